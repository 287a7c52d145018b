"""MXNet's AMP: bfloat16 training with loss scaling, and what float16 AMP
feeds the layer (tests/test_amp.py).
"""
import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors
from tests.scenarios import _twin_nets, contexts, scenario, split_batch


@scenario
def amp_training(sizes=(1, 3), steps=3, hybridize=False, amp=True, save=None, seed=0):
    """A small conv net with SyncBatchNorm on len(sizes) contexts and the same
    net with nn.BatchNorm on one context, both under ``amp.init('bfloat16')``
    (MXNet's AMP on CPU) with AMP's Trainer and loss scaling, from the same
    weights. Returns worst relative errors of the first step's losses and
    gradients and of the parameters after ``steps``. ``save``: also write both
    nets' first-step gradients (unscaled) there; ``amp=False``: the same
    without AMP, to measure what bfloat16 itself changes."""
    from mxnet.contrib import amp as mx_amp
    if amp:
        mx_amp.init(target_dtype='bfloat16')
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    batch = int(sum(sizes))
    mx.random.seed(seed)
    ref, net, ref_trainer, trainer = _twin_nets(
        lambda: gluon.nn.BatchNorm(in_channels=8), lambda: SyncBatchNorm(in_channels=8), ctxs,
        hybridize)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    if amp:
        mx_amp.init_trainer(trainer)
        mx_amp.init_trainer(ref_trainer)
    errs = WorstErrors()
    for step in range(steps):
        x = rng.randn(batch, 3, 8, 8).astype(np.float32)
        label = rng.randint(0, 5, batch).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
        ls = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(label, sizes), ctxs)]
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ls)]
            if amp:
                with mx_amp.scale_loss(losses, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                autograd.backward(losses)
        with autograd.record():
            ref_loss = loss_fn(ref(mx.nd.array(x)), mx.nd.array(label))
            if amp:
                with mx_amp.scale_loss(ref_loss, ref_trainer) as scaled:
                    scaled.backward()
            else:
                ref_loss.backward()
        if step == 0:
            errs.note('loss', np.concatenate([l.asnumpy() for l in losses]), ref_loss.asnumpy())
            scale = trainer._amp_loss_scaler.loss_scale if amp else 1.0
            grads = {}
            for i, ((name, p), rp) in enumerate(zip(net.collect_params().items(),
                                                   ref.collect_params().values())):
                if p.grad_req == 'null':
                    continue
                try:
                    ours = sum(p.grad(c).asnumpy().astype(np.float64) for c in ctxs)
                    errs.note('grad', ours, rp.grad().asnumpy())
                except mx.base.MXNetError as exc:
                    # Which gradient: ours (the layer's) or MKL-DNN's (convolutions).
                    raise RuntimeError('reading the gradient of %s: %s' % (name, exc))
                grads['ours%d' % i] = ours / scale
                grads['ref%d' % i] = rp.grad().asnumpy().astype(np.float64) / scale
            if save:
                np.savez(save, **grads)
            errs['amp_output_dtype'] = dtype_of(losses[0])
        trainer.step(batch)
        ref_trainer.step(batch)
    for p, rp in zip(net.collect_params().values(), ref.collect_params().values()):
        for c in ctxs:
            errs.note('running' if 'running' in p.name else 'param', p.data(c).asnumpy(),
                      rp.data().asnumpy())
    return errs


@scenario
def amp_float16_layer(sizes=(2, 3), hybridize=False, seed=0):
    """What ``amp.init()`` (float16, the GPU setting) feeds the layer, on CPU
    contexts: a BN-relu-BN net (CPU has no float16 convolution) on float16
    input vs the same net with nn.BatchNorm on one context under the same AMP.
    Run on the 'exchange' or 'exchange-device' path (conftest.PATHS) it exercises
    the GPU path's code."""
    from mxnet.contrib import amp as mx_amp
    mx_amp.init(target_dtype='float16')
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))

    def make(norm):
        net = gluon.nn.HybridSequential()
        net.add(norm(), gluon.nn.Activation('relu'), norm())
        return net
    ref = make(lambda: gluon.nn.BatchNorm(in_channels=4))
    ref.initialize(ctx=mx.cpu(0))
    net = make(lambda: SyncBatchNorm(in_channels=4))
    net.initialize(ctx=ctxs)
    if hybridize:
        for n in (ref, net):
            n.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    errs = WorstErrors()
    for _ in range(2):
        x = (rng.randn(sum(sizes), 4, 6, 6) * 3 + 2).astype(np.float16)
        dy = rng.randn(*x.shape).astype(np.float16)
        xs = [mx.nd.array(p, ctx=c, dtype='float16') for p, c in zip(split_batch(x, sizes), ctxs)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [net(a) for a in xs]
        autograd.backward(ys, [mx.nd.array(p, ctx=c, dtype='float16')
                               for p, c in zip(split_batch(dy, sizes), ctxs)])
        xf = mx.nd.array(x, dtype='float16')
        xf.attach_grad()
        with autograd.record():
            yf = ref(xf)
        yf.backward(mx.nd.array(dy, dtype='float16'))
        errs.note('y', np.concatenate([a.asnumpy() for a in ys]), yf.asnumpy())
        errs.note('dx', np.concatenate([a.grad.asnumpy() for a in xs]), xf.grad.asnumpy())
        errs['dx_dtype_ok'] = float(all(a.grad.dtype == np.float16 for a in xs))
        for c in ctxs:
            errs.note('running', net[0].running_mean.data(c).asnumpy(),
                      ref[0].running_mean.data().asnumpy())
    return errs


def dtype_of(arr):
    from gluon_syncbn.mxnet_private import dtype_name
    return dtype_name(arr.dtype)
