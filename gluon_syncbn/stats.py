"""The statistics of synchronized batch normalization, in float64 NumPy.

Every device summarizes its slice of the batch as *local moments* computed by
MXNet's native reductions (see :mod:`gluon_syncbn.block`):

``m1``
    the local mean of ``x`` per channel (a float32 estimate), used as a
    constant: the output does not depend on where we center, so no gradient
    flows through ``m1`` (the block wraps it in BlockGrad);
``m2``
    the mean of ``x - m1`` (the small correction that makes ``m1 + m2`` exact);
``v``
    the (biased) variance of ``x - m1``, the local variance: MXNet's
    ``moments`` operator gives ``m2`` and ``v`` together.

Centering on ``m1`` first keeps the sums free of catastrophic cancellation even
when ``|mean| >> std`` (e.g. ``1e4 + randn`` in float32). The devices' moments
are merged exactly by summing, in float64, ``n``, ``n*mean`` and
``n*(var + mean**2)`` (Chan's parallel formula written as sums: one
all-reduce, whatever the transport). The only rounding left is float64's,
about ``1e-16 * mean**2 / var`` relative.

Backward needs the global sums of ``dy`` and ``dy * (x - mean)`` (one
all-reduce of ``2*C`` numbers), those of the textbook formula.

The vectors' layouts are :mod:`gluon_syncbn.wire`'s. ``native/stats.h`` has
these functions under the same names for the native operators.

All functions take and return 1-D float64 arrays of length ``C`` (channels).
"""
import numpy as np

from . import wire

__all__ = ['forward_contribution', 'merge', 'normalize_coefficients',
           'backward_contribution', 'local_moment_grads', 'Tally']


def forward_contribution(count, m1, m2, v):
    """The vector ``[n, n*mean, n*(var + mean**2)]`` one device adds to the sum."""
    return wire.pack_forward(count, m1 + m2, np.maximum(v, 0.0))


def merge(total):
    """Global ``(n, mean, biased var)`` from the summed forward contributions
    (``n > 0``: the meeting refuses an empty batch first)."""
    n, mean, mean_sq = wire.unpack_forward(total)
    return n, mean, np.maximum(mean_sq - mean * mean, 0.0)


def normalize_coefficients(mean, var, m1, gamma, beta, eps):
    """``y = (x - m1) * scale + shift`` with the global statistics.

    Returns ``(scale, shift, inv_std)``; ``shift`` absorbs ``mean - m1`` so the
    large offset never meets the per-element data again.
    """
    inv_std = 1.0 / np.sqrt(var + eps)
    scale = gamma * inv_std
    shift = beta - (mean - m1) * scale
    return scale, shift, inv_std


def backward_contribution(d_scale, d_shift, mean, m1, inv_std):
    """This device's ``BACKWARD`` vector and its gamma/beta gradients.

    ``d_scale`` and ``d_shift`` are the gradients MXNet's autograd delivers for
    ``scale`` and ``shift`` on this device (sums of ``dy*(x-m1)`` and ``dy``).
    Returns ``(contribution, d_gamma, d_beta)``.
    """
    sum_dy_xc = d_scale - d_shift * (mean - m1)        # = sum(dy * (x - mean))
    return wire.pack_backward(d_shift, sum_dy_xc), sum_dy_xc * inv_std, d_shift


def local_moment_grads(total, count, n, mean, local_mean, gamma, inv_std):
    """Gradients for this device's ``(m2, v)`` from the summed ``BACKWARD`` vector
    (``local_mean``: ``m1 + m2``).

    ``m1`` is a constant (see above), so these carry the whole gradient of the
    statistics: ``dL/dx = dy*scale + d_m2/count + d_v*2*(x - local_mean)/count``.
    """
    sum_dy, sum_dy_xc = wire.unpack_backward(total)
    g_delta = -sum_dy * gamma * inv_std                # dL/d(global mean)
    g_var = -0.5 * sum_dy_xc * gamma * inv_std ** 3    # dL/d(global var)
    w = count / n
    d_m2 = g_delta * w + g_var * 2.0 * w * (local_mean - mean)
    d_v = g_var * w
    return d_m2, d_v


class Tally(object):
    """Over a run of training calls (:func:`gluon_syncbn.update_bn_stats`):
    their number and the float64 sums of each call's ``n``, ``n * mean`` and
    ``n * var``, so that the averages weighted by ``n`` are :meth:`average`
    (``native/stats.h`` has it too). Tallies of calls on different slices
    add up (``+``).

    Parameters
    ----------
    calls : int
        Training calls tallied.
    n : float
        Their samples per channel.
    mean_sum, var_sum : array of float64, or None (no call)
        Sums of ``n * mean`` and ``n * var`` (biased variance) per channel.
    """

    def __init__(self, calls=0, n=0.0, mean_sum=None, var_sum=None):
        self.calls, self.n = calls, float(n)
        self.mean_sum = None if mean_sum is None else np.asarray(mean_sum, np.float64)
        self.var_sum = None if var_sum is None else np.asarray(var_sum, np.float64)

    def add(self, n, mean, var):
        """Tally one call with statistics ``n``, ``mean``, ``var``: float64
        NumPy arrays, or float64 NDArrays, which then stay on their device
        (``.asnumpy()`` the sums to read them)."""
        self.calls += 1
        self.n += n
        if self.mean_sum is None:
            self.mean_sum, self.var_sum = mean * n, var * n
        else:
            self.mean_sum += mean * n
            self.var_sum += var * n

    def __add__(self, other):
        if other.mean_sum is None:
            return Tally(self.calls, self.n, self.mean_sum, self.var_sum)
        if self.mean_sum is None:
            return other + self
        return Tally(self.calls + other.calls, self.n + other.n,
                     self.mean_sum + other.mean_sum, self.var_sum + other.var_sum)

    def average(self):
        """``(mean, var)`` weighted by each call's ``n``; None without samples."""
        if self.mean_sum is None or self.n <= 0:
            return None
        return self.mean_sum / self.n, self.var_sum / self.n
