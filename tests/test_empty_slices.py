"""Empty slices: a device fed no samples takes part with count 0 (under MXNet's
NumPy shape mode, the only one with size-0 arrays), and the others get exactly
the statistics of the non-empty slices. Across processes: test_multiprocess
(a worker's empty shard)."""
import pytest

from tests.conftest import OPERATOR_PATHS, PATHS, result_of, run_batch, run_scenario

EXACT = 1e-5
POSITIONS = {'first': [0], 'middle': [1], 'last': [2], 'two': [0, 2]}
MODES = [False, True, 'static']
CASES = [(p, m) for p in POSITIONS for m in MODES]


@pytest.fixture(scope='module', params=OPERATOR_PATHS)
def results(request):
    return run_batch([('empty_slices', dict(empty=POSITIONS[p], hybridize=m)) for p, m in CASES],
                     timeout=300, env=PATHS[request.param])


@pytest.mark.parametrize('position,hybridize', CASES)
def test_empty_slice_takes_part_with_count_zero(results, position, hybridize):
    errs = result_of(results, CASES.index((position, hybridize)))
    for name in ('y', 'dx', 'dgamma', 'dbeta', 'running_mean', 'running_var'):
        assert errs[name] < EXACT, (name, errs)
    assert errs['empty_shapes_ok'] == 1.0  # empty output and input gradient
    assert errs['empty_grads_zero'] == 1.0  # its gamma/beta gradients are 0


@pytest.mark.parametrize('hybridize', [False, True])
def test_a_batch_empty_on_every_device_is_a_clear_error(operator, hybridize):
    r = run_scenario('empty_slices', timeout=120, empty=[0, 1, 2],
                     hybridize=hybridize)
    assert r['type'] == 'SyncBatchNormError', r
    assert "SyncBatchNorm 'syncbatchnorm0': every device's slice of this batch is empty" \
        in r['message'], r['message']
    assert r['seconds'] < 10
    assert r['recovered'] < EXACT  # the next step is exact again


@pytest.mark.parametrize('hybridize', [False, True])
def test_an_empty_slice_outside_numpy_shape_mode_names_the_fix(hybridize):
    r = run_scenario('empty_slices', timeout=120, empty=[1], hybridize=hybridize,
                     numpy_shape=False)
    assert r['type'] == 'SyncBatchNormError', r
    assert 'set_np_shape(True)' in r['message'] and "'syncbatchnorm0'" in r['message']
    assert r['seconds'] < 10
    assert r['recovered'] < EXACT


@pytest.mark.parametrize('read,hybridize', [('losses', False), ('step', True),
                                            ('waitall', 'static')])
def test_an_empty_slice_an_earlier_layer_refuses_is_named_at_once(read, hybridize):
    # MXNet's convolution refuses the empty slice, so its device never calls
    # the layer: the step fails at once naming it and the fix (not the
    # timeout), wherever the user reads, and the next step is exact.
    r = run_scenario('empty_slice_in_network', timeout=180, read=read, hybridize=hybridize)
    assert r['type'] == 'SyncBatchNormError', r
    assert "the empty slice on cpu(2) (shape (0, 4, 4, 4)) never reached it: an earlier " \
        "operator on cpu(2) failed on it" in r['message'], r['message']
    assert "last_batch='discard'" in r['message'], r['message']
    assert r['seconds'] < 10, r  # the layer's timeout is 60 s
    assert r['recovered'] < EXACT, r
