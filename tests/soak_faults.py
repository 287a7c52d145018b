"""Every fault scenario of the suite on every operator path, many times over.

How often does a failing step crash the process, hang it, or end with a
wrong message or a wrong next step? The suite runs each fault once per path
and never retries, so a rare crash shows up there as a flaky failure; this
script measures the rates. Not part of the suite (200 runs of everything take
about an hour on 2 cores):

    python -m tests.soak_faults --runs 200
    python -m tests.soak_faults --runs 20 --paths async exchange --cases user_code_raises

Runs go in batches of ``--batch`` repetitions per process (a crash loses the
rest of its batch, which is run again). Prints one line per (path, case) and
a JSON summary line ``SUMMARY {...}``.
"""
import argparse
import json
import re
import sys
import time

from tests.conftest import OPERATOR_PATHS, PATHS, ScenarioFailed, run_batch

RECOVERED = 1e-5
LAYER = re.compile(r"SyncBatchNorm 'syncbatchnorm\d+'")
MISSING_TIMEOUT = 0.5  # seconds: the missing-device case waits this long each run


def _problems(checks):
    return [what for what, ok in checks if not ok]


def check_missing(r):
    return _problems([
        ('layer named', LAYER.search(r['message'] or '')),
        # cpu(2) never calls; under load a slow device may miss the short
        # timeout too, and is rightly named beside it.
        ('missing device named', re.search(r'missing: [^.]*cpu\(2\)', r['message'] or '')),
        ('waited the timeout, not longer', 0.75 * MISSING_TIMEOUT < r['seconds'] < 30),
        ('next step exact', r['recovered'] < RECOVERED)])


def check_bad_input(expected):
    def check(r):
        return _problems([
            ('layer named', LAYER.search(r['message'] or '')),
            ('cause named', expected in (r['message'] or '')),
            ('fast', r['seconds'] < 10),
            ('next step exact', r['recovered'] < RECOVERED)])
    return check


def check_user_code(r):
    return _problems([
        ("user's exception", r['type'] == 'ValueError'),
        ('issued calls failed at once', r['drain_seconds'] < 10),
        ('layer named', LAYER.search(r['drain_message'] or '')),
        ('cause named', 'abandoned' in (r['drain_message'] or '')),
        ('next step exact', r['recovered'] < RECOVERED)])


def check_all_empty(r):
    return _problems([
        ('cause named', "every device's slice of this batch is empty" in (r['message'] or '')),
        ('layer named', LAYER.search(r['message'] or '')),
        ('next step exact', r['recovered'] < RECOVERED)])


def check_abandoned(r):
    return _problems([
        ("every device's output raised", r['raised'] == r['outputs']),
        ('layer named', r['named'] == r['outputs']),
        ('next step exact', r['recovered'] < RECOVERED)])


# id: (scenario, kwargs, check): the fault cases of test_faults.py and
# test_empty_slices.py that synchronize (the others fail before any call).
CASES = {}
for _hybridize in (False, True):
    _mode = 'hybridized' if _hybridize else 'imperative'
    CASES['missing_device-' + _mode] = (
        'missing_device', dict(hybridize=_hybridize, timeout_seconds=MISSING_TIMEOUT),
        check_missing)
    for _problem, _expected in (('channels', 'channels'), ('rank', '2 to 5 dimensions'),
                                ('dtype', 'disagree on the input dtype')):
        CASES['bad_input_%s-%s' % (_problem, _mode)] = (
            'bad_input_on_one_device',
            dict(problem=_problem, hybridize=_hybridize, timeout_seconds=60.0),
            check_bad_input(_expected))
    CASES['user_code_raises-' + _mode] = (
        'user_code_raises', dict(hybridize=_hybridize, timeout_seconds=60.0), check_user_code)
    CASES['abandoned_steps-' + _mode] = (
        'abandoned_steps', dict(hybridize=_hybridize), check_abandoned)
    CASES['all_empty-' + _mode] = (
        'empty_slices', dict(empty=[0, 1, 2], hybridize=_hybridize), check_all_empty)


def soak(path, case, runs, batch):
    """Run ``case`` ``runs`` times on ``path``; return counts by outcome."""
    name, kwargs, check = CASES[case]
    counts = {'ok': 0, 'wrong': 0, 'crash': 0, 'hang': 0}
    examples = []
    left = runs
    while left > 0:
        size = min(batch, left)
        results = run_batch([(name, kwargs)] * size, timeout=60 + 10 * size, env=PATHS[path])
        for i in range(size):
            result = results[i]
            if isinstance(result, ScenarioFailed):
                # The process ended (or was killed) here; later runs never started.
                text = str(result)
                kind = 'hang' if 'did not finish within' in text else 'crash'
                counts[kind] += 1
                examples.append('%s: %s' % (kind, text[-600:]))
                left -= i + 1
                break
            problems = check(result)
            counts['wrong' if problems else 'ok'] += 1
            if problems:
                examples.append('wrong (%s): %s' % (', '.join(problems), json.dumps(result)[:600]))
        else:
            left -= size
    return counts, examples


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, default=200, help='runs per path and case')
    parser.add_argument('--batch', type=int, default=25, help='runs per process')
    parser.add_argument('--paths', nargs='+', default=OPERATOR_PATHS, choices=list(PATHS))
    parser.add_argument('--cases', nargs='+', default=list(CASES),
                        help='case ids, or prefixes of them (default: all)')
    args = parser.parse_args(argv)
    cases = [c for c in CASES if any(c.startswith(p) for p in args.cases)]
    summary = {}
    for path in args.paths:
        for case in cases:
            start = time.time()
            counts, examples = soak(path, case, args.runs, args.batch)
            summary['%s/%s' % (path, case)] = counts
            print('%-14s %-32s %s  (%.0f s)' % (path, case, ' '.join(
                '%s %d' % kv for kv in counts.items()), time.time() - start))
            for example in examples[:3]:
                print('    ' + example.replace('\n', '\n    '))
            sys.stdout.flush()
    print('SUMMARY ' + json.dumps(summary))
    bad = sum(c['wrong'] + c['crash'] + c['hang'] for c in summary.values())
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
