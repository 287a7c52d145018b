"""Long static-graph training on CPU contexts: no stall, no slow-down.

Static graphs keep the temp-space slot of their first call; from one pool
shared by every CPU context, each turn of the pool would hand a held slot to
another device and training would stall (docs/findings.md, "Static graphs
stalled every N/K steps"), hence a pool per context
(``native/cpu_resources.h``). This trains model-zoo ``resnet18_v1`` through
``convert_model`` on N CPU contexts for ``--steps`` steps in each mode:
``static_shape`` (``static_alloc=True, static_shape=True``, which stalled) and
``static_alloc`` alone (the baseline, which never did), each in a fresh
process with a deadline, so that a stall is reported with the step it
stopped at. Per mode: steps completed, median step time over the first,
middle and last 100 steps, the slowest step, running statistics across
devices, and device 0's statistics and weights against the baseline's.

    python benchmarks/bench_static_long.py              # N = 2 -> results/static-long
    python benchmarks/bench_static_long.py --n 4        # -> results/static-long-n4
    python benchmarks/bench_static_long.py --steps 20 --out /tmp/smoke   # smoke

Fewer than 300 steps (three disjoint windows of 100) is a smoke run (see report.py).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402

MODES = {'static_shape': dict(static_alloc=True, static_shape=True),
         'static_alloc': dict(static_alloc=True)}
DEFAULT_MODES = ['static_shape', 'static_alloc']   # the last: the baseline
PER_DEVICE = 2
WINDOW = 100
MIN_STEPS = 3 * WINDOW


# ----------------------------------------------------------------- worker side
def worker(cfg):
    """Train one mode: ``STEP k`` after each step (where a killed run stopped),
    device 0's parameters saved to ``cfg['save']``, ``RESULT <json>`` (step times)."""
    import time
    import numpy as np
    import gluon_syncbn
    n = cfg['n']
    gluon_syncbn.configure_cpu_contexts(n)   # before MXNet's first operator
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.gluon.model_zoo import vision

    mx.random.seed(1)
    np.random.seed(1)
    ctxs = [mx.cpu(i) for i in range(n)]
    net = gluon_syncbn.convert_model(vision.resnet18_v1(classes=10), timeout=cfg['sync_timeout'])
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    net.hybridize(**MODES[cfg['mode']])
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.05, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(0)   # the same batches in every mode
    batch = PER_DEVICE * n
    res = dict(times=[], cpu=[], stopped=None)
    for step in range(1, cfg['steps'] + 1):
        xs = gluon.utils.split_and_load(mx.nd.array(rng.randn(batch, 3, 32, 32)), ctxs)
        ys = gluon.utils.split_and_load(mx.nd.array(rng.randint(0, 10, batch)), ctxs)
        start, cpu = time.perf_counter(), time.process_time()   # all threads' CPU time
        try:
            with autograd.record():
                losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
            autograd.backward(losses)
            trainer.step(batch)
            for loss in losses:
                loss.asnumpy()
        except Exception as err:  # noqa: BLE001 -- a stall surfaces as the layer's timeout
            res['stopped'] = 'error in step %d: %s' % (step, str(err).strip().split('. ')[0][:200])
            break
        res['times'].append(time.perf_counter() - start)
        res['cpu'].append(time.process_time() - cpu)
        print('STEP %d' % step, flush=True)
    res['operator'] = report.operator_of(net)
    if res['stopped'] is None:
        mx.nd.waitall()  # the last backward's running-statistics update (CPU contexts)
        params = net.collect_params()
        res['replica_spread'] = max(float(np.abs(p.data(c).asnumpy() - p.data(ctxs[0]).asnumpy())
                                          .max()) for name, p in params.items()
                                    if 'running_' in name for c in ctxs)
        np.savez(cfg['save'], **{name: p.data(ctxs[0]).asnumpy() for name, p in params.items()})
    print('RESULT ' + json.dumps(res), flush=True)
    os._exit(0)   # after a failed step MXNet's engine threads may never let the process exit


# ----------------------------------------------------------------- driver side
def run(cfg, deadline):
    """``worker(cfg)`` in a fresh process: its result, or where and why it stopped."""
    code = ('import json, sys; sys.path.insert(0, %r); import bench_static_long; '
            'bench_static_long.worker(json.loads(sys.argv[1]))' % HERE)
    with tempfile.TemporaryFile('w+') as log:
        proc = subprocess.Popen([sys.executable, '-c', code, json.dumps(cfg)], stdout=log,
                                stderr=subprocess.STDOUT, text=True, cwd=HERE)
        try:
            why = 'exit %d' % proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            why = 'killed at the %.0f s deadline' % deadline
        log.seek(0)
        lines = log.read().splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith('RESULT ')]
    if results:
        return results[0]
    done = ([0] + [int(line[5:]) for line in lines if line.startswith('STEP ')])[-1]
    last = [': ' + line[:200] for line in lines if not line.startswith('STEP ')][-1:]
    return dict(times=[None] * done, stopped='%s in step %d%s' % (why, done + 1, ''.join(last)))


def median(xs):
    return sorted(xs)[len(xs) // 2]


def row(mode, res, base, steps):
    """The table's row for one mode, and its headline for history.md."""
    done = '%d of %d' % (len(res['times']), steps)
    ms = [1e3 * t for t in res['times'] if t is not None]
    if res['stopped'] or not ms:
        return '| %s | %s (%s) |%s' % (mode, done, res['stopped'], ' - |' * 7), \
            '%s %s, %s' % (mode, done, res['stopped'][:80])
    mid = len(ms) // 2
    windows = [median(ms[:WINDOW]), median(ms[max(0, mid - WINDOW // 2):mid + WINDOW // 2]),
               median(ms[-WINDOW:])]
    slowest = max(range(1, len(ms)), key=ms.__getitem__) if len(ms) > 1 else 0
    spread = res['replica_spread']
    cells = [mode, done] + ['%.0f ms' % t for t in windows] + [
        '%.2fx' % (windows[2] / windows[0]), '%.0f ms (step %d)' % (ms[slowest], slowest + 1),
        'identical' if spread == 0 else 'max abs diff %.3g' % spread, '-']
    if 'vs_baseline' in res:
        diff = res['vs_baseline']
        cells[-1] = '%.2fx time, %.2fx CPU; stats %s; weights %s' % (
            (median(res['times']) / median(base['times']), median(res['cpu']) / median(base['cpu']))
            + tuple('bit-identical' if diff[k] == 0 else 'max abs diff %.3g' % diff[k]
                    for k in ('stats', 'weights')))
    headline = '%s %s steps, %s ms' % (mode, done, '/'.join('%.0f' % t for t in windows))
    return '| %s |' % ' | '.join(cells), headline + (', ' + cells[-1] if cells[-1] != '-' else '')


def compare(path, base_path):
    """Max abs difference of device 0's running statistics and of its weights."""
    import numpy as np
    a, b = np.load(path), np.load(base_path)
    diff = {'stats': 0.0, 'weights': 0.0}
    for key in a.files:
        kind = 'stats' if 'running_' in key else 'weights'
        diff[kind] = max(diff[kind], float(np.abs(a[key] - b[key]).max()))
    return diff


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--n', type=int, default=2, help='CPU contexts')
    parser.add_argument('--steps', type=int, default=1000, help='training steps per mode')
    parser.add_argument('--modes', nargs='+', default=DEFAULT_MODES, choices=sorted(MODES),
                        help='the last is the baseline the others are compared with')
    parser.add_argument('--sync-timeout', type=float, default=60.0,
                        help="the layers' timeout: how soon a stall is reported")
    parser.add_argument('--deadline', type=float, default=None,
                        help='per mode, seconds (default: 120 + 2 per step)')
    report.add_arguments(parser)
    args = parser.parse_args()
    name = 'static-long' + ('-n%d' % args.n if args.n != 2 else '') + (
        '-' + '-'.join(args.modes) if args.modes != DEFAULT_MODES else '')
    out = report.Run(name, args.out, smoke=args.steps < MIN_STEPS)
    base = args.modes[-1]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            cfg = dict(n=args.n, mode=mode, steps=args.steps, sync_timeout=args.sync_timeout,
                       save=os.path.join(tmp, mode + '.npz'))
            results[mode] = run(cfg, args.deadline or 120 + 2.0 * args.steps)
            print(mode, results[mode]['stopped'] or 'completed', flush=True)
        for mode in args.modes[:-1]:
            if not results[mode]['stopped'] and not results[base]['stopped']:
                results[mode]['vs_baseline'] = compare(*(os.path.join(tmp, m + '.npz')
                                                         for m in (mode, base)))
    rows = [row(mode, results[mode], results[base], args.steps) for mode in args.modes]
    lines = ['`resnet18_v1` (10 classes), `convert_model(timeout=%g)`, %d CPU contexts '
             '(`configure_cpu_contexts(%d)`), %d images of 32x32 per device, SGD with momentum; '
             'a step: forward + backward + `Trainer.step` + the loss read with `asnumpy`. '
             'Against %s (same seeds and batches): ratios of the median step times and CPU '
             "times (the process's, all threads), and max abs difference of device 0's running "
             'statistics and weights after the last step. The modes run one after the other: '
             "a change in the machine's load between them shows in the time ratio, less in the "
             'CPU ratio.' % (args.sync_timeout, args.n, args.n, PER_DEVICE, base), '',
             '| mode | steps | median first %d | median middle %d | median last %d | last / first '
             '| slowest after step 1 | running stats across devices | vs %s |'
             % (WINDOW, WINDOW, WINDOW, base), '|---|---|---|---|---|---|---|---|---|']
    lines += [line for line, _ in rows]
    out.write('Long static-graph training on CPU contexts (bench_static_long.py)',
              report.backend_text([r.get('operator') for r in results.values()], others=()),
              lines, [dict(mode=m, **r) for m, r in results.items()],
              '; '.join(headline for _, headline in rows))


if __name__ == '__main__':
    main()
