"""Run in a subprocess by ``native.load()``: do the asynchronous operator and
the exchange operator work with this MXNet build? They rely on libmxnet's C++
ABI (see ``mxnet_abi.h``); a build whose ABI differs crashes here, not in the
user's process. Checks one device's forward and backward of each, imperative
and in a static graph, against NumPy. Prints ``ok`` and exits 0 if so."""
import os
import sys

import numpy as np

os.environ['GLUON_SYNCBN_SELFTEST'] = '1'  # load() registers without asking us again

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from gluon_syncbn import native  # noqa: E402

GROUP = '_gluon_syncbn_selftest'


def reference(x, gamma, beta, w, eps):
    mean = x.mean(axis=(0, 2))
    var = x.var(axis=(0, 2))
    xhat = (x - mean[None, :, None]) / np.sqrt(var + eps)[None, :, None]
    dxhat = w * gamma[None, :, None]
    dx = (dxhat - dxhat.mean(axis=(0, 2))[None, :, None]
          - xhat * (dxhat * xhat).mean(axis=(0, 2))[None, :, None])
    dx /= np.sqrt(var + eps)[None, :, None]
    return xhat * gamma[None, :, None] + beta[None, :, None], dx, (w * xhat).sum(axis=(0, 2))


def main():
    lib = native.load()
    ops = native.async_operator()
    if lib is None or ops is None:
        sys.exit('the native library did not load')
    subgroups = (native.ctypes.c_int * 1)(0)
    lib.gsbn_group_create(GROUP.encode(), b'selftest', b'cpu(0)', 1, 60.0, b'', subgroups, 1)
    rng = np.random.RandomState(0)
    x = rng.randn(4, 3, 5)
    w = rng.randn(4, 3, 5)
    gamma, beta = rng.rand(3) + 0.5, rng.randn(3)
    eps = 1e-5
    want_y, want_dx, want_dgamma = reference(x, gamma, beta, w, eps)
    kwargs = dict(group=GROUP, eps=eps, momentum=0.9, fix_gamma=False, axis=1,
                  input_dtype='float64')

    class Layer(gluon.HybridBlock):
        def hybrid_forward(self, F, data, g, b, m, v):
            return ops[F](data, g, b, m, v, static_shape=True, **kwargs)

    expected = (want_y, want_dx, want_dgamma, w.sum(axis=(0, 2)), 0.1 * x.mean(axis=(0, 2)),
                0.9 + 0.1 * x.var(axis=(0, 2)))
    check(Layer, 'the asynchronous operator', x, w, gamma, beta, expected)
    exchange = native.device_operator()
    if exchange is not None:
        check_exchange(exchange, kwargs, x, w, gamma, beta, expected)
    lib.gsbn_group_remove(GROUP.encode())
    print('ok')


def check_exchange(exchange, kwargs, x, w, gamma, beta, expected):
    """The exchange operator (the GPU path) in the graph the block builds
    around it: moments by MXNet's operators, one packed vector in and out."""

    class Layer(gluon.HybridBlock):
        def hybrid_forward(self, F, data, g, b, m, v):
            m1 = F.BlockGrad(F.mean(data, axis=1, exclude=True, keepdims=True))
            xc = F.broadcast_sub(data, m1)
            m2 = F.mean(xc, axis=1, exclude=True, keepdims=True)
            sqdev = F.mean(F.square(xc), axis=1, exclude=True, keepdims=True)
            shape = F.Cast(F.BlockGrad(F.shape_array(data)), dtype='float64')
            packed = F.concat(F.reshape(F.concat(m1, m2, sqdev, dim=0), shape=(-1,)), shape,
                              g, b, dim=0)
            out = exchange[F](packed, m1, g, b, m, v, static_shape=True, **kwargs)
            scale, shift = F.split(out, num_outputs=2, axis=0)
            return F.broadcast_add(F.broadcast_mul(xc, F.reshape_like(scale, m1)),
                                   F.reshape_like(shift, m1))

    check(Layer, 'the exchange operator', x, w, gamma, beta, expected)


def check(layer_class, what, x, w, gamma, beta, expected):
    """Forward and backward of ``layer_class()`` on float64 arrays, imperative
    and in a static graph, from a head gradient ``w`` (independent of y);
    exit naming ``what`` unless y, the gradients of x, gamma and beta and the
    running mean and variance equal ``expected``."""
    for hybridize in (False, True):
        arrays = [mx.nd.array(a, dtype='float64') for a in (x, gamma, beta)]
        running = [mx.nd.zeros(3, dtype='float64'), mx.nd.ones(3, dtype='float64')]
        for a in arrays:
            a.attach_grad()
        layer = layer_class()
        if hybridize:
            layer.hybridize(static_alloc=True, static_shape=True)
        with autograd.record():
            y = layer(*(arrays + running))
        y.backward(mx.nd.array(w, dtype='float64'))
        results = [y] + [a.grad for a in arrays] + running
        for got, want in zip(results, expected):
            if not np.allclose(got.asnumpy(), want, rtol=1e-9, atol=1e-9):
                sys.exit('wrong results from %s (hybridized=%s)' % (what, hybridize))


if __name__ == '__main__':
    main()
