"""The path GPUs take, training and inference: time and engine operations
per BN call, ours against MXNet's contrib layer and nn.BatchNorm.

CPU contexts down the GPU path (``GLUON_SYNCBN_BACKEND=exchange``: MXNet's
operators compute the moments, the exchange operator exchanges them; on a
GPU it copies where here it reads in place). bench_overhead.py's stack, 53 x
(conv 1x1 + BN + relu) on (2, 16, 2, 2) per device, in two hybridization
regimes: ``hybridize()`` and ``hybridize(static_alloc=True,
static_shape=True)``. Per (N, regime), one process; in it the three
variants take turns, training steps (forward + backward + waitall) and
inference passes (forward + waitall, predict mode), medians after warm-up
calls in the same mode; then MXNet's profiler counts engine operations per
BN call per device beyond nn.BatchNorm's (counts do not depend on the
hardware).

    python benchmarks/bench_gpu_path.py                  # -> results/gpu-path.md
    python benchmarks/bench_gpu_path.py --repeat 3       # -> results/gpu-path-x3.md
    python benchmarks/bench_gpu_path.py --n 2 --steps 2 --warmup 1 --out /tmp/smoke
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench import run_worker  # noqa: E402
from bench_overhead import LAYERS, engine_operations, stack  # noqa: E402
import report  # noqa: E402

VARIANTS = ('plain', 'contrib', 'ours')
REGIMES = {'hybridize()': {}, 'static_alloc': dict(static_alloc=True, static_shape=True)}
MIN_STEPS = 10


def worker(cfg):
    """Median seconds per training step and per inference pass, and engine
    operations per BN call per device, for every variant of one (N, regime)."""
    import numpy as np
    import gluon_syncbn
    n = cfg['n']
    gluon_syncbn.configure_cpu_contexts(n, temp_slots=cfg['temp_slots'])
    import mxnet as mx
    from mxnet import autograd

    ctxs = [mx.cpu(i) for i in range(n)]

    rng = np.random.RandomState(0)
    xs = [mx.nd.array(rng.randn(2, 16, 2, 2), ctx=c) for c in ctxs]
    steps = {}
    for kind in VARIANTS:
        net = stack(kind, ctxs, cfg['sync_timeout'])
        net.hybridize(**REGIMES[cfg['regime']])

        def train(net=net):
            with autograd.record():
                ys = [net(x) for x in xs]
            autograd.backward(ys)
            mx.nd.waitall()

        def infer(net=net):
            for x in xs:
                net(x)
            mx.nd.waitall()
        steps[kind] = {'train': train, 'infer': infer}
    result = {}
    for mode in ('train', 'infer'):
        times = {kind: [] for kind in VARIANTS}
        for i in range(cfg['warmup'] + cfg['steps']):
            for kind in VARIANTS:  # interleaved: the same noise for all
                t = time.perf_counter()
                steps[kind][mode]()
                if i >= cfg['warmup']:
                    times[kind].append(time.perf_counter() - t)
        ops = {kind: engine_operations(steps[kind][mode]) / (LAYERS * n) for kind in VARIANTS}
        result[mode] = {kind: {'seconds': sorted(ts)[len(ts) // 2],
                               'ops': ops[kind] - ops['plain']} for kind, ts in times.items()}
    return result


def rows(n, regime, res):
    if not isinstance(res, dict):
        return ['| %d | %s | - | %s |' % (n, regime, res)]
    out = []
    for mode in ('train', 'infer'):
        r = res[mode]
        plain, contrib, ours = (r[k]['seconds'] for k in VARIANTS)
        out.append('| %d | %s | %s | %.1f ms | %.1f ms (+%.1f ops) | %.1f ms (+%.1f ops) | '
                   '%.2fx | %.2fx |' % (
                       n, regime, 'training' if mode == 'train' else 'inference',
                       1e3 * plain, 1e3 * contrib, r['contrib']['ops'], 1e3 * ours,
                       r['ours']['ops'], ours / contrib, ours / plain))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--n', type=int, nargs='*', default=[2, 4])
    parser.add_argument('--regimes', nargs='*', default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--warmup', type=int, default=5)
    parser.add_argument('--repeat', type=int, default=1,
                        help='processes per (N, regime): rows each, for the spread')
    parser.add_argument('--temp-slots', type=int, default=4096,
                        help='configure_cpu_contexts(N, temp_slots=...): three such nets '
                             'in one process need more than the default')
    parser.add_argument('--sync-timeout', type=float, default=30.0)
    parser.add_argument('--deadline', type=float, default=300.0, help='per process, seconds')
    report.add_arguments(parser)
    args = parser.parse_args()
    name = 'gpu-path' + ('-x%d' % args.repeat if args.repeat > 1 else '')
    run = report.Run(name, args.out, smoke=args.steps < MIN_STEPS)
    env = dict(os.environ, GLUON_SYNCBN_BACKEND='exchange', GLUON_SYNCBN_DEVICE_PATH='0')
    lines = ['CPU contexts down the GPU path (`GLUON_SYNCBN_BACKEND=exchange`), '
             '`configure_cpu_contexts(N, temp_slots=%d)`. %d x (conv 1x1 + BN + relu) on '
             '(2, 16, 2, 2) per device; training: forward + backward + waitall; inference: '
             'forward in predict mode + waitall; medians of %d interleaved calls after %d warm '
             'ones in the same mode; in brackets the engine operations added per BN call per '
             "device beyond nn.BatchNorm's (MXNet's profiler: operators pushed alone, bulked "
             'segments, engine variables deleted).' % (args.temp_slots, LAYERS, args.steps,
                                                       args.warmup),
             '',
             '| N | regime | mode | nn.BatchNorm | contrib SyncBatchNorm | gluon_syncbn | '
             'ours / contrib | ours / nn.BatchNorm |',
             '|---|---|---|---|---|---|---|---|']
    raw, headline = [], []
    for n in args.n:
        for regime in args.regimes:
            for _ in range(args.repeat):
                cfg = dict(n=n, regime=regime, steps=args.steps, warmup=args.warmup,
                           temp_slots=args.temp_slots, sync_timeout=args.sync_timeout)
                res = run_worker('worker', cfg, args.deadline, module='bench_gpu_path', env=env)
                raw.append(dict(n=n, regime=regime, result=res))
                lines.extend(rows(n, regime, res))
                print('\n'.join(lines[-2:]), flush=True)
                if isinstance(res, dict):
                    headline.append('N=%d %s train %.2fx contrib, infer %.2fx BN' % (
                        n, regime, res['train']['ours']['seconds'] /
                        res['train']['contrib']['seconds'],
                        res['infer']['ours']['seconds'] / res['infer']['plain']['seconds']))
    run.write('The GPU path: training and inference against contrib and nn.BatchNorm '
              '(bench_gpu_path.py)', 'exchange (--backend exchange)', lines, raw,
              'gluon_syncbn ' + ', '.join(headline))


if __name__ == '__main__':
    main()
