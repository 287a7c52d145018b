// The native SyncBatchNorm operators: two operators of MXNet's own kind
// (registered in its C++ registry through mxnet_abi.h), one session and
// meeting. Neither is a custom operator and no thread ever waits in them:
//   async_op.h    CPU contexts: the whole layer call; it runs on the device's
//                 engine worker, returns at once and completes when the
//                 devices have met;
//   exchange_op.h GPUs: MXNet's operators compute the local moments on the
//                 device; this operator (cpu and gpu) exchanges the
//                 per-channel vectors, one batch of copies each way
//                 (device_copies.h, the only reliance on CUDA's runtime);
//   transport.h   across processes: a process's sums through the kvstore or
//                 Horovod as engine operations on one buffer per key;
//   session.h     the step token, the meeting of the devices' k-th calls
//                 (continuations, whose deadlines a watchdog thread keeps),
//                 recovery: every failure (a timeout, devices that disagree,
//                 a call of an aborted step) aborts the step; the token
//                 advances and every waiting meeting fails at once with the
//                 cause. Python's Session calls gsbn_abort for failures it
//                 sees first. One token, one path.
//   sync_call.h   the protocol of both operators' calls (SyncCall): state,
//                 numbering, checks, exchange, continuation, completion;
//   stats.h       the maths in float64: tests/stats.py's functions
//                 (same names) and the asynchronous operator's loops;
//   wire.h        the exchanged vectors' layouts, named once, and how they
//                 cross processes exactly.
//   messages.h    the wording of failures both languages report
//                 (gluon_syncbn/messages.py's templates).
//   arrays.h      reading and writing host arrays as the dtypes they have.
//   params.h      the operators' string arguments.
//   failures.h    how failed operations complete (MXNet's unlocked error list).
//   cpu_resources.h temp space of its own for each CPU context (MXNet's
//                 resource manager shares one pool among them).
//   mxnet_abi.h   every reliance on libmxnet's C++ ABI.
//
// Reliance on MXNet 1.9.1 behaviour is listed with the Python side's in
// gluon_syncbn/mxnet_private.py; an asynchronous operator's completion may be
// called from any thread.
#include "mxnet_abi.h"  // first: its #define must precede every MXNet header

#include <mxnet/c_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "async_op.h"
#include "cpu_resources.h"
#include "exchange_op.h"

// ----------------------------------------------------- interface to Python --
// Loaded with ctypes by gluon_syncbn/native/library.py, the only caller:
// every entry point is declared there. Strings are UTF-8.

namespace {

int copy_out(const std::string& text, char* buf, int size) {
  if (size > 0) std::snprintf(buf, size, "%s", text.c_str());
  return static_cast<int>(text.size());
}

}  // namespace

extern "C" {

// The wording of every message (NUL-separated name and template pairs,
// ended by an empty name; gluon_syncbn/messages.py), and room in MXNet's
// list of engine errors (see reserve_engine_errors). Once, at load.
void gsbn_init(const char* templates) {
  for (const char* p = templates; *p; p += std::strlen(p) + 1) {
    const char* text = p + std::strlen(p) + 1;
    message_templates()[p] = text;
    p = text;
  }
  reserve_engine_errors(kReservedEngineErrors);
}

// Registers operator "async" (_gluon_syncbn_async) or "exchange"
// (_gluon_syncbn_exchange); 0 on success.
int gsbn_register(const char* op) {
  const std::string which = op;
  if (which == "async") register_async_op();
  else if (which == "exchange") register_exchange_op();
  else return 1;
  return 0;
}

// A layer's state: its devices (NUL-separated names), each one's sync
// group, the seconds a device waits for the others and
// a process for the other workers, and across processes the transport its
// vectors leave through (0: none) with this worker's `num_owners` entries of
// the global device ownership vector. Returns its handle, the operators'
// `layer` argument.
int64_t gsbn_layer_create(const char* name, const char* devices, int num_devices,
                          double timeout, double remote_timeout,
                          const char* hint, const int* sync_group_of, int num_sync_groups,
                          int transport, const double* owners, int num_owners) {
  auto layer = std::make_shared<Layer>();
  layer->name = name;
  layer->hint = hint;
  layer->timeout = timeout;
  layer->remote_timeout = remote_timeout;
  const char* d = devices;
  for (int i = 0; i < num_devices; ++i, d += std::strlen(d) + 1) layer->devices.emplace_back(d);
  layer->sync_group_of.assign(sync_group_of, sync_group_of + num_devices);
  layer->num_sync_groups = num_sync_groups;
  layer->numbered_token.assign(num_devices, 0);
  layer->next_call.assign(num_devices, 0);
  layer->issued.assign(num_devices, 0);
  layer->stamped_step.resize(num_devices);
  layer->issuer.resize(num_devices);
  if (transport > 0) {
    layer->transport = find_transport(transport);
    layer->ownership.assign(owners, owners + num_owners);
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  const int64_t handle = g_next_handle++;
  g_layers[handle] = layer;
  g_live.push_back(layer);
  return handle;
}

// A layer was garbage-collected: its state and its staging go.
void gsbn_layer_remove(int64_t handle) {
  forget_layer_staging(handle);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_layers.erase(handle);
}

// A static graph is being issued on one device, with calls of `layers`
// (handles) on their devices `devices` (indices): one engine operation on
// those layers' engine variables, so ordered after the calls issued before
// and before the graph's, records the step they are issued in,
// which numbers them (number_call): a static graph makes its operators once,
// so they cannot know it. A call of an aborted step is then refused at once
// instead of waiting for partners. 0 on success.
int gsbn_stamp_static(const int64_t* layers, const int* devices, int num) {
  std::shared_ptr<Step> step;
  std::vector<std::pair<std::shared_ptr<Layer>, int>> stamps;
  std::vector<mxnet::Engine::VarHandle> vars;
  for (int i = 0; i < num; ++i) {
    std::string error;
    auto layer = find_layer(layers[i], &error);
    if (!layer || devices[i] < 0 || devices[i] >= static_cast<int>(layer->devices.size()))
      continue;
    step = issue_step(*layer, devices[i], true);
    stamps.emplace_back(layer, devices[i]);
    vars.push_back(layer_variable(layer_key(layers[i], devices[i])));
  }
  if (vars.empty()) return 0;
  return push_ordering([stamps, step]() {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& s : stamps) s.first->stamped_step[s.second] = step;
  }, vars, "gluon_syncbn_stamp");
}

// A predict-mode graph is being issued on one device after training calls of
// `layers` (handles) on their devices `devices` (indices) in a static graph,
// which holds the running statistics as read-only inputs (its calls update
// them inside, ordered by the layers' engine variables): one engine operation
// on those variables and on `arrays` (the running statistics the predict
// graph reads), so that the reads come after the updates. 0 on success.
int gsbn_fence(const int64_t* layers, const int* devices, int num, NDArrayHandle* arrays,
               int num_arrays) {
  std::vector<mxnet::Engine::VarHandle> vars;
  for (int i = 0; i < num; ++i) vars.push_back(layer_variable(layer_key(layers[i], devices[i])));
  for (int i = 0; i < num_arrays; ++i) vars.push_back(array_variable(arrays[i]));
  return push_ordering([]() {}, vars, "gluon_syncbn_fence");
}

// An empty slice `x` is issued to a layer: MXNet's layers before it may
// have refused it (its convolutions fail on size-0 arrays), and the engine
// then skips this device's calls, which the other devices would wait for
// until the timeout. Two engine operations tell: the first runs only if `x`
// was computed (it writes a variable of its own), the second runs anyway
// (kNoSkip) after it and, if the first did not run, aborts the step with
// `why` while the step `x` was issued in has not failed. 0 on success.
int gsbn_watch_slice(NDArrayHandle x, const char* why) {
  std::shared_ptr<Step> step;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_step->token != g_token) return 0;  // a failed step's call: refused anyway
    step = g_step;
  }
  auto computed = std::make_shared<std::atomic<bool>>(false);
  mxnet::Engine::VarHandle seen = new_engine_variable(), input = array_variable(x);
  int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}
  const int anyway = static_cast<int>(mxnet::FnProperty::kNoSkip);
  int failed = MXEnginePushSync(run_pushed, new Pushed{[computed]() { *computed = true; }},
                                delete_pushed, ctx, &input, 1, &seen, 1, nullptr, 0,
                                "gluon_syncbn_slice_computed");
  if (!failed) {
    const std::string cause = why;
    failed = MXEnginePushSync(run_pushed, new Pushed{[computed, step, cause]() {
      if (*computed) return;
      {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (!current_locked(*step)) return;
        abort_locked(cause);
      }
      run_pending();
    }}, delete_pushed, ctx, &seen, 1, nullptr, 0, &anyway, 0, "gluon_syncbn_slice_check");
  }
  delete_engine_variable(seen);
  return failed;
}

// Waits for the calls of layer `handle` issued so far on every device and
// clears the error a failed one left on their arrays (settle_engine_variable
// on its engine variables); after an abort, before the next step's calls.
void gsbn_settle(int64_t handle) {
  std::string error;
  auto layer = find_layer(handle, &error);
  if (!layer) return;
  for (size_t i = 0; i < layer->devices.size(); ++i)
    settle_engine_variable(layer_variable(layer_key(handle, static_cast<int>(i))));
}

// Gives the calling thread's MXNet resource manager a temp-space pool of
// `slots` slots per CPU context (cpu_resources.h). 0 on success, else 1
// with the reason in `why`.
int gsbn_separate_cpu_temp_space(int slots, char* why, int why_size) {
  const std::string error = separate_cpu_temp_space(slots);
  copy_out(error, why, why_size);
  return error.empty() ? 0 : 1;
}

// After an abort, before the next step's operations: fresh temp-space
// slots for every CPU context (`recycle`: 0); once the engine was drained
// and the errors cleared, the retired ones are kept for reuse (`recycle`: 1).
void gsbn_cpu_temp_space_after_abort(int recycle) {
  if (recycle) recycle_cpu_temp_space();
  else retire_cpu_temp_space();
}

// The temp-space slots CPU context `dev_id` has of its own (0: none yet).
int gsbn_cpu_temp_slots(int dev_id) { return cpu_temp_slots(dev_id); }

// Starts layer `handle`'s tally (`on`: every device's emptied) or stops it.
void gsbn_tally(int64_t handle, int on) {
  std::string error;
  auto layer = find_layer(handle, &error);
  if (!layer) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (on) layer->tallies.assign(layer->devices.size(), Tally());
  layer->tallying = on != 0;
}

// Device `device`'s tally of layer `handle`: its calls and n in counts[0..1],
// its sums in mean_sum and var_sum (`channels` each, if that is their
// size). Returns their size (0: no call was tallied), or -1 for an unknown
// layer or device.
int gsbn_tally_read(int64_t handle, int device, double* counts, double* mean_sum,
                    double* var_sum, int channels) {
  std::string error;
  auto layer = find_layer(handle, &error);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!layer || device < 0 || device >= static_cast<int>(layer->tallies.size())) return -1;
  const Tally& t = layer->tallies[device];
  const int size = static_cast<int>(t.mean_sum.size());
  counts[0] = t.calls;
  counts[1] = t.n;
  if (size == channels) {
    std::copy(t.mean_sum.begin(), t.mean_sum.end(), mean_sum);
    std::copy(t.var_sum.begin(), t.var_sum.end(), var_sum);
  }
  return size;
}

// This thread now waits in `read` (an output's asnumpy(), waitall(), ...),
// or no longer (null), for the timeouts' messages (timeout_message); `sole`:
// it is the only thread in the step.
void gsbn_reading(const char* read, int sole) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (read) g_reads[std::this_thread::get_id()] = Read{read, sole != 0};
  else g_reads.erase(std::this_thread::get_id());
}

// The current step's token; `begin`: a training step begins first (Python's
// record()/train_mode() scope is entered), so calls issued from now get it
// (a new step where balanced_locked, else the one begun before).
uint64_t gsbn_step(int begin) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (begin) {
    if (g_step->token != g_token || balanced_locked()) g_step.reset(new Step{g_token, false});
    g_remote_in_step = false;
  }
  return g_token;
}

// Why the current step failed, as failure_text has it ("SyncBatchNormTimeout:
// ..."), copied into `text`; "" while it has not. Returns its length.
int gsbn_step_failure(char* text, int text_size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return copy_out(g_token == g_step->token ? "" : failure_text(g_cause, g_cause_kind), text,
                  text_size);
}

// Aborts the current step (`exiting`: at interpreter exit, which is never
// fatal, every call issued so far: abort_locked).
void gsbn_abort(const char* cause, int exiting) { abort_step(cause, exiting != 0, exiting != 0); }

// Why cross-process synchronization broke ("" if it did not; fatal_locked),
// copied into `text`; returns its length.
int gsbn_broken(char* text, int text_size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return copy_out(g_broken, text, text_size);
}

// A cross-process transport (transport.h), returning its id: "kvstore"
// (`target`: the KVStore handle; its scheduler watched from now on:
// watch_helpers) or "horovod" (`target`: Horovod 0.28's
// horovod_mxnet_allreduce_async, `sum_op` its Sum). `exit_grace`: how long
// the process may live on after a fatal failure (fatal_locked).
int gsbn_transport_create(const char* kind, void* target, int sum_op, int rank, int workers,
                          const char* name, double exit_grace) {
  const std::string which = kind;
  std::shared_ptr<Transport> t;
  if (which == "kvstore") t = std::make_shared<KVStoreTransport>(target, rank, workers, name);
  if (which == "horovod")
    t = std::make_shared<HorovodTransport>(target, sum_op, rank, workers);
  if (!t) return 0;
  g_exit_grace = exit_grace;
  if (which == "kvstore") watch_helpers(t);
  return add_transport(std::move(t));
}

// The kvstore behind `transport` was destroyed: its reductions fail with `why`.
void gsbn_transport_close(int transport, const char* why) {
  auto t = find_transport(transport);
  if (t) t->close(why);
}

// The store lock of a kvstore transport, for Python's wrappers of the
// store's methods (transport.py): acquiring may wait (ctypes releases the
// GIL); releasing first issues what engine threads queued meanwhile.
void gsbn_store_lock(int transport, int acquire) {
  auto t = find_kvstore(transport);
  if (t && acquire) t->lock.acquire();
  else if (t) t->lock.release();
}

// When a layer that synchronizes across workers is made: every worker's
// layer made in its place must have the same sync groups (`sync_groups` as
// the user gave them; `devices`: the devices they number where they are
// explicit, else 0) and name as compared (`matched`; `name` for
// messages), before they are worked out. Waits at most `timeout`
// seconds. 0, or the error's length with its text in `error` (the
// process's end started).
int gsbn_compare_layer(int transport, const char* name, const char* matched, int devices,
                       const char* sync_groups, double timeout, char* error, int size) {
  auto t = find_transport(transport);
  if (!t) return copy_out("unknown transport", error, size);
  const std::string why = compare_layer(t, name, matched, devices, sync_groups, timeout);
  return why.empty() ? 0 : copy_out(why, error, size);
}

// update_bn_stats' batch `batch` (from 0), which this worker has or not
// (`has`): 0 with `lacking[0..*num_lacking)` the workers without it, or the
// error's length with its text in `error` (the process's end started).
int gsbn_agree_on_batch(int transport, int batch, int has, double timeout, int* lacking,
                        int* num_lacking, char* error, int size) {
  auto t = find_transport(transport);
  if (!t) return copy_out("unknown transport", error, size);
  std::vector<int> without;
  const std::string why = agree_on_batch(t, batch, has != 0, timeout, &without);
  if (!why.empty()) return copy_out(why, error, size);
  *num_lacking = static_cast<int>(without.size());
  std::copy(without.begin(), without.end(), lacking);
  return 0;
}

// This worker ends through `transport` (remote.h, end_remote): its script
// finished, or failed (`failed`). Waits at most `timeout` seconds for the
// other workers' ends. 0 where every other worker ended its script too, -1
// where they did not within `timeout`; else the length of what they did
// instead, in `text`.
int gsbn_end(int transport, int failed, double timeout, char* text, int size) {
  auto t = find_transport(transport);
  if (!t) return 0;
  bool late = false;
  const std::string seen = end_remote(t, failed ? kEndFailed : kEndFinished, timeout, &late);
  return late ? -1 : seen.empty() ? 0 : copy_out(seen, text, size);
}

}  // extern "C"

#ifdef GSBN_TESTING
// The tests' entry points (the suite names the file: tests/native_testing.h).
#include GSBN_TESTING
#endif
