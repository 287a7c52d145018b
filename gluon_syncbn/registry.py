"""Process-wide table of synchronization groups, one per SyncBatchNorm layer.

The custom operator is created by MXNet from string arguments only, so it finds
its layer's barrier here by the group id the block baked into the graph. Ids
are unique per layer object (not per prefix), so two networks with equal
prefixes never share a barrier.
"""
import itertools
import os
import threading

import numpy as np

from .barrier import CallOrderBarrier
from .errors import SyncBatchNormError, record_failure
from .transport import LocalTransport

__all__ = ['SyncGroup', 'get_group', 'new_group_id', 'register', 'unregister', 'SESSION']

_groups = {}
_lock = threading.Lock()
_ids = itertools.count()


class Session(object):
    """Which training step calls belong to, across all layers of the process.

    Operators take a token when MXNet creates them (when they are issued, in
    imperative and dynamic-graph mode). A failure that leaves calls without
    partners (a device raised, a device never came, ``reset()``) starts a new
    token: calls issued before it fail at once with the cause instead of
    waiting, or pairing with the next step's calls.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._token = 0
        self._cause = None
        self._abort_listeners = []

    def add_abort_listener(self, listener):
        """Call ``listener(cause)`` on every abort except the one at interpreter exit."""
        with self._lock:
            if listener not in self._abort_listeners:
                self._abort_listeners.append(listener)

    def token(self):
        return self._token

    def active(self):
        """True once any SyncBatchNorm layer has synchronized in this process."""
        with _lock:
            return bool(_groups)

    def check(self, token):
        if token != self._token:
            exc = SyncBatchNormError(
                'this SyncBatchNorm call belongs to a step that failed earlier: %s'
                % self._cause)
            record_failure(exc)
            raise exc

    def abort(self, cause, exiting=False):
        """Start a new token; calls issued before now belong to an aborted step."""
        with self._lock:
            self._token += 1
            self._cause = cause
            listeners = [] if exiting else list(self._abort_listeners)
        for listener in listeners:
            listener(cause)

    def fail_others(self, cause):
        """Wake every waiting call of every layer with ``cause``."""
        with _lock:
            groups = list(_groups.values())
        for group in groups:
            group.barrier.fail_pending(cause)

    def abort_all(self, cause=None, exiting=False):
        """Abort the current step everywhere: the manual ``gluon_syncbn.reset()``."""
        if cause is None:
            cause = SyncBatchNormError('gluon_syncbn.reset() was called while this call waited.')
        self.abort(cause, exiting)
        self.fail_others(cause)


SESSION = Session()

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
    """

    def __init__(self, group_id, name, devices, axis, timeout, transport=None, arrays=None):
        self.group_id = group_id
        self.name = name
        self.devices = list(devices)
        self._arrays = arrays
        self._cleared_token = [0] * len(self.devices)
        self.axis = axis
        self.transport = transport or LocalTransport()
        if self.transport.cross_process:
            # An aborted step leaves the other workers waiting for our sums.
            SESSION.add_abort_listener(self.transport.fail_on_abort)
        self.barrier = CallOrderBarrier(name, self.devices, self._combine, timeout,
                                        hint=timeout_hint(self.devices), session=SESSION)

    def attach(self, channels):
        """Prepare the transport for this layer (main thread, at its first call)."""
        self.transport.attach(self.group_id, self.name, channels)

    def running_params(self, device):
        """The running mean and variance arrays of ``device`` (the layer's own)."""
        return self._arrays(self.devices[device], 'running')

    def clear_failed_state(self, device, token):
        """After an aborted step, clear the error MXNet left on our running statistics.

        A failed call leaves its exception on the arrays it writes (running
        statistics, gamma/beta gradients); every later operator touching them
        would be skipped with the same error. Waiting on an array clears its
        error, so the first call of ``device`` issued after an abort waits on
        them once (the aborted calls finish at once) and swallows the stale error.
        """
        if self._cleared_token[device] == token or self._arrays is None:
            return
        self._cleared_token[device] = token
        for arr in self._arrays(self.devices[device], 'written'):
            try:
                arr.wait_to_read()
            except Exception:  # pylint: disable=broad-except
                pass  # the stale error of the aborted step, already reported

    def device_index(self, ctx):
        ctx = str(ctx)
        try:
            return self.devices.index(ctx)
        except ValueError:
            raise SyncBatchNormError(
                "SyncBatchNorm '%s' was called on %s, but its parameters live on %s. "
                "Initialize the network on every context you feed." % (
                    self.name, ctx, ', '.join(self.devices)))

    def _combine(self, key, values):
        """Check the devices agree, then sum their float64 vectors."""
        sizes = {i: v[0].size for i, v in values.items()}
        dtypes = {i: v[1] for i, v in values.items()}
        if len(set(sizes.values())) > 1:
            raise SyncBatchNormError(
                "SyncBatchNorm '%s': devices disagree on the channel count: %s. Every device "
                "must feed the same number of channels on axis %d." % (
                    self.name, ', '.join('%s: %d' % (self.devices[i], (s - 1) // 2 if key[0] == 'fwd'
                                                      else s // 2)
                                         for i, s in sorted(sizes.items())), self.axis))
        if len(set(dtypes.values())) > 1:
            raise SyncBatchNormError(
                "SyncBatchNorm '%s': devices disagree on the input dtype: %s. Cast every "
                "slice to the same dtype." % (self.name, ', '.join(
                    '%s: %s' % (self.devices[i], d) for i, d in sorted(dtypes.items()))))
        total = np.sum([v[0] for v in values.values()], axis=0, dtype=np.float64)
        return self.transport.allreduce(self.group_id, key, total, self.barrier.timeout)


def register(group):
    with _lock:
        _groups[group.group_id] = group


def get_group(group_id):
    with _lock:
        group = _groups.get(group_id)
    if group is None:
        raise SyncBatchNormError(
            'SyncBatchNorm group %r is unknown: the layer was deleted or its graph was '
            'loaded into another process. Use revert_model() before export.' % group_id)
    return group


def unregister(group_id):
    with _lock:
        _groups.pop(group_id, None)
