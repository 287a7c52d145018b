"""Swap BatchNorm layers for SyncBatchNorm in a model, and back for deployment.

Both directions hand the *same* Parameter objects to the new layer, so values,
contexts, gradients and checkpoints are untouched (bit-exact by construction).
"""
from mxnet.gluon import nn
from mxnet.gluon.contrib import nn as contrib_nn

from .block import SyncBatchNorm

__all__ = ['convert_model', 'revert_model']


def _settings(bn):
    kwargs = dict(getattr(bn, '_kwargs', {}))
    return dict(axis=kwargs.get('axis', 1), momentum=kwargs.get('momentum', 0.9),
                epsilon=kwargs.get('eps', 1e-5), center=bn.beta.grad_req != 'null',
                scale=not kwargs.get('fix_gamma', False),
                use_global_stats=kwargs.get('use_global_stats', False),
                in_channels=bn.gamma.shape[0] if bn.gamma.shape else 0)


def _swap(block, match, make):
    """Replace, anywhere below ``block``, every child ``match(child)`` by ``make(child)``.

    Returns how many layers were replaced. Children are found through Gluon's
    registry and replaced there and in every attribute, list, tuple or dict of
    the parent that refers to them.
    """
    replaced = 0
    for key, child in list(block._children.items()):
        if match(child):
            new = make(child)
            block._children[key] = new
            _replace_references(block, child, new)
            replaced += 1
        else:
            replaced += _swap(child, match, make)
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


def convert_model(net, num_devices=None, timeout=None, kvstore=None, sync_groups=None):
    """Replace every BatchNorm in ``net`` by :class:`SyncBatchNorm`, in place.

    Handles ``gluon.nn.BatchNorm`` and ``gluon.contrib.nn.SyncBatchNorm`` at any
    depth (Sequential, HybridSequential, custom blocks, lists of blocks). Each new
    layer reuses the old layer's Parameter objects, so initialized values, running
    statistics and checkpoints carry over exactly.

    Parameters
    ----------
    net : Block
        The model; modified in place and returned.
    num_devices : int or None
        Passed to every :class:`SyncBatchNorm` (None: the number of contexts).
    timeout : float or None
        Passed to every :class:`SyncBatchNorm`.
    kvstore : KVStore, 'horovod' or None
        Passed to every :class:`SyncBatchNorm`: synchronize across worker
        processes too.
    sync_groups : int, list of lists of int, or None
        Passed to every :class:`SyncBatchNorm`: normalize within these groups
        of devices.

    Returns
    -------
    Block
        ``net``. Call ``hybridize()`` again if it was hybridized.
    """
    def make(bn):
        return SyncBatchNorm(num_devices=num_devices, timeout=timeout, kvstore=kvstore,
                             sync_groups=sync_groups, prefix=bn.prefix, params=bn.params,
                             **_settings(bn))
    if _is_batchnorm(net):
        return make(net)
    _swap(net, _is_batchnorm, make)
    return net


def revert_model(net):
    """Replace every :class:`SyncBatchNorm` in ``net`` by ``gluon.nn.BatchNorm``, in place.

    The result contains only stock Gluon layers: ``hybridize()`` + ``export()``
    give a symbol file that plain MXNet loads (``SymbolBlock.imports``) without
    this package. Parameters are shared, as in :func:`convert_model`.

    Parameters
    ----------
    net : Block

    Returns
    -------
    Block
        ``net``. Call ``hybridize()`` again if it was hybridized.
    """
    def make(bn):
        return nn.BatchNorm(prefix=bn.prefix, params=bn.params, **_settings(bn))
    if isinstance(net, SyncBatchNorm):
        return make(net)
    _swap(net, lambda b: isinstance(b, SyncBatchNorm), make)
    return net


def _is_batchnorm(block):
    return (isinstance(block, (nn.BatchNorm, contrib_nn.SyncBatchNorm))
            and not isinstance(block, SyncBatchNorm))
