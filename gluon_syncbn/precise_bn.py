"""Precise running statistics: :func:`update_bn_stats` recomputes every
batch-norm layer's running mean and variance over many batches with the
weights fixed, exactly, and identically on every device and worker.

The running statistics a network trains with are an exponential average of
its last batches' statistics, seen while the weights still moved. Here the
network runs in training mode without recording, and each layer's training
calls are tallied (:class:`~gluon_syncbn.tally.Tally`):

* a SyncBatchNorm layer that synchronizes tallies, on every device, the
  global statistics each call normalizes with, where the native session
  computes them, across processes as within one: every device of a sync
  group tallies the same numbers in the same order;
* ``nn.BatchNorm``, and a SyncBatchNorm layer that does not synchronize (one
  device, one process), tallies the float64 moments of its input on the
  input's device, from a forward pre-hook; its devices' tallies are summed,
  so that every device gets the same statistics.

A network whose batch-norm layers all synchronize runs as it trains, through
its graphs if hybridized (static_shape ones too: each graph call is stamped
with its step, see ``hooks``). It runs imperatively (its graphs stay for
later calls) where a layer of the second kind needs its pre-hook, which a
graph does not call.
"""
import contextlib
import itertools

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.util import is_np_array, is_np_shape

from .block import is_sync_batchnorm
from .errors import SyncBatchNormError, warn_user
from .graphs import blocks_of, graph_batchnorms, imperatively, layers_of
from .session import drain
from .tally import Tally

__all__ = ['update_bn_stats']

NAME = 'gluon_syncbn.update_bn_stats'


def update_bn_stats(net, data, num_batches=200, ctx_list=None, batch_axis=0, progress=True):
    """Set every batch-norm layer's running statistics to their precise
    values over ``num_batches`` batches of ``data``, the weights fixed
    ("precise BN", fvcore's ``update_bn_stats``).

    A layer's running mean and variance become the averages, weighted by
    each batch's sample count, of the mean and (biased) variance it
    normalizes each batch with in training mode, accumulated in float64.
    For a SyncBatchNorm layer those are the statistics of the whole batch
    over all devices and workers, so every device and worker gets the same
    values (the devices of a sync group get their group's); for an
    ``nn.BatchNorm`` layer, those of its slices, averaged over this
    process's devices. Layers with ``use_global_stats=True`` are left alone.

    The network runs in training mode (Dropout too) without recording. The
    weights, gradients, a Trainer's state and the layers' momentum are
    untouched. If anything fails, or the run is interrupted, every layer
    keeps its original running statistics, and the exception says so.

    Parameters
    ----------
    net : Block
        The network, initialized; hybridized or not.
    data : iterable
        The batches. With ``ctx_list``: as a DataLoader yields them, an
        NDArray, or a tuple whose first element is the network's input
        (``(data, label)``), split over ``ctx_list`` as ``split_and_load``
        splits it. Without ``ctx_list``: each item is one step's input,
        already split as the training loop splits it: a list with one input
        per context (an NDArray, or a tuple of NDArrays for a network with
        several inputs), or one NDArray on one context.
    num_batches : int or None, default 200
        How many batches to use; None: all of ``data``. Across processes the
        workers stop together, after as many batches as the one with the
        fewest has (the others warn).
    ctx_list : list of Context, or None
        The contexts to split each batch over.
    batch_axis : int, default 0
        The batch axis of ``data``'s arrays, with ``ctx_list``.
    progress : bool, default True
        Show a tqdm progress bar (where tqdm is installed).

    Returns
    -------
    int
        The number of batches used.
    """
    if num_batches is not None and (int(num_batches) != num_batches or num_batches < 1):
        raise ValueError('%s: num_batches must be a positive integer or None, got %r'
                         % (NAME, num_batches))
    tallies = [_tally_of(layer) for layer in _batchnorm_layers(net)]
    if not tallies:
        warn_user('%s: %s has no batch-norm layer that uses batch statistics; nothing '
                  'to do.' % (NAME, net.name))
        return 0
    # Calls issued before must not be tallied, and the copies kept for a
    # failure must hold the statistics as they are.
    mx.nd.waitall()
    saved = [_copies(t.layer) for t in tallies]
    bar = _ProgressBar(progress, num_batches, data)
    try:
        ended = _run(net, tallies, itertools.islice(data, num_batches), ctx_list, batch_axis,
                     bar)
        averages = [t.averages() for t in tallies]
        for t, values in zip(tallies, averages):
            _write(t.layer, values)
    except BaseException as exc:
        _restore(tallies, saved)
        _explain(exc, "%s stopped after %d batch(es): every layer's running statistics are "
                      "as they were before the call." % (NAME, bar.done))
        raise
    finally:
        bar.close()
    unused = [t.layer.name for t, values in zip(tallies, averages) if values is None]
    if unused:
        warn_user('%s: %s saw no sample in training mode, and keep their running '
                  'statistics.' % (NAME, ', '.join(unused)))
    if ended and num_batches is not None and bar.done < num_batches:
        warn_user('%s: data ended after %d of %d batches; the statistics are over those.'
                  % (NAME, bar.done, num_batches))
    return bar.done


def _run(net, tallies, batches, ctx_list, batch_axis, bar):
    """``net`` in training mode without recording on every batch, its
    layers' tallies on; whether ``batches`` ended (not another worker's)."""
    # Imperatively where a pre-hook must see a layer's input.
    imperative = any(isinstance(t, _LocalTally) for t in tallies)
    graph_only = [b for b in blocks_of(net) if isinstance(b, gluon.SymbolBlock)]
    if imperative and graph_only:
        raise SyncBatchNormError(
            "%s: '%s' is a SymbolBlock, which runs only as a graph, and layer(s) %s do not "
            "synchronize (one device in one process, or nn.BatchNorm): their statistics are "
            "tallied from their input, which only an imperative run shows. Run "
            "update_bn_stats with the network on several devices (each SyncBatchNorm layer "
            "then tallies inside the graph), or on the network's Python model." % (
                NAME, graph_only[0].name,
                ', '.join("'%s'" % t.layer.name for t in tallies if isinstance(t, _LocalTally))))
    contexts = tallies[0].contexts
    agree = _agreement(tallies)
    for t in tallies:
        t.start()
    try:
        with imperatively(net) if imperative else contextlib.nullcontext():
            pending = []
            for i, batch in enumerate(itertools.chain(batches, [_END])):
                if agree(i, batch is not _END) or batch is _END:
                    ended = batch is _END
                    break
                steps = _inputs(batch, ctx_list, batch_axis, contexts, i)
                # A step per batch: only an exception that leaves a batch
                # half-issued aborts the step (hooks), failing the calls that
                # wait for it; one from the data lets the batches issued
                # before finish.
                with autograd.pause(train_mode=True):
                    outputs = [net(*inputs) for inputs in steps]
                _wait(pending)  # at most one batch ahead of the engine
                pending = outputs
                bar.update()
        mx.nd.waitall()
    finally:
        for t in tallies:
            t.stop()
    if not bar.done:
        raise SyncBatchNormError('%s: data gave no batch.' % NAME)
    return ended


_END = object()  # after the last batch


def _agreement(tallies):
    """``agree(i, has)``: whether update_bn_stats stops before batch ``i``
    (from 0), which this process has or not (``has``). Across processes the
    workers stop together, where the first runs out of batches: each
    worker's layers would wait for the others' calls of a batch they do not
    have. One process never stops early."""
    layers = [t.layer for t in tallies if isinstance(t, _SyncedTally)
              and t.layer._transport.cross_process]
    if not layers:
        return lambda i, has: False
    from .native import load  # pylint: disable=import-outside-toplevel
    transport, timeout = layers[0]._transport, layers[0]._remote_timeout

    def agree(i, has):
        lacking = transport.agree_on_batch(load(), i, has, timeout)
        if lacking and has:
            warn_user('%s: worker(s) %s had no batch #%d: every worker stops after %d batches.'
                      % (NAME, ', '.join(map(str, lacking)), i + 1, i))
        return bool(lacking)
    return agree


# -------------------------------------------------------------- the layers --

def _batchnorm_layers(net):
    """The batch-norm layers of ``net`` that normalize with batch statistics
    in training mode, each once: those of its tree, and the SyncBatchNorm
    layers its SymbolBlocks' graphs run (the layers that traced them, or
    their shadows: see ``graphs``). A SymbolBlock's BatchNorm operators of
    no layer cannot be tallied: an error names them."""
    for block in blocks_of(net):
        plain = [n['name'] for n in graph_batchnorms(block)]
        if plain:
            raise SyncBatchNormError(
                "%s: '%s' is a SymbolBlock whose graph holds BatchNorm operator(s) %s of no "
                "SyncBatchNorm layer, which update_bn_stats cannot tally. Convert them first "
                "(gluon_syncbn.convert_model(net)), or run it on the network's Python model."
                % (NAME, block.name, ', '.join("'%s'" % n for n in plain)))
    seen, found = set(), []
    candidates = [b for b in blocks_of(net) if isinstance(b, gluon.nn.BatchNorm)]
    for block in candidates + layers_of(net):
        if id(block) in seen:
            continue
        seen.add(id(block))
        if block._kwargs.get('use_global_stats'):
            continue
        if block._kwargs.get('ndev', 1) > 1:
            raise SyncBatchNormError(
                "%s: '%s' is mxnet.gluon.contrib.nn.SyncBatchNorm, whose statistics cannot be "
                "read. Convert the network with gluon_syncbn.convert_model first."
                % (NAME, block.name))
        if block.running_mean._data is None:
            raise SyncBatchNormError(
                "%s: '%s' has no running statistics yet (its parameters are not initialized, "
                "or wait for their shape): initialize the network and run it on one batch "
                "first." % (NAME, block.name))
        found.append(block)
    return found


def _tally_of(layer):
    backend = layer._training_backend() if is_sync_batchnorm(layer) else None
    return _SyncedTally(layer, backend) if backend is not None else _LocalTally(layer)


class _SyncedTally(object):
    """A synchronizing SyncBatchNorm layer's tallies: each device's, of the
    global statistics its calls normalized with (kept by the backend)."""

    def __init__(self, layer, backend):
        self.layer, self.backend = layer, backend
        self.contexts = layer.running_mean.list_ctx()

    def start(self):
        self.backend.start_tally()

    def stop(self):
        self.backend.stop_tally()

    def averages(self):
        """Each context's ``(mean, var)``, or None if its device saw no call."""
        values = [self.backend.tally(d).average() for d in range(len(self.contexts))]
        return None if all(v is None for v in values) else values


class _LocalTally(object):
    """An ``nn.BatchNorm`` layer's tally (or a SyncBatchNorm layer's that does
    not synchronize): the float64 moments of its inputs, summed on each
    device, then over the devices."""

    def __init__(self, layer):
        self.layer = layer
        self.contexts = layer.running_mean.list_ctx()
        self._sums, self._hook = {}, None  # a Tally per context

    def start(self):
        self._sums = {}
        self._hook = self.layer.register_forward_pre_hook(self._add)

    def stop(self):
        if self._hook is not None:
            self._hook.detach()
            self._hook = None

    def _add(self, layer, inputs):
        x = inputs[0]
        x = x.as_nd_ndarray() if is_np_array() else x
        axis = layer._kwargs['axis'] % x.ndim
        n = x.size // x.shape[axis] if x.shape[axis] else 0
        if n == 0:
            return  # an empty slice: nothing to tally
        axes = tuple(a for a in range(x.ndim) if a != axis)
        mean, var = mx.nd.moments(x.astype('float64'), axes=axes)
        self._sums.setdefault(x.context, Tally()).add(n, mean, var)  # on the device

    def averages(self):
        sums = [self._sums[ctx] for ctx in self.contexts if ctx in self._sums]
        value = Tally(0, sum(t.n for t in sums), sum(t.mean_sum.asnumpy() for t in sums),
                      sum(t.var_sum.asnumpy() for t in sums)).average() if sums else None
        return None if value is None else [value] * len(self.contexts)


# -------------------------------------------------------------- the batches --

def _inputs(batch, ctx_list, batch_axis, contexts, index):
    """The network's arguments for each device's call of batch ``index``."""
    if ctx_list is not None:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        steps = [(s,) for s in _split(x, ctx_list, batch_axis, index)]
    elif isinstance(batch, (list, tuple)):
        steps = [tuple(s) if isinstance(s, (list, tuple)) else (s,) for s in batch]
    else:
        steps = [(batch,)]
    given = [str(s[0].context) if hasattr(s[0], 'context') else type(s[0]).__name__
             for s in steps]
    if sorted(given) != sorted(str(c) for c in contexts):
        raise SyncBatchNormError(
            "%s: batch %d has inputs on [%s], but the network's batch-norm layers are on "
            "[%s]. Pass one input per context (a list, as the training loop gives the "
            "network), or pass the DataLoader's batches with ctx_list=." % (
                NAME, index, ', '.join(given), ', '.join(str(c) for c in contexts)))
    return steps


def _split(x, ctx_list, batch_axis, index):
    """``x`` split over ``ctx_list`` as ``split_and_load`` splits it; with
    fewer samples than contexts, the last slices are empty."""
    if isinstance(x, np.ndarray):
        x = mx.nd.array(x)
    size = x.shape[batch_axis]
    if size >= len(ctx_list):
        return gluon.utils.split_and_load(x, ctx_list, batch_axis, even_split=False)
    if not is_np_shape():
        raise SyncBatchNormError(
            "%s: batch %d has %d sample(s) for %d contexts, and MXNet handles empty slices "
            "only in NumPy shape mode. Use a DataLoader with last_batch='discard', or call "
            "mx.util.set_np_shape(True) at the start of the program." % (
                NAME, index, size, len(ctx_list)))
    slices = gluon.utils.split_and_load(x, ctx_list[:size], batch_axis, even_split=False) \
        if size else []
    shape = list(x.shape)
    shape[batch_axis] = 0
    zeros = mx.np.zeros if is_np_array() else mx.nd.zeros
    return slices + [zeros(tuple(shape), ctx=c, dtype=x.dtype) for c in ctx_list[size:]]


def _wait(outputs):
    for out in outputs:
        if isinstance(out, (list, tuple)):
            _wait(out)
        elif hasattr(out, 'wait_to_read'):
            out.wait_to_read()


# --------------------------------------------------- running statistics --

def _running_arrays(layer):
    """Each context's running mean and variance, as legacy NDArrays (views)."""
    return [[p.data(c).as_nd_ndarray() for p in (layer.running_mean, layer.running_var)]
            for c in layer.running_mean.list_ctx()]


def _copies(layer):
    return [[a.copy() for a in arrays] for arrays in _running_arrays(layer)]


def _write(layer, values):
    """Each context's ``(mean, var)`` into its running statistics (None:
    left as they are)."""
    if values is None:
        return
    for arrays, value in zip(_running_arrays(layer), values):
        if value is not None:
            for array, v in zip(arrays, value):
                array[:] = v.astype(array.dtype)


def _restore(tallies, saved):
    drain()  # the calls still running; their error is the one being raised
    for t, copies in zip(tallies, saved):
        for arrays, kept in zip(_running_arrays(t.layer), copies):
            for array, copy in zip(arrays, kept):
                array[:] = copy
    mx.nd.waitall()


def _explain(exc, text):
    """Add ``text`` to the exception being raised (a warning where Python
    has no exception notes)."""
    if hasattr(exc, 'add_note'):
        exc.add_note(text)
    else:
        warn_user(text)


# ------------------------------------------------------------- progress --

class _ProgressBar(object):
    """Counts the batches done; shows them with tqdm where it is installed
    and ``enabled``."""

    def __init__(self, enabled, num_batches, data):
        self.done = 0
        self._bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm  # pylint: disable=import-outside-toplevel
        except ImportError:
            return
        total = num_batches
        if hasattr(data, '__len__'):
            total = len(data) if total is None else min(total, len(data))
        self._bar = tqdm(total=total, desc='update_bn_stats', leave=False)

    def update(self):
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self):
        if self._bar is not None:
            self._bar.close()
