"""The native backends: the asynchronous operator (CPU contexts) and the
exchange operator (GPUs), both in the native session (``native/``).

A layer's group there is an integer handle, created with the backend and
removed with it; the operators take it as their ``group`` argument.
"""
import weakref

from mxnet.gluon.parameter import DeferredInitializationError

from ..hooks import request_retrace
from ..mxnet_private import dtype_name
from .base import Backend
from .vector_graph import VectorBackend

__all__ = ['AsyncBackend', 'ExchangeBackend']


def native_group(backend, lib):
    """The handle of ``backend``'s group in the native session, created now
    and removed when the backend goes. Across processes its sums leave
    through the transport's native twin, where a sync group spans workers."""
    transport, owners = backend.transport, ()
    twin = 0
    if transport.cross_process:
        local, workers, rank = len(backend.devices), transport.num_workers, transport.rank
        # (A cross-process store of one worker, which only tests make, is
        # used too: it runs the real reduction chain in one process.)
        if workers == 1 or any(len({d // local for d in members}) > 1
                               for members in backend.sync_groups):
            twin = transport.make_native(lib)
            if backend.explicit_sync_groups:
                # Each reduction also checks that the workers agree on the
                # global numbering: every device owned once.
                owners = [1.0 if rank * local <= d < (rank + 1) * local else 0.0
                          for d in range(local * workers)]
    handle = lib.create_group(backend.layer_name, backend.devices, backend.timeout,
                              backend.hint, backend.sync_group_of, len(backend.sync_groups),
                              twin, owners)
    # Not at interpreter exit: the exit hook still needs the group then.
    weakref.finalize(backend, lib.remove_group, handle).atexit = False
    return handle


def _arguments(backend, handle):
    """The operator's arguments that never change, as the strings MXNet
    would make of them at every call."""
    kwargs = backend.kwargs
    return dict(group=str(handle), eps=str(kwargs['eps']), momentum=str(kwargs['momentum']),
                fix_gamma=str(kwargs['fix_gamma']), axis=str(kwargs['axis']), name='sync')


class AsyncBackend(Backend):
    """The asynchronous operator (``native/async_op.h``): the whole call in
    one operator of MXNet's own kind, without a custom operator's threads.
    It reads and writes every float dtype as it is, so no Cast surrounds it."""

    name = 'async'
    host_memory = True

    def __init__(self, layer, devices, transport, lib, functions):
        super(AsyncBackend, self).__init__(layer, devices, transport)
        self._functions = functions
        self.handle = native_group(self, lib)
        self._arguments = _arguments(self, self.handle)

    def forward(self, F, x, gamma, beta, running_mean, running_var, dtype, static_shape,
                imperative):
        return self._functions[F](x, gamma, beta, running_mean, running_var,
                                  static_shape=static_shape, input_dtype=dtype,
                                  **self._arguments)


class ExchangeBackend(VectorBackend):
    """The exchange operator (``native/exchange_op.h``) on the per-channel
    moments MXNet's operators compute on the device."""

    name = 'exchange'
    cache_imperative = True

    def __init__(self, layer, devices, transport, lib, functions):
        super(ExchangeBackend, self).__init__(layer, devices, transport)
        self._functions = functions
        self._lib = lib
        self.handle = native_group(self, lib)
        self._arguments = _arguments(self, self.handle)
        self._running = []

    def _param_dtype(self):
        return dtype_name(self._layer().gamma.dtype)

    def _set_running_arrays(self):
        """Hand the operator each device's running mean and variance arrays,
        for static_shape graphs, whose auxiliary states are read-only: it
        updates the Parameter's own arrays in engine order
        (``exchange_op.h``, queue_running_update)."""
        arrays = [self.running_arrays(d) for d in range(len(self.devices))]
        if [a.handle.value for p in arrays for a in p] != [
                a.handle.value for p in self._running for a in p]:
            self._running = arrays  # keeps the handles valid
            for device, (mean, var) in enumerate(arrays):
                self._lib.set_running(self.handle, device, mean, var)

    def _graph(self, F, xs, gamma, beta, running_mean, running_var, dtype, static_shape,
               imperative):
        if not imperative and static_shape:
            try:
                self._set_running_arrays()
            except DeferredInitializationError:
                request_retrace()  # shapes are known after the first call
        return super(ExchangeBackend, self)._graph(F, xs, gamma, beta, running_mean,
                                                   running_var, dtype, static_shape, imperative)

    def _exchange(self, F, m1, m2, v, data, gamma, beta, running_mean, running_var, dtype,
                  static_shape):
        stat = 'float64' if dtype == 'float64' else 'float32'
        g, b = ((gamma, beta) if self._param_dtype() == stat else
                (F.Cast(gamma, dtype=stat), F.Cast(beta, dtype=stat)))
        out = self._functions[F](F.concat(m1, m2, v, g, b, dim=0), data, gamma, beta,
                                 running_mean, running_var, static_shape=static_shape,
                                 input_dtype=dtype, **self._arguments)
        return F.split(out, num_outputs=2, axis=0, squeeze_axis=True)
