"""SyncBatchNorm(sync_groups=...) against float64 maths within each group
(tests/test_sync_groups.py; its misconfiguration case is faults.misconfigured).
"""
import numpy as np

import mxnet as mx
from mxnet import autograd

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors, grouped_batchnorm_float64
from tests.scenarios import contexts, scenario, split_batch


@scenario
def sync_groups_layer(sync_groups, sizes=(1, 2, 3, 2), hybridize=False, steps=2, seed=0):
    """SyncBatchNorm(sync_groups=...) on len(sizes) devices vs float64 maths
    within each group (as independent runs on each group's devices would
    give). Returns worst relative errors; running statistics per device
    against its group's."""
    from gluon_syncbn.groups import check_sync_groups, partition
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    groups = partition(check_sync_groups(sync_groups), len(ctxs), 'reference')
    gamma = rng.uniform(0.5, 1.5, channels)
    beta = rng.uniform(-0.5, 0.5, channels)
    bn = SyncBatchNorm(in_channels=channels, sync_groups=sync_groups)
    bn.initialize(ctx=ctxs)
    bn.gamma.set_data(mx.nd.array(gamma))
    bn.beta.set_data(mx.nd.array(beta))
    if hybridize:
        bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    errs = WorstErrors()
    run = [(np.zeros(channels), np.ones(channels))] * len(ctxs)
    for _ in range(steps):
        x = (rng.randn(sum(sizes), channels, 4, 5) * 2 + 1).astype(np.float32)
        dy = rng.randn(*x.shape).astype(np.float32)
        x_parts, dy_parts = split_batch(x, sizes), split_batch(dy, sizes)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(x_parts, ctxs)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [bn(a) for a in xs]
        autograd.backward(ys, [mx.nd.array(p, ctx=c) for p, c in zip(dy_parts, ctxs)])
        ref = grouped_batchnorm_float64(x_parts, dy_parts, groups, gamma, beta)
        for i, c in enumerate(ctxs):
            y64, dx64, dg64, db64, mean64, var64 = ref[i]
            run[i] = (run[i][0] * 0.9 + mean64 * 0.1, run[i][1] * 0.9 + var64 * 0.1)
            errs.note('y', ys[i].asnumpy(), y64)
            errs.note('dx', xs[i].grad.asnumpy(), dx64)
            errs.note('dgamma', bn.gamma.grad(c).asnumpy(), dg64)
            errs.note('dbeta', bn.beta.grad(c).asnumpy(), db64)
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run[i][0])
            errs.note('running_var', bn.running_var.data(c).asnumpy(), run[i][1])
    return errs
