// The exchange operator: the GPU path's synchronization step as an
// asynchronous operator of MXNet's own kind (registered for cpu and gpu
// contexts in MXNet's C++ registry, see mxnet_abi.h), with no thread waiting
// for another device and no engine operation of its own but the
// continuations that let each device finish in parallel.
//
//   forward:  m1 (the centre, shaped to broadcast against the data), m2, v
//             (the local moments of data - m1), gamma, beta, running mean
//             and variance (mutated), data (its shape only)
//             -> scale, shift, each shaped like m1: the block computes
//             (data - m1) * scale + shift
//   backward: d scale, d shift, running mean and variance (mutated)
//             -> d m2, d v, d gamma, d beta
//
// One call reads its per-channel vectors from the device in one batch of
// copies, meets the other devices' calls (session.h, meet_async), and each
// device's continuation computes its scale and shift (stats.h), updates the
// running statistics read-modify-write in float64, and writes them all back
// in one batch before the call completes: one round trip to the host per
// call and direction (device_copies.h; on CPU contexts the arrays are read
// and written in place). The protocol of a call is SyncCall's (sync_call.h).
//
// The running statistics are mutable inputs of both calls, and one of them
// updates them with the call's global statistics, where MXNet's BatchNorm
// on that kind of device does: on GPUs the forward call, in call order, as
// cuDNN's training forward (cudnnBatchNormalizationForwardTraining, which
// takes the moving averages; MXNet's GPU BatchNorm runs it for every
// training call: batch_norm.cu, BatchNormCompute<gpu>); on CPU contexts
// (the argument running_update=backward) the backward call, as MXNet's CPU
// BatchNorm (async_op.h). Only this operator writes them in a training
// graph, and MXNet runs a layer's calls on a device one after another (their
// states share the layer's engine variable, sync_call.h), so the update is in
// order however far the main thread runs ahead, also in static_shape graphs,
// whose executor holds them as read-only inputs of the call (as the
// asynchronous operator's update).
//
// The forward's m1, local mean, gamma and count stay in the state, with its
// global statistics, for the backward call.
#pragma once
#include <climits>
#include <condition_variable>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>

#include "device_copies.h"
#include "mxnet_abi.h"
#include "stats.h"
#include "sync_call.h"

namespace {

const char* EXCHANGE_OP = "_gluon_syncbn_exchange";
const char* EXCHANGE_BACKWARD_OP = "_backward_gluon_syncbn_exchange";

// Inputs, in order, and the forward's and backward's host staging slots.
enum { kM1, kM2, kV, kGamma, kBeta, kRunningMean, kRunningVar, kData, kInputs };
enum { kForwardIn = 0, kForwardOut = 7, kBackwardIn = 9, kBackwardOut = 13 };

// Turns off the engine's bulking on this thread for its scope. A thread
// inside a bulked segment (the main thread running a graph, where this
// operator's compute may run inline) appends a synchronous operation (a
// continuation pushed to a worker) to the segment instead of pushing it, and
// the segment runs as one operation that waits for all its variables: among
// them this operator's outputs, so the continuation would wait for the call
// it completes. Setting the size flushes what the segment holds so far.
struct NoBulk {
  int previous = 0;
  NoBulk() { MXEngineSetBulkSize(0, &previous); }
  ~NoBulk() {
    int zero = 0;
    MXEngineSetBulkSize(previous, &zero);
  }
};

// One layer's host staging on one device, shared by its states (imperative
// calls, each graph) until the layer is gone (forget_layer_staging); a state
// that outlives it keeps its own.
struct LayerStaging {
  std::vector<HostBuffer> buffers;
  ~LayerStaging() {
    for (HostBuffer& b : buffers)
      if (b.data != nullptr) cuda_runtime().free_host(b.data);
  }
};

std::mutex& g_staging_mutex = *new std::mutex();
auto& g_staging = *new std::map<LayerKey, std::shared_ptr<LayerStaging>>();

std::shared_ptr<LayerStaging> layer_staging(const LayerKey& key) {
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  auto& staging = g_staging[key];
  if (!staging) staging = std::make_shared<LayerStaging>();
  return staging;
}

// The layer `layer` was garbage-collected (gsbn_layer_remove).
void forget_layer_staging(const LayerId& layer) {
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  g_staging.erase(g_staging.lower_bound(layer_key(layer, INT_MIN)),
                  g_staging.upper_bound(layer_key(layer, INT_MAX)));
}

size_t staging_layers() {
  std::lock_guard<std::mutex> lock(g_staging_mutex);
  return g_staging.size();
}

// Where a device's continuations run when its copies wait for a GPU: a
// thread of the device's own (started at its first use, kept for the
// process's life), so the devices copy in parallel instead of one after
// another on the thread of the last to arrive. An engine operation per
// continuation would do the same and cost the engine as much again as the
// rest of the call.
class DeviceThread {
 public:
  static void run(int dev_id, std::function<void()> fn) {
    static std::mutex& mutex = *new std::mutex();
    static auto& threads = *new std::map<int, DeviceThread*>();
    DeviceThread* t;
    {
      std::lock_guard<std::mutex> lock(mutex);
      DeviceThread*& made = threads[dev_id];
      if (made == nullptr) made = new DeviceThread();
      t = made;
    }
    t->push(std::move(fn));
  }

 private:
  DeviceThread() { std::thread([this]() { loop(); }).detach(); }

  void push(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(fn));
    }
    ready_.notify_one();
  }

  void loop() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this]() { return !queue_.empty(); });
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
};

struct ExchangeState : NodeState {
  std::vector<double> m1, local_mean, gamma;  // the forward's, for the backward call
  double count = 0;
  std::shared_ptr<LayerStaging> staging;
};

mxnet::OpStatePtr exchange_create_state(const nnvm::NodeAttrs& attrs, mxnet::Context ctx,
                                        const mxnet::ShapeVector& in_shapes,
                                        const std::vector<int>&) {
  auto* state = new ExchangeState();
  // the channel count: gamma's shape, as shape inference set it
  mxnet::OpStatePtr ptr = create_state(state, attrs, ctx, in_shapes[kGamma].Size());
  state->staging = layer_staging(layer_key(state->params.layer_id, state->device));
  return ptr;
}

// A call of the exchange operator: its state, its copies, and the arrays it
// writes with their host images.
struct ExchangeCall : SyncCall {
  ExchangeState& state;
  DeviceCopies copies;
  std::vector<mxnet::NDArray> written;
  std::vector<Array> images;
  ExchangeCall(const mxnet::OpStatePtr& ptr, const mxnet::OpContext& ctx,
               const mxnet::Context& device)
      : SyncCall(ptr, ptr.get_state<ExchangeState>(), ctx),
        state(ptr.get_state<ExchangeState>()),
        copies(device, node.layer->devices[node.device],
               &ptr.get_state<ExchangeState>().staging->buffers) {}

  // The images written back, the call completed.
  void finish() {
    std::string error;
    if (!copies.write(written, images, &error)) return fail_call(error);
    complete();
  }

  // `fn` on this device's DeviceThread where its copies wait for a GPU and
  // another device's thread got here first, else here and now.
  void finish_on_device(std::function<void()> fn) {
    if (copies.through_cuda() && std::this_thread::get_id() != issuer)
      return DeviceThread::run(node.dev_id, guard(std::move(fn)));
    fn();
  }
};

struct ExchangeForward : ExchangeCall {
  using ExchangeCall::ExchangeCall;
  bool train = false;
};

// Scale and shift (and in training on GPUs the running statistics' update)
// into the images, then written back.
void finish_forward(const std::shared_ptr<ExchangeForward>& c, const std::vector<double>& m1,
                    const std::vector<double>& gamma, const std::vector<double>& beta,
                    const Info& stats) {
  const Params& p = c->node.params;
  std::vector<double> scale, shift;
  normalize_coefficients(p, stats, m1, gamma, beta, &scale, &shift);
  for (size_t ch = 0; ch < scale.size(); ++ch) {
    put(c->images[0], ch, scale[ch], 1);
    put(c->images[1], ch, shift[ch], 1);
  }
  if (c->train && !p.running_at_backward) update_running(p, c->images[2], c->images[3], stats);
  if (c->train && p.fix_gamma)  // as nn.BatchNorm's training forward leaves it: the last image
    for (size_t ch = 0; ch < scale.size(); ++ch) put(c->images.back(), ch, 1.0, 1);
  c->finish();
}

void exchange_op_forward(const mxnet::OpStatePtr& state, const mxnet::OpContext& ctx,
                         const std::vector<mxnet::NDArray>& in,
                         const std::vector<mxnet::OpReqType>& req,
                         const std::vector<mxnet::NDArray>& out) {
  NoBulk no_bulk;
  auto c = std::make_shared<ExchangeForward>(state, ctx, in[kM2].ctx());
  const int64_t C = static_cast<int64_t>(in[kGamma].shape().Size());
  if (req[0] == kAddTo || req[1] == kAddTo)
    return c->fail_call("on " + c->node.layer->devices[c->node.device] + " the exchange operator "
                        "was asked to add to its output, which it cannot");
  c->train = ctx.is_train;
  if (c->train && !c->number()) return;
  const std::vector<mxnet::NDArray> reads = {plain(in[kM1]), in[kM2], in[kV], in[kGamma],
                                             in[kBeta], in[kRunningMean], in[kRunningVar]};
  std::vector<Array> h;
  std::string error;
  if (!c->copies.read(reads, kForwardIn, &h, &error)) return c->fail_call(error);
  std::vector<double> m1 = values(h[kM1]), m2 = values(h[kM2]), v = values(h[kV]),
                      gamma = values(h[kGamma]), beta = values(h[kBeta]);
  c->written = {out[0], out[1]};
  if (!c->copies.images(c->written, kForwardOut, &c->images, &error)) return c->fail_call(error);
  if (c->train && !c->node.params.running_at_backward) {
    c->written.insert(c->written.end(), {reads[kRunningMean], reads[kRunningVar]});
    c->images.insert(c->images.end(), {h[kRunningMean], h[kRunningVar]});
  }
  if (c->train && c->node.params.fix_gamma) {
    c->written.push_back(reads[kGamma]);
    c->images.push_back(h[kGamma]);
  }
  c->state.m1 = m1;
  c->state.local_mean = m1;
  for (size_t ch = 0; ch < m2.size(); ++ch) c->state.local_mean[ch] += m2[ch];
  c->state.gamma = gamma;
  c->state.count = C > 0 ? static_cast<double>(in[kData].shape().Size()) / C : 0.0;
  c->keep = reads;  // what the continuation writes, alive until the call completes
  c->keep.insert(c->keep.end(), {in[kM1], out[0], out[1]});
  if (!c->train) {  // predict mode: the running statistics, no backward through it
    c->node.stats = running_statistics(h[kRunningMean], h[kRunningVar]);
    return finish_forward(c, m1, gamma, beta, c->node.stats);
  }
  c->exchange_forward(forward_contribution(c->state.count, m1, m2, v),
                      [c, m1, gamma, beta](const Info& stats) {
    c->finish_on_device([=]() { finish_forward(c, m1, gamma, beta, stats); });
  });
}

struct ExchangeBackward : ExchangeCall {
  using ExchangeCall::ExchangeCall;
  std::vector<int> outputs, reqs;  // the outputs written (their indices) and how
};

// Inputs: d scale, d shift, running mean and variance; outputs: d m2, d v,
// d gamma, d beta, and on CPU contexts the running statistics' update (the
// images after the outputs').
void exchange_op_backward(const mxnet::OpStatePtr& state, const mxnet::OpContext& ctx,
                          const std::vector<mxnet::NDArray>& in,
                          const std::vector<mxnet::OpReqType>& req,
                          const std::vector<mxnet::NDArray>& out) {
  NoBulk no_bulk;
  auto c = std::make_shared<ExchangeBackward>(state, ctx, in[0].ctx());
  if (!c->has_forward(in[0].dtype())) return;
  if (!c->current()) return;
  const bool update = c->node.params.running_at_backward;
  std::vector<mxnet::NDArray> reads = {in[0], in[1]};
  if (update) reads.insert(reads.end(), {in[2], in[3]});
  std::vector<Array> h;
  std::string error;
  if (!c->copies.read(reads, kBackwardIn, &h, &error)) return c->fail_call(error);
  std::vector<double> d_scale = values(h[0]), d_shift = values(h[1]);
  for (size_t i = 0; i < out.size(); ++i) {
    if (req[i] == kNull) continue;
    c->written.push_back(out[i]);
    c->outputs.push_back(static_cast<int>(i));
    c->reqs.push_back(req[i]);
  }
  const bool adds = std::count(c->reqs.begin(), c->reqs.end(), kAddTo) > 0;
  if (!(adds ? c->copies.read(c->written, kBackwardOut, &c->images, &error)
             : c->copies.images(c->written, kBackwardOut, &c->images, &error)))
    return c->fail_call(error);
  if (update) {
    c->written.insert(c->written.end(), {in[2], in[3]});
    c->images.insert(c->images.end(), {h[2], h[3]});
  }
  std::vector<double> gamma = c->state.gamma, inv_stds, d_gamma;
  std::vector<double> contribution =
      backward_contribution(c->node.params, c->stats, c->state.m1, c->state.count, &gamma,
                            &d_scale, &d_shift, &inv_stds, &d_gamma);
  c->keep = reads;
  c->keep.insert(c->keep.end(), out.begin(), out.end());
  c->exchange_backward(contribution, [=](const std::vector<double>& total) {
    c->finish_on_device([=]() {
      std::vector<double> d_m2, d_v;
      local_moment_grads(total, c->state.count, c->stats, c->state.local_mean, gamma, inv_stds,
                         &d_m2, &d_v);
      const std::vector<double>* grads[] = {&d_m2, &d_v, &d_gamma, &d_shift};  // d beta: d shift
      for (size_t k = 0; k < c->outputs.size(); ++k)
        for (size_t ch = 0; ch < d_m2.size(); ++ch)
          put(c->images[k], ch, (*grads[c->outputs[k]])[ch], c->reqs[k]);
      if (update) {
        const size_t n = c->outputs.size();
        update_running(c->node.params, c->images[n], c->images[n + 1], c->stats);
      }
      c->finish();
    });
  });
}

// ------------------------------------------------------------ registration --

bool exchange_infer_shape(const nnvm::NodeAttrs& attrs, mxnet::ShapeVector* in,
                          mxnet::ShapeVector* out) {
  const mxnet::TShape& data = (*in)[kData];
  if (!mxnet::ndim_is_known(data)) return false;
  int axis = 0;
  const Params p = node_params(attrs);
  const int64_t channels = infer_channels(p, data, in, kGamma, &axis);
  if (channels < 0) return false;
  mxnet::TShape centre(data.ndim(), 1);  // scale and shift broadcast against the data
  centre[axis] = channels;
  mxnet::TShape& m1 = (*in)[kM1];
  if (!mxnet::ndim_is_known(m1)) m1 = centre;
  CHECK_EQ(m1.Size(), static_cast<size_t>(channels)) << layer_name(p) << ": m1";
  (*in)[kM2] = (*in)[kV] = mxnet::TShape(1, channels);
  (*out)[0] = (*out)[1] = m1;
  return true;
}

bool exchange_infer_type(const nnvm::NodeAttrs& attrs, std::vector<int>* in,
                         std::vector<int>* out) {
  const int stat = (*in)[kM2];
  if (stat < 0) return false;
  if (stat == kFloat16)
    refuse(message("float16_statistics", {{"layer", layer_name(node_params(attrs))}}));
  (*in)[kM1] = (*in)[kV] = stat;
  if ((*in)[kData] < 0) (*in)[kData] = stat;  // its shape only
  const int param = (*in)[kGamma] >= 0 ? (*in)[kGamma] : stat;
  for (int i = kGamma; i <= kRunningVar; ++i) (*in)[i] = param;
  (*out)[0] = (*out)[1] = stat;
  return true;
}

const char* const EXCHANGE_INPUTS[] = {"m1",           "m2",          "v",   "gamma", "beta",
                                       "running_mean", "running_var", "data"};

std::vector<std::string> exchange_input_names(const nnvm::NodeAttrs&) {
  return {std::begin(EXCHANGE_INPUTS), std::end(EXCHANGE_INPUTS)};
}

std::vector<uint32_t> exchange_mutated(const nnvm::NodeAttrs&) {
  return {kRunningMean, kRunningVar};
}

// The backward node's running statistics (its inputs 2 and 3), mutable
// whichever call updates them: the rule is the forward's argument, and a
// backward node has no arguments of its own.
std::vector<uint32_t> exchange_backward_mutated(const nnvm::NodeAttrs&) { return {2, 3}; }

// The backward node's four outputs go to m2, v, gamma and beta; m1 is a
// constant (BlockGrad in backends/vector_graph.py's graph), data was read for its shape only, the
// running statistics get none.
std::vector<nnvm::NodeEntry> exchange_gradient(const nnvm::ObjectPtr& node,
                                               const std::vector<nnvm::NodeEntry>& out_grads) {
  const auto& inputs = node_inputs(node);
  nnvm::ObjectPtr grad = make_node(
      EXCHANGE_BACKWARD_OP,
      {out_grads[0], out_grads[1], inputs[kRunningMean], inputs[kRunningVar]}, {node});
  nnvm::ObjectPtr none = make_node("_NoGradient", {}, {});
  std::vector<nnvm::NodeEntry> out(kInputs, nnvm::NodeEntry(none, 0, 0));
  out[kM1] = nnvm::NodeEntry(make_node("zeros_like", {inputs[kM1]}, {}), 0, 0);
  out[kData] = nnvm::NodeEntry(make_node("zeros_like", {inputs[kData]}, {}), 0, 0);
  const int to[] = {kM2, kV, kGamma, kBeta};
  for (uint32_t i = 0; i < 4; ++i) out[to[i]] = nnvm::NodeEntry(grad, i, 0);
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
  fwd->set_num_inputs(kInputs).set_num_outputs(2);
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
  nnvm::Op* bwd = register_backward(EXCHANGE_BACKWARD_OP, 4, 4);
  set_attr<nnvm::FMutateInputs>(bwd, "FMutateInputs", OLD_ABI(exchange_backward_mutated));
  set_compute(bwd, OLD_ABI(exchange_op_backward));
}

}  // namespace
