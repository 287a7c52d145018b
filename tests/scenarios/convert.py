"""convert_model and what users' code does with a BatchNorm besides
calling it: drop-in use, model-zoo networks, export() and SymbolBlock.imports,
what a backward raises, graphs refused (tests/test_convert.py).
"""
import json
import os

import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors, batchnorm_float64, max_rel_err, worst
from tests.scenarios import (_BNStack, _blocks, _capture, _compare_step, _graph_step, _hybridize,
                             _ready, _set_weights, _step, _two_layers_float64, _values, contexts,
                             scenario, split_batch)


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
    hybridized network that has run (the error; after hybridize(False) a
    copy and a pickle that predict as it does), gamma after a training
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
    if hybridize:  # without its CachedOp a network copies and pickles again
        net.hybridize(False)
        errs.note('unhybridized_copy', copy.deepcopy(net)(probe).asnumpy(), net(probe).asnumpy())
        errs.note('unhybridized_pickle', pickle.loads(pickle.dumps(net))(probe).asnumpy(),
                  net(probe).asnumpy())
    return dict(errs, refused=refused, gammas=gammas, second=second, second_type=second_type,
                is_batchnorm=isinstance(net.bn1, gluon.nn.BatchNorm),
                operator=net.bn1._sync_backend.name)


@scenario
def pickle_network(path, hybridize=True):
    """Two layers (a _BNStack) on two contexts, hybridized as ``hybridize``
    says and never called, pickled to ``path``."""
    import pickle
    net = _ready(_BNStack(30.0), contexts(2), hybridize)
    with open(path, 'wb') as f:
        pickle.dump(net, f)
    return {}


@scenario
def unpickled_network(path, seed=0):
    """A hybridized nn.BatchNorm network called (nothing of ours binds its
    graph: this process has made no layer), then the network
    ``pickle_network`` wrote, unpickled before this process makes a layer of
    its own, trained for a step on two contexts (split 1 + 3) on data 1e3
    from zero: output and every device's running statistics against
    float64 maths on the whole batch."""
    import pickle
    rng = np.random.RandomState(seed)
    ctxs = contexts(2)
    plain = gluon.nn.HybridSequential()
    plain.add(gluon.nn.Conv2D(3, 1), gluon.nn.BatchNorm())
    plain.initialize(ctx=ctxs[0])
    plain.hybridize()
    plain(mx.nd.ones((2, 3, 4, 4), ctx=ctxs[0])).asnumpy()
    made_before = SyncBatchNorm.made_any
    with open(path, 'rb') as f:
        net = pickle.load(f)
    net.collect_params().reset_ctx(ctxs)  # gradients attached
    x = (rng.randn(4, 3, 4, 4) + 1e3).astype(np.float32)
    with autograd.record():
        ys = [net(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, [1, 3]), ctxs)]
    autograd.backward(ys)
    y64, batch = _two_layers_float64(x)
    errs = WorstErrors()
    errs.note('output', np.concatenate([y.asnumpy() for y in ys]), y64)
    for bn, (mean, var) in zip((net.bn1, net.bn2), batch):
        for c in ctxs:
            errs.note('running', bn.running_mean.data(c).asnumpy(), 0.1 * mean)
            errs.note('running', bn.running_var.data(c).asnumpy(), 0.9 + 0.1 * var)
    return dict(errs, made_before=made_before, hybridized=bool(net._active),
                plain_bound='_gluon_syncbn_graphs' in plain.__dict__,
                bound='_gluon_syncbn_graphs' in net.__dict__)


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


# What a fine-tuning script freezes (GluonCV's: gamma and beta), but the
# input layer's: nn.BatchNorm on CPU updates its running statistics in
# backward, which MXNet skips for a layer nothing before needs a gradient
# of, so the reference would keep that layer's as they were.
FROZEN = 'net_batchnorm[12]_(gamma|beta)'


def _parameter_attributes(net):
    """Each Parameter of ``net``, the object and what the Trainer and
    initialization read of it."""
    return [(name, id(p), p.grad_req, p.lr_mult, p.wd_mult, p._differentiable, str(p.init))
            for name, p in net.collect_params().items()]


@scenario
def frozen_network(freeze='before', hybridize=True, sizes=(3, 2, 2), seed=0):
    """A network whose BatchNorm gamma and beta are frozen (``grad_req``
    'null', as GluonCV's fine-tuning freezes them), ``'before'`` conversion
    (after a first call, hybridized as ``hybridize``) or ``'after'`` it
    (then reverted and converted again), with other Parameters' ``lr_mult``
    and ``wd_mult`` set: whether every Parameter is the object it was with
    its attributes, and two training steps (Trainer included) on
    len(sizes) contexts against the same network with nn.BatchNorm on the
    whole batch in float64, data 1e3 from zero."""
    from gluon_syncbn import convert_model, revert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    net = _export_net(gluon.nn.BatchNorm, gluon.nn.BatchNorm)
    net.initialize(ctx=ctxs)
    _set_weights(net, rng)
    net.collect_params('.*conv0_weight').setattr('lr_mult', 0.5)
    net.collect_params('.*dense0_weight').setattr('wd_mult', 0.0)
    net.collect_params('.*batchnorm0_gamma').setattr('init', mx.init.Constant(2.0))
    _hybridize(net, hybridize)
    if freeze == 'before':
        net.collect_params(FROZEN).setattr('grad_req', 'null')
        with autograd.predict_mode():
            net(mx.nd.ones((1, 3, 6, 6), ctx=ctxs[0]))
        before = _parameter_attributes(net)
        convert_model(net, timeout=60)
    else:
        convert_model(net, timeout=60)
        net.collect_params(FROZEN).setattr('grad_req', 'null')
        before = _parameter_attributes(net)
        revert_model(net)
        convert_model(net, timeout=60)
    result = {'kept': _parameter_attributes(net) == before,
              'layers': sum(isinstance(b, SyncBatchNorm) for b in _blocks(net))}
    twin = _export_net(gluon.nn.BatchNorm, gluon.nn.BatchNorm)
    twin.initialize(ctx=mx.cpu(0))
    twin.cast('float64')
    for name, value in _values(net.collect_params()).items():
        twin.collect_params()[name].set_data(mx.nd.array(value, dtype='float64'))
    for name, p in net.collect_params().items():
        twin.collect_params()[name].grad_req = p.grad_req
        twin.collect_params()[name].lr_mult, twin.collect_params()[name].wd_mult = \
            p.lr_mult, p.wd_mult
    _hybridize(net, hybridize)
    _hybridize(twin, hybridize)
    frozen = {n: v for n, v in _values(net.collect_params(FROZEN)).items()}
    trainers = [gluon.Trainer(n.collect_params(), 'sgd', {'learning_rate': 0.1, 'wd': 1e-3})
                for n in (net, twin)]
    errs = WorstErrors()
    for _ in range(2):
        x = (rng.randn(sum(sizes), 3, 6, 6) + 1e3).astype(np.float32)
        _compare_step(errs, 'step', net, twin, x, sizes, ctxs, rng)
        for trainer in trainers:
            trainer.step(sum(sizes))
        for name, p in net.collect_params().items():
            for c in ctxs:
                errs.note('param', p.data(c).asnumpy(), twin.collect_params()[name].data().asnumpy())
    result['frozen_unchanged'] = all((_values(net.collect_params(FROZEN))[n] == v).all()
                                     for n, v in frozen.items())
    result['operator'] = net[0]._sync_backend.name
    result.update(errs)
    return result


def _mixed_network():
    """SyncBatchNorm beside batch-norm layers that normalize per device:
    nn.BatchNorm, contrib's layer for 1 device, a SymbolBlock's BatchNorm
    node, and one that does not normalize over the batch (global
    statistics)."""
    net = gluon.nn.HybridSequential(prefix='mixed_')
    with net.name_scope():
        net.add(SyncBatchNorm(in_channels=3, timeout=60, prefix='sync_'),
                gluon.nn.BatchNorm(in_channels=3, prefix='plain_'),
                gluon.nn.BatchNorm(in_channels=3, use_global_stats=True, prefix='global_'),
                gluon.contrib.nn.SyncBatchNorm(in_channels=3, num_devices=1, prefix='contrib_'))
    data = mx.sym.var('data')
    net.add(gluon.SymbolBlock(mx.sym.BatchNorm(data, name='node_bn', fix_gamma=False), data))
    return net


@scenario
def mixed_network(hybridize=False, keep=None, seed=0):
    """:func:`_mixed_network` on 2 contexts, ``convert_model(net, keep=keep)``
    first where ``keep`` is given, two training steps: gluon_syncbn's
    warnings and when they came, and the layers whose running statistics
    differ between the devices."""
    import warnings as warnings_
    from gluon_syncbn import convert_model
    rng = np.random.RandomState(seed)
    ctxs = contexts(2)
    net = _mixed_network()
    with warnings_.catch_warnings(record=True) as caught:
        warnings_.simplefilter('always')
        if keep:
            convert_model(net, timeout=60, keep=keep)
        net.initialize(ctx=ctxs)
        _hybridize(net, hybridize)
        with autograd.predict_mode():
            net(mx.nd.ones((1, 3, 2, 2), ctx=ctxs[0]))
        when = ['predict'] * len(caught)
        for step in range(2):
            x = (rng.randn(4, 3, 2, 2) + 1e3).astype(np.float32)
            _step(net, [mx.nd.array(p, ctx=c) for p, c in zip(split_batch(x, [1, 3]), ctxs)])
            when += ['step %d' % step] * (len(caught) - len(when))
    mine = [(w, str(c.message)) for w, c in zip(when, caught) if 'gluon_syncbn' in str(c.message)
            or 'convert_model' in str(c.message)]
    return {'warnings': [m for _, m in mine], 'when': [w for w, _ in mine],
            'differ': sorted(n.rsplit('_', 2)[0] for n, p in net.collect_params().items()
                             if n.endswith('running_mean') or n.endswith('moving_mean')
                             if not np.array_equal(p.data(ctxs[0]).asnumpy(),
                                                   p.data(ctxs[1]).asnumpy()))}


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
