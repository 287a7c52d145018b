"""The native operators (``syncbn.cc``): built once per libmxnet.so, loaded with ctypes.

Two operators of MXNet's own kind, registered in its C++ registry; neither
is a custom operator, and no thread waits in them:

* the asynchronous operator (``async_op.h``), CPU contexts: the whole layer
  call; it runs on the device's engine worker and completes when the devices
  have met;
* the exchange operator (``exchange_op.h``), GPUs: the synchronization step
  on the packed per-channel vector (cpu and gpu), moving data only with
  MXNet's engine copies.

Both rely on the C++ ABI of the libmxnet.so they were built against
(``mxnet_abi.h``); a self-test in a subprocess checks each once per build
(``selftest.py``, its verdict in ``<library>.<part>.selftest``): the
asynchronous operator at load, the exchange operator at the GPU path's first
use, on two devices and once per GPU driver too. Where one fails, its layers
run the Python operator, with one warning.

``GLUON_SYNCBN_BACKEND`` selects the backend of every layer in one process:

``auto`` (default)
    the asynchronous operator on CPU contexts, the exchange operator on GPUs;
    where the one a layer needs cannot be had (no C++ compiler, no MXNet
    headers, a failed self-test), the Python operator, with one warning
    saying why;
``async``
    the asynchronous operator, or an error saying why it cannot be had (and
    for layers on GPUs, which it cannot run);
``exchange``
    the exchange operator, on CPU contexts too (they then take the GPUs' path:
    MXNet's operators compute the moments), or an error saying why it cannot
    be had;
``python``
    the Python operator (``gluon_syncbn.op``) for every layer. The library is
    still built and loaded where it can be, quietly, for the step session and
    for completing the Python operator's failed calls one after another
    (``failures.h``); it registers no operator.

Across processes (kvstore, Horovod) the same operators run, and each
process's sums leave it through the transport's native twin (``transport.h``,
made by :mod:`gluon_syncbn.transport`); where there is none (an unknown
Horovod version), the Python operator and its Python transport.

The library is compiled with ``$CXX`` (default ``g++``) against the headers
and ``libmxnet.so`` that ship in the mxnet wheel, into
``$GLUON_SYNCBN_CACHE`` (default ``~/.cache/gluon_syncbn``), one file per
``libmxnet.so`` (its path, size and time: CPU and GPU environments sharing a
cache never share a build or a self-test verdict) and source, so an upgrade or
an edit rebuilds it and concurrent processes never load a half-written file.
"""
import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from .. import messages
from ..errors import SyncBatchNormError, warn_user

__all__ = ['load', 'requested_backend', 'choose_operator', 'async_operator',
           'exchange_operator']

ASYNC_OP = '_gluon_syncbn_sync'
EXCHANGE_OP = '_gluon_syncbn_exchange'
BACKEND_VARIABLE = 'GLUON_SYNCBN_BACKEND'
BACKENDS = ('auto', 'async', 'exchange', 'python')
RENAMED_VARIABLE = 'GLUON_SYNCBN_OPERATOR'  # its values were auto, native and python
CACHE_VARIABLE = 'GLUON_SYNCBN_CACHE'
SELFTEST_VARIABLE = 'GLUON_SYNCBN_SELFTEST'  # set in the self-test's own process
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

# Filled once, under _lock: a layer's first call may come from one Python
# thread per device at once (GluonCV's parallel_apply), and building,
# self-testing, registering and generating the operators' functions must
# happen once. 'loaded' is set last, so a thread that sees it reads the rest
# without the lock.
_state = {'lib': None, 'path': None, 'why_not': None, 'async': None, 'exchange': None,
          'loaded': False, 'exchange_checked': False, 'verdicts': {}}
_lock = threading.RLock()


class NativeUnavailable(Exception):
    """The native operator cannot be built or loaded here; the message says why."""


def requested_backend():
    """``'auto'``, ``'async'``, ``'exchange'`` or ``'python'``, from
    ``GLUON_SYNCBN_BACKEND``; raises on any other value."""
    if os.environ.get(RENAMED_VARIABLE) is not None:
        raise SyncBatchNormError(
            '%s is no longer read: set %s=auto, async (CPU contexts), exchange (GPUs) or '
            'python instead, and unset %s.' % (RENAMED_VARIABLE, BACKEND_VARIABLE,
                                               RENAMED_VARIABLE))
    value = os.environ.get(BACKEND_VARIABLE, 'auto').strip().lower() or 'auto'
    if value not in BACKENDS:
        raise SyncBatchNormError('%s=%r: use %s.' % (BACKEND_VARIABLE, value,
                                                      ', '.join(BACKENDS)))
    return value


def _mxnet_dir():
    import mxnet
    return os.path.dirname(os.path.abspath(mxnet.__file__)), mxnet.__version__


def mxnet_identity(mx_dir):
    """What tells the ``libmxnet.so`` the library links against from any other.

    The CPU and GPU wheels are both version 1.9.1, and a CPU and a GPU venv
    often share one cache: a library built, and self-tested, against one
    wheel's libmxnet.so must never be loaded with the other's. Its real path,
    size and modification time tell them apart at the cost of one ``stat``
    (hashing the file would read 0.9 GB for the GPU wheel at every import:
    0.8 s measured with it in the page cache, 6.5 s without); reinstalling
    the wheel changes the time, so it rebuilds.

    Parameters
    ----------
    mx_dir : str
        The mxnet package's folder, where the build links ``libmxnet.so``.

    Returns
    -------
    str
        The path, size and time, or the path alone if there is no file.
    """
    library = os.path.realpath(os.path.join(mx_dir, 'libmxnet.so'))
    try:
        info = os.stat(library)
    except OSError:
        return library  # no library there: the build says so
    return '%s\0%d\0%d' % (library, info.st_size, info.st_mtime_ns)


def library_path():
    """Where the library for this libmxnet.so and this source lives."""
    mx_dir, version = _mxnet_dir()
    digest = hashlib.sha256(' '.join(FLAGS).encode())
    digest.update(b'\0' + mxnet_identity(mx_dir).encode() + b'\0')
    for name in sorted(os.listdir(SOURCE_DIR)):
        if name.endswith(('.cc', '.h')):
            with open(os.path.join(SOURCE_DIR, name), 'rb') as f:
                digest.update(name.encode() + b'\0' + f.read())
    digest = digest.hexdigest()[:16]
    cache = os.environ.get(CACHE_VARIABLE) or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache'),
        'gluon_syncbn')
    return os.path.join(cache, 'mxnet-%s' % version, 'libgluon_syncbn-%s.so' % digest)


def _mkldnn():
    import mxnet
    return int(mxnet.runtime.Features().is_enabled('MKLDNN'))


def build(path):
    """Compile ``syncbn.cc`` into ``path``; raise NativeUnavailable with the reason."""
    mx_dir, _ = _mxnet_dir()
    header = os.path.join(mx_dir, 'include', 'mxnet', 'c_api.h')
    if not os.path.exists(header):
        raise NativeUnavailable('the mxnet package has no C API headers (%s)' % header)
    compiler = os.environ.get('CXX') or 'g++'
    if shutil.which(compiler) is None:
        raise NativeUnavailable('no C++ compiler: %r was not found (set CXX to one)' % compiler)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=os.path.dirname(path))
    os.close(fd)
    include = os.path.join(mx_dir, 'include')
    command = [compiler] + FLAGS + ['-DMXNET_USE_MKLDNN=%d' % _mkldnn(), '-I' + include,
                                    '-I' + os.path.join(include, 'mkldnn'), SOURCE, '-o', tmp,
                                    '-L' + mx_dir, '-l:libmxnet.so', '-Wl,-rpath,' + mx_dir]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
        if proc.returncode != 0:
            raise NativeUnavailable('%s failed:\n%s' % (' '.join(command), proc.stderr[-2000:]))
        os.replace(tmp, path)  # atomic: other processes see all of it or nothing
    except subprocess.TimeoutExpired:
        raise NativeUnavailable('%s took more than %ds' % (compiler, BUILD_SECONDS))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _declare(lib):
    c = ctypes
    lib.gsbn_register_async.argtypes = []
    lib.gsbn_register_exchange.argtypes = []
    lib.gsbn_set_message.argtypes = [c.c_char_p, c.c_char_p]
    lib.gsbn_set_message.restype = None
    lib.gsbn_group_create.argtypes = [c.c_char_p, c.c_char_p, c.c_char_p, c.c_int, c.c_double,
                                      c.c_char_p, c.POINTER(c.c_int), c.c_int]
    lib.gsbn_group_create.restype = None
    lib.gsbn_group_set_running.argtypes = [c.c_char_p, c.c_int, c.c_void_p, c.c_void_p]
    lib.gsbn_group_set_running.restype = None
    lib.gsbn_group_remove.argtypes = [c.c_char_p]
    lib.gsbn_group_remove.restype = None
    lib.gsbn_reserve_engine_errors.argtypes = []
    lib.gsbn_reserve_engine_errors.restype = None
    lib.gsbn_fail_python_call.argtypes = [c.c_void_p, c.c_void_p, c.c_char_p]
    lib.gsbn_token.restype = c.c_uint64
    lib.gsbn_begin_step.restype = None
    lib.gsbn_abort.argtypes = [c.c_char_p, c.c_int]
    lib.gsbn_abort.restype = None
    lib.gsbn_group_set_transport.argtypes = [c.c_char_p, c.c_int, c.POINTER(c.c_double),
                                             c.c_int]
    lib.gsbn_group_set_transport.restype = None
    lib.gsbn_transport_kvstore.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_char_p,
                                           c.c_double]
    lib.gsbn_transport_horovod.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_double]
    lib.gsbn_transport_loopback.argtypes = [c.c_int, c.c_char_p, c.c_double]
    lib.gsbn_transport_close.argtypes = [c.c_int, c.c_char_p]
    lib.gsbn_transport_close.restype = None
    for name in ('gsbn_staging_layers', 'gsbn_pending_exchanges'):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = c.c_int64
    lib.gsbn_store_queued.argtypes = [c.c_int]
    lib.gsbn_store_queued.restype = c.c_int64
    for name in ('gsbn_store_acquire', 'gsbn_store_release'):
        getattr(lib, name).argtypes = [c.c_int]
        getattr(lib, name).restype = None
    for name in ('gsbn_cause', 'gsbn_take_errors', 'gsbn_broken'):
        getattr(lib, name).argtypes = [c.c_char_p, c.c_int]


def load():
    """The loaded native library, or None where it cannot be had.

    Builds it on first use, once, whichever threads ask at the same time
    (the others wait, then share the result). Where it cannot be had,
    ``auto`` warns once, ``async`` and ``exchange`` raise
    :class:`SyncBatchNormError`, and ``python`` says nothing; ``python``
    registers no operator.
    """
    backend = requested_backend()
    if not _state['loaded']:
        with _lock:
            if not _state['loaded']:
                _load_locked(backend)
                _state['loaded'] = True
    if _state['lib'] is None and backend in ('async', 'exchange'):
        raise SyncBatchNormError('%s=%s, but the native library is not available: %s'
                                 % (BACKEND_VARIABLE, backend, _state['why_not']))
    return _state['lib']


def _load_locked(backend):
    try:
        path = library_path()
        if not os.path.exists(path):
            build(path)
        lib = ctypes.CDLL(path)
        _declare(lib)
        messages.install(lib)
        # The asynchronous operator relies on libmxnet's C++ ABI (see
        # mxnet_abi.h): registered only where its self-test passed.
        if backend != 'python' and _passes_selftest(path, 'async') and \
                lib.gsbn_register_async() == 0:
            from ..mxnet_private import operator_functions
            _state['async'] = operator_functions(ASYNC_OP)
        _state['path'] = path
        _state['lib'] = lib
    except (NativeUnavailable, OSError) as exc:
        _state['why_not'] = str(exc)
        if backend == 'auto':
            warn_user(
                'gluon_syncbn: the native operators are not available (%s). %s Install a '
                'C++ compiler (or set CXX), or set %s=python to silence this.'
                % (exc, FALLBACK, BACKEND_VARIABLE))


FALLBACK = 'Its layers run the Python operator (the same results, about 10-40x the host ' \
           'cost per call).'


# What failed, by part of selftest.py.
SELFTEST_FAILED = {
    'async': 'the native operators failed their self-test with this MXNet build',
    'exchange': "the GPU path's exchange operator failed its self-test with this MXNet build "
                'and driver',
}


def _passes_selftest(path, part):
    """Whether ``part`` of ``selftest.py`` passed with the library at
    ``path`` (the verdict kept in ``_state['verdicts']``); under ``auto`` a
    failure warns once."""
    verdict = _state['verdicts'][part] = _selftest(path, part)
    if verdict != 'ok' and requested_backend() == 'auto':
        warn_user('gluon_syncbn: %s (%s). %s Set %s=python to silence this.'
                  % (SELFTEST_FAILED[part], verdict, FALLBACK, BACKEND_VARIABLE))
    return verdict == 'ok'


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
    """``'ok'``, or why ``python -m gluon_syncbn.native.selftest <part>``
    failed with the library at ``path``: run in a subprocess (a crash ends
    it, not the user's process). A definite verdict is kept beside the
    library in ``<library>.<part>[-<driver>].selftest`` and never asked
    again; any other outcome only for this process."""
    if os.environ.get(SELFTEST_VARIABLE) == '1':
        return 'ok'  # this is the self-test's process
    marker = '%s.%s%s.selftest' % (path, part, _driver_tag() if part == 'exchange' else '')
    if not os.path.exists(marker):
        verdict, definite = _run_selftest(part)
        if not definite:
            return verdict
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(marker))
        with os.fdopen(fd, 'w') as f:
            f.write(verdict)
        os.replace(tmp, marker)
    with open(marker) as f:
        verdict = f.read()
    return verdict if verdict == 'ok' else '%s; see %s' % (verdict.strip()[-300:], marker)


def _run_selftest(part):
    """``(verdict, definite)``: the outcome of ``selftest.py <part>`` in a
    subprocess, and whether it is a verdict on the build."""
    try:
        proc = subprocess.run([sys.executable, '-m', 'gluon_syncbn.native.selftest', part],
                              capture_output=True, text=True, timeout=SELFTEST_SECONDS,
                              env=dict(os.environ, **{SELFTEST_VARIABLE: '1'}))
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


def take_errors(lib):
    """``[(kind, message)]`` the native operator recorded since the last call."""
    buf = ctypes.create_string_buffer(1 << 16)
    lib.gsbn_take_errors(buf, len(buf))
    lines = buf.value.decode('utf-8', 'replace').splitlines()
    return [tuple(line.split('\t', 1)) for line in lines if '\t' in line]


def cause(lib):
    buf = ctypes.create_string_buffer(1 << 14)
    lib.gsbn_cause(buf, len(buf))
    return buf.value.decode('utf-8', 'replace')


def exchange_operator():
    """``{mx.nd: f, mx.sym: f}`` for the exchange operator (the GPU path), or
    None (the Python operator runs). Registered at the GPU path's first use,
    where its self-test passed, and only with the asynchronous operator (the
    same reliance on libmxnet's ABI, checked first)."""
    lib = load()
    if lib is not None and _state['async'] is not None and not _state['exchange_checked']:
        with _lock:  # once, as load()
            if not _state['exchange_checked']:
                # Its self-test: one layer on two devices (two GPUs where
                # there are, else two CPU contexts down the GPU path) against
                # NumPy, once per library and GPU driver.
                if _passes_selftest(_state['path'], 'exchange') and \
                        lib.gsbn_register_exchange() == 0:
                    from ..mxnet_private import operator_functions
                    _state['exchange'] = operator_functions(EXCHANGE_OP)
                _state['exchange_checked'] = True
    return _state['exchange']


def choose_operator(layer, devices, on_cpu, transport):
    """``(operator, why_python)``: the operator the calls of ``layer`` (its
    name) on ``devices`` take, chosen here and nowhere else, once per layer
    (``registry.SyncGroup``).

    ``auto`` takes the asynchronous operator (``'async'``) on CPU contexts
    (``on_cpu``, see :func:`gluon_syncbn.engine.in_host_memory`) and the
    exchange operator (``'exchange'``) on GPUs, where it loaded and passed its
    self-test and, across processes, where ``transport`` has a native twin
    (:mod:`gluon_syncbn.transport`); else ``'python'``, with the reason in
    ``why_python`` ('' for a native operator). ``async`` and ``exchange``
    raise :class:`SyncBatchNormError` with that reason instead.
    """
    backend = requested_backend()
    if backend == 'python':
        return 'python', '%s=python' % BACKEND_VARIABLE
    kind = backend if backend != 'auto' else ('async' if on_cpu else 'exchange')
    if kind == 'async' and not on_cpu:
        why = ('the asynchronous operator runs on CPU contexts only, and this layer runs on '
               '%s' % ', '.join(devices))
    else:
        why = _why_not(kind, transport)
    if not why:
        return kind, ''
    if backend == 'auto':
        return 'python', why
    raise SyncBatchNormError(
        "SyncBatchNorm '%s': %s=%s, but %s. Unset %s to let the library choose (it falls "
        "back to the Python operator)." % (layer, BACKEND_VARIABLE, backend, why,
                                           BACKEND_VARIABLE))


def _why_not(kind, transport):
    """'' if the ``kind`` operator can run a layer over ``transport``, else why not."""
    functions = async_operator() if kind == 'async' else exchange_operator()
    if functions is None:
        if _state['why_not']:
            return _state['why_not']
        # The exchange operator is registered only beside the asynchronous one.
        failed = kind if kind in _state['verdicts'] else 'async'
        verdict = _state['verdicts'].get(failed)
        if verdict == 'ok':
            return "MXNet's registry refused the %s operator" % failed
        return 'the %s operator failed its self-test: %s' % (failed, verdict)
    if transport.cross_process and transport.make_native(_state['lib']) is None:
        return transport.why_python
    return ''


def async_operator():
    """``{mx.nd: f, mx.sym: f}`` for the asynchronous operator (CPU contexts),
    or None (the Python operator runs)."""
    load()
    return _state['async']
