"""The SyncBatchNorm layer: arguments, parameters, input checks, and when
it synchronizes. How it does is its backend's business (:mod:`.backends`);
what it puts in a traced graph is ``nn.BatchNorm``'s node, marked
(:mod:`.traced`), which :mod:`.graphs` binds to its backend when a block
builds its cached graph."""
import copy
import os

from mxnet import autograd, ndarray
from mxnet.gluon import nn
from mxnet.util import is_np_array, is_np_shape

from . import messages
from .backends import make_backend
from .backends.base import Call, Layer, Params
from .backends.vector_graph import LOW_PRECISION
from .cpu_contexts import check_cpu_contexts, is_naive_engine
from .errors import SyncBatchNormError, ours_behind
from .gpus import check_gpus
from .groups import check_sync_groups
from .mxnet_private import dtype_name
from .session import SESSION, SETUP_LOCK
from .traced import MARK, token_of
from .transport import make_transport

__all__ = ['SyncBatchNorm', 'adopt_parameters', 'is_sync_batchnorm', 'use_network_check']

# Seconds a device waits for the other devices of its process, and a worker
# for the other workers: those may pause far longer in a healthy job (an
# evaluation or a checkpoint on one worker only; torch's default for its
# collectives is 30 minutes), and a worker that dies ends the job at once
# by other means (transport.py, launch.py).
DEFAULT_TIMEOUT = 180.0
DEFAULT_REMOTE_TIMEOUT = 1800.0


def timeouts(timeout):
    """``(in the process, across workers)`` for ``SyncBatchNorm(timeout=...)``:
    ``timeout`` for both, else ``GLUON_SYNCBN_TIMEOUT`` for both, else the
    defaults."""
    value = os.environ.get('GLUON_SYNCBN_TIMEOUT') if timeout is None else timeout
    if value is None or value == '':
        return DEFAULT_TIMEOUT, DEFAULT_REMOTE_TIMEOUT
    return float(value), float(value)


# What a layer's first training call that synchronizes runs, given the layer
# and its number of devices: the check of the network calling it
# (graphs.check_network, which hooks.install hands over: block.py does not
# import graphs).
_network_check = [lambda layer, num_devices: None]


def use_network_check(check):
    """Called by ``hooks.install``: ``check(layer, num_devices)``."""
    _network_check[0] = check


class SyncBatchNorm(nn.BatchNorm):
    """Batch normalization with statistics over the whole batch on all devices.

    A drop-in replacement for :class:`mxnet.gluon.nn.BatchNorm`, and one
    (``isinstance(layer, nn.BatchNorm)``): same arguments, defaults and
    parameter names (``gamma``, ``beta``, ``running_mean``, ``running_var``),
    so parameter files move between the two. In training mode
    each call meets the same call on the other devices (the k-th call on each
    device belongs together) and normalizes with the mean and variance of the
    concatenated batch, for any split, uneven ones included. Gradients are those
    of one BatchNorm on the concatenated batch; ``gamma``/``beta`` gradients stay
    per device and the Trainer sums them like any other parameter's.

    Parameters
    ----------
    axis : int, default 1
        The channel axis (1 for NCHW, -1 or 3 for NHWC).
    momentum : float, default 0.9
        ``running = running * momentum + batch * (1 - momentum)``.
    epsilon : float, default 1e-5
        Added to the variance.
    center : bool, default True
        Add ``beta``. If False, ``beta`` is not learned.
    scale : bool, default True
        Multiply by ``gamma``. If False, ``gamma`` is treated as 1.
    use_global_stats : bool, default False
        Always normalize with the running statistics (no synchronization).
    beta_initializer, gamma_initializer : str or Initializer
        Default 'zeros' and 'ones'.
    running_mean_initializer, running_variance_initializer : str or Initializer
        Default 'zeros' and 'ones'.
    in_channels : int, default 0
        Number of channels; 0 defers initialization to the first call.
    num_devices : int or None, default None
        Devices taking part. None: the number of contexts the parameters were
        initialized on. Any other value must equal that number: across
        processes, this worker's devices only (not the job's).
    timeout : float or None, default None
        Seconds a device waits for the others before raising
        :class:`SyncBatchNormTimeout`; None reads ``GLUON_SYNCBN_TIMEOUT``,
        else 180 for the devices of one process and 1800 for other worker
        processes (a healthy job may pause that long on one worker: an
        evaluation on rank 0 only; a dead worker ends the job at once).
    kvstore : KVStore, 'horovod' or None, default None
        Synchronize with the devices of other worker processes too: the job's
        ``mx.kv.create('dist_sync')`` store (shared with a Trainer created with
        ``update_on_kvstore=False``), or ``'horovod'`` for ``horovod.mxnet``.
        None (or a local kvstore): this process's devices only.
    sync_groups : int, list of lists of int, or None, default None
        Normalize within groups of devices instead of over all of them: a
        group size (consecutive devices), or the groups as lists of device
        indices, e.g. ``[[0, 2], [1, 3]]``. Devices are numbered in the order
        of the contexts the parameters were initialized on; across processes,
        worker ``r``'s device ``i`` is ``r * devices_per_worker + i``. The
        groups must tile the devices. None: one group of all.

    Inputs:
        - **data**: input of 2 to 5 dimensions, float16, bfloat16, float32 or
          float64; an ``mx.np.ndarray`` in NumPy mode. A slice may be empty
          (0 samples, in NumPy shape mode): it takes part with count 0.

    Outputs:
        - **out**: output of the same shape and dtype as `data` (except on the
          GPU path in a graph whose types MXNet cannot infer when it is bound,
          which returns float32 for float16 input unless the network was cast
          with ``net.cast('float16')``: under AMP, AMP casts it onwards).

    Notes
    -----
    Running statistics take each training call's whole-batch mean and
    variance where ``nn.BatchNorm`` takes them on the same kind of device,
    for any number of calls per step: on CPU contexts in the call's backward
    pass, in the order MXNet runs the backward passes (a call with no
    backward leaves them alone), equal to ``nn.BatchNorm``'s; on GPUs in the
    forward pass, in call order, as cuDNN's does, but with the biased
    variance, as on CPU (cuDNN folds in the unbiased one). With
    ``hybridize(static_shape=True)`` read them after ``mx.nd.waitall()``.

    Called on a Symbol (a hybridized network's trace, or a backbone traced
    into a SymbolBlock, as GluonCV's feature extractors do) the layer is
    ``nn.BatchNorm``'s node, marked; the block that runs the graph makes it
    synchronize over the devices its Parameters live on, and ``export()``
    writes ``nn.BatchNorm``'s graph.

    Several CPU contexts share MXNet's CPU resources: call
    :func:`gluon_syncbn.configure_cpu_contexts` before MXNet runs its first
    operator, or the first synchronized call raises :class:`SyncBatchNormError`.
    """

    def __init__(self, axis=1, momentum=0.9, epsilon=1e-5, center=True, scale=True,
                 use_global_stats=False, beta_initializer='zeros', gamma_initializer='ones',
                 running_mean_initializer='zeros', running_variance_initializer='ones',
                 in_channels=0, num_devices=None, timeout=None, kvstore=None, sync_groups=None,
                 **kwargs):
        if num_devices is not None and (int(num_devices) != num_devices or num_devices < 1):
            raise ValueError('SyncBatchNorm: num_devices must be a positive integer or None, '
                             'got %r' % (num_devices,))
        # nn.BatchNorm's parameters (gamma, beta, running_mean, running_var),
        # and its _kwargs, which the operators take.
        super(SyncBatchNorm, self).__init__(
            axis=axis, momentum=momentum, epsilon=epsilon, center=center, scale=scale,
            use_global_stats=use_global_stats, beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            running_mean_initializer=running_mean_initializer,
            running_variance_initializer=running_variance_initializer,
            in_channels=in_channels, **kwargs)
        SyncBatchNorm.made_any = True
        self._num_devices = num_devices
        self._timeout, self._remote_timeout = timeouts(timeout)
        self._transport = make_transport(kvstore)
        self._sync_groups = check_sync_groups(sync_groups)
        self._sync_backend = None
        # The parameters' context list the checks passed for (a Parameter
        # keeps one list until it is initialized again), and whether the
        # layer synchronizes on it.
        self._checked_contexts = None
        self._synchronizes = False
        self._checked_shape = None  # the input shape the last imperative call checked
        self._input_dtype = 'float32'
        self._network_checked = False  # _network_check, at the first training call

    # Whether this process made a layer (a shadow too): until then no graph
    # holds one, and the hooks take MXNet's own path at once (a graph marked
    # in another process and loaded here runs as nn.BatchNorm's: README.md,
    # "Limits").
    made_any = False

    def _alias(self):
        return 'syncbatchnorm'  # names as before nn.BatchNorm was its base ('batchnorm')

    # What a copy (copy.deepcopy) or a pickle starts afresh: the backend and
    # the checks of the devices it synchronized on, which a copy makes for
    # itself at its first training call (so it never joins the original's
    # calls); and what graphs kept of it (its token in traced graphs: the
    # copy's traces name the copy).
    _FRESH = {'_sync_backend': None, '_checked_contexts': None, '_synchronizes': False,
              '_checked_shape': None, '_network_checked': False}

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if not k.startswith('_gluon_syncbn')}
        state.update(self._FRESH)
        return state

    def __setstate__(self, state):
        SyncBatchNorm.made_any = True  # a layer unpickled in a process that made none
        self.__dict__.update(state)

    def __deepcopy__(self, memo):
        # The copy shares the transport: one per store, holding locks and the
        # user's kvstore.
        memo[id(self._transport)] = self._transport
        # Python's own copy (as without a __deepcopy__: __reduce_ex__, which
        # takes __getstate__).
        reduced = self.__reduce_ex__(4)
        return copy._reconstruct(self, memo, *reduced)  # pylint: disable=protected-access

    def _deferred_infer_shape(self, *args):
        # Gluon wraps every failure of a deferred initialization in a
        # ValueError about shapes; ours (a missing configure step, a wrong
        # num_devices, a backend that cannot be had) are not about shapes.
        try:
            super(SyncBatchNorm, self)._deferred_infer_shape(*args)
        except ValueError as exc:
            ours = ours_behind(exc)
            if ours is None:
                raise
            raise ours from None

    @property
    def num_devices(self):
        """The number of devices synchronizing, once the parameters are initialized."""
        return len(self._devices())

    def cast(self, dtype):
        # Like nn.BatchNorm: float16 networks keep float32 parameters (bfloat16
        # ones too). We also remember the network's dtype, for a graph whose
        # types MXNet cannot infer when it is bound (graphs): float16 input
        # needs casts around float32 statistics on the GPU path.
        self._input_dtype = dtype_name(dtype)
        if self._input_dtype in LOW_PRECISION:
            dtype = 'float32'
        super(SyncBatchNorm, self).cast(dtype)

    def _devices(self):
        return [str(c) for c in self.gamma.list_ctx()]

    def _check_devices(self, contexts):
        """Raise if this layer cannot run on ``contexts``: checked at the
        first training call on them, before any library work. Then whether
        it synchronizes: not on one device in one process, where it is
        ``nn.BatchNorm``."""
        devices = [str(c) for c in contexts]
        if self._num_devices is not None and self._num_devices != len(devices):
            if self._transport.cross_process:
                # The job's count is no fix here: this worker cannot hold the
                # other workers' devices.
                fix = ("Across processes num_devices counts this worker's devices only, the "
                       "contexts its parameters live on here (the other workers' devices "
                       "take part through the layer's kvstore): omit num_devices (None "
                       "counts them) or pass num_devices=%d." % len(devices))
            else:
                fix = ("Pass num_devices=%d (or None, which counts them), or initialize on %d "
                       "context(s)." % (len(devices), self._num_devices))
            raise SyncBatchNormError(
                "SyncBatchNorm '%s': num_devices=%d but its parameters are initialized on %d "
                "context(s) (%s); %s. %s" % (
                    self.name, self._num_devices, len(devices), ', '.join(devices),
                    'it would wait for devices that never call'
                    if self._num_devices > len(devices) else
                    'every context its parameters live on takes part in each call', fix))
        check_gpus(self.name, devices)
        if len(devices) > 1 and is_naive_engine():
            raise SyncBatchNormError(
                "SyncBatchNorm '%s': MXNET_ENGINE_TYPE=NaiveEngine runs operators one at a "
                "time, so device 0 would wait forever for device 1. Unset it (use "
                "ThreadedEnginePerDevice) or train on one device." % self.name)
        self._synchronizes = self._synchronizes_on(contexts)
        self._checked_contexts = contexts

    def _synchronizes_on(self, contexts):
        """Whether the layer synchronizes with its Parameters on
        ``contexts``: on several devices, or across processes (on one device
        in one process it is ``nn.BatchNorm``)."""
        return len(contexts) > 1 or self._transport.cross_process

    def _training_backend(self):
        """The backend of the training calls on the parameters' contexts,
        made now if need be (the first call's checks run first), or None
        where the layer does not synchronize (it is ``nn.BatchNorm`` there)."""
        contexts = self.gamma.list_ctx()
        if contexts is not self._checked_contexts:
            self._check_devices(contexts)
        return self._backend_for(contexts) if self._synchronizes else None

    def _backend_for(self, contexts):
        """The backend for ``contexts``, made at the first call on them,
        once, whichever of the devices' threads comes first."""
        backend = self._sync_backend
        if backend is not None and backend.contexts is contexts:
            return backend
        with SETUP_LOCK:
            backend = self._sync_backend
            devices = [str(c) for c in contexts]
            if backend is not None and backend.devices == devices:
                # The same devices in a new list (deferred initialization
                # traces with one list and runs with another): graphs
                # traced already hold this backend.
                backend.contexts = contexts
            elif backend is None or backend.contexts is not contexts:
                check_cpu_contexts(self.name, devices)
                layer = Layer(self.name, self._kwargs['axis'], self._kwargs['fix_gamma'],
                              self._sync_groups, self._timeout, self._remote_timeout,
                              Params(self.gamma, self.beta, self.running_mean,
                                     self.running_var))
                backend = self._sync_backend = make_backend(layer, devices, self._transport)
                if sum(d.startswith('cpu') for d in devices) > 1:
                    SESSION.separate_cpu_temp_space()  # after the self-test, which checks it
        return backend

    def _check_input(self, x):
        shape = x.shape
        if shape == self._checked_shape:
            return  # what the checks read is the same as at the last call
        try:
            self._validate_input(x, shape)
        except SyncBatchNormError as exc:
            # Devices issued before this one would wait for it: fail them now.
            SESSION.fail_step(exc)
            raise
        if all(shape):  # not an empty slice: that check reads the shape mode too
            self._checked_shape = shape

    def _validate_input(self, x, shape):
        ndim = len(shape)
        if not all(shape) and not is_np_shape():
            raise SyncBatchNormError(
                "SyncBatchNorm '%s' got an empty slice (shape %s) on %s. MXNet handles size-0 "
                "arrays only in NumPy shape mode: call mx.util.set_np_shape(True) (or "
                "npx.set_np()) at the start of the program, and the slice takes part with "
                "0 samples." % (self.name, shape, x.context))
        if not 2 <= ndim <= 5:
            raise SyncBatchNormError(messages.text('bad_ndim', layer=self.name, ndim=ndim))
        axis = self._kwargs['axis']
        if not -ndim <= axis < ndim:
            raise SyncBatchNormError(messages.text('bad_axis', layer=self.name, axis=axis,
                                                   ndim=ndim))
        channels = shape[axis]
        expected = self.gamma.shape[0] if self.gamma.shape else 0
        if expected and channels != expected:
            raise SyncBatchNormError(messages.text('wrong_channels', layer=self.name,
                                                   channels=channels, axis=axis,
                                                   expected=expected))

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        if is_np_array():
            # NumPy mode (npx.set_np()): our operators are MXNet's legacy ones,
            # which refuse mx.np arrays and symbols. Views of the same arrays
            # (autograd follows them) in, a view of the output back.
            legacy = [a.as_nd_ndarray() for a in (x, gamma, beta, running_mean, running_var)]
            return self._forward(F, *legacy).as_np_ndarray()
        return self._forward(F, x, gamma, beta, running_mean, running_var)

    def _forward(self, F, x, gamma, beta, running_mean, running_var):
        if F is not ndarray:
            return self._traced(F, x, gamma, beta, running_mean, running_var)
        self._check_input(x)
        if self._kwargs['use_global_stats'] or not autograd.is_training():
            # Inference: running statistics, no synchronization at all.
            return F.BatchNorm(x, gamma, beta, running_mean, running_var, name='fwd',
                               **dict(self._kwargs, use_global_stats=True))
        backend = self._training_backend()
        if backend is None:
            # Nothing to synchronize: be nn.BatchNorm, kernel and all, with no
            # library work. (Like nn.BatchNorm's, float16 input takes float32
            # parameters, and float64 running statistics have float32's
            # precision on CPU.)
            return F.BatchNorm(x, gamma, beta, running_mean, running_var, name='fwd',
                               **self._kwargs)
        if not self._network_checked:
            self._network_checked = True
            _network_check[0](self, len(backend.devices))
        SESSION.clear_failed_arrays()
        if not all(x.shape):  # an empty slice (NumPy shape mode: _check_input)
            backend.watch_empty_slice(x)
        # Also in a static network run imperatively (an empty slice's call,
        # update_bn_stats): Call.imperative says why.
        return backend.forward(F, x, Params(gamma, beta, running_mean, running_var),
                               Call.imperative(x, self._kwargs))

    def _traced(self, F, x, gamma, beta, running_mean, running_var):
        """What a trace gets (Gluon's, of a hybridized network, or a call on
        a Symbol, as GluonCV's feature extractors make): ``nn.BatchNorm``'s
        node with this layer's arguments, marked with the layer where it
        uses batch statistics. Which devices it synchronizes, and how, is
        decided when a block builds its cached graph (:mod:`.graphs`), so
        the trace needs no devices, shapes or initialization."""
        op = F.contrib.BatchNormWithReLU if self._fused_relu() else F.BatchNorm
        mark = None if self._kwargs['use_global_stats'] else {MARK: token_of(self)}
        return op(x, gamma, beta, running_mean, running_var, name='fwd', attr=mark,
                  **self._kwargs)

    def _fused_relu(self):
        """Whether a trace emits ``nn.BatchNormReLU``'s node, ReLU included."""
        return False

    @classmethod
    def shadow(cls, node_kwargs, params, template=None, **settings):
        """The layer that runs a marked graph node whose Parameters
        (``params``: gamma, beta, running mean and variance) belong to no
        SyncBatchNorm: those of a SymbolBlock of its own, or a graph's
        BatchNorm node ``convert_model`` marked. It has the node's arguments
        (``node_kwargs``, ``_kwargs`` as :func:`.traced.node_kwargs` gives
        them), ``template``'s settings (the layer that traced the node) or
        ``settings`` (``convert_model``'s), and is named after gamma's
        Parameter (``<prefix>gamma``). No block holds it as a child."""
        gamma = params[0].name
        prefix = gamma[:-len('gamma')] if gamma.endswith('gamma') else gamma + '_'
        if template is not None:
            settings = dict(num_devices=template._num_devices, timeout=template._timeout,
                            sync_groups=template._sync_groups)
        layer = cls(prefix=prefix, **settings)
        if template is not None:
            layer._transport = template._transport
            layer._remote_timeout = template._remote_timeout
            layer._input_dtype = template._input_dtype
        layer._kwargs = dict(node_kwargs)
        return adopt_parameters(layer, params)

    def __repr__(self):
        s = '{name}({content}'
        in_channels = self.gamma.shape[0] if self.gamma.shape else 0
        s += ', in_channels={0}'.format(in_channels or None)
        s += ', num_devices={0})'.format(self._num_devices)
        return s.format(name=self.__class__.__name__,
                        content=', '.join('='.join([k, v.__repr__()])
                                          for k, v in self._kwargs.items()))


def adopt_parameters(layer, params):
    """``layer`` (a batch-norm layer) with ``params``, the Parameter objects
    gamma, beta, running mean and variance of another, in place of its own:
    values, contexts, gradients and every attribute (``grad_req``,
    ``lr_mult``, ``init``, ...) as they are. (Gluon's ``params=`` sharing
    would compare the attributes with the layer's defaults, and refuse a
    frozen gamma.) Returns ``layer``."""
    for attribute, param in zip(('gamma', 'beta', 'running_mean', 'running_var'), params):
        layer._reg_params[attribute] = param
        object.__setattr__(layer, attribute, param)
    layer._params._params.clear()
    layer._params._params.update((p.name, p) for p in params)
    return layer


def is_sync_batchnorm(block):
    """Whether ``block`` is a SyncBatchNorm layer: the one test every module
    uses."""
    return isinstance(block, SyncBatchNorm)
