"""``python -m gluon_syncbn``: the report a user reads or pastes into a bug report."""
import os
import subprocess
import sys

import mxnet as mx

from tests.conftest import ROOT, run_python

REPORT = 'import runpy, sys; sys.argv[1:] = %r; runpy.run_module("gluon_syncbn", run_name="__main__")'


# The report as a user sees it who has not set up CPU contexts.
UNCONFIGURED = ('MXNET_CPU_TEMP_COPY', 'MXNET_CPU_PARALLEL_RAND_COPY', 'GLUON_SYNCBN_CPU_CONTEXTS')


def report(args=(), drop=(), **env):
    out = run_python(REPORT % (list(args),), timeout=300, env=env, drop=drop)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout


def test_the_report_names_each_backend_and_why():
    # The users' build (not the tests'): its self-tests run here too.
    text = report(['--selftest'], drop=UNCONFIGURED, GLUON_SYNCBN_TESTING='0')
    for section in ('Machine', 'MXNet', 'GPUs', 'Native library', 'Backends',
                    'Across processes', 'Settings'):
        assert '\n%s' % section in text, text
    assert 'self-test async now: ok' in text and 'self-test exchange now: ok' in text, text
    assert 'CPU contexts: async (the asynchronous operator, native and self-tested' in text
    assert 'across processes (CPU contexts): async' in text, text
    assert 'features: ' in text and 'MKLDNN' in text, text
    # No GPU operator claimed where no GPU can run: this machine has none.
    if mx.runtime.Features().is_enabled('CUDA'):  # the GPU wheel, through the stand-in
        assert '  GPUs: none found; exchange would run them (the exchange operator' in text
    else:
        assert '  GPUs: none (this MXNet build has no CUDA)' in text, text
        assert 'across processes (GPUs): none (this MXNet build has no CUDA)' in text, text
    # What a bug report needs of the machine.
    assert '  CPU cores: %d usable of %d' % (len(os.sched_getaffinity(0)), os.cpu_count()) \
        in text, text
    avx512 = 'avx512bw' in open('/proc/cpuinfo').read()
    assert ('  AVX-512: yes' if avx512 else '  AVX-512: no: bfloat16 AMP cannot run') in text
    assert '  compiler: ' in text and 'g++' in text, text
    assert '  CPU-context setup: not in effect (MXNET_CPU_TEMP_COPY=' in text, text


def test_the_report_says_whether_the_cpu_context_setup_is_in_effect():
    text = report(drop=UNCONFIGURED, GLUON_SYNCBN_CPU_CONTEXTS='4')
    assert '  CPU-context setup: in effect for up to 4 CPU contexts (MXNET_CPU_TEMP_COPY=1024, ' \
        'MXNET_CPU_PARALLEL_RAND_COPY=32)' in text, text


def test_without_mxnet_import_names_the_extras_and_the_report_reports():
    # -S: no site-packages, so no MXNet (nor NumPy); this checkout through PYTHONPATH.
    extras = ("gluon_syncbn needs MXNet 1.9.1, which is not installed here: install the package "
              "with one of its extras, pip install -e '.[cpu]' (MXNet's CPU build) or "
              "pip install -e '.[gpu]'")

    def run(*args):
        return subprocess.run([sys.executable, '-S'] + list(args), capture_output=True,
                              text=True, timeout=60, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    proc = run('-c', 'import gluon_syncbn')
    assert proc.returncode == 1, proc
    assert proc.stderr.strip().splitlines()[-1].startswith('ModuleNotFoundError: ' + extras), \
        proc.stderr
    proc = run('-m', 'gluon_syncbn', '--selftest')
    assert proc.returncode == 0 and not proc.stderr, proc
    text = proc.stdout
    assert '\nMachine\n  CPU cores: %d usable' % len(os.sched_getaffinity(0)) in text, text
    assert '\nMXNet\n  not found by %s\n  %s' % (sys.executable, extras) in text, text
    assert 'the native library and its self-tests, needs MXNet' in text, text
    assert '\nSettings\n  GLUON_SYNCBN_BACKEND=' in text, text


def test_the_report_says_why_no_backend_can_run(tmp_path):
    text = report(CXX='/nonexistent/g++', GLUON_SYNCBN_CACHE=str(tmp_path))
    assert "not available: no C++ compiler: '/nonexistent/g++' was not found. Install a C++ " \
        'compiler' in text, text
    assert 'CPU contexts: none (the native operators are required, but the native library is ' \
        "not available: no C++ compiler: '/nonexistent/g++' was not found. Install a C++ " \
        'compiler' in text, text
    assert 'across processes (CPU contexts): none (across processes the native operators ' \
        'are required' in text, text
    (tmp_path / 'file').write_text('')  # a cache under a file cannot be made
    text = report(GLUON_SYNCBN_CACHE=str(tmp_path / 'file' / 'cache'))
    assert 'not available: its cache directory %s cannot be written' % (
        tmp_path / 'file' / 'cache') in text, text
    assert 'Set GLUON_SYNCBN_CACHE to a directory you can write' in text, text
