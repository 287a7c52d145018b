"""Cross-process transports inside one process (SCENARIO_TRANSPORT):
a store shared with a Trainer, one step, a deleted store, a failure that
lingers (tests/test_native_transport.py).
"""
import contextlib
import time

import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests import native_testing
from tests.reference import WorstErrors, batchnorm_float64
from tests.scenarios import _RunAheadNet, contexts, scenario, split_batch


@scenario
def store_shared_with_trainer(steps=4, sizes=(3, 5), hybridize=False, seed=0):
    """Under ``SCENARIO_TRANSPORT=kvstore``: the layer reduces through the
    same 'local' kvstore a Trainer uses, and the main thread keeps using it
    (a pushpull of a key of its own) while the layer's reductions are in
    flight, which engine threads issue then from the store lock's queue.
    Returns the running statistics' errors against float64 momentum
    updates, and the main thread's sums' error."""
    from gluon_syncbn import block
    transport = block.make_transport(None)
    store = transport.store
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    net = _RunAheadNet(channels, 1)
    net.initialize(ctx=ctxs)
    if hybridize:
        net.hybridize()
    trainer = gluon.Trainer(net.conv.collect_params(), 'sgd', {'learning_rate': 0.01},
                            kvstore=store, update_on_kvstore=False)
    mine = mx.nd.zeros(16)
    store.init(7, mine)
    run_mean, run_var = np.zeros(channels), np.ones(channels)
    ones, zeros = np.ones(channels), np.zeros(channels)
    errs = WorstErrors()
    for step in range(steps):
        x = (rng.randn(sum(sizes), channels, 4, 4) * 2 + 1).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
        # From the second step on the main thread holds the store's lock
        # while the forward's reductions come (as in a long store call).
        with (transport._store_lock if step else contextlib.ExitStack()):
            with autograd.record():
                losses = [(net(a) ** 2).mean() for a in xs]
                for _ in range(20):
                    out = mx.nd.zeros(16)
                    store.pushpull(7, mx.nd.full(16, step + 1.0), out=out)
            time.sleep(0.05)
        autograd.backward(losses)
        for _ in range(20):  # and the backward ones
            store.pushpull(7, mx.nd.full(16, step + 1.0), out=out)
        trainer.step(sum(sizes))
        errs.note('main_thread_sums', out.asnumpy(), np.full(16, step + 1.0))
        _, _, _, _, mean, var = batchnorm_float64(x, np.zeros_like(x), ones, zeros)
        run_mean = run_mean * 0.9 + mean * 0.1
        run_var = run_var * 0.9 + var * 0.1
    mx.nd.waitall()
    for c in ctxs:
        errs.note('running_mean', net.bn.running_mean.data(c).asnumpy(), run_mean)
        errs.note('running_var', net.bn.running_var.data(c).asnumpy(), run_var)
    errs['operator'] = net.bn._sync_backend.name
    errs['queued'] = transport.twin and native_testing.count(
        gluon_syncbn.session.SESSION.native, 'queued', transport.twin)
    return errs


@scenario
def one_step(sizes=(1, 3), **layer_kwargs):
    """One training step of a layer made with ``layer_kwargs``; for the
    failures a transport reports (tests/test_native_transport.py)."""
    ctxs = contexts(len(sizes))
    bn = SyncBatchNorm(in_channels=3, **layer_kwargs)
    bn.initialize(ctx=ctxs)
    with autograd.record():
        ys = [bn(mx.nd.ones((n, 3, 2, 2), ctx=c)) for n, c in zip(sizes, ctxs)]
    autograd.backward(ys)
    return {'y': float(sum(y.asnumpy().sum() for y in ys))}


@scenario
def store_deleted():
    """Under ``SCENARIO_TRANSPORT=kvstore``: a step, then the user drops the
    store the layer reduces through, then another step."""
    from gluon_syncbn import block
    transport = block.make_transport(None)
    ctxs = contexts(2)
    bn = SyncBatchNorm(in_channels=3)
    bn.initialize(ctx=ctxs)
    for step in range(2):
        if step:
            del transport.store  # its last reference: destroyed now
        with autograd.record():
            ys = [bn(mx.nd.ones((2, 3, 2, 2), ctx=c)) for c in ctxs]
        autograd.backward(ys)
        mx.nd.waitall()
    return {}


@scenario
def fail_then_linger(seconds=60):
    """A step that fails, caught by user code, which then goes on with other
    work: across processes the process must still end (exit grace)."""
    ctxs = contexts(2)
    bn = SyncBatchNorm(in_channels=3)
    bn.initialize(ctx=ctxs)
    try:
        with autograd.record():
            ys = [bn(mx.nd.ones((2, 3, 2, 2), ctx=c)) for c in ctxs]
        autograd.backward(ys)
        mx.nd.waitall()
    except mx.base.MXNetError as exc:
        print('caught: %s' % str(exc).splitlines()[0], flush=True)
    time.sleep(seconds)
    return {}
