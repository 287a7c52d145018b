"""What synchronizing across processes costs: one process vs dist kvstore vs Horovod.

Every configuration holds 2 devices in all (2 CPU contexts in one process, or
2 workers with one context each). Inside each worker, nn.BatchNorm and
SyncBatchNorm take turns call by call, so each ratio compares timings taken
under the same noise. Two workloads:

* ``call``: forward + backward of one layer on a tiny (2, 8, 4, 4) slice, waited
  for: the fixed cost per synchronized call; beside it the transport's
  *floor*, nn.BatchNorm's call plus the two all-reduces a SyncBatchNorm call
  makes (forward, then backward), of its payload (``native/wire.h``,
  CHECKED: every worker's row, each number as the engine carries it exactly:
  four float32 numbers over the kvstore, one float64 over Horovod);
* ``step``: a training step of the small conv net of ``bench.py`` (4 conv+BN+relu,
  16-64 channels, 32x32, batch 8 per device) with a Trainer.

    python benchmarks/bench_multiprocess.py      # -> results/multiprocess.{md,json}
    python benchmarks/bench_multiprocess.py --baseline ../old-checkout

``--baseline``: also run every configuration with the package of another
checkout (its SyncBatchNorm beside this script's nn.BatchNorm), one after
the other with this one's, for a before/after in one run.

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
    reductions = _reductions(kvstore, devices, cfg) if cfg['workload'] == 'call' else []
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

    def run(net, trainer, xs, reduce=()):
        with autograd.record():
            outs = [net(x) for x in xs]
        autograd.backward(outs)
        for r in reduce:  # as a SyncBatchNorm call waits for each in turn
            r()
            mx.nd.waitall()
        if cfg['workload'] == 'step':
            trainer.step(8 * devices)
        mx.nd.waitall()

    if reductions:
        variants['floor'] = variants['plain'] + (reductions,)
    times = {name: [] for name in variants}
    for i in range(cfg['warmup'] + cfg['steps']):
        for name, variant in variants.items():
            start = time.perf_counter()
            run(*variant)
            if i >= cfg['warmup']:
                times[name].append(time.perf_counter() - start)
    operator = report.operator_of(variants['sync'][0])
    print('RESULT ' + json.dumps({'rank': rank, 'times': times, 'operator': operator}),
          flush=True)


def _reductions(kvstore, devices, cfg, channels=8, workers=2):
    """The two all-reduces of one SyncBatchNorm call's payload (forward and
    backward, ``channels`` channels), as callables, or none in one process."""
    import mxnet as mx
    import numpy as np
    if kvstore is None:
        return []
    float32 = kvstore != 'horovod'  # the kvstore's keys: four float32 numbers per value
    per_value = 4 if float32 else 1
    sizes = [workers * (4 + per_value * (1 + 2 * channels)), workers * (4 + per_value * 2 * channels)]
    dtype = 'float32' if float32 else 'float64'
    arrays = [mx.nd.array(np.zeros(n), dtype=dtype) for n in sizes]
    if kvstore == 'horovod':
        import horovod.mxnet as hvd
        return [lambda a=a, i=i: hvd.allreduce_(a, average=False, name='floor%d' % i)
                for i, a in enumerate(arrays)]
    keys = [900000 + i for i in range(len(arrays))]  # beside the Trainer's and the layers'
    for key, a in zip(keys, arrays):
        kvstore.init(key, a)
    return [lambda key=key, a=a: kvstore.pushpull(key, a, out=a) for key, a in zip(keys, arrays)]


def run_config(cfg, timeout, env=None, tree=ROOT):
    """Run one configuration (a job, or one process) with the package of
    checkout ``tree``; return rank 0's timings."""
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + HERE, BENCH_MP_CFG=json.dumps(cfg),
               **(env or {}))
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
    parser.add_argument('--baseline', default=None,
                        help='another checkout, whose package runs every configuration too')
    report.add_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(os.environ['BENCH_MP_CFG']))
    trees = [('this', ROOT)] + ([('baseline', os.path.abspath(args.baseline))]
                                if args.baseline else [])
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
                for code, tree in trees:
                    cfg = dict(backend=backend, devices=devices, workload=workload,
                               hybridize=hybridize, warmup=10, steps=steps)
                    mode = 'hybridized' if hybridize else 'imperative'
                    try:
                        result = run_config(cfg, timeout=900, env=env, tree=tree)
                    except Exception as exc:  # pylint: disable=broad-except
                        print('skipped %s: %s' % (label, str(exc)[-300:]), file=sys.stderr)
                        skipped.append('%s, %s, %s, %s: %s' % (
                            code, workload, mode, label, str(exc).splitlines()[0][:200]))
                        continue
                    times = result['times']
                    ran.add('%s (%s)' % (result.get('operator'), backend))
                    plain, sync = median(times['plain']) * 1e3, median(times['sync']) * 1e3
                    floor = median(times['floor']) * 1e3 if 'floor' in times else None
                    rows.append((code, workload, mode, label, plain, sync, sync / plain,
                                 '%.2f' % floor if floor else '', '%.2fx' % (sync / floor)
                                 if floor and code == 'this' else ''))
                    raw.append(dict(cfg, code=code, operator=result.get('operator'), env=env,
                                    times=times))
                    print('%-8s %-4s %-10s %-45s plain %7.2f ms  sync %7.2f ms  %.2fx  '
                          'floor %s %s' % rows[-1], flush=True)
    lines = ['Medians of %d steps (x3 for `call`) after 10 warm-up steps; nn.BatchNorm and '
             'SyncBatchNorm alternate within each worker.' % args.steps, '',
             '`call`: one layer, forward + backward on a (2, 8, 4, 4) slice per device, '
             'waited for; its floor is nn.BatchNorm\'s call plus the two all-reduces of the '
             'payload this code sends, one after the other. `step`: a training step of the '
             'small net. In `step` rows across workers the SyncBatchNorm net\'s Trainer also '
             'all-reduces gradients across workers, while the nn.BatchNorm net trains each '
             'worker alone (one kvstore cannot serve two Trainers), so those ratios include '
             'gradient communication.' + (' `baseline`: the package of %s, run beside this '
                                          'one.' % args.baseline if args.baseline else ''), '',
             '| code | workload | mode | setup | nn.BatchNorm ms | SyncBatchNorm ms | ratio | '
             'floor ms | SyncBatchNorm / floor |', '|---|---|---|---|---|---|---|---|---|']
    lines += ['| %s | %s | %s | %s | %.2f | %.2f | %.2fx | %s | %s |' % row for row in rows]
    if skipped:
        lines += ['', 'Skipped:'] + ['- ' + s for s in skipped]
    run.write('Cross-process synchronization cost (bench_multiprocess.py)',
              'gluon_syncbn operator per setup: %s; beside nn.BatchNorm'
              % ', '.join(sorted(ran)), lines, raw,
              ', '.join('%s %s %s %s %.2fx' % (r[0], r[1], r[2][:3], r[3].split(',')[-1].strip(),
                                               r[6]) for r in rows)
              + ('; %d skipped' % len(skipped) if skipped else ''))
    return 0


if __name__ == '__main__':
    sys.exit(main())
