"""Every place gluon_syncbn relies on MXNet 1.9.1 behaviour that is not public
API, and every patch of code that is not ours (MXNet's, Python's, the user's
kvstore): the patches themselves all live in ``hooks``.

Each item names what we rely on and where the code that relies on it lives.
An MXNet upgrade starts here.

Raw memory
    * Layouts: the asynchronous operator reorders MKL-DNN inputs itself, into
      arrays it holds until it completes (``native/async_op.h``).
    * ``mxnet::Context`` is ``{int32 dev_type, int32 dev_id}`` (the native
      operators pass one to ``MXEnginePushSyncND``).
    * static_shape graphs register an operator's auxiliary states and
      mutable inputs as read-only inputs, and make their operators once; the
      native operators' states share one engine variable per layer and device
      (``native/sync_call.h`` layer_variable), which orders a layer's calls,
      and their updates inside them, there; ``graphs`` stamps each graph call
      with its step (``gsbn_stamp_static``) and fences a predict call after
      training calls (``gsbn_fence``, which reads an NDArray's engine
      variable, ``NDArray::var``).
    * After an abort the engine variables of a layer are waited on with
      ``Engine::WaitForVar`` (``native/mxnet_abi.h``
      settle_engine_variable), which rethrows and nulls the error a failed
      call left on every array it reached.

Failures
    * The engine keeps failed operations' errors in one list per process
      (``threaded_engine.h``, ``AddToGlobalExceptions``), appended from the
      thread that completes a failure and searched from every thread that
      starts an operation on a failed array, without a lock; the next
      ``waitall`` walks it. Concurrent appends, or an append that moves the
      list under a search, corrupt it, and ``waitall`` then crashes. The native
      library fails operations one at a time (``fail_operation``) and grows
      the list once when it loads (``reserve_engine_errors``, from
      ``gsbn_init``), before any operator of ours runs.
    * Python raises a failed operation's error as the class registered
      (``mxnet.error.register``) under the name before the first ':' of its
      text (``c_api_error.cc`` ``NormalizeError``, ``base.py``
      ``get_last_ffi_error``), wherever it surfaces; the native operators'
      failures start with ``SyncBatchNormError: `` or ``SyncBatchNormTimeout: ``
      (``native/failures.h`` failure_text), the names ``errors.py``
      registers.
    * A failed call leaves its exception on the arrays it writes until someone
      waits on one of them, which clears it on all (``ThrowException`` nulls
      the shared ``exception_ptr``); until then MXNet skips every operation
      on them and passes the error on (``session.Session.clear_failed_arrays``).

Class patches (``hooks``, installed by the package's ``__init__``: ``hooks.install``)
    ``autograd._RecordingStateScope.__exit__`` (an exception aborts the
    step; its own fields are not read), ``autograd.set_recording`` and
    ``set_training`` (module functions the scopes call by name: steps begin
    where a thread starts recording or training), ``gluon.data.DataLoader.__iter__``
    (across processes, a batch it fails to give abandons the step), ``NDArray.asnumpy``,
    ``NDArray.wait_to_read`` and ``mx.nd.waitall`` (a read notes that its
    thread waits), ``HybridBlock._call_cached_op`` (which
    ``SymbolBlock.forward`` calls for every NDArray call),
    ``HybridBlock.export``, ``CachedOp.__init__``,
    ``module.executor_group.DataParallelExecutorGroup.__init__``, and an
    ``atexit`` handler that must run before MXNet's own.
    ``HybridBlock._active`` is lowered for one call with an empty input, so
    the tree runs imperatively (``graphs.imperatively``).
    A block keeps a graph for each mode (``graphs``): Gluon's ``_build_cache``
    (which traces, finishes a deferred initialization and builds a CachedOp
    of ``_cached_graph``, whatever Symbol that holds: the training graph is
    built with it swapped in) and ``_clear_cached_op`` (SymbolBlock's keeps
    ``_cached_graph``), the attributes that make up a cached graph
    (``_cached_graph``, ``_cached_op``, ``_cached_op_args``: ``(is_arg,
    Parameter)`` pairs, ``_in_format``, ``_out_format``), ``_flags``
    (``static_shape``), ``_backend`` (a partitioned graph replaces
    ``_cached_graph``), and ``export``, which writes ``_cached_graph[1]``.
    ``Trainer._init_params`` (the first step's broadcast of every parameter
    from device 0) first drains the engine where ``Trainer._params_to_init``
    (the parameters it has yet to broadcast) is not empty
    (``hooks.install_trainer_hook``).
    ``Parameter._init_impl`` (initialize, ``reset_ctx``, a load onto other
    contexts) is counted (``hooks.install_parameter_hook``), and a bound
    graph compares ``Parameter.list_ctx()`` with the list it was bound for.
    ``HybridBlock.__deepcopy__`` (Gluon defines none) refuses a network with
    a cached graph and SyncBatchNorm layers, else copies as Python does
    (``copy._reconstruct``); ``autograd.grad``, ``autograd.backward`` and
    ``NDArray.backward`` raise our error for a higher-order gradient MXNet
    refuses through our layers (``hooks.install_grad_hooks``,
    ``backward_errors``), reading the recorded graph
    (``autograd.get_symbol``) for the layers' handles and for the autograd
    variables of their gamma and beta, which MXNet names ``var<N>`` once,
    when ``attach_grad`` marks them (``Imperative::MarkVariables``).

Traced graphs (``traced``, ``graphs``)
    A node's attributes whose keys start with ``__`` are skipped by MXNet's
    operator parameter parsers (``dmlc::parameter::kAllowHidden``), so the
    mark on a layer's ``BatchNorm`` node leaves plain MXNet's reading of it
    alone; ``Symbol.tojson`` drops AMP's casts unless
    ``remove_amp_cast=False``, and ``mx.sym.load_json`` rebuilds a graph from
    that JSON (nodes, ``inputs`` as ``[node, output, version]``, ``heads``,
    ``arg_nodes``; ``node_row_ptr`` left out). A SymbolBlock shares
    Parameters given to it (``ParameterDict('', params)``) and makes its own
    for the rest; GluonCV's feature extractors pass the backbone's
    ``collect_params()``.

The layer's base (``block.SyncBatchNorm``, ``convert.py``)
    ``nn.BatchNorm``'s constructor makes the parameters and ``_kwargs`` the
    operators take (its ``eps`` and ``momentum`` read at each call, a graph
    bound again where users change them: ``graphs.Graphs.moved``); its
    ``_alias`` is 'batchnorm', ours 'syncbatchnorm'. Its ``_deferred_infer_shape`` is
    overridden: Gluon wraps any failure of a deferred initialization in a
    ValueError about shapes, and ours are re-raised unwrapped
    (``errors.ours_behind``). ``Parameter._data`` is None until a parameter
    has data (``precise_bn``, which refuses layers without running
    statistics).
    ``nn.BatchNormReLU`` and other batch-norm blocks are found as subclasses
    of Gluon's private ``_BatchNorm``, contrib's layer by its ``_kwargs``'
    ``ndev``. A shadow layer (``SyncBatchNorm.shadow``), and a layer
    ``convert_model`` makes, adopts another's Parameters through
    ``Block._reg_params`` and ``ParameterDict._params``. The network a user
    called is the ``self`` of the outermost frame of ``Block.__call__``
    (``graphs._called_network``), which every block's call goes through. A native operator's backward node
    refuses its own gradient (``FGradient``, ``sync_call.h``
    no_higher_order), reading the layer from its forward node, the backward
    node's control dependency, where MXNet keeps it.

Size-0 arrays (``ExchangeBackend._empty_slice`` in ``backends/vector_graph.py``, the operators)
    ``reshape`` with -1 divides by zero, reductions give NaN forward and leave
    their gradient outputs unwritten, ``broadcast_add``'s backward segfaults.

NumPy mode (``block``)
    ``as_nd_ndarray()``/``as_np_ndarray()`` are views that keep the autograd
    entry (``MXShallowCopyNDArray``).

AMP (``backends/vector_graph.py``, :func:`amp_initialized`)
    ``Cast`` is on AMP's float32 lists; ``amp_cast`` widens
    float16/bfloat16 only, and on CPU is MKL-DNN's (refuses float64).
    ``amp.init()`` wraps the operator functions of ``mx.sym`` and ``mx.nd``
    once, and says so in ``amp._amp_initialized``: only graphs traced after
    it can be fed float16 they do not declare.

The user's kvstore (``transport.wrap_kvstore``)
    Its methods are wrapped to take one lock, and ``init``/``broadcast`` drain
    the engine: 1.9.1's dist kvstore keeps per-key buffers in unguarded maps.
    Its ``set_gradient_compression`` raises: 1.9.1 compresses every key of a
    dist kvstore and refuses pushpull on a compressed one
    (``kvstore_dist.h``, ``PushPullImpl``).

The kvstore server and ps-lite (``native/session.h``, ``transport.h``, ``transport.py``)
    1.9.1's server never initializes its ``multi_precision_`` flag
    (``kvstore_dist_server.h``): where the heap leaves it set (the GPU
    wheel's server, in most runs) it stores and sums every float64 key in
    float32. The layers' keys are therefore float32, and every number on
    them is exact in float32 with zeros as its other addends (a gather:
    ``native/wire.h``, CHECKED and ``encode_exact``). The server aborts on a
    push whose size is not its key's, so the workers compare each layer
    before its keys exist (``attach_remote``). The store's destructor waits
    in ps-lite's final barrier for every worker, at the scheduler: a worker
    whose script failed, or whose synchronization broke, ends with
    ``os._exit`` at interpreter exit (``transport._at_exit``), and one whose
    scheduler no longer answers at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``
    ends itself (``watch_helpers``).

Python (``transport._guard_exit``, at the first cross-process layer's construction)
    ``sys.excepthook``, ``sys.exit`` and the builtin ``SystemExit`` are
    replaced (the last by a subclass), and an ``atexit`` handler added, so a
    worker learns how its script ended and ends at once when it failed
    (``transport._at_exit``); that handler puts the three back.

Block trees (``graphs.blocks_of``, ``convert.py``)
    ``Block._children``, the ordered children of a block, walked to find and
    replace layers.

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

__all__ = ['dtype_name', 'operator_dtype', 'operator_functions', 'amp_initialized']

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
