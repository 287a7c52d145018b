"""The graph around the vector operators: the exchange operator (GPUs) and the
Python operator (the fallback, and every cross-process job).

MXNet's own operators compute each device's per-channel moments of the input
(on the device, on GPUs), the operator synchronizes those vectors into the
(scale, shift) that normalize, and MXNet's operators apply them. The
asynchronous operator (CPU contexts) needs none of this: it takes the whole
call (``block.SyncBatchNorm._forward``).
"""
from mxnet.gluon.parameter import DeferredInitializationError

from . import native
from . import op as _op
from .hooks import CENTER_OP, request_retrace
from .mxnet_private import amp_initialized, dtype_name, operator_dtype
from .registry import SETUP_LOCK

__all__ = ['LOW_PRECISION', 'VectorGraph', 'channel_affine', 'ChannelMoments']

# Input dtypes whose statistics are computed in (at least) float32.
LOW_PRECISION = ('float16', 'bfloat16')


def channel_affine(F, x, scale, shift, channels, name=None):
    """``x * scale + shift`` per channel, for ``x`` in the layer's working view
    and ``scale``, ``shift`` of shape (1, C, 1, ...) like the means.

    With ``channels`` given (``x`` is then (N, C, 1, L)), as a depthwise 1x1
    convolution: the same maths, and its weight and bias gradients are the
    per-channel sums of ``dy * x`` and ``dy`` that broadcast_mul/add would give,
    but it runs in MKL-DNN's fused kernels, 5-10x cheaper than those two, whose
    backward reductions dominated the layer's time on CPU. ``channels=0``: the
    broadcast operators.
    """
    if channels <= 0:
        return F.broadcast_add(F.broadcast_mul(x, scale), shift)
    # transpose and squeeze, not reshape: see ChannelMoments on temp space.
    return F.Convolution(x, F.transpose(scale, axes=(1, 0, 2, 3)),
                         F.squeeze(shift, axis=(0, 2, 3)), kernel=(1, 1),
                         num_filter=channels, num_group=channels, name=name)


class ChannelMoments(object):
    """Per-channel statistics of tensors shaped like ``like``, as the operator takes them.

    ``fast=False``: MXNet's ``mean`` over every axis but the channel ``axis``.
    ``fast=True`` (``like`` is the (N, C, 1, L) view): the sums of each
    (sample, channel) row, shape (N, C, 1, 1): FullyConnected over the last
    axis with a row of ones, whose forward and backward run as MKL GEMV/GEMM,
    4-5x cheaper on CPU than ``mean``, which reduces over non-contiguous axes.
    The operator adds the rows up and divides by the count itself.

    Every operator here that needs MXNet's temp space (reductions, slice,
    FullyConnected, convolutions, reshapes under MKL-DNN) holds one more shared
    slot, which sets the deadlock bound (see :mod:`gluon_syncbn.engine`), so
    the fast path uses them only where the data needs them, and for one sum
    of the ones row.
    """

    def __init__(self, F, like, fast, axis=1):
        self._F = F
        self._fast = fast
        self._axis = axis
        if fast:
            row = F.slice_axis(F.slice_axis(like, axis=0, begin=0, end=1), axis=1, begin=0, end=1)
            self._ones = F.BlockGrad(F.ones_like(F.squeeze(row, axis=(1, 2))))  # (1, L)
            self._mean_row = F.broadcast_div(self._ones, F.sum(self._ones))  # (1, L) of 1/L

    def __call__(self, x, keepdims=True):
        F = self._F
        if not self._fast:
            return F.mean(x, axis=self._axis, exclude=True, keepdims=keepdims)
        return F.FullyConnected(x, self._ones, num_hidden=1, no_bias=True, flatten=False)

    def centre(self, x):
        """A (1, C, 1, ...) estimate of the mean to centre on. A centre k standard
        deviations off costs the variance a factor 1 + k^2 of float32 rounding.
        Fast: the first sample's mean (1/N of the data), for which k^2 <= N - 1
        whatever the data (Cauchy-Schwarz). One element is not enough: in a
        deep net a corner pixel (zero padding) of a near-constant channel lay
        thousands of standard deviations off, and a 20-layer net's parameters
        came out 10% wrong."""
        if not self._fast:
            return self(x)
        first = self._F.slice_axis(x, axis=0, begin=0, end=1)
        return self._F.FullyConnected(first, self._mean_row, num_hidden=1, no_bias=True,
                                      flatten=False)


class VectorGraph(object):
    """One training call of a layer whose group synchronizes per-channel vectors.

    Parameters
    ----------
    group : registry.SyncGroup
        The layer's group; its ``operator`` is 'exchange' or 'python'.
    dtype : str
        The input's dtype (in a traced graph: the network's, see ``cast``).
    kwargs : dict
        The layer's ``axis``, ``eps``, ``momentum`` and ``fix_gamma``.
    static_shape : bool
        The graph is hybridized with ``static_shape=True``.
    fast_ops : bool
        MKL-DNN runs the moments and the affine (float32 on CPU contexts).
    gamma : Parameter
        The layer's gamma: its channel count (0 until known) and dtype.
    """

    def __init__(self, group, dtype, kwargs, static_shape, fast_ops, gamma):
        self.group = group
        self.dtype = dtype
        self.kwargs = kwargs
        self.static_shape = static_shape
        self.fast_ops = fast_ops
        self.channels = (gamma.shape or (0,))[0]
        self.param_dtype = dtype_name(gamma.dtype)
        # The exchange operator's functions if this group's calls use it (the
        # GPU path, where the self-test passed), else None: the Python operator.
        self.exchange = native.exchange_operator() if group.operator == 'exchange' else None

    def __call__(self, F, x, gamma, beta, running_mean, running_var, imperative):
        """The layer's output for ``x``, normalized with the statistics of every device."""
        if not imperative and self.static_shape and self.exchange is not None:
            try:
                self.group.register_running_arrays()
            except DeferredInitializationError:
                request_retrace()  # shapes are known after the first call
        if imperative and x.size == 0:
            return self._empty_slice(F, x, gamma, beta, running_mean, running_var)
        if imperative and self.exchange is not None:
            op, order = self._cached_op()
            arrays = (x, gamma, beta, running_mean, running_var)
            return op(*[arrays[i] for i in order])
        return self._graph(F, x, gamma, beta, running_mean, running_var, imperative)

    def _cached_op(self):
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
        ``registry.Session.clear_failed_arrays``.

        Returns ``(op, order)``: ``op`` takes (x, gamma, beta, running_mean,
        running_var) permuted by ``order``, the order of its inputs.
        """
        key = (self.dtype, self.param_dtype, amp_initialized())
        cached = self.group.imperative_graphs.get(key)
        if cached is None:
            with SETUP_LOCK:  # traced once, whichever device's thread comes first
                cached = self.group.imperative_graphs.get(key)
                if cached is None:
                    cached = self.group.imperative_graphs[key] = self._trace()
        return cached

    def _trace(self):
        """``(op, order)`` of :meth:`_cached_op`, traced now."""
        from mxnet import ndarray, symbol
        names = ('data', 'gamma', 'beta', 'running_mean', 'running_var')
        # Traced as imperative: the input's dtype is known.
        out = self._graph(symbol, *[symbol.var(n) for n in names], imperative=True)
        order = [names.index(n) for n in out.list_inputs()]
        return ndarray.CachedOp(out, flags=[('static_alloc', True)]), order

    def _graph(self, F, x, gamma, beta, running_mean, running_var, imperative):
        """The operators of a call; ``imperative``: ``x`` has dtype ``self.dtype``
        (an NDArray, or traced for an imperative call's CachedOp)."""
        dtype = self.dtype
        half = dtype in LOW_PRECISION
        # Statistics in at least float32: float16 input is widened, then narrowed back.
        xs = F.Cast(x, dtype='float32') if half else x
        if (not imperative and dtype == 'float32' and not self.group.host_memory
                and amp_initialized()):
            # Under AMP (amp.init()) a traced graph is fed float16 it cannot
            # see: amp_cast widens float16/bfloat16 and leaves float32 alone.
            # (Not for float64 networks: on CPU it is MKL-DNN's and refuses it.)
            xs = F.amp_cast(x, dtype='float32')
        if self.exchange is not None:
            out = self._exchange_graph(F, xs, gamma, beta, running_mean, running_var)
        else:
            out = self._python_graph(F, x, xs, gamma, beta, running_mean, running_var, imperative)
        # The head gradient enters through the last operator: Cast's and
        # reshape_like's backward convert it to the output's dtype, where
        # MXNet's broadcast operators would refuse any other (AMP makes
        # float16 heads for float32 outputs).
        if half:
            return F.Cast(out, dtype=operator_dtype(dtype))
        return F.reshape_like(out, xs) if self.exchange is not None else out

    def _exchange_graph(self, F, xs, gamma, beta, running_mean, running_var):
        """The exchange operator's graph: 12 operators (13 with the caller's
        reshape_like), each a kernel on a GPU.

        The centre m1 is the mean MXNet computes, a constant to autograd (the
        output does not depend on it), blocked at its input: blocked at its
        output, the mean's backward would still run. m2 corrects m1's float32
        rounding, which at |mean| >> std is large against the std.
        """
        axis = self.kwargs['axis']
        m1 = F.mean(F.BlockGrad(xs), axis=axis, exclude=True, keepdims=True)
        xc = F.broadcast_sub(xs, m1)
        m2 = F.mean(xc, axis=axis, exclude=True)
        v = F.mean(F.square(xc), axis=axis, exclude=True)
        scale, shift = self._exchange(F, F.reshape(m1, shape=(-1,)), m2, v, xc, gamma, beta,
                                      running_mean, running_var, self.static_shape)
        return F.broadcast_add(F.broadcast_mul(xc, scale), shift)

    def _exchange(self, F, m1, m2, v, data, gamma, beta, running_mean, running_var,
                  static_shape):
        """The exchange operator on this device's (C,) moments: the (scale,
        shift) that normalize ``x - m1``, each shaped to broadcast against
        ``data``, whose shape gives the sample count."""
        kwargs = self.kwargs
        stat = 'float64' if self.dtype == 'float64' else 'float32'
        g, b = ((gamma, beta) if self.param_dtype == stat else
                (F.Cast(gamma, dtype=stat), F.Cast(beta, dtype=stat)))
        out = self.exchange[F](F.concat(m1, m2, v, g, b, dim=0), data, gamma, beta,
                               running_mean, running_var, group=self.group.group_id,
                               eps=kwargs['eps'], momentum=kwargs['momentum'],
                               fix_gamma=kwargs['fix_gamma'], static_shape=static_shape,
                               axis=kwargs['axis'], input_dtype=self.dtype, name='sync')
        return F.split(out, num_outputs=2, axis=0, squeeze_axis=True)

    def _python_graph(self, F, x, xs, gamma, beta, running_mean, running_var, imperative):
        """The Python operator's graph, with MKL-DNN's fast operators where
        they run (see ChannelMoments and channel_affine)."""
        axis = self.kwargs['axis']
        # The fast operators (see channel_affine and ChannelMoments) need the
        # channel count: known in imperative mode; while a deferred-init graph
        # is traced, not yet, so the graph is traced once more after its first
        # call. Only where MKL-DNN runs them (float32 on CPU): without it, 20-layer
        # nets on 4 CPU contexts deadlocked in MXNet's own convolution and
        # FullyConnected (GPUs: untested, so MXNet's broadcast operators there).
        channels = 0
        if axis == 1 and self.fast_ops and self.dtype != 'float64':
            channels = x.shape[axis] if imperative else self.channels
            if channels == 0:
                request_retrace()
        if channels:
            # The convolutions' and FullyConnected's view: (N, C, 1, L).
            xs = F.reshape(xs, shape=(0, 0, 1, -1))
        elif axis == 1:
            # NCHW and friends: MXNet reduces over (0, 2) of an (N, C, L) view
            # markedly faster than over (0, 2, 3, ...) of the input.
            xs = F.reshape(xs, shape=(0, 0, -1))
        moments = ChannelMoments(F, xs, fast=channels > 0, axis=axis)
        # The centre is a constant to autograd: the output does not depend on
        # it, so the gradient reaches x through m2, sqdev and xc alone. (Blocked
        # at its input, not its output: MXNet 1.9.1's autograd segfaulted on a
        # FullyConnected whose output gradient was blocked.)
        m1 = moments.centre(F.BlockGrad(xs))
        if channels:
            # Named: its shape check is the first to see a wrong channel count
            # in a hybridized graph (see hooks.CENTER_OP).
            xc = channel_affine(F, xs, F.ones_like(m1), -m1, channels, name=CENTER_OP)
        else:
            xc = F.broadcast_sub(xs, m1)
        m2 = moments(xc)
        sqdev = moments(F.square(xc))
        scale, shift = self._python_op(F, m1, m2, sqdev, F.BlockGrad(F.shape_array(x)),
                                       gamma, beta, running_mean, running_var,
                                       self.static_shape, channels > 0)
        out = channel_affine(F, xc, scale, shift, channels)
        if channels:
            # Through a 3-D shape: reshaped straight back to 4-D, the
            # convolution's output kept its MKL-DNN (N, C, 1, L) layout, and a
            # Pooling after the layer then failed in backward (hybridized).
            out = F.squeeze(out, axis=2)
        # Also where no reshape happened (axis other than 1): the head
        # gradient enters through reshape_like, which converts its dtype.
        return F.reshape_like(out, x)

    def _python_op(self, F, m1, m2, sqdev, shape, gamma, beta, running_mean, running_var,
                   static_shape, row_sums):
        """The Python operator (op.py): the (scale, shift) that normalize ``x - m1``."""
        kwargs = self.kwargs
        scale, shift, _ = F.Custom(
            m1, m2, sqdev, shape, gamma, beta, running_mean, running_var,
            op_type=_op.OP_TYPE,
            group=self.group.group_id, eps=kwargs['eps'], momentum=kwargs['momentum'],
            fix_gamma=kwargs['fix_gamma'], static_shape=static_shape, row_sums=row_sums,
            input_dtype=self.dtype, name='sync')
        return scale, shift

    def _empty_slice(self, F, x, gamma, beta, running_mean, running_var):
        """A slice with no samples: MXNet's reductions give NaN and its reshapes
        divide by zero on it, so the operator gets zero moments (the count,
        from the shape, is 0) and still joins both exchanges; the empty output
        depends on scale so that its backward runs too."""
        dtype = self.dtype
        axis = self.kwargs['axis'] % x.ndim
        stat_shape = tuple(x.shape[axis] if i == axis else 1 for i in range(x.ndim))
        zeros = F.zeros(stat_shape, ctx=x.context,
                        dtype='float32' if dtype in LOW_PRECISION else dtype)
        if self.exchange is not None:
            flat = zeros.reshape(-1)
            scale, _ = self._exchange(F, flat, flat, flat, x, gamma, beta, running_mean,
                                      running_var, False)
        else:
            scale, _ = self._python_op(F, zeros, zeros, zeros, F.shape_array(x), gamma, beta,
                                       running_mean, running_var, False, False)
        # Not broadcast_add: its backward over a size-0 array segfaults in 1.9.1.
        return F.broadcast_mul(x, F.Cast(scale, dtype=operator_dtype(dtype)))
