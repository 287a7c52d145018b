"""Head gradients whose dtype differs from the layer's output
(tests/test_head_dtypes.py).
"""
import numpy as np

import mxnet as mx
from mxnet import autograd

from gluon_syncbn import SyncBatchNorm
from tests.reference import batchnorm_float64, max_rel_err
from tests.scenarios import _capture, contexts, scenario, split_batch


def as_dtype(a, dtype):
    """``a`` (an NDArray) as ``dtype``, bfloat16 included (only amp_cast makes
    it, from float32: on CPU it is MKL-DNN's)."""
    from gluon_syncbn.mxnet_private import operator_dtype
    if dtype == 'bfloat16':
        return mx.nd.amp_cast(a.astype('float32'), dtype=operator_dtype(dtype))
    return a.astype(dtype)


@scenario
def head_dtypes(out_dtype='float32', heads=('float16', 'bfloat16', 'float32', 'float64'),
                hybridize=False, sizes=(2, 3), axis=1, seed=0):
    """Head gradients whose dtype differs from the output's (``autograd.backward``
    accepts them; AMP-style code makes them), one fresh layer per head dtype on
    len(sizes) devices, channels on ``axis``; the network is float32 or cast to
    ``out_dtype``.
    Inputs and heads are multiples of 1/4 below 4 in magnitude, exact in every
    float dtype, so float64 maths on the same numbers (on the head as given:
    an integer head truncates them) is the reference. Returns per head dtype
    the worst relative errors of y and dx, or the error message."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    shape = (sum(sizes), 3, 2, 3)
    results = {}
    for head in heads:
        bn = SyncBatchNorm(in_channels=shape[axis], axis=axis)
        bn.initialize(ctx=ctxs)
        if out_dtype != 'float32':
            bn.cast(out_dtype)
        if hybridize:
            bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        x = rng.randint(-15, 16, shape) / 4.0
        dy = rng.randint(-15, 16, shape) / 4.0
        xs = [mx.nd.array(p, ctx=c, dtype=out_dtype) for p, c in zip(split_batch(x, sizes), ctxs)]
        dys = [as_dtype(mx.nd.array(p, ctx=c, dtype='float64'), head)
               for p, c in zip(split_batch(dy, sizes), ctxs)]
        for a in xs:
            a.attach_grad()
        try:
            with autograd.record():
                ys = [bn(a) for a in xs]
            autograd.backward(ys, dys)
            y = np.concatenate([a.asnumpy() for a in ys])
            dx = np.concatenate([a.grad.asnumpy() for a in xs])
        except Exception as exc:  # pylint: disable=broad-except
            results[head] = {'message': '%s: %s' % (type(exc).__name__, exc)}
            _capture(mx.nd.waitall)  # the failed step's error on the other arrays
            continue
        given = np.concatenate([as_dtype(d, 'float32').asnumpy() for d in dys])
        y64, dx64 = (np.moveaxis(a, 1, axis) for a in batchnorm_float64(
            np.moveaxis(x, axis, 1), np.moveaxis(given, axis, 1), np.ones(shape[axis]),
            np.zeros(shape[axis]))[:2])
        results[head] = {'y': max_rel_err(y, y64), 'dx': max_rel_err(dx, dx64),
                         'dx_dtype_ok': float(all(a.grad.dtype == np.dtype(out_dtype)
                                                  for a in xs))}
    results['operator'] = bn._sync_backend.name
    return results
