"""The GPU wheel's CUDA libraries, loaded before MXNet (gluon_syncbn.cuda_libs),
tested without that wheel: small libraries compiled here stand in for
libmxnet.so, NVIDIA's wheels and the driver, with the sonames the real ones
have. Every load happens in a fresh process with a deadline (a library
loaded into pytest's own process would stay there)."""
import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, run_python

CC = os.environ.get('CC') or 'gcc'
MODULE = os.path.join(ROOT, 'gluon_syncbn', 'cuda_libs.py')
SONAMES = {
    'libcudart.so.11.0': 'cuda_runtime', 'libcublas.so.11': 'cublas',
    'libcufft.so.10': 'cufft', 'libcurand.so.10': 'curand',
    'libcusolver.so.11': 'cusolver', 'libnvrtc.so.11.2': 'cuda_nvrtc',
    'libnvToolsExt.so.1': 'nvtx', 'libcudnn.so.8': 'cudnn', 'libnccl.so.2': 'nccl',
}
# The GPU build's CUDA entries, deliberately not in dependency order.
GPU_NEEDS = ['libcudnn.so.8', 'libcuda.so.1', 'libnccl.so.2', 'libcudart.so.11.0',
             'libcusolver.so.11', 'libcublas.so.11']


def compile_library(path, soname, needs=(), folder=None):
    """A shared library with this soname whose DT_NEEDED entries are ``needs``
    (found in ``folder`` at link time), in that order."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    command = [CC, '-shared', '-fPIC', '-x', 'c', '-', '-o', path, '-Wl,-soname,' + soname,
               '-Wl,--no-as-needed']
    if needs:
        command += ['-L' + folder] + ['-l:' + name for name in needs]
    source = 'int marker_%s(void) { return 1; }\n' % soname.replace('.', '_').replace('-', '_')
    subprocess.run(command, input=source, text=True, check=True, timeout=60,
                   capture_output=True)
    return path


@pytest.fixture(scope='module')
def fakes(tmp_path_factory):
    if shutil.which(CC) is None:
        pytest.skip('no C compiler (%s) to build the stand-in libraries' % CC)
    root = tmp_path_factory.mktemp('cuda')
    build = str(root / 'build')
    for soname in SONAMES:
        # cuSOLVER links against cuBLAS (as NVIDIA's does), without a RUNPATH:
        # it loads only once cuBLAS is loaded, so the order is checked.
        needs = ['libcublas.so.11'] if soname == 'libcusolver.so.11' else []
        compile_library(os.path.join(build, soname), soname, needs, build)
    compile_library(os.path.join(build, 'libcuda.so.1'), 'libcuda.so.1')
    site = root / 'site'
    for soname, folder in SONAMES.items():
        (site / 'nvidia' / folder / 'lib').mkdir(parents=True)
        shutil.copy(os.path.join(build, soname), str(site / 'nvidia' / folder / 'lib' / soname))
    (root / 'driver').mkdir()
    shutil.copy(os.path.join(build, 'libcuda.so.1'), str(root / 'driver' / 'libcuda.so.1'))
    return {
        'root': root, 'site': str(site), 'driver': str(root / 'driver'),
        'gpu': compile_library(str(root / 'gpu' / 'libmxnet.so'), 'libmxnet.so', GPU_NEEDS, build),
        'cpu': compile_library(str(root / 'cpu' / 'libmxnet.so'), 'libmxnet.so',
                               ['libm.so.6'], '/nonexistent'),
    }


def run(code, driver=None, timeout=60, **kwargs):
    """Run ``code`` with ``cuda_libs`` loaded on its own (not the package,
    which would import mxnet); return what it printed as JSON."""
    prelude = ('import importlib.util, json, sys\n'
               'spec = importlib.util.spec_from_file_location("cuda_libs", %r)\n'
               'cuda_libs = importlib.util.module_from_spec(spec)\n'
               'spec.loader.exec_module(cuda_libs)\n'
               'args = json.loads(%r)\n' % (MODULE, json.dumps(kwargs)))
    # Only the driver the test gives, if any.
    return run_python(prelude + code, timeout, env={'LD_LIBRARY_PATH': driver or ''})


def result(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len('RESULT '):])


MAPPED = '''
def mapped():
    with open('/proc/self/maps') as f:
        return sorted({line.split()[-1] for line in f if args['root'] in line})
'''


def test_needed_libraries_reads_the_dynamic_section(fakes):
    proc = run('print("RESULT", json.dumps([cuda_libs.needed_libraries(args["gpu"]),'
               ' cuda_libs.needed_libraries(args["cpu"]), cuda_libs.needed_libraries(args["py"])]))',
               gpu=fakes['gpu'], cpu=fakes['cpu'], py=MODULE)
    gpu, cpu, not_elf = result(proc)
    # The compiler adds the C library after the ones asked for.
    assert gpu == GPU_NEEDS + ['libc.so.6']
    assert cpu == ['libm.so.6', 'libc.so.6']
    assert not_elf == []


def test_the_cpu_build_loads_nothing(fakes):
    proc = run(MAPPED + 'print("RESULT", json.dumps([cuda_libs.preload(args["cpu"], [args["site"]]),'
               ' mapped()]))', driver=fakes['driver'], cpu=fakes['cpu'], site=fakes['site'],
               root=str(fakes['root']))
    assert result(proc) == [[], []]


def test_the_gpu_build_loads_the_wheels_in_dependency_order(fakes):
    proc = run(MAPPED + 'print("RESULT", json.dumps([cuda_libs.preload(args["gpu"], [args["site"]]),'
               ' mapped()]))', driver=fakes['driver'], gpu=fakes['gpu'], site=fakes['site'],
               root=str(fakes['root']))
    loaded, mapped = result(proc)
    wheel = [os.path.join(fakes['site'], 'nvidia', SONAMES[name], 'lib', name)
             for name in ('libcudart.so.11.0', 'libcublas.so.11', 'libcusolver.so.11',
                          'libcudnn.so.8', 'libnccl.so.2')]
    # Only what libmxnet.so names, wheels first (cuBLAS before cuSOLVER), the driver last.
    assert loaded == wheel + ['libcuda.so.1'], loaded
    assert mapped == sorted(wheel + [os.path.join(fakes['driver'], 'libcuda.so.1')])


def test_what_loads_next_finds_them_loaded(fakes):
    # What MXNet does next: dlopen libmxnet.so, whose dependencies are found
    # only because they are loaded already (nothing is on the library path).
    code = ('import ctypes\ncuda_libs.preload(args["gpu"], [args["site"]])\n'
            'ctypes.CDLL(args["gpu"], ctypes.RTLD_LOCAL)\nprint("RESULT 1")')
    assert result(run(code, driver=fakes['driver'], gpu=fakes['gpu'], site=fakes['site'])) == 1
    # And without the preload it fails, as `import mxnet` does.
    proc = run('import ctypes\nctypes.CDLL(args["gpu"])', driver=fakes['driver'], gpu=fakes['gpu'])
    assert proc.returncode != 0 and 'cannot open shared object file' in proc.stderr


def test_a_missing_wheel_library_names_it_and_the_fix(fakes, tmp_path):
    site = tmp_path / 'site'
    shutil.copytree(fakes['site'], str(site))
    shutil.rmtree(str(site / 'nvidia' / 'nccl'))
    proc = run('cuda_libs.preload(args["gpu"], [args["site"]])', driver=fakes['driver'],
               gpu=fakes['gpu'], site=str(site))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('cuda_libs.CudaLibraryError: gluon_syncbn: the installed mxnet is '
                           'the GPU build (%s) and needs libnccl.so.2 (from the wheel '
                           'nvidia-nccl-cu11)' % fakes['gpu']), last
    assert 'pip install -e ".[gpu]"' in last and 'pip install nvidia-nccl-cu11' in last, last
    assert 'OSError' not in proc.stderr


def test_a_missing_driver_names_it_and_the_fix(fakes):
    proc = run('cuda_libs.preload(args["gpu"], [args["site"]])', gpu=fakes['gpu'],
               site=fakes['site'])
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "needs libcuda.so.1, the NVIDIA driver's library, but it is not on the library " \
           "path" in last, last
    assert 'Install the NVIDIA driver (version 520 or later' in last
    assert 'pip install -e ".[cpu]"' in last


def test_nothing_happens_once_mxnet_is_imported(fakes):
    # Its library is loaded (or its import failed): too late, and not needed.
    code = 'sys.modules["mxnet"] = sys\nprint("RESULT", json.dumps(cuda_libs.preload()))'
    assert result(run(code)) == []


def test_import_gluon_syncbn_raises_the_clear_error(fakes, tmp_path):
    # The package preloads before it imports mxnet: MXNET_LIBRARY_PATH makes
    # MXNet's own search (and so the preload) find the stand-in GPU build,
    # and no wheel folder has NCCL.
    proc = run_python('import gluon_syncbn', 60, cwd=str(tmp_path),
                      env={'MXNET_LIBRARY_PATH': fakes['gpu'], 'LD_LIBRARY_PATH': ''})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('gluon_syncbn.cuda_libs.CudaLibraryError: gluon_syncbn: the '
                           'installed mxnet is the GPU build (%s) and needs ' % fakes['gpu']), last


def test_the_printed_library_path(fakes):
    from gluon_syncbn.cuda_path import library_path
    folders = library_path(fakes['gpu'], [fakes['site']], '/opt/x:' + fakes['site'] +
                           '/nvidia/cudnn/lib')
    assert folders.split(':') == [os.path.join(fakes['site'], 'nvidia', SONAMES[name], 'lib')
                                  for name in ('libcudart.so.11.0', 'libcublas.so.11',
                                               'libcusolver.so.11', 'libcudnn.so.8',
                                               'libnccl.so.2')] + ['/opt/x']
    assert library_path(fakes['cpu'], [fakes['site']], '/opt/x') == '/opt/x'
