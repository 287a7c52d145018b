// The exchange operator: the GPU path's synchronization step as an
// asynchronous operator of MXNet's own kind (registered for cpu and gpu
// contexts in MXNet's C++ registry, see mxnet_abi.h), with no thread blocked
// and no synchronous copy.
//
//   forward:  packed [m1 | m2 | v | gamma | beta] (the block's concat), data,
//             gamma, beta (their shapes only), running mean/var (mutated)
//             -> [scale ; shift], shape (2, 1, .., C, .., 1): each half
//             broadcasts against data
//   backward: d [scale ; shift] -> d packed (m1's part zero)
//
// Its compute function never touches device memory. It issues MXNet's own
// engine copies (CopyFromTo) from a fresh-variable view of the packed input to
// host staging (pinned memory for a GPU), then an engine operation that reads
// the staging array, so it runs once the copy has completed; that operation
// hands the host vector to meet_async (session.h). Each device's
// continuation, on its own cpu(dev_id) worker, computes scale and shift
// (stats.h's per-channel part), writes them to host staging, CopyFromTo's
// them into a fresh-variable view of the output, queues the running
// statistics' read-modify-write with MXNet's operators, and a last engine
// operation reading the output's view (and the running statistics' views)
// completes the call. The protocol of a call is SyncCall's (sync_call.h).
//
// Why fresh-variable views: the engine holds this operator's own variables
// (its output's, its inputs') until it completes, so a copy declared on them
// would wait for the operator while the operator waits for the copy. The
// views' memory is the operator's, alive until it completes, and a view is
// used only while its call runs.
//
// The sample count and the output's shape come from data's shape, which
// needs no copy; the forward's statistics, m1, gamma and count stay in the
// state for the backward call: one packed copy each way per call, forward
// and backward.
//
// The views and the host staging stay from call to call of the layer on the
// device (see Staging): each new engine variable would cost an engine
// operation to delete.
#pragma once
#include <climits>
#include <cstdio>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "mxnet_abi.h"
#include "stats.h"
#include "sync_call.h"

namespace {

const char* EXCHANGE_OP = "_gluon_syncbn_exchange";
const char* EXCHANGE_BACKWARD_OP = "_backward_gluon_syncbn_exchange";


// Turns off the engine's bulking on this thread for its scope. A thread
// inside a bulked segment (the main thread running a graph, where this
// operator's compute may run inline) appends a synchronous operation to the
// segment instead of pushing it, and the segment runs as one operation that
// waits for all its variables: among them this operator's output, so an
// operation this operator waits for would wait for it (a deadlock), and
// dependencies would be registered out of order. Setting the size flushes
// what the segment holds so far.
struct NoBulk {
  int previous = 0;
  NoBulk() { MXEngineSetBulkSize(0, &previous); }
  ~NoBulk() {
    int zero = 0;
    MXEngineSetBulkSize(previous, &zero);
  }
};

bool on_gpu(const mxnet::NDArray& a) { return a.ctx().dev_type == mxnet::Context::kGPU; }

// A new engine variable over a's memory (see above), flat like the staging
// arrays it is copied to and from.
mxnet::NDArray fresh_view(const mxnet::NDArray& a) {
  return mxnet::NDArray(a.data().reshape(mxnet::TShape(1, a.shape().Size())), a.ctx().dev_id);
}

// Host memory for copies to and from `like`'s device: pinned for a GPU; for a
// CPU context that context itself, whose worker runs copies from it (MXNet
// runs a CPU-to-CPU copy on the source's), not cpu(0)'s.
mxnet::NDArray staging(const mxnet::NDArray& like, int64_t size, int dtype) {
  const mxnet::Context ctx = on_gpu(like) ? mxnet::Context::CPUPinned(like.ctx().dev_id)
                                          : like.ctx();
  return mxnet::NDArray(mxnet::TShape(1, size), ctx, false, dtype);
}

// A device array's fresh-variable view and its host staging, kept from call
// to call of one layer on one device. Reusing them is safe because MXNet
// orders every call of the layer on the device (forward and backward, every
// graph node) after the completion of the one before (their states' engine
// variable is the layer's, see exchange_create_state), and a call completes
// only after every operation it queued on them: the copies to and from the
// views and the engine operations reading the staging.
struct Staging {
  mxnet::NDArray view, host;

  // The view of `a`, made anew only when `a`'s memory changed (imperative
  // calls, the first call of a graph).
  const mxnet::NDArray& view_of(const mxnet::NDArray& a) {
    if (view.is_none() || view.data().dptr_ != a.data().dptr_ ||
        view.shape().Size() != a.shape().Size() || view.dtype() != a.dtype())
      view = fresh_view(a);
    return view;
  }

  // The view of `a` and staging of `size` elements of `dtype`.
  void of(const mxnet::NDArray& a, int64_t size, int dtype) {
    view_of(a);
    if (host.is_none() || static_cast<int64_t>(host.shape().Size()) != size ||
        host.dtype() != dtype)
      host = staging(a, size, dtype);
  }
};

// forward: packed in, (predict mode) running mean and variance in, output
// out; backward: d output in, d packed out
struct LayerStaging {
  Staging packed, running_mean, running_var, out, d_out, d_packed;
};

// The staging of every layer on every device: shared by the layer's states
// (imperative calls, each graph) until the layer is gone
// (forget_layer_staging); a state that outlives it keeps its own.
std::mutex& g_staging_mutex = *new std::mutex();
auto& g_staging = *new std::map<LayerKey, std::shared_ptr<LayerStaging>>();

std::shared_ptr<LayerStaging> layer_staging(const LayerKey& key) {
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  auto& staging = g_staging[key];
  if (!staging) staging = std::make_shared<LayerStaging>();
  return staging;
}

// The layer of `group` was garbage-collected (gsbn_group_remove).
void forget_layer_staging(const GroupId& group) {
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  g_staging.erase(g_staging.lower_bound(layer_key(group, INT_MIN)),
                  g_staging.upper_bound(layer_key(group, INT_MAX)));
}

size_t staging_layers() {
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  return g_staging.size();
}

struct ExchangeState : Op {
  std::vector<double> m1, gamma;  // the forward's, for the backward call
  double count = 0;
  std::shared_ptr<LayerStaging> staging;
};

// A host array, flat.
Array host_array(const mxnet::NDArray& a) {
  Array h = array_of(a);
  h.shape = {h.size()};
  return h;
}

std::vector<double> read_host(const mxnet::NDArray& a, int64_t begin, int64_t end) {
  return values(host_array(a), begin, end);
}

// CopyFromTo, with its CHECK failures as an error.
bool copy_to(const mxnet::NDArray& from, const mxnet::NDArray& to, std::string* error) {
  try {
    mxnet::CopyFromTo(from, to, 0, false);
    return true;
  } catch (const std::exception& e) {
    *error = e.what();
    return false;
  }
}

// An NDArray handle of the C API, freed at scope exit.
struct Handle {
  NDArrayHandle h = nullptr;
  ~Handle() {
    if (h != nullptr) MXNDArrayFree(h);
  }
};

// Elements [begin, begin + n) of the 1-D array `a` as a (1, n) matrix: the
// same memory and engine variable.
bool row_view(const mxnet::NDArray& a, int64_t begin, int64_t n, Handle* out) {
  Handle part;
  dim_t dims[2] = {1, n};
  return MXNDArraySlice(const_cast<mxnet::NDArray*>(&a), static_cast<uint32_t>(begin),
                        static_cast<uint32_t>(begin + n), &part.h) == 0 &&
         MXNDArrayReshape64(part.h, 2, dims, false, &out->h) == 0;
}

// Queue running = momentum * running + (1 - momentum) * batch for the running
// mean and variance (arrays on any device) with MXNet's own operators,
// without waiting: each read-modify-write runs in engine order, after every
// operation already issued on the array and before every later one, however
// far the main thread runs ahead (a new value computed from a read made now,
// then copied in, would lose an update queued in between). One linalg_gemm
// per array, C := alpha * A * B + beta * C with A = [1], B the batch's
// statistics and alpha, beta in double; [1 | mean | var] reaches the device
// by one engine copy.
bool queue_running_updates(const std::vector<mxnet::NDArray>& running, const Info& stats,
                           double momentum, std::string* error) {
  const mxnet::NDArray& like = running[0];
  const int64_t C = static_cast<int64_t>(stats.mean.size());
  mxnet::NDArray batch(mxnet::TShape(1, 1 + 2 * C), like.ctx(), false, like.dtype());
  mxnet::NDArray host = on_gpu(like) ? staging(like, 1 + 2 * C, like.dtype()) : batch;
  Array h = host_array(host);
  put(h, 0, 1.0, 1);
  for (int64_t c = 0; c < C; ++c) {
    put(h, 1 + c, stats.mean[c], 1);
    put(h, 1 + C + c, stats.var[c], 1);
  }
  if (on_gpu(like) && !copy_to(host, batch, error)) return false;
  char alpha[32], beta[32];
  std::snprintf(alpha, sizeof(alpha), "%.17g", 1.0 - momentum);
  std::snprintf(beta, sizeof(beta), "%.17g", momentum);
  Handle one, mean, var, running_mean, running_var;
  if (!row_view(batch, 0, 1, &one) || !row_view(batch, 1, C, &mean) ||
      !row_view(batch, 1 + C, C, &var) || !row_view(running[0], 0, C, &running_mean) ||
      !row_view(running[1], 0, C, &running_var) ||
      !invoke("_linalg_gemm", {one.h, mean.h, running_mean.h}, running_mean.h,
              {"alpha", "beta"}, {alpha, beta}) ||
      !invoke("_linalg_gemm", {one.h, var.h, running_var.h}, running_var.h,
              {"alpha", "beta"}, {alpha, beta})) {
    *error = MXGetLastError();
    return false;
  }
  return true;
}

mxnet::OpStatePtr exchange_create_state(const nnvm::NodeAttrs& attrs, mxnet::Context ctx,
                                        const mxnet::ShapeVector& in_shapes,
                                        const std::vector<int>&) {
  auto* state = new ExchangeState();
  // the channel count: gamma's shape, as shape inference set it
  mxnet::OpStatePtr ptr = create_state(state, attrs, ctx, in_shapes[2].Size());
  state->staging = layer_staging(layer_key(state->params.group_id, state->device));
  return ptr;
}

// A call of the exchange operator: its state, and what its continuations use.
struct ExchangeCall : SyncCall {
  ExchangeState& state;
  int64_t C = 0;
  bool write = true;
  ExchangeCall(const mxnet::OpStatePtr& ptr, const mxnet::OpContext& ctx)
      : SyncCall(ptr, ptr.get_state<ExchangeState>(), ctx),
        state(ptr.get_state<ExchangeState>()) {}
};

struct ExchangeForward : ExchangeCall {
  using ExchangeCall::ExchangeCall;
  bool train = false, ordered = false;
  double count = 0;
  std::vector<mxnet::NDArray> hosts, running;
  mxnet::NDArray out_view, out_host;
};

struct ExchangeBackward : ExchangeCall {
  using ExchangeCall::ExchangeCall;
  mxnet::NDArray dy_host, gin_view, gin_host;
};

// Scale and shift into the output, the running statistics' update queued,
// and the done-operation that completes the call once they are written.
void finish_forward(const std::shared_ptr<ExchangeForward>& c, const std::vector<double>& m1,
                    const std::vector<double>& gamma, const std::vector<double>& beta,
                    const Info& stats) {
  NoBulk no_bulk;
  const int64_t C = c->C;
  std::vector<double> scale, shift;
  normalize_coefficients(c->op.params, stats, m1, gamma, beta, &scale, &shift);
  Array h = host_array(c->out_host);
  for (int64_t ch = 0; ch < C; ++ch) {
    put(h, ch, scale[ch], 1);
    put(h, C + ch, shift[ch], 1);
  }
  std::string error;
  std::vector<mxnet::NDArray> wait = {c->out_view};
  if (c->write && !copy_to(c->out_host, c->out_view, &error)) return c->fail_call(error);
  if (c->train) {
    if (!queue_running_updates(c->running, stats, c->op.params.momentum, &error))
      return c->fail_call(error);
    if (!c->ordered) wait.insert(wait.end(), c->running.begin(), c->running.end());
  }
  c->run_after(wait, [c]() { c->complete(); }, "gluon_syncbn_exchange_done");
}

// On the host, once the packed vector is: the forward's vectors kept for
// the backward call, and the FORWARD exchange (predict mode: the running
// statistics instead).
void forward_step(const std::shared_ptr<ExchangeForward>& c) {
  NoBulk no_bulk;
  const int64_t C = c->C;
  const mxnet::NDArray& host = c->hosts[0];
  std::vector<double> m1 = read_host(host, 0, C), m2 = read_host(host, C, 2 * C),
                      v = read_host(host, 2 * C, 3 * C), gamma = read_host(host, 3 * C, 4 * C),
                      beta = read_host(host, 4 * C, 5 * C);
  c->state.m1 = m1;
  c->state.gamma = gamma;
  c->state.count = c->count;
  if (!c->train) {
    Info stats;  // call < 0: no backward through it
    stats.mean = read_host(c->hosts[1], 0, C);
    stats.var = read_host(c->hosts[2], 0, C);
    c->state.stats = stats;
    return finish_forward(c, m1, gamma, beta, stats);
  }
  c->exchange_forward(forward_contribution(c->count, m1, m2, v),
                      [c, m1, gamma, beta](const Info& stats) {
    // Each device issues its own copies and updates, in parallel with the others.
    c->run_on_worker([=]() { finish_forward(c, m1, gamma, beta, stats); });
  });
}

// Inputs: packed, data, gamma, beta, running_mean, running_var.
void exchange_op_forward(const mxnet::OpStatePtr& state, const mxnet::OpContext& ctx,
                         const std::vector<mxnet::NDArray>& in,
                         const std::vector<mxnet::OpReqType>& req,
                         const std::vector<mxnet::NDArray>& out) {
  NoBulk no_bulk;
  auto c = std::make_shared<ExchangeForward>(state, ctx);
  const Params& p = c->op.params;
  const Group& g = *c->op.group;
  const int64_t C = c->C = static_cast<int64_t>(in[4].shape().Size());
  const mxnet::NDArray packed = plain(in[0]);
  const int64_t P = static_cast<int64_t>(packed.shape().Size());
  const std::string& device = g.devices[c->op.device];
  if (P != 5 * C || C == 0)
    return c->fail_call("on " + device + " the exchange operator got a packed input of " +
                        std::to_string(P) + " elements for " + std::to_string(C) +
                        " channels (5 per channel expected)");
  if (req[0] == kAddTo)
    return c->fail_call("on " + device + " the exchange operator was asked to add to its "
                        "output, which it cannot");
  c->count = static_cast<double>(in[1].shape().Size()) / static_cast<double>(C);
  c->train = ctx.is_train;
  c->write = req[0] != kNull;
  if (c->train && !c->number()) return;
  // Device to host: the packed vector (and in predict mode the running statistics).
  LayerStaging& staged = *c->state.staging;
  std::vector<Staging*> down = {&staged.packed};
  std::vector<mxnet::NDArray> sources = {packed};
  if (!c->train) {
    down.insert(down.end(), {&staged.running_mean, &staged.running_var});
    sources.insert(sources.end(), {plain(in[4]), plain(in[5])});
  }
  std::string error;
  for (size_t i = 0; i < sources.size(); ++i) {
    const mxnet::NDArray& a = sources[i];
    down[i]->of(a, static_cast<int64_t>(a.shape().Size()), a.dtype());
    c->hosts.push_back(down[i]->host);
    if (!copy_to(down[i]->view, c->hosts.back(), &error)) return c->fail_call(error);
  }
  staged.out.of(out[0], 2 * C, out[0].dtype());
  c->out_view = staged.out.view;
  c->out_host = staged.out.host;
  // The running statistics' arrays: the Parameter's own in static_shape
  // graphs, whose auxiliary states are read-only (queued behind every earlier
  // operation on them); else this call's mutable inputs, through views
  // written before the call completes.
  c->ordered = p.static_shape && g.running.size() == g.devices.size();
  if (c->train) {
    if (c->ordered) {
      for (NDArrayHandle h : g.running[c->op.device])
        c->running.push_back(*static_cast<mxnet::NDArray*>(h));
    } else {
      c->running = {staged.running_mean.view_of(plain(in[4])),
                    staged.running_var.view_of(plain(in[5]))};
    }
  }
  c->keep = {in[0], in[4], in[5], out[0], packed};
  c->run_after(c->hosts, [c]() { forward_step(c); }, "gluon_syncbn_exchange");
}

// After the BACKWARD exchange: d packed into the input's gradient, and the
// done-operation that completes the call once it is written.
void finish_backward(const std::shared_ptr<ExchangeBackward>& c, const std::vector<double>& total,
                     const std::vector<double>& gamma, const std::vector<double>& inv_stds,
                     const std::vector<double>& d_gamma, const std::vector<double>& d_shift) {
  if (!c->write) return c->complete();
  NoBulk no_bulk;
  const int64_t C = c->C;
  std::vector<double> d_m2, d_v;
  local_moment_grads(total, c->state.count, c->stats, c->state.m1, gamma, inv_stds, &d_m2, &d_v);
  Array h = host_array(c->gin_host);
  for (int64_t ch = 0; ch < C; ++ch) {
    put(h, ch, 0.0, 1);  // m1: a constant
    put(h, C + ch, d_m2[ch], 1);
    put(h, 2 * C + ch, d_v[ch], 1);
    put(h, 3 * C + ch, d_gamma[ch], 1);
    put(h, 4 * C + ch, d_shift[ch], 1);  // d beta = sum dy
  }
  std::string error;
  if (!copy_to(c->gin_host, c->gin_view, &error)) return c->fail_call(error);
  c->run_after({c->gin_view}, [c]() { c->complete(); }, "gluon_syncbn_exchange_done");
}

// On the host, once d [scale | shift] is: the BACKWARD exchange.
void backward_step(const std::shared_ptr<ExchangeBackward>& c) {
  NoBulk no_bulk;
  const int64_t C = c->C;
  std::vector<double> d_scale = read_host(c->dy_host, 0, C),
                      d_shift = read_host(c->dy_host, C, 2 * C);
  std::vector<double> gamma = c->state.gamma, inv_stds, d_gamma;
  std::vector<double> contribution =
      backward_contribution(c->op.params, c->stats, c->state.m1, c->state.count, &gamma,
                            &d_scale, &d_shift, &inv_stds, &d_gamma);
  c->exchange_backward(contribution, [=](const std::vector<double>& total) {
    finish_backward(c, total, gamma, inv_stds, d_gamma, d_shift);
  });
}

// Input: d [scale | shift]; output: d packed.
void exchange_op_backward(const mxnet::OpStatePtr& state, const mxnet::OpContext& ctx,
                          const std::vector<mxnet::NDArray>& in,
                          const std::vector<mxnet::OpReqType>& req,
                          const std::vector<mxnet::NDArray>& out) {
  NoBulk no_bulk;
  auto c = std::make_shared<ExchangeBackward>(state, ctx);
  if (!c->has_forward(in[0].dtype())) return;
  if (req[0] == kAddTo)
    return c->fail_call("on " + c->op.group->devices[c->op.device] + " the exchange operator "
                        "was asked to add to its input's gradient, which it cannot");
  if (!c->current()) return;
  const int64_t C = c->C = static_cast<int64_t>(c->state.m1.size());
  const mxnet::NDArray dy = plain(in[0]);
  LayerStaging& staged = *c->state.staging;
  staged.d_out.of(dy, 2 * C, dy.dtype());
  c->dy_host = staged.d_out.host;
  std::string error;
  if (!copy_to(staged.d_out.view, c->dy_host, &error)) return c->fail_call(error);
  staged.d_packed.of(out[0], static_cast<int64_t>(out[0].shape().Size()), out[0].dtype());
  c->gin_view = staged.d_packed.view;
  c->gin_host = staged.d_packed.host;
  c->write = req[0] != kNull;
  c->keep = {in[0], dy, out[0], c->gin_host};
  c->run_after({c->dy_host}, [c]() { backward_step(c); }, "gluon_syncbn_exchange_backward");
}

// ------------------------------------------------------------ registration --

bool exchange_infer_shape(const nnvm::NodeAttrs& attrs, mxnet::ShapeVector* in,
                          mxnet::ShapeVector* out) {
  const mxnet::TShape& data = (*in)[1];
  if (!mxnet::ndim_is_known(data)) return false;
  int axis = 0;
  const int64_t channels = infer_channels(node_params(attrs), data, in, 2, &axis);
  if (channels < 0) return false;
  (*in)[0] = mxnet::TShape(1, 5 * channels);  // [m1 | m2 | v | gamma | beta]
  mxnet::TShape halves(data.ndim() + 1, 1);  // [scale ; shift], each shaped to broadcast
  halves[0] = 2;
  halves[axis + 1] = channels;
  (*out)[0] = halves;
  return true;
}

bool exchange_infer_type(const nnvm::NodeAttrs& attrs, std::vector<int>* in,
                         std::vector<int>* out) {
  const int stat = (*in)[0];
  if (stat < 0) return false;
  CHECK(stat != kFloat16) << message("float16_statistics",
                                     {{"layer", layer_name(node_params(attrs))}});
  if ((*in)[1] < 0) (*in)[1] = stat;  // data: its shape only
  const int param = (*in)[2] >= 0 ? (*in)[2] : stat;
  for (int i = 2; i < 6; ++i) (*in)[i] = param;
  (*out)[0] = stat;
  return true;
}

const char* const EXCHANGE_INPUTS[] = {"packed", "data", "gamma", "beta", "running_mean",
                                       "running_var"};

std::vector<std::string> exchange_input_names(const nnvm::NodeAttrs&) {
  return {std::begin(EXCHANGE_INPUTS), std::end(EXCHANGE_INPUTS)};
}

std::vector<uint32_t> exchange_mutated(const nnvm::NodeAttrs&) { return {4, 5}; }

// d packed from the backward node; data, gamma and beta were read for their
// shapes only (their gradients flow through the packed input), the running
// statistics get none.
std::vector<nnvm::NodeEntry> exchange_gradient(const nnvm::ObjectPtr& node,
                                               const std::vector<nnvm::NodeEntry>& out_grads) {
  const auto& inputs = reinterpret_cast<const NodeLayout*>(node.get())->inputs;
  nnvm::ObjectPtr grad = make_node(EXCHANGE_BACKWARD_OP, {out_grads[0]}, {node});
  std::vector<nnvm::NodeEntry> out = {nnvm::NodeEntry(grad, 0, 0)};
  for (int i = 1; i < 4; ++i)
    out.emplace_back(make_node("zeros_like", {inputs[i]}, {}), 0, 0);
  nnvm::ObjectPtr none = make_node("_NoGradient", {}, {});
  out.emplace_back(none, 0, 0);
  out.emplace_back(none, 0, 0);
  return out;
}

// `fn` as `op`'s compute function on cpu, and on gpu where this libmxnet has
// GPU operators (the GPU wheel).
void set_compute(nnvm::Op* op, const mxnet::FStatefulComputeEx& fn) {
  set_attr<mxnet::FStatefulComputeEx>(op, "FStatefulComputeEx<cpu>", fn);
  if (nnvm::Op::GetAttrMap("FStatefulComputeEx<gpu>") != nullptr)
    set_attr<mxnet::FStatefulComputeEx>(op, "FStatefulComputeEx<gpu>", fn);
}

void register_exchange_op() {
  nnvm::Op* fwd = &dmlc::Registry<nnvm::Op>::Get()->__REGISTER_OR_GET__(EXCHANGE_OP);
  fwd->set_num_inputs(6).set_num_outputs(1);
  for (const char* name : EXCHANGE_INPUTS)
    fwd->add_argument(name, "NDArray-or-Symbol", name);
  set_attr<nnvm::FListInputNames>(fwd, "FListInputNames", OLD_ABI(exchange_input_names));
  set_attr<nnvm::FMutateInputs>(fwd, "FMutateInputs", OLD_ABI(exchange_mutated));
  set_attr<mxnet::FInferShape>(fwd, "FInferShape", OLD_ABI(exchange_infer_shape));
  set_attr<nnvm::FInferType>(fwd, "FInferType", OLD_ABI(exchange_infer_type));
  set_attr<mxnet::FInferStorageType>(fwd, "FInferStorageType", OLD_ABI(default_storage));
  set_attr<mxnet::FCreateOpState>(fwd, "FCreateOpState", OLD_ABI(exchange_create_state));
  set_attr<mxnet::FExecType>(fwd, "FExecType", OLD_ABI(async_exec));
  set_compute(fwd, OLD_ABI(exchange_op_forward));
  set_attr<nnvm::FGradient>(fwd, "FGradient", OLD_ABI(exchange_gradient));
  set_compute(register_backward(EXCHANGE_BACKWARD_OP, 1, 1), OLD_ABI(exchange_op_backward));
}

}  // namespace
