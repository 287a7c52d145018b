"""The float64 statistics maths, checked against NumPy on the concatenated batch.

The chain rule through MXNet's graph (x -> m1, xc, m2, v -> op -> scale, shift
-> y) is written out by hand here, so the op's backward maths is tested without
MXNet.
"""
import numpy as np
import pytest

from tests import stats
from tests.reference import batchnorm_float64, max_rel_err


def local_moments(x):
    """What the block computes per device (float32, as MXNet would)."""
    x = x.astype(np.float32)
    m1 = x.mean(axis=(0, 2, 3), dtype=np.float32)
    xc = x - m1.reshape(1, -1, 1, 1)
    m2 = xc.mean(axis=(0, 2, 3))
    v = xc.var(axis=(0, 2, 3))
    return xc, m1.astype(np.float64), m2.astype(np.float64), v.astype(np.float64)


def sync_bn(parts, dys, gamma, beta, eps=1e-5):
    """Forward and backward of SyncBN over ``parts`` using only tests/stats.py."""
    moments = [local_moments(p) for p in parts]
    total = stats.combine([stats.forward_contribution(p.size // p.shape[1], m1, m2, v)
                           for p, (_, m1, m2, v) in zip(parts, moments)])
    n, mean, var = stats.global_statistics(total)
    ys, saved, bwd = [], [], []
    for p, dy, (xc, m1, m2, v) in zip(parts, dys, moments):
        scale, shift, inv = stats.normalize_coefficients(mean, var, m1, gamma, beta, eps)
        xc = xc.astype(np.float64)
        ys.append(xc * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1))
        d_scale = (dy * xc).sum(axis=(0, 2, 3))
        d_shift = dy.sum(axis=(0, 2, 3))
        contribution, d_gamma, d_beta = stats.backward_contribution(
            d_scale, d_shift, mean, m1, inv)
        saved.append((p, dy, xc, m1, m2, scale, inv, contribution))
        bwd.append((d_gamma, d_beta))
    btotal = sum(s[-1] for s in saved)
    dxs = []
    for p, dy, xc, m1, m2, scale, inv, contribution in saved:
        count = p.size // p.shape[1]
        d_m2, d_v = stats.local_moment_grads(btotal, count, n, mean, m1 + m2, gamma, inv)
        b = lambda a: a.reshape(1, -1, 1, 1)  # noqa: E731
        # m1 is a constant: no term through it (moments' backward)
        dxs.append(dy * b(scale) + b(d_m2) / count + b(d_v) * 2 * (xc - b(m2)) / count)
    d_gamma = sum(g for g, _ in bwd)
    d_beta = sum(b_ for _, b_ in bwd)
    return np.concatenate(ys), np.concatenate(dxs), d_gamma, d_beta, mean, var


@pytest.mark.parametrize('sizes', [[4], [2, 2], [3, 2, 2], [1, 1, 5], [1, 2, 3, 4]])
@pytest.mark.parametrize('offset', [0.0, 1e3, 1e4])
def test_sync_maths_equals_full_batch(sizes, offset):
    rng = np.random.RandomState(len(sizes))
    x = (rng.randn(sum(sizes), 3, 4, 5) * 2 + offset).astype(np.float32)
    dy = rng.randn(*x.shape)
    gamma, beta = rng.uniform(0.5, 1.5, 3), rng.uniform(-1, 1, 3)
    bounds = np.cumsum([0] + sizes)
    parts = [x[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
    dys = [dy[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
    got = sync_bn(parts, dys, gamma, beta)
    want = batchnorm_float64(x, dy, gamma, beta)
    for name, a, b in zip(['y', 'dx', 'dgamma', 'dbeta', 'mean', 'var'], got,
                          [want[0], want[1], want[2], want[3], want[4], want[5]]):
        assert max_rel_err(a, b) < 1e-5, name


def test_merge_is_exact_where_float32_moments_cancel():
    # E[x^2] - E[x]^2 in float32 loses everything at this offset; the merge must not.
    rng = np.random.RandomState(0)
    x = (1e4 + rng.randn(6, 2, 8, 8)).astype(np.float32)
    parts = [x[:1], x[1:6]]
    total = stats.combine([stats.forward_contribution(p.size // 2, *local_moments(p)[1:])
                           for p in parts])
    _, mean, var = stats.global_statistics(total)
    ref = x.astype(np.float64)
    assert np.allclose(mean, ref.mean(axis=(0, 2, 3)), rtol=1e-12, atol=1e-9)
    assert np.allclose(var, ref.var(axis=(0, 2, 3)), rtol=1e-6)
    naive = (x * x).mean(axis=(0, 2, 3)) - x.mean(axis=(0, 2, 3)) ** 2
    assert np.abs(naive - ref.var(axis=(0, 2, 3))).max() > 1e-2  # the test can fail
