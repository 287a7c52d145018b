"""Where a SyncBatchNorm call spends its time: the layer and its pieces on one
(8, 64, 32, 32) tensor, forward + backward unless marked, one CPU context.

    python benchmarks/profile_layer.py              # -> results/profile_layer.{md,json}
    python benchmarks/profile_layer.py --runs 2 --out /tmp/profile   # smoke

Medians of ``--runs`` timed runs after 5 untimed ones; fewer than 10 is a
smoke run (see report.py).
"""
import argparse
import os
import sys
import time

import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

gluon_syncbn.configure_cpu_contexts(2)
RUNS = {'n': 30}
TIMES = {}


def bench(name, f, grad=True):
    n = RUNS['n']
    ts = []
    for i in range(n + 5):
        t = time.perf_counter()
        if grad:
            with autograd.record():
                y = f()
            y.backward()
        else:
            f()
        mx.nd.waitall()
        if i >= 5:
            ts.append(time.perf_counter() - t)
    TIMES[name] = ts
    print('%-48s %7.2f ms' % (name, 1e3 * sorted(ts)[len(ts) // 2]), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=30)
    report.add_arguments(parser)
    args = parser.parse_args()
    RUNS['n'] = args.runs
    run = report.Run('profile_layer', args.out, smoke=args.runs < 10)
    ctxs = [mx.cpu(0), mx.cpu(1)]
    x = mx.nd.array(np.random.randn(8, 64, 32, 32))
    x.attach_grad()
    c = mx.nd.array(np.random.randn(1, 64, 1, 1))
    bn = mx.gluon.nn.BatchNorm(in_channels=64)
    bn.initialize()
    sync = gluon_syncbn.SyncBatchNorm(in_channels=64)
    sync.initialize(ctx=ctxs)
    x2 = [x.copyto(ctx) for ctx in ctxs]

    def sync_call():  # one call per context; report per call
        outs = [sync(a) for a in x2]
        return outs[0] + outs[1].as_in_context(ctxs[0])

    bench('nn.BatchNorm', lambda: bn(x))
    bench('SyncBatchNorm, 2 contexts (both calls)', sync_call)
    bench('mean over (0,2,3), forward only', lambda: mx.nd.mean(x, axis=1, exclude=True,
                                                               keepdims=True), grad=False)
    bench('broadcast_sub, forward only', lambda: mx.nd.broadcast_sub(x, c), grad=False)
    bench('broadcast_sub, forward + backward', lambda: mx.nd.broadcast_sub(x, c))
    bench('square, forward only', lambda: mx.nd.square(x), grad=False)
    bench('sum over last axis of (N, C, HW), forward only',
          lambda: mx.nd.sum(x.reshape((0, 0, -1)), axis=2), grad=False)
    g, b = mx.nd.ones(64), mx.nd.zeros(64)
    mm, mv = mx.nd.zeros(64), mx.nd.ones(64)
    bench('BatchNorm(use_global_stats), forward only',
          lambda: mx.nd.BatchNorm(x, g, b, mm, mv, use_global_stats=True), grad=False)
    med = {name: 1e3 * sorted(ts)[len(ts) // 2] for name, ts in TIMES.items()}
    lines = ['One (8, 64, 32, 32) float32 tensor, forward + backward unless marked, '
             'medians of %d runs in ms; SyncBatchNorm on 2 CPU contexts (both calls).'
             % args.runs, '', '| call | ms |', '|---|---|']
    lines += ['| %s | %.2f |' % kv for kv in med.items()]
    run.write('Where a SyncBatchNorm call spends its time (profile_layer.py)',
              report.backend_text([report.operator_of(sync)], others=('nn.BatchNorm',)),
              lines, TIMES, 'nn.BatchNorm %.2f ms, SyncBatchNorm pair %.2f ms' % (
                  med['nn.BatchNorm'], med['SyncBatchNorm, 2 contexts (both calls)']))


if __name__ == '__main__':
    main()
