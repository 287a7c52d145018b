"""The native operators (``syncbn.cc``): built once per libmxnet.so, loaded with ctypes.

Two operators of MXNet's own kind, registered in its C++ registry; neither
is a custom operator, and no thread waits in them:

* the asynchronous operator (``async_op.h``), CPU contexts: the whole layer
  call; it runs on the device's engine worker and completes when the devices
  have met;
* the exchange operator (``exchange_op.h``), GPUs: the synchronization step
  on the packed per-channel vector, copied between the GPU and the host
  through the CUDA runtime (``device_copies.h``).

Both rely on the C++ ABI of the libmxnet.so they were built against
(``mxnet_abi.h``); a self-test in a subprocess checks each once per build
(``selftest.py``, its verdict in ``<library>.<part>.selftest``): each at
its first use, the exchange operator on two devices and once per GPU driver
too.

Which layers run which operator, also where a self-test failed, is
:mod:`gluon_syncbn.backends`' choice; this module only builds, self-tests,
loads and registers. Every entry
point is called through :mod:`.library`.

The library is compiled with ``$CXX`` (default ``g++``) against the headers
and ``libmxnet.so`` that ship in the mxnet wheel, into
``$GLUON_SYNCBN_CACHE`` (default ``~/.cache/gluon_syncbn``), one file per
``libmxnet.so`` (its path, size and time: CPU and GPU environments sharing a
cache never share a build or a self-test verdict) and source, so an upgrade or
an edit rebuilds it and concurrent processes never load a half-written file.
It and its verdicts are used only where nobody else can change them
(:mod:`.cache`).
"""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .. import messages
from ..errors import warn_user
from . import cache
from .cache import CACHE_VARIABLE
from .library import Library

__all__ = ['load', 'async_operator', 'exchange_operator', 'status']

ASYNC_OP = '_gluon_syncbn_async'
EXCHANGE_OP = '_gluon_syncbn_exchange'
SELFTEST_VARIABLE = 'GLUON_SYNCBN_SELFTEST'  # set in the self-test's own process
# The library a self-test's process tests: the one its parent loaded.
SELFTEST_LIBRARY_VARIABLE = 'GLUON_SYNCBN_SELFTEST_LIBRARY'
# The path of a C++ file of the tests' entry points (tests/native_testing.h),
# compiled into a build of its own; unset, empty or '0' in users' builds.
TESTING_VARIABLE = 'GLUON_SYNCBN_TESTING'
SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(SOURCE_DIR, 'syncbn.cc')  # includes the .h files beside it
FLAGS = ['-O3', '-shared', '-fPIC', '-std=c++14',
         # The wheel's build settings (see mxnet_abi.h): its C++ headers must
         # see the layouts libmxnet.so was compiled with.
         '-D_GLIBCXX_USE_CXX11_ABI=0', '-DMSHADOW_USE_CUDA=0', '-DMXNET_USE_CUDA=0',
         '-DMSHADOW_USE_MKL=0', '-DMSHADOW_USE_CBLAS=0', '-DMSHADOW_STAND_ALONE=1',
         '-DDMLC_USE_CXX11=1', '-DMSHADOW_INT64_TENSOR_SIZE=0',
         # float16 conversions in portable code (F16C instructions need
         # -mf16c); both round to nearest even, as MXNet does.
         '-DMSHADOW_USE_F16C=0']
BUILD_SECONDS = 300
SELFTEST_SECONDS = 120

# What load() and the operators' registration found (see _once).
_state = {'path': None, 'digest': None, 'why_not': None, 'fix': '', 'verdicts': {}}
_lock = threading.RLock()


class NativeUnavailable(Exception):
    """The native operator cannot be built or loaded here; the message says
    why, and ``fix`` (where there is one) what to do."""

    def __init__(self, why, fix=''):
        super(NativeUnavailable, self).__init__(why)
        self.fix = fix


def _mxnet_dir():
    import mxnet
    return os.path.dirname(os.path.abspath(mxnet.__file__)), mxnet.__version__


def mxnet_identity(mx_dir):
    """What tells the ``libmxnet.so`` in ``mx_dir`` from any other: its real
    path, size and modification time, or the path alone if there is no file.

    The CPU and GPU wheels are both 1.9.1, and CPU and GPU venvs often share
    one cache: a library built and self-tested against one wheel must never
    be loaded with the other. One ``stat`` tells them apart (hashing the file
    would read 0.9 GB at every import); a reinstall changes the time, so it
    rebuilds.
    """
    library = os.path.realpath(os.path.join(mx_dir, 'libmxnet.so'))
    try:
        info = os.stat(library)
    except OSError:
        return library  # no library there: the build says so
    return '%s\0%d\0%d' % (library, info.st_size, info.st_mtime_ns)


def _testing_source():
    source = os.environ.get(TESTING_VARIABLE, '')
    return os.path.abspath(source) if source not in ('', '0') else None


def _flags():
    source = _testing_source()
    return FLAGS + (['-DGSBN_TESTING="%s"' % source] if source else [])


def library_path(cache_root=None):
    """Where the library for this libmxnet.so, this source and these flags
    lives, in ``cache_root`` (default: the cache's, :func:`cache.root`)."""
    mx_dir, version = _mxnet_dir()
    digest = hashlib.sha256(' '.join(_flags()).encode())
    digest.update(b'\0' + mxnet_identity(mx_dir).encode() + b'\0')
    testing = _testing_source()
    sources = [os.path.join(SOURCE_DIR, name) for name in sorted(os.listdir(SOURCE_DIR))
               if name.endswith(('.cc', '.h'))] + ([testing] if testing else [])
    for source in sources:
        with open(source, 'rb') as f:
            digest.update(os.path.basename(source).encode() + b'\0' + f.read())
    digest = digest.hexdigest()[:16]
    return os.path.join(cache_root or cache.root(), 'mxnet-%s' % version,
                        'libgluon_syncbn-%s.so' % digest)


def build(path, cache_root):
    """Compile ``syncbn.cc`` into ``path`` (its missing directories up to
    ``cache_root`` made 0700); raise NativeUnavailable with the reason."""
    mx_dir, _ = _mxnet_dir()
    header = os.path.join(mx_dir, 'include', 'mxnet', 'c_api.h')
    if not os.path.exists(header):
        raise NativeUnavailable('the mxnet package has no C API headers (%s)' % header,
                                fix="Reinstall MXNet's wheel, which ships them")
    compiler = compiler_name()
    if shutil.which(compiler) is None:
        raise NativeUnavailable('no C++ compiler: %r was not found' % compiler,
                                fix='Install a C++ compiler (g++, or set CXX to one)')
    try:
        cache.make_directories(os.path.dirname(path), cache_root)
        fd, tmp = tempfile.mkstemp(suffix='.so', dir=os.path.dirname(path))
    except OSError as exc:
        raise NativeUnavailable(
            'its cache directory %s cannot be written (%s%s)' % (
                cache_root, exc.filename + ': ' if exc.filename else '', exc.strerror or exc),
            fix='Set %s to a directory you can write, or unset it for %s'
                % (CACHE_VARIABLE, cache.default_root()))
    os.close(fd)
    include = os.path.join(mx_dir, 'include')
    import mxnet
    mkldnn = int(mxnet.runtime.Features().is_enabled('MKLDNN'))
    command = [compiler] + _flags() + ['-DMXNET_USE_MKLDNN=%d' % mkldnn, '-I' + include,
                                    '-I' + os.path.join(include, 'mkldnn'), SOURCE, '-o', tmp,
                                    '-L' + mx_dir, '-l:libmxnet.so', '-Wl,-rpath,' + mx_dir]
    # A layer's first call is silent for half a minute otherwise: say why.
    _say('compiling the native library (once per MXNet install, about 30 s) into %s ...' % path)
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
        if proc.returncode != 0:
            raise NativeUnavailable('%s failed:\n%s' % (' '.join(command), proc.stderr[-2000:]))
        os.replace(tmp, path)  # atomic: other processes see all of it or nothing
        _say('compiled in %.1f s' % (time.monotonic() - start))
    except subprocess.TimeoutExpired:
        raise NativeUnavailable('%s took more than %ds' % (compiler, BUILD_SECONDS))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def compiler_name():
    """The compiler :func:`build` runs: ``$CXX``, else ``g++``."""
    return os.environ.get('CXX') or 'g++'


def compiler_version():
    """The first line ``<compiler> --version`` prints, or why there is none."""
    compiler = compiler_name()
    if shutil.which(compiler) is None:
        return '%r not found' % compiler
    try:
        proc = subprocess.run([compiler, '--version'], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return '%s: %s' % (compiler, exc)
    first = (proc.stdout or proc.stderr).strip().splitlines()
    return '%s (%s)' % (shutil.which(compiler), first[0] if first else 'no version')


def _say(line):
    """``gluon_syncbn: <line>`` on stderr, at once: progress, not a warning."""
    sys.stderr.write('gluon_syncbn: %s\n' % line)
    sys.stderr.flush()


def _once(name, make):
    """``make()``, kept as ``_state[name]``. Made once, whichever threads ask
    at the same time (a layer's first call may come from one Python thread
    per device: GluonCV's parallel_apply); the others wait, then share it."""
    done = name + ' done'
    if done not in _state:
        with _lock:
            if done not in _state:
                _state[name] = make()
                _state[done] = True  # last: who sees it reads the result unlocked
    return _state[name]


def load():
    """The loaded native library (a :class:`~.library.Library`), or None where
    it cannot be had (the reason in :func:`status`), built at the first
    call. Its operators are registered later, each where a layer needs it
    and its self-test passed (:func:`async_operator`, :func:`exchange_operator`).
    """
    return _once('lib', _load)


def _load():
    try:
        path = _trusted_library()
        lib = Library(path, testing=_testing_source() is not None)
        lib.init(messages.TEMPLATES)
        _state['path'] = path
        return lib
    except (NativeUnavailable, OSError) as exc:
        _state['why_not'] = str(exc)
        _state['fix'] = getattr(exc, 'fix', '')
        return None


def _trusted_library():
    """The library's path, built where needed, where nobody else can change
    it or its verdicts (:mod:`.cache`): in the cache, or after one warning in
    a private place; its digest kept in ``_state``. Raises NativeUnavailable
    where no place can be trusted."""
    root, path = cache.root(), os.environ.get(SELFTEST_LIBRARY_VARIABLE)
    if path:  # a self-test's process: its parent's library, whose root is two levels up
        root = os.path.dirname(os.path.dirname(path))
    else:
        path = library_path(root)
    why = cache.untrusted(path, root)
    if why:
        private = cache.private_root(root)
        path = library_path(private)
        warn_user('gluon_syncbn: the native library is not loaded from %s, since %s: '
                  'somebody else could change the code every training job loads. It is '
                  'built in %s instead. Set %s to a directory only you can write.'
                  % (root, why, private, CACHE_VARIABLE))
        root = private
        why = cache.untrusted(path, root)
        if why:
            raise NativeUnavailable('no place to keep it can be trusted: %s' % why)
    if os.path.exists(path):
        digest = cache.digest(path)
        stale = [m for m in cache.verdicts(path) if cache.read_verdict(m)[0] != digest]
        if stale:
            warn_user('gluon_syncbn: %s is not the library its self-test verdict %s was '
                      'reached on: it is not loaded, but built again.' % (path, stale[0]))
            os.remove(path)
    if not os.path.exists(path):
        for marker in cache.verdicts(path):
            os.remove(marker)  # verdicts on a library that is gone
        build(path, root)
        digest = cache.digest(path)
    _state['digest'] = digest
    return path


def _register(part):
    """``{mx.nd: f, mx.sym: f}`` for operator ``part``, registered now where
    the library loaded and ``part``'s self-test passed; else None."""
    lib = load()
    if lib is None:
        return None
    verdict = _state['verdicts'][part] = _selftest(_state['path'], part)
    if verdict != 'ok' or not lib.register(part):
        return None
    from ..mxnet_private import operator_functions
    return operator_functions(ASYNC_OP if part == 'async' else EXCHANGE_OP)


def async_operator():
    """``{mx.nd: f, mx.sym: f}`` for the asynchronous operator (CPU
    contexts), or None. Registered at its first use, once."""
    return _once('async', lambda: _register('async'))


def exchange_operator():
    """``{mx.nd: f, mx.sym: f}`` for the exchange operator (the GPU path), or
    None. Registered at its first use, once, only beside the asynchronous
    operator (the same reliance on libmxnet's ABI, checked first). Its
    self-test: one layer on two devices (two GPUs where there are, else two
    CPU contexts down the GPU path) against NumPy, once per library and GPU
    driver."""
    return _once('exchange', lambda: _register('exchange')
                 if async_operator() is not None else None)


def status():
    """What was found so far: ``{'path', 'why_not', 'fix', 'verdicts'}``;
    ``fix`` is what to do about ``why_not`` ('' where nothing can be done), a
    verdict per self-test run (``'ok'`` or why it failed)."""
    return {'path': _state['path'], 'why_not': _state['why_not'], 'fix': _state['fix'],
            'verdicts': dict(_state['verdicts'])}


def _driver_tag():
    """The NVIDIA driver's version line's hash, or '' without one."""
    try:
        with open('/proc/driver/nvidia/version', 'rb') as f:
            return '-' + hashlib.sha1(f.readline()).hexdigest()[:12]
    except OSError:
        return ''


# How a self-test's process can end with a verdict on the build: ``ok``, its
# own failure (FAILED_EXIT, see selftest.py) or a crash the build causes.
# Anything else (the time limit on a loaded machine, a kill from outside)
# says nothing about the build: that outcome is not kept, and the next
# process runs the self-test again.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)
FAILED_EXIT = 3


def _selftest(path, part):
    """``'ok'``, or why ``python -m gluon_syncbn.selftest <part>``
    failed with the library at ``path``: run in a subprocess (a crash ends
    it, not the user's process). A definite verdict is kept beside the
    library in ``<library>.<part>[-<driver>].selftest`` and never asked
    again; any other outcome only for this process."""
    if os.environ.get(SELFTEST_VARIABLE) == '1':
        return 'ok'  # this is the self-test's process
    marker = '%s.%s%s.selftest' % (path, part, _driver_tag() if part == 'exchange' else '')
    kept = cache.read_verdict(marker) if os.path.exists(marker) else (None, None)
    if kept[0] != _state['digest']:  # none yet
        _say('self-testing the %s operator in a subprocess (a few seconds, once per build) ...'
             % ('asynchronous' if part == 'async' else part))
        verdict, definite = run_selftest(part)
        if not definite:
            return verdict
        cache.write_verdict(marker, _state['digest'], verdict)
        kept = (_state['digest'], verdict)
    verdict = kept[1]
    return verdict if verdict == 'ok' else '%s; see %s' % (verdict.strip()[-300:], marker)


def run_selftest(part):
    """``(verdict, definite)``: the outcome of ``selftest.py <part>`` in a
    subprocess, and whether it is a verdict on the build."""
    # From the directory that holds this package, which `-m` then imports:
    # from the caller's, another checkout there would be tested instead.
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, **{SELFTEST_VARIABLE: '1'})
    if _state['path']:
        env[SELFTEST_LIBRARY_VARIABLE] = os.path.abspath(_state['path'])
    try:
        proc = subprocess.run([sys.executable, '-m', 'gluon_syncbn.selftest', part],
                              cwd=package_parent, env=env, capture_output=True, text=True,
                              timeout=SELFTEST_SECONDS)
    except subprocess.TimeoutExpired:
        return 'it took more than %gs%s' % (SELFTEST_SECONDS, RETRIED % SELFTEST_SECONDS), False
    output = (proc.stderr or proc.stdout)[-500:]
    if proc.returncode == 0 and 'ok' in proc.stdout.split():
        return 'ok', True
    if proc.returncode == FAILED_EXIT:
        return 'failed: %s' % output, True
    if -proc.returncode in CRASH_SIGNALS:
        return 'crashed (%s): %s' % (signal.Signals(-proc.returncode).name, output), True
    return 'it ended with %s: %s%s' % (
        'signal %d' % -proc.returncode if proc.returncode < 0 else 'exit %d' % proc.returncode,
        output.strip()[-300:], RETRIED % SELFTEST_SECONDS), False


RETRIED = ('; not a verdict on the build, so not kept: the next process runs the self-test '
           'again at its first synchronized call (up to %gs)')


