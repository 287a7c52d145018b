"""The Python backend: the fallback where the native operators cannot run
(no C++ compiler, a failed self-test), in one process only.

MXNet's operators compute the local moments and apply the (scale, shift) the
custom operator (:mod:`.python_op`) computes from the vectors of every
device, which meet at a :class:`~gluon_syncbn.barrier.CallOrderBarrier`.
"""
import os

import numpy as np

from .. import messages, wire
from ..barrier import CallOrderBarrier
from ..cpu_contexts import in_host_memory, mkldnn_active
from ..errors import SyncBatchNormError
from ..hooks import CENTER_OP, request_retrace
from ..session import SESSION
from . import python_op
from .vector_graph import VectorBackend

__all__ = ['PythonBackend', 'channel_affine', 'ChannelMoments']


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
    slot, which sets the deadlock bound (see :mod:`gluon_syncbn.cpu_contexts`), so
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


class PythonBackend(VectorBackend):
    """The Python operator's backend; see :class:`~.base.Backend`."""

    name = 'python'

    def __init__(self, layer, devices, transport):
        super(PythonBackend, self).__init__(layer, devices, transport)
        self.host_memory = in_host_memory(self.devices)
        # MKL-DNN runs the moments and the affine (float32 on CPU contexts).
        self._fast_ops = (mkldnn_active() and self.host_memory and
                          os.environ.get('GLUON_SYNCBN_CONV_NORMALIZE', '1') != '0')
        self.barrier = CallOrderBarrier(self.layer_name, self.devices, self.timeout, SESSION,
                                        hint=self.hint)
        self.handle = python_op.register(self)

    def fail_pending(self, cause):
        self.barrier.fail_pending(cause)

    def device_index(self, ctx):
        ctx = str(ctx)
        try:
            return self.devices.index(ctx)
        except ValueError:
            raise SyncBatchNormError(messages.text(
                'wrong_device', layer=self.layer_name, device=ctx,
                devices=', '.join(self.devices)))

    def reduce(self, key, values):
        """The meeting ``key`` (see :mod:`.python_op`): check that the
        devices agree, then sum their float64 vectors per sync group in
        device order. Returns one row per sync group."""
        sizes = {i: v[0].size for i, v in values.items()}
        dtypes = {i: v[1] for i, v in values.items()}
        if len(set(sizes.values())) > 1:
            raise SyncBatchNormError(messages.text(
                'channels_disagree', layer=self.layer_name, channels=', '.join(
                    '%s: %d' % (self.devices[i], wire.channels_of(key[0], v[0]))
                    for i, v in sorted(values.items()))))
        if len(set(dtypes.values())) > 1:
            raise SyncBatchNormError(messages.text(
                'dtypes_disagree', layers="'%s'" % self.layer_name, dtypes=', '.join(
                    '%s: %s' % (self.devices[i], d) for i, d in sorted(dtypes.items()))))
        size = next(iter(values.values()))[0].size
        stacked = np.zeros((len(self.sync_groups), size))
        for i in sorted(values):
            stacked[self.sync_group_of[i]] += values[i][0]
        for g in sorted(set(self.sync_group_of)):
            if key[0] == 'fwd' and stacked[g][0] <= 0:  # FORWARD: n
                raise SyncBatchNormError(messages.text(
                    'empty_batch', layer=self.layer_name,
                    where=messages.text('in_sync_group', group=g)
                    if len(self.sync_groups) > 1 else ''))
        return stacked

    def _graph(self, F, x, xs, gamma, beta, running_mean, running_var, dtype, static_shape,
               imperative):
        """With MKL-DNN's fast operators where they run (see ChannelMoments
        and channel_affine)."""
        axis = self.kwargs['axis']
        # The fast operators (see channel_affine and ChannelMoments) need the
        # channel count: known in imperative mode; while a deferred-init graph
        # is traced, not yet, so the graph is traced once more after its first
        # call. Only where MKL-DNN runs them (float32 on CPU): without it, 20-layer
        # nets on 4 CPU contexts deadlocked in MXNet's own convolution and
        # FullyConnected (GPUs: untested, so MXNet's broadcast operators there).
        channels = 0
        if axis == 1 and self._fast_ops and dtype != 'float64':
            channels = x.shape[axis] if imperative else (self._layer().gamma.shape or (0,))[0]
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
                                       gamma, beta, running_mean, running_var, dtype,
                                       static_shape, channels > 0)
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
                   dtype, static_shape, row_sums):
        """The Python operator: the (scale, shift) that normalize ``x - m1``."""
        kwargs = self.kwargs
        scale, shift, _ = F.Custom(
            m1, m2, sqdev, shape, gamma, beta, running_mean, running_var,
            op_type=python_op.OP_TYPE, group=self.handle, eps=kwargs['eps'],
            momentum=kwargs['momentum'], fix_gamma=kwargs['fix_gamma'],
            static_shape=static_shape, row_sums=row_sums, input_dtype=dtype, name='sync')
        return scale, shift

    def _empty_scale(self, F, zeros, x, gamma, beta, running_mean, running_var, dtype):
        scale, _ = self._python_op(F, zeros, zeros, zeros, F.shape_array(x), gamma, beta,
                                   running_mean, running_var, dtype, False, False)
        return scale

