"""examples/multiprocess/train.py through ``python -m gluon_syncbn.launch``, on
the dist_sync kvstore (2 workers x 2 CPU contexts) and Horovod (2 workers x
1), each job bounded by the launcher's --deadline and a subprocess timeout."""
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_multiprocess import HOROVOD

EXAMPLE = os.path.join(ROOT, 'examples', 'multiprocess', 'train.py')


@pytest.mark.parametrize('backend,contexts', [('kvstore', 2), ('horovod', 1)])
def test_the_example_trains_and_its_statistics_agree_on_every_worker(backend, contexts):
    if backend == 'horovod' and HOROVOD:
        pytest.skip(HOROVOD)
    argv = [sys.executable, '-m', 'gluon_syncbn.launch', '-n', '2', '--backend', backend,
            '--deadline', '240'] + (['-s', '1'] if backend == 'kvstore' else [])
    proc = subprocess.run(argv + [EXAMPLE, '--epochs', '2'], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    losses = {}
    for rank, epoch, loss in re.findall(r'^\[worker \d\] worker (\d) epoch (\d) loss (\S+)$',
                                        output, re.M):
        losses.setdefault(int(rank), []).append((int(epoch), float(loss)))
    assert sorted(losses) == [0, 1], output[-4000:]
    for rank, history in losses.items():
        assert [epoch for epoch, _ in history] == [1, 2], (rank, history)
        assert history[1][1] < history[0][1], (rank, history)   # it learns
    verdicts = re.findall(r'^\[worker (\d)\] worker \1 running statistics identical on all '
                          r'(\d) devices of the 2 workers: (\w+) \(crc32 (\w+)\)$', output, re.M)
    assert sorted(v[0] for v in verdicts) == ['0', '1'], output[-4000:]
    assert {v[1:3] for v in verdicts} == {(str(2 * contexts), 'True')}, verdicts
    assert len({v[3] for v in verdicts}) == 1, verdicts   # the same bits on both workers
