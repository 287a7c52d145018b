// The native SyncBatchNorm operators: two operators of MXNet's own kind
// (registered in its C++ registry through mxnet_abi.h), one session and
// barrier. Neither is a custom operator and no thread ever waits in them:
//   async_op.h    CPU contexts: the whole layer call; it runs on the device's
//                 engine worker, returns at once and completes when the
//                 devices have met;
//   exchange_op.h GPUs: MXNet's operators compute the local moments on the
//                 device; this operator (cpu and gpu) exchanges the packed
//                 per-channel vector through MXNet's engine copies;
//   transport.h   across processes: a process's sums through the kvstore or
//                 Horovod as engine operations on one buffer per key;
//   session.h     the step token, the call-order barrier (continuations, whose
//                 deadlines a watchdog thread keeps), recovery: every failure
//                 (a timeout, devices that disagree, a call of an aborted step)
//                 aborts the step; the token advances, every waiting exchange
//                 fails at once with the cause, and the cause is queued for
//                 Python (gsbn_take_errors). Python's Session calls gsbn_abort
//                 for failures it sees first. One token, one path.
//   sync_call.h   the protocol of both operators' calls (SyncCall): state,
//                 numbering, checks, exchange, continuation, completion;
//   stats.h       the maths in float64: gluon_syncbn/stats.py's functions
//                 (same names) and the asynchronous operator's loops;
//   wire.h        the exchanged vectors' layouts (gluon_syncbn/wire.py's).
//   messages.h    the wording of failures both languages report
//                 (gluon_syncbn/messages.py's templates).
//   arrays.h      reading and writing host arrays as the dtypes they have.
//   params.h      the operators' string arguments.
//   failures.h    how failed operations complete (MXNet's unlocked error list),
//                 the Python operator's included.
//   mxnet_abi.h   every reliance on libmxnet's C++ ABI.
//
// Reliance on MXNet 1.9.1 behaviour is listed with the Python side's in
// gluon_syncbn/mxnet_private.py; an asynchronous operator's completion may be
// called from any thread.
#include "mxnet_abi.h"  // first: its #define must precede every MXNet header

#include <mxnet/c_api.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "async_op.h"
#include "exchange_op.h"

// ----------------------------------------------------- interface to Python --
// Loaded with ctypes by gluon_syncbn/native/__init__.py. Strings are UTF-8.

extern "C" {

// Sets the wording of message `name` (gluon_syncbn/messages.py's templates;
// messages.h), before any operator is registered.
void gsbn_set_message(const char* name, const char* text) { message_templates()[name] = text; }

// Registers the asynchronous operator (_gluon_syncbn_sync); 0 on success.
int gsbn_register_async() {
  register_async_op();
  return 0;
}

// Registers the exchange operator (_gluon_syncbn_exchange); 0 on success.
int gsbn_register_exchange() {
  register_exchange_op();
  return 0;
}

// Makes room in MXNet's list of engine errors (see reserve_engine_errors);
// called once, before the first layer's first call.
void gsbn_reserve_engine_errors() { reserve_engine_errors(kReservedEngineErrors); }

// Fails the Python operator's call whose callback got the arrays `hold` and
// `probe` with `message`, after the calls failed before it (see failures.h,
// fail_python_call); 0 if the failure was queued.
int gsbn_fail_python_call(NDArrayHandle hold, NDArrayHandle probe, const char* message) {
  return fail_python_call(hold, probe, message);
}

// A layer's devices (NUL-separated names) and each one's sync group.
void gsbn_group_create(const char* id, const char* name, const char* devices, int num_devices,
                       double timeout, const char* hint, const int* subgroups,
                       int num_subgroups) {
  auto g = std::make_shared<Group>();
  g->name = name;
  g->hint = hint;
  g->timeout = timeout;
  const char* d = devices;  // num_devices NUL-separated names
  for (int i = 0; i < num_devices; ++i, d += std::strlen(d) + 1) g->devices.emplace_back(d);
  g->subgroup.assign(subgroups, subgroups + num_devices);
  g->num_subgroups = num_subgroups;
  g->next_call.assign(num_devices, 0);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_groups[id] = g;
  g_live.push_back(g);
}

// static_shape graphs: device `device`'s running mean and variance arrays (the
// Parameter's own NDArrays, whose handles the Python group keeps valid), which
// the exchange operator updates in engine order.
void gsbn_group_set_running(const char* id, int device, NDArrayHandle mean, NDArrayHandle var) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(id);
  if (it == g_groups.end()) return;
  auto& running = it->second->running;
  if (running.size() <= static_cast<size_t>(device)) running.resize(device + 1);
  running[device] = {mean, var};
}

// Across processes: the group's sums leave the process through transport
// `transport` (gsbn_transport_*), with this worker's `num_owners` entries of
// the global device ownership vector (none without sync_groups).
void gsbn_group_set_transport(const char* id, int transport, const double* owners,
                              int num_owners) {
  auto t = find_transport(transport);
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(id);
  if (it == g_groups.end() || !t) return;
  it->second->transport = t;
  it->second->ownership.assign(owners, owners + num_owners);
}

// The transports (transport.h); each returns its id. `exit_grace`: how long
// the process may live on after a fatal failure (fatal_locked).
int gsbn_transport_kvstore(void* handle, int rank, int workers, const char* name,
                           double exit_grace) {
  g_exit_grace = exit_grace;
  return add_transport(std::make_shared<KVStoreTransport>(handle, rank, workers, name));
}

int gsbn_transport_horovod(void* allreduce, int sum_op, int rank, int workers,
                           double exit_grace) {
  g_exit_grace = exit_grace;
  return add_transport(std::make_shared<HorovodTransport>(allreduce, sum_op, rank, workers));
}

int gsbn_transport_loopback(int workers, const char* mode, double exit_grace) {
  g_exit_grace = exit_grace;
  return add_transport(std::make_shared<LoopbackTransport>(workers, mode));
}

// The kvstore behind `transport` was destroyed: its reductions fail with `why`.
void gsbn_transport_close(int transport, const char* why) {
  auto t = find_transport(transport);
  if (t) t->close(why);
}

// The store lock of a kvstore transport, for Python's wrappers of the
// store's methods (transport.py): acquire may wait (ctypes releases the GIL);
// release first issues what engine threads queued meanwhile.
void gsbn_store_acquire(int transport) {
  auto t = find_kvstore(transport);
  if (t) t->lock.acquire();
}

void gsbn_store_release(int transport) {
  auto t = find_kvstore(transport);
  if (t) t->lock.release();
}

// How many reductions engine threads left to the holder of the store lock.
int64_t gsbn_store_queued(int transport) {
  auto t = find_kvstore(transport);
  return t ? t->lock.queued() : -1;
}

// Why cross-process synchronization broke ("" if it did not), copied into buf.
int gsbn_broken(char* buf, int size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::snprintf(buf, size, "%s", g_broken.c_str());
  return static_cast<int>(g_broken.size());
}

// A layer was garbage-collected: its group and its staging go.
void gsbn_group_remove(const char* id) {
  forget_layer_staging(id);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_groups.erase(id);
}

// How many (layer, device) pairs hold exchange staging (for tests).
int64_t gsbn_staging_layers() { return static_cast<int64_t>(staging_layers()); }

// How many exchanges the barrier holds, over every live group (for tests).
int64_t gsbn_pending_exchanges() {
  std::lock_guard<std::mutex> lock(g_mutex);
  int64_t n = 0;
  for (auto& g : live_groups_locked()) n += static_cast<int64_t>(g->exchanges.size());
  return n;
}

uint64_t gsbn_token() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_token;
}

// A training step begins (Python's record()/train_mode() scope is entered).
void gsbn_begin_step() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_issue_token = g_token;
}

// Aborts the step; `exiting`: at interpreter exit, which is never fatal.
void gsbn_abort(const char* cause, int exiting) { abort_step(cause, exiting != 0); }

// The cause of the last abort, copied into buf (at most size bytes).
int gsbn_cause(char* buf, int size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::snprintf(buf, size, "%s", g_cause.c_str());
  return static_cast<int>(g_cause.size());
}

// Failures since the last call, "Kind\tmessage" lines, oldest first.
int gsbn_take_errors(char* buf, int size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::string out;
  for (const auto& e : g_errors) out += e + "\n";
  g_errors.clear();
  std::snprintf(buf, size, "%s", out.c_str());
  return static_cast<int>(out.size());
}

}  // extern "C"

#ifdef GSBN_TESTING
// stats.h on the given per-channel inputs of C channels (tests/test_native_stats.py):
// forward_contribution(count, m1, m2, v), merge(total), then with its
// statistics normalize_coefficients, backward_contribution(d_scale, d_shift)
// and local_moment_grads(backward_total). `out` gets their results one after
// another: 1 + 2C, 1 + 2C (n, mean, var), 2C (scale, shift), 3C
// (contribution, d gamma), 2C (d m2, d v).
extern "C" void gsbn_test_stats(int C, double count, const double* m1, const double* m2,
                                const double* v, const double* total, const double* gamma,
                                const double* beta, double eps, int fix_gamma,
                                const double* d_scale, const double* d_shift,
                                const double* backward_total, double* out) {
  auto vec = [](const double* a, int n) { return std::vector<double>(a, a + n); };
  auto emit = [&out](const std::vector<double>& a) { out = std::copy(a.begin(), a.end(), out); };
  Params p;
  p.eps = eps;
  p.fix_gamma = fix_gamma != 0;
  const std::vector<double> centre = vec(m1, C);
  emit(forward_contribution(count, centre, vec(m2, C), vec(v, C)));
  const Info stats = merge(vec(total, 1 + 2 * C));
  emit({stats.n});
  emit(stats.mean);
  emit(stats.var);
  std::vector<double> scale, shift, g = vec(gamma, C), ds = vec(d_scale, C),
                      dsh = vec(d_shift, C), inv_stds, d_gamma, d_m2, d_v;
  normalize_coefficients(p, stats, centre, g, vec(beta, C), &scale, &shift);
  emit(scale);
  emit(shift);
  emit(backward_contribution(p, stats, centre, count, &g, &ds, &dsh, &inv_stds, &d_gamma));
  emit(d_gamma);
  local_moment_grads(vec(backward_total, 2 * C), count, stats, centre, g, inv_stds, &d_m2, &d_v);
  emit(d_m2);
  emit(d_v);
}
#endif
