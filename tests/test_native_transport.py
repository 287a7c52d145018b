"""The cross-process rules through the native transports, in one process.

``tests/loopback.py`` gives the layer a transport of two workers whose other
worker sends what a mode says (its native twin, in the tests' build of the
library), or a 'local' kvstore through the real ``MXKVStorePushPull`` chain. A failure across processes is fatal, as in
a real job, so every case runs in its own process, with a deadline. The real
engines (dist kvstore, Horovod) run in test_multiprocess.py.
"""
import json
import re
import time

import pytest

from tests.conftest import PATH_OPERATOR, PATHS, _run, run_batch, run_python, run_scenario

EXACT = 2e-6  # float32 against float64, as in the one-process tests
RECOVERED = 1e-5  # a step after a failure, float32 against float64 (test_faults.py)

# With mode 'same' the other worker holds a copy of this process's batch, so
# the global statistics are this process's and every result must equal one
# process's: output, gradients and running statistics against float64 maths
# and nn.BatchNorm, and running statistics when the main thread runs ahead.
EXACT_CASES = [
    ('layer_vs_reference', dict(shape=[5, 3, 4, 4], sizes=[2, 3], offset=1e4)),
    ('layer_vs_reference', dict(shape=[6, 4, 3], sizes=[1, 5], hybridize=True, offset=1e3)),
    ('layer_vs_reference', dict(shape=[5, 3, 4, 4], sizes=[3, 2], hybridize='static',
                                offset=1e4)),
    ('run_ahead', dict(hybridize=False)),
    ('run_ahead', dict(hybridize=True)),
    ('run_ahead', dict(hybridize='static')),
]


@pytest.mark.parametrize('transport,path', [
    ('loopback', 'async'), ('loopback', 'exchange'),
    ('loopback:float32', 'async'), ('loopback:float32', 'exchange'),
    ('kvstore', 'async'), ('kvstore', 'exchange')])
def test_exact_through_a_cross_process_transport(transport, path):
    """Also where the engine sums every payload in float32, far from zero."""
    env = dict(PATHS[path], SCENARIO_TRANSPORT=transport)
    results = run_batch(EXACT_CASES, timeout=240, env=env)
    for i, (name, kwargs) in enumerate(EXACT_CASES):
        r = results[i]
        if isinstance(r, Exception):
            raise r
        assert r.pop('operator') == PATH_OPERATOR[path], (name, kwargs)
        errors = {k: v for k, v in r.items() if k.startswith(('y', 'dx', 'dgamma', 'dbeta',
                                                              'running'))}
        bad = {k: v for k, v in errors.items() if not v < EXACT}
        assert errors and not bad, (name, kwargs, bad)


def test_engine_threads_queue_behind_a_trainer_using_the_store():
    """The main thread uses the store (and holds its lock) while the layer's
    reductions come from engine threads: they queue, nothing deadlocks."""
    for hybridize in (False, True):
        result = run_scenario('store_shared_with_trainer', env=dict(SCENARIO_TRANSPORT='kvstore'),
                              hybridize=hybridize)
        assert result['operator'] == 'async'
        assert result['queued'] > 0, result  # the queue was used
        for name in ('main_thread_sums', 'running_mean', 'running_var'):
            assert result[name] < EXACT, result


# (mode, scenario, kwargs, what the error and the exit message say)
FATAL_CASES = {
    'out of step': ('call', 'layer_vs_reference', dict(shape=[4, 3, 2], sizes=[1, 3]),
                    r"'syncbatchnorm0': the workers are out of step at its fwd reduction #0 "
                    r"\(slot 0\): worker 0: 3 channels, call #0, float32; worker 1: 3 channels, "
                    r"call #1, float32"),
    # the other worker's layer has 5 channels: found before any key of that size exists
    'networks differ': ('channels', 'layer_vs_reference', dict(shape=[4, 3, 2], sizes=[1, 3]),
                        r"'syncbatchnorm0': the workers' networks differ at their layer #1 to "
                        r"synchronize across workers: "
                        r"worker 0: 'syncbatchnorm0', 3 channels, float32; worker 1: "
                        r"'syncbatchnorm0', 5 channels, float32"),
    'optimizer': ('scale', 'layer_vs_reference', dict(shape=[4, 3, 2], sizes=[1, 3]),
                  r'update_on_kvstore=False'),
    'engine error': ('fail', 'layer_vs_reference', dict(shape=[4, 3, 2], sizes=[1, 3]),
                     r'failed in loopback: no sum came back'),
    # the other worker claims this one's devices (0, 1) instead of its own (2, 3)
    'device numbering': ('same', 'one_step', dict(sync_groups=[[0, 2], [1, 3]]),
                         r'disagree on the global device numbering.*\[0, 1, 2, 3\]'),
    # the step's reductions had left this worker: the others wait for its next ones
    'local failure': ('same', 'user_code_raises', dict(after_forward=True),
                      r'a SyncBatchNorm step failed on worker 0: .*user code failed after the '
                      r'forward pass'),
}


# Every case on the asynchronous operator; the GPU path shares its session.
@pytest.mark.parametrize('case,path', [(case, 'async') for case in sorted(FATAL_CASES)] + [
    ('out of step', 'exchange'), ('device numbering', 'exchange')])
def test_a_failed_reduction_is_an_error_then_ends_the_process(case, path):
    mode, name, kwargs, expected = FATAL_CASES[case]
    env = dict(PATHS[path], SCENARIO_TRANSPORT='loopback:' + mode)
    proc = _run([name, json.dumps(kwargs)], 120, env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert re.search(expected, output, re.S), output[-4000:]
    assert re.search(r'gluon_syncbn: worker 0 exits after a failed cross-process reduction:',
                     output), output[-4000:]


@pytest.mark.parametrize('path', ['async', 'exchange'])
def test_a_step_abandoned_before_its_reductions_costs_nothing_more(path):
    """Bad input on one device at the step's first call: no reduction of
    the step left the process, so the step fails alone and the next one
    (through the transport) is exact, as in one process."""
    env = dict(PATHS[path], SCENARIO_TRANSPORT='loopback:same')
    result = run_scenario('bad_input_on_one_device', env=env, problem='channels')
    assert result['type'] == 'SyncBatchNormError', result
    assert 'input has 4 channels on axis 1' in result['message'], result
    assert result['recovered'] < RECOVERED and result['seconds'] < 30, result


def test_a_deleted_store_is_an_error_naming_the_fix():
    proc = _run(['store_deleted', '{}'], 60, dict(PATHS['async'], SCENARIO_TRANSPORT='kvstore'))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert "failed in kvstore 'local': the kvstore given as kvstore= was deleted; keep it " \
           "alive while the network trains" in output, output[-4000:]


@pytest.mark.parametrize('path', ['async', 'exchange'])
def test_a_reduction_that_never_completes_times_out_within_the_timeout(path):
    env = dict(PATHS[path], SCENARIO_TRANSPORT='loopback:never', GLUON_SYNCBN_TIMEOUT='0.5')
    start = time.monotonic()
    proc = _run(['layer_vs_reference', '{"shape": [4, 3, 2], "sizes": [1, 3]}'], 60, env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert ("worker 0 of 2 waited 0.5s for the other workers at the fwd reduction #0 of "
            "layer 'syncbatchnorm0' (slot 0) (loopback)") in output, output[-4000:]
    assert time.monotonic() - start < 30


def test_a_process_that_lingers_after_a_failure_ends_after_the_grace_period():
    env = dict(PATHS['async'], SCENARIO_TRANSPORT='loopback:call', GLUON_SYNCBN_EXIT_GRACE='2')
    start = time.monotonic()
    proc = _run(['fail_then_linger', '{"seconds": 60}'], 60, env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert 'caught: ' in output and 'out of step' in output, output[-4000:]
    assert 'gluon_syncbn: worker 0 did not exit within 2s of a failed cross-process ' \
           'reduction' in output, output[-4000:]
    assert time.monotonic() - start < 40  # not the 60 s the scenario sleeps


HOROVOD_VERSION_GATE = """
import horovod
horovod.__version__ = '%s'
from gluon_syncbn import transport
print('WHY', transport.HorovodTransport().why_not_native())
"""


@pytest.mark.parametrize('version,native', [('0.28.1', True), ('0.27.0', False)])
def test_only_a_known_horovod_gets_the_native_transport(version, native):
    import importlib.util
    if importlib.util.find_spec('horovod') is None:
        pytest.skip('Horovod is not installed here (test_multiprocess.py says how)')
    proc = run_python(HOROVOD_VERSION_GATE % version)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    if native:
        assert 'WHY \n' in out, out[-3000:]
    else:
        assert 'WHY Horovod 0.27.0 is installed: the native transport calls ' \
            'horovod_mxnet_allreduce_async' in out and 'Install Horovod 0.28.1' in out, \
            out[-3000:]


def test_across_processes_without_the_native_library_the_first_call_raises(tmp_path):
    env = dict(CXX='/nonexistent/g++', GLUON_SYNCBN_CACHE=str(tmp_path))
    proc = _run(['layer_vs_reference', '{"shape": [4, 3, 2], "sizes": [1, 3]}'], 120,
                dict(env, SCENARIO_TRANSPORT='loopback:same'))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert ("SyncBatchNorm 'syncbatchnorm0': across processes the native operators are "
            "required, but the native library is not available: no C++ compiler: "
            "'/nonexistent/g++' was not found") in output, output[-4000:]
    assert 'Install a C++ compiler' in output
