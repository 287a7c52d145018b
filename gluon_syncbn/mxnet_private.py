"""Every place gluon_syncbn relies on MXNet 1.9.1 behaviour that is not public API.

Each item names what we rely on and where the code that relies on it lives.
An MXNet upgrade starts here.

Raw memory
    * :func:`host_view` (used by ``backends/python_op.py``) reads and writes
      the memory of the arrays a custom-operator callback receives. In
      1.9.1 those are fresh NDArrays over the operator's own default-layout
      buffers (``custom.cc``: ``AllocateNDArrayCopy`` of inputs that
      ``CreateDefaultInputs`` reordered), so waiting on them cannot deadlock,
      and the engine holds the operator's write access to its outputs and (in
      non-static graphs) its auxiliary states.
    * Layouts: ``CreateDefaultInputs`` reorders an MKL-DNN input into a
      temporary that is freed when the custom operator's engine function
      returns, before the callback runs on the custom-operator thread, and an
      in-place operator (``Cast`` to the same dtype) over an MKL-DNN array leaves
      blocked bytes flagged as default layout. So the Python operator gets
      only per-channel vectors that MXNet's own operators computed; the
      asynchronous operator reorders MKL-DNN inputs itself, into arrays it
      holds until it completes (``native/async_op.h``).
    * ``mxnet::Context`` is ``{int32 dev_type, int32 dev_id}`` (the native
      operators pass one to ``MXEnginePushSyncND``).
    * static_shape graphs register an operator's auxiliary states and
      mutable inputs as read-only inputs, and make their operators once; the
      native operators' states share one engine variable per layer and device
      (``native/sync_call.h`` layer_variable), which orders a layer's calls,
      and their updates inside them, there; ``hooks`` stamps each graph call
      with its step (``gsbn_stamp_static``) and fences a predict call after
      training calls (``gsbn_fence``, which reads an NDArray's engine
      variable, ``NDArray::var``); a block whose layers run the Python
      operator gets its graphs without static_shape (its ``_flags``).
    * After an abort the engine variables of a layer are waited on with
      ``Engine::WaitForVar`` (``native/mxnet_abi.h``
      settle_engine_variable), which rethrows and nulls the error a failed
      call left on every array it reached.

Failures
    * A custom-operator callback that fails (raises, in the Python operator)
      leaves its exception in the custom-operator runtime's one process-wide
      slot (``custom-inl.h``, ``CustomOperator::exception_``), which the next
      custom operator to complete takes, without a lock: when several devices'
      calls fail together, some complete as if they had succeeded (their
      outputs unwritten) and two writes can free the slot twice. But a custom
      operator completes by rethrowing any exception on the engine variables
      of its callback's arrays (``Engine::Throw``, in ``CustomOperatorWait``,
      which reads every one of them), so a failed call makes an engine
      operation fail on one of them and returns success:
      :func:`fail_custom_call`, through the native library's held operations
      (``native/failures.h``) or, without it, a ``take`` in ``raise`` mode,
      whose check fails at run time.
    * The engine keeps failed operations' errors in one list per process
      (``threaded_engine.h``, ``AddToGlobalExceptions``), appended from the
      thread that completes a failure and searched from every thread that
      starts an operation on a failed array, without a lock; the next
      ``waitall`` walks it. Concurrent appends, or an append that moves the
      list under a search, corrupt it, and ``waitall`` then crashes. The native
      library fails operations one at a time (``fail_operation``) and grows
      the list once when it loads (``reserve_engine_errors``, from
      ``gsbn_init``), before any operator of ours runs. A failed custom operator is completed by
      MXNet with a new error on that device's worker thread
      (``CustomOperatorWait``), so the native library lets the Python
      operator's failed calls complete one after another: each call's failing
      operation is held until its ``CustomOperatorWait`` is queued (an
      operation writing another of its arrays is held back then) and the one
      before has completed. Without the native library (no compiler) the
      Python operator's calls failing together stay exposed.
    * MXNet's text for such a failure is its own (:data:`FAILED_CALL_TEXT`, or
      ``Check failed ... kCustomOpProp`` for a property callback that fails on
      the main thread). ``hooks`` puts our cause in its place or after it in
      ``MXNetError`` (a patch of its ``__init__``). A ``take`` of the user's own
      that fails in ``raise`` mode would read as the last SyncBatchNorm
      failure, if there was one.
    * A failed call leaves its exception on the arrays it writes until someone
      waits on one of them, which clears it on all (``ThrowException`` nulls
      the shared ``exception_ptr``); until then MXNet skips every operation
      on them and passes the error on (``session.Session.clear_failed_arrays``).

Class patches (``hooks``, installed by the package's ``__init__``: ``hooks.install``)
    ``MXNetError.__init__``, ``autograd._RecordingStateScope.__enter__`` and
    ``__exit__``, ``HybridBlock._call_cached_op``, and an ``atexit`` handler
    that must run before MXNet's own.
    ``HybridBlock._active`` is lowered for one call with an empty input, so
    the tree runs imperatively (``hooks._forward_imperatively``).
    A hybridized block keeps a graph for each mode (``hooks._use_graph_for_mode``):
    Gluon's ``_build_cache`` and ``_clear_cached_op``, the attributes that make
    up a cached graph (``_cached_graph``, ``_cached_op``, ``_cached_op_args``,
    ``_in_format``, ``_out_format``), ``_flags`` (``static_shape``), and the
    names its trace gives the block's inputs (``data``, or ``data0``,
    ``data1``, ...: ``hooks.traced_ndim``).
    ``Trainer._init_params`` (the first step's broadcast of every parameter
    from device 0) first drains the engine (``hooks.install_trainer_hook``).
    ``Parameter._init_impl`` (initialize, ``reset_ctx``, a load onto other
    contexts) is counted (``hooks.install_parameter_hook``), and a cached
    graph compares ``Parameter.list_ctx()`` with the list it was traced for.
    ``HybridBlock.__deepcopy__`` (Gluon defines none) refuses a network with
    a cached graph and SyncBatchNorm layers, else copies as Python does
    (``copy._reconstruct``); ``autograd.grad``, ``autograd.backward`` and
    ``NDArray.backward`` raise our error for a higher-order gradient MXNet
    refuses through our layers (``hooks.install_grad_hooks``), reading the
    recorded graph (``autograd.get_symbol``) for the layers' handles.

The layer's base (``block.SyncBatchNorm``, ``convert.py``)
    ``nn.BatchNorm``'s constructor makes the parameters and ``_kwargs`` the
    operators take; its ``_alias`` is 'batchnorm', ours 'syncbatchnorm'.
    ``nn.BatchNormReLU`` and other batch-norm blocks are found as subclasses
    of Gluon's private ``_BatchNorm``. A native operator's backward node
    refuses its own gradient (``FGradient``, ``sync_call.h``
    no_higher_order), reading the layer from its forward node, the backward
    node's control dependency, where MXNet keeps it.

Size-0 arrays (``VectorBackend._empty_slice`` in ``backends/vector_graph.py``, the operators)
    ``reshape`` with -1 divides by zero, reductions give NaN forward and leave
    their gradient outputs unwritten, ``broadcast_add``'s backward segfaults.

NumPy mode (``block``)
    ``as_nd_ndarray()``/``as_np_ndarray()`` are views that keep the autograd
    entry (``MXShallowCopyNDArray``).

AMP (``backends/vector_graph.py``, :func:`amp_initialized`)
    ``Custom`` and ``Cast`` are on AMP's float32 lists; ``amp_cast`` widens
    float16/bfloat16 only, and on CPU is MKL-DNN's (refuses float64).
    ``amp.init()`` wraps the operator functions of ``mx.sym`` and ``mx.nd``
    once, and says so in ``amp._amp_initialized``: only graphs traced after
    it can be fed float16 they do not declare.

The user's kvstore (``transport._serialize_calls``)
    Its methods are wrapped to take one lock, and ``init``/``broadcast`` drain
    the engine: 1.9.1's dist kvstore keeps per-key buffers in unguarded maps.

The kvstore server and ps-lite (``native/session.h``, ``transport.py``)
    1.9.1's server never initializes its ``multi_precision_`` flag
    (``kvstore_dist_server.h``): where the heap leaves it set (the GPU
    wheel's server, in most runs) it stores and sums every float64 key in
    float32. Forward sums therefore cross processes about a shift close to
    their mean (``native/wire.h`` ``shift_forward``), and the check rows
    hold whole numbers below 2^24. The server aborts on a push whose size
    is not its key's, so the workers compare each layer before its keys
    exist (``attach_remote``). The store's destructor waits in ps-lite's
    final barrier for every worker, so a worker whose script failed, or
    whose synchronization broke, ends with ``os._exit`` at interpreter exit
    (``transport._at_exit``).

Block trees (``hooks.blocks_of``, ``convert.py``)
    ``Block._children``, the ordered children of a block, walked to find and
    replace layers.

Custom-operator dtypes (``backends/python_op.py``)
    ``mxnet.ndarray.ndarray._DTYPE_MX_TO_NP`` names the NumPy dtype of the
    type code MXNet hands ``create_operator``.

bfloat16 (``dtype_name``)
    MXNet 1.9.1 gives bfloat16 arrays the NumPy dtype
    ``np.dtype([('bfloat16', np.uint16)])``, whose ``.name`` is ``void16``;
    its operator wrappers take that dtype (and not the string 'bfloat16').

MXNet's C++ registry (``native/mxnet_abi.h``, ``async_op.h``, ``exchange_op.h``)
    The asynchronous operator (CPU contexts) and the exchange operator (GPUs)
    are registered from our library into ``dmlc::Registry<nnvm::Op>``, with
    the layouts of the wheel's build (GCC 4.8's ``std::function`` invokers and
    ``unordered_map``), each checked once per build by ``selftest.py``
    (``python -m gluon_syncbn.selftest``); :func:`operator_functions` makes
    their Python functions with MXNet's generators (``_make_ndarray_function``,
    ``_make_symbol_function``).

Engine settings (``cpu_contexts``)
    ``MXNET_CPU_TEMP_COPY`` and ``MXNET_CPU_PARALLEL_RAND_COPY`` are read once,
    when MXNet makes its first resource manager (``mx.random.seed``, or the
    first operator that needs temp space or random numbers); CPU contexts
    share those pools. Whether that happened is read from libmxnet's guard of
    their registry (:func:`resources_made`, an exported symbol).
"""
import ctypes

import numpy as np
from mxnet.base import _LIB, check_call

__all__ = ['host_view', 'dtype_name', 'operator_dtype', 'operator_functions',
           'amp_initialized']

_BFLOAT16 = np.dtype([('bfloat16', np.uint16)])


def amp_initialized():
    """Whether ``mxnet.contrib.amp.init()`` has run in this process."""
    from mxnet.contrib.amp import amp
    return bool(getattr(amp, '_amp_initialized', True))


def dtype_name(dtype):
    """The name MXNet's operators take for ``dtype`` ('float32', 'bfloat16', ...)."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # TypeError: not hashable
        dtype = np.dtype(dtype)
        return 'bfloat16' if dtype == _BFLOAT16 else dtype.name


# Every layer call asks for its input's: np.dtype() costs more than a look-up.
_DTYPE_NAMES = {t: np.dtype(t).name for t in (np.float16, np.float32, np.float64)}


def operator_dtype(name):
    """What an operator's ``dtype=`` argument takes for the dtype ``name``."""
    return _BFLOAT16 if name == 'bfloat16' else name


def host_view(arr):
    """A NumPy view of a CPU NDArray's own memory, or None for other devices.

    Inside a callback MXNet's engine already holds this operator's write access
    to its outputs, input gradients and auxiliary states, so writing the memory
    directly is safe; ``arr[:] = value`` would push a synchronous copy through
    the engine (about 130 us each, two thirds of the Python operator's fixed
    cost per call).
    """
    if arr.context.device_type != 'cpu':
        return None
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(arr.handle, ctypes.byref(ptr)))
    dtype = np.dtype(arr.dtype)
    size = int(np.prod(arr.shape))
    buf = (ctypes.c_char * (size * dtype.itemsize)).from_address(ptr.value)
    return np.frombuffer(buf, dtype=dtype).reshape(arr.shape)


# What MXNet's error says when fail_custom_call's operation fails.
FAILED_CALL_TEXT = 'take operator contains indices out of bound'


# The guard of the registry of MXNet's per-thread resource managers
# (dmlc::ThreadLocalStore<ResourceManagerImpl>::Singleton()::inst), set when
# the first one is made: MXNet reads MXNET_CPU_TEMP_COPY and
# MXNET_CPU_PARALLEL_RAND_COPY then, and never again.
_RESOURCES_MADE = ('_ZGVZN4dmlc16ThreadLocalStoreIN5mxnet8resource19ResourceManagerImplEE'
                   '9SingletonEvE4inst')


def resources_made():
    """Whether MXNet has made its resources (temp space, random numbers):
    ``mx.random.seed`` does, and so does the first operator that needs them.
    None where this build does not tell."""
    try:
        return bool(ctypes.c_uint8.in_dll(_LIB, _RESOURCES_MADE).value)
    except ValueError:  # no such symbol
        return None


def fail_custom_call(hold, probe, failure, lib=None):
    """Fail the custom-operator call whose callback got ``hold`` and ``probe``
    (two different arrays of it) with the exception ``failure``, and that
    call alone; the callback then returns normally. ``lib``: the native
    library, which completes such failures one after another (native
    ``failures.h``); without it a ``take`` fails on ``hold``, whose text
    ``hooks`` replaces with ``failure`` (recorded by ``errors.record_failure``
    first)."""
    text = '%s: %s' % (type(failure).__name__, failure)
    if lib is not None and lib.fail_python_call(hold.handle, probe.handle, text) == 0:
        return
    import mxnet as mx
    source = mx.nd.zeros((1,), ctx=hold.context, dtype=hold.dtype)
    out_of_bounds = mx.nd.ones(hold.shape, ctx=hold.context)
    mx.nd.take(source, out_of_bounds, mode='raise', out=hold)


def operator_functions(op_name):
    """``{mx.nd: f, mx.sym: f}`` calling the operator ``op_name``, registered
    after ``import mxnet`` generated its operator modules (MXNet's own
    generators, as ``mx.library.load`` uses them)."""
    import mxnet as mx
    from mxnet.base import OpHandle, c_str
    from mxnet.ndarray.register import _make_ndarray_function
    from mxnet.symbol.register import _make_symbol_function
    handle = OpHandle()
    check_call(_LIB.NNGetOpHandle(c_str(op_name), ctypes.byref(handle)))
    return {mx.nd: _make_ndarray_function(handle, op_name, op_name),
            mx.sym: _make_symbol_function(handle, op_name, op_name)}
