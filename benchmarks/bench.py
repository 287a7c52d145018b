"""Training-step time of SyncBatchNorm vs nn.BatchNorm and MXNet's contrib SyncBatchNorm.

Each configuration (net, number of CPU contexts, imperative/hybridized) runs in
its own subprocess with a deadline; inside it the variants take turns step by
step, so they share the same machine noise, and we report medians and ratios
to plain nn.BatchNorm measured in the same run. MXNet's contrib layer hangs on
4+ CPU contexts in a Trainer step; there it is only probed, in a separate
process with a deadline.

    python benchmarks/bench.py                 # full table -> results/bench.{md,json}
    python benchmarks/bench.py --quick         # fewer configurations -> results/bench-quick
    python benchmarks/bench.py --only resnet:2:hybrid,small:2:imperative  # -> results/bench-only
    python benchmarks/bench.py --fixed-cost    # cost per layer call -> results/bench-fixed-cost
    python benchmarks/bench.py --memory        # RSS over 2,000 steps -> results/bench-memory

Fewer than 5 steps is a smoke run (see report.py).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import report  # noqa: E402

MIN_STEPS = 5   # fewer: a smoke run


# ----------------------------------------------------------------- worker side
def build(arch, norm, n):
    import mxnet as mx  # noqa: F401
    from mxnet import gluon
    from gluon_syncbn import SyncBatchNorm

    def bn():
        if norm == 'plain':
            return gluon.nn.BatchNorm()
        if norm == 'contrib':
            return gluon.contrib.nn.SyncBatchNorm(num_devices=n)
        return SyncBatchNorm()

    net = gluon.nn.HybridSequential()
    if arch == 'small':   # 4 x (conv, BN, relu), 16-64 channels
        for width in (16, 32, 64, 64):
            net.add(gluon.nn.Conv2D(width, 3, padding=1, use_bias=False), bn(),
                    gluon.nn.Activation('relu'))
    else:                 # ResNet-18-like: stem + 4 stages of 2 basic blocks
        net.add(gluon.nn.Conv2D(32, 3, padding=1, use_bias=False), bn(), gluon.nn.Activation('relu'))
        for width, stride in ((32, 1), (64, 2), (128, 2), (256, 2)):
            for i in range(2):
                net.add(ResBlock(width, stride if i == 0 else 1, bn))
    net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(10))
    return net


def ResBlock(width, stride, bn):
    from mxnet import gluon

    class Block(gluon.HybridBlock):
        def __init__(self):
            super(Block, self).__init__()
            with self.name_scope():
                self.body = gluon.nn.HybridSequential()
                self.body.add(gluon.nn.Conv2D(width, 3, stride, 1, use_bias=False), bn(),
                              gluon.nn.Activation('relu'),
                              gluon.nn.Conv2D(width, 3, 1, 1, use_bias=False), bn())
                self.down = gluon.nn.HybridSequential()
                self.down.add(gluon.nn.Conv2D(width, 1, stride, use_bias=False), bn())

        def hybrid_forward(self, F, x):
            return F.relu(self.body(x) + self.down(x))
    return Block()


def worker(cfg):
    import numpy as np
    import gluon_syncbn
    import mxnet as mx
    from mxnet import autograd, gluon
    import psutil

    n, arch, hybrid = cfg['n'], cfg['arch'], cfg['hybridize']
    gluon_syncbn.configure_cpu_contexts(n)  # all variants alike: same engine settings
    ctxs = [mx.cpu(i) for i in range(n)]
    size = 32 if arch == 'small' else 64
    per_device = cfg.get('per_device', 8)
    rng = np.random.RandomState(0)
    steps, nets = {}, {}
    for norm in cfg['variants']:
        net = build(arch, norm, n)
        net.initialize(mx.init.Xavier(), ctx=ctxs)
        if hybrid:
            net.hybridize(static_alloc=True)
        trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01, 'momentum': 0.9})
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        xs = [mx.nd.array(rng.randn(per_device, 3, size, size), ctx=c) for c in ctxs]
        ys = [mx.nd.array(rng.randint(0, 10, per_device), ctx=c) for c in ctxs]

        def step(net=net, trainer=trainer, loss_fn=loss_fn, xs=xs, ys=ys):
            with autograd.record():
                losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
            autograd.backward(losses)
            trainer.step(per_device * n)
            mx.nd.waitall()
        steps[norm], nets[norm] = step, net
    times = {norm: [] for norm in steps}
    warmup = warm_up(steps.values(), cfg['warmup'], cfg.get('max_warmup', cfg['warmup']),
                     lambda: psutil.Process().memory_info().rss)
    for _ in range(cfg['steps']):
        for norm, step in steps.items():   # interleaved: same noise for all
            t = time.perf_counter()
            step()
            times[norm].append(time.perf_counter() - t)
    return {'times': times, 'rss_mb': psutil.Process().memory_info().rss / 2 ** 20,
            'warmup_steps': warmup, 'operator': report.operator_of(nets['ours'])
            if 'ours' in nets else None}


def warm_up(steps, least, most, rss, window=10, growth=0.01):
    """Run the steps in turn until resident memory is flat; return how many rounds.

    With many temp-space slots (see gluon_syncbn.cpu_contexts) MXNet keeps growing a
    slot's buffer the first times it is handed a larger request: until every
    slot has its buffer, steps pay page faults in proportion to how many
    temp-space operators they run. Steady-state training is what users run for
    thousands of steps, so we time it: after ``least`` rounds, and once memory
    grew less than ``growth`` over the last ``window`` rounds (at most ``most``).
    """
    history = []
    for i in range(most):
        for step in steps:
            step()
        history.append(rss())
        if i + 1 >= least and len(history) > window and \
                history[-1] <= history[-1 - window] * (1 + growth):
            return i + 1
    return most


def overhead_worker(cfg):
    """Fixed cost per layer call (forward+backward) on a tiny tensor: each
    measured step calls the layer once on each of 2 CPU contexts."""
    import numpy as np
    import gluon_syncbn
    import mxnet as mx
    from mxnet import autograd, gluon
    from gluon_syncbn import SyncBatchNorm

    gluon_syncbn.configure_cpu_contexts(2)

    class Nop(mx.operator.CustomOp):
        def forward(self, is_train, req, in_data, out_data, aux):
            self.assign(out_data[0], req[0], in_data[0])

        def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
            self.assign(in_grad[0], req[0], out_grad[0])

    @mx.operator.register('bench_nop')
    class NopProp(mx.operator.CustomOpProp):
        def __init__(self):
            super(NopProp, self).__init__(need_top_grad=True)

        def infer_shape(self, s):
            return s, [s[0]], []

        def create_operator(self, ctx, shapes, dtypes):
            return Nop()

    ctxs = [mx.cpu(0), mx.cpu(1)]
    xs = [mx.nd.array(np.random.randn(2, 4, 2, 2), ctx=c) for c in ctxs]
    for x in xs:
        x.attach_grad()
    layers = {'nn.BatchNorm': gluon.nn.BatchNorm(in_channels=4),
              'SyncBatchNorm': SyncBatchNorm(in_channels=4),
              'contrib SyncBatchNorm': gluon.contrib.nn.SyncBatchNorm(in_channels=4,
                                                                      num_devices=2)}
    for layer in layers.values():
        layer.initialize(ctx=ctxs)
    calls = {name: (lambda x, layer=layer: layer(x)) for name, layer in layers.items()}
    calls['do-nothing custom op'] = lambda x: mx.nd.Custom(x, op_type='bench_nop')
    times = {name: [] for name in calls}
    for i in range(cfg['steps'] + 20):
        for name, call in calls.items():
            t = time.perf_counter()
            with autograd.record():
                ys = [call(x) for x in xs]
            autograd.backward(ys)
            mx.nd.waitall()
            if i >= 20:
                times[name].append((time.perf_counter() - t) / len(xs))
    return {'times': times,
            'operator': report.operator_of(layers['SyncBatchNorm'])}


def memory_worker(cfg):
    """Resident memory (MB) of a training loop at ``checkpoints`` (steps).

    ``norm`` as in build(); ``arch`` (default 'small'), ``per_device`` images
    of ``size`` x ``size`` (default 2 of 16x16); ``configure=False`` leaves
    MXNet's engine settings at their defaults.
    """
    import numpy as np
    import gluon_syncbn
    if cfg.get('configure', True):
        gluon_syncbn.configure_cpu_contexts(cfg['n'])
    import mxnet as mx
    from mxnet import autograd, gluon
    import psutil

    ctxs = [mx.cpu(i) for i in range(cfg['n'])]
    net = build(cfg.get('arch', 'small'), cfg.get('norm', 'ours'), cfg['n'])
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    if cfg['hybridize']:
        net.hybridize(static_alloc=True)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(0)
    per_device, size = cfg.get('per_device', 2), cfg.get('size', 16)
    rss = {}
    for step in range(1, cfg['steps'] + 1):
        xs = [mx.nd.array(rng.randn(per_device, 3, size, size), ctx=c) for c in ctxs]
        ys = [mx.nd.array(rng.randint(0, 10, per_device), ctx=c) for c in ctxs]
        with autograd.record():
            losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(per_device * len(ctxs))
        mx.nd.waitall()
        if step in cfg['checkpoints']:
            rss[step] = psutil.Process().memory_info().rss / 2 ** 20
    return {'rss_mb': rss, 'temp_slots': os.environ.get('MXNET_CPU_TEMP_COPY'),
            'random_slots': os.environ.get('MXNET_CPU_PARALLEL_RAND_COPY'),
            'operator': report.operator_of(net)}


# ----------------------------------------------------------------- driver side
def run_worker(kind, cfg, timeout, module='bench', env=None):
    """``module.kind(cfg)`` in a fresh process (environment ``env``, default ours).

    Returns its result, 'hang' past ``timeout`` seconds, or 'error: <cause>'.
    """
    code = ('import json, sys; sys.path.insert(0, %r); sys.path.insert(0, %r); import %s; '
            'print("RESULT " + json.dumps(%s.%s(json.loads(sys.argv[1]))))'
            % (ROOT, HERE, module, module, kind))
    try:
        out = subprocess.run([sys.executable, '-c', code, json.dumps(cfg)], capture_output=True,
                             text=True, timeout=timeout, cwd=HERE, env=env)
    except subprocess.TimeoutExpired:
        return 'hang'
    for line in out.stdout.splitlines():
        if line.startswith('RESULT '):
            return json.loads(line[7:])
    # Our own cause (appended to MXNet's generic custom-op error) says most.
    lines = ([l for l in out.stderr.splitlines() if l.startswith('SyncBatchNorm')] or
             [l for l in out.stderr.splitlines() if 'Error' in l] or
             out.stderr.strip().splitlines() or ['?'])
    return 'error: ' + lines[-1][:300]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def spread(xs):
    xs = sorted(xs)
    return xs[(3 * len(xs)) // 4] - xs[len(xs) // 4]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true')
    parser.add_argument('--steps', type=int, default=None)
    parser.add_argument('--warmup', type=int, default=3, help='warm-up rounds, at least')
    parser.add_argument('--no-steady', dest='steady', action='store_false',
                        help='time right after --warmup rounds, without waiting for '
                             'resident memory to stop growing')
    parser.add_argument('--only', default='',
                        help='e.g. resnet:3:hybrid,resnet:2:imperative: measure only these '
                             '(a run of its own: results/bench-only)')
    parser.add_argument('--fixed-cost', '--overhead-only', dest='fixed_cost',
                        action='store_true',
                        help='only the fixed cost per layer call (results/bench-fixed-cost)')
    parser.add_argument('--memory', action='store_true',
                        help='resident memory after 200, 1,000 and 2,000 training steps '
                             '(results/bench-memory)')
    report.add_arguments(parser)
    args = parser.parse_args()
    steps = args.steps or (10 if args.quick else 30)
    if args.fixed_cost:
        return fixed_cost(args, steps)
    if args.memory:
        return memory(args, steps)
    if args.only:
        configs = [dict(arch=arch, n=int(n), hybridize=mode == 'hybrid') for arch, n, mode in
                   (spec.split(':') for spec in args.only.split(','))]
        name = 'bench-only'
    else:
        configs, name = configurations(args.quick), 'bench-quick' if args.quick else 'bench'
    run = report.Run(name, args.out, smoke=steps < MIN_STEPS)
    raw = {'steps': steps, 'configs': [measure(cfg, args, steps) for cfg in configs]}
    if not args.only:
        raw['overhead'] = run_worker('overhead_worker', {'steps': 200}, timeout=600)
    write(run, raw)


def configurations(quick=False):
    """The configurations of a run, in table order."""
    configs = [dict(arch='small', n=n, hybridize=hybrid)
               for n in ([2, 4] if quick else [1, 2, 3, 4, 8]) for hybrid in (False, True)]
    if not quick:  # the larger net: seconds per step on 2 cores, so fewer cases
        configs += [dict(arch='resnet', n=n, hybridize=hybrid)
                    for hybrid in (True, False) for n in ((2, 3, 4) if hybrid else (2, 3))]
    return configs


def measure(cfg, args, steps):
    """Time one configuration; return its entry for the results' json."""
    contrib_ok = cfg['n'] <= 3
    variants = ['plain', 'ours'] + (['contrib'] if contrib_ok else [])
    small = cfg['arch'] == 'small'
    wcfg = dict(cfg, variants=variants, steps=steps if small else max(1, steps // 2),
                warmup=args.warmup, max_warmup=(150 if small else 60) if args.steady else
                args.warmup)
    entry = dict(cfg, result=run_worker('worker', wcfg, timeout=1200))
    if not contrib_ok:
        probe = run_worker('worker', dict(cfg, variants=['contrib'], steps=2, warmup=1), 90)
        entry['contrib_probe'] = probe if isinstance(probe, str) else 'ran'
    res = entry['result']
    print(cfg, res if isinstance(res, str) else
          {k: (round(v, 2) if isinstance(v, float) else v) for k, v in summarize(entry).items()},
          flush=True)
    return entry


def fixed_cost(args, steps):
    """Only the fixed cost per layer call (``--fixed-cost``)."""
    run = report.Run('bench-fixed-cost', args.out, smoke=steps < MIN_STEPS)
    over = run_worker('overhead_worker', {'steps': 200 if args.steps is None else steps},
                      timeout=600)
    lines = fixed_cost_lines(over)
    ours = over['times'].get('SyncBatchNorm') if isinstance(over, dict) else None
    run.write('Fixed cost per layer call (bench.py --fixed-cost)',
              report.backend_text([over.get('operator')] if isinstance(over, dict) else []),
              lines or ['failed: %s' % over], over,
              'SyncBatchNorm %.3f ms per call' % (1e3 * median(ours)) if ours else str(over))


def memory(args, steps):
    """Resident memory of long runs (``--memory``), ours and plain under the same settings."""
    total = 2000 if args.steps is None else steps
    run = report.Run('bench-memory', args.out, smoke=total < 200)
    checkpoints = sorted({min(200, total), total // 2, total})
    lines = ['Small net, batch 2 x 16x16 per device, N = 2, every process fresh, both under '
             '`configure_cpu_contexts(2)`; resident MB after %s steps.'
             % ' / '.join(map(str, checkpoints)), '',
             '| layer | imperative | hybridized |', '|---|---|---|']
    raw, ran, cells = [], set(), {}
    for norm, label in (('ours', 'gluon_syncbn'), ('plain', 'plain `nn.BatchNorm`')):
        for hybrid in (False, True):
            res = run_worker('memory_worker', dict(n=2, hybridize=hybrid, steps=total,
                                                   checkpoints=checkpoints, norm=norm), 3000)
            raw.append(dict(norm=norm, hybridize=hybrid, result=res))
            if isinstance(res, dict):
                if norm == 'ours':
                    ran.add(res.get('operator'))
                mb = [res['rss_mb'][str(c)] for c in checkpoints]
                cells[norm, hybrid] = '%s (%+.1f%%)' % (' / '.join('%.1f' % v for v in mb),
                                                        100 * (mb[-1] / mb[0] - 1))
            else:
                cells[norm, hybrid] = res
        lines.append('| %s | %s | %s |' % (label, cells[norm, False], cells[norm, True]))
        print(lines[-1], flush=True)
    run.write('Resident memory over a long run (bench.py --memory)',
              report.backend_text(ran, others=('nn.BatchNorm',)), lines, raw,
              'RSS MB, gluon_syncbn imperative %s, hybridized %s; nn.BatchNorm %s, %s' % (
                  cells['ours', False], cells['ours', True], cells['plain', False],
                  cells['plain', True]))


def table_rows(raw):
    rows = []
    for entry in raw['configs']:
        cfg = {k: entry[k] for k in ('arch', 'n', 'hybridize')}
        res = entry['result']
        rows.append((cfg, res if isinstance(res, str) else summarize(entry)))
    return rows


def summarize(entry):
    """One table row (medians, ratios to plain BN) from a configuration's raw result."""
    res = entry['result']
    t = res['times']
    base = median(t['plain'])
    return {'plain_ms': 1e3 * base, 'ours_ms': 1e3 * median(t['ours']),
            'ours_x': median(t['ours']) / base, 'ours_spread_ms': 1e3 * spread(t['ours']),
            'contrib_x': (median(t['contrib']) / base) if 'contrib' in t else None,
            'contrib_note': entry.get('contrib_probe'), 'rss_mb': res['rss_mb'],
            'warmup': res.get('warmup_steps')}


def fixed_cost_lines(over):
    if not isinstance(over, dict):
        return []
    lines = ['Fixed cost per layer call (forward + backward) on a (2, 4, 2, 2) input, calls '
             'on 2 CPU contexts per step (median of %d):' % len(next(iter(
                 over['times'].values()))), '', '| call | ms |', '|---|---|']
    for name, ts in over['times'].items():
        lines.append('| %s | %.3f |' % (name, 1e3 * median(ts)))
    return lines


def write(run, raw):
    lines = ['CPU contexts. Step = forward + backward + Trainer.step + waitall; medians of %d '
             'interleaved steps (half on the resnet net), timed after the warm-up rounds '
             'shown (all variants in turn, until resident memory grew < 1%% over 10 rounds); '
             'ratios are to plain nn.BatchNorm (no synchronization) in the same process. '
             'N contexts share the machine\'s cores: read the ratios.' % raw['steps'], '',
             '| net | N | mode | warm-up | nn.BatchNorm ms | ours ms (IQR) | ours / BN '
             '| contrib / BN | RSS MB |',
             '|---|---|---|---|---|---|---|---|---|']
    ran, headline = set(), []
    for (cfg, row), entry in zip(table_rows(raw), raw['configs']):
        mode = 'hybrid' if cfg['hybridize'] else 'imperative'
        if isinstance(row, str):
            lines.append('| %s | %d | %s |  | %s |  |  |  |  |' % (cfg['arch'], cfg['n'], mode,
                                                                  row))
            headline.append('%s N=%d %s %s' % (cfg['arch'], cfg['n'], mode[:3], row[:40]))
            continue
        ran.add(entry['result'].get('operator'))
        contrib = ('%.2fx' % row['contrib_x']) if row['contrib_x'] else (
            'hangs' if row['contrib_note'] == 'hang' else str(row['contrib_note']))
        lines.append('| %s | %d | %s | %s | %.1f | %.1f (%.1f) | %.2fx | %s | %.0f |' % (
            cfg['arch'], cfg['n'], mode, row['warmup'], row['plain_ms'], row['ours_ms'],
            row['ours_spread_ms'], row['ours_x'], contrib, row['rss_mb']))
        headline.append('%s N=%d %s %.2fx' % (cfg['arch'], cfg['n'], mode[:3], row['ours_x']))
    over = raw.get('overhead')
    if over is not None:
        lines += [''] + (fixed_cost_lines(over) or ['Fixed cost per layer call: %s' % over])
        if isinstance(over, dict):
            ran.add(over.get('operator'))
            headline.append('fixed cost %.3f ms' % (1e3 * median(over['times']['SyncBatchNorm'])))
    run.write('Training steps (bench.py)', report.backend_text(ran), lines, raw,
              'ours / nn.BatchNorm: ' + ', '.join(headline))


if __name__ == '__main__':
    main()
