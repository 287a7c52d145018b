"""Transport selection and the cross-process rules, with a fake engine in one process.

The real engines (dist kvstore, Horovod) are exercised in test_multiprocess.py.
"""
import threading
import time

import numpy as np
import pytest

from gluon_syncbn import SyncBatchNorm, SyncBatchNormError, SyncBatchNormTimeout
from gluon_syncbn.transport import LocalTransport, make_transport


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
def test_one_process_stores_get_the_local_transport(store):
    assert isinstance(make_transport(store), LocalTransport)


def test_the_layer_checks_kvstore_at_construction():
    with pytest.raises(SyncBatchNormError, match="byteps"):
        SyncBatchNorm(kvstore=FakeStore('byteps'))
