"""Run a multi-process job on this machine: ``python -m gluon_syncbn.launch``.

For local runs and tests of cross-process SyncBatchNorm. It starts the
engine's own processes on 127.0.0.1 with the settings the engine expects and
watches them:

* ``--backend kvstore`` (default): ps-lite's scheduler, ``-s`` servers and
  ``-n`` workers, with the ``DMLC_*`` variables MXNet's ``dist_sync`` kvstore
  reads (loopback addresses, or ps-lite binds the first non-loopback interface).
* ``--backend horovod``: Horovod's own Gloo rendezvous server and ``-n``
  workers with the ``HOROVOD_*`` variables ``horovodrun`` would set.

Every line a process prints is forwarded with its role and index as prefix
(``[worker 1] ...``). When all workers exit 0 the job succeeded. When a
worker fails, a server or the scheduler exits early, or ``--deadline``
passes, every process is ended (by process group: SIGTERM, then SIGKILL) and
the launcher exits non-zero (with the code of the process that failed first,
128 + N if signal N ended it, as a shell reports it; 124 at the deadline),
naming that process and the last error its traceback showed. Nothing is left
running, however the launcher itself ends: a guard process of its own session
ends the job's process groups once the launcher is gone, also when it was
killed with SIGKILL (``timeout -k``, the OOM killer, a CI runner).

Example::

    python -m gluon_syncbn.launch -n 2 -s 1 train.py --epochs 3
    python -m gluon_syncbn.launch -n 2 --backend horovod train.py

On several machines use the engines' own launchers instead
(examples/multiprocess/README.md, section 'On several machines').
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ['main', 'Job']

EXIT_DEADLINE = 124  # like coreutils' timeout
# What a worker's error says where it gave up waiting for the other workers
# (messages.py: remote_timeout, setup_timeout).
WAITED = 'for the other workers'
# Runs ps-lite's role at MXNet's import; gluon_syncbn's import first loads the
# GPU wheel's CUDA libraries, without which that wheel does not import.
_SERVER_COMMAND = [sys.executable, '-c', 'import gluon_syncbn']


def free_port():
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class Job(object):
    """The processes of one job: start, forward output, watch, end.

    A guard process (:func:`guard`) learns every process group the job
    starts and ends them if the launcher goes away without ending them
    itself.

    Parameters
    ----------
    commands : list of (str, list, dict)
        ``(label, argv, extra environment)`` per process.
    workers : list of str
        Labels of the processes whose exit ends the job (the others are helpers).
    deadline : float
        Seconds before every process is ended.
    out : file
        Where prefixed output goes.
    """

    def __init__(self, commands, workers, deadline, out=None):
        self.commands = commands
        self.workers = set(workers)
        self.deadline = float(deadline)
        self.out = out or sys.stdout
        self._out_lock = threading.Lock()
        self.procs = {}
        self.ended = {}   # label: when its process exited (time.monotonic())
        self.errors = {}  # label: the last line naming an exception in its tracebacks
        self._threads = []
        self._guard = None

    def say(self, label, line):
        with self._out_lock:
            self.out.write('[%s] %s\n' % (label, line.rstrip('\n')))
            self.out.flush()

    def _forward(self, label, stream):
        in_traceback = False
        for raw in iter(stream.readline, b''):
            line = raw.decode('utf-8', 'replace').rstrip('\n')
            self.say(label, line)
            if line.endswith('Traceback (most recent call last):'):  # MXNet's: at the end
                in_traceback = True
            elif in_traceback and line and not line[0].isspace():
                self.errors[label] = line  # the exception's own line ends a traceback
                in_traceback = False
        stream.close()

    def _wait(self, label, proc):
        proc.wait()
        self.ended[label] = time.monotonic()

    def start(self):
        self._guard = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), GUARD_FLAG], stdin=subprocess.PIPE,
            start_new_session=True)  # out of reach of whatever ends the launcher's group
        for label, argv, env in self.commands:
            proc = subprocess.Popen(
                argv, env=dict(os.environ, **env), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group: we end its children too
            self.procs[label] = proc
            self._tell_guard('%d\n' % proc.pid)
            for target, args in ((self._forward, (label, proc.stdout)),
                                 (self._wait, (label, proc))):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _tell_guard(self, line):
        try:
            self._guard.stdin.write(line.encode())
            self._guard.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the guard is gone: stop() still ends everything

    def _release_guard(self):
        """Every group is ended: the guard exits without touching them
        (their ids may be reused from now on)."""
        if self._guard is not None:
            self._tell_guard(GUARD_DONE + '\n')
            try:
                self._guard.stdin.close()
            except BrokenPipeError:
                pass  # the guard is gone already
            self._guard.wait()
            self._guard = None

    def watch(self, helper_grace=10.0):
        """Wait for the job; return ``(exit code, reason)``.

        A helper (scheduler, server) that exits 0 is normal once the workers
        finish, which they do within moments; if they still run
        ``helper_grace`` seconds later, the job has lost its helper.
        """
        end = time.monotonic() + self.deadline
        helper_done = {}
        while True:
            codes = {label: proc.poll() for label, proc in self.procs.items()}
            failed = [label for label in list(self.ended) if codes[label] not in (None, 0)]
            if failed:
                # The first to exit: the others may have died of its absence.
                label = min(failed, key=self.ended.get)
                code = codes[label]
                error = self.errors.get(label)
                return (exit_code(code),
                        '%s (pid %d) failed with %s%s%s' % (
                            label, self.procs[label].pid, describe_exit(code),
                            ': ' + error if error else '', self._late(label, error)))
            for label, code in sorted(codes.items()):
                if code == 0 and label not in self.workers:
                    since = helper_done.setdefault(label, time.monotonic())
                    if time.monotonic() - since > helper_grace:
                        return 1, '%s (pid %d) exited while workers still ran' % (
                            label, self.procs[label].pid)
            if all(codes[w] == 0 for w in self.workers):
                return 0, 'all %d workers finished' % len(self.workers)
            if time.monotonic() > end:
                return EXIT_DEADLINE, 'the deadline of %gs passed' % self.deadline
            time.sleep(0.05)

    def _late(self, label, error):
        """Where ``label`` gave up waiting for the other workers (its error
        says it waited for them): '; still running then: ...', naming the
        workers it waited for, which were alive when it ended (slow, or
        paused: the layers' timeout ended it), else ''."""
        if not error or WAITED not in error:
            return ''
        end = self.ended[label]
        late = ['%s (pid %d)' % (w, self.procs[w].pid) for w in sorted(self.workers)
                if w != label and self.ended.get(w, float('inf')) > end]
        return '; the workers it waited for, still running then: %s' % ', '.join(late) \
            if late else ''

    def finish(self, grace=10.0):
        """Let helpers exit by themselves for ``grace`` seconds, then end everything."""
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        self.stop()

    def stop(self):
        """End every process group: SIGTERM, then SIGKILL after 3 s.

        Groups of processes that already exited too: their children may live on.
        """
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            running = [p for p in self.procs.values() if p.poll() is None]
            for proc in self.procs.values():
                _signal_group(proc.pid, sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and any(p.poll() is None for p in running):
                time.sleep(0.05)
        self._release_guard()
        for thread in self._threads:
            thread.join(1.0)

    def run(self):
        """Start, watch and end the job; return its exit code."""
        self.start()
        try:
            code, reason = self.watch()
        except KeyboardInterrupt:
            code, reason = 130, 'interrupted'
        if code == 0:
            self.finish()
        else:
            self.stop()
        self.say('launch', 'job %s: %s' % ('succeeded' if code == 0 else 'stopped', reason))
        return code


GUARD_FLAG = '--guard-job'
GUARD_DONE = 'done'


def guard(lines, grace=3.0):
    """The guard's work: read the job's process group ids from ``lines``
    (the launcher's pipe) until it ends; unless the launcher said
    ``GUARD_DONE`` first (it ended every group itself), end every group
    (SIGTERM, then SIGKILL after ``grace`` seconds). The pipe ends when the
    launcher exits, however it does: a SIGKILL leaves it no other say."""
    groups = []
    for line in lines:
        line = line.strip()
        if line == GUARD_DONE:
            return
        groups.append(int(line))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [g for g in groups if _signal_group(g, sig)]
        end = time.monotonic() + grace
        while alive and time.monotonic() < end:
            time.sleep(0.05)
            alive = [g for g in alive if _signal_group(g, 0)]
        if not alive:
            return


def _signal_group(group, sig):
    """Send ``sig`` to process group ``group``; False if the group is gone."""
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def exit_code(returncode):
    """The launcher's exit code for a process's ``returncode``: the same, or
    128 + N for a process signal N ended (``returncode == -N``), as a shell
    and coreutils' timeout report it."""
    return returncode if returncode >= 0 else 128 - returncode


def describe_exit(code):
    if code < 0:
        try:
            return 'signal %s' % signal.Signals(-code).name
        except ValueError:
            return 'signal %d' % -code
    return 'exit code %d' % code


def kvstore_commands(num_workers, num_servers, worker_argv):
    """Scheduler, servers and workers of a ps-lite job on 127.0.0.1."""
    common = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': str(free_port()),
              'DMLC_NODE_HOST': '127.0.0.1', 'DMLC_NUM_WORKER': str(num_workers),
              'DMLC_NUM_SERVER': str(num_servers)}
    commands = [('scheduler', _SERVER_COMMAND, dict(common, DMLC_ROLE='scheduler'))]
    commands += [('server %d' % i, _SERVER_COMMAND, dict(common, DMLC_ROLE='server'))
                 for i in range(num_servers)]
    # ps-lite ranks workers by their ports (it ignores DMLC_RANK): ascending
    # ports make kv.rank equal the index in the output prefix.
    ports = sorted(free_port() for _ in range(num_workers))
    commands += [('worker %d' % i, worker_argv,
                  dict(common, DMLC_ROLE='worker', PORT=str(ports[i])))
                 for i in range(num_workers)]
    return commands


def horovod_commands(num_workers, worker_argv):
    """Workers of a Horovod (Gloo) job on 127.0.0.1, and the rendezvous server.

    Returns ``(commands, rendezvous)``; stop the rendezvous after the job.
    """
    try:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
    except ImportError as exc:
        raise SystemExit("gluon_syncbn.launch: --backend horovod needs Horovod (%s); install "
                         "it with the command in docs/install.md, section 'Horovod'." % exc)
    hosts = parse_hosts('127.0.0.1:%d' % num_workers)
    slots = get_host_assignments(hosts, num_workers)
    rendezvous = RendezvousServer(verbose=0)
    port = rendezvous.start()
    rendezvous.init(slots)
    commands = []
    for slot in slots:
        env = {'HOROVOD_GLOO_RENDEZVOUS_ADDR': '127.0.0.1',
               'HOROVOD_GLOO_RENDEZVOUS_PORT': str(port),
               'HOROVOD_CONTROLLER': 'gloo', 'HOROVOD_CPU_OPERATIONS': 'gloo',
               'HOROVOD_GLOO_IFACE': 'lo', 'HOROVOD_HOSTNAME': slot.hostname,
               'HOROVOD_RANK': str(slot.rank), 'HOROVOD_SIZE': str(slot.size),
               'HOROVOD_LOCAL_RANK': str(slot.local_rank),
               'HOROVOD_LOCAL_SIZE': str(slot.local_size),
               'HOROVOD_CROSS_RANK': str(slot.cross_rank),
               'HOROVOD_CROSS_SIZE': str(slot.cross_size)}
        commands.append(('worker %d' % slot.rank, worker_argv, env))
    return commands, rendezvous


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m gluon_syncbn.launch',
        description='Run SCRIPT as NUM_WORKERS processes on this machine, synchronized '
                    "through MXNet's dist_sync kvstore or Horovod.")
    parser.add_argument('-n', '--num-workers', type=int, required=True)
    parser.add_argument('-s', '--num-servers', type=int, default=None,
                        help='ps-lite servers (kvstore backend); default: as many as workers')
    parser.add_argument('--backend', choices=('kvstore', 'horovod'), default='kvstore')
    parser.add_argument('--deadline', type=float, default=3600.0,
                        help='seconds before the whole job is stopped (default 3600)')
    parser.add_argument('script', help='the Python script every worker runs')
    parser.add_argument('args', nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.num_workers < 1 or (args.num_servers is not None and args.num_servers < 1):
        parser.error('--num-workers and --num-servers must be at least 1')
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == [GUARD_FLAG]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is not ours
        guard(sys.stdin)
        return 0
    args = parse_args(argv)
    worker_argv = [sys.executable, args.script] + args.args
    rendezvous = None
    if args.backend == 'horovod':
        commands, rendezvous = horovod_commands(args.num_workers, worker_argv)
    else:
        commands = kvstore_commands(args.num_workers, args.num_servers or args.num_workers,
                                    worker_argv)
    workers = [label for label, _, _ in commands if label.startswith('worker')]
    job = Job(commands, workers, args.deadline)
    # End the job on SIGTERM too (a CI runner or a test's timeout sends it).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return job.run()
    finally:
        if rendezvous is not None:
            rendezvous.stop()


if __name__ == '__main__':
    sys.exit(main())
