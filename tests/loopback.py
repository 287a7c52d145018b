"""Cross-process transports inside one process, for tests.

:class:`LoopbackTransport` plays ``workers`` workers of which the others send
what ``mode`` says (its native twin, ``tests/native_testing.h``, in the
tests' build of the library):

``same``   the others send this worker's payload: the global batch is this
           process's batch ``workers`` times, whose statistics are the local
           ones, so every result equals one process's;
``call``     their call numbers are one ahead (workers out of step);
``channels`` their layers have 2 channels more (networks that differ);
``float32``  as ``same``, every payload rounded to float32 (MXNet 1.9.1's kvstore
             server, where its ``multi_precision_`` flag is left uninitialized);
``scale``    the sum comes back scaled by 0.45 (an optimizer on the server);
``never``    a layer's reduction never completes;
``fail``     the engine reports an error on a layer's reduction (as Horovod does).

:func:`install` makes ``SyncBatchNorm(kvstore=None)`` use one, or a 'local'
kvstore through the real ``MXKVStorePushPull`` chain (``'kvstore'``), so the
one-process scenarios run through a cross-process transport. A failure there
is fatal, as in a real job: such processes end after it.
"""
from gluon_syncbn import block, transport
from tests import native_testing


class LoopbackTransport(transport._CrossProcessTransport):
    name = 'loopback'

    def __init__(self, workers=2, mode='same'):
        self.rank, self.num_workers, self.mode = 0, workers, mode
        super(LoopbackTransport, self).__init__()

    def _make_native(self, lib):
        return native_testing.loopback(lib, self.num_workers, self.mode, self.exit_grace)


def install(kind, **kwargs):
    """From now on ``SyncBatchNorm(kvstore=None)`` (only) gets one shared
    transport: ``'loopback'`` (``kwargs`` as :class:`LoopbackTransport`'s)
    or ``'kvstore'`` (a 'local' kvstore, one worker). Returns it."""
    if kind == 'loopback':
        shared = LoopbackTransport(**kwargs)
    else:
        import mxnet as mx
        store = mx.kv.create('local')
        shared = transport.KVStoreTransport(store)
        shared.store = store  # the transport holds it weakly
    make = block.make_transport
    block.make_transport = lambda kvstore: shared if kvstore is None else make(kvstore)
    return shared
