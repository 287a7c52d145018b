"""``python -m gluon_syncbn``: the report a user reads or pastes into a bug report."""
from tests.conftest import run_python

REPORT = 'import runpy, sys; sys.argv[1:] = %r; runpy.run_module("gluon_syncbn", run_name="__main__")'


def report(args=(), **env):
    out = run_python(REPORT % (list(args),), timeout=300, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout


def test_the_report_names_each_backend_and_why():
    # The users' build (not the tests'): its self-tests run here too.
    text = report(['--selftest'], GLUON_SYNCBN_TESTING='0')
    for section in ('MXNet', 'GPUs', 'Native library', 'Backends', 'Across processes',
                    'Settings'):
        assert '\n%s' % section in text, text
    assert 'self-test async now: ok' in text and 'self-test exchange now: ok' in text, text
    assert 'CPU contexts: async (the asynchronous operator, native and self-tested' in text
    assert 'GPUs: exchange (the exchange operator, native and self-tested' in text, text
    assert 'across processes (CPU contexts): async' in text, text
    assert 'features: ' in text and 'MKLDNN' in text, text


def test_the_report_says_why_no_backend_can_run(tmp_path):
    text = report(CXX='/nonexistent/g++', GLUON_SYNCBN_CACHE=str(tmp_path))
    assert "not available: no C++ compiler: '/nonexistent/g++' was not found. Install a C++ " \
        'compiler' in text, text
    assert 'CPU contexts: none (the native operators are required, but the native library is ' \
        "not available: no C++ compiler: '/nonexistent/g++' was not found. Install a C++ " \
        'compiler' in text, text
    assert 'across processes (GPUs): none (across processes the native operators are ' \
        'required' in text, text
    (tmp_path / 'file').write_text('')  # a cache under a file cannot be made
    text = report(GLUON_SYNCBN_CACHE=str(tmp_path / 'file' / 'cache'))
    assert 'not available: its cache directory %s cannot be written' % (
        tmp_path / 'file' / 'cache') in text, text
    assert 'Set GLUON_SYNCBN_CACHE to a directory you can write' in text, text
