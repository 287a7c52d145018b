"""Importing gluon_syncbn costs nothing; CPU contexts take one explicit step.

Every process here is fresh, with a deadline, and starts without MXNet's slot
variables in its environment.
"""
import os
import sys
import time

import pytest

from gluon_syncbn import cpu_contexts as engine
from tests.conftest import ROOT, run_python

SLOT_VARIABLES = ('MXNET_CPU_TEMP_COPY', 'MXNET_CPU_PARALLEL_RAND_COPY',
                  'GLUON_SYNCBN_CPU_CONTEXTS')


def python(code, timeout=120, **env):
    start = time.time()
    out = run_python(code, timeout, env, drop=SLOT_VARIABLES)
    return out, time.time() - start


SHOW_SLOTS = ('import os, gluon_syncbn\n'
              'print("SLOTS", os.environ.get("MXNET_CPU_TEMP_COPY"), '
              'os.environ.get("MXNET_CPU_PARALLEL_RAND_COPY"))\n')


def slots(out):
    line = [l for l in out.stdout.splitlines() if l.startswith('SLOTS')]
    assert line, out.stderr[-2000:]
    return line[0].split()[1:]


def test_import_leaves_mxnet_settings_alone():
    out, _ = python(SHOW_SLOTS)
    assert slots(out) == ['None', 'None']


@pytest.mark.parametrize('contexts,expected', [('2', ['512', '16']), ('4', ['1024', '32']),
                                               ('8', ['1024', '64']), ('1', ['None', 'None'])])
def test_environment_variable_is_the_explicit_step(contexts, expected):
    out, _ = python(SHOW_SLOTS, GLUON_SYNCBN_CPU_CONTEXTS=contexts)
    assert slots(out) == expected


def test_bad_environment_variable_names_itself():
    out, _ = python(SHOW_SLOTS, GLUON_SYNCBN_CPU_CONTEXTS='four')
    assert out.returncode != 0
    assert "GLUON_SYNCBN_CPU_CONTEXTS='four'" in out.stderr and 'e.g.' in out.stderr


@pytest.fixture
def fresh_engine(monkeypatch):
    for name in SLOT_VARIABLES:
        # Set first, so that the values configure writes are undone afterwards:
        # monkeypatch restores only what it has seen.
        monkeypatch.setenv(name, '')
        monkeypatch.delenv(name)
    monkeypatch.setattr(engine, '_configured_contexts', [0])
    # Earlier tests in this process made MXNet's resources, after which a
    # configure that raises a setting is refused; these tests are about the
    # bookkeeping, and the refusal has its own test in a fresh process.
    monkeypatch.setattr(engine, 'resources_made', lambda: False)


def test_configure_sizes_from_contexts_and_never_lowers(fresh_engine, monkeypatch):
    assert engine.configure_cpu_contexts(3) == {'MXNET_CPU_TEMP_COPY': '768',
                                                'MXNET_CPU_PARALLEL_RAND_COPY': '24'}
    monkeypatch.setenv('MXNET_CPU_TEMP_COPY', '2048')
    assert engine.configure_cpu_contexts(2, random_slots=40) == {
        'MXNET_CPU_TEMP_COPY': '2048', 'MXNET_CPU_PARALLEL_RAND_COPY': '40'}
    for bad in (0, -1, 2.5, True, 'two'):
        with pytest.raises((ValueError, TypeError)):
            engine.configure_cpu_contexts(bad)


def test_check_passes_for_gpus_one_cpu_and_configured_counts(fresh_engine, monkeypatch):
    engine.check_cpu_contexts('bn', ['gpu(0)', 'gpu(1)', 'gpu(2)'])
    engine.check_cpu_contexts('bn', ['cpu(0)'])
    with pytest.raises(engine.SyncBatchNormError, match=r'configure_cpu_contexts\(2\)'):
        engine.check_cpu_contexts('bn', ['cpu(0)', 'cpu(1)'])
    engine.configure_cpu_contexts(2)
    engine.check_cpu_contexts('bn', ['cpu(0)', 'cpu(1)'])
    with pytest.raises(engine.SyncBatchNormError,
                       match=r'configured for 2 CPU contexts, but this layer synchronizes 4'):
        engine.check_cpu_contexts('bn', ['cpu(%d)' % i for i in range(4)])


def test_settings_made_by_hand_count_as_the_step(fresh_engine, monkeypatch):
    monkeypatch.setenv('MXNET_CPU_TEMP_COPY', '256')
    monkeypatch.setenv('MXNET_CPU_PARALLEL_RAND_COPY', '16')
    engine.check_cpu_contexts('bn', ['cpu(%d)' % i for i in range(4)])
    monkeypatch.setenv('MXNET_CPU_TEMP_COPY', '8')   # too few to be a choice for this
    with pytest.raises(engine.SyncBatchNormError, match='MXNET_CPU_TEMP_COPY=8'):
        engine.check_cpu_contexts('bn', ['cpu(0)', 'cpu(1)'])


UNCONFIGURED = '''
import time, gluon_syncbn, mxnet as mx
from mxnet import autograd
{configure}
ctxs = [mx.cpu(i) for i in range({n})]
net = mx.gluon.nn.HybridSequential()
net.add(mx.gluon.nn.Conv2D(4, 3), gluon_syncbn.SyncBatchNorm(in_channels={in_channels},
                                                             timeout=100))
net.initialize(ctx=ctxs)
if {hybridize}:
    net.hybridize()
start = time.time()
try:
    with autograd.record():
        ys = [net(mx.nd.ones((2, 3, 6, 6), ctx=c)) for c in ctxs]
    mx.nd.waitall()
    print('NO ERROR')
except gluon_syncbn.SyncBatchNormError as exc:
    print('ERROR %.2f %s' % (time.time() - start, exc))
'''


def unconfigured(configure='', n=2, hybridize=False, in_channels=4):
    return UNCONFIGURED.format(configure=configure, n=n, hybridize=hybridize,
                               in_channels=in_channels)


@pytest.mark.parametrize('in_channels', [4, 0], ids=['in_channels', 'deferred'])
@pytest.mark.parametrize('hybridize', [False, True])
def test_missing_step_fails_at_once_naming_the_line_to_add(hybridize, in_channels):
    # Deferred: the check runs inside Gluon's deferred initialization, which
    # wraps whatever fails there in a ValueError about shapes; the user must
    # still get ours.
    out, seconds = python(unconfigured(hybridize=hybridize, in_channels=in_channels))
    assert 'ERROR' in out.stdout, out.stdout + out.stderr[-2000:]
    message = out.stdout.split('ERROR', 1)[1]
    assert "SyncBatchNorm 'syncbatchnorm0'" in message
    assert 'gluon_syncbn.configure_cpu_contexts(2)' in message
    assert 'GLUON_SYNCBN_CPU_CONTEXTS=2' in message
    assert float(message.split()[0]) < 5     # at once, not the layer's 100 s timeout
    assert seconds < 60


def test_step_for_fewer_contexts_than_used_is_refused():
    out, _ = python(unconfigured('gluon_syncbn.configure_cpu_contexts(2)', n=3,
                                 in_channels=0))
    assert 'configured for 2 CPU contexts, but this layer synchronizes 3' in out.stdout, \
        out.stdout + out.stderr[-2000:]
    assert 'configure_cpu_contexts(3)' in out.stdout


LATE = '''
import os, gluon_syncbn, mxnet as mx
from gluon_syncbn.mxnet_private import resources_made
print('BEFORE', resources_made())
gluon_syncbn.configure_cpu_contexts(2)     # in time
mx.nd.ones((2, 2)).asnumpy()               # an operator needing no resources
print('OPERATOR', resources_made())
mx.random.seed(0)
print('SEEDED', resources_made())
gluon_syncbn.configure_cpu_contexts(2)     # nothing to change: accepted
try:
    gluon_syncbn.configure_cpu_contexts(4)
    print('ACCEPTED')
except gluon_syncbn.SyncBatchNormError as exc:
    print('REFUSED', exc)
print('SLOTS', os.environ.get("MXNET_CPU_TEMP_COPY"),
      os.environ.get("MXNET_CPU_PARALLEL_RAND_COPY"))
'''


def test_configure_after_mxnet_made_its_resources_is_refused_and_sets_nothing():
    # MXNet reads the slot variables once, when it makes its resources: a
    # later call would set variables nothing reads, and the user would meet
    # the shortage as a timeout, many steps later.
    out, _ = python(LATE)
    lines = dict(l.split(' ', 1) for l in out.stdout.splitlines() if ' ' in l)
    assert lines.get('BEFORE') == 'False' and lines['OPERATOR'] == 'False', out.stderr[-2000:]
    assert lines['SEEDED'] == 'True'
    message = lines['REFUSED']
    assert 'configure_cpu_contexts(4) came after MXNet made its CPU resources' in message
    assert 'mx.random.seed' in message and 'GLUON_SYNCBN_CPU_CONTEXTS=4' in message
    assert lines['SLOTS'] == '512 16'     # as the call in time left them
    out, _ = python('import mxnet as mx\nmx.random.seed(0)\nimport gluon_syncbn\n',
                    GLUON_SYNCBN_CPU_CONTEXTS='4')
    assert out.returncode != 0
    assert 'SyncBatchNormError: import gluon_syncbn with GLUON_SYNCBN_CPU_CONTEXTS=4 came ' \
        'after MXNet made its CPU resources' in out.stderr, out.stderr[-2000:]


def test_configured_step_trains():
    out, _ = python(unconfigured('gluon_syncbn.configure_cpu_contexts(3)', n=3,
                                 hybridize=True))
    assert 'NO ERROR' in out.stdout, out.stdout + out.stderr[-2000:]


def test_import_costs_nothing_to_one_context_training():
    # resnet18_v1 on one CPU context, with and without the import, in turns.
    # 1024 temp-space slots set at import would cost 17x the memory over these
    # 60 steps (and 3.4x the time, which benchmarks/bench_import.py measures).
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import bench_import  # pylint: disable=import-outside-toplevel
    res = bench_import.compare_import(steps=60, checkpoints=[30, 60], rounds=1, timeout=300)
    assert res['with'][0]['temp_slots'] is None
    assert res['with'][0]['imported'] and not res['without'][0]['imported']
    assert res['rss_ratio'] < 1.2, res


STATIC_TRAINING = '''
import os, time, gluon_syncbn, mxnet as mx, numpy as np
from mxnet import autograd, gluon
from gluon_syncbn.session import SESSION
gluon_syncbn.configure_cpu_contexts({n}, temp_slots={temp_slots})
ctxs = [mx.cpu(i) for i in range({n})]
net = gluon.nn.HybridSequential()
for channels in (8, 16):
    net.add(gluon.nn.Conv2D(channels, 3, padding=1, use_bias=False),
            gluon_syncbn.SyncBatchNorm(timeout=20), gluon.nn.Activation('relu'))
net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(10))
net.initialize(ctx=ctxs)
net.hybridize(static_alloc=True, static_shape=True)
trainer = gluon.Trainer(net.collect_params(), 'sgd', {{'learning_rate': 0.05}})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
rng = np.random.RandomState(0)
step = -1
try:
    for step in range({steps}):
        xs = gluon.utils.split_and_load(mx.nd.array(rng.randn(2 * {n}, 3, 8, 8)), ctxs)
        ys = gluon.utils.split_and_load(mx.nd.array(rng.randint(0, 10, 2 * {n})), ctxs)
        with autograd.record():
            losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(2 * {n})
        [l.asnumpy() for l in losses]
    print('TRAINED', step + 1, repr(SESSION.cpu_temp_space),
          [SESSION.native.cpu_temp_slots(i) for i in range({n})])
except mx.base.MXNetError as exc:
    print('STALLED AT STEP', step, str(exc).splitlines()[0][:300])
'''


@pytest.mark.parametrize('n', [2, 4])
def test_static_graphs_outlast_every_turn_of_the_shared_pool(n):
    # A static_shape graph keeps one temp-space slot per device for its life.
    # With MXNet's one pool for every CPU context, the other operators'
    # slots (14 per step here at N = 2) swept over it once per turn of the
    # 64 slots and device 1's first convolution landed on device 0's graph
    # slot within a few steps: a deadlock at the timeout, again every turn.
    # Each CPU context now has a pool of its own.
    out, _ = python(STATIC_TRAINING.format(n=n, temp_slots=64, steps=40), timeout=240)
    assert 'TRAINED 40' in out.stdout, out.stdout + out.stderr[-2000:]
    assert "TRAINED 40 '' %s" % ([4] * n) in out.stdout, out.stdout


def test_one_context_keeps_mxnets_shared_temp_space():
    out, _ = python(
        'import gluon_syncbn, mxnet as mx\n'
        'from mxnet import autograd\n'
        'from gluon_syncbn.session import SESSION\n'
        'net = gluon_syncbn.SyncBatchNorm(in_channels=4)\n'
        'net.initialize(ctx=mx.cpu(0))\n'
        'with autograd.record():\n'
        '    y = net(mx.nd.ones((2, 4, 3, 3)))\n'
        'y.backward(); mx.nd.waitall()\n'
        'print("SEPARATED", SESSION.cpu_temp_space)\n')
    assert 'SEPARATED None' in out.stdout, out.stdout + out.stderr[-2000:]
