"""The exceptions gluon_syncbn raises, and how warnings reach the user's code.

The native operators fail an operation with a text that starts with the
exception's name (``native/failures.h``, ``failure_text``); both classes are
registered under their names in MXNet's registry of error types
(``mxnet.error.register``), so wherever MXNet raises such a failure (a read
of an output, ``wait_to_read``, ``waitall``, a later operation; imperative,
hybridized or static), it raises ours.
"""
import os
import re
import sys
import warnings

from mxnet.base import MXNetError
from mxnet.error import register

__all__ = ['SyncBatchNormError', 'SyncBatchNormTimeout']

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@register
class SyncBatchNormError(MXNetError):
    """A SyncBatchNorm layer could not synchronize or got bad input (an
    ``MXNetError``, as MXNet's own failures of a call are)."""

    def __init__(self, message=''):
        # MXNet hands the text of a failure over with the class's name first,
        # which the exception's type already says, and, where our code
        # refused while MXNet issued a call, after the C++ stack of that
        # refusal (the line naming the layer says it all).
        found = re.search(r'(?:^|\n)%s: ' % type(self).__name__, message) \
            if isinstance(message, str) else None
        if found:
            message = message[found.end():]
        super(SyncBatchNormError, self).__init__(message)


@register
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
