"""The custom operator that synchronizes one SyncBatchNorm call across devices.

It has the exchange operator's place in the graph (:mod:`.vector_graph`):
it sees only per-channel vectors, the local moments computed by MXNet's
native operators, gamma/beta and the running statistics, and never touches
the activations, so MKL-DNN's blocked layouts never reach Python. Reading and
writing its small arrays are direct copies (on GPUs, MXNet copies it does
not wait for), so nothing it does can queue behind work that waits for it.

Data flow of one training call on device ``d``::

    local moments --> forward_contribution --> barrier (all devices, call #k)
        --> backend.reduce: sum per sync group --> merge --> scale, shift  (and running stats)

and of its backward::

    d scale, d shift --> backward_contribution --> barrier (key of call #k)
        --> backend.reduce: sum per sync group --> local_moment_grads, d gamma, d beta

It runs in one process only: across processes the native operators are required.
"""
import itertools
import weakref

import numpy as np
import mxnet as mx
from mxnet.ndarray.ndarray import _DTYPE_MX_TO_NP

from .. import messages, stats, wire
from ..errors import SyncBatchNormError, record_failure
from ..mxnet_private import fail_custom_call, host_view
from ..session import SESSION

OP_TYPE = '_gluon_syncbn'

# The Python backends by handle: MXNet creates a custom operator from string
# arguments only, and the operator finds its layer's backend here.
_backends = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def register(backend):
    """A handle for ``backend``, the operator's ``layer`` argument."""
    handle = next(_handles)
    _backends[handle] = backend
    return handle


def _backend(handle):
    backend = _backends.get(int(handle))
    if backend is None:
        raise SyncBatchNormError(messages.text('unknown_layer', layer=handle))
    return backend


def _write(dst, req, value, in_place):
    """Store a NumPy value into a callback array: in place (``in_place``: host
    memory, no operator issued) or by a copy through MXNet (GPUs)."""
    if req == 'null':
        return
    value = np.asarray(value, dtype=dst.dtype).reshape(dst.shape)
    view = host_view(dst) if in_place else None
    if view is None:
        dst[:] = value + dst.asnumpy() if req == 'add' else value
    elif req == 'add':
        view += value
    else:
        view[...] = value


def _read(arr):
    return arr.asnumpy().astype(np.float64).ravel()


def _count(shape, channels):
    """Samples per channel on this device, from the input's ``shape_array``."""
    return int(np.prod(shape.asnumpy())) // max(channels, 1)


class SyncBatchNormOp(mx.operator.CustomOp):
    """One device's instance of the synchronization operator."""

    def __init__(self, backend, device, eps, momentum, fix_gamma, input_dtype):
        super(SyncBatchNormOp, self).__init__()
        self.input_dtype = input_dtype
        self.backend = backend
        self.device = device
        self.eps = eps
        self.momentum = momentum
        self.fix_gamma = fix_gamma
        self.in_place = backend.host_memory
        self.sync_group = backend.sync_group_of[device]  # our row of the reduced sums
        # The step this call was issued in: MXNet makes the operator when the
        # call is issued (hooks makes no static_shape graph for its layers,
        # which would make it once).
        self.token = SESSION.issue_token()

    def forward(self, is_train, req, in_data, out_data, aux):
        try:
            self._forward(is_train, req, in_data, out_data, aux)
        except Exception as exc:  # pylint: disable=broad-except
            self._fail(in_data[0], in_data[1], exc)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        try:
            self._backward(req, out_grad, in_data, out_data, in_grad, aux)
        except Exception as exc:  # pylint: disable=broad-except
            self._fail(in_grad[0], in_grad[1], exc)

    def _fail(self, hold, probe, exc):
        record_failure(exc)
        fail_custom_call(hold, probe, exc, SESSION.native)
        self.backend.note_failed([hold])

    def _forward(self, is_train, req, in_data, out_data, aux):
        m1, m2, v = (_read(a) for a in in_data[:3])
        count = _count(in_data[3], m1.size)
        gamma = np.ones_like(m1) if self.fix_gamma else _read(in_data[4])
        beta = _read(in_data[5])
        if not is_train:
            mean, var = _read(aux[0]), _read(aux[1])
            token, call, n = -1, -1, 0
        else:
            barrier = self.backend.barrier
            key = barrier.next_forward_key(self.device, self.token)
            contribution = stats.forward_contribution(count, m1, m2, v)
            total = barrier.meet(key, self.device, (contribution, self.input_dtype),
                                 self.backend.reduce, token=self.token)[self.sync_group]
            n, mean, var = stats.merge(total)
            self.backend.add_to_tally(self.device, n, mean, var)
            self._update_running(aux, mean, var)
            if self.fix_gamma:  # as nn.BatchNorm's training forward leaves it
                _write(in_data[4], 'write', np.ones(in_data[4].shape), self.in_place)
            token, call = key[1], key[2]
        scale, shift, _ = stats.normalize_coefficients(mean, var, m1, gamma, beta, self.eps)
        _write(out_data[0], req[0], scale, self.in_place)
        _write(out_data[1], req[1], shift, self.in_place)
        _write(out_data[2], req[2], wire.pack_info(token, call, n, mean, var), self.in_place)

    def _update_running(self, aux, mean, var):
        # The running statistics are this call's to write: it never runs in a
        # static_shape graph (hooks makes none for its layers), where MXNet
        # would hold them as read-only inputs.
        mom = self.momentum
        _write(aux[0], 'write', _read(aux[0]) * mom + mean * (1.0 - mom), self.in_place)
        _write(aux[1], 'write', _read(aux[1]) * mom + var * (1.0 - mom), self.in_place)

    def _backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        token, call, n, mean, var = wire.unpack_info(_read(out_data[2]))
        channels = mean.size
        if call < 0:
            raise SyncBatchNormError(messages.text('inference_backward', layer=self.backend.layer_name))
        m1 = _read(in_data[0])
        count = _count(in_data[3], channels)
        gamma = np.ones_like(m1) if self.fix_gamma else _read(in_data[4])
        inv_std = 1.0 / np.sqrt(var + self.eps)
        # An empty slice adds nothing (MXNet leaves its reductions over size-0
        # arrays unwritten, so its gradients here are not even zeros).
        d_scale, d_shift = ((_read(out_grad[0]), _read(out_grad[1])) if count > 0
                            else (np.zeros(channels), np.zeros(channels)))
        contribution, d_gamma, d_beta = stats.backward_contribution(
            d_scale, d_shift, mean, m1, inv_std)
        key = ('bwd', token, call)  # the forward's: a call of a failed step raises
        total = self.backend.barrier.meet(key, self.device, (contribution, self.input_dtype),
                                          self.backend.reduce, token=token)[self.sync_group]
        d_m2, d_v = stats.local_moment_grads(total, count, n, mean, m1 + _read(in_data[1]),
                                             gamma, inv_std)
        _write(in_grad[0], req[0], 0, self.in_place)  # m1 is a constant (BlockGrad in the block)
        _write(in_grad[1], req[1], d_m2, self.in_place)
        _write(in_grad[2], req[2], d_v, self.in_place)
        _write(in_grad[3], req[3], 0, self.in_place)
        _write(in_grad[4], req[4], 0 if self.fix_gamma else d_gamma, self.in_place)
        _write(in_grad[5], req[5], d_beta, self.in_place)


@mx.operator.register(OP_TYPE)
class SyncBatchNormProp(mx.operator.CustomOpProp):
    """Shapes, types and construction of :class:`SyncBatchNormOp`.

    ``declare_backward_dependency`` is left at MXNet's default on purpose:
    mx.operator keeps one process-wide copy of it, and overriding it would break
    other custom operators that rely on the default.
    """

    def __init__(self, layer, eps, momentum, fix_gamma, axis, input_dtype='float32'):
        super(SyncBatchNormProp, self).__init__(need_top_grad=True)
        self.handle = layer
        self.eps = float(eps)
        self.momentum = float(momentum)
        self.fix_gamma = fix_gamma in ('True', 'true', '1')
        self.axis = int(axis)
        self.input_dtype = input_dtype

    def list_arguments(self):
        return ['mean', 'residual', 'sqdev', 'shape', 'gamma', 'beta']

    def list_outputs(self):
        return ['scale', 'shift', 'info']

    def list_auxiliary_states(self):
        return ['running_mean', 'running_var']

    def infer_shape(self, in_shape):
        """The moments (m1 shaped to broadcast against the input, m2 and v
        (C,)) and the input's shape in; scale and shift shaped to broadcast
        against the input, and the info vector, out."""
        backend = _backend(self.handle)
        channels = int(np.prod(in_shape[0]))
        ndim = tuple(in_shape[3])[0] if len(in_shape) > 3 and len(in_shape[3]) else 0
        if ndim > 0 and not 2 <= ndim <= 5:
            self._fail_shape(messages.text('bad_ndim', layer=backend.layer_name, ndim=ndim))
        for i in (4, 5, 6, 7):  # gamma, beta, running_mean, running_var
            given = tuple(in_shape[i]) if i < len(in_shape) else ()
            known = given and all(d > 0 for d in given)
            if known and int(np.prod(given)) != channels:
                self._fail_shape(messages.text('wrong_channels', layer=backend.layer_name,
                                               channels=channels,
                                               axis=backend.kwargs['axis'],
                                               expected=int(np.prod(given))))
        vec = (channels,)
        stat_shape = tuple(channels if i == self.axis % max(ndim, 1) else 1
                           for i in range(ndim))
        centre = tuple(in_shape[0]) or vec  # shaped to broadcast, as the block computes it
        return ([centre, vec, vec, (ndim,) if ndim > 0 else (0,), vec, vec],
                [stat_shape, stat_shape, (wire.info_size(channels),)],
                [vec, vec])

    @staticmethod
    def _fail_shape(message):
        exc = SyncBatchNormError(message)
        record_failure(exc)
        SESSION.fail_step(exc)  # devices already issued would otherwise wait for this one
        raise exc

    def infer_type(self, in_type):
        dtype = in_type[0]
        if dtype is not None and np.dtype(dtype) == np.float16:
            self._fail_shape(messages.text('float16_statistics',
                                           layer=_backend(self.handle).layer_name))
        param = in_type[4] if in_type[4] is not None else np.float32
        return ([dtype] * 3 + [np.int64, param, param],
                [dtype, dtype, np.float64],
                [param, param])

    def create_operator(self, ctx, in_shapes, in_dtypes):
        backend = _backend(self.handle)
        device = backend.device_index(ctx)
        # The graph's own dtype (float32 for float16 input widened by the
        # block) and the input's dtype as the block saw it must both agree.
        stats_dtype = np.dtype(_DTYPE_MX_TO_NP[in_dtypes[0]]).name  # MXNet type code
        dtype = '%s (statistics in %s)' % (self.input_dtype, stats_dtype)
        return SyncBatchNormOp(backend, device, self.eps, self.momentum, self.fix_gamma, dtype)
