"""GluonCV's threaded data parallelism, one Python thread per device
(tests/test_threads.py, tests/soak_threads.py).
"""
import contextlib
import threading
import time
import warnings

import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from gluon_syncbn import SyncBatchNorm
from tests.reference import WorstErrors, batchnorm_float64
from tests.scenarios import contexts, scenario


@scenario
def gluoncv_threads(num_devices=2, batch=7, hybridize=False, steps=3, seed=0, fail=False):
    """GluonCV's threaded data parallelism, as its segmentation and detection
    scripts run it (``--syncbn``): ``parallel_apply`` calls the network from
    one Python thread per device inside ``autograd.record()``, each thread
    waiting for its output; ``DataParallelCriterion(sync=True)`` computes the
    losses the same way; the main thread calls ``autograd.backward``.

    A float64 BN -> tanh -> BN network whose first synchronized call comes
    from the threads (hybridized: the graph is traced once in the main
    thread first, by an inference call, as README says), the batch split by
    ``split_and_load(even_split=False)`` as ``DataParallelModel`` splits it,
    no sync point between steps but the threads' own. Against float64 maths
    on the whole batch: the input gradient of every step, and the running
    statistics of both layers after the last. Also counts the warnings.

    ``fail``: how many steps after the first fail (True: one): in each a
    device's thread raises in user code at once (device 0's in the first,
    then each device's in turn), the others started after it failed (each
    0.3 s after the one before) in the first, then at once or a random 0-20
    ms apart, so that their calls race with the failure; the first step's
    error (``failed``), the slowest step's seconds (``failed_seconds``), each
    step whose error was not its failing thread's own (``wrong``) and,
    skipping those batches, the steps after them.
    """
    from gluoncv.utils.parallel import DataParallelCriterion, parallel_apply
    rng = np.random.RandomState(seed)
    ctxs = contexts(num_devices)
    channels, momentum = 3, 0.9
    gammas = [rng.uniform(0.5, 1.5, channels) for _ in range(2)]
    betas = [rng.uniform(-0.5, 0.5, channels) for _ in range(2)]
    net = gluon.nn.HybridSequential()
    net.add(SyncBatchNorm(in_channels=channels, momentum=momentum),
            gluon.nn.Activation('tanh'),
            SyncBatchNorm(in_channels=channels, momentum=momentum))
    net.initialize(ctx=ctxs)
    net.cast('float64')
    for layer, g, b in zip((net[0], net[2]), gammas, betas):
        layer.gamma.set_data(mx.nd.array(g, dtype='float64'))
        layer.beta.set_data(mx.nd.array(b, dtype='float64'))

    class Dot(gluon.HybridBlock):
        """sum(y * dy): the gradient reaching y is dy."""
        def hybrid_forward(self, F, y, dy):
            return F.sum(y * dy)
    criterion = DataParallelCriterion(Dot(), ctxs, sync=True)
    if hybridize:
        net.hybridize()
        net(mx.nd.zeros((2, channels, 4, 4), ctx=ctxs[0], dtype='float64'))  # the trace

    def failing(block, device):
        def call(x):
            if x.context == ctxs[device]:
                raise ValueError('user code failed on %s' % x.context)
            return block(x)
        return call

    steps_done, failed = [], {'wrong': [], 'failed_seconds': 0.0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', RuntimeWarning)
        for step in range(steps + int(fail)):
            x = rng.randn(batch, channels, 4, 4) * 2 + 1
            dy = rng.randn(batch, channels, 4, 4)
            xs = gluon.utils.split_and_load(mx.nd.array(x, dtype='float64'), ctxs,
                                            even_split=False)
            for a in xs:
                a.attach_grad()
            if 1 <= step <= int(fail):
                device = (step - 1) % num_devices
                delay = 0.3 if step == 1 else rng.choice([0.0, 0.0, 0.002, 0.01, 0.02])
                start, error = time.time(), 'no error'
                try:
                    with _threads_started_late(delay), autograd.record():
                        parallel_apply(failing(net, device), [(a,) for a in xs], sync=True)
                except Exception as exc:  # pylint: disable=broad-except
                    error = '%s: %s' % (type(exc).__name__, exc)
                failed['failed_seconds'] = max(failed['failed_seconds'], time.time() - start)
                failed.setdefault('failed', error)
                if error != 'ValueError: user code failed on %s' % ctxs[device]:
                    failed['wrong'].append((step, error))
                continue
            with autograd.record():
                outputs = parallel_apply(net, [(a,) for a in xs], sync=True)
                losses = criterion(outputs, mx.nd.array(dy, dtype='float64'))
            autograd.backward(losses)
            steps_done.append((xs, x, dy))

    errs = WorstErrors()
    running = [(np.zeros(channels), np.ones(channels)) for _ in range(2)]
    for xs, x, dy in steps_done:
        # float64 maths on the whole batch: BN -> tanh -> BN
        y1, _, _, _, mean1, var1 = batchnorm_float64(x, dy, gammas[0], betas[0])
        a = np.tanh(y1)
        _, da, _, _, mean2, var2 = batchnorm_float64(a, dy, gammas[1], betas[1])
        dx = batchnorm_float64(x, da * (1 - a * a), gammas[0], betas[0])[1]
        errs.note('dx', np.concatenate([p.grad.asnumpy() for p in xs]), dx)
        running = [(m * momentum + mean * (1 - momentum), v * momentum + var * (1 - momentum))
                   for (m, v), mean, var in zip(running, (mean1, mean2), (var1, var2))]
    for layer, (mean, var) in zip((net[0], net[2]), running):
        for c in ctxs:
            errs.note('running_mean', layer.running_mean.data(c).asnumpy(), mean)
            errs.note('running_var', layer.running_var.data(c).asnumpy(), var)
    errs['slices'] = [int(p.shape[0]) for p in steps_done[0][0]]
    errs['operator'] = net[0]._sync_backend.name
    errs['warnings'] = sum('gluon_syncbn' in str(w.message) for w in caught)
    errs.update(failed)
    return errs


@contextlib.contextmanager
def _threads_started_late(delay=0.3):
    """Each thread started in the context starts ``delay`` seconds after the
    one before."""
    start = threading.Thread.start
    count = [0]

    def late(thread):
        time.sleep(delay * count[0])
        count[0] += 1
        start(thread)
    threading.Thread.start = late
    try:
        yield
    finally:
        threading.Thread.start = start
