// The asynchronous operator: CPU contexts' whole layer call as an MXNet
// operator of its own (registered in MXNet's C++ registry, see mxnet_abi.h)
// instead of a custom operator. It runs on the engine's worker of its device
// and returns at once: the call completes when the exchange does, on the
// thread of the last device to arrive (or of an abort, or of the watchdog at
// the timeout). No thread waits, no custom-operator hand-off, no temp-space
// slot. The protocol of a call is SyncCall's (sync_call.h); this operator
// supplies what it sends and how it finishes:
//
//   forward:  x, gamma, beta, running mean/var (mutable, as BatchNorm's
//             auxiliary states; read in predict mode only) -> y
//             this slice's FORWARD vector; then y
//   backward: dy, x, gamma, running mean/var (mutated) -> dx, d gamma, d beta
//             this slice's BACKWARD sums; then the gradients and the running
//             statistics
//
// The running statistics take each call's global statistics in its backward
// call, as MXNet's CPU BatchNorm does (batch_norm.cc, BatchNormBackwardImpl;
// MKL-DNN's, MKLDNNBatchNormBackwardImpl): in the order MXNet runs the
// backward calls, and not at all for a call whose backward never runs.
//
// The maths are stats.h's, in float64 on arrays read and written as the
// dtypes they have (float16, bfloat16, float32, float64: arrays.h), so no
// Cast surrounds the operator. MKL-DNN inputs are reordered into arrays the
// call keeps until it completes.
#pragma once
#include "mxnet_abi.h"
#include "stats.h"
#include "sync_call.h"

#include <array>

namespace {

const char* ASYNC_OP = "_gluon_syncbn_async";
const char* ASYNC_BACKWARD_OP = "_backward_gluon_syncbn_async";

mxnet::OpStatePtr async_create_state(const nnvm::NodeAttrs& attrs, mxnet::Context ctx,
                                     const mxnet::ShapeVector& in_shapes,
                                     const std::vector<int>&) {
  // the channel count: gamma's shape, as shape inference set it
  return create_state(new NodeState(), attrs, ctx, in_shapes[1].Size());
}

struct AsyncForward : SyncCall {
  using SyncCall::SyncCall;
  Array x, gamma, beta, rmean, rvar, y;
  int write = 0;
  Layout l;
};

struct AsyncBackward : SyncCall {
  using SyncCall::SyncCall;
  Array dy, x, gamma, rmean, rvar, dx, dgamma, dbeta;
  std::array<int, 3> reqs;
  Layout l;
  std::vector<double> sum_dy, sum_dy_xc;
};

void async_forward(const mxnet::OpStatePtr& state, const mxnet::OpContext& ctx,
                   const std::vector<mxnet::NDArray>& in, const std::vector<mxnet::OpReqType>& req,
                   const std::vector<mxnet::NDArray>& out) {
  auto c = std::make_shared<AsyncForward>(state, state.get_state<NodeState>(), ctx);
  const Params& p = c->node.params;
  const mxnet::NDArray x_nd = plain(in[0]);
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
    c->node.stats = Info();
    return c->complete();
  }
  std::vector<double> contribution = slice_contribution(c->l, c->x);
  if (!c->number()) return;
  c->keep = {x_nd, in[1], in[2], in[3], in[4], out[0]};
  c->exchange_forward(contribution, [c](const Info& stats) {
    c->finish_on(c->x.size(), [c, stats]() {
      const Params& p = c->node.params;
      if (p.fix_gamma) fill(c->gamma, 1.0);  // as nn.BatchNorm's training forward leaves it
      normalize(p, c->l, c->x, c->gamma, c->beta, stats, c->y, c->write);
      c->complete();
    });
  });
}

void async_backward(const mxnet::OpStatePtr& state, const mxnet::OpContext& ctx,
                    const std::vector<mxnet::NDArray>& in,
                    const std::vector<mxnet::OpReqType>& req,
                    const std::vector<mxnet::NDArray>& out) {
  auto c = std::make_shared<AsyncBackward>(state, state.get_state<NodeState>(), ctx);
  const mxnet::NDArray dy_nd = plain(in[0]), x_nd = plain(in[1]);
  c->dy = array_of(dy_nd);
  c->x = array_of(x_nd);
  c->gamma = array_of(in[2]);
  c->rmean = array_of(in[3]);
  c->rvar = array_of(in[4]);
  c->dx = array_of(out[0]);
  c->dgamma = array_of(out[1]);
  c->dbeta = array_of(out[2]);
  c->reqs = {req[0], req[1], req[2]};
  if (!c->has_forward(c->dy.dtype)) return;
  c->l = Layout(c->x.shape, c->node.params.axis);
  backward_sums(c->l, c->dy, c->x, c->stats, &c->sum_dy, &c->sum_dy_xc);
  if (!c->current()) return;
  c->keep = {dy_nd, x_nd, in[2], in[3], in[4], out[0], out[1], out[2]};
  c->exchange_backward(pack_backward(c->sum_dy, c->sum_dy_xc),
                       [c](const std::vector<double>& total) {
    c->finish_on(c->x.size(), [c, total]() {
      write_gradients(c->node.params, c->l, c->dy, c->x, c->gamma, c->stats, total, c->sum_dy,
                      c->sum_dy_xc, c->dx, c->dgamma, c->dbeta, c->reqs.data());
      update_running(c->node.params, c->rmean, c->rvar, c->stats);  // mutable inputs
      c->complete();
    });
  });
}

// ------------------------------------------------------------ registration --

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
    refuse(dtype_problem(layer_name(node_params(attrs)), "its input", data));
  const int param = (*in)[1] >= 0 ? (*in)[1] : kFloat32;
  for (int i = 1; i < 5; ++i) (*in)[i] = param;
  (*out)[0] = data;
  return true;
}

std::vector<std::string> async_input_names(const nnvm::NodeAttrs&) {
  return {"data", "gamma", "beta", "running_mean", "running_var"};
}

// The running statistics: the forward's inputs 3 and 4, the backward's too.
std::vector<uint32_t> async_mutated(const nnvm::NodeAttrs&) { return {3, 4}; }

// Backward node: dy, x, gamma and the running statistics in; d x, d gamma,
// d beta out; the running statistics get no gradient (as nn.BatchNorm's).
std::vector<nnvm::NodeEntry> async_gradient(const nnvm::ObjectPtr& node,
                                            const std::vector<nnvm::NodeEntry>& out_grads) {
  const auto& inputs = node_inputs(node);
  nnvm::ObjectPtr grad = make_node(
      ASYNC_BACKWARD_OP, {out_grads[0], inputs[0], inputs[1], inputs[3], inputs[4]}, {node});
  nnvm::ObjectPtr none = make_node("_NoGradient", {}, {});
  return {nnvm::NodeEntry(grad, 0, 0), nnvm::NodeEntry(grad, 1, 0),
          nnvm::NodeEntry(grad, 2, 0), nnvm::NodeEntry(none, 0, 0),
          nnvm::NodeEntry(none, 0, 0)};
}

void register_async_op() {
  nnvm::Op* fwd = &dmlc::Registry<nnvm::Op>::Get()->__REGISTER_OR_GET__(ASYNC_OP);
  fwd->set_num_inputs(5).set_num_outputs(1);
  for (const char* name : {"data", "gamma", "beta", "running_mean", "running_var"})
    fwd->add_argument(name, "NDArray-or-Symbol", name);
  set_attr<nnvm::FListInputNames>(fwd, "FListInputNames", OLD_ABI(async_input_names));
  set_attr<nnvm::FMutateInputs>(fwd, "FMutateInputs", OLD_ABI(async_mutated));
  set_attr<mxnet::FInferShape>(fwd, "FInferShape", OLD_ABI(async_infer_shape));
  set_attr<nnvm::FInferType>(fwd, "FInferType", OLD_ABI(async_infer_type));
  set_attr<mxnet::FInferStorageType>(fwd, "FInferStorageType", OLD_ABI(default_storage));
  set_attr<mxnet::FCreateOpState>(fwd, "FCreateOpState", OLD_ABI(async_create_state));
  set_attr<mxnet::FExecType>(fwd, "FExecType", OLD_ABI(async_exec));
  set_attr<bool>(fwd, "TIsMKLDNN", true);  // inputs as they are: plain() reorders
  set_attr<mxnet::FStatefulComputeEx>(fwd, "FStatefulComputeEx<cpu>", OLD_ABI(async_forward));
  set_attr<nnvm::FGradient>(fwd, "FGradient", OLD_ABI(async_gradient));
  nnvm::Op* bwd = register_backward(ASYNC_BACKWARD_OP, 5, 3);
  set_attr<nnvm::FMutateInputs>(bwd, "FMutateInputs", OLD_ABI(async_mutated));
  set_attr<bool>(bwd, "TIsMKLDNN", true);
  set_attr<mxnet::FStatefulComputeEx>(bwd, "FStatefulComputeEx<cpu>", OLD_ABI(async_backward));
}

}  // namespace
