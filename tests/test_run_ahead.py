"""Running statistics stay exact when the main thread runs ahead of the engine.

GPU training loops queue step after step without waiting on any result; a
layer that computed its running-statistics update from a value read in its
callback and queued the result would lose updates there (a read of step k+1
queued before step k's write). Each case trains a conv + SyncBatchNorm net
on 2 contexts, uneven 3 + 5 split, 20 Trainer steps of two accumulated
forward/backward passes (grad_req='add'), the layer called twice per pass,
with no sync until the end, and compares every device's running mean and
variance with float64 momentum updates over the global batch, on every code
path (conftest.PATHS) and in every mode.
"""
import pytest

from tests.conftest import PATHS, PATH_OPERATOR, result_of, run_batch

F32 = 1e-5
MODES = [False, True, 'static']


@pytest.fixture(scope='module', params=list(PATHS))
def results(request):
    return request.param, run_batch([('run_ahead', dict(hybridize=m)) for m in MODES],
                                    timeout=400, env=PATHS[request.param])


@pytest.mark.parametrize('mode', MODES, ids=['imperative', 'hybridized', 'static_shape'])
def test_running_statistics_exact_without_sync(results, mode):
    path, batch = results
    errs = result_of(batch, MODES.index(mode))
    assert errs['operator'] == PATH_OPERATOR[path], errs
    assert errs['running_mean'] < F32, errs
    assert errs['running_var'] < F32, errs
