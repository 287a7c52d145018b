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
from ..transport import LocalTransport
from .native_backends import AsyncBackend, ExchangeBackend

__all__ = ['make_backend', 'requested_backend', 'explain', 'Choice']

BACKEND_VARIABLE = 'GLUON_SYNCBN_BACKEND'
BACKENDS = ('auto', 'async', 'exchange')
RENAMED_VARIABLE = 'GLUON_SYNCBN_OPERATOR'  # its values were auto, native and python
INSTEAD = 'auto (or unset it), async (CPU contexts) or exchange (GPUs)'

# A backend and why it was chosen (or, with backend None, why none can run).
Choice = collections.namedtuple('Choice', 'backend reason')


def requested_backend():
    """``'auto'``, ``'async'`` or ``'exchange'``, from ``GLUON_SYNCBN_BACKEND``;
    raises on any other value."""
    if os.environ.get(RENAMED_VARIABLE) is not None:
        raise SyncBatchNormError(
            '%s is no longer read: set %s=auto, async (CPU contexts) or exchange (GPUs) '
            'instead, and unset %s.' % (RENAMED_VARIABLE, BACKEND_VARIABLE, RENAMED_VARIABLE))
    value = os.environ.get(BACKEND_VARIABLE, 'auto').strip().lower() or 'auto'
    if value == 'python':
        raise SyncBatchNormError(
            '%s=python: there is no Python operator; a layer that synchronizes runs a native '
            'operator, built with a C++ compiler at its first call (`python -m gluon_syncbn` '
            'says whether it can be here, and why). Set %s=%s.'
            % (BACKEND_VARIABLE, BACKEND_VARIABLE, INSTEAD))
    if value not in BACKENDS:
        raise SyncBatchNormError('%s=%r: use %s.' % (BACKEND_VARIABLE, value,
                                                      ', '.join(BACKENDS)))
    return value


def _why_not(name, devices, on_cpu, transport):
    """'' if operator ``name`` (``'async'`` or ``'exchange'``) can run a
    layer on ``devices`` over ``transport`` here, else why not."""
    if name == 'async' and not on_cpu:
        return ('the asynchronous operator runs on CPU contexts only, and this layer runs on '
                '%s' % ', '.join(devices))
    if native.load() is None:
        return 'the native library is not available: %s' % native.status()['why_not']
    functions = native.async_operator() if name == 'async' else native.exchange_operator()
    if functions is None:
        # The exchange operator is registered only beside the asynchronous one.
        verdicts = native.status()['verdicts']
        failed = 'async' if verdicts.get('async') != 'ok' else name
        verdict = verdicts.get(failed)
        if verdict == 'ok':
            return "MXNet's registry refused the %s operator" % failed
        return 'the %s operator failed its self-test: %s' % (failed, verdict)
    if transport.cross_process:
        return transport.why_not_native()
    return ''


def _fix():
    """' <what to do>.' where the library did not build for a reason that has
    a fix (a missing compiler, a cache directory that cannot be written),
    else ''."""
    fix = native.status()['fix']
    return ' %s.' % fix if fix else ''


def choose(devices, transport, requested=None):
    """The :class:`Choice` for a layer on ``devices`` (context strings) over
    ``transport``; ``backend`` is ``'async'``, ``'exchange'`` or None
    (nothing can run it: ``reason`` says why and how to fix it). May build
    and load the native library and run a self-test."""
    requested = requested or requested_backend()
    on_cpu = on_cpu_path(devices)
    where = 'across processes' if transport.cross_process else 'in one process'
    natural = 'async' if on_cpu else 'exchange'
    name = natural if requested == 'auto' else requested
    why = _why_not(name, devices, on_cpu, transport)
    if not why:
        return Choice(name, 'the %s operator, native and self-tested, %s' % (
            'asynchronous' if name == 'async' else 'exchange',
            'for %s %s' % ('CPU contexts' if on_cpu else 'GPUs', where)
            if requested == 'auto' else 'as %s=%s asks' % (BACKEND_VARIABLE, requested)))
    if requested == 'auto' or transport.cross_process:
        head = '%sthe native operators are required' % (
            'across processes ' if transport.cross_process else '')
    else:
        head = '%s=%s' % (BACKEND_VARIABLE, requested)
    # Without the library, its fix; with it, a setting that asks for another
    # operator than the devices' own is what to undo.
    advice = _fix() or (' Unset %s to let the library choose.' % BACKEND_VARIABLE
                        if requested not in ('auto', natural) else '')
    return Choice(None, '%s, but %s.%s' % (head, why, advice))


def make_backend(layer, devices, transport):
    """The backend that runs ``layer``'s training calls on ``devices``;
    raises, naming the reason and the fix, where none can."""
    SESSION.load_native()
    choice = choose(devices, transport)
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


class _AnyRemote(object):
    """A cross-process transport with a native twin (the report says which
    engines have one)."""
    cross_process = True

    @staticmethod
    def why_not_native():
        return ''


def explain():
    """``{question: Choice}`` for a layer on CPU contexts, on GPUs and across
    processes here (``python -m gluon_syncbn``)."""
    requested, local, remote = requested_backend(), LocalTransport(), _AnyRemote()
    return collections.OrderedDict([
        ('CPU contexts', choose(['cpu(0)', 'cpu(1)'], local, requested)),
        ('GPUs', choose(['gpu(0)', 'gpu(1)'], local, requested)),
        ('across processes (CPU contexts)', choose(['cpu(0)'], remote, requested)),
        ('across processes (GPUs)', choose(['gpu(0)'], remote, requested))])
