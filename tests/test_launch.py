"""The launcher's process handling, with plain Python processes (no MXNet)."""
import io
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gluon_syncbn.launch import (EXIT_DEADLINE, Job, horovod_commands, kvstore_commands,
                                 parse_args)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, 'examples', 'multiprocess', 'train.py')


def python(code):
    return [sys.executable, '-c', code]


def run(commands, workers, deadline=30):
    out = io.StringIO()
    job = Job(commands, workers, deadline, out=out)
    start = time.monotonic()
    code = job.run()
    return code, out.getvalue(), time.monotonic() - start, job


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_output_is_prefixed_and_success_waits_for_every_worker():
    code, out, _, _ = run([('worker 0', python('print("a")'), {}),
                           ('worker 1', python('import time; time.sleep(0.5); print("b")'), {})],
                          ['worker 0', 'worker 1'])
    assert code == 0
    assert '[worker 0] a' in out and '[worker 1] b' in out
    assert 'job succeeded: all 2 workers finished' in out


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM], ids=['SIGKILL', 'SIGTERM'])
def test_a_failed_worker_ends_the_others_and_their_children_at_once(sig):
    sleeper = ('import subprocess, sys, time; '
               'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]); '
               'print("child started", flush=True); time.sleep(600)')
    suicide = 'import time, os; time.sleep(1); os.kill(os.getpid(), %d)' % sig
    code, out, elapsed, job = run([('scheduler', python(sleeper), {}),
                                   ('worker 0', python(sleeper), {}),
                                   ('worker 1', python(suicide), {})],
                                  ['worker 0', 'worker 1'])
    assert code == 128 + sig  # as a shell and coreutils' timeout report it: 137, 143
    assert 'worker 1 (pid %d) failed with signal %s' % (job.procs['worker 1'].pid,
                                                         sig.name) in out
    assert elapsed < 10
    assert all(p.poll() is not None for p in job.procs.values())


def test_the_deadline_ends_a_hung_job():
    code, out, elapsed, job = run([('worker 0', python('import time; time.sleep(600)'), {})],
                                  ['worker 0'], deadline=1)
    assert code == EXIT_DEADLINE
    assert 'the deadline of 1s passed' in out
    assert elapsed < 10
    assert not alive(job.procs['worker 0'].pid)


def test_a_helper_that_dies_fails_the_job():
    code, out, _, _ = run([('server 0', python('raise SystemExit(3)'), {}),
                           ('worker 0', python('import time; time.sleep(600)'), {})],
                          ['worker 0'])
    assert code == 3
    assert 'server 0' in out and 'exit code 3' in out


def test_worker_environment_follows_the_ps_lite_recipe():
    commands = kvstore_commands(2, 1, ['train.py'])
    labels = [label for label, _, _ in commands]
    assert labels == ['scheduler', 'server 0', 'worker 0', 'worker 1']
    envs = {label: env for label, _, env in commands}
    for env in envs.values():
        assert env['DMLC_PS_ROOT_URI'] == '127.0.0.1' and env['DMLC_NODE_HOST'] == '127.0.0.1'
        assert env['DMLC_NUM_WORKER'] == '2' and env['DMLC_NUM_SERVER'] == '1'
    # ps-lite ranks workers by port: ascending ports give kv.rank == prefix index
    assert int(envs['worker 0']['PORT']) < int(envs['worker 1']['PORT'])


def test_arguments_after_the_script_belong_to_the_script():
    args = parse_args(['-n', '2', 'train.py', '--epochs', '3', '-n', '5'])
    assert args.num_workers == 2 and args.script == 'train.py'
    assert args.args == ['--epochs', '3', '-n', '5']
    with pytest.raises(SystemExit):
        parse_args(['-n', '0', 'train.py'])


WAITING_WORKER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
print('ready', flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=['SIGKILL', 'SIGTERM', 'SIGINT'])
def test_the_launcher_leaves_nothing_running_however_it_ends(sig, tmp_path):
    """A whole job (scheduler, server, workers and the workers' children)
    ends once the launcher is gone: by SIGKILL (timeout -k, the OOM killer)
    as by SIGTERM or SIGINT."""
    script = tmp_path / 'worker.py'
    script.write_text(WAITING_WORKER)
    launcher = subprocess.Popen(
        [sys.executable, '-m', 'gluon_syncbn.launch', '-n', '2', '-s', '1', '--deadline', '120',
         str(script)], stdout=subprocess.PIPE, text=True,
        cwd=ROOT)
    try:
        ready = 0
        while ready < 2:
            line = launcher.stdout.readline()
            assert line, 'the launcher ended early'
            ready += line.endswith('] ready\n')
        job = psutil.Process(launcher.pid).children(recursive=True)
        assert len(job) >= 7  # guard, scheduler, server, 2 workers, their 2 children
        launcher.send_signal(sig)
        launcher.wait(30)
        _, alive = psutil.wait_procs(job, timeout=15)
        assert not alive, alive
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize('argv', [
    ['-m', 'gluon_syncbn.launch', '-n', '2', '--backend', 'horovod', EXAMPLE],
    # the example's own flag, under the kvstore's launcher or none
    [EXAMPLE, '--backend', 'horovod'],
], ids=['launcher', 'example'])
def test_without_horovod_backend_horovod_ends_in_one_line_naming_the_install_fix(argv,
                                                                                tmp_path):
    """As where Horovod is not installed, or was built without MXNet: a
    ``horovod`` package whose import fails comes first on the path."""
    (tmp_path / 'horovod').mkdir()
    (tmp_path / 'horovod' / '__init__.py').write_text(
        'raise ImportError("horovod is absent here (a stub)")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    proc = subprocess.run([sys.executable] + argv, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert 'Traceback' not in output, output[-3000:]
    lines = [line for line in proc.stderr.splitlines() if 'horovod' in line]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith(('gluon_syncbn.launch: --backend horovod needs Horovod',
                                'train.py: --backend horovod needs horovod.mxnet')), lines
    assert '(horovod is absent here (a stub))' in lines[0], lines
    assert "docs/install.md, section 'Horovod'" in lines[0], lines


def test_without_horovod_the_launcher_names_where_the_install_command_is(monkeypatch):
    # As where Horovod is not installed: its import fails.
    monkeypatch.setitem(sys.modules, 'horovod', None)
    with pytest.raises(SystemExit) as stop:
        horovod_commands(2, ['train.py'])
    message = str(stop.value.code)
    assert message.startswith('gluon_syncbn.launch: --backend horovod needs Horovod'), message
    assert "docs/install.md, section 'Horovod'" in message, message
    # ... and that section has the command.
    install = open(os.path.join(ROOT, 'docs', 'install.md')).read()
    section = install.split('\n## Horovod\n', 1)[1].split('\n## ', 1)[0]
    assert 'pip install --no-build-isolation horovod==0.28.1' in section, section


def test_the_docs_give_every_default_wait_as_the_code_has_it():
    """README's API line: the layers' timeout in a process and across
    workers; install.md's 'Across processes': those and the launcher's
    --deadline."""
    from gluon_syncbn.block import DEFAULT_REMOTE_TIMEOUT, DEFAULT_TIMEOUT
    local, remote = '{:,g}'.format(DEFAULT_TIMEOUT), '{:,g}'.format(DEFAULT_REMOTE_TIMEOUT)
    deadline = '{:,g}'.format(parse_args(['-n', '1', 'train.py']).deadline)
    readme = ' '.join(open(os.path.join(ROOT, 'README.md')).read().split())
    assert 'else %s in a process, %s across workers' % (local, remote) in readme
    install = open(os.path.join(ROOT, 'docs', 'install.md')).read()
    section = ' '.join(install.split('\n## Across processes\n', 1)[1].split('\n## ', 1)[0].split())
    for text in ('%s s for the other devices of a process, %s s' % (local, remote),
                 '--deadline` (default %s s)' % deadline):
        assert text in section, (text, section)
