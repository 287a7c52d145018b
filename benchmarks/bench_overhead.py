"""Host cost of a synchronized BN call: a deep net on tiny tensors.

On GPUs the arithmetic runs on the devices; what is left on the host is the
cost of issuing and synchronizing every BN call on every device. This measures
that regime on CPU contexts: 53 x (conv 1x1 + BN + relu), a ResNet-50-deep
stack, on (2, 16, 2, 2) per device, forward + backward, with plain
``nn.BatchNorm`` (the floor), MXNet's ``contrib.nn.SyncBatchNorm`` and
gluon_syncbn's ``SyncBatchNorm``. Each (N, mode) runs in its own process with
a deadline; the variants there take turns step by step, and each is reported
as a ratio to plain in that process, and as milliseconds added per BN call per
device: ``(t - t_plain) / (53 * N)``. A variant that hangs or fails is retried
alone beside plain in a fresh process, so the others still get their numbers.

    python benchmarks/bench_overhead.py                     # N = 2, 4, 8 -> results/overhead-async
    python benchmarks/bench_overhead.py --n 8 --temp-slots 4096   # -> results/overhead-async-n8
    python benchmarks/bench_overhead.py --n 2 --backend exchange  # -> results/overhead-exchange-n2
    python benchmarks/bench_overhead.py --n 2 --steps 2 --warmup 1 --out /tmp/smoke  # smoke
    python benchmarks/bench_overhead.py --modes hybridized --repeat 3   # the spread, 3 processes each
    python benchmarks/bench_overhead.py --backend exchange --count-ops  # + engine operations
    python benchmarks/bench_overhead.py --backend exchange --graph-only  # + the graph alone

``--backend`` picks gluon_syncbn's backend (the result file is named by it;
the header says which ran): ``async`` (the default) is what CPU contexts run;
``exchange`` runs CPU contexts down the path GPUs take (MXNet's operators
compute the local moments, and the exchange operator exchanges the vectors):
the host cost of the GPU path. ``--graph-only`` adds a fourth variant: the GPU
path's graph of MXNet operators around the exchange operator (moments,
normalization), the exchange replaced by a slice and a reshape (timing only,
not normalizing); its cost beside gluon_syncbn's separates the graph's share
from the exchange operator's. ``--n`` other than the default adds
``-n<N>[-<N>...]`` to the file name. Fewer than 10 steps is a smoke run
(see report.py).
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench import run_worker  # noqa: E402
import report  # noqa: E402

LAYERS = 53
VARIANTS = ('plain', 'contrib', 'ours')
DEFAULT_N = [2, 4, 8]
MODES = ['hybridized', 'imperative']
# --backend -> the settings that select it on CPU contexts
BACKEND = {'async': dict(GLUON_SYNCBN_BACKEND='async', GLUON_SYNCBN_DEVICE_PATH='0'),
           'exchange': dict(GLUON_SYNCBN_BACKEND='exchange', GLUON_SYNCBN_DEVICE_PATH='0')}
MIN_STEPS = 10   # fewer: a smoke run


# ----------------------------------------------------------------- worker side
def worker(cfg):
    """Median step time (s) per variant for one (N, mode)."""
    import numpy as np
    import gluon_syncbn
    n = cfg['n']
    # every variant under the same settings
    gluon_syncbn.configure_cpu_contexts(n, temp_slots=cfg.get('temp_slots'))
    import mxnet as mx
    from mxnet import autograd

    ctxs = [mx.cpu(i) for i in range(n)]

    steps, nets = {}, {}
    rng = np.random.RandomState(0)
    for kind in cfg['variants']:
        net = stack(kind, ctxs, cfg['sync_timeout'])
        if cfg['hybridize']:
            net.hybridize(static_alloc=True, static_shape=True)
        xs = [mx.nd.array(rng.randn(2, 16, 2, 2), ctx=c) for c in ctxs]

        def step(net=net, xs=xs):
            with autograd.record():
                ys = [net(x) for x in xs]
            autograd.backward(ys)
            mx.nd.waitall()
        steps[kind], nets[kind] = step, net
    times = {kind: [] for kind in steps}
    for i in range(cfg['warmup'] + cfg['steps']):
        for kind, step in steps.items():   # interleaved: same noise for all
            t = time.perf_counter()
            step()
            if i >= cfg['warmup']:
                times[kind].append(time.perf_counter() - t)
    res = {kind: sorted(ts)[len(ts) // 2] for kind, ts in times.items()}
    if 'ours' in nets:
        res['operator'] = report.operator_of(nets['ours'])
    if cfg.get('count_ops'):
        res['ops'] = {kind: engine_operations(step) / (LAYERS * n)
                      for kind, step in steps.items()}
    return res


def stack(kind, ctxs, sync_timeout):
    """The benchmark's network, LAYERS x (conv 1x1 + BN + relu) with the BN
    layer of variant ``kind``, initialized on ``ctxs`` (not hybridized)."""
    import mxnet as mx
    from mxnet import gluon
    net = gluon.nn.HybridSequential()
    for _ in range(LAYERS):
        net.add(gluon.nn.Conv2D(16, 1, use_bias=False, in_channels=16),
                norm_layer(kind, len(ctxs), sync_timeout), gluon.nn.Activation('relu'))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    return net


def norm_layer(kind, n, sync_timeout):
    """The BN layer of variant ``kind`` for the stack on ``n`` devices."""
    import gluon_syncbn
    from mxnet import gluon
    if kind == 'plain':
        return gluon.nn.BatchNorm(in_channels=16)
    if kind == 'contrib':
        return gluon.contrib.nn.SyncBatchNorm(in_channels=16, num_devices=n)
    if kind == 'graph':
        return _graph_only(16)
    return gluon_syncbn.SyncBatchNorm(in_channels=16, timeout=sync_timeout)


def _graph_only(channels):
    """A block running the operators of ``ExchangeBackend._graph`` (backends/vector_graph.py)
    with the exchange operator replaced by a slice and a reshape: their host
    cost, for timing only (its output is not normalized)."""
    from mxnet import gluon

    class GraphOnly(gluon.HybridBlock):
        def __init__(self):
            super(GraphOnly, self).__init__()
            self.gamma = self.params.get('gamma', shape=(channels,), init='ones')
            self.beta = self.params.get('beta', shape=(channels,), init='zeros')

        def hybrid_forward(self, F, x, gamma, beta):  # pylint: disable=arguments-differ
            m1 = F.mean(F.BlockGrad(x), axis=1, exclude=True, keepdims=True)
            xc = F.broadcast_sub(x, m1)
            m2 = F.mean(xc, axis=1, exclude=True)
            v = F.mean(F.square(xc), axis=1, exclude=True)
            packed = F.concat(F.reshape(m1, shape=(-1,)), m2, v, gamma, beta, dim=0)
            halves = F.reshape(F.slice_axis(packed, axis=0, begin=0, end=2 * channels),
                               shape=(2, 1, channels, 1, 1))
            scale, shift = F.split(halves, num_outputs=2, axis=0, squeeze_axis=True)
            return F.reshape_like(F.broadcast_add(F.broadcast_mul(xc, scale), shift), x)
    return GraphOnly()


def engine_operations(step, steps=3):
    """Engine operations per step of ``step``, counted by MXNet's profiler:
    each operator pushed alone, each bulked segment, each engine variable
    deleted, each operation our operators push."""
    import json
    from mxnet import profiler
    profiler.set_config(profile_all=True, aggregate_stats=True, filename=os.devnull)
    profiler.set_state('run')
    for _ in range(steps):
        step()
    profiler.set_state('stop')
    stats = json.loads(profiler.dumps(reset=True, format='json'))
    return sum(s['Count'] for s in stats['Time'].get('operator', {}).values()) / steps


# ----------------------------------------------------------------- driver side
def measure(n, hybridize, args):
    """Median step times for every variant of one (N, mode), or why there are none."""
    cfg = dict(n=n, hybridize=hybridize, steps=args.steps, warmup=args.warmup,
               sync_timeout=args.sync_timeout,
               variants=list(VARIANTS) + (['graph'] if args.graph_only else []),
               temp_slots=args.temp_slots, count_ops=args.count_ops)
    env = dict(os.environ, **BACKEND[args.backend])
    res = run_worker('worker', cfg, args.deadline, module='bench_overhead', env=env)
    if isinstance(res, dict):
        return res
    # Something hung or failed: each synchronized variant alone beside plain.
    found = {'first try': res}
    for kind in cfg['variants'][1:]:
        alone = run_worker('worker', dict(cfg, variants=['plain', kind]), args.deadline,
                           module='bench_overhead', env=env)
        if isinstance(alone, dict):
            found.setdefault('plain', alone['plain'])
            found[kind + '_vs_plain'] = alone[kind] / alone['plain']
            found[kind] = alone[kind] * found['plain'] / alone['plain']
            if kind == 'ours':
                found['operator'] = alone.get('operator')
        else:
            found[kind] = alone
    return found


def row(n, hybridize, res):
    mode = 'hybridized' if hybridize else 'imperative'
    plain = res.get('plain')
    cells = []
    kinds = ('contrib', 'ours') + (('graph',) if 'graph' in res else ())
    for kind in kinds:
        t = res.get(kind)
        if isinstance(t, float) and isinstance(plain, float):
            cells.append('%.1f ms (%.2fx, +%.3f ms/call)' % (
                1e3 * t, t / plain, 1e3 * (t - plain) / (LAYERS * n)))
        else:
            cells.append(str(t if t is not None else res.get('first try')))
    ours, contrib = res.get('ours'), res.get('contrib')
    versus = ('%.2fx' % (ours / contrib) if isinstance(ours, float) and
              isinstance(contrib, float) else '-')
    ops = res.get('ops')
    if ops:  # engine operations per BN call per device, beyond plain's
        cells = ['%s, +%.1f ops' % (cell, ops[kind] - ops['plain']) if kind in ops else cell
                 for cell, kind in zip(cells, kinds)]
    columns = [str(n), mode, '%.1f ms' % (1e3 * plain) if isinstance(plain, float) else '-',
               cells[0], cells[1], versus] + cells[2:]
    return '| %s |' % ' | '.join(columns)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--n', type=int, nargs='*', default=DEFAULT_N)
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--warmup', type=int, default=5)
    parser.add_argument('--sync-timeout', type=float, default=30.0,
                        help="gluon_syncbn's timeout: how soon a deadlock is reported")
    parser.add_argument('--deadline', type=float, default=240.0, help='per process, seconds')
    parser.add_argument('--backend', default='async', choices=sorted(BACKEND),
                        help="gluon_syncbn's backend; exchange: CPU contexts down the "
                             "GPU path")
    parser.add_argument('--modes', nargs='*', default=MODES, choices=MODES)
    parser.add_argument('--repeat', type=int, default=1,
                        help='processes per (N, mode): a row each, for the spread between them')
    parser.add_argument('--count-ops', action='store_true',
                        help='also count engine operations per BN call per device with '
                             "MXNet's profiler (3 more steps per variant, after the timing)")
    parser.add_argument('--graph-only', action='store_true',
                        help="also time the GPU path's graph without its exchange operator "
                             '(timing only; see the docstring)')
    parser.add_argument('--temp-slots', type=int, default=None,
                        help='configure_cpu_contexts(N, temp_slots=...): the default '
                             '(1024 at N = 8) is too few for three such nets in one process')
    report.add_arguments(parser)
    args = parser.parse_args()
    name = 'overhead-' + args.backend
    if args.n != DEFAULT_N:
        name += '-n' + '-'.join(map(str, args.n))
    if args.modes != MODES:
        name += '-' + '-'.join(args.modes)
    if args.repeat > 1:
        name += '-x%d' % args.repeat
    if args.graph_only:
        name += '-graph'
    run = report.Run(name, args.out, smoke=args.steps < MIN_STEPS)
    lines = ['CPU contexts, every process under `configure_cpu_contexts(N%s)`. %d x (conv 1x1 + '
             'BN + relu) on (2, 16, 2, 2) per device, forward + backward + waitall, medians of '
             '%d interleaved steps after %d warm-up steps; in brackets: ratio to plain '
             'nn.BatchNorm in the same process, and milliseconds added per BN call per device%s.'
             % (', temp_slots=%d' % args.temp_slots if args.temp_slots else '', LAYERS,
                args.steps, args.warmup,
                ' and engine operations added per BN call per device (MXNet\'s profiler: '
                'operators pushed alone, bulked segments, engine variables deleted)'
                if args.count_ops else ''),
             '',
             '| N | mode | nn.BatchNorm | contrib SyncBatchNorm | gluon_syncbn | ours / contrib |'
             + (' graph only |' if args.graph_only else ''),
             '|---|---|---|---|---|---|' + ('---|' if args.graph_only else '')]
    raw, ran, headline = [], set(), []
    runs = [(n, mode == 'hybridized') for n in args.n for mode in args.modes
            for _ in range(args.repeat)]
    for n, hybridize in runs:
        res = measure(n, hybridize, args)
        raw.append(dict(n=n, hybridize=hybridize, result=res))
        if res.get('operator'):
            ran.add(res['operator'])
        lines.append(row(n, hybridize, res))
        print(lines[-1], flush=True)
        ours, plain = res.get('ours'), res.get('plain')
        headline.append('N=%d %s %s' % (n, 'hyb' if hybridize else 'imp', (
            '%+.3f ms/call' % (1e3 * (ours - plain) / (LAYERS * n))
            if isinstance(ours, float) and isinstance(plain, float) else str(ours)[:40])))
    run.write('Host cost per BN call: %d-layer stack on tiny tensors (bench_overhead.py)'
              % LAYERS, report.backend_text(ran) + ' (--backend %s)' % args.backend,
              lines, raw, 'gluon_syncbn ' + ', '.join(headline))


if __name__ == '__main__':
    main()
