"""Run in a subprocess by ``native.async_operator()`` and
``native.exchange_operator()``: does the asynchronous operator (``python -m
gluon_syncbn.selftest async``) or the exchange operator (``... exchange``) work with this MXNet
build? Both rely on libmxnet's C++ ABI (see ``mxnet_abi.h``); a build whose
ABI differs crashes here, not in the user's process. The asynchronous
operator: one CPU context's forward and backward, imperative and in a static
graph, and a CPU context's temp space of its own. The exchange operator: the
GPU path's layer as users run it, on two GPUs where there are, else on two
CPU contexts down the GPU path, one uneven step imperative and in a static
graph. Both against NumPy; prints
``ok`` and exits 0 if right, and exits ``native.FAILED_EXIT`` with the reason
if not (a verdict the caller keeps, as it keeps a crash)."""
import os
import sys

import numpy as np

os.environ['GLUON_SYNCBN_SELFTEST'] = '1'  # load() registers without asking us again

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from gluon_syncbn import SyncBatchNorm, configure_cpu_contexts, native  # noqa: E402


def reference(x, gamma, beta, w, eps):
    mean = x.mean(axis=(0, 2))
    var = x.var(axis=(0, 2))
    xhat = (x - mean[None, :, None]) / np.sqrt(var + eps)[None, :, None]
    dxhat = w * gamma[None, :, None]
    dx = (dxhat - dxhat.mean(axis=(0, 2))[None, :, None]
          - xhat * (dxhat * xhat).mean(axis=(0, 2))[None, :, None])
    dx /= np.sqrt(var + eps)[None, :, None]
    return xhat * gamma[None, :, None] + beta[None, :, None], dx, (w * xhat).sum(axis=(0, 2))


def fail(reason):
    """End with this build's verdict: it does not work here, for ``reason``."""
    sys.stderr.write(reason + '\n')
    sys.exit(native.FAILED_EXIT)


def main(part):
    lib = native.load()
    if lib is None or native.async_operator() is None:
        fail('the native library did not load')
    rng = np.random.RandomState(0)
    x = rng.randn(4, 3, 5)
    w = rng.randn(4, 3, 5)
    gamma, beta = rng.rand(3) + 0.5, rng.randn(3)
    eps = 1e-5
    want_y, want_dx, want_dgamma = reference(x, gamma, beta, w, eps)
    expected = (want_y, want_dx, want_dgamma, w.sum(axis=(0, 2)), 0.1 * x.mean(axis=(0, 2)),
                0.9 + 0.1 * x.var(axis=(0, 2)))
    if part == 'async':
        check_async(lib, x, w, gamma, beta, eps, expected)
    elif part == 'exchange':
        check_exchange(x, w, gamma, beta, eps, expected)
    else:
        sys.exit('unknown part %r: async or exchange' % (part,))
    print('ok')


def check_async(lib, x, w, gamma, beta, eps, expected):
    """The asynchronous operator on one CPU context."""
    ops = native.async_operator()
    handle = lib.create_layer('selftest', ['cpu(0)'], 60.0, 60.0, '', [0], 1)
    kwargs = dict(layer=handle, fix_gamma=False, axis=1, eps=eps, momentum=0.9,
                  input_dtype='float64')

    class Layer(gluon.HybridBlock):
        def hybrid_forward(self, F, data, g, b, m, v):
            return ops[F](data, g, b, m, v, static_shape=True, **kwargs)

    for hybridize in (False, True):
        arrays = [mx.nd.array(a, dtype='float64') for a in (x, gamma, beta)]
        running = [mx.nd.zeros(3, dtype='float64'), mx.nd.ones(3, dtype='float64')]
        for a in arrays:
            a.attach_grad()
        layer = Layer()
        if hybridize:
            layer.hybridize(static_alloc=True, static_shape=True)
        with autograd.record():
            y = layer(*(arrays + running))
        y.backward(mx.nd.array(w, dtype='float64'))
        compare('the asynchronous operator', hybridize,
                [y] + [a.grad for a in arrays] + running, expected)
    lib.remove_layer(handle)
    check_cpu_temp_space(lib, x)


def check_cpu_temp_space(lib, x):
    """A CPU context's temp space of its own (``cpu_resources.h``), as a
    layer on several CPU contexts gets it: a reduction that takes temp
    space, answered from cpu(1)'s pool, against NumPy."""
    why = lib.separate_cpu_temp_space(4)
    if why:
        return  # the layer then keeps MXNet's shared pool, and says so
    for _ in range(6):  # more than the pool's slots: every slot handed out and reused
        got = mx.nd.sum(mx.nd.array(x, ctx=mx.cpu(1), dtype='float64'), axis=(0, 2))
        if not np.allclose(got.asnumpy(), x.sum(axis=(0, 2)), rtol=1e-12, atol=0):
            fail('wrong results with a temp-space pool per CPU context')
    if lib.cpu_temp_slots(1) != 4:
        fail('the temp-space pool per CPU context was not used')


def check_exchange(x, w, gamma, beta, eps, expected):
    """The GPU path's layer (the exchange operator in the graph of
    ``backends/vector_graph.py``)
    on two devices, 1 + 3 samples."""
    if mx.context.num_gpus() >= 2:
        ctxs = [mx.gpu(0), mx.gpu(1)]
    else:
        os.environ['GLUON_SYNCBN_BACKEND'] = 'exchange'  # on CPU contexts too
        ctxs = [mx.cpu(0), mx.cpu(1)]
        configure_cpu_contexts(2)  # before MXNet's first operator
    for hybridize in (False, True):
        layer = SyncBatchNorm(in_channels=3, epsilon=eps, momentum=0.9, timeout=60)
        layer.cast('float64')
        layer.initialize(ctx=ctxs)
        layer.gamma.set_data(mx.nd.array(gamma, dtype='float64'))
        layer.beta.set_data(mx.nd.array(beta, dtype='float64'))
        if hybridize:
            layer.hybridize(static_alloc=True, static_shape=True)
        xs = [mx.nd.array(x[:1], ctx=ctxs[0], dtype='float64'),
              mx.nd.array(x[1:], ctx=ctxs[1], dtype='float64')]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [layer(a) for a in xs]
        autograd.backward(ys, [mx.nd.array(w[:1], ctx=ctxs[0], dtype='float64'),
                               mx.nd.array(w[1:], ctx=ctxs[1], dtype='float64')])
        if layer._sync_backend.name != 'exchange':
            fail('the layer did not take the exchange operator')
        total = lambda p: sum(p.grad(c).asnumpy() for c in ctxs)  # noqa: E731
        got = [np.concatenate([y.asnumpy() for y in ys]),
               np.concatenate([a.grad.asnumpy() for a in xs]),
               total(layer.gamma), total(layer.beta)]
        for c in ctxs:  # each device's running statistics
            compare('the exchange operator', hybridize,
                    got + [layer.running_mean.data(c), layer.running_var.data(c)], expected)


def compare(what, hybridize, got, expected):
    """Exit naming ``what`` unless y, the gradients of x, gamma and beta and
    the running mean and variance in ``got`` equal ``expected``."""
    for g, want in zip(got, expected):
        g = g.asnumpy() if hasattr(g, 'asnumpy') else g
        if not np.allclose(g, want, rtol=1e-9, atol=1e-9):
            fail('wrong results from %s (hybridized=%s)' % (what, hybridize))


if __name__ == '__main__':
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else 'async')
    except (MemoryError, KeyboardInterrupt):
        raise  # says nothing about the build
    except Exception as exc:  # pylint: disable=broad-except
        import traceback
        traceback.print_exc()
        fail('%s: %s' % (type(exc).__name__, exc))
