"""Multi-device scenarios, each run in its own subprocess by tests (see conftest).

Run as ``python -m tests.scenarios NAME JSON_KWARGS`` (``__main__.py``); prints
one JSON line ``RESULT {...}`` with the measured errors. Keeping MXNet out of
the pytest process means a wedged engine fails one test (by its timeout), not
the suite.

This package is the shared harness: importing it (which importing any of its
modules does first) configures the CPU contexts before MXNet runs its first
operator (``SCENARIO_CONTEXTS``), installs the transport
``SCENARIO_TRANSPORT`` names and, on the device path, the stand-in CUDA
runtime, and holds the registry (``@scenario``) and the helpers several
families use. The scenarios are in one module per test family, named
after the tests that run them (``faults.py``: ``test_faults.py``'s);
``__main__.py`` imports them all.
"""
import os
import time

import numpy as np

import gluon_syncbn

# The explicit step for CPU contexts, before MXNet runs its first operator.
# Scenarios use up to 4 contexts unless SCENARIO_CONTEXTS says more.
gluon_syncbn.configure_cpu_contexts(int(os.environ.get('SCENARIO_CONTEXTS', '4')))

import mxnet as mx
from mxnet import autograd, gluon

if os.environ.get('SCENARIO_TRANSPORT'):  # 'loopback:MODE' or 'kvstore': see tests/loopback.py
    from tests.loopback import install
    _kind, _, _mode = os.environ['SCENARIO_TRANSPORT'].partition(':')
    install(_kind, **({'mode': _mode} if _mode else {}))

from gluon_syncbn import SyncBatchNorm
from tests import native_testing

if (os.environ.get('GLUON_SYNCBN_DEVICE_PATH') == '1'
        and os.environ.get('GLUON_SYNCBN_BACKEND') == 'exchange'):
    # The exchange operator copies as on a GPU, through a stand-in CUDA runtime.
    native_testing.copy_like_a_gpu(gluon_syncbn.native.load())
from tests.reference import batchnorm_float64, max_rel_err

SCENARIOS = {}
VERBOSE = bool(os.environ.get('SCENARIO_VERBOSE'))


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def contexts(n):
    return [mx.cpu(i) for i in range(n)]


def split_batch(x, sizes):
    bounds = np.cumsum([0] + list(sizes))
    return [x[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]


# Networks from the same weights: networks and native (copy_params), amp
# and numpy_mode (_twin_nets).
def copy_params(src, dst):
    src_params = list(src.collect_params().values())
    dst_params = list(dst.collect_params().values())
    assert len(src_params) == len(dst_params)
    for s, d in zip(src_params, dst_params):
        d.set_data(s.data(s.list_ctx()[0]).copyto(mx.cpu(0)))


def _twin_nets(reference_norm, sync_norm, ctxs, hybridize):
    """A small conv net (2 x conv+BN+relu, pooling, dense) with ``reference_norm``
    on one context and, from the same weights, with ``sync_norm`` on ``ctxs``
    (None: the reference's layers converted with convert_model); both
    hybridized alike; and an SGD Trainer for each."""
    from gluon_syncbn import convert_model

    def make(norm):
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(8, 3, padding=1, use_bias=False, in_channels=3), norm(),
                gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(8, 3, padding=1, use_bias=False, in_channels=8), norm(),
                gluon.nn.Activation('relu'), gluon.nn.GlobalAvgPool2D(),
                gluon.nn.Dense(5, in_units=8))
        return net
    ref = make(reference_norm)
    ref.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    net = make(sync_norm) if sync_norm else convert_model(make(reference_norm))
    net.initialize(ctx=ctxs)
    for src, dst in zip(ref.collect_params().values(), net.collect_params().values()):
        dst.set_data(src.data())
    if hybridize:
        for n in (ref, net):
            n.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    opt = {'learning_rate': 0.1, 'momentum': 0.9}
    return (ref, net, gluon.Trainer(ref.collect_params(), 'sgd', dict(opt)),
            gluon.Trainer(net.collect_params(), 'sgd', dict(opt)))


# A step that fails and the steps that recover: empty_slices, faults and
# gpu_path (_capture: also convert, head_dtypes and run_ahead).
def _step(net, arrays, functional=False):
    """One training step's forward and backward; returns the outputs as NumPy.
    ``functional``: through ``autograd.set_recording``/``set_training``
    instead of a ``record()`` scope."""
    if functional:
        autograd.set_recording(True)
        autograd.set_training(True)
        try:
            outs = [net(a) for a in arrays]
        finally:
            autograd.set_recording(False)
            autograd.set_training(False)
    else:
        with autograd.record():
            outs = [net(a) for a in arrays]
    autograd.backward(outs)
    return [o.asnumpy() for o in outs]


def _capture(fn):
    """Run ``fn``; return (exception text or None, its type name, seconds)."""
    start = time.time()
    try:
        fn()
        mx.nd.waitall()
    except Exception as exc:  # pylint: disable=broad-except
        return str(exc), type(exc).__name__, time.time() - start
    return None, None, time.time() - start


def _recovery_error(net, ctxs, rng, shape, functional=False, steps=1):
    """Worst relative error of full, correct steps after a failure."""
    worst = 0.0
    for _ in range(steps):
        x = rng.randn(*shape).astype(np.float32)
        outs = _step(net, [mx.nd.array(p, ctx=c)
                           for p, c in zip(split_batch(x, [1] * len(ctxs)), ctxs)], functional)
        y64 = batchnorm_float64(x, np.ones_like(x), np.ones(shape[1]), np.zeros(shape[1]))[0]
        worst = max(worst, max_rel_err(np.concatenate(outs), y64))
    return worst


def _fault_net(ctxs, hybridize, timeout, channels=3):
    """Two SyncBatchNorm layers on ``ctxs``, hybridized as ``_hybridize``."""
    net = gluon.nn.HybridSequential()
    net.add(SyncBatchNorm(in_channels=channels, timeout=timeout))
    net.add(SyncBatchNorm(in_channels=channels, timeout=timeout))
    net.initialize(ctx=ctxs)
    _hybridize(net, hybridize)
    return net


# Two SyncBatchNorm layers against float64 maths: run_ahead and convert
# (_hybridize: most families).
def _hybridize(net, hybridize):
    """``False``, ``True`` (``hybridize()``), ``'static_alloc'`` or ``'static'``
    (static_alloc and static_shape)."""
    if hybridize:
        net.hybridize(static_alloc=hybridize in ('static_alloc', 'static'),
                      static_shape=hybridize == 'static')


# The first layer's gamma and beta in _DelayedNet and _BNStack runs: the
# second layer's input is then as far from zero as its output.
_GAMMA1, _BETA1 = np.array([0.5, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])


def _ready(net, ctxs, hybridize=False):
    """``net`` (a _DelayedNet or _BNStack) initialized on ``ctxs``, its first
    layer's gamma and beta _GAMMA1 and _BETA1, hybridized as ``_hybridize``."""
    net.initialize(ctx=ctxs)
    net.bn1.gamma.set_data(mx.nd.array(_GAMMA1))
    net.bn1.beta.set_data(mx.nd.array(_BETA1))
    _hybridize(net, hybridize)
    return net


def _two_layers_float64(x):
    """Both layers' float64 output and batch statistics (the first with
    _GAMMA1 and _BETA1, the second with gamma 1 and beta 0)."""
    y1, _, _, _, m1, v1 = batchnorm_float64(x, x, _GAMMA1, _BETA1)
    y2, _, _, _, m2, v2 = batchnorm_float64(y1, y1, np.ones(3), np.zeros(3))
    return y2, [(m1, v1), (m2, v2)]


class _BNStack(gluon.HybridBlock):
    """Two SyncBatchNorm layers, the first with _GAMMA1 and _BETA1."""

    def __init__(self, timeout, **kwargs):
        super(_BNStack, self).__init__(**kwargs)
        with self.name_scope():
            self.bn1 = SyncBatchNorm(in_channels=3, timeout=timeout)
            self.bn2 = SyncBatchNorm(in_channels=3, timeout=timeout)

    def hybrid_forward(self, F, x):
        return self.bn2(self.bn1(x))


# Every block of a network: convert, native and numpy_mode.
def _blocks(block):
    yield block
    for child in block._children.values():
        yield from _blocks(child)


# A layer called several times per pass, on random passes: run_ahead,
# gpu_path and native_transport.
class _RunAheadNet(gluon.HybridBlock):
    """SyncBatchNorm first, on the input (so its batch statistics are known in
    float64), called ``calls`` times per forward pass (each further call on
    ``0.5 * previous + 1``, the sum of all outputs going on), then a
    convolution the Trainer updates."""

    def __init__(self, channels, calls, **kwargs):
        super(_RunAheadNet, self).__init__(**kwargs)
        self._calls = calls
        with self.name_scope():
            self.bn = SyncBatchNorm(in_channels=channels)
            self.conv = gluon.nn.Conv2D(4, 3, padding=1, in_channels=channels)

    def hybrid_forward(self, F, x):
        out = a = self.bn(x)
        for _ in range(self._calls - 1):
            a = self.bn(a * 0.5 + 1)
            out = out + a
        return self.conv(out)


def _random_pass(net, rng, sizes, channels, ctxs):
    """One forward and backward pass of ``net`` on a batch of random scale and
    offset, split ``sizes`` over ``ctxs``, not waited for; returns the batch."""
    x = (rng.randn(sum(sizes), channels, 4, 4) * rng.uniform(0.5, 3)
         + rng.uniform(-2, 2)).astype(np.float32)
    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
    with autograd.record():
        losses = [(net(a) ** 2).mean() for a in xs]
    autograd.backward(losses)
    return x


# Traced graphs against their float64 twins: networks and convert.
def _set_weights(block, rng):
    """Every Parameter of ``block`` (initialized, or waiting for its shape)
    set to values a trained network might have, the same on each of its
    contexts."""
    params = block.collect_params()
    if any(not p.shape or not all(p.shape) for p in params.values()):
        block.infer_shape(mx.nd.zeros((1, 3, 8, 8)))  # a SymbolBlock's own Parameters
    for name, p in sorted(params.items()):
        if name.endswith('gamma'):
            value = rng.uniform(0.5, 1.5, p.shape)
        elif name.endswith('running_var') or name.endswith('moving_var'):
            value = rng.uniform(0.5, 2.0, p.shape)
        elif name.endswith('weight'):
            value = rng.randn(*p.shape) * 0.3
        else:
            value = rng.uniform(-0.5, 0.5, p.shape)
        p.set_data(mx.nd.array(value, dtype=p.dtype))


def _values(params):
    """Every Parameter's value by name (set, or waiting for a first call:
    a SymbolBlock's own Parameters)."""
    values = {}
    for name, p in params.items():
        try:
            values[name] = p.data(p.list_ctx()[0]).asnumpy()
        except gluon.parameter.DeferredInitializationError:
            values[name] = p._deferred_init[3].asnumpy()  # what set_data gave it
    return values


def _twin_dtype(net):
    """The dtype of ``net``'s parameters."""
    return np.dtype(next(iter(net.collect_params().values())).dtype).name


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _graph_step(net, xs, dys):
    """A forward and backward pass of ``net`` on each device's ``xs`` with
    head gradients ``dys`` (one per output); returns the outputs."""
    with autograd.record():
        outs = [_as_list(net(a)) for a in xs]
    autograd.backward([o for out in outs for o in out], [d for ds in dys for d in ds])
    return outs


def _compare_step(errs, key, net, twin, x, sizes, ctxs, rng):
    """One step of ``net`` on ``x`` split ``sizes`` over ``ctxs`` and of its
    float64 twin on the whole batch, from the same values: outputs,
    every Parameter's gradient (summed over devices) and every device's
    running statistics."""
    dtype = _twin_dtype(twin)
    with autograd.predict_mode():
        shapes = [o.shape for o in _as_list(twin(mx.nd.array(x[:1], dtype=dtype)))]
    dys = [rng.randn(len(x), *shape[1:]) for shape in shapes]
    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
    parts = [split_batch(d, sizes) for d in dys]
    outs = _graph_step(net, xs, [[mx.nd.array(parts[k][i], ctx=c) for k in range(len(dys))]
                                 for i, c in enumerate(ctxs)])
    with autograd.record():
        outs64 = _as_list(twin(mx.nd.array(x, dtype=dtype)))
    autograd.backward(outs64, [mx.nd.array(d, dtype=dtype) for d in dys])
    for k, out64 in enumerate(outs64):
        errs.note(key + '_out', np.concatenate([o[k].asnumpy() for o in outs]), out64.asnumpy())
    theirs = twin.collect_params()
    for name, p in net.collect_params().items():
        want = theirs[name]
        if p.grad_req != 'null':
            errs.note(key + '_grad', sum(p.grad(c).asnumpy().astype(np.float64) for c in ctxs),
                      want.grad().asnumpy())
        if 'running' in name or 'moving' in name:
            for c in ctxs:
                errs.note(key + '_running', p.data(c).asnumpy(), want.data().asnumpy())
