"""Which backend runs a layer's training calls: chosen here, once per layer
and set of devices, with its reason.

``GLUON_SYNCBN_BACKEND`` selects the backend of every layer in one process:

``auto`` (default)
    the asynchronous operator on CPU contexts, the exchange operator on GPUs;
``async``
    the asynchronous operator, or an error saying why it cannot be had (and
    for layers on GPUs, which it cannot run);
``exchange``
    the exchange operator, on CPU contexts too (they then take the GPUs' path:
    MXNet's operators compute the moments), or an error saying why not.

The native operators are required wherever a layer synchronizes, in one
process as across processes (kvstore, Horovod): a layer that cannot have the
one it needs (no C++ compiler, no MXNet headers, a cache that cannot be
written, a failed self-test) raises at its first synchronized call with the
reason and the fix. A layer on one device in one process needs none: it is
``nn.BatchNorm`` there.
"""
import collections
import os

from .. import native
from ..cpu_contexts import on_cpu_path
from ..errors import SyncBatchNormError
from ..session import SESSION
from .base import AsyncBackend
from .vector_graph import ExchangeBackend

__all__ = ['make_backend', 'requested_backend', 'choose', 'explain', 'Choice']

BACKEND_VARIABLE = 'GLUON_SYNCBN_BACKEND'
BACKENDS = ('auto', 'async', 'exchange')

# A backend and why it was chosen (or, with backend None, why none can run).
Choice = collections.namedtuple('Choice', 'backend reason')


def requested_backend():
    """``'auto'``, ``'async'`` or ``'exchange'``, from ``GLUON_SYNCBN_BACKEND``;
    raises on any other value."""
    value = os.environ.get(BACKEND_VARIABLE, 'auto').strip().lower() or 'auto'
    if value not in BACKENDS:
        raise SyncBatchNormError('%s=%r: use %s.' % (BACKEND_VARIABLE, value,
                                                      ', '.join(BACKENDS)))
    return value


def choose(devices, cross_process=False, why_not_native='', requested=None):
    """The :class:`Choice` for a layer on ``devices`` (context strings), in
    one process or across processes (whose transport cannot have a native
    twin where ``why_not_native`` says why): ``backend`` is ``'async'``,
    ``'exchange'`` or None (nothing can run it: ``reason`` says why and how
    to fix it). May build and load the native library and run a self-test."""
    requested = requested or requested_backend()
    on_cpu = on_cpu_path(devices)
    natural = 'async' if on_cpu else 'exchange'
    name = natural if requested == 'auto' else requested
    if name == 'async' and not on_cpu:
        why = ('the asynchronous operator runs on CPU contexts only, and this layer runs on '
               '%s' % ', '.join(devices))
    elif native.load() is None:
        why = 'the native library is not available: %s' % native.status()['why_not']
    elif (native.async_operator() if name == 'async' else native.exchange_operator()) is None:
        # (Registered, and so self-tested, only beside the asynchronous one.)
        verdicts = native.status()['verdicts']
        failed = 'async' if verdicts.get('async') != 'ok' else name
        why = ("MXNet's registry refused the %s operator" % failed
               if verdicts.get(failed) == 'ok' else
               'the %s operator failed its self-test: %s' % (failed, verdicts.get(failed)))
    else:
        why = why_not_native if cross_process else ''
    if not why:
        return Choice(name, 'the %s operator, native and self-tested, %s' % (
            'asynchronous' if name == 'async' else 'exchange',
            'for %s %s' % ('CPU contexts' if on_cpu else 'GPUs',
                           'across processes' if cross_process else 'in one process')
            if requested == 'auto' else 'as %s=%s asks' % (BACKEND_VARIABLE, requested)))
    if requested == 'auto' or cross_process:
        head = '%sthe native operators are required' % (
            'across processes ' if cross_process else '')
    else:
        head = '%s=%s' % (BACKEND_VARIABLE, requested)
    # Without the library, its fix (a missing compiler, a cache directory
    # that cannot be written); with it, a setting that asks for another
    # operator than the devices' own is what to undo.
    fix = native.status()['fix']
    advice = ' %s.' % fix if fix else (' Unset %s to let the library choose.' % BACKEND_VARIABLE
                                       if requested not in ('auto', natural) else '')
    return Choice(None, '%s, but %s.%s' % (head, why, advice))


def make_backend(layer, devices, transport):
    """The backend that runs the training calls of ``layer`` (a
    :class:`~.base.Layer`) on ``devices``; raises, naming the reason and the
    fix, where none can."""
    SESSION.load_native()
    choice = choose(devices, transport.cross_process,
                    transport.why_not_native() if transport.cross_process else '')
    if choice.backend is None:
        raise SyncBatchNormError("SyncBatchNorm '%s': %s" % (layer.name, choice.reason))
    if transport.cross_process:
        transport.agree_on_layer(native.load(), layer, devices)
    cls, functions = ((AsyncBackend, native.async_operator()) if choice.backend == 'async'
                      else (ExchangeBackend, native.exchange_operator()))
    backend = cls(layer, devices, transport, native.load(), functions)
    backend.reason = choice.reason
    SESSION.add(backend)
    return backend


def explain():
    """``{question: Choice}`` for a layer on CPU contexts, on GPUs and across
    processes here (``python -m gluon_syncbn``)."""
    requested = requested_backend()
    return collections.OrderedDict(
        (question, choose(devices, remote, '', requested)) for question, devices, remote in [
            ('CPU contexts', ['cpu(0)', 'cpu(1)'], False), ('GPUs', ['gpu(0)', 'gpu(1)'], False),
            ('across processes (CPU contexts)', ['cpu(0)'], True),
            ('across processes (GPUs)', ['gpu(0)'], True)])
