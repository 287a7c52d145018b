"""Synchronized batch normalization for MXNet Gluon.

``SyncBatchNorm`` is a drop-in replacement for ``mxnet.gluon.nn.BatchNorm``
that normalizes with the statistics of the whole mini-batch across all
devices, exactly as one BatchNorm on the concatenated batch would.

Importing it changes nothing for code that does not synchronize: the
modules' import-time work is only what they need before MXNet runs (see
``cuda_libs``, ``cpu_contexts``), and the hooks (``hooks``) do nothing until
a layer has synchronized.
"""
import importlib.util as _importlib_util
import sys as _sys

__version__ = '0.1.0'
__all__ = ['SyncBatchNorm', 'SyncBatchNormError', 'SyncBatchNormTimeout',
           'configure_cpu_contexts', 'convert_model', 'revert_model', 'reset',
           'update_bn_stats']

# What importing raises without MXNet, and what the report says there.
NO_MXNET = ("gluon_syncbn needs MXNet 1.9.1, which is not installed here: install the package "
            "with one of its extras, pip install -e '.[cpu]' (MXNet's CPU build) or "
            "pip install -e '.[gpu]' (its CUDA 11.2 build; docs/install.md, section 'GPUs')")

if _importlib_util.find_spec('mxnet') is None:
    # Python imports the package while it locates a module run with -m, with
    # sys.argv[0] '-m' meanwhile: `python -m gluon_syncbn` then reports what
    # is missing, and nothing here needs MXNet.
    if _sys.argv[:1] != ['-m']:
        raise ModuleNotFoundError(NO_MXNET, name='mxnet')
else:
    from .cuda_libs import preload as _preload_cuda_libraries

    # First, before anything imports mxnet: its GPU build then finds the CUDA
    # runtime wheels' libraries (nothing happens with the CPU build).
    _preload_cuda_libraries()

    from .cpu_contexts import configure_cpu_contexts
    from .errors import SyncBatchNormError, SyncBatchNormTimeout
    from .block import SyncBatchNorm
    from .convert import convert_model, revert_model
    from .session import reset
    from .precise_bn import update_bn_stats
    from . import hooks as _hooks
    from .backends import requested_backend as _requested_backend
    from .cpu_contexts import configure_from_environment as _configure_from_environment

    # Everything importing does, here: the environment's settings read (a bad
    # GLUON_SYNCBN_BACKEND fails now, not at the first call; the CPU-context
    # setup only if GLUON_SYNCBN_CPU_CONTEXTS asks for it), and MXNet's classes
    # patched where the layer needs it (each patch does nothing until a layer
    # has synchronized; see hooks).
    _requested_backend()
    _configure_from_environment()
    _hooks.install()
