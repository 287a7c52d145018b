"""The session's dtype record, with plain threads (no MXNet work)."""
import threading

import pytest

from gluon_syncbn.errors import SyncBatchNormError
from gluon_syncbn.session import OPEN_CALLS, Session


def run_devices(fns, deadline=10.0):
    """Run one function per device in threads; return results or exceptions."""
    out = [None] * len(fns)

    def wrap(i):
        try:
            out[i] = fns[i]()
        except Exception as exc:  # pylint: disable=broad-except
            out[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline)
        assert not t.is_alive(), 'a device thread hung'
    return out


class Layer(object):
    """Stands in for a layer or a hybridized block: what owns a dtype record."""


def test_the_dtype_record_pairs_calls_by_number_and_keeps_nothing_finished():
    session = Session()
    layer = Layer()
    for _ in range(1000):
        for device in ('cpu(0)', 'cpu(1)'):
            session.check_dtypes(layer, "'bn'", 2, device, 'float32')
    assert layer._gluon_syncbn_dtypes[2] == {}  # no call left open
    # Devices running ahead of each other: the k-th calls are compared.
    for device, dtype in [('cpu(0)', 'float32'), ('cpu(0)', 'float64'), ('cpu(1)', 'float32')]:
        session.check_dtypes(layer, "'bn'", 2, device, dtype)
    with pytest.raises(SyncBatchNormError, match=r"cpu\(0\): float64, cpu\(1\): float16"):
        session.check_dtypes(layer, "'bn'", 2, 'cpu(1)', 'float16')
    # Calls one device alone makes (an empty slice runs a hybridized net's
    # layers imperatively) are kept up to a bound.
    alone = Layer()
    for _ in range(3 * OPEN_CALLS):
        session.check_dtypes(alone, "'bn'", 2, 'cpu(0)', 'float32')
    assert len(alone._gluon_syncbn_dtypes[2]) == OPEN_CALLS


def test_a_new_owner_never_sees_an_old_ones_calls():
    # A garbage-collected block's id is reused at once by CPython; its record
    # goes with it. Several threads record at once.
    session = Session()
    for _ in range(50):
        old = Layer()
        session.check_dtypes(old, "'bn'", 2, 'cpu(0)', 'float32')  # cpu(1) never calls
        del old
        new = Layer()
        assert run_devices([lambda d=d: session.check_dtypes(new, "'bn'", 4, 'cpu(%d)' % d,
                                                             'float64')
                            for d in range(4)]) == [None] * 4
        assert new._gluon_syncbn_dtypes[2] == {}


def test_a_process_without_layers_runs_the_hooks_alone_and_still_knows_its_step():
    # Before a layer is made every hook takes MXNet's path at once, but for
    # the step hooks' note of which threads are in a step: a thread in
    # record() when the first layer is made is known to be in it, so a
    # thread starting then joins its step (sole_thread: not alone).
    from tests.conftest import run_python  # pylint: disable=import-outside-toplevel
    code = r'''
import collections, os, sys, threading
import mxnet as mx
from mxnet import autograd
from mxnet.gluon import nn
import gluon_syncbn
from gluon_syncbn.session import SESSION
net = nn.HybridSequential()
net.add(nn.Dense(4), nn.BatchNorm())
net.initialize(ctx=mx.cpu(0))
x = mx.nd.ones((2, 3))
net(x).wait_to_read()  # deferred initialization, which scopes its own calls
package = os.path.dirname(gluon_syncbn.__file__)
ran = collections.Counter()
def profile(frame, event, arg):
    if event == 'call' and frame.f_code.co_filename.startswith(package):
        ran[frame.f_code.co_name] += 1
sys.setprofile(profile)
with autograd.record():
    out = net(x)
out.backward()
out.asnumpy()
mx.nd.waitall()
sys.setprofile(None)
print('RAN', sorted(ran.items()))
with autograd.record():
    gluon_syncbn.SyncBatchNorm()
    alone = []
    worker = threading.Thread(target=lambda: alone.append(SESSION.sole_thread()))
    worker.start()
    worker.join(30)
    print('ALONE', alone)
'''
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAN [('__exit__', 1), ('call', 1), ('read', 2), ('set_recording_hooked', 2), " \
        "('set_training_hooked', 2), ('thread_in_step', 2)]" in proc.stdout, proc.stdout
    assert 'ALONE [False]' in proc.stdout, proc.stdout
