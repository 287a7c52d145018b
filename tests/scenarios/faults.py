"""Faults: a missing device, bad input on one device, an early read, user
code raising in a step, abandoned steps, misconfigured layers
(tests/test_faults.py; tests/test_sync_groups.py, tests/test_native_transport.py
and tests/soak_faults.py run some of them).
"""
import time

import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.scenarios import _capture, _fault_net, _recovery_error, _step, contexts, scenario


@scenario
def missing_device(num_devices=3, hybridize=False, timeout_seconds=2.0, seed=0):
    """Steps of a Trainer loop where the last device gets no slice (a last
    batch of fewer samples than devices), then a normal step. The timeout
    is caught as ``gluon_syncbn.SyncBatchNormTimeout`` where it surfaces:
    in the first step when the losses are read back (``asnumpy``), in the
    second at ``mx.nd.waitall()`` (``caught``: what each raised).
    ``hybridize``: False, True or 'static' (``_hybridize``)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    x = rng.randn(*shape).astype(np.float32)
    short = [mx.nd.array(x[i:i + 1], ctx=c) for i, c in enumerate(ctxs[:-1])]

    def train_step(read):
        with autograd.record():
            losses = [net(a).sum() for a in short]
        autograd.backward(losses)
        trainer.step(len(short))
        read(losses)

    caught, messages, seconds = [], [], []
    for read in (lambda losses: [l.asnumpy() for l in losses], lambda losses: mx.nd.waitall()):
        start = time.time()
        try:
            train_step(read)
            caught.append(None)
        except gluon_syncbn.SyncBatchNormTimeout as exc:
            caught.append('SyncBatchNormTimeout')
            messages.append(str(exc))
        except Exception as exc:  # pylint: disable=broad-except
            caught.append(type(exc).__name__)
            messages.append(str(exc))
        seconds.append(time.time() - start)
    return {'message': messages[0] if messages else None, 'caught': caught,
            'seconds': seconds[0], 'recovered': _recovery_error(net, ctxs, rng, shape)}


@scenario
def bad_input_on_one_device(problem, num_devices=3, hybridize=False, timeout_seconds=60.0,
                            seed=0, functional=False):
    """Device 1 gets a wrong input; the others must fail fast, then recover
    (two steps). ``functional``: every step through ``autograd.set_recording``
    / ``set_training`` instead of ``record()``."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    good = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]
    bad = {'channels': lambda c: mx.nd.array(rng.randn(1, 4, 4, 4), ctx=c),
           'rank': lambda c: mx.nd.array(rng.randn(1, 3, 4, 4, 2, 2), ctx=c),
           'dtype': lambda c: mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c, dtype='float64')}[problem]
    arrays = [good[0], bad(ctxs[1])] + good[2:]
    msg, kind, seconds = _capture(lambda: _step(net, arrays, functional))
    return {'message': msg, 'type': kind, 'seconds': seconds,
            'recovered': _recovery_error(net, ctxs, rng, shape, functional, steps=2)}


@scenario
def early_read(num_devices=2, hybridize=False, timeout_seconds=3.0, seed=0, first=False):
    """After a normal step (``first``: as the process's first step), one
    whose per-device loop reads device 0's output before device 1's call is
    issued: the timeout (``seconds``) and its ``message``, then a normal
    step."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    before = 0.0 if first else _recovery_error(net, ctxs, rng, shape)
    arrays = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]

    def step():
        with autograd.record():
            for a in arrays:
                net(a).asnumpy()  # a metric's read, inside the per-device loop
    msg, kind, seconds = _capture(step)
    return {'message': msg, 'type': kind, 'seconds': seconds,
            'recovered': max(before, _recovery_error(net, ctxs, rng, shape))}


@scenario
def user_code_raises(num_devices=3, hybridize=False, timeout_seconds=60.0, seed=0,
                     after_forward=False):
    """Device 1's forward raises in user code inside autograd.record(): the call
    already issued for device 0 must fail at once, and the next step recover.
    ``after_forward``: user code raises later, once every device's forward
    pass has completed."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    net = _fault_net(ctxs, hybridize, timeout_seconds)
    arrays = [mx.nd.array(rng.randn(1, 3, 4, 4), ctx=c) for c in ctxs]

    def step():
        with autograd.record():
            outs = []
            for a in arrays:
                if a.context == ctxs[1] and not after_forward:
                    raise ValueError('user code failed on device 1')
                outs.append(net(a))
            mx.nd.waitall()
            raise ValueError('user code failed after the forward pass')

    msg, kind, _ = _capture(step)
    start = time.time()
    drained = _capture(mx.nd.waitall)
    return {'message': msg, 'type': kind, 'drain_seconds': time.time() - start,
            'drain_message': drained[0],
            'recovered': _recovery_error(net, ctxs, rng, shape)}


@scenario
def abandoned_steps(num_devices=4, steps=10, hybridize=False, seed=0, cause='user_code'):
    """Steps that fail with every device's calls issued or in flight, each
    device's output then read on its own, the main thread running ahead.
    Every one must raise, naming the layer. ``cause``: ``'user_code'``, an
    exception in user code after all devices but the last were issued (the
    step fails in Python, at once); ``'empty_batch'``, every slice empty (it
    fails in the first layer's meeting, in the engine, while the main thread
    still issues the second layer's calls)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    shape = (num_devices, 3, 4, 4)
    with mx.util.np_shape(cause == 'empty_batch'):
        net = _fault_net(ctxs, hybridize, 60.0)
        samples = 0 if cause == 'empty_batch' else 1
        arrays = [mx.nd.array(rng.randn(samples, 3, 4, 4), ctx=c) for c in ctxs]
        outputs, messages = 0, []
        for _ in range(steps):
            outs = []
            try:
                with autograd.record():
                    for a in arrays:
                        if cause == 'user_code' and a.context == ctxs[-1]:
                            raise ValueError('user code failed on the last device')
                        outs.append(net(a))
                autograd.backward(outs)
            except ValueError:
                pass
            outputs += len(outs)
            messages += [_capture(o.wait_to_read)[0] for o in outs]
            _capture(mx.nd.waitall)
        return {'outputs': outputs, 'raised': sum(m is not None for m in messages),
                'named': sum(m is not None and "SyncBatchNorm 'syncbatchnorm" in m
                             for m in messages),
                'recovered': _recovery_error(net, ctxs, rng, shape)}


@scenario
def misconfigured(problem, hybridize=False, deferred=False):
    """Errors raised before any synchronization: the message and how fast
    (``deferred``: the layer learns its channels at its first call, inside
    Gluon's deferred initialization)."""
    ctxs = contexts(2)
    num_devices = {'num_devices': 4, 'num_devices_small': 1}.get(problem)
    sync_groups = [[0, 1], [2]] if problem == 'sync_groups' else None  # 3 devices, 2 here
    net = gluon.nn.HybridSequential()
    net.add(SyncBatchNorm(in_channels=0 if deferred else 3, num_devices=num_devices, timeout=60,
                          sync_groups=sync_groups))
    net.initialize(ctx=ctxs)
    if hybridize:
        net.hybridize()
    arrays = [mx.nd.ones((2, 3, 4, 4), ctx=c) for c in ctxs]
    msg, kind, seconds = _capture(lambda: _step(net, arrays))
    return {'message': msg, 'type': kind, 'seconds': seconds}
