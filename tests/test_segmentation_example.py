"""The segmentation example: metrics by hand, the VOC loader on a generated
folder, and a tiny training run (in a subprocess with a deadline)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, run_python

sys.path.insert(0, os.path.join(ROOT, 'examples', 'segmentation'))
from metrics import SegmentationMetric  # noqa: E402
from data import IGNORE_LABEL, SyntheticShapes, VOCSegmentation  # noqa: E402

TRAIN = os.path.join(ROOT, 'examples', 'segmentation', 'train.py')


def test_metric_against_hand_computed_confusion():
    label = np.array([[0, 0, 1, 1], [2, 2, 255, -1]])
    pred = np.array([[0, 1, 1, 1], [2, 0, 0, 2]])
    m = SegmentationMetric(3)
    m.update(label, pred)
    # rows = truth, cols = prediction; the 255 and -1 pixels are ignored
    assert m.confusion.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    pixacc, miou = m.get()
    assert pixacc == pytest.approx(4 / 6)
    # IoU: class0 1/(2+2-1)=1/3, class1 2/(2+3-2)=2/3, class2 1/(2+1-1)=1/2
    assert miou == pytest.approx((1 / 3 + 2 / 3 + 1 / 2) / 3)


def test_metric_accumulates_and_skips_absent_classes():
    m = SegmentationMetric(4)
    m.update(np.array([0, 1]), np.array([0, 1]))
    m.update(np.array([1, 255]), np.array([1, 3]))
    assert m.get() == (1.0, 1.0)  # classes 2 and 3 never appear in truth or prediction


def test_synthetic_data_is_deterministic_and_labelled():
    a, b = SyntheticShapes(4, 32, seed=3), SyntheticShapes(4, 32, seed=3)
    x1, y1 = a[2]
    x2, y2 = b[2]
    assert (x1 == x2).all() and (y1 == y2).all()
    assert x1.shape == (3, 32, 32) and y1.shape == (32, 32)
    assert set(np.unique(y1)) <= {0, 1, 2, 3, IGNORE_LABEL} and (y1 > 0).any()
    assert not (SyntheticShapes(4, 32, seed=4)[2][0] == x1).all()


def test_voc_loader_reads_the_voc_layout(tmp_path):
    from PIL import Image
    for sub in ('JPEGImages', 'SegmentationClass', 'ImageSets/Segmentation'):
        os.makedirs(str(tmp_path / sub))
    ids = ['2007_000001', '2007_000002']
    for i, name in enumerate(ids):
        Image.fromarray(np.full((20, 30, 3), 40 * i, np.uint8)).save(
            str(tmp_path / 'JPEGImages' / (name + '.jpg')))
        label = np.zeros((20, 30), np.uint8)
        label[5:15, 10:20] = 15 + i
        label[0, :] = 255
        img = Image.fromarray(label, mode='P')
        img.putpalette([0, 0, 0] * 256)
        img.save(str(tmp_path / 'SegmentationClass' / (name + '.png')))
    (tmp_path / 'ImageSets' / 'Segmentation' / 'train.txt').write_text('\n'.join(ids) + '\n')
    ds = VOCSegmentation(str(tmp_path), 'train', crop_size=16)
    assert len(ds) == 2 and ds.num_classes == 21
    image, label = ds[1]
    assert image.shape == (3, 16, 16) and label.shape == (16, 16)
    assert set(np.unique(label)) == {0, 16, 255}
    with pytest.raises(FileNotFoundError, match='VOC folder'):
        VOCSegmentation(str(tmp_path), 'missing')


def run_train(args, timeout=300):
    out = subprocess.run([sys.executable, TRAIN] + args, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tiny_training_run_learns_and_checkpoints_round_trip(tmp_path):
    save = str(tmp_path / 'run')
    common = ['--train-size', '32', '--val-size', '16', '--crop-size', '32',
              '--num-devices', '2', '--batch-size', '4', '--save-dir', save]
    result = run_train(common + ['--epochs', '3', '--aux'])
    assert result['loss'][-1] < result['loss'][0]
    for name in ('epoch_0003.params', 'epoch_0003.states', 'history.json', 'train.log',
                 'curves.png', 'predictions.png'):
        assert os.path.isfile(os.path.join(save, name)), name
    ckpt = os.path.join(save, 'epoch_0003.params')
    evaluated = run_train(common + ['--aux', '--eval', '--resume', ckpt])
    assert evaluated['miou'] == pytest.approx(result['miou'], abs=1e-9)
    resumed = run_train(common + ['--epochs', '4', '--aux', '--no-figures', '--resume',
                                  os.path.join(save, 'epoch_0002.params')])
    assert len(resumed['loss']) == 4   # epochs 3 and 4 appended to the saved history


def test_precise_bn_before_each_evaluation(tmp_path):
    """--precise-bn: the mIoU before it is kept, and the checkpoint holds the
    precise statistics (evaluating it gives the mIoU after)."""
    save = str(tmp_path / 'run')
    common = ['--train-size', '32', '--val-size', '16', '--crop-size', '32',
              '--num-devices', '2', '--batch-size', '4', '--save-dir', save, '--no-figures']
    result = run_train(common + ['--epochs', '2', '--precise-bn', '3'])
    assert len(result['precise_bn_seconds']) == 2, result
    assert 0 <= result['miou_before_precise_bn'] <= 1, result
    history = json.load(open(os.path.join(save, 'history.json')))
    assert len(history['miou_before_precise_bn']) == 2, history
    evaluated = run_train(common + ['--eval', '--resume', os.path.join(save, 'epoch_0002.params')])
    assert evaluated['miou'] == pytest.approx(result['miou'], abs=1e-9)


@pytest.mark.parametrize('module,package,flags', [
    ('matplotlib', 'matplotlib', []),
    ('tqdm', 'tqdm', ['--no-figures']),
])
def test_missing_dependency_stops_before_training(tmp_path, module, package, flags):
    # The package made unimportable the way a fresh environment would lack it.
    save = str(tmp_path / 'run')
    code = ('import runpy, sys; sys.modules[%r] = None; sys.argv = %r; '
            'runpy.run_path(%r, run_name="__main__")'
            % (module, [TRAIN, '--epochs', '1', '--save-dir', save] + flags, TRAIN))
    out = run_python(code)
    assert out.returncode != 0
    assert 'missing %s' % package in out.stderr, out.stderr[-2000:]
    assert 'pip install -e ".[examples]"' in out.stderr
    assert not os.path.exists(save)            # stopped before training or logging began
