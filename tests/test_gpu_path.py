"""The path GPUs take, counted: what a layer call costs beyond nn.BatchNorm's.

Counts do not depend on the hardware, so they are checked here, on CPU
contexts. Predict mode costs exactly what nn.BatchNorm costs, on every path:
a hybridized network keeps a graph for each mode, the predict one
nn.BatchNorm's (hooks), and imperative inference is BatchNorm itself; on the
exchange operator's GPU code (the stand-in CUDA runtime) it copies nothing.
A training call makes one round trip to the host per direction: one wait for
the copies up and one for the copies down. And predict calls in the middle of
training, with no sync point anywhere, see exactly the running statistics
training has reached, in every mode, with 1, 2 or 3 calls per step (folded in
as MXNet's BatchNorm does on the devices' kind: reference.update_order).
"""
import re

import pytest

from tests.conftest import PATHS, PATH_OPERATOR, result_of, run_batch, run_scenario

MODES = [False, True, 'static']
MODE_IDS = ['imperative', 'hybridized', 'static_shape']
# Engine operations a training call (forward and backward) adds per device
# on the exchange operator's path, at most: half of what the graph around
# it once cost (docs/findings.md, "Engine operations per call on the GPU
# path": 24 and 4.6 now).
TRAINING_BOUND = {True: 25, 'static': 8}


CALLS = [1, 2, 3]  # the network's calls per training step in train_and_predict


@pytest.fixture(scope='module', params=list(PATHS))
def results(request):
    """Both scenarios in every mode, one process per path; returns the path
    and ``{(scenario, mode[, calls]): the case's result, or its failure}``."""
    cases = ([('operations_per_call', m) for m in MODES]
             + [('train_and_predict', m, k) for m in MODES for k in CALLS])
    batch = run_batch([(case[0], dict(hybridize=case[1], **(
        {'calls': case[2]} if len(case) > 2 else {}))) for case in cases], timeout=400,
        env=PATHS[request.param])
    return request.param, {case: batch[i] for i, case in enumerate(cases)}


@pytest.mark.parametrize('mode', MODES, ids=MODE_IDS)
def test_predict_mode_costs_what_nn_batchnorm_costs(results, mode):
    path, by_case = results
    result = result_of(by_case, ('operations_per_call', mode))
    assert result['operator'] == PATH_OPERATOR[path], result
    # Per layer call per device: an operation of ours would add 1 or more;
    # the profiler's count varies by an operation or so per run (an engine
    # variable freed inside or outside the counted calls).
    assert abs(result['predict']) < 0.5, result
    if path == 'exchange-device':
        for name in ('copies_up', 'copies_down', 'waits'):
            assert result['predict_' + name] == 0, result


@pytest.mark.parametrize('results', ['exchange-device'], indirect=True)  # the stand-in counts
@pytest.mark.parametrize('mode', MODES, ids=MODE_IDS)
def test_a_training_call_waits_for_the_host_once_per_direction(results, mode):
    _, by_case = results
    result = result_of(by_case, ('operations_per_call', mode))
    assert result['train_waits'] == 4, result  # forward and backward: up, then down
    assert result['train_refused'] == 0, result
    # up: m1, m2, v, gamma, beta, running mean and variance; d scale, d shift
    assert result['train_copies_up'] == 9, result
    # down: scale, shift, running mean and variance; d m2, d v, d gamma, d beta
    assert result['train_copies_down'] == 8, result
    assert result['train_streams'] == 0, result  # one per device, made at the first call


@pytest.mark.parametrize('results', ['exchange', 'exchange-device'], indirect=True)
@pytest.mark.parametrize('mode', [True, 'static'], ids=MODE_IDS[1:])
def test_training_operations_stay_within_the_bound(results, mode):
    _, by_case = results
    result = result_of(by_case, ('operations_per_call', mode))
    assert result['train'] <= TRAINING_BOUND[mode], result


@pytest.mark.parametrize('calls', CALLS)
@pytest.mark.parametrize('mode', MODES, ids=MODE_IDS)
def test_predict_calls_amid_training_see_the_running_statistics(results, mode, calls):
    path, by_case = results
    result = result_of(by_case, ('train_and_predict', mode, calls))
    assert result['operator'] == PATH_OPERATOR[path], result
    assert result['predict'] < 1e-5, result
    assert result['two_graphs'] == float(mode is not False), result


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
@pytest.mark.parametrize('direction', ['forward', 'backward'])
def test_a_failed_device_copy_fails_the_step_and_the_next_recovers(direction, hybridize):
    # One device's copy fails: every device's call fails with the cause
    # naming it, at once (not at the layer's 60 s timeout); the next step is exact.
    result = run_scenario('device_copy_fails', env=PATHS['exchange-device'],
                          direction=direction, hybridize=hybridize)
    assert result['refused'] == 1, result
    cause = re.compile(r"SyncBatchNorm 'syncbatchnorm\d+': exchanging the statistics failed: "
                       r'cudaMemcpyAsync on cpu\(\d\) failed: an illegal memory access')
    for message in result['messages']:
        assert message and cause.search(message), result
    assert result['seconds'] < 30, result
    assert result['recovered'] < 1e-5, result
