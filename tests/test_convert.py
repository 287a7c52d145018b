"""convert_model / revert_model, checkpoints both ways, export without this
package, and model-zoo networks."""

import re
import warnings

import numpy as np
import pytest

import gluon_syncbn  # noqa: F401  (before MXNet runs an operator)
import mxnet as mx
from mxnet import gluon
from mxnet.gluon.model_zoo import vision

from gluon_syncbn import SyncBatchNorm, convert_model, revert_model, traced
from tests.conftest import (OPERATOR_PATHS, PATH_OPERATOR, PATHS, result_of, run_batch,
                            run_python, run_scenario)


class Custom(gluon.HybridBlock):
    """BN layers as an attribute, inside a list, and in a nested Sequential."""

    def __init__(self, **kwargs):
        super(Custom, self).__init__(**kwargs)
        with self.name_scope():
            self.conv = gluon.nn.Conv2D(4, 3, padding=1)
            self.bn = gluon.nn.BatchNorm(momentum=0.8, epsilon=1e-3, center=False)
            self.branches = [gluon.nn.BatchNorm(axis=1, scale=False) for _ in range(2)]
            for b in self.branches:
                self.register_child(b)
            self.seq = gluon.nn.HybridSequential()
            self.seq.add(gluon.nn.Conv2D(4, 1), gluon.contrib.nn.SyncBatchNorm(num_devices=1))

    def hybrid_forward(self, F, x):
        x = self.bn(self.conv(x))
        return self.seq(sum(b(x) for b in self.branches))


def layers(net, cls):
    found = []
    net.apply(lambda b: found.append(b) if type(b) is cls else None)
    return found


@pytest.mark.parametrize('frozen', [False, True])
def test_convert_reaches_every_kind_of_child_and_keeps_settings(frozen):
    net = Custom()
    net.initialize()
    if frozen:  # as GluonCV's fine-tuning freezes them
        net.collect_params('.*gamma|.*beta').setattr('grad_req', 'null')

    def attributes():
        return [(id(p), p.grad_req, p.lr_mult, p._differentiable, p.init)
                for p in net.collect_params().values()]
    kept = attributes()
    convert_model(net)
    assert attributes() == kept
    assert len(layers(net, SyncBatchNorm)) == 4
    assert not layers(net, gluon.nn.BatchNorm)
    assert isinstance(net.bn, SyncBatchNorm) and all(isinstance(b, SyncBatchNorm)
                                                      for b in net.branches)
    assert net.bn._kwargs['momentum'] == 0.8 and net.bn._kwargs['eps'] == 1e-3
    assert net.bn.beta.grad_req == 'null'             # center=False kept
    assert net.branches[0]._kwargs['fix_gamma'] is True  # scale=False kept
    revert_model(net)
    assert attributes() == kept and len(layers(net, gluon.nn.BatchNorm)) == 4


def test_checkpoints_move_both_ways_bit_exact(tmp_path):
    x = mx.nd.random.normal(shape=(2, 3, 8, 8))
    plain = Custom()
    plain.initialize(mx.init.Xavier())
    plain(x)  # finish deferred initialization
    for p in plain.collect_params().values():  # non-trivial running statistics
        p.set_data(mx.nd.random.uniform(0.5, 1.5, shape=p.shape))
    plain.save_parameters(str(tmp_path / 'plain.params'))
    synced = convert_model(Custom())
    synced.initialize()
    synced(x)
    synced.load_parameters(str(tmp_path / 'plain.params'))
    synced.save_parameters(str(tmp_path / 'synced.params'))
    back = Custom()
    back.initialize()
    back(x)
    back.load_parameters(str(tmp_path / 'synced.params'))
    for a, b, c in zip(plain.collect_params().values(), synced.collect_params().values(),
                       back.collect_params().values()):
        assert (a.data().asnumpy() == b.data().asnumpy()).all()
        assert (a.data().asnumpy() == c.data().asnumpy()).all()
    # inference output is the same layer maths
    want = plain(x).asnumpy()
    assert np.abs(synced(x).asnumpy() - want).max() < 1e-6 * np.abs(want).max()


def test_convert_keeps_initialized_values_and_resnet_inference():
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.normal(shape=(2, 3, 32, 32))
    before = net(x).asnumpy()
    convert_model(net)
    assert len(layers(net, SyncBatchNorm)) == 20
    assert np.abs(net(x).asnumpy() - before).max() < 1e-6 * np.abs(before).max()


@pytest.mark.parametrize('builder', [vision.resnet18_v2, vision.mobilenet0_25,
                                     vision.densenet121])
def test_model_zoo_models_convert_completely(builder):
    net = convert_model(builder())
    assert layers(net, SyncBatchNorm) and not layers(net, gluon.nn.BatchNorm)


def test_norm_layer_builder_convention():
    # GluonCV-style builders take norm_layer/norm_kwargs
    def block(channels, norm_layer=gluon.nn.BatchNorm, norm_kwargs=None):
        seq = gluon.nn.HybridSequential()
        seq.add(gluon.nn.Conv2D(channels, 3, padding=1), norm_layer(**(norm_kwargs or {})))
        return seq
    net = block(4, norm_layer=SyncBatchNorm, norm_kwargs={'num_devices': None, 'momentum': 0.5})
    net.initialize()
    assert isinstance(net[1], SyncBatchNorm) and net[1]._kwargs['momentum'] == 0.5


def _export_loads_in_plain_mxnet(net, x, tmp_path):
    """``net`` (reverted) exported: a fresh interpreter that never imports
    gluon_syncbn loads it and computes what ``net`` computed before."""
    expected = net(x).asnumpy()
    net.hybridize()
    net(x)
    net.export(str(tmp_path / 'model'))
    np.save(str(tmp_path / 'x.npy'), x.asnumpy())
    np.save(str(tmp_path / 'y.npy'), expected)
    code = ('import numpy as np, mxnet as mx, sys\n'
            'assert "gluon_syncbn" not in sys.modules\n'
            'net = mx.gluon.SymbolBlock.imports(r"{0}/model-symbol.json", ["data"], '
            'r"{0}/model-0000.params")\n'
            'y = net(mx.nd.array(np.load(r"{0}/x.npy"))).asnumpy()\n'
            'print("MAXDIFF", np.abs(y - np.load(r"{0}/y.npy")).max())\n').format(tmp_path)
    out = run_python(code, env={'PYTHONPATH': ''}, cwd=str(tmp_path))
    line = [l for l in out.stdout.splitlines() if l.startswith('MAXDIFF')]
    assert line, out.stderr[-2000:]
    assert float(line[0].split()[1]) < 1e-5
    assert 'gluon_syncbn' not in open(str(tmp_path / 'model-symbol.json')).read()


def test_revert_then_export_loads_in_plain_mxnet(tmp_path):
    net = convert_model(vision.resnet18_v1(classes=10))
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.normal(shape=(1, 3, 32, 32))
    expected = net(x).asnumpy()
    revert_model(net)
    assert not layers(net, SyncBatchNorm)
    assert np.abs(net(x).asnumpy() - expected).max() == 0
    _export_loads_in_plain_mxnet(net, x, tmp_path)


def test_syncbatchnorm_is_an_nn_batchnorm():
    """What a loop reads of an nn.BatchNorm reads the same on ours; the two
    stay apart where it matters."""
    ours, theirs = SyncBatchNorm(in_channels=3, momentum=0.8, scale=False), \
        gluon.nn.BatchNorm(in_channels=3, momentum=0.8, scale=False)
    assert isinstance(ours, gluon.nn.BatchNorm) and ours.name.startswith('syncbatchnorm')
    assert ours._kwargs == theirs._kwargs
    for name in ('gamma', 'beta', 'running_mean', 'running_var'):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a.shape, a.grad_req, a._differentiable) == (b.shape, b.grad_req, b._differentiable)
    for layer in (ours, theirs):
        layer.initialize()
        layer.cast('float16')
    assert np.dtype(ours.gamma.dtype) == np.dtype(theirs.gamma.dtype) == np.float32
    net = gluon.nn.HybridSequential()
    net.add(SyncBatchNorm(), gluon.nn.BatchNorm())
    convert_model(net)
    assert len(layers(net, SyncBatchNorm)) == 2  # the first left as it was
    revert_model(net)
    assert len(layers(net, gluon.nn.BatchNorm)) == 2


class _OwnBatchNorm(gluon.nn.BatchNorm):
    """A user's subclass: convert_model does not know what it adds."""


def test_batchnorm_relu_converts_and_reverts_and_unknown_ones_are_named(tmp_path):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3), gluon.nn.BatchNormReLU(), gluon.nn.Conv2D(4, 3),
            _OwnBatchNorm())
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.normal(shape=(2, 3, 9, 9))
    expected = net(x).asnumpy()
    params = [id(p) for p in net.collect_params().values()]
    with pytest.warns(RuntimeWarning) as caught:
        convert_model(net)
    assert isinstance(net[1], SyncBatchNorm) and type(net[3]) is _OwnBatchNorm
    assert [id(p) for p in net.collect_params().values()] == params
    assert np.abs(net(x).asnumpy() - expected).max() == 0  # ReLU included
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "'%s' (tests.test_convert._OwnBatchNorm)" % net[3].name \
        in messages[0] and 'normalizes each device\'s slice alone' in messages[0], messages
    revert_model(net)
    assert type(net[1]) is gluon.nn.BatchNormReLU
    _export_loads_in_plain_mxnet(net, x, tmp_path)
    # The imported graph's BatchNorm nodes (nn.BatchNormReLU's fused one
    # too) are marked, each with a layer of its own; revert_model unmarks.
    loaded = gluon.SymbolBlock.imports(str(tmp_path / 'model-symbol.json'), ['data'],
                                       str(tmp_path / 'model-0000.params'))
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        convert_model(loaded)
    assert len(loaded._gluon_syncbn_shadows) == 2
    assert traced.has_marks(loaded._cached_graph[1])
    assert np.abs(loaded(x).asnumpy() - expected).max() < 1e-5 * np.abs(expected).max()
    revert_model(loaded)
    assert not traced.has_marks(loaded._cached_graph[1])


def test_symbol_blocks_nodes_it_cannot_synchronize_are_named():
    """contrib's SyncBatchNorm nodes in a SymbolBlock's graph (a traced
    layer's, and the operator's as GluonCV's FPN calls it) become marked
    BatchNorm nodes, predicting as before; a BatchNorm_v1 node stays, with
    one warning naming it; a SymbolBlock inside a hybridized network is
    converted there, and the network's graph traced again."""
    plain = gluon.nn.HybridSequential(prefix='contrib_')
    with plain.name_scope():
        plain.add(gluon.contrib.nn.SyncBatchNorm(num_devices=1, in_channels=3))
    data = mx.sym.var('data')
    node = mx.sym.contrib.SyncBatchNorm(plain(data), name='P2_bn', key='P2_bn', ndev=2)
    block = gluon.SymbolBlock(mx.sym.BatchNorm_v1(node, name='v1'), data,
                              params=plain.collect_params())
    block.initialize()
    x = mx.nd.random.normal(shape=(2, 3, 4, 4))
    block.collect_params('.*var').setattr('init', 'ones')
    block.collect_params('.*var').initialize(force_reinit=True)
    expected = block(x).asnumpy()
    with pytest.warns(RuntimeWarning) as caught:
        convert_model(block)
    assert [str(w.message) for w in caught] == [
        "convert_model: '%s' is a SymbolBlock whose graph holds batch-norm operator(s) it "
        "cannot synchronize ('v1': BatchNorm_v1, or statistics that are no Parameters of the "
        "block): they stay as they are and normalize each device's slice alone. Build the "
        "network in Python (its Gluon model) and convert that." % block.name]
    nodes = [n for n in traced.graph_of(block._cached_graph[1])['nodes'] if n['op'] != 'null']
    assert [(n['op'], traced.MARK in n.get('attrs', {})) for n in nodes] == [
        ('BatchNorm', True), ('BatchNorm', True), ('BatchNorm_v1', False)], nodes
    assert not {'ndev', 'key'} & (set(nodes[0]['attrs']) | set(nodes[1]['attrs'])), nodes
    assert np.abs(block(x).asnumpy() - expected).max() <= 1e-6 * np.abs(expected).max()
    backbone = gluon.nn.HybridSequential(prefix='bb_')
    with backbone.name_scope():
        backbone.add(gluon.nn.Conv2D(3, 1, in_channels=3), gluon.nn.BatchNorm(in_channels=3))
    backbone.initialize()
    outer = gluon.nn.HybridSequential()
    outer.add(gluon.SymbolBlock(backbone(data), data, params=backbone.collect_params()))
    outer.hybridize()
    x = mx.nd.random.normal(shape=(2, 3, 4, 4))
    expected = outer(x).asnumpy()
    assert not traced.has_marks(outer._cached_graph[1])
    convert_model(outer)
    assert np.abs(outer(x).asnumpy() - expected).max() == 0
    assert traced.has_marks(outer._cached_graph[1])  # traced again, with the marks


@pytest.mark.parametrize('path', ['async', 'exchange', 'exchange-device'])
def test_copies_pickles_fixed_gamma_and_second_order_gradients_as_nn_batchnorm(path):
    """copy.deepcopy and pickle of a network (a copy trains on its own,
    beside the original, both exact); gamma with scale=False stored as
    nn.BatchNorm stores it; a second-order gradient refused naming the
    layers, the next step exact. Imperative and hybridized."""
    results = run_batch([('drop_in', dict(hybridize=h)) for h in (False, True)],
                        env=PATHS[path])
    for hybridize in (False, True):
        r = result_of(results, int(hybridize))
        assert r['operator'] == PATH_OPERATOR[path] and r['is_batchnorm'], r
        for key in ('original', 'copy_predicts', 'pickled_predicts', 'interleaved',
                    'original_running', 'copy_running', 'after'):
            assert r[key] < 2e-6, (key, r)
        assert r['gammas'] == [[1.0, 1.0, 1.0]] * 2, r
        assert r['second_type'] == 'SyncBatchNormError', r
        assert re.match(r"SyncBatchNorm '_bnstack\d_syncbatchnorm0', '_bnstack\d_syncbatchnorm1'"
                        r".* does not support higher-order gradients", r['second']), r
        assert 'hybridize' not in r['second'], r
        if hybridize:
            assert re.match(r"'_bnstack\d' is hybridized and has run: its cached graph",
                            r['refused']), r


def test_converted_resnet18_trains_on_two_contexts():
    r = run_scenario('resnet18_converted', timeout=300)
    assert r['num_syncbn'] == 20
    assert r['finite'] == 1.0
    assert r['replicas_identical'] == 1.0


def test_networks_with_equal_prefixes_do_not_share_meetings():
    r = run_scenario('same_prefix_networks', timeout=120)
    assert r['same_names'] == 1.0
    assert r['max_err'] < 1e-5


def test_convert_model_passes_sync_groups_to_every_layer():
    net = convert_model(vision.resnet18_v1(), sync_groups=[[0, 2], [1, 3]])
    found = layers(net, SyncBatchNorm)
    assert len(found) == 20 and all(b._sync_groups == ((0, 2), (1, 3)) for b in found)


# export(), SymbolBlock.imports, convert_model (scenarios.convert.export_and_import):
# a converted network (relu: its last norm layer nn.BatchNormReLU) trained
# on 3 contexts, exported after a training step and after a predict call.
EXPORTS = [dict(hybridize=True), dict(hybridize='static'), dict(hybridize=True, relu=True)]
EXPORT_IDS = ['hybridized', 'static_shape', 'hybridized-batchnormrelu']


# Fine-tuning's frozen gamma and beta (scenarios.convert.frozen_network), in
# the same processes: frozen before conversion or after it (then reverted
# and converted again).
FROZEN = [dict(freeze='before', hybridize=False), dict(freeze='before', hybridize='static'),
          dict(freeze='after', hybridize=True)]
FROZEN_IDS = ['before-imperative', 'before-static_shape', 'after-hybridized']


@pytest.fixture(scope='module', params=OPERATOR_PATHS)
def exported(request, tmp_path_factory):
    folders = [str(tmp_path_factory.mktemp('export')) for _ in EXPORTS]
    batch = run_batch([('export_and_import', dict(case, export_to=folder))
                       for case, folder in zip(EXPORTS, folders)] +
                      [('frozen_network', case) for case in FROZEN], timeout=300,
                      env=PATHS[request.param])
    return request.param, batch, folders


@pytest.mark.parametrize('case', EXPORTS, ids=EXPORT_IDS)
def test_export_writes_nn_batchnorms_graph_whatever_the_last_call(exported, case):
    """After a training step and after a predict call: the symbol file
    nn.BatchNorm's network writes, with training-mode arguments; a process
    without gluon_syncbn loads it and predicts as the network did."""
    path, batch, folders = exported
    r = result_of(batch, EXPORTS.index(case))
    assert r['operator'] == PATH_OPERATOR[path], r
    for when in ('training', 'predict'):
        assert r[when + '_equal'], r
        assert r[when + '_global_stats'] == ['False'], r
        assert not [op for op in r[when + '_nodes'] if 'gluon_syncbn' in op], r
    code = ('import sys, numpy as np, mxnet as mx\n'
            'want = np.load("y.npy")\n'
            'for when in ("training", "predict"):\n'
            '    net = mx.gluon.SymbolBlock.imports("ours-%s-symbol.json" % when, ["data"], '
            '"ours-%s-0000.params" % when)\n'
            '    out = net(mx.nd.array(np.load("x.npy"))).asnumpy()\n'
            '    print("LOADED", when, "gluon_syncbn" in sys.modules, '
            'np.abs(out - want).max() / np.abs(want).max())\n')
    out = run_python(code, env={'PYTHONPATH': ''}, cwd=folders[EXPORTS.index(case)])
    lines = [l.split() for l in out.stdout.splitlines() if l.startswith('LOADED')]
    assert len(lines) == 2, out.stderr[-2000:]
    for _, _, loaded, err in lines:
        assert loaded == 'False' and float(err) < 1e-6, lines


@pytest.mark.parametrize('case', EXPORTS, ids=EXPORT_IDS)
def test_an_imported_export_converts_and_trains_synchronized(exported, case):
    """SymbolBlock.imports of the export, then convert_model: its 3
    BatchNorm nodes synchronize on 3 contexts, two steps as the imported
    graph on the whole batch in float64 (outputs, every gradient, every
    device's running statistics); exported again it is the file imported,
    and revert_model leaves no mark."""
    path, batch, _ = exported
    r = result_of(batch, EXPORTS.index(case))
    assert r['shadows'] == 3 and r['imported_operator'] == [PATH_OPERATOR[path]], r
    for key in ('imported_out', 'imported_grad', 'imported_running'):
        assert r[key] < 1e-5, (key, r)
    assert r['export_is_the_import'] and not r['reverted_marks'], r


@pytest.mark.parametrize('case', FROZEN, ids=FROZEN_IDS)
def test_a_frozen_network_converts_keeping_its_parameters_and_trains_exactly(exported, case):
    """convert_model and revert_model keep every Parameter, the object and
    its grad_req, lr_mult, wd_mult, differentiable and init; the converted
    network trains on 3 contexts as nn.BatchNorm's on the whole batch in
    float64 (outputs, gradients, running statistics, the Trainer's update),
    its frozen gamma and beta as they were."""
    path, batch, _ = exported
    r = result_of(batch, len(EXPORTS) + FROZEN.index(case))
    assert r['operator'] == PATH_OPERATOR[path] and r['layers'] == 3, r
    assert r['kept'] and r['frozen_unchanged'], r
    for key in ('step_out', 'step_grad', 'step_running', 'param'):
        assert r[key] < 1e-5, (key, r)


# What a backward raises (scenarios.convert.backward_errors), in every mode.
BACKWARD_MODES = [False, True, 'static']


@pytest.fixture(scope='module', params=OPERATOR_PATHS)
def backward(request):
    return request.param, run_batch([('backward_errors', dict(hybridize=m))
                                     for m in BACKWARD_MODES], timeout=200,
                                    env=PATHS[request.param])


@pytest.mark.parametrize('mode', BACKWARD_MODES, ids=['imperative', 'hybridized', 'static'])
def test_a_backward_error_names_our_layer_only_where_it_is_the_cause(backward, mode):
    """A step run without autograd.record(), then backward: MXNet's own
    error; a higher-order gradient through another hybridized network:
    MXNet's; through ours: ours, naming the layers; the next step exact."""
    path, batch = backward
    r = result_of(batch, BACKWARD_MODES.index(mode))
    assert r['operator'] == PATH_OPERATOR[path], r
    assert r['unrecorded_type'] == 'MXNetError', r
    assert 'Cannot differentiate node because it is not in a computational graph' \
        in r['unrecorded'] and 'SyncBatchNorm' not in r['unrecorded'], r
    assert r['other_type'] == 'MXNetError', r
    assert 'CachedOp does not support higher order gradients' in r['other'] \
        and 'SyncBatchNorm' not in r['other'], r
    assert r['ours_type'] == 'SyncBatchNormError', r
    assert re.match(r"SyncBatchNorm '_bnstack\d_syncbatchnorm0', '_bnstack\d_syncbatchnorm1'"
                    r".* does not support higher-order gradients", r['ours']), r
    assert r['after'] < 2e-6, r


# Graphs whose layers would run per device (scenarios.convert.refused_graph): each
# refused at once, the message naming the layers or nodes and the way that
# works.
REFUSED = {
    'cached_op': r"SyncBatchNorm layer\(s\) '_bnstack\d+_syncbatchnorm0', "
                 r"'_bnstack\d+_syncbatchnorm1' synchronize over 2 devices, but a CachedOp "
                 r".*mx.nd.CachedOp.* Call the network",
    'optimize_for': r"'_bnstack\d+_syncbatchnorm0', '_bnstack\d+_syncbatchnorm1' synchronize "
                    r"over 2 devices, .*HybridBlock.optimize_for",
    'module': r"mx.mod.Module: SyncBatchNorm node\(s\) '_bnstack\d+_syncbatchnorm0_fwd', "
              r"'_bnstack\d+_syncbatchnorm1_fwd' cannot synchronize in a Module on 2 "
              r"contexts.* Train the network with Gluon",
    'backend': r"'_bnstack\d+': SyncBatchNorm layer\(s\) .* would run in a graph partitioned "
               r"for backend 'MKLDNN', .*Hybridize without a backend",
    'foreach': r"'_foreachnet\d+': SyncBatchNorm layer\(s\) '_foreachnet\d+_syncbatchnorm0' "
               r"would run inside a control-flow operator's subgraph.* Call them outside",
    'computed_gamma': r"'symbolblock\d+': SyncBatchNorm layer\(s\) "
                      r"'_bnstack\d+_syncbatchnorm0' would run on gamma, beta or running "
                      r"statistics that are no Parameters.* params=net.collect_params\(\)",
    'empty_slice': r"'symbolblock\d+' got an empty slice on cpu\(1\).*\(a SymbolBlock\)\. Feed "
                   r"every device at least one sample",
    'precise_one_device': r"update_bn_stats: 'symbolblock\d+' is a SymbolBlock, .* do not "
                          r"synchronize .* on several devices",
    'precise_plain': r"update_bn_stats: 'symbolblock\d+' is a SymbolBlock whose graph holds "
                     r"BatchNorm operator\(s\) .* of no SyncBatchNorm layer.*convert_model",
}


# SyncBatchNorm beside batch-norm layers that normalize per device
# (scenarios.convert.mixed_network), in the same processes.
MIXED = [dict(hybridize=False), dict(hybridize='static'),
         dict(hybridize=True, keep='mixed_plain|node_bn')]
MIXED_IDS = ['imperative', 'static_shape', 'hybridized-kept']


@pytest.fixture(scope='module', params=OPERATOR_PATHS)
def refused(request):
    return run_batch([('refused_graph', dict(case=c)) for c in REFUSED] +
                     [('mixed_network', case) for case in MIXED], timeout=200,
                     env=PATHS[request.param])


@pytest.mark.parametrize('case', list(REFUSED))
def test_a_graph_that_cannot_synchronize_is_refused_at_once(refused, case):
    r = result_of(refused, list(REFUSED).index(case))
    assert r['type'] == 'SyncBatchNormError', r
    assert re.search(REFUSED[case], r['message']), r
    assert r['seconds'] < 5, r  # no device waited for the layers' 30 s timeout


@pytest.mark.parametrize('case', MIXED, ids=MIXED_IDS)
def test_layers_left_per_device_are_named_once_at_the_first_training_step(refused, case):
    """A network on 2 contexts whose SyncBatchNorm layers synchronize beside
    layers that normalize per device: one warning, at its first training
    step (not at a predict call before), naming them (not the one using
    global statistics) and the fix; none where convert_model converted the
    others and kept those named by keep=, which stay per device."""
    r = result_of(refused, len(REFUSED) + MIXED.index(case))
    if case.get('keep'):
        assert r['warnings'] == [] and r['differ'] == ['mixed_plain', 'node_bn'], r
        return
    assert r['when'] == ['step 0'], r
    assert re.match(r"gluon_syncbn: 'mixed' trains with SyncBatchNorm layers synchronizing 2 "
                    r"devices, but its batch-norm layer\(s\) 'mixed_plain', 'mixed_contrib', "
                    r"'node_bn' \(of SymbolBlock 'symbolblock\d+'\) normalize each device's slice "
                    r"alone\. gluon_syncbn\.convert_model\(net\) synchronizes them \(or names "
                    r"those it cannot\); to keep some per device on purpose, "
                    r"convert_model\(net, keep='<a regular expression matching their names>'\)\.$",
                    r['warnings'][0]), r
    assert r['differ'] == ['mixed_contrib', 'mixed_plain', 'node_bn'], r


def test_what_normalizes_per_device_beside_synchronized_layers():
    """Named: nn.BatchNorm, a user's subclass, contrib's layer or node for
    another number of devices, a SymbolBlock's BatchNorm node; not: ours,
    layers and nodes using global statistics, contrib's for as many devices
    as ours synchronize."""
    from gluon_syncbn.graphs import per_device_batchnorms
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(SyncBatchNorm(), gluon.nn.BatchNorm(), _OwnBatchNorm(),
                gluon.nn.BatchNorm(use_global_stats=True),
                gluon.contrib.nn.SyncBatchNorm(num_devices=2),
                gluon.contrib.nn.SyncBatchNorm(num_devices=4))
    data = mx.sym.var('data')
    net.add(gluon.SymbolBlock([mx.sym.BatchNorm(data, name='bn'),
                               mx.sym.BatchNorm(data, name='global', use_global_stats=True),
                               mx.sym.contrib.SyncBatchNorm(data, name='contrib2', key='2', ndev=2),
                               mx.sym.contrib.SyncBatchNorm(data, name='contrib1', key='1')], data))
    assert per_device_batchnorms(net, 2) == ["'%s'" % net[i].name for i in (1, 2, 5)] + [
        "'bn', 'contrib1' (of SymbolBlock '%s')" % net[6].name]
