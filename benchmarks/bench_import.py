"""What importing gluon_syncbn, and configuring CPU contexts, costs other code.

Two measurements, each process fresh, with a deadline:

* ``--import``: plain model-zoo ``resnet18_v1`` (no SyncBatchNorm anywhere)
  trained on ONE CPU context, hybridized with static_alloc, in two processes
  that differ only by ``import gluon_syncbn`` at the top: resident memory at
  checkpoints and the time for the steps. Run in turns (A B A B ...) so both
  see the same machine noise; medians of the ratios.
* ``--calls``: a small conv + ``nn.BatchNorm`` network (no SyncBatchNorm)
  on one CPU context, hybridized and imperative, with and without the
  import, in fresh processes in turns: the first training call's time and
  the time per training and per predict call after it (each call waited
  for, so Python's own work shows); medians of the ratios.
* ``--settings``: resident memory of SyncBatchNorm training on N CPU contexts
  under ``configure_cpu_contexts(N)`` (small net and ResNet-18-like of
  bench.py), against the same net with plain ``nn.BatchNorm`` under MXNet's
  defaults, which is what those contexts would cost without synchronizing.

    python benchmarks/bench_import.py                     # both -> results/import
    python benchmarks/bench_import.py --import            # -> results/import-import
    python benchmarks/bench_import.py --settings          # -> results/import-settings
    python benchmarks/bench_import.py --import --steps 60 # quick
    python benchmarks/bench_import.py --calls             # -> results/import-calls

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


def bn_calls(cfg):
    """Seconds of the first training call and per call after it (training
    and predict) of a small conv + nn.BatchNorm network on cpu(0)."""
    if cfg['import_first']:
        import gluon_syncbn  # noqa: F401  (the only difference)
    import mxnet as mx
    from mxnet import autograd
    from mxnet.gluon import nn

    class Residual(nn.HybridBlock):
        def __init__(self, channels, **kwargs):
            super(Residual, self).__init__(**kwargs)
            with self.name_scope():
                self.body = nn.HybridSequential()
                self.body.add(nn.Conv2D(channels, 3, padding=1, use_bias=False),
                              nn.BatchNorm(), nn.Activation('relu'),
                              nn.Conv2D(channels, 3, padding=1, use_bias=False),
                              nn.BatchNorm())

        def hybrid_forward(self, F, x):
            return F.relu(x + self.body(x))

    net = nn.HybridSequential()
    net.add(nn.Conv2D(8, 3, padding=1, use_bias=False), nn.BatchNorm(), nn.Activation('relu'))
    for _ in range(cfg.get('blocks', 4)):
        net.add(Residual(8))
    net.add(nn.GlobalAvgPool2D(), nn.Dense(10))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    if cfg['hybridize']:
        net.hybridize()
    x = mx.nd.random.uniform(shape=(2, 3, 8, 8))
    mx.nd.waitall()

    def train():
        with autograd.record():
            out = net(x)
        out.backward()
        mx.nd.waitall()

    def predict():
        net(x).wait_to_read()

    start = time.perf_counter()
    train()
    first = time.perf_counter() - start
    predict()
    found = {'first': first}
    for name, call in (('train', train), ('predict', predict)):
        start = time.perf_counter()
        for _ in range(cfg['calls']):
            call()
        found[name] = (time.perf_counter() - start) / cfg['calls']
    if cfg['import_first']:
        # Python functions of the package a call runs (hooks included): what
        # the timings cannot resolve on a shared machine, counted.
        package = os.path.dirname(sys.modules['gluon_syncbn'].__file__)
        for name, call in (('train', train), ('predict', predict)):
            count = [0]

            def profile(frame, event, arg, count=count):
                if event == 'call' and frame.f_code.co_filename.startswith(package):
                    count[0] += 1
            sys.setprofile(profile)
            call()
            sys.setprofile(None)
            found['package_calls_' + name] = count[0]
    return found


def compare_calls(calls, rounds, timeout=600):
    """Per mode (hybridized, imperative): with/without the import, median
    ratios of the first call and of the time per training and predict call."""
    found = {}
    for hybridize in (True, False):
        runs = {True: [], False: []}
        for _ in range(rounds):
            for imported in (False, True):
                runs[imported].append(in_fresh_process(
                    'bn_calls', dict(calls=calls, hybridize=hybridize, import_first=imported),
                    timeout))

        def med(xs):
            return sorted(xs)[len(xs) // 2]
        found['hybridized' if hybridize else 'imperative'] = {
            'ratio': {k: med([w[k] / wo[k] for w, wo in zip(runs[True], runs[False])])
                      for k in ('first', 'train', 'predict')},
            'without': {k: med([r[k] for r in runs[False]]) for k in ('first', 'train', 'predict')},
            'with': {k: med([r[k] for r in runs[True]]) for k in ('first', 'train', 'predict',
                                                                  'package_calls_train',
                                                                  'package_calls_predict')},
            'runs': runs}
    return found


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
    parser.add_argument('--calls', action='store_true')
    parser.add_argument('--calls-per-process', type=int, default=300,
                        help='--calls: timed calls of each kind per process')
    parser.add_argument('--steps', type=int, default=400, help='--import: steps per process')
    parser.add_argument('--rounds', type=int, default=2)
    report.add_arguments(parser)
    args = parser.parse_args()
    if args.calls:
        run = report.Run('import-calls', args.out, smoke=args.calls_per_process < MIN_STEPS)
        res = compare_calls(args.calls_per_process, max(args.rounds, 3))
        lines = ['One CPU context, conv + nn.BatchNorm network (9 BatchNorm layers, 4 residual '
                 'blocks), 2x3x8x8 input, every call waited for; each number the median over '
                 'fresh processes in turns:', '',
                 '| mode | first training call, ms (without / with) | training call, ms | '
                 'predict call, ms | with / without: first, training, predict | '
                 'package functions run per training / predict call |',
                 '|---|---|---|---|---|---|']
        for mode, r in res.items():
            lines.append('| %s | %.1f / %.1f | %.3f / %.3f | %.3f / %.3f | %.3fx, %.3fx, %.3fx '
                         '| %d / %d |' % (
                             mode, 1e3 * r['without']['first'], 1e3 * r['with']['first'],
                             1e3 * r['without']['train'], 1e3 * r['with']['train'],
                             1e3 * r['without']['predict'], 1e3 * r['with']['predict'],
                             r['ratio']['first'], r['ratio']['train'], r['ratio']['predict'],
                             r['with']['package_calls_train'],
                             r['with']['package_calls_predict']))
        print('\n'.join(lines), flush=True)
        run.write('What importing gluon_syncbn costs a network of nn.BatchNorm only, per call '
                  '(bench_import.py --calls)', 'no synchronizing layer (nn.BatchNorm only)',
                  lines, res, '; '.join('%s: first %.3fx, training %.3fx, predict %.3fx' % (
                      m, r['ratio']['first'], r['ratio']['train'], r['ratio']['predict'])
                      for m, r in res.items()))
        return
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
