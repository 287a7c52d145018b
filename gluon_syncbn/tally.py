"""What precise BN (:func:`gluon_syncbn.update_bn_stats`) averages: a
device's tally of the statistics its training calls normalized with."""
import numpy as np

__all__ = ['Tally']


class Tally(object):
    """Over a run of training calls: their number and the float64 sums of
    each call's ``n``, ``n * mean`` and ``n * var``, so that the averages
    weighted by ``n`` are :meth:`average` (the native session keeps the same,
    ``native/stats.h``).

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

    def average(self):
        """``(mean, var)`` weighted by each call's ``n``; None without samples."""
        if self.mean_sum is None or self.n <= 0:
            return None
        return self.mean_sum / self.n, self.var_sum / self.n
