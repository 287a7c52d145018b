"""Probe (not a test): a static_shape network's steps after one abandoned
step, with the layer's calls held behind a large ``dot`` so that they run
after the main thread has abandoned the step on the last device. Prints each
of the four steps issued next (at once, no sync): its worst relative error
against float64 maths, or the error it raised, and the seconds taken.
docs/findings.md, 2026-11-27 (twenty-second session), has what it printed:

    GLUON_SYNCBN_BACKEND=async python benchmarks/probes/static_abort.py     # 1 timeout, exact
    GLUON_SYNCBN_BACKEND=exchange python benchmarks/probes/static_abort.py  # 4 steps fail
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gluon_syncbn  # noqa: E402
gluon_syncbn.configure_cpu_contexts(3)
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from gluon_syncbn import SyncBatchNorm  # noqa: E402
from tests.reference import batchnorm_float64, max_rel_err  # noqa: E402
ctxs = [mx.cpu(i) for i in range(3)]
class Net(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.bn = SyncBatchNorm(in_channels=3, timeout=20)
    def hybrid_forward(self, F, x, slow):
        # slow: a big matmul that delays the layer's call in the engine
        d = F.sum(F.dot(slow, slow)) * 0
        return self.bn(F.broadcast_add(x, d))
net = Net()
net.initialize(ctx=ctxs)
net.hybridize(static_alloc=True, static_shape=True)
rng = np.random.RandomState(0)
slows = [mx.nd.ones((1500, 1500), ctx=c) for c in ctxs]
def step(x, fail=False):
    outs = []
    with autograd.record():
        for i, c in enumerate(ctxs):
            if fail and i == 2:
                raise ValueError('user code')
            outs.append(net(mx.nd.array(x[i:i+1], ctx=c), slows[i]))
    autograd.backward(outs)
    return outs
x = rng.randn(3, 3, 4, 4).astype('float32')
step(x); mx.nd.waitall()
t = time.time()
try:
    step(x * 100 + 50, fail=True)
except ValueError:
    pass
res = []
for k in range(4):
    x = rng.randn(3, 3, 4, 4).astype('float32')
    res.append((x, step(x)))
errs = []
for x, outs in res:
    try:
        y = np.concatenate([o.asnumpy() for o in outs])
        ref = batchnorm_float64(x, x*0, np.ones(3), np.zeros(3))[0]
        errs.append('%.1e' % max_rel_err(y, ref))
    except Exception as e:
        errs.append(type(e).__name__ + str(e)[:120].replace('\n', ' '))
print('next steps', errs, '%.1fs' % (time.time() - t))
