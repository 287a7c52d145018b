"""Synchronized batch normalization for MXNet Gluon.

``SyncBatchNorm`` is a drop-in replacement for ``mxnet.gluon.nn.BatchNorm``
that normalizes with the statistics of the whole mini-batch across all
devices, exactly as one BatchNorm on the concatenated batch would.
"""
from .cuda_libs import preload as _preload_cuda_libraries

# Before anything imports mxnet: its GPU build then finds the CUDA runtime
# wheels' libraries (nothing happens with the CPU build).
_preload_cuda_libraries()

from .engine import configure_cpu_contexts, configure_from_environment  # noqa: E402

# Only if GLUON_SYNCBN_CPU_CONTEXTS asks for it: importing changes nothing else.
configure_from_environment()

from .native import requested_backend as _requested_backend  # noqa: E402

# A bad GLUON_SYNCBN_BACKEND is an error now, not at the first call. The
# native library itself is built and loaded at the first layer's first call
# (registry.Session.load_native).
_requested_backend()

import mxnet as _mx  # noqa: E402

from .errors import SyncBatchNormError, SyncBatchNormTimeout  # noqa: E402
from .hooks import (install_error_text_hook, install_exit_abort_hook,  # noqa: E402
                    install_record_abort_hook, install_cached_op_hook,
                    install_trainer_hook)
from .block import SyncBatchNorm  # noqa: E402
from .convert import convert_model, revert_model  # noqa: E402
from .registry import SESSION as _SESSION  # noqa: E402

install_error_text_hook(_mx.base.MXNetError)
install_record_abort_hook(_mx.autograd._RecordingStateScope, _SESSION,
                          _mx.autograd.is_recording, _mx.autograd.is_training)
install_exit_abort_hook(_SESSION, _mx.nd.waitall)
install_cached_op_hook(_mx.gluon.HybridBlock, _SESSION, _mx.autograd.is_training)
install_trainer_hook(_mx.gluon.Trainer, _SESSION, _mx.nd.waitall)


def reset():
    """Fail every waiting SyncBatchNorm call now and restart the call numbering.

    Not needed after the errors this library raises (it recovers by itself);
    for code that abandons a step half-way for its own reasons.
    """
    _SESSION.fail_step()
    _SESSION.begin_step()


__version__ = '0.1.0'
__all__ = ['SyncBatchNorm', 'SyncBatchNormError', 'SyncBatchNormTimeout',
           'configure_cpu_contexts', 'convert_model', 'revert_model', 'reset']
