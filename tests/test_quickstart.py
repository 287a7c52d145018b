"""examples/quickstart.py prints what README.md says it prints; README's quick start runs as written."""
import os
import re
import subprocess
import sys

import numpy as np

from tests.conftest import ROOT, run_python

NUMBER = re.compile(r'-?\d+\.\d+(?:e[-+]\d+)?')


def readme_block():
    """The lines README.md shows under 'It prints:'."""
    text = open(os.path.join(ROOT, 'README.md')).read()
    block = text.split('It prints:', 1)[1].split('```', 2)[1]
    return [l for l in block.strip().splitlines()]


def test_quickstart_loss_falls_and_output_matches_readme():
    out = subprocess.run([sys.executable, os.path.join(ROOT, 'examples', 'quickstart.py')],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = out.stdout.strip().splitlines()
    expected = readme_block()
    assert len(got) == len(expected), (got, expected)
    for line, shown in zip(got, expected):
        # the same words; numbers as shown, up to float rounding across machines
        assert NUMBER.sub('#', line) == NUMBER.sub('#', shown), (line, shown)
        for a, b in zip(NUMBER.findall(line), NUMBER.findall(shown)):
            assert abs(float(a) - float(b)) <= 1e-3 + 0.02 * abs(float(b)), (line, shown)
    losses = [float(NUMBER.findall(l)[0]) for l in got if l.startswith('epoch')]
    assert len(losses) == 5 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert got[-1].endswith('True')


def test_the_readme_quickstart_runs_as_written():
    text = open(os.path.join(ROOT, 'README.md')).read()
    code = text.split('## Quick start', 1)[1].split('```python', 1)[1].split('```', 1)[0]
    # What it trained: running statistics that moved, alike on every device.
    check = ('\nimport numpy as np\n'
             'means = [net[1].running_mean.data(c).asnumpy() for c in ctxs]\n'
             'assert all(np.array_equal(m, means[0]) for m in means), means\n'
             'assert np.abs(means[0]).max() > 0, means[0]\n'
             'print("trained", float(sum(l.sum().asscalar() for l in losses)))\n')
    out = run_python(code + check, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith('trained '), out.stdout
    assert np.isfinite(float(out.stdout.split()[1])), out.stdout
