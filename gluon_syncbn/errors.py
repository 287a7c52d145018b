"""The exceptions gluon_syncbn raises, and how warnings reach the user's code."""
import os
import sys
import warnings

from mxnet.base import MXNetError

__all__ = ['SyncBatchNormError', 'SyncBatchNormTimeout']

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class SyncBatchNormError(MXNetError):
    """A SyncBatchNorm layer could not synchronize or got bad input (an
    ``MXNetError``, as MXNet's own failures of a call are)."""


class SyncBatchNormTimeout(SyncBatchNormError):
    """Not every device reached the same SyncBatchNorm call within the timeout."""


def ours_behind(exc):
    """The SyncBatchNorm failure behind ``exc`` as our own exception, or None
    (none, or ``exc`` is ours already): the ``SyncBatchNormError`` Gluon
    wrapped in a ValueError about shapes (a deferred initialization), or the
    text of one in MXNet's error (a graph's shape inference, an operator
    MXNet refused)."""
    if isinstance(exc, SyncBatchNormError) or not isinstance(exc, (MXNetError, ValueError)):
        return None
    if isinstance(exc.__context__, SyncBatchNormError):
        return exc.__context__
    text = str(exc)
    start = text.find("SyncBatchNorm '")
    if start < 0:
        return None
    ours = SyncBatchNormError(text[start:].split('\n', 1)[0])
    ours.__cause__ = exc
    return ours


def warn_user(message):
    """A ``RuntimeWarning`` located at the user's code: the first frame
    outside gluon_syncbn and mxnet, however deep the library calls from."""
    import mxnet  # pylint: disable=import-outside-toplevel
    # A layer's first call arrives through Gluon's Block.__call__.
    internal = (_PACKAGE_DIR, os.path.dirname(os.path.abspath(mxnet.__file__)) + os.sep)
    frame, level = sys._getframe(1), 2  # pylint: disable=protected-access
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)
