"""Which GPUs MXNet 1.9.1 can run on, read through the CUDA runtime.

Every CUDA wheel of MXNet 1.9.1 (cu112 to cu117) carries machine code for
compute capabilities 5.0, 6.0, 7.0, 8.0 and 8.6, and no PTX. A GPU runs
machine code built for its own major version and an equal or lower minor
one, so MXNet's own kernels run on compute capability 5.0 to 8.9 (V100, T4,
A100, A10, L4, RTX 30 and 40 series) and on nothing newer: on Hopper (9.0:
H100, H200) and later every MXNet kernel fails with "no kernel image is
available", although cuDNN and cuBLAS would run. A layer on such a GPU says
so at its first training call instead (inference runs MXNet's own BatchNorm,
which fails there by itself).

The capability is read from the CUDA runtime the GPU build already loaded
(``cudaDeviceGetAttribute``), without creating a context or running a
kernel. Without that runtime (the CPU build) there is nothing to check.
"""
import ctypes
import functools

from .cpu_contexts import on_cpu_path
from .errors import SyncBatchNormError

__all__ = ['RUNTIME_LIBRARY', 'gpu_properties', 'check_gpus']

# The CUDA runtime of mxnet-cu112, as cuda_libs loads it.
RUNTIME_LIBRARY = 'libcudart.so.11.0'
# Compute capabilities MXNet 1.9.1's machine code runs on: [first, last).
FIRST, LAST = (5, 0), (9, 0)
_MAJOR, _MINOR = 75, 76  # cudaDevAttrComputeCapabilityMajor, ...Minor
_PROPERTIES_SIZE = 4096  # more than any cudaDeviceProp; its name comes first
_NAME_SIZE = 256


def gpu_properties(runtime=None):
    """``[(name, (major, minor))]`` for each GPU the CUDA runtime sees, in
    device order; empty without a runtime or without GPUs.

    Parameters
    ----------
    runtime : ctypes.CDLL, optional
        The CUDA runtime (default: :data:`RUNTIME_LIBRARY`, if loadable).
    """
    if runtime is None:
        try:
            runtime = ctypes.CDLL(RUNTIME_LIBRARY)
        except OSError:
            return []
    count = ctypes.c_int(0)
    if runtime.cudaGetDeviceCount(ctypes.byref(count)) != 0:
        return []  # no driver, no device: MXNet says so itself
    gpus = []
    for device in range(count.value):
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        props = ctypes.create_string_buffer(_PROPERTIES_SIZE)
        if (runtime.cudaDeviceGetAttribute(ctypes.byref(major), _MAJOR, device) != 0 or
                runtime.cudaDeviceGetAttribute(ctypes.byref(minor), _MINOR, device) != 0):
            return gpus
        name = ('GPU %d' % device if runtime.cudaGetDeviceProperties(props, device) != 0
                else props.raw[:_NAME_SIZE].split(b'\0', 1)[0].decode('utf-8', 'replace'))
        gpus.append((name, (major.value, minor.value)))
    return gpus


@functools.lru_cache(maxsize=None)
def _gpus():
    return gpu_properties()


def check_gpus(layer, devices):
    """Raise :class:`SyncBatchNormError` if a GPU among ``devices`` (context
    strings) is one MXNet 1.9.1's kernels cannot run on, naming it, its
    compute capability and why. ``gpu(i)`` is the runtime's device ``i``;
    where the test switch ``GLUON_SYNCBN_DEVICE_PATH=1`` makes CPU contexts
    take the GPUs' path, ``cpu(i)`` is checked as device ``i``."""
    if on_cpu_path(devices):
        return
    gpus = _gpus()
    for device in devices:
        index = int(device[device.index('(') + 1:-1])
        if index >= len(gpus):
            continue
        name, capability = gpus[index]
        if FIRST <= capability < LAST:
            continue
        raise SyncBatchNormError(
            "SyncBatchNorm '%s': %s is a GPU of compute capability %d.%d (%s), on which "
            "MXNet 1.9.1 cannot run: its CUDA wheels carry machine code for compute capabilities "
            "5.0, 6.0, 7.0, 8.0 and 8.6 only, and no PTX to compile for newer GPUs, so none "
            "of MXNet's own kernels can execute there (\"no kernel image is available\"). "
            "Use GPUs of compute capability 5.0 to 8.9 (V100, T4, A100, A10, L4, RTX 30 or "
            "40 series)." % ((layer, device) + capability + (name,)))
