"""The numbers that leave one device's call, named once.

Every vector is float64 and ``C`` is the channel count.

``FORWARD``  ``[n, n*mean (C), n*(var + mean**2) (C)]``
    one device's (or worker's) batch statistics; summing these over devices
    merges the statistics exactly (Chan's formula written as sums).
``BACKWARD`` ``[sum dy (C), sum dy*(x - mean) (C)]``
    with the global ``mean``; summed over devices they give the two means of
    the backward formula.
``CHECKED``  ``[one row per worker: channels, call, dtype][vector...][ownership]``
    a vector sent to other workers (by the native session only). Each worker
    fills its own row (the others are 0), so the sum brings every worker's,
    which must all be this worker's; a ``FORWARD`` vector travels about the
    layer's *shift* (``[n, sum (x - s), sum (x - s)**2]``, ``s`` the global
    means of the layer's previous call, the same on every worker; before its
    first call, a first round sends the sums as they are, only for their
    means), so that its sums survive an engine that adds them in float32.
``LAYER``    ``[one row per worker: channels, dtype, sync groups, ownership
    entries, name length, name bytes (48)]``: a layer's description at its
    first call, before its keys are made; every worker's must be this one's.

Every number crossing processes is float64, summed by the engine in float64
(Horovod; MXNet's kvstore server unless it takes float64 keys for float32,
which MXNet 1.9.1 does where a flag of its server is left uninitialized: the
rows and the shift keep the sums exact there too). What bounds the precision
is the float64 merge of raw moments, in one process as across processes:
``var = E[x**2] - mean**2`` loses about ``1e-16 * (mean / std)**2`` relative.
The rows hold small whole numbers (the call number modulo ``2**20``), exact
in float32.

``native/wire.h`` packs and unpacks the same layouts for the native operators.
"""
import numpy as np

__all__ = ['pack_forward', 'unpack_forward', 'pack_backward', 'unpack_backward']

DTYPES = ('', 'float32', 'float64', 'float16', 'bfloat16')  # CHECKED and LAYER dtype codes


def pack_forward(count, mean, var):
    """``FORWARD`` for ``count`` samples per channel of mean ``mean``, variance ``var``."""
    return np.concatenate(([float(count)], count * mean, count * (var + mean * mean)))


def unpack_forward(total):
    """``(n, sum x / n, sum x**2 / n)`` from a summed ``FORWARD`` vector."""
    channels = (total.size - 1) // 2
    n = total[0]
    return n, total[1:1 + channels] / n, total[1 + channels:] / n


def pack_backward(sum_dy, sum_dy_xc):
    return np.concatenate((sum_dy, sum_dy_xc))


def unpack_backward(total):
    """``(sum dy, sum dy*(x - mean))`` from a summed ``BACKWARD`` vector."""
    channels = total.size // 2
    return total[:channels], total[channels:]
