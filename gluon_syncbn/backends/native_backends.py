"""The native backends: the asynchronous operator (CPU contexts) and the
exchange operator (GPUs); what they share is :class:`~.base.Backend`'s."""
from ..cpu_contexts import on_cpu_path
from .base import Backend
from .vector_graph import VectorBackend

__all__ = ['AsyncBackend', 'ExchangeBackend']


class AsyncBackend(Backend):
    """The asynchronous operator (``native/async_op.h``): the whole call in
    one operator of MXNet's own kind. It reads and writes every float dtype
    as it is, so no Cast surrounds it."""

    name = 'async'

    def forward(self, F, x, params, call):
        return self._functions[F](x, *params, static_shape=call.static_shape,
                                  input_dtype=call.dtype, **self._arguments)


class ExchangeBackend(VectorBackend):
    """The exchange operator (``native/exchange_op.h``) on the per-channel
    moments MXNet's operators compute on the device. It updates the running
    statistics where MXNet's BatchNorm does on these devices: in the forward
    call on GPUs (cuDNN's), in the backward call on CPU contexts."""

    name = 'exchange'

    def __init__(self, *args):
        super(ExchangeBackend, self).__init__(*args)
        if on_cpu_path(self.devices):
            self._arguments['running_update'] = 'backward'

    def _exchange(self, F, moments, data, params, call):
        out = self._functions[F](*moments, *params, data, static_shape=call.static_shape,
                                 input_dtype=call.dtype, **self._arguments)
        return out[0], out[1]
