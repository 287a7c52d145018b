"""A converted network trained under MXNet's NumPy mode
(tests/test_numpy_mode.py).
"""
import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors
from tests.scenarios import _blocks, _twin_nets, contexts, scenario, split_batch


@scenario
def numpy_mode_training(sizes=(2, 2), steps=3, hybridize=False, seed=0):
    """Under ``npx.set_np()``: a small net built with nn.BatchNorm, converted
    with convert_model, trained with a Trainer on len(sizes) contexts, vs the
    unconverted net on one context on the concatenated batch, from the same
    weights. Returns worst relative errors of losses, parameters and running
    statistics over all steps."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    batch = int(sum(sizes))
    with mx.util.np_shape(True), mx.util.np_array(True):
        ref, net, ref_trainer, trainer = _twin_nets(
            lambda: gluon.nn.BatchNorm(in_channels=8), None, ctxs, hybridize)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        errs = WorstErrors()
        for _ in range(steps):
            x = rng.randn(batch, 3, 6, 6).astype(np.float32)
            label = rng.randint(0, 5, batch).astype(np.float32)
            xs = [mx.np.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
            ls = [mx.np.array(p, ctx=c) for p, c in zip(split_batch(label, sizes), ctxs)]
            with autograd.record():
                losses = [loss_fn(net(a), b) for a, b in zip(xs, ls)]
            autograd.backward(losses)
            trainer.step(batch)
            with autograd.record():
                ref_loss = loss_fn(ref(mx.np.array(x)), mx.np.array(label))
            ref_loss.backward()
            ref_trainer.step(batch)
            errs.note('loss', np.concatenate([l.asnumpy() for l in losses]), ref_loss.asnumpy())
            for (name, p), rp in zip(net.collect_params().items(), ref.collect_params().values()):
                for c in ctxs:
                    errs.note('running' if 'running' in name else 'param', p.data(c).asnumpy(),
                              rp.data().asnumpy())
        errs['num_syncbn'] = sum(isinstance(b, SyncBatchNorm) for b in _blocks(net))
        errs['out_is_np'] = float(isinstance(losses[0], mx.np.ndarray))
    return errs
