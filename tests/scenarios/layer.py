"""One SyncBatchNorm layer on N contexts against float64 maths and
nn.BatchNorm on one (tests/test_layer.py; tests/test_native_transport.py runs
it through a cross-process transport).
"""
import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import (WorstErrors, backward_order, batchnorm_float64, fold_running,
                             update_order)
from tests.scenarios import contexts, scenario, split_batch


@scenario
def layer_vs_reference(shape, sizes, axis=1, dtype='float32', hybridize=False, steps=3,
                       offset=0.0, momentum=0.9, seed=0, deferred=False, numpy_mode=False,
                       ndim_unknown=False, calls=1, reverse=False):
    """SyncBatchNorm on len(sizes) devices vs float64 maths and nn.BatchNorm on one.

    ``calls``: the layer is called that many times per step (a GAN
    discriminator on real and fake batches), call k on data ``offset * (k +
    1)`` away from zero, every output in one backward (``reverse``: the
    last call's outputs first); the running statistics fold the calls in as
    MXNet's BatchNorm does on the devices' kind
    (:func:`tests.reference.update_order`), and where that is CPU's they are
    compared with nn.BatchNorm's too.
    ``deferred``: no in_channels, so a hybridized graph is first traced without
    the channel count (gamma and beta keep their initial ones and zeros).
    ``numpy_mode``: everything under ``npx.set_np()``, on ``mx.np`` arrays.
    ``ndim_unknown``: a hybridized graph is traced as where shape inference
    cannot tell the input's number of dimensions (the GPU path's graph then
    reshapes before ``moments``).
    Returns the worst relative error per quantity over all steps.
    """
    if ndim_unknown:
        from gluon_syncbn import graphs
        graphs.traced_ndim = lambda shape: None
    if numpy_mode:
        with mx.util.np_shape(True), mx.util.np_array(True):
            errs = _layer_vs_reference(shape, sizes, axis, dtype, hybridize, steps, offset,
                                       momentum, seed, deferred, calls, reverse, mx.np.array)
        errs['out_is_np'] = float(errs.pop('out_type') == 'mxnet.numpy.ndarray')
        return errs
    return _layer_vs_reference(shape, sizes, axis, dtype, hybridize, steps, offset, momentum,
                               seed, deferred, calls, reverse, mx.nd.array)


def _layer_vs_reference(shape, sizes, axis, dtype, hybridize, steps, offset, momentum, seed,
                        deferred, calls, reverse, array):
    rng = np.random.RandomState(seed)
    shape = tuple(shape)
    channels = shape[axis]
    ctxs = contexts(len(sizes))
    gamma = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, channels).astype(np.float32)

    bn = SyncBatchNorm(axis=axis, momentum=momentum, in_channels=0 if deferred else channels)
    bn.initialize(ctx=ctxs)
    if deferred:
        gamma, beta = np.ones_like(gamma), np.zeros_like(beta)
    else:
        bn.gamma.set_data(array(gamma))
        bn.beta.set_data(array(beta))
    if hybridize:
        bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    if dtype != 'float32':
        bn.cast(dtype)  # as a float16 or float64 network does

    ref = gluon.nn.BatchNorm(axis=axis, momentum=momentum, in_channels=channels)
    ref.initialize(ctx=mx.cpu(0))
    ref.gamma.set_data(array(gamma))
    ref.beta.set_data(array(beta))

    errs = WorstErrors()
    running = (np.zeros(channels), np.ones(channels))
    order = update_order(calls, hybridize, reverse)
    # nn.BatchNorm's running statistics are CPU's: where the devices' rule
    # folds otherwise, they are no reference.
    cpu_order = order == backward_order(calls, hybridize, reverse)

    for _ in range(steps):
        batches = []  # per call: x, dy and their slices
        for k in range(calls):
            x = (rng.randn(*shape) * rng.uniform(0.5, 3) + offset * (k + 1)).astype(dtype)
            dy = rng.randn(*shape).astype(dtype)
            xs = [array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(x, sizes), ctxs)]
            dys = [array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(dy, sizes), ctxs)]
            for a in xs:
                a.attach_grad()
            batches.append((x, dy, xs, dys))
        with autograd.record():
            ys = [[bn(a) for a in xs] for _, _, xs, _ in batches]
        turn = slice(None, None, -1 if reverse else 1)
        autograd.backward(sum(ys[turn], []), sum([dys for _, _, _, dys in batches][turn], []))
        y = np.concatenate([a.asnumpy() for a in sum(ys, [])])
        dx = np.concatenate([a.grad.asnumpy() for _, _, xs, _ in batches for a in xs])
        dgamma = sum(bn.gamma.grad(c).asnumpy().astype(np.float64) for c in ctxs)
        dbeta = sum(bn.beta.grad(c).asnumpy().astype(np.float64) for c in ctxs)

        # float64 maths on the same (rounded) input, call by call
        refs = [batchnorm_float64(x, dy, gamma, beta, axis) for x, dy, _, _ in batches]
        running = fold_running(running, [r[4:] for r in refs], order, momentum)
        errs.note('y', y, np.concatenate([r[0] for r in refs]))
        errs.note('dx', dx, np.concatenate([r[1] for r in refs]))
        errs.note('dgamma', dgamma, sum(r[2] for r in refs))
        errs.note('dbeta', dbeta, sum(r[3] for r in refs))
        run_mean, run_var = running
        for c in ctxs:
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run_mean)
            errs.note('running_var', bn.running_var.data(c).asnumpy(), run_var)
        errs['replicas_identical'] = float(all(
            (bn.running_mean.data(c).asnumpy() == bn.running_mean.data(ctxs[0]).asnumpy()).all()
            and (bn.running_var.data(c).asnumpy() == bn.running_var.data(ctxs[0]).asnumpy()).all()
            for c in ctxs))

        if dtype == 'float32' and (offset == 0.0 or calls > 1):
            # nn.BatchNorm on each call's concatenated batch, one context
            xfs = [array(x, ctx=mx.cpu(0)) for x, _, _, _ in batches]
            for xf in xfs:
                xf.attach_grad()
            with autograd.record():
                yfs = [ref(xf) for xf in xfs]
            dyfs = [array(dy, ctx=mx.cpu(0)) for _, dy, _, _ in batches]
            autograd.backward(yfs[turn], dyfs[turn])
            if offset == 0.0:  # far from zero its float32 kernel rounds to 1e-4
                errs.note('y_vs_nn', y, np.concatenate([yf.asnumpy() for yf in yfs]))
                errs.note('dx_vs_nn', dx, np.concatenate([xf.grad.asnumpy() for xf in xfs]))
                errs.note('dgamma_vs_nn', dgamma, ref.gamma.grad().asnumpy())
                errs.note('dbeta_vs_nn', dbeta, ref.beta.grad().asnumpy())
            if cpu_order:
                errs.note('running_mean_vs_nn', bn.running_mean.data(ctxs[0]).asnumpy(),
                          ref.running_mean.data().asnumpy())
                errs.note('running_var_vs_nn', bn.running_var.data(ctxs[0]).asnumpy(),
                          ref.running_var.data().asnumpy())
    outs = sum(ys, [])
    errs['out_dtype_ok'] = float(all(a.dtype == np.dtype(dtype) for a in outs))
    errs['out_type'] = '%s.%s' % (type(outs[0]).__module__, type(outs[0]).__name__)
    # Which backend synchronized (see gluon_syncbn.backends); one device has none.
    errs['operator'] = bn._sync_backend.name if bn._sync_backend is not None else None
    return errs
