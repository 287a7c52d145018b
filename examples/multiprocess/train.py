"""SyncBatchNorm across worker processes: a small convnet on synthetic data.

Every worker trains on its own shard of the data; the BatchNorm layers
normalize with the statistics of the whole batch over every device of every
worker. Run it through a launcher (see README.md beside this file):

    python -m gluon_syncbn.launch -n 2 -s 1 examples/multiprocess/train.py
    python -m gluon_syncbn.launch -n 2 --backend horovod examples/multiprocess/train.py

Each worker prints its mean training loss per epoch, then whether the
running statistics are the same, bit for bit, on every device of every worker.
"""
import argparse
import math
import os
import sys
import zlib

import numpy as np

# Runs from a clone without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gluon_syncbn  # noqa: E402  (before mxnet: the GPU wheel's CUDA libraries)
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

CLASSES = 4


def fail(message):
    """Stop with one line naming the problem and the fix."""
    raise SystemExit('train.py: ' + message)


def parse_args(argv=None):
    """The flags, checked: a bad one stops the script with one line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--backend', choices=['kvstore', 'horovod'], default=None,
                   help="MXNet's dist_sync kvstore or Horovod (default: Horovod where its "
                        "launcher started this process, else the kvstore)")
    p.add_argument('--contexts', type=int, default=None,
                   help='CPU contexts per worker (default: 2 with the kvstore, 1 with Horovod)')
    p.add_argument('--batch-size', type=int, default=8, help='per worker, over its contexts')
    p.add_argument('--samples', type=int, default=256, help='synthetic images in all')
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--lr', type=float, default=0.1)
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    if args.backend is None:
        horovod = ('HOROVOD_RANK', 'OMPI_COMM_WORLD_RANK', 'PMI_RANK')  # Gloo's, MPI's
        args.backend = 'horovod' if any(v in os.environ for v in horovod) else 'kvstore'
    if args.contexts is None:
        args.contexts = 2 if args.backend == 'kvstore' else 1
    for name, value in (('--contexts', args.contexts), ('--batch-size', args.batch_size),
                        ('--samples', args.samples), ('--epochs', args.epochs)):
        if value < 1:
            fail('%s %d: give 1 or more' % (name, value))
    if args.backend == 'horovod' and args.contexts != 1:
        # hvd.DistributedTrainer reduces the gradients of a worker's first context only.
        fail('--contexts %d: Horovod takes one context per worker; start more workers '
             'instead (the launcher\'s -n)' % args.contexts)
    if args.batch_size % args.contexts:
        fail('--batch-size %d does not split evenly over %d contexts: give a multiple of %d'
             % (args.batch_size, args.contexts, args.contexts))
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail('--lr %r: give a positive learning rate, e.g. 0.1' % args.lr)
    if not 0 <= args.seed < 2 ** 32:
        fail('--seed %d: give 0 or more and less than 2**32' % args.seed)
    if args.backend == 'kvstore' and 'DMLC_ROLE' not in os.environ:
        # Without the launcher's settings ps-lite has no scheduler to join.
        fail('run me through a launcher, which starts the scheduler, the servers and the '
             'workers: python -m gluon_syncbn.launch -n 2 -s 1 examples/multiprocess/train.py '
             '(see examples/multiprocess/README.md)')
    return args


def synthetic_data(samples, seed):
    """``(images, labels)``: 3x16x16 images whose channel means tell the class."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, CLASSES, samples)
    means = rng.uniform(-1, 1, (CLASSES, 3))
    images = rng.randn(samples, 3, 16, 16) + 0.5 * means[labels][:, :, None, None] + 5
    return images.astype(np.float32), labels.astype(np.float32)


def build_net():
    """Conv-BN-ReLU twice and a classifier, with plain nn.BatchNorm (converted later)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
            gluon.nn.Activation('relu'),
            gluon.nn.Conv2D(32, 3, strides=2, padding=1, use_bias=False), gluon.nn.BatchNorm(),
            gluon.nn.Activation('relu'),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(CLASSES))
    return net


class Job(object):
    """This worker's view of the job: rank, workers, the layers' ``kvstore``
    argument, the trainer, and the sum of an array over the workers."""

    def __init__(self, backend):
        if backend == 'horovod':
            try:
                import horovod.mxnet as hvd  # pylint: disable=import-outside-toplevel
            except ImportError as exc:  # not installed, or built without MXNet
                fail('--backend horovod needs horovod.mxnet, which does not import here (%s): '
                     "install Horovod with MXNet support, the command in docs/install.md, "
                     "section 'Horovod'" % exc)
            hvd.init()
            self.hvd, self.kvstore = hvd, 'horovod'
            self.rank, self.num_workers = hvd.rank(), hvd.size()
        else:
            self.hvd, self.kvstore = None, mx.kv.create('dist_sync')
            self.rank, self.num_workers = self.kvstore.rank, self.kvstore.num_workers

    def trainer(self, params, optimizer_params):
        """``(trainer, batch_size factor)``: what ``trainer.step`` takes is this
        worker's batch size times the factor, for the mean gradient over the
        global batch either way."""
        if self.hvd is not None:
            # Averages the gradients over the workers: the per-worker batch.
            self.hvd.broadcast_parameters(params, root_rank=0)
            return self.hvd.DistributedTrainer(params, 'sgd', optimizer_params), 1
        # Sums them over every device of every worker: the global batch.
        return gluon.Trainer(params, 'sgd', optimizer_params, kvstore=self.kvstore,
                             update_on_kvstore=False), self.num_workers

    def gather(self, vector, key):
        """Every worker's ``vector`` (float32), one row per rank, on every worker:
        a sum over the workers of rows that are zero but this worker's, exact."""
        rows = mx.nd.zeros((self.num_workers, vector.size))
        rows[self.rank] = mx.nd.array(vector)
        if self.hvd is not None:
            return self.hvd.allreduce(rows, average=False, name='gather').asnumpy()
        self.kvstore.init(key, mx.nd.zeros(rows.shape))
        self.kvstore.push(key, rows)
        self.kvstore.pull(key, out=rows)
        return rows.asnumpy()


def main(args):
    gluon_syncbn.configure_cpu_contexts(args.contexts)  # before MXNet's first operator
    job = Job(args.backend)
    ctxs = [mx.cpu(i) for i in range(args.contexts)]
    # Repeatable runs; the workers start from rank 0's initial parameters either
    # way (the Trainer's first step sends them, or hvd.broadcast_parameters).
    mx.random.seed(args.seed)
    images, labels = synthetic_data(args.samples, args.seed)
    # This worker's shard; every worker takes the same number of steps.
    shard = np.arange(job.rank, args.samples, job.num_workers)
    steps = args.samples // job.num_workers // args.batch_size
    if steps == 0:
        fail('%d samples over %d workers make no batch of %d: give --samples %d or more'
             % (args.samples, job.num_workers, args.batch_size,
                job.num_workers * args.batch_size))
    net = gluon_syncbn.convert_model(build_net(), kvstore=job.kvstore)
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    net.hybridize()
    trainer, factor = job.trainer(net.collect_params(), {'learning_rate': args.lr,
                                                         'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for epoch in range(args.epochs):
        order = np.random.RandomState([args.seed, epoch, job.rank]).permutation(shard)
        total = 0.0
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            xs = gluon.utils.split_and_load(images[batch], ctxs)
            ys = gluon.utils.split_and_load(labels[batch], ctxs)
            with autograd.record():
                losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
            autograd.backward(losses)
            trainer.step(args.batch_size * factor)
            total += sum(float(l.sum().asscalar()) for l in losses)
        print('worker %d epoch %d loss %.4f' % (job.rank, epoch + 1,
                                                total / (steps * args.batch_size)), flush=True)
    running = [p for _, p in sorted(net.collect_params('.*running.*').items())]
    per_context = [np.concatenate([p.data(c).asnumpy().ravel() for p in running])
                   for c in ctxs]
    mine = per_context[0]
    local = all(np.array_equal(v, mine) for v in per_context)
    # A key after the Trainer's (one per parameter) and far below gluon_syncbn's own.
    rows = job.gather(mine, key=len(net.collect_params().keys()))
    same = local and all(np.array_equal(row, rows[0]) for row in rows)
    print('worker %d running statistics identical on all %d devices of the %d workers: %s '
          '(crc32 %08x)' % (job.rank, args.contexts * job.num_workers, job.num_workers, same,
                            zlib.crc32(mine.tobytes())), flush=True)
    if not same:
        raise SystemExit(1)


if __name__ == '__main__':
    main(parse_args())
