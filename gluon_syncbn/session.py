"""The session: which training step calls belong to, and how a step fails,
across every layer of the process.

Calls carry a token, the step they were issued in; every failure (a device
raised, a device never came, ``reset()``) aborts the step. The token lives
in the native library's session (``native/session.h``), loaded at the first
layer's first synchronized call: every layer that synchronizes runs a native
operator.
"""
import threading
import weakref

from . import messages
from . import native
from .errors import SyncBatchNormError, SyncBatchNormTimeout, warn_user

__all__ = ['SESSION', 'SETUP_LOCK', 'reset']

# One-time work of a layer's first calls, which may come from one Python
# thread per device at once (GluonCV's parallel_apply): loading the native
# library, making a layer's backend, tracing its imperative graphs. Whoever
# comes first does it; the others wait, then find it done. Reentrant: making
# a backend loads the library.
SETUP_LOCK = threading.RLock()

# Temp-space slots of each CPU context's own pool (MXNet's default for its
# one shared pool, MXNET_CPU_TEMP_COPY, is 4).
CPU_TEMP_SLOTS = 4


class Session(object):
    """Which training step calls belong to, across all layers of the process.

    Operators take their step when they are issued (in imperative and
    dynamic-graph mode; a static graph's calls are stamped with it, see
    ``graphs``). A failure that leaves calls without partners (a device raised, a
    device never came, ``reset()``) fails the step and starts a new token:
    the step's calls fail at once with the cause instead of waiting, or
    pairing with the next step's calls. Calls issued after the failure but
    before the next step begins (:meth:`thread_in_step`) still get the
    failed step: they are the rest of it. A failure seen in Python fails the
    current step alone: an earlier step's calls still queued in the engine
    run on (``session.h``, ``abort_locked``).

    Every source of a failure in Python (bad input, an exception leaving
    ``record()``, interpreter exit, ``reset()``) enters here through
    :meth:`fail_step`; the native library's own failures abort the same
    step there (``session.h``, ``abort_locked``). Before the library is
    loaded no layer has synchronized, so no call can be waiting.
    """

    def __init__(self):
        self._backends = weakref.WeakSet()  # every layer's, while it lives
        self.native = None
        self._cleared_token = 0
        self._clear_lock = threading.Lock()
        self._issue_token = 0
        self._dtypes_lock = threading.Lock()
        self._inside = set()  # the threads recording or training now (thread_in_step)
        self._threads_lock = threading.Lock()
        # Temp space of its own for each CPU context (native cpu_resources.h):
        # '' once a layer synchronizes CPU contexts with it, else why not
        # (None: not asked yet); each Python thread's resource manager is
        # separated once (MXNet keeps one per thread).
        self.cpu_temp_space = None
        self._thread = threading.local()
        self._temp_space_token = None  # the step the CPU contexts' temp space is for
        # The last abort's (cause, the user's exception behind it, its thread)
        # where a user's exception abandoned a step (fail_step).
        self._raised = None

    def load_native(self):
        """The native library, built and loaded at the first layer's first
        synchronized call (not at import), or None where it cannot be had.

        No call has been issued before the first layer's, so the token
        starts afresh there.
        """
        if self.native is None:
            with SETUP_LOCK:
                lib = native.load() if self.native is None else None
                if lib is not None:
                    self._issue_token = lib.token(begin=True)
                    self.native = lib  # last: the token lives there from now on
        return self.native

    def separate_cpu_temp_space(self):
        """Give each CPU context a temp-space pool of its own, in this
        thread's and, from now on, in every thread that issues a step
        (:meth:`separate_this_thread`); at the first synchronized call on
        several CPU contexts, once the native library is loaded."""
        if self.cpu_temp_space is None:
            with SETUP_LOCK:
                if self.cpu_temp_space is None:
                    why = self.native.separate_cpu_temp_space(CPU_TEMP_SLOTS)
                    self._thread.separated = not why
                    self._temp_space_token = self._issue_token
                    if why:
                        warn_user('gluon_syncbn: CPU contexts keep sharing MXNet\'s temp space '
                                  '(%s); static_shape graphs may stall after some steps: '
                                  'hybridize without static_shape on CPU contexts.' % why)
                    self.cpu_temp_space = why
        else:
            self.separate_this_thread()

    def separate_this_thread(self):
        """This thread's MXNet resource manager too, once the CPU contexts'
        temp space is separated (MXNet keeps one per thread)."""
        if self.cpu_temp_space == '' and not getattr(self._thread, 'separated', False):
            self._thread.separated = True
            self.native.separate_cpu_temp_space(CPU_TEMP_SLOTS)

    def add(self, backend):
        """Clean up after a failed step ``backend``'s arrays with every other
        layer's (:meth:`clear_failed_arrays`)."""
        self._backends.add(backend)

    def live_backends(self):
        """Every live layer's backend."""
        while True:
            try:
                return list(self._backends)
            except RuntimeError:  # a layer was collected meanwhile
                continue

    def check_dtypes(self, owner, name, num_devices, device, dtype):
        """Raise if the call of ``owner`` (a hybridized block holding layers;
        ``name`` names them) issued now on ``device`` (a Context or its name)
        has another dtype than the same call on the other devices: the k-th
        call of each of the
        ``num_devices`` devices since the step token last changed, as the
        operators pair them. The meetings compare the devices' dtypes too;
        this finds a mismatch as the calls are issued, where a meeting cannot
        (a traced graph's operators see the network's dtype).

        The record lives on ``owner`` (nothing outlives it) and keeps only
        calls some device has not made yet, at most :data:`OPEN_CALLS` of
        them (a device with an empty slice runs a hybridized network's layers
        imperatively: the others never make those calls).
        """
        with self._dtypes_lock:
            record = owner.__dict__.get('_gluon_syncbn_dtypes')
            if record is None or record[0] != self._issue_token:
                record = owner._gluon_syncbn_dtypes = (self._issue_token, {}, {})
            _, made, open_calls = record  # {device: calls made}, {call: {device: dtype}}
            call = made.get(device, 0)
            made[device] = call + 1
            seen = open_calls.setdefault(call, {})
            seen[device] = dtype
            if len(seen) == num_devices:
                del open_calls[call]
            elif len(open_calls) > OPEN_CALLS:
                del open_calls[next(iter(open_calls))]  # the oldest
            if len(set(seen.values())) <= 1:
                return
        exc = SyncBatchNormError(messages.text(
            'dtypes_disagree', layers=name,
            dtypes=', '.join('%s: %s' % (d, t) for d, t in sorted(seen.items(), key=str))))
        self.fail_step(exc)
        raise exc

    def restart(self):
        """Calls issued from now on belong to a new step (a step begins,
        ``reset()``); to the one before where a layer has had more calls
        issued on one device than on another (``gsbn_step``): a loop of one
        ``record()`` block per device is one step."""
        if self.native is None:
            return
        self._issue_token = self.native.token(begin=True)
        if self.cpu_temp_space == '' and self._temp_space_token != self._issue_token:
            # A step failed since the last began: its operations' errors sit
            # on the CPU contexts' temp-space slots until the clearing
            # (clear_failed_arrays); this step's operations take fresh ones.
            self._temp_space_token = self._issue_token
            self.native.retire_cpu_temp_space()

    def thread_in_step(self, inside):
        """This thread starts (``inside``) or stops recording or training
        (``record()``, ``train_mode()``, ``autograd.set_recording``,
        ``set_training``). A step begins where a thread starts while no other
        thread is inside one: calls issued from then on belong to it. A
        thread that starts while another is inside (one of a data-parallel
        step's threads, started by a main thread inside ``record()``, as
        GluonCV's ``parallel_apply``) joins that step, also where another of
        its threads failed it meanwhile: its calls then fail at once instead
        of waiting for the failed thread's device."""
        me = threading.get_ident()
        # Each test below is the callee's own, made here: a process with no
        # layer runs only this function per switch (and needs no more).
        if inside and self.cpu_temp_space == '':
            self.separate_this_thread()  # it issues operations from now on
        with self._threads_lock:
            if not inside:
                self._inside.discard(me)
                return
            if self._inside and not self._inside.issubset(_live_threads()):
                self._inside &= _live_threads()  # threads that ended inside one
            if not self._inside and self.native is not None:
                self.restart()
            self._inside.add(me)

    def sole_thread(self):
        """Whether at most the calling thread is in a step now: a loop over
        the devices in one thread, which issues every device's calls."""
        with self._threads_lock:
            return self._inside <= {threading.get_ident()}

    def active(self):
        """True while any SyncBatchNorm layer that has synchronized lives."""
        return len(self._backends) > 0

    def clear_failed_arrays(self):
        """At the first call of a step that began after an abort, clear the
        errors MXNet left on the layers' arrays.

        A failed call leaves its exception on the arrays it writes (running
        statistics, gamma/beta gradients), and every later operator touching
        them would be skipped with the same error. Waiting on an array clears
        its error, and with it that of every array the same failed operator
        poisoned: MXNet shares one error object among them
        (``threaded_engine.cc``, ``OnComplete``, ``ThrowException``), so the
        static arrays of cached graphs are clean too. Called before a
        network's calls are issued (by the block, and for cached graphs by
        hooks); the aborted calls finish at once, so the wait is short.

        Not while the failed step's own calls are still being issued (an
        abort in the engine comes mid-step): they must find its errors, so
        that MXNet skips them and every output of the step raises. Cleared
        under them, they would run, read back without an error, and leave
        errors of their own for the next step.
        """
        step = self._issue_token
        if step == self._cleared_token:
            return
        # Threads calling for each device at once: one clears, and the others
        # wait until it is done. Were they to go on, the clearing thread could
        # wait on a running statistic written by their calls, which wait for
        # its device's call.
        with self._clear_lock:
            if step == self._cleared_token:
                return
            # The aborted step's calls end at once (a stale one is refused by
            # its token), so this waits only for the work queued before
            # them; a static_shape graph's poison the next step's arrays
            # when they run, and must have run before the clearing.
            drain()
            for backend in self.live_backends():
                backend.clear_failed_state()
            if self.cpu_temp_space == '':
                self.native.recycle_cpu_temp_space()  # the drain cleared their errors
            self._cleared_token = step

    def failure_behind(self, exc):
        """What a wait for the whole engine (``waitall``) that raised ``exc``
        raises: where the current step failed, its cause as our exception,
        with ``exc`` as that exception's cause. MXNet raises the first error
        any operation left, which is often what made the step fail (an
        operator on one device, so that device never called a layer) and
        says nothing of the layers that waited for it; else ``exc``."""
        if self.native is None or isinstance(exc, SyncBatchNormError):
            return exc
        failure = self.native.step_failure()
        if not failure:
            return exc
        ours = (SyncBatchNormTimeout if failure.startswith(SyncBatchNormTimeout.__name__ + ':')
                else SyncBatchNormError)(failure)
        ours.__cause__ = exc
        return ours

    def fail_step(self, cause=None, exiting=False, raised=None):
        """The current step failed with ``cause`` (default: ``gluon_syncbn.reset()``
        was called): abort it, so that every call of it fails at once (at
        interpreter exit, every call issued so far).
        ``exiting``: at interpreter exit, which is never fatal to a job.
        ``raised``: the user's exception that abandoned the step in this
        thread (:meth:`raised_elsewhere`)."""
        if cause is None:
            cause = SyncBatchNormError('gluon_syncbn.reset() was called while this call waited.')
        if self.native is not None:
            self._raised = (str(cause), raised, threading.get_ident()) if raised is not None \
                else None
            self.native.abort(cause, exiting)

    def raised_elsewhere(self, exc):
        """The user's exception that abandoned the step in another thread,
        where ``exc`` is a call of that step refused for it; else None."""
        raised = self._raised
        if raised is None or raised[2] == threading.get_ident() or \
                not messages.is_stale_call(exc) or raised[0] not in str(exc):
            return None
        return raised[1]


def _live_threads():
    return {t.ident for t in threading.enumerate()}


def drain():
    """Wait for the engine, swallowing a failed step's error (its cause is
    reported by whoever failed it)."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    try:
        mx.nd.waitall()
    except Exception:  # pylint: disable=broad-except
        pass


SESSION = Session()
# How many calls a dtype record keeps open: far more than one step issues.
OPEN_CALLS = 4096


def reset():
    """Fail the current step's SyncBatchNorm calls now and restart the call numbering.

    Not needed after the errors this library raises (it recovers by itself);
    for code that abandons a step half-way for its own reasons.
    """
    SESSION.fail_step()
    SESSION.restart()
