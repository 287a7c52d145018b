"""Quick start: SyncBatchNorm on 4 CPU contexts, one image each.

Shows that the layer sees the whole batch (its statistics equal one BatchNorm
on the concatenated batch) and trains a small conv net with gluon.Trainer.

    python examples/quickstart.py
"""
import numpy as np

import gluon_syncbn  # import before MXNet runs its first operator
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm

ctxs = [mx.cpu(i) for i in range(4)]   # use [mx.gpu(i) ...] on a GPU machine
batch = 4                              # one image per device

net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(16, 3, padding=1, use_bias=False), SyncBatchNorm(),
        gluon.nn.Activation('relu'), gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(3))
net.initialize(mx.init.Xavier(), ctx=ctxs)
net.hybridize()

# 1. One layer alone: its statistics are those of the whole batch.
layer = SyncBatchNorm(in_channels=3)
layer.initialize(ctx=ctxs)
x = np.random.RandomState(0).randn(batch, 3, 16, 16).astype(np.float32) * 3 + 2
with autograd.record():
    outs = [layer(mx.nd.array(x[i:i + 1], ctx=c)) for i, c in enumerate(ctxs)]
y = np.concatenate([o.asnumpy() for o in outs])
print('output mean over the whole batch, per channel: %.1e (0 expected)'
      % np.abs(y.mean(axis=(0, 2, 3))).max())
print('output std  over the whole batch, per channel: %.5f (1 expected)'
      % y.std(axis=(0, 2, 3)).mean())

# 2. An ordinary data-parallel training loop.
trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.05})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
rng = np.random.RandomState(1)
for step in range(20):
    labels = rng.randint(0, 3, batch)
    images = rng.randn(batch, 3, 16, 16).astype(np.float32) + labels[:, None, None, None]
    xs = gluon.utils.split_and_load(images, ctxs)
    ys = gluon.utils.split_and_load(labels, ctxs)
    with autograd.record():
        losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
    autograd.backward(losses)
    trainer.step(batch)
    if step % 5 == 4:
        print('step %2d  loss %.4f' % (step + 1, np.mean([l.mean().asscalar() for l in losses])))
bn = net[1]
same = all((bn.running_mean.data(c).asnumpy() == bn.running_mean.data(ctxs[0]).asnumpy()).all()
           for c in ctxs)
print('running statistics identical on all %d devices: %s' % (len(ctxs), same))
