"""Call-order rendezvous of the devices of one SyncBatchNorm layer.

The k-th training call of a layer on each device belongs with the k-th call on
every other device. :class:`CallOrderBarrier` numbers each device's forward
calls, gathers one contribution per device for each number, reduces them once
with the function the caller passes (the last device to arrive does the work;
for a layer, ``PythonBackend.reduce``: a sum per sync group) and hands the
same result to all.
Backward meetings use the key of the forward call they belong to, so they pair
correctly even when devices run their backward passes in different orders.

Calls carry a *token*: the training step they were issued in (see
:class:`gluon_syncbn.session.Session`). Numbering restarts from zero with
every new token, and a call whose token is no longer current belongs to an
aborted step: it raises at once.

Nothing here knows about MXNet: the barrier is tested with plain threads.

Failure rules (every wait is bounded):

* if ``reduce`` raises, every device of the meeting gets that exception;
* if not all devices arrive within ``timeout`` seconds, the devices that did
  arrive get :class:`SyncBatchNormTimeout` naming the missing ones;
* any of these aborts the step in the session: every other waiting or
  already-issued call of the step fails at once with the same cause.
"""
import threading
import time

from . import messages
from .errors import SyncBatchNormError, SyncBatchNormTimeout, in_layer, record_failure

__all__ = ['CallOrderBarrier']


class _Meeting(object):
    __slots__ = ('token', 'values', 'result', 'error', 'taken')

    def __init__(self, token):
        self.token = token
        self.values = {}
        self.result = None
        self.error = None
        self.taken = 0


class CallOrderBarrier(object):
    """Rendezvous of ``len(devices)`` devices, keyed by call order.

    Parameters
    ----------
    name : str
        Layer name, used in error messages.
    devices : list of str
        Names of the participating devices; ``device`` arguments index this list.
    timeout : float
        Seconds a device waits for the others before giving up.
    session : object
        Shared by all barriers of a process (see
        :class:`gluon_syncbn.session.Session`): ``token()``, ``check(token)``
        (raises for a token that is no longer current), ``abort(error)`` (called
        with this barrier's lock held, before any waiter wakes) and
        ``fail_others(error)`` (called after the lock is released).
    hint : str, optional
        Advice appended to the timeout message.
    """

    def __init__(self, name, devices, timeout, session, hint=''):
        self.name = name
        self.devices = list(devices)
        self.num_devices = len(self.devices)
        self.timeout = float(timeout)
        self.hint = hint
        self.session = session
        self._cond = threading.Condition()
        self._meetings = {}
        self._counter_token = None
        self._next_call = [0] * self.num_devices

    def _current(self, token):
        """The token a call runs under; raises if it belongs to an aborted step."""
        if token is None:
            # Operators created once (static graphs) cannot tell their step.
            return self.session.token()
        self.session.check(token, self.name)
        return token

    def next_forward_key(self, device, token=None):
        """Number the next forward call of ``device``: ``('fwd', token, k)``."""
        with self._cond:
            token = self._current(token)
            if token != self._counter_token:
                self._counter_token = token
                self._next_call = [0] * self.num_devices
            k = self._next_call[device]
            self._next_call[device] = k + 1
            return ('fwd', token, k)

    def meet(self, key, device, value, reduce, token=None):
        """Contribute ``value`` for ``key``; return the reduced result.

        ``reduce(key, values)`` gets ``{device_index: value}`` with one entry
        per device and returns the result handed to every device; it runs once
        per meeting, on the thread of the last device to arrive. ``token`` is
        the step the call was issued in (None: unknown).

        Raises
        ------
        SyncBatchNormError
            The meeting failed: ``reduce`` raised, the call belongs to an
            aborted step, or the timeout passed.
        """
        deadline = time.monotonic() + self.timeout
        failure = None  # set when this thread is the one that fails the step
        with self._cond:
            token = self._current(token)
            ex = self._meetings.get(key)
            if ex is None:
                ex = self._meetings[key] = _Meeting(token)
            if device in ex.values:
                raise SyncBatchNormError(
                    "SyncBatchNorm '%s': device %s called %s twice; this is a bug in "
                    "gluon_syncbn, please report it." % (self.name, self.devices[device], key))
            ex.values[device] = value
            if ex.error is None and len(ex.values) == self.num_devices:
                try:
                    ex.result = reduce(key, ex.values)
                except Exception as exc:  # pylint: disable=broad-except
                    failure = exc
                self._cond.notify_all()
            while failure is None and ex.result is None and ex.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    failure = self._timeout_error(key, ex)
                    break
                self._cond.wait(remaining)
            if failure is not None:
                # Before anyone wakes: nobody may see this error and issue the
                # next step before the step is marked aborted.
                self.session.abort(failure)
                self._fail(failure, lambda e: True)
            ex.taken += 1
            # A failed meeting of the current step stays until every device
            # has passed it, so a device that arrives late fails at once
            # instead of waiting (one of an aborted step goes at once: see _fail).
            if ex.taken == self.num_devices and self._meetings.get(key) is ex:
                del self._meetings[key]
            error, result = ex.error, ex.result
        if failure is not None:
            self.session.fail_others(failure)
        if error is not None:
            error = in_layer(self.name, error)
            record_failure(error)
            raise error
        return result

    def _timeout_error(self, key, ex):
        arrived = sorted(ex.values)
        missing = [self.devices[i] for i in range(self.num_devices) if i not in ex.values]
        return SyncBatchNormTimeout(messages.text(
            'call_timeout', layer=self.name, arrived=len(arrived), devices=self.num_devices,
            present=', '.join(self.devices[i] for i in arrived),
            direction='forward' if key[0] == 'fwd' else 'backward', call=key[-1],
            timeout=messages.number(self.timeout), missing=', '.join(missing), hint=self.hint))

    def _fail(self, error, which):
        """Fail the pending meetings ``which(ex)`` selects, and forget
        those of steps that are no longer current: a call of an aborted step
        fails at its token (``session.check``) before it looks for one, and
        a device that never calls would keep them for ever (lock held)."""
        current = self.session.token()
        for key, ex in list(self._meetings.items()):
            if ex.result is None and ex.error is None and which(ex):
                ex.error = error
            if ex.token != current and (ex.result is not None or ex.error is not None):
                del self._meetings[key]
        self._cond.notify_all()

    def fail_pending(self, error):
        """Fail the waiting meetings of steps that are no longer current."""
        with self._cond:
            current = self.session.token()
            self._fail(error, lambda ex: ex.token != current)
