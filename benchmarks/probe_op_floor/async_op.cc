// Probe, not project code: a do-nothing NNVM operator registered from a
// shared library, executed asynchronously (ExecType::kAsync) on the engine's
// own worker, without MXNet's custom-operator threads. It measures the floor
// of a native operator that a SyncBatchNorm could be built on; see README.md.
//
// MXNet's C API has no way to register such an operator, so this uses the
// C++ registry directly, which the pip wheel exports. Two ABI facts of the
// 1.9.1 wheel (built with GCC 4.8's libstdc++, old std::string ABI) shape it:
//   * GCC 4.8's std::function calls its invoker with the arguments by value;
//     g++ >= 5 generates invokers that take them by reference. Every
//     std::function handed to libmxnet gets an invoker with the old
//     convention (OldAbi below). Signatures whose arguments are all
//     references are the same under both.
//   * GCC 4.8's unordered_map is 48 bytes (later ones 56), so nnvm::Node's
//     fields after NodeAttrs::dict sit 8 bytes earlier in libmxnet than in a
//     Node compiled here. Nodes are created by libmxnet
//     (NNSymbolCreateAtomicSymbol) and reached through NodeMirror.
#include <functional>  // every standard header nnvm/op.h uses, before the #define
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>
#define private public  // nnvm::Op::GetAttrMap, index_ and OpMap::data_
#include <nnvm/op.h>
#undef private
#include <mxnet/base.h>
#include <mxnet/ndarray.h>
#include <mxnet/op_attr_types.h>
#include <nnvm/c_api.h>
#include <nnvm/node.h>
#include <nnvm/op_attr_types.h>
#include <nnvm/symbolic.h>

#include <cstring>

using namespace mxnet;

namespace {

struct FunctionLayout { void* functor[2]; void* manager; void* invoker; };

template <typename Sig, Sig* F> struct OldAbi;
template <typename R, typename... A, R (*F)(A...)> struct OldAbi<R(A...), F> {
  static R invoke(const std::_Any_data&, A... args) { return F(args...); }
  static std::function<R(A...)> make() {
    static_assert(sizeof(FunctionLayout) == sizeof(std::function<R(A...)>), "layout");
    std::function<R(A...)> f(F);
    reinterpret_cast<FunctionLayout*>(&f)->invoker = reinterpret_cast<void*>(&invoke);
    return f;
  }
};
#define OLD_ABI(F) OldAbi<decltype(F), F>::make()

// Op::set_attr without its std::function<void(any*)> updater: every
// attribute used here already has a map in libmxnet.
template <typename T> void set(nnvm::Op& op, const char* key, const T& value) {
  const dmlc::any* map = nnvm::Op::GetAttrMap(key);
  CHECK(map != nullptr) << key;
  auto& values = const_cast<nnvm::OpMap<T>&>(nnvm::get<nnvm::OpMap<T>>(*map)).data_;
  if (values.size() <= op.index_) values.resize(op.index_ + 1, std::make_pair(T(), 0));
  values[op.index_] = std::make_pair(value, 11);
}

struct NodeMirror {
  const nnvm::Op* op;
  std::string name;
  char dict[48];
  dmlc::any parsed;
  std::vector<std::shared_ptr<nnvm::Symbol>> subgraphs;
  std::vector<nnvm::NodeEntry> inputs;
  std::vector<nnvm::ObjectPtr> control_deps;
};

struct State { int calls = 0; };

// The deleter OpStatePtr::Create hands DeleteVariable ignores its argument,
// so the invoker convention does not matter there.
OpStatePtr create_state(const nnvm::NodeAttrs&, Context, const mxnet::ShapeVector&,
                        const std::vector<int>&) {
  return OpStatePtr::Create<State>();
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

// The backward node: created by libmxnet, wired through NodeMirror; its
// control dependency on the forward node gives it the forward's state.
std::vector<nnvm::NodeEntry> gradient(const nnvm::ObjectPtr& node,
                                      const std::vector<nnvm::NodeEntry>& out_grads) {
  void* op = nullptr;
  SymbolHandle symbol = nullptr;
  CHECK_EQ(NNGetOpHandle("_backward_gsbn_probe_async", &op), 0);
  CHECK_EQ(NNSymbolCreateAtomicSymbol(op, 0, nullptr, nullptr, &symbol), 0);
  nnvm::ObjectPtr grad = static_cast<nnvm::Symbol*>(symbol)->outputs[0].node;
  NNSymbolFree(symbol);
  NodeMirror* mirror = reinterpret_cast<NodeMirror*>(grad.get());
  mirror->control_deps.emplace_back(node);
  mirror->inputs.push_back(out_grads[0]);
  return {nnvm::NodeEntry(grad, 0, 0)};
}

}  // namespace

extern "C" int gsbn_probe_register() {
  auto* registry = dmlc::Registry<nnvm::Op>::Get();
  nnvm::Op& fwd = registry->__REGISTER_OR_GET__("_gsbn_probe_async");
  fwd.set_num_inputs(1).set_num_outputs(1).add_argument("data", "NDArray-or-Symbol", "input");
  set<nnvm::FListInputNames>(fwd, "FListInputNames", OLD_ABI(input_names));
  set<mxnet::FInferShape>(fwd, "FInferShape", OLD_ABI(infer_shape));
  set<nnvm::FInferType>(fwd, "FInferType", OLD_ABI(infer_type));
  set<FInferStorageType>(fwd, "FInferStorageType", OLD_ABI(infer_storage));
  set<FCreateOpState>(fwd, "FCreateOpState", OLD_ABI(create_state));
  set<FExecType>(fwd, "FExecType", OLD_ABI(exec_async));
  set<bool>(fwd, "TIsMKLDNN", true);  // inputs as they are; copy() reorders
  set<FStatefulComputeEx>(fwd, "FStatefulComputeEx<cpu>", OLD_ABI(forward));
  set<nnvm::FGradient>(fwd, "FGradient", OLD_ABI(gradient));
  nnvm::Op& bwd = registry->__REGISTER_OR_GET__("_backward_gsbn_probe_async");
  bwd.set_num_inputs(1).set_num_outputs(1);
  set<bool>(bwd, "TIsBackward", true);
  set<bool>(bwd, "TIsLayerOpBackward", true);
  set<FInferStorageType>(bwd, "FInferStorageType", OLD_ABI(infer_storage));
  set<FExecType>(bwd, "FExecType", OLD_ABI(exec_async));
  set<bool>(bwd, "TIsMKLDNN", true);
  set<FStatefulComputeEx>(bwd, "FStatefulComputeEx<cpu>", OLD_ABI(backward));
  return 0;
}
