"""update_bn_stats (precise BatchNorm statistics) after Trainer steps
(tests/test_precise_bn.py; tests/dist_worker.py uses its network and
references across workers).
"""
import time

import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors, batchnorm_float64
from tests.scenarios import contexts, scenario, split_batch


class _PreciseNet(gluon.HybridBlock):
    """SyncBatchNorm on the input, then ``second`` (``'sync'``: SyncBatchNorm,
    ``'nn'``: nn.BatchNorm) on ``relu(first) + 0.5 * x``, whose statistics
    depend on how the first normalized: both layers' statistics are known
    in float64 (:func:`_precise_float64`)."""

    def __init__(self, channels, second='sync', **sync_kwargs):
        super(_PreciseNet, self).__init__()
        with self.name_scope():
            self.bn1 = SyncBatchNorm(in_channels=channels, **sync_kwargs)
            self.bn2 = (SyncBatchNorm(in_channels=channels, **sync_kwargs) if second == 'sync'
                        else gluon.nn.BatchNorm(in_channels=channels))

    def hybrid_forward(self, F, x):
        return self.bn2(F.relu(self.bn1(x)) + 0.5 * x)


def _precise_float64(batches, sizes, gamma, beta, groups=None, second='sync'):
    """What precise BN gives _PreciseNet's layers on each device, in float64:
    ``[(mean1, var1, mean2, var2)]`` per device. ``batches``: the global
    batches, split ``sizes`` over the devices, normalized within ``groups``
    (lists of device indices; default one group of all); with ``second='nn'``
    the second layer normalizes each slice alone and every device gets the
    average over all slices."""
    groups = groups or [list(range(len(sizes)))]
    tallies = {}  # (layer, group or None): [n, mean_sum, var_sum]

    def add(key, n, mean, var):
        total = tallies.setdefault(key, [0.0, 0.0, 0.0])
        total[0] += n
        total[1] = total[1] + n * mean
        total[2] = total[2] + n * var

    for x in batches:
        parts = split_batch(x.astype(np.float64), sizes)
        for g, group in enumerate(groups):
            xg = np.concatenate([parts[i] for i in group])
            y, _, _, _, mean, var = batchnorm_float64(xg, np.zeros_like(xg), gamma, beta)
            add((1, g), len(xg) * x[0, 0].size, mean, var)
            b = np.maximum(y, 0) + 0.5 * xg
            if second == 'sync':
                add((2, g), len(b) * x[0, 0].size, b.mean(axis=(0, 2, 3)), b.var(axis=(0, 2, 3)))
                continue
            for part in split_batch(b, [sizes[i] for i in group]):
                if len(part):
                    add((2, None), len(part) * x[0, 0].size, part.mean(axis=(0, 2, 3)),
                        part.var(axis=(0, 2, 3)))
    out = [None] * len(sizes)
    for g, group in enumerate(groups):
        second_key = (2, g) if second == 'sync' else (2, None)
        values = [v for key in ((1, g), second_key)
                  for v in (tallies[key][1] / tallies[key][0], tallies[key][2] / tallies[key][0])]
        for i in group:
            out[i] = values
    return out


def _running_statistics(net, ctxs):
    """Each device's ``[bn1 mean, bn1 var, bn2 mean, bn2 var]`` (NumPy)."""
    return [[p.data(c).asnumpy() for layer in (net.bn1, net.bn2)
             for p in (layer.running_mean, layer.running_var)] for c in ctxs]


def _precise_errors(got, expected):
    """Worst relative errors of :func:`_running_statistics` ``got`` against
    :func:`_precise_float64` ``expected`` (the same devices, in order)."""
    errs = WorstErrors()
    for mine, want in zip(got, expected):
        for name, a, b in zip(('mean1', 'var1', 'mean2', 'var2'), mine, want):
            errs.note(name, a, b)
    return errs


def _everything_else(net, trainer):
    """Every parameter's value and gradient but the running statistics, and
    the Trainer's optimizer state, as NumPy arrays by name."""
    found = {}
    for name, param in net.collect_params().items():
        if 'running' in name:
            continue
        for c in param.list_ctx():
            found['%s %s' % (name, c)] = param.data(c).asnumpy()
            if param.grad_req != 'null':
                found['%s grad %s' % (name, c)] = param.grad(c).asnumpy()
    for i, updater in enumerate(trainer._updaters):
        for key, state in updater.states.items():
            found['trainer %d %s' % (i, key)] = state.asnumpy()
    return found


def _interrupted(batches, after, problem):
    """``batches``, with ``problem`` after ``after`` of them: 'keyboard'
    (the data raises KeyboardInterrupt) or 'bad_input' (the last device's
    slice has the wrong channel count, found as that device's call is
    issued, after the others')."""
    for i, batch in enumerate(batches):
        if i == after:
            if problem == 'keyboard':
                raise KeyboardInterrupt()
            batch = batch[:-1] + [mx.nd.ones((2, 5, 4, 4), ctx=batch[-1].context)]
        yield batch


@scenario
def precise_bn(sizes=(3, 5), hybridize=False, second='sync', batches=4, dtype='float32',
               sync_groups=None, loader=False, interrupt=None, symbol_block=False, seed=0):
    """gluon_syncbn.update_bn_stats on _PreciseNet after two Trainer steps
    issued without waiting, over ``batches`` random batches of random scale
    and offset split ``sizes`` (a 0: an empty slice, in NumPy shape mode),
    given as per-device lists or (``loader``) as a DataLoader's batches with
    ``ctx_list``. Returns the worst relative errors of every device's
    running statistics against :func:`_precise_float64`, whether they are
    identical on the devices that must agree, and how many of the other
    arrays (weights, gradients, Trainer state) changed.
    ``interrupt``: the run stops half-way (:func:`_interrupted`); then also
    whether every running statistic is as before, what was raised with
    which note, and the errors of a second, complete run. ``symbol_block``:
    the network traced into a SymbolBlock sharing its Parameters (GluonCV's
    feature extractors), which trains and is updated instead."""
    if 0 in sizes:
        mx.util.set_np_shape(True)
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    net = _PreciseNet(channels, second, sync_groups=sync_groups, timeout=60)
    net.initialize(ctx=ctxs)
    net.bn1.gamma.set_data(mx.nd.array(rng.uniform(0.5, 1.5, channels)))
    net.bn1.beta.set_data(mx.nd.array(rng.uniform(-0.5, 0.5, channels)))
    if dtype != 'float32':
        net.cast(dtype)
    runner = net
    if symbol_block:
        data = mx.sym.var('data')
        runner = gluon.SymbolBlock(net(data), data, params=net.collect_params())
    if hybridize or symbol_block:
        runner.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1,
                                                          'momentum': 0.9})
    for _ in range(2):  # not waited for: update_bn_stats must wait for these
        x = (rng.randn(sum(sizes), channels, 4, 4) * 2 + 1).astype(dtype)
        xs = [mx.nd.array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(x, sizes), ctxs)]
        with autograd.record():
            losses = [(runner(a) ** 2).mean() for a in xs]
        autograd.backward(losses)
        trainer.step(sum(sizes))
    mx.nd.waitall()
    before, others = _running_statistics(net, ctxs), _everything_else(net, trainer)
    xs = [(rng.randn(sum(sizes), channels, 4, 4) * rng.uniform(0.5, 3)
           + rng.uniform(-2, 2)).astype(dtype) for _ in range(batches)]
    if loader:
        data = gluon.data.DataLoader(gluon.data.ArrayDataset(np.concatenate(xs),
                                                             np.zeros(len(xs) * sum(sizes))),
                                     batch_size=sum(sizes))
        n, k = sum(sizes), len(sizes)
        sizes = [n // k] * (k - 1) + [n - (k - 1) * (n // k)]  # split_and_load's split
    else:
        data = [[mx.nd.array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(x, sizes), ctxs)]
                for x in xs]
    result = {'operator': getattr(net.bn1._sync_backend, 'name', None)}
    if interrupt:
        start = time.time()
        try:
            gluon_syncbn.update_bn_stats(runner, _interrupted(data, 2, interrupt), batches)
        except BaseException as exc:  # pylint: disable=broad-except
            result['raised'] = type(exc).__name__
            result['message'] = str(exc)
            result['notes'] = getattr(exc, '__notes__', [])
        result['interrupted_seconds'] = time.time() - start
        result['restored'] = float(all(
            (a == b).all() for mine, kept in zip(_running_statistics(net, ctxs), before)
            for a, b in zip(mine, kept)))
    kwargs = dict(ctx_list=ctxs) if loader else {}
    result['used'] = gluon_syncbn.update_bn_stats(runner, data, batches, **kwargs)
    got = _running_statistics(net, ctxs)
    groups = None
    if sync_groups is not None:
        from gluon_syncbn.groups import check_sync_groups, partition
        groups = partition(check_sync_groups(sync_groups), len(sizes), 'reference')
    gamma = net.bn1.gamma.data(ctxs[0]).asnumpy().astype(np.float64)
    beta = net.bn1.beta.data(ctxs[0]).asnumpy().astype(np.float64)
    result.update(_precise_errors(got, _precise_float64(xs, sizes, gamma, beta, groups, second)))
    def same(devices, layer):  # layer 0: bn1's mean and var; 1: bn2's
        first = got[devices[0]][2 * layer:2 * layer + 2]
        return all((a == b).all() for i in devices
                   for a, b in zip(first, got[i][2 * layer:2 * layer + 2]))
    within = groups or [list(range(len(sizes)))]
    result['identical'] = float(all(same(g, 0) for g in within) and (
        all(same(g, 1) for g in within) if second == 'sync' else same(range(len(sizes)), 1)))
    after = _everything_else(net, trainer)
    result['changed'] = sorted(k for k in others if not (others[k] == after[k]).all())
    result['momentum'] = [net.bn1._kwargs['momentum'], net.bn2._kwargs['momentum']]
    return result
