"""How the devices' summed statistics cross process boundaries.

Within one process the barrier already holds every device's contribution and
sums them in float64; :class:`LocalTransport` adds nothing. Across processes
the barrier's last arrival all-reduces that per-process sum through an
existing engine: MXNet's distributed kvstore (:class:`KVStoreTransport`) or
Horovod (:class:`HorovodTransport`). Either way, one reduction per layer call
in forward and one in backward.

Each cross-process transport has a *native twin* (``native/transport.h``)
where the native operators run: the same reductions issued as engine
operations by the native session, no Python per call. The classes here then
only set it up (:meth:`~_CrossProcessTransport.make_native`), share the
store's lock with it and end the process after its fatal failures; their own
``allreduce`` serves the Python operator, the fallback.

Rules every cross-process transport follows:

* Each layer gets a *slot* when its first call is issued. That happens on the
  main thread, in the network's order, identically on every worker, so the
  kvstore keys (which need a collective ``init``) line up.
* Every reduction carries two check numbers, the channel count and the
  layer's call number (``wire.CHECKED``). Their sums must be ``workers x`` this worker's: if not,
  the workers are out of step, or a kvstore applies an optimizer to our keys
  (a Trainer with ``update_on_kvstore=True``). Either is an error, never a
  silently wrong mean.
* Every wait is bounded by the layer's timeout. A lost worker makes ps-lite
  peers wait forever, and MXNet cannot cancel a pending operation, so a failed
  cross-process reduction is fatal: the call raises, and a process that has
  not ended ``exit_grace`` seconds later (or reaches interpreter exit) is
  ended with ``os._exit(1)`` after printing the cause. A launcher then stops
  the other workers.
"""
import atexit
import ctypes
import os
import sys
import threading
import time
import weakref

import numpy as np

from . import messages, wire
from .errors import SyncBatchNormError, SyncBatchNormTimeout, record_failure, warn_user

__all__ = ['LocalTransport', 'KVStoreTransport', 'HorovodTransport', 'make_transport']

# Trainer uses int keys 0..P-1 and one store cannot mix int and str keys, so
# ours are ints far above any parameter count: slot s uses KEY_BASE + 2s (+1).
KEY_BASE = 1 << 30  # native/transport.h's kKeyBase
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

    def attach(self, group_id, layer_name, forward_len, backward_len):
        """Nothing to set up in one process."""

    def allreduce(self, group_id, key, vector, channels, timeout):
        """Return the sum of ``vector`` over all processes (here: ``vector``)."""
        return np.asarray(vector, dtype=np.float64)


class _CrossProcessTransport(object):
    """Slots, check numbers, bounded waits and fatal failures; engines subclass it.

    Subclasses set ``name``, ``rank`` and ``num_workers`` and implement
    ``_init_slot(slot, forward_size, backward_size)`` (main thread, collective)
    and ``_start(slot, direction, vector) -> wait`` where ``wait()`` blocks
    until the sum is there and returns it as a NumPy array.
    """

    cross_process = True

    def __init__(self):
        self._lock = threading.RLock()
        self._slots = {}
        self._layers = {}  # slot -> layer name, for messages
        self._broken = None
        self.exit_grace = float(os.environ.get('GLUON_SYNCBN_EXIT_GRACE', DEFAULT_EXIT_GRACE))
        self.native = None  # the native twin's id, once made
        self.why_python = ''  # why there is none

    def make_native(self, lib):
        """The id of this transport's native twin in ``lib``, made at the
        first call; None (with the reason in ``why_python``) if there cannot
        be one. Once a twin exists, the process ends at interpreter exit if
        its synchronization broke (the native session's fatal failures)."""
        if self.native is None and not self.why_python:
            twin = self._make_native(lib)
            if twin is not None:
                atexit.register(_exit_if_broken, lib, self.rank)
                self.native = twin
        return self.native

    def _make_native(self, lib):
        self.why_python = 'this transport has no native twin'
        return None

    def attach(self, group_id, layer_name, forward_len, backward_len):
        """Give the layer a slot for vectors of these lengths, once, in
        network order (every thread calls the layers in that order)."""
        if group_id in self._slots:
            return
        with self._lock:
            if group_id in self._slots:
                return
            slot = len(self._slots)
            self._layers[slot] = layer_name
            self._init_slot(slot, wire.CHECKS + forward_len, wire.CHECKS + backward_len)
            self._slots[group_id] = slot

    def allreduce(self, group_id, key, vector, channels, timeout):
        """Sum ``vector`` over every worker; raise (fatally) if that fails.
        ``channels`` is a check number: the workers must agree on it."""
        if self._broken is not None:
            raise self._broken
        direction, call = key[0], key[-1]
        slot = self._slots.get(group_id)
        if slot is None:
            raise SyncBatchNormError(messages.text('no_slot', layer=group_id,
                                                   transport=self.name))
        payload = wire.pack_checked(channels, call, vector)
        checks = payload[:wire.CHECKS]
        try:
            with self._lock:
                wait = self._start(slot, direction, payload)
            total = self._bounded(wait, timeout, direction, call, slot)
        except SyncBatchNormError as exc:
            raise self._fatal(exc)
        except Exception as exc:  # pylint: disable=broad-except
            raise self._fatal(SyncBatchNormError(messages.text(
                'reduction_failed', direction=direction, layer=self._layers[slot], slot=slot,
                transport=self.name, why='%s: %s' % (type(exc).__name__, exc))))
        got, total = wire.unpack_checked(total)
        expected = checks * self.num_workers
        if not np.array_equal(got, expected):
            raise self._fatal(SyncBatchNormError(self._mismatch_message(
                direction, slot, checks, got, expected)))
        return total

    def _mismatch_message(self, direction, slot, checks, got, expected):
        advice = (messages.text('kvstore_optimizer') if not np.array_equal(got, np.round(got))
                  else messages.text('out_of_step', channels=int(checks[0]),
                                     call=int(checks[1])))
        return messages.text('checks_mismatch', direction=direction, layer=self._layers[slot],
                             slot=slot, workers=self.num_workers, got=messages.numbers(got),
                             expected=messages.numbers(expected), advice=advice)

    def _bounded(self, wait, timeout, direction, call, slot):
        """Run ``wait()`` on a helper thread; give up after ``timeout`` seconds."""
        box = {}
        done = threading.Event()

        def run():
            try:
                box['value'] = wait()
            except Exception as exc:  # pylint: disable=broad-except
                box['error'] = exc
            done.set()

        # A daemon thread: if the engine never completes, it must not keep the
        # process alive. It costs ~0.1 ms next to a ~1 ms reduction.
        threading.Thread(target=run, name='gluon_syncbn-wait', daemon=True).start()
        if not done.wait(timeout):
            raise SyncBatchNormTimeout(messages.text(
                'remote_timeout', rank=self.rank, workers=self.num_workers,
                timeout=messages.number(timeout), direction=direction, call=call,
                layer=self._layers[slot], slot=slot, transport=self.name))
        if 'error' in box:
            raise box['error']
        return np.asarray(box['value'], dtype=np.float64).ravel()

    def _fatal(self, exc):
        """Mark the transport broken and make sure the process ends."""
        with self._lock:
            if self._broken is None:
                self._broken = SyncBatchNormError(messages.text('broken', transport=self.name,
                                                                cause=exc))
                self._on_fatal(exc)
        record_failure(exc)
        return exc

    def _on_fatal(self, exc):
        """Make sure the process ends: at interpreter exit, or ``exit_grace`` s from now.

        Otherwise MXNet's own waits (a Trainer's pushpull, the engine drain and
        ps-lite's finalize barrier at exit) would wait forever for operations and
        workers that are gone.
        """
        atexit.register(_end_process, messages.text('exit_after', rank=self.rank, cause=exc))

        def end_later():
            time.sleep(self.exit_grace)
            _end_process(messages.text('exit_late', rank=self.rank,
                                       grace=messages.number(self.exit_grace), cause=exc))
        threading.Thread(target=end_later, name='gluon_syncbn-exit', daemon=True).start()

    def fail_on_abort(self, cause):
        """A step aborted in this process: the other workers now wait for sums we
        will not send, and the call numbering no longer lines up. Fatal."""
        if self._slots and self._broken is None:
            self._fatal(SyncBatchNormError(messages.text('worker_step_failed', rank=self.rank,
                                                         cause=cause)))


def _exit_if_broken(lib, rank):
    buf = ctypes.create_string_buffer(1 << 14)
    if lib.gsbn_broken(buf, len(buf)):
        _end_process(messages.text('exit_after', rank=rank,
                                   cause=buf.value.decode('utf-8', 'replace')))


def _end_process(message):
    sys.stdout.flush()
    sys.stderr.write(message + '\n')
    sys.stderr.flush()
    os._exit(1)


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
        self._keys = {}
        super(KVStoreTransport, self).__init__()
        self._store_lock = _StoreLock(self)
        _serialize_calls(kvstore, self._store_lock)

    def _make_native(self, lib):
        kvstore = self.kvstore
        with self._store_lock:  # the wrappers take the twin's lock from now on
            twin = lib.gsbn_transport_kvstore(kvstore.handle, self.rank, self.num_workers,
                                              self.name.encode(), self.exit_grace)
            self._native_lib = lib
        # A store the user drops while layers still use it: their reductions
        # fail with this instead of touching freed memory.
        weakref.finalize(kvstore, lib.gsbn_transport_close, twin, (
            'the kvstore given as kvstore= was deleted; keep it alive while the network '
            'trains (the Trainer normally holds it)').encode())
        return twin

    @property
    def kvstore(self):
        kvstore = self._kvstore()
        if kvstore is None:
            raise SyncBatchNormError(
                'SyncBatchNorm: the kvstore given as kvstore= was deleted; keep it alive '
                'while the network trains (the Trainer normally holds it).')
        return kvstore

    def _init_slot(self, slot, forward_size, backward_size):
        import mxnet as mx
        for offset, (direction, size) in enumerate((('fwd', forward_size),
                                                    ('bwd', backward_size))):
            key = KEY_BASE + 2 * slot + offset
            # A collective: rank 0 pushes the zeros, then every worker waits at
            # ps-lite's barrier. Hence main thread and fixed order only. Not the
            # wrapped init: its drain would wait for this very forward pass. And
            # no mx.nd.zeros: inside a hybridized forward MXNet bulks the
            # operators this thread issues, and init would wait for a zero-fill
            # held back in the bulk (a deadlock we hit).
            kvstore = self.kvstore
            type(kvstore).init(kvstore, key,
                               mx.nd.array(np.zeros(size), ctx=mx.cpu(), dtype='float64'))
            self._keys[slot, direction] = key

    def _start(self, slot, direction, vector):
        import mxnet as mx
        key = self._keys[slot, direction]
        send = mx.nd.array(vector, ctx=mx.cpu(), dtype='float64')
        # Separate output: a push copies, so pushing and pulling into one array
        # would overwrite our contribution with the sum before it is sent.
        out = mx.nd.empty(vector.shape, ctx=mx.cpu(), dtype='float64')
        self.kvstore.pushpull(key, send, out=out)
        return out.asnumpy


class _StoreLock(object):
    """The lock every call on a kvstore holds: the transport's own, and,
    once the native twin exists, the twin's store lock too, behind which
    engine threads queue their reductions instead of waiting
    (``native/transport.h``, ``StoreLock``). Re-entrant: the Python operator's
    ``allreduce`` holds the transport's lock around the wrapped ``pushpull``."""

    def __init__(self, transport):
        self._transport = transport
        self._native = []  # per nesting level: whether it took the twin's lock

    def __enter__(self):
        transport = self._transport
        transport._lock.acquire()
        twin = transport.native if len(self._native) == 0 else None
        if twin is not None:
            transport._native_lib.gsbn_store_acquire(twin)
        self._native.append(twin)
        return self

    def __exit__(self, *exc):
        twin = self._native.pop()
        if twin is not None:
            self._transport._native_lib.gsbn_store_release(twin)
        self._transport._lock.release()


def _serialize_calls(kvstore, lock):
    """Make every call on ``kvstore`` take ``lock``, ours and the Trainer's alike.

    MXNet's dist kvstore front end keeps per-key buffers in unguarded C++ maps.
    Our reductions are issued from custom-op threads while the main thread
    issues the Trainer's, and the Trainer's first calls insert into those maps.

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
    import mxnet as mx
    ref = weakref.ref(kvstore)
    for name in ('init', 'broadcast', 'push', 'pull', 'pushpull', 'row_sparse_pull'):
        method = getattr(type(kvstore), name, None)
        if method is not None:
            drain = mx.nd.waitall if name in ('init', 'broadcast') else None
            setattr(kvstore, name, _locked(method, ref, lock, drain))


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
                "here (%s). Install Horovod with MXNet support: HOROVOD_WITH_MXNET=1 "
                "HOROVOD_WITH_GLOO=1 pip install --no-build-isolation horovod (see README)."
                % exc)
        hvd.init()
        self._hvd = hvd
        self.name = 'horovod'
        self.rank = hvd.rank()
        self.num_workers = hvd.size()
        super(HorovodTransport, self).__init__()

    def _make_native(self, lib):
        import horovod  # pylint: disable=import-outside-toplevel
        if not horovod.__version__.startswith(_HOROVOD_NATIVE + '.'):
            self.why_python = (
                'Horovod %s: the native transport calls horovod_mxnet_allreduce_async, whose C '
                'signature it knows for Horovod %s.x only' % (horovod.__version__,
                                                             _HOROVOD_NATIVE))
            warn_user('gluon_syncbn: %s; using the Python operator across processes (the '
                      'same results, about 10x the host cost per call).' % self.why_python)
            return None
        from horovod.mxnet import mpi_ops  # pylint: disable=import-outside-toplevel
        allreduce = ctypes.cast(mpi_ops.MPI_MXNET_LIB_CTYPES.horovod_mxnet_allreduce_async,
                                ctypes.c_void_p).value
        return lib.gsbn_transport_horovod(allreduce, int(self._hvd.Sum), self.rank,
                                          self.num_workers, self.exit_grace)

    def _init_slot(self, slot, forward_size, backward_size):
        pass  # Horovod matches reductions by name; nothing to create.

    def _start(self, slot, direction, vector):
        import mxnet as mx
        send = mx.nd.array(vector, ctx=mx.cpu(), dtype='float64')
        out = self._hvd.allreduce(send, op=self._hvd.Sum,
                                  name='gluon_syncbn.%d.%s' % (slot, direction))
        return out.asnumpy


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
        return _LOCAL  # one process: the devices already meet at the barrier
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
