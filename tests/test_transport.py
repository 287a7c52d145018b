"""Transport selection and the cross-process rules, with a fake engine in one process.

The real engines (dist kvstore, Horovod) are exercised in test_multiprocess.py.
"""
import threading
import time

import numpy as np
import pytest

from gluon_syncbn import SyncBatchNorm, SyncBatchNormError, SyncBatchNormTimeout
from gluon_syncbn.registry import Session
from gluon_syncbn.transport import LocalTransport, _CrossProcessTransport, make_transport


class FakeStore(object):
    def __init__(self, kv_type, num_workers=1, rank=0):
        self.type, self.num_workers, self.rank = kv_type, num_workers, rank


@pytest.mark.parametrize('kv_type', ['horovod', 'byteps'])
def test_kvstore_types_mxnet_silently_makes_local_are_refused(kv_type):
    with pytest.raises(SyncBatchNormError, match="gives a plain local store"):
        make_transport(FakeStore(kv_type))


@pytest.mark.parametrize('kv_type', ['dist_async', 'dist_device_async', 'dist'])
def test_asynchronous_kvstores_are_refused(kv_type):
    with pytest.raises(SyncBatchNormError, match="synchronous all-reduce"):
        make_transport(FakeStore(kv_type, num_workers=2))


@pytest.mark.parametrize('value', ['dist_sync', 'byteps', 3])
def test_other_values_are_refused_with_the_accepted_ones(value):
    with pytest.raises(SyncBatchNormError, match="horovod"):
        make_transport(value)


@pytest.mark.parametrize('store', [None, FakeStore('local'), FakeStore('device'),
                                   FakeStore('dist_sync', num_workers=1)])
def test_one_process_stores_use_the_local_barrier_only(store):
    assert isinstance(make_transport(store), LocalTransport)


def test_the_layer_checks_kvstore_at_construction():
    with pytest.raises(SyncBatchNormError, match="byteps"):
        SyncBatchNorm(kvstore=FakeStore('byteps'))


class FakeEngine(_CrossProcessTransport):
    """Workers simulated by a function of this worker's payload."""
    name = 'fake'

    def __init__(self, others, num_workers=2):
        self.rank, self.num_workers = 0, num_workers
        self.others = others  # payload -> sum of the other workers' payloads, or None: hang
        self.fatal = []
        self.inits = []
        super(FakeEngine, self).__init__()

    def _init_slot(self, slot, forward_size, backward_size):
        self.inits.append((slot, forward_size, backward_size))

    def _start(self, slot, direction, vector):
        others = self.others(vector)
        if others is None:
            return threading.Event().wait  # never completes
        return lambda: vector + others

    def _on_fatal(self, exc):
        self.fatal.append(exc)  # the real one ends the process


def forward_vector(channels, value=1.0):
    return np.full(1 + 2 * channels, value)


def test_sums_with_other_workers_and_strips_the_check_numbers():
    engine = FakeEngine(lambda v: v * 2, num_workers=3)
    engine.attach('bn0', 'bn', 9, 8)
    engine.attach('bn0', 'bn', 9, 8)  # idempotent: one slot per layer
    assert engine.inits == [(0, 2 + 9, 2 + 8)]
    total = engine.allreduce('bn0', ('fwd', 0, 0), forward_vector(4), 4, timeout=5)
    np.testing.assert_array_equal(total, forward_vector(4, 3.0))
    assert not engine.fatal


@pytest.mark.parametrize('others,expected', [
    (lambda v: np.concatenate(([v[0], v[1] + 1], v[2:])), 'out of step'),  # call numbers
    (lambda v: np.concatenate(([v[0] + 2], v[1:])), 'out of step'),  # channel counts
    (lambda v: v * 0.45, 'update_on_kvstore=False'),  # a server-side optimizer
])
def test_disagreeing_workers_are_a_fatal_error_not_a_wrong_mean(others, expected):
    engine = FakeEngine(others)
    engine.attach('bn0', 'bn', 7, 6)
    with pytest.raises(SyncBatchNormError, match=expected):
        engine.allreduce('bn0', ('fwd', 0, 5), forward_vector(3), 3, timeout=5)
    assert len(engine.fatal) == 1
    with pytest.raises(SyncBatchNormError, match='cannot resume'):
        engine.allreduce('bn0', ('fwd', 0, 6), forward_vector(3), 3, timeout=5)


def test_a_reduction_that_never_completes_times_out():
    engine = FakeEngine(lambda v: None)
    engine.attach('bn0', 'bn', 7, 6)
    start = time.monotonic()
    with pytest.raises(SyncBatchNormTimeout, match='worker 0 of 2 waited 0.3s'):
        engine.allreduce('bn0', ('bwd', 0, 7), np.ones(6), 3, timeout=0.3)
    assert time.monotonic() - start < 2
    assert len(engine.fatal) == 1


def test_engine_errors_are_wrapped_with_the_likely_cause():
    def fail(_):
        raise RuntimeError('Horovod has been shut down')
    engine = FakeEngine(fail)
    engine.attach('bn0', 'bn', 7, 6)
    with pytest.raises(SyncBatchNormError, match='Another worker probably died'):
        engine.allreduce('bn0', ('fwd', 0, 0), forward_vector(3), 3, timeout=5)


def test_an_aborted_step_breaks_cross_process_sync_except_at_exit():
    session = Session()
    engine = FakeEngine(lambda v: v)
    session.add_abort_listener(engine.fail_on_abort)
    session.abort(SyncBatchNormError('exiting'), exiting=True)
    engine.attach('bn0', 'bn', 7, 6)
    session.abort(SyncBatchNormError('exiting'), exiting=True)
    assert not engine.fatal
    session.abort(SyncBatchNormError('bad input on cpu(1)'))
    assert len(engine.fatal) == 1 and 'bad input on cpu(1)' in str(engine.fatal[0])
