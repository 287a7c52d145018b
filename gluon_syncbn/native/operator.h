// What the two native operators share: their string arguments, the state of
// one operator instance (one device's call, or one device's graph node in a
// static graph), and the property callbacks MXNet calls on the main thread
// (names, shapes, types, dependencies, and creating instances).
#pragma once
#include <mxnet/c_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "arrays.h"
#include "session.h"

namespace {

// The operator's string arguments, as the block passes them to F.Custom.
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
  Fn callbacks[3];
  void* contexts[3];
};

struct Handles {  // the callback's arrays by tag, freed when it returns
  std::vector<NDArrayHandle> by_tag[5];
  int size;
  void** ptrs;
  Handles(int n, void** p, const int* tags) : size(n), ptrs(p) {
    for (int i = 0; i < n; ++i) by_tag[tags[i]].push_back(p[i]);
  }
  ~Handles() { for (int i = 0; i < size; ++i) MXNDArrayFree(ptrs[i]); }
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
// (reserve_engine_errors; for the asynchronous and exchange operators, which
// complete their own failures, not for custom operators, which MXNet
// completes).

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

// What a forward or backward callback returns when its call failed: the
// failure goes to this call alone. A callback that returns 0 leaves MXNet's
// error in the custom-operator runtime's one process-wide slot (1.9.1
// custom-inl.h, CustomOperator::exception_), which the next custom operator
// to complete takes, unlocked: when several devices' calls fail together,
// some complete as if they had succeeded, their outputs unwritten, and two
// writes can free the slot twice. But a custom operator completes by
// rethrowing any exception on its callback's arrays (Engine::Throw on each
// one's engine variable), so the callback queues an engine operation that
// fails writing one of them (fail_array), and returns success.
//
// Queues that operation: it fails `array`'s engine variable with `message`;
// 0 if queued.
int fail_array(NDArrayHandle array, const std::string& message) {
  int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}: where the failing operation runs
  return MXEnginePushAsyncND(raise_on, new std::string(message), delete_message, ctx, nullptr, 0,
                             &array, 1, nullptr, 0, "gluon_syncbn_failed_call", false);
}

int failed_call(const Handles& h, const std::string& message) {
  // An array MXNet checks: the inputs of a forward call, the input gradients
  // of a backward call (which gets placeholders for undeclared inputs).
  NDArrayHandle array = h.by_tag[kInGrad].empty() ? h.by_tag[kInData][0] : h.by_tag[kInGrad][0];
  if (fail_array(array, message) == 0) return 1;
  return fail("SyncBatchNormError", message);  // MXNet's slot, as a last resort
}

// Why a backward call cannot be: its forward ran in inference mode.
std::string inference_backward(const std::string& layer) {
  return "SyncBatchNorm '" + layer + "': backward through a call made in inference mode; "
         "record the forward pass under autograd.record() (train_mode=True).";
}

// The forward exchange of one call: numbers it, sums the devices' FORWARD
// vectors, and fills `stats` with the group's statistics and the call's step
// and number. False, with `error` set, if the call failed.
bool exchange_forward(const Op& op, double count, const std::vector<double>& mean,
                      const std::vector<double>& var, Info* stats, std::string* error) {
  uint64_t token;
  int64_t call;
  std::vector<double> total;
  if (!number_call(*op.group, op.device, op.params.static_shape, op.token, &token, &call,
                   error) ||
      !exchange(*op.group, Key(0, token, call), op.device, pack_forward(count, mean, var),
                op.params.dtype_name, &total, error))
    return false;
  unpack_forward(total, &stats->n, &stats->mean, &stats->var);
  stats->token = static_cast<double>(token);
  stats->call = static_cast<double>(call);
  return true;
}

// The backward exchange of the call `stats` (its INFO) describes: sums the
// devices' BACKWARD vectors into `total`. False, with `error` set, if the call
// was made in inference mode, belongs to a failed step, or the exchange failed.
bool exchange_backward(const Op& op, const Info& stats, const std::vector<double>& sum_dy,
                       const std::vector<double>& sum_dy_xc, std::vector<double>* total,
                       std::string* error) {
  if (stats.call < 0) {
    *error = inference_backward(op.group->name);
    return false;
  }
  return backward_current(*op.group, op.params.static_shape, op.token, error) &&
         exchange(*op.group, Key(1, static_cast<uint64_t>(stats.token),
                                 static_cast<int64_t>(stats.call)),
                  op.device, pack_backward(sum_dy, sum_dy_xc), op.params.dtype_name, total,
                  error);
}

typedef int (*FBFunc)(int, void**, int*, const int*, const int, void*);

// The callbacks of one operator type (see host_op.h and device_op.h).
struct OpType {
  const char** args;
  const char** outs;
  const char** auxs;
  int (*infer_shape)(int, int*, int**, void*);
  int (*infer_type)(int, int*, void*);
  int (*bwd_dep)(const int*, const int*, const int*, int*, int**, void*);
  FBFunc forward, backward;
};

// MXNet keeps one property per graph node; it hands back shapes through
// pointers that must outlive the call, hence the buffers.
struct Prop {
  Params params;
  const OpType* type;
  std::vector<int> shape_buffer[3];
  Fn callbacks[10];
  void* contexts[10];
};

// The group of a property's layer, or null with the error recorded.
std::shared_ptr<Group> prop_group(void* state) {
  std::string error;
  auto group = find_group(static_cast<Prop*>(state)->params.group_id, &error);
  if (!group) fail("SyncBatchNormError", error);
  return group;
}

std::string layer_name(const Params& p) {
  std::string error;
  auto group = find_group(p.group_id, &error);
  return group ? group->name : p.group_id;
}

int list_args(char*** out, void* s) {
  *out = const_cast<char**>(static_cast<Prop*>(s)->type->args);
  return 1;
}
int list_outs(char*** out, void* s) {
  *out = const_cast<char**>(static_cast<Prop*>(s)->type->outs);
  return 1;
}
int list_auxs(char*** out, void* s) {
  *out = const_cast<char**>(static_cast<Prop*>(s)->type->auxs);
  return 1;
}
int infer_shape(int num, int* ndims, int** shapes, void* s) {
  return static_cast<Prop*>(s)->type->infer_shape(num, ndims, shapes, s);
}
int infer_type(int num, int* types, void* s) {
  return static_cast<Prop*>(s)->type->infer_type(num, types, s);
}
int bwd_dep(const int* out_grad, const int* in_data, const int* out_data, int* num,
            int** deps, void* s) {
  return static_cast<Prop*>(s)->type->bwd_dep(out_grad, in_data, out_data, num, deps, s);
}

int infer_stype(int num, int* stypes, void*) {
  for (int i = 0; i < num; ++i) stypes[i] = 0;  // default storage only
  return 1;
}

int infer_stype_backward(int num, int* stypes, int*, void*) {
  for (int i = 0; i < num; ++i) stypes[i] = 0;
  return 1;
}

int op_delete(void* state) { delete static_cast<Op*>(state); return 1; }

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

// One instance per device and call (per graph node in static graphs), created
// on the main thread when the call is issued.
int create_operator(const char* ctx, int, unsigned**, const int*, const int*,
                    MXCallbackList* ret, void* state) {
  Prop& p = *static_cast<Prop*>(state);
  std::string error;
  auto group = find_group(p.params.group_id, &error);
  if (!group) return fail("SyncBatchNormError", error);
  const int device = device_index(*group, ctx, &error);
  if (device < 0) return fail("SyncBatchNormError", error);
  Op* op = new Op();
  op->params = p.params;
  op->group = group;
  op->device = device;
  op->token = issue_token();
  op->callbacks[0] = reinterpret_cast<Fn>(op_delete);
  op->callbacks[1] = reinterpret_cast<Fn>(p.type->forward);
  op->callbacks[2] = reinterpret_cast<Fn>(p.type->backward);
  for (auto& c : op->contexts) c = op;
  ret->num_callbacks = 3;
  ret->callbacks = op->callbacks;
  ret->contexts = op->contexts;
  return 1;
}

int prop_delete(void* state) { delete static_cast<Prop*>(state); return 1; }

// A property for one graph node of operator type `type`.
int create_prop(const OpType* type, int num_kwargs, const char** keys, const char** values,
                MXCallbackList* ret) {
  Prop* p = new Prop();
  p->params = parse_params(num_kwargs, keys, values);
  p->type = type;
  Fn fns[10] = {reinterpret_cast<Fn>(prop_delete), reinterpret_cast<Fn>(list_args),
                reinterpret_cast<Fn>(list_outs), reinterpret_cast<Fn>(list_auxs),
                reinterpret_cast<Fn>(infer_shape), reinterpret_cast<Fn>(bwd_dep),
                reinterpret_cast<Fn>(create_operator), reinterpret_cast<Fn>(infer_type),
                reinterpret_cast<Fn>(infer_stype), reinterpret_cast<Fn>(infer_stype_backward)};
  for (int i = 0; i < 10; ++i) { p->callbacks[i] = fns[i]; p->contexts[i] = p; }
  ret->num_callbacks = 10;
  ret->callbacks = p->callbacks;
  ret->contexts = p->contexts;
  return 1;
}

}  // namespace
