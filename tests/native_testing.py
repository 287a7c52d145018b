"""The tests' entry points of the native library (``tests/native_testing.h``),
in the build ``tests/conftest.py`` asks for (``GLUON_SYNCBN_TESTING``)."""
import ctypes
import os

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'native_testing.h')


def entry_points(lib):
    """The ctypes library of ``lib`` (a loaded ``native.library.Library``,
    built with this file) with the tests' entry points declared."""
    assert lib.testing, 'the library was built without tests/native_testing.h'
    c, doubles = ctypes, ctypes.POINTER(ctypes.c_double)
    raw = lib._lib
    for name, argtypes, restype in [
            ('gsbn_test_loopback', [c.c_int, c.c_char_p, c.c_double], c.c_int),
            ('gsbn_test_count', [c.c_char_p, c.c_int], c.c_int64),
            ('gsbn_test_cuda_stand_in', [], None),
            ('gsbn_test_cuda_calls', [c.c_int, c.c_int64], c.c_int64),
            ('gsbn_test_combine', [c.c_int, doubles, doubles, c.c_int, doubles], None),
            ('gsbn_test_encode', [c.c_double, c.c_int, doubles], None),
            ('gsbn_test_stats', [c.c_int, c.c_double] + [doubles] * 6 +
             [c.c_double, c.c_int] + [doubles] * 4, None)]:
        function = getattr(raw, name)
        function.argtypes, function.restype = argtypes, restype
    return raw


def count(lib, what, transport=0):
    """``'staging'``: (layer, device) pairs holding exchange staging;
    ``'meetings'``: meetings the native session holds; ``'queued'``:
    reductions engine threads left to the holder of ``transport``'s store lock."""
    return entry_points(lib).gsbn_test_count(what.encode(), transport)


def loopback(lib, workers, mode, exit_grace):
    """A loopback transport's id (see ``LoopbackTransport`` in the header)."""
    return entry_points(lib).gsbn_test_loopback(workers, mode.encode(), exit_grace)


CUDA_CALLS = ('copies_up', 'copies_down', 'waits', 'streams', 'refused')


def copy_like_a_gpu(lib):
    """From now on the exchange operator's copies on CPU contexts go through
    device_copies.h's GPU branch, with a stand-in for the CUDA runtime."""
    entry_points(lib).gsbn_test_cuda_stand_in()


def cuda_calls(lib, fail_at=-1):
    """The stand-in's counters (CUDA_CALLS); ``fail_at`` >= 0: the copy of
    that number (counting every copy asked for so far) fails."""
    raw = entry_points(lib)
    return {name: raw.gsbn_test_cuda_calls(i, fail_at if i == 0 else -1)
            for i, name in enumerate(CUDA_CALLS)}


def combine(lib, direction, a, b):
    """``native/wire.h``'s ``combine`` of two float64 vectors (0: FORWARD, 1: BACKWARD)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    a, b = np.ascontiguousarray(a, np.float64), np.ascontiguousarray(b, np.float64)
    out = np.zeros_like(a)
    ptr = ctypes.POINTER(ctypes.c_double)
    entry_points(lib).gsbn_test_combine(direction, a.ctypes.data_as(ptr), b.ctypes.data_as(ptr),
                                        a.size, out.ctypes.data_as(ptr))
    return out


def encode(lib, value, numbers):
    """``(numbers, decoded)``: ``native/wire.h``'s exact encoding of
    ``value`` as a key of ``numbers`` numbers per value holds it, decoded."""
    out = (ctypes.c_double * (numbers + 1))()
    entry_points(lib).gsbn_test_encode(value, numbers, out)
    return list(out[:numbers]), out[numbers]
