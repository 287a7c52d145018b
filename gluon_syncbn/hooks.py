"""Where gluon_syncbn hooks into MXNet; each hook is narrow and idempotent.

* Entering the outermost ``autograd.record()`` (or ``train_mode()``) scope
  begins a training step: calls issued after a failure but before that belong
  to the failed step (see ``session.Session``).
* An exception that leaves ``autograd.record()`` means the step was abandoned
  half-way (say device 2's forward raised in user code): the SyncBatchNorm calls
  already issued for devices 0 and 1 would wait for partners that never come, so
  we abort the step and they fail at once instead of at the timeout.
* Before a cached graph's calls are issued, the errors an aborted step left
  on the layers' arrays are cleared (the block does it in imperative mode).
* A Trainer's first step broadcasts every parameter from device 0, running
  statistics included. In static_shape graphs our operators update those
  inside their calls, which such graphs hold as read-only inputs, so the
  engine does not order the broadcast after them: some devices' updates can
  land before it and some after, and replicas then differ (seen in 1 of 3
  runs of the static test nets). Before that first broadcast we wait for the
  engine, once, if any layer has synchronized.
* At interpreter exit MXNet's own ``atexit`` handler waits for the engine, and
  a SyncBatchNorm call waiting for a partner that never comes would hold it
  until the layer's timeout. Ours, registered after MXNet's so it runs first,
  drains the engine for a bounded time and then aborts the step.
* A worker of a multi-process job notes how its script ended (``sys.exit``,
  ``SystemExit``, ``sys.excepthook``) and ends at once after a failure, and
  every call on its kvstore takes the lock the native reductions take
  (installed by ``transport.py``, which says why).
"""
import atexit
import builtins
import collections
import contextlib
import copy
import sys
import threading
import weakref

import mxnet as mx

from . import messages
from .errors import SyncBatchNormError, ours_behind
from .mxnet_private import dtype_name
from .session import SESSION

__all__ = ['install']


def install_record_abort_hook(scope_class, session):
    """An exception that leaves a ``record()`` (or ``train_mode()``) scope
    aborts the step: with it as the cause where it is ours, else saying so.
    Not a call refused for belonging to a step that failed already (whose
    text would nest that step's cause in another)."""
    if getattr(scope_class, '_gluon_syncbn_hooked', False):
        return
    original_exit = scope_class.__exit__

    def __exit__(self, ptype, value, trace):
        if ptype is not None and session.active() and not messages.is_stale_call(value):
            session.fail_step(value if isinstance(value, SyncBatchNormError) else
                              SyncBatchNormError('the training step was abandoned (in thread '
                                                 '%r): %s: %s' % (threading.current_thread().name,
                                                                  ptype.__name__, value)))
        return original_exit(self, ptype, value, trace)

    scope_class.__exit__ = __exit__
    scope_class._gluon_syncbn_hooked = True


def install_step_hooks(autograd_module, session):
    """Steps begin where threads start recording or training
    (``Session.thread_in_step``), whether through ``record()`` and
    ``train_mode()`` scopes (which call these functions) or through
    ``autograd.set_recording`` / ``set_training`` themselves."""
    if getattr(autograd_module.set_recording, '_gluon_syncbn_hooked', False):
        return
    set_recording, set_training = autograd_module.set_recording, autograd_module.set_training
    is_recording, is_training = autograd_module.is_recording, autograd_module.is_training

    def switched(before, after):
        if before != after:
            session.thread_in_step(after)

    def set_recording_hooked(is_record):
        previous = set_recording(is_record)
        training = is_training()
        switched(previous or training, bool(is_record) or training)
        return previous

    def set_training_hooked(train_mode):
        previous = set_training(train_mode)
        recording = is_recording()
        switched(previous or recording, bool(train_mode) or recording)
        return previous

    for name, function, original in (('set_recording', set_recording_hooked, set_recording),
                                     ('set_training', set_training_hooked, set_training)):
        function.__doc__ = original.__doc__
        function._gluon_syncbn_hooked = True
        setattr(autograd_module, name, function)


# Read at exit, so that a test can shorten it.
EXIT_DRAIN_SECONDS = 10.0


def install_exit_abort_hook(session, waitall):
    """At interpreter exit, drain the engine; fail the calls still waiting after a while.

    A script that ends right after issuing its last step (no ``waitall``) still
    has that step's calls in flight: they get ``EXIT_DRAIN_SECONDS`` to finish,
    so a healthy step is never failed.
    Calls waiting for a partner that never comes are failed after that, and
    the drain then ends.
    """
    def abort_at_exit():
        if not session.active():
            return
        drained = threading.Event()

        def drain():
            try:
                waitall()
            except Exception:  # pylint: disable=broad-except
                pass  # a failed step's error; the program is ending anyway
            drained.set()
        threading.Thread(target=drain, name='gluon_syncbn-exit-drain', daemon=True).start()
        if not drained.wait(EXIT_DRAIN_SECONDS):
            session.fail_step(SyncBatchNormError('the Python interpreter is exiting'),
                              exiting=True)
            drained.wait()
    atexit.register(abort_at_exit)


def blocks_of(block):
    """``block`` and every block of its tree, depth first (a shared child as
    often as it appears)."""
    yield block
    for child in block._children.values():
        yield from blocks_of(child)


@contextlib.contextmanager
def imperatively(block):
    """Every block of ``block``'s tree un-hybridized in the context."""
    active = [b for b in blocks_of(block) if getattr(b, '_active', False)]
    for b in active:
        b._active = False  # the flag alone: the cached graphs stay for later calls
    try:
        yield
    finally:
        for b in active:
            b._active = True


def _forward_imperatively(block, args):
    """``block(*args)`` with every block of its tree un-hybridized for this call."""
    with imperatively(block):
        return block.forward(*args)


# What a hybridized block's cached graph is: Gluon's attributes for it.
_GRAPH_ATTRIBUTES = ('_cached_graph', '_cached_op', '_cached_op_args', '_in_format',
                     '_out_format')
_OP = _GRAPH_ATTRIBUTES.index('_cached_op')
_tracing = threading.local()
_switch_lock = threading.Lock()


def traced_ndim(symbol):
    """The number of dimensions of ``symbol``, an intermediate of the graph
    being traced now, where the block's inputs tell (shape inference from
    them: :func:`_use_graph_for_mode`); else None."""
    shapes = getattr(_tracing, 'input_shapes', None)
    if not shapes:
        return None
    try:
        inputs = set(symbol.list_inputs())
        _, out, _ = symbol.infer_shape_partial(**{n: s for n, s in shapes.items() if n in inputs})
    except Exception:  # pylint: disable=broad-except
        return None
    return len(out[0]) if out and out[0] else None


def tracing_for_prediction():
    """Whether the graph being traced now will only ever run in predict mode
    (see :func:`_use_graph_for_mode`)."""
    return getattr(_tracing, 'prediction', False)


def traced_call(backend):
    """A training call of ``backend``'s layer is being traced into a graph
    (:func:`_stamp_static` needs how many the graph makes)."""
    calls = getattr(_tracing, 'calls', None)
    if calls is not None:
        calls[backend] += 1


def _synchronizes(block):
    return any(getattr(b, '_synchronizes', False) for b in blocks_of(block))


def _build(block, args, prediction):
    """Gluon's ``_build_cache``, with the shapes of the block's inputs known
    to the layers it traces (:func:`traced_ndim`; Gluon names a block's
    inputs ``data``, or ``data0``, ``data1``, ... as here)."""
    arrays = [a for a in _flatten(args) if a is not None]
    names = ['data'] if len(arrays) == 1 else ['data%d' % i for i in range(len(arrays))]
    _tracing.input_shapes = {n: a.shape for n, a in zip(names, arrays) if hasattr(a, 'shape')}
    _tracing.prediction = prediction
    _tracing.calls = collections.Counter()
    try:
        block._build_cache(*args)
        return _tracing.calls
    finally:
        _tracing.input_shapes, _tracing.prediction, _tracing.calls = None, False, None


def _flatten(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flatten(a)
        else:
            yield a


def _use_graph_for_mode(block, args, training):
    """Give ``block`` its cached graph for training (``training``) or for
    prediction: two graphs where a SyncBatchNorm layer in it synchronizes.

    A traced graph runs in both modes (MXNet passes the mode to each operator
    at run time), so one graph would run a synchronizing layer's moments and
    exchange in predict mode too. Such a block gets a second graph, traced
    for prediction, in which each layer is ``BatchNorm`` with the running
    statistics: the graph ``nn.BatchNorm`` would have. Both are traced at the
    block's first call, whatever its mode, so that the threads of a
    data-parallel step, which must not trace (MXNet's name scopes race),
    find both. Gluon's own clearing (``hybridize()``, a new child, ``cast``)
    drops both.

    In static_shape graphs MXNet holds a call's running statistics as
    read-only inputs (see ``mxnet_private``), so the engine does not order
    a training call's update of them against a predict call's read: there
    a predict call after training calls on its device is fenced
    (:func:`_fence`)."""
    graphs = block.__dict__.get('_gluon_syncbn_graphs')
    if graphs is not None and block._cached_op is not graphs[graphs['mode']][_OP]:
        graphs = block._gluon_syncbn_graphs = None  # cleared or rebuilt by Gluon
    if block._cached_op is not None and _moved(block):
        block._clear_cached_op()  # traced for the devices its layers lived on before
        graphs = block._gluon_syncbn_graphs = None
    if graphs is None:
        if block._cached_op is not None:
            return  # built with nothing synchronizing
        calls = _build(block, args, prediction=False)
        _note_placement(block)
        if not _synchronizes(block):
            return
        static = bool(dict(block._flags).get('static_shape'))
        # 'static': per device, the static training graph's native layers
        # (None: its training graph is not static_shape); 'trained': the
        # devices with training calls since their last predict call.
        graphs = {'mode': True, True: [getattr(block, a) for a in _GRAPH_ATTRIBUTES],
                  'calls': calls, 'static': {} if static else None, 'trained': set()}
        block._clear_cached_op()
        try:
            _build(block, args, prediction=True)
        except BaseException:
            block._clear_cached_op()  # no half-built pair: the next call traces both again
            raise
        graphs[False] = [getattr(block, a) for a in _GRAPH_ATTRIBUTES]
        graphs['mode'] = False
        block._gluon_syncbn_graphs = graphs
    if graphs['mode'] != training:
        with _switch_lock:
            if graphs['mode'] != training:
                for name, value in zip(_GRAPH_ATTRIBUTES, graphs[training]):
                    setattr(block, name, value)
                graphs['mode'] = training


# How many times a Parameter was placed on contexts (initialized, moved,
# loaded onto others): a cached graph knows the layers' devices at its trace,
# and checks them again only when this changed (:func:`_moved`).
_placements = [0]


def install_parameter_hook(parameter_class):
    """Count placements of Parameters (``_init_impl``: ``initialize``,
    ``reset_ctx``, ``load_parameters(ctx=...)``)."""
    if getattr(parameter_class, '_gluon_syncbn_hooked', False):
        return
    original = parameter_class._init_impl

    def _init_impl(self, *args, **kwargs):
        _placements[0] += 1
        return original(self, *args, **kwargs)

    parameter_class._init_impl = _init_impl
    parameter_class._gluon_syncbn_hooked = True


def _note_placement(block):
    """Remember the contexts of the SyncBatchNorm layers ``block``'s graph
    was traced for."""
    block._gluon_syncbn_placement = [_placements[0]] + [
        (b.gamma, b.gamma.list_ctx()) for b in blocks_of(block) if hasattr(b, '_backend_for')]


def _moved(block):
    """Whether a SyncBatchNorm layer of ``block`` lives on other contexts
    than its cached graph was traced for (``reset_ctx``, ``initialize(...,
    force_reinit=True)``, ``load_parameters(ctx=...)``): the graph holds the
    layers' backends for those devices, and would wait for a device that no
    longer calls, or refuse one that now does."""
    placement = block.__dict__.get('_gluon_syncbn_placement')
    if placement is None or placement[0] == _placements[0]:
        return False
    for param, contexts in placement[1:]:
        try:
            if param.list_ctx() is not contexts:
                return True
        except RuntimeError:  # not initialized any more
            return True
    placement[0] = _placements[0]
    return False


class _StaticLayers(object):
    """A static_shape graph's native layers on one device, found once per
    graph and device: their handles, device indices and running statistics."""

    def __init__(self, graphs, ctx):
        self.handles, self.devices, self.running = [], [], []
        for backend in graphs['calls']:
            if ctx in backend.devices:
                device = backend.devices.index(ctx)
                self.handles.append(backend.handle)
                self.devices.append(device)
                self.running += backend.running_arrays(device)


def _static_layers(graphs, ctx):
    found = graphs['static'].get(ctx)
    if found is None:
        found = graphs['static'][ctx] = _StaticLayers(graphs, ctx)
    return found


def _stamp_static(graphs, ctx, session):
    """Before a static_shape graph's training calls on ``ctx`` are issued:
    tell its layers the step they belong to, which its operators, made once,
    cannot know: one engine operation on their engine variables, ordered
    before the graph's calls (``gsbn_stamp_static``)."""
    layers = _static_layers(graphs, ctx)
    if layers.handles:
        session.native.stamp_static(layers.handles, layers.devices)
    graphs['trained'].add(ctx)


def _fence(graphs, ctx, session):
    """Before a static_shape block's predict-mode graph is issued on ``ctx``
    after training calls there: its reads of the running statistics come
    after those calls' updates, which the static graph made inside its
    operators, as read-only inputs: one engine operation on the layers'
    engine variables and running statistics (``gsbn_fence``). No thread
    waits, so a device's predict call may come before another device's
    training call of the same step."""
    graphs['trained'].discard(ctx)
    layers = _static_layers(graphs, ctx)
    if layers.handles:
        session.native.fence(layers.handles, layers.devices, layers.running)


def install_cached_op_hook(hybrid_block_class, session, is_training):
    """Before a cached graph with SyncBatchNorm layers runs: the graph of the
    mode (:func:`_use_graph_for_mode`); a failed step's errors cleared; every
    device checked to feed it one dtype in this step."""
    if getattr(hybrid_block_class, '_gluon_syncbn_cached_op_hooked', False):
        return
    original = hybrid_block_class._call_cached_op

    def _call_cached_op(self, *args):
        try:
            return _run_cached_op(self, args)
        except (mx.base.MXNetError, ValueError) as exc:
            # A layer's refusal, while the graph was traced or issued (its
            # shape or type inference): the devices issued before fail now.
            ours = exc if isinstance(exc, SyncBatchNormError) else ours_behind(exc)
            if ours is None:
                raise
            session.fail_step(ours)
            if ours is exc:
                raise
            raise ours from exc

    def _run_cached_op(self, args):
        session.separate_this_thread()
        training = bool(is_training())
        _use_graph_for_mode(self, args, training)
        session.clear_failed_arrays()
        graphs = self.__dict__.get('_gluon_syncbn_graphs')
        if graphs and training:
            for backend in graphs['calls']:  # eps and momentum, as the user set them now
                backend.follow_arguments()
        if graphs and graphs['static'] is not None and args and hasattr(args[0], 'context'):
            ctx = str(args[0].context)
            if training:
                _stamp_static(graphs, ctx, session)
            elif ctx in graphs['trained']:
                _fence(graphs, ctx, session)
        layers = None
        if args and hasattr(args[0], 'dtype') and training:
            # The layers' names and device count, found again whenever the
            # graph is rebuilt (convert_model and hybridize() after a first
            # call rebuild it).
            graph, layers = getattr(self, '_gluon_syncbn_layers', (None, None))
            if layers is None or graph is not self._cached_op:
                found = [b for b in blocks_of(self) if hasattr(b, '_backend_for')]
                layers = (', '.join("'%s'" % b.name for b in found),
                          len(found[0].gamma.list_ctx())) if found else ()
                self._gluon_syncbn_layers = (self._cached_op, layers)
        if layers:
            names, num_devices = layers
            session.check_dtypes(self, names, num_devices, args[0].context,
                                 dtype_name(args[0].dtype))
            if any(getattr(a, 'size', 1) == 0 for a in args):
                # An empty slice: cached graphs divide by zero on size-0 input
                # (reshape), so this call runs imperatively, where each
                # SyncBatchNorm layer joins its exchanges with count 0.
                return _forward_imperatively(self, args)
        return original(self, *args)

    hybrid_block_class._call_cached_op = _call_cached_op
    hybrid_block_class._gluon_syncbn_cached_op_hooked = True


def refuse_copy_of_graph(block):
    """Raise if ``block``, which holds SyncBatchNorm layers, has a cached
    graph: MXNet's CachedOp cannot be copied (nn.BatchNorm's network fails
    there too, deep inside ``copy``: "ctypes objects containing pointers
    cannot be pickled")."""
    if block._cached_op is not None or block.__dict__.get('_gluon_syncbn_graphs'):
        raise SyncBatchNormError(
            "'%s' is hybridized and has run: its cached graph (MXNet's CachedOp) cannot be "
            "copied, with SyncBatchNorm as with nn.BatchNorm layers. Copy it before its first "
            "call, or call net.hybridize(False) first (it drops the graph; hybridize the copy "
            "and the original again after)." % block.name)


def deepcopy_as_default(obj, memo):
    """What ``copy.deepcopy`` does for ``obj`` without a ``__deepcopy__``
    (its ``__reduce_ex__``, which uses ``__getstate__``): Python's own
    ``copy._reconstruct``."""
    return copy._reconstruct(obj, memo, *obj.__reduce_ex__(4))  # pylint: disable=protected-access


def install_deepcopy_hook(hybrid_block_class):
    """``copy.deepcopy`` of a hybridized block that holds SyncBatchNorm
    layers and has a cached graph raises our error, saying why; any other
    copy is Python's own."""
    if '__deepcopy__' in vars(hybrid_block_class):
        return

    def __deepcopy__(self, memo):
        if any(hasattr(b, '_backend_for') for b in blocks_of(self)):
            refuse_copy_of_graph(self)
        return deepcopy_as_default(self, memo)

    hybrid_block_class.__deepcopy__ = __deepcopy__


# MXNet's refusal of a higher-order gradient through our layers where their
# own operators cannot say it: a CachedOp's (a hybridized network's, or the
# GPU path's imperative call's, whose advice about hybridize is wrong for a
# network that was not hybridized).
_NO_HIGHER_ORDER = 'CachedOp does not support higher order gradients'


def _as_ours(exc, heads, session):
    """The SyncBatchNorm failure behind MXNet's error ``exc``, raised by
    ``autograd.grad``/``backward`` of ``heads``, or None: a layer's own
    refusal, or MXNet's of a higher-order gradient where SyncBatchNorm
    layers synchronize, naming the layers ``heads`` were computed through
    (a graph run as a CachedOp does not show its operators: then every layer
    that synchronizes)."""
    ours = exc if isinstance(exc, SyncBatchNormError) else ours_behind(exc)
    unnamed = ours is not None and "SyncBatchNorm '?'" in str(ours)
    if ours is not None and not unnamed:
        return None if ours is exc else ours
    if not unnamed and (not session.active()
                        or _NO_HIGHER_ORDER not in str(exc)):
        return None
    names = _layers_in(heads, session) or sorted(
        {b.layer_name for b in session.live_backends()})
    ours = SyncBatchNormError(messages.text('no_higher_order', layer="', '".join(names)))
    ours.__cause__ = exc
    return ours


def _layers_in(heads, session):
    """The names of the SyncBatchNorm layers whose operators the graph
    ``heads`` were computed through shows (by the layers' handles)."""
    import json  # pylint: disable=import-outside-toplevel
    handles = set()
    for head in heads if isinstance(heads, (list, tuple)) else [heads]:
        try:
            nodes = json.loads(mx.autograd.get_symbol(head).tojson())['nodes']
        except Exception:  # pylint: disable=broad-except
            continue
        handles.update(n.get('attrs', {}).get('layer') for n in nodes)
    return sorted(b.layer_name for b in session.live_backends() if str(b.handle) in handles)


def install_grad_hooks(autograd_module, ndarray_class, session):
    """A higher-order gradient through a SyncBatchNorm layer
    (``autograd.grad(..., create_graph=True)``, then a backward through the
    gradient) raises our error naming the layer, as MXNet names
    nn.BatchNorm's backward: from ``autograd.grad``, ``autograd.backward`` or
    ``NDArray.backward``. The native operators' backward refuses a gradient
    of its own with the layer's name (``no_higher_order``)."""
    if getattr(autograd_module.grad, '_gluon_syncbn_hooked', False):
        return

    def translated(function, heads_of):
        def call(*args, **kwargs):
            session.separate_this_thread()
            try:
                return function(*args, **kwargs)
            except mx.base.MXNetError as exc:
                ours = _as_ours(exc, heads_of(*args, **kwargs), session)
                if ours is None:
                    raise
                raise ours from exc
        call.__doc__ = function.__doc__
        call._gluon_syncbn_hooked = True
        return call

    autograd_module.grad = translated(autograd_module.grad, lambda heads, *a, **k: heads)
    autograd_module.backward = translated(autograd_module.backward,
                                          lambda heads, *a, **k: heads)
    ndarray_class.backward = translated(ndarray_class.backward, lambda self, *a, **k: self)


def install_trainer_hook(trainer_class, session, waitall):
    """Drain the engine before a Trainer's first broadcast of its parameters
    (see the module docstring), when any SyncBatchNorm layer has synchronized."""
    if getattr(trainer_class, '_gluon_syncbn_trainer_hooked', False):
        return
    original = trainer_class._init_params

    def _init_params(self):
        if session.active() and self._params_to_init:
            try:
                waitall()  # running statistics written by pending engine operations
            except Exception as exc:  # pylint: disable=broad-except
                raise session.failure_behind(exc)
        return original(self)

    trainer_class._init_params = _init_params
    trainer_class._gluon_syncbn_trainer_hooked = True


def install_read_hooks(ndarray_class, namespaces, session):
    """While a thread waits for an output (``NDArray.asnumpy``,
    ``wait_to_read``, ``waitall``), the native session knows it: a layer
    whose device's calls this thread issues, and that times out waiting for
    one, then says that the read came before that device's call
    (``early_read``). Nothing is noted until a layer has synchronized."""
    if getattr(ndarray_class.asnumpy, '_gluon_syncbn_hooked', False):
        return

    def noted(function, describe, whole_engine=False):
        def read(*args, **kwargs):
            if not session.active():
                return function(*args, **kwargs)
            session.native.reading(describe(*args))
            try:
                return function(*args, **kwargs)
            except Exception as exc:  # pylint: disable=broad-except
                if not whole_engine:
                    raise  # the array's own error
                raise session.failure_behind(exc)
            finally:
                session.native.reading(None)
        read.__doc__ = function.__doc__
        read._gluon_syncbn_hooked = True
        return read

    for name in ('asnumpy', 'wait_to_read'):
        setattr(ndarray_class, name, noted(
            getattr(ndarray_class, name),
            lambda self, *a, name=name: 'NDArray.%s() of an array on %s' % (name, self.context)))
    # waitall raises the first error of any operation: where a step failed,
    # its cause (Session.failure_behind).
    waitall = noted(namespaces[0].waitall, lambda *a: 'mx.nd.waitall()', whole_engine=True)
    for namespace in namespaces:
        namespace.waitall = waitall


def install():
    """Install every hook (idempotent; the package's ``__init__`` does, at
    import); each does nothing until a layer has synchronized."""
    install_record_abort_hook(mx.autograd._RecordingStateScope, SESSION)
    install_step_hooks(mx.autograd, SESSION)
    install_exit_abort_hook(SESSION, mx.nd.waitall)
    install_cached_op_hook(mx.gluon.HybridBlock, SESSION, mx.autograd.is_training)
    install_parameter_hook(mx.gluon.Parameter)
    install_deepcopy_hook(mx.gluon.HybridBlock)
    install_grad_hooks(mx.autograd, mx.nd.NDArray, SESSION)
    install_trainer_hook(mx.gluon.Trainer, SESSION, mx.nd.waitall)
    install_read_hooks(mx.nd.NDArray, (mx.nd, mx.nd.ndarray), SESSION)



# ------------------------------------------ Python's exit and a user's kvstore --
# Installed by transport.py for a cross-process layer (the policy, what to do
# at exit and under which lock, stays there); here because they patch code
# that is not ours.

def install_exit_guard(note_failure, at_exit):
    """Once per process: ``at_exit()`` runs at interpreter exit, and
    ``note_failure(code, cause)`` learns how the script ended where that was
    a failure.

    Python tells nobody at exit how the script ended, so hooks note it as
    it happens: ``sys.excepthook`` (an uncaught exception), and the exit
    exception, which notes a non-zero code when it is deleted with no Python
    code left on the stack, which happens only once it has ended the script
    (one the script catches dies inside its frames). That exception is
    :class:`_ScriptExit`: ``sys.exit`` raises it, and it is the builtin
    ``SystemExit`` from now on, which ``raise SystemExit(n)`` and the
    builtin ``exit(n)`` raise (a subclass: ``except SystemExit`` catches it).
    """
    if sys.exit is _script_exit:
        return
    previous_hook = sys.excepthook

    def excepthook(kind, value, trace):
        if not _in_python_code():  # the uncaught exception that ends the script
            note_failure(130 if issubclass(kind, KeyboardInterrupt) else 1,
                         ('%s: %s' % (kind.__name__, value)) if str(value) else kind.__name__)
        previous_hook(kind, value, trace)
    sys.excepthook = excepthook
    _ScriptExit.note_failure = staticmethod(note_failure)
    sys.exit = _script_exit
    builtins.SystemExit = _ScriptExit
    atexit.register(at_exit)


def _in_python_code():
    """Whether a Python frame is on the stack beyond the caller's own."""
    try:
        sys._getframe(2)
    except ValueError:
        return False
    return True


class _ScriptExit(SystemExit):
    """What ``sys.exit`` raises once :func:`install_exit_guard` ran."""

    def __del__(self):
        code = 0 if self.code is None else self.code if isinstance(self.code, int) else 1
        if code != 0 and not _in_python_code():
            self.note_failure(code, 'sys.exit(%r)' % (self.code,))


def _script_exit(status=None):
    """``sys.exit`` once :func:`install_exit_guard` ran."""
    raise _ScriptExit(status)


def wrap_kvstore(kvstore, lock, refusal):
    """Make every call on the user's ``kvstore`` take ``lock``, ours and the
    Trainer's alike, and its ``set_gradient_compression`` raise ``refusal``.

    MXNet's dist kvstore front end keeps per-key buffers in unguarded C++ maps.
    Our reductions are issued from engine threads while the main thread
    issues the Trainer's, and the Trainer's first calls insert into those maps.
    Compression MXNet would apply to every key of the store, ours too, and
    then refuse pushpull.

    Issuing a push or pull is asynchronous, so the lock is held briefly. ``init``
    and ``broadcast`` block until the store holds the value, which may wait for
    our operators (they write the running statistics the Trainer broadcasts)
    while those wait for the lock: so these first drain the engine, then lock.
    They also drain afterwards: a broadcast's pull still in flight when the same
    key's first pushpull is issued can land in the wrong array (MXNet 1.9.1
    reuses one per-key buffer for both). Plain Gluon with a dist_sync Trainer
    diverged across workers in 9 of 16 loaded runs that way; draining after
    the Trainer's lazy initialization, 0 of 12.
    The wrappers reach the store through a weak reference, so the store is
    still destroyed when the user drops it.
    """
    ref = weakref.ref(kvstore)
    for name in ('init', 'broadcast', 'push', 'pull', 'pushpull', 'row_sparse_pull'):
        method = getattr(type(kvstore), name, None)
        if method is not None:
            drain = mx.nd.waitall if name in ('init', 'broadcast') else None
            setattr(kvstore, name, _locked(method, ref, lock, drain))

    def set_gradient_compression(compression_params):
        raise refusal
    kvstore.set_gradient_compression = set_gradient_compression


def _locked(method, ref, lock, drain):
    def call(*args, **kwargs):
        if drain is not None:
            drain()
        with lock:
            result = method(ref(), *args, **kwargs)
        if drain is not None:
            drain()
        return result
    call.__doc__ = method.__doc__
    return call
