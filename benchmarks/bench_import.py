"""What importing gluon_syncbn, and configuring CPU contexts, costs other code.

Two measurements, each process fresh, with a deadline:

* ``--import``: plain model-zoo ``resnet18_v1`` (no SyncBatchNorm anywhere)
  trained on ONE CPU context, hybridized with static_alloc, in two processes
  that differ only by ``import gluon_syncbn`` at the top: resident memory at
  checkpoints and the time for the steps. Run in turns (A B A B ...) so both
  see the same machine noise; medians of the ratios.
* ``--settings``: resident memory of SyncBatchNorm training on N CPU contexts
  under ``configure_cpu_contexts(N)`` (small net and ResNet-18-like of
  bench.py), against the same net with plain ``nn.BatchNorm`` under MXNet's
  defaults, which is what those contexts would cost without synchronizing.

    python benchmarks/bench_import.py                     # both -> results/import
    python benchmarks/bench_import.py --import            # -> results/import-import
    python benchmarks/bench_import.py --settings          # -> results/import-settings
    python benchmarks/bench_import.py --import --steps 60 # quick

Fewer than 50 steps is a smoke run (see report.py).
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench import run_worker  # noqa: E402
import report  # noqa: E402

MIN_STEPS = 50   # fewer (--import): a smoke run


# ----------------------------------------------------------------- worker side
def one_context_training(cfg):
    """Train ``resnet18_v1`` on cpu(0); RSS (MB) at ``checkpoints`` and seconds per phase."""
    if cfg['import_first']:
        import gluon_syncbn  # noqa: F401  (the only difference)
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon
    import psutil

    size, batch = cfg.get('size', 64), cfg.get('batch', 8)
    net = gluon.model_zoo.vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    net.hybridize(static_alloc=True)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01,
                                                           'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.randn(batch, 3, size, size))
    y = mx.nd.array(rng.randint(0, 10, batch))
    rss, seconds, start = {}, {}, time.perf_counter()
    for step in range(1, cfg['steps'] + 1):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch)
        mx.nd.waitall()
        if step in cfg['checkpoints']:
            rss[step] = psutil.Process().memory_info().rss / 2 ** 20
            seconds[step] = time.perf_counter() - start
    return {'rss_mb': rss, 'seconds': seconds,
            'temp_slots': os.environ.get('MXNET_CPU_TEMP_COPY'),
            'imported': 'gluon_syncbn' in sys.modules}


def settings_memory(cfg):
    """bench.memory_worker, hybridized, 8 images per device; configured only for 'ours'."""
    from bench import memory_worker
    return memory_worker(dict(cfg, hybridize=True, per_device=8, configure=cfg['norm'] == 'ours',
                              size=32 if cfg['arch'] == 'small' else 64))


# ----------------------------------------------------------------- driver side
def in_fresh_process(kind, cfg, timeout):
    """``kind(cfg)`` in a fresh process whose environment sets no MXNet slots."""
    env = {k: v for k, v in os.environ.items()
           if k not in ('MXNET_CPU_TEMP_COPY', 'MXNET_CPU_PARALLEL_RAND_COPY',
                        'GLUON_SYNCBN_CPU_CONTEXTS')}
    result = run_worker(kind, cfg, timeout, module='bench_import', env=env)
    if isinstance(result, str):
        raise RuntimeError('%s %s: %s' % (kind, cfg, result))
    return result


def compare_import(steps, checkpoints, rounds, timeout=1800):
    """Ratios with/without the import: RSS at each checkpoint, time for all steps."""
    cfg = dict(steps=steps, checkpoints=checkpoints)
    runs = {True: [], False: []}
    for _ in range(rounds):
        for imported in (False, True):
            runs[imported].append(in_fresh_process(
                'one_context_training', dict(cfg, import_first=imported), timeout))
    last = str(steps)

    def med(xs):
        return sorted(xs)[len(xs) // 2]
    return {
        'rss_ratio': max(med([w['rss_mb'][str(c)] / wo['rss_mb'][str(c)]
                              for w, wo in zip(runs[True], runs[False])]) for c in checkpoints),
        'time_ratio': med([w['seconds'][last] / wo['seconds'][last]
                           for w, wo in zip(runs[True], runs[False])]),
        'with': runs[True], 'without': runs[False]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--import', dest='do_import', action='store_true')
    parser.add_argument('--settings', action='store_true')
    parser.add_argument('--steps', type=int, default=400, help='--import: steps per process')
    parser.add_argument('--rounds', type=int, default=2)
    report.add_arguments(parser)
    args = parser.parse_args()
    both = not (args.do_import or args.settings)
    name = 'import' + ('' if both else '-import' if args.do_import else '-settings')
    run = report.Run(name, args.out, smoke=(both or args.do_import) and args.steps < MIN_STEPS)
    lines, raw, headline, ran = [], {}, [], set()
    if args.do_import or both:
        checkpoints = sorted({min(50, args.steps), args.steps // 2, args.steps})
        res = compare_import(args.steps, checkpoints, args.rounds)
        raw['import'] = res
        lines += ['One CPU context, model-zoo resnet18_v1, 64x64, batch 8, hybridized '
                  '(static_alloc), %d steps, %d rounds in turns:' % (args.steps, args.rounds), '',
                  '| | RSS MB at steps %s | seconds for %d steps |' % (
                      ' / '.join(map(str, checkpoints)), args.steps), '|---|---|---|']
        for label, key in (('without the import', 'without'), ('with the import', 'with')):
            r = res[key][0]
            lines.append('| %s | %s | %.1f |' % (label, ' / '.join(
                '%.0f' % r['rss_mb'][str(c)] for c in checkpoints), r['seconds'][str(args.steps)]))
        lines += ['', 'with / without, median over rounds: RSS %.3fx (worst checkpoint), '
                  'time %.3fx' % (res['rss_ratio'], res['time_ratio']), '']
        headline.append('import: RSS %.3fx, time %.3fx' % (res['rss_ratio'], res['time_ratio']))
        print('\n'.join(lines), flush=True)
    if args.settings or both:
        lines += ['Resident memory (MB) after 20 / 100 / 200 training steps, hybridized, '
                  '8 images per device, every process fresh: SyncBatchNorm under '
                  '`configure_cpu_contexts(N)` against nn.BatchNorm under MXNet\'s defaults.',
                  '', '| net | N | slots (temp / random) | nn.BatchNorm, defaults | '
                  'SyncBatchNorm, configured | extra |', '|---|---|---|---|---|---|']
        raw['settings'] = []
        for arch in ('small', 'resnet'):
            for n in (2, 4):
                cfg = dict(arch=arch, n=n, steps=200, checkpoints=[20, 100, 200])
                plain = in_fresh_process('settings_memory', dict(cfg, norm='plain'), 3600)
                ours = in_fresh_process('settings_memory', dict(cfg, norm='ours'), 3600)
                ran.add(ours.get('operator'))
                raw['settings'].append({'cfg': cfg, 'plain': plain, 'ours': ours})
                extra = ours['rss_mb']['200'] - plain['rss_mb']['200']
                line = '| %s | %d | %s / %s | %s | %s | %+.0f |' % (
                    arch, n, ours['temp_slots'], ours['random_slots'],
                    ' / '.join('%.0f' % v for v in plain['rss_mb'].values()),
                    ' / '.join('%.0f' % v for v in ours['rss_mb'].values()), extra)
                lines.append(line)
                headline.append('%s N=%d %+.0f MB' % (arch, n, extra))
                print(line, flush=True)
    backends = ('no synchronizing layer (--import: resnet18_v1 with nn.BatchNorm)'
                if not ran else report.backend_text(ran, others=('nn.BatchNorm',)))
    run.write('What importing gluon_syncbn and configuring CPU contexts cost (bench_import.py)',
              backends, lines, raw, '; '.join(headline))


if __name__ == '__main__':
    main()
