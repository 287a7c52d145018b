"""Synchronized batch normalization for MXNet Gluon.

``SyncBatchNorm`` is a drop-in replacement for ``mxnet.gluon.nn.BatchNorm``
that normalizes with the statistics of the whole mini-batch across all
devices, exactly as one BatchNorm on the concatenated batch would.

Importing it changes nothing for code that does not synchronize: the
modules' import-time work is only what they need before MXNet runs (see
``cuda_libs``, ``cpu_contexts``, ``hooks``).
"""
from . import cuda_libs as _cuda_libs  # first: it must run before mxnet is imported
from .cpu_contexts import configure_cpu_contexts
from .errors import SyncBatchNormError, SyncBatchNormTimeout
from .block import SyncBatchNorm
from .convert import convert_model, revert_model
from .session import reset

__version__ = '0.1.0'
__all__ = ['SyncBatchNorm', 'SyncBatchNormError', 'SyncBatchNormTimeout',
           'configure_cpu_contexts', 'convert_model', 'revert_model', 'reset']
