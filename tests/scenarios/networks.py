"""Networks trained on several contexts against one context on the
concatenated batch, and converted backbones traced into SymbolBlocks
(tests/test_networks.py).
"""
import json
import os
import sys

import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors, max_rel_err
from tests.scenarios import (VERBOSE, _as_list, _compare_step, _graph_step, _hybridize,
                             _set_weights, _twin_dtype, _values, contexts, copy_params, scenario,
                             split_batch)


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


def _backbone(norm, prefix='bb_'):
    """BN on the input (far from zero: its statistics are exact in float64),
    then three conv + BN + relu stages, the last two with stride 2 (8x8,
    4x4, 2x2 maps): a backbone GluonCV's feature extractors take. Its norm
    layers are named bn0 to bn3, whatever ``norm`` is."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(norm(in_channels=3, prefix='bn0_'),
                gluon.nn.Conv2D(8, 3, padding=1, use_bias=False, in_channels=3),
                norm(in_channels=8, prefix='bn1_'),
                gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(8, 3, strides=2, padding=1, use_bias=False, in_channels=8),
                norm(in_channels=8, momentum=0.8, prefix='bn2_'), gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(8, 3, strides=2, padding=1, use_bias=False, in_channels=8),
                norm(in_channels=8, epsilon=1e-3, prefix='bn3_'), gluon.nn.Activation('relu'))
    return net


def _contrib_norm(**kwargs):
    """contrib's SyncBatchNorm, as GluonCV's _syncbn_ networks build their backbones."""
    return gluon.contrib.nn.SyncBatchNorm(num_devices=3, **kwargs)


def _batchnorm_named(data, name=None, key=None, ndev=None):
    """BatchNorm's operator, named as GluonCV names contrib's SyncBatchNorm
    operator (which has BatchNorm's arguments and defaults)."""
    return mx.sym.BatchNorm(data, name=name)


def _feature_block(kind, backbone, reference=False):
    """``backbone`` traced into a SymbolBlock: by hand (``'hand'``: sharing
    its Parameters; ``'hand_own'``: Parameters of its own), GluonCV's
    FeatureExpander (``'expander'``; ``'expander_bn'`` with its own BatchNorm
    operators) or FPNFeatureExpander (``'fpn'``; ``'fpn_syncbn'`` with
    contrib's SyncBatchNorm operator after its convolutions, as GluonCV's
    _syncbn_ detectors build it, BatchNorm's for the ``reference``)."""
    if kind in ('hand', 'hand_own'):
        data = mx.sym.var('data')
        internals = backbone(data).get_internals()
        outputs = [internals['bb_relu1_fwd_output'], internals['bb_relu2_fwd_output']]
        return gluon.SymbolBlock(outputs, data, params=backbone.collect_params()
                                 if kind == 'hand' else None)
    from gluoncv.nn.feature import FeatureExpander, FPNFeatureExpander
    outputs = ['relu0_fwd', 'relu1_fwd', 'relu2_fwd']
    if kind == 'fpn':
        return FPNFeatureExpander(backbone, outputs, num_filters=[8, 8, 8])
    if kind == 'fpn_syncbn':
        from unittest import mock
        from gluoncv.nn import feature
        if not reference:
            return FPNFeatureExpander(backbone, outputs, num_filters=[8, 8, 8],
                                      norm_layer=mx.sym.contrib.SyncBatchNorm,
                                      norm_kwargs={'ndev': 3})
        # GluonCV names the nodes only for contrib's operator.
        with mock.patch.object(feature, 'SyncBatchNorm', _batchnorm_named):
            return FPNFeatureExpander(backbone, outputs, num_filters=[8, 8, 8],
                                      norm_layer=_batchnorm_named)
    return FeatureExpander(backbone, ['relu1_fwd', 'relu2_fwd'], num_filters=[8],
                           use_bn=kind == 'expander_bn', min_depth=8)


def _twin64(kind, values):
    """The same graph with nn.BatchNorm, on one context, in float64, with
    ``values`` (by name): nn.BatchNorm on the whole batch."""
    twin = _feature_block(kind, _backbone(gluon.nn.BatchNorm), reference=True)
    params = twin.collect_params()
    params.initialize(ctx=mx.cpu(0))
    twin.cast('float64')
    for name, p in params.items():
        p.set_data(mx.nd.array(values[name], dtype='float64'))
    return twin


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
    backbone = _backbone(_contrib_norm) if kind == 'fpn_syncbn' else \
        convert_model(_backbone(gluon.nn.BatchNorm), timeout=60)
    if order == 'initall':
        backbone.initialize(ctx=ctxs)
    elif order in ('init1', 'run1_then_all'):
        backbone.initialize(ctx=one)
    feat = _feature_block(kind, backbone)
    if kind in ('expander_bn', 'fpn_syncbn'):
        convert_model(feat, timeout=60)
    params = feat.collect_params()
    with warnings_.catch_warnings():
        warnings_.simplefilter('ignore')  # the backbone's, initialized already
        if order == 'load_after':
            source = _feature_block(kind, _backbone(gluon.nn.BatchNorm), reference=True)
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


def _plain_graph(symbol):
    """``symbol`` as a network of nn.BatchNorm has it: no marks, and
    BatchNorm nodes for contrib's SyncBatchNorm (the same arguments and
    defaults, less its count of devices and key)."""
    graph = json.loads(symbol.tojson())
    for node in graph['nodes']:
        attrs = node.get('attrs', {})
        attrs.pop('__gluon_syncbn__', None)
        if node['op'] == '_contrib_SyncBatchNorm':
            node['op'] = 'BatchNorm'
            for name in ('ndev', 'key'):
                attrs.pop(name, None)
    return mx.sym.load_json(json.dumps(graph))


@scenario
def gluoncv_detector(name, convert=True, whole=False, syncbn=False, sizes=(2, 2), size=64,
                     seed=0, **build):
    """GluonCV's detector ``name`` built as its users build it, without
    weights (``build``: the builder's further arguments; ``syncbn``: also
    ``norm_layer=SyncBatchNorm``, ``norm_kwargs={'num_devices': N}``),
    ``convert_model`` on it where ``convert``, then, with random values, one
    training step on len(sizes) contexts on data 1e3 from zero, of the whole
    network (``whole``, SSD's) or of its feature extractor (a SymbolBlock): the
    warnings of gluon_syncbn (the conversion's and the step's), how many of
    the feature extractor's running statistics differ between devices, and
    its running statistics (and outputs, unless ``whole``) against its graph
    with BatchNorm's operator on the whole batch on one context in float64,
    beside that graph's own float32 distance from float64."""
    import warnings as warnings_
    from gluoncv import model_zoo
    from gluon_syncbn import convert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    if syncbn:
        build.update(norm_layer=SyncBatchNorm, norm_kwargs={'num_devices': len(sizes)})
    with warnings_.catch_warnings(record=True) as caught:
        warnings_.simplefilter('always')
        net = model_zoo.get_model(name, pretrained=False, pretrained_base=False, **build)
        if convert:
            convert_model(net, timeout=60)
        net.initialize(ctx=ctxs)
        feat = net.features
        with autograd.predict_mode():
            feat(mx.nd.zeros((1, 3, size, size), ctx=ctxs[0]))  # its own Parameters' shapes
        for param_name, p in sorted(feat.collect_params().items()):
            low, high = {'gamma': (0.5, 1.5), 'beta': (-0.5, 0.5), 'mean': (-0.5, 0.5),
                         'var': (0.5, 2.0)}.get(param_name.rsplit('_', 1)[-1], (None, None))
            if low is not None:
                p.set_data(mx.nd.array(rng.uniform(low, high, p.shape)))
        values = _values(feat.collect_params())
        target = net if whole else feat
        target.hybridize()
        x = (rng.randn(sum(sizes), 3, size, size) + 1e3).astype(np.float32)
        xs = [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, sizes), ctxs)]
        if whole:  # SSD's anchors, one for the batch, cannot take split head gradients
            with autograd.record():
                outs = [_as_list(target(a)) for a in xs]
            autograd.backward([o for out in outs for o in out])
        else:
            with autograd.predict_mode():
                shapes = [o.shape for o in _as_list(target(xs[0]))]
            dys = [split_batch(rng.randn(len(x), *shape[1:]), sizes) for shape in shapes]
            outs = _graph_step(target, xs, [[mx.nd.array(d[i], ctx=c) for d in dys]
                                            for i, c in enumerate(ctxs)])
        mx.nd.waitall()
    running = {n: p for n, p in feat.collect_params().items() if 'running' in n or 'moving' in n}
    result = {'warnings': [str(w.message) for w in caught
                           if 'gluon_syncbn' in str(w.message) or 'convert_model' in str(w.message)],
              'running': len(running), 'differ': sum(
                  not np.array_equal(p.data(ctxs[0]).asnumpy(), p.data(c).asnumpy())
                  for p in running.values() for c in ctxs[1:])}
    errs, twins, refs = WorstErrors(), {}, {}
    plain = _plain_graph(feat._cached_graph[1])
    for dtype in ('float64', 'float32'):
        twin = twins[dtype] = gluon.SymbolBlock(plain, mx.sym.var('data'))
        with warnings_.catch_warnings():
            warnings_.simplefilter('ignore')
            twin.collect_params().initialize(ctx=mx.cpu(0))
        twin.cast(dtype)
        for param_name, p in twin.collect_params().items():
            p.set_data(mx.nd.array(values[param_name], dtype=dtype))
        with autograd.record():
            ref = _as_list(twin(mx.nd.array(x, dtype=dtype)))
        # Its running statistics (nn.BatchNorm updates them in backward): what
        # the head gradients are does not matter.
        autograd.backward(ref, [mx.nd.ones_like(r) for r in ref])
        refs[dtype] = ([r.asnumpy() for r in ref],
                       {n: twin.collect_params()[n].data().asnumpy() for n in running})
    for dtype in ('float64', 'float32'):
        for k, r in enumerate(refs[dtype][0] if not whole else ()):
            errs.note(dtype + '_out', np.concatenate([o[k].asnumpy() for o in outs]), r)
        for param_name, p in running.items():
            for c in ctxs:
                errs.note(dtype + '_running', p.data(c).asnumpy(), refs[dtype][1][param_name])
    (out32, running32), (out64, running64) = refs['float32'], refs['float64']
    for a, b in zip(out32, out64) if not whole else ():
        errs.note('plain32_out', a, b)
    for param_name in running:
        errs.note('plain32_running', running32[param_name], running64[param_name])
    result.update(errs)
    return result
