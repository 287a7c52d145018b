"""The exchange operator's backend (GPUs), and the graph around it.

MXNet's own operators compute each device's per-channel moments of the input
(on the device, on GPUs), the backend's operator synchronizes those vectors
into the (scale, shift) that normalize, and MXNet's operators apply them. The
asynchronous operator (CPU contexts) needs none of this: it takes the whole
call.
"""
from mxnet import ndarray, symbol

from ..cpu_contexts import on_cpu_path
from ..mxnet_private import amp_initialized, dtype_name, operator_dtype
from ..session import SETUP_LOCK
from .base import Backend, Params

__all__ = ['LOW_PRECISION', 'ExchangeBackend']

# Input dtypes whose statistics are computed in (at least) float32.
LOW_PRECISION = ('float16', 'bfloat16')


def _channels_in_middle(F, x, axis):
    """``(x as (outer, C, inner) or (outer, C), the axes to reduce)``: what
    ``moments`` needs for per-channel moments whatever ``x``'s number of
    dimensions, for a traced graph that does not know it. Reshapes only."""
    if axis == -1:
        return F.reshape(x, shape=(-1, 0), reverse=True), (0,)
    if axis < 0:  # merge the dimensions after the channel's into one
        for _ in range(-axis - 2):
            x = F.reshape(x, shape=(-2, -3), reverse=True)
        return F.reshape(x, shape=(-1, 0, 0), reverse=True), (0, 2)
    if axis == 0:
        x = F.reshape(x, shape=(-4, 1, -1, -2))
    for _ in range(axis - 1):  # merge the dimensions before the channel's into one
        x = F.reshape(x, shape=(-3, -2))
    return F.reshape(x, shape=(0, 0, -1)), (0, 2)


class ExchangeBackend(Backend):
    """The exchange operator (``native/exchange_op.h``) on the per-channel
    moments MXNet's operators compute on the device. It updates the running
    statistics where MXNet's BatchNorm does on these devices: in the forward
    call on GPUs (cuDNN's), in the backward call on CPU contexts. Imperative
    calls run as one CachedOp per input dtype (:meth:`_cached_op`)."""

    name = 'exchange'

    def __init__(self, *args):
        super(ExchangeBackend, self).__init__(*args)
        if on_cpu_path(self.devices):
            self._arguments['running_update'] = 'backward'
        self._imperative_graphs = {}

    def forward(self, F, x, params, call):
        if F is ndarray:
            if x.size == 0:
                return self._empty_slice(F, x, params, call)
            op, order = self._cached_op(call, dtype_name(params.gamma.dtype))
            arrays = (x,) + tuple(params)
            return op(*[arrays[i] for i in order])
        return self._whole_graph(F, x, params, call)

    def _cached_op(self, call, param_dtype):
        """The graph of an imperative call as one CachedOp, traced once per
        input dtype: one call into MXNet instead of one per operator, and
        static memory instead of a new array per operator output, each of
        whose engine variables costs an engine operation to delete. MXNet
        gives each call that autograd still holds for backward its own
        memory. Not static_shape: that would also pin each operator's
        temp-space slot, and CPU contexts share one pool of them, so an
        imperative operator of one device would in time take a slot pinned by
        another device's later layer and wait for it (a deadlock).

        After an aborted step its static arrays carry no error: see
        ``Session.clear_failed_arrays``.

        Its operator takes the call's eps and momentum as arguments: a
        graph made for others is traced again, and replaces the one before
        (a momentum schedule would otherwise keep one per value).

        Returns ``(op, order)``: ``op`` takes (x, gamma, beta, running_mean,
        running_var) permuted by ``order``, the order of its inputs.
        """
        key = (call.dtype, param_dtype, amp_initialized(), call.ndim)
        cached = self._imperative_graphs.get(key)
        if cached is None or cached[0] != call:
            with SETUP_LOCK:  # traced once, whichever device's thread comes first
                cached = self._imperative_graphs.get(key)
                if cached is None or cached[0] != call:
                    cached = self._imperative_graphs[key] = (call, *self._trace(call))
        return cached[1:]

    def _trace(self, call):
        names = ('data',) + Params._fields
        out = self._whole_graph(symbol, symbol.var('data'),
                                Params(*[symbol.var(n) for n in Params._fields]), call)
        order = [names.index(n) for n in out.list_inputs()]
        return ndarray.CachedOp(out, flags=[('static_alloc', True)]), order

    def _whole_graph(self, F, x, params, call):
        """The operators of a call (:class:`~.base.Call` says what each of
        its fields changes)."""
        dtype = call.dtype
        half = dtype in LOW_PRECISION
        # Statistics in at least float32: float16 input is widened, then narrowed back.
        xs = F.Cast(x, dtype='float32') if half else x
        if not call.dtype_known and dtype == 'float32' and amp_initialized():
            # Under AMP (amp.init()) a graph whose types are unknown may be
            # fed float16: amp_cast widens float16/bfloat16 and leaves
            # float32 alone. (Not for float64 networks: on CPU it is
            # MKL-DNN's and refuses it.)
            xs = F.amp_cast(x, dtype='float32')
        out = self._graph(F, xs, params, call)
        return F.Cast(out, dtype=operator_dtype(dtype)) if half else out

    def _graph(self, F, xs, params, call):
        """The output for ``xs`` (the input, widened): 6 operators, 7 with
        reshape_like and one more where ``moments`` needs a reshape, each a
        kernel on a GPU, around the backend's operator.

        The centre m1 is the mean MXNet computes, a constant to autograd (the
        output does not depend on it), blocked at its input: blocked at its
        output, the mean's backward would still run. The moments of x - m1
        correct m1's float32 rounding, which at |mean| >> std is large
        against the std: m2 = mean(x - m1) and v = var(x - m1), one
        ``moments`` operator, whose backward is one operator too. It takes
        its axes by number, so a graph traced without knowing ``ndim`` first
        reshapes ``x - m1`` to three dimensions (one more operator each way).

        The head gradient enters through the last operator: a Cast (for
        float16 and bfloat16 input) or a reshape_like, whose backward converts
        it to the output's dtype, where MXNet's broadcast operators would
        refuse any other (AMP makes float16 heads for float32 outputs).
        """
        axis, ndim = self.layer.axis, call.ndim
        m1 = F.mean(F.BlockGrad(xs), axis=axis, exclude=True, keepdims=True)
        xc = F.broadcast_sub(xs, m1)
        if ndim:
            m2, v = F.moments(xc, axes=tuple(i for i in range(ndim) if i != axis % ndim))
        else:
            m2, v = F.moments(*_channels_in_middle(F, xc, axis))
        scale, shift = self._exchange(F, (m1, m2, v), xs, params, call)
        out = F.broadcast_add(F.broadcast_mul(xc, scale), shift)
        return out if call.dtype in LOW_PRECISION else F.reshape_like(out, xs)

    def _exchange(self, F, moments, data, params, call):
        """The operator on this device's moments ``(m1, m2, v)`` (``m1``
        shaped to broadcast against the data, ``m2`` and ``v`` of shape
        (C,)): the (scale, shift) that normalize ``x - m1``, each shaped like
        ``m1``; ``data``'s shape gives the sample count."""
        out = self._functions[F](*moments, *params, data, **call.arguments(), **self._arguments)
        return out[0], out[1]

    def _empty_slice(self, F, x, params, call):
        """A slice with no samples: MXNet's reductions give NaN and its reshapes
        divide by zero on it, so the operator gets zero moments (the count,
        from the shape, is 0) and still joins both exchanges; the empty output
        depends on scale so that its backward runs too."""
        dtype = call.dtype
        axis = self.layer.axis % x.ndim
        centre = [1] * x.ndim
        centre[axis] = x.shape[axis]
        stat = 'float32' if dtype in LOW_PRECISION else dtype
        m1 = F.zeros(tuple(centre), ctx=x.context, dtype=stat)
        zeros = F.zeros((x.shape[axis],), ctx=x.context, dtype=stat)
        scale, _ = self._exchange(F, (m1, zeros, zeros), x, params, call)
        # Not broadcast_add: its backward over a size-0 array segfaults in 1.9.1.
        return F.broadcast_mul(x, F.Cast(scale, dtype=operator_dtype(dtype)))
