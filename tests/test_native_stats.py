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
    total = stats.combine([stats.forward_contribution(n, *m) for n, m in zip(counts, moments)])
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.uniform(-1, 1, C)
    eps = 1e-5
    backward_total = rng.randn(2 * C) * 10
    count, (m1, m2, v) = counts[0], moments[0]
    d_scale, d_shift = rng.randn(C) * 3, rng.randn(C) * 3

    n, mean, var = stats.global_statistics(total)
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


@pytest.fixture(scope='module')
def library():
    loaded = native.load()
    assert loaded is not None, native.status()
    return loaded


def forward_vector(rng, n, offset):
    return stats.pack_forward(n, rng.randn(C) + offset, rng.uniform(0.1, 4.0, C))


@pytest.mark.parametrize('counts', [(3, 5), (0, 6), (6, 0), (1, 12)])
@pytest.mark.parametrize('offsets', [(0.0, 0.0), (1e4, -1e4), (0.0, 1e8)])
def test_wire_h_combines_as_wire_py(library, counts, offsets):
    """Chan's merge of two slices' FORWARD vectors (their means far apart
    too), bit for bit as tests/stats.py's, and the BACKWARD sum."""
    rng = np.random.RandomState(sum(counts))
    a, b = (forward_vector(rng, n, o) for n, o in zip(counts, offsets))
    assert np.array_equal(native_testing.combine(library, 0, a, b), stats.combine_forward(a, b))
    a, b = rng.randn(2 * C) * 1e4, rng.randn(2 * C)
    assert np.array_equal(native_testing.combine(library, 1, a, b), a + b)


def test_the_exact_encoding_survives_an_engine_that_sums_in_float32(library):
    """Every float64, as four numbers each exact in float32 (or as itself),
    decodes to itself: what a kvstore server that takes float64 keys for
    float32 ones, or sums float32 keys, hands back."""
    rng = np.random.RandomState(0)
    values = [0.0, -0.0, 1.0, 1 / 3, -1e-300, 5e-324, 1e300, -1.7976931348623157e308,
              1e20 + 1, 1e4 + 1e-12, float('nan'), float('inf'), float('-inf')]
    values += list(rng.randn(200) * 10.0 ** rng.randint(-30, 30, 200))
    for value in values:
        for numbers in (1, 4):
            encoded, decoded = native_testing.encode(library, value, numbers)
            assert all(np.float32(e) == e or not np.isfinite(e) for e in encoded) or numbers == 1
            same = decoded == value  # zeros lose their sign in any sum
            assert same or (np.isnan(value) and np.isnan(decoded)), (value, numbers, decoded)
    # the encoding is needed: float32 alone loses the value
    assert np.float64(np.float32(1e4 + 1e-12)) != 1e4 + 1e-12
