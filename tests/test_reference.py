"""The comparison helpers themselves: a NaN or an infinity can never pass."""
import numpy as np

from tests.reference import WorstErrors, max_rel_err, worst


def test_nan_or_inf_anywhere_is_an_infinite_error():
    right = np.array([1.0, 2.0])
    assert max_rel_err(right, right) == 0.0
    for bad in (np.nan, np.inf, -np.inf):
        assert max_rel_err(np.array([1.0, bad]), right) == float('inf')
        assert max_rel_err(right, np.array([bad, 2.0])) == float('inf')


def test_worst_counts_nan_as_infinite_in_any_position():
    assert worst(0.0, float('nan')) == float('inf')  # builtin max gives 0.0
    assert worst(float('nan'), 0.0) == float('inf')
    assert worst(1e-7, 2e-7) == 2e-7


def test_worst_errors_keep_a_nan_seen_after_a_good_value():
    errs = WorstErrors()
    errs.note('dx', np.ones(3), np.ones(3))
    errs.note('dx', np.array([1.0, np.nan, 1.0]), np.ones(3))
    errs.note('dx', np.ones(3), np.ones(3))
    assert errs['dx'] == float('inf')
