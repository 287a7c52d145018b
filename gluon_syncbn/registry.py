"""Process-wide table of synchronization groups, one per SyncBatchNorm layer,
and the session: which training step calls belong to, and how a step fails.

MXNet creates operators from string arguments only, so every operator finds
its layer's group here by the group id the block baked into the graph. Ids
are unique per layer object (not per prefix), so two networks with equal
prefixes never share a barrier. A group whose calls run in a native operator
(asynchronous or exchange) is registered in the native session too (same
id), and its barrier lives there; the Python operator's lives here.
"""
import collections
import ctypes
import itertools
import os
import threading

import numpy as np

from . import messages
from . import native
from . import wire
from .barrier import CallOrderBarrier
from .engine import in_host_memory
from .groups import partition
from .errors import (SyncBatchNormError, SyncBatchNormTimeout, add_failure_source,
                     record_failure)
from .transport import LocalTransport

__all__ = ['SyncGroup', 'get_group', 'new_group_id', 'register', 'unregister', 'SESSION',
           'SETUP_LOCK']

_groups = {}
_lock = threading.Lock()
# One-time work of a layer's first calls, which may come from one Python
# thread per device at once (GluonCV's parallel_apply): loading the native
# library, creating and registering a layer's group, tracing a group's
# imperative graphs. Whoever comes first does it; the others wait, then find
# it done. Reentrant: creating a group loads the library.
SETUP_LOCK = threading.RLock()
# Ids of groups whose layer was garbage-collected. A layer's finalizer runs at
# whatever allocation triggers the collection, also on a thread inside a
# `with _lock:` block, so it only queues the id (waiting for the lock there
# would wait forever); the queue is emptied under the lock.
_collected = collections.deque()
_ids = itertools.count()


class Session(object):
    """Which training step calls belong to, across all layers of the process.

    Operators take a token when MXNet creates them (when they are issued, in
    imperative and dynamic-graph mode). A failure that leaves calls without
    partners (a device raised, a device never came, ``reset()``) starts a new
    token: calls issued before it fail at once with the cause instead of
    waiting, or pairing with the next step's calls. Calls issued after the
    failure but before the next step begins (the outermost ``record()`` or
    ``train_mode()`` scope is entered: see hooks) still get the old token:
    they are the rest of the failed step.

    Every source of a failure in Python (bad input, an exception leaving
    ``record()``, a shape the Python operator refuses, interpreter exit,
    ``reset()``) enters here through :meth:`fail_step`; a barrier, which must
    mark the step aborted before its own waiters wake, calls its two halves,
    :meth:`abort` and :meth:`fail_others`. The native library's own failures
    abort the same step there (``session.h``, ``abort_locked``): once it is
    loaded the token lives in it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._token = 0
        self._cause = None
        self._abort_listeners = []
        self._native = None
        self._engine_ready = False
        self._cleared_token = 0
        self._clear_lock = threading.Lock()
        self._issue_token = 0
        self._dtypes_lock = threading.Lock()

    def load_native(self):
        """The native library, built, self-tested and loaded at the first
        layer's first call (not at import), or None where it cannot be had.

        From then on the step token lives there, so both operators share one
        step: a native timeout fails the Python calls of the step and the
        other way round. No call has been issued before the first layer's, so
        the token starts afresh.
        """
        with SETUP_LOCK:
            if self._native is None:
                self._load_native_locked()
        return self._native

    def _load_native_locked(self):
        lib = native.load()  # raises where GLUON_SYNCBN_BACKEND=async|exchange cannot be had
        if lib is not None:
            add_failure_source(lambda: [
                (SyncBatchNormTimeout if kind == 'SyncBatchNormTimeout'
                 else SyncBatchNormError)(m)
                for kind, m in native.take_errors(lib)])
            self._issue_token = lib.gsbn_token()
            lib.gsbn_begin_step()
            self._native = lib  # last: the token lives there from now on

    def prepare_engine(self):
        """Once, before the first layer's first call, where the native library
        is loaded: room in MXNet's list of engine errors, so failures never
        move it under a search (native ``failures.h``
        ``reserve_engine_errors``; :mod:`mxnet_private`)."""
        if self._native is not None and not self._engine_ready:
            self._engine_ready = True
            self._native.gsbn_reserve_engine_errors()

    def add_abort_listener(self, listener):
        """Call ``listener(cause)`` on every abort except the one at interpreter exit."""
        with self._lock:
            if listener not in self._abort_listeners:
                self._abort_listeners.append(listener)

    def token(self):
        """The current step's token."""
        return self._native.gsbn_token() if self._native is not None else self._token

    def issue_token(self):
        """The token of a call issued now: the step that began last."""
        return self._issue_token

    def check_dtypes(self, owner, name, num_devices, device, dtype):
        """Raise if the call of ``owner`` (a layer, or a hybridized block
        holding layers, named ``name``) issued now on ``device`` has another
        dtype than the same call on the other devices: the k-th call of each
        of the ``num_devices`` devices since the step token last changed, as
        the operators pair them. Checked when a call is issued: found later,
        inside the operators, the failure would have to travel through
        MXNet's error path once per device at the same moment.

        The record lives on ``owner`` (nothing outlives it) and keeps only
        calls some device has not made yet, at most :data:`OPEN_CALLS` of
        them (a device with an empty slice runs a hybridized network's layers
        imperatively: the others never make those calls).
        """
        with self._dtypes_lock:
            record = owner.__dict__.get('_gluon_syncbn_dtypes')
            if record is None or record[0] != self._issue_token:
                record = owner._gluon_syncbn_dtypes = (self._issue_token, {}, {})
            _, made, open_calls = record  # {device: calls made}, {call: {device: dtype}}
            call = made.get(device, 0)
            made[device] = call + 1
            seen = open_calls.setdefault(call, {})
            seen[device] = dtype
            if len(seen) == num_devices:
                del open_calls[call]
            elif len(open_calls) > OPEN_CALLS:
                del open_calls[next(iter(open_calls))]  # the oldest
            if len(set(seen.values())) <= 1:
                return
        exc = SyncBatchNormError(messages.text(
            'dtypes_disagree', layers=name,
            dtypes=', '.join('%s: %s' % (d, t) for d, t in sorted(seen.items()))))
        self.fail_step(exc)
        raise exc

    def begin_step(self):
        """A training step begins: calls issued from now on belong to it.
        Called by every thread that enters ``record()``, so once or once per
        device per step."""
        self._issue_token = self.token()
        if self._native is not None:
            self._native.gsbn_begin_step()

    def cause(self):
        return native.cause(self._native) if self._native is not None else self._cause

    def active(self):
        """True once any SyncBatchNorm layer has synchronized in this process."""
        with _lock:
            return bool(_groups)

    def check(self, token, layer):
        """Raise if a call of ``layer`` issued with ``token`` belongs to a failed step."""
        if token != self.token():
            exc = SyncBatchNormError(messages.text('stale_call', layer=layer,
                                                   cause=self.cause()))
            record_failure(exc)
            raise exc

    def abort(self, cause, exiting=False):
        """Start a new token; calls issued before now belong to an aborted step."""
        with self._lock:
            if self._native is None:
                self._token += 1
                self._cause = cause
            else:  # the token lives there (see load_native)
                self._native.gsbn_abort(str(cause).encode('utf-8', 'replace'), int(exiting))
            listeners = [] if exiting else list(self._abort_listeners)
        for listener in listeners:
            listener(cause)

    def fail_others(self, cause):
        """Wake every waiting call of every layer with ``cause``."""
        with _lock:
            groups = list(_groups.values())
        for group in groups:
            group.barrier.fail_pending(cause)

    def clear_failed_arrays(self):
        """After an aborted step, clear the errors MXNet left on the layers' arrays.

        A failed call leaves its exception on the arrays it writes (running
        statistics, gamma/beta gradients), and every later operator touching
        them would be skipped with the same error. Waiting on an array clears
        its error, and with it that of every array the same failed operator
        poisoned: MXNet shares one error object among them
        (``threaded_engine.cc``, ``OnComplete``, ``ThrowException``), so the
        static arrays of cached graphs are clean too. Called on the main thread
        before a network's calls are issued (by the block, and for cached
        graphs by hooks); the aborted calls finish at once, so the wait is short.
        """
        token = self.token()
        if token == self._cleared_token:
            return
        # Threads calling for each device at once: one clears, and the others
        # wait until it is done. Were they to go on, the clearing thread could
        # wait on a running statistic written by their calls, which wait for
        # its device's call.
        with self._clear_lock:
            if token == self._cleared_token:
                return
            with _lock:
                groups = list(_groups.values())
            for group in groups:
                group.clear_failed_state()
            self._cleared_token = token

    def fail_step(self, cause=None, exiting=False):
        """The current step failed with ``cause`` (default: ``gluon_syncbn.reset()``
        was called): abort it, and wake every waiting call of every layer."""
        if cause is None:
            cause = SyncBatchNormError('gluon_syncbn.reset() was called while this call waited.')
        self.abort(cause, exiting)
        self.fail_others(cause)


SESSION = Session()
# How many calls a dtype record keeps open: far more than one step issues.
OPEN_CALLS = 4096

LAST_BATCH_HINT = (
    "A device that never calls the layer usually means the batch had fewer samples than "
    "devices, so split_and_load made fewer slices: use a DataLoader with "
    "last_batch='discard' or 'rollover'. Otherwise raise timeout= (or GLUON_SYNCBN_TIMEOUT) "
    "if a device is just slow.")
CPU_SLOTS_HINT = (
    " If every device was fed: CPU contexts share MXNet's temp-space and random-number "
    "slots, and a network with many Dropout (or other) layers between the devices' calls "
    "can use them all (now MXNET_CPU_PARALLEL_RAND_COPY=%s, MXNET_CPU_TEMP_COPY=%s): pass "
    "larger random_slots= / temp_slots= to gluon_syncbn.configure_cpu_contexts() at the "
    "start of the program.")


def timeout_hint(devices):
    """The advice in a timeout message for a layer on ``devices``."""
    if any(d.startswith('cpu') for d in devices):
        return LAST_BATCH_HINT + CPU_SLOTS_HINT % (
            os.environ.get('MXNET_CPU_PARALLEL_RAND_COPY'), os.environ.get('MXNET_CPU_TEMP_COPY'))
    return LAST_BATCH_HINT


def new_group_id():
    return 'syncbn%d' % next(_ids)


class SyncGroup(object):
    """The devices of one layer, its barrier, and how sums leave the process.

    Parameters
    ----------
    group_id : str
        Key in the registry.
    name : str
        Layer name for messages.
    devices : list of str
        Context strings, e.g. ``['cpu(0)', 'cpu(1)']``; a device's index is its
        position here.
    axis : int
        Channel axis (for messages).
    timeout : float
        Seconds to wait for the other devices.
    transport : object
        How the per-process sums reach the other processes (see
        :mod:`gluon_syncbn.transport`); default: this process only.
    arrays : callable, optional
        ``arrays(device_name, which)``: the layer's NDArrays on that device,
        ``which='running'`` (running mean, variance) or ``'written'`` (those plus
        the gamma/beta gradients). Without it, no running-statistics copies and
        no clean-up after an abort.
    sync_groups : int, tuple of tuples or None
        Which devices normalize together (see :mod:`gluon_syncbn.groups`).
    """

    def __init__(self, group_id, name, devices, axis, timeout, transport=None, arrays=None,
                 sync_groups=None):
        self.group_id = group_id
        self.name = name
        self.devices = list(devices)
        self._arrays = arrays
        self.axis = axis
        self.transport = transport or LocalTransport()
        self._init_subgroups(sync_groups)
        hint = timeout_hint(self.devices)
        self.barrier = CallOrderBarrier(name, self.devices, timeout, hint=hint, session=SESSION)
        SESSION.load_native()
        on_cpu = in_host_memory(self.devices)
        # Which operator synchronizes the calls ('async', 'exchange' or
        # 'python') and, for the Python operator, why.
        self.operator, self.why_python = native.choose_operator(name, self.devices, on_cpu,
                                                                self.transport)
        # Whether the operators may touch the layer's arrays in place: the
        # exchange operator only sees per-channel vectors, on CPU contexts too.
        self.host_memory = on_cpu and self.operator != 'exchange'
        if self.transport.cross_process and self.operator == 'python':
            # An aborted step leaves the other workers waiting for our sums
            # (the native session sees to that for the native operators).
            SESSION.add_abort_listener(self.transport.fail_on_abort)
        SESSION.prepare_engine()
        self._running_arrays = []
        # The exchange graph of imperative calls, as CachedOps (graph.VectorGraph).
        self.imperative_graphs = {}
        if self.operator != 'python':
            subgroups = (ctypes.c_int * len(self.devices))(*self.subgroup_of)
            SESSION._native.gsbn_group_create(
                group_id.encode(), name.encode(), b'\0'.join(d.encode() for d in self.devices),
                len(self.devices), float(timeout), hint.encode(), subgroups,
                len(self.groups))
            if self.needs_transport:
                owners = (ctypes.c_double * self._ownership.size)(*self._ownership)
                SESSION._native.gsbn_group_set_transport(
                    group_id.encode(), self.transport.native, owners, self._ownership.size)

    def _init_subgroups(self, sync_groups):
        """``groups`` (global device indices), each local device's group, and
        whether sums must leave the process: only if a group spans workers."""
        local = len(self.devices)
        cross = self.transport.cross_process
        workers, rank = (self.transport.num_workers, self.transport.rank) if cross else (1, 0)
        self.groups = partition(sync_groups, local * workers, self.name)
        first = rank * local
        owner = {d: g for g, members in enumerate(self.groups) for d in members}
        self.subgroup_of = [owner[first + i] for i in range(local)]
        # (A cross-process store of one worker, which only tests make, is
        # used too: it runs the real reduction chain in one process.)
        self.needs_transport = cross and (workers == 1 or any(
            len({d // local for d in members}) > 1 for members in self.groups))
        # With groups across workers, each reduction also checks that the
        # workers agree on the global numbering: every device owned once.
        self._ownership = np.zeros(0)
        if self.needs_transport and sync_groups is not None:
            self._ownership = np.zeros(local * workers)
            self._ownership[first:first + local] = 1.0

    def register_running_arrays(self):
        """Hand the exchange operator each device's running mean and variance
        arrays, for static_shape graphs, whose auxiliary states are read-only:
        it updates the Parameter's own arrays in engine order
        (``exchange_op.h``, queue_running_update)."""
        arrays = [self.running_params(d) for d in range(len(self.devices))]
        if [a.handle.value for p in arrays for a in p] != [
                a.handle.value for p in self._running_arrays for a in p]:
            self._running_arrays = arrays  # keeps the handles valid
            for device, (mean, var) in enumerate(arrays):
                SESSION._native.gsbn_group_set_running(self.group_id.encode(), device,
                                                       mean.handle, var.handle)

    def attach(self, channels):
        """Prepare the transport for this layer (main thread, at its first call)."""
        extra = self._ownership.size
        self.transport.attach(self.group_id, self.name,
                              len(self.groups) * wire.forward_size(channels) + extra,
                              len(self.groups) * wire.backward_size(channels) + extra)

    def running_params(self, device):
        """The running mean and variance arrays of ``device`` (the layer's own)."""
        return self._arrays(self.devices[device], 'running')

    def clear_failed_state(self):
        """Wait on every array our calls write, swallowing a failed step's error
        (see :meth:`Session.clear_failed_arrays`)."""
        if self._arrays is None:
            return
        for device in self.devices:
            try:
                arrays = self._arrays(device, 'written')
            except Exception:  # pylint: disable=broad-except
                continue  # the layer is gone or not initialized there
            for arr in arrays:
                try:
                    arr.wait_to_read()
                except Exception:  # pylint: disable=broad-except
                    pass  # the stale error of the aborted step, already reported

    def device_index(self, ctx):
        ctx = str(ctx)
        try:
            return self.devices.index(ctx)
        except ValueError:
            raise SyncBatchNormError(messages.text(
                'wrong_device', layer=self.name, device=ctx, devices=', '.join(self.devices)))

    def reduce(self, key, values):
        """The exchange ``key`` of the Python operator (see :mod:`gluon_syncbn.op`):
        check that the devices agree, sum their float64 vectors per sync group
        in device order, then over the other processes through the transport.
        Returns one row per group; device ``i`` takes row ``subgroup_of[i]``."""
        sizes = {i: v[0].size for i, v in values.items()}
        dtypes = {i: v[1] for i, v in values.items()}
        if len(set(sizes.values())) > 1:
            raise SyncBatchNormError(messages.text(
                'channels_disagree', layer=self.name, channels=', '.join(
                    '%s: %d' % (self.devices[i], wire.channels_of(key[0], v[0]))
                    for i, v in sorted(values.items()))))
        if len(set(dtypes.values())) > 1:
            raise SyncBatchNormError(messages.text(
                'dtypes_disagree', layers="'%s'" % self.name, dtypes=', '.join(
                    '%s: %s' % (self.devices[i], d) for i, d in sorted(dtypes.items()))))
        size = next(iter(values.values()))[0].size
        stacked = np.zeros((len(self.groups), size))  # one sum per sync group
        for i in sorted(values):
            stacked[self.subgroup_of[i]] += values[i][0]
        if self.needs_transport:
            flat = np.concatenate((stacked.ravel(), self._ownership))
            flat = self.transport.allreduce(self.group_id, key, flat,
                                            wire.channels_of(key[0], values[0][0]),
                                            self.barrier.timeout)
            stacked = flat[:stacked.size].reshape(stacked.shape)
            owners = flat[stacked.size:]
            if owners.size and not (owners == 1).all():
                raise SyncBatchNormError(messages.text(
                    'numbering_disagrees', layer=self.name,
                    devices=', '.join(str(d) for d, c in enumerate(owners) if c != 1)))
        for g in sorted(set(self.subgroup_of)):
            if key[0] == 'fwd' and stacked[g][0] <= 0:  # FORWARD: n
                raise SyncBatchNormError(messages.text(
                    'empty_batch', layer=self.name, where=messages.text('in_sync_group', group=g)
                    if len(self.groups) > 1 else ''))
        return stacked


def register(group):
    with _lock:
        _remove_collected_locked()
        _groups[group.group_id] = group


def get_group(group_id):
    with _lock:
        group = _groups.get(group_id)
    if group is None:
        raise SyncBatchNormError(messages.text('unknown_group', group=group_id))
    return group


def unregister(group_id):
    """Forget the group of a layer that was garbage-collected (its finalizer):
    now if the lock is free, else at the next registration. Never waits."""
    _collected.append(group_id)
    if _lock.acquire(False):
        try:
            _remove_collected_locked()
        finally:
            _lock.release()


def _remove_collected_locked():
    while _collected:
        group = _groups.pop(_collected.popleft(), None)
        if group is not None and group.operator != 'python':
            SESSION._native.gsbn_group_remove(group.group_id.encode())

