"""gluon_syncbn.update_bn_stats (precise BN) against float64 maths.

Each case (``scenarios.precise_bn.precise_bn``) trains a two-layer network for two
Trainer steps without waiting, then recomputes its running statistics over
4 random batches of random scale and offset, and compares every device's
with float64 NumPy maths on the same batches: the averages, weighted by
sample count, of the statistics each batch normalizes with in training
mode. Also: the devices that must agree are identical bit for bit; the
weights, gradients and Trainer state are untouched; an interrupted run
leaves everything as it was; a SymbolBlock of the network (its graph's
layers) alike. On every code path (conftest.PATHS); across processes:
test_multiprocess.py.
"""
import pytest

from tests.conftest import PATHS, PATH_OPERATOR, result_of, run_batch, run_python

F32 = 2e-6   # float32 layers against float64 maths
F64 = 1e-12
# The second layer's input comes out of the first in float16.
F16 = {'mean1': F32, 'var1': F32, 'mean2': 1e-3, 'var2': 1e-3}
CASES = {
    'imperative': {},
    'hybridized, uneven': {'hybridize': True, 'sizes': [1, 4, 2]},
    'static_shape': {'hybridize': 'static', 'sizes': [2, 1]},
    'nn.BatchNorm second': {'second': 'nn', 'hybridize': True},
    'float64': {'dtype': 'float64'},
    'float16': {'dtype': 'float16'},
    'DataLoader and ctx_list': {'loader': True, 'sizes': [2, 3]},
    'sync groups': {'sizes': [1, 2, 3, 2], 'sync_groups': [[0, 2], [1, 3]]},
    'interrupted by the user': {'interrupt': 'keyboard'},
    'a device fails': {'interrupt': 'bad_input', 'sizes': [2, 2, 2]},
    'a device fails, hybridized': {'interrupt': 'bad_input', 'sizes': [2, 2, 2],
                                   'hybridize': True},
    'interrupted, static_shape': {'interrupt': 'keyboard', 'hybridize': 'static'},
    'a device fails, static_shape': {'interrupt': 'bad_input', 'sizes': [2, 2, 2],
                                     'hybridize': 'static'},
    # The network traced into a SymbolBlock sharing its Parameters (GluonCV's
    # feature extractors): its graph's layers are found and tallied.
    'a SymbolBlock of the network': {'symbol_block': True, 'sizes': [2, 3, 1]},
    'a SymbolBlock, interrupted, static_shape': {'symbol_block': True, 'hybridize': 'static',
                                                 'interrupt': 'keyboard'},
    'empty slices': {'sizes': [0, 3, 0]},  # last: it sets NumPy shape mode
}
RESTORED = ("gluon_syncbn.update_bn_stats stopped after 2 batch(es): every layer's running "
            "statistics are as they were before the call.")


def check(result, case):
    tol = F16 if case.get('dtype') == 'float16' else {}
    for name in ('mean1', 'var1', 'mean2', 'var2'):
        limit = tol.get(name, F64 if case.get('dtype') == 'float64' else F32)
        assert result[name] < limit, (name, result)
    assert result['identical'] == 1.0, result
    assert result['changed'] == [], result
    assert result['momentum'] == [0.9, 0.9], result
    assert result['used'] == 4, result


@pytest.fixture(scope='module', params=list(PATHS))
def results(request):
    return request.param, run_batch([('precise_bn', c) for c in CASES.values()], timeout=300,
                                    env=PATHS[request.param])


@pytest.mark.parametrize('name', list(CASES))
def test_precise_statistics_equal_float64_maths(results, name):
    path, batch = results
    result = result_of(batch, list(CASES).index(name))
    assert result['operator'] == PATH_OPERATOR[path], result
    check(result, CASES[name])
    if 'interrupt' in CASES[name]:
        assert result['restored'] == 1.0, result
        assert result['notes'] == [RESTORED], result
        # the other devices' calls failed at once, not at the 60 s timeout
        assert result['interrupted_seconds'] < 20, result
        if CASES[name]['interrupt'] == 'keyboard':
            assert result['raised'] == 'KeyboardInterrupt', result
        elif CASES[name].get('hybridize') is True:
            # the graph's shape inference refuses the input (MXNet's text)
            assert result['raised'] in ('MXNetError', 'SyncBatchNormError'), result
        else:
            assert result['raised'] == 'SyncBatchNormError', result
            assert 'input has 5 channels' in result['message'], result


ONE_DEVICE = [{'sizes': [8]}, {'sizes': [8], 'second': 'nn', 'hybridize': 'static'},
              {'sizes': [8], 'loader': True}]


def test_one_device_uses_the_inputs_moments():
    """On one device nothing synchronizes (SyncBatchNorm is nn.BatchNorm):
    the statistics come from the layers' inputs."""
    batch = run_batch([('precise_bn', c) for c in ONE_DEVICE], timeout=200)
    for i, case in enumerate(ONE_DEVICE):
        result = result_of(batch, i)
        assert result['operator'] is None, result
        check(result, case)


MISUSE = r'''
import warnings
import gluon_syncbn
gluon_syncbn.configure_cpu_contexts(2)
import mxnet as mx
from mxnet import gluon
from gluon_syncbn import SyncBatchNorm, update_bn_stats

ctxs = [mx.cpu(0), mx.cpu(1)]
net = gluon.nn.HybridSequential()
net.add(SyncBatchNorm(in_channels=3))
net.initialize(ctx=ctxs)
x = [mx.nd.ones((2, 3, 4), ctx=c) for c in ctxs]

def attempt(label, fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            print(label, 'returned', fn())
        except Exception as exc:
            print(label, type(exc).__name__, exc)
    for w in caught:
        print(label, 'warning', w.message)

attempt('zero', lambda: update_bn_stats(net, [x], 0))
attempt('one_context', lambda: update_bn_stats(net, [(x[0], x[0])]))
attempt('short_batch', lambda: update_bn_stats(net, [mx.nd.ones((1, 3, 4))], ctx_list=ctxs))
attempt('ends_early', lambda: update_bn_stats(net, [x, x], 5))
attempt('no_data', lambda: update_bn_stats(net, []))
plain = gluon.nn.Dense(2)
plain.initialize()
attempt('no_layer', lambda: update_bn_stats(plain, [mx.nd.ones((2, 3))]))
deferred = gluon.nn.BatchNorm()
deferred.initialize()
attempt('deferred', lambda: update_bn_stats(deferred, [mx.nd.ones((2, 3))]))
contrib = gluon.contrib.nn.SyncBatchNorm(in_channels=3, num_devices=2)
contrib.initialize(ctx=ctxs)
attempt('contrib', lambda: update_bn_stats(contrib, [x]))
'''


def test_misuse_is_a_clear_error_or_warning():
    proc = run_python(MISUSE, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = {
        'zero': 'ValueError gluon_syncbn.update_bn_stats: num_batches must be a positive '
                'integer or None, got 0',
        'one_context': "batch 0 has inputs on [cpu(0), cpu(0)], but the network's batch-norm "
                       "layers are on [cpu(0), cpu(1)]",
        'short_batch': "batch 0 has 1 sample(s) for 2 contexts, and MXNet handles empty "
                       "slices only in NumPy shape mode. Use a DataLoader with "
                       "last_batch='discard'",
        'ends_early': 'warning gluon_syncbn.update_bn_stats: data ended after 2 of 5 batches',
        'no_data': 'SyncBatchNormError gluon_syncbn.update_bn_stats: data gave no batch.',
        'no_layer': 'has no batch-norm layer that uses batch statistics; nothing to do.',
        'deferred': 'has no running statistics yet',
        'contrib': 'is mxnet.gluon.contrib.nn.SyncBatchNorm, whose statistics cannot be read. '
                   'Convert the network with gluon_syncbn.convert_model first.',
    }
    for label, text in expected.items():
        lines = [line for line in out.splitlines() if line.startswith(label + ' ')]
        assert any(text in line for line in lines), (label, out)
    assert 'ends_early returned 2' in out, out
    assert 'no_layer returned 0' in out, out


PROGRESS = r'''
import sys
if %r:
    sys.modules['tqdm'] = None  # as if tqdm were not installed
import gluon_syncbn
import mxnet as mx
from mxnet import gluon
net = gluon.nn.BatchNorm(in_channels=3)
net.initialize()
print('used', gluon_syncbn.update_bn_stats(net, [mx.nd.ones((2, 3))] * 3, 3, progress=%r))
'''


@pytest.mark.parametrize('without_tqdm,progress,shown', [
    (False, True, True), (True, True, False), (False, False, False)])
def test_a_progress_bar_only_where_tqdm_is_installed(without_tqdm, progress, shown):
    proc = run_python(PROGRESS % (without_tqdm, progress), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == 'used 3\n', proc.stdout
    assert ('update_bn_stats' in proc.stderr) == shown, proc.stderr
    if not shown:
        assert proc.stderr == '', proc.stderr
