// The asynchronous operator: CPU contexts' whole layer call as an MXNet
// operator of its own (registered in MXNet's C++ registry, see mxnet_abi.h)
// instead of a custom operator. It runs on the engine's worker of its device
// and returns at once: the call completes (async_on_complete) when the
// exchange does, on the thread of the last device to arrive (or of an abort,
// or of the watchdog at the timeout). No thread waits, no custom-operator
// hand-off, no temp-space slot.
//
//   forward:  x, gamma, beta, running mean/var (mutated) -> y
//             local moments -> FORWARD exchange -> normalize, running stats
//   backward: dy, x, gamma -> dx, d gamma, d beta
//             BACKWARD exchange of call #k (its statistics kept in the state)
//
// The maths are stats.h's (whole calls in host memory), in float64 on
// arrays read and written as the dtypes they have (float16, bfloat16,
// float32, float64: arrays.h), so no Cast surrounds the operator. MKL-DNN
// inputs are reordered into arrays the call holds until it completes.
// MXNet orders a stateful operator's backward after its forward through the
// state's engine variable (written by both), so backward always finds the
// statistics its forward left in the state.
#pragma once
#include "mxnet_abi.h"
#include "stats.h"
#include "operator.h"

#include <array>
#include <thread>

namespace {

const char* ASYNC_OP = "_gluon_syncbn_sync";
const char* ASYNC_BACKWARD_OP = "_backward_gluon_syncbn_sync";

// One node's state (one device's call; one device's node in static graphs),
// shared by its forward and backward.
struct AsyncState {
  Op op;                 // params, group, device, issue token
  int dev_id = 0;        // the CPU context's id: where its completion runs
  Info stats;            // the forward's global statistics and call number
};

// Runs `finish` (the part of a device's call after the exchange) on the
// worker of CPU context `dev_id`, as an engine operation there, so that each
// device normalizes its own slice in parallel with the others. It runs here
// and now instead if this thread is the one `issuer` names (the device
// arrived last, or failed at once), or if the slice has at most
// kFinishHereElements elements: pushing an engine operation costs about what
// normalizing that many elements does.
const int64_t kFinishHereElements = 1 << 14;

struct Finish { std::function<void()> fn; };
void run_finish(void*, void* param) { static_cast<Finish*>(param)->fn(); }
void delete_finish(void* param) { delete static_cast<Finish*>(param); }

// `finish` on the worker of CPU context `dev_id`, or here and now if this
// thread is the one `issuer` names.
void run_on_worker(int dev_id, std::thread::id issuer, std::function<void()> finish) {
  if (std::this_thread::get_id() == issuer) return finish();
  int ctx[2] = {1, dev_id};  // mxnet::Context{kCPU, dev_id}
  auto* f = new Finish{std::move(finish)};
  if (MXEnginePushSyncND(run_finish, f, delete_finish, ctx, nullptr, 0, nullptr, 0, nullptr, 0,
                         "gluon_syncbn_finish") != 0) {
    run_finish(nullptr, f);  // the engine refused: finish here rather than never
    delete_finish(f);
  }
}

void finish_on(int dev_id, std::thread::id issuer, int64_t elements,
               std::function<void()> finish) {
  if (elements <= kFinishHereElements) return finish();
  run_on_worker(dev_id, issuer, std::move(finish));
}

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

void complete(const mxnet::engine::CallbackOnComplete& on_complete, const std::string& error) {
  if (error.empty()) {
    on_complete();
  } else {
    fail_operation(on_complete, error);
  }
}

// The block's string arguments of a node (group, eps, momentum, ...).
Params node_params(const nnvm::NodeAttrs& attrs) {
  std::vector<const char*> keys, values;
  auto arguments = node_arguments(attrs);
  for (const auto& kv : arguments) {
    keys.push_back(kv.first.c_str());
    values.push_back(kv.second.c_str());
  }
  return parse_params(static_cast<int>(keys.size()), keys.data(), values.data());
}

// The engine variable of a layer's calls on one device, shared by all their
// states. A static graph makes one state per node and orders a node's
// operations only through its own state's variable (the running statistics
// are read-only inputs there), so without it a layer called twice per
// forward pass could run step k+1's first call before step k's second,
// numbering and updating them out of order; with it every call of the layer
// on the device runs in the order it was issued, the same on every device.
// One small variable per layer and device, kept for the process's life.
mxnet::Engine::VarHandle layer_variable(const std::string& group_id, int device) {
  static std::mutex& mutex = *new std::mutex();
  static auto& variables = *new std::map<std::pair<std::string, int>, mxnet::Engine::VarHandle>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& var = variables[std::make_pair(group_id, device)];
  if (var == nullptr) var = new_engine_variable();
  return var;
}

// The instance of a graph node on context `ctx`: its arguments, its layer's
// group and this device's place in it, the step it is issued in.
Op node_op(const nnvm::NodeAttrs& attrs, const mxnet::Context& ctx) {
  Op op;
  op.params = node_params(attrs);
  std::string error;
  op.group = find_group(op.params.group_id, &error);
  CHECK(op.group) << error;
  const std::string kind = ctx.dev_type == mxnet::Context::kGPU ? "gpu(" : "cpu(";
  op.device = device_index(*op.group, kind + std::to_string(ctx.dev_id) + ")", &error);
  CHECK_GE(op.device, 0) << error;
  op.token = issue_token();
  return op;
}

mxnet::OpStatePtr async_create_state(const nnvm::NodeAttrs& attrs, mxnet::Context ctx,
                                     const mxnet::ShapeVector& in_shapes,
                                     const std::vector<int>&) {
  auto* state = new AsyncState();
  state->dev_id = ctx.dev_id;
  state->op = node_op(attrs, ctx);
  std::string error;  // the channel count: gamma's shape, as shape inference set it
  CHECK(attach_remote(*state->op.group, in_shapes[1].Size(), &error)) << error;
  return make_state(state, layer_variable(state->op.params.group_id, state->op.device));
}

// What a call needs once its exchange is done, whichever thread finishes it:
// one allocation per call, shared by its continuations. The state (and its
// parameters) outlives the call: MXNet holds it until the call completes.
struct Call {
  AsyncState* state;
  std::vector<mxnet::NDArray> keep;  // alive (x's reordered copy with them) till completion
  Layout l;
  mxnet::engine::CallbackOnComplete on_complete;
  std::thread::id issuer;  // the thread that issued the call (see finish_on)
};

struct ForwardCall : Call {
  Array x, gamma, beta, rmean, rvar, y;
  int write;
  uint64_t token;
  int64_t call;
};

struct BackwardCall : Call {
  Array dy, x, gamma, dx, dgamma, dbeta;
  std::array<int, 3> reqs;
  Info stats;
  std::vector<double> sum_dy, sum_dy_xc;
};

// After the forward exchange: the running statistics and y.
void finish_forward(const ForwardCall& c, const std::vector<double>& total) {
  const Params& p = c.state->op.params;
  Info stats = merge(total);
  stats.token = static_cast<double>(c.token);
  stats.call = static_cast<double>(c.call);
  update_running(p, c.rmean, c.rvar, stats);  // mutable inputs: ours to write
  normalize(p, c.l, c.x, c.gamma, c.beta, stats, c.y, c.write);
  c.state->stats = stats;
  complete(c.on_complete, "");
}

// After the backward exchange: dx, d gamma and d beta.
void finish_backward(const BackwardCall& c, const std::vector<double>& total) {
  write_gradients(c.state->op.params, c.l, c.dy, c.x, c.gamma, c.stats, total, c.sum_dy,
                  c.sum_dy_xc, c.dx, c.dgamma, c.dbeta, c.reqs.data());
  complete(c.on_complete, "");
}

void async_forward(const mxnet::OpStatePtr& state_ptr, const mxnet::OpContext& ctx,
                   const std::vector<mxnet::NDArray>& in, const std::vector<mxnet::OpReqType>& req,
                   const std::vector<mxnet::NDArray>& out) {
  AsyncState& state = state_ptr.get_state<AsyncState>();
  const Op& op = state.op;
  const Params& p = op.params;
  const mxnet::NDArray x_nd = plain(in[0]);
  auto c = std::make_shared<ForwardCall>();
  c->x = array_of(x_nd);
  c->gamma = array_of(in[1]);
  c->beta = array_of(in[2]);
  c->rmean = array_of(in[3]);
  c->rvar = array_of(in[4]);
  c->y = array_of(out[0]);
  c->write = req[0];
  c->l = Layout(c->x.shape, p.axis);
  if (!ctx.is_train) {  // predict mode inside a graph: the running statistics
    normalize(p, c->l, c->x, c->gamma, c->beta, running_statistics(c->rmean, c->rvar), c->y,
              c->write);
    state.stats = Info();  // call < 0: no backward through it
    ctx.async_on_complete();
    return;
  }
  std::vector<double> mean, var;
  const double count = local_moments(c->l, c->x, &mean, &var);
  c->on_complete = ctx.async_on_complete;
  std::string error;
  if (!number_call(*op.group, op.device, p.static_shape, op.token, &c->token, &c->call, &error))
    return complete(c->on_complete, error);
  c->state = &state;
  c->keep = {x_nd, in[1], in[2], in[3], in[4], out[0]};
  c->issuer = std::this_thread::get_id();
  exchange_async(*op.group, Key(0, c->token, c->call), op.device,
                 pack_forward(count, mean, var), p.dtype_name,
                 [c](const std::string& error, const std::vector<double>& total) {
    if (!error.empty()) return complete(c->on_complete, error);
    finish_on(c->state->dev_id, c->issuer, c->x.size(), [c, total]() {
      finish_forward(*c, total);
    });
  });
}

void async_backward(const mxnet::OpStatePtr& state_ptr, const mxnet::OpContext& ctx,
                    const std::vector<mxnet::NDArray>& in,
                    const std::vector<mxnet::OpReqType>& req,
                    const std::vector<mxnet::NDArray>& out) {
  AsyncState& state = state_ptr.get_state<AsyncState>();
  const Op& op = state.op;
  const Params& p = op.params;
  auto c = std::make_shared<BackwardCall>();
  const mxnet::NDArray dy_nd = plain(in[0]), x_nd = plain(in[1]);
  c->dy = array_of(dy_nd);
  c->x = array_of(x_nd);
  c->gamma = array_of(in[2]);
  c->dx = array_of(out[0]);
  c->dgamma = array_of(out[1]);
  c->dbeta = array_of(out[2]);
  c->reqs = {req[0], req[1], req[2]};
  c->on_complete = ctx.async_on_complete;
  c->stats = state.stats;
  if (c->stats.call < 0) return complete(c->on_complete, inference_backward(op.group->name));
  // A head gradient may have any dtype (autograd.backward does not check).
  std::string error = dtype_problem(op.group->name, "the gradient of its output", c->dy.dtype);
  if (!error.empty()) {
    abort_step(error);  // the other devices' backward calls would wait for this one
    return complete(c->on_complete, error);
  }
  c->l = Layout(c->x.shape, p.axis);
  backward_sums(c->l, c->dy, c->x, c->stats, &c->sum_dy, &c->sum_dy_xc);
  if (!backward_current(*op.group, p.static_shape, op.token, &error))
    return complete(c->on_complete, error);
  c->state = &state;
  c->keep = {dy_nd, x_nd, in[2], out[0], out[1], out[2]};
  c->issuer = std::this_thread::get_id();
  exchange_async(*op.group, Key(1, static_cast<uint64_t>(c->stats.token),
                                static_cast<int64_t>(c->stats.call)),
                 op.device, pack_backward(c->sum_dy, c->sum_dy_xc), p.dtype_name,
                 [c](const std::string& error, const std::vector<double>& total) {
    if (!error.empty()) return complete(c->on_complete, error);
    finish_on(c->state->dev_id, c->issuer, c->x.size(), [c, total]() { finish_backward(*c, total); });
  });
}

// ------------------------------------------------------------ registration --

// The channel count of the layer's input `data`, whose dimensions are known
// (checked: 2 to 5 of them, the axis in range; -1 while the channel's size is
// unknown), with the per-channel inputs in[first .. first + 3] (gamma, beta,
// running_mean, running_var) set to (C,).
int64_t infer_channels(const Params& p, const mxnet::TShape& data, mxnet::ShapeVector* in,
                       int first, int* axis_out) {
  const int ndim = data.ndim();
  std::string name = layer_name(p);
  CHECK(ndim >= 2 && ndim <= 5) << message("bad_ndim", {{"layer", name},
                                                        {"ndim", std::to_string(ndim)}});
  const int axis = p.axis < 0 ? p.axis + ndim : p.axis;
  CHECK(axis >= 0 && axis < ndim) << message("bad_axis", {{"layer", name},
                                                          {"axis", std::to_string(p.axis)},
                                                          {"ndim", std::to_string(ndim)}});
  const int64_t channels = data[axis];
  for (int i = 0; i < 4; ++i) {
    const mxnet::TShape& s = (*in)[first + i];
    if (mxnet::ndim_is_known(s) && s.ndim() == 1 && s[0] > 0 && s[0] != channels && channels > 0)
      LOG(FATAL) << message("wrong_channels", {{"layer", name},
                                              {"channels", std::to_string(channels)},
                                              {"axis", std::to_string(p.axis)},
                                              {"expected", std::to_string(s[0])}});
    (*in)[first + i] = mxnet::TShape(1, channels);
  }
  *axis_out = axis;
  return channels;
}

bool async_infer_shape(const nnvm::NodeAttrs& attrs, mxnet::ShapeVector* in,
                       mxnet::ShapeVector* out) {
  const mxnet::TShape& data = (*in)[0];
  if (!mxnet::ndim_is_known(data)) return false;
  int axis = 0;
  infer_channels(node_params(attrs), data, in, 1, &axis);
  (*out)[0] = data;
  return mxnet::shape_is_known(data);
}

bool async_infer_type(const nnvm::NodeAttrs& attrs, std::vector<int>* in,
                      std::vector<int>* out) {
  const int data = (*in)[0];
  if (data < 0) return false;
  if (!is_float(data))  // the layer's name only then: this runs at every imperative call
    LOG(FATAL) << dtype_problem(layer_name(node_params(attrs)), "its input", data);
  const int param = (*in)[1] >= 0 ? (*in)[1] : kFloat32;
  for (int i = 1; i < 5; ++i) (*in)[i] = param;
  (*out)[0] = data;
  return true;
}

bool async_infer_storage(const nnvm::NodeAttrs&, const int, mxnet::DispatchMode* mode,
                         std::vector<int>* in, std::vector<int>* out) {
  for (auto& s : *in) s = mxnet::kDefaultStorage;
  for (auto& s : *out) s = mxnet::kDefaultStorage;
  *mode = mxnet::DispatchMode::kFComputeEx;
  return true;
}

std::vector<std::string> async_input_names(const nnvm::NodeAttrs&) {
  return {"data", "gamma", "beta", "running_mean", "running_var"};
}

std::vector<uint32_t> async_mutated(const nnvm::NodeAttrs&) { return {3, 4}; }

mxnet::ExecType async_exec(const nnvm::NodeAttrs&) { return mxnet::ExecType::kAsync; }

// Backward node: dy, x, gamma in; d x, d gamma, d beta out; the running
// statistics get no gradient (as nn.BatchNorm's).
std::vector<nnvm::NodeEntry> async_gradient(const nnvm::ObjectPtr& node,
                                            const std::vector<nnvm::NodeEntry>& out_grads) {
  const auto& inputs = reinterpret_cast<const NodeLayout*>(node.get())->inputs;
  nnvm::ObjectPtr grad = make_node(ASYNC_BACKWARD_OP, {out_grads[0], inputs[0], inputs[1]},
                                   {node});
  nnvm::ObjectPtr none = make_node("_NoGradient", {}, {});
  return {nnvm::NodeEntry(grad, 0, 0), nnvm::NodeEntry(grad, 1, 0),
          nnvm::NodeEntry(grad, 2, 0), nnvm::NodeEntry(none, 0, 0),
          nnvm::NodeEntry(none, 0, 0)};
}

void register_async_op() {
  auto* registry = dmlc::Registry<nnvm::Op>::Get();
  nnvm::Op* fwd = &registry->__REGISTER_OR_GET__(ASYNC_OP);
  fwd->set_num_inputs(5).set_num_outputs(1);
  for (const char* name : {"data", "gamma", "beta", "running_mean", "running_var"})
    fwd->add_argument(name, "NDArray-or-Symbol", name);
  set_attr<nnvm::FListInputNames>(fwd, "FListInputNames", OLD_ABI(async_input_names));
  set_attr<nnvm::FMutateInputs>(fwd, "FMutateInputs", OLD_ABI(async_mutated));
  set_attr<mxnet::FInferShape>(fwd, "FInferShape", OLD_ABI(async_infer_shape));
  set_attr<nnvm::FInferType>(fwd, "FInferType", OLD_ABI(async_infer_type));
  set_attr<mxnet::FInferStorageType>(fwd, "FInferStorageType", OLD_ABI(async_infer_storage));
  set_attr<mxnet::FCreateOpState>(fwd, "FCreateOpState", OLD_ABI(async_create_state));
  set_attr<mxnet::FExecType>(fwd, "FExecType", OLD_ABI(async_exec));
  set_attr<bool>(fwd, "TIsMKLDNN", true);  // inputs as they are: plain() reorders
  set_attr<mxnet::FStatefulComputeEx>(fwd, "FStatefulComputeEx<cpu>", OLD_ABI(async_forward));
  set_attr<nnvm::FGradient>(fwd, "FGradient", OLD_ABI(async_gradient));
  nnvm::Op* bwd = &registry->__REGISTER_OR_GET__(ASYNC_BACKWARD_OP);
  bwd->set_num_inputs(3).set_num_outputs(3);
  set_attr<bool>(bwd, "TIsBackward", true);
  set_attr<bool>(bwd, "TIsLayerOpBackward", true);
  set_attr<mxnet::FInferStorageType>(bwd, "FInferStorageType", OLD_ABI(async_infer_storage));
  set_attr<mxnet::FExecType>(bwd, "FExecType", OLD_ABI(async_exec));
  set_attr<bool>(bwd, "TIsMKLDNN", true);
  set_attr<mxnet::FStatefulComputeEx>(bwd, "FStatefulComputeEx<cpu>", OLD_ABI(async_backward));
}

}  // namespace
