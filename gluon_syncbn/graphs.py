"""A block's cached graphs: what runs when a hybridized block, or a
SymbolBlock, holding SyncBatchNorm layers in its graph is called.

A traced graph holds ``nn.BatchNorm``'s node for each layer, marked with
the layer (:mod:`.traced`), whoever traced it: Gluon for a hybridized
block, the user or GluonCV for a SymbolBlock. When a block builds its
CachedOp (its call, through ``HybridBlock._call_cached_op``: ``hooks``), the
graph is *bound*:

* Gluon's own build makes the CachedOp of the traced graph as it is, the
  graph ``nn.BatchNorm``'s network has: the **predict graph**. It also
  finishes a deferred initialization.
* Each marked node is resolved to a layer by one rule (:func:`layer_for`,
  which ``convert_model`` applies to a SymbolBlock's nodes too): the layer
  its mark names, where that layer's ``gamma`` is the Parameter the block
  feeds the node; else a *shadow*, a layer with the node's arguments and
  the marking layer's settings (``convert_model``'s) that adopts the
  block's Parameters (a SymbolBlock's own, or the nodes ``convert_model``
  marked in one). Shadows are held by the block (:class:`Shadows`), not as
  children.
* Where a layer synchronizes on the devices its Parameters live on now, a
  **training graph** is made from the traced one: each of its nodes
  replaced by the layer's backend's graph (the native operators take the
  layer's handle as an argument, bound here, before MXNet creates any
  operator state), with the number of dimensions and the dtype of the
  node's input that MXNet infers from the block's inputs. Gluon builds its
  CachedOp too.

A block keeps both (:class:`Graphs`, its ``_gluon_syncbn_graphs``) and
switches between them by the call's mode; ``export()`` writes the traced
graph without marks (:func:`without_marks`), whatever the last call's mode.
A graph none of whose layers synchronizes runs as Gluon's call, and
until the process has made a layer no block is bound at all (``hooks``).
A graph is bound again when its layers' Parameters move to other devices
(:meth:`Graphs.moved`) and after Gluon's own clearing (``hybridize()``,
``cast``, a new child). In static_shape graphs a training call is stamped
with its step and a predict call after training calls is fenced
(:meth:`Graphs.stamp`, :meth:`Graphs.fence`). A marked graph that cannot
synchronize is refused at its first call (a node inside a control-flow
operator's subgraph or a partitioned graph, parameters computed by
operators), and so is a CachedOp or a Module made from a synchronizing
graph outside a block's call (:func:`check_cached_op`,
:func:`check_module`). At a network's first training call that
synchronizes, its batch-norm layers left per device get one warning
(:func:`check_network`).
"""
import contextlib
import sys
import threading
import weakref

import mxnet as mx
from mxnet.gluon import SymbolBlock
from mxnet.gluon.nn.basic_layers import _BatchNorm

from . import traced
from .backends.base import Call, Params
from .block import SyncBatchNorm, is_sync_batchnorm
from .errors import SyncBatchNormError, warn_user
from .mxnet_private import dtype_name

__all__ = ['blocks_of', 'imperatively', 'layers_of', 'run_cached_op', 'without_marks',
           'check_cached_op', 'check_module', 'Graphs', 'Shadows', 'own_parameters', 'layer_for',
           'graph_layers', 'graph_batchnorms', 'keep_per_device', 'per_device_batchnorms',
           'check_network']


# ------------------------------------------------------------ block trees --

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


def layers_of(block):
    """Every SyncBatchNorm layer ``block`` runs, each once: those of its
    tree, and those the graphs of its SymbolBlocks resolve to (the layers
    that traced them, or shadows)."""
    seen, found = set(), []
    for b in blocks_of(block):
        if is_sync_batchnorm(b):
            layers = [b]
        elif isinstance(b, SymbolBlock):
            graph = traced.graph_of(b._cached_graph[1])
            params = {p.name: p for p in b.collect_params().values()}
            layers = [layer for _, _, layer in graph_layers(b, graph, params)]
        else:
            continue
        for layer in layers:
            if id(layer) not in seen:
                seen.add(id(layer))
                found.append(layer)
    return found


def graph_batchnorms(block):
    """The batch-norm nodes (as JSON) of a SymbolBlock's graph that use
    batch statistics and run as no layer (``nn.BatchNorm``'s nodes no
    ``convert_model`` marked, contrib's SyncBatchNorm); [] for any other
    block."""
    if not isinstance(block, SymbolBlock):
        return []
    graph = traced.graph_of(block._cached_graph[1])
    params = {p.name: p for p in block.collect_params().values()}
    resolved = {index for index, _, _ in graph_layers(block, graph, params)}
    return [n for i, n in enumerate(graph['nodes'])
            if i not in resolved and n['op'] in traced.BATCHNORMS
            and not traced.node_kwargs(n)['use_global_stats']]


# ---------------------------------------------- layers left per device --

# The networks check_network saw, each once.
_checked = weakref.WeakSet()
_checked_lock = threading.Lock()


def keep_per_device(block, name):
    """Note that the batch-norm layer ``block``, or the node ``name`` of the
    SymbolBlock ``block``'s graph, normalizes per device on purpose
    (``convert_model(..., keep=...)``): :func:`check_network` passes it."""
    block.__dict__.setdefault('_gluon_syncbn_kept', set()).add(name)


def per_device_batchnorms(net, num_devices):
    """What of ``net``'s tree normalizes each device's slice alone where its
    SyncBatchNorm layers synchronize ``num_devices`` devices, as text for a
    message: batch-norm blocks (``nn.BatchNorm`` and other ``_BatchNorm``
    subclasses, contrib's layer with another count) and SymbolBlocks'
    batch-norm nodes of no layer; neither those using their running
    statistics in training nor those kept per device."""
    found = []
    for block in blocks_of(net):
        kept = block.__dict__.get('_gluon_syncbn_kept', ())
        if isinstance(block, SymbolBlock):
            try:
                plain = graph_batchnorms(block)
            except SyncBatchNormError:
                continue  # a graph refused at its own first call, saying why
            nodes = ["'%s'" % n['name'] for n in plain if n['name'] not in kept
                     and int(n.get('attrs', {}).get('ndev', 1)) != num_devices]
            if nodes:
                found.append("%s (of SymbolBlock '%s')" % (', '.join(nodes), block.name))
        elif (isinstance(block, _BatchNorm) and not is_sync_batchnorm(block)
              and not block._kwargs.get('use_global_stats') and block.name not in kept
              and block._kwargs.get('ndev') != num_devices):
            found.append("'%s'" % block.name)
    return found


_BLOCK_CALL = mx.gluon.Block.__call__.__code__


def _called_network():
    """The block of the outermost frame of Gluon's ``Block.__call__`` on
    this thread's stack: the network the user called; None outside a
    call."""
    frame, network = sys._getframe(1), None  # pylint: disable=protected-access
    while frame is not None:
        if frame.f_code is _BLOCK_CALL:
            network = frame.f_locals.get('self', network)
        frame = frame.f_back
    return network


def check_network(caller, num_devices):
    """At the first training call that synchronizes ``num_devices`` devices
    of ``caller`` (a SyncBatchNorm layer, or a block whose graph runs such
    layers): one warning, once per network (the one the user called), if
    batch-norm layers there normalize each device's slice alone, naming
    them and the fix."""
    network = _called_network() or caller
    with _checked_lock:
        if network in _checked:
            return
        _checked.add(network)
    found = per_device_batchnorms(network, num_devices)
    if found:
        warn_user(
            "gluon_syncbn: '%s' trains with SyncBatchNorm layers synchronizing %d devices, "
            "but its batch-norm layer(s) %s normalize each device's slice alone. "
            "gluon_syncbn.convert_model(net) synchronizes them (or names those it cannot); "
            "to keep some per device on purpose, convert_model(net, keep='<a regular "
            "expression matching their names>')." % (network.name, num_devices, ', '.join(found)))


# ---------------------------------------------------------------- shadows --

class Shadows(object):
    """The shadow layers of a block's graph, by gamma's name (held outside
    Gluon's containers: a list or dict of Blocks in a block's attributes gets
    a warning from Gluon)."""

    def __init__(self):
        self.layers = {}

    def __iter__(self):
        return iter(self.layers.values())

    def __len__(self):
        return len(self.layers)


def shadows_of(block):
    """``block``'s :class:`Shadows`, made at the first need."""
    shadows = block.__dict__.get('_gluon_syncbn_shadows')
    if shadows is None:
        shadows = block.__dict__['_gluon_syncbn_shadows'] = Shadows()
    return shadows


def drop_shadows(block):
    """Forget ``block``'s shadows."""
    block.__dict__.pop('_gluon_syncbn_shadows', None)


# ------------------------------------------------------- resolving marks --

def _contexts_of(params):
    """The contexts the first initialized Parameter of ``params`` lives on
    (a graph's Parameters live on one list of contexts), or []."""
    for param in params:
        try:
            return param.list_ctx()
        except RuntimeError:  # not initialized
            continue
    return []


def _refuse(block, layers, where, fix):
    raise SyncBatchNormError(
        "'%s': SyncBatchNorm layer(s) %s would run %s, where they cannot synchronize: "
        "each device would normalize its slice alone. %s"
        % (block.name, ', '.join("'%s'" % l.name for l in layers), where, fix))


def own_parameters(graph, node, params):
    """The Parameters (of ``params``, by name) ``node`` takes as gamma, beta
    and the running statistics, or None where one of them is none of
    ``params`` (computed by an operator, or fed as an input)."""
    names = traced.parameter_inputs(graph, node)
    own = [params.get(n) for n in names] if names else [None]
    return None if any(p is None for p in own) else own


def layer_for(block, node, own, settings=None):
    """The one rule that resolves a batch-norm node of ``block``'s graph,
    fed the Parameters ``own``, to the layer it runs as: the live layer its
    mark names, where that layer's gamma is ``own``'s; else a shadow held by
    ``block``: made anew with ``settings`` where given (``convert_model``'s),
    else the one made before, or one with the marking layer's settings
    (default ones where the mark names no live layer). A shadow has the
    node's arguments (:meth:`SyncBatchNorm.shadow`)."""
    marking = traced.layer_of(node.get('attrs', {}).get(traced.MARK))
    if marking is not None and marking.gamma is own[0]:
        return marking
    shadows = shadows_of(block).layers
    layer = shadows.get(own[0].name)
    if settings is not None or layer is None or layer.gamma is not own[0]:
        layer = shadows[own[0].name] = SyncBatchNorm.shadow(
            traced.node_kwargs(node), own, **(settings or {'template': marking}))
    return layer


def graph_layers(block, graph, params):
    """``[(index, node, layer)]``: the marked nodes of ``graph``, ``block``'s
    traced graph as JSON, and the layer each runs as (:func:`layer_for`),
    given the Parameters ``block`` feeds its graph (``params``, by name).
    Raises where a node of a layer that would synchronize cannot: inside a
    subgraph (a control-flow operator's, or a graph partitioned by
    ``hybridize(backend=...)``), or fed gamma, beta or the running
    statistics by operators."""
    contexts = _contexts_of(params.values())

    def synchronizes(layer):
        return layer is not None and layer._synchronizes_on(contexts)
    hidden = [traced.layer_of(n['attrs'][traced.MARK]) for n in traced.marked_in_subgraphs(graph)]
    hidden = [layer for layer in hidden if synchronizes(layer)]
    if hidden:
        _refuse(block, hidden, "inside a control-flow operator's subgraph (or a graph "
                "partitioned by hybridize(backend=...))", 'Call them outside control-flow '
                'operators, and hybridize without a backend.')
    found = []
    for index, node in traced.marked(graph):
        own = own_parameters(graph, node, params)
        if own is None:
            marking = traced.layer_of(node['attrs'][traced.MARK])
            if synchronizes(marking):
                _refuse(block, [marking], "on gamma, beta or running statistics that are no "
                        "Parameters of the block (computed by operators, or fed as inputs)",
                        'Give the SymbolBlock the Parameters: gluon.SymbolBlock(outputs, '
                        'inputs, params=net.collect_params()).')
            continue  # it stays nn.BatchNorm's node
        found.append((index, node, layer_for(block, node, own)))
    return found


# ----------------------------------------------------------------- graphs --

# Held while Gluon builds a CachedOp for a block's call (check_cached_op).
_building = threading.local()
_switch_lock = threading.Lock()


def _gluon_build(block, args):
    """Gluon's ``_build_cache``: the CachedOp of ``block._cached_graph``,
    traced first if need be (which also finishes a deferred
    initialization)."""
    _building.depth = getattr(_building, 'depth', 0) + 1
    try:
        block._build_cache(*args)
    finally:
        _building.depth -= 1


class Graphs(object):
    """A block's bound graphs: the CachedOp of its traced graph (predict
    mode, and training where no layer in it synchronizes) and, where one
    does, the training graph's; which of them is in the block's attributes
    (Gluon's ``_cached_op`` and ``_cached_op_args``); what static_shape
    graphs need per device; the contexts its layers lived on.

    A copy or a pickle of a block starts without graphs."""

    def __init__(self, predict, layers=(), training=None, backends=(), static=False,
                 imperative=True, arguments=()):
        self._ops = {False: predict, True: training or predict}
        self.mode = False  # the predict graph is in the block's attributes
        # The contexts the layers lived on when bound: a Parameter placed
        # again (initialize, reset_ctx, load_parameters(ctx=...)) gets a new
        # list, which an identity check sees.
        self.contexts = [(layer.gamma, layer.gamma.list_ctx()) for layer in layers]
        self.arguments = arguments  # (layer, its eps and momentum in the training graph)
        self.backends = list(backends)
        names = sorted({b.layer.name for b in self.backends})
        self.names = ', '.join("'%s'" % n for n in names)
        self.num_devices = len(self.backends[0].devices) if self.backends else 0
        # Whether an empty slice can run imperatively: every layer in the
        # block's tree, run by its Python code.
        self.imperative = imperative
        # Per device, the static training graph's native layers (None: the
        # training graph is not static_shape); the devices with training
        # calls since their last predict call.
        self.static = {} if static and training is not None else None
        self.trained = set()
        self.network_checked = False  # check_network, at the first training call

    def __reduce__(self):
        # A copy or a pickle of the block (after hybridize(False), which
        # drops Gluon's CachedOp but not these) starts without graphs: they
        # hold CachedOps, which neither copy nor pickle.
        return _no_graphs, ()

    def current(self, block):
        """Whether ``block``'s CachedOp is the one these graphs put there
        (Gluon's clearing drops it; ``optimize_for`` builds another)."""
        return block._cached_op is self._ops[self.mode][0]

    def use(self, block, training):
        """The graph for ``training`` (or predict) mode into ``block``'s
        attributes."""
        if self.mode != training:
            with _switch_lock:
                if self.mode != training:
                    block._cached_op, block._cached_op_args = self._ops[training]
                    self.mode = training

    def moved(self, training):
        """Whether the graphs must be bound again: a layer lives on other
        contexts than when bound, or, for a ``training`` call, the user
        changed its eps or momentum (a momentum schedule), which the training
        graph's operators take as arguments (the predict graph's node, as
        ``nn.BatchNorm``'s, keeps those it was traced with)."""
        for param, contexts in self.contexts:
            try:
                if param.list_ctx() is not contexts:
                    return True
            except RuntimeError:  # not initialized any more
                return True
        return training and any(_arguments(layer) != bound for layer, bound in self.arguments)

    def _static_layers(self, ctx):
        found = self.static.get(ctx)
        if found is None:
            found = self.static[ctx] = _StaticLayers(self.backends, ctx)
        return found

    def stamp(self, ctx, session):
        """Before a static_shape graph's training calls on ``ctx`` are
        issued: tell its layers the step they belong to, which its
        operators, made once, cannot know: one engine operation on their
        engine variables, ordered before the graph's calls
        (``gsbn_stamp_static``)."""
        layers = self._static_layers(ctx)
        if layers.handles:
            session.native.stamp_static(layers.handles, layers.devices)
        self.trained.add(ctx)

    def fence(self, ctx, session):
        """Before a static_shape block's predict graph is issued on ``ctx``
        after training calls there: its reads of the running statistics
        come after those calls' updates, which the static graph made inside
        its operators, as read-only inputs: one engine operation on the
        layers' engine variables and running statistics (``gsbn_fence``).
        No thread waits, so a device's predict call may come before another
        device's training call of the same step."""
        self.trained.discard(ctx)
        layers = self._static_layers(ctx)
        if layers.handles:
            session.native.fence(layers.handles, layers.devices, layers.running)


def _no_graphs():
    return None


class _StaticLayers(object):
    """A static_shape graph's native layers on one device, found once per
    graph and device: their handles, device indices and running statistics."""

    def __init__(self, backends, ctx):
        self.handles, self.devices, self.running = [], [], []
        for backend in backends:
            if ctx in backend.devices:
                device = backend.devices.index(ctx)
                self.handles.append(backend.handle)
                self.devices.append(device)
                self.running += backend.running_arrays(device)


def _flatten(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flatten(a)
        else:
            yield a


def traced_ndim(shape):
    """A node's input's number of dimensions, from the shape MXNet inferred
    for it when the graph was bound, or None where it could not tell (the
    GPU path's graph then reshapes before ``moments``)."""
    return len(shape) if shape else None


def _training_symbol(block, symbol, graph, nodes, args, params, static):
    """``block``'s traced graph (``symbol``, as JSON ``graph``) with each of
    ``nodes`` (``(index, node, layer, backend)``) replaced by its layer's
    training graph from its backend."""
    arrays = [a for a in _flatten(args) if a is not None]
    inputs = [s.name for s in block._cached_graph[0]]
    shapes = {n: a.shape for n, a in zip(inputs, arrays) if hasattr(a, 'shape')}
    dtypes = {n: a.dtype for n, a in zip(inputs, arrays) if hasattr(a, 'dtype')}
    for name, param in params.items():
        if param.shape and all(param.shape):
            shapes.setdefault(name, param.shape)
        dtypes.setdefault(name, param.dtype)
    entries = [node['inputs'][0] for _, node, _, _ in nodes]
    found = traced.entry_attributes(graph, entries, shapes, dtypes, symbol)

    def replacement(node, layer, backend, shape, dtype):
        # The layer's own names (<prefix>sync, ...), as its trace gave them.
        name = node['name']
        prefix = name[:-len('fwd')] if name.endswith('fwd') else name + '_'
        known = dtype is not None
        dtype = dtype if known else layer._input_dtype

        def make(placeholders):
            data, *params = [mx.sym.var(n) for n in placeholders]
            with mx.name.Prefix(prefix):
                out = backend.forward(mx.sym, data, Params(*params), Call(
                    dtype, static, traced_ndim(shape), known, *_arguments(layer)))
                return mx.sym.relu(out, name='relu') if node['op'] in traced.WITH_RELU else out
        return make
    return traced.splice(graph, {index: replacement(node, layer, backend, *attributes)
                                 for (index, node, layer, backend), attributes
                                 in zip(nodes, found)}, symbol)


def _arguments(layer):
    """``layer``'s eps and momentum, which its training graph's operators
    take as arguments (as ``nn.BatchNorm``'s node does)."""
    return layer._kwargs['eps'], layer._kwargs['momentum']


def _bind(block, args):
    """:class:`Graphs` for ``block``, whose CachedOp of its traced graph was
    just built: the training graph's too where a layer synchronizes."""
    predict = (block._cached_op, block._cached_op_args)
    symbol = block._cached_graph[1]
    text = symbol.tojson(remove_amp_cast=False)
    if traced.MARK not in text:
        return Graphs(predict)
    graph = traced.graph_of(symbol)
    params = {p.name: p for is_arg, p in block._cached_op_args if not is_arg}
    found = graph_layers(block, graph, params)
    layers = list({id(layer): layer for _, _, layer in found}.values())
    backends = {}
    for layer in layers:
        backend = layer._training_backend()
        if backend is not None:
            backends[id(layer)] = backend
    nodes = [(i, n, layer, backends[id(layer)]) for i, n, layer in found if id(layer) in backends]
    if not nodes:
        return Graphs(predict, layers)
    if block._backend:
        _refuse(block, [layer for _, _, layer, _ in nodes],
                "in a graph partitioned for backend '%s'" % block._backend,
                'Hybridize without a backend (hybridize(backend=None)).')
    static = bool(dict(block._flags).get('static_shape'))
    training_symbol = _training_symbol(block, symbol, graph, nodes, args, params, static)
    traced_graph = block._cached_graph
    block._cached_graph = (traced_graph[0], training_symbol)
    block._cached_op = None
    try:
        _gluon_build(block, args)
        training = (block._cached_op, block._cached_op_args)
    finally:
        block._cached_graph = traced_graph
        block._cached_op, block._cached_op_args = predict
    tree = {id(b) for b in blocks_of(block)}
    return Graphs(predict, layers, training, backends.values(), static,
                  imperative=all(id(layer) in tree for _, _, layer, _ in nodes),
                  arguments=[(layer, _arguments(layer)) for _, _, layer, _ in nodes])


def _graphs_for(block, args, training):
    """``block``'s :class:`Graphs`, bound now if need be, with the graph for
    ``training`` (or predict) mode in its attributes."""
    before = graphs = block.__dict__.get('_gluon_syncbn_graphs')
    if graphs is not None and graphs.current(block):
        if not graphs.moved(training):
            graphs.use(block, training)
            return graphs
        block._cached_op = None  # bound for other devices, or another eps or momentum
    try:
        if block._cached_op is None:
            _gluon_build(block, args)
        graphs = _bind(block, args)
    except BaseException:
        block._clear_cached_op()  # nothing half-bound: the next call binds again
        raise
    if before is not None:
        # A predict call after the training calls of the graph before is
        # fenced all the same (a new eps or momentum between them).
        graphs.trained = before.trained
    block.__dict__['_gluon_syncbn_graphs'] = graphs
    graphs.use(block, training)
    return graphs


def run_cached_op(block, args, call, training, session):
    """``call(block, *args)``, Gluon's run of ``block``'s CachedOp, with the
    graph of the mode (``training``) bound; the network checked at its first
    training call that synchronizes; a failed step's errors cleared;
    a static_shape graph's call stamped or fenced; every device checked to
    feed it one dtype in a step; an empty slice run imperatively."""
    session.separate_this_thread()
    graphs = _graphs_for(block, args, training)
    if not graphs.backends:  # no layer in it synchronizes: Gluon's call as it is
        return call(block, *args)
    if training and not graphs.network_checked:
        graphs.network_checked = True
        check_network(block, graphs.num_devices)
    session.clear_failed_arrays()
    if graphs.static is not None and args and hasattr(args[0], 'context'):
        ctx = str(args[0].context)
        if training:
            graphs.stamp(ctx, session)
        elif ctx in graphs.trained:
            graphs.fence(ctx, session)
    if training and args and hasattr(args[0], 'dtype'):
        session.check_dtypes(block, graphs.names, graphs.num_devices, args[0].context,
                             dtype_name(args[0].dtype))
        if any(getattr(a, 'size', 1) == 0 for a in args):
            # An empty slice: cached graphs divide by zero on size-0 input
            # (reshape), so this call runs imperatively, where each
            # SyncBatchNorm layer joins its exchanges with count 0.
            if not graphs.imperative:
                exc = SyncBatchNormError(
                    "'%s' got an empty slice on %s: only a network's Python code runs one "
                    "(each layer joins its exchanges with 0 samples), and its SyncBatchNorm "
                    "layer(s) %s run in a graph without it (a SymbolBlock). Feed every device "
                    "at least one sample (DataLoader(..., last_batch='discard'))."
                    % (block.name, args[0].context, graphs.names))
                session.fail_step(exc)
                raise exc
            with imperatively(block):
                return block.forward(*args)
    return call(block, *args)


# ----------------------------------------------------------------- export --

@contextlib.contextmanager
def without_marks(block):
    """``block``'s traced graph without marks in the context: what
    ``export()`` writes, ``nn.BatchNorm``'s graph, which plain MXNet loads."""
    graph = block._cached_graph
    if not graph or not traced.has_marks(graph[1]):
        yield
        return
    block._cached_graph = (graph[0], traced.strip(graph[1]))
    try:
        yield
    finally:
        block._cached_graph = graph


# ------------------------------------------- graphs run outside a block --

def _synchronizing_layers(symbol):
    """The live layers marked in ``symbol`` that synchronize on their
    Parameters' devices (subgraphs included)."""
    graph = traced.graph_of(symbol)
    nodes = [n for _, n in traced.marked(graph)] + traced.marked_in_subgraphs(graph)
    found = {}
    for node in nodes:
        layer = traced.layer_of(node['attrs'][traced.MARK])
        if layer is not None and layer._synchronizes_on(_contexts_of([layer.gamma])):
            found[id(layer)] = layer
    return list(found.values())


def check_cached_op(symbol):
    """Raise if ``symbol``, about to become a CachedOp that no block's call
    builds (``mx.nd.CachedOp``, ``optimize_for``), holds a layer that
    synchronizes: such a CachedOp would run it as ``nn.BatchNorm`` on each
    device alone."""
    if getattr(_building, 'depth', 0) or not SyncBatchNorm.made_any \
            or traced.MARK not in symbol.tojson(remove_amp_cast=False):
        return
    layers = _synchronizing_layers(symbol)
    if layers:
        raise SyncBatchNormError(
            "SyncBatchNorm layer(s) %s synchronize over %d devices, but a CachedOp made from "
            "their graph outside a block's call (mx.nd.CachedOp, HybridBlock.optimize_for) "
            "would normalize each device's slice alone. Call the network (hybridized, or a "
            "gluon.SymbolBlock of the graph with params=net.collect_params()); for a "
            "deployment graph, export() writes nn.BatchNorm's."
            % (', '.join("'%s'" % l.name for l in layers), len(layers[0].gamma.list_ctx())))


def check_module(symbol, contexts):
    """Raise if a Module on several ``contexts`` would run ``symbol``, which
    holds marked layers: it binds one executor per context, each a
    BatchNorm of its own slice."""
    if len(contexts) < 2 or not SyncBatchNorm.made_any \
            or traced.MARK not in symbol.tojson(remove_amp_cast=False):
        return
    graph = traced.graph_of(symbol)
    nodes = [n for _, n in traced.marked(graph)] + traced.marked_in_subgraphs(graph)
    raise SyncBatchNormError(
        "%s: SyncBatchNorm node(s) %s cannot synchronize in a Module on %d contexts (one "
        "executor per context, each normalizing its slice alone). Train the network with "
        "Gluon (hybridized, or a gluon.SymbolBlock of this symbol), or export() it "
        "first for nn.BatchNorm's graph." % (
            'mx.mod.Module', ', '.join("'%s'" % n['name'] for n in nodes), len(contexts)))
