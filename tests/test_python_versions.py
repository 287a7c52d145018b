"""pip says that this package needs another Python, on the Pythons it does not
support, with the pip each of them ships: before any requirement is built
(NumPy < 1.24 has no wheel there, and its source build fails on Python 3.12
for a reason that names neither the package nor the Python). Runs where
a Python 3.12 or 3.13 is found (on PATH as python3.12 / python3.13, or
under pyenv's versions: this project's machines have them), in a fresh venv
each."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYENV = os.environ.get('PYENV_ROOT', os.path.join(os.path.expanduser('~'), '.pyenv'))


def _find_python(minor):
    """``(path, version)`` of a Python ``minor`` that runs, on PATH or under
    pyenv (a pyenv shim of a version not installed does not), or Nones."""
    under = sorted(glob.glob(os.path.join(PYENV, 'versions', minor + '.*', 'bin', 'python')))
    for python in [shutil.which('python' + minor)] + under[::-1]:
        if python is None:
            continue
        out = subprocess.run([python, '-c', 'import platform; print(platform.python_version())'],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0 and out.stdout.startswith(minor + '.'):
            return python, out.stdout.strip()
    return None, None


@pytest.mark.timeout(300)
@pytest.mark.parametrize('minor', ['3.12', '3.13'])
def test_pip_names_the_python_as_the_problem(minor, tmp_path):
    python, version = _find_python(minor)
    if python is None:
        pytest.skip('no Python %s here (python%s on PATH, or pyenv under %s)'
                    % (minor, minor, PYENV))
    venv = tmp_path / 'venv'
    subprocess.run([python, '-m', 'venv', str(venv)], check=True, timeout=120)
    pip = [str(venv / 'bin' / 'python'), '-m', 'pip']
    shipped = subprocess.run(pip + ['--version'], capture_output=True, text=True).stdout
    out = subprocess.run(pip + ['install', '--no-cache-dir', ROOT + '[cpu,test,examples]'],
                         capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "requires a different Python: %s not in '<3.12,>=3.7'" % version in text, (
        shipped, text[-3000:])
    assert 'Building wheel for numpy' not in text and 'distutils' not in text, text[-3000:]
