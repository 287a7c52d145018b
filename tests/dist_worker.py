"""One worker of a multi-process test job, started by ``gluon_syncbn.launch``.

Run as ``python tests/dist_worker.py SCENARIO JSON_KWARGS`` on every worker;
each worker prints ``RESULT {...}`` with its rank and worst relative errors.
Every worker draws the same global batch from the same seed, takes the slices
of its own devices, and computes the float64 reference on the whole batch
itself, so no worker trusts another's numbers.
"""
import json
import os
import re
import signal
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gluon_syncbn  # noqa: E402

gluon_syncbn.configure_cpu_contexts(2)  # workers use 1-2 CPU contexts

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from gluon_syncbn import SyncBatchNorm, convert_model  # noqa: E402
from tests.reference import (WorstErrors, fold_running,  # noqa: E402
                             grouped_batchnorm_float64, max_rel_err, max_rel_err_where_finite,
                             update_order)
from tests.scenarios import copy_params, split_batch  # noqa: E402
from tests.scenarios.networks import build  # noqa: E402


SGD = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4}  # workers and reference alike


class Worker(object):
    """This process's place in the job: backend, rank, devices and batch slices.

    ``devices``: devices per worker, an int or one int per rank; ``sizes``: the
    global batch's slice sizes, one per device of every worker in rank order.
    """

    def __init__(self, backend, devices, sizes):
        if backend == 'horovod':
            import horovod.mxnet as hvd  # pylint: disable=import-outside-toplevel
            hvd.init()
            self.hvd, self.kvstore = hvd, 'horovod'
            self.rank, self.num_workers = hvd.rank(), hvd.size()
        else:
            self.kvstore = mx.kv.create(backend)
            self.rank, self.num_workers = self.kvstore.rank, self.kvstore.num_workers
        per_worker = devices if isinstance(devices, list) else [devices] * self.num_workers
        assert len(sizes) == sum(per_worker), (sizes, per_worker)
        first = sum(per_worker[:self.rank])
        self.ctxs = [mx.cpu(i) for i in range(per_worker[self.rank])]
        self.sizes = list(sizes)
        self.mine = list(range(first, first + per_worker[self.rank]))

    def slices(self, x):
        """This worker's device slices of a global array."""
        parts = split_batch(x, self.sizes)
        return [mx.nd.array(parts[i], ctx=c, dtype=x.dtype) for i, c in zip(self.mine, self.ctxs)]

    def rows(self, x):
        """This worker's rows of a global NumPy array, concatenated."""
        parts = split_batch(x, self.sizes)
        return np.concatenate([parts[i] for i in self.mine])


def _layer(worker, gamma, beta, hybridize, **kwargs):
    """A SyncBatchNorm on the worker's devices, through its transport, with
    ``gamma`` and ``beta``; ``hybridize='static'``: static_alloc and
    static_shape."""
    bn = SyncBatchNorm(in_channels=len(gamma), kvstore=worker.kvstore, timeout=60, **kwargs)
    bn.initialize(ctx=worker.ctxs)
    bn.gamma.set_data(mx.nd.array(gamma))
    bn.beta.set_data(mx.nd.array(beta))
    if hybridize:
        bn.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    return bn


def layer(backend, devices, sizes, shape=(3, 4, 5), axis=1, steps=2, hybridize=False, seed=0,
          sync_groups=None, run_ahead=False, offset=1e3):
    """SyncBatchNorm across workers vs float64 maths on the global batch (or,
    with ``sync_groups``, within each group of global devices), on data
    ``offset`` away from zero (2 x randn around it).
    A size of 0 is an empty slice (run under NumPy shape mode).
    ``hybridize='static'``: static_alloc and static_shape. ``run_ahead``:
    nothing is read until every step is issued (then the gradients of gamma
    and beta, which each step overwrites, only for the last step)."""
    from gluon_syncbn.groups import check_sync_groups, partition
    if 0 in sizes:
        mx.util.set_np_shape(True)
    worker = Worker(backend, devices, sizes)
    rng = np.random.RandomState(seed)
    full = (int(sum(sizes)),) + tuple(shape)
    channels = full[axis]
    gamma = rng.uniform(0.5, 1.5, channels)
    beta = rng.uniform(-0.5, 0.5, channels)
    groups = partition(check_sync_groups(sync_groups), len(sizes), 'reference')
    bn = _layer(worker, gamma, beta, hybridize, axis=axis, sync_groups=sync_groups)
    errs = WorstErrors()
    run = {i: (np.zeros(channels), np.ones(channels)) for i in worker.mine}
    issued = []
    for step in range(steps):
        x = (rng.randn(*full) * 2 + offset).astype(np.float32)
        dy = rng.randn(*full).astype(np.float32)
        xs, dys = worker.slices(x), worker.slices(dy)
        for a in xs:
            a.attach_grad()
        with autograd.record():
            ys = [bn(a) for a in xs]
        autograd.backward(ys, dys)
        ref = grouped_batchnorm_float64(split_batch(x, sizes), split_batch(dy, sizes), groups,
                                        gamma, beta, axis)
        issued.append((ys, xs, ref))
        if run_ahead and step < steps - 1:
            continue
        for ys, xs, ref in issued:
            for i, c, y, a in zip(worker.mine, worker.ctxs, ys, xs):
                y64, dx64, dg64, db64, mean64, var64 = ref[i]
                run[i] = (run[i][0] * 0.9 + mean64 * 0.1, run[i][1] * 0.9 + var64 * 0.1)
                errs.note('y', y.asnumpy(), y64)
                errs.note('dx', a.grad.asnumpy(), dx64)
        # gamma/beta gradients stay per device: this device's share of the sums
        for i, c in zip(worker.mine, worker.ctxs):
            y64, dx64, dg64, db64, mean64, var64 = ref[i]
            errs.note('dgamma', bn.gamma.grad(c).asnumpy(), dg64)
            errs.note('dbeta', bn.beta.grad(c).asnumpy(), db64)
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run[i][0])
            errs.note('running_var', bn.running_var.data(c).asnumpy(), run[i][1])
        issued = []
    return dict(errs, rank=worker.rank, operator=bn._sync_backend.name)


# What the data does in each step of `moves`: the offsets of its first two
# calls' inputs (one per channel, or one for all; a third call's is their
# midpoint), the head gradients' offset, and what one value of the first
# call is instead.
MOVES = [
    (0.0, 100.0, 0.0, None),                      # a real and a fake batch, 50 std apart
    (1e4, 1e4 + 100.0, 1e4, None),                # a jump of 5e3 std; heads far from zero
    (0.0, -1e4, 0.0, None),                       # back to zero, and the other way
    ([1e4, -1e4, 0.0], [0.0, 0.0, 1e4], 0.0, None),  # channels far apart
    (0.0, 0.0, 0.0, float('nan')),                # one NaN in channel 0
    (0.0, 100.0, 0.0, None),                      # clean again
    # one outlier in channel 1 (its square within float32's range: the GPU
    # path takes the moments in float32 on the device, as nn.BatchNorm does)
    (0.0, 0.0, 0.0, 1e18),
    (1e3, 1e3 + 100.0, -1e4, None),               # clean again, heads far from zero
]


def moves(backend, devices, sizes, hybridize=False, seed=0, run_ahead=True, heads=True,
          calls=2):
    """The layer on data that moves between calls (:data:`MOVES`), called
    ``calls`` times per step (1 to 3: a GAN discriminator's real and fake
    batches), the outputs to one backward the last call's first, against
    float64 maths on each call's global batch: every output, input and
    parameter gradient and running statistic (the calls folded in as MXNet's
    BatchNorm does on CPU contexts, :func:`tests.reference.update_order`),
    also in the steps after a NaN and an outlier. Where a NaN made the
    reference's numbers NaN, ours must not be finite either. ``run_ahead``:
    nothing is read until every step is issued (then gamma's and beta's
    gradients, which each step overwrites, only for the last step).
    ``heads``: the head gradients' offsets too (the GPU path's backward sums
    them on the device in float32, as nn.BatchNorm does: at 1e4 from zero
    that is 6e-4 of their spread, in one process too)."""
    worker = Worker(backend, devices, sizes)
    rng = np.random.RandomState(seed)
    full, channels = (int(sum(sizes)), 3, 4, 5), 3
    gamma, beta = rng.uniform(0.5, 1.5, channels), rng.uniform(-0.5, 0.5, channels)
    bn = _layer(worker, gamma, beta, hybridize)
    errs = WorstErrors()
    run = {i: (np.zeros(channels), np.ones(channels)) for i in worker.mine}
    groups = [list(range(len(sizes)))]
    order = update_order(calls, hybridize, reverse=True)
    issued = []
    for step, (offset_a, offset_b, head, odd) in enumerate(MOVES):
        offsets = [np.asarray(o, np.float64) for o in (offset_a, offset_b)]
        offsets = (offsets + [(offsets[0] + offsets[1]) / 2])[:calls]
        batches = []
        for k, offset in enumerate(offsets):
            x = rng.randn(*full) * 2 + offset.reshape(-1, 1, 1)
            if k == 0 and odd is not None:
                x[0, 0 if odd != odd else 1, 0, 0] = odd  # NaN: channel 0; else channel 1
            dy = rng.randn(*full) + (head if heads else 0.0)
            batches.append((x.astype(np.float32), dy.astype(np.float32)))
        xs = [worker.slices(x) for x, _ in batches]
        for a in sum(xs, []):
            a.attach_grad()
        with autograd.record():
            ys = [[bn(a) for a in call] for call in xs]
        dys = [worker.slices(dy) for _, dy in batches]
        autograd.backward(sum(ys[::-1], []), sum(dys[::-1], []))
        refs = [grouped_batchnorm_float64(split_batch(x, sizes), split_batch(dy, sizes), groups,
                                          gamma, beta) for x, dy in batches]
        issued.append((ys, xs, refs))
        if run_ahead and step < len(MOVES) - 1:
            continue
        for ys, xs, refs in issued:
            for i in worker.mine:
                run[i] = fold_running(run[i], [ref[i][4:] for ref in refs], order)
            for call_ys, call_xs, ref in zip(ys, xs, refs):
                for i, y, a in zip(worker.mine, call_ys, call_xs):
                    y64, dx64 = ref[i][:2]
                    errs.note('y', y.asnumpy(), y64, max_rel_err_where_finite)
                    errs.note('dx', a.grad.asnumpy(), dx64, max_rel_err_where_finite)
        for i, c in zip(worker.mine, worker.ctxs):  # every call's share of this step's sums
            errs.note('dgamma', bn.gamma.grad(c).asnumpy(), sum(ref[i][2] for ref in refs),
                      max_rel_err_where_finite)
            errs.note('dbeta', bn.beta.grad(c).asnumpy(), sum(ref[i][3] for ref in refs),
                      max_rel_err_where_finite)
            errs.note('running_mean', bn.running_mean.data(c).asnumpy(), run[i][0],
                      max_rel_err_where_finite)
            errs.note('running_var', bn.running_var.data(c).asnumpy(), run[i][1],
                      max_rel_err_where_finite)
        issued = []
    return dict(errs, rank=worker.rank, operator=bn._sync_backend.name)


# Gradient compression as a user asks a Trainer for it.
COMPRESSION = {'type': '2bit', 'threshold': 0.5}


def _trainer(worker, net, update_on_kvstore, compression):
    if worker.kvstore == 'horovod':
        # Horovod averages gradients over workers and reduces only the first
        # context's: one device per worker. Its compression is the gradients'.
        from horovod.mxnet.compression import Compression
        return worker.hvd.DistributedTrainer(
            net.collect_params(), 'sgd', dict(SGD),
            compression=Compression.fp16 if compression else Compression.none)
    return gluon.Trainer(net.collect_params(), 'sgd', dict(SGD), kvstore=worker.kvstore,
                         update_on_kvstore=update_on_kvstore,
                         compression_params=COMPRESSION if compression else None)


def train(backend, devices, sizes, steps=3, hybridize=False, image=8, seed=0, fault=None,
          timeout=None, update_on_kvstore=False, layers=3, dtype='float32', offset=1e3,
          compression=False, short=0, rank0_net=False):
    """A Trainer loop across workers vs float64 full-batch training in one process.

    The images are ``offset`` away from zero, and a BN layer normalizes them
    first. ``dtype``: the network's (float64 keeps deep nets' rounding far below
    the tolerance). ``fault``: what goes wrong in step 2 (:func:`_fault`), or
    ``'skip_alike'`` (every worker raises inside ``record()`` at step 2,
    before any layer call, and skips that batch, as the reference does), or
    ``'late'`` (worker 1 reaches its first step 3 timeouts late), or
    ``'skip_one'`` (worker 1 alone does what ``'skip_alike'`` does), or
    ``'skip_loader'`` (worker 1 alone skips a batch its DataLoader failed to
    give, before ``record()``).
    ``short``: worker 1's loop ends that many steps early. ``rank0_net``:
    rank 0 alone first builds a network of its own (an evaluation copy,
    converted with the job's kvstore, which shifts Gluon's automatic names
    of every later block) and runs it in inference mode after each step.
    ``compression``: the Trainer's gradient compression (the kvstore's 2-bit,
    or Horovod's float16). ``timeout``: the layers' (None: their default;
    ``timeouts`` in the result).
    """
    worker = Worker(backend, devices, sizes)
    rng = np.random.RandomState(seed)
    mx.random.seed(seed)
    batch = int(sum(sizes))
    if rank0_net and worker.rank == 0:
        rank0_net = convert_model(build('conv', 'plain', layers=layers, input_norm=True),
                                  kvstore=worker.kvstore, timeout=timeout)
        rank0_net.initialize(ctx=worker.ctxs)
    ref = build('conv', 'plain', layers=layers, input_norm=True)
    ref.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    net = convert_model(build('conv', 'plain', layers=layers, input_norm=True),
                        kvstore=worker.kvstore, timeout=timeout)
    net.initialize(ctx=worker.ctxs)
    first = next(b for b in _blocks(net) if isinstance(b, SyncBatchNorm))
    timeouts = [first._timeout, first._remote_timeout]
    x0 = mx.nd.array(rng.randn(batch, 3, image, image), dtype='float32')
    ref(x0)
    net(x0.as_in_context(worker.ctxs[0]))
    # Xavier draws differ between processes: every worker copies a fixed draw
    # (by the name rank 0's own network leaves alone: not the block's number)
    for p in ref.collect_params().values():
        key = re.sub(r'^convstack\d+_', '', p.name) if rank0_net is not False else p.name
        p.set_data(mx.nd.array(np.random.RandomState(zlib.crc32(key.encode())).uniform(
            -0.3, 0.3, p.shape) + (1.0 if p.name.endswith(('gamma', 'running_var')) else 0.0)))
    copy_params(ref, net)
    ref.cast('float64')
    net.cast(dtype)
    if hybridize:
        net.hybridize()
        ref.hybridize()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer = _trainer(worker, net, update_on_kvstore, compression)
    ref_trainer = gluon.Trainer(ref.collect_params(), 'sgd', dict(SGD))
    # Horovod averages over workers: scale the batch size to get the global mean
    step_batch = batch / worker.num_workers if worker.kvstore == 'horovod' else batch
    errs = WorstErrors()

    for step in range(steps):
        if worker.rank == 1 and step == steps - short:
            break  # its shard ends early
        x = (rng.randn(batch, 3, image, image) + offset).astype(np.float32)
        label = rng.randint(0, 5, batch).astype(np.float32)
        faulty = worker.rank == 1 and fault is not None
        if fault == 'late' and faulty and step == 0:
            time.sleep(3 * timeout)
        elif fault == 'skip_loader' and faulty and step == 1:
            try:  # its data loader fails on this batch, before record()
                next(iter(gluon.data.DataLoader(_Unreadable(), batch_size=1)))
            except OSError:
                continue
        elif (fault == 'skip_alike' or fault == 'skip_one' and worker.rank == 1) and step == 1:
            try:
                with autograd.record():
                    raise RuntimeError('a bad batch, skipped by every worker')
            except RuntimeError:
                continue
        elif faulty and step == (0 if fault == 'raise_first' else 1):
            x = _fault(fault, x)
        xs, labels = worker.slices(x.astype(dtype)), worker.slices(label.astype(dtype))
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, labels)]
            if faulty and step == 1 and fault == 'raise_in_record':
                raise RuntimeError('worker 1 fails inside record()')
        autograd.backward(losses)
        trainer.step(step_batch)
        if rank0_net and worker.rank == 0:
            rank0_net(xs[0])  # an evaluation on rank 0 only
        mx.nd.waitall()
        with autograd.record():
            ref_loss = loss_fn(ref(mx.nd.array(x, dtype='float64')),
                               mx.nd.array(label, dtype='float64'))
        ref_loss.backward()
        ref_trainer.step(batch)
        errs.note('loss', np.concatenate([l.asnumpy() for l in losses]),
                  worker.rows(ref_loss.asnumpy()))
        for (name, p), rp in zip(net.collect_params().items(), ref.collect_params().values()):
            kind = 'running' if 'running' in name else 'param'
            for c in worker.ctxs:
                errs.note(kind, p.data(c).asnumpy(), rp.data().asnumpy())
                if os.environ.get('SCENARIO_VERBOSE'):
                    print('step', step, name, c, max_rel_err(p.data(c).asnumpy(),
                                                             rp.data().asnumpy()), flush=True)
    return dict(errs, rank=worker.rank, operator=','.join(sorted(_operators(net))),
                timeouts=timeouts)


class _Unreadable(gluon.data.Dataset):
    """A data set whose every sample fails to load."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise OSError('sample %d cannot be read' % index)


def _fault(fault, x):
    """What a failing worker does before a step's forward pass: ``'kill'``
    (SIGKILL), ``'stall'`` (stops calling), ``'freeze'`` (SIGSTOP: the whole
    process, its engines' threads too), ``'bad_input'`` (returns ``x``
    with the wrong channel count), ``'raise'`` and ``'raise_first'`` (an
    exception between steps: before the second step, before the first),
    ``'exit'`` (``sys.exit(3)``), ``'exit_builtin'`` (the builtin
    ``exit(3)``), ``'system_exit'`` (``raise SystemExit(3)``), ``'term'``
    (SIGTERM), ``'interrupt'``
    (SIGINT: a KeyboardInterrupt); ``'raise_in_record'`` raises later, inside
    ``record()`` (see :func:`train`)."""
    print({'kill': 'killing myself', 'stall': 'stalling'}.get(fault, 'failing: ' + fault),
          flush=True)
    if fault == 'kill':
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == 'stall':
        time.sleep(600)
    if fault == 'freeze':
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault in ('raise', 'raise_first'):
        raise RuntimeError('worker 1 fails between steps')
    if fault == 'exit':
        sys.exit(3)
    if fault == 'exit_builtin':
        exit(3)  # noqa: F821 (site's builtin)
    if fault == 'system_exit':
        raise SystemExit(3)
    if fault == 'term':
        os.kill(os.getpid(), signal.SIGTERM)
    if fault == 'interrupt':
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)  # the KeyboardInterrupt comes at once
    return x[:, :2] if fault == 'bad_input' else x


def _blocks(block):
    yield block
    for child in block._children.values():
        yield from _blocks(child)


def _operators(net):
    """The operators the SyncBatchNorm layers in ``net`` synchronize with."""
    found = set()

    def look(block):
        if getattr(block, '_sync_backend', None) is not None:
            found.add(block._sync_backend.name)
    net.apply(look)
    return found


def precise_bn(backend, devices, sizes, batches=3, hybridize=False, seed=0, offset=1e3,
               spread=0.0, nan_first=False, short=None):
    """gluon_syncbn.update_bn_stats on tests.scenarios.precise_bn._PreciseNet across the
    workers, each with its slices of the same global batches, against float64
    maths on the global batches; ``digest``: a checksum of the running
    statistics, which must be the same on every worker, and ``differs``
    whether this worker's devices disagree (0.0: they agree bit for bit).
    ``spread``: the batches' means alternate between ``offset`` +- it.
    ``nan_first``: a training step on a batch with a NaN first (its running
    statistics NaN). ``short``: the rank whose data has one batch fewer (every
    worker then uses one batch fewer)."""
    from tests.scenarios.precise_bn import (_PreciseNet, _precise_errors, _precise_float64,
                                            _running_statistics)
    if 0 in sizes:
        mx.util.set_np_shape(True)
    worker = Worker(backend, devices, sizes)
    rng = np.random.RandomState(seed)
    channels = 3
    net = _PreciseNet(channels, kvstore=worker.kvstore, timeout=60)
    net.initialize(ctx=worker.ctxs)
    gamma, beta = rng.uniform(0.5, 1.5, channels), rng.uniform(-0.5, 0.5, channels)
    net.bn1.gamma.set_data(mx.nd.array(gamma))
    net.bn1.beta.set_data(mx.nd.array(beta))
    if hybridize:
        net.hybridize(static_alloc=hybridize == 'static', static_shape=hybridize == 'static')
    if nan_first:
        x = np.full((int(sum(sizes)), channels, 4, 4), offset, np.float32)
        x[0, 0, 0, 0] = np.nan
        with autograd.record():
            losses = [net(a) for a in worker.slices(x)]
        autograd.backward(losses)
    xs = [(rng.randn(int(sum(sizes)), channels, 4, 4) * rng.uniform(0.5, 3)
           + rng.uniform(-2, 2) + offset + spread * (-1) ** b).astype(np.float32)
          for b in range(batches)]
    mine = xs[:-1] if worker.rank == short else xs
    used = gluon_syncbn.update_bn_stats(net, [worker.slices(x) for x in mine], batches,
                                        progress=False)
    expected = _precise_float64(xs[:used], sizes, gamma, beta)
    got = _running_statistics(net, worker.ctxs)
    errs = _precise_errors(got, [expected[i] for i in worker.mine])
    errs['differs'] = float(any((a != b).any() for mine in got for a, b in zip(got[0], mine)))
    errs['used_all'] = float(len(xs) - (short is not None) - used)
    return dict(errs, rank=worker.rank, operator=net.bn1._sync_backend.name,
                digest=zlib.crc32(b''.join(a.tobytes() for a in got[0])))


def out_of_step(backend, what, timeout=60.0, steps=3):
    """Worker 1 differs from worker 0 in ``what``: ``'channels'`` (its
    second layer has 6 channels, worker 0's 4), ``'dtype'`` (its network is
    float64), ``'layers'`` (it lacks worker 0's second layer: its second to
    synchronize is worker 0's third, of the same width), ``'calls'`` (it
    calls the network twice per step), ``'groups'`` (its layers have
    sync_groups=1, worker 0's none) or ``'devices'`` (it has 2 devices,
    worker 0 one, with sync_groups=2 on both); or ``'num_devices'``: every
    worker has 2 devices and layers with num_devices=4, the job's count
    (contrib's habit), where this worker's is meant. Nothing is read before
    the last step is issued. Reports the error each worker raised."""
    devices, sizes = {'devices': ([1, 2], [3, 2, 2]),
                      'num_devices': (2, [3, 2, 2, 1])}.get(what, (1, [3, 2]))
    worker = Worker(backend, devices, sizes)
    rng = np.random.RandomState(0)
    odd = worker.rank == 1
    widths = [4, 6 if odd and what == 'channels' else 4, 4]
    kept = [0, 2] if odd and what == 'layers' else [0, 1, 2]
    groups = {'groups': 1 if odd else None, 'devices': 2}.get(what)
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        for i in kept:
            net.add(gluon.nn.Dense(widths[i], prefix='dense%d_' % i),
                    SyncBatchNorm(kvstore=worker.kvstore, timeout=timeout, prefix='bn%d_' % i,
                                  sync_groups=groups,
                                  num_devices=4 if what == 'num_devices' else None))
    net.initialize(ctx=worker.ctxs)
    if odd and what == 'dtype':
        net.cast('float64')
    dtype = 'float64' if odd and what == 'dtype' else 'float32'
    calls = 2 if odd and what == 'calls' else 1
    losses = []
    try:
        for _ in range(steps):
            x = mx.nd.array(rng.randn(worker.sizes[worker.rank], 5) + 1e3, ctx=worker.ctxs[0],
                            dtype=dtype)
            with autograd.record():
                loss = sum(net(x).sum() for _ in range(calls))
            loss.backward()
            losses.append(loss)
        mx.nd.waitall()
    except mx.base.MXNetError as exc:
        text = str(exc).splitlines()[-1]
        print('RAISED %s: %s' % (type(exc).__name__, text.split(': ', 1)[-1]
                                 if re.match(r'\w+: SyncBatchNorm', text) else text), flush=True)
        raise
    return dict(rank=worker.rank, operator=net[1]._sync_backend.name)


class OwnInit(mx.init.Xavier):
    """A script's own initializer (registered by ``healthy_end(own_init=True)``)."""

    def _init_weight(self, name, arr):
        super(OwnInit, self)._init_weight(name, arr)


def _own_function():
    """A script's own function, set on an MXNet class by ``healthy_end(own_init=True)``."""
    return KEPT


KEPT = []  # what a script training at module level keeps in its globals


def healthy_end(backend, steps=6, lag=0.0, own_init=False):
    """``steps`` training steps of a small network, the last one issued and
    not waited for: the script ends with it in flight. Worker 1 starts its
    last step ``lag`` seconds after the others. ``own_init``: the script
    registers an initializer of its own (:class:`OwnInit`, which initializes
    the network), sets a function of its own on an MXNet class, and keeps
    its store and network in its globals: MXNet's modules then reach the
    script's globals, and through them the store."""
    worker = Worker(backend, 2, [2, 1, 3, 2])
    net = gluon.nn.HybridSequential()
    for _ in range(3):
        net.add(gluon.nn.Conv2D(8, 3, padding=1),
                SyncBatchNorm(in_channels=8, kvstore=worker.kvstore, timeout=60))
    if own_init:
        mx.init.register(OwnInit)
        gluon.Block.own_function = _own_function
        KEPT.extend([worker, net])
    net.initialize(mx.init.create('owninit') if own_init else mx.init.Uniform(),
                   ctx=worker.ctxs)
    for step in range(steps):
        if step == steps - 1 and worker.rank == 1:
            time.sleep(lag)
        xs = [mx.nd.random.normal(1e3, shape=(n, 8, 8, 8), ctx=c)
              for n, c in zip(worker.sizes[2 * worker.rank:], worker.ctxs)]
        with autograd.record():
            losses = [net(x).sum() for x in xs]
        autograd.backward(losses)
    return dict(rank=worker.rank, operator=net[1]._sync_backend.name)


def helper_lost(backend, flag, steps_after=0, timeout=5.0):
    """Two training steps, then ``TRAINED`` and a wait until ``flag`` exists
    (the test ends one of the job's own processes first), then
    ``steps_after`` more steps."""
    worker = Worker(backend, 1, [3, 2])
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4), SyncBatchNorm(kvstore=worker.kvstore, timeout=timeout))
    net.initialize(ctx=worker.ctxs)

    def step():
        with autograd.record():
            loss = net(mx.nd.ones((worker.sizes[worker.rank], 5), ctx=worker.ctxs[0])).sum()
        loss.backward()
        mx.nd.waitall()
    step()
    step()
    print('TRAINED', flush=True)
    deadline = time.time() + 60
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.1)
    for _ in range(steps_after):
        step()
    return dict(rank=worker.rank, operator=net[1]._sync_backend.name)


SCENARIOS = {'layer': layer, 'moves': moves, 'train': train, 'helper_lost': helper_lost, 'precise_bn': precise_bn, 'out_of_step': out_of_step,
             'healthy_end': healthy_end}

if __name__ == '__main__':
    if os.environ.get('DIST_WORKER_TRACEBACK_AFTER'):  # where a hung worker waits
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ['DIST_WORKER_TRACEBACK_AFTER']))
    result = SCENARIOS[sys.argv[1]](**json.loads(sys.argv[2]))
    print('RESULT ' + json.dumps(result), flush=True)
