"""The segmentation example: metrics by hand, the VOC loader on a generated
folder, a tiny training run (in a subprocess with a deadline), and bad flags
stopped before anything is written."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

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


def test_metric_refuses_a_score_over_no_pixels():
    m = SegmentationMetric(4)
    m.update(np.array([255, -1]), np.array([0, 1]))
    with pytest.raises(ValueError, match='no labelled pixel'):
        m.get()


def test_synthetic_data_is_deterministic_and_labelled():
    a, b = SyntheticShapes(4, 32, seed=3), SyntheticShapes(4, 32, seed=3)
    x1, y1 = a[2]
    x2, y2 = b[2]
    assert (x1 == x2).all() and (y1 == y2).all()
    assert x1.shape == (3, 32, 32) and y1.shape == (32, 32)
    assert set(np.unique(y1)) <= {0, 1, 2, 3, IGNORE_LABEL} and (y1 > 0).any()
    assert not (SyntheticShapes(4, 32, seed=4)[2][0] == x1).all()


def make_voc(root, splits):
    """A VOC folder: ``splits`` maps a list name to its image ids."""
    from PIL import Image
    for sub in ('JPEGImages', 'SegmentationClass', 'ImageSets/Segmentation'):
        os.makedirs(str(root / sub), exist_ok=True)
    for split, ids in splits.items():
        for i, name in enumerate(ids):
            Image.fromarray(np.full((20, 30, 3), 40 * i, np.uint8)).save(
                str(root / 'JPEGImages' / (name + '.jpg')))
            label = np.zeros((20, 30), np.uint8)
            label[5:15, 10:20] = 15 + i
            label[0, :] = 255
            img = Image.fromarray(label, mode='P')
            img.putpalette([0, 0, 0] * 256)
            img.save(str(root / 'SegmentationClass' / (name + '.png')))
        (root / 'ImageSets' / 'Segmentation' / (split + '.txt')).write_text(
            '\n'.join(ids) + '\n')


def test_voc_loader_reads_the_voc_layout(tmp_path):
    make_voc(tmp_path, {'train': ['2007_000001', '2007_000002']})
    ds = VOCSegmentation(str(tmp_path), 'train', crop_size=16)
    assert len(ds) == 2 and ds.num_classes == 21
    image, label = ds[1]
    assert image.shape == (3, 16, 16) and label.shape == (16, 16)
    assert set(np.unique(label)) == {0, 16, 255}
    with pytest.raises(FileNotFoundError, match='VOC folder'):
        VOCSegmentation(str(tmp_path), 'missing')
    # a listed image without its files stops the loader when it is made, not mid-epoch
    os.remove(str(tmp_path / 'SegmentationClass' / '2007_000002.png'))
    with pytest.raises(FileNotFoundError, match=r'1 of the 2 images .* \(first: 2007_000002\)'):
        VOCSegmentation(str(tmp_path), 'train')


def run_train(args, timeout=300):
    out = subprocess.run([sys.executable, TRAIN] + args, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def labelled_pixels(dataset):
    return sum(int(((label != IGNORE_LABEL) & (label >= 0)).sum())
               for _, label in (dataset[i] for i in range(len(dataset))))


def test_tiny_training_run_learns_and_scores_its_saved_checkpoint(tmp_path):
    """nn.BatchNorm on 2 devices: the logged scores are the saved checkpoint's
    on one device (its running statistics are the devices' mean), over all 17
    validation images (the last batch's one image on one device); --keep 2."""
    save = str(tmp_path / 'run')
    common = ['--val-size', '17', '--crop-size', '32', '--batch-size', '4', '--save-dir', save,
              '--aux']
    training = common + ['--train-size', '32', '--no-syncbn']
    result = run_train(training + ['--num-devices', '2', '--epochs', '3', '--keep', '2'])
    assert result['loss'][-1] < result['loss'][0]
    assert result['val_images'] == 17
    assert result['val_pixels'] == labelled_pixels(SyntheticShapes(17, 32, seed=1))
    for name in ('epoch_0002.params', 'epoch_0003.params', 'epoch_0003.states',
                 'epoch_0003.json', 'history.json', 'train.log', 'curves.png',
                 'predictions.png'):
        assert os.path.isfile(os.path.join(save, name)), name
    assert not [f for f in os.listdir(save) if f.startswith('epoch_0001')]
    ckpt = os.path.join(save, 'epoch_0003.params')
    evaluated = run_train(common + ['--num-devices', '1', '--eval', '--resume', ckpt])
    assert (evaluated['pixacc'], evaluated['miou']) == (result['pixacc'], result['miou'])
    assert evaluated['images'] == 17
    resumed = run_train(training + ['--num-devices', '2', '--epochs', '4', '--no-figures',
                                  '--resume', os.path.join(save, 'epoch_0002.params')])
    assert len(resumed['loss']) == 4   # epochs 3 and 4 appended to the saved history


def test_an_interrupted_run_resumed_as_it_says_gives_the_uninterrupted_numbers(tmp_path):
    """Ctrl-C (SIGINT) once the first epoch's checkpoint exists: exit 130 with
    one log line, in train.log too, naming the command that continues the
    run; that command ends with the uninterrupted run's losses, scores and
    checkpoint, bit for bit (SyncBN: the running statistics are the same on
    every device, so the checkpoint holds what each device had)."""
    flags = ['--num-devices', '2', '--train-size', '32', '--val-size', '8', '--crop-size', '32',
             '--batch-size', '4', '--epochs', '4', '--no-figures']
    whole = run_train(flags + ['--save-dir', str(tmp_path / 'whole')])
    save = tmp_path / 'cut'
    proc = subprocess.Popen([sys.executable, TRAIN] + flags + ['--save-dir', str(save)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not (save / 'epoch_0001.json').exists() and proc.poll() is None:
            assert time.monotonic() < deadline, 'no checkpoint within 300 s'
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out + err)[-3000:]
    assert 'Traceback' not in err, err[-3000:]
    last = out.strip().splitlines()[-1]
    found = re.search(r' interrupted in epoch (\d) of 4; to continue from (\S+): (.*)$', last)
    assert found, last
    assert last.split(' ', 2)[2] in (save / 'train.log').read_text().splitlines()[-1]
    checkpoint, words = found.group(2), shlex.split(found.group(3))
    assert os.path.isfile(checkpoint) and int(found.group(1)) > 1, last
    assert words[0] == os.path.basename(sys.executable) and words[1] == TRAIN, words
    assert words[words.index('--resume') + 1] == checkpoint, words
    resumed = run_train(words[2:])
    for key in ('loss', 'pixacc', 'miou', 'val_pixels'):
        assert resumed[key] == whole[key], key
    histories = [json.load(open(str(folder / 'history.json'))) for folder in (save,
                                                                              tmp_path / 'whole')]
    for key in ('loss', 'pixacc', 'miou'):   # every epoch's
        assert histories[0][key] == histories[1][key], key
    assert (save / 'epoch_0004.params').read_bytes() == \
        (tmp_path / 'whole' / 'epoch_0004.params').read_bytes()


def test_precise_bn_before_each_evaluation(tmp_path):
    """--precise-bn: the mIoU before it is kept, and the checkpoint holds the
    precise statistics (evaluating it gives the mIoU after)."""
    save = str(tmp_path / 'run')
    common = ['--val-size', '16', '--crop-size', '32', '--num-devices', '2', '--batch-size', '4',
              '--save-dir', save]
    result = run_train(common + ['--train-size', '32', '--no-figures', '--epochs', '2',
                                 '--precise-bn', '3'])
    assert len(result['precise_bn_seconds']) == 2, result
    assert 0 <= result['miou_before_precise_bn'] <= 1, result
    history = json.load(open(os.path.join(save, 'history.json')))
    assert len(history['miou_before_precise_bn']) == 2, history
    # --keep 1 (the default): the last epoch's files only
    assert sorted(f for f in os.listdir(save) if f.startswith('epoch_')) == [
        'epoch_0002.json', 'epoch_0002.params', 'epoch_0002.states']
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


# Runs in one process: each bad flag through train.parse_args (and, for the
# checkpoint, train.train), the messages printed as JSON; then --gpus 0 through
# the script itself, whose exit is the process's.
BAD_INPUTS = r'''
import json, runpy, sys
sys.path.insert(0, %(dir)r)
import mxnet as mx
import train
from data import SyntheticShapes

def stop(call):
    try:
        call()
    except SystemExit as exc:
        return str(exc.code)
    return None

out = {}
for name, argv in %(cases)s:
    out[name] = stop(lambda: train.parse_args(argv))
# A machine with 2 GPUs and MXNet's CUDA build, as MXNet would report it.
features, count = mx.runtime.Features.is_enabled, mx.context.num_gpus
mx.runtime.Features.is_enabled = lambda self, name: name == 'CUDA' or features(self, name)
mx.context.num_gpus = lambda: 2
for name, argv in %(gpu_cases)s:
    out[name] = stop(lambda: train.parse_args(argv))
mx.runtime.Features.is_enabled, mx.context.num_gpus = features, count
out['checkpoint'] = stop(lambda: train.train(train.parse_args(%(checkpoint)s)))
out['train_mode'] = stop(lambda: train.evaluate(
    None, SyntheticShapes(9, 8), 4, [mx.cpu(0), mx.cpu(1)], 4, train_mode=True))
print(json.dumps(out))
sys.stdout.flush()
sys.argv = [%(train)r, '--gpus', '0'] + %(save)s
runpy.run_path(%(train)r, run_name='__main__')
'''


def test_bad_inputs_stop_before_anything_is_written(tmp_path):
    """Each bad flag: one line naming the problem and the fix, no traceback,
    no save directory; checked before MXNet runs an operator."""
    save = ['--save-dir', str(tmp_path / 'run')]
    missing = str(tmp_path / 'missing.params')
    garbage = tmp_path / 'garbage.params'
    garbage.write_text('not a parameter file')
    done = tmp_path / 'done'
    done.mkdir()
    (done / 'epoch_0003.params').write_text('')
    (done / 'epoch_0003.json').write_text(json.dumps({'epoch': 3, 'history': {}}))
    make_voc(tmp_path / 'voc', {'train': ['a', 'b'], 'val': ['c']})
    make_voc(tmp_path / 'voc_nolist', {'val': ['c']})
    make_voc(tmp_path / 'voc_hole', {'train': ['a', 'b'], 'val': ['c']})
    os.remove(str(tmp_path / 'voc_hole' / 'JPEGImages' / 'b.jpg'))
    voc = ['--dataset', 'voc', '--no-figures', '--crop-size', '8', '--data-root']
    expected = {   # name: (flags, what the line must say)
        'cpu_build': (['--gpus', '0'], ['this MXNet 1.9.1 is the CPU build',
                                        'pip install -e ".[gpu]"', 'leave out --gpus']),
        'gpus_syntax': (['--gpus', '0;1'], ['give distinct GPU numbers', '--gpus 0,1,2,3']),
        'resume': (['--resume', missing], ['--resume %s: no such file' % missing]),
        'pretrained': (['--pretrained', missing], ['--pretrained %s: no such file' % missing]),
        'eval': (['--eval'], ['--eval needs a checkpoint', 'add --resume']),
        'nothing_left': (['--resume', str(done / 'epoch_0003.params'), '--epochs', '3'],
                         ['ends epoch 3', 'give --epochs 4 or more']),
        'voc_no_root': (['--dataset', 'voc'], ['--dataset voc needs --data-root']),
        'voc_wrong_root': (voc + ['/wrong'], ['--data-root /wrong: not a folder',
                                              'give the VOC2012 folder']),
        'voc_no_list': (voc + [str(tmp_path / 'voc_nolist')], ['no ', 'train.txt',
                                                               'must be a VOC folder']),
        'voc_hole': (voc + [str(tmp_path / 'voc_hole')], ['1 of the 2 images', '(first: b)']),
        'voc_small': (voc + [str(tmp_path / 'voc')], ['2 training images make no batch of 8',
                                                     'smaller --batch-size']),
        'batch_zero': (['--batch-size', '0'], ['--batch-size 0: give 1 or more']),
        'batch_uneven': (['--batch-size', '6'], ['over 4 devices: give a multiple of 4']),
        'devices_zero': (['--num-devices', '0'], ['--num-devices 0: give 1 or more']),
        'epochs_zero': (['--epochs', '0'], ['--epochs 0: give 1 or more']),
        'keep': (['--keep', '-1'], ['--keep -1: give 0 or more']),
        'no_train_batch': (['--train-size', '4'], ['4 training images make no batch of 8',
                                                   'give --train-size 8 or more']),
        'no_val': (['--val-size', '0'], ['--val-size 0: give 1 or more']),
        'train_size_negative': (['--train-size', '-8'], ['--train-size -8: give 1 or more']),
        'seed_negative': (['--seed', '-1'], ['--seed -1: give 0 or more']),
        'seed_big': (['--seed', str(2 ** 32)], ['--seed 4294967296: give less than 2**32']),
        'lr_negative': (['--lr', '-1'], ['--lr -1.0: give a positive learning rate']),
        'lr_zero': (['--lr', '0'], ['--lr 0.0: give a positive learning rate']),
        'lr_nan': (['--lr', 'nan'], ['--lr nan: give a positive learning rate']),
        'lr_inf': (['--lr', 'inf'], ['--lr inf: give a positive learning rate']),
        'momentum': (['--momentum', '1'], ['--momentum 1.0: give 0 (none) or more and less '
                                           'than 1']),
        'momentum_negative': (['--momentum', '-0.5'], ['--momentum -0.5: give 0']),
        'wd_negative': (['--wd=-1e-4'], ['--wd -0.0001: give 0 (none) or a positive']),
        # flags this run cannot use
        'data_root_synthetic': (['--data-root', '/nonexistent'],
                                ['--data-root does nothing in this run',
                                 'add --dataset voc', 'leave out --data-root']),
        'voc_train_size': (voc + [str(tmp_path / 'voc'), '--train-size', '8'],
                           ['--train-size does nothing in this run', 'counts synthetic images',
                            'leave out --train-size']),
        'voc_val_size': (voc + [str(tmp_path / 'voc'), '--val-size', '8'],
                         ['--val-size does nothing in this run', 'leave out --val-size']),
        'num_devices_with_gpus': (['--gpus', '0', '--num-devices', '2'],
                                  ['--num-devices does nothing in this run', 'counts CPU '
                                   'contexts', 'leave out --num-devices']),
        'pretrained_with_resume': (['--resume', missing, '--pretrained', missing],
                                   ['--pretrained does nothing in this run',
                                    '--resume loads every parameter', 'leave out --pretrained']),
        'voc_eval_seed': (['--dataset', 'voc', '--data-root', str(tmp_path / 'voc'), '--eval',
                           '--resume', missing, '--seed', '1'],
                          ['--seed does nothing in this run', 'leave out --seed']),
        'precise_bn': (['--precise-bn', '9', '--train-size', '64'],
                       ['only 8 training batches', 'give --precise-bn 8 or less']),
    }
    for flags in (['--epochs', '3'], ['--lr', '0.1'], ['--momentum', '0.5'], ['--wd', '0'],
                  ['--train-size', '8'], ['--keep', '2'], ['--precise-bn', '1'],
                  ['--pretrained', missing], ['--syncbn'], ['--no-syncbn'], ['--no-figures']):
        expected['eval' + flags[0].replace('-', '_')] = (
            ['--eval', '--resume', missing] + flags,
            ['%s does nothing in this run' % flags[0], '--eval only scores the checkpoint',
             'leave out %s, or leave out --eval to train' % flags[0]])
    gpu_expected = {
        'gpu_absent': (['--gpus', '0,3'], ['MXNet sees 2 GPU(s) (0-1), not 3']),
        'gpu_uneven': (['--gpus', '0,1', '--batch-size', '3'], ['over 2 devices']),
    }
    code = BAD_INPUTS % {
        'dir': os.path.dirname(TRAIN), 'train': TRAIN, 'save': save,
        'cases': [(k, v[0] + save) for k, v in expected.items()],
        'gpu_cases': [(k, v[0] + save) for k, v in gpu_expected.items()],
        'checkpoint': ['--resume', str(garbage), '--num-devices', '2', '--epochs', '1'] + save}
    out = run_python(code, timeout=120)
    messages = json.loads(out.stdout.strip().splitlines()[-1])
    expected.update(gpu_expected)
    expected['checkpoint'] = (None, ['%s does not fit this network' % garbage,
                                     'Invalid NDArray file format', 'same --dataset and --aux'])
    expected['train_mode'] = (None, ['a batch of 1 validation images',
                                     'leaves 0 or at least 2 in the last batch'])
    for name, (_, says) in expected.items():
        line = messages[name]
        assert line and line.startswith('train.py: ') and '\n' not in line, (name, line)
        for words in says:
            assert words in line, (name, words, line)
    # the script itself: exit status 1, the one line on stderr and nothing else
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.strip() == messages['cpu_build'], out.stderr[-2000:]
    assert not os.path.exists(save[1])
