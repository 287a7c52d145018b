"""pip says that this package needs another Python, on the Pythons it does not
support, with the pip each of them ships: before any requirement is built
(NumPy < 1.24 has no wheel there, and its source build fails on Python 3.12
for a reason that names neither the package nor the Python). Runs where
pyenv has those Pythons (this project's machines do), in a fresh venv each."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYENV = os.path.join(os.path.expanduser('~'), '.pyenv', 'versions')


@pytest.mark.timeout(300)
@pytest.mark.parametrize('version', ['3.12.1', '3.13.0'])
def test_pip_names_the_python_as_the_problem(version, tmp_path):
    python = os.path.join(PYENV, version, 'bin', 'python')
    if not os.path.exists(python):
        pytest.skip('Python %s is not installed here (pyenv)' % version)
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
