"""The statistics of synchronized batch normalization, in float64 NumPy: the
tests' oracle for the native library's maths (``native/stats.h`` has these
functions under the same names, checked against these by
``test_native_stats.py``; ``test_stats.py`` checks these against NumPy on
the concatenated batch).

Every device summarizes its slice of the batch as *local moments* (on the
GPU path computed by MXNet's reductions, ``backends/vector_graph.py``; the
asynchronous operator computes its own, ``native/stats.h``):

``m1``
    the local mean of ``x`` per channel (a float32 estimate), used as a
    constant: the output does not depend on where we center, so no gradient
    flows through ``m1`` (the graph wraps it in BlockGrad);
``m2``
    the mean of ``x - m1`` (the small correction that makes ``m1 + m2`` exact);
``v``
    the (biased) variance of ``x - m1``, the local variance: MXNet's
    ``moments`` operator gives ``m2`` and ``v`` together.

Centering on ``m1`` first keeps the moments free of catastrophic
cancellation even when ``|mean| >> std`` (e.g. ``1e4 + randn`` in float32).
The devices' vectors ``[n, mean, n*var]`` are combined with Chan's parallel
formula in float64 (:func:`combine_forward`), exact whatever their means.

Backward needs the global sums of ``dy`` and ``dy * (x - mean)`` (``2*C``
numbers), those of the textbook formula.

The vectors' layouts are ``native/wire.h``'s (FORWARD, BACKWARD), packed
and combined here as there.

All functions take and return 1-D float64 arrays of length ``C`` (channels).
"""
import numpy as np

__all__ = ['pack_forward', 'combine_forward', 'forward_contribution', 'combine',
           'global_statistics', 'normalize_coefficients', 'backward_contribution',
           'local_moment_grads']


def pack_forward(count, mean, var):
    """``FORWARD`` for ``count`` samples per channel of mean ``mean``, variance ``var``."""
    return np.concatenate(([float(count)], mean, count * var))


def combine_forward(a, b):
    """The ``FORWARD`` vector of the slices of ``a`` and ``b`` together (Chan's formula)."""
    na, nb = a[0], b[0]
    if nb == 0:
        return a.copy()
    if na == 0:
        return b.copy()
    channels, n = (a.size - 1) // 2, na + nb
    delta = b[1:1 + channels] - a[1:1 + channels]
    return np.concatenate(([n], a[1:1 + channels] + delta * (nb / n),
                           a[1 + channels:] + b[1 + channels:] + delta * delta * (na * nb / n)))


def forward_contribution(count, m1, m2, v):
    """This device's ``FORWARD`` vector ``[n, mean, n*var]``."""
    return pack_forward(count, m1 + m2, np.maximum(v, 0.0))


def combine(vectors):
    """The ``FORWARD`` vectors of several slices, combined in order (as the
    meetings combine them: ``native/wire.h``, ``combine_forward``)."""
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = combine_forward(total, v)
    return total


def global_statistics(total):
    """Global ``(n, mean, biased var)`` from the combined forward contributions
    (``n > 0``: the meeting refuses an empty batch first)."""
    channels = (total.size - 1) // 2
    n = total[0]
    return n, total[1:1 + channels], np.maximum(total[1 + channels:] / n, 0.0)


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
    return np.concatenate((d_shift, sum_dy_xc)), sum_dy_xc * inv_std, d_shift


def local_moment_grads(total, count, n, mean, local_mean, gamma, inv_std):
    """Gradients for this device's ``(m2, v)`` from the summed ``BACKWARD`` vector
    (``local_mean``: ``m1 + m2``).

    ``m1`` is a constant (see above), so these carry the whole gradient of the
    statistics: ``dL/dx = dy*scale + d_m2/count + d_v*2*(x - local_mean)/count``.
    """
    sum_dy, sum_dy_xc = np.split(total, 2)
    g_delta = -sum_dy * gamma * inv_std                # dL/d(global mean)
    g_var = -0.5 * sum_dy_xc * gamma * inv_std ** 3    # dL/d(global var)
    w = count / n
    d_m2 = g_delta * w + g_var * 2.0 * w * (local_mean - mean)
    d_v = g_var * w
    return d_m2, d_v
