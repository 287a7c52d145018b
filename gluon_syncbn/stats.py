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
    the mean of ``(x - m1)**2``, so the local variance is ``v - m2**2``.

Centering on ``m1`` first keeps the sums free of catastrophic cancellation even
when ``|mean| >> std`` (e.g. ``1e4 + randn`` in float32). The devices' moments
are merged exactly by summing, in float64, ``n``, ``n*mean`` and
``n*(var + mean**2)`` (Chan's parallel formula written as sums: one
all-reduce, whatever the transport). The only rounding left is float64's,
about ``1e-16 * mean**2 / var`` relative.

Backward needs the global sums of ``dL/d delta`` and ``dL/d var`` (one
all-reduce of ``2*C`` numbers), equivalent to the sums of ``dy`` and
``dy * xhat`` of the textbook formula.

All functions take and return 1-D float64 arrays of length ``C`` (channels).
"""
import numpy as np

__all__ = ['forward_contribution', 'merge', 'normalize_coefficients',
           'backward_contribution', 'local_moment_grads']


def forward_contribution(count, m1, m2, v):
    """The vector ``[n, n*mean, n*(var + mean**2)]`` one device adds to the sum."""
    mean = m1 + m2
    var = np.maximum(v - m2 * m2, 0.0)
    return np.concatenate(([float(count)], count * mean, count * (var + mean * mean)))


def merge(total):
    """Global ``(n, mean, biased var)`` from the summed forward contributions."""
    channels = (total.size - 1) // 2
    n = total[0]
    if n <= 0:
        raise ValueError('the batch is empty on every device')
    mean = total[1:1 + channels] / n
    var = np.maximum(total[1 + channels:] / n - mean * mean, 0.0)
    return n, mean, var


def normalize_coefficients(mean, var, m1, gamma, beta, eps):
    """``y = (x - m1) * scale + shift`` with the global statistics.

    Returns ``(scale, shift, inv_std)``; ``shift`` absorbs ``mean - m1`` so the
    large offset never meets the per-element data again.
    """
    inv_std = 1.0 / np.sqrt(var + eps)
    scale = gamma * inv_std
    shift = beta - (mean - m1) * scale
    return scale, shift, inv_std


def backward_contribution(d_scale, d_shift, mean, m1, gamma, inv_std):
    """Per-device ``(dL/d delta, dL/d var)`` and the gamma/beta gradients.

    ``d_scale`` and ``d_shift`` are the gradients MXNet's autograd delivers for
    ``scale`` and ``shift`` on this device (sums of ``dy*(x-m1)`` and ``dy``).
    Returns ``(contribution, d_gamma, d_beta)`` where ``contribution`` is the
    ``2*C`` vector to all-reduce.
    """
    delta = mean - m1
    d_delta = -d_shift * gamma * inv_std
    d_scale_total = d_scale - d_shift * delta          # = sum(dy * (x - mean))
    d_gamma = d_scale_total * inv_std                  # = sum(dy * xhat)
    d_var = -0.5 * d_scale_total * gamma * inv_std ** 3
    return np.concatenate((d_delta, d_var)), d_gamma, d_shift


def local_moment_grads(total, count, n, mean, m1):
    """Gradients for this device's ``(m2, v)`` from the summed backward vector.

    ``m1`` is a constant (see above), so these carry the whole gradient of the
    statistics: ``dL/dx = dy*scale + d_m2/count + d_v*2*(x - m1)/count``.
    """
    channels = total.size // 2
    g_delta, g_var = total[:channels], total[channels:]
    w = count / n
    d_m2 = g_delta * w + g_var * 2.0 * w * (m1 - mean)
    d_v = g_var * w
    return d_m2, d_v
