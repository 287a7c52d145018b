"""convert_model / revert_model, checkpoints both ways, export without this
package, and model-zoo networks."""

import numpy as np
import pytest

import gluon_syncbn  # noqa: F401  (before MXNet runs an operator)
import mxnet as mx
from mxnet import gluon
from mxnet.gluon.model_zoo import vision

from gluon_syncbn import SyncBatchNorm, convert_model, revert_model
from tests.conftest import run_python, run_scenario


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


def test_revert_then_export_loads_in_plain_mxnet(tmp_path):
    net = convert_model(vision.resnet18_v1(classes=10))
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.normal(shape=(1, 3, 32, 32))
    expected = net(x).asnumpy()
    revert_model(net)
    assert not layers(net, SyncBatchNorm)
    net.hybridize()
    net(x)
    net.export(str(tmp_path / 'model'))
    np.save(str(tmp_path / 'x.npy'), x.asnumpy())
    np.save(str(tmp_path / 'y.npy'), expected)
    # a fresh interpreter that never imports gluon_syncbn
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
