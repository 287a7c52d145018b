// The one protocol of the two native operators' calls, SyncCall: numbering
// (a call of a failed step fails), for backward the forward's statistics,
// the head gradient's dtype and the step's currency, then the operator's
// contribution, the exchange (forward: its global statistics kept in the
// state for backward), the operator's finish, and completion, exactly once.
// Every failure completes the call: with the exchange's error or, when it
// failed alone (an engine refusal, a copy MXNet rejected, a dtype), after
// aborting the step, so the other devices' calls fail now instead of waiting
// for this one until the timeout. MXNet orders every call of a layer on a
// device through the layer's engine variable (layer_variable), so a backward
// call finds its forward's statistics in the state; the state and the
// arrays a call keeps live until its last continuation is gone.
#pragma once
#include "mxnet_abi.h"

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "arrays.h"
#include "failures.h"
#include "params.h"
#include "meeting.h"
#include "remote.h"
#include "session.h"
#include "stats.h"

namespace {

// The block's string arguments of a node (layer, eps, momentum, ...).
Params node_params(const nnvm::NodeAttrs& attrs) {
  Params p;
  for_each_argument(attrs, [&p](const std::string& key, const std::string& value) {
    set_param(&p, key, value);
  });
  return p;
}

std::string layer_name(const Params& p) {
  std::string error;
  auto layer = find_layer(p.layer_id, &error);
  return layer ? layer->name : std::to_string(p.layer_id);
}

// The index of device `ctx` ("cpu(1)") among the layer's, or -1 with the error.
int device_index(const Layer& layer, const std::string& ctx, std::string* error) {
  for (size_t i = 0; i < layer.devices.size(); ++i)
    if (layer.devices[i] == ctx) return static_cast<int>(i);
  *error = message("wrong_device", {{"layer", layer.name}, {"device", ctx},
                                    {"devices", join(layer.devices)}});
  return -1;
}

// The step of a call of `layer` issued now on its device `device` (imperative
// and dynamic graphs; a static graph's, stamped), this thread noted as the
// device's issuer; `call`: a call (not a static graph's operator, made once
// whenever MXNet sets the graph up), counted (balanced_locked). A call issued
// after an abort but before the next step begins belongs to the failed step.
std::shared_ptr<Step> issue_step(Layer& layer, int device, bool call) {
  std::lock_guard<std::mutex> lock(g_mutex);
  layer.issuer[device] = std::this_thread::get_id();
  if (layer.issued_token != g_step->token) {
    layer.issued_token = g_step->token;
    layer.issued.assign(layer.devices.size(), 0);
  }
  layer.issued[device] += call;
  return g_step;
}

// The engine variable of a layer's calls on one device, shared by all their
// states. A static graph makes one state per node and orders a node's
// operations only through its own state's variable (the running statistics
// are read-only inputs there), so without it a layer called twice per
// forward pass could run step k+1's first call before step k's second,
// numbering and updating them out of order; with it every call of the layer
// on the device runs in the order it was issued, the same on every device.
// One small variable per layer and device, kept for the process's life.
mxnet::Engine::VarHandle layer_variable(const LayerKey& key) {
  static std::mutex& mutex = *new std::mutex();
  static auto& variables = *new std::map<LayerKey, mxnet::Engine::VarHandle>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& var = variables[key];
  if (var == nullptr) var = new_engine_variable();
  return var;
}

// One graph node's state (an operator instance): its arguments, its layer and device, the step it
// was issued in (in static graphs, whose instances outlive steps, that of
// its last forward call: number_call), and its forward call's global statistics.
struct NodeState {
  Params params;
  std::shared_ptr<Layer> layer;
  int device = -1;       // the index among the layer's devices
  int dev_id = 0;        // the context's id: whose worker runs continuations
  std::shared_ptr<Step> step;
  Info stats;            // call < 0: the forward ran in inference mode
};

// The state of a graph node on context `ctx` with `channels` channels:
// `state` filled in, its layer attached to the other processes, its
// engine variable the layer's.
template <typename State>
mxnet::OpStatePtr create_state(State* state, const nnvm::NodeAttrs& attrs,
                               const mxnet::Context& ctx, int64_t channels) {
  NodeState& node = *state;
  node.params = node_params(attrs);
  std::string error;
  node.layer = find_layer(node.params.layer_id, &error);
  if (!node.layer) refuse(error);
  const std::string kind = ctx.dev_type == mxnet::Context::kGPU ? "gpu(" : "cpu(";
  node.device = device_index(*node.layer, kind + std::to_string(ctx.dev_id) + ")", &error);
  if (node.device < 0) refuse(error);
  node.dev_id = ctx.dev_id;
  node.step = issue_step(*node.layer, node.device, !node.params.static_shape);
  if (!attach_remote(*node.layer, channels, node.params.dtype_name, &error)) refuse(error);
  return make_state(state, layer_variable(layer_key(node.params.layer_id, node.device)));
}

// An operation pushed to the engine: fn, run on a CPU context's worker.
struct Pushed { std::function<void()> fn; };
void run_pushed(void*, void* param) { static_cast<Pushed*>(param)->fn(); }
void delete_pushed(void* param) { delete static_cast<Pushed*>(param); }

// Pushes `f` as an engine operation on CPU context `dev_id`'s worker, run
// once every operation queued so far on `reads` has completed; false (f
// still the caller's) if the engine refused.
bool push_on_worker(int dev_id, const std::vector<mxnet::NDArray>& reads, Pushed* f,
                    const char* name) {
  std::vector<NDArrayHandle> handles;
  for (const auto& a : reads) handles.push_back(const_cast<mxnet::NDArray*>(&a));
  int ctx[2] = {1, dev_id};  // mxnet::Context{kCPU, dev_id}
  return MXEnginePushSyncND(run_pushed, f, delete_pushed, ctx, handles.data(),
                            static_cast<int>(handles.size()), nullptr, 0, nullptr, 0,
                            name) == 0;
}

// Pushes `fn` as an engine operation that writes the engine variables
// `vars`: it runs after every operation queued on them so far and before
// those queued after it; it only orders, so any worker runs it. 0 on
// success, as MXEnginePushSync.
int push_ordering(std::function<void()> fn, std::vector<mxnet::Engine::VarHandle> vars,
                  const char* name) {
  int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}
  return MXEnginePushSync(run_pushed, new Pushed{std::move(fn)}, delete_pushed, ctx, nullptr, 0,
                          vars.data(), static_cast<int>(vars.size()), nullptr, 0, name);
}

// A continuation runs here and now if the slice has at most this many
// elements: pushing an engine operation costs about what normalizing that
// many elements does.
const int64_t kFinishHereElements = 1 << 14;

// One call of an operator on one device, from its compute function to its
// completion, shared (std::shared_ptr) by the continuations that finish it.
struct SyncCall : std::enable_shared_from_this<SyncCall> {
  typedef std::shared_ptr<SyncCall> Call;
  const mxnet::OpStatePtr held;  // keeps `node` alive while a continuation may run
  NodeState& node;
  const mxnet::engine::CallbackOnComplete on_complete;
  std::vector<mxnet::NDArray> keep;  // what the call's operations use, alive till completion
  uint64_t token = 0;                // the forward's step and call number
  int64_t call = -1;
  Info stats;                        // the global statistics (the backward's: its forward's)
  std::thread::id issuer;            // the thread that started the exchange
  std::atomic<bool> completed{false};

  SyncCall(const mxnet::OpStatePtr& state, NodeState& node, const mxnet::OpContext& ctx)
      : held(state), node(node), on_complete(ctx.async_on_complete) {}

  // Completes the call, failed with `failure` (failure_text's) unless it is
  // empty; only the first completion counts.
  void complete(const std::string& failure = "") {
    if (completed.exchange(true)) return;
    if (failure.empty()) {
      on_complete();
    } else {
      fail_operation(on_complete, failure);
    }
  }

  // The call failed alone: the step is aborted, then the call completes.
  void abort_with(const std::string& message) {
    abort_step(message);
    complete(failure_text(message));
  }

  void fail_call(const std::string& error) {
    abort_with(in_layer(node.layer->name, "exchanging the statistics failed: " + error));
  }

  bool completed_with(const std::string& error) {
    complete(failure_text(error));
    return false;
  }

  // Forward: the call's step token and number; false (completed) for a call
  // of a step that failed earlier.
  bool number() {
    std::string error;
    if (!number_call(*node.layer, node.device, node.params.static_shape, &node.step, &call,
                     &error))
      return completed_with(error);
    token = node.step->token;
    return true;
  }

  // Backward: the forward's statistics, and a head gradient of a dtype the
  // layer takes (autograd.backward does not check it; the other devices'
  // backward calls would wait for this one); false (completed) if not.
  bool has_forward(int head_dtype) {
    stats = node.stats;
    if (stats.call < 0)
      return completed_with(message("inference_backward", {{"layer", node.layer->name}}));
    std::string error = dtype_problem(node.layer->name, "the gradient of its output", head_dtype);
    if (error.empty()) return true;
    abort_with(error);
    return false;
  }

  // Backward: false (completed) if the call belongs to a step that failed
  // since it was issued.
  bool current() {
    std::string error;
    return backward_current(*node.layer, *node.step, &error) ||
           completed_with(error);
  }

  // The FORWARD exchange of `contribution`; `then` gets the global
  // statistics, which the state keeps for the backward call.
  void exchange_forward(std::vector<double> contribution, std::function<void(const Info&)> then) {
    Call self = shared_from_this();
    exchange(Key(0, token, call), std::move(contribution),
             [self, then](const std::vector<double>& total) {
      Info stats = global_statistics(total);
      stats.token = static_cast<double>(self->token);
      stats.call = static_cast<double>(self->call);
      self->node.stats = self->stats = stats;
      add_to_tally(*self->node.layer, self->node.device, stats);
      then(stats);
    });
  }

  // The BACKWARD exchange of `contribution`, that of the forward's call;
  // `then` gets the devices' sum.
  void exchange_backward(std::vector<double> contribution,
                         std::function<void(const std::vector<double>&)> then) {
    exchange(Key(1, static_cast<uint64_t>(stats.token), static_cast<int64_t>(stats.call)),
             std::move(contribution), std::move(then));
  }

  // `fn` on the worker of the call's CPU context, so that each device
  // finishes its own slice in parallel with the others; here and now if this
  // thread started the exchange (the device arrived last, or failed at once)
  // or the engine refuses it.
  void run_on_worker(std::function<void()> fn) {
    std::function<void()> guarded = guard(std::move(fn));
    if (std::this_thread::get_id() == issuer) return guarded();
    auto* f = new Pushed{guarded};
    if (!push_on_worker(node.dev_id, {}, f, "gluon_syncbn_finish")) {
      run_pushed(nullptr, f);
      delete_pushed(f);
    }
  }

  // `fn`, with an exception it throws failing the call.
  std::function<void()> guard(std::function<void()> fn) {
    Call self = shared_from_this();
    return [self, fn]() {
      try {
        fn();
      } catch (const std::exception& e) {
        self->fail_call(e.what());
      }
    };
  }

  // run_on_worker, but here and now too for a slice of at most
  // kFinishHereElements elements.
  void finish_on(int64_t elements, std::function<void()> fn) {
    if (elements <= kFinishHereElements) return guard(std::move(fn))();
    run_on_worker(std::move(fn));
  }

  // `fn` as an engine operation on the worker of the call's CPU context once
  // every operation queued so far on `reads` has completed; the call fails
  // if the engine refuses it.
  void run_after(const std::vector<mxnet::NDArray>& reads, std::function<void()> fn,
                 const char* name) {
    if (!push_on_worker(node.dev_id, reads, new Pushed{guard(std::move(fn))}, name))
      fail_call(MXGetLastError());
  }

 private:
  void exchange(const Key& key, std::vector<double> contribution,
                std::function<void(const std::vector<double>&)> then) {
    Call self = shared_from_this();
    issuer = std::this_thread::get_id();
    meet_async(*node.layer, key, node.step, node.device, std::move(contribution),
               node.params.dtype_name,
                   [self, then](const std::string& failure, const std::vector<double>& total) {
      if (!failure.empty()) return self->complete(failure);
      self->guard([&then, &total]() { then(total); })();
    });
  }
};

Array array_of(const mxnet::NDArray& a) {
  Array out;
  const mxnet::TShape& shape = a.shape();
  for (int i = 0; i < shape.ndim(); ++i) out.shape.push_back(shape[i]);
  out.dtype = a.dtype();
  out.data = out.size() > 0 ? a.data().dptr_ : nullptr;
  return out;
}

// The array in MXNet's default layout (MKL-DNN's blocked one reordered).
mxnet::NDArray plain(const mxnet::NDArray& a) {
  return a.IsMKLDNNData() ? a.Reorder2Default() : a;
}

// ------------------------------------------------------------ registration --

// The channel count of the layer's input `data`, whose dimensions are known
// (checked: 2 to 5 of them, the axis in range; -1 while the channel's size is
// unknown), with the per-channel inputs in[first .. first + 3] (gamma, beta,
// running_mean, running_var) set to (C,).
int64_t infer_channels(const Params& p, const mxnet::TShape& data, mxnet::ShapeVector* in,
                       int first, int* axis_out) {
  const int ndim = data.ndim();
  if (ndim < 2 || ndim > 5)
    refuse(message("bad_ndim", {{"layer", layer_name(p)}, {"ndim", std::to_string(ndim)}}));
  const int axis = p.axis < 0 ? p.axis + ndim : p.axis;
  if (axis < 0 || axis >= ndim)
    refuse(message("bad_axis", {{"layer", layer_name(p)}, {"axis", std::to_string(p.axis)},
                                {"ndim", std::to_string(ndim)}}));
  const int64_t channels = data[axis];
  for (int i = 0; i < 4; ++i) {
    const mxnet::TShape& s = (*in)[first + i];
    if (mxnet::ndim_is_known(s) && s.ndim() == 1 && s[0] > 0 && s[0] != channels && channels > 0)
      refuse(message("wrong_channels", {{"layer", layer_name(p)},
                                        {"channels", std::to_string(channels)},
                                        {"axis", std::to_string(p.axis)},
                                        {"expected", std::to_string(s[0])}}));
    (*in)[first + i] = mxnet::TShape(1, channels);
  }
  *axis_out = axis;
  return channels;
}

bool default_storage(const nnvm::NodeAttrs&, const int, mxnet::DispatchMode* mode,
                     std::vector<int>* in, std::vector<int>* out) {
  for (auto& s : *in) s = mxnet::kDefaultStorage;
  for (auto& s : *out) s = mxnet::kDefaultStorage;
  *mode = mxnet::DispatchMode::kFComputeEx;
  return true;
}

mxnet::ExecType async_exec(const nnvm::NodeAttrs&) { return mxnet::ExecType::kAsync; }

// A backward node's gradient, asked for only by a higher-order gradient
// (autograd.grad(..., create_graph=True)): refused, naming the layer.
std::vector<nnvm::NodeEntry> no_higher_order(const nnvm::ObjectPtr& node,
                                             const std::vector<nnvm::NodeEntry>&) {
  // The backward node's control dependency is its forward node (make_node),
  // whose arguments name the layer.
  const auto& forward = node_control_deps(node);
  const std::string layer =
      forward.empty() ? "?" : layer_name(node_params(forward[0]->attrs));
  refuse(message("no_higher_order", {{"layer", layer}}));
  return {};
}

// A backward node's attributes, shared by both operators' backward nodes.
nnvm::Op* register_backward(const char* name, int inputs, int outputs) {
  nnvm::Op* bwd = &dmlc::Registry<nnvm::Op>::Get()->__REGISTER_OR_GET__(name);
  bwd->set_num_inputs(inputs).set_num_outputs(outputs);
  set_attr<bool>(bwd, "TIsBackward", true);
  set_attr<bool>(bwd, "TIsLayerOpBackward", true);
  set_attr<mxnet::FInferStorageType>(bwd, "FInferStorageType", OLD_ABI(default_storage));
  set_attr<mxnet::FExecType>(bwd, "FExecType", OLD_ABI(async_exec));
  set_attr<nnvm::FGradient>(bwd, "FGradient", OLD_ABI(no_higher_order));
  return bwd;
}

}  // namespace
