"""Probe: the floor of the operator machineries a SyncBatchNorm can run on.

Times the 53-layer stack of bench_overhead.py (conv 1x1 + X + relu on
(2, 16, 2, 2) per device, forward + backward) with X one of: nothing, plain
nn.BatchNorm, do-nothing native custom operators with two signatures, a
do-nothing asynchronous NNVM operator (async_op.cc), MXNet's contrib
SyncBatchNorm and gluon_syncbn's SyncBatchNorm, all in one process, taking
turns step by step. Prints milliseconds added per call per device against
nn.BatchNorm. Not a test and not project code: see README.md.

    python benchmarks/probe_op_floor/probe.py --n 2 --mode hybrid imperative
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = 53
# name -> (args, outs, auxs) of a do-nothing custom operator
CUSTOM = {'custom 1-1-0': (1, 1, 0),   # x -> y
          'custom 3-2-2': (3, 2, 2)}   # gluon_syncbn's host operator's arrays
KINDS = ['nothing', 'nn.BatchNorm'] + list(CUSTOM) + ['async', 'gluon_syncbn']  # contrib: see README.md


def build(out_dir):
    """Compile both probe libraries against the installed MXNet wheel."""
    import mxnet as mx
    root = os.path.dirname(mx.__file__)
    mkldnn = int(mx.runtime.Features().is_enabled('MKLDNN'))
    common = ['g++', '-O2', '-shared', '-fPIC', '-std=c++11', '-I' + os.path.join(root, 'include'),
              '-L' + root, '-l:libmxnet.so', '-Wl,-rpath,' + root]
    # The wheel's build: old std::string ABI, no CUDA, int32 tensor sizes.
    flags = ['-D_GLIBCXX_USE_CXX11_ABI=0', '-DMXNET_USE_MKLDNN=%d' % mkldnn,
             '-DMSHADOW_USE_CUDA=0', '-DMXNET_USE_CUDA=0', '-DMSHADOW_USE_MKL=0',
             '-DMSHADOW_USE_CBLAS=0', '-DMSHADOW_STAND_ALONE=1', '-DDMLC_USE_CXX11=1',
             '-DMSHADOW_INT64_TENSOR_SIZE=0', '-I' + os.path.join(root, 'include', 'mkldnn')]
    libs = {}
    for name, extra in (('custom_op', []), ('async_op', flags)):
        libs[name] = os.path.join(out_dir, 'lib%s.so' % name)
        subprocess.check_call(common[:1] + [os.path.join(HERE, name + '.cc'), '-o', libs[name]]
                              + common[1:] + extra)
    return libs


def worker(n, mode, steps, libs, kinds):
    import ctypes
    import time
    import warnings
    warnings.filterwarnings('ignore')
    import numpy as np
    import gluon_syncbn
    gluon_syncbn.configure_cpu_contexts(n)
    import mxnet as mx
    from mxnet import autograd
    from mxnet.base import _LIB, OpHandle, c_str, check_call
    from mxnet.gluon import HybridBlock, nn
    from mxnet.ndarray.register import _make_ndarray_function
    from mxnet.symbol.register import _make_symbol_function

    custom = ctypes.CDLL(libs['custom_op'])
    for i, (args, outs, auxs) in enumerate(CUSTOM.values()):
        assert custom.register_noop(b'noop%d' % i, args, outs, auxs) == 0
    assert ctypes.CDLL(libs['async_op']).gsbn_probe_register() == 0
    handle = OpHandle()
    check_call(_LIB.NNGetOpHandle(c_str('_gsbn_probe_async'), ctypes.byref(handle)))
    async_op = {mx.nd: _make_ndarray_function(handle, '_gsbn_probe_async', 'probe'),
                mx.sym: _make_symbol_function(handle, '_gsbn_probe_async', 'probe')}

    class Noop(HybridBlock):
        """x -> x through one of the probe operators."""
        def __init__(self, kind):
            super(Noop, self).__init__()
            self.kind = kind
            self.arrays = []
            if kind in CUSTOM:
                args, _, auxs = CUSTOM[kind]
                for i in range(args - 1 + auxs):
                    self.arrays.append('p%d' % i)
                    setattr(self, 'p%d' % i, self.params.get(
                        'p%d' % i, shape=(16,), init='ones', allow_deferred_init=True,
                        grad_req='write' if i < args - 1 else 'null'))

        def hybrid_forward(self, F, x, **params):
            if self.kind == 'async':
                return async_op[F](x)
            i = list(CUSTOM).index(self.kind)
            out = F.Custom(x, *[params[p] for p in self.arrays], op_type='noop%d' % i)
            return out[0] if CUSTOM[self.kind][1] > 1 else out

    def middle(kind):
        if kind == 'nothing':
            return nn.HybridLambda(lambda F, x: x)
        if kind == 'nn.BatchNorm':
            return nn.BatchNorm(in_channels=16)
        if kind == 'contrib':
            return mx.gluon.contrib.nn.SyncBatchNorm(in_channels=16, num_devices=n)
        if kind == 'gluon_syncbn':
            return gluon_syncbn.SyncBatchNorm(in_channels=16)
        return Noop(kind)

    ctxs = [mx.cpu(i) for i in range(n)]
    xs = [mx.nd.random.normal(shape=(2, 16, 2, 2), ctx=c) for c in ctxs]
    nets = {}
    for kind in kinds:
        net = nn.HybridSequential()
        for _ in range(LAYERS):
            net.add(nn.Conv2D(16, 1, use_bias=False, in_channels=16), middle(kind),
                    nn.Activation('relu'))
        net.initialize(mx.init.Xavier(), ctx=ctxs)
        if mode == 'hybrid':
            net.hybridize(static_alloc=True, static_shape=True)
        nets[kind] = net
    times = {kind: [] for kind in kinds}
    for step in range(steps + 3):
        for kind, net in nets.items():
            start = time.perf_counter()
            with autograd.record():
                ys = [net(x) for x in xs]
            autograd.backward(ys)
            mx.nd.waitall()
            if step >= 3:
                times[kind].append(time.perf_counter() - start)
    median = {kind: np.median(t) * 1e3 for kind, t in times.items()}
    base = median['nn.BatchNorm']
    for kind in kinds:
        print('| %d | %s | %s | %.1f ms | %+.3f |' % (
            n, mode, kind, median[kind], (median[kind] - base) / (LAYERS * n)), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--n', type=int, nargs='*', default=[2])
    parser.add_argument('--mode', nargs='*', default=['hybrid', 'imperative'])
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--kinds', nargs='*', default=KINDS,
                        help='what runs between conv and relu (contrib too: %(choices)s)',
                        choices=KINDS + ['contrib'])
    parser.add_argument('--deadline', type=float, default=300.0)
    parser.add_argument('--worker', nargs=2, help=argparse.SUPPRESS)
    parser.add_argument('--libs', nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        n, mode = args.worker
        worker(int(n), mode, args.steps, dict(zip(('custom_op', 'async_op'), args.libs)),
               args.kinds)
        return
    out_dir = tempfile.mkdtemp(prefix='gsbn_probe_')
    libs = build(out_dir)
    print('| N | mode | between conv and relu | step | ms per call per device vs nn.BatchNorm |')
    print('|---|---|---|---|---|', flush=True)
    for n in args.n:
        for mode in args.mode:
            try:
                subprocess.run([sys.executable, __file__, '--worker', str(n), mode,
                                '--steps', str(args.steps), '--kinds'] + args.kinds + ['--libs', libs['custom_op'],
                                libs['async_op']], timeout=args.deadline, check=True)
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
                print('| %d | %s | failed: %s | | |' % (n, mode, exc), flush=True)


if __name__ == '__main__':
    main()
