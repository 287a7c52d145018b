"""The first synchronized call from one Python thread per device (GluonCV's
parallel_apply), many times over, each run a fresh process.

One-time setup (building and loading the native library, its self-tests, a
layer's group, the exchange path's imperative graphs) is where races live;
the suite runs each case once per backend, this script measures the rates.
Not part of the suite (50 runs per backend take about 10 minutes on 2 cores):

    python -m tests.soak_threads --runs 50
    python -m tests.soak_threads --runs 20 --backends async --devices 2 --fresh-cache

``--fresh-cache``: every run builds the library into an empty cache first
(about 20 s more per run), so the build and the self-tests race too.
Prints one line per backend and a JSON summary line ``SUMMARY {...}``.
"""
import argparse
import collections
import json
import shutil
import sys
import tempfile
import time

from tests.conftest import OPERATOR_PATHS, PATHS, ScenarioFailed, run_scenario

EXACT = 1e-12


def outcome(backend, devices, fresh_cache, timeout):
    """'exact', 'wrong' or the first line of the failure, and the seconds."""
    env = dict(PATHS[backend], GLUON_SYNCBN_TIMEOUT=str(timeout))
    cache = tempfile.mkdtemp() if fresh_cache else None
    if cache:
        env['GLUON_SYNCBN_CACHE'] = cache
    start = time.time()
    try:
        r = run_scenario('gluoncv_threads', timeout=timeout + 120, env=env,
                         num_devices=devices, batch=2 * devices + 1, steps=1)
        worst = max(r['dx'], r['running_mean'], r['running_var'])
        what = 'exact' if worst < EXACT and r['warnings'] == 0 else 'wrong: %r' % r
    except ScenarioFailed as exc:
        lines = [l for l in str(exc).splitlines() if 'Error' in l or 'did not finish' in l]
        what = (lines or str(exc).splitlines() or ['?'])[-1][:200]
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    return what, time.time() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=50)
    parser.add_argument('--backends', nargs='+', default=OPERATOR_PATHS)
    parser.add_argument('--devices', type=int, default=4)
    parser.add_argument('--timeout', type=float, default=60)
    parser.add_argument('--fresh-cache', action='store_true')
    args = parser.parse_args(argv)
    summary = {}
    for backend in args.backends:
        counts, seconds = collections.Counter(), []
        for _ in range(args.runs):
            what, took = outcome(backend, args.devices, args.fresh_cache, args.timeout)
            counts[what] += 1
            seconds.append(took)
        summary[backend] = {'runs': args.runs, 'exact': counts['exact'],
                            'outcomes': dict(counts), 'max_seconds': round(max(seconds), 1)}
        print('%-9s %d/%d exact, slowest run %.1f s; %s' % (
            backend, counts['exact'], args.runs, max(seconds),
            {k: v for k, v in counts.items() if k != 'exact'} or 'no failures'))
        sys.stdout.flush()
    print('SUMMARY ' + json.dumps(summary))


if __name__ == '__main__':
    main()
