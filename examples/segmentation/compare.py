"""Why SyncBN: the same model trained with 1 image per device on 4 CPU contexts,
once with nn.BatchNorm and once with SyncBatchNorm (same seed, data and budget).

    python examples/segmentation/compare.py [--epochs 6] [--save-dir runs/compare]

Reports validation pixAcc/mIoU in eval mode (running statistics, how the model is
deployed) and in train mode (batch statistics), whose difference is the eval-mode
gap. Writes compare.json and compare.md into the save directory.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(norm_flag, args, save_dir):
    cmd = [sys.executable, os.path.join(HERE, 'train.py'), norm_flag, '--num-devices', '4',
           '--batch-size', '4', '--epochs', str(args.epochs), '--seed', str(args.seed),
           '--save-dir', save_dir, '--no-figures']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # evaluate the last checkpoint in train mode too (batch statistics)
    ckpt = os.path.join(save_dir, 'epoch_%04d.params' % args.epochs)
    code = ('import sys, json; sys.path.insert(0, %r); import train; '
            'a = train.parse_args(%r); ctxs = train.contexts(a); '
            'tr, va = train.datasets(a); _, vl = train.loaders(a, tr, va, len(ctxs)); '
            'net = train.build(a, tr.num_classes, ctxs); '
            'print(json.dumps(train.evaluate(net, vl, ctxs, tr.num_classes, train_mode=True)))'
            % (HERE, [norm_flag, '--num-devices', '4', '--batch-size', '4', '--resume', ckpt,
                      '--eval']))
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=args.timeout)
    result['train_mode'] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=6)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--save-dir', default='runs/compare')
    p.add_argument('--timeout', type=int, default=3600)
    args = p.parse_args()
    os.makedirs(args.save_dir, exist_ok=True)
    results = {name: run(flag, args, os.path.join(args.save_dir, name))
               for name, flag in (('BatchNorm', '--no-syncbn'), ('SyncBatchNorm', '--syncbn'))}
    lines = ['| 1 image/device, 4 CPU contexts, %d epochs | val mIoU (eval mode) | val pixAcc '
             '(eval mode) | val mIoU (train mode) | eval-mode gap | training loss | seconds '
             'per epoch (median) |' % args.epochs, '|---|---|---|---|---|---|---|']
    for name, r in results.items():
        tm = r['train_mode'][1]
        lines.append('| %s | %.3f | %.3f | %.3f | %+.3f | %.3f | %.1f |' % (
            name, r['miou'], r['pixacc'], tm, r['miou'] - tm, r['loss'][-1],
            sorted(r['seconds'])[len(r['seconds']) // 2]))
    json.dump(results, open(os.path.join(args.save_dir, 'compare.json'), 'w'), indent=1)
    open(os.path.join(args.save_dir, 'compare.md'), 'w').write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
