"""The catalogue of every reliance of gluon_syncbn on MXNet 1.9.1 beyond its
public API (Python attributes, Gluon's private fields, C++ layouts, virtual
tables, symbols, engine behaviour), and on GluonCV, ps-lite and Python the
same way: an MXNet upgrade starts here (``tests/test_mxnet_private.py``
checks that every MXNet private name the package's Python uses, and every
mangled symbol in it, is listed).

Each entry: what, and where the code that relies on it lives; **serves**;
**public**: why nothing public does; **checked**: what catches a changed
MXNet first. ``selftest`` is ``selftest.py``, run in a subprocess once per
build before the native library registers an operator or gives CPU contexts
their temp space (where it fails, the layer refuses that operator at its
first synchronized call, or keeps MXNet's shared temp space and warns);
"tests" means only the test suite, on MXNet 1.9.1.

C++: libmxnet's ABI (``native/mxnet_abi.h`` unless said)
    Registration into ``dmlc::Registry<nnvm::Op>`` (``__REGISTER_OR_GET__``,
    exported by libmxnet; ``async_op.h``, ``exchange_op.h``, ``sync_call.h``
    register_backward), with ``FExecType`` kAsync, ``FStatefulComputeEx``,
    ``FCreateOpState``, ``FMutateInputs``, ``FGradient``, ``TIsBackward``,
    ``TIsLayerOpBackward``, ``TIsMKLDNN``, ``OpContext::async_on_complete``.
    **Serves** both native operators. **Public** the C API's operator
    libraries (``lib_api.h``, ``mx.library.load``) run synchronously, with a
    state of their own and MXNet's gradient wiring: no asynchronous
    completion, no engine variable shared by a layer's calls, no gradient
    node that refuses a higher order. **Checked** selftest.
    GCC 4.8 ``std::function`` invokers forged (``OLD_ABI``): the wheel's
    libstdc++ calls an invoker with arguments by value, g++ >= 5 builds take
    them by reference; every function handed to libmxnet (operator
    attributes, engine callbacks, a state's deleter) gets one. **Public**
    none: every C++ entry point takes a ``std::function``. **Checked**
    selftest.
    ``#define private public`` around MXNet's headers, for
    ``Op::GetAttrMap``, ``Op::index_`` and ``OpMap::data_`` (``set_attr``
    fills an attribute map directly, since nnvm's ``Op::set_attr`` hands
    libmxnet a ``std::function`` of the new ABI) and ``OpStatePtr::ptr_``
    (``make_state``: a state on the layer's engine variable with a deleter
    libmxnet can call; ``OpStatePtr::Create`` makes a variable of its own and
    deletes through a new-ABI lambda). **Checked** selftest.
    ``nnvm::Node`` as libmxnet lays it out (``NodeLayout``: GCC 4.8's
    ``unordered_map`` is 48 bytes, so ``inputs`` and ``control_deps`` sit 8
    bytes earlier than g++ >= 5 puts them): the gradient nodes' inputs and
    control dependency (``make_node``, ``node_inputs``; the refusal of a
    higher-order gradient reads the forward node, ``node_control_deps``);
    ``NodeAttrs::dict`` is only iterated (its leading fields agree).
    **Public** nnvm's C API reads a node's inputs (``NNSymbolGetChildren``)
    and adds control dependencies (``NNAddControlDeps``), but sets inputs
    only through ``NNSymbolCompose``, and MXNet asks for a gradient with
    null placeholder inputs (``Imperative::GetBackwardDependency``, at every
    recorded call), which Compose dereferences (``UpdateNodeVersion``;
    tried: the self-test segfaulted there). **Checked** selftest (both
    operators' backward).
    Exported engine and array methods: ``Engine::Get()`` ``NewVariable``,
    ``DeleteVariable``, ``WaitForVar`` (``settle_engine_variable``: it
    rethrows and nulls the error a failed call left, ``ThrowException``
    sharing one ``exception_ptr`` among every array the failure reached),
    ``NDArray::var`` (``array_variable``: ``gsbn_fence``). **Public** the C
    API pushes operations on engine variables (``MXEnginePushSync``) but
    cannot make one, give an array's, or wait for one. **Checked**
    selftest.
    ``mxnet::Context`` is ``{int32 dev_type, int32 dev_id}``
    (``MXEnginePushSyncND`` takes one by pointer: ``sync_call.h``).
    **Checked** selftest.

C++: the resource manager's virtual table (``native/cpu_resources.h``; ``mxnet_abi.h`` replace_resource_request, make_temp_space_slot)
    In each thread that issues a step (``Session.separate_cpu_temp_space``,
    ``separate_this_thread``; MXNet keeps one resource manager per thread,
    ``resource.cc`` 455-458) the manager's virtual table is replaced by a
    copy whose ``Request`` answers ``cpu(i)``'s temp-space requests from a
    pool of ``cpu(i)``'s own and forwards every other request to MXNet's; its
    slots are MXNet's kind, built on resource.cc's ``SpaceAllocator`` layout,
    which libmxnet's ``Resource::get_space_internal`` grows. **Serves**
    static_shape graphs on several CPU contexts (the GPU path's static tests
    run on them): such a graph holds its temp-space slot for its life
    (``attach_op_resource_pass.cc`` 45-73, from ``cached_op.cc`` 486), and
    from MXNet's one pool for every CPU context (``Request`` ignores a CPU
    context's id, ``resource.cc`` 128-135; round-robin, ``GetNext`` 283-292)
    other operators' slots sweep over it once per turn: device 1's work
    before a layer lands on device 0's held slot and both wait for ever
    (docs/design.md, 'The engine hazard'). **Public** none: no setting gives
    CPU contexts pools of their own (``MXNET_CPU_TEMP_COPY`` only delays the
    stall), our operators already take no temp space (the held slot is the
    user's convolutions'), and graphs without static_shape, which take a new
    slot per call, would drop what the user asked for. **Checked** the three
    virtual functions are named by ``dladdr`` before the one entry is
    replaced (``kResourceManagerVirtuals``:
    ``_ZN5mxnet8resource19ResourceManagerImpl7RequestENS_7ContextERKNS_15ResourceRequestE``,
    ``_ZN5mxnet8resource19ResourceManagerImpl10SeedRandomEj``,
    ``_ZN5mxnet8resource19ResourceManagerImpl10SeedRandomENS_7ContextEj``),
    else nothing changes and the layer warns; selftest (a reduction on
    ``cpu(1)`` answered from its pool, against NumPy).
    ``_ZGVZN4dmlc16ThreadLocalStoreIN5mxnet8resource19ResourceManagerImplEE9SingletonEvE4inst``,
    the guard of the registry of those managers, set when the first is made
    (:func:`resources_made`). **Serves** ``configure_cpu_contexts``, which
    refuses to set ``MXNET_CPU_TEMP_COPY`` and
    ``MXNET_CPU_PARALLEL_RAND_COPY`` after MXNet read them (when it makes a
    thread's manager, ``resource.cc`` 88-105: for the main thread at
    ``mx.random.seed`` or the first operator needing temp space or random
    numbers). **Public** nothing tells whether MXNet made its resources.
    **Checked** looked up by name: where absent, :func:`resources_made` says
    None and the refusal is skipped.

The engine's behaviour (no field read; relied on by the native operators)
    * static_shape graphs register an operator's auxiliary states and
      mutable inputs as read-only inputs, and make their operators once; the
      native operators' states share one engine variable per layer and device
      (``native/sync_call.h`` layer_variable), which orders a layer's calls,
      and their updates inside them, there; ``graphs`` stamps each static
      graph call with its step (``gsbn_stamp_static``) and fences a predict
      call after training calls (``gsbn_fence``). **Tests**.
    * Failed operations' errors sit in one list per process
      (``threaded_engine.h``, ``AddToGlobalExceptions``), appended and
      searched from engine threads without a lock, walked by ``waitall``:
      the native library fails operations one at a time (``failures.h``
      fail_operation) and grows the list once when it loads
      (``reserve_engine_errors``, through the C API). **Tests**.
    * Python raises a failed operation's error as the class registered
      (``mxnet.error.register``) under the name before the first ':' of its
      text (``c_api_error.cc`` ``NormalizeError``, ``base.py``
      ``get_last_ffi_error``); ``failures.h`` failure_text starts with the
      names ``errors.py`` registers. **Tests**.
    * A failed call leaves its exception on the arrays it writes, and MXNet
      skips every operation on them (``threaded_engine.h`` OnStart 472-489),
      until a wait on one of them clears it on all
      (``Session.clear_failed_arrays``; a CPU context's temp-space slots are
      retired at an abort for the same reason). **Tests**.
    * The asynchronous operator reorders MKL-DNN inputs itself
      (``TIsMKLDNN``: ``native/async_op.h``). **Tests**.

Gluon's private fields, read and written
    A block's cached graph: ``HybridBlock._cached_graph`` (read by
    ``graphs`` and ``convert``; written by ``graphs._bind``, which builds the
    training graph with it swapped in, ``graphs.without_marks``, which
    ``export`` writes from, and ``convert._synchronize_graph`` /
    ``_unsynchronize_graph``, which mark and strip a SymbolBlock's),
    ``_cached_op`` and ``_cached_op_args`` (``(is_arg, Parameter)`` pairs;
    ``graphs`` keeps one pair per mode and swaps them), ``_build_cache`` (``graphs._gluon_build``: it traces, finishes
    a deferred initialization and builds a CachedOp of whatever Symbol
    ``_cached_graph`` holds, with the ``_in_format``/``_out_format`` both
    modes share), ``_clear_cached_op`` (SymbolBlock's keeps
    ``_cached_graph``), ``_flags`` (``static_shape``), ``_backend`` (a
    partitioned graph is refused). **Serves** one graph per mode, export
    without marks, converted SymbolBlocks. **Public** Gluon has one
    ``hybridize`` graph per block and no way to give it another Symbol.
    **Tests**.
    ``HybridBlock._active``, lowered on a tree for one call
    (``graphs.imperatively``: an empty input runs imperatively). **Tests**.
    ``Block._children``, read (the ordered children: ``graphs.blocks_of``
    and ``convert._swap`` walk them; ``convert._swap`` replaces a layer with
    the public ``register_child`` under its name). **Public**
    ``Block.apply`` walks a tree children first, without the name a child
    is registered under. ``Block._reg_params`` and
    ``ParameterDict._params``, written (``block.adopt_parameters``: a shadow
    layer, and one ``convert_model`` makes, take another's Parameter
    objects). **Public** ``params=`` sharing compares the attributes with
    the layer's defaults and refuses a frozen gamma. **Tests**.
    ``nn.BatchNorm``: its constructor makes the parameters and ``_kwargs``
    the operators take (read by ``block``, ``backends/base``, ``precise_bn``,
    ``convert``; written by ``SyncBatchNorm.shadow``; its ``eps`` and
    ``momentum``, which users change between steps, read at each call, a bound graph bound again where they changed:
    ``graphs.Graphs.moved``); ``_alias`` overridden ('syncbatchnorm';
    ``transport._block_aliases`` reads every class's name, the prefixes
    Gluon counts); ``_deferred_infer_shape`` overridden (Gluon wraps any
    failure in a ValueError about shapes: ours are re-raised unwrapped,
    ``errors.ours_behind``); other batch-norm blocks found as subclasses of
    the private ``nn.basic_layers._BatchNorm`` (``graphs``, ``convert``),
    contrib's layer by its ``_kwargs``' ``ndev``. **Tests**.
    ``Trainer._params_to_init`` (``hooks.install_trainer_hook``).
    ``Parameter.list_ctx()`` returns the Parameter's own list, which Gluon
    replaces whenever it places the Parameter again (initialize,
    ``reset_ctx``, a load onto other contexts): a bound graph compares it,
    by identity, with the list it was bound for (``Graphs.moved``).
    ``CachedOp.handle`` set to None when its construction is refused, so
    ``__del__`` frees nothing (``hooks.install_unbound_graph_hooks``).
    **Tests**.
    The network a user called is the ``self`` of the outermost frame of
    ``Block.__call__`` (``graphs._called_network``, ``sys._getframe``),
    which every block's call goes through. **Tests**.
    ``mxnet.base._LIB``, ``ndarray.register._make_ndarray_function`` and
    ``symbol.register._make_symbol_function`` (:func:`operator_functions`:
    the Python functions of an operator registered after ``import mxnet``,
    as ``mx.library.load`` makes them). ``amp._amp_initialized``
    (:func:`amp_initialized`; absent, AMP counts as initialized).
    **Tests**.

Patches of code that is not ours (``hooks``, installed by ``hooks.install``
at import; the exit guard by ``transport.py`` at the first cross-process
layer; Gluon fields written elsewhere are listed above; each CPU context's
temp space above)
    ``autograd._RecordingStateScope.__exit__`` (an exception aborts the
    step; its fields are not read), ``autograd.set_recording`` and
    ``set_training`` (module functions the scopes call by name: steps begin
    where a thread starts recording or training), ``gluon.data.DataLoader.__iter__``
    (across processes, a batch it fails to give abandons the step),
    ``NDArray.asnumpy``, ``NDArray.wait_to_read`` and ``mx.nd.waitall`` (a
    read notes that its thread waits), ``HybridBlock._call_cached_op``
    (which ``SymbolBlock.forward`` calls for every NDArray call),
    ``HybridBlock.export``, ``CachedOp.__init__``,
    ``module.executor_group.DataParallelExecutorGroup.__init__``,
    ``Trainer._init_params`` (the first step's broadcast of every parameter
    from device 0 drains the engine first), ``autograd.grad``, ``autograd.backward`` and
    ``NDArray.backward`` (our error for a higher-order gradient MXNet
    refuses through our layers, ``backward_errors``, reading the recorded
    graph, ``autograd.get_symbol``, for the layers' handles and the autograd
    variables of gamma and beta, named ``var<N>`` once, by ``attach_grad``:
    ``Imperative::MarkVariables``), an ``atexit`` handler that must run
    before MXNet's own; ``sys.excepthook``, ``sys.exit`` and the builtin
    ``SystemExit`` (replaced by a subclass) in a worker of a multi-process
    job (``transport._guard_exit``: a worker learns how its script ended,
    ``transport._at_exit``, which puts them back); the user's kvstore's
    methods (``transport.wrap_kvstore``, below). **Public** MXNet has no
    callbacks for a step's start, end or failure. **Checked** each
    idempotent; tests.

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
    ``collect_params()``. A native operator's backward node refuses its own
    gradient (``FGradient``, ``sync_call.h`` no_higher_order), reading the
    layer from its forward node, the backward node's control dependency,
    where MXNet keeps it. **Tests**.

Data types and modes
    Size-0 arrays (``ExchangeBackend._empty_slice`` in ``backends/vector_graph.py``, the
    operators): ``reshape`` with -1 divides by zero, reductions give NaN
    forward and leave their gradient outputs unwritten, ``broadcast_add``'s
    backward segfaults. NumPy mode (``block``): ``as_nd_ndarray()`` /
    ``as_np_ndarray()`` are views that keep the autograd entry
    (``MXShallowCopyNDArray``). AMP (``backends/vector_graph.py``):
    ``Cast`` is on AMP's float32 lists; ``amp_cast`` widens float16/bfloat16
    only, and on CPU is MKL-DNN's (refuses float64); ``amp.init()`` wraps the
    operator functions of ``mx.sym`` and ``mx.nd`` once: only graphs traced
    after it can be fed float16 they do not declare. bfloat16
    (:func:`dtype_name`): MXNet gives bfloat16 arrays the NumPy dtype
    ``np.dtype([('bfloat16', np.uint16)])``, whose ``.name`` is ``void16``,
    and its operator wrappers take that dtype, not 'bfloat16'. **Tests**.

The user's kvstore, its server and ps-lite (``transport.wrap_kvstore``, ``native/session.h``, ``transport.h``, ``transport.py``)
    Its methods are wrapped to take one lock, and ``init``/``broadcast`` drain
    the engine: 1.9.1's dist kvstore keeps per-key buffers in unguarded maps.
    Its ``set_gradient_compression`` raises: 1.9.1 compresses every key of a
    dist kvstore and refuses pushpull on a compressed one
    (``kvstore_dist.h``, ``PushPullImpl``). The server never initializes
    its ``multi_precision_`` flag (``kvstore_dist_server.h``): where the heap
    leaves it set (the GPU wheel's server, in most runs) it sums every
    float64 key in float32, so the layers' keys are float32 and every number
    on them is exact in float32 with zeros as its other addends
    (``native/wire.h``, CHECKED and ``encode_exact``). The server aborts on a
    push whose size is not its key's, so the workers compare each layer
    before its keys exist (``attach_remote``). The store's destructor waits
    in ps-lite's final barrier for every worker, at the scheduler: a worker
    whose script failed, or whose synchronization broke, ends with
    ``os._exit`` at interpreter exit (``transport._at_exit``), and one whose
    scheduler no longer answers at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``
    ends itself (``watch_helpers``). **Tests**.

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
# the first one is made, which reads MXNET_CPU_TEMP_COPY and
# MXNET_CPU_PARALLEL_RAND_COPY (each thread's own reads them when it is made).
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
