"""Exact when the main thread runs ahead of the engine, on every code path
(conftest.PATHS) and in every mode: after abandoned steps, with predict calls
inside training steps, on a new set of devices.

GPU training loops queue step after step without waiting on any result; a
layer that computed its running-statistics update from a value read in its
callback and queued the result would lose updates there (a read of step k+1
queued before step k's write). Each ``run_ahead`` case trains a conv +
SyncBatchNorm net on 2 contexts, uneven 3 + 5 split, 20 Trainer steps of two
accumulated forward/backward passes (grad_req='add'), the layer called twice
per pass, with no sync until the end, and compares every device's running
mean and variance with float64 momentum updates over the global batch.
"""
import pytest

from tests.conftest import PATHS, PATH_OPERATOR, result_of, run_batch

F32 = 1e-5
MODES = [False, True, 'static']
# Steps abandoned with the layers' calls held behind a dot (they run after the
# main thread has moved on), then 4 steps issued at once (scenarios.run_ahead.aborted_then_exact):
# the first case, under hybridize(), is what the others' time is held to.
ABORTS = [dict(hybridize=h) for h in (True, False, 'static_alloc', 'static')] + [
    dict(hybridize='static', cause='interrupt', aborts=3),
    dict(hybridize='static', cause='bad_input'),
    dict(hybridize='static', cause='reset'),
    dict(hybridize='static', cause='missing', timeout_seconds=3.0),
    dict(hybridize=True, blocks=True)]
PREDICTS = [dict(pattern='targets', hybridize='static'), dict(pattern='targets', hybridize=True),
            dict(pattern='gan', hybridize='static')]
MOVES = [dict(change='reset_ctx', before=4, after=2, hybridize='static'),
         dict(change='reinit', before=2, after=4, hybridize=True),
         dict(change='reset_ctx', before=1, after=3, hybridize='static')]
CASES = ([('run_ahead', dict(hybridize=m)) for m in MODES]
         + [('aborted_then_exact', dict(dict(timeout_seconds=30.0), **a)) for a in ABORTS]
         + [('predict_in_step', p) for p in PREDICTS]
         + [('new_device_set', m) for m in MOVES])


@pytest.fixture(scope='module', params=list(PATHS))
def results(request):
    return request.param, run_batch(CASES, timeout=400, env=PATHS[request.param])


@pytest.mark.parametrize('mode', MODES, ids=['imperative', 'hybridized', 'static_shape'])
def test_running_statistics_exact_without_sync(results, mode):
    path, batch = results
    errs = result_of(batch, MODES.index(mode))
    assert errs['operator'] == PATH_OPERATOR[path], errs
    assert errs['running_mean'] < F32, errs
    assert errs['running_var'] < F32, errs


def _exact(errs, keys, tol=F32):
    bad = {k: errs[k] for k in keys if not errs[k] < tol}
    assert not bad, (bad, errs)


@pytest.mark.parametrize('case', ABORTS, ids=lambda a: '%s-%s%s' % (
    a['hybridize'], a.get('cause', 'user_code'), '-x%d' % a['aborts'] if 'aborts' in a else '')
    + ('-blocks' if a.get('blocks') else ''))
def test_an_abandoned_step_ends_itself_and_nothing_else(results, case):
    """Later steps exact, the running statistics untouched by the abandoned
    ones, and no wait for the layers' 30 s timeout: the sequence takes what
    hybridize()'s takes (2 s more at most)."""
    path, batch = results
    first = len(MODES)
    errs = result_of(batch, first + ABORTS.index(case))
    assert errs['operator'] == PATH_OPERATOR[path], errs
    assert errs['failed'] == 0, errs
    _exact(errs, ('first', 'first_grads', 'y', 'running_mean', 'running_var'))
    # The failures the operators complete in the engine raise as ours
    # wherever they surface (reset: the abort's; missing: the timeout).
    expected = {None: 'ValueError', 'interrupt': 'KeyboardInterrupt',
                'bad_input': 'SyncBatchNormError', 'reset': 'SyncBatchNormError',
                'missing': 'SyncBatchNormTimeout'}
    assert errs['aborted'] == [expected[case.get('cause')]] * case.get('aborts', 1), errs
    bound = result_of(batch, first)['seconds'] + 2 + case.get('timeout_seconds', 0)
    assert errs['seconds'] < bound, (errs, bound)


@pytest.mark.parametrize('case', PREDICTS, ids=lambda p: '%s-%s' % (p['pattern'], p['hybridize']))
def test_predict_calls_inside_a_training_step(results, case):
    """Per device a training call then a predict-mode call (consistency
    targets), or a generator trained through a static discriminator in
    predict mode: both exact, the predict calls with the running statistics
    of the step's own update, and nothing waits for the layers' timeout."""
    path, batch = results
    errs = result_of(batch, len(MODES) + len(ABORTS) + PREDICTS.index(case))
    assert errs['operator'] == PATH_OPERATOR[path], errs
    _exact(errs, ('y', 'target'))
    assert errs['seconds'] < 10, errs


@pytest.mark.parametrize('case', MOVES, ids=lambda m: '%s-%d-to-%d-%s' % (
    m['change'], m['before'], m['after'], m['hybridize']))
def test_a_network_follows_its_parameters_to_other_devices(results, case):
    """After reset_ctx or initialize(force_reinit=True) onto fewer or more
    devices (from one, where nothing synchronized), the next steps
    synchronize exactly those devices, at once; a call on a context the
    parameters left gets a true message at once."""
    path, batch = results
    errs = result_of(batch, len(MODES) + len(ABORTS) + len(PREDICTS) + MOVES.index(case))
    assert errs['operator'] == PATH_OPERATOR[path], errs
    # from one device, the first step was nn.BatchNorm's float32 kernel, whose
    # running statistics at 1e3 + randn are 1e-5 from float64 maths
    _exact(errs, ('y',))
    _exact(errs, ('running_mean', 'running_var'), 1e-4 if case['before'] == 1 else F32)
    assert errs['seconds'] < 10, errs
    assert errs['outside'] is not None and 'cpu(%d)' % case['after'] in errs['outside'], errs
    assert errs['outside_seconds'] < 5, errs
