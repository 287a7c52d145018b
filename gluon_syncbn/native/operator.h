// What the asynchronous and the exchange operator share: their string
// arguments, one operator instance (one device's call, or one device's graph
// node in a static graph), how a failed operation completes, and where a call
// belongs (its device, its step).
#pragma once
#include <mxnet/c_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "arrays.h"
#include "session.h"

namespace {

// The operator's string arguments, as the block passes them.
struct Params {
  std::string group_id, dtype_name = "float32";
  double eps = 1e-5, momentum = 0.9;
  bool fix_gamma = false, static_shape = false, row_sums = false;
  int axis = 1;
};

Params parse_params(int num, const char** keys, const char** values) {
  Params p;
  for (int i = 0; i < num; ++i) {
    std::string key = keys[i], value = values[i];
    bool yes = value == "True" || value == "true" || value == "1";
    if (key == "group") p.group_id = value;
    else if (key == "eps") p.eps = std::stod(value);
    else if (key == "momentum") p.momentum = std::stod(value);
    else if (key == "fix_gamma") p.fix_gamma = yes;
    else if (key == "static_shape") p.static_shape = yes;
    else if (key == "row_sums") p.row_sums = yes;
    else if (key == "axis") p.axis = std::stoi(value);
    else if (key == "input_dtype") p.dtype_name = value;
  }
  return p;
}

// One operator instance: its arguments, its group and device, and the step it
// was issued in (unused in static graphs, whose instances outlive steps).
struct Op {
  Params params;
  std::shared_ptr<Group> group;
  int device;
  uint64_t token;
};

// MXNet 1.9.1's engine keeps failed operations' errors in one plain
// std::vector per process (threaded_engine.h, AddToGlobalExceptions), which
// waitall walks and clears: a failed operation appends its error from the
// thread that completes it, and every operation that starts on a failed array
// searches the list from its own thread, all without a lock. Two appends at
// once, or an append that outgrows the list and moves it under a search
// (which then misses, and appends too), corrupt it, and the next waitall
// crashes. An aborted step fails every device's calls at once, so the native
// operators take two measures: their failures complete one at a time in the
// process (fail_operation), and the list gets room before their first call
// (reserve_engine_errors). Custom operators cannot: MXNet completes each
// failed one with an error of its own, on that device's worker thread
// (custom-inl.h, CustomOperatorWait), so the native operators are never
// custom operators.

// Completes an engine operation with `error`, one failure at a time.
void fail_operation(const mxnet::engine::CallbackOnComplete& on_complete,
                    const std::string& error) {
  static std::mutex* one_at_a_time = new std::mutex;  // never destroyed: used at exit
  std::lock_guard<std::mutex> lock(*one_at_a_time);
  dmlc::Error e(error);
  on_complete(&e);
}

void raise_on(void*, void* on_complete, void* message) {
  fail_operation(*static_cast<mxnet::engine::CallbackOnComplete*>(on_complete),
                 *static_cast<std::string*>(message));
}

// The list grows by doubling and keeps its room when waitall clears it:
// 2^k + 1 entries leave room for 2^k - 1 more errors before the next waitall
// and 2^(k+1) after it.
const int kReservedEngineErrors = 4097;

// Grows the list by `n` errors: `n` operations fail on fresh arrays, inline
// on this thread (kAsync), and their errors are taken at once, which leaves
// entries that waitall skips and clears. Run before the asynchronous or the
// exchange operator's first call (registry.Session.prepare_engine).
void reserve_engine_errors(int n) {
  static std::string why = "gluon_syncbn: making room in the engine's list of errors";
  const uint32_t shape[1] = {1};
  const int inline_here = static_cast<int>(mxnet::FnProperty::kAsync);
  int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}
  std::vector<NDArrayHandle> arrays;
  for (int i = 0; i < n; ++i) {
    NDArrayHandle a = nullptr;
    if (MXNDArrayCreateEx(shape, 1, 1, 0, 1, 0, &a) != 0) break;
    arrays.push_back(a);
    MXEnginePushAsyncND(raise_on, &why, nullptr, ctx, nullptr, 0, &a, 1, &inline_here, 0,
                        "gluon_syncbn_reserve", false);
  }
  for (NDArrayHandle a : arrays) {
    MXNDArrayWaitToRead(a);  // takes the error: -1, as expected
    MXNDArrayFree(a);
  }
}

void delete_message(void* message) { delete static_cast<std::string*>(message); }

// How the Python operator (a custom operator) fails one call, so the failure
// goes to that call alone. A callback that raises leaves MXNet's error in the
// custom-operator runtime's one process-wide slot (1.9.1 custom-inl.h,
// CustomOperator::exception_), which the next custom operator to complete
// takes, unlocked: when several devices' calls fail together, some complete
// as if they had succeeded, their outputs unwritten, and two writes can free
// the slot twice. But a custom operator completes by rethrowing any exception
// on its callback's arrays (Engine::Throw on each one's engine variable), so
// the callback queues an engine operation that fails writing one of them
// (fail_array), and returns success.
//
// Queues that operation: it fails `array`'s engine variable with `message`;
// 0 if queued.
int fail_array(NDArrayHandle array, const std::string& message) {
  int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}: where the failing operation runs
  return MXEnginePushAsyncND(raise_on, new std::string(message), delete_message, ctx, nullptr, 0,
                             &array, 1, nullptr, 0, "gluon_syncbn_failed_call", false);
}

// Why a backward call cannot be: its forward ran in inference mode.
std::string inference_backward(const std::string& layer) {
  return "SyncBatchNorm '" + layer + "': backward through a call made in inference mode; "
         "record the forward pass under autograd.record() (train_mode=True).";
}

std::string layer_name(const Params& p) {
  std::string error;
  auto group = find_group(p.group_id, &error);
  return group ? group->name : p.group_id;
}

// The index of device `ctx` ("cpu(1)") in the group, or -1 with the error.
int device_index(const Group& g, const std::string& ctx, std::string* error) {
  for (size_t i = 0; i < g.devices.size(); ++i)
    if (g.devices[i] == ctx) return static_cast<int>(i);
  *error = "SyncBatchNorm '" + g.name + "' was called on " + ctx + ", but its parameters " +
           "live on " + join(g.devices) + ". Initialize the network on every context you feed.";
  return -1;
}

// The token of a call issued now (imperative and dynamic graphs). A call
// issued after an abort but before the next step begins belongs to the
// failed step.
uint64_t issue_token() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_issue_token;
}

}  // namespace
