"""SyncBatchNorm across worker processes: MXNet's dist_sync kvstore and Horovod.

Each test starts a whole job through ``python -m gluon_syncbn.launch`` (which
bounds it with ``--deadline``) inside ``subprocess.run(timeout=...)``: a hang
fails the test, never the suite. The workers run ``tests/dist_worker.py``,
which compares against float64 maths / float64 full-batch training on the
global batch.
"""
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, run_python

WORKER = os.path.join(ROOT, 'tests', 'dist_worker.py')
EXACT = 2e-6  # float32 against float64, as in the one-process tests
# The native operators are the default across processes too; these select others.
EXCHANGE = {'GLUON_SYNCBN_BACKEND': 'exchange'}



def _horovod_missing():
    """None if horovod.mxnet imports (checked in a subprocess), else why not."""
    proc = run_python('import horovod.mxnet')
    if proc.returncode == 0:
        return None
    return ("horovod.mxnet does not import here (%s): docs/install.md, section 'Horovod', "
            "installs it" % (proc.stderr.strip().splitlines() or ['?'])[-1])


HOROVOD = _horovod_missing()
if HOROVOD and os.environ.get('GLUON_SYNCBN_REQUIRE_HOROVOD'):
    raise RuntimeError('GLUON_SYNCBN_REQUIRE_HOROVOD is set but ' + HOROVOD)


def run_job(workers, scenario, kwargs, backend='kvstore', servers=None, deadline=120, env=None):
    """Run a job; return (exit code, output, seconds, {rank: result})."""
    argv = [sys.executable, '-m', 'gluon_syncbn.launch', '-n', str(workers),
            '--backend', backend, '--deadline', str(deadline)]
    if servers:
        argv += ['-s', str(servers)]
    argv += [WORKER, scenario, json.dumps(kwargs)]
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=deadline + 30)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    results = {}
    for line in output.splitlines():
        match = re.match(r'\[worker (\d+)\] RESULT (.*)$', line)
        if match:
            result = json.loads(match.group(2))
            results[result.pop('rank')] = result
    return proc.returncode, output, elapsed, results


def assert_exact(code, output, results, workers, tol=EXACT, operator='async'):
    """Every worker reported errors within ``tol``, synchronizing with ``operator``."""
    assert code == 0, output[-5000:]
    assert sorted(results) == list(range(workers)), output[-5000:]
    for rank, errs in results.items():
        assert errs.pop('operator') == operator, (rank, output[-3000:])
        errs.pop('timeouts', None)
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, 'worker %d: %s' % (rank, bad)


KVSTORE_LAYER_CASES = [
    # (workers, devices per worker, global per-device batch sizes, extra)
    (2, 2, [1, 3, 2, 1], {}),
    (2, 2, [2, 2, 2, 2], {'hybridize': True}),
    (3, 1, [1, 3, 2], {}),
    (3, 1, [2, 1, 4], {'hybridize': True, 'axis': -1}),
    (2, 1, [1, 2], {'shape': [6]}),  # 2-D input, 3 samples in all
    (2, [2, 1], [1, 2, 3], {}),  # 2 devices on worker 0, 1 on worker 1
    (2, 1, [3, 0], {}),  # worker 1's shard is empty this step
    (2, 2, [0, 0, 1, 2], {'hybridize': True}),  # worker 0's too, hybridized
    (2, 2, [1, 3, 2, 1], {'sync_groups': 2}),  # a group per worker: nothing leaves it
    (2, 2, [1, 3, 2, 1], {'sync_groups': [[0, 2], [1, 3]], 'hybridize': True}),  # across
]


@pytest.mark.parametrize('workers,devices,sizes,extra', KVSTORE_LAYER_CASES)
def test_layer_over_dist_kvstore_matches_float64(workers, devices, sizes, extra):
    kwargs = dict(backend='dist_sync', devices=devices, sizes=sizes, **extra)
    code, output, _, results = run_job(workers, 'layer', kwargs, servers=1)
    assert_exact(code, output, results, workers)


@pytest.mark.parametrize('backend,offset,extra', [
    ('dist_sync', 1e3, {'hybridize': 'static'}), ('dist_sync', 1e4, {}),
    ('dist_sync_device', 1e4, {'hybridize': True, 'steps': 3})])
def test_far_from_zero_over_dist_kvstore_matches_float64(backend, offset, extra):
    """2 workers x 2 contexts, uneven slices, data offset + 2 randn. CI's GPU
    stage runs these with the GPU wheel's servers too, which sum float64
    keys in float32 in most runs (MXNet 1.9.1 leaves their multi_precision_
    flag uninitialized): exact all the same."""
    kwargs = dict(backend=backend, devices=2, sizes=[3, 2, 4, 1], offset=offset, **extra)
    code, output, _, results = run_job(2, 'layer', kwargs, servers=1)
    assert_exact(code, output, results, 2)


@pytest.mark.parametrize('workers,devices,sizes,extra', [
    (2, 2, [1, 3, 2, 1], {}),
    (2, 2, [1, 3, 2, 1], {'hybridize': True}),
    (3, 1, [3, 1, 2], {}),
    # every worker abandons step 2 inside record() before any layer call
    # and skips that batch, as the reference does: it costs nothing more
    (2, 2, [1, 3, 2, 1], {'fault': 'skip_alike', 'steps': 4}),
    # rank 0 alone has a network of its own (other automatic names from
    # then on), which it runs in inference mode: it changes nothing
    (2, 2, [1, 3, 2, 1], {'rank0_net': True, 'hybridize': True}),
])
def test_trainer_over_dist_kvstore_matches_full_batch_training(workers, devices, sizes, extra):
    kwargs = dict(backend='dist_sync', devices=devices, sizes=sizes, **extra)
    code, output, _, results = run_job(workers, 'train', kwargs, servers=2)
    # the layers' default timeouts: 180 s in a process, 30 minutes for the workers
    assert all(r['timeouts'] == [180.0, 1800.0] for r in results.values()), results
    assert_exact(code, output, results, workers, tol=5e-6)


# Data that moves between calls (dist_worker.MOVES: jumps of any size and
# direction, 1 to 3 calls per step far apart, channels far apart, head
# gradients far from zero, a NaN and an outlier of 1e20 in one call each):
# exact at every step on every transport and operator, the running
# statistics folding the calls in as nn.BatchNorm on CPU does, also through
# a kvstore server that sums in float32 (CI's GPU stage runs these with the
# GPU wheel's servers, which do in most runs).
MOVES_CASES = [
    ('dist_sync', 'kvstore', {'calls': 3}, {}),
    ('dist_sync_device', 'kvstore', {'hybridize': True, 'calls': 2}, {}),
    ('dist_sync', 'kvstore', {'hybridize': 'static', 'heads': False, 'calls': 3}, EXCHANGE),
    ('horovod', 'horovod', {'hybridize': 'static', 'calls': 1}, {}),
]


@pytest.mark.parametrize('backend,launcher,extra,env', MOVES_CASES)
def test_exact_whatever_the_data_does_between_calls(backend, launcher, extra, env):
    if launcher == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=2, sizes=[3, 2, 4, 1], **extra)
    code, output, _, results = run_job(2, 'moves', kwargs, backend=launcher,
                                       servers=1 if launcher == 'kvstore' else None, env=env)
    assert_exact(code, output, results, 2, operator='exchange' if env else 'async')


# The GPU path's exchange operator runs a selection of the layer cases.
EXCHANGE_CASES = [
    # (workers, devices, sizes, extra)
    (2, 2, [1, 3, 2, 1], {}),
    (2, 2, [0, 0, 1, 2], {'hybridize': True}),
    (2, 2, [1, 3, 2, 1], {'sync_groups': [[0, 2], [1, 3]]}),
    (3, 1, [2, 1, 4], {'hybridize': 'static', 'run_ahead': True, 'steps': 4}),
]


@pytest.mark.parametrize('workers,devices,sizes,extra', EXCHANGE_CASES)
def test_the_exchange_operator_over_dist_kvstore_matches_float64(workers, devices, sizes,
                                                                 extra):
    kwargs = dict(backend='dist_sync', devices=devices, sizes=sizes, **extra)
    code, output, _, results = run_job(workers, 'layer', kwargs, servers=1, env=EXCHANGE)
    assert_exact(code, output, results, workers, operator='exchange')


def test_no_native_operator_across_processes_is_an_error_naming_the_fix(tmp_path):
    # Where the library cannot be built (a cache under a file), every
    # worker's first call raises with the fix.
    (tmp_path / 'file').write_text('')
    env = {'GLUON_SYNCBN_BACKEND': 'auto', 'GLUON_SYNCBN_CACHE': str(tmp_path / 'file' / 'cache')}
    kwargs = dict(backend='dist_sync', devices=1, sizes=[2, 2])
    code, output, elapsed, _ = run_job(2, 'layer', kwargs, servers=1, deadline=60, env=env)
    assert code != 0
    expected = ('across processes the native operators are required, but the native '
                'library is not available: its cache directory %s cannot be written '
                '(%s: File exists). Set GLUON_SYNCBN_CACHE to a directory you can write'
                % (tmp_path / 'file' / 'cache', tmp_path / 'file'))
    assert expected in output, output[-3000:]
    assert elapsed < 40, elapsed


@pytest.mark.parametrize('hybridize', [True, 'static'])
def test_running_ahead_over_dist_kvstore_matches_float64(hybridize):
    """No sync point until every step is issued, the main thread far ahead."""
    kwargs = dict(backend='dist_sync', devices=2, sizes=[1, 3, 2, 2], hybridize=hybridize,
                  run_ahead=True, steps=5)
    code, output, _, results = run_job(2, 'layer', kwargs, servers=1)
    assert_exact(code, output, results, 2)


def test_twenty_layers_on_two_workers_of_two_contexts_match_full_batch_training():
    """In float64: in float32 twenty layers amplify rounding to 2e-2; in
    float64 the errors are those of 3 layers (3e-7, the reference's)."""
    kwargs = dict(backend='dist_sync', devices=2, sizes=[1, 3, 2, 2], hybridize=True,
                  layers=20, steps=2, dtype='float64')
    code, output, _, results = run_job(2, 'train', kwargs, servers=1, deadline=240)
    assert_exact(code, output, results, 2)


# The fault tests, over either engine.
BACKENDS = [('dist_sync', 'kvstore'), ('horovod', 'horovod')]


def test_a_kvstore_that_applies_the_optimizer_is_an_error():
    kwargs = dict(backend='dist_sync', devices=1, sizes=[2, 2], update_on_kvstore=True)
    code, output, elapsed, _ = run_job(2, 'train', kwargs, deadline=60,
                                       env=dict(GLUON_SYNCBN_EXIT_GRACE='4'))
    assert code != 0
    assert 'update_on_kvstore=False' in output, output[-3000:]
    assert elapsed < 40, elapsed


@pytest.mark.parametrize('backend,launcher', BACKENDS)
def test_killed_worker_stops_the_job_within_the_deadline(backend, launcher):
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=1, sizes=[3, 2], fault='kill', timeout=5)
    code, output, elapsed, _ = run_job(2, 'train', kwargs, backend=launcher, deadline=60)
    assert code != 0
    assert 'killing myself' in output
    assert re.search(r'job stopped: worker \d \(pid \d+\) failed', output), output[-3000:]
    assert elapsed < 30, elapsed  # far below the 60 s deadline: no hang


@pytest.mark.parametrize('backend,launcher', BACKENDS)
def test_stalled_worker_gives_a_timeout_error_then_ends(backend, launcher):
    """A live peer that stops calling: the layer's bounded wait names the problem,
    and the worker ends itself even though MXNet's own waits never return."""
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=1, sizes=[3, 2], fault='stall', timeout=3)
    code, output, elapsed, _ = run_job(2, 'train', kwargs, backend=launcher, deadline=60,
                                       env=dict(GLUON_SYNCBN_EXIT_GRACE='4'))
    assert code != 0
    assert 'worker 0 of 2 waited 3s for the other workers' in output, output[-3000:]
    assert 'job stopped: worker 0' in output, output[-3000:]
    assert elapsed < 40, elapsed


# How a worker fails before a step (dist_worker._fault), the end of the
# launcher's last line, which must name worker 1 and its error, and the
# launcher's exit code: worker 1's, 128 + N for signal N. The layers wait 60 s
# for each other: a job that waits for that fails the bound.
FAILURES = [
    ('raise_first', 'exit code 1: RuntimeError: worker 1 fails between steps', 1),
    ('raise', 'exit code 1: RuntimeError: worker 1 fails between steps', 1),
    ('raise_in_record', r'exit code 1: RuntimeError: worker 1 fails inside record\(\)', 1),
    ('exit', 'exit code 3', 3),
    ('exit_builtin', 'exit code 3', 3),
    ('system_exit', 'exit code 3', 3),
    ('term', 'signal SIGTERM', 143),
    ('interrupt', 'exit code 130: KeyboardInterrupt', 130),
]


@pytest.mark.parametrize('backend,launcher,fault,expected,exit_code',
                         [('dist_sync', 'kvstore') + f for f in FAILURES] +
                         [('horovod', 'horovod') + f for f in FAILURES if f[0] in ('raise', 'exit')])
def test_a_failing_worker_ends_the_job_at_once_and_is_named(backend, launcher, fault, expected,
                                                            exit_code):
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=1, sizes=[3, 2], fault=fault, timeout=60)
    code, output, elapsed, _ = run_job(2, 'train', kwargs, backend=launcher, deadline=120)
    assert code == exit_code, (code, output[-3000:])
    last = output.strip().splitlines()[-1]
    assert re.match(r'\[launch\] job stopped: worker 1 \(pid \d+\) failed with %s$' % expected,
                    last), output[-3000:]
    assert elapsed < 20, elapsed
    # Worker 0 (ended by the launcher, or, over Horovod, told by Gloo that its
    # peer is gone) blames neither itself nor its data.
    assert not re.search(r'failed on worker 0|fewer samples than', output), output[-3000:]


# Workers whose loops differ (dist_worker.train): worker 1's shard ends two
# steps early, or it alone skips a batch (inside record(), or one its
# DataLoader failed to give, before record()). With the layers' default
# timeout (30 minutes across workers), the job ends in seconds: the others
# learn it at their next synchronized call, named.
UNEVEN = [
    ({'short': 2, 'steps': 4},
     r"worker 0 \(pid \d+\) failed with exit code 1: .*SyncBatchNorm '\w+': worker 1 ended "
     r"its script after 2 fwd calls of this layer while worker 0 makes its fwd call #3: the "
     r"workers ran different numbers of training steps\. Give every worker the same number "
     r"of batches: shards of equal size, and a DataLoader with last_batch='discard' \(or "
     r"'rollover'\)\.$"),
    ({'fault': 'skip_one', 'steps': 4},
     r"worker \d \(pid \d+\) failed with exit code 1: .*a training step was abandoned on "
     r"some workers only .*: worker 0: its call #2 of this layer, after 0 abandoned steps; "
     r"worker 1: its call #2 of this layer, after 1 abandoned step\. .*skip a batch on every "
     r"worker alike, or on none\.$"),
    ({'fault': 'skip_loader', 'steps': 4},
     r"worker \d \(pid \d+\) failed with exit code 1: .*a training step was abandoned on "
     r"some workers only \(.*their DataLoader failed to give a batch\).*: worker 0: its call "
     r"#2 of this layer, after 0 abandoned steps; worker 1: its call #2 of this layer, after 1 "
     r"abandoned step\. .*skip a batch on every worker alike, or on none\.$"),
]


@pytest.mark.parametrize('backend,launcher,uneven,expected',
                         [b + u for b in BACKENDS for u in UNEVEN])
def test_workers_that_run_different_steps_end_the_job_at_once_named(backend, launcher, uneven,
                                                                    expected):
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=1, sizes=[3, 2], **uneven)
    code, output, elapsed, _ = run_job(2, 'train', kwargs, backend=launcher, deadline=120)
    assert code == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert re.match(r'\[launch\] job stopped: ' + expected, last), output[-3000:]
    assert elapsed < 30, elapsed


# own_init: the script registers its own initializer and sets a function of
# its own on an MXNet class (dist_worker.healthy_end), which keeps its globals,
# the store among them, alive as long as MXNet's modules.
@pytest.mark.parametrize('own_init', [False, True])
def test_a_healthy_job_exits_0_with_its_last_step_in_flight_beside_a_cpu_hog(own_init):
    """The script ends right after issuing its last step. The last job's
    worker 1 starts that step 12 s late: worker 0's exit waits for it."""
    hog = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    try:
        for lag in (0, 0, 0, 0, 0, 12):
            code, output, elapsed, results = run_job(
                2, 'healthy_end', dict(backend='dist_sync', lag=lag, own_init=own_init),
                servers=1, deadline=120)
            assert code == 0, (lag, output[-5000:])
            assert sorted(results) == [0, 1], output[-3000:]
            assert elapsed < 60, (lag, elapsed)
    finally:
        hog.kill()
        hog.wait()


@pytest.mark.parametrize('own_init', [False, True])
def test_a_healthy_horovod_job_exits_0_with_its_last_step_in_flight(own_init):
    if HOROVOD:
        pytest.skip(HOROVOD)
    code, output, _, results = run_job(2, 'healthy_end',
                                       dict(backend='horovod', own_init=own_init),
                                       backend='horovod')
    assert code == 0, output[-5000:]
    assert sorted(results) == [0, 1], output[-3000:]


# MXNet's own launcher for a job on this machine, tools/launch.py. The
# dmlc_tracker it runs calls Thread.isAlive, gone since Python 3.9, and would
# then never start the workers while its scheduler waits for them.
MXNET_LAUNCH = os.path.join(os.path.dirname(importlib.util.find_spec('mxnet').origin), 'tools',
                            'launch.py')
TRACKER_SHIM = ('import runpy, sys, threading; threading.Thread.isAlive = '
                'threading.Thread.is_alive; sys.argv = sys.argv[1:]; '
                'runpy.run_path(sys.argv[0], run_name="__main__")')


def test_a_healthy_job_with_its_own_initializer_exits_0_under_mxnets_launcher():
    """``--launcher local`` watches nothing: a worker that aborts at its exit
    leaves the scheduler waiting for it for ever."""
    kwargs = dict(backend='dist_sync', own_init=True)
    # The launcher runs the command through bash, its words joined by spaces.
    argv = [sys.executable, '-c', TRACKER_SHIM, MXNET_LAUNCH, '-n', '2', '-s', '1',
            '--launcher', 'local', sys.executable, WORKER, 'healthy_end',
            shlex.quote(json.dumps(kwargs))]
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output = None
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the job still runs
        except ProcessLookupError:
            pass
    if output is None:
        pytest.fail('the job did not end within 120 s:\n' + proc.communicate()[0][-5000:])
    # The workers share one output, unprefixed: their lines may interleave.
    ranks = sorted(json.loads(r)['rank'] for r in re.findall(r'RESULT (\{[^}]*\})', output))
    assert proc.returncode == 0, output[-5000:]
    assert ranks == [0, 1], output[-3000:]


# What worker 1's network does differently (dist_worker.out_of_step), and what
# every worker's error says: found at the layer's first call, before any key
# of another size reaches the parameter server.
OUT_OF_STEP = [
    ('channels', "'net_bn1': the workers' networks differ at their layer #2 to synchronize "
                 "across workers: worker 0: 'net_bn1', 4 channels, float32; worker 1: 'net_bn1', "
                 "6 channels, float32."),
    ('groups', "'net_bn0': the workers' networks differ at their layer #1 to synchronize "
               "across workers: worker 0: 'net_bn0', sync_groups=None; worker 1: 'net_bn0', "
               "sync_groups=1 over 1 device."),
    ('devices', "'net_bn0': the workers' networks differ at their layer #1 to synchronize "
                "across workers: worker 0: 'net_bn0', sync_groups=2 over 1 device; worker 1: "
                "'net_bn0', sync_groups=2 over 2 devices."),
    ('dtype', "'net_bn0': the workers' networks differ at their layer #1 to synchronize across "
              "workers: worker 0: 'net_bn0', 4 channels, float32; worker 1: 'net_bn0', 4 "
              "channels, float64."),
    ('layers', "the workers' networks differ at their layer #2 to synchronize across workers: "
               "worker 0: 'net_bn1'; worker 1: 'net_bn2'."),
]


@pytest.mark.parametrize('backend,launcher,what,expected',
                         [('dist_sync', 'kvstore') + c for c in OUT_OF_STEP] +
                         [('horovod', 'horovod', ) + OUT_OF_STEP[0]])
def test_workers_out_of_step_get_the_same_error_at_once(backend, launcher, what, expected):
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    code, output, elapsed, _ = run_job(2, 'out_of_step', dict(backend=backend, what=what),
                                       backend=launcher, servers=1 if launcher == 'kvstore'
                                       else None, deadline=120)
    assert code != 0
    for rank in (0, 1):  # our error, whether MXNet raised it or a layer
        assert re.search(r"\[worker %d\] RAISED (MXNetError|SyncBatchNormError): SyncBatchNorm "
                         % rank, output), output[-3000:]
    assert output.count(expected) >= 2, output[-3000:]
    assert 'Check failed' not in output and 'shape mismatch' not in output, output[-3000:]
    assert elapsed < 20, elapsed


@pytest.mark.parametrize('backend,launcher', BACKENDS)
def test_num_devices_counts_this_workers_devices_and_the_error_says_so(backend, launcher):
    """2 workers x 2 contexts with num_devices=4, the job's count: a worker
    refuses it at its first call, before any reduction, with the fix that
    applies across processes (not 'initialize on 4 contexts'); the first to
    refuse ends the job, which may stop the other before it reaches its own."""
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    code, output, elapsed, _ = run_job(2, 'out_of_step', dict(backend=backend, what='num_devices'),
                                       backend=launcher, servers=1 if launcher == 'kvstore'
                                       else None, deadline=120)
    assert code == 1, (code, output[-3000:])
    expected = ("SyncBatchNorm 'net_bn0': num_devices=4 but its parameters are initialized on "
                "2 context(s) (cpu(0), cpu(1)); it would wait for devices that never call. "
                "Across processes num_devices counts this worker's devices only, the contexts "
                "its parameters live on here (the other workers' devices take part through the "
                "layer's kvstore): omit num_devices (None counts them) or pass num_devices=2.")
    raised = re.findall(r'\[worker \d\] RAISED (.*)', output)
    assert raised and all(line == 'SyncBatchNormError: ' + expected for line in raised), \
        output[-3000:]
    assert 'initialize on 4 context(s)' not in output, output[-3000:]
    assert elapsed < 20, elapsed


def test_a_worker_calling_more_often_per_step_ends_the_job_within_its_timeout():
    """Worker 1 calls the network twice per step: the layers' calls wait for
    each other across the workers until the timeout names the layer."""
    code, output, elapsed, _ = run_job(2, 'out_of_step', dict(backend='dist_sync', what='calls',
                                                              timeout=5), servers=1,
                                       deadline=120, env=dict(GLUON_SYNCBN_EXIT_GRACE='4'))
    assert code != 0
    for rank in (0, 1):
        assert re.search(r"worker %d of 2 waited 5s for the other workers at the (fwd|bwd) "
                         r"reduction #\d+ of layer 'net_bn\d'" % rank, output), output[-3000:]
    assert 'runs a different number of training calls' in output
    assert elapsed < 40, elapsed


def test_bad_input_on_one_worker_ends_the_job_with_its_error():
    kwargs = dict(backend='dist_sync', devices=2, sizes=[1, 3, 2, 1], fault='bad_input')
    code, output, elapsed, _ = run_job(2, 'train', kwargs, deadline=60)
    assert code != 0
    # the network's first layer, a SyncBatchNorm on the images, names the problem
    last = output.strip().splitlines()[-1]
    assert re.match(r'\[launch\] job stopped: worker 1 \(pid \d+\) failed with exit code 1: '
                    r'.*input has 2 channels on axis 1 but the layer has in_channels=3', last), \
        output[-3000:]
    assert elapsed < 40, elapsed


@pytest.mark.parametrize('backend,launcher', BACKENDS)
def test_a_worker_late_to_its_first_step_is_named_with_the_timeout_to_raise(backend, launcher):
    """Worker 1 reaches its first step later than the layers' timeout: worker
    0's error says what it waited for and which setting to raise, and the
    launcher names worker 1, still running, as the one it waited for."""
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=1, sizes=[3, 2], fault='late', timeout=4)
    code, output, elapsed, _ = run_job(2, 'train', kwargs, backend=launcher, deadline=60,
                                       env=dict(GLUON_SYNCBN_EXIT_GRACE='4'))
    assert code != 0
    last = output.strip().splitlines()[-1]
    assert re.match(r'\[launch\] job stopped: worker 0 \(pid \d+\) failed with exit code 1: '
                    r".*worker 0 of 2 waited 4s for the other workers to set up layer '\w+', "
                    r'its layer #1 .*raise timeout= \(or GLUON_SYNCBN_TIMEOUT\) if it is just '
                    r'slow.*; the workers it waited for, still running then: worker 1 \(pid '
                    r'\d+\)$', last), output[-3000:]
    assert elapsed < 30, elapsed


@pytest.mark.parametrize('backend,launcher', BACKENDS)
def test_gradient_compression_is_refused_at_once_or_works(backend, launcher):
    """A kvstore with gradient compression cannot carry the layers' numbers:
    refused at the Trainer's first step, naming the conflict and the fix.
    Horovod's compression is the gradients' only: it trains beside the layers."""
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=1, sizes=[3, 2], compression=True)
    code, output, elapsed, results = run_job(2, 'train', kwargs, backend=launcher, deadline=60)
    if backend == 'horovod':
        assert_exact(code, output, results, 2, tol=2e-3)  # float16 gradients
        return
    assert code != 0
    assert "SyncBatchNorm cannot synchronize through kvstore 'dist_sync': it has gradient " \
        "compression" in output and 'Horovod' in output, output[-3000:]
    assert elapsed < 30, elapsed


@pytest.mark.parametrize('devices,sizes,sync_groups', [(2, [1, 3, 2, 1], None),
                                                      (1, [2, 3], None),
                                                      (2, [2, 1, 0, 0], None),  # empty shard
                                                      (2, [1, 3, 2, 1], [[0, 3], [1, 2]])])
def test_layer_over_horovod_matches_float64(devices, sizes, sync_groups):
    if HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend='horovod', devices=devices, sizes=sizes, sync_groups=sync_groups)
    code, output, _, results = run_job(2, 'layer', kwargs, backend='horovod')
    assert_exact(code, output, results, 2)


@pytest.mark.parametrize('hybridize,rank0_net', [(False, False), (True, True)])
def test_horovod_trainer_matches_full_batch_training(hybridize, rank0_net):
    if HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend='horovod', devices=1, sizes=[3, 2], hybridize=hybridize,
                  rank0_net=rank0_net)
    code, output, _, results = run_job(2, 'train', kwargs, backend='horovod')
    assert_exact(code, output, results, 2, tol=5e-6)


@pytest.mark.parametrize('backend,launcher,devices,sizes,extra', [
    # batches 2e3 apart, after a training step with a NaN
    ('dist_sync', 'kvstore', 2, [1, 3, 2, 1], {'spread': 1e3, 'nan_first': True}),
    ('dist_sync', 'kvstore', 2, [2, 1, 0, 0], {'hybridize': 'static'}),  # an empty shard
    ('dist_sync', 'kvstore', 1, [3, 2], {'short': 1}),  # worker 1 has a batch fewer
    ('horovod', 'horovod', 2, [1, 3, 2, 1], {'hybridize': True, 'spread': 1e3}),
])
def test_precise_bn_is_exact_and_identical_on_every_worker(backend, launcher, devices, sizes,
                                                           extra):
    """update_bn_stats over the workers' shards: float64 maths on the global
    batches, the same bits on every device of every worker."""
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    kwargs = dict(backend=backend, devices=devices, sizes=sizes, **extra)
    code, output, _, results = run_job(2, 'precise_bn', kwargs, backend=launcher,
                                       servers=1 if launcher == 'kvstore' else None)
    digests = {rank: r.pop('digest') for rank, r in results.items()}
    assert_exact(code, output, results, 2)
    assert len(set(digests.values())) == 1, digests
    if extra.get('short'):  # the others stop with it, and say why
        assert '[worker 0] ' in output and 'worker(s) 1 had no batch #3: every worker stops ' \
            'after 2 batches' in output, output[-3000:]


@pytest.mark.parametrize('helper', ['scheduler', 'server 0'])
def test_without_the_launcher_a_lost_helper_is_named_and_no_worker_hangs(tmp_path, helper):
    """As across machines, where nothing watches the job's processes: the
    kvstore's scheduler dies after training (the workers' exit would wait for
    it in ps-lite's final barrier for ever, here when the store is dropped
    as the scenario's function returns), or its server dies during training
    (the next reductions wait for it). Every worker ends, naming what was
    lost, within seconds (of the layers' 5 s timeout, for the server)."""
    from gluon_syncbn.launch import kvstore_commands
    flag = tmp_path / 'lost'
    kwargs = dict(backend='dist_sync', flag=str(flag), steps_after=0 if helper == 'scheduler' else 2)
    commands = kvstore_commands(2, 1, [sys.executable, WORKER, 'helper_lost', json.dumps(kwargs)])
    env = dict(os.environ, PYTHONPATH=ROOT, GLUON_SYNCBN_EXIT_GRACE='4')
    procs, lines = {}, {}
    try:
        for label, argv, extra in commands:
            procs[label] = subprocess.Popen(argv, env=dict(env, **extra), cwd=ROOT,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            start_new_session=True, text=True)
            lines[label] = []
            threading.Thread(target=lambda p, out: out.extend(p.stdout), daemon=True,
                             args=(procs[label], lines[label])).start()
        workers = ['worker 0', 'worker 1']
        deadline = time.monotonic() + 90
        while not all(any('TRAINED' in l for l in lines[w]) for w in workers):
            assert time.monotonic() < deadline, lines
            time.sleep(0.1)
        procs[helper].kill()
        flag.write_text('')
        for w in workers:
            procs[w].wait(timeout=60)  # a worker that hangs fails the test here
        output = ''.join(lines['worker 0'] + lines['worker 1'])
        assert all(procs[w].returncode == 1 for w in workers), output[-3000:]
        if helper == 'scheduler':
            assert output.count("the kvstore's scheduler at 127.0.0.1:%s does not answer, so "
                                "the job cannot finish" % env_port(commands)) == 2, output[-3000:]
        else:
            assert 'waited 5s for the other workers at the' in output and \
                "A worker (or a server of the job's kvstore) died" in output, output[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def env_port(commands):
    """The scheduler's port in a job's ``kvstore_commands``."""
    return dict(commands[0][2])['DMLC_PS_ROOT_PORT']
