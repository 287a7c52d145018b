"""Where the benchmark scripts write, and the header every result carries.

Every script ends with one ``Run.write``: its results go to
``benchmarks/results/<name>.md`` (the table) and ``.json`` (raw numbers), each
headed by the date (UTC), the git commit (``+dirty`` when tracked files other
than the results differ from it), the machine, MXNet's version, the
backend(s) that ran and the exact command line. An accepted run (completed,
not a smoke run, written into ``results/``) also appends one line to
``benchmarks/history.md``. A smoke run (fewer steps than the script's
minimum, which the script states) without ``--out`` writes into
``benchmarks/scratch/`` (not tracked) and records no history.

Worker side: ``operator_of(block)`` names the gluon_syncbn operator(s) a
block's layers ran ('async' or 'exchange'; read after a first call).
"""
import json
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, 'results')
SCRATCH = os.path.join(HERE, 'scratch')
HISTORY = os.path.join(HERE, 'history.md')
HISTORY_HEAD = ('# Benchmark history\n\nOne line per accepted run (see README.md): date (UTC), '
                'commit, result file, command, headline figures. Appended by the scripts; '
                'never edited.\n\n')  # if history.md is missing


# ----------------------------------------------------------------- worker side
def operator_of(block):
    """The operator(s) gluon_syncbn's layers in ``block`` ran, '+'-joined
    ('async', 'exchange', or e.g. 'async+exchange'), or None."""
    found = set()

    def look(b):
        backend = getattr(b, '_sync_backend', None)
        if backend is not None:
            found.add(backend.name)
    block.apply(look)
    return '+'.join(sorted(found)) or None


# ----------------------------------------------------------------- driver side
def add_arguments(parser):
    parser.add_argument('--out', default=None,
                        help='output path without extension (default: benchmarks/results/'
                             '<name>; a smoke run: benchmarks/scratch/<name>); runs written '
                             'elsewhere than results/ add no line to history.md')


def _git(*args):
    try:
        return subprocess.run(['git'] + list(args), cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ''


def commit():
    """Short HEAD, '+dirty' when tracked files (results and history aside) differ."""
    head = _git('rev-parse', '--short', 'HEAD') or 'unknown'
    dirty = _git('status', '--porcelain', '--untracked-files=no', '--', '.',
                 ':(exclude)benchmarks/results', ':(exclude)benchmarks/history.md')
    return head + ('+dirty' if dirty else '')


def machine():
    """CPU model (from /proc/cpuinfo) and core count."""
    model = ''
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    model = line.split(':', 1)[1].strip()
                    break
    except OSError:
        pass
    return '%s, %d cores' % (model or platform.processor() or platform.machine(),
                             os.cpu_count() or 0)


def mxnet_version():
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        return '?'
    for dist in ('mxnet', 'mxnet-mkl', 'mxnet-cu112', 'mxnet-cu110', 'mxnet-cu102'):
        try:
            return '%s %s' % (dist, metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return '?'


def command_line():
    argv = list(sys.argv)
    script = os.path.abspath(argv[0])
    if script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    return ' '.join(shlex.quote(a) for a in ['python', script] + argv[1:])


def selection_env():
    """The library's backend switches set in this environment (inherited by workers)."""
    return {k: os.environ[k] for k in ('GLUON_SYNCBN_BACKEND', 'GLUON_SYNCBN_DEVICE_PATH')
            if k in os.environ}


class Run(object):
    """One run of a script: where it writes, and what its header says.

    ``name`` is ``<script>[-<variant>]``, the file name under results/;
    ``smoke`` says that the script's arguments make this a smoke run.
    """

    def __init__(self, name, out=None, smoke=False):
        self.name = name
        self.smoke = smoke
        self.out = out or os.path.join(SCRATCH if smoke else RESULTS, name)
        self.meta = {'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
                     'commit': commit(), 'machine': machine(), 'mxnet': mxnet_version(),
                     'python': platform.python_version(), 'command': command_line()}

    @property
    def accepted(self):
        return (not self.smoke and os.path.dirname(os.path.abspath(self.out)) ==
                os.path.abspath(RESULTS))

    def header(self, title, backends):
        """Markdown lines: title, then date, commit, machine, backend(s), command line."""
        env = selection_env()
        return ['# %s' % title, '',
                '- date: %s' % self.meta['date'],
                '- commit: %s' % self.meta['commit'],
                '- machine: %s; %s, Python %s' % (self.meta['machine'], self.meta['mxnet'],
                                                   self.meta['python']),
                '- backend: %s%s' % (backends, ''.join('; %s=%s' % kv for kv in
                                                       sorted(env.items()))),
                '- command: `%s`%s' % (self.meta['command'],
                                       ' (smoke run)' if self.smoke else ''), '']

    def write(self, title, backends, lines, raw, headline):
        """Write ``<out>.md`` (header + ``lines``) and ``<out>.json`` (meta + ``raw``);
        append ``headline`` to history.md when the run is accepted."""
        self.meta['backend'] = backends
        directory = os.path.dirname(os.path.abspath(self.out))
        if not os.path.isdir(directory):
            os.makedirs(directory)
        text = '\n'.join(self.header(title, backends) + list(lines)) + '\n'
        with open(self.out + '.md', 'w') as f:
            f.write(text)
        with open(self.out + '.json', 'w') as f:
            json.dump({'meta': self.meta, 'results': raw}, f, indent=1)
        if self.accepted:
            self.history(headline)
        print(text)
        print('wrote %s.{md,json}%s' % (os.path.relpath(self.out, ROOT) if self.out.startswith(
            ROOT) else self.out, '; history.md +1 line' if self.accepted else
            ' (not recorded in history.md)'))

    def history(self, headline):
        new = not os.path.exists(HISTORY)
        with open(HISTORY, 'a') as f:
            if new:
                f.write(HISTORY_HEAD)
            f.write('- %s, %s, results/%s, `%s`: %s\n' % (
                self.meta['date'], self.meta['commit'], self.name, self.meta['command'],
                headline))


def backend_text(ops, others=('nn.BatchNorm', 'contrib SyncBatchNorm')):
    """'gluon_syncbn async operator; beside nn.BatchNorm, ...' from the operators seen."""
    ops = sorted(set(o for o in ops if o))
    ours = ('gluon_syncbn %s operator' % '+'.join(ops)) if ops else \
        'gluon_syncbn (no synchronizing operator ran)'
    return ours + ('; beside %s' % ', '.join(others) if others else '')
