"""Semantic segmentation with SyncBatchNorm on several devices (GluonCV-style flags).

Default run (4 CPU contexts, synthetic data, a few minutes on 2 cores):

    python examples/segmentation/train.py

Real data in Pascal VOC layout, 4 GPUs:

    python examples/segmentation/train.py --dataset voc --data-root ~/VOC2012 \\
        --gpus 0,1,2,3 --batch-size 16 --crop-size 320 --epochs 50
"""
import argparse
import json
import logging
import os
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--dataset', choices=['synthetic', 'voc'], default='synthetic')
    p.add_argument('--data-root', default=None, help='VOC2012 folder (for --dataset voc)')
    p.add_argument('--num-devices', type=int, default=4, help='CPU contexts (without --gpus)')
    p.add_argument('--gpus', default='', help='e.g. 0,1,2,3; overrides --num-devices')
    p.add_argument('--batch-size', type=int, default=8, help='total over all devices')
    p.add_argument('--epochs', type=int, default=15)
    p.add_argument('--crop-size', type=int, default=64)
    p.add_argument('--lr', type=float, default=0.05, help='base learning rate (poly schedule)')
    p.add_argument('--momentum', type=float, default=0.9)
    p.add_argument('--wd', type=float, default=1e-4)
    p.add_argument('--syncbn', dest='syncbn', action='store_true', default=True)
    p.add_argument('--no-syncbn', dest='syncbn', action='store_false')
    p.add_argument('--aux', action='store_true', help='auxiliary head with weight 0.4')
    p.add_argument('--pretrained', default=None, help='local ResNet-18 v1 parameter file')
    p.add_argument('--train-size', type=int, default=192, help='synthetic training images')
    p.add_argument('--val-size', type=int, default=48, help='synthetic validation images')
    p.add_argument('--save-dir', default='runs/segmentation')
    p.add_argument('--resume', default=None, help='checkpoint .params to continue from')
    p.add_argument('--eval', action='store_true', help='only evaluate (--resume checkpoint)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--precise-bn', type=int, default=0, metavar='N',
                   help='before each evaluation, recompute the running statistics over N '
                        'training batches (gluon_syncbn.update_bn_stats)')
    p.add_argument('--no-hybridize', dest='hybridize', action='store_false', default=True)
    p.add_argument('--no-figures', dest='figures', action='store_false', default=True)
    args = p.parse_args(argv)
    if args.eval and not args.resume:
        p.error('--eval needs --resume CHECKPOINT')
    if args.dataset == 'voc' and not args.data_root:
        p.error('--dataset voc needs --data-root')
    check_dependencies(args)
    return args


INSTALL_EXAMPLES = 'pip install -e ".[examples]"  (from the gluon_syncbn folder)'


def check_dependencies(args):
    """Stop before training, not after it, if a package this run needs is missing."""
    needed = [('tqdm', 'tqdm', 'the progress bar')]
    if args.figures:
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


def contexts(args):
    """The devices; call before MXNet runs its first operator (engine settings)."""
    if args.gpus:
        return [mx.gpu(int(i)) for i in args.gpus.split(',')]
    if args.syncbn:
        # SyncBatchNorm on several CPU contexts needs MXNet's shared CPU resources
        # sized first (plain BatchNorm does not: it would only cost memory).
        gluon_syncbn.configure_cpu_contexts(args.num_devices)
    return [mx.cpu(i) for i in range(args.num_devices)]


def datasets(args):
    if args.dataset == 'synthetic':
        return (SyntheticShapes(args.train_size, args.crop_size, seed=args.seed),
                SyntheticShapes(args.val_size, args.crop_size, seed=args.seed + 1))
    return (VOCSegmentation(args.data_root, 'train', args.crop_size),
            VOCSegmentation(args.data_root, 'val', args.crop_size))


def loaders(args, train_set, val_set, num_devices):
    if args.batch_size % num_devices:
        raise SystemExit('--batch-size %d must be a multiple of the %d devices'
                         % (args.batch_size, num_devices))
    # 'discard': a last batch with fewer samples than devices would leave a
    # device without a slice, and SyncBatchNorm would wait for it.
    train = gluon.data.DataLoader(_ArrayDataset(train_set), args.batch_size, shuffle=True,
                                  last_batch='discard')
    val = gluon.data.DataLoader(_ArrayDataset(val_set), args.batch_size, shuffle=False,
                                last_batch='discard')
    return train, val


class _ArrayDataset(gluon.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, idx):
        return self.base[idx]


def segmentation_loss(F, logits, label):
    """Sum of per-pixel cross entropy over pixels whose label is a class."""
    valid = (label != IGNORE_LABEL) * (label >= 0)
    logp = F.log_softmax(logits, axis=1)
    nll = -F.pick(logp, label * valid, axis=1)
    return F.sum(nll * valid), F.sum(valid)


def build(args, num_classes, ctxs):
    norm_layer = gluon_syncbn.SyncBatchNorm if args.syncbn else gluon.nn.BatchNorm
    net = FCN(num_classes, norm_layer=norm_layer, aux=args.aux, pretrained=args.pretrained)
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctxs)
    if args.resume:
        net.load_parameters(args.resume, ctx=ctxs)
    if args.hybridize:
        net.hybridize()
    return net


def evaluate(net, loader, ctxs, num_classes, train_mode=False):
    """pixAcc and mIoU; ``train_mode`` normalizes with batch statistics instead."""
    metric = SegmentationMetric(num_classes)
    for data, label in loader:
        xs = gluon.utils.split_and_load(data, ctxs)
        ys = gluon.utils.split_and_load(label, ctxs)
        with autograd.train_mode() if train_mode else autograd.predict_mode():
            outs = [net(x) for x in xs]
        for out, y in zip(outs, ys):
            out = out[0] if isinstance(out, (tuple, list)) else out
            metric.update(y.asnumpy(), out.argmax(axis=1).asnumpy())
    return metric.get()


def train(args):
    from tqdm import tqdm  # checked by parse_args
    ctxs = contexts(args)  # first: mx.random.seed already starts MXNet's resources
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    os.makedirs(args.save_dir, exist_ok=True)
    log = setup_logging(args.save_dir)
    train_set, val_set = datasets(args)
    num_classes = train_set.num_classes
    train_loader, val_loader = loaders(args, train_set, val_set, len(ctxs))
    net = build(args, num_classes, ctxs)
    history_file = os.path.join(args.save_dir, 'history.json')
    history = {'loss': [], 'pixacc': [], 'miou': [], 'args': vars(args)}
    start_epoch = 0
    if args.resume:
        state_file = args.resume.replace('.params', '.json')
        if os.path.isfile(state_file):
            state = json.load(open(state_file))
            start_epoch, history = state['epoch'], state['history']
    if args.eval:
        pixacc, miou = evaluate(net, val_loader, ctxs, num_classes)
        log.info('eval %s: pixAcc %.4f mIoU %.4f', args.resume, pixacc, miou)
        return {'pixacc': pixacc, 'miou': miou}
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {
        'learning_rate': args.lr, 'momentum': args.momentum, 'wd': args.wd})
    if args.resume and os.path.isfile(args.resume.replace('.params', '.states')):
        trainer.load_states(args.resume.replace('.params', '.states'))
    iters_per_epoch = len(train_loader)
    max_iter = args.epochs * iters_per_epoch
    log.info('%s on %d device(s) %s, %d train / %d val images, %s', 'SyncBatchNorm' if
             args.syncbn else 'BatchNorm', len(ctxs), ctxs, len(train_set), len(val_set),
             args.dataset)
    for epoch in range(start_epoch, args.epochs):
        tic, total, count = time.time(), 0.0, 0
        bar = tqdm(total=iters_per_epoch, desc='epoch %d/%d' % (epoch + 1, args.epochs),
                   leave=False)
        for i, (data, label) in enumerate(train_loader):
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
        bar.close()
        pixacc, miou = evaluate(net, val_loader, ctxs, num_classes)
        seconds = time.time() - tic  # training and evaluation
        if args.precise_bn:
            log.info('epoch %d: val mIoU %.4f before precise BN', epoch + 1, miou)
            history.setdefault('miou_before_precise_bn', []).append(miou)
            tic = time.time()
            gluon_syncbn.update_bn_stats(net, train_loader, args.precise_bn, ctx_list=ctxs)
            history.setdefault('precise_bn_seconds', []).append(time.time() - tic)
            pixacc, miou = evaluate(net, val_loader, ctxs, num_classes)
        history['loss'].append(total / max(count, 1))
        history['pixacc'].append(pixacc)
        history['miou'].append(miou)
        history.setdefault('seconds', []).append(seconds)
        log.info('epoch %d: loss %.4f, val pixAcc %.4f, mIoU %.4f (%.1fs)', epoch + 1,
                 total / max(count, 1), pixacc, miou, history['seconds'][-1])
        ckpt = os.path.join(args.save_dir, 'epoch_%04d.params' % (epoch + 1))
        net.save_parameters(ckpt)
        trainer.save_states(ckpt.replace('.params', '.states'))
        json.dump({'epoch': epoch + 1, 'history': history},
                  open(ckpt.replace('.params', '.json'), 'w'))
        json.dump(history, open(history_file, 'w'), indent=1)
    result = {'pixacc': history['pixacc'][-1] if history['pixacc'] else None,
              'miou': history['miou'][-1] if history['miou'] else None,
              'loss': history['loss'], 'seconds': history.get('seconds', [])}
    if history.get('miou_before_precise_bn'):
        result['miou_before_precise_bn'] = history['miou_before_precise_bn'][-1]
        result['precise_bn_seconds'] = history['precise_bn_seconds']
    if args.figures:
        figures(args, net, val_set, ctxs, history)
    return result


def setup_logging(save_dir):
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


if __name__ == '__main__':
    print(json.dumps(train(parse_args())))
