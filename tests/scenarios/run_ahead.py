"""A main thread that never waits between steps: exact running
statistics, aborted steps, predict calls inside a step, a new device set
(tests/test_run_ahead.py; tests/test_native_transport.py and
tests/dist_worker.py's jobs run run_ahead too).
"""
import contextlib
import threading
import time

import numpy as np

import gluon_syncbn
import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import (WorstErrors, batchnorm_float64, fold_running, on_gpus,
                             update_order)
from tests.scenarios import (VERBOSE, _BETA1, _BNStack, _GAMMA1, _RunAheadNet, _capture,
                             _random_pass, _ready, _two_layers_float64, contexts, scenario,
                             split_batch)


class _DelayedNet(gluon.HybridBlock):
    """Two SyncBatchNorm layers behind a large ``dot`` whose result is
    discarded: each device's layer calls run well after the main thread has
    issued them (as on a GPU, where they queue behind earlier work)."""

    def __init__(self, timeout, **kwargs):
        super(_DelayedNet, self).__init__(**kwargs)
        with self.name_scope():
            self.bn1 = SyncBatchNorm(in_channels=3, timeout=timeout)
            self.bn2 = SyncBatchNorm(in_channels=3, timeout=timeout)

    def hybrid_forward(self, F, x, slow):
        late = F.broadcast_add(x, F.sum(F.dot(slow, slow)) * 0)
        return self.bn2(self.bn1(late))


# Set: the held operators' outputs are computed (_Held).
_RELEASE = threading.Event()


class _Held(mx.operator.CustomOp):
    """Its input, once _RELEASE is set: what reads its output stays queued in
    the engine until then (a custom operator runs on a thread of its own, so
    no engine worker waits)."""

    def forward(self, is_train, req, in_data, out_data, aux):
        _RELEASE.wait(60)
        self.assign(out_data[0], req[0], in_data[0])


@mx.operator.register('gluon_syncbn_tests_held')
class _HeldProp(mx.operator.CustomOpProp):
    def __init__(self):
        super(_HeldProp, self).__init__(need_top_grad=False)

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _Held()


@scenario
def aborted_then_exact(hybridize='static', cause='user_code', aborts=1, steps=4, delay=800,
                       num_devices=3, timeout_seconds=30.0, seed=0, blocks=False):
    """One exact step whose backward calls stay queued (its head gradients
    held, _Held) until the first abandoned step failed, then ``aborts``
    steps abandoned by ``cause`` with the layers' calls held behind a
    ``delay`` x ``delay`` dot, then ``steps`` steps issued at once, nothing
    read before the last: their outputs and the running statistics against
    float64 maths (the abandoned steps must leave the statistics alone, and
    the first step's backward must run: ``first_grads``, the second layer's
    gamma and beta gradients), and the seconds from the first abandoned step
    to the last result. ``cause``: ``'user_code'`` (a ValueError after
    every device but the last was issued), ``'interrupt'`` (a
    KeyboardInterrupt there), ``'bad_input'`` (the last device's slice has
    the wrong channel count: the layer refuses it), ``'missing'`` (the last
    device is never fed: the others' calls time out, after
    ``timeout_seconds``, and a read raises) or ``'reset'``
    (``gluon_syncbn.reset()`` there). ``blocks``: every step records one
    ``autograd.record()`` block per device (one step all the same: an abort
    in the last fails the others' calls at once)."""
    _RELEASE.clear()
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    net = _ready(_DelayedNet(timeout_seconds), ctxs, hybridize)
    slows = [mx.nd.ones((delay, delay), ctx=c) for c in ctxs]
    shape = (num_devices, 3, 4, 4)
    expected_running = [(np.zeros(3), np.ones(3)), (np.zeros(3), np.ones(3))]

    def step(x, fail=None, dy=None):
        outs = []
        # One record() block for all devices, or (``blocks``) one per device
        outer, inner = ((contextlib.nullcontext, autograd.record) if blocks
                        else (autograd.record, contextlib.nullcontext))
        with outer():
            for i, c in enumerate(ctxs):
                with inner():
                    last = i == num_devices - 1
                    if last and fail == 'user_code':
                        raise ValueError('user code failed on the last device')
                    if last and fail == 'interrupt':
                        raise KeyboardInterrupt
                    if last and fail == 'reset':
                        gluon_syncbn.reset()
                        return outs
                    if last and fail == 'missing':
                        return outs
                    xi = x[i:i + 1] if not (last and fail == 'bad_input') else x[i:i + 1, :2]
                    outs.append(net(mx.nd.array(xi, ctx=c), slows[i]))
        autograd.backward(outs, None if dy is None else [
            mx.nd.Custom(mx.nd.array(dy[i:i + 1], ctx=c), op_type='gluon_syncbn_tests_held')
            for i, c in enumerate(ctxs)])
        return outs

    def expect(x):
        y, batch = _two_layers_float64(x)
        for i, (m, v) in enumerate(batch):
            rm, rv = expected_running[i]
            expected_running[i] = (rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
        return y

    x, dy = rng.randn(*shape).astype(np.float32), rng.randn(*shape).astype(np.float32)
    errs = WorstErrors()
    errs.note('first', np.concatenate([o.asnumpy() for o in step(x, dy=dy)]), expect(x))
    y1 = batchnorm_float64(x, x, _GAMMA1, _BETA1)[0]
    _, _, dgamma, dbeta, _, _ = batchnorm_float64(y1, dy, np.ones(3), np.zeros(3))
    start = time.time()
    raised = []
    for _ in range(aborts):
        outs = None
        try:
            outs = step((rng.randn(*shape) * 100 + 50).astype(np.float32), fail=cause)
        except (ValueError, KeyboardInterrupt, gluon_syncbn.SyncBatchNormError,
                mx.base.MXNetError) as exc:  # a hybridized graph's refusal is MXNet's
            raised.append(type(exc).__name__)
        _RELEASE.set()  # the first step's backward runs after the abort
        if outs is not None:
            raised.append(_capture(lambda: [o.wait_to_read() for o in outs])[1])
    # (the first layer's are sums that cancel to rounding: the second's
    # input gradient is orthogonal to them)
    try:
        for param, expected in ((net.bn2.gamma, dgamma), (net.bn2.beta, dbeta)):
            errs.note('first_grads', sum(g.asnumpy() for g in param.list_grad()), expected)
    except mx.base.MXNetError:  # the first step's backward failed
        errs['first_grads'] = float('inf')
    issued = []
    for _ in range(steps):
        x = rng.randn(*shape).astype(np.float32)
        issued.append((x, step(x)))
    failed = 0
    for x, outs in issued:
        try:
            errs.note('y', np.concatenate([o.asnumpy() for o in outs]), expect(x))
        except mx.base.MXNetError as exc:
            failed += 1
            if VERBOSE:
                print('a later step raised:', str(exc).splitlines()[-1], flush=True)
    seconds = time.time() - start
    mx.nd.waitall()  # the last step's backward calls (README: static graphs)
    for i, bn in enumerate((net.bn1, net.bn2)):
        for c in ctxs:
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), expected_running[i][0])
            errs.note('running_var', bn.running_var.data(c).asnumpy(), expected_running[i][1])
    return dict(errs, failed=failed, seconds=seconds, aborted=raised,
                operator=net.bn1._sync_backend.name)


def _predict_float64(x, running):
    """_BNStack's predict-mode output from its layers' running statistics."""
    y = x.astype(np.float64)
    for (mean, var), gamma, beta in zip(running, (_GAMMA1, np.ones(3)), (_BETA1, np.zeros(3))):
        shape = (1, -1) + (1,) * (y.ndim - 2)
        y = ((y - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + 1e-5)
             * gamma.reshape(shape) + beta.reshape(shape))
    return y


@scenario
def predict_in_step(pattern='targets', hybridize='static', steps=4, num_devices=3,
                    timeout_seconds=30.0, seed=0):
    """Predict-mode calls inside training steps, nothing read before the
    last step. ``'targets'``: per device, a training call, then a
    predict-mode call of the same network on the same slice (consistency
    targets), before the step's backward: outputs against float64 maths, the
    predict ones with the running statistics as they are then (on GPUs with
    the step's own update, made by its forward; on CPU contexts without,
    made by its backward). ``'gan'``: a discriminator
    (``hybridize``) trained for a step, then a generator (``hybridize()``)
    trained through it in predict mode, per device: the generator's outputs
    and the discriminator's predictions. Also the seconds all that took."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    net = _ready(_BNStack(timeout_seconds), ctxs, hybridize)
    running = [(np.zeros(3), np.ones(3)), (np.zeros(3), np.ones(3))]
    shape = (2 * num_devices, 3, 4, 4)
    errs = WorstErrors()
    issued = []
    start = time.time()
    if pattern == 'targets':
        for _ in range(steps):
            x = (rng.randn(*shape) + 1e3).astype(np.float32)
            ys, ts = [], []
            with autograd.record():
                for part, c in zip(split_batch(x, [2] * num_devices), ctxs):
                    a = mx.nd.array(part, ctx=c)
                    ys.append(net(a))
                    with autograd.predict_mode():
                        ts.append(net(a))
            autograd.backward(ys)
            y64, batch = _two_layers_float64(x)
            before = running
            running = [(rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
                       for (rm, rv), (m, v) in zip(running, batch)]
            issued.append((ys, y64, ts, _predict_float64(x, running if on_gpus() else before)))
        for ys, y64, ts, t64 in issued:
            errs.note('y', np.concatenate([y.asnumpy() for y in ys]), y64)
            errs.note('target', np.concatenate([t.asnumpy() for t in ts]), t64)
    else:
        gen = SyncBatchNorm(in_channels=3, timeout=timeout_seconds)
        gen.initialize(ctx=ctxs)
        gen.hybridize()
        for _ in range(steps):
            real = (rng.randn(*shape) + 1e3).astype(np.float32)
            with autograd.record():  # the discriminator's step
                outs = [net(mx.nd.array(p, ctx=c))
                        for p, c in zip(split_batch(real, [2] * num_devices), ctxs)]
            autograd.backward(outs)
            _, batch = _two_layers_float64(real)
            running = [(rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
                       for (rm, rv), (m, v) in zip(running, batch)]
            z = (rng.randn(*shape) * 3 + 5).astype(np.float32)
            fakes, judged = [], []
            with autograd.record():  # the generator's, through it in predict mode
                for p, c in zip(split_batch(z, [2] * num_devices), ctxs):
                    fakes.append(gen(mx.nd.array(p, ctx=c)))
                    with autograd.predict_mode():
                        judged.append(net(fakes[-1]))
            autograd.backward(judged)
            fake64 = batchnorm_float64(z, z, np.ones(3), np.zeros(3))[0]
            issued.append((fakes, fake64, judged, _predict_float64(fake64, running)))
        for fakes, fake64, judged, judged64 in issued:
            errs.note('y', np.concatenate([f.asnumpy() for f in fakes]), fake64)
            errs.note('target', np.concatenate([j.asnumpy() for j in judged]), judged64)
    return dict(errs, seconds=time.time() - start, operator=net.bn1._sync_backend.name)


@scenario
def new_device_set(change='reset_ctx', before=4, after=2, hybridize=True, steps=2,
                   timeout_seconds=30.0, seed=0):
    """A network trained on ``before`` contexts moves to ``after`` by
    ``change``: ``'reset_ctx'`` or ``'reinit'`` (``initialize(force_reinit=True)``
    and the parameters set again), then
    trains there, nothing read before the last step: outputs and running
    statistics against float64 maths, the seconds the later steps took, and
    the message of a call on a context outside the new ones (None if it
    synchronized)."""
    rng = np.random.RandomState(seed)
    net = _ready(_BNStack(timeout_seconds), contexts(before), hybridize)
    running = [(np.zeros(3), np.ones(3)), (np.zeros(3), np.ones(3))]
    errs = WorstErrors()

    def train(ctxs, checked):
        nonlocal running
        x = (rng.randn(2 * len(ctxs), 3, 4, 4) + 1e3).astype(np.float32)
        with autograd.record():
            ys = [net(mx.nd.array(p, ctx=c)) for p, c in zip(split_batch(x, [2] * len(ctxs)), ctxs)]
        autograd.backward(ys)
        y64, batch = _two_layers_float64(x)
        running = [(rm * 0.9 + m * 0.1, rv * 0.9 + v * 0.1)
                   for (rm, rv), (m, v) in zip(running, batch)]
        checked.append((ys, y64))

    first = []
    train(contexts(before), first)
    for ys, y64 in first:
        errs.note('y', np.concatenate([y.asnumpy() for y in ys]), y64)
    # The backward calls update the running statistics on CPU contexts, and
    # a static graph's executor orders neither the move's reads of them nor
    # the last ones after that (README: read after mx.nd.waitall()).
    mx.nd.waitall()
    ctxs = contexts(after)
    if change == 'reset_ctx':
        net.collect_params().reset_ctx(ctxs)
    else:
        saved = {name: p.data(p.list_ctx()[0]).asnumpy()
                 for name, p in net.collect_params().items()}
        net.initialize(ctx=ctxs, force_reinit=True)
        for name, p in net.collect_params().items():
            p.set_data(mx.nd.array(saved[name]))
    start = time.time()
    later = []
    for _ in range(steps):
        train(ctxs, later)
    for ys, y64 in later:
        errs.note('y', np.concatenate([y.asnumpy() for y in ys]), y64)
    seconds = time.time() - start
    mx.nd.waitall()
    for i, bn in enumerate((net.bn1, net.bn2)):
        for c in ctxs:
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), running[i][0])
            errs.note('running_var', bn.running_var.data(c).asnumpy(), running[i][1])
    outside = mx.cpu(after)  # a context the parameters no longer (or never) live on
    with autograd.record():
        message = _capture(lambda: net(mx.nd.ones((2, 3, 4, 4), ctx=outside)))
    return dict(errs, seconds=seconds, outside=message[0], outside_seconds=message[2],
                operator=net.bn1._sync_backend.name)


# A momentum and eps schedule, set between steps (as a BN-momentum schedule
# sets nn.BatchNorm's ``_kwargs``).
SCHEDULE = [(0.9, 1e-5), (0.5, 1e-3), (0.99, 1e-5), (0.1, 0.5)]


@scenario
def run_ahead(hybridize=False, calls=2, sizes=(3, 5), steps=20, micro_steps=2, seed=0):
    """Training that never waits between steps, as GPU loops do: ``steps``
    Trainer steps, each accumulating gradients (grad_req='add') over
    ``micro_steps`` forward/backward passes, with no asnumpy or waitall until
    the end; the layer is called ``calls`` times per forward pass, its
    momentum and eps changed between steps (:data:`SCHEDULE`). Returns the
    worst relative error of every device's running mean and variance against
    float64 momentum updates over the global batch, the calls (each on the
    one before's output) folded in as MXNet's BatchNorm does on the devices'
    kind (:func:`tests.reference.update_order`)."""
    rng = np.random.RandomState(seed)
    ctxs = contexts(len(sizes))
    channels = 3
    net = _RunAheadNet(channels, calls)
    net.initialize(ctx=ctxs)
    for param in net.collect_params().values():
        if param.grad_req != 'null':
            param.grad_req = 'add'
    if hybridize:
        net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    trainer = gluon.Trainer(net.conv.collect_params(), 'sgd', {'learning_rate': 0.01})
    running = (np.zeros(channels), np.ones(channels))
    ones, zeros = np.ones(channels), np.zeros(channels)
    order = update_order(calls, hybridize, chained=True)

    for step in range(steps):
        momentum, eps = SCHEDULE[step % len(SCHEDULE)]
        net.bn._kwargs.update(momentum=momentum, eps=eps)
        for _ in range(micro_steps):
            batch, stats = _random_pass(net, rng, sizes, channels, ctxs), []
            for _ in range(calls):
                out, _, _, _, mean, var = batchnorm_float64(batch, np.zeros_like(batch), ones,
                                                            zeros, eps=eps)
                stats.append((mean, var))
                batch = out * 0.5 + 1
            running = fold_running(running, stats, order, momentum)
        trainer.step(sum(sizes) * micro_steps)
        for param in net.collect_params().values():
            if param.grad_req != 'null':
                param.zero_grad()
    # The one sync point. (In static graphs the engine does not order a read
    # of the running statistics after the updates the last step's calls make
    # inside them: read after a sync point, as README says.)
    mx.nd.waitall()
    errs = WorstErrors()
    for c in ctxs:
        errs.note('running_mean', net.bn.running_mean.data(c).asnumpy(), running[0])
        errs.note('running_var', net.bn.running_var.data(c).asnumpy(), running[1])
    errs['operator'] = net.bn._sync_backend.name
    return errs
