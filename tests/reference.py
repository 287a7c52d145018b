"""Independent references: NumPy float64 batch-norm maths and nn.BatchNorm."""
import itertools
import os

import numpy as np


def batchnorm_float64(x, dy, gamma, beta, axis=1, eps=1e-5):
    """Training-mode batch norm on the whole batch in float64.

    Returns ``(y, dx, dgamma, dbeta, mean, var)``; ``var`` is the biased variance.
    """
    x = x.astype(np.float64)
    dy = dy.astype(np.float64)
    axis = axis % x.ndim
    red = tuple(i for i in range(x.ndim) if i != axis)
    bshape = [1] * x.ndim
    bshape[axis] = -1
    mean = x.mean(axis=red)
    var = x.var(axis=red)
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean.reshape(bshape)) * inv.reshape(bshape)
    g = np.asarray(gamma, np.float64).reshape(bshape)
    y = xhat * g + np.asarray(beta, np.float64).reshape(bshape)
    dgamma = (dy * xhat).sum(axis=red)
    dbeta = dy.sum(axis=red)
    dx = g * inv.reshape(bshape) * (dy - dy.mean(axis=red, keepdims=True)
                                    - xhat * (dy * xhat).mean(axis=red, keepdims=True))
    return y, dx, dgamma, dbeta, mean, var


def fold_running(running, batches, order, momentum=0.9):
    """The running ``(mean, var)`` after the calls' batch statistics
    ``batches`` (``[(mean, var), ...]`` in call order) were folded in in
    ``order`` (indices into ``batches``):
    ``running = momentum * running + (1 - momentum) * batch``."""
    mean, var = running
    for k in order:
        mean = mean * momentum + batches[k][0] * (1 - momentum)
        var = var * momentum + batches[k][1] * (1 - momentum)
    return mean, var


def backward_order(calls, hybridize=False, reverse=False):
    """The order in which MXNet runs the backward calls of a layer called
    ``calls`` times in one recorded step, each on an input that has a
    gradient, whose outputs go to ``autograd.backward`` as one list in call
    order (``reverse``: the last call's first; with several devices: each
    device's, call by call). MXNet's CPU BatchNorm folds each call's
    statistics into the running statistics in its backward call, so in this
    order, which follows MXNet's backward graph (for 3 calls (0, 2, 1), and
    (2, 0, 1) reversed: neither call order nor its reverse) and changes with
    it (inputs without a gradient change it too).
    Read off ``nn.BatchNorm`` on ``cpu(0)``: call k's input constant at
    ``10 ** k``, momentum 0.5, one step, the one order whose fold gives its
    running mean."""
    import mxnet as mx
    from mxnet import autograd, gluon
    with mx.util.np_array(False):  # legacy arrays, also inside NumPy mode
        bn = gluon.nn.BatchNorm(momentum=0.5, in_channels=1)
        bn.initialize(ctx=mx.cpu(0))
        if hybridize:
            bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        xs = [mx.nd.full((2, 1), 10.0 ** k, ctx=mx.cpu(0)) for k in range(calls)]
        for x in xs:
            x.attach_grad()
        with autograd.record():
            ys = [bn(x) for x in xs]
        autograd.backward(ys[::-1] if reverse else ys)
        got = bn.running_mean.data().asnumpy()[0]
    batches = [(np.array([10.0 ** k]), np.zeros(1)) for k in range(calls)]
    orders = [o for o in itertools.permutations(range(calls)) if abs(
        fold_running((np.zeros(1), np.ones(1)), batches, o, 0.5)[0][0] / got - 1) < 1e-6]
    assert len(orders) == 1, (calls, got, orders)
    return orders[0]


def on_gpus():
    """Whether the layers' devices count as GPUs: CPU contexts down the
    exchange operator's GPU code (the test switch ``GLUON_SYNCBN_DEVICE_PATH=1``)."""
    return (os.environ.get('GLUON_SYNCBN_DEVICE_PATH') == '1'
            and os.environ.get('GLUON_SYNCBN_BACKEND') == 'exchange')


def update_order(calls, hybridize=False, reverse=False, chained=False):
    """The order in which a synchronized layer called ``calls`` times per
    step folds the calls into its running statistics, as MXNet's BatchNorm
    does on the devices' kind: on GPUs cuDNN's, at each forward call, in
    call order; on CPU contexts at each backward call, in the order MXNet
    runs them: :func:`backward_order`, or for ``chained`` calls (each on the
    output of the one before) from the last to the first."""
    if on_gpus():
        return tuple(range(calls))
    if chained:
        return tuple(reversed(range(calls)))
    return backward_order(calls, hybridize, reverse)


def max_rel_err(actual, expected):
    """max |actual - expected| / max(|expected|, tiny), as a float.

    A NaN or infinity anywhere, on either side, is an infinite error: a
    comparison with NaN is always False, so ``err < tol`` with a NaN error
    would fail only by luck, and ``max(0.0, nan)`` is 0.0.
    """
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if expected.size == 0:  # an empty slice: right if it is empty too
        return 0.0 if actual.size == 0 else float('inf')
    if not (np.isfinite(actual).all() and np.isfinite(expected).all()):
        return float('inf')
    scale = max(float(np.abs(expected).max()), 1e-12)
    return float(np.abs(actual - expected).max() / scale)


def max_rel_err_where_finite(actual, expected):
    """:func:`max_rel_err` over the numbers ``expected`` holds finite; where
    it holds a NaN or an infinity (the call it came from had one), ``actual``
    must not be finite either, or the error is infinite."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    odd = ~np.isfinite(expected)
    if actual.shape != expected.shape or np.isfinite(actual[odd]).any():
        return float('inf')
    return max_rel_err(actual[~odd], expected[~odd])


def worst(*errors):
    """The largest of ``errors``, NaN counted as infinite (builtin ``max`` drops
    a NaN that is not its first argument)."""
    return max(float('inf') if np.isnan(e) else float(e) for e in errors)


class WorstErrors(dict):
    """Worst relative error per quantity over a run: ``errs.note(name, actual, expected)``."""

    def note(self, name, actual, expected, compare=max_rel_err):
        self[name] = worst(self.get(name, 0.0), compare(actual, expected))


def grouped_batchnorm_float64(x_parts, dy_parts, groups, gamma, beta, axis=1, eps=1e-5):
    """:func:`batchnorm_float64` within each group of device slices.

    ``groups``: lists of indices into ``x_parts``. Returns per device
    ``(y, dx, dgamma, dbeta, mean, var)``: outputs and input gradients of its
    slice, its own share of the gamma/beta gradient sums, and its group's
    statistics.
    """
    out = [None] * len(x_parts)
    for group in groups:
        x = np.concatenate([x_parts[i] for i in group])
        dy = np.concatenate([dy_parts[i] for i in group])
        y, dx, _, _, mean, var = batchnorm_float64(x, dy, gamma, beta, axis, eps)
        red = tuple(k for k in range(x.ndim) if k != axis % x.ndim)
        shape = [1] * x.ndim
        shape[axis] = -1
        xhat = (x.astype(np.float64) - mean.reshape(shape)) / np.sqrt(var + eps).reshape(shape)
        start = 0
        for i in group:
            stop = start + len(x_parts[i])
            dyi = dy[start:stop].astype(np.float64)
            out[i] = (y[start:stop], dx[start:stop], (dyi * xhat[start:stop]).sum(axis=red),
                      dyi.sum(axis=red), mean, var)
            start = stop
    return out
