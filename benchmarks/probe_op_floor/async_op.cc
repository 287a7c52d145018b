// Probe, not project code: a do-nothing NNVM operator registered from a
// shared library, executed asynchronously (ExecType::kAsync) on the engine's
// own worker, without MXNet's custom-operator threads. It measures the floor
// of a native operator that a SyncBatchNorm could be built on; see README.md.
//
// MXNet's C API has no way to register such an operator, so this uses the
// C++ registry directly, which the pip wheel exports, through
// gluon_syncbn/native/mxnet_abi.h: the layouts of the wheel's GCC 4.8 build
// (std::function invokers, nnvm::Node) are explained there.
#include "../../gluon_syncbn/native/mxnet_abi.h"

#include <cstring>

using namespace mxnet;

namespace {

struct State { int calls = 0; };

OpStatePtr create_state(const nnvm::NodeAttrs&, Context, const mxnet::ShapeVector&,
                        const std::vector<int>&) {
  return make_state(new State());
}

void copy(const NDArray& src, const NDArray& dst) {
  // An MKL-DNN input is reordered into an array this function holds.
  NDArray plain = src.IsMKLDNNData() ? src.Reorder2Default() : src;
  const TBlob& s = plain.data();
  std::memcpy(dst.data().dptr_, s.dptr_, s.Size() * mshadow::mshadow_sizeof(s.type_flag_));
}

void forward(const OpStatePtr& state, const OpContext& ctx, const std::vector<NDArray>& in,
             const std::vector<OpReqType>&, const std::vector<NDArray>& out) {
  state.get_state<State>().calls++;
  copy(in[0], out[0]);
  ctx.async_on_complete();  // a SyncBatchNorm would call it once the devices met
}

void backward(const OpStatePtr&, const OpContext& ctx, const std::vector<NDArray>& in,
              const std::vector<OpReqType>&, const std::vector<NDArray>& out) {
  copy(in[0], out[0]);
  ctx.async_on_complete();
}

bool infer_shape(const nnvm::NodeAttrs&, mxnet::ShapeVector* in, mxnet::ShapeVector* out) {
  (*out)[0] = (*in)[0];
  return mxnet::shape_is_known((*in)[0]);
}

bool infer_type(const nnvm::NodeAttrs&, std::vector<int>* in, std::vector<int>* out) {
  (*out)[0] = (*in)[0];
  return (*in)[0] != -1;
}

bool infer_storage(const nnvm::NodeAttrs&, const int, DispatchMode* mode, std::vector<int>* in,
                   std::vector<int>* out) {
  for (auto& s : *in) s = kDefaultStorage;
  for (auto& s : *out) s = kDefaultStorage;
  *mode = DispatchMode::kFComputeEx;
  return true;
}

std::vector<std::string> input_names(const nnvm::NodeAttrs&) { return {"data"}; }

ExecType exec_async(const nnvm::NodeAttrs&) { return ExecType::kAsync; }

// The backward node: its control dependency on the forward node gives it
// the forward's state.
std::vector<nnvm::NodeEntry> gradient(const nnvm::ObjectPtr& node,
                                      const std::vector<nnvm::NodeEntry>& out_grads) {
  return {nnvm::NodeEntry(make_node("_backward_gsbn_probe_async", {out_grads[0]}, {node}), 0, 0)};
}

}  // namespace

extern "C" int gsbn_probe_register() {
  auto* registry = dmlc::Registry<nnvm::Op>::Get();
  nnvm::Op& fwd = registry->__REGISTER_OR_GET__("_gsbn_probe_async");
  fwd.set_num_inputs(1).set_num_outputs(1).add_argument("data", "NDArray-or-Symbol", "input");
  set_attr<nnvm::FListInputNames>(&fwd, "FListInputNames", OLD_ABI(input_names));
  set_attr<mxnet::FInferShape>(&fwd, "FInferShape", OLD_ABI(infer_shape));
  set_attr<nnvm::FInferType>(&fwd, "FInferType", OLD_ABI(infer_type));
  set_attr<FInferStorageType>(&fwd, "FInferStorageType", OLD_ABI(infer_storage));
  set_attr<FCreateOpState>(&fwd, "FCreateOpState", OLD_ABI(create_state));
  set_attr<FExecType>(&fwd, "FExecType", OLD_ABI(exec_async));
  set_attr<bool>(&fwd, "TIsMKLDNN", true);  // inputs as they are; copy() reorders
  set_attr<FStatefulComputeEx>(&fwd, "FStatefulComputeEx<cpu>", OLD_ABI(forward));
  set_attr<nnvm::FGradient>(&fwd, "FGradient", OLD_ABI(gradient));
  nnvm::Op& bwd = registry->__REGISTER_OR_GET__("_backward_gsbn_probe_async");
  bwd.set_num_inputs(1).set_num_outputs(1);
  set_attr<bool>(&bwd, "TIsBackward", true);
  set_attr<bool>(&bwd, "TIsLayerOpBackward", true);
  set_attr<FInferStorageType>(&bwd, "FInferStorageType", OLD_ABI(infer_storage));
  set_attr<FExecType>(&bwd, "FExecType", OLD_ABI(exec_async));
  set_attr<bool>(&bwd, "TIsMKLDNN", true);
  set_attr<FStatefulComputeEx>(&bwd, "FStatefulComputeEx<cpu>", OLD_ABI(backward));
  return 0;
}
