"""Devices given a slice with no samples, one layer and inside a network
(tests/test_empty_slices.py; tests/soak_faults.py repeats them).
"""
import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors, batchnorm_float64, max_rel_err
from tests.scenarios import (_capture, _hybridize, _recovery_error, _step, contexts, scenario,
                             split_batch)


@scenario
def empty_slices(empty, sizes=(2, 3, 1), hybridize=False, steps=2, seed=0, numpy_shape=True):
    """Devices ``empty`` (indices) get a slice with no samples, under NumPy
    shape mode (``numpy_shape=False``: without it, where that is an error);
    compared with float64 maths on the other slices: outputs and
    input gradients, gamma/beta gradients summed over devices, running
    statistics on every device. If every slice is empty, the error, then a
    normal step (``recovered``)."""
    rng = np.random.RandomState(seed)
    sizes = [0 if i in empty else s for i, s in enumerate(sizes)]
    ctxs = contexts(len(sizes))
    channels = 3
    gamma = rng.uniform(0.5, 1.5, channels)
    beta = rng.uniform(-0.5, 0.5, channels)
    with mx.util.np_shape(numpy_shape):
        bn = SyncBatchNorm(in_channels=channels, timeout=60)
        bn.initialize(ctx=ctxs)
        bn.gamma.set_data(mx.nd.array(gamma))
        bn.beta.set_data(mx.nd.array(beta))
        if hybridize:
            bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        if not sum(sizes) or not numpy_shape:
            xs = [mx.nd.array(np.zeros((s, channels, 4, 5)), ctx=c) for s, c in zip(sizes, ctxs)]
            msg, kind, seconds = _capture(lambda: _step(bn, xs))
            bn.gamma.set_data(mx.nd.ones(channels))
            bn.beta.set_data(mx.nd.zeros(channels))
            return {'message': msg, 'type': kind, 'seconds': seconds,
                    'recovered': _recovery_error(bn, ctxs, rng, (len(ctxs), channels, 4, 5))}
        errs = WorstErrors()
        run_mean, run_var = np.zeros(channels), np.ones(channels)
        for _ in range(steps):
            x = rng.randn(sum(sizes), channels, 4, 5).astype(np.float32) * 2 + 1
            dy = rng.randn(*x.shape).astype(np.float32)
            xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
            for a in xs:
                a.attach_grad()
            with autograd.record():
                ys = [bn(a) for a in xs]
            autograd.backward(ys, [mx.nd.array(p, ctx=c)
                                   for p, c in zip(split_batch(dy, sizes), ctxs)])
            y64, dx64, dg64, db64, mean64, var64 = batchnorm_float64(x, dy, gamma, beta)
            run_mean = run_mean * 0.9 + mean64 * 0.1
            run_var = run_var * 0.9 + var64 * 0.1
            errs.note('y', np.concatenate([a.asnumpy() for a in ys]), y64)
            errs.note('dx', np.concatenate([a.grad.asnumpy() for a in xs]), dx64)
            errs.note('dgamma', sum(bn.gamma.grad(c).asnumpy().astype(np.float64) for c in ctxs),
                      dg64)
            errs.note('dbeta', sum(bn.beta.grad(c).asnumpy().astype(np.float64) for c in ctxs),
                      db64)
            for c in ctxs:
                errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run_mean)
                errs.note('running_var', bn.running_var.data(c).asnumpy(), run_var)
            errs['empty_shapes_ok'] = float(all(
                ys[i].shape == xs[i].shape == xs[i].grad.shape for i in empty))
            errs['empty_grads_zero'] = float(all(
                not bn.gamma.grad(ctxs[i]).asnumpy().any() and
                not bn.beta.grad(ctxs[i]).asnumpy().any() for i in empty))
        return errs


@scenario
def empty_slice_in_network(read='losses', hybridize=False, seed=0):
    """A Trainer step of Conv2D -> SyncBatchNorm on 3 contexts, a batch of 2
    split by ``split_and_load(..., even_split=False)`` in NumPy shape mode
    (set after the network is built: MXNet cannot build its legacy layers in
    it): cpu(2)'s slice is empty and MXNet's convolution refuses it, so that
    device never calls the layer. The error where ``read`` surfaces it
    ('losses': their asnumpy; 'step': the Trainer's first step; 'waitall'),
    then a step on a batch of 3 compared with float64 maths (``recovered``)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(3)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, in_channels=3, use_bias=False),
            SyncBatchNorm(in_channels=4, timeout=60))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    _hybridize(net, hybridize)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.0})
    mx.util.set_np_shape(True)

    def step(batch):
        xs = gluon.utils.split_and_load(mx.nd.array(batch), ctxs, even_split=False)
        with autograd.record():
            outs = [net(a) for a in xs]
            losses = [o.sum() for o in outs]
        autograd.backward(losses)
        if read == 'losses':
            [l.asnumpy() for l in losses]  # pylint: disable=expression-not-assigned
        trainer.step(batch.shape[0])
        mx.nd.waitall()
        return outs

    msg, kind, seconds = _capture(lambda: step(rng.randn(2, 3, 6, 6).astype(np.float32)))
    x = rng.randn(3, 3, 6, 6).astype(np.float32) * 3 + 1e3
    y = np.concatenate([o.asnumpy() for o in step(x)])
    # The convolution's own float32 output (its rounding is not the layer's).
    conv = np.concatenate([net[0](a).asnumpy() for a in gluon.utils.split_and_load(
        mx.nd.array(x), ctxs)]).astype(np.float64)
    y64 = batchnorm_float64(conv, np.ones_like(conv), np.ones(4), np.zeros(4))[0]
    return {'message': msg, 'type': kind, 'seconds': seconds,
            'recovered': max_rel_err(y, y64)}
