"""Swap BatchNorm layers for SyncBatchNorm in a model, and back for deployment.

Both directions hand the *same* Parameter objects to the new layer, so values,
contexts, gradients, attributes (a frozen ``grad_req``, ``lr_mult``, ...) and
checkpoints are untouched (bit-exact by construction).
In a SymbolBlock's graph (``SymbolBlock.imports`` of an export, GluonCV's
feature extractors) the BatchNorm nodes fed by the block's Parameters, and
contrib's SyncBatchNorm nodes made BatchNorm's, are marked with a layer
each, as a SyncBatchNorm's trace marks its node (:mod:`.traced`), and
unmarked again (BatchNorm's nodes). A block that normalizes over the batch
but is none of the layers known here (another subclass of Gluon's
``_BatchNorm``; a node of ``BatchNorm_v1``, or one whose statistics are
computed by operators, in a SymbolBlock) stays as it is, with a warning
naming it.
"""
import re

from mxnet import ndarray
from mxnet.gluon import SymbolBlock, nn
from mxnet.gluon.contrib import nn as contrib_nn
from mxnet.gluon.nn.basic_layers import _BatchNorm
from mxnet.util import is_np_array

from . import traced
from .block import SyncBatchNorm, adopt_parameters, is_sync_batchnorm
from .errors import warn_user
from .graphs import drop_shadows, keep_per_device, layer_for, own_parameters

__all__ = ['convert_model', 'revert_model']


class _SyncBatchNormReLU(SyncBatchNorm):
    """What ``convert_model`` makes of ``nn.BatchNormReLU``: SyncBatchNorm,
    then ReLU, with the same Parameters (and names) as the layer it replaces."""

    def _alias(self):
        return 'syncbatchnormrelu'

    def _fused_relu(self):
        # As nn.BatchNormReLU: BatchNormWithReLU, ReLU included, where MXNet
        # has it (not in NumPy mode).
        return not is_np_array()

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        out = super(_SyncBatchNormReLU, self).hybrid_forward(F, x, gamma, beta, running_mean,
                                                             running_var)
        if F is not ndarray and self._fused_relu():
            return out  # a trace: nn.BatchNormReLU's node, ReLU included
        return F.npx.relu(out) if is_np_array() else F.relu(out)


# The layers convert_model replaces (by their exact class: a subclass may
# do more than its base, which a replacement would drop), and what by.
_SYNCHRONIZED = {nn.BatchNorm: SyncBatchNorm, contrib_nn.SyncBatchNorm: SyncBatchNorm,
                 nn.BatchNormReLU: _SyncBatchNormReLU}
_REVERTED = {SyncBatchNorm: nn.BatchNorm, _SyncBatchNormReLU: nn.BatchNormReLU}


def _replacement(cls, bn, **settings):
    """A ``cls`` layer named as ``bn``, with its arguments (contrib's layer
    has no ``axis``: 1) and its very Parameter objects."""
    kwargs = dict(getattr(bn, '_kwargs', {}))
    layer = cls(prefix=bn.prefix, axis=kwargs.get('axis', 1),
                momentum=kwargs.get('momentum', 0.9), epsilon=kwargs.get('eps', 1e-5),
                scale=not kwargs.get('fix_gamma', False),
                use_global_stats=kwargs.get('use_global_stats', False),
                in_channels=bn.gamma.shape[0] if bn.gamma.shape else 0, **settings)
    return adopt_parameters(layer, (bn.gamma, bn.beta, bn.running_mean, bn.running_var))


def _swap(block, make):
    """Replace, anywhere below ``block``, every child for which ``make(child)``
    gives a layer by that layer (``child`` itself: changed in place, a
    SymbolBlock's graph).

    Returns how many layers were replaced or changed. Children are found
    through Gluon's registry and replaced there and in every attribute,
    list, tuple or dict of the parent that refers to them.
    """
    replaced = 0
    for key, child in list(block._children.items()):
        new = make(child)
        if new is child:
            replaced += 1
        elif new is not None:
            block.register_child(new, key)  # in place: same name, same position
            _replace_references(block, child, new)
            replaced += 1
        else:
            replaced += _swap(child, make)
    if replaced and hasattr(block, '_clear_cached_op'):
        block._clear_cached_op()  # the cached graph still holds the old layers
    return replaced


def _replace_references(parent, old, new):
    for name, value in list(vars(parent).items()):
        if value is old:
            object.__setattr__(parent, name, new)
        elif isinstance(value, list):
            value[:] = [new if v is old else v for v in value]
        elif isinstance(value, tuple) and any(v is old for v in value):
            object.__setattr__(parent, name, tuple(new if v is old else v for v in value))
        elif isinstance(value, dict) and not name.startswith('_'):
            for k, v in list(value.items()):
                if v is old:
                    value[k] = new


def convert_model(net, num_devices=None, timeout=None, kvstore=None, sync_groups=None,
                  keep=None):
    """Replace every BatchNorm in ``net`` by :class:`SyncBatchNorm`, in place.

    Handles ``gluon.nn.BatchNorm``, ``gluon.nn.BatchNormReLU`` and
    ``gluon.contrib.nn.SyncBatchNorm`` at any depth (Sequential,
    HybridSequential, custom blocks, lists of blocks). Each new layer reuses
    the old layer's Parameter objects, so initialized values, running
    statistics and checkpoints carry over exactly. In a SymbolBlock's graph
    (``SymbolBlock.imports`` of an export, GluonCV's feature extractors) every
    BatchNorm or contrib SyncBatchNorm node (GluonCV's ``_syncbn_`` networks)
    that uses batch statistics and takes its statistics from the block's
    Parameters synchronizes, with a layer of its own.

    Parameters
    ----------
    net : Block
        The model; modified in place and returned.
    num_devices : int or None
        Passed to every :class:`SyncBatchNorm` (None: the number of contexts,
        across processes this worker's).
    timeout : float or None
        Passed to every :class:`SyncBatchNorm`.
    kvstore : KVStore, 'horovod' or None
        Passed to every :class:`SyncBatchNorm`: synchronize across worker
        processes too.
    sync_groups : int, list of lists of int, or None
        Passed to every :class:`SyncBatchNorm`: normalize within these groups
        of devices.
    keep : str or None
        A regular expression, as ``collect_params(select)`` takes: the
        batch-norm layers and SymbolBlock nodes whose names it matches stay
        as they are, normalizing each device's slice alone on purpose, which
        no warning names then (neither here nor at the first training step).

    Returns
    -------
    Block
        ``net``. Call ``hybridize()`` again if it was hybridized.
    """
    settings = dict(num_devices=num_devices, timeout=timeout, kvstore=kvstore,
                    sync_groups=sync_groups)
    kept = re.compile(keep).match if keep else lambda name: None

    def make(block):
        if isinstance(block, SymbolBlock):
            return block if _synchronize_graph(block, settings, kept) else None
        if isinstance(block, _BatchNorm) and not is_sync_batchnorm(block) and kept(block.name):
            keep_per_device(block, block.name)
            return None
        layer = _SYNCHRONIZED.get(type(block))
        if layer is None:
            _warn_if_it_normalizes(block)
            return None
        return _replacement(layer, block, **settings)
    new = make(net)
    if new is not None:
        return new
    _swap(net, make)
    return net


def revert_model(net):
    """Replace every :class:`SyncBatchNorm` in ``net`` by ``gluon.nn.BatchNorm``, in place.

    The result contains only stock Gluon layers, and a SymbolBlock's graph
    no mark. (``export()`` writes ``nn.BatchNorm``'s graph either way, which
    plain MXNet loads without this package.) Parameters are shared, as in
    :func:`convert_model`.

    Parameters
    ----------
    net : Block

    Returns
    -------
    Block
        ``net``. Call ``hybridize()`` again if it was hybridized.
    """
    def make(block):
        if isinstance(block, SymbolBlock):
            return block if _unsynchronize_graph(block) else None
        layer = _REVERTED.get(type(block))
        return _replacement(layer, block) if layer is not None else None
    new = make(net)
    if new is not None:
        return new
    _swap(net, make)
    return net


def _synchronize_graph(block, settings, kept):
    """Mark every BatchNorm node of a SymbolBlock's graph (contrib's
    SyncBatchNorm nodes made BatchNorm's) that uses batch statistics and
    takes gamma, beta and the running statistics from the block's
    Parameters, each with a layer of its own (a shadow with the
    node's arguments and ``settings``: :func:`.graphs.layer_for`), as a
    SyncBatchNorm's trace would; nodes a live layer of the block's
    Parameters marked already keep their layer; nodes whose name ``kept``
    matches stay per device (:func:`.graphs.keep_per_device`). Warns about
    batch-norm nodes it cannot mark. Returns whether the graph changed."""
    inputs, symbol = block._cached_graph
    graph = traced.graph_of(symbol)
    params = {p.name: p for p in block.collect_params().values()}
    tokens, left = {}, []
    for node in graph['nodes']:
        if node['op'] in traced.BATCHNORMS and kept(node['name']):
            keep_per_device(block, node['name'])
            continue
        if node['op'] not in traced.MARKABLE + (traced.CONTRIB,):
            if node['op'] in traced.BATCHNORMS:
                left.append(node['name'])
            continue
        kwargs = traced.node_kwargs(node)
        if kwargs['use_global_stats']:
            continue  # running statistics in training too: nothing to synchronize
        own = own_parameters(graph, node, params)
        if own is None:
            left.append(node['name'])
            continue
        token = traced.token_of(layer_for(block, node, own, settings))
        if node.get('attrs', {}).get(traced.MARK) != token:
            tokens[node['name']] = token
    if left:
        warn_user("convert_model: '%s' is a SymbolBlock whose graph holds batch-norm "
                  "operator(s) it cannot synchronize (%s: BatchNorm_v1, or statistics that "
                  "are no Parameters of the block): they stay as they are and normalize each "
                  "device's slice alone. Build the network in Python (its Gluon model) and "
                  "convert that."
                  % (block.name, ', '.join("'%s'" % n for n in left)))
    if not tokens:
        return False
    block._cached_graph = (inputs, traced.mark(symbol, tokens))
    block._clear_cached_op()
    return True


def _unsynchronize_graph(block):
    """The inverse of :func:`_synchronize_graph`, for every mark: the graph
    ``nn.BatchNorm``'s network has, and no shadows. Returns whether the
    graph changed."""
    inputs, symbol = block._cached_graph
    if not traced.has_marks(symbol):
        return False
    block._cached_graph = (inputs, traced.strip(symbol))
    drop_shadows(block)
    block._clear_cached_op()
    return True


def _warn_if_it_normalizes(block):
    """One warning naming ``block`` if it normalizes over the batch, each
    device's slice alone, and convert_model cannot replace it."""
    if isinstance(block, _BatchNorm) and not is_sync_batchnorm(block):
        warn_user("convert_model: '%s' (%s.%s) normalizes over the batch, but it is none of "
                  "the layers convert_model replaces (nn.BatchNorm, nn.BatchNormReLU, "
                  "contrib.nn.SyncBatchNorm): it stays as it is and normalizes each device's "
                  "slice alone. Build it as gluon_syncbn.SyncBatchNorm (norm_layer=) instead."
                  % (block.name, type(block).__module__, type(block).__name__))
