"""Settings of MXNet's engine that synchronization depends on.

A SyncBatchNorm call on device 0 waits for the same call on device 1, a
dependency MXNet's engine cannot see. On CPU contexts every context shares one
pool of temp-space slots and one of random-number slots, handed out
round-robin, and an operator waits for every earlier operator on its slot. If
device 0's work *after* the layer holds a slot that device 1's work *before*
the layer also needs, each waits for the other forever. That cannot happen
while fewer operators that use such a slot are issued between the first and the
last device's call of one layer than there are slots, so we raise the number
of slots well above what a network issues there. The variables must be set
before MXNet runs its first operator; importing gluon_syncbn first does that.
"""
import functools
import os
import warnings

__all__ = ['configure', 'ENGINE_SETTINGS', 'is_naive_engine', 'mkldnn_active']

# name -> value set when the user has not chosen one
ENGINE_SETTINGS = {
    'MXNET_CPU_TEMP_COPY': '1024',
    'MXNET_CPU_PARALLEL_RAND_COPY': '32',
}
MIN_SLOTS = {'MXNET_CPU_TEMP_COPY': 64, 'MXNET_CPU_PARALLEL_RAND_COPY': 16}


def configure():
    """Set the engine variables this library needs unless the user set them."""
    for name, value in ENGINE_SETTINGS.items():
        current = os.environ.setdefault(name, value)
        try:
            too_low = int(current) < MIN_SLOTS[name]
        except ValueError:
            too_low = True
        if too_low:
            warnings.warn(
                '%s=%s: SyncBatchNorm on several CPU contexts can deadlock with few slots; '
                'gluon_syncbn recommends %s.' % (name, current, value), RuntimeWarning)


def is_naive_engine():
    return os.environ.get('MXNET_ENGINE_TYPE', '') == 'NaiveEngine'


@functools.lru_cache(maxsize=None)
def mkldnn_active():
    """True when MXNet runs CPU operators through MKL-DNN (the CPU wheel's default)."""
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1') == '0':
        return False
    import mxnet as mx
    try:
        return mx.runtime.Features().is_enabled('MKLDNN')
    except Exception:  # pylint: disable=broad-except
        return False
