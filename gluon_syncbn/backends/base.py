"""The two backends, and what they share: a layer's devices and sync
groups, its state in the native session (an integer handle, the operators'
``layer`` argument, created with the backend and removed with it), its
tallies there, and the clean-up after an aborted step. The asynchronous
operator's backend is here; the exchange operator's, with the graph around
it, in :mod:`.vector_graph`."""
import collections
import os
import weakref

from .. import messages
from ..groups import partition
from ..mxnet_private import dtype_name
from ..tally import Tally

__all__ = ['AsyncBackend', 'Backend', 'Call', 'Layer', 'Params', 'timeout_hint']


# The layer's four parameter arrays (or, in a graph, symbols), in the order
# MXNet's BatchNorm takes them.
Params = collections.namedtuple('Params', ['gamma', 'beta', 'running_mean', 'running_var'])


class Layer(collections.namedtuple('Layer', ['name', 'axis', 'fix_gamma', 'sync_groups',
                                             'timeout', 'remote_timeout', 'params'])):
    """What a backend and a transport know of a layer, fixed when its backend
    is made (``SyncBatchNorm._sync_backend``): its name, ``axis`` and
    ``fix_gamma``, its ``sync_groups`` as given (None: one group), its
    timeouts in seconds (for the devices of its process, and for the other
    workers) and its :data:`Params` (the Parameters). Its eps and momentum,
    which users change between steps, come with each :class:`Call`."""
    __slots__ = ()


class Call(collections.namedtuple('Call', ['dtype', 'static_shape', 'ndim', 'dtype_known',
                                           'eps', 'momentum'])):
    """How a training call's graph is made, beside its arrays.

    dtype : str
        The input's; in a graph whose types MXNet could not infer
        (``dtype_known`` false), the network's (``SyncBatchNorm.cast``).
    static_shape : bool
        The graph's operators are made once (a static_shape graph).
    ndim : int or None
        The input's number of dimensions, None where a graph cannot tell.
    dtype_known : bool
        Whether the input has dtype ``dtype`` (else, under AMP, it may be
        narrower).
    eps, momentum : float
        The layer's (its ``_kwargs``) when the call, or its graph, is made:
        the operators' arguments, as for ``nn.BatchNorm``'s node.
    """
    __slots__ = ()

    @classmethod
    def imperative(cls, x, kwargs):
        """An imperative call on NDArray ``x`` of a layer with ``_kwargs``
        ``kwargs``: static in no sense (its operator is made for it and knows
        the step it was issued in)."""
        return cls(dtype_name(x.dtype), False, x.ndim, True, kwargs['eps'], kwargs['momentum'])

    def arguments(self):
        """The operators' arguments this call sets (MXNet would make strings
        of them; ``repr`` keeps every digit of eps and momentum)."""
        return dict(static_shape=self.static_shape, input_dtype=self.dtype,
                    eps=repr(float(self.eps)), momentum=repr(float(self.momentum)))

LAST_BATCH_HINT = (
    "A device that never calls the layer was not given its part of the step (a loop over "
    "fewer slices than devices, a thread that did not run), or an earlier operator failed "
    "on it (that device's outputs carry the error). Feed every device in every step (a "
    "DataLoader with last_batch='discard' or 'rollover'); raise timeout= (or "
    "GLUON_SYNCBN_TIMEOUT) if a device is just slow.")
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
    """How one layer's training calls on its devices synchronize, through
    the native operator ``functions`` of ``lib``.

    Made once per layer and set of devices (``SyncBatchNorm._sync_backend``);
    what never changes between calls is worked out here, so a call does only
    what it needs (:meth:`forward`).

    Parameters
    ----------
    layer : Layer
        What the backend knows of the layer.
    devices : list of str
        Its parameters' contexts, e.g. ``['cpu(0)', 'cpu(1)']``; a device's
        index is its position here.
    transport : object
        How sums leave the process (:mod:`gluon_syncbn.transport`).
    lib : native.library.Library
        The native library.
    functions : dict
        ``{mx.nd: f, mx.sym: f}``, the operator's functions.
    """

    name = None

    def __init__(self, layer, devices, transport, lib, functions):
        self.layer = layer
        self.devices = list(devices)
        self.transport = transport
        self.contexts = layer.params.gamma.list_ctx()  # the Parameter's own list
        local = len(self.devices)
        workers, rank = (transport.num_workers, transport.rank) if transport.cross_process \
            else (1, 0)
        self.sync_groups = partition(layer.sync_groups, local * workers, layer.name)
        owner = {d: g for g, members in enumerate(self.sync_groups) for d in members}
        # Each local device's sync group, by index into sync_groups.
        self.sync_group_of = [owner[rank * local + i] for i in range(local)]
        self._lib, self._functions = lib, functions
        self.handle = self._native_layer()
        # The operator's arguments that never change, as the strings MXNet
        # would make of them at every call.
        self._arguments = dict(layer=str(self.handle), fix_gamma=str(layer.fix_gamma),
                               axis=str(layer.axis), name='sync')

    def _native_layer(self):
        """The handle of this layer's state in the native session, created
        now and removed when the backend goes. Across processes its sums
        leave through the transport's native twin, where a sync group spans
        workers."""
        transport, owners, twin = self.transport, (), 0
        if transport.cross_process:
            local, workers, rank = len(self.devices), transport.num_workers, transport.rank
            # (A cross-process store of one worker, which only tests make, is
            # used too: it runs the real reduction chain in one process.)
            if workers == 1 or any(len({d // local for d in members}) > 1
                                   for members in self.sync_groups):
                twin = transport.make_native(self._lib)
                if self.layer.sync_groups is not None:
                    # Each reduction also checks that the workers agree on the
                    # global numbering: every device owned once.
                    owners = [1.0 if rank * local <= d < (rank + 1) * local else 0.0
                              for d in range(local * workers)]
        handle = self._lib.create_layer(self.layer.name, self.devices, self.layer.timeout,
                                        self.layer.remote_timeout, timeout_hint(self.devices),
                                        self.sync_group_of, len(self.sync_groups), twin, owners)
        # Not at interpreter exit: the exit hook still needs the layer then.
        weakref.finalize(self, self._lib.remove_layer, handle).atexit = False
        return handle

    def watch_empty_slice(self, x):
        """Before an imperative training call on ``x``, an empty slice: if an
        earlier operator on its device refused it (MXNet's convolutions do),
        the engine skips this device's calls, and the step fails at once
        naming the empty slice instead of the others waiting for it
        (``gsbn_watch_slice``)."""
        self._lib.watch_slice(x, messages.text('empty_slice_refused', layer=self.layer.name,
                                               device=x.context, shape=x.shape))

    def forward(self, F, x, params, call):
        """The layer's training output for ``x``, normalized with the
        statistics of its sync group: an NDArray (``F`` is ``mx.nd``), or
        the Symbol a graph's node is bound to (``mx.sym``, see ``graphs``).
        ``params``: :data:`Params`; ``call``: :class:`Call`."""
        raise NotImplementedError

    def start_tally(self):
        """Start tallying the global statistics of this layer's training calls
        on every device (see :class:`~gluon_syncbn.tally.Tally`, and
        ``add_to_tally`` in ``native/session.h``), from empty tallies; no
        call may be in flight."""
        self._lib.tally(self.handle, True)

    def stop_tally(self):
        """Stop tallying; the tallies stay readable."""
        self._lib.tally(self.handle, False)

    def tally(self, device):
        """Device ``device``'s :class:`~gluon_syncbn.tally.Tally` since
        :meth:`start_tally`, once its calls have completed."""
        counts = self._lib.read_tally(self.handle, device, self.layer.params.gamma.shape[0])
        return Tally(*counts) if counts is not None else Tally()

    def running_arrays(self, device):
        """Device ``device``'s running mean and variance (the layer's own arrays)."""
        params, ctx = self.layer.params, self.contexts[device]
        return [params.running_mean.data(ctx), params.running_var.data(ctx)]

    def clear_failed_state(self):
        """Clear the error a failed step left on this layer's arrays (see
        ``Session.clear_failed_arrays``): its engine variables, which every
        call of it writes, so what a static_shape graph's calls of an aborted
        step poisoned (their arrays are the next step's) is cleared with
        them; then every array its calls write, swallowing that error."""
        self._lib.settle(self.handle)
        params = self.layer.params
        written = [params.running_mean, params.running_var] + [
            p for p in (params.gamma, params.beta) if p.grad_req != 'null']
        for ctx in self.contexts:
            for param in written:
                try:
                    arr = param.data(ctx) if param.grad_req == 'null' else param.grad(ctx)
                    arr.wait_to_read()
                except Exception:  # pylint: disable=broad-except
                    pass  # the stale error of the aborted step, already reported


class AsyncBackend(Backend):
    """The asynchronous operator (``native/async_op.h``): the whole call in
    one operator of MXNet's own kind. It reads and writes every float dtype
    as it is, so no Cast surrounds it."""

    name = 'async'

    def forward(self, F, x, params, call):
        return self._functions[F](x, *params, **call.arguments(), **self._arguments)
