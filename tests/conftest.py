"""Running multi-device scenarios in subprocesses with hard deadlines.

MXNet never runs in the pytest process for multi-device work: a wedged engine
then costs one test (killed at its deadline), not the whole suite.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The native library with the tests' entry points and loopback transport
# (tests/native_testing.h), here and in every subprocess.
os.environ['GLUON_SYNCBN_TESTING'] = os.path.join(ROOT, 'tests', 'native_testing.h')


class ScenarioFailed(AssertionError):
    pass


def run_python(code, timeout=120, env=None, drop=(), cwd=ROOT):
    """``python -c code`` in a fresh process with a deadline, as the user would
    run it: this checkout importable, the environment plus ``env`` without the
    variables named in ``drop``. Returns the completed process (text output)."""
    full_env = {k: v for k, v in os.environ.items() if k not in drop}
    full_env['PYTHONPATH'] = ROOT
    full_env.update(env or {})
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=full_env)


def _run(args, timeout, env):
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env['PYTHONPATH'] = ROOT + os.pathsep + full_env.get('PYTHONPATH', '')
    full_env.setdefault('SCENARIO_TRACEBACK_AFTER', str(max(timeout - 10, 1)))
    try:
        proc = subprocess.run([sys.executable, '-m', 'tests.scenarios'] + args, cwd=ROOT,
                              env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        def text(stream):
            return (stream or b'').decode() if isinstance(stream, bytes) else (stream or '')
        raise ScenarioFailed('scenario %s did not finish within %ss (hang?)\n%s\n%s'
                             % (args[0], timeout, text(exc.stdout)[-3000:],
                                text(exc.stderr)[-6000:]))
    return proc


def run_scenario(name, timeout=120, env=None, **kwargs):
    """Run one scenario in a fresh process; return its result dict."""
    proc = _run([name, json.dumps(kwargs)], timeout, env)
    for line in proc.stdout.splitlines():
        if line.startswith('RESULT '):
            return json.loads(line[len('RESULT '):])
    raise ScenarioFailed('scenario %s %s failed (exit %d):\n%s' % (
        name, kwargs, proc.returncode, (proc.stdout + proc.stderr)[-4000:]))


def run_batch(cases, timeout=300, env=None):
    """Run ``[(name, kwargs), ...]`` in one fresh process; return results by index.

    A case that did not report (crash, or the deadline) maps to a ScenarioFailed.
    """
    try:
        proc = _run(['--batch', json.dumps(cases)], timeout, env)
        output = proc.stdout + proc.stderr
    except ScenarioFailed as exc:
        proc, output = None, str(exc)
    results = {}
    for line in (proc.stdout.splitlines() if proc else []):
        if line.startswith('RESULT '):
            _, index, payload = line.split(' ', 2)
            results[int(index)] = json.loads(payload)
    for i in range(len(cases)):
        results.setdefault(i, ScenarioFailed('case %s did not report:\n%s'
                                             % (cases[i], output[-4000:])))
    return results


def result_of(results, index):
    result = results[index]
    if isinstance(result, Exception):
        raise result
    return result


# The backends (see gluon_syncbn/backends): the exactness and fault suites run on each.
BACKEND_VARIABLE = 'GLUON_SYNCBN_BACKEND'
DEVICE_PATH_VARIABLE = 'GLUON_SYNCBN_DEVICE_PATH'
# Every code path a layer call can take, named by its backend, and the
# environment that selects it on CPU contexts: 'exchange' and
# 'exchange-device' are the path GPUs take (MXNet's operators compute the
# moments). Where CPU contexts count as GPUs (the test switch
# GLUON_SYNCBN_DEVICE_PATH) the exchange operator copies through its GPU code
# with a stand-in CUDA runtime (tests/native_testing.h), never touching the
# arrays in place.
PATHS = {
    'async': {BACKEND_VARIABLE: 'async'},
    'exchange': {BACKEND_VARIABLE: 'exchange'},
    'exchange-device': {BACKEND_VARIABLE: 'exchange', DEVICE_PATH_VARIABLE: '1'},
}
# The backend each path runs (the layer's _sync_backend.name).
PATH_OPERATOR = {'async': 'async', 'exchange': 'exchange', 'exchange-device': 'exchange'}
# The paths the fault, empty-slice, group, NumPy-mode and AMP suites run on:
# each backend once.
OPERATOR_PATHS = ['async', 'exchange']


@pytest.fixture(params=OPERATOR_PATHS)
def operator(request, monkeypatch):
    """Run the test's subprocesses on each operator in turn: the native
    asynchronous and exchange operators (see PATHS)."""
    for name, value in PATHS[request.param].items():
        monkeypatch.setenv(name, value)
    if DEVICE_PATH_VARIABLE not in PATHS[request.param]:
        monkeypatch.delenv(DEVICE_PATH_VARIABLE, raising=False)
    return request.param


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: long multi-device runs (still part of CI)')


# GluonCV's own code where it is installed (.ci/run installs it and sets
# GLUON_SYNCBN_REQUIRE_GLUONCV, which makes its absence an error).
GLUONCV = None if importlib.util.find_spec('gluoncv') else (
    'gluoncv is not installed: pip install --no-deps gluoncv==0.10.5.post0 scipy==1.15.3 '
    'portalocker==4.4.2 (.ci/run does)')
if GLUONCV and os.environ.get('GLUON_SYNCBN_REQUIRE_GLUONCV'):
    raise RuntimeError('GLUON_SYNCBN_REQUIRE_GLUONCV is set but ' + GLUONCV)
needs_gluoncv = pytest.mark.skipif(bool(GLUONCV), reason=GLUONCV or '')
