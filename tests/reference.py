"""Independent references: NumPy float64 batch-norm maths and nn.BatchNorm."""
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
