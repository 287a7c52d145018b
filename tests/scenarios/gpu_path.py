"""The GPU code path on CPU contexts: a device copy that fails, epochs
of training then predicting, engine operations per call
(tests/test_gpu_path.py).
"""
import os
import time

import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests import native_testing
from tests.reference import WorstErrors, batchnorm_float64, fold_running, update_order
from tests.scenarios import (_capture, _fault_net, _random_pass, _recovery_error, _step, contexts,
                             scenario, split_batch)


@scenario
def device_copy_fails(direction='forward', num_devices=3, hybridize=False, seed=0):
    """On the exchange operator's GPU code (the stand-in CUDA runtime), one
    copy of the next step fails (``direction``: one of the forward's copies
    up, or of the backward's copies down): every device must fail at once
    with the cause, and the step after recover."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, 60.0)
    arrays = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]
    for a in arrays:
        a.attach_grad()
    _step(net, arrays)
    # Every copy of that step done before counting (its backward's copies
    # down may still run after its outputs were read).
    mx.nd.waitall()
    lib = gluon_syncbn.native.load()
    done = native_testing.cuda_calls(lib)
    copies = done['copies_up'] + done['copies_down'] + done['refused']
    # Per layer call per device, 7 copies up and 4 down forward, 2 up and 4
    # down backward: one of the first layer's forward copies up, or one of
    # the last layer's backward copies down.
    fail_at = copies + 7 if direction == 'forward' else copies + 2 * num_devices * 11 + 2
    native_testing.cuda_calls(lib, fail_at=fail_at)
    start = time.time()
    with autograd.record():
        outs = [net(a) for a in arrays]
    autograd.backward(outs)
    messages = [_capture(a.grad.wait_to_read)[0] for a in arrays]
    return {'messages': messages, 'seconds': time.time() - start,
            'refused': native_testing.cuda_calls(lib)['refused'],
            'recovered': _recovery_error(net, ctxs, rng, shape)}


class _TwoLayerNet(gluon.HybridBlock):
    """Two SyncBatchNorm layers on the input, the second on ``0.5 * first + 1``,
    so both layers' batch statistics are known in float64."""

    def __init__(self, channels, **kwargs):
        super(_TwoLayerNet, self).__init__(**kwargs)
        with self.name_scope():
            self.bn1 = SyncBatchNorm(in_channels=channels)
            self.bn2 = SyncBatchNorm(in_channels=channels)

    def hybrid_forward(self, F, x):
        return self.bn2(self.bn1(x) * 0.5 + 1)


def _float64_two_layers(x, stats=None):
    """_TwoLayerNet in float64 (gamma 1, beta 0): in training mode (no
    ``stats``) each layer's batch statistics, ``[(mean, var), (mean,
    var)]``; in predict mode the output, normalized with ``stats`` (the
    running statistics, in that form)."""
    channels = x.shape[1]
    ones, zeros = np.ones(channels), np.zeros(channels)
    a, batch = x.astype(np.float64), []
    for layer in range(2):
        if stats is None:
            a, _, _, _, mean, var = batchnorm_float64(a, np.zeros_like(a), ones, zeros)
            batch.append((mean, var))
        else:
            mean, var = stats[layer]
            a = (a - mean.reshape(1, -1, 1, 1)) / np.sqrt(var.reshape(1, -1, 1, 1) + 1e-5)
        if layer == 0:
            a = a * 0.5 + 1
    return a if stats is not None else batch


def _passes(net, rng, sizes, channels, ctxs, calls):
    """One training step of ``net``, not waited for: one random pass, or
    ``calls`` of them on batches ``1e3 * (k + 1)`` from zero, each input
    with a gradient, every output in one backward, the last call's first (a
    GAN discriminator on real and fake batches). Returns the batches."""
    if calls == 1:
        return [_random_pass(net, rng, sizes, channels, ctxs)]
    batches = [(rng.randn(sum(sizes), channels, 4, 4) * rng.uniform(0.5, 3)
                + 1e3 * (k + 1)).astype(np.float32) for k in range(calls)]
    xs = [[mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)] for x in batches]
    for a in sum(xs, []):
        a.attach_grad()
    with autograd.record():
        ys = [[net(a) for a in call] for call in xs]
    autograd.backward(sum(ys[::-1], []))
    return batches


@scenario
def train_and_predict(hybridize=False, sizes=(3, 5), epochs=3, steps=4, seed=0, calls=1):
    """Epochs of ``steps`` training steps (the network called ``calls``
    times in each, :func:`_passes`), each epoch followed by a validation
    pass in predict mode, as training scripts do, with no sync point at all
    until the end: the predict outputs against float64 maths with the
    running statistics float64 training gives at that point, the calls
    folded in as MXNet's BatchNorm does on the devices' kind
    (:func:`tests.reference.update_order`). Returns their worst relative
    error, and whether the network kept a graph for each mode (hooks)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    net = _TwoLayerNet(channels)
    net.initialize(ctx=ctxs)
    if hybridize:
        net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    stats = [(np.zeros(channels), np.ones(channels))] * 2
    order = update_order(calls, hybridize, reverse=True)
    checks = []
    for _ in range(epochs):
        for _ in range(steps):
            batches = [_float64_two_layers(x)
                       for x in _passes(net, rng, sizes, channels, ctxs, calls)]
            stats = [fold_running(stats[i], [b[i] for b in batches], order) for i in range(2)]
        x = rng.randn(sum(sizes), channels, 4, 4).astype(np.float32) * 2 + 1
        ys = [net(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, sizes), ctxs)]
        checks.append((ys, _float64_two_layers(x, stats)))
    errs = WorstErrors()
    for ys, expected in checks:
        errs.note('predict', np.concatenate([y.asnumpy() for y in ys]), expected)
    errs['two_graphs'] = float(hybridize is not False and '_gluon_syncbn_graphs' in net.__dict__)
    errs['operator'] = net.bn1._sync_backend.name
    return errs


def engine_operations(step, calls=3):
    """Engine operations per call of ``step``, counted by MXNet's profiler
    (each operator pushed alone, each bulked segment, each engine variable
    deleted, each operation our operators push)."""
    import gc
    import json as json_
    from mxnet import profiler
    # What earlier cases left for the garbage collector is freed now, not
    # inside the counted calls (each freed array is an engine operation).
    gc.collect()
    mx.nd.waitall()
    profiler.set_config(profile_all=True, aggregate_stats=True, filename=os.devnull)
    profiler.set_state('run')
    for _ in range(calls):
        step()
    profiler.set_state('stop')
    stats = json_.loads(profiler.dumps(reset=True, format='json'))
    return sum(s['Count'] for s in stats['Time'].get('operator', {}).values()) / calls


@scenario
def operations_per_call(hybridize=True, sizes=(2, 3), layers=4, seed=0):
    """What a layer call costs beyond nn.BatchNorm's, counted: engine
    operations per layer call per device (MXNet's profiler), in training
    (forward and backward) and in predict mode, on a stack of ``layers`` x
    (conv 1x1, norm, relu), counted after two warm calls in each mode; where
    the exchange operator copies through the stand-in CUDA runtime, its
    copies and waits per layer call per device too."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    x = rng.randn(sum(sizes), 8, 2, 2).astype(np.float32)
    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
    nets = {}
    for kind in ('plain', 'ours'):
        net = gluon.nn.HybridSequential()
        for _ in range(layers):
            net.add(gluon.nn.Conv2D(8, 1, use_bias=False, in_channels=8),
                    gluon.nn.BatchNorm(in_channels=8) if kind == 'plain'
                    else SyncBatchNorm(in_channels=8),
                    gluon.nn.Activation('relu'))
        net.initialize(mx.init.Xavier(), ctx=ctxs)
        if hybridize:
            net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        nets[kind] = net

    def train(net):
        with autograd.record():
            ys = [net(a) for a in xs]
        autograd.backward(ys)
        mx.nd.waitall()

    def predict(net):
        for a in xs:
            net(a)
        mx.nd.waitall()

    lib = gluon_syncbn.native.load()
    stand_in = lib is not None and lib.testing and os.environ.get(
        'GLUON_SYNCBN_DEVICE_PATH') == '1'
    per_call = float(layers * len(sizes))
    result = {}
    for mode, step in (('train', train), ('predict', predict)):
        for _ in range(2):
            step(nets['ours'])
            step(nets['plain'])
        before = native_testing.cuda_calls(lib) if stand_in else None
        ours = engine_operations(lambda: step(nets['ours']))
        after = native_testing.cuda_calls(lib) if stand_in else None
        result[mode] = (ours - engine_operations(lambda: step(nets['plain']))) / per_call
        if stand_in:
            for name in native_testing.CUDA_CALLS:
                result['%s_%s' % (mode, name)] = (after[name] - before[name]) / 3 / per_call
    result['operator'] = nets['ours'][1]._sync_backend.name
    return result
