"""MXNet engine settings that synchronizing several CPU contexts needs.

A SyncBatchNorm call on device 0 waits for the same call on device 1, a
dependency MXNet's engine cannot see. On CPU contexts every context shares one
pool of temp-space slots and one of random-number slots, handed out
round-robin, and an operator waits for every earlier operator on its slot. If
device 0's work *after* the layer holds a slot that device 1's work *before*
the layer also needs, each waits for the other forever. That cannot happen
while fewer operators that use such a slot are issued between the first and the
last device's call of one layer than there are slots.

Temp space does not depend on that bound: at the first synchronized call on
several CPU contexts the native library gives each context a temp-space pool
of its own (``native/cpu_resources.h``, ``Session.separate_cpu_temp_space``),
as MXNet gives each GPU, because a static_shape graph keeps its temp-space
slots for its life, and from one shared pool the other operators' slots
would sweep over them once per turn of the pool, whatever the number of
slots. The shared pool's size still matters where that separation cannot be
made (the layer warns) and for the random-number slots everywhere.

More slots are not free: each keeps the largest buffer it was ever handed
(what that costs a process that does not synchronize: docs/design.md,
section 'The engine hazard'). Importing gluon_syncbn therefore changes
nothing; synchronizing several CPU contexts takes one explicit step,
:func:`configure_cpu_contexts` (or ``GLUON_SYNCBN_CPU_CONTEXTS`` in the environment, read at import), before
MXNet runs its first operator (MXNet reads the variables once, when its
resource manager starts, which ``mx.random.seed`` also does). Without that
step the first synchronized call on several CPU contexts raises at once
(:func:`check_cpu_contexts`). GPUs have their own resources per device and
need nothing.
"""
import os

from .errors import SyncBatchNormError
from .mxnet_private import resources_made

__all__ = ['configure_cpu_contexts', 'configure_from_environment', 'check_cpu_contexts',
           'describe', 'slots_for', 'is_naive_engine', 'on_cpu_path']

CONTEXTS_VARIABLE = 'GLUON_SYNCBN_CPU_CONTEXTS'
DEVICE_PATH_VARIABLE = 'GLUON_SYNCBN_DEVICE_PATH'
TEMP_SLOTS = 'MXNET_CPU_TEMP_COPY'
RANDOM_SLOTS = 'MXNET_CPU_PARALLEL_RAND_COPY'
# Settings set by hand count as the explicit step when at least these.
MIN_SLOTS = {TEMP_SLOTS: 64, RANDOM_SLOTS: 16}

_configured_contexts = [0]  # the largest num_contexts configure_cpu_contexts was given


def slots_for(num_contexts):
    """``(temp-space slots, random-number slots)`` for ``num_contexts`` CPU contexts.

    Slots needed grow with the contexts (the work issued between the first and
    the last device's call of a layer) and with depth; these cover the 20-layer
    test nets and a ResNet-18-like net at 4 contexts, 4 Dropout layers at 8.
    """
    return min(1024, 256 * num_contexts), max(16, 8 * num_contexts)


def configure_cpu_contexts(num_contexts, temp_slots=None, random_slots=None):
    """Size MXNet's shared CPU resources for SyncBatchNorm on ``num_contexts`` CPU contexts.

    Call it right after ``import gluon_syncbn``, before MXNet runs its first
    operator or ``mx.random.seed``; setting ``GLUON_SYNCBN_CPU_CONTEXTS=num_contexts``
    in the environment does the same at import. It sets ``MXNET_CPU_TEMP_COPY`` and
    ``MXNET_CPU_PARALLEL_RAND_COPY``, never lowering a value already in the
    environment. Not needed on GPUs or on one context.

    Parameters
    ----------
    num_contexts : int
        The most CPU contexts one SyncBatchNorm layer will synchronize.
    temp_slots, random_slots : int or None
        Override the sizes :func:`slots_for` picks: raise them for a deeper net
        or one with more Dropout layers if a timeout message asks for it.

    Returns
    -------
    dict
        The two variables as now set.

    Raises
    ------
    SyncBatchNormError
        Where MXNet made its CPU resources already (it reads the settings
        once, then) and this call would raise one of them.
    """
    if isinstance(num_contexts, bool) or int(num_contexts) != num_contexts or num_contexts < 1:
        raise ValueError('configure_cpu_contexts: num_contexts must be a positive integer, '
                         'got %r' % (num_contexts,))
    return _configure(int(num_contexts), temp_slots, random_slots,
                      'configure_cpu_contexts(%d)' % num_contexts)


def _configure(num_contexts, temp_slots, random_slots, step):
    """:func:`configure_cpu_contexts`, the user's ``step`` named in its error."""
    temp, rand = slots_for(num_contexts)
    wanted = {TEMP_SLOTS: temp_slots or temp, RANDOM_SLOTS: random_slots or rand}
    changes = {name: int(value) for name, value in wanted.items()
               if num_contexts > 1 and int(value) > _int_env(name)}
    if changes and resources_made():
        raise SyncBatchNormError(
            '%s came after MXNet made its CPU resources (at mx.random.seed, or at the first '
            'operator that needs temp space or random numbers): it reads %s once, then, so '
            'these settings cannot take effect any more (MXNet keeps its defaults). Import '
            'gluon_syncbn and call configure_cpu_contexts(%d) first, before mx.random.seed and '
            'any operator (or set %s=%d in the environment and import gluon_syncbn first); '
            'then start the program again.' % (
                step, ' and '.join(sorted(changes)), num_contexts, CONTEXTS_VARIABLE,
                num_contexts))
    for name, value in changes.items():
        os.environ[name] = str(value)
    _configured_contexts[0] = max(_configured_contexts[0], num_contexts)
    return {name: os.environ.get(name) for name in wanted}


def configure_from_environment():
    """At import: take the step if ``GLUON_SYNCBN_CPU_CONTEXTS`` asks for it."""
    value = os.environ.get(CONTEXTS_VARIABLE, '').strip()
    if not value:
        return
    try:
        contexts = int(value)
        if contexts < 1:
            raise ValueError(value)
    except ValueError:
        raise ValueError('%s=%r: expected the number of CPU contexts, e.g. %s=4'
                         % (CONTEXTS_VARIABLE, value, CONTEXTS_VARIABLE)) from None
    _configure(contexts, None, None, 'import gluon_syncbn with %s=%d' % (CONTEXTS_VARIABLE,
                                                                        contexts))


def check_cpu_contexts(layer_name, devices):
    """Raise unless the engine was configured for this many CPU contexts.

    Runs at a layer's first synchronized call, before anything is issued, so a
    missing step fails at once instead of deadlocking or waiting for the timeout.
    """
    cpus = sum(1 for d in devices if d.startswith('cpu'))
    if cpus < 2 or _configured_contexts[0] >= cpus:
        return
    if not _configured_contexts[0] and all(_int_env(name) >= least
                                           for name, least in MIN_SLOTS.items()):
        return  # set by hand, before MXNet started: the user's explicit choice
    if _configured_contexts[0]:
        problem = ('the engine was configured for %d CPU contexts, but this layer '
                   'synchronizes %d' % (_configured_contexts[0], cpus))
    else:
        problem = ('synchronizing %d CPU contexts needs more of MXNet\'s shared CPU '
                   'temp-space and random-number slots than its defaults (%s=%s, %s=%s), or '
                   'the devices can deadlock' % (cpus, TEMP_SLOTS, os.environ.get(TEMP_SLOTS, 4),
                                                 RANDOM_SLOTS, os.environ.get(RANDOM_SLOTS, 1)))
    raise SyncBatchNormError(
        "SyncBatchNorm '%s': %s. Add `gluon_syncbn.configure_cpu_contexts(%d)` right after "
        "`import gluon_syncbn`, before MXNet runs its first operator (or set %s=%d in the "
        "environment); then start the program again." % (
            layer_name, problem, cpus, CONTEXTS_VARIABLE, cpus))


def describe():
    """One line: for how many CPU contexts the engine is set up in this
    process, and with what (``python -m gluon_syncbn``)."""
    values = ', '.join('%s=%s' % (name, os.environ.get(name, 'unset'))
                       for name in (TEMP_SLOTS, RANDOM_SLOTS))
    if _configured_contexts[0] > 1:
        return 'in effect for up to %d CPU contexts (%s)' % (_configured_contexts[0], values)
    if all(_int_env(name) >= least for name, least in MIN_SLOTS.items()):
        return 'set by hand (%s), taken as in effect' % values
    return ('not in effect (%s): one CPU context per layer only; for more, '
            'configure_cpu_contexts(N) or %s=N' % (values, CONTEXTS_VARIABLE))


def _int_env(name):
    try:
        return int(os.environ.get(name, '0'))
    except ValueError:
        return 0


def is_naive_engine():
    return os.environ.get('MXNET_ENGINE_TYPE', '') == 'NaiveEngine'


def on_cpu_path(devices):
    """Whether layers on ``devices`` take the CPU contexts' path (the
    asynchronous operator, where ``auto`` chooses; arrays read and written in
    place): every device a CPU context, and ``GLUON_SYNCBN_DEVICE_PATH`` not
    ``1``. That test switch makes CPU contexts count as GPUs, so the code
    GPUs run (the exchange operator, which ``auto`` picks for them, copying
    its vectors as on a GPU in the tests' build) runs in CI, which has no
    GPU."""
    return (all(d.startswith('cpu') for d in devices)
            and os.environ.get(DEVICE_PATH_VARIABLE, '0') != '1')
