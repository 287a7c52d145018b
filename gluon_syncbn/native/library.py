"""The seam between Python and the native library: every ctypes entry point
of ``syncbn.cc``, declared and called here and nowhere else.

A layer's state in the native session is an integer handle (the operators' ``layer``
argument); a transport is an integer id. The operators' failures reach
Python through MXNet, as the errors of the operations they complete.
"""
import ctypes

__all__ = ['Library']

_TEXT = 1 << 16  # room for one message


class Library(object):
    """The loaded native library.

    Parameters
    ----------
    path : str
        The built library.
    testing : bool
        It was built with the tests' entry points (``GSBN_TESTING``; the
        tests declare them: ``tests/native_testing.py``).
    """

    def __init__(self, path, testing=False):
        self.path = path
        self.testing = testing
        self._lib = lib = ctypes.CDLL(path)
        c = ctypes
        for name, argtypes, restype in [
                ('gsbn_init', [c.c_char_p], None),
                ('gsbn_register', [c.c_char_p], c.c_int),
                ('gsbn_layer_create', [c.c_char_p, c.c_char_p, c.c_int, c.c_double, c.c_double,
                                       c.c_char_p, c.POINTER(c.c_int),
                                       c.c_int, c.c_int, c.POINTER(c.c_double), c.c_int],
                 c.c_int64),
                ('gsbn_layer_remove', [c.c_int64], None),
                ('gsbn_stamp_static', [c.POINTER(c.c_int64), c.POINTER(c.c_int), c.c_int],
                 c.c_int),
                ('gsbn_settle', [c.c_int64], None),
                ('gsbn_fence', [c.POINTER(c.c_int64), c.POINTER(c.c_int), c.c_int,
                                c.POINTER(c.c_void_p), c.c_int], c.c_int),
                ('gsbn_watch_slice', [c.c_void_p, c.c_char_p], c.c_int),
                ('gsbn_separate_cpu_temp_space', [c.c_int, c.c_char_p, c.c_int], c.c_int),
                ('gsbn_cpu_temp_slots', [c.c_int], c.c_int),
                ('gsbn_cpu_temp_space_after_abort', [c.c_int], None),
                ('gsbn_tally', [c.c_int64, c.c_int], None),
                ('gsbn_tally_read', [c.c_int64, c.c_int, c.POINTER(c.c_double),
                                     c.POINTER(c.c_double), c.POINTER(c.c_double), c.c_int],
                 c.c_int),
                ('gsbn_step', [c.c_int], c.c_uint64),
                ('gsbn_reading', [c.c_char_p, c.c_int], None),
                ('gsbn_abort', [c.c_char_p, c.c_int], None),
                ('gsbn_broken', [c.c_char_p, c.c_int], c.c_int),
                ('gsbn_step_failure', [c.c_char_p, c.c_int], c.c_int),
                ('gsbn_transport_create', [c.c_char_p, c.c_void_p, c.c_int, c.c_int, c.c_int,
                                           c.c_char_p, c.c_double], c.c_int),
                ('gsbn_transport_close', [c.c_int, c.c_char_p], None),
                ('gsbn_store_lock', [c.c_int, c.c_int], None),
                ('gsbn_compare_layer', [c.c_int, c.c_char_p, c.c_char_p, c.c_int, c.c_char_p,
                                        c.c_double,
                                        c.c_char_p, c.c_int], c.c_int),
                ('gsbn_end', [c.c_int, c.c_int, c.c_double, c.c_char_p, c.c_int], c.c_int),
                ('gsbn_agree_on_batch', [c.c_int, c.c_int, c.c_int, c.c_double,
                                         c.POINTER(c.c_int), c.POINTER(c.c_int), c.c_char_p,
                                         c.c_int], c.c_int)]:
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, restype

    def init(self, templates):
        """Hand over the message templates (``{name: text}``) and make room in
        MXNet's list of engine errors (``failures.h``); once, at load."""
        blob = b''.join(name.encode() + b'\0' + text.encode('utf-8') + b'\0'
                        for name, text in templates.items())
        self._lib.gsbn_init(blob + b'\0')

    def register(self, op):
        """Register operator ``'async'`` or ``'exchange'`` in MXNet; True on success."""
        return self._lib.gsbn_register(op.encode()) == 0

    def create_layer(self, name, devices, timeout, remote_timeout, hint,
                     sync_group_of, num_sync_groups, transport=0, owners=()):
        """A layer's state on ``devices`` in the native session; returns its handle."""
        c = ctypes
        return self._lib.gsbn_layer_create(
            name.encode(), b'\0'.join(d.encode() for d in devices), len(devices),
            float(timeout), float(remote_timeout),
            hint.encode(),
            (c.c_int * len(devices))(*sync_group_of), num_sync_groups, transport or 0,
            (c.c_double * len(owners))(*owners), len(owners))

    def compare_layer(self, transport, name, matched, devices, sync_groups, timeout):
        """'' where every worker's layer made in this one's place (``name``,
        compared as ``matched``) has the same sync groups, else why not
        (fatal to the process)."""
        return self._text(lambda buf: self._lib.gsbn_compare_layer(
            transport, name.encode(), matched.encode(), devices, sync_groups.encode(),
            float(timeout), buf, len(buf)))

    def agree_on_batch(self, transport, batch, has, timeout, workers):
        """``(why not, the workers without update_bn_stats' batch ``batch``)``:
        ``('', [...])`` once every worker said whether it has it."""
        c = ctypes
        lacking, num = (c.c_int * workers)(), c.c_int(0)
        why = self._text(lambda buf: self._lib.gsbn_agree_on_batch(
            transport, batch, int(has), float(timeout), lacking, c.byref(num), buf, len(buf)))
        return why, list(lacking[:num.value])

    @staticmethod
    def _text(call):
        """'' where ``call(buffer)`` returns 0, else the text it wrote."""
        buf = ctypes.create_string_buffer(_TEXT)
        return '' if call(buf) == 0 else buf.value.decode('utf-8', 'replace')

    def remove_layer(self, layer):
        self._lib.gsbn_layer_remove(layer)

    def stamp_static(self, layers, devices):
        """A static graph with calls of ``layers`` (handles) on ``devices``
        (their indices) is being issued: stamp its step on them. True on success."""
        c = ctypes
        return self._lib.gsbn_stamp_static((c.c_int64 * len(layers))(*layers),
                                           (c.c_int * len(devices))(*devices), len(layers)) == 0

    def fence(self, layers, devices, arrays):
        """Order reads of ``arrays`` (NDArrays) issued from now on after the
        calls of ``layers`` (handles) on ``devices`` (their indices) issued so
        far. True on success."""
        c = ctypes
        return self._lib.gsbn_fence((c.c_int64 * len(layers))(*layers),
                                    (c.c_int * len(devices))(*devices), len(layers),
                                    (c.c_void_p * len(arrays))(*[a.handle for a in arrays]),
                                    len(arrays)) == 0

    def watch_slice(self, array, why):
        """``array``, an empty slice, is issued to a layer: if it turns out
        not computed (an earlier operator on its device failed), the step is
        aborted with ``why``. True on success."""
        return self._lib.gsbn_watch_slice(array.handle, why.encode()) == 0

    def settle(self, layer):
        """Wait for ``layer``'s calls issued so far and clear the error a failed
        one left on their arrays."""
        self._lib.gsbn_settle(layer)

    def separate_cpu_temp_space(self, slots):
        """Give the calling thread's MXNet resource manager a temp-space pool
        of ``slots`` slots per CPU context (``cpu_resources.h``); '' on
        success, else why not (nothing changed)."""
        why = ctypes.create_string_buffer(1024)
        if self._lib.gsbn_separate_cpu_temp_space(int(slots), why, len(why)) == 0:
            return ''
        return why.value.decode('utf-8', 'replace')

    def retire_cpu_temp_space(self):
        """After an abort, before the next step's operations: every CPU
        context hands out fresh temp-space slots (a failed step's operations
        leave their errors on theirs)."""
        self._lib.gsbn_cpu_temp_space_after_abort(0)

    def recycle_cpu_temp_space(self):
        """Once the engine was drained after an abort: the retired slots,
        clean now, are kept for the next abort."""
        self._lib.gsbn_cpu_temp_space_after_abort(1)

    def cpu_temp_slots(self, dev_id):
        """How many temp-space slots CPU context ``dev_id`` has of its own (0: none yet)."""
        return self._lib.gsbn_cpu_temp_slots(int(dev_id))

    def tally(self, layer, on):
        """Start (``on``: every device's tally emptied) or stop ``layer``'s tally."""
        self._lib.gsbn_tally(layer, int(on))

    def read_tally(self, layer, device, channels):
        """Device ``device``'s tally of ``layer``: ``(calls, n, mean_sum, var_sum)``
        (the sums as lists of ``channels`` floats), or None if no call was tallied."""
        c = ctypes
        counts, mean_sum, var_sum = (c.c_double * 2)(), (c.c_double * channels)(), \
            (c.c_double * channels)()
        size = self._lib.gsbn_tally_read(layer, device, counts, mean_sum, var_sum, channels)
        if size <= 0:
            return None
        if size != channels:
            raise ValueError('the tally has %d channels, not %d' % (size, channels))
        return counts[0], counts[1], list(mean_sum), list(var_sum)

    def reading(self, read, sole=False):
        """This thread now waits in ``read`` (a description), or no longer
        (None); ``sole``: it is the only thread in the step."""
        self._lib.gsbn_reading(read.encode() if read else None, int(sole))

    def token(self, begin=False):
        """The current step's token; ``begin``: a step begins first."""
        return self._lib.gsbn_step(int(begin))

    def abort(self, cause, exiting):
        self._lib.gsbn_abort(str(cause).encode('utf-8', 'replace'), int(exiting))

    def step_failure(self):
        """Why the current step failed (``'SyncBatchNormTimeout: ...'``, as the
        operators fail), or '' while it has not."""
        text = ctypes.create_string_buffer(_TEXT)
        self._lib.gsbn_step_failure(text, len(text))
        return text.value.decode('utf-8', 'replace')

    def broken(self):
        """Why cross-process synchronization broke, or ''."""
        text = ctypes.create_string_buffer(_TEXT)
        self._lib.gsbn_broken(text, len(text))
        return text.value.decode('utf-8', 'replace')

    def create_transport(self, kind, target=None, sum_op=0, rank=0, workers=1, name='',
                         exit_grace=30.0):
        """A cross-process transport; returns its id (0: unknown ``kind``)."""
        return self._lib.gsbn_transport_create(kind.encode(), target, sum_op, rank, workers,
                                               name.encode(), exit_grace)

    def end(self, transport, failed, timeout):
        """This worker ends (its script finished, or ``failed``): tell the
        other workers through ``transport`` and wait at most ``timeout``
        seconds for theirs. '' where every other worker ended its script too,
        None where they did not in time, else what they did instead."""
        buf = ctypes.create_string_buffer(_TEXT)
        code = self._lib.gsbn_end(transport, int(failed), float(timeout), buf, len(buf))
        return None if code < 0 else buf.value.decode('utf-8', 'replace') if code else ''

    def close_transport(self, transport, why):
        self._lib.gsbn_transport_close(transport, why.encode())

    def store_lock(self, transport, acquire):
        self._lib.gsbn_store_lock(transport, int(acquire))
