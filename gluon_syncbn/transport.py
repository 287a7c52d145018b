"""How the devices' summed statistics cross process boundaries.

Within one process the devices' sums need nothing more: :class:`LocalTransport`.
Across processes each layer call's per-process sum is all-reduced through an
existing engine, MXNet's distributed kvstore (:class:`KVStoreTransport`) or
Horovod (:class:`HorovodTransport`), by the transport's *native twin*
(``native/transport.h``): the reductions are engine operations the native
session issues, with no Python per call, one per layer call in forward and
one in backward. The classes here make the twin
(:meth:`~_CrossProcessTransport.make_native`), share the store's lock with
it (every call on the user's kvstore takes it: :func:`wrap_kvstore`), and
end the process after its fatal failures. The native library is
therefore required across processes (``backends.choose``).

The rules the twin follows (``native/session.h``, the remote phase): each
layer gets a slot, in the order of the layers' first calls, identically on
every worker; every reduction carries two check numbers (``wire.CHECKED``),
whose sums must be ``workers x`` this worker's; every wait is bounded by the
layer's timeout; and a failed cross-process reduction is fatal, since
MXNet cannot cancel a pending operation: the call raises, and a process that
has not ended ``exit_grace`` seconds later (or reaches interpreter exit) is
ended with ``os._exit(1)`` after printing the cause.

A worker whose script fails ends at once too (:func:`_guard_exit`): left
to itself, its interpreter's exit would wait in ps-lite's final barrier for
the other workers, which wait for its sums until their timeout. A worker
whose script ends tells the others (:func:`_tell_the_others`): one still
training fails at its next synchronized call, naming it.
"""
import atexit
import builtins
import ctypes
import os
import re
import sys
import threading
import weakref

import mxnet as mx

from . import messages
from .errors import SyncBatchNormError
from .session import drain

__all__ = ['LocalTransport', 'KVStoreTransport', 'HorovodTransport', 'make_transport']

# The Horovod releases whose horovod_mxnet_allreduce_async the native twin calls.
_HOROVOD_NATIVE = '0.28'
DEFAULT_EXIT_GRACE = 30.0

_SUPPORTED_KVSTORES = ('dist_sync', 'dist_sync_device', 'dist_device_sync')
_LOCAL_KVSTORES = ('local', 'device', 'local_update_cpu', 'local_allreduce_cpu',
                   'local_allreduce_device', 'nccl')


class LocalTransport(object):
    """All devices live in this process: the per-process sum is the global sum."""

    name = 'local'
    cross_process = False


class _CrossProcessTransport(object):
    """What the engines share: the native twin and the process's end (see
    :func:`_guard_exit`). Subclasses set ``name``, ``rank`` and
    ``num_workers``, and implement ``_make_native(lib)``."""

    cross_process = True

    def __init__(self):
        self._lock = threading.RLock()
        self.exit_grace = float(os.environ.get('GLUON_SYNCBN_EXIT_GRACE', DEFAULT_EXIT_GRACE))
        self.twin = None  # the native twin's id, once made
        _guard_exit(self.rank)

    def why_not_native(self):
        """Why this transport can have no native twin here, or ''."""
        return ''

    def __reduce__(self):
        raise SyncBatchNormError(
            "SyncBatchNorm: a layer that synchronizes across processes cannot be pickled (its "
            "kvstore or Horovod cannot). Save its parameters (save_parameters), or pickle a "
            "network built with kvstore=None.")

    def make_native(self, lib):
        """The id of this transport's native twin in ``lib``, made at the
        first call. From then on the process ends at interpreter exit if its
        synchronization broke (the native session's fatal failures)."""
        with self._lock:
            if self.twin is None:
                self.twin = self._make_native(lib)
                _exit_state['library'] = lib
                _exit_state['twins'].append(self.twin)
        return self.twin

    def agree_on_layer(self, lib, layer, devices):
        """Before the backend of ``layer`` (a :class:`~.backends.base.Layer`)
        on ``devices`` is made: every worker's layer made in its place must
        have the same sync_groups (with, where they are explicit, as many
        devices to number) and name, Gluon's counters aside
        (:func:`matched_name`), or every worker raises the same error, before
        the sync groups are worked out. (Its channels and dtype are compared
        at its first call, before its keys are made: ``native/remote.h``,
        ``attach_remote``.)"""
        explicit = layer.sync_groups is not None
        _exit_state['timeout'] = max(_exit_state['timeout'], layer.remote_timeout)
        error = lib.compare_layer(self.make_native(lib), layer.name, matched_name(layer.name),
                                  len(devices) if explicit else 0, repr(layer.sync_groups),
                                  layer.remote_timeout)
        if error:
            raise SyncBatchNormError(error)

    def agree_on_batch(self, lib, batch, has, timeout):
        """The workers without update_bn_stats' batch ``batch`` (from 0),
        once every worker said whether it has it (``has``: this one)."""
        error, lacking = lib.agree_on_batch(self.make_native(lib), batch, has, timeout,
                                            self.num_workers)
        if error:
            raise SyncBatchNormError(error)
        return lacking


def matched_name(name):
    """``name`` as the workers compare it: without the numbers Gluon's
    automatic names count blocks with (``'hybridsequential1_batchnorm0'``
    -> ``'hybridsequential_batchnorm'``), which differ between workers
    wherever one made blocks the others did not (an EMA or evaluation copy
    on rank 0), although nothing that synchronizes differs. A number after
    a name no Block class has (``'bn1'``, from ``prefix='bn1_'``) is the
    user's, and stays."""
    aliases = _block_aliases()
    return re.sub(r'(?<![a-z0-9])([a-z][a-z0-9]*?)\d+(?=_|$)',
                  lambda m: m.group(1) if m.group(1) in aliases else m.group(0), name)


def _block_aliases():
    """The names Gluon counts automatic prefixes of: every Block class's
    own, in lower case (``Block._alias``)."""
    found, todo = set(), [mx.gluon.Block]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__.lower())
        todo.extend(cls.__subclasses__())
    return found


# ------------------------------------------------------- the process's end --
# A worker's exit must not wait for the other workers when they cannot come:
# ps-lite's final barrier (and MXNet's wait for pending operations) would
# hold a failed worker until the others' timeouts, and a healthy one whose
# synchronization broke for ever. What _at_exit needs: how the script ended
# where that was a failure ((exit code, what ended it), noted by the hooks
# _guard_exit installs), the native library once a twin exists, the twins,
# and how long a finished worker waits for the others to end (the layers'
# longest timeout for the other workers).
_exit_state = {'failure': None, 'library': None, 'twins': [], 'timeout': 0.0}
# How long a failing worker waits for its END rows to leave (none of their
# rounds completes while other workers still train).
FAILED_END_WAIT = 1.0


def across_processes():
    """Whether a layer of this process synchronizes with other workers."""
    return bool(_exit_state['twins'])


def _note_failure(code, cause):
    _exit_state['failure'] = (code, cause)


def _at_exit(rank):
    """At interpreter exit of a worker: end it at once if its
    synchronization broke (the native session's fatal failures), or, with
    its script's exit code, if the script failed (the other workers cannot
    go on without it; the job's launcher then ends them, naming this
    worker). Else let its last step finish, however long the other workers
    take (the layers' timeouts bound it), check again, and wait for the
    other workers to end too; where one failed or still trains instead,
    end at once with code 0 (its script succeeded)."""
    lib = _exit_state['library']
    _exit_if_broken(lib, rank)
    failure = _exit_state['failure']
    if failure is not None:
        code, cause = failure
        _tell_the_others(lib, failed=True)
        _exit_now(code, messages.text('exit_failed', rank=rank, code=code, cause=cause))
    if lib is not None:
        drain()  # a failed step's error: its cause is the library's, checked next
        _exit_if_broken(lib, rank)
        others = _tell_the_others(lib, failed=False)
        if others:
            _exit_now(0, messages.text('exit_others', rank=rank, why=others))


def _tell_the_others(lib, failed):
    """This worker ends (``failed``: badly): every twin sends its END rows
    (``native/remote.h``, ``end_remote``; a failing worker only where
    another ended first), so that a worker still training fails at its next
    synchronized call, naming this one, instead of at its timeout. Returns
    what the other workers did instead of ending their scripts too, or ''
    (also where they did not end within the wait: the interpreter's exit
    then waits for them, as MXNet's does)."""
    if lib is None:
        return ''
    wait = FAILED_END_WAIT if failed else _exit_state['timeout']
    for twin in _exit_state['twins']:
        others = lib.end(twin, failed, wait)
        if others:
            return others
    return ''


def _exit_if_broken(lib, rank):
    broken = lib.broken() if lib is not None else ''
    if broken:
        _tell_the_others(lib, failed=True)
        _exit_now(1, messages.text('exit_after', rank=rank, cause=broken))


def _exit_now(code, why):
    """End the process with ``code`` after printing ``why``, skipping the
    rest of the interpreter's exit."""
    sys.stdout.flush()
    sys.stderr.write(why + '\n')
    sys.stderr.flush()
    os._exit(code)


def _guard_exit(rank):
    """Once per process, at the first cross-process layer's construction:
    :func:`_at_exit` runs at interpreter exit, and :func:`_note_failure`
    learns how the script ended where that was a failure.

    Python tells nobody at exit how the script ended, so hooks note it as
    it happens: ``sys.excepthook`` (an uncaught exception), and the exit
    exception, which notes a non-zero code when it is deleted with no Python
    code left on the stack, which happens only once it has ended the script
    (one the script catches dies inside its frames). That exception is
    :class:`_ScriptExit`: ``sys.exit`` raises it, and it is the builtin
    ``SystemExit`` from now on, which ``raise SystemExit(n)`` and the
    builtin ``exit(n)`` raise (a subclass: ``except SystemExit`` catches it).

    Once :func:`_at_exit` has returned, the three are Python's again. Python
    empties ``sys`` last: our functions left there would keep our modules,
    and through them MXNet's, alive through the collection that frees the
    modules' objects at exit, and with MXNet's whatever the script hung on
    them (a registered initializer's method, a function set on a class)
    with its globals, the user's kvstore among them. The store would then
    be deleted only once MXNet's module globals are None, where
    ``KVStore.__del__`` fails unheard: ps-lite is never finalized, and the
    C++ exit destroys its threads still running, which aborts the process
    ("terminate called without an active exception").
    """
    if sys.exit is _script_exit:
        return
    previous = sys.excepthook, sys.exit, builtins.SystemExit
    previous_hook = previous[0]

    def excepthook(kind, value, trace):
        if not _in_python_code():  # the uncaught exception that ends the script
            _note_failure(130 if issubclass(kind, KeyboardInterrupt) else 1,
                         ('%s: %s' % (kind.__name__, value)) if str(value) else kind.__name__)
        previous_hook(kind, value, trace)

    def at_exit_then_remove():
        try:
            _at_exit(rank)
        finally:
            # Each only where it is still ours: a hook set later may call ours.
            for namespace, name, ours, original in zip(
                    (sys, sys, builtins), ('excepthook', 'exit', 'SystemExit'),
                    (excepthook, _script_exit, _ScriptExit), previous):
                if getattr(namespace, name) is ours:
                    setattr(namespace, name, original)
    sys.excepthook = excepthook
    sys.exit = _script_exit
    builtins.SystemExit = _ScriptExit
    atexit.register(at_exit_then_remove)


def _in_python_code():
    """Whether a Python frame is on the stack beyond the caller's own."""
    try:
        sys._getframe(2)
    except ValueError:
        return False
    return True


class _ScriptExit(SystemExit):
    """What ``sys.exit`` raises once :func:`_guard_exit` ran."""

    def __del__(self):
        code = 0 if self.code is None else self.code if isinstance(self.code, int) else 1
        if code != 0 and not _in_python_code():
            _note_failure(code, 'sys.exit(%r)' % (self.code,))


def _script_exit(status=None):
    """``sys.exit`` once :func:`_guard_exit` ran."""
    raise _ScriptExit(status)



class KVStoreTransport(_CrossProcessTransport):
    """All-reduce over the job's MXNet distributed kvstore (ps-lite).

    Parameters
    ----------
    kvstore : mxnet.kvstore.KVStore
        The job's ``mx.kv.create('dist_sync')`` (or ``'dist_sync_device'``)
        store, the same one the Trainer uses (with ``update_on_kvstore=False``).
    """

    def __init__(self, kvstore):
        # Weakly: a store that outlives the user's own reference is destroyed
        # during module teardown, after MXNet's shutdown, and ps-lite's
        # finalize then aborts the process.
        self._kvstore = weakref.ref(kvstore)
        self.name = "kvstore '%s'" % kvstore.type
        self.rank = kvstore.rank
        self.num_workers = kvstore.num_workers
        super(KVStoreTransport, self).__init__()
        # Every call on the store takes the lock the twin's reductions take:
        # MXNet's dist kvstore front end keeps per-key buffers in unguarded
        # maps (wrap_kvstore says more).
        self._store_lock = _StoreLock(self)
        wrap_kvstore(kvstore, self._store_lock, SyncBatchNormError(
            messages.text('compression', transport=self.name) + '.'))

    def _make_native(self, lib):
        kvstore = self.kvstore
        with self._store_lock:  # the wrappers take the twin's lock from now on
            twin = lib.create_transport('kvstore', kvstore.handle, rank=self.rank,
                                        workers=self.num_workers, name=self.name,
                                        exit_grace=self.exit_grace)
            self._native_lib = lib
        # A store the user drops while layers still use it: their reductions
        # fail with this instead of touching freed memory. Not at interpreter
        # exit, where the last step may still be reducing (_at_exit lets it).
        closer = weakref.finalize(kvstore, lib.close_transport, twin,
                                  'the kvstore given as kvstore= was deleted; keep it alive '
                                  'while the network trains (the Trainer normally holds it)')
        closer.atexit = False
        return twin

    @property
    def kvstore(self):
        kvstore = self._kvstore()
        if kvstore is None:
            raise SyncBatchNormError(
                'SyncBatchNorm: the kvstore given as kvstore= was deleted; keep it alive '
                'while the network trains (the Trainer normally holds it).')
        return kvstore


class _StoreLock(object):
    """The lock every call on a kvstore holds: the transport's own, and,
    once the native twin exists, the twin's store lock too, behind which
    engine threads queue their reductions instead of waiting
    (``native/transport.h``, ``StoreLock``). Re-entrant."""

    def __init__(self, transport):
        self._transport = transport
        self._held = []  # per nesting level: the twin whose lock it took, or None

    def __enter__(self):
        transport = self._transport
        transport._lock.acquire()
        twin = transport.twin if len(self._held) == 0 else None
        if twin is not None:
            transport._native_lib.store_lock(twin, True)
        self._held.append(twin)
        return self

    def __exit__(self, *exc):
        twin = self._held.pop()
        if twin is not None:
            self._transport._native_lib.store_lock(twin, False)
        self._transport._lock.release()


def wrap_kvstore(kvstore, lock, refusal):
    """Make every call on the user's ``kvstore`` take ``lock``, ours and the
    Trainer's alike, and its ``set_gradient_compression`` raise ``refusal``.

    MXNet's dist kvstore front end keeps per-key buffers in unguarded C++ maps.
    Our reductions are issued from engine threads while the main thread
    issues the Trainer's, and the Trainer's first calls insert into those maps.
    Compression MXNet would apply to every key of the store, ours too, and
    then refuse pushpull.

    Issuing a push or pull is asynchronous, so the lock is held briefly. ``init``
    and ``broadcast`` block until the store holds the value, which may wait for
    our operators (they write the running statistics the Trainer broadcasts)
    while those wait for the lock: so these first drain the engine, then lock.
    They also drain afterwards: a broadcast's pull still in flight when the same
    key's first pushpull is issued can land in the wrong array (MXNet 1.9.1
    reuses one per-key buffer for both). Plain Gluon with a dist_sync Trainer
    diverged across workers in 9 of 16 loaded runs that way; draining after
    the Trainer's lazy initialization, 0 of 12.
    The wrappers reach the store through a weak reference, so the store is
    still destroyed when the user drops it.
    """
    ref = weakref.ref(kvstore)
    for name in ('init', 'broadcast', 'push', 'pull', 'pushpull', 'row_sparse_pull'):
        method = getattr(type(kvstore), name, None)
        if method is not None:
            drain = mx.nd.waitall if name in ('init', 'broadcast') else None
            setattr(kvstore, name, _locked(method, ref, lock, drain))

    def set_gradient_compression(compression_params):
        raise refusal
    kvstore.set_gradient_compression = set_gradient_compression


def _locked(method, ref, lock, drain):
    def call(*args, **kwargs):
        if drain is not None:
            drain()
        with lock:
            result = method(ref(), *args, **kwargs)
        if drain is not None:
            drain()
        return result
    call.__doc__ = method.__doc__
    return call


class HorovodTransport(_CrossProcessTransport):
    """All-reduce through ``horovod.mxnet`` (initialized here if it is not yet)."""

    def __init__(self):
        try:
            import horovod.mxnet as hvd  # pylint: disable=import-outside-toplevel
        except ImportError as exc:
            raise SyncBatchNormError(
                "SyncBatchNorm(kvstore='horovod') needs horovod.mxnet, which does not import "
                "here (%s). Install Horovod 0.28.1 with MXNet support: HOROVOD_WITH_MXNET=1 "
                "HOROVOD_WITH_GLOO=1 pip install --no-build-isolation horovod==0.28.1 (the "
                "whole command and what it needs first: docs/install.md, section 'Horovod')."
                % exc)
        hvd.init()
        self._hvd = hvd
        self.name = 'horovod'
        self.rank = hvd.rank()
        self.num_workers = hvd.size()
        super(HorovodTransport, self).__init__()

    @staticmethod
    def why_not_native():
        import horovod  # pylint: disable=import-outside-toplevel
        if horovod.__version__.startswith(_HOROVOD_NATIVE + '.'):
            return ''
        return ('Horovod %s is installed: the native transport calls '
                'horovod_mxnet_allreduce_async, whose C signature it knows for Horovod %s.x '
                "only. Install Horovod 0.28.1 (docs/install.md, section 'Horovod')"
                % (horovod.__version__, _HOROVOD_NATIVE))

    def _make_native(self, lib):
        from horovod.mxnet import mpi_ops  # pylint: disable=import-outside-toplevel
        allreduce = ctypes.cast(mpi_ops.MPI_MXNET_LIB_CTYPES.horovod_mxnet_allreduce_async,
                                ctypes.c_void_p).value
        return lib.create_transport('horovod', allreduce, sum_op=int(self._hvd.Sum),
                                    rank=self.rank, workers=self.num_workers,
                                    exit_grace=self.exit_grace)


_LOCAL = LocalTransport()
_shared = {}


def make_transport(kvstore):
    """The transport for ``SyncBatchNorm(kvstore=...)``; one per store, shared by all layers.

    Raises
    ------
    SyncBatchNormError
        For kvstore types that would not synchronize across workers, or that
        MXNet 1.9.1 silently turns into a local store.
    """
    if kvstore is None:
        return _LOCAL
    if isinstance(kvstore, str):
        if kvstore.lower() == 'horovod':
            if 'horovod' not in _shared:
                _shared['horovod'] = HorovodTransport()
            return _shared['horovod']
        raise SyncBatchNormError(
            "SyncBatchNorm: kvstore=%r is not supported. Pass the job's kvstore object "
            "(kv = mx.kv.create('dist_sync'), the same one the Trainer gets), "
            "kvstore='horovod', or None for one process." % (kvstore,))
    kv_type = getattr(kvstore, 'type', None)
    if kv_type is None:
        raise SyncBatchNormError(
            'SyncBatchNorm: kvstore must be an mxnet KVStore, the string \'horovod\' or None; '
            'got %r.' % (kvstore,))
    if kv_type in ('horovod', 'byteps'):
        raise SyncBatchNormError(
            "SyncBatchNorm: mx.kv.create(%r) gives a plain local store in MXNet 1.9.1 (it "
            "would not synchronize anything across workers). For Horovod pass "
            "kvstore='horovod' to SyncBatchNorm and use hvd.DistributedTrainer; BytePS is "
            "not supported: use a 'dist_sync' kvstore or Horovod." % kv_type)
    if kv_type in _LOCAL_KVSTORES:
        return _LOCAL  # one process: the devices already meet in the session
    if kv_type not in _SUPPORTED_KVSTORES:
        raise SyncBatchNormError(
            "SyncBatchNorm: kvstore type %r is not supported: batch statistics need a "
            "synchronous all-reduce. Use 'dist_sync' or 'dist_sync_device' (or Horovod)."
            % kv_type)
    if kvstore.num_workers == 1:
        return _LOCAL
    transport = _shared.get(id(kvstore))
    if transport is None or transport._kvstore() is not kvstore:  # ids are reused
        transport = _shared[id(kvstore)] = KVStoreTransport(kvstore)
    return transport
