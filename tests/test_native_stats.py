"""native/stats.h against tests/stats.py on the same inputs.

The tests' build of the library (``GLUON_SYNCBN_TESTING``, see conftest,
which adds ``gsbn_test_stats``: ``tests/native_testing.h``) is loaded and called through ctypes: no
MXNet operator runs. Every result is
compared exactly, except the two that go through ``inv_std ** 3``
(``local_moment_grads``: NumPy's power and libm's pow may round differently),
compared within 1e-15 relative.
"""
import ctypes

import numpy as np
import pytest

from gluon_syncbn import native
from tests import native_testing, stats

C = 7
EXACT = ('forward', 'n', 'mean', 'var', 'scale', 'shift', 'contribution', 'd_gamma')
CLOSE = ('d_m2', 'd_v')
SIZES = {'forward': 1 + 2 * C, 'n': 1, 'mean': C, 'var': C, 'scale': C, 'shift': C,
         'contribution': 2 * C, 'd_gamma': C, 'd_m2': C, 'd_v': C}


@pytest.fixture(scope='module')
def lib():
    loaded = native.load()
    assert loaded is not None, native.status()
    return native_testing.entry_points(loaded)


def native_stats(lib, count, m1, m2, v, total, gamma, beta, eps, fix_gamma, d_scale, d_shift,
                 backward_total):
    out = np.full(sum(SIZES.values()), np.nan)
    arrays = [np.ascontiguousarray(a, dtype=np.float64)
              for a in (m1, m2, v, total, gamma, beta, d_scale, d_shift, backward_total)]
    ptr = [a.ctypes.data_as(ctypes.POINTER(ctypes.c_double)) for a in arrays + [out]]
    lib.gsbn_test_stats(C, count, *ptr[:6], eps, int(fix_gamma), *ptr[6:])
    results, start = {}, 0
    for name, size in SIZES.items():
        results[name] = out[start:start + size]
        start += size
    return results


def device_moments(rng, offset):
    """One device's m1 (a float32 centre), m2 and v, as the block hands them over."""
    m1 = (rng.randn(C) + offset).astype(np.float32).astype(np.float64)
    m2 = rng.randn(C) * 1e-3
    v = rng.uniform(0.1, 4.0, C)
    return m1, m2, v


@pytest.mark.parametrize('fix_gamma', [False, True])
@pytest.mark.parametrize('offset', [0.0, 1e4])
@pytest.mark.parametrize('counts', [(3, 5), (0, 6), (12, 1)])
def test_stats_h_matches_stats_py(lib, counts, offset, fix_gamma):
    rng = np.random.RandomState(sum(counts) + int(offset) + fix_gamma)
    moments = [device_moments(rng, offset) for _ in counts]
    total = sum(stats.forward_contribution(n, *m) for n, m in zip(counts, moments))
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.uniform(-1, 1, C)
    eps = 1e-5
    backward_total = rng.randn(2 * C) * 10
    count, (m1, m2, v) = counts[0], moments[0]
    d_scale, d_shift = rng.randn(C) * 3, rng.randn(C) * 3

    n, mean, var = stats.merge(total)
    g = np.ones(C) if fix_gamma else gamma
    scale, shift, inv_std = stats.normalize_coefficients(mean, var, m1, g, beta, eps)
    if count == 0:  # an empty slice adds nothing (stats.h)
        d_scale, d_shift = np.zeros(C), np.zeros(C)
    contribution, d_gamma, _ = stats.backward_contribution(d_scale, d_shift, mean, m1, inv_std)
    d_m2, d_v = stats.local_moment_grads(backward_total, count, n, mean, m1 + m2, g, inv_std)
    expected = {'forward': stats.forward_contribution(count, m1, m2, v), 'n': [n],
                'mean': mean, 'var': var, 'scale': scale, 'shift': shift,
                'contribution': contribution,
                'd_gamma': np.zeros(C) if fix_gamma else d_gamma, 'd_m2': d_m2, 'd_v': d_v}

    got = native_stats(lib, count, m1, m2, v, total, gamma, beta, eps, fix_gamma, d_scale,
                       d_shift, backward_total)
    for name in EXACT:
        assert np.array_equal(got[name], expected[name]), name
    for name in CLOSE:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-15, atol=0, err_msg=name)
