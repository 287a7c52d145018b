"""Multi-device scenarios, each run in its own subprocess by tests (see conftest).

Run as ``python -m tests.scenarios NAME JSON_KWARGS``; prints one JSON line
``RESULT {...}`` with the measured errors. Keeping MXNet out of the pytest
process means a wedged engine fails one test (by its timeout), not the suite.
"""
import contextlib
import json
import os
import sys
import threading
import time
import warnings

import numpy as np

import gluon_syncbn

# The explicit step for CPU contexts, before MXNet runs its first operator.
# Scenarios use up to 4 contexts unless SCENARIO_CONTEXTS says more.
gluon_syncbn.configure_cpu_contexts(int(os.environ.get('SCENARIO_CONTEXTS', '4')))

import mxnet as mx
from mxnet import autograd, gluon

if os.environ.get('SCENARIO_TRANSPORT'):  # 'loopback:MODE' or 'kvstore': see tests/loopback.py
    from tests.loopback import install
    _kind, _, _mode = os.environ['SCENARIO_TRANSPORT'].partition(':')
    install(_kind, **({'mode': _mode} if _mode else {}))

from gluon_syncbn import SyncBatchNorm
from tests import native_testing

if (os.environ.get('GLUON_SYNCBN_DEVICE_PATH') == '1'
        and os.environ.get('GLUON_SYNCBN_BACKEND') == 'exchange'):
    # The exchange operator copies as on a GPU, through a stand-in CUDA runtime.
    native_testing.copy_like_a_gpu(gluon_syncbn.native.load())
from tests.reference import (WorstErrors, batchnorm_float64, grouped_batchnorm_float64,
                             max_rel_err, worst)

SCENARIOS = {}
VERBOSE = bool(os.environ.get('SCENARIO_VERBOSE'))


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def contexts(n):
    return [mx.cpu(i) for i in range(n)]


def split_batch(x, sizes):
    bounds = np.cumsum([0] + list(sizes))
    return [x[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]


@scenario
def layer_vs_reference(shape, sizes, axis=1, dtype='float32', hybridize=False, steps=3,
                       offset=0.0, momentum=0.9, seed=0, deferred=False, numpy_mode=False,
                       ndim_unknown=False):
    """SyncBatchNorm on len(sizes) devices vs float64 maths and nn.BatchNorm on one.

    ``deferred``: no in_channels, so a hybridized graph is first traced without
    the channel count (gamma and beta keep their initial ones and zeros).
    ``numpy_mode``: everything under ``npx.set_np()``, on ``mx.np`` arrays.
    ``ndim_unknown``: a hybridized graph is traced as where shape inference
    cannot tell the input's number of dimensions (the GPU path's graph then
    reshapes before ``moments``).
    Returns the worst relative error per quantity over all steps.
    """
    if ndim_unknown:
        from gluon_syncbn import graphs
        graphs.traced_ndim = lambda shape: None
    if numpy_mode:
        with mx.util.np_shape(True), mx.util.np_array(True):
            errs = _layer_vs_reference(shape, sizes, axis, dtype, hybridize, steps, offset,
                                       momentum, seed, deferred, mx.np.array)
        errs['out_is_np'] = float(errs.pop('out_type') == 'mxnet.numpy.ndarray')
        return errs
    return _layer_vs_reference(shape, sizes, axis, dtype, hybridize, steps, offset, momentum,
                               seed, deferred, mx.nd.array)


def _layer_vs_reference(shape, sizes, axis, dtype, hybridize, steps, offset, momentum, seed,
                        deferred, array):
    rng = np.random.RandomState(seed)
    shape = tuple(shape)
    channels = shape[axis]
    ctxs = contexts(len(sizes))
    gamma = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, channels).astype(np.float32)

    bn = SyncBatchNorm(axis=axis, momentum=momentum, in_channels=0 if deferred else channels)
    bn.initialize(ctx=ctxs)
    if deferred:
        gamma, beta = np.ones_like(gamma), np.zeros_like(beta)
    else:
        bn.gamma.set_data(array(gamma))
        bn.beta.set_data(array(beta))
    if hybridize:
        bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    if dtype != 'float32':
        bn.cast(dtype)  # as a float16 or float64 network does

    ref = gluon.nn.BatchNorm(axis=axis, momentum=momentum, in_channels=channels)
    ref.initialize(ctx=mx.cpu(0))
    ref.gamma.set_data(array(gamma))
    ref.beta.set_data(array(beta))

    errs = WorstErrors()
    run_mean = np.zeros(channels)
    run_var = np.ones(channels)

    for _ in range(steps):
        x = (rng.randn(*shape) * rng.uniform(0.5, 3) + offset).astype(dtype)
        dy = rng.randn(*shape).astype(dtype)
        xs = [array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(x, sizes), ctxs)]
        dys = [array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(dy, sizes), ctxs)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [bn(a) for a in xs]
        autograd.backward(ys, dys)
        y = np.concatenate([a.asnumpy() for a in ys])
        dx = np.concatenate([a.grad.asnumpy() for a in xs])
        dgamma = sum(bn.gamma.grad(c).asnumpy().astype(np.float64) for c in ctxs)
        dbeta = sum(bn.beta.grad(c).asnumpy().astype(np.float64) for c in ctxs)

        # float64 maths on the same (rounded) input
        y64, dx64, dg64, db64, mean64, var64 = batchnorm_float64(x, dy, gamma, beta, axis)
        run_mean = run_mean * momentum + mean64 * (1 - momentum)
        run_var = run_var * momentum + var64 * (1 - momentum)
        errs.note('y', y, y64)
        errs.note('dx', dx, dx64)
        errs.note('dgamma', dgamma, dg64)
        errs.note('dbeta', dbeta, db64)
        for c in ctxs:
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run_mean)
            errs.note('running_var', bn.running_var.data(c).asnumpy(), run_var)
        errs['replicas_identical'] = float(all(
            (bn.running_mean.data(c).asnumpy() == bn.running_mean.data(ctxs[0]).asnumpy()).all()
            and (bn.running_var.data(c).asnumpy() == bn.running_var.data(ctxs[0]).asnumpy()).all()
            for c in ctxs))

        if dtype == 'float32' and offset == 0.0:
            # nn.BatchNorm on the concatenated batch, one context
            xf = array(x, ctx=mx.cpu(0))
            xf.attach_grad()
            with autograd.record():
                yf = ref(xf)
            yf.backward(array(dy, ctx=mx.cpu(0)))
            errs.note('y_vs_nn', y, yf.asnumpy())
            errs.note('dx_vs_nn', dx, xf.grad.asnumpy())
            errs.note('dgamma_vs_nn', dgamma, ref.gamma.grad().asnumpy())
            errs.note('dbeta_vs_nn', dbeta, ref.beta.grad().asnumpy())
            errs.note('running_mean_vs_nn', bn.running_mean.data(ctxs[0]).asnumpy(),
                 ref.running_mean.data().asnumpy())
            errs.note('running_var_vs_nn', bn.running_var.data(ctxs[0]).asnumpy(),
                 ref.running_var.data().asnumpy())
    errs['out_dtype_ok'] = float(all(a.dtype == np.dtype(dtype) for a in ys))
    errs['out_type'] = '%s.%s' % (type(ys[0]).__module__, type(ys[0]).__name__)
    # Which backend synchronized (see gluon_syncbn.backends); one device has none.
    errs['operator'] = bn._sync_backend.name if bn._sync_backend is not None else None
    return errs


def as_dtype(a, dtype):
    """``a`` (an NDArray) as ``dtype``, bfloat16 included (only amp_cast makes
    it, from float32: on CPU it is MKL-DNN's)."""
    from gluon_syncbn.mxnet_private import operator_dtype
    if dtype == 'bfloat16':
        return mx.nd.amp_cast(a.astype('float32'), dtype=operator_dtype(dtype))
    return a.astype(dtype)


@scenario
def head_dtypes(out_dtype='float32', heads=('float16', 'bfloat16', 'float32', 'float64'),
                hybridize=False, sizes=(2, 3), axis=1, seed=0):
    """Head gradients whose dtype differs from the output's (``autograd.backward``
    accepts them; AMP-style code makes them), one fresh layer per head dtype on
    len(sizes) devices, channels on ``axis``; the network is float32 or cast to
    ``out_dtype``.
    Inputs and heads are multiples of 1/4 below 4 in magnitude, exact in every
    float dtype, so float64 maths on the same numbers (on the head as given:
    an integer head truncates them) is the reference. Returns per head dtype
    the worst relative errors of y and dx, or the error message."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    shape = (sum(sizes), 3, 2, 3)
    results = {}
    for head in heads:
        bn = SyncBatchNorm(in_channels=shape[axis], axis=axis)
        bn.initialize(ctx=ctxs)
        if out_dtype != 'float32':
            bn.cast(out_dtype)
        if hybridize:
            bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        x = rng.randint(-15, 16, shape) / 4.0
        dy = rng.randint(-15, 16, shape) / 4.0
        xs = [mx.nd.array(p, ctx=c, dtype=out_dtype) for p, c in zip(split_batch(x, sizes), ctxs)]
        dys = [as_dtype(mx.nd.array(p, ctx=c, dtype='float64'), head)
               for p, c in zip(split_batch(dy, sizes), ctxs)]
        for a in xs:
            a.attach_grad()
        try:
            with autograd.record():
                ys = [bn(a) for a in xs]
            autograd.backward(ys, dys)
            y = np.concatenate([a.asnumpy() for a in ys])
            dx = np.concatenate([a.grad.asnumpy() for a in xs])
        except Exception as exc:  # pylint: disable=broad-except
            results[head] = {'message': '%s: %s' % (type(exc).__name__, exc)}
            _capture(mx.nd.waitall)  # the failed step's error on the other arrays
            continue
        given = np.concatenate([as_dtype(d, 'float32').asnumpy() for d in dys])
        y64, dx64 = (np.moveaxis(a, 1, axis) for a in batchnorm_float64(
            np.moveaxis(x, axis, 1), np.moveaxis(given, axis, 1), np.ones(shape[axis]),
            np.zeros(shape[axis]))[:2])
        results[head] = {'y': max_rel_err(y, y64), 'dx': max_rel_err(dx, dx64),
                         'dx_dtype_ok': float(all(a.grad.dtype == np.dtype(out_dtype)
                                                  for a in xs))}
    results['operator'] = bn._sync_backend.name
    return results


@scenario
def sync_groups_layer(sync_groups, sizes=(1, 2, 3, 2), hybridize=False, steps=2, seed=0):
    """SyncBatchNorm(sync_groups=...) on len(sizes) devices vs float64 maths
    within each group (as independent runs on each group's devices would
    give). Returns worst relative errors; running statistics per device
    against its group's."""
    from gluon_syncbn.groups import check_sync_groups, partition
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    groups = partition(check_sync_groups(sync_groups), len(ctxs), 'reference')
    gamma = rng.uniform(0.5, 1.5, channels)
    beta = rng.uniform(-0.5, 0.5, channels)
    bn = SyncBatchNorm(in_channels=channels, sync_groups=sync_groups)
    bn.initialize(ctx=ctxs)
    bn.gamma.set_data(mx.nd.array(gamma))
    bn.beta.set_data(mx.nd.array(beta))
    if hybridize:
        bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    errs = WorstErrors()
    run = [(np.zeros(channels), np.ones(channels))] * len(ctxs)
    for _ in range(steps):
        x = (rng.randn(sum(sizes), channels, 4, 5) * 2 + 1).astype(np.float32)
        dy = rng.randn(*x.shape).astype(np.float32)
        x_parts, dy_parts = split_batch(x, sizes), split_batch(dy, sizes)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(x_parts, ctxs)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [bn(a) for a in xs]
        autograd.backward(ys, [mx.nd.array(p, ctx=c) for p, c in zip(dy_parts, ctxs)])
        ref = grouped_batchnorm_float64(x_parts, dy_parts, groups, gamma, beta)
        for i, c in enumerate(ctxs):
            y64, dx64, dg64, db64, mean64, var64 = ref[i]
            run[i] = (run[i][0] * 0.9 + mean64 * 0.1, run[i][1] * 0.9 + var64 * 0.1)
            errs.note('y', ys[i].asnumpy(), y64)
            errs.note('dx', xs[i].grad.asnumpy(), dx64)
            errs.note('dgamma', bn.gamma.grad(c).asnumpy(), dg64)
            errs.note('dbeta', bn.beta.grad(c).asnumpy(), db64)
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run[i][0])
            errs.note('running_var', bn.running_var.data(c).asnumpy(), run[i][1])
    return errs


# ---------------------------------------------------------------- networks
def make_norm(kind, **kwargs):
    return SyncBatchNorm(**kwargs) if kind == 'sync' else gluon.nn.BatchNorm(**kwargs)


class ConvStack(gluon.HybridBlock):
    """``layers`` x (conv 3x3, BN, relu [, dropout]), global pooling, dense.

    ``pool=True``: MXNet's Pooling operators (max pooling after the first
    block, global average pooling at the end) instead of ``mean``: in MKL-DNN
    they read the layout of the BN layer's output, as in ResNets.
    ``input_norm=True``: a BN layer on the input first, so that data far from
    zero reaches a BN layer exactly as given.
    """

    def __init__(self, norm, layers, width=8, dropout=0.0, classes=5, pool=False,
                 input_norm=False, **kwargs):
        super(ConvStack, self).__init__(**kwargs)
        self._pool = pool
        with self.name_scope():
            self.body = gluon.nn.HybridSequential()
            if input_norm:
                self.body.add(make_norm(norm))
            for i in range(layers):
                self.body.add(gluon.nn.Conv2D(width * (1 + i % 2), 3, padding=1, use_bias=False))
                if dropout:
                    self.body.add(gluon.nn.Dropout(dropout))
                self.body.add(make_norm(norm))
                self.body.add(gluon.nn.Activation('relu'))
                if dropout:
                    self.body.add(gluon.nn.Dropout(dropout))
                if pool and i == 0:
                    self.body.add(gluon.nn.MaxPool2D(2))
            if pool:
                self.body.add(gluon.nn.GlobalAvgPool2D())
            self.head = gluon.nn.Dense(classes)

    def hybrid_forward(self, F, x):
        features = self.body(x)
        return self.head(features if self._pool else F.mean(features, axis=(2, 3)))


class ASPPNet(gluon.HybridBlock):
    """A stem and parallel dilated branches, each with its own BN (several BN
    layers in flight on one device at once), concatenated, then a residual block."""

    def __init__(self, norm, width=8, classes=5, **kwargs):
        super(ASPPNet, self).__init__(**kwargs)
        with self.name_scope():
            self.stem = gluon.nn.HybridSequential()
            self.stem.add(gluon.nn.Conv2D(width, 3, padding=1, use_bias=False), make_norm(norm),
                          gluon.nn.Activation('relu'))
            self.branches = []
            for i, rate in enumerate((1, 2, 3)):
                branch = gluon.nn.HybridSequential(prefix='branch%d_' % i)
                branch.add(gluon.nn.Conv2D(width, 3 if rate > 1 else 1, padding=rate if rate > 1 else 0,
                                           dilation=rate, use_bias=False), make_norm(norm),
                           gluon.nn.Activation('relu'))
                self.register_child(branch)
                self.branches.append(branch)
            self.project = gluon.nn.HybridSequential()
            self.project.add(gluon.nn.Conv2D(width, 1, use_bias=False), make_norm(norm))
            self.res = gluon.nn.HybridSequential()
            self.res.add(gluon.nn.Conv2D(width, 3, padding=1, use_bias=False), make_norm(norm),
                         gluon.nn.Activation('relu'),
                         gluon.nn.Conv2D(width, 3, padding=1, use_bias=False), make_norm(norm))
            self.head = gluon.nn.Dense(classes)

    def hybrid_forward(self, F, x):
        x = self.stem(x)
        x = self.project(F.concat(*[b(x) for b in self.branches], dim=1))
        x = F.relu(x + self.res(x))
        return self.head(F.mean(x, axis=(2, 3)))


def build(arch, norm, **kwargs):
    if arch == 'conv':
        return ConvStack(norm, **kwargs)
    if arch == 'aspp':
        return ASPPNet(norm, **kwargs)
    raise ValueError(arch)


def copy_params(src, dst):
    src_params = list(src.collect_params().values())
    dst_params = list(dst.collect_params().values())
    assert len(src_params) == len(dst_params)
    for s, d in zip(src_params, dst_params):
        d.set_data(s.data(s.list_ctx()[0]).copyto(mx.cpu(0)))


@scenario
def train_vs_single_device(arch='conv', sizes=(2, 2), steps=3, hybridize=False, optimizer='sgd',
                           image=8, seed=0, compare=True, reference='plain', dtype='float32',
                           **arch_kwargs):
    """Train with SyncBN on len(sizes) contexts and, from the same weights, the
    reference on one context on the concatenated batch: nn.BatchNorm in float64
    (``reference='float64'``), in float32 (``'plain'``), or SyncBatchNorm itself
    (``'sync'``). ``dtype='float64'``: the SyncBatchNorm net in float64 too.
    Returns worst relative errors of losses, parameters and running statistics
    over all steps."""
    rng = np.random.RandomState(seed)
    mx.random.seed(seed)
    ctxs = contexts(len(sizes))
    batch = int(sum(sizes))
    opt_args = {'sgd': {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4},
                # epsilon: Adam turns noise-level gradients into full steps
                'adam': {'learning_rate': 0.01, 'epsilon': 1e-3}}[optimizer]
    ref = build(arch, 'sync' if reference == 'sync' else 'plain', **arch_kwargs)
    ref_dtype = 'float64' if reference == 'float64' else 'float32'
    ref.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    net = build(arch, 'sync', **arch_kwargs)
    net.initialize(ctx=ctxs)
    x0 = mx.nd.array(rng.randn(batch, 3, image, image), dtype='float32')
    ref(x0)
    net(x0.as_in_context(ctxs[0]))
    copy_params(ref, net)
    ref.cast(ref_dtype)
    if dtype != 'float32':
        net.cast(dtype)  # the SyncBatchNorm net in float64 too (see test_networks)
    if hybridize:
        ref.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    ref_trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(opt_args))
    trainer = gluon.Trainer(net.collect_params(), optimizer, dict(opt_args))
    errs = WorstErrors()

    for _ in range(steps):
        x = rng.randn(batch, 3, image, image).astype(np.float32)
        label = rng.randint(0, 5, batch).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(x, sizes), ctxs)]
        ls = [mx.nd.array(p, ctx=c, dtype=dtype) for p, c in zip(split_batch(label, sizes), ctxs)]
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ls)]
        autograd.backward(losses)
        trainer.step(batch)
        loss = np.concatenate([l.asnumpy() for l in losses])
        if not compare:
            continue
        with autograd.record():
            ref_loss = loss_fn(ref(mx.nd.array(x, dtype=ref_dtype)),
                               mx.nd.array(label, dtype=ref_dtype))
        ref_loss.backward()
        ref_trainer.step(batch)
        mx.nd.waitall()
        errs.note('loss', loss, ref_loss.asnumpy())
        for (name, p), rp in zip(net.collect_params().items(), ref.collect_params().values()):
            kind = 'running' if 'running' in name else 'param'
            for c in ctxs:
                errs.note(kind, p.data(c).asnumpy(), rp.data().asnumpy())
                if VERBOSE:
                    print(name, c, max_rel_err(p.data(c).asnumpy(), rp.data().asnumpy()),
                          np.abs(rp.data().asnumpy()).max(), file=sys.stderr)
    # replicas of every running statistic must be bit-identical
    errs['replicas_identical'] = float(all(
        all((p.data(c).asnumpy() == p.data(ctxs[0]).asnumpy()).all() for c in ctxs)
        for name, p in net.collect_params().items() if 'running' in name))
    return errs


def _twin_nets(reference_norm, sync_norm, ctxs, hybridize):
    """A small conv net (2 x conv+BN+relu, pooling, dense) with ``reference_norm``
    on one context and, from the same weights, with ``sync_norm`` on ``ctxs``
    (None: the reference's layers converted with convert_model); both
    hybridized alike; and an SGD Trainer for each."""
    from gluon_syncbn import convert_model

    def make(norm):
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(8, 3, padding=1, use_bias=False, in_channels=3), norm(),
                gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(8, 3, padding=1, use_bias=False, in_channels=8), norm(),
                gluon.nn.Activation('relu'), gluon.nn.GlobalAvgPool2D(),
                gluon.nn.Dense(5, in_units=8))
        return net
    ref = make(reference_norm)
    ref.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    net = make(sync_norm) if sync_norm else convert_model(make(reference_norm))
    net.initialize(ctx=ctxs)
    for src, dst in zip(ref.collect_params().values(), net.collect_params().values()):
        dst.set_data(src.data())
    if hybridize:
        for n in (ref, net):
            n.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    opt = {'learning_rate': 0.1, 'momentum': 0.9}
    return (ref, net, gluon.Trainer(ref.collect_params(), 'sgd', dict(opt)),
            gluon.Trainer(net.collect_params(), 'sgd', dict(opt)))


@scenario
def numpy_mode_training(sizes=(2, 2), steps=3, hybridize=False, seed=0):
    """Under ``npx.set_np()``: a small net built with nn.BatchNorm, converted
    with convert_model, trained with a Trainer on len(sizes) contexts, vs the
    unconverted net on one context on the concatenated batch, from the same
    weights. Returns worst relative errors of losses, parameters and running
    statistics over all steps."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    batch = int(sum(sizes))
    with mx.util.np_shape(True), mx.util.np_array(True):
        ref, net, ref_trainer, trainer = _twin_nets(
            lambda: gluon.nn.BatchNorm(in_channels=8), None, ctxs, hybridize)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        errs = WorstErrors()
        for _ in range(steps):
            x = rng.randn(batch, 3, 6, 6).astype(np.float32)
            label = rng.randint(0, 5, batch).astype(np.float32)
            xs = [mx.np.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
            ls = [mx.np.array(p, ctx=c) for p, c in zip(split_batch(label, sizes), ctxs)]
            with autograd.record():
                losses = [loss_fn(net(a), b) for a, b in zip(xs, ls)]
            autograd.backward(losses)
            trainer.step(batch)
            with autograd.record():
                ref_loss = loss_fn(ref(mx.np.array(x)), mx.np.array(label))
            ref_loss.backward()
            ref_trainer.step(batch)
            errs.note('loss', np.concatenate([l.asnumpy() for l in losses]), ref_loss.asnumpy())
            for (name, p), rp in zip(net.collect_params().items(), ref.collect_params().values()):
                for c in ctxs:
                    errs.note('running' if 'running' in name else 'param', p.data(c).asnumpy(),
                              rp.data().asnumpy())
        errs['num_syncbn'] = sum(isinstance(b, SyncBatchNorm) for b in _blocks(net))
        errs['out_is_np'] = float(isinstance(losses[0], mx.np.ndarray))
    return errs


@scenario
def amp_training(sizes=(1, 3), steps=3, hybridize=False, amp=True, save=None, seed=0):
    """A small conv net with SyncBatchNorm on len(sizes) contexts and the same
    net with nn.BatchNorm on one context, both under ``amp.init('bfloat16')``
    (MXNet's AMP on CPU) with AMP's Trainer and loss scaling, from the same
    weights. Returns worst relative errors of the first step's losses and
    gradients and of the parameters after ``steps``. ``save``: also write both
    nets' first-step gradients (unscaled) there; ``amp=False``: the same
    without AMP, to measure what bfloat16 itself changes."""
    from mxnet.contrib import amp as mx_amp
    if amp:
        mx_amp.init(target_dtype='bfloat16')
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    batch = int(sum(sizes))
    mx.random.seed(seed)
    ref, net, ref_trainer, trainer = _twin_nets(
        lambda: gluon.nn.BatchNorm(in_channels=8), lambda: SyncBatchNorm(in_channels=8), ctxs,
        hybridize)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    if amp:
        mx_amp.init_trainer(trainer)
        mx_amp.init_trainer(ref_trainer)
    errs = WorstErrors()
    for step in range(steps):
        x = rng.randn(batch, 3, 8, 8).astype(np.float32)
        label = rng.randint(0, 5, batch).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
        ls = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(label, sizes), ctxs)]
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ls)]
            if amp:
                with mx_amp.scale_loss(losses, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                autograd.backward(losses)
        with autograd.record():
            ref_loss = loss_fn(ref(mx.nd.array(x)), mx.nd.array(label))
            if amp:
                with mx_amp.scale_loss(ref_loss, ref_trainer) as scaled:
                    scaled.backward()
            else:
                ref_loss.backward()
        if step == 0:
            errs.note('loss', np.concatenate([l.asnumpy() for l in losses]), ref_loss.asnumpy())
            scale = trainer._amp_loss_scaler.loss_scale if amp else 1.0
            grads = {}
            for i, ((name, p), rp) in enumerate(zip(net.collect_params().items(),
                                                   ref.collect_params().values())):
                if p.grad_req == 'null':
                    continue
                try:
                    ours = sum(p.grad(c).asnumpy().astype(np.float64) for c in ctxs)
                    errs.note('grad', ours, rp.grad().asnumpy())
                except mx.base.MXNetError as exc:
                    # Which gradient: ours (the layer's) or MKL-DNN's (convolutions).
                    raise RuntimeError('reading the gradient of %s: %s' % (name, exc))
                grads['ours%d' % i] = ours / scale
                grads['ref%d' % i] = rp.grad().asnumpy().astype(np.float64) / scale
            if save:
                np.savez(save, **grads)
            errs['amp_output_dtype'] = dtype_of(losses[0])
        trainer.step(batch)
        ref_trainer.step(batch)
    for p, rp in zip(net.collect_params().values(), ref.collect_params().values()):
        for c in ctxs:
            errs.note('running' if 'running' in p.name else 'param', p.data(c).asnumpy(),
                      rp.data().asnumpy())
    return errs


@scenario
def amp_float16_layer(sizes=(2, 3), hybridize=False, seed=0):
    """What ``amp.init()`` (float16, the GPU setting) feeds the layer, on CPU
    contexts: a BN-relu-BN net (CPU has no float16 convolution) on float16
    input vs the same net with nn.BatchNorm on one context under the same AMP.
    Run on the 'exchange' or 'exchange-device' path (conftest.PATHS) it exercises
    the GPU path's code."""
    from mxnet.contrib import amp as mx_amp
    mx_amp.init(target_dtype='float16')
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))

    def make(norm):
        net = gluon.nn.HybridSequential()
        net.add(norm(), gluon.nn.Activation('relu'), norm())
        return net
    ref = make(lambda: gluon.nn.BatchNorm(in_channels=4))
    ref.initialize(ctx=mx.cpu(0))
    net = make(lambda: SyncBatchNorm(in_channels=4))
    net.initialize(ctx=ctxs)
    if hybridize:
        for n in (ref, net):
            n.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    errs = WorstErrors()
    for _ in range(2):
        x = (rng.randn(sum(sizes), 4, 6, 6) * 3 + 2).astype(np.float16)
        dy = rng.randn(*x.shape).astype(np.float16)
        xs = [mx.nd.array(p, ctx=c, dtype='float16') for p, c in zip(split_batch(x, sizes), ctxs)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [net(a) for a in xs]
        autograd.backward(ys, [mx.nd.array(p, ctx=c, dtype='float16')
                               for p, c in zip(split_batch(dy, sizes), ctxs)])
        xf = mx.nd.array(x, dtype='float16')
        xf.attach_grad()
        with autograd.record():
            yf = ref(xf)
        yf.backward(mx.nd.array(dy, dtype='float16'))
        errs.note('y', np.concatenate([a.asnumpy() for a in ys]), yf.asnumpy())
        errs.note('dx', np.concatenate([a.grad.asnumpy() for a in xs]), xf.grad.asnumpy())
        errs['dx_dtype_ok'] = float(all(a.grad.dtype == np.float16 for a in xs))
        for c in ctxs:
            errs.note('running', net[0].running_mean.data(c).asnumpy(),
                      ref[0].running_mean.data().asnumpy())
    return errs


def dtype_of(arr):
    from gluon_syncbn.mxnet_private import dtype_name
    return dtype_name(arr.dtype)


# ---------------------------------------------------------------- faults
def _step(net, arrays, functional=False):
    """One training step's forward and backward; returns the outputs as NumPy.
    ``functional``: through ``autograd.set_recording``/``set_training``
    instead of a ``record()`` scope."""
    if functional:
        autograd.set_recording(True)
        autograd.set_training(True)
        try:
            outs = [net(a) for a in arrays]
        finally:
            autograd.set_recording(False)
            autograd.set_training(False)
    else:
        with autograd.record():
            outs = [net(a) for a in arrays]
    autograd.backward(outs)
    return [o.asnumpy() for o in outs]


def _capture(fn):
    """Run ``fn``; return (exception text or None, its type name, seconds)."""
    start = time.time()
    try:
        fn()
        mx.nd.waitall()
    except Exception as exc:  # pylint: disable=broad-except
        return str(exc), type(exc).__name__, time.time() - start
    return None, None, time.time() - start


def _recovery_error(net, ctxs, rng, shape, functional=False, steps=1):
    """Worst relative error of full, correct steps after a failure."""
    worst = 0.0
    for _ in range(steps):
        x = rng.randn(*shape).astype(np.float32)
        outs = _step(net, [mx.nd.array(p, ctx=c)
                           for p, c in zip(split_batch(x, [1] * len(ctxs)), ctxs)], functional)
        y64 = batchnorm_float64(x, np.ones_like(x), np.ones(shape[1]), np.zeros(shape[1]))[0]
        worst = max(worst, max_rel_err(np.concatenate(outs), y64))
    return worst


def _fault_net(ctxs, hybridize, timeout, channels=3):
    """Two SyncBatchNorm layers on ``ctxs``, hybridized as ``_hybridize``."""
    net = gluon.nn.HybridSequential()
    net.add(SyncBatchNorm(in_channels=channels, timeout=timeout))
    net.add(SyncBatchNorm(in_channels=channels, timeout=timeout))
    net.initialize(ctx=ctxs)
    _hybridize(net, hybridize)
    return net


@scenario
def empty_slices(empty, sizes=(2, 3, 1), hybridize=False, steps=2, seed=0, numpy_shape=True):
    """Devices ``empty`` (indices) get a slice with no samples, under NumPy
    shape mode (``numpy_shape=False``: without it, where that is an error);
    compared with float64 maths on the other slices: outputs and
    input gradients, gamma/beta gradients summed over devices, running
    statistics on every device. If every slice is empty, the error, then a
    normal step (``recovered``)."""
    rng = np.random.RandomState(seed)
    sizes = [0 if i in empty else s for i, s in enumerate(sizes)]
    ctxs = contexts(len(sizes))
    channels = 3
    gamma = rng.uniform(0.5, 1.5, channels)
    beta = rng.uniform(-0.5, 0.5, channels)
    with mx.util.np_shape(numpy_shape):
        bn = SyncBatchNorm(in_channels=channels, timeout=60)
        bn.initialize(ctx=ctxs)
        bn.gamma.set_data(mx.nd.array(gamma))
        bn.beta.set_data(mx.nd.array(beta))
        if hybridize:
            bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        if not sum(sizes) or not numpy_shape:
            xs = [mx.nd.array(np.zeros((s, channels, 4, 5)), ctx=c) for s, c in zip(sizes, ctxs)]
            msg, kind, seconds = _capture(lambda: _step(bn, xs))
            bn.gamma.set_data(mx.nd.ones(channels))
            bn.beta.set_data(mx.nd.zeros(channels))
            return {'message': msg, 'type': kind, 'seconds': seconds,
                    'recovered': _recovery_error(bn, ctxs, rng, (len(ctxs), channels, 4, 5))}
        errs = WorstErrors()
        run_mean, run_var = np.zeros(channels), np.ones(channels)
        for _ in range(steps):
            x = rng.randn(sum(sizes), channels, 4, 5).astype(np.float32) * 2 + 1
            dy = rng.randn(*x.shape).astype(np.float32)
            xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
            for a in xs:
                a.attach_grad()
            with autograd.record():
                ys = [bn(a) for a in xs]
            autograd.backward(ys, [mx.nd.array(p, ctx=c)
                                   for p, c in zip(split_batch(dy, sizes), ctxs)])
            y64, dx64, dg64, db64, mean64, var64 = batchnorm_float64(x, dy, gamma, beta)
            run_mean = run_mean * 0.9 + mean64 * 0.1
            run_var = run_var * 0.9 + var64 * 0.1
            errs.note('y', np.concatenate([a.asnumpy() for a in ys]), y64)
            errs.note('dx', np.concatenate([a.grad.asnumpy() for a in xs]), dx64)
            errs.note('dgamma', sum(bn.gamma.grad(c).asnumpy().astype(np.float64) for c in ctxs),
                      dg64)
            errs.note('dbeta', sum(bn.beta.grad(c).asnumpy().astype(np.float64) for c in ctxs),
                      db64)
            for c in ctxs:
                errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run_mean)
                errs.note('running_var', bn.running_var.data(c).asnumpy(), run_var)
            errs['empty_shapes_ok'] = float(all(
                ys[i].shape == xs[i].shape == xs[i].grad.shape for i in empty))
            errs['empty_grads_zero'] = float(all(
                not bn.gamma.grad(ctxs[i]).asnumpy().any() and
                not bn.beta.grad(ctxs[i]).asnumpy().any() for i in empty))
        return errs


@scenario
def empty_slice_in_network(read='losses', hybridize=False, seed=0):
    """A Trainer step of Conv2D -> SyncBatchNorm on 3 contexts, a batch of 2
    split by ``split_and_load(..., even_split=False)`` in NumPy shape mode
    (set after the network is built: MXNet cannot build its legacy layers in
    it): cpu(2)'s slice is empty and MXNet's convolution refuses it, so that
    device never calls the layer. The error where ``read`` surfaces it
    ('losses': their asnumpy; 'step': the Trainer's first step; 'waitall'),
    then a step on a batch of 3 compared with float64 maths (``recovered``)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(3)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, in_channels=3, use_bias=False),
            SyncBatchNorm(in_channels=4, timeout=60))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    _hybridize(net, hybridize)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.0})
    mx.util.set_np_shape(True)

    def step(batch):
        xs = gluon.utils.split_and_load(mx.nd.array(batch), ctxs, even_split=False)
        with autograd.record():
            outs = [net(a) for a in xs]
            losses = [o.sum() for o in outs]
        autograd.backward(losses)
        if read == 'losses':
            [l.asnumpy() for l in losses]  # pylint: disable=expression-not-assigned
        trainer.step(batch.shape[0])
        mx.nd.waitall()
        return outs

    msg, kind, seconds = _capture(lambda: step(rng.randn(2, 3, 6, 6).astype(np.float32)))
    x = rng.randn(3, 3, 6, 6).astype(np.float32) * 3 + 1e3
    y = np.concatenate([o.asnumpy() for o in step(x)])
    # The convolution's own float32 output (its rounding is not the layer's).
    conv = np.concatenate([net[0](a).asnumpy() for a in gluon.utils.split_and_load(
        mx.nd.array(x), ctxs)]).astype(np.float64)
    y64 = batchnorm_float64(conv, np.ones_like(conv), np.ones(4), np.zeros(4))[0]
    return {'message': msg, 'type': kind, 'seconds': seconds,
            'recovered': max_rel_err(y, y64)}


@scenario
def missing_device(num_devices=3, hybridize=False, timeout_seconds=2.0, seed=0):
    """Steps of a Trainer loop where the last device gets no slice (a last
    batch of fewer samples than devices), then a normal step. The timeout
    is caught as ``gluon_syncbn.SyncBatchNormTimeout`` where it surfaces:
    in the first step when the losses are read back (``asnumpy``), in the
    second at ``mx.nd.waitall()`` (``caught``: what each raised).
    ``hybridize``: False, True or 'static' (``_hybridize``)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    x = rng.randn(*shape).astype(np.float32)
    short = [mx.nd.array(x[i:i + 1], ctx=c) for i, c in enumerate(ctxs[:-1])]

    def train_step(read):
        with autograd.record():
            losses = [net(a).sum() for a in short]
        autograd.backward(losses)
        trainer.step(len(short))
        read(losses)

    caught, messages, seconds = [], [], []
    for read in (lambda losses: [l.asnumpy() for l in losses], lambda losses: mx.nd.waitall()):
        start = time.time()
        try:
            train_step(read)
            caught.append(None)
        except gluon_syncbn.SyncBatchNormTimeout as exc:
            caught.append('SyncBatchNormTimeout')
            messages.append(str(exc))
        except Exception as exc:  # pylint: disable=broad-except
            caught.append(type(exc).__name__)
            messages.append(str(exc))
        seconds.append(time.time() - start)
    return {'message': messages[0] if messages else None, 'caught': caught,
            'seconds': seconds[0], 'recovered': _recovery_error(net, ctxs, rng, shape)}


@scenario
def bad_input_on_one_device(problem, num_devices=3, hybridize=False, timeout_seconds=60.0,
                            seed=0, functional=False):
    """Device 1 gets a wrong input; the others must fail fast, then recover
    (two steps). ``functional``: every step through ``autograd.set_recording``
    / ``set_training`` instead of ``record()``."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    good = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]
    bad = {'channels': lambda c: mx.nd.array(rng.randn(1, 4, 4, 4), ctx=c),
           'rank': lambda c: mx.nd.array(rng.randn(1, 3, 4, 4, 2, 2), ctx=c),
           'dtype': lambda c: mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c, dtype='float64')}[problem]
    arrays = [good[0], bad(ctxs[1])] + good[2:]
    msg, kind, seconds = _capture(lambda: _step(net, arrays, functional))
    return {'message': msg, 'type': kind, 'seconds': seconds,
            'recovered': _recovery_error(net, ctxs, rng, shape, functional, steps=2)}


@scenario
def early_read(num_devices=2, hybridize=False, timeout_seconds=3.0, seed=0):
    """After a normal step, one whose per-device loop reads device 0's
    output before device 1's call is issued: the timeout (``seconds``) and
    its ``message``, then a normal step."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    first = _recovery_error(net, ctxs, rng, shape)
    arrays = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]

    def step():
        with autograd.record():
            for a in arrays:
                net(a).asnumpy()  # a metric's read, inside the per-device loop
    msg, kind, seconds = _capture(step)
    return {'message': msg, 'type': kind, 'seconds': seconds,
            'recovered': max(first, _recovery_error(net, ctxs, rng, shape))}


@scenario
def device_copy_fails(direction='forward', num_devices=3, hybridize=False, seed=0):
    """On the exchange operator's GPU code (the stand-in CUDA runtime), one
    copy of the next step fails (``direction``: one of the forward's copies
    up, or of the backward's copies down): every device must fail at once
    with the cause, and the step after recover."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, 60.0)
    arrays = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]
    for a in arrays:
        a.attach_grad()
    _step(net, arrays)
    lib = gluon_syncbn.native.load()
    done = native_testing.cuda_calls(lib)
    copies = done['copies_up'] + done['copies_down'] + done['refused']
    # Per layer call per device, 7 copies up and 4 down forward, 2 up and 4
    # down backward: one of the first layer's forward copies up, or one of
    # the last layer's backward copies down.
    fail_at = copies + 7 if direction == 'forward' else copies + 2 * num_devices * 11 + 2
    native_testing.cuda_calls(lib, fail_at=fail_at)
    start = time.time()
    with autograd.record():
        outs = [net(a) for a in arrays]
    autograd.backward(outs)
    messages = [_capture(a.grad.wait_to_read)[0] for a in arrays]
    return {'messages': messages, 'seconds': time.time() - start,
            'refused': native_testing.cuda_calls(lib)['refused'],
            'recovered': _recovery_error(net, ctxs, rng, shape)}


@scenario
def user_code_raises(num_devices=3, hybridize=False, timeout_seconds=60.0, seed=0,
                     after_forward=False):
    """Device 1's forward raises in user code inside autograd.record(): the call
    already issued for device 0 must fail at once, and the next step recover.
    ``after_forward``: user code raises later, once every device's forward
    pass has completed."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    arrays = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]

    def step():
        with autograd.record():
            outs = []
            for a in arrays:
                if a.context == ctxs[1] and not after_forward:
                    raise ValueError('user code failed on device 1')
                outs.append(net(a))
            mx.nd.waitall()
            raise ValueError('user code failed after the forward pass')

    msg, kind, _ = _capture(step)
    start = time.time()
    drained = _capture(mx.nd.waitall)
    return {'message': msg, 'type': kind, 'drain_seconds': time.time() - start,
            'drain_message': drained[0],
            'recovered': _recovery_error(net, ctxs, rng, shape)}


@scenario
def abandoned_steps(num_devices=4, steps=10, hybridize=False, seed=0, cause='user_code'):
    """Steps that fail with every device's calls issued or in flight, each
    device's output then read on its own, the main thread running ahead.
    Every one must raise, naming the layer. ``cause``: ``'user_code'``, an
    exception in user code after all devices but the last were issued (the
    step fails in Python, at once); ``'empty_batch'``, every slice empty (it
    fails in the first layer's meeting, in the engine, while the main thread
    still issues the second layer's calls)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    with mx.util.np_shape(cause == 'empty_batch'):
        net = _fault_net(ctxs, hybridize, 60.0)
        samples = 0 if cause == 'empty_batch' else 1
        arrays = [mx.nd.array(rng.randn(samples, 3, 4, 4), ctx=c) for c in ctxs]
        outputs, messages = 0, []
        for _ in range(steps):
            outs = []
            try:
                with autograd.record():
                    for a in arrays:
                        if cause == 'user_code' and a.context == ctxs[-1]:
                            raise ValueError('user code failed on the last device')
                        outs.append(net(a))
                autograd.backward(outs)
            except ValueError:
                pass
            outputs += len(outs)
            messages += [_capture(o.wait_to_read)[0] for o in outs]
            _capture(mx.nd.waitall)
        return {'outputs': outputs, 'raised': sum(m is not None for m in messages),
                'named': sum(m is not None and "SyncBatchNorm 'syncbatchnorm" in m
                             for m in messages),
                'recovered': _recovery_error(net, ctxs, rng, shape)}


class _DelayedNet(gluon.HybridBlock):
    """Two SyncBatchNorm layers behind a large ``dot`` whose result is
    discarded: each device's layer calls run well after the main thread has
    issued them (as on a GPU, where they queue behind earlier work)."""

    def __init__(self, timeout, **kwargs):
        super(_DelayedNet, self).__init__(**kwargs)
        with self.name_scope():
            self.bn1 = SyncBatchNorm(in_channels=3, timeout=timeout)
            self.bn2 = SyncBatchNorm(in_channels=3, timeout=timeout)

    def hybrid_forward(self, F, x, slow):
        late = F.broadcast_add(x, F.sum(F.dot(slow, slow)) * 0)
        return self.bn2(self.bn1(late))


def _hybridize(net, hybridize):
    """``False``, ``True`` (``hybridize()``), ``'static_alloc'`` or ``'static'``
    (static_alloc and static_shape)."""
    if hybridize:
        net.hybridize(static_alloc=hybridize in ('static_alloc', 'static'),
                      static_shape=hybridize == 'static')


# The first layer's gamma and beta in _DelayedNet and _BNStack runs: the
# second layer's input is then as far from zero as its output.
_GAMMA1, _BETA1 = np.array([0.5, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])


def _ready(net, ctxs, hybridize=False):
    """``net`` (a _DelayedNet or _BNStack) initialized on ``ctxs``, its first
    layer's gamma and beta _GAMMA1 and _BETA1, hybridized as ``_hybridize``."""
    net.initialize(ctx=ctxs)
    net.bn1.gamma.set_data(mx.nd.array(_GAMMA1))
    net.bn1.beta.set_data(mx.nd.array(_BETA1))
    _hybridize(net, hybridize)
    return net


def _two_layers_float64(x):
    """Both layers' float64 output and batch statistics (the first with
    _GAMMA1 and _BETA1, the second with gamma 1 and beta 0)."""
    y1, _, _, _, m1, v1 = batchnorm_float64(x, x, _GAMMA1, _BETA1)
    y2, _, _, _, m2, v2 = batchnorm_float64(y1, y1, np.ones(3), np.zeros(3))
    return y2, [(m1, v1), (m2, v2)]


@scenario
def aborted_then_exact(hybridize='static', cause='user_code', aborts=1, steps=4, delay=800,
                       num_devices=3, timeout_seconds=30.0, seed=0):
    """One exact step, then ``aborts`` steps abandoned by ``cause`` with the
    layers' calls held behind a ``delay`` x ``delay`` dot, then ``steps``
    steps issued at once, nothing read before the last: their outputs and
    the running statistics against float64 maths (the abandoned steps must
    leave the statistics alone), and the seconds from the first abandoned
    step to the last result. ``cause``: ``'user_code'`` (a ValueError after
    every device but the last was issued), ``'interrupt'`` (a
    KeyboardInterrupt there), ``'bad_input'`` (the last device's slice has
    the wrong channel count: the layer refuses it), ``'missing'`` (the last
    device is never fed: the others' calls time out, after
    ``timeout_seconds``, and a read raises) or ``'reset'``
    (``gluon_syncbn.reset()`` there)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    net = _ready(_DelayedNet(timeout_seconds), ctxs, hybridize)
    slows = [mx.nd.ones((delay, delay), ctx=c) for c in ctxs]
    shape = (num_devices, 3, 4, 4)
    expected_running = [(np.zeros(3), np.ones(3)), (np.zeros(3), np.ones(3))]

    def step(x, fail=None):
        outs = []
        with autograd.record():
            for i, c in enumerate(ctxs):
                last = i == num_devices - 1
                if last and fail == 'user_code':
                    raise ValueError('user code failed on the last device')
                if last and fail == 'interrupt':
                    raise KeyboardInterrupt
                if last and fail == 'reset':
                    gluon_syncbn.reset()
                    return outs
                if last and fail == 'missing':
                    return outs
                xi = x[i:i + 1] if not (last and fail == 'bad_input') else x[i:i + 1, :2]
                outs.append(net(mx.nd.array(xi, ctx=c), slows[i]))
        autograd.backward(outs)
        return outs

    def expect(x):
        y, batch = _two_layers_float64(x)
        for i, (m, v) in enumerate(batch):
            rm, rv = expected_running[i]
            expected_running[i] = (rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
        return y

    x = rng.randn(*shape).astype(np.float32)
    errs = WorstErrors()
    errs.note('first', np.concatenate([o.asnumpy() for o in step(x)]), expect(x))
    start = time.time()
    raised = []
    for _ in range(aborts):
        try:
            outs = step((rng.randn(*shape) * 100 + 50).astype(np.float32), fail=cause)
        except (ValueError, KeyboardInterrupt, gluon_syncbn.SyncBatchNormError,
                mx.base.MXNetError) as exc:  # a hybridized graph's refusal is MXNet's
            raised.append(type(exc).__name__)
        else:
            raised.append(_capture(lambda: [o.wait_to_read() for o in outs])[1])
    issued = []
    for _ in range(steps):
        x = rng.randn(*shape).astype(np.float32)
        issued.append((x, step(x)))
    failed = 0
    for x, outs in issued:
        try:
            errs.note('y', np.concatenate([o.asnumpy() for o in outs]), expect(x))
        except mx.base.MXNetError as exc:
            failed += 1
            if VERBOSE:
                print('a later step raised:', str(exc).splitlines()[-1], flush=True)
    seconds = time.time() - start
    for i, bn in enumerate((net.bn1, net.bn2)):
        for c in ctxs:
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), expected_running[i][0])
            errs.note('running_var', bn.running_var.data(c).asnumpy(), expected_running[i][1])
    return dict(errs, failed=failed, seconds=seconds, aborted=raised,
                operator=net.bn1._sync_backend.name)


class _BNStack(gluon.HybridBlock):
    """Two SyncBatchNorm layers, the first with _GAMMA1 and _BETA1."""

    def __init__(self, timeout, **kwargs):
        super(_BNStack, self).__init__(**kwargs)
        with self.name_scope():
            self.bn1 = SyncBatchNorm(in_channels=3, timeout=timeout)
            self.bn2 = SyncBatchNorm(in_channels=3, timeout=timeout)

    def hybrid_forward(self, F, x):
        return self.bn2(self.bn1(x))


def _predict_float64(x, running):
    """_BNStack's predict-mode output from its layers' running statistics."""
    y = x.astype(np.float64)
    for (mean, var), gamma, beta in zip(running, (_GAMMA1, np.ones(3)), (_BETA1, np.zeros(3))):
        shape = (1, -1) + (1,) * (y.ndim - 2)
        y = ((y - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + 1e-5)
             * gamma.reshape(shape) + beta.reshape(shape))
    return y


@scenario
def predict_in_step(pattern='targets', hybridize='static', steps=4, num_devices=3,
                    timeout_seconds=30.0, seed=0):
    """Predict-mode calls inside training steps, nothing read before the
    last step. ``'targets'``: per device, a training call, then a
    predict-mode call of the same network on the same slice (consistency
    targets): outputs against float64 maths, the predict ones with the
    running statistics of the step's own update. ``'gan'``: a discriminator
    (``hybridize``) trained for a step, then a generator (``hybridize()``)
    trained through it in predict mode, per device: the generator's outputs
    and the discriminator's predictions. Also the seconds all that took."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    net = _ready(_BNStack(timeout_seconds), ctxs, hybridize)
    running = [(np.zeros(3), np.ones(3)), (np.zeros(3), np.ones(3))]
    shape = (2 * num_devices, 3, 4, 4)
    errs = WorstErrors()
    issued = []
    start = time.time()
    if pattern == 'targets':
        for _ in range(steps):
            x = (rng.randn(*shape) + 1e3).astype(np.float32)
            ys, ts = [], []
            with autograd.record():
                for part, c in zip(split_batch(x, [2] * num_devices), ctxs):
                    a = mx.nd.array(part, ctx=c)
                    ys.append(net(a))
                    with autograd.predict_mode():
                        ts.append(net(a))
            autograd.backward(ys)
            y64, batch = _two_layers_float64(x)
            running = [(rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
                       for (rm, rv), (m, v) in zip(running, batch)]
            issued.append((ys, y64, ts, _predict_float64(x, running)))
        for ys, y64, ts, t64 in issued:
            errs.note('y', np.concatenate([y.asnumpy() for y in ys]), y64)
            errs.note('target', np.concatenate([t.asnumpy() for t in ts]), t64)
    else:
        gen = SyncBatchNorm(in_channels=3, timeout=timeout_seconds)
        gen.initialize(ctx=ctxs)
        gen.hybridize()
        for _ in range(steps):
            real = (rng.randn(*shape) + 1e3).astype(np.float32)
            with autograd.record():  # the discriminator's step
                outs = [net(mx.nd.array(p, ctx=c))
                        for p, c in zip(split_batch(real, [2] * num_devices), ctxs)]
            autograd.backward(outs)
            _, batch = _two_layers_float64(real)
            running = [(rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
                       for (rm, rv), (m, v) in zip(running, batch)]
            z = (rng.randn(*shape) * 3 + 5).astype(np.float32)
            fakes, judged = [], []
            with autograd.record():  # the generator's, through it in predict mode
                for p, c in zip(split_batch(z, [2] * num_devices), ctxs):
                    fakes.append(gen(mx.nd.array(p, ctx=c)))
                    with autograd.predict_mode():
                        judged.append(net(fakes[-1]))
            autograd.backward(judged)
            fake64 = batchnorm_float64(z, z, np.ones(3), np.zeros(3))[0]
            issued.append((fakes, fake64, judged, _predict_float64(fake64, running)))
        for fakes, fake64, judged, judged64 in issued:
            errs.note('y', np.concatenate([f.asnumpy() for f in fakes]), fake64)
            errs.note('target', np.concatenate([j.asnumpy() for j in judged]), judged64)
    return dict(errs, seconds=time.time() - start, operator=net.bn1._sync_backend.name)


@scenario
def new_device_set(change='reset_ctx', before=4, after=2, hybridize=True, steps=2,
                   timeout_seconds=30.0, seed=0):
    """A network trained on ``before`` contexts moves to ``after`` by
    ``change``: ``'reset_ctx'`` or ``'reinit'`` (``initialize(force_reinit=True)``
    and the parameters set again), then
    trains there, nothing read before the last step: outputs and running
    statistics against float64 maths, the seconds the later steps took, and
    the message of a call on a context outside the new ones (None if it
    synchronized)."""
    rng = np.random.RandomState(seed)
    net = _ready(_BNStack(timeout_seconds), contexts(before), hybridize)
    running = [(np.zeros(3), np.ones(3)), (np.zeros(3), np.ones(3))]
    errs = WorstErrors()

    def train(ctxs, checked):
        nonlocal running
        x = (rng.randn(2 * len(ctxs), 3, 4, 4) + 1e3).astype(np.float32)
        with autograd.record():
            ys = [net(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, [2] * len(ctxs)), ctxs)]
        autograd.backward(ys)
        y64, batch = _two_layers_float64(x)
        running = [(rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
                   for (rm, rv), (m, v) in zip(running, batch)]
        checked.append((ys, y64))

    first = []
    train(contexts(before), first)
    for ys, y64 in first:
        errs.note('y', np.concatenate([y.asnumpy() for y in ys]), y64)
    ctxs = contexts(after)
    if change == 'reset_ctx':
        net.collect_params().reset_ctx(ctxs)
    else:
        saved = {name: p.data(p.list_ctx()[0]).asnumpy()
                 for name, p in net.collect_params().items()}
        net.initialize(ctx=ctxs, force_reinit=True)
        for name, p in net.collect_params().items():
            p.set_data(mx.nd.array(saved[name]))
    start = time.time()
    later = []
    for _ in range(steps):
        train(ctxs, later)
    for ys, y64 in later:
        errs.note('y', np.concatenate([y.asnumpy() for y in ys]), y64)
    seconds = time.time() - start
    for i, bn in enumerate((net.bn1, net.bn2)):
        for c in ctxs:
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), running[i][0])
            errs.note('running_var', bn.running_var.data(c).asnumpy(), running[i][1])
    outside = mx.cpu(after)  # a context the parameters no longer (or never) live on
    with autograd.record():
        message = _capture(lambda: net(mx.nd.ones((2, 3, 4, 4), ctx=outside)))
    return dict(errs, seconds=seconds, outside=message[0], outside_seconds=message[2],
                operator=net.bn1._sync_backend.name)


def _second_order(net, xs):
    """A second-order gradient through ``net`` on each device's ``xs``:
    ``autograd.grad(..., create_graph=True)``, then a backward through it."""
    for a in xs:
        a.attach_grad()
    with autograd.record():
        outs = [net(a) for a in xs]
        grads = [autograd.grad((o * o).sum(), [a], create_graph=True)[0]
                 for o, a in zip(outs, xs)]
    autograd.backward([g.sum() for g in grads])


@scenario
def drop_in(hybridize=False, seed=0):
    """What users' code does with an nn.BatchNorm besides calling it, on
    two contexts: a deep copy (inferring as the original; made trainable,
    trained beside the original, each exact against float64 maths and
    neither touching the other's running statistics), a pickle, a copy of a
    hybridized network that has run (the error), gamma after a training
    step with scale=False (stored as nn.BatchNorm stores it), and a
    second-order gradient (the error, then a step that works)."""
    import copy
    import pickle
    rng = np.random.RandomState(seed)
    ctxs = contexts(2)
    net = _ready(_BNStack(30.0), ctxs)
    errs = WorstErrors()
    running = {}

    def train(n, x):
        with autograd.record():
            ys = [n(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, [2, 2]), ctxs)]
        autograd.backward(ys)
        y64, batch = _two_layers_float64(x)
        old = running.get(id(n), [(np.zeros(3), np.ones(3))] * 2)
        running[id(n)] = [(rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
                          for (rm, rv), (m, v) in zip(old, batch)]
        return ys, y64

    def check(n, name):
        for i, bn in enumerate((n.bn1, n.bn2)):
            for c in ctxs:
                errs.note(name + '_running', bn.running_var.data(c).asnumpy(),
                          running[id(n)][i][1])

    x = (rng.randn(4, 3, 4, 4) + 1e3).astype(np.float32)
    ys, y64 = train(net, x)
    errs.note('original', np.concatenate([y.asnumpy() for y in ys]), y64)
    copied = copy.deepcopy(net)
    running[id(copied)] = running[id(net)]
    probe = mx.nd.array(x[:2], ctx=ctxs[0])
    errs.note('copy_predicts', copied(probe).asnumpy(), net(probe).asnumpy())
    copied.collect_params().reset_ctx(ctxs)  # MXNet: a copied array has no gradient attached
    restored = pickle.loads(pickle.dumps(copied))  # (a hybridized network that ran cannot be)
    errs.note('pickled_predicts', restored(probe).asnumpy(), copied(probe).asnumpy())
    _hybridize(net, hybridize)
    _hybridize(copied, hybridize)
    issued = []
    for _ in range(3):  # interleaved, nothing read before the last
        issued.append(train(net, (rng.randn(4, 3, 4, 4) + 1e3).astype(np.float32)))
        issued.append(train(copied, (rng.randn(4, 3, 4, 4) * 2 - 5e2).astype(np.float32)))
    for ys, y64 in issued:
        errs.note('interleaved', np.concatenate([y.asnumpy() for y in ys]), y64)
    check(net, 'original')
    check(copied, 'copy')
    refused = _capture(lambda: copy.deepcopy(net))[0] if hybridize else None

    fixed = SyncBatchNorm(in_channels=3, scale=False)
    fixed.initialize(ctx=ctxs)
    fixed.gamma.set_data(mx.nd.array([2.0, 3.0, 4.0]))
    _hybridize(fixed, hybridize)
    with autograd.record():
        outs = [fixed(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, [2, 2]), ctxs)]
    autograd.backward(outs)
    # MXNet's BatchNorm writes gamma without declaring it written (only the
    # running statistics are mutable inputs), and so do ours: a reader waits
    # for the call itself, for nn.BatchNorm's gamma alike.
    mx.nd.waitall()
    gammas = [fixed.gamma.data(c).asnumpy().tolist() for c in ctxs]

    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, [2, 2]), ctxs)]
    second, second_type, _ = _capture(lambda: _second_order(net, xs))
    ys, y64 = train(net, (rng.randn(4, 3, 4, 4) + 1e3).astype(np.float32))
    errs.note('after', np.concatenate([y.asnumpy() for y in ys]), y64)
    return dict(errs, refused=refused, gammas=gammas, second=second, second_type=second_type,
                is_batchnorm=isinstance(net.bn1, gluon.nn.BatchNorm),
                operator=net.bn1._sync_backend.name)


@scenario
def misconfigured(problem, hybridize=False, deferred=False):
    """Errors raised before any synchronization: the message and how fast
    (``deferred``: the layer learns its channels at its first call, inside
    Gluon's deferred initialization)."""
    ctxs = contexts(2)
    num_devices = {'num_devices': 4, 'num_devices_small': 1}.get(problem)
    sync_groups = [[0, 1], [2]] if problem == 'sync_groups' else None  # 3 devices, 2 here
    net = gluon.nn.HybridSequential()
    net.add(SyncBatchNorm(in_channels=0 if deferred else 3, num_devices=num_devices, timeout=60,
                          sync_groups=sync_groups))
    net.initialize(ctx=ctxs)
    if hybridize:
        net.hybridize()
    arrays = [mx.nd.ones((2, 3, 4, 4), ctx=c) for c in ctxs]
    msg, kind, seconds = _capture(lambda: _step(net, arrays))
    return {'message': msg, 'type': kind, 'seconds': seconds}


# ---------------------------------------------------------------- integration
@scenario
def resnet18_converted(sizes=(2, 2), steps=2, hybridize=True, seed=0):
    """model_zoo ResNet-18 converted with convert_model, trained a few steps on
    len(sizes) contexts; running statistics must stay identical across devices."""
    from mxnet.gluon.model_zoo import vision
    from gluon_syncbn import convert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    net = convert_model(vision.resnet18_v1(classes=10))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    if hybridize:
        net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.05, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        x = rng.randn(sum(sizes), 3, 32, 32).astype(np.float32)
        y = rng.randint(0, 10, sum(sizes)).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
        ys = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(y, sizes), ctxs)]
        with autograd.record():
            ls = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(ls)
        trainer.step(sum(sizes))
        losses.append(float(sum(l.sum().asscalar() for l in ls)))
    running = [p for n, p in net.collect_params().items() if 'running' in n]
    return {'losses': losses, 'finite': float(np.isfinite(losses).all()),
            'num_syncbn': sum(isinstance(b, SyncBatchNorm) for b in _blocks(net)),
            'replicas_identical': float(all(
                (p.data(c).asnumpy() == p.data(ctxs[0]).asnumpy()).all()
                for p in running for c in ctxs))}


@scenario
def deep_stack(num_devices, hybridize, layers=53, steps=2, seed=0):
    """The host-cost benchmark's net, layers x (conv 1x1 + SyncBN + relu) on
    (2, 16, 2, 2) per device: it must finish (no deadlock at this depth) with
    finite outputs and input gradients, compared with nn.BatchNorm on one
    context on the concatenated batch."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)

    def stack(norm):
        net = gluon.nn.HybridSequential()
        for _ in range(layers):
            net.add(gluon.nn.Conv2D(16, 1, use_bias=False, in_channels=16), norm(),
                    gluon.nn.Activation('relu'))
        return net
    net = stack(lambda: SyncBatchNorm(in_channels=16))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    ref = stack(lambda: gluon.nn.BatchNorm(in_channels=16))
    ref.initialize(ctx=mx.cpu())
    copy_params(net, ref)
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    errors = WorstErrors()
    finite = True
    for _ in range(steps):
        x = rng.randn(2 * num_devices, 16, 2, 2).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, [2] * num_devices), ctxs)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [net(a) for a in xs]
        autograd.backward(ys)
        xr = mx.nd.array(x)
        xr.attach_grad()
        with autograd.record():
            yr = ref(xr)
        yr.backward()
        out = np.concatenate([y.asnumpy() for y in ys])
        dx = np.concatenate([a.grad.asnumpy() for a in xs])
        finite = finite and bool(np.isfinite(out).all() and np.isfinite(dx).all())
        errors.note('out', out, yr.asnumpy())
        errors.note('dx', dx, xr.grad.asnumpy())
    return dict(errors, finite=float(finite))


@scenario
def resnet50_converted(num_devices=4, hybridize=True, steps=1, seed=0):
    """model_zoo ResNet-50 v1 converted with convert_model, at 64x64 with 2
    images per device, trained with a Trainer: it must finish and keep the
    running statistics identical on every device."""
    from mxnet.gluon.model_zoo import vision
    from gluon_syncbn import convert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    net = convert_model(vision.resnet50_v1(classes=10))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        x = rng.randn(2 * num_devices, 3, 64, 64).astype(np.float32)
        y = rng.randint(0, 10, 2 * num_devices).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, [2] * num_devices), ctxs)]
        ys = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(y, [2] * num_devices), ctxs)]
        with autograd.record():
            ls = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(ls)
        trainer.step(2 * num_devices)
        losses.append(float(sum(l.sum().asscalar() for l in ls)))
    running = [p for n, p in net.collect_params().items() if 'running' in n]
    return {'finite': float(np.isfinite(losses).all()),
            'num_syncbn': sum(isinstance(b, SyncBatchNorm) for b in _blocks(net)),
            'replicas_identical': float(all(
                (p.data(c).asnumpy() == p.data(ctxs[0]).asnumpy()).all()
                for p in running for c in ctxs))}


def _blocks(block):
    yield block
    for child in block._children.values():
        yield from _blocks(child)


@scenario
def same_prefix_networks(seed=0):
    """Two independent nets with equal prefixes train in one process on 2
    contexts, interleaved; each must equal its own float64 full-batch maths."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(2)
    nets = []
    for _ in range(2):
        net = gluon.nn.HybridSequential(prefix='model_')
        with net.name_scope():
            net.add(SyncBatchNorm(in_channels=3))
        net.initialize(ctx=ctxs)
        nets.append(net)
    errs = []
    for step in range(3):
        xs = [rng.randn(4, 3, 4, 4).astype(np.float32) for _ in nets]
        with autograd.record():
            outs = [[net(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, [1, 3]), ctxs)]
                    for net, x in zip(nets, xs)]
        for x, out in zip(xs, outs):
            y64 = batchnorm_float64(x, np.ones_like(x), np.ones(3), np.zeros(3))[0]
            errs.append(max_rel_err(np.concatenate([o.asnumpy() for o in out]), y64))
    return {'max_err': worst(*errs), 'same_names': float(
        list(nets[0].collect_params()) == list(nets[1].collect_params()))}


class _RunAheadNet(gluon.HybridBlock):
    """SyncBatchNorm first, on the input (so its batch statistics are known in
    float64), called ``calls`` times per forward pass (each further call on
    ``0.5 * previous + 1``, the sum of all outputs going on), then a
    convolution the Trainer updates."""

    def __init__(self, channels, calls, **kwargs):
        super(_RunAheadNet, self).__init__(**kwargs)
        self._calls = calls
        with self.name_scope():
            self.bn = SyncBatchNorm(in_channels=channels)
            self.conv = gluon.nn.Conv2D(4, 3, padding=1, in_channels=channels)

    def hybrid_forward(self, F, x):
        out = a = self.bn(x)
        for _ in range(self._calls - 1):
            a = self.bn(a * 0.5 + 1)
            out = out + a
        return self.conv(out)


def _random_pass(net, rng, sizes, channels, ctxs):
    """One forward and backward pass of ``net`` on a batch of random scale and
    offset, split ``sizes`` over ``ctxs``, not waited for; returns the batch."""
    x = (rng.randn(sum(sizes), channels, 4, 4) * rng.uniform(0.5, 3)
         + rng.uniform(-2, 2)).astype(np.float32)
    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
    with autograd.record():
        losses = [(net(a) ** 2).mean() for a in xs]
    autograd.backward(losses)
    return x


# A momentum and eps schedule, set between steps (as a BN-momentum schedule
# sets nn.BatchNorm's ``_kwargs``).
SCHEDULE = [(0.9, 1e-5), (0.5, 1e-3), (0.99, 1e-5), (0.1, 0.5)]


@scenario
def run_ahead(hybridize=False, calls=2, sizes=(3, 5), steps=20, micro_steps=2, seed=0):
    """Training that never waits between steps, as GPU loops do: ``steps``
    Trainer steps, each accumulating gradients (grad_req='add') over
    ``micro_steps`` forward/backward passes, with no asnumpy or waitall until
    the end; the layer is called ``calls`` times per forward pass, its
    momentum and eps changed between steps (:data:`SCHEDULE`). Returns the
    worst relative error of every device's running mean and variance against
    float64 momentum updates over the global batch, in call order."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    net = _RunAheadNet(channels, calls)
    net.initialize(ctx=ctxs)
    for param in net.collect_params().values():
        if param.grad_req != 'null':
            param.grad_req = 'add'
    if hybridize:
        net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    trainer = gluon.Trainer(net.conv.collect_params(), 'sgd', {'learning_rate': 0.01})
    run_mean, run_var = np.zeros(channels), np.ones(channels)
    ones, zeros = np.ones(channels), np.zeros(channels)

    def update(batch):
        nonlocal run_mean, run_var
        _, _, _, _, mean, var = batchnorm_float64(batch, np.zeros_like(batch), ones, zeros)
        run_mean = run_mean * momentum + mean * (1 - momentum)
        run_var = run_var * momentum + var * (1 - momentum)

    for step in range(steps):
        momentum, eps = SCHEDULE[step % len(SCHEDULE)]
        net.bn._kwargs.update(momentum=momentum, eps=eps)
        for _ in range(micro_steps):
            batch = _random_pass(net, rng, sizes, channels, ctxs)
            for _ in range(calls):
                update(batch)
                batch = batchnorm_float64(batch, np.zeros_like(batch), ones, zeros,
                                          eps=eps)[0] * 0.5 + 1
        trainer.step(sum(sizes) * micro_steps)
        for param in net.collect_params().values():
            if param.grad_req != 'null':
                param.zero_grad()
    # The one sync point. (In static graphs the engine does not order a read
    # of the running statistics after the updates the last step's calls make
    # inside them: read after a sync point, as README says.)
    mx.nd.waitall()
    errs = WorstErrors()
    for c in ctxs:
        errs.note('running_mean', net.bn.running_mean.data(c).asnumpy(), run_mean)
        errs.note('running_var', net.bn.running_var.data(c).asnumpy(), run_var)
    errs['operator'] = net.bn._sync_backend.name
    return errs


class _TwoLayerNet(gluon.HybridBlock):
    """Two SyncBatchNorm layers on the input, the second on ``0.5 * first + 1``,
    so both layers' batch statistics are known in float64."""

    def __init__(self, channels, **kwargs):
        super(_TwoLayerNet, self).__init__(**kwargs)
        with self.name_scope():
            self.bn1 = SyncBatchNorm(in_channels=channels)
            self.bn2 = SyncBatchNorm(in_channels=channels)

    def hybrid_forward(self, F, x):
        return self.bn2(self.bn1(x) * 0.5 + 1)


def _float64_two_layers(x, stats, momentum=0.9, train=True):
    """_TwoLayerNet in float64 (gamma 1, beta 0): training mode updates
    ``stats`` ([(mean, var), (mean, var)], the running statistics) in place;
    predict mode normalizes with them. Returns the output."""
    channels = x.shape[1]
    ones, zeros = np.ones(channels), np.zeros(channels)
    a = x.astype(np.float64)
    for layer in range(2):
        if train:
            a, _, _, _, mean, var = batchnorm_float64(a, np.zeros_like(a), ones, zeros)
            stats[layer] = (stats[layer][0] * momentum + mean * (1 - momentum),
                            stats[layer][1] * momentum + var * (1 - momentum))
        else:
            mean, var = stats[layer]
            a = (a - mean.reshape(1, -1, 1, 1)) / np.sqrt(var.reshape(1, -1, 1, 1) + 1e-5)
        if layer == 0:
            a = a * 0.5 + 1
    return a


@scenario
def train_and_predict(hybridize=False, sizes=(3, 5), epochs=3, steps=4, seed=0):
    """Epochs of ``steps`` training steps, each epoch followed by a
    validation pass in predict mode, as training scripts do, with no sync
    point at all until the end: the predict outputs against float64 maths
    with the running statistics float64 training gives at that point.
    Returns their worst relative error, and whether the network kept a graph
    for each mode (hooks)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    net = _TwoLayerNet(channels)
    net.initialize(ctx=ctxs)
    if hybridize:
        net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    stats = [(np.zeros(channels), np.ones(channels))] * 2
    checks = []
    for _ in range(epochs):
        for _ in range(steps):
            _float64_two_layers(_random_pass(net, rng, sizes, channels, ctxs), stats)
        x = rng.randn(sum(sizes), channels, 4, 4).astype(np.float32) * 2 + 1
        ys = [net(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, sizes), ctxs)]
        checks.append((ys, _float64_two_layers(x, stats, train=False)))
    errs = WorstErrors()
    for ys, expected in checks:
        errs.note('predict', np.concatenate([y.asnumpy() for y in ys]), expected)
    errs['two_graphs'] = float(hybridize is not False and '_gluon_syncbn_graphs' in net.__dict__)
    errs['operator'] = net.bn1._sync_backend.name
    return errs


def engine_operations(step, calls=3):
    """Engine operations per call of ``step``, counted by MXNet's profiler
    (each operator pushed alone, each bulked segment, each engine variable
    deleted, each operation our operators push)."""
    import gc
    import json as json_
    from mxnet import profiler
    # What earlier cases left for the garbage collector is freed now, not
    # inside the counted calls (each freed array is an engine operation).
    gc.collect()
    mx.nd.waitall()
    profiler.set_config(profile_all=True, aggregate_stats=True, filename=os.devnull)
    profiler.set_state('run')
    for _ in range(calls):
        step()
    profiler.set_state('stop')
    stats = json_.loads(profiler.dumps(reset=True, format='json'))
    return sum(s['Count'] for s in stats['Time'].get('operator', {}).values()) / calls


@scenario
def operations_per_call(hybridize=True, sizes=(2, 3), layers=4, seed=0):
    """What a layer call costs beyond nn.BatchNorm's, counted: engine
    operations per layer call per device (MXNet's profiler), in training
    (forward and backward) and in predict mode, on a stack of ``layers`` x
    (conv 1x1, norm, relu), counted after two warm calls in each mode; where
    the exchange operator copies through the stand-in CUDA runtime, its
    copies and waits per layer call per device too."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    x = rng.randn(sum(sizes), 8, 2, 2).astype(np.float32)
    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
    nets = {}
    for kind in ('plain', 'ours'):
        net = gluon.nn.HybridSequential()
        for _ in range(layers):
            net.add(gluon.nn.Conv2D(8, 1, use_bias=False, in_channels=8),
                    gluon.nn.BatchNorm(in_channels=8) if kind == 'plain'
                    else SyncBatchNorm(in_channels=8),
                    gluon.nn.Activation('relu'))
        net.initialize(mx.init.Xavier(), ctx=ctxs)
        if hybridize:
            net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
        nets[kind] = net

    def train(net):
        with autograd.record():
            ys = [net(a) for a in xs]
        autograd.backward(ys)
        mx.nd.waitall()

    def predict(net):
        for a in xs:
            net(a)
        mx.nd.waitall()

    lib = gluon_syncbn.native.load()
    stand_in = lib is not None and lib.testing and os.environ.get(
        'GLUON_SYNCBN_DEVICE_PATH') == '1'
    per_call = float(layers * len(sizes))
    result = {}
    for mode, step in (('train', train), ('predict', predict)):
        for _ in range(2):
            step(nets['ours'])
            step(nets['plain'])
        before = native_testing.cuda_calls(lib) if stand_in else None
        ours = engine_operations(lambda: step(nets['ours']))
        after = native_testing.cuda_calls(lib) if stand_in else None
        result[mode] = (ours - engine_operations(lambda: step(nets['plain']))) / per_call
        if stand_in:
            for name in native_testing.CUDA_CALLS:
                result['%s_%s' % (mode, name)] = (after[name] - before[name]) / 3 / per_call
    result['operator'] = nets['ours'][1]._sync_backend.name
    return result


@scenario
def store_shared_with_trainer(steps=4, sizes=(3, 5), hybridize=False, seed=0):
    """Under ``SCENARIO_TRANSPORT=kvstore``: the layer reduces through the
    same 'local' kvstore a Trainer uses, and the main thread keeps using it
    (a pushpull of a key of its own) while the layer's reductions are in
    flight, which engine threads issue then from the store lock's queue.
    Returns the running statistics' errors against float64 momentum
    updates, and the main thread's sums' error."""
    from gluon_syncbn import block
    transport = block.make_transport(None)
    store = transport.store
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    net = _RunAheadNet(channels, 1)
    net.initialize(ctx=ctxs)
    if hybridize:
        net.hybridize()
    trainer = gluon.Trainer(net.conv.collect_params(), 'sgd', {'learning_rate': 0.01},
                            kvstore=store, update_on_kvstore=False)
    mine = mx.nd.zeros(16)
    store.init(7, mine)
    run_mean, run_var = np.zeros(channels), np.ones(channels)
    ones, zeros = np.ones(channels), np.zeros(channels)
    errs = WorstErrors()
    for step in range(steps):
        x = (rng.randn(sum(sizes), channels, 4, 4) * 2 + 1).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
        # From the second step on the main thread holds the store's lock
        # while the forward's reductions come (as in a long store call).
        with (transport._store_lock if step else contextlib.ExitStack()):
            with autograd.record():
                losses = [(net(a) ** 2).mean() for a in xs]
                for _ in range(20):
                    out = mx.nd.zeros(16)
                    store.pushpull(7, mx.nd.full(16, step + 1.0), out=out)
            time.sleep(0.05)
        autograd.backward(losses)
        for _ in range(20):  # and the backward ones
            store.pushpull(7, mx.nd.full(16, step + 1.0), out=out)
        trainer.step(sum(sizes))
        errs.note('main_thread_sums', out.asnumpy(), np.full(16, step + 1.0))
        _, _, _, _, mean, var = batchnorm_float64(x, np.zeros_like(x), ones, zeros)
        run_mean = run_mean * 0.9 + mean * 0.1
        run_var = run_var * 0.9 + var * 0.1
    mx.nd.waitall()
    for c in ctxs:
        errs.note('running_mean', net.bn.running_mean.data(c).asnumpy(), run_mean)
        errs.note('running_var', net.bn.running_var.data(c).asnumpy(), run_var)
    errs['operator'] = net.bn._sync_backend.name
    errs['queued'] = transport.twin and native_testing.count(
        gluon_syncbn.session.SESSION.native, 'queued', transport.twin)
    return errs


@scenario
def one_step(sizes=(1, 3), **layer_kwargs):
    """One training step of a layer made with ``layer_kwargs``; for the
    failures a transport reports (tests/test_native_transport.py)."""
    ctxs = contexts(len(sizes))
    bn = SyncBatchNorm(in_channels=3, **layer_kwargs)
    bn.initialize(ctx=ctxs)
    with autograd.record():
        ys = [bn(mx.nd.ones((n, 3, 2, 2), ctx=c)) for n, c in zip(sizes, ctxs)]
    autograd.backward(ys)
    return {'y': float(sum(y.asnumpy().sum() for y in ys))}


@scenario
def store_deleted():
    """Under ``SCENARIO_TRANSPORT=kvstore``: a step, then the user drops the
    store the layer reduces through, then another step."""
    from gluon_syncbn import block
    transport = block.make_transport(None)
    ctxs = contexts(2)
    bn = SyncBatchNorm(in_channels=3)
    bn.initialize(ctx=ctxs)
    for step in range(2):
        if step:
            del transport.store  # its last reference: destroyed now
        with autograd.record():
            ys = [bn(mx.nd.ones((2, 3, 2, 2), ctx=c)) for c in ctxs]
        autograd.backward(ys)
        mx.nd.waitall()
    return {}


@scenario
def fail_then_linger(seconds=60):
    """A step that fails, caught by user code, which then goes on with other
    work: across processes the process must still end (exit grace)."""
    ctxs = contexts(2)
    bn = SyncBatchNorm(in_channels=3)
    bn.initialize(ctx=ctxs)
    try:
        with autograd.record():
            ys = [bn(mx.nd.ones((2, 3, 2, 2), ctx=c)) for c in ctxs]
        autograd.backward(ys)
        mx.nd.waitall()
    except mx.base.MXNetError as exc:
        print('caught: %s' % str(exc).splitlines()[0], flush=True)
    time.sleep(seconds)
    return {}


@scenario
def gluoncv_threads(num_devices=2, batch=7, hybridize=False, steps=3, seed=0, fail=False):
    """GluonCV's threaded data parallelism, as its segmentation and detection
    scripts run it (``--syncbn``): ``parallel_apply`` calls the network from
    one Python thread per device inside ``autograd.record()``, each thread
    waiting for its output; ``DataParallelCriterion(sync=True)`` computes the
    losses the same way; the main thread calls ``autograd.backward``.

    A float64 BN -> tanh -> BN network whose first synchronized call comes
    from the threads (hybridized: the graph is traced once in the main
    thread first, by an inference call, as README says), the batch split by
    ``split_and_load(even_split=False)`` as ``DataParallelModel`` splits it,
    no sync point between steps but the threads' own. Against float64 maths
    on the whole batch: the input gradient of every step, and the running
    statistics of both layers after the last. Also counts the warnings.

    ``fail``: in the second step the first device's thread raises in user
    code at once and the others start after it failed (each 0.3 s after the
    one before); the step's error (``failed``, its seconds) and, skipping that
    batch, the steps after it.
    """
    from gluoncv.utils.parallel import DataParallelCriterion, parallel_apply
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    channels, momentum = 3, 0.9
    gammas = [rng.uniform(0.5, 1.5, channels) for _ in range(2)]
    betas = [rng.uniform(-0.5, 0.5, channels) for _ in range(2)]
    net = gluon.nn.HybridSequential()
    net.add(SyncBatchNorm(in_channels=channels, momentum=momentum),
            gluon.nn.Activation('tanh'),
            SyncBatchNorm(in_channels=channels, momentum=momentum))
    net.initialize(ctx=ctxs)
    net.cast('float64')
    for layer, g, b in zip((net[0], net[2]), gammas, betas):
        layer.gamma.set_data(mx.nd.array(g, dtype='float64'))
        layer.beta.set_data(mx.nd.array(b, dtype='float64'))

    class Dot(gluon.HybridBlock):
        """sum(y * dy): the gradient reaching y is dy."""
        def hybrid_forward(self, F, y, dy):
            return F.sum(y * dy)
    criterion = DataParallelCriterion(Dot(), ctxs, sync=True)
    if hybridize:
        net.hybridize()
        net(mx.nd.zeros((2, channels, 4, 4), ctx=ctxs[0], dtype='float64'))  # the trace

    def failing(block):
        def call(x):
            if x.context == ctxs[0]:
                raise ValueError('user code failed on %s' % x.context)
            return block(x)
        return call

    steps_done, failed = [], {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', RuntimeWarning)
        for step in range(steps + fail):
            x = rng.randn(batch, channels, 4, 4) * 2 + 1
            dy = rng.randn(batch, channels, 4, 4)
            xs = gluon.utils.split_and_load(mx.nd.array(x, dtype='float64'), ctxs,
                                            even_split=False)
            for a in xs:
                a.attach_grad()
            if fail and step == 1:
                start = time.time()
                try:
                    with _threads_started_late(), autograd.record():
                        parallel_apply(failing(net), [(a,) for a in xs], sync=True)
                except Exception as exc:  # pylint: disable=broad-except
                    failed = {'failed': '%s: %s' % (type(exc).__name__, exc),
                              'failed_seconds': time.time() - start}
                continue
            with autograd.record():
                outputs = parallel_apply(net, [(a,) for a in xs], sync=True)
                losses = criterion(outputs, mx.nd.array(dy, dtype='float64'))
            autograd.backward(losses)
            steps_done.append((xs, x, dy))

    errs = WorstErrors()
    running = [(np.zeros(channels), np.ones(channels)) for _ in range(2)]
    for xs, x, dy in steps_done:
        # float64 maths on the whole batch: BN -> tanh -> BN
        y1, _, _, _, mean1, var1 = batchnorm_float64(x, dy, gammas[0], betas[0])
        a = np.tanh(y1)
        _, da, _, _, mean2, var2 = batchnorm_float64(a, dy, gammas[1], betas[1])
        dx = batchnorm_float64(x, da * (1 - a * a), gammas[0], betas[0])[1]
        errs.note('dx', np.concatenate([p.grad.asnumpy() for p in xs]), dx)
        running = [(m * momentum + mean * (1 - momentum), v * momentum + var * (1 - momentum))
                   for (m, v), mean, var in zip(running, (mean1, mean2), (var1, var2))]
    for layer, (mean, var) in zip((net[0], net[2]), running):
        for c in ctxs:
            errs.note('running_mean', layer.running_mean.data(c).asnumpy(), mean)
            errs.note('running_var', layer.running_var.data(c).asnumpy(), var)
    errs['slices'] = [int(p.shape[0]) for p in steps_done[0][0]]
    errs['operator'] = net[0]._sync_backend.name
    errs['warnings'] = sum('gluon_syncbn' in str(w.message) for w in caught)
    errs.update(failed)
    return errs


@contextlib.contextmanager
def _threads_started_late(delay=0.3):
    """Each thread started in the context starts ``delay`` seconds after the
    one before."""
    start = threading.Thread.start
    count = [0]

    def late(thread):
        time.sleep(delay * count[0])
        count[0] += 1
        start(thread)
    threading.Thread.start = late
    try:
        yield
    finally:
        threading.Thread.start = start


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


# ------------------------------------------- traced graphs and SymbolBlocks
def _backbone(norm, prefix='bb_'):
    """BN on the input (far from zero: its statistics are exact in float64),
    then three conv + BN + relu stages, the last two with stride 2 (8x8,
    4x4, 2x2 maps): a backbone GluonCV's feature extractors take."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(norm(in_channels=3),
                gluon.nn.Conv2D(8, 3, padding=1, use_bias=False, in_channels=3),
                norm(in_channels=8),
                gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(8, 3, strides=2, padding=1, use_bias=False, in_channels=8),
                norm(in_channels=8, momentum=0.8), gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(8, 3, strides=2, padding=1, use_bias=False, in_channels=8),
                norm(in_channels=8, epsilon=1e-3), gluon.nn.Activation('relu'))
    return net


def _feature_block(kind, backbone):
    """``backbone`` traced into a SymbolBlock: by hand (``'hand'``: sharing
    its Parameters; ``'hand_own'``: Parameters of its own), GluonCV's
    FeatureExpander (``'expander'``; ``'expander_bn'`` with its own BatchNorm
    operators) or FPNFeatureExpander (``'fpn'``)."""
    if kind in ('hand', 'hand_own'):
        data = mx.sym.var('data')
        internals = backbone(data).get_internals()
        outputs = [internals['bb_relu1_fwd_output'], internals['bb_relu2_fwd_output']]
        return gluon.SymbolBlock(outputs, data, params=backbone.collect_params()
                                 if kind == 'hand' else None)
    from gluoncv.nn.feature import FeatureExpander, FPNFeatureExpander
    if kind == 'fpn':
        return FPNFeatureExpander(backbone, ['relu0_fwd', 'relu1_fwd', 'relu2_fwd'],
                                  num_filters=[8, 8, 8])
    return FeatureExpander(backbone, ['relu1_fwd', 'relu2_fwd'], num_filters=[8],
                           use_bn=kind == 'expander_bn', min_depth=8)


def _set_weights(block, rng):
    """Every Parameter of ``block`` (initialized, or waiting for its shape)
    set to values a trained network might have, the same on each of its
    contexts."""
    params = block.collect_params()
    if any(not p.shape or not all(p.shape) for p in params.values()):
        block.infer_shape(mx.nd.zeros((1, 3, 8, 8)))  # a SymbolBlock's own Parameters
    for name, p in sorted(params.items()):
        if name.endswith('gamma'):
            value = rng.uniform(0.5, 1.5, p.shape)
        elif name.endswith('running_var') or name.endswith('moving_var'):
            value = rng.uniform(0.5, 2.0, p.shape)
        elif name.endswith('weight'):
            value = rng.randn(*p.shape) * 0.3
        else:
            value = rng.uniform(-0.5, 0.5, p.shape)
        p.set_data(mx.nd.array(value, dtype=p.dtype))


def _values(params):
    """Every Parameter's value by name (set, or waiting for a first call:
    a SymbolBlock's own Parameters)."""
    values = {}
    for name, p in params.items():
        try:
            values[name] = p.data(p.list_ctx()[0]).asnumpy()
        except gluon.parameter.DeferredInitializationError:
            values[name] = p._deferred_init[3].asnumpy()  # what set_data gave it
    return values


def _twin64(kind, values):
    """The same graph with nn.BatchNorm, on one context, in float64, with
    ``values`` (by name): nn.BatchNorm on the whole batch."""
    twin = _feature_block(kind, _backbone(gluon.nn.BatchNorm))
    params = twin.collect_params()
    params.initialize(ctx=mx.cpu(0))
    twin.cast('float64')
    for name, p in params.items():
        p.set_data(mx.nd.array(values[name], dtype='float64'))
    return twin


def _twin_dtype(net):
    """The dtype of ``net``'s parameters."""
    return np.dtype(next(iter(net.collect_params().values())).dtype).name


def _unfused(symbol):
    """``symbol`` with each BatchNormWithReLU node (MKL-DNN's only: no
    float64) as BatchNorm then relu: a float64 twin can run it."""
    graph = json.loads(symbol.tojson())
    nodes, where = [], {}
    for i, node in enumerate(graph['nodes']):
        node = dict(node, inputs=[[where[e[0]]] + list(e[1:]) for e in node['inputs']])
        if node['op'] == '_contrib_BatchNormWithReLU':
            nodes.append(dict(node, op='BatchNorm'))
            node = {'op': 'Activation', 'name': node['name'] + '_relu',
                    'attrs': {'act_type': 'relu'}, 'inputs': [[len(nodes) - 1, 0, 0]]}
        nodes.append(node)
        where[i] = len(nodes) - 1
    graph = {'nodes': nodes, 'heads': [[where[h[0]]] + list(h[1:]) for h in graph['heads']],
             'arg_nodes': [k for k, n in enumerate(nodes) if n['op'] == 'null'],
             'attrs': graph.get('attrs', {})}
    return mx.sym.load_json(json.dumps(graph))


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _graph_step(net, xs, dys):
    """A forward and backward pass of ``net`` on each device's ``xs`` with
    head gradients ``dys`` (one per output); returns the outputs."""
    with autograd.record():
        outs = [_as_list(net(a)) for a in xs]
    autograd.backward([o for out in outs for o in out], [d for ds in dys for d in ds])
    return outs


def _compare_step(errs, key, net, twin, x, sizes, ctxs, rng):
    """One step of ``net`` on ``x`` split ``sizes`` over ``ctxs`` and of its
    float64 twin on the whole batch, from the same values: outputs,
    every Parameter's gradient (summed over devices) and every device's
    running statistics."""
    dtype = _twin_dtype(twin)
    with autograd.predict_mode():
        shapes = [o.shape for o in _as_list(twin(mx.nd.array(x[:1], dtype=dtype)))]
    dys = [rng.randn(len(x), *shape[1:]) for shape in shapes]
    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
    parts = [split_batch(d, sizes) for d in dys]
    outs = _graph_step(net, xs, [[mx.nd.array(parts[k][i], ctx=c) for k in range(len(dys))]
                                 for i, c in enumerate(ctxs)])
    with autograd.record():
        outs64 = _as_list(twin(mx.nd.array(x, dtype=dtype)))
    autograd.backward(outs64, [mx.nd.array(d, dtype=dtype) for d in dys])
    for k, out64 in enumerate(outs64):
        errs.note(key + '_out', np.concatenate([o[k].asnumpy() for o in outs]), out64.asnumpy())
    theirs = twin.collect_params()
    for name, p in net.collect_params().items():
        want = theirs[name]
        if p.grad_req != 'null':
            errs.note(key + '_grad', sum(p.grad(c).asnumpy().astype(np.float64) for c in ctxs),
                      want.grad().asnumpy())
        if 'running' in name or 'moving' in name:
            for c in ctxs:
                errs.note(key + '_running', p.data(c).asnumpy(), want.data().asnumpy())


@scenario
def traced_backbone(kind='hand', order='initall', hybridize=True, sizes=(3, 2, 2), steps=2,
                    export_to=None, seed=0):
    """A converted backbone traced into a SymbolBlock (:func:`_feature_block`),
    trained on len(sizes) contexts on data 1e3 from zero, against the same
    graph with nn.BatchNorm in float64 on the whole batch, after ``order``:
    ``'initall'`` (the backbone initialized on every context before the
    trace), ``'init1'`` (on one, then ``reset_ctx``), ``'uninit'`` (never
    initialized before the trace), ``'load_after'`` (the weights loaded onto
    every context after the trace), ``'run1_then_all'`` (a training call on
    one context first, then ``reset_ctx``). Then a predict call, and (on 3
    contexts or more) a step after a move to two. ``export_to``: the
    SymbolBlock exported there, with a test input and its predictions."""
    import warnings as warnings_
    from gluon_syncbn import convert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    one = [mx.cpu(0)]
    backbone = convert_model(_backbone(gluon.nn.BatchNorm), timeout=60)
    if order == 'initall':
        backbone.initialize(ctx=ctxs)
    elif order in ('init1', 'run1_then_all'):
        backbone.initialize(ctx=one)
    feat = _feature_block(kind, backbone)
    if kind == 'expander_bn':
        convert_model(feat, timeout=60)
    params = feat.collect_params()
    with warnings_.catch_warnings():
        warnings_.simplefilter('ignore')  # the backbone's, initialized already
        if order == 'load_after':
            source = _feature_block(kind, _backbone(gluon.nn.BatchNorm))
            source.collect_params().initialize(ctx=one)
            _set_weights(source, rng)
            source(mx.nd.zeros((1, 3, 8, 8)))  # its own Parameters get their values
            path = os.path.join(export_to or '/tmp', 'gluon_syncbn_weights_%d.params' % os.getpid())
            source.collect_params().save(path)
            params.load(path, ctx=ctxs)
            os.remove(path)
        else:
            params.initialize(ctx=one if order in ('init1', 'run1_then_all') else ctxs)
            _set_weights(feat, rng)
    _hybridize(feat, hybridize)
    if order == 'run1_then_all':
        x = (rng.randn(2, 3, 8, 8) + 1e3).astype(np.float32)
        _graph_step(feat, [mx.nd.array(x)], [[mx.nd.ones_like(o) for o in
                                              _as_list(feat(mx.nd.array(x)))]])
    if order in ('init1', 'run1_then_all'):
        params.reset_ctx(ctxs)
    twin = _twin64(kind, _values(params))
    _hybridize(twin, hybridize)
    errs = WorstErrors()
    for _ in range(steps):
        x = (rng.randn(sum(sizes), 3, 8, 8) + 1e3).astype(np.float32)
        _compare_step(errs, 'step', feat, twin, x, sizes, ctxs, rng)
    graphs = feat._gluon_syncbn_graphs
    result = dict(layers=len(graphs.backends), operator=sorted({b.name for b in graphs.backends}),
                  shadows=len(getattr(feat, '_gluon_syncbn_shadows', ())))
    test = (rng.randn(3, 3, 8, 8) + 1e3).astype(np.float32)
    with autograd.predict_mode():
        mine = [o.asnumpy() for o in _as_list(feat(mx.nd.array(test, ctx=ctxs[-1])))]
        for m, o in zip(mine, _as_list(twin(mx.nd.array(test, dtype=_twin_dtype(twin))))):
            errs.note('predict', m, o.asnumpy())
    if len(sizes) >= 3:
        params.reset_ctx(ctxs[:2])
        x = (rng.randn(5, 3, 8, 8) + 1e3).astype(np.float32)
        _compare_step(errs, 'moved', feat, twin, x, [3, 2], ctxs[:2], rng)
        result['moved_devices'] = sorted({len(b.devices) for b in
                                          feat._gluon_syncbn_graphs.backends})
    if export_to:
        feat.export(os.path.join(export_to, 'feat'))
        np.save(os.path.join(export_to, 'x.npy'), test)
        with autograd.predict_mode():
            np.save(os.path.join(export_to, 'y.npy'), np.concatenate(
                [o.asnumpy().ravel() for o in _as_list(feat(mx.nd.array(test, ctx=ctxs[0])))]))
    result.update(errs)
    return result


def _export_net(norm, relu_norm):
    """A network to export: BN on the input, conv, BN, relu, conv, BN with
    ReLU, pooling, dense; its layers' names depend on nothing but the
    prefix (convert_model keeps them)."""
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(norm(in_channels=3),
                gluon.nn.Conv2D(4, 3, padding=1, use_bias=False, in_channels=3),
                norm(in_channels=4, momentum=0.8), gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(4, 3, padding=1, use_bias=False, in_channels=4),
                relu_norm(in_channels=4),
                gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(5, in_units=4))
    return net


@scenario
def export_and_import(export_to, hybridize=True, relu=False, sizes=(3, 2, 2), seed=0):
    """``export()`` of a converted network after a training step and after
    a predict call, beside ``nn.BatchNorm``'s network with the same names
    (both trained alike): whether the symbol files are equal, the
    BatchNorm nodes' arguments, and files for a process without gluon_syncbn
    to load (a test input and our predictions). Then ``SymbolBlock.imports``
    of the export, ``convert_model`` on it, two training steps on len(sizes)
    contexts against the imported graph on one context in float64
    (``relu``: its last norm layer is nn.BatchNormReLU); exported again, whether the file is the one imported;
    reverted, whether a mark is left. Data 1e3 from zero."""
    from gluon_syncbn import convert_model, revert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    relu_norm = gluon.nn.BatchNormReLU if relu else gluon.nn.BatchNorm
    ours = convert_model(_export_net(gluon.nn.BatchNorm, relu_norm), timeout=60)
    plain = _export_net(gluon.nn.BatchNorm, relu_norm)
    ours.initialize(ctx=ctxs)
    plain.initialize(ctx=mx.cpu(0))
    _set_weights(ours, rng)
    for name, value in _values(ours.collect_params()).items():
        plain.collect_params()[name].set_data(mx.nd.array(value))
    _hybridize(ours, hybridize)
    _hybridize(plain, hybridize)
    x = (rng.randn(sum(sizes), 3, 6, 6) + 1e3).astype(np.float32)
    dy = rng.randn(sum(sizes), 5).astype(np.float32)
    _graph_step(ours, [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)],
                [[mx.nd.array(d, ctx=c)] for d, c in zip(split_batch(dy, sizes), ctxs)])
    _graph_step(plain, [mx.nd.array(x)], [[mx.nd.array(dy)]])
    result = {'operator': ours[0]._sync_backend.name}
    test = (rng.randn(4, 3, 6, 6) + 1e3).astype(np.float32)
    np.save(os.path.join(export_to, 'x.npy'), test)
    for when in ('training', 'predict'):
        if when == 'predict':
            with autograd.predict_mode():
                ours(mx.nd.array(test, ctx=ctxs[1]))
                plain(mx.nd.array(test))
        ours.export(os.path.join(export_to, 'ours-' + when))
        plain.export(os.path.join(export_to, 'plain-' + when))
        with open(os.path.join(export_to, 'ours-%s-symbol.json' % when)) as f:
            mine = json.load(f)
        with open(os.path.join(export_to, 'plain-%s-symbol.json' % when)) as f:
            theirs = json.load(f)
        result[when + '_equal'] = mine == theirs
        result[when + '_nodes'] = sorted({n['op'] for n in mine['nodes']} - {'null'})
        result[when + '_global_stats'] = sorted({n['attrs'].get('use_global_stats') for n in
                                                 mine['nodes'] if 'BatchNorm' in n['op']})
    with autograd.predict_mode():
        np.save(os.path.join(export_to, 'y.npy'), ours(mx.nd.array(test, ctx=ctxs[0])).asnumpy())
    symbol_file = os.path.join(export_to, 'ours-training-symbol.json')
    param_file = os.path.join(export_to, 'ours-training-0000.params')
    imported = gluon.SymbolBlock.imports(symbol_file, ['data'], param_file, ctx=ctxs)
    convert_model(imported, timeout=60)
    result['shadows'] = len(imported._gluon_syncbn_shadows)
    twin = gluon.SymbolBlock(_unfused(mx.sym.load(symbol_file)), mx.sym.var('data'))
    twin.collect_params().load(param_file, ctx=mx.cpu(0))
    twin.cast('float64')
    _hybridize(imported, hybridize)
    _hybridize(twin, hybridize)
    errs = WorstErrors()
    for _ in range(2):
        x = (rng.randn(sum(sizes), 3, 6, 6) + 1e3).astype(np.float32)
        _compare_step(errs, 'imported', imported, twin, x, sizes, ctxs, rng)
    result['imported_operator'] = sorted({b.name for b in imported._gluon_syncbn_graphs.backends})
    imported.export(os.path.join(export_to, 'again'))
    with open(symbol_file) as f, open(os.path.join(export_to, 'again-symbol.json')) as g:
        result['export_is_the_import'] = json.load(f) == json.load(g)
    revert_model(imported)
    from gluon_syncbn import traced
    result['reverted_marks'] = traced.has_marks(imported._cached_graph[1])
    result.update(errs)
    return result


@scenario
def backward_errors(hybridize=True, seed=0):
    """What a backward raises, on _BNStack on two contexts, after a good
    step: a step run without ``autograd.record()`` then backward; a
    higher-order gradient through another, nn.BatchNorm-free hybridized
    network; a higher-order gradient through ours. Each: the type and text."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(2)
    net = _ready(_BNStack(30.0), ctxs, hybridize)
    x = (rng.randn(4, 3, 4, 4) + 1e3).astype(np.float32)
    xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, [2, 2]), ctxs)]
    with autograd.record():
        ys = [net(a) for a in xs]
    autograd.backward(ys)
    result = {}

    def unrecorded():
        autograd.backward([net(a).sum() for a in xs])
    result['unrecorded'], result['unrecorded_type'], _ = _capture(unrecorded)
    other = gluon.nn.HybridSequential()
    other.add(gluon.nn.Dense(4, in_units=3, activation='tanh'), gluon.nn.Dense(1, in_units=4))
    other.initialize(ctx=ctxs[0])
    _hybridize(other, hybridize or True)

    def other_higher():
        a = mx.nd.array(rng.randn(2, 3), ctx=ctxs[0])
        a.attach_grad()
        with autograd.record():
            g = autograd.grad(other(a).sum(), [a], create_graph=True)[0]
            second = (g * g).sum()
        second.backward()
    result['other'], result['other_type'], _ = _capture(other_higher)
    result['ours'], result['ours_type'], _ = _capture(lambda: _second_order(net, xs))
    x = (rng.randn(4, 3, 4, 4) + 1e3).astype(np.float32)
    with autograd.record():
        ys = [net(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, [2, 2]), ctxs)]
    autograd.backward(ys)
    result['after'] = max_rel_err(np.concatenate([y.asnumpy() for y in ys]),
                                  _two_layers_float64(x)[0])
    result['operator'] = net.bn1._sync_backend.name
    return result


class _ForeachNet(gluon.HybridBlock):
    """A SyncBatchNorm layer called inside a control-flow operator's body."""

    def __init__(self, **kwargs):
        super(_ForeachNet, self).__init__(**kwargs)
        with self.name_scope():
            self.bn = SyncBatchNorm(in_channels=3, timeout=30)

    def hybrid_forward(self, F, x):
        out, _ = F.contrib.foreach(lambda data, states: (self.bn(data), states), x,
                                   [F.zeros((1,))])
        return out


@scenario
def refused_graph(case):
    """A graph whose SyncBatchNorm layers would run per device, refused at
    once: the message, the exception's type and the seconds it took.
    ``case``: ``'cached_op'`` (mx.nd.CachedOp of a traced symbol),
    ``'optimize_for'``, ``'module'`` (Module on two contexts),
    ``'backend'`` (hybridize(backend=...)), ``'foreach'`` (a layer inside a
    control-flow operator), ``'computed_gamma'`` (a SymbolBlock whose node
    takes gamma from an operator), ``'empty_slice'`` (a SymbolBlock fed an
    empty slice), ``'precise_one_device'`` and ``'precise_plain'``
    (update_bn_stats on a SymbolBlock whose layer does not synchronize, and
    on an imported nn.BatchNorm graph)."""
    ctxs = contexts(2)
    x = mx.nd.ones((2, 3, 4, 4)) + 1e3
    net = _ready(_BNStack(30.0), ctxs if case != 'precise_one_device' else ctxs[:1])
    data = mx.sym.var('data')
    shared = gluon.SymbolBlock(net(data), data, params=net.collect_params())
    shared.hybridize()

    def step(block, arrays):
        with autograd.record():
            outs = [block(*a) if isinstance(a, tuple) else block(a) for a in arrays]
        autograd.backward(outs)

    if case == 'cached_op':
        def run():
            mx.nd.CachedOp(net(mx.sym.var('data')))
    elif case == 'optimize_for':
        def run():
            net.optimize_for(x, backend='MKLDNN')
    elif case == 'module':
        def run():
            module = mx.mod.Module(net(mx.sym.var('data')), label_names=None, context=ctxs)
            module.bind(data_shapes=[('data', (4, 3, 4, 4))])
    elif case == 'backend':
        def run():
            net.hybridize(backend='MKLDNN')
            step(net, [x.copyto(c) for c in ctxs])
    elif case == 'foreach':
        foreach = _ForeachNet()
        foreach.initialize(ctx=ctxs)
        foreach.hybridize()

        def run():
            step(foreach, [mx.nd.ones((2, 1, 3, 4), ctx=c) for c in ctxs])
    elif case == 'computed_gamma':
        symbol = net(data)
        gamma = mx.sym.var('gamma_source')
        symbol._compose(**{net.bn1.gamma.name: gamma * 1})
        params = gluon.ParameterDict()
        params.update({k: v for k, v in net.collect_params().items()
                       if k != net.bn1.gamma.name})
        computed = gluon.SymbolBlock(symbol, [data, gamma], params=params)

        def run():
            step(computed, [(x.copyto(c), mx.nd.ones((3,), ctx=c)) for c in ctxs])
    elif case == 'empty_slice':
        mx.util.set_np_shape(True)

        def run():
            step(shared, [x.copyto(ctxs[0]), mx.nd.zeros((0, 3, 4, 4), ctx=ctxs[1])])
    elif case == 'precise_one_device':
        def run():
            gluon_syncbn.update_bn_stats(shared, [[x]], 1, progress=False)
    elif case == 'precise_plain':
        from gluon_syncbn import revert_model
        import tempfile
        folder = tempfile.mkdtemp()
        plain = revert_model(_ready(_BNStack(30.0), ctxs[:1], True))
        plain(x)
        plain.export(os.path.join(folder, 'plain'))
        imported = gluon.SymbolBlock.imports(os.path.join(folder, 'plain-symbol.json'),
                                             ['data'], os.path.join(folder, 'plain-0000.params'),
                                             ctx=ctxs)

        def run():
            gluon_syncbn.update_bn_stats(imported, [[x.copyto(c) for c in ctxs]], 1,
                                         progress=False)
    message, kind, seconds = _capture(run)
    gluon_syncbn.session.drain()  # the calls the refusal failed
    return {'message': message, 'type': kind, 'seconds': seconds}


def run(name, kwargs):
    start = time.time()
    result = SCENARIOS[name](**kwargs)
    mx.nd.waitall()
    result.setdefault('seconds', time.time() - start)
    return result


def main():
    """``NAME JSON`` runs one scenario; ``--batch JSON_LIST`` runs ``[[name, kwargs], ...]``
    in order, printing ``RESULT <index> {...}`` after each."""
    if os.environ.get('SCENARIO_TRACEBACK_AFTER'):
        # A scenario that hangs prints where every thread waits before it is killed.
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ['SCENARIO_TRACEBACK_AFTER']))
    if sys.argv[1] == '--batch':
        for i, (name, kwargs) in enumerate(json.loads(sys.argv[2])):
            print('RESULT %d %s' % (i, json.dumps(run(name, kwargs))))
            sys.stdout.flush()
        return
    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print('RESULT ' + json.dumps(run(sys.argv[1], kwargs)))
    sys.stdout.flush()


if __name__ == '__main__':
    main()
