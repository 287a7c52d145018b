"""examples/quickstart.py trains, and prints what README.md says it prints."""
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

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
