"""Semantic segmentation with SyncBatchNorm on several devices (GluonCV-style flags).

Default run (4 CPU contexts, synthetic data; about 35 s on a 2-core machine, about
50 s the first time, which builds the native operator):

    python examples/segmentation/train.py

Real data in Pascal VOC layout, 4 GPUs:

    python examples/segmentation/train.py --dataset voc --data-root ~/VOC2012 \\
        --gpus 0,1,2,3 --batch-size 16 --crop-size 320 --epochs 50

Every flag is checked before anything is written; a bad one, or one the run
would not use, stops the script with one line naming the problem and the fix.
Ctrl-C stops it with one line naming the command that continues it, which
gives the uninterrupted run's numbers bit for bit. The validation scores are those
of each epoch's saved checkpoint, evaluated as it is deployed (see
``deployed_model``), over every validation image.
"""
import argparse
import json
import logging
import math
import os
import shlex
import signal
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import gluon_syncbn  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from data import IGNORE_LABEL, SyntheticShapes, VOCSegmentation  # noqa: E402
from metrics import SegmentationMetric  # noqa: E402
from model import FCN  # noqa: E402


def make_parser(defaults=True):
    """The flags; with ``defaults=False`` a flag left out is absent from the
    parsed namespace, which tells the flags given from the defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                argument_default=None if defaults else argparse.SUPPRESS)

    def add(*flags, **kwargs):
        if not defaults:
            kwargs.pop('default', None)
        p.add_argument(*flags, **kwargs)
    add('--dataset', choices=['synthetic', 'voc'], default='synthetic')
    add('--data-root', default=None, help='VOC2012 folder (for --dataset voc)')
    add('--num-devices', type=int, default=4, help='CPU contexts (without --gpus)')
    add('--gpus', default='', help='e.g. 0,1,2,3, instead of --num-devices')
    add('--batch-size', type=int, default=8, help='total over all devices')
    add('--epochs', type=int, default=15)
    add('--crop-size', type=int, default=64)
    add('--lr', type=float, default=0.05, help='base learning rate (poly schedule)')
    add('--momentum', type=float, default=0.9)
    add('--wd', type=float, default=1e-4)
    add('--syncbn', dest='syncbn', action='store_true', default=True)
    add('--no-syncbn', dest='syncbn', action='store_false')
    add('--aux', action='store_true', default=False, help='auxiliary head with weight 0.4')
    add('--pretrained', default=None, help='local ResNet-18 v1 parameter file')
    add('--train-size', type=int, default=192, help='synthetic training images')
    add('--val-size', type=int, default=48, help='synthetic validation images')
    add('--save-dir', default='runs/segmentation')
    add('--keep', type=int, default=1, metavar='N',
        help='keep the checkpoints of the last N epochs this run trains (0: every epoch)')
    add('--resume', default=None, help='checkpoint .params to continue from')
    add('--eval', action='store_true', default=False,
        help='only evaluate (--resume checkpoint)')
    add('--seed', type=int, default=0, help='data order, initialization and Dropout')
    add('--precise-bn', type=int, default=0, metavar='N',
        help='before each evaluation, recompute the running statistics over N '
             'training batches (gluon_syncbn.update_bn_stats)')
    add('--no-hybridize', dest='hybridize', action='store_false', default=True)
    add('--no-figures', dest='figures', action='store_false', default=True)
    return p


def parse_args(argv=None):
    """The flags, checked (see ``check_inputs``); nothing is written here.

    ``args.given`` lists the flags given (by their ``dest``), for
    ``check_inputs`` and for the command that resumes the run (``command``).
    """
    args = make_parser().parse_args(argv)
    args.given = sorted(vars(make_parser(defaults=False).parse_args(argv)))
    check_dependencies(args)
    check_inputs(args)
    return args


def flag(args, dest):
    """The flag that sets ``dest`` to its value in ``args``, as the user spells it."""
    for action in make_parser()._actions:  # pylint: disable=protected-access
        if action.dest == dest and (action.nargs != 0 or action.const == getattr(args, dest)):
            return action.option_strings[0]
    raise KeyError(dest)


def command(args, **changes):
    """The command line that runs train.py with the flags ``args`` were given,
    ``changes`` applied (``dest=value``; None leaves the flag out)."""
    given = {dest: getattr(args, dest) for dest in args.given}
    given.update(changes)
    words = [os.path.basename(sys.executable), sys.argv[0] or 'train.py']
    for action in make_parser()._actions:  # pylint: disable=protected-access
        value = given.get(action.dest)
        if value is None or not action.option_strings or action.dest == 'help':
            continue
        if action.nargs == 0:
            if action.const == value:
                words.append(action.option_strings[0])
        else:
            words += [action.option_strings[0], str(value)]  # str(float) reads back exactly
    return ' '.join(shlex.quote(word) for word in words)


INSTALL_EXAMPLES = 'pip install -e ".[examples]"  (from the gluon_syncbn folder)'


def fail(message):
    """Stop the script with one line naming the problem and the fix (no traceback)."""
    raise SystemExit('train.py: ' + message)


def check_dependencies(args):
    """Stop before training, not after it, if a package this run needs is missing."""
    needed = [('tqdm', 'tqdm', 'the progress bar')]
    if args.figures and not args.eval:
        needed.append(('matplotlib', 'matplotlib', 'the figures (or pass --no-figures)'))
    if args.dataset == 'voc':
        needed.append(('PIL', 'pillow', 'reading VOC images'))
    missing = []
    for module, package, why in needed:
        try:
            __import__(module)
        except ImportError:
            missing.append('%s (for %s)' % (package, why))
    if missing:
        raise SystemExit('train.py: missing %s. Install the example\'s dependencies:\n    %s'
                         % (', '.join(missing), INSTALL_EXAMPLES))


# What only training uses: with --eval each of these flags would do nothing.
TRAINING_ONLY = ('epochs', 'lr', 'momentum', 'wd', 'train_size', 'keep', 'precise_bn',
                 'pretrained', 'syncbn', 'figures')


def unused_flag(args):
    """A flag given that this run cannot use: ``(flag, why)``, or None.

    Parameters
    ----------
    args : argparse.Namespace
        From ``parse_args``, with ``args.given``.

    Returns
    -------
    tuple of str or None
        The flag as the user spelled it, and why it does nothing here and
        what to do instead.
    """
    given = set(args.given)
    if args.eval:
        for dest in TRAINING_ONLY:
            if dest in given:
                name = flag(args, dest)
                return name, ('--eval only scores the checkpoint as it is deployed (nn.BatchNorm '
                              'in eval mode, whichever layer trained it): leave out %s, or '
                              'leave out --eval to train' % name)
        if 'seed' in given and args.dataset == 'voc':
            return '--seed', '--eval on VOC images draws nothing at random: leave out --seed'
    elif 'pretrained' in given and args.resume:
        return '--pretrained', ('--resume loads every parameter, the backbone\'s too, over '
                                'the pretrained ones: leave out --pretrained')
    if 'data_root' in given and args.dataset != 'voc':
        return '--data-root', ('the folder is read with --dataset voc only: add --dataset voc '
                               'to use it, or leave out --data-root to use synthetic data')
    for dest in ('train_size', 'val_size'):
        if dest in given and args.dataset == 'voc':
            return flag(args, dest), ('it counts synthetic images, and with --dataset voc the '
                                      'lists in ImageSets/Segmentation/ choose the images: '
                                      'leave out %s' % flag(args, dest))
    if 'num_devices' in given and args.gpus:
        return '--num-devices', ('it counts CPU contexts, and --gpus trains on the GPUs it '
                                 'lists: leave out --num-devices')
    return None


def out_of_range(args):
    """The first numeric flag out of its range, as the line that says so, or None."""
    least = [('--batch-size', args.batch_size, 1), ('--crop-size', args.crop_size, 1),
             ('--epochs', args.epochs, 1), ('--precise-bn', args.precise_bn, 0),
             ('--keep', args.keep, 0), ('--train-size', args.train_size, 1),
             ('--val-size', args.val_size, 1), ('--seed', args.seed, 0)]
    if not args.gpus:
        least.insert(0, ('--num-devices', args.num_devices, 1))
    for name, value, smallest in least:
        if value < smallest:
            return '%s %d: give %d or more' % (name, value, smallest)
    if args.seed >= 2 ** 32:
        return '--seed %d: give less than 2**32 (%d), as NumPy\'s generator takes' % (
            args.seed, 2 ** 32)
    if not (math.isfinite(args.lr) and args.lr > 0):
        return '--lr %r: give a positive learning rate, e.g. --lr 0.05' % args.lr
    if not 0 <= args.momentum < 1:
        return '--momentum %r: give 0 (none) or more and less than 1, e.g. 0.9' % args.momentum
    if not (math.isfinite(args.wd) and args.wd >= 0):
        return '--wd %r: give 0 (none) or a positive weight decay, e.g. 1e-4' % args.wd
    return None


def check_inputs(args):
    """Stop, with one line naming the fix, on any flag this run cannot use.

    Runs before anything is written and before MXNet's first operator: flags
    given that the run would not use, numbers out of range, the devices
    against the installed MXNet, the files that must exist (the checkpoint,
    the pretrained file, the VOC folder's lists and images), and the sizes
    (every training batch split evenly over the devices, at least one
    training batch per epoch, at least one validation image).

    Parameters
    ----------
    args : argparse.Namespace
        The parsed flags, with ``args.given``.

    Raises
    ------
    SystemExit
        ``'train.py: <the problem>: <the fix>'``, one line.
    """
    if args.eval and not args.resume:
        fail('--eval needs a checkpoint to evaluate: add --resume FILE.params')
    unused = unused_flag(args)
    if unused:
        fail('%s does nothing in this run: %s' % unused)
    problem = out_of_range(args)
    if problem:
        fail(problem)
    num_devices = len(gpu_ids(args)) if args.gpus else args.num_devices
    if not args.eval and args.batch_size % num_devices:
        fail('--batch-size %d does not split evenly over %d devices: give a multiple of %d'
             % (args.batch_size, num_devices, num_devices))
    for name, path in (('--resume', args.resume), ('--pretrained', args.pretrained)):
        if path and not os.path.isfile(path):
            fail('%s %s: no such file; give the path of a .params file' % (name, path))
    if args.resume and not args.eval:
        state = read_state(args.resume)
        if state and state['epoch'] >= args.epochs:
            fail('--resume %s ends epoch %d, so --epochs %d leaves nothing to train: give '
                 '--epochs %d or more, or --eval to evaluate it'
                 % (args.resume, state['epoch'], args.epochs, state['epoch'] + 1))
    train_set, val_set = datasets(args)
    if train_set is not None:
        batches = len(train_set) // args.batch_size   # the last partial batch is dropped
        if batches == 0:
            fail('%d training images make no batch of %d: %s'
                 % (len(train_set), args.batch_size, 'give --train-size %d or more'
                    % args.batch_size if args.dataset == 'synthetic' else
                    'give a smaller --batch-size'))
        if args.precise_bn > batches:
            fail('--precise-bn %d: an epoch has only %d training batches (%d images, batch '
                 '%d); give --precise-bn %d or less' % (args.precise_bn, batches,
                                                        len(train_set), args.batch_size,
                                                        batches))
    if len(val_set) == 0:   # --val-size is at least 1: a VOC list
        fail('no validation image: list images in ImageSets/Segmentation/val.txt')


def gpu_ids(args):
    """The GPU numbers of ``--gpus``, checked against the installed MXNet.

    Asks MXNet only what it was built with and how many GPUs it sees, which
    runs no operator (the CPU wheel answers without CUDA).

    Parameters
    ----------
    args : argparse.Namespace
        The parsed flags, with ``args.gpus`` set.

    Returns
    -------
    list of int
    """
    try:
        ids = [int(i) for i in args.gpus.split(',')]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        fail('--gpus %s: give distinct GPU numbers separated by commas, e.g. --gpus 0,1,2,3'
             % args.gpus)
    if not mx.runtime.Features().is_enabled('CUDA'):
        fail('--gpus %s: this MXNet %s is the CPU build; install the GPU build (pip install '
             '-e ".[gpu]", see docs/install.md), or leave out --gpus to train on CPU '
             'contexts (--num-devices)' % (args.gpus, mx.__version__))
    try:
        count = mx.context.num_gpus()
    except mx.base.MXNetError as exc:
        fail('--gpus %s: MXNet cannot count the GPUs (%s); check the driver with nvidia-smi'
             % (args.gpus, one_line(exc)))
    absent = [i for i in ids if i >= count]
    if absent:
        fail('--gpus %s: MXNet sees %d GPU(s)%s, not %s; give GPUs among those'
             % (args.gpus, count, ' (0-%d)' % (count - 1) if count else '',
                ','.join(map(str, absent))))
    return ids


def one_line(exc):
    """The line of an exception's message that says what went wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith('MXNetError:'):
            return line[len('MXNetError:'):].strip()
    return lines[-1] if lines else type(exc).__name__


def contexts(args):
    """The devices; call before MXNet runs its first operator (engine settings)."""
    if args.gpus:
        return [mx.gpu(i) for i in gpu_ids(args)]
    if args.syncbn:
        # SyncBatchNorm on several CPU contexts needs MXNet's shared CPU resources
        # sized first (plain BatchNorm does not: it would only cost memory).
        gluon_syncbn.configure_cpu_contexts(args.num_devices)
    return [mx.cpu(i) for i in range(args.num_devices)]


def datasets(args):
    """``(training set, validation set)``; no training set with ``--eval``.

    A VOC folder that lacks a file the loader needs stops the script here.
    """
    if args.dataset == 'synthetic':
        return (None if args.eval else
                SyntheticShapes(args.train_size, args.crop_size, seed=args.seed),
                SyntheticShapes(args.val_size, args.crop_size, seed=args.seed + 1))
    if not args.data_root:
        fail('--dataset voc needs --data-root, the VOC2012 folder')
    if not os.path.isdir(args.data_root):
        fail('--data-root %s: not a folder; give the VOC2012 folder (with JPEGImages/, '
             'SegmentationClass/ and ImageSets/Segmentation/)' % args.data_root)
    try:
        return (None if args.eval else VOCSegmentation(args.data_root, 'train', args.crop_size),
                VOCSegmentation(args.data_root, 'val', args.crop_size))
    except FileNotFoundError as exc:
        fail('--data-root %s: %s' % (args.data_root, exc))


def epoch_random(seed, epoch, purpose):
    """The random state of one epoch and ``purpose`` (0: the data order, 1:
    MXNet's seed), a function of these alone: a run resumed at an epoch
    draws what the uninterrupted run drew there."""
    return np.random.RandomState([seed, epoch, purpose])


class EpochShuffle(gluon.data.Sampler):
    """The indices ``0..length-1`` in the order of epoch ``self.epoch``.

    Parameters
    ----------
    length : int
    seed : int
        ``--seed``; each epoch's order is ``epoch_random(seed, epoch, 0)``'s.
    """

    def __init__(self, length, seed):
        self.length, self.seed, self.epoch = length, seed, 0

    def __iter__(self):
        return iter(epoch_random(self.seed, self.epoch, 0).permutation(self.length).tolist())

    def __len__(self):
        return self.length


def train_loader(args, train_set):
    """``(loader, sampler)``: shuffled training batches, each split evenly over
    the devices, in the order of epoch ``sampler.epoch``.

    'discard': a last batch with fewer samples than devices would leave a
    device without a slice, and SyncBatchNorm would wait for it.
    """
    sampler = EpochShuffle(len(train_set), args.seed)
    batches = gluon.data.BatchSampler(sampler, args.batch_size, last_batch='discard')
    return gluon.data.DataLoader(_ArrayDataset(train_set), batch_sampler=batches), sampler


class _ArrayDataset(gluon.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, idx):
        return self.base[idx]


def split_batch(batch, ctxs):
    """Slices of ``batch`` on as many of ``ctxs`` as it has samples.

    ``gluon.utils.split_and_load`` refuses a batch with fewer samples than
    contexts; a final validation batch may have them.

    Parameters
    ----------
    batch : NDArray
        Samples along axis 0.
    ctxs : list of Context

    Returns
    -------
    list of NDArray
        ``min(len(batch), len(ctxs))`` slices, sizes differing by at most 1,
        the k-th on ``ctxs[k]``.
    """
    n = batch.shape[0]
    used = min(n, len(ctxs))
    bounds = [n * i // used for i in range(used + 1)]
    return [batch[bounds[i]:bounds[i + 1]].as_in_context(ctxs[i]) for i in range(used)]


def segmentation_loss(F, logits, label):
    """Sum of per-pixel cross entropy over pixels whose label is a class."""
    valid = (label != IGNORE_LABEL) * (label >= 0)
    logp = F.log_softmax(logits, axis=1)
    nll = -F.pick(logp, label * valid, axis=1)
    return F.sum(nll * valid), F.sum(valid)


def load_checkpoint(net, path, ctxs):
    """``net.load_parameters(path, ctx=ctxs)``; a file that does not fit stops the script.

    Parameters
    ----------
    net : Block
    path : str
        A ``.params`` file.
    ctxs : list of Context
    """
    try:
        net.load_parameters(path, ctx=ctxs)
    except (ValueError, AssertionError, mx.base.MXNetError) as exc:
        fail('%s does not fit this network (%s): give a checkpoint train.py wrote with the '
             'same --dataset and --aux' % (path, one_line(exc)))


def build(args, num_classes, ctxs):
    """The network to train (or to evaluate in train mode), with ``--resume`` loaded."""
    norm_layer = gluon_syncbn.SyncBatchNorm if args.syncbn else gluon.nn.BatchNorm
    net = FCN(num_classes, norm_layer=norm_layer, aux=args.aux, pretrained=args.pretrained)
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctxs)
    if args.resume:
        load_checkpoint(net, args.resume, ctxs)
    if args.hybridize:
        net.hybridize()
    return net


def deployed_model(args, num_classes):
    """The network as a saved checkpoint is deployed, for eval-mode scores.

    Its parameters come from a checkpoint (``load_checkpoint``), the same on
    every device, so each image scores as on one device. ``save_parameters``
    stores each parameter's mean over the devices: for ``nn.BatchNorm``,
    whose running statistics differ per device, no training device holds
    what the checkpoint holds. Its layers are ``nn.BatchNorm``, which
    SyncBatchNorm is in eval mode.

    Parameters
    ----------
    args : argparse.Namespace
        ``args.aux`` and ``args.hybridize`` are used.
    num_classes : int

    Returns
    -------
    FCN
        Uninitialized: ``load_checkpoint`` gives it its parameters.
    """
    net = FCN(num_classes, norm_layer=gluon.nn.BatchNorm, aux=args.aux)
    if args.hybridize:
        net.hybridize()
    return net


def evaluate(net, dataset, batch_size, ctxs, num_classes, train_mode=False):
    """Scores over every image of ``dataset``, in batches of ``batch_size``.

    Parameters
    ----------
    net : Block
        In eval mode, a network with the same parameters on every device
        (``deployed_model``).
    dataset : SyntheticShapes or VOCSegmentation
    batch_size : int
        Images per batch, over all devices. In eval mode a batch is split
        over as many devices as it has images, the last partial one too.
    ctxs : list of Context
    num_classes : int
    train_mode : bool
        Normalize with batch statistics (and Dropout on), as in training.
        Every device then takes part in every batch (SyncBatchNorm
        synchronizes them), so every batch, the last one included, needs at
        least one image per device; otherwise the script stops before
        evaluating anything.

    Returns
    -------
    dict
        ``pixacc``, ``miou``, ``images`` and ``pixels`` (labelled pixels) counted.
    """
    smallest = len(dataset) % batch_size or min(batch_size, len(dataset))
    if not smallest:
        fail('no validation image to evaluate')
    if train_mode and smallest < len(ctxs):
        fail('train-mode evaluation gives every one of the %d devices a share of every batch, '
             'and a batch of %d validation images (%d in all, batches of %d) has fewer: give a '
             'number of validation images that leaves 0 or at least %d in the last batch'
             % (len(ctxs), smallest, len(dataset), batch_size, len(ctxs)))
    loader = gluon.data.DataLoader(_ArrayDataset(dataset), batch_size, shuffle=False,
                                   last_batch='keep')
    metric = SegmentationMetric(num_classes)
    images = 0
    for data, label in loader:
        xs, ys = split_batch(data, ctxs), split_batch(label, ctxs)
        with autograd.train_mode() if train_mode else autograd.predict_mode():
            outs = [net(x) for x in xs]
        for out, y in zip(outs, ys):
            out = out[0] if isinstance(out, (tuple, list)) else out
            metric.update(y.asnumpy(), out.argmax(axis=1).asnumpy())
            images += y.shape[0]
    try:
        pixacc, miou = metric.get()
    except ValueError as exc:
        fail('%s over %d validation images: check their labels' % (exc, images))
    return {'pixacc': pixacc, 'miou': miou, 'images': images,
            'pixels': int(metric.confusion.sum())}


def read_state(checkpoint):
    """The ``epoch`` and ``history`` saved beside a checkpoint, or None."""
    state_file = os.path.splitext(checkpoint)[0] + '.json'
    if not os.path.isfile(state_file):
        return None
    try:
        with open(state_file) as f:
            state = json.load(f)
        return {'epoch': int(state['epoch']), 'history': state['history']}
    except (ValueError, KeyError, TypeError) as exc:
        fail('%s is not a state file train.py wrote (%s): move it away to resume without '
             'the history' % (state_file, one_line(exc)))


class Interruption(object):
    """Ctrl-C during the epochs, taken between two training steps.

    Python raises KeyboardInterrupt wherever the interpreter is, also inside
    the callbacks MXNet calls, such as the Trainer's update of a parameter,
    which swallow it, print a traceback and go on with a half-done step. So
    the first Ctrl-C is only noted here (``check`` raises it between steps);
    a second one interrupts at once, as by default.
    """

    def __init__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGINT, self._note)

    def _note(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def check(self):
        """Raise KeyboardInterrupt if Ctrl-C was pressed."""
        if self.requested:
            raise KeyboardInterrupt

    def restore(self):
        signal.signal(signal.SIGINT, self.previous)


def checkpoint_files(save_dir, epoch):
    """The files ``train`` writes for one epoch: parameters, trainer state, history."""
    stem = os.path.join(save_dir, 'epoch_%04d' % epoch)
    return [stem + '.params', stem + '.states', stem + '.json']


def train(args, progress=None):
    """Train (or, with ``--eval``, evaluate) as ``args`` say.

    Everything that can be checked is checked before the save directory and
    its ``train.log`` are made: the flags (``parse_args``), then the
    checkpoint to resume from against the network. Each epoch writes
    ``epoch_<N>.params``, ``.states`` and ``.json`` and scores the saved
    ``.params`` (``deployed_model``); ``--keep`` says how many epochs' files stay.

    Parameters
    ----------
    args : argparse.Namespace
        From ``parse_args``.
    progress : dict or None
        Filled in as the run goes, for ``interrupted``: ``log`` once logging
        is set up, ``epoch`` (0-based) of the epoch that runs or is next, ``bar``
        its progress bar, ``checkpoint`` the last complete one to resume from,
        ``done`` once the last epoch's is written.

    Returns
    -------
    dict
        The last epoch's ``pixacc``, ``miou``, ``val_images`` (images scored),
        ``val_pixels`` (labelled pixels scored) and ``checkpoint``; ``loss`` and
        ``seconds`` per epoch; with ``--eval``, ``evaluate``'s dict.
    """
    from tqdm import tqdm  # checked by parse_args
    progress = {} if progress is None else progress
    ctxs = contexts(args)  # first: mx.random.seed already starts MXNet's resources
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    train_set, val_set = datasets(args)
    num_classes = val_set.num_classes
    deployed = deployed_model(args, num_classes)
    if args.eval:
        load_checkpoint(deployed, args.resume, ctxs)
        log = progress['log'] = setup_logging(args.save_dir)
        scores = evaluate(deployed, val_set, args.batch_size, ctxs, num_classes)
        log.info('eval %s: pixAcc %.4f mIoU %.4f (%d images)', args.resume, scores['pixacc'],
                 scores['miou'], scores['images'])
        return scores
    net = build(args, num_classes, ctxs)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {
        'learning_rate': args.lr, 'momentum': args.momentum, 'wd': args.wd})
    history = {'loss': [], 'pixacc': [], 'miou': [], 'args': vars(args)}
    start_epoch = 0
    states = None
    if args.resume:
        state = read_state(args.resume)
        if state:
            start_epoch, history = state['epoch'], state['history']
        states = os.path.splitext(args.resume)[0] + '.states'
        if os.path.isfile(states):
            try:
                trainer.load_states(states)
            except (ValueError, AssertionError, mx.base.MXNetError) as exc:
                fail('%s does not fit this network\'s trainer (%s): move it away to resume '
                     'with fresh momentum' % (states, one_line(exc)))
        else:
            states = None
    log = progress['log'] = setup_logging(args.save_dir)
    progress['checkpoint'] = args.resume
    history_file = os.path.join(args.save_dir, 'history.json')
    loader, sampler = train_loader(args, train_set)
    iters_per_epoch = len(loader)
    max_iter = args.epochs * iters_per_epoch
    log.info('%s on %d device(s) %s, %d train / %d val images, %s; val scores: each '
             'epoch\'s saved checkpoint, eval mode, every image', 'SyncBatchNorm' if
             args.syncbn else 'BatchNorm', len(ctxs), ctxs, len(train_set), len(val_set),
             args.dataset)
    if args.resume:
        log.info('resuming from %s at epoch %d%s', args.resume, start_epoch + 1,
                 '' if states else ' (no .states beside it: momentum starts from zero)')
    written = []
    scores = None
    interruption = Interruption()
    for epoch in range(start_epoch, args.epochs):
        tic, total, count = time.time(), 0.0, 0
        progress['epoch'] = sampler.epoch = epoch
        # Dropout's masks too are a function of the seed and the epoch.
        mx.random.seed(int(epoch_random(args.seed, epoch, 1).randint(2 ** 31)))
        bar = progress['bar'] = tqdm(total=iters_per_epoch, leave=False,
                                     desc='epoch %d/%d' % (epoch + 1, args.epochs))
        for i, (data, label) in enumerate(loader):
            it = epoch * iters_per_epoch + i
            trainer.set_learning_rate(args.lr * (1 - it / max_iter) ** 0.9)   # poly
            xs = gluon.utils.split_and_load(data, ctxs)
            ys = gluon.utils.split_and_load(label, ctxs)
            with autograd.record():
                losses, pixels = [], []
                for x, y in zip(xs, ys):
                    out = net(x)
                    if args.aux:
                        main, aux = segmentation_loss(mx.nd, out[0], y), \
                            segmentation_loss(mx.nd, out[1], y)
                        losses.append(main[0] + 0.4 * aux[0])
                        pixels.append(main[1])
                    else:
                        loss, n = segmentation_loss(mx.nd, out, y)
                        losses.append(loss)
                        pixels.append(n)
            autograd.backward(losses)
            n_pixels = max(sum(float(n.asscalar()) for n in pixels), 1.0)
            trainer.step(n_pixels)  # gradients of the mean loss over valid pixels
            total += sum(float(l.asscalar()) for l in losses) / n_pixels
            count += 1
            bar.update(1)
            bar.set_postfix_str('loss %.4f lr %.4f' % (total / count, trainer.learning_rate))
            interruption.check()
        bar.close()
        params, states, state = checkpoint_files(args.save_dir, epoch + 1)
        # The scores are the saved file's, loaded as it is deployed (see deployed_model).
        net.save_parameters(params)
        trainer.save_states(states)
        load_checkpoint(deployed, params, ctxs)
        scores = evaluate(deployed, val_set, args.batch_size, ctxs, num_classes)
        seconds = time.time() - tic  # training, saving and evaluation
        if args.precise_bn:
            log.info('epoch %d: val mIoU %.4f before precise BN', epoch + 1, scores['miou'])
            history.setdefault('miou_before_precise_bn', []).append(scores['miou'])
            tic = time.time()
            gluon_syncbn.update_bn_stats(net, loader, args.precise_bn, ctx_list=ctxs)
            history.setdefault('precise_bn_seconds', []).append(time.time() - tic)
            net.save_parameters(params)   # the checkpoint holds the precise statistics
            load_checkpoint(deployed, params, ctxs)
            scores = evaluate(deployed, val_set, args.batch_size, ctxs, num_classes)
        history['loss'].append(total / count)
        history['pixacc'].append(scores['pixacc'])
        history['miou'].append(scores['miou'])
        history['val_images'] = scores['images']
        history.setdefault('seconds', []).append(seconds)
        log.info('epoch %d: loss %.4f, val pixAcc %.4f, mIoU %.4f (%.1fs)', epoch + 1,
                 total / count, scores['pixacc'], scores['miou'], seconds)
        with open(state, 'w') as f:
            json.dump({'epoch': epoch + 1, 'history': history}, f)
        with open(history_file, 'w') as f:
            json.dump(history, f, indent=1)
        written.append(epoch + 1)
        progress['checkpoint'], progress['done'] = params, epoch + 1 == args.epochs
        progress['epoch'] = epoch + 1   # what is left starts there
        if args.keep and len(written) > args.keep:
            for path in checkpoint_files(args.save_dir, written.pop(0)):
                if os.path.isfile(path):
                    os.remove(path)
        interruption.check()
    interruption.restore()
    result = {'pixacc': history['pixacc'][-1] if history['pixacc'] else None,
              'miou': history['miou'][-1] if history['miou'] else None,
              'loss': history['loss'], 'seconds': history.get('seconds', [])}
    if scores:
        result.update(val_images=scores['images'], val_pixels=scores['pixels'],
                      checkpoint=checkpoint_files(args.save_dir, args.epochs)[0])
    if history.get('miou_before_precise_bn'):
        result['miou_before_precise_bn'] = history['miou_before_precise_bn'][-1]
        result['precise_bn_seconds'] = history['precise_bn_seconds']
    if args.figures:
        figures(args, deployed, val_set, ctxs, history)
    return result


def setup_logging(save_dir):
    """Log to stdout and ``save_dir/train.log``, making ``save_dir``."""
    os.makedirs(save_dir, exist_ok=True)
    log = logging.getLogger('segmentation')
    log.setLevel(logging.INFO)
    log.handlers = []
    fmt = logging.Formatter('%(asctime)s %(message)s')
    for handler in (logging.StreamHandler(sys.stdout),
                    logging.FileHandler(os.path.join(save_dir, 'train.log'))):
        handler.setFormatter(fmt)
        log.addHandler(handler)
    return log


def figures(args, net, val_set, ctxs, history):
    """``curves.png`` (loss and scores per epoch) and ``predictions.png`` (the
    first validation images, predicted by ``net``, the deployed model)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from data import MEAN, STD
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    epochs = range(1, len(history['loss']) + 1)
    ax[0].plot(epochs, history['loss'], 'o-')
    ax[0].set(title='training loss', xlabel='epoch')
    ax[1].plot(epochs, history['miou'], 'o-', label='mIoU')
    ax[1].plot(epochs, history['pixacc'], 's-', label='pixAcc')
    ax[1].set(title='validation', xlabel='epoch', ylim=(0, 1))
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.save_dir, 'curves.png'), dpi=100)
    plt.close(fig)
    rows = min(4, len(val_set))
    fig, ax = plt.subplots(rows, 3, figsize=(6, 2 * rows), squeeze=False)
    cmap = plt.get_cmap('tab20', max(val_set.num_classes, 2))
    for r in range(rows):
        image, label = val_set[r]
        out = net(mx.nd.array(image[None], ctx=ctxs[0]))
        out = out[0] if isinstance(out, (tuple, list)) else out
        pred = out.argmax(axis=1)[0].asnumpy()
        shown = np.clip(image.transpose(1, 2, 0) * STD + MEAN, 0, 1)
        label = np.ma.masked_equal(label, IGNORE_LABEL)
        for c, (img, title) in enumerate([(shown, 'image'), (label, 'ground truth'),
                                          (pred, 'prediction')]):
            ax[r][c].imshow(img, cmap=None if c == 0 else cmap, vmin=0,
                            vmax=val_set.num_classes - 1)
            ax[r][c].set_axis_off()
            if r == 0:
                ax[r][c].set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(args.save_dir, 'predictions.png'), dpi=100)
    plt.close(fig)


def interrupted(args, progress):
    """End the run after Ctrl-C with one line, logged to ``train.log`` too:
    the command that continues it (``--resume`` its last complete checkpoint).

    Parameters
    ----------
    args : argparse.Namespace
    progress : dict
        As ``train`` left it.

    Raises
    ------
    SystemExit
        130, as a shell reports a process ended by SIGINT.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C would cut the line short
    if progress.get('bar') is not None:
        progress['bar'].close()
    checkpoint = progress.get('checkpoint')
    if progress.get('done'):
        line = 'interrupted after the last epoch: its checkpoint %s and history.json are ' \
               'complete%s' % (checkpoint, '; the figures may be missing' if args.figures else '')
    elif 'epoch' in progress and checkpoint:
        line = 'interrupted in epoch %d of %d; to continue from %s: %s' % (
            progress['epoch'] + 1, args.epochs, checkpoint,
            command(args, resume=checkpoint, pretrained=None))
    elif 'epoch' in progress:
        line = ('interrupted in epoch %d of %d, before the first checkpoint; nothing to '
                'continue from: run the same command again' % (progress['epoch'] + 1,
                                                                args.epochs))
    else:
        line = 'interrupted %s: run the same command again' % (
            'during the evaluation' if args.eval else 'before the first epoch')
    if progress.get('log'):
        progress['log'].info(line)
    else:
        sys.stderr.write('train.py: %s\n' % line)
    raise SystemExit(130)


if __name__ == '__main__':
    ARGS, PROGRESS = parse_args(), {}
    try:
        print(json.dumps(train(ARGS, PROGRESS)))
    except KeyboardInterrupt:
        interrupted(ARGS, PROGRESS)
