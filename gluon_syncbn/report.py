"""``python -m gluon_syncbn``: what this installation can do, and why.

Prints, for a user to read or paste into a bug report: the machine (cores,
AVX-512, the compiler, the CPU-context setup); MXNet's build and
features; each GPU with its compute capability and whether MXNet 1.9.1 runs
there; the CUDA libraries found; the native library, its build and its
self-tests' verdicts; which backend a layer on CPU contexts, on GPUs and
across processes gets here, and why; the engine settings; Horovod and
kvstore support. ``--selftest`` runs the self-tests now, in subprocesses, on
two GPUs where there are, else on two CPU contexts.
"""
import argparse
import importlib.util
import os
import sys

__all__ = ['main', 'report']

ENVIRONMENT = ('GLUON_SYNCBN_BACKEND', 'GLUON_SYNCBN_CACHE', 'GLUON_SYNCBN_TIMEOUT',
               'GLUON_SYNCBN_CPU_CONTEXTS', 'MXNET_ENGINE_TYPE', 'MXNET_CPU_TEMP_COPY',
               'MXNET_CPU_PARALLEL_RAND_COPY', 'MXNET_MKLDNN_ENABLED', 'CXX')


def _section(lines, title):
    lines.append('')
    lines.append(title)


def report(selftest=False):
    """The report's lines. ``selftest``: run both self-tests now. Without
    MXNet: the machine, how to install MXNet, and the settings."""
    from . import NO_MXNET, __version__
    lines = ['gluon_syncbn %s, Python %s' % (__version__, sys.version.split()[0])]
    _section(lines, 'Machine')
    lines.append('  CPU cores: %d usable of %d' % (len(os.sched_getaffinity(0)), os.cpu_count()))
    lines.append('  AVX-512: %s' % _avx512())
    if importlib.util.find_spec('mxnet') is None:
        _section(lines, 'MXNet')
        lines.append('  not found by %s' % sys.executable)
        lines.append('  %s' % NO_MXNET)
        lines.append('  the rest of this report, the native library%s, needs MXNet'
                     % (' and its self-tests' if selftest else ''))
        _settings(lines)
        return lines
    import mxnet as mx
    from . import backends, cpu_contexts, cuda_libs, gpus, native
    lines.append('  compiler: %s' % native.compiler_version())
    lines.append('  CPU-context setup: %s' % cpu_contexts.describe())
    _section(lines, 'MXNet')
    features = mx.runtime.Features()
    lines.append('  %s at %s' % (mx.__version__, os.path.dirname(mx.__file__)))
    lines.append('  features: %s' % ', '.join(
        name for name in ('CUDA', 'CUDNN', 'NCCL', 'MKLDNN', 'DIST_KVSTORE')
        if features.is_enabled(name)))
    _section(lines, 'GPUs')
    cuda = features.is_enabled('CUDA')
    found = gpus.gpu_properties() if cuda else []
    for i, (name, capability) in enumerate(found):
        runs = gpus.FIRST <= capability < gpus.LAST
        lines.append('  gpu(%d): %s, compute capability %d.%d: %s' % (
            i, name, capability[0], capability[1],
            'MXNet 1.9.1 runs here' if runs else 'MXNet 1.9.1 has no kernels for it'))
    if not cuda:
        lines.append('  none: this MXNet build has no CUDA (for GPUs: pip install '
                     "'gluon_syncbn[gpu]', MXNet's CUDA 11.2 build)")
    elif not found:
        lines.append('  none found (no GPU, or no driver)')
    library = cuda_libs.mxnet_library()
    needed = sorted(set(cuda_libs.RUNTIME) & set(cuda_libs.needed_libraries(library))) \
        if library else []
    lines.append('  CUDA libraries: %s' % (', '.join(
        '%s (%s)' % (s, cuda_libs.wheel_library(s) or 'library path') for s in needed)
        or 'none needed (CPU build)'))
    _section(lines, 'Native library')
    lib = native.load()
    status = native.status()
    lines.append('  %s' % (status['path'] if lib is not None
                           else 'not available: %s%s' % (
                               status['why_not'], '. ' + status['fix'] if status['fix'] else '')))
    if selftest:
        for part in ('async', 'exchange'):
            lines.append('  self-test %s now: %s' % (part, native.run_selftest(part)[0]))
    _section(lines, 'Backends (%s=%s)' % (backends.BACKEND_VARIABLE,
                                         backends.requested_backend()))
    for question, choice in backends.explain().items():
        if 'GPUs' in question and not cuda:
            lines.append('  %s: none (this MXNet build has no CUDA)' % question)
        elif 'GPUs' in question and not found:
            lines.append('  %s: none found; %s would run them (%s)' % (
                question, choice.backend or 'nothing', choice.reason))
        else:
            lines.append('  %s: %s (%s)' % (question, choice.backend or 'none', choice.reason))
    for part, verdict in sorted(native.status()['verdicts'].items()):
        lines.append('  self-test %s: %s' % (part, verdict))
    _section(lines, 'Across processes')
    lines.append('  kvstore: %s' % ('dist_sync and dist_sync_device' if features.is_enabled(
        'DIST_KVSTORE') else 'not in this MXNet build (no DIST_KVSTORE)'))
    lines.append('  horovod: %s' % _horovod())
    _settings(lines)
    return lines


def _settings(lines):
    _section(lines, 'Settings')
    for name in ENVIRONMENT:
        lines.append('  %s=%s' % (name, os.environ.get(name, '')))


def _avx512():
    """Whether this CPU has the AVX-512 that MKL-DNN's bfloat16 kernels need."""
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            flags = next((line.split(':', 1)[1].split() for line in cpuinfo
                          if line.startswith('flags')), [])
    except OSError:
        return 'unknown (no /proc/cpuinfo)'
    core = all(f in flags for f in ('avx512f', 'avx512bw', 'avx512vl', 'avx512dq'))
    if not core:
        return 'no: bfloat16 AMP cannot run on this CPU (MKL-DNN needs AVX-512 for it)'
    return 'yes%s: bfloat16 AMP can run' % (', with avx512_bf16' if 'avx512_bf16' in flags
                                             else '')


def _horovod():
    try:
        import horovod  # pylint: disable=import-outside-toplevel
        import horovod.mxnet  # noqa: F401  pylint: disable=import-outside-toplevel
    except ImportError as exc:
        return 'not available (%s)' % exc
    from .transport import HorovodTransport
    why = HorovodTransport.why_not_native()
    return '%s%s' % (horovod.__version__, ': ' + why if why else ', native transport')


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m gluon_syncbn', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--selftest', action='store_true',
                        help='run the native self-tests now')
    args = parser.parse_args(argv)
    print('\n'.join(report(selftest=args.selftest)))
