"""The wording of every failure the native library reports, and of those
Python reports too, in one place.

A template's fields are ``{name}``; values arrive formatted (numbers as
C's ``%g``, lists joined with ', '). Python fills them in with :func:`text`; the
native library gets the templates when it loads (``Library.init``) and fills
them in the same way (``native/messages.h``), so a message reads the same
whichever backend raised it.
"""

__all__ = ['text', 'is_stale_call']

TEMPLATES = {
    # A call's input.
    'bad_ndim':
        "SyncBatchNorm '{layer}' expects input of 2 to 5 dimensions, got {ndim}. Reshape it, "
        "e.g. to (N, C, L).",
    'bad_axis':
        "SyncBatchNorm '{layer}': axis={axis} is out of range for input of {ndim} dimensions.",
    'wrong_channels':
        "SyncBatchNorm '{layer}': input has {channels} channels on axis {axis} but the layer "
        "has in_channels={expected}. Feed {expected} channels or build the layer with "
        "in_channels={channels}.",
    'float16_statistics':
        "SyncBatchNorm '{layer}' got float16 statistics inside a hybridized graph: call "
        "net.cast('float16') so the layer knows to compute its statistics in float32.",
    # A layer's devices, in one process.
    'wrong_device':
        "SyncBatchNorm '{layer}' was called on {device}, but its parameters live on {devices}. "
        "Initialize the network on every context you feed.",
    'unknown_layer':
        "SyncBatchNorm layer handle '{layer}' is unknown: the layer was deleted or its graph "
        "was loaded into another process. Use revert_model() before export.",
    'dtypes_disagree':
        "SyncBatchNorm {layers}: devices disagree on the input dtype: {dtypes}. Cast every "
        "slice to the same dtype.",
    'channels_disagree':
        "SyncBatchNorm '{layer}': devices disagree on the channel count: {channels}. Every "
        "device must feed the same number of channels.",
    'empty_batch':
        "SyncBatchNorm '{layer}': every device's slice of this batch is empty{where}; there is "
        "nothing to normalize. Skip empty batches.",
    'empty_slice_refused':
        "SyncBatchNorm '{layer}': the empty slice on {device} (shape {shape}) never reached "
        "it: an earlier operator on {device} failed on it (MXNet's convolutions and dense "
        "layers refuse size-0 arrays; that device's outputs carry their error). Feed every "
        "device at least one sample: a DataLoader with last_batch='discard' (or 'rollover'), "
        "or batches the number of devices divides (split_and_load(..., even_split=True)).",
    'in_sync_group': " in sync group {group}",
    'call_timeout':
        "SyncBatchNorm '{layer}': only {arrived} of {devices} devices ({present}) reached "
        "{direction} call #{call} within {timeout}s; missing: {missing}. {hint}",
    'early_read':
        "The thread that issues {device}'s calls waits in {read}, since before {device}'s call "
        "was issued: a read of an output inside the per-device loop (a metric, a loss's "
        "asnumpy()) waits for this layer on every device, so it cannot return before every "
        "device has called the layer. Read outputs once every device has called the network.",
    'stale_call':
        "SyncBatchNorm '{layer}': this call belongs to a step that failed earlier: {cause}",
    'no_higher_order':
        "SyncBatchNorm '{layer}' does not support higher-order gradients "
        "(autograd.grad(..., create_graph=True)), as nn.BatchNorm does not: its backward "
        "has no gradient of its own.",
    'inference_backward':
        "SyncBatchNorm '{layer}': backward through a call made in inference mode; record the "
        "forward pass under autograd.record() (train_mode=True).",
    # Across processes (the remote phase): a layer's reduction is named
    # "the fwd reduction of layer 'x' (slot 3)".
    'no_slot':
        "SyncBatchNorm '{layer}' has no slot in {transport}: its first call was not issued "
        "from the main thread; this is a bug in gluon_syncbn, please report it.",
    'reduction_failed':
        "SyncBatchNorm: the {direction} reduction of layer '{layer}' (slot {slot}) failed in "
        "{transport}: {why}. Another worker probably died; see its log.",
    'sums_changed':
        "SyncBatchNorm: {transport} changed the sums of the {direction} reduction of layer "
        "'{layer}' (slot {slot}): it applies an optimizer to every key. Create the Trainer "
        "with update_on_kvstore=False.",
    'out_of_step':
        "SyncBatchNorm '{layer}': the workers are out of step at its {direction} reduction "
        "#{call} (slot {slot}): {workers}. Every worker must run the same network and call it "
        "the same number of times per step.",
    'step_abandoned':
        "SyncBatchNorm '{layer}': a training step was abandoned on some workers only (an "
        "exception left their autograd.record() scope, or their DataLoader failed to give a "
        "batch), found at its {direction} reduction (slot {slot}): {workers}. A batch one worker skips would pair each of its later "
        "steps with another worker's next one: skip a batch on every worker alike, or on "
        "none.",
    'worker_ended':
        "SyncBatchNorm: worker {worker} ended its script{after} while worker {rank} {where}: "
        "the workers ran different numbers of training steps. Give every worker the same "
        "number of batches: shards of equal size, and a DataLoader with "
        "last_batch='discard' (or 'rollover').",
    'worker_failed':
        "SyncBatchNorm: worker {worker} failed while worker {rank} {where}; see worker "
        "{worker}'s log.",
    'layers_differ':
        "SyncBatchNorm '{layer}': the workers' networks differ at their layer #{number} to "
        "synchronize across workers: {workers}. Layers are matched across workers by the "
        "order of their first training calls: every worker must run the same network, built "
        "the same way (the same channels, dtype and sync_groups, over as many devices where "
        "they are explicit, and the same names where you gave them: Gluon's automatic "
        "numbering is not compared).",
    'setup_timeout':
        "SyncBatchNorm: worker {rank} of {workers} waited {timeout}s for the other workers to "
        "{what} ({transport}). A worker died, hangs, runs a network with fewer SyncBatchNorm "
        "layers, or is still on its way there (loading data, a long first step): raise "
        "timeout= (or GLUON_SYNCBN_TIMEOUT) if it is just slow; see the other workers' logs.",
    'setup_out_of_step':
        "SyncBatchNorm: the workers are out of step where this one was to {what}: {workers}. "
        "Every worker must run the same network, call it the same number of times per step, "
        "and give update_bn_stats the same batches.",
    'compression':
        "SyncBatchNorm cannot synchronize through {transport}: it has gradient compression "
        "(set_gradient_compression, or a Trainer's compression_params), which MXNet applies "
        "to every key of the store and which refuses pushpull. Use a kvstore without "
        "compression for SyncBatchNorm and its Trainer, or Horovod, whose "
        "hvd.DistributedTrainer(compression=...) compresses gradients only (docs/install.md, "
        "section 'Across processes')",
    'numbering_disagrees':
        "SyncBatchNorm '{layer}': the workers disagree on the global device numbering of "
        "sync_groups (devices owned by no worker or by several: [{devices}]). Every worker "
        "must use the same number of devices.",
    'remote_timeout':
        "SyncBatchNorm: worker {rank} of {workers} waited {timeout}s for the other workers at "
        "the {direction} reduction #{call} of layer '{layer}' (slot {slot}) ({transport})."
        "{helpers} A worker (or a server of the job's kvstore) died, hangs, pauses (an "
        "evaluation on one worker only), or runs a different number of training calls; see "
        "the other workers' logs. Raise timeout= (or GLUON_SYNCBN_TIMEOUT) if a worker is just "
        "slow.",
    'broken':
        "SyncBatchNorm: cross-process synchronization was lost earlier and cannot resume "
        "(pending {transport} reductions cannot be cancelled): {cause}",
    'worker_step_failed': "a SyncBatchNorm step failed on worker {rank}: {cause}",
    # How a worker says it ends after a fatal failure (printed, not raised).
    'exit_after':
        "gluon_syncbn: worker {rank} exits after a failed cross-process reduction: {cause}",
    'exit_failed':
        "gluon_syncbn: worker {rank} ends now with exit code {code} ({cause}): the other "
        "workers cannot go on without it.",
    'exit_helpers_gone':
        "gluon_syncbn: worker {rank} ends now with exit code 1: {why}, so the job cannot "
        "finish (ps-lite's barriers, the kvstore's final one at exit among them, meet there).",
    'exit_others':
        "gluon_syncbn: worker {rank} finished its script, but the job cannot end cleanly: "
        "{why}. It exits now with code 0, without waiting in the engine's final "
        "synchronization for workers that will not come; see their logs.",
    'exit_late':
        "gluon_syncbn: worker {rank} did not exit within {grace}s of a failed cross-process "
        "reduction: {cause}",
}


def is_stale_call(exc):
    """Whether ``exc`` is a call refused for belonging to a failed step (``stale_call``)."""
    return TEMPLATES['stale_call'].split('{cause}')[0].split("': ", 1)[1] in str(exc)


def text(name, **fields):
    """The message ``name`` with ``fields`` filled in."""
    return TEMPLATES[name].format(**fields)
