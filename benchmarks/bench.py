"""Training-step time of SyncBatchNorm vs nn.BatchNorm and MXNet's contrib SyncBatchNorm.

Each configuration (net, number of CPU contexts, imperative/hybridized) runs in
its own subprocess with a deadline; inside it the variants take turns step by
step, so they share the same machine noise, and we report medians and ratios
to plain nn.BatchNorm measured in the same run. MXNet's contrib layer hangs on
4+ CPU contexts in a Trainer step; there it is only probed, in a separate
process with a deadline.

    python benchmarks/bench.py                 # full table -> benchmarks/results.{md,json}
    python benchmarks/bench.py --quick         # fewer configurations and steps
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


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
    steps = {}
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
        steps[norm] = step
    times = {norm: [] for norm in steps}
    warmup = warm_up(steps.values(), cfg['warmup'], cfg.get('max_warmup', cfg['warmup']),
                     lambda: psutil.Process().memory_info().rss)
    for _ in range(cfg['steps']):
        for norm, step in steps.items():   # interleaved: same noise for all
            t = time.perf_counter()
            step()
            times[norm].append(time.perf_counter() - t)
    return {'times': times, 'rss_mb': psutil.Process().memory_info().rss / 2 ** 20,
            'warmup_steps': warmup}


def warm_up(steps, least, most, rss, window=10, growth=0.01):
    """Run the steps in turn until resident memory is flat; return how many rounds.

    With many temp-space slots (see gluon_syncbn.engine) MXNet keeps growing a
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
    return {'times': times}


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
            'random_slots': os.environ.get('MXNET_CPU_PARALLEL_RAND_COPY')}


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
    parser.add_argument('--out', default=os.path.join(HERE, 'results'))
    parser.add_argument('--only', default='',
                        help='e.g. resnet:3:hybrid,resnet:2:imperative: measure these and '
                             'splice them into the existing --out results')
    parser.add_argument('--overhead-only', action='store_true',
                        help='re-measure the fixed cost into an existing --out')
    parser.add_argument('--memory', action='store_true',
                        help='resident memory after 200 and 2,000 training steps')
    args = parser.parse_args()
    if args.overhead_only:
        return overhead_only(args.out)
    if args.memory:
        for norm in ('ours', 'plain'):  # plain: the same engine settings, no sync
            for hybrid in (False, True):
                res = run_worker('memory_worker', dict(n=2, hybridize=hybrid, steps=2000,
                                                       checkpoints=[200, 1000, 2000],
                                                       norm=norm), 3000)
                print('memory, %s, small net (batch 2 x 16x16 per device), N=2, %s: %s'
                      % (norm, 'hybrid' if hybrid else 'imperative', res))
        return
    steps = args.steps or (10 if args.quick else 30)
    if args.only:
        return only(args, steps)
    raw = {'date': time.strftime('%Y-%m-%d'), 'machine': platform.processor() or
           platform.machine(), 'cpus': os.cpu_count(), 'configs': []}
    for cfg in configurations(args.quick):
        raw['configs'].append(measure(cfg, args, steps))
    raw['overhead'] = run_worker('overhead_worker', {'steps': 200}, timeout=600)
    write(args.out, table_rows(raw), raw['overhead'], raw)


def configurations(quick=False):
    """The configurations of a run, in table order."""
    configs = [dict(arch='small', n=n, hybridize=hybrid)
               for n in ([2, 4] if quick else [1, 2, 3, 4, 8]) for hybrid in (False, True)]
    if not quick:  # the larger net: seconds per step on 2 cores, so fewer cases
        configs += [dict(arch='resnet', n=n, hybridize=hybrid)
                    for hybrid in (True, False) for n in ((2, 3, 4) if hybrid else (2, 3))]
    return configs


def measure(cfg, args, steps):
    """Time one configuration; return its entry for results.json."""
    contrib_ok = cfg['n'] <= 3
    variants = ['plain', 'ours'] + (['contrib'] if contrib_ok else [])
    small = cfg['arch'] == 'small'
    wcfg = dict(cfg, variants=variants, steps=steps if small else steps // 2,
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


def only(args, steps):
    """Measure the ``--only`` configurations and splice them into existing results."""
    raw = json.load(open(args.out + '.json'))
    for spec in args.only.split(','):
        arch, n, mode = spec.split(':')
        cfg = dict(arch=arch, n=int(n), hybridize=mode == 'hybrid')
        entry = measure(cfg, args, steps)
        raw['configs'] = [e for e in raw['configs']
                          if {k: e[k] for k in cfg} != cfg] + [entry]
    order = [tuple(sorted(c.items())) for c in configurations()]
    raw['configs'].sort(key=lambda e: order.index(
        tuple(sorted((k, e[k]) for k in ('arch', 'hybridize', 'n')))))
    write(args.out, table_rows(raw), raw['overhead'], raw)


def table_rows(raw):
    rows = []
    for entry in raw['configs']:
        cfg = {k: entry[k] for k in ('arch', 'n', 'hybridize')}
        res = entry['result']
        rows.append((cfg, res if isinstance(res, str) else summarize(entry)))
    return rows


def overhead_only(out):
    """Re-measure just the fixed cost and splice it into an existing results file."""
    raw = json.load(open(out + '.json'))
    raw['overhead'] = run_worker('overhead_worker', {'steps': 200}, timeout=600)
    write(out, table_rows(raw), raw['overhead'], raw)


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


def write(out, rows, over, raw):
    lines = ['Measured %s on %s (%s CPUs), MXNet 1.9.1 CPU wheel, CPU contexts. Step = '
             'forward + backward + Trainer.step + waitall; medians of interleaved steps, '
             'timed after the warm-up rounds shown (all variants in turn, until resident '
             'memory grew < 1%% over 10 rounds); ratios are to plain nn.BatchNorm (no '
             'synchronization) in the same process.'
             % (raw['date'], raw['machine'], raw['cpus']), '',
             '| net | N | mode | warm-up | nn.BatchNorm ms | ours ms (IQR) | ours / BN '
             '| contrib / BN | RSS MB |',
             '|---|---|---|---|---|---|---|---|---|']
    for cfg, row in rows:
        mode = 'hybrid' if cfg['hybridize'] else 'imperative'
        if isinstance(row, str):
            lines.append('| %s | %d | %s |  | %s |  |  |  |  |' % (cfg['arch'], cfg['n'], mode,
                                                                  row))
            continue
        contrib = ('%.2fx' % row['contrib_x']) if row['contrib_x'] else (
            'hangs' if row['contrib_note'] == 'hang' else str(row['contrib_note']))
        lines.append('| %s | %d | %s | %s | %.1f | %.1f (%.1f) | %.2fx | %s | %.0f |' % (
            cfg['arch'], cfg['n'], mode, row['warmup'], row['plain_ms'], row['ours_ms'],
            row['ours_spread_ms'], row['ours_x'], contrib, row['rss_mb']))
    if isinstance(over, dict):
        lines += ['', 'Fixed cost per layer call (forward + backward) on a (2, 4, 2, 2) input, '
                  'calls on 2 CPU contexts per step (median of 200):', '', '| call | ms |',
                  '|---|---|']
        for name, ts in over['times'].items():
            lines.append('| %s | %.3f |' % (name, 1e3 * median(ts)))
    open(out + '.md', 'w').write('\n'.join(lines) + '\n')
    json.dump(raw, open(out + '.json', 'w'), indent=1)
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
