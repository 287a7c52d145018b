"""The native backends: the asynchronous operator (CPU contexts) and the
exchange operator (GPUs), both in the native session (``native/``).

A layer's state there is an integer handle, created with the backend and
removed with it; the operators take it as their ``layer`` argument.
"""
import weakref

from ..tally import Tally
from .base import Backend
from .vector_graph import VectorBackend

__all__ = ['AsyncBackend', 'ExchangeBackend']


def native_layer(backend, lib):
    """The handle of ``backend``'s layer in the native session, created now
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
    handle = lib.create_layer(backend.layer_name, backend.devices, backend.timeout,
                              backend.remote_timeout, backend.hint, backend.sync_group_of,
                              len(backend.sync_groups), twin, owners)
    # Not at interpreter exit: the exit hook still needs the layer then.
    weakref.finalize(backend, lib.remove_layer, handle).atexit = False
    return handle


def _arguments(backend, handle):
    """The operator's arguments that never change, as the strings MXNet
    would make of them at every call."""
    kwargs = backend.kwargs
    return dict(layer=str(handle), eps=str(kwargs['eps']), momentum=str(kwargs['momentum']),
                fix_gamma=str(kwargs['fix_gamma']), axis=str(kwargs['axis']), name='sync')


class _NativeTallies(object):
    """The tallies of a native backend's layer, kept by the native session
    (``add_to_tally`` in ``native/session.h``), and the settling of its
    calls after an aborted step."""

    def clear_failed_state(self):
        # The layer's engine variables, which every call of it writes: what
        # a static_shape graph's calls of an aborted step poisoned (their
        # arrays are the next step's) is cleared with them.
        self._lib.settle(self.handle)
        super(_NativeTallies, self).clear_failed_state()

    def start_tally(self):
        self._lib.tally(self.handle, True)

    def stop_tally(self):
        self._lib.tally(self.handle, False)

    def tally(self, device):
        counts = self._lib.read_tally(self.handle, device, self._layer().gamma.shape[0])
        return Tally(*counts) if counts is not None else Tally()


class AsyncBackend(_NativeTallies, Backend):
    """The asynchronous operator (``native/async_op.h``): the whole call in
    one operator of MXNet's own kind. It reads and writes every float dtype
    as it is, so no Cast surrounds it."""

    name = 'async'

    def __init__(self, layer, devices, transport, lib, functions):
        super(AsyncBackend, self).__init__(layer, devices, transport)
        self._functions, self._lib = functions, lib
        self.handle = native_layer(self, lib)
        self._arguments = _arguments(self, self.handle)

    def forward(self, F, x, gamma, beta, running_mean, running_var, dtype, static_shape=False,
                ndim=None, dtype_known=True):
        return self._functions[F](x, gamma, beta, running_mean, running_var,
                                  static_shape=static_shape, input_dtype=dtype,
                                  **self._arguments)


class ExchangeBackend(_NativeTallies, VectorBackend):
    """The exchange operator (``native/exchange_op.h``) on the per-channel
    moments MXNet's operators compute on the device."""

    name = 'exchange'

    def __init__(self, layer, devices, transport, lib, functions):
        super(ExchangeBackend, self).__init__(layer, devices, transport)
        self._functions, self._lib = functions, lib
        self.handle = native_layer(self, lib)
        self._arguments = _arguments(self, self.handle)

    def _exchange(self, F, m1, m2, v, data, gamma, beta, running_mean, running_var, dtype,
                  static_shape):
        out = self._functions[F](m1, m2, v, gamma, beta, running_mean, running_var, data,
                                 static_shape=static_shape, input_dtype=dtype,
                                 **self._arguments)
        return out[0], out[1]
