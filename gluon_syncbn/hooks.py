"""Where gluon_syncbn hooks into MXNet; each hook is narrow and idempotent.

* Entering the outermost ``autograd.record()`` (or ``train_mode()``) scope
  begins a training step: calls issued after a failure but before that belong
  to the failed step (see ``session.Session``).
* In a worker of a multi-process job, a batch a DataLoader fails to give
  abandons the step too (a script that catches that skips the batch).
* An exception that leaves ``autograd.record()`` means the step was abandoned
  half-way (say device 2's forward raised in user code): the SyncBatchNorm calls
  already issued for devices 0 and 1 would wait for partners that never come, so
  we abort the step and they fail at once instead of at the timeout.
* A hybridized block's call (a SymbolBlock's too) runs the graph of its mode
  as ``graphs`` binds it, after clearing the errors an aborted step left on
  the layers' arrays (the block does it in imperative mode); ``export()``
  writes the traced graph without marks; a CachedOp or a Module made from a
  synchronizing graph outside a block's call is refused (``graphs``): it
  would normalize each device's slice alone, silently.
* Until the process has made a layer (``SyncBatchNorm.made_any``) no graph
  holds one and nothing synchronizes: the hooks take MXNet's own path at
  once, testing the flag when they run (a ``record()`` scope entered before
  the first layer is watched when it is left), but for the step hooks' note
  of which threads record or train (``Session.thread_in_step``), kept from
  the start: a thread inside ``record()`` when another makes the first layer
  could tell it no later, and a thread starting then joins that step only
  if one is known to be inside.
* A backward error names our layer only where it is the cause
  (``backward_errors``).
* A network's first training call that synchronizes is checked for
  batch-norm layers left per device (``graphs.check_network``), which
  ``install`` hands the layer for its imperative calls
  (``block.use_network_check``).
* A Trainer's first step broadcasts every parameter from device 0, running
  statistics included. In static_shape graphs our operators update those
  inside their calls, which such graphs hold as read-only inputs, so the
  engine does not order the broadcast after them: some devices' updates can
  land before it and some after, and replicas then differ (seen in 1 of 3
  runs of the static test nets). Before that first broadcast we wait for the
  engine, once, if any layer has synchronized.
* At interpreter exit MXNet's own ``atexit`` handler waits for the engine, and
  a SyncBatchNorm call waiting for a partner that never comes would hold it
  until the layer's timeout. Ours, registered after MXNet's so it runs first,
  drains the engine for a bounded time and then aborts the step.

A worker's exit (``sys.exit``, ``SystemExit``, ``sys.excepthook``) and its
kvstore's methods are patched by ``transport.py``, where they act.
"""
import atexit
import threading

import mxnet as mx

from . import graphs, messages, transport
from .backward_errors import as_ours
from .block import SyncBatchNorm, use_network_check
from .errors import SyncBatchNormError, ours_behind
from .session import SESSION

__all__ = ['install']


def install_record_abort_hook(scope_class, session):
    """An exception that leaves a ``record()`` (or ``train_mode()``) scope
    aborts the step: with it as the cause where it is ours, else saying so.
    Not a call refused for belonging to a step that failed already (whose
    text would nest that step's cause in another)."""
    if getattr(scope_class, '_gluon_syncbn_hooked', False):
        return
    original_exit = scope_class.__exit__

    def __exit__(self, ptype, value, trace):
        if ptype is not None and session.active() and not messages.is_stale_call(value):
            session.fail_step(value if isinstance(value, SyncBatchNormError) else
                              SyncBatchNormError('the training step was abandoned (in thread '
                                                 '%r): %s: %s' % (threading.current_thread().name,
                                                                  ptype.__name__, value)),
                              raised=value)
        return original_exit(self, ptype, value, trace)

    scope_class.__exit__ = __exit__
    scope_class._gluon_syncbn_hooked = True


def install_data_loader_hook(loader_class, session, across_processes):
    """In a worker of a multi-process job (``across_processes()``), a batch
    a DataLoader fails to give (its iterator raised: a script that catches
    that skips the batch) abandons the step, as an exception leaving
    ``record()`` does: a batch one worker alone skips so ends the job at
    its next synchronized call, naming it, instead of pairing each of its
    later steps with the others' next one; one every worker skips alike
    costs nothing."""
    if getattr(loader_class.__iter__, '_gluon_syncbn_hooked', False):
        return
    original = loader_class.__iter__

    def __iter__(self):
        batches = original(self)
        if not SyncBatchNorm.made_any:
            return batches
        return _WatchedBatches(batches, session) if across_processes() else batches

    __iter__._gluon_syncbn_hooked = True
    loader_class.__iter__ = __iter__


class _WatchedBatches(object):
    """A DataLoader's iterator whose failures abandon the step (see
    :func:`install_data_loader_hook`); usable again after one, as the
    iterator it wraps."""

    def __init__(self, batches, session):
        self._batches = batches
        self._session = session

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._batches)
        except StopIteration:
            raise
        except Exception as exc:
            self._session.fail_step(SyncBatchNormError(
                'a batch failed to load (in thread %r): %s: %s' % (
                    threading.current_thread().name, type(exc).__name__, exc)), raised=exc)
            raise

    def __getattr__(self, name):
        return getattr(self._batches, name)

    def __len__(self):
        return len(self._batches)


def install_step_hooks(autograd_module, session):
    """Steps begin where threads start recording or training
    (``Session.thread_in_step``), whether through ``record()`` and
    ``train_mode()`` scopes (which call these functions) or through
    ``autograd.set_recording`` / ``set_training`` themselves."""
    if getattr(autograd_module.set_recording, '_gluon_syncbn_hooked', False):
        return
    set_recording, set_training = autograd_module.set_recording, autograd_module.set_training
    is_recording, is_training = autograd_module.is_recording, autograd_module.is_training

    def set_recording_hooked(is_record):
        previous = set_recording(is_record)
        training = is_training()
        if not training and bool(previous) != bool(is_record):
            session.thread_in_step(bool(is_record))
        return previous

    def set_training_hooked(train_mode):
        previous = set_training(train_mode)
        recording = is_recording()
        if not recording and bool(previous) != bool(train_mode):
            session.thread_in_step(bool(train_mode))
        return previous

    for name, function, original in (('set_recording', set_recording_hooked, set_recording),
                                     ('set_training', set_training_hooked, set_training)):
        function.__doc__ = original.__doc__
        function._gluon_syncbn_hooked = True
        setattr(autograd_module, name, function)


# Read at exit, so that a test can shorten it.
EXIT_DRAIN_SECONDS = 10.0


def install_exit_abort_hook(session, waitall):
    """At interpreter exit, drain the engine; fail the calls still waiting after a while.

    A script that ends right after issuing its last step (no ``waitall``) still
    has that step's calls in flight: they get ``EXIT_DRAIN_SECONDS`` to finish,
    so a healthy step is never failed.
    Calls waiting for a partner that never comes are failed after that, and
    the drain then ends.
    """
    def abort_at_exit():
        if not session.active():
            return
        drained = threading.Event()

        def drain():
            try:
                waitall()
            except Exception:  # pylint: disable=broad-except
                pass  # a failed step's error; the program is ending anyway
            drained.set()
        threading.Thread(target=drain, name='gluon_syncbn-exit-drain', daemon=True).start()
        if not drained.wait(EXIT_DRAIN_SECONDS):
            session.fail_step(SyncBatchNormError('the Python interpreter is exiting'),
                              exiting=True)
            drained.wait()
    atexit.register(abort_at_exit)


def install_cached_op_hook(hybrid_block_class, session, is_training):
    """Before a cached graph runs: the block's graphs bound and the one of
    the call's mode in place, the call prepared (``graphs.run_cached_op``);
    a layer's refusal while the graph was bound or issued raised as ours."""
    if getattr(hybrid_block_class, '_gluon_syncbn_cached_op_hooked', False):
        return
    original = hybrid_block_class._call_cached_op

    def _call_cached_op(self, *args):
        if not SyncBatchNorm.made_any:  # no graph can hold a layer
            return original(self, *args)
        try:
            return graphs.run_cached_op(self, args, original, bool(is_training()), session)
        except (mx.base.MXNetError, ValueError) as exc:
            # A layer's refusal, while the graph was bound or issued (its
            # shape or type inference): the devices issued before fail now.
            ours = exc if isinstance(exc, SyncBatchNormError) else ours_behind(exc)
            if ours is None:
                raise
            session.fail_step(ours)
            if ours is exc:
                raise
            raise ours from exc

    hybrid_block_class._call_cached_op = _call_cached_op
    hybrid_block_class._gluon_syncbn_cached_op_hooked = True


def install_export_hook(hybrid_block_class):
    """``export()`` writes a block's traced graph without its marks
    (``graphs.without_marks``): ``nn.BatchNorm``'s graph, whatever the last
    call's mode, which plain MXNet loads."""
    if getattr(hybrid_block_class.export, '_gluon_syncbn_hooked', False):
        return
    original = hybrid_block_class.export

    def export(self, path, epoch=0, remove_amp_cast=True):
        if not SyncBatchNorm.made_any:
            return original(self, path, epoch, remove_amp_cast)
        with graphs.without_marks(self):
            return original(self, path, epoch, remove_amp_cast)

    export.__doc__ = original.__doc__
    export._gluon_syncbn_hooked = True
    hybrid_block_class.export = export


def install_unbound_graph_hooks(cached_op_class, executor_group_class):
    """A CachedOp that no block's call builds (``mx.nd.CachedOp``,
    ``optimize_for``) from a graph whose layers synchronize, and a Module on
    several contexts running marked layers, are refused at once
    (``graphs.check_cached_op``, ``graphs.check_module``): both would run
    each layer as a BatchNorm of each device's slice."""
    if getattr(cached_op_class, '_gluon_syncbn_hooked', False):
        return
    cached_op_init = cached_op_class.__init__
    group_init = executor_group_class.__init__

    def __init__(self, sym, *args, **kwargs):
        try:
            graphs.check_cached_op(sym)
        except SyncBatchNormError:
            self.handle = None  # what __del__ frees: nothing (MXNet deletes a null handle)
            raise
        cached_op_init(self, sym, *args, **kwargs)

    def group__init__(self, symbol, contexts, *args, **kwargs):
        graphs.check_module(symbol, contexts)
        group_init(self, symbol, contexts, *args, **kwargs)

    cached_op_class.__init__ = __init__
    executor_group_class.__init__ = group__init__
    cached_op_class._gluon_syncbn_hooked = True


def install_grad_hooks(autograd_module, ndarray_class, session):
    """A higher-order gradient through a SyncBatchNorm layer
    (``autograd.grad(..., create_graph=True)``, then a backward through the
    gradient) raises our error naming the layer, as MXNet names
    nn.BatchNorm's backward: from ``autograd.grad``, ``autograd.backward`` or
    ``NDArray.backward``. The native operators' backward refuses a gradient
    of its own with the layer's name (``no_higher_order``)."""
    if getattr(autograd_module.grad, '_gluon_syncbn_hooked', False):
        return

    def translated(function, heads_of):
        def call(*args, **kwargs):
            if not SyncBatchNorm.made_any:
                return function(*args, **kwargs)
            session.separate_this_thread()
            try:
                return function(*args, **kwargs)
            except mx.base.MXNetError as exc:
                ours = as_ours(exc, heads_of(*args, **kwargs), session)
                if ours is None:
                    raise
                raise ours from exc
        call.__doc__ = function.__doc__
        call._gluon_syncbn_hooked = True
        return call

    autograd_module.grad = translated(autograd_module.grad, lambda heads, *a, **k: heads)
    autograd_module.backward = translated(autograd_module.backward,
                                          lambda heads, *a, **k: heads)
    ndarray_class.backward = translated(ndarray_class.backward, lambda self, *a, **k: self)


def install_trainer_hook(trainer_class, session, waitall):
    """Drain the engine before a Trainer's first broadcast of its parameters
    (see the module docstring), when any SyncBatchNorm layer has synchronized."""
    if getattr(trainer_class, '_gluon_syncbn_trainer_hooked', False):
        return
    original = trainer_class._init_params

    def _init_params(self):
        if SyncBatchNorm.made_any and session.active() and self._params_to_init:
            try:
                waitall()  # running statistics written by pending engine operations
            except Exception as exc:  # pylint: disable=broad-except
                raise session.failure_behind(exc)
        return original(self)

    trainer_class._init_params = _init_params
    trainer_class._gluon_syncbn_trainer_hooked = True


def install_read_hooks(ndarray_class, namespaces, session):
    """While a thread waits for an output (``NDArray.asnumpy``,
    ``wait_to_read``, ``waitall``), the native session knows it: a layer
    whose device's calls this thread issues, and that times out waiting for
    one, then says that the read came before that device's call
    (``early_read``). Nothing is noted until a layer has synchronized."""
    if getattr(ndarray_class.asnumpy, '_gluon_syncbn_hooked', False):
        return

    def noted(function, describe, whole_engine=False):
        def read(*args, **kwargs):
            if not SyncBatchNorm.made_any or not session.active():
                return function(*args, **kwargs)
            session.native.reading(describe(*args), session.sole_thread())
            try:
                return function(*args, **kwargs)
            except Exception as exc:  # pylint: disable=broad-except
                # A call that failed with its step: in a thread of the step
                # that did not fail it, the exception that did (GluonCV's
                # parallel_apply raises the first device's thread's).
                raised = session.raised_elsewhere(exc)
                if raised is not None:
                    raise raised from None
                if not whole_engine:
                    raise  # the array's own error
                raise session.failure_behind(exc)
            finally:
                session.native.reading(None)
        read.__doc__ = function.__doc__
        read._gluon_syncbn_hooked = True
        return read

    for name in ('asnumpy', 'wait_to_read'):
        setattr(ndarray_class, name, noted(
            getattr(ndarray_class, name),
            lambda self, *a, name=name: 'NDArray.%s() of an array on %s' % (name, self.context)))
    # waitall raises the first error of any operation: where a step failed,
    # its cause (Session.failure_behind).
    waitall = noted(namespaces[0].waitall, lambda *a: 'mx.nd.waitall()', whole_engine=True)
    for namespace in namespaces:
        namespace.waitall = waitall


def install():
    """Install every hook (idempotent; the package's ``__init__`` does, at
    import); each takes MXNet's path until a layer is made (the step hooks
    note the threads in a step from the start: see the module docstring)."""
    install_record_abort_hook(mx.autograd._RecordingStateScope, SESSION)
    install_step_hooks(mx.autograd, SESSION)
    install_data_loader_hook(mx.gluon.data.DataLoader, SESSION, transport.across_processes)
    install_exit_abort_hook(SESSION, mx.nd.waitall)
    install_cached_op_hook(mx.gluon.HybridBlock, SESSION, mx.autograd.is_training)
    install_export_hook(mx.gluon.HybridBlock)
    install_unbound_graph_hooks(mx.nd.CachedOp, mx.module.executor_group.DataParallelExecutorGroup)
    install_grad_hooks(mx.autograd, mx.nd.NDArray, SESSION)
    install_trainer_hook(mx.gluon.Trainer, SESSION, mx.nd.waitall)
    install_read_hooks(mx.nd.NDArray, (mx.nd, mx.nd.ndarray), SESSION)
    use_network_check(graphs.check_network)
