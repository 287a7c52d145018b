"""Why SyncBN: the same model trained with 1 image per device on 4 CPU contexts,
once with nn.BatchNorm and once with SyncBatchNorm (same seed, data and budget).

    python examples/segmentation/compare.py [--epochs 6] [--precise-bn 40]
                                            [--save-dir runs/compare]

Reports validation pixAcc/mIoU, over all 48 validation images, of each run's
saved checkpoint in eval mode, loaded as it is deployed (train.py's scores:
the checkpoint's running statistics, for nn.BatchNorm the mean over the
devices that ``save_parameters`` stores), and of the same checkpoint in train
mode (the statistics of each device's slice of each batch, SyncBatchNorm's of
the whole batch, and Dropout on, as in training), whose difference is the
eval-mode gap; with ``--precise-bn N``, eval mode after
gluon_syncbn.update_bn_stats over N training batches, and before it. Writes
compare.json and compare.md into the save directory.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def check(out, what):
    """Stop with the subprocess's last words if it failed."""
    if out.returncode != 0:
        raise SystemExit('compare.py: %s failed (exit %d):\n%s%s' % (
            what, out.returncode, out.stdout[-2000:], out.stderr[-2000:]))


def run(norm_flag, args, save_dir):
    cmd = [sys.executable, os.path.join(HERE, 'train.py'), norm_flag, '--num-devices', '4',
           '--batch-size', '4', '--epochs', str(args.epochs), '--seed', str(args.seed),
           '--save-dir', save_dir, '--no-figures', '--precise-bn', str(args.precise_bn)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    check(out, ' '.join(cmd[1:]))
    result = json.loads(out.stdout.strip().splitlines()[-1])
    history = json.load(open(os.path.join(save_dir, 'history.json')))
    result['history'] = history['miou']
    result['history_before'] = history.get('miou_before_precise_bn', [])
    # the saved checkpoint in train mode (batch statistics), on the training devices
    # train.py --eval scores as deployed and refuses --syncbn/--no-syncbn; this
    # evaluation builds the training network, with the layer that trained it.
    code = ('import sys, json; sys.path.insert(0, %r); import train; '
            'a = train.parse_args(%r); a.syncbn = %r; ctxs = train.contexts(a); '
            '_, va = train.datasets(a); net = train.build(a, va.num_classes, ctxs); '
            'print(json.dumps(train.evaluate(net, va, a.batch_size, ctxs, va.num_classes, '
            'train_mode=True)))'
            % (HERE, ['--num-devices', '4', '--batch-size', '4', '--seed', str(args.seed),
                      '--resume', result['checkpoint'], '--eval'], norm_flag == '--syncbn'))
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=args.timeout)
    check(out, 'the train-mode evaluation of %s' % result['checkpoint'])
    result['train_mode'] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=6)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--save-dir', default='runs/compare')
    p.add_argument('--precise-bn', type=int, default=0, metavar='N')
    p.add_argument('--timeout', type=int, default=3600)
    args = p.parse_args()
    os.makedirs(args.save_dir, exist_ok=True)
    results = {name: run(flag, args, os.path.join(args.save_dir, name))
               for name, flag in (('BatchNorm', '--no-syncbn'), ('SyncBatchNorm', '--syncbn'))}

    def median(values):
        return sorted(values)[len(values) // 2]

    images = {r['val_images'] for r in results.values()} | {
        r['train_mode']['images'] for r in results.values()}
    head = ['1 image/device, 4 CPU contexts, %d epochs, %s val images'
            % (args.epochs, '/'.join(map(str, sorted(images)))),
            'val mIoU, saved checkpoint (eval mode)']
    if args.precise_bn:
        head += ['val mIoU, saved checkpoint (eval mode) after precise BN over %d batches'
                 % args.precise_bn]
    head += ['val pixAcc (eval mode%s)' % (', after' if args.precise_bn else ''),
             'val mIoU, saved checkpoint (train mode)', 'eval-mode gap', 'training loss',
             'seconds per epoch (median)']
    if args.precise_bn:
        head += ['seconds of precise BN (median)']
    lines = ['| %s |' % ' | '.join(head), '|' + '---|' * len(head)]
    for name, r in results.items():
        tm = r['train_mode']['miou']
        row = [name, '%.3f' % r.get('miou_before_precise_bn', r['miou'])]
        if args.precise_bn:
            row += ['%.3f' % r['miou']]
        row += ['%.3f' % r['pixacc'], '%.3f' % tm, '%+.3f' % (r['miou'] - tm),
                '%.3f' % r['loss'][-1], '%.1f' % median(r['seconds'])]
        if args.precise_bn:
            row += ['%.1f' % median(r['precise_bn_seconds'])]
        lines.append('| %s |' % ' | '.join(row))
    if args.precise_bn:
        lines.append('\nval mIoU (eval mode) per epoch, before -> after precise BN:')
        for name, r in results.items():
            lines.append('- %s: %s' % (name, ', '.join(
                '%.3f -> %.3f' % pair for pair in zip(r['history_before'], r['history']))))
    json.dump(results, open(os.path.join(args.save_dir, 'compare.json'), 'w'), indent=1)
    open(os.path.join(args.save_dir, 'compare.md'), 'w').write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
