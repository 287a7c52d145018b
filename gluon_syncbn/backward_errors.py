"""Which of MXNet's backward errors a SyncBatchNorm layer is the cause of.

``autograd.grad``, ``autograd.backward`` and ``NDArray.backward`` raise
MXNet's errors (``hooks`` wraps them); a backward error names our layer
only where the layer is the cause, and says otherwise what MXNet says for
``nn.BatchNorm``:

* a layer's own refusal, raised through MXNet (its text names the layer):
  ours;
* heads that were never recorded (a step run without ``autograd.record()``):
  MXNet's "Cannot differentiate node because it is not in a computational
  graph";
* MXNet's refusal of a higher-order gradient through a CachedOp (a
  hybridized network, or the GPU path's imperative call, where its advice
  to un-hybridize is wrong): ours, naming the layers, where the recorded
  graph of the heads goes through a layer that synchronizes; else MXNet's
  (a higher-order gradient through other hybridized blocks).
"""
import json

import mxnet as mx

from . import messages
from .errors import SyncBatchNormError, ours_behind

__all__ = ['as_ours']

_NO_HIGHER_ORDER = 'CachedOp does not support higher order gradients'


def as_ours(exc, heads, session):
    """The SyncBatchNorm failure behind MXNet's error ``exc``, raised by a
    backward of ``heads``, or None where ``exc`` says it as it is."""
    ours = exc if isinstance(exc, SyncBatchNormError) else ours_behind(exc)
    unnamed = ours is not None and "SyncBatchNorm '?'" in str(ours)
    if ours is not None and not unnamed:
        return None if ours is exc else ours
    if not unnamed and (not session.active() or _NO_HIGHER_ORDER not in str(exc)):
        return None
    names = _layers_in(heads, session)
    if names is None:
        return None  # a head was never recorded: MXNet's error is the one
    if not names:
        if not unnamed:
            return None  # not through our layers
        names = sorted({b.layer.name for b in session.live_backends()})
    ours = SyncBatchNormError(messages.text('no_higher_order', layer="', '".join(names)))
    ours.__cause__ = exc
    return ours


def _layers_in(heads, session):
    """The names of the synchronizing layers the recorded graph of ``heads``
    goes through, or None if a head was never recorded. A layer is found by
    its operators' handles (an imperative call records its operator), or by
    the autograd variables of its gamma and beta: a CachedOp's recorded node
    shows only its inputs, and MXNet names each variable once, when
    ``attach_grad`` marks it (``var<N>``). Layers whose gamma and beta are
    both frozen (``grad_req='null'``) have no such variable."""
    handles, variables = set(), set()
    for head in heads if isinstance(heads, (list, tuple)) else [heads]:
        try:
            nodes = json.loads(mx.autograd.get_symbol(head).tojson())['nodes']
        except mx.base.MXNetError:
            return None  # "NDArray is not part of a computation graph"
        handles.update(n.get('attrs', {}).get('layer') for n in nodes)
        variables.update(n['name'] for n in nodes if n['op'] == 'null')
    found = set()
    for backend in session.live_backends():
        if str(backend.handle) in handles or _variables_of(backend.layer.params) & variables:
            found.add(backend.layer.name)
    return sorted(found)


def _variables_of(params):
    """The autograd variables' names of a layer's gamma and beta arrays
    (``params``: its :data:`~.backends.base.Params`)."""
    names = set()
    for param in (params.gamma, params.beta):
        if param.grad_req == 'null':
            continue
        try:
            arrays = param.list_data()
        except RuntimeError:  # not initialized
            continue
        for array in arrays:
            try:
                names.add(mx.autograd.get_symbol(array).name)
            except mx.base.MXNetError:
                pass
    return names
