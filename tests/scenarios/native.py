"""Deep networks on the native operators: a deep stack, ResNet-50
converted (tests/test_native.py).
"""
import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors
from tests.scenarios import _blocks, contexts, copy_params, scenario, split_batch


@scenario
def deep_stack(num_devices, hybridize, layers=53, steps=2, seed=0):
    """The host-cost benchmark's net, layers x (conv 1x1 + SyncBN + relu) on
    (2, 16, 2, 2) per device: it must finish (no deadlock at this depth) with
    finite outputs and input gradients, compared with nn.BatchNorm on one
    context on the concatenated batch."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)

    def stack(norm):
        net = gluon.nn.HybridSequential()
        for _ in range(layers):
            net.add(gluon.nn.Conv2D(16, 1, use_bias=False, in_channels=16), norm(),
                    gluon.nn.Activation('relu'))
        return net
    net = stack(lambda: SyncBatchNorm(in_channels=16))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    ref = stack(lambda: gluon.nn.BatchNorm(in_channels=16))
    ref.initialize(ctx=mx.cpu())
    copy_params(net, ref)
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    errors = WorstErrors()
    finite = True
    for _ in range(steps):
        x = rng.randn(2 * num_devices, 16, 2, 2).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, [2] * num_devices), ctxs)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [net(a) for a in xs]
        autograd.backward(ys)
        xr = mx.nd.array(x)
        xr.attach_grad()
        with autograd.record():
            yr = ref(xr)
        yr.backward()
        out = np.concatenate([y.asnumpy() for y in ys])
        dx = np.concatenate([a.grad.asnumpy() for a in xs])
        finite = finite and bool(np.isfinite(out).all() and np.isfinite(dx).all())
        errors.note('out', out, yr.asnumpy())
        errors.note('dx', dx, xr.grad.asnumpy())
    return dict(errors, finite=float(finite))


@scenario
def resnet50_converted(num_devices=4, hybridize=True, steps=1, seed=0):
    """model_zoo ResNet-50 v1 converted with convert_model, at 64x64 with 2
    images per device, trained with a Trainer: it must finish and keep the
    running statistics identical on every device."""
    from mxnet.gluon.model_zoo import vision
    from gluon_syncbn import convert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    net = convert_model(vision.resnet50_v1(classes=10))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        x = rng.randn(2 * num_devices, 3, 64, 64).astype(np.float32)
        y = rng.randint(0, 10, 2 * num_devices).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, [2] * num_devices), ctxs)]
        ys = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(y, [2] * num_devices), ctxs)]
        with autograd.record():
            ls = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(ls)
        trainer.step(2 * num_devices)
        losses.append(float(sum(l.sum().asscalar() for l in ls)))
    running = [p for n, p in net.collect_params().items() if 'running' in n]
    return {'finite': float(np.isfinite(losses).all()),
            'num_syncbn': sum(isinstance(b, SyncBatchNorm) for b in _blocks(net)),
            'replicas_identical': float(all(
                (p.data(c).asnumpy() == p.data(ctxs[0]).asnumpy()).all()
                for p in running for c in ctxs))}
