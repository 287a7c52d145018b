"""What every backend shares: a layer's devices and sync groups, its arrays,
and the clean-up after an aborted step."""
import os
import weakref

from ..groups import partition

__all__ = ['Backend', 'timeout_hint']

LAST_BATCH_HINT = (
    "A device that never calls the layer usually means the batch had fewer samples than "
    "devices, so split_and_load made fewer slices: use a DataLoader with "
    "last_batch='discard' or 'rollover'. Otherwise raise timeout= (or GLUON_SYNCBN_TIMEOUT) "
    "if a device is just slow.")
CPU_SLOTS_HINT = (
    " If every device was fed: CPU contexts share MXNet's temp-space and random-number "
    "slots, and a network with many Dropout (or other) layers between the devices' calls "
    "can use them all (the environment has MXNET_CPU_PARALLEL_RAND_COPY=%s, "
    "MXNET_CPU_TEMP_COPY=%s, which MXNet reads when it makes its resources): pass "
    "larger random_slots= / temp_slots= to gluon_syncbn.configure_cpu_contexts() at the "
    "start of the program.")


def timeout_hint(devices):
    """The advice in a timeout message for a layer on ``devices``."""
    if any(d.startswith('cpu') for d in devices):
        return LAST_BATCH_HINT + CPU_SLOTS_HINT % (
            os.environ.get('MXNET_CPU_PARALLEL_RAND_COPY'), os.environ.get('MXNET_CPU_TEMP_COPY'))
    return LAST_BATCH_HINT


class Backend(object):
    """How one layer's training calls on its devices synchronize.

    Made once per layer and set of devices (``SyncBatchNorm._sync_backend``);
    what never changes between calls is worked out here, so a call does only
    what it needs (:meth:`forward`).

    Parameters
    ----------
    layer : SyncBatchNorm
        The layer (held weakly): its name, arguments and Parameters.
    devices : list of str
        Its parameters' contexts, e.g. ``['cpu(0)', 'cpu(1)']``; a device's
        index is its position here.
    transport : object
        How sums leave the process (:mod:`gluon_syncbn.transport`).
    """

    name = None

    def __init__(self, layer, devices, transport):
        self.layer_name = layer.name
        self.devices = list(devices)
        self.kwargs = layer._kwargs
        self.timeout, self.remote_timeout = layer._timeout, layer._remote_timeout
        self.transport = transport
        self.hint = timeout_hint(self.devices)
        self._layer = weakref.ref(layer)
        self.contexts = layer.gamma.list_ctx()  # the Parameter's own list
        local = len(self.devices)
        workers, rank = (transport.num_workers, transport.rank) if transport.cross_process \
            else (1, 0)
        self.sync_groups = partition(layer._sync_groups, local * workers, layer.name)
        self.explicit_sync_groups = layer._sync_groups is not None
        owner = {d: g for g, members in enumerate(self.sync_groups) for d in members}
        # Each local device's sync group, by index into sync_groups.
        self.sync_group_of = [owner[rank * local + i] for i in range(local)]

    def forward(self, F, x, gamma, beta, running_mean, running_var, dtype, static_shape=False,
                ndim=None, dtype_known=True):
        """The layer's training output for ``x``, normalized with the
        statistics of its sync group: an NDArray (``F`` is ``mx.nd``), or
        the Symbol a graph's node is bound to (``mx.sym``, see ``graphs``).
        ``dtype``: the input's; in a graph whose types MXNet could not infer
        (``dtype_known`` false), the network's (``SyncBatchNorm.cast``).
        ``static_shape``: the graph's operators are made once; ``ndim``: the
        input's number of dimensions, None where a graph cannot tell."""
        raise NotImplementedError

    def start_tally(self):
        """Start tallying the global statistics of this layer's training calls
        on every device (see :class:`~gluon_syncbn.tally.Tally`), from empty
        tallies; no call may be in flight."""
        raise NotImplementedError

    def stop_tally(self):
        """Stop tallying; the tallies stay readable."""
        raise NotImplementedError

    def tally(self, device):
        """Device ``device``'s :class:`~gluon_syncbn.tally.Tally` since
        :meth:`start_tally`, once its calls have completed."""
        raise NotImplementedError

    def running_arrays(self, device):
        """Device ``device``'s running mean and variance (the layer's own arrays)."""
        layer, ctx = self._layer(), self.contexts[device]
        return [layer.running_mean.data(ctx), layer.running_var.data(ctx)]

    def clear_failed_state(self):
        """Wait on every array this layer's calls write, swallowing a failed
        step's error (see ``Session.clear_failed_arrays``)."""
        layer = self._layer()
        if layer is None:
            return
        params = [layer.running_mean, layer.running_var] + [
            p for p in (layer.gamma, layer.beta) if p.grad_req != 'null']
        for ctx in self.contexts:
            for param in params:
                try:
                    arr = param.data(ctx) if param.grad_req == 'null' else param.grad(ctx)
                    arr.wait_to_read()
                except Exception:  # pylint: disable=broad-except
                    pass  # the stale error of the aborted step, already reported
