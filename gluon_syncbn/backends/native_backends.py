"""The native backends: the asynchronous operator (CPU contexts) and the
exchange operator (GPUs); what they share is :class:`~.base.Backend`'s."""
from .base import Backend
from .vector_graph import VectorBackend

__all__ = ['AsyncBackend', 'ExchangeBackend']


class AsyncBackend(Backend):
    """The asynchronous operator (``native/async_op.h``): the whole call in
    one operator of MXNet's own kind. It reads and writes every float dtype
    as it is, so no Cast surrounds it."""

    name = 'async'

    def forward(self, F, x, gamma, beta, running_mean, running_var, dtype, static_shape=False,
                ndim=None, dtype_known=True):
        return self._functions[F](x, gamma, beta, running_mean, running_var,
                                  static_shape=static_shape, input_dtype=dtype,
                                  **self._arguments)


class ExchangeBackend(VectorBackend):
    """The exchange operator (``native/exchange_op.h``) on the per-channel
    moments MXNet's operators compute on the device."""

    name = 'exchange'

    def _exchange(self, F, m1, m2, v, data, gamma, beta, running_mean, running_var, dtype,
                  static_shape):
        out = self._functions[F](m1, m2, v, gamma, beta, running_mean, running_var, data,
                                 static_shape=static_shape, input_dtype=dtype,
                                 **self._arguments)
        return out[0], out[1]
