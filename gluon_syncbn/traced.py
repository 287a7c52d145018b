"""What a SyncBatchNorm layer puts in a traced graph, and the surgery on
such graphs: marking, stripping, splicing.

A SyncBatchNorm called on a Symbol (Gluon's trace of a hybridized network,
or ``net(mx.sym.var('data'))`` wrapped in a SymbolBlock, as GluonCV's
feature extractors do) emits exactly ``nn.BatchNorm``'s node, with the
layer's own arguments, plus one hidden attribute, :data:`MARK`: a token
naming the layer in this process. MXNet's parameter parsers skip
``__dunder__`` keys (``dmlc::parameter::kAllowHidden``), so plain MXNet
runs and loads a marked graph as ``nn.BatchNorm``'s. Nothing in the node
depends on the layer's devices, shapes or initialization.

Graphs are handled here as MXNet's JSON (``Symbol.tojson``), always with
AMP's casts kept (``remove_amp_cast=False``: by default ``tojson`` drops
``amp_cast`` and ``amp_multicast``).
"""
import itertools
import json
import os
import weakref

from .mxnet_private import dtype_name

__all__ = ['MARK', 'token_of', 'layer_of', 'has_marks', 'graph_of', 'symbol_of',
           'marked', 'marked_in_subgraphs', 'strip', 'mark', 'parameter_inputs', 'node_kwargs',
           'splice', 'entry_attributes']

MARK = '__gluon_syncbn__'
# The nodes a layer traces to, and so the ones a mark may sit on.
MARKABLE = ('BatchNorm', '_contrib_BatchNormWithReLU')
# Of those, the ones whose output goes through ReLU (nn.BatchNormReLU's).
WITH_RELU = ('_contrib_BatchNormWithReLU',)
# contrib's SyncBatchNorm operator (GluonCV's _syncbn_ networks): BatchNorm's
# arguments, defaults included, and two of its own, the count of devices and
# the key of its barrier, which :func:`mark` drops, making it BatchNorm.
CONTRIB = '_contrib_SyncBatchNorm'
_CONTRIB_ONLY = ('ndev', 'key')
# Every batch-norm operator a graph may hold; the others no mark can
# synchronize.
BATCHNORMS = MARKABLE + (CONTRIB, 'BatchNorm_v1')

# A token is '<this process's nonce>.<count>': one from another process (a
# symbol saved with Symbol.save) names no layer here.
_NONCE = os.urandom(6).hex()
_counter = itertools.count(1)
_LAYERS = weakref.WeakValueDictionary()


def token_of(layer):
    """The token naming ``layer`` in this process's graphs, made at its
    first trace (a copy or a pickle of the layer gets its own)."""
    token = layer.__dict__.get('_gluon_syncbn_token')
    if token is None or _LAYERS.get(token) is not layer:
        token = '%s.%d' % (_NONCE, next(_counter))
        layer.__dict__['_gluon_syncbn_token'] = token
        _LAYERS[token] = layer
    return token


def layer_of(token):
    """The live layer ``token`` names in this process, or None."""
    return _LAYERS.get(token)


def has_marks(symbol):
    """Whether ``symbol``'s graph holds a marked node, subgraphs included."""
    return MARK in symbol.tojson(remove_amp_cast=False)


def graph_of(symbol):
    """``symbol``'s graph as MXNet's JSON, a dict, AMP's casts included."""
    return json.loads(symbol.tojson(remove_amp_cast=False))


def symbol_of(graph, like):
    """The Symbol of ``graph`` (a JSON dict), a NumPy-mode Symbol where
    ``like`` is one."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    loaded = mx.sym.load_json(json.dumps(graph))
    if type(like).__module__.startswith('mxnet.symbol.numpy'):
        loaded = loaded.as_np_ndarray()
    return loaded


def marked(graph):
    """``[(index, node)]``: the marked nodes of ``graph`` (its own nodes,
    not its subgraphs')."""
    return [(i, n) for i, n in enumerate(graph['nodes'])
            if n['op'] in MARKABLE and MARK in n.get('attrs', {})]


def marked_in_subgraphs(graph):
    """The marked nodes inside the subgraphs of ``graph``'s nodes (those of
    control-flow operators, ``_foreach``, ``_while_loop``, ``_cond``, and of
    partitioned graphs), at any depth."""
    found = []
    for node in graph['nodes']:
        for sub in node.get('subgraphs', ()):
            found += [n for _, n in marked(sub)] + marked_in_subgraphs(sub)
    return found


def _retokened(symbol, token_for):
    """``symbol`` with each markable node's mark set to ``token_for(node)``
    (None: no mark); a node of contrib's SyncBatchNorm given one becomes a
    BatchNorm node."""
    graph = graph_of(symbol)
    for node in graph['nodes']:
        if node['op'] == CONTRIB and token_for(node) is not None:
            node['op'] = 'BatchNorm'
            for name in _CONTRIB_ONLY:
                node.get('attrs', {}).pop(name, None)
        if node['op'] not in MARKABLE:
            continue
        attrs = node.setdefault('attrs', {})
        token = token_for(node)
        if token is None:
            attrs.pop(MARK, None)
        else:
            attrs[MARK] = token
    return symbol_of(graph, symbol)


def strip(symbol):
    """``symbol`` without marks: the graph ``nn.BatchNorm``'s network has."""
    return _retokened(symbol, lambda node: None)


def mark(symbol, tokens):
    """``symbol`` with node ``name`` marked ``tokens[name]`` for each name in
    ``tokens`` (a node of contrib's SyncBatchNorm made BatchNorm's first);
    other nodes as they are."""
    return _retokened(symbol, lambda node: tokens.get(node['name'],
                                                      node.get('attrs', {}).get(MARK)))


def parameter_inputs(graph, node):
    """The names of the variables ``node`` takes as gamma, beta and the
    running statistics (its inputs after the data), or None where one of
    them is computed by an operator."""
    names = []
    for entry in node['inputs'][1:]:
        source = graph['nodes'][entry[0]]
        if source['op'] != 'null':
            return None
        names.append(source['name'])
    return names


# The defaults of MXNet's BatchNorm operator, for nodes that leave an
# argument out (GluonCV's FeatureExpander writes mx.sym.BatchNorm(y)).
_OPERATOR_DEFAULTS = {'eps': '0.001', 'momentum': '0.9', 'fix_gamma': 'True',
                      'use_global_stats': 'False', 'axis': '1'}


def node_kwargs(node):
    """The ``_kwargs`` of ``nn.BatchNorm`` that give ``node``'s arguments."""
    attrs = dict(_OPERATOR_DEFAULTS, **node.get('attrs', {}))

    def yes(value):
        return value in ('True', 'true', '1')
    return {'axis': int(attrs['axis']), 'eps': float(attrs['eps']),
            'momentum': float(attrs['momentum']), 'fix_gamma': yes(attrs['fix_gamma']),
            'use_global_stats': yes(attrs['use_global_stats'])}


def entry_attributes(graph, entries, shapes, dtypes, like):
    """``[(shape, dtype name)]`` of ``entries`` (nodes' inputs, as
    ``[node, output, version]``) of ``graph``, inferred from the ``shapes``
    and ``dtypes`` of its inputs by name, in one pass; None for what cannot
    be inferred."""
    symbol = symbol_of(dict(graph, heads=[list(e) for e in entries]), like)
    names = set(symbol.list_inputs())
    try:
        _, out_shapes, _ = symbol.infer_shape_partial(
            **{n: s for n, s in shapes.items() if n in names})
    except Exception:  # pylint: disable=broad-except
        out_shapes = None
    try:
        _, out_types, _ = symbol.infer_type_partial(
            **{n: t for n, t in dtypes.items() if n in names})
    except Exception:  # pylint: disable=broad-except
        out_types = None
    found = []
    for i in range(len(entries)):
        # An unknown shape is () (None in NumPy shape mode); a partly known
        # one still has its number of dimensions.
        shape = tuple(out_shapes[i]) if out_shapes and out_shapes[i] else None
        dtype = out_types[i] if out_types else None
        found.append((shape, dtype_name(dtype) if dtype is not None else None))
    return found


def splice(graph, replacements, like):
    """The Symbol of ``graph`` with each node ``i`` of ``replacements``
    replaced: ``replacements[i](placeholders)`` returns the Symbol to put in
    its place, a function of variables named ``placeholders`` (one per input
    of the node, in order), whose first output takes the place of the
    node's. The result has the same inputs and outputs as ``graph``; only
    a replaced node's first output may be used."""
    nodes, new, where, head_of = graph['nodes'], [], {}, {}

    def entry(e):
        version = e[2] if len(e) > 2 else 0
        if e[0] in head_of:
            if e[1] != 0:
                raise ValueError("node '%s': only its first output may be used"
                                 % nodes[e[0]]['name'])
            return list(head_of[e[0]])
        return [where[e[0]], e[1], version]

    for i, node in enumerate(nodes):
        inputs = [entry(e) for e in node['inputs']]
        if i not in replacements:
            copied = dict(node, inputs=inputs)
            if node.get('control_deps'):
                copied['control_deps'] = [where[d] for d in node['control_deps']]
            new.append(copied)
            where[i] = len(new) - 1
            continue
        names = ['__gluon_syncbn_input%d' % k for k in range(len(inputs))]
        sub = graph_of(replacements[i](names))
        local = {}
        for j, sub_node in enumerate(sub['nodes']):
            if sub_node['op'] == 'null':
                if sub_node['name'] not in names:
                    raise ValueError('a replacement may not add variables: %s'
                                     % sub_node['name'])
                local[j] = ('outer', inputs[names.index(sub_node['name'])])
                continue
            new.append(dict(sub_node, inputs=[_local(local, e) for e in sub_node['inputs']]))
            local[j] = ('new', len(new) - 1)
        head_of[i] = _local(local, sub['heads'][0])
    result = dict(graph, nodes=new, heads=[entry(h) for h in graph['heads']],
                  arg_nodes=[k for k, n in enumerate(new) if n['op'] == 'null'])
    result.pop('node_row_ptr', None)  # recomputed by MXNet at load
    return symbol_of(result, like)


def _local(local, e):
    kind, target = local[e[0]]
    if kind == 'outer':  # a placeholder: the outer graph's entry
        return list(target)
    return [target, e[1], e[2] if len(e) > 2 else 0]
