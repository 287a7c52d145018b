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
from tests.conftest import (PATH_OPERATOR, PATHS, result_of, run_batch, run_python,
                            run_scenario)


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


def test_convert_reaches_every_kind_of_child_and_keeps_settings():
    net = Custom()
    net.initialize()
    convert_model(net)
    assert len(layers(net, SyncBatchNorm)) == 4
    assert not layers(net, gluon.nn.BatchNorm)
    assert isinstance(net.bn, SyncBatchNorm) and all(isinstance(b, SyncBatchNorm)
                                                      for b in net.branches)
    assert net.bn._kwargs['momentum'] == 0.8 and net.bn._kwargs['eps'] == 1e-3
    assert net.bn.beta.grad_req == 'null'             # center=False kept
    assert net.branches[0]._kwargs['fix_gamma'] is True  # scale=False kept


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
    """contrib's SyncBatchNorm in a SymbolBlock's graph stays, with one
    warning naming its node; a SymbolBlock inside a hybridized network is
    converted there, and the network's graph traced again."""
    plain = gluon.nn.HybridSequential(prefix='contrib_')
    with plain.name_scope():
        plain.add(gluon.contrib.nn.SyncBatchNorm(num_devices=1, in_channels=3))
    data = mx.sym.var('data')
    block = gluon.SymbolBlock(plain(data), data, params=plain.collect_params())
    with pytest.warns(RuntimeWarning, match="'%s' is a SymbolBlock whose graph holds "
                                            "batch-norm operator.* it cannot synchronize "
                                            "\\('contrib_syncbatchnorm0_fwd'" % block.name):
        convert_model(block)
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


def test_networks_with_equal_prefixes_do_not_share_barriers():
    r = run_scenario('same_prefix_networks', timeout=120)
    assert r['same_names'] == 1.0
    assert r['max_err'] < 1e-5


def test_convert_model_passes_sync_groups_to_every_layer():
    net = convert_model(vision.resnet18_v1(), sync_groups=[[0, 2], [1, 3]])
    found = layers(net, SyncBatchNorm)
    assert len(found) == 20 and all(b._sync_groups == ((0, 2), (1, 3)) for b in found)
