"""Which devices normalize together: the ``sync_groups`` argument.

Devices are numbered globally: this process's contexts in the order the
layer's parameters were initialized on, and, with a cross-process transport,
worker ``r``'s local device ``i`` is ``r * devices_per_worker + i`` (every
worker must use the same number of devices). ``sync_groups`` partitions those
numbers; each group normalizes with the statistics of its own devices.
"""
from .errors import SyncBatchNormError

__all__ = ['check_sync_groups', 'partition']


def check_sync_groups(value):
    """``value`` in a canonical form (None, an int, or a tuple of tuples of
    ints); raise ValueError at construction for what can never be valid."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError('sync_groups=%d: a group size must be at least 1.' % value)
        return value
    try:
        groups = tuple(tuple(int(d) for d in group) for group in value)
    except (TypeError, ValueError):
        raise ValueError('sync_groups=%r: pass a group size (int) or a list of lists of device '
                         'indices, e.g. [[0, 1], [2, 3]].' % (value,))
    flat = [d for group in groups for d in group]
    if not groups or any(not group for group in groups) or min(flat) < 0 \
            or len(set(flat)) != len(flat):
        raise ValueError('sync_groups=%r: groups must be non-empty lists of distinct device '
                         'indices (0, 1, ...) that appear in one group each.' % (value,))
    return groups


def partition(sync_groups, num_devices, layer_name):
    """The groups as lists of global device indices, tiling ``range(num_devices)``."""
    if sync_groups is None:
        return [list(range(num_devices))]
    if isinstance(sync_groups, int):
        if num_devices % sync_groups:
            raise SyncBatchNormError(
                "SyncBatchNorm '%s': sync_groups=%d does not divide the %d devices taking "
                "part into groups of equal size. Pick a divisor of %d, or list the groups."
                % (layer_name, sync_groups, num_devices, num_devices))
        return [list(range(start, start + sync_groups))
                for start in range(0, num_devices, sync_groups)]
    flat = sorted(d for group in sync_groups for d in group)
    if flat != list(range(num_devices)):
        missing = sorted(set(range(num_devices)) - set(flat))
        extra = sorted(set(flat) - set(range(num_devices)))
        raise SyncBatchNormError(
            "SyncBatchNorm '%s': sync_groups=%s must tile the %d devices taking part (0 to %d)"
            "%s%s. Every device must be in exactly one group." % (
                layer_name, [list(g) for g in sync_groups], num_devices, num_devices - 1,
                '; missing: %s' % missing if missing else '',
                '; no such device: %s' % extra if extra else ''))
    return [list(group) for group in sync_groups]
