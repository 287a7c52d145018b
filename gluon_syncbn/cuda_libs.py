"""The CUDA libraries of the GPU wheel, loaded before MXNet loads its library.

``mxnet-cu112``'s ``libmxnet.so`` links against the CUDA 11 runtime libraries
(cudart, cuBLAS, cuFFT, cuRAND, cuSOLVER, NVRTC, NVTX, cuDNN, NCCL) and the
NVIDIA driver's ``libcuda.so.1``, and looks for them only on the system's
library path. ``pip install -e ".[gpu]"`` installs the runtime libraries as
NVIDIA's wheels, into ``site-packages/nvidia/<name>/lib``, which is not on that
path. Importing gluon_syncbn before mxnet loads them first, by absolute path
and with ``RTLD_GLOBAL``, in dependency order, as PyTorch does with the same
wheels: the dynamic loader then resolves ``libmxnet.so``'s dependencies to the
libraries already loaded.

Whether anything is to be loaded is read from the ``libmxnet.so`` MXNet is
about to load (found by MXNet's own ``libinfo.find_lib_path``): the CUDA
libraries its ``DT_NEEDED`` entries name, a few kilobytes at the start of the
file. The CPU wheel's names none, and nothing is loaded.

Programs that import mxnet before gluon_syncbn need the libraries on the
library path instead; ``python -m gluon_syncbn.cuda_path`` prints it.
"""
import ctypes
import importlib.util
import os
import struct
import sys

__all__ = ['CudaLibraryError', 'RUNTIME', 'DRIVER', 'mxnet_library', 'needed_libraries',
           'wheel_library', 'preload']

# Each soname the GPU wheel's libmxnet.so asks for -> (its folder under
# site-packages/nvidia, the wheel that installs it), in the order they are
# loaded: cuSOLVER links against cuBLAS, cuDNN's sub-libraries against
# cuBLAS too; cuBLASLt (cuBLAS's own dependency) is found through cuBLAS's
# RUNPATH, so is every library a wheel's library loads itself.
RUNTIME = {
    'libcudart.so.11.0': ('cuda_runtime', 'nvidia-cuda-runtime-cu11'),
    'libcublas.so.11': ('cublas', 'nvidia-cublas-cu11'),
    'libcufft.so.10': ('cufft', 'nvidia-cufft-cu11'),
    'libcurand.so.10': ('curand', 'nvidia-curand-cu11'),
    'libcusolver.so.11': ('cusolver', 'nvidia-cusolver-cu11'),
    'libnvrtc.so.11.2': ('cuda_nvrtc', 'nvidia-cuda-nvrtc-cu11'),
    'libnvToolsExt.so.1': ('nvtx', 'nvidia-nvtx-cu11'),
    'libcudnn.so.8': ('cudnn', 'nvidia-cudnn-cu11'),
    'libnccl.so.2': ('nccl', 'nvidia-nccl-cu11'),
}
# The driver's library: no wheel has it, the NVIDIA driver installs it.
DRIVER = 'libcuda.so.1'
INSTALL_GPU = 'pip install -e ".[gpu]" in a clone of gluon_syncbn'
_handles = []  # the loaded libraries, kept for the life of the process


class CudaLibraryError(ImportError):
    """The GPU build of mxnet is installed, and a CUDA library it needs is not."""


def mxnet_library():
    """The ``libmxnet.so`` that ``import mxnet`` would load, or None.

    Found by MXNet's own search (``MXNET_LIBRARY_PATH``, then
    ``LD_LIBRARY_PATH``, then the package's folder), ``mxnet/libinfo.py`` run on
    its own: importing the ``mxnet`` package would load the library.

    Returns
    -------
    str or None
        The path, or None when mxnet is not installed or has no library (its
        own import then says so).
    """
    spec = importlib.util.find_spec('mxnet')
    if spec is None or not spec.submodule_search_locations:
        return None
    source = os.path.join(list(spec.submodule_search_locations)[0], 'libinfo.py')
    if not os.path.isfile(source):
        return None
    libinfo_spec = importlib.util.spec_from_file_location('_gluon_syncbn_mxnet_libinfo', source)
    libinfo = importlib.util.module_from_spec(libinfo_spec)
    libinfo_spec.loader.exec_module(libinfo)
    try:
        return libinfo.find_lib_path()[0]
    except (RuntimeError, IndexError):
        return None


def needed_libraries(path):
    """The sonames an ELF shared library's ``DT_NEEDED`` entries name.

    Reads the program headers, the dynamic segment and the names only (a
    few kilobytes of a file of 0.9 GB for the GPU wheel).

    Parameters
    ----------
    path : str
        A 64-bit little-endian ELF file (what the Linux wheels ship).

    Returns
    -------
    list of str
        The sonames, in the file's order; empty for anything else (not ELF,
        another class or byte order, no dynamic segment).
    """
    with open(path, 'rb') as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b'\x7fELF' or header[4:6] != b'\x02\x01':
            return []
        phoff, = struct.unpack_from('<Q', header, 32)
        phentsize, phnum = struct.unpack_from('<HH', header, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        segments, dynamic = [], None
        for i in range(phnum):
            kind, _, offset, vaddr, _, size = struct.unpack_from('<IIQQQQ', table, i * phentsize)
            if kind == 1:  # PT_LOAD: maps file offsets to addresses
                segments.append((vaddr, offset, size))
            elif kind == 2:  # PT_DYNAMIC
                dynamic = (offset, size)
        if dynamic is None:
            return []
        f.seek(dynamic[0])
        entries = f.read(dynamic[1])
        names, strtab, strsz = [], None, 0
        for tag, value in struct.iter_unpack('<qQ', entries[:len(entries) // 16 * 16]):
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED: an offset into the string table
                names.append(value)
            elif tag == 5:  # DT_STRTAB: an address
                strtab = value
            elif tag == 10:  # DT_STRSZ
                strsz = value
        offsets = [offset + strtab - vaddr for vaddr, offset, size in segments
                   if strtab is not None and vaddr <= strtab < vaddr + size]
        if not offsets:
            return []
        sonames = []
        for name in names:
            # One short read per name: the table also holds every exported
            # symbol (27 MB for the GPU wheel), and these names come last.
            f.seek(offsets[0] + name)
            text = f.read(min(256, max(strsz - name, 0)))
            sonames.append(text.split(b'\0', 1)[0].decode('utf-8', 'replace'))
    return sonames


def wheel_library(soname, search=None):
    """Where NVIDIA's wheel put ``soname``: ``<dir>/nvidia/<folder>/lib/<soname>``.

    Parameters
    ----------
    soname : str
        A key of :data:`RUNTIME`.
    search : list of str, optional
        The site-packages folders to look in, in order (default: ``sys.path``).

    Returns
    -------
    str or None
        The first such file, or None.
    """
    folder = RUNTIME[soname][0]
    for base in (sys.path if search is None else search):
        path = os.path.join(base or os.curdir, 'nvidia', folder, 'lib', soname)
        if os.path.isfile(path):
            return path
    return None


def _load(soname, path, library):
    """Load ``path`` (or ``soname`` from the library path) with ``RTLD_GLOBAL``;
    a failure raises CudaLibraryError naming the library and the fix."""
    try:
        handle = ctypes.CDLL(path or soname, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        if soname == DRIVER:
            fix = ('Install the NVIDIA driver (version 520 or later for the CUDA 11.8 runtime '
                   'the [gpu] extra installs); on a machine without an NVIDIA GPU, use the CPU '
                   'build instead: pip uninstall mxnet-cu112, then pip install -e ".[cpu]"')
            what = '%s, the NVIDIA driver\'s library' % DRIVER
        else:
            fix = 'Install the CUDA runtime wheels: %s (or pip install %s)' % (
                INSTALL_GPU, RUNTIME[soname][1])
            what = '%s (from the wheel %s)' % (soname, RUNTIME[soname][1])
        if path:
            where = 'loading %s failed' % path
        elif soname == DRIVER:
            where = 'it is not on the library path'
        else:
            where = 'it is in no site-packages/nvidia folder on sys.path nor on the library path'
        raise CudaLibraryError(
            'gluon_syncbn: the installed mxnet is the GPU build (%s) and needs %s, but %s: '
            '%s. %s.' % (library, what, where, exc, fix)) from None
    _handles.append(handle)


def preload(library=None, search=None):
    """Load the CUDA libraries the GPU build of mxnet needs, before MXNet loads.

    Does nothing when mxnet is already imported (its library found its
    dependencies, or its import failed already), not installed, or the CPU
    build.

    Parameters
    ----------
    library : str, optional
        The ``libmxnet.so`` to read (default: :func:`mxnet_library`).
    search : list of str, optional
        Where to look for NVIDIA's wheels (default: ``sys.path``).

    Returns
    -------
    list of str
        What was loaded: absolute paths of wheel libraries, sonames of those
        found on the library path (the driver, a system-wide CUDA).

    Raises
    ------
    CudaLibraryError
        A library the GPU build needs can be loaded neither from a wheel nor
        from the library path; the message names it and the fix.
    """
    if library is None:
        if 'mxnet' in sys.modules:
            return []
        library = mxnet_library()
        if library is None:
            return []
    needed = needed_libraries(library)
    loaded = []
    for soname in RUNTIME:  # dependency order
        if soname in needed:
            path = wheel_library(soname, search)
            _load(soname, path, library)
            loaded.append(path or soname)
    if loaded and DRIVER in needed:
        _load(DRIVER, None, library)
        loaded.append(DRIVER)
    return loaded
