"""The Python backend: the fallback where the native operators cannot run
(no C++ compiler, a failed self-test), in one process only.

The graph is the exchange operator's (:mod:`.vector_graph`); the custom
operator (:mod:`.python_op`) computes the (scale, shift) from the vectors of
every device, which meet at a :class:`~gluon_syncbn.barrier.CallOrderBarrier`.
"""
import threading

import numpy as np

from .. import messages, wire
from ..barrier import CallOrderBarrier
from ..cpu_contexts import on_cpu_path
from ..errors import SyncBatchNormError
from ..session import SESSION
from ..stats import Tally
from . import python_op
from .vector_graph import VectorBackend

__all__ = ['PythonBackend']


class PythonBackend(VectorBackend):
    """The Python operator's backend; see :class:`~.base.Backend`."""

    name = 'python'
    tallying = False

    def __init__(self, layer, devices, transport):
        super(PythonBackend, self).__init__(layer, devices, transport)
        self.host_memory = on_cpu_path(self.devices)
        self.barrier = CallOrderBarrier(self.layer_name, self.devices, self.timeout, SESSION,
                                        hint=self.hint)
        self.handle = python_op.register(self)
        self._tallies = None  # a Tally per device while tallying
        self._tally_lock = threading.Lock()
        self._failed_arrays = []  # arrays failed calls left their error on

    def note_failed(self, arrays):
        """A call failed with its error on ``arrays`` (see ``fail_custom_call``):
        cleared at the next step's first call (:meth:`clear_failed_state`)."""
        self._failed_arrays.extend(arrays)

    def clear_failed_state(self):
        failed, self._failed_arrays = self._failed_arrays, []
        for arr in failed:
            try:
                arr.wait_to_read()  # clears the error every array it reached shares
            except Exception:  # pylint: disable=broad-except
                pass  # the error of the aborted step, already reported
        super(PythonBackend, self).clear_failed_state()

    def forward(self, F, x, gamma, beta, running_mean, running_var, dtype, static_shape,
                imperative):
        if imperative:
            # The devices' input dtypes are compared as the calls are issued,
            # not only at the barrier: found there, the failure would complete
            # every device's custom-operator call at once, which MXNet's
            # unlocked list of engine errors cannot take without the native
            # library (mxnet_private, "Failures").
            SESSION.check_dtypes(self, "'%s'" % self.layer_name, len(self.devices),
                                 x.context, dtype)
        return super(PythonBackend, self).forward(F, x, gamma, beta, running_mean,
                                                  running_var, dtype, static_shape, imperative)

    def start_tally(self):
        with self._tally_lock:
            self._tallies = [Tally() for _ in self.devices]
            self.tallying = True

    def stop_tally(self):
        self.tallying = False

    def tally(self, device):
        with self._tally_lock:
            return self._tallies[device] if self._tallies else Tally()

    def add_to_tally(self, device, n, mean, var):
        """Tally a training call's global statistics on ``device``, if tallying."""
        if not self.tallying:
            return  # every training call comes here: no lock unless tallying
        with self._tally_lock:
            if self.tallying:
                self._tallies[device].add(n, mean, var)

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

    def _exchange(self, F, m1, m2, v, data, gamma, beta, running_mean, running_var, dtype,
                  static_shape):
        kwargs = self.kwargs
        scale, shift, _ = F.Custom(
            m1, m2, v, F.BlockGrad(F.shape_array(data)), gamma, beta, running_mean,
            running_var, op_type=python_op.OP_TYPE, layer=self.handle, eps=kwargs['eps'],
            momentum=kwargs['momentum'], fix_gamma=kwargs['fix_gamma'], axis=kwargs['axis'],
            input_dtype=dtype, name='sync')
        return scale, shift
