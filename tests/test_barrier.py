"""The call-order barrier with plain threads (no MXNet involved)."""
import threading
import time

import pytest

from gluon_syncbn.barrier import CallOrderBarrier
from gluon_syncbn.errors import SyncBatchNormError, SyncBatchNormTimeout
from gluon_syncbn.session import OPEN_CALLS, Session


class LocalSession(object):
    """A session for a barrier used on its own: one token, never aborted."""

    def token(self):
        return 0

    def check(self, token, layer):
        pass

    def abort(self, cause):
        pass

    def fail_others(self, cause):
        pass


def summing_barrier(n, timeout=5.0, session=None):
    return CallOrderBarrier('bn', ['dev%d' % i for i in range(n)], timeout,
                            session or LocalSession(), hint='HINT')


def add_up(key, values):
    return sum(values.values())


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


def forward(barrier, device, value, token=None):
    key = barrier.next_forward_key(device, token)
    return key, barrier.meet(key, device, value, add_up, token=token)


def test_kth_calls_pair_up_whatever_the_arrival_order():
    barrier = summing_barrier(3)

    def device(i):
        results = []
        for k in range(5):
            time.sleep(0.002 * ((i + k) % 3))  # devices arrive in different orders
            results.append(forward(barrier, i, 10 ** i * (k + 1))[1])
        return results

    out = run_devices([lambda i=i: device(i) for i in range(3)])
    assert out == [[111 * (k + 1) for k in range(5)]] * 3


def test_backward_pairs_by_forward_key_even_in_reverse_order():
    # As in MXNet, every backward call runs on its own thread; device 1 issues
    # them in the reverse order of device 0.
    barrier = summing_barrier(2)
    keys = run_devices([lambda i=i: [forward(barrier, i, 0)[0] for _ in range(3)]
                        for i in range(2)])
    assert keys[0] == keys[1]
    calls = []
    for i in range(2):
        order = keys[i] if i == 0 else keys[i][::-1]
        calls += [lambda i=i, key=key: (key, barrier.meet(('bwd',) + key[1:], i,
                                                               (i + 1) * (key[2] + 1), add_up))
                  for key in order]
    out = dict()
    for key, total in run_devices(calls):
        out.setdefault(key, set()).add(total)
    assert {k[2]: v for k, v in out.items()} == {0: {3}, 1: {6}, 2: {9}}


def test_timeout_names_the_missing_device_and_fails_in_time():
    barrier = summing_barrier(3, timeout=0.3)
    start = time.monotonic()
    out = run_devices([lambda: forward(barrier, 0, 1), lambda: forward(barrier, 1, 1)])
    assert time.monotonic() - start < 2.0
    for exc in out:
        assert isinstance(exc, SyncBatchNormTimeout)
        assert 'missing: dev2' in str(exc) and 'HINT' in str(exc) and '2 of 3' in str(exc)


def test_reduce_error_reaches_every_device():
    def reduce(key, values):
        raise SyncBatchNormError('channels disagree')
    barrier = CallOrderBarrier('bn', ['a', 'b'], 5.0, LocalSession())
    out = run_devices([lambda i=i: barrier.meet(barrier.next_forward_key(i), i, 1, reduce)
                       for i in range(2)])
    assert all(isinstance(e, SyncBatchNormError) and 'disagree' in str(e) for e in out)


def test_abort_fails_stale_calls_and_the_next_step_pairs_from_zero():
    session = Session()
    barrier = summing_barrier(2, timeout=0.3, session=session)
    old = session.token()
    # step 1: device 1 never comes
    with pytest.raises(SyncBatchNormTimeout):
        forward(barrier, 0, 1, old)
    assert session.token() != old
    # a call issued in the aborted step fails at once, without arriving
    start = time.monotonic()
    with pytest.raises(SyncBatchNormError, match='step that failed earlier'):
        forward(barrier, 1, 1, old)
    assert time.monotonic() - start < 0.2
    # step 2 pairs up from call #0 on both devices
    new = session.token()
    out = run_devices([lambda: forward(barrier, 0, 1, new), lambda: forward(barrier, 1, 2, new)])
    assert [o[1] for o in out] == [3, 3]
    assert out[0][0] == ('fwd', new, 0)


def test_a_timed_out_exchange_is_not_kept_for_a_device_that_never_comes():
    # With a real session a timeout aborts the step: a late call of it fails
    # at its token, so the barrier keeps nothing for the missing device.
    session = Session()
    barrier = summing_barrier(2, timeout=0.2, session=session)
    for _ in range(3):
        token = session.issue_token()
        out = run_devices([lambda: forward(barrier, 0, 1.0, token)])
        assert isinstance(out[0], SyncBatchNormTimeout)
        session.begin_step()
    assert barrier._meetings == {}


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
