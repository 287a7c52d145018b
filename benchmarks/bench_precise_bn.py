"""What precise BN costs: ``gluon_syncbn.update_bn_stats`` per batch against
the same network's training-mode forward pass (what a hand-written loop
over the batches would run), for SyncBatchNorm and nn.BatchNorm.

bench_overhead.py's stack, 53 x (conv 1x1 + BN + relu) on (2, 16, 2, 2) per
device, hybridized (``hybridize()``). Per (N, backend), one process; in it,
for each layer kind, ``update_bn_stats`` over ``--batches`` batches takes
turns with as many training-mode forward passes without recording (the
graph, and imperatively), ``waitall`` after each; medians per batch after
warm-up rounds. ``update_bn_stats`` runs a SyncBatchNorm network through
its graph, and an nn.BatchNorm one imperatively (a forward pre-hook per
layer must see its input), so the floor is the graph's pass for one and the
imperative pass for the other.

    python benchmarks/bench_precise_bn.py                    # -> results/precise-bn.md
    python benchmarks/bench_precise_bn.py --n 2 --rounds 2 --warmup 1 --out /tmp/smoke
"""
import argparse
import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench import run_worker  # noqa: E402
from bench_overhead import LAYERS, stack  # noqa: E402
import report  # noqa: E402

KINDS = ('plain', 'ours')
BACKENDS = {'async': 'CPU contexts (async)', 'exchange': 'the GPU path (exchange)'}
MIN_ROUNDS = 5


def worker(cfg):
    """Median seconds per batch of each (layer kind, way of running)."""
    import numpy as np
    import gluon_syncbn
    n = cfg['n']
    gluon_syncbn.configure_cpu_contexts(n, temp_slots=cfg['temp_slots'])
    import mxnet as mx
    from mxnet import autograd

    ctxs = [mx.cpu(i) for i in range(n)]
    rng = np.random.RandomState(0)
    batches = [[mx.nd.array(rng.randn(2, 16, 2, 2), ctx=c) for c in ctxs]
               for _ in range(cfg['batches'])]
    runs = {}
    for kind in KINDS:
        net = stack(kind, ctxs, cfg['sync_timeout'])
        net.hybridize()

        def forward(net=net, imperative=False):
            way = gluon_syncbn.hooks.imperatively(net) if imperative else contextlib.nullcontext()
            with way, autograd.pause(train_mode=True):
                for xs in batches:
                    for x in xs:
                        net(x)
            mx.nd.waitall()

        def precise(net=net):
            gluon_syncbn.update_bn_stats(net, batches, len(batches), progress=False)

        runs[kind] = {'graph': forward, 'imperative': lambda f=forward: f(imperative=True),
                      'update_bn_stats': precise}
    times = {(k, w): [] for k in KINDS for w in runs[KINDS[0]]}
    for i in range(cfg['warmup'] + cfg['rounds']):
        for (kind, way), ts in times.items():  # interleaved: the same noise for all
            t = time.perf_counter()
            runs[kind][way]()
            if i >= cfg['warmup']:
                ts.append((time.perf_counter() - t) / len(batches))
    return {'%s %s' % key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}


def rows(n, backend, res):
    if not isinstance(res, dict):
        return ['| %d | %s | %s |' % (n, BACKENDS[backend], res)]
    out = []
    for kind, name in (('ours', 'SyncBatchNorm'), ('plain', 'nn.BatchNorm')):
        graph, imp, precise = (res['%s %s' % (kind, w)]
                               for w in ('graph', 'imperative', 'update_bn_stats'))
        out.append('| %d | %s | %s | %.1f ms | %.1f ms | %.1f ms | %.2fx | %.2fx |' % (
            n, BACKENDS[backend], name, 1e3 * graph, 1e3 * imp, 1e3 * precise,
            precise / graph, precise / imp))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--n', type=int, nargs='*', default=[2, 4])
    parser.add_argument('--backends', nargs='*', default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument('--batches', type=int, default=10)
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--temp-slots', type=int, default=4096)
    parser.add_argument('--sync-timeout', type=float, default=30.0)
    parser.add_argument('--deadline', type=float, default=600.0, help='per process, seconds')
    report.add_arguments(parser)
    args = parser.parse_args()
    run = report.Run('precise-bn', args.out, smoke=args.rounds < MIN_ROUNDS)
    lines = ['`configure_cpu_contexts(N, temp_slots=%d)`. %d x (conv 1x1 + BN + relu) on '
             '(2, 16, 2, 2) per device, `hybridize()`; per batch: the training-mode forward '
             'pass without recording through the graph and imperatively, and '
             '`update_bn_stats`, each over %d batches then '
             '`waitall`; medians of %d interleaved rounds after %d warm ones.' % (
                 args.temp_slots, LAYERS, args.batches, args.rounds, args.warmup),
             '',
             '| N | path | layer | forward (graph) | forward (imperative) | update_bn_stats | '
             '/ graph | / imperative |',
             '|---|---|---|---|---|---|---|---|']
    raw, headline = [], []
    for n in args.n:
        for backend in args.backends:
            env = dict(os.environ, GLUON_SYNCBN_BACKEND=backend, GLUON_SYNCBN_DEVICE_PATH='0')
            cfg = dict(n=n, batches=args.batches, rounds=args.rounds, warmup=args.warmup,
                       temp_slots=args.temp_slots, sync_timeout=args.sync_timeout)
            res = run_worker('worker', cfg, args.deadline, module='bench_precise_bn', env=env)
            raw.append(dict(n=n, backend=backend, result=res))
            lines.extend(rows(n, backend, res))
            print('\n'.join(lines[-2:]), flush=True)
            if isinstance(res, dict):
                headline.append('N=%d %s %.2fx the graph pass' % (
                    n, backend, res['ours update_bn_stats'] / res['ours graph']))
    run.write('Precise BN: update_bn_stats against forward passes (bench_precise_bn.py)',
              ', '.join(args.backends), lines, raw, 'gluon_syncbn ' + ', '.join(headline))


if __name__ == '__main__':
    main()
