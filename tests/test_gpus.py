"""Which GPUs MXNet 1.9.1 runs on (gluon_syncbn.gpus), without a GPU: a
stand-in for the CUDA runtime, compiled here, reports the GPUs a test names
(``STANDIN_GPUS="name=major.minor;..."``) through the entry points the
library reads. Every load happens in a fresh process with a deadline."""
import os
import shutil
import subprocess

import pytest

from tests.conftest import run_python

CC = os.environ.get('CC') or 'gcc'
STANDIN = r'''
#include <stdlib.h>
#include <string.h>
/* cudaGetDeviceCount, cudaDeviceGetAttribute and cudaGetDeviceProperties
   as CUDA 11's runtime declares them, answering from $STANDIN_GPUS. */
static int gpu(int device, char* name, int* major, int* minor) {
  const char* list = getenv("STANDIN_GPUS");
  for (int i = 0; list && *list; ++i) {
    const char* end = strchr(list, ';');
    size_t n = end ? (size_t)(end - list) : strlen(list);
    const char* eq = memchr(list, '=', n);
    if (i == device && eq) {
      if (name) { memcpy(name, list, eq - list); name[eq - list] = 0; }
      *major = atoi(eq + 1);
      *minor = atoi(strchr(eq, '.') + 1);
      return 1;
    }
    list = end ? end + 1 : list + n;
  }
  return 0;
}
int cudaGetDeviceCount(int* count) {
  int major, minor, n = 0;
  while (gpu(n, 0, &major, &minor)) ++n;
  *count = n;
  return n ? 0 : 100;  /* cudaErrorNoDevice */
}
int cudaDeviceGetAttribute(int* value, int attr, int device) {
  int major, minor;
  if (!gpu(device, 0, &major, &minor) || (attr != 75 && attr != 76)) return 101;
  *value = attr == 75 ? major : minor;
  return 0;
}
int cudaGetDeviceProperties(char* props, int device) {
  int major, minor;
  memset(props, 0, 1008);  /* sizeof(cudaDeviceProp) in CUDA 11.8 */
  return gpu(device, props, &major, &minor) ? 0 : 101;
}
'''
HOPPER = 'NVIDIA H100 80GB HBM3=9.0;NVIDIA H100 80GB HBM3=9.0'
VOLTA = 'Tesla V100-SXM2-16GB=7.0;Tesla V100-SXM2-16GB=7.0'

TWO_DEVICE_CALL = '''
import gluon_syncbn
gluon_syncbn.configure_cpu_contexts(2)
import mxnet as mx
from mxnet import autograd
ctxs = [mx.cpu(0), mx.cpu(1)][:%d]
bn = gluon_syncbn.SyncBatchNorm(in_channels=3)
bn.initialize(ctx=ctxs)
with autograd.record():
    ys = [bn(mx.nd.ones((2, 3, 2, 2), ctx=c)) for c in ctxs]
print('SUM', sum(float(y.sum().asscalar()) for y in ys))
'''


@pytest.fixture(scope='module')
def runtime(tmp_path_factory):
    """A folder holding the stand-in as ``libcudart.so.11.0``."""
    if shutil.which(CC) is None:
        pytest.skip('no C compiler (%s) to build the stand-in runtime' % CC)
    folder = tmp_path_factory.mktemp('cudart')
    subprocess.run([CC, '-shared', '-fPIC', '-x', 'c', '-', '-o',
                    str(folder / 'libcudart.so.11.0'), '-Wl,-soname,libcudart.so.11.0'],
                   input=STANDIN, text=True, check=True, timeout=60, capture_output=True)
    return str(folder)


def test_names_and_compute_capabilities_are_read_from_the_runtime(runtime):
    code = ('import ctypes\nfrom gluon_syncbn import gpus\n'
            'print(gpus.gpu_properties(ctypes.CDLL(%r)))\n'
            'print(gpus.gpu_properties())\n' % os.path.join(runtime, 'libcudart.so.11.0'))
    out = run_python(code, 60, {'STANDIN_GPUS': 'NVIDIA H100 80GB HBM3=9.0;NVIDIA A10=8.6',
                                'LD_LIBRARY_PATH': runtime})
    assert out.returncode == 0, out.stderr[-3000:]
    # Given, and found by its soname as the GPU build loads it.
    assert out.stdout.splitlines() == [
        "[('NVIDIA H100 80GB HBM3', (9, 0)), ('NVIDIA A10', (8, 6))]"] * 2, out.stdout
    none = run_python(code.splitlines()[0] + '\nfrom gluon_syncbn import gpus\n'
                      'print(gpus.gpu_properties())\n', 60, {'STANDIN_GPUS': ''})
    assert none.stdout.strip() == '[]', none.stdout + none.stderr[-2000:]


@pytest.mark.parametrize('devices', [2, 1])
def test_a_layer_on_hopper_says_why_at_its_first_call(runtime, tmp_path, devices):
    # CPU contexts down the GPU path, counted as the runtime's GPUs 0 and 1:
    # one clear error naming the device, its GPU and compute capability, and
    # why; before any library work (nothing built), one device or two.
    env = {'STANDIN_GPUS': HOPPER, 'LD_LIBRARY_PATH': runtime, 'GLUON_SYNCBN_DEVICE_PATH': '1',
           'GLUON_SYNCBN_CACHE': str(tmp_path / 'cache'), 'GLUON_SYNCBN_BACKEND': 'auto'}
    out = run_python(TWO_DEVICE_CALL % devices, 120, env)
    assert out.returncode != 0
    assert ("SyncBatchNormError: SyncBatchNorm 'syncbatchnorm0': cpu(0) is a GPU of compute "
            'capability 9.0 (NVIDIA H100 80GB HBM3), on which MXNet 1.9.1 cannot run') \
        in out.stderr, out.stderr[-3000:]
    assert 'no PTX' in out.stderr and 'compute capability 5.0 to 8.9' in out.stderr
    assert not os.path.exists(tmp_path / 'cache')


def test_a_layer_on_volta_runs(runtime):
    env = {'STANDIN_GPUS': VOLTA, 'LD_LIBRARY_PATH': runtime, 'GLUON_SYNCBN_DEVICE_PATH': '1',
           'GLUON_SYNCBN_BACKEND': 'exchange'}
    out = run_python(TWO_DEVICE_CALL % 2, 120, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert abs(float(out.stdout.split()[-1])) < 1e-5, out.stdout  # normalized ones: zeros
