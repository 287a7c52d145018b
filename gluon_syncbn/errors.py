"""Exceptions raised by gluon_syncbn, and the record of recent failures.

MXNet runs operators on its own threads, and the error a failed call raises
at the next synchronization point is MXNet's own text, not ours (see
``mxnet_private``, "Failures"). Every failure is therefore recorded here;
:mod:`gluon_syncbn.hooks` adds it to the text of that ``MXNetError``.
"""
import collections
import os
import sys
import threading
import warnings

from mxnet.base import MXNetError

__all__ = ['SyncBatchNormError', 'SyncBatchNormTimeout']

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class SyncBatchNormError(MXNetError):
    """A SyncBatchNorm layer could not synchronize or got bad input (an
    ``MXNetError``, as MXNet's own failures of a call are)."""


class SyncBatchNormTimeout(SyncBatchNormError):
    """Not every device reached the same SyncBatchNorm call within the timeout."""


def in_layer(layer, exc):
    """``exc`` as an error of the layer named ``layer``: every failure a call
    raises names the layer it surfaced in, also when another layer or user
    code caused it. ``exc`` itself if its message names the layer already."""
    head = "SyncBatchNorm '%s'" % layer
    if str(exc).startswith(head):
        return exc
    kind = SyncBatchNormTimeout if isinstance(exc, SyncBatchNormTimeout) else SyncBatchNormError
    named = kind('%s: %s' % (head, exc))
    named.__cause__ = exc
    return named


def ours_behind(exc):
    """The SyncBatchNorm failure behind ``exc`` as our own exception, or None
    (none, or ``exc`` is ours already): the ``SyncBatchNormError`` Gluon
    wrapped in a ValueError about shapes (a deferred initialization), or the
    text of one in MXNet's error (a graph's shape inference, an operator
    MXNet refused, a custom operator's failure)."""
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


_recent = collections.deque(maxlen=8)
_recent_lock = threading.Lock()
_sources = []  # other recorders (the native operator's): () -> [exception]


def add_failure_source(source):
    """Also report what ``source()`` returns: failures recorded outside Python."""
    _sources.append(source)


def record_failure(exc):
    """Remember ``exc`` so the next custom-op ``MXNetError`` can carry its text."""
    with _recent_lock:
        for earlier in [e for e in _recent if str(e) == str(exc)]:
            _recent.remove(earlier)
        _recent.append(exc)


def last_failure():
    """The failure recorded last (kept), or None."""
    with _recent_lock:
        return _recent[-1] if _recent else None


def take_failures():
    """The failures recorded since the last call, oldest first."""
    with _recent_lock:
        failures = list(_recent)
        _recent.clear()
    for source in _sources:
        failures += [e for e in source() if all(str(e) != str(f) for f in failures)]
    return failures


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
