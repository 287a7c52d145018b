"""Which backend runs a layer's training calls: chosen here, once per layer
and set of devices, with its reason.

``GLUON_SYNCBN_BACKEND`` selects the backend of every layer in one process:

``auto`` (default)
    the asynchronous operator on CPU contexts, the exchange operator on GPUs;
    in one process, where the one a layer needs cannot be had (no C++
    compiler, no MXNet headers, a failed self-test), the Python operator,
    with one warning saying why;
``async``
    the asynchronous operator, or an error saying why it cannot be had (and
    for layers on GPUs, which it cannot run);
``exchange``
    the exchange operator, on CPU contexts too (they then take the GPUs' path:
    MXNet's operators compute the moments), or an error saying why not;
``python``
    the Python operator for every layer of one process.

Across processes (kvstore, Horovod) the native operators are required: a
cross-process layer that cannot have one raises at its first call with the
reason and the fix.
"""
import collections
import os

from .. import native
from ..cpu_contexts import on_cpu_path
from ..errors import SyncBatchNormError, warn_user
from ..session import SESSION
from ..transport import LocalTransport
from .native_backends import AsyncBackend, ExchangeBackend
from .python_backend import PythonBackend

__all__ = ['make_backend', 'requested_backend', 'explain', 'Choice']

BACKEND_VARIABLE = 'GLUON_SYNCBN_BACKEND'
BACKENDS = ('auto', 'async', 'exchange', 'python')
RENAMED_VARIABLE = 'GLUON_SYNCBN_OPERATOR'  # its values were auto, native and python
FALLBACK = ('its layers run the Python operator (the same results, about 10-40x the host '
            'cost per call)')

# A backend and why it was chosen (or, with backend None, why none can run).
Choice = collections.namedtuple('Choice', 'backend reason')
_warned = set()


def requested_backend():
    """``'auto'``, ``'async'``, ``'exchange'`` or ``'python'``, from
    ``GLUON_SYNCBN_BACKEND``; raises on any other value."""
    if os.environ.get(RENAMED_VARIABLE) is not None:
        raise SyncBatchNormError(
            '%s is no longer read: set %s=auto, async (CPU contexts), exchange (GPUs) or '
            'python instead, and unset %s.' % (RENAMED_VARIABLE, BACKEND_VARIABLE,
                                               RENAMED_VARIABLE))
    value = os.environ.get(BACKEND_VARIABLE, 'auto').strip().lower() or 'auto'
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
    ``transport``; ``backend`` is ``'async'``, ``'exchange'``, ``'python'``
    or None (nothing can run it: ``reason`` says why and how to fix it).
    May build and load the native library and run a self-test."""
    requested = requested or requested_backend()
    on_cpu = on_cpu_path(devices)
    where = 'across processes' if transport.cross_process else 'in one process'
    if requested == 'python':
        if transport.cross_process:
            return Choice(None, '%s=python, but across processes the native operators are '
                                'required. Unset %s.' % (BACKEND_VARIABLE, BACKEND_VARIABLE))
        return Choice('python', '%s=python' % BACKEND_VARIABLE)
    name = requested if requested != 'auto' else ('async' if on_cpu else 'exchange')
    why = _why_not(name, devices, on_cpu, transport)
    if not why:
        return Choice(name, 'the %s operator, native and self-tested, %s' % (
            'asynchronous' if name == 'async' else 'exchange',
            'for %s %s' % ('CPU contexts' if on_cpu else 'GPUs', where)
            if requested == 'auto' else 'as %s=%s asks' % (BACKEND_VARIABLE, requested)))
    if transport.cross_process:
        return Choice(None, 'across processes the native operators are required, but %s.%s'
                      % (why, _fix()))
    if requested != 'auto':
        fix = native.status()['fix']
        return Choice(None, '%s=%s, but %s. %s %s to let the library choose (it falls back '
                      'to the Python operator).' % (
                          BACKEND_VARIABLE, requested, why,
                          fix + ', or unset' if fix else 'Unset', BACKEND_VARIABLE))
    return Choice('python', why)


def make_backend(layer, devices, transport):
    """The backend that runs ``layer``'s training calls on ``devices``."""
    SESSION.load_native()
    choice = choose(devices, transport)
    if choice.backend is None:
        raise SyncBatchNormError("SyncBatchNorm '%s': %s" % (layer.name, choice.reason))
    if choice.backend == 'python':
        if requested_backend() == 'auto' and choice.reason not in _warned:
            _warned.add(choice.reason)
            warn_user('gluon_syncbn: %s; %s.%s Set %s=python to silence this.' % (
                choice.reason, FALLBACK, _fix(), BACKEND_VARIABLE))
        backend = PythonBackend(layer, devices, transport)
    else:
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


# A bad GLUON_SYNCBN_BACKEND is an error at import, not at the first call.
requested_backend()
