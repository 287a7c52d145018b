"""Quick start: SyncBatchNorm on 4 CPU contexts, one image each.

Shows that the layer sees the whole batch (its statistics equal one BatchNorm
on the concatenated batch) and trains a small conv net with gluon.Trainer.

    python examples/quickstart.py
"""
import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm

# Several CPU contexts share MXNet's CPU resources: size them before the first
# operator runs. (Not needed on GPUs: use [mx.gpu(i) ...] there.)
gluon_syncbn.configure_cpu_contexts(4)
ctxs = [mx.cpu(i) for i in range(4)]
mx.random.seed(0)                      # the same run every time
np.random.seed(0)                      # (DataLoader's shuffle)
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

# 2. An ordinary data-parallel training loop: 64 noisy images of 3 classes
# (horizontal stripes, vertical stripes, checkerboard), batches of 4 split
# over the devices.
rng = np.random.RandomState(1)
rows, cols = np.indices((16, 16)) % 2
patterns = np.stack([rows, cols, rows ^ cols]) * 2.0 - 1.0
labels = rng.randint(0, 3, 64)
images = (rng.randn(64, 3, 16, 16) + patterns[labels][:, None]).astype(np.float32)
loader = gluon.data.DataLoader(gluon.data.ArrayDataset(images, labels), batch_size=batch,
                               shuffle=True, last_batch='discard')
trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.05})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
for epoch in range(5):
    total = 0.0
    for data, label in loader:
        xs = gluon.utils.split_and_load(data, ctxs)
        ys = gluon.utils.split_and_load(label, ctxs)
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(batch)
        total += sum(l.sum().asscalar() for l in losses)
    print('epoch %d  mean training loss %.4f' % (epoch + 1, total / len(images)))
bn = net[1]
same = all((bn.running_mean.data(c).asnumpy() == bn.running_mean.data(ctxs[0]).asnumpy()).all()
           for c in ctxs)
print('running statistics identical on all %d devices: %s' % (len(ctxs), same))
