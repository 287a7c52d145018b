"""What synchronizing across processes costs: one process vs dist kvstore vs Horovod.

Every configuration holds 2 devices in all (2 CPU contexts in one process, or
2 workers with one context each). Inside each worker, nn.BatchNorm and
SyncBatchNorm take turns call by call, so each ratio compares timings taken
under the same noise. Two workloads:

* ``call``: forward + backward of one layer on a tiny (2, 8, 4, 4) slice, waited
  for: the fixed cost per synchronized call;
* ``step``: a training step of the small conv net of ``bench.py`` (4 conv+BN+relu,
  16-64 channels, 32x32, batch 8 per device) with a Trainer.

    python benchmarks/bench_multiprocess.py      # -> results/multiprocess.{md,json}

Fewer than 20 steps is a smoke run (see report.py). A setup that cannot run
(e.g. Horovod not installed) is skipped and named in the results.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench import median  # noqa: E402
import report  # noqa: E402

MIN_STEPS = 20   # fewer: a smoke run


def worker(cfg):
    """Runs inside each process of a configuration; prints one RESULT line."""
    import numpy as np
    import gluon_syncbn
    import mxnet as mx
    from mxnet import autograd, gluon
    from bench import build

    backend, devices = cfg['backend'], cfg['devices']
    gluon_syncbn.configure_cpu_contexts(devices)
    if backend == 'horovod':
        import horovod.mxnet as hvd
        hvd.init()
        kvstore, rank = 'horovod', hvd.rank()
    elif backend == 'dist_sync':
        kvstore = mx.kv.create('dist_sync')
        rank = kvstore.rank
    else:
        kvstore, rank = None, 0
    ctxs = [mx.cpu(i) for i in range(devices)]
    variants = {}
    for norm in ('plain', 'sync'):
        if cfg['workload'] == 'call':
            net = (gluon.nn.BatchNorm(in_channels=8) if norm == 'plain'
                   else gluon_syncbn.SyncBatchNorm(in_channels=8, kvstore=kvstore))
            shape = (2, 8, 4, 4)
        else:
            net = build('small', 'plain', devices)
            if norm == 'sync':
                gluon_syncbn.convert_model(net, kvstore=kvstore)
            shape = (8, 3, 32, 32)
        net.initialize(mx.init.Xavier(), ctx=ctxs)
        if cfg['hybridize']:
            net.hybridize()
        if isinstance(kvstore, mx.kv.KVStore) and norm == 'sync':
            trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01},
                                    kvstore=kvstore, update_on_kvstore=False)
        elif kvstore == 'horovod':
            trainer = hvd.DistributedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.01})
        else:
            trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01})
        xs = [mx.nd.array(np.random.randn(*shape), ctx=c) for c in ctxs]
        variants[norm] = (net, trainer, xs)

    def run(net, trainer, xs):
        with autograd.record():
            outs = [net(x) for x in xs]
        autograd.backward(outs)
        if cfg['workload'] == 'step':
            trainer.step(8 * devices)
        mx.nd.waitall()

    times = {name: [] for name in variants}
    for i in range(cfg['warmup'] + cfg['steps']):
        for name, (net, trainer, xs) in variants.items():
            start = time.perf_counter()
            run(net, trainer, xs)
            if i >= cfg['warmup']:
                times[name].append(time.perf_counter() - start)
    operator = report.operator_of(variants['sync'][0])
    print('RESULT ' + json.dumps({'rank': rank, 'times': times, 'operator': operator}),
          flush=True)


def run_config(cfg, timeout, env=None):
    """Run one configuration (a job, or one process); return rank 0's timings."""
    env = dict(os.environ, PYTHONPATH=ROOT, BENCH_MP_CFG=json.dumps(cfg), **(env or {}))
    if cfg['backend'] == 'local':
        argv = [sys.executable, __file__, '--worker']
    else:
        argv = [sys.executable, '-m', 'gluon_syncbn.launch', '-n', '2', '-s', '1',
                '--backend', 'horovod' if cfg['backend'] == 'horovod' else 'kvstore',
                '--deadline', str(timeout), __file__, '--worker']
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout + 30)
    for line in proc.stdout.splitlines():
        if 'RESULT ' in line:
            result = json.loads(line.split('RESULT ', 1)[1])
            if result['rank'] == 0:
                return result
    raise RuntimeError('configuration %s failed:\n%s' % (cfg, (proc.stdout + proc.stderr)[-3000:]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--steps', type=int, default=100)
    report.add_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(os.environ['BENCH_MP_CFG']))
    run = report.Run('multiprocess', args.out, smoke=args.steps < MIN_STEPS)
    setups = [('local', 2, 'one process, 2 CPU contexts', {}),
              ('dist_sync', 1, "2 workers x 1 context, kvstore 'dist_sync'", {}),
              ('horovod', 1, '2 workers x 1 context, Horovod (Gloo)', {}),
              ('horovod', 1, '2 workers x 1 context, Horovod (Gloo), HOROVOD_CYCLE_TIME=0.1',
               {'HOROVOD_CYCLE_TIME': '0.1'})]
    rows, raw, skipped, ran = [], [], [], set()
    for workload, steps in (('call', args.steps * 3), ('step', args.steps)):
        for hybridize in (False, True):
            for backend, devices, label, env in setups:
                cfg = dict(backend=backend, devices=devices, workload=workload,
                           hybridize=hybridize, warmup=10, steps=steps)
                try:
                    result = run_config(cfg, timeout=900, env=env)
                except Exception as exc:  # pylint: disable=broad-except
                    print('skipped %s: %s' % (label, str(exc)[-300:]), file=sys.stderr)
                    skipped.append('%s, %s, %s: %s' % (workload, 'hybridized' if hybridize
                                                       else 'imperative', label,
                                                       str(exc).splitlines()[0][:200]))
                    continue
                times = result['times']
                ran.add('%s (%s)' % (result.get('operator'), backend))
                plain, sync = median(times['plain']) * 1e3, median(times['sync']) * 1e3
                rows.append((workload, 'hybridized' if hybridize else 'imperative', label,
                             plain, sync, sync / plain))
                raw.append(dict(cfg, operator=result.get('operator'), env=env, times=times))
                print('%-4s %-10s %-45s plain %7.2f ms  sync %7.2f ms  %.2fx' % rows[-1],
                      flush=True)
    lines = ['Medians of %d steps (x3 for `call`) after 10 warm-up steps; nn.BatchNorm and '
             'SyncBatchNorm alternate within each worker.' % args.steps, '',
             '`call`: one layer, forward + backward on a (2, 8, 4, 4) slice per device, '
             'waited for. `step`: a training step of the small net. In `step` rows across '
             'workers the SyncBatchNorm net\'s Trainer also all-reduces gradients across '
             'workers, while the nn.BatchNorm net trains each worker alone (one kvstore '
             'cannot serve two Trainers), so those ratios include gradient communication.', '',
             '| workload | mode | setup | nn.BatchNorm ms | SyncBatchNorm ms | ratio |',
             '|---|---|---|---|---|---|']
    lines += ['| %s | %s | %s | %.2f | %.2f | %.2fx |' % row for row in rows]
    if skipped:
        lines += ['', 'Skipped:'] + ['- ' + s for s in skipped]
    run.write('Cross-process synchronization cost (bench_multiprocess.py)',
              'gluon_syncbn operator per setup: %s; beside nn.BatchNorm'
              % ', '.join(sorted(ran)), lines, raw,
              ', '.join('%s %s %s %.2fx' % (r[0], r[1][:3], r[2].split(',')[-1].strip(), r[5])
                        for r in rows) + ('; %d skipped' % len(skipped) if skipped else ''))
    return 0


if __name__ == '__main__':
    sys.exit(main())
