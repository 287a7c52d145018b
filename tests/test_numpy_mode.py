"""MXNet's NumPy mode (``npx.set_np()``): a network converted with convert_model
trains with a Trainer exactly like nn.BatchNorm on the concatenated batch.
The layer's own exactness grid in NumPy mode is in test_layer (``*-numpy``)."""
import pytest

from tests.conftest import OPERATOR_PATHS, PATHS, result_of, run_batch

TRAINED = 1e-5  # relative: losses, parameters and running statistics after 3 SGD steps
MODES = [False, True, 'static']


@pytest.fixture(scope='module', params=OPERATOR_PATHS)
def results(request):
    cases = [('numpy_mode_training', dict(sizes=[1, 3], hybridize=h)) for h in MODES]
    return run_batch(cases, timeout=300, env=PATHS[request.param])


@pytest.mark.parametrize('hybridize', MODES)
def test_trainer_loop_in_numpy_mode_matches_one_device(results, hybridize):
    errs = result_of(results, MODES.index(hybridize))
    assert errs['num_syncbn'] == 2  # convert_model found both layers
    assert errs['out_is_np'] == 1.0
    for name in ('loss', 'param', 'running'):
        assert errs[name] < TRAINED, (name, errs)
