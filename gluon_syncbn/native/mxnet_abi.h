// How this library reaches MXNet's C++ operator registry, engine and
// resource manager, which its C API does not expose. Every reliance on
// libmxnet's C++ ABI here and in cpu_resources.h is catalogued, with why
// nothing public does and what checks it, in gluon_syncbn/mxnet_private.py.
//
// libmxnet.so of the 1.9.1 wheels exports its registry and NDArray methods,
// and the wheel ships the headers; syncbn.cc is compiled with the wheel's
// settings (old std::string ABI, MKL-DNN as the wheel has it, no CUDA, int32
// tensor sizes: native/__init__.py). The wheel was built with GCC 4.8's
// libstdc++, and two of its layouts differ from what g++ >= 5 generates:
//   * std::function: GCC 4.8 calls the invoker with arguments by value, later
//     ones by reference. Every std::function handed to libmxnet gets a GCC
//     4.8-style invoker (old_abi below); attribute maps are filled directly,
//     without nnvm's set_attr (which hands libmxnet a std::function too).
//   * unordered_map is 48 bytes in GCC 4.8, 56 later, so nnvm::Node's fields
//     after NodeAttrs::dict sit 8 bytes earlier in libmxnet. Nodes are made
//     by libmxnet (NNSymbolCreateAtomicSymbol) and wired through NodeLayout;
//     NodeAttrs::dict is only iterated (its leading fields agree).
// gluon_syncbn/selftest.py checks these facts in a subprocess before the
// library registers either operator or gives CPU contexts their temp space;
// where it fails, a layer that needs the operator raises at its first
// synchronized call.
#pragma once
#include <cstring>  // the standard headers MXNet's use, before the #define
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <dlfcn.h>
#define private public  // Op::GetAttrMap/index_, OpMap::data_, OpStatePtr::ptr_
#include <mxnet/base.h>
#include <mxnet/engine.h>
#include <mxnet/ndarray.h>
#include <mxnet/op_attr_types.h>
#include <mxnet/resource.h>
#include <mxnet/storage.h>
#include <nnvm/c_api.h>
#include <nnvm/node.h>
#include <nnvm/op.h>
#include <nnvm/op_attr_types.h>
#include <nnvm/symbolic.h>
#undef private

namespace {

struct FunctionLayout { void* functor[2]; void* manager; void* invoker; };

template <typename Sig, Sig* F> struct OldAbi;
template <typename R, typename... A, R (*F)(A...)> struct OldAbi<R(A...), F> {
  static R invoke(const std::_Any_data&, A... args) { return F(args...); }
  static std::function<R(A...)> make() {
    static_assert(sizeof(FunctionLayout) == sizeof(std::function<R(A...)>), "std::function");
    std::function<R(A...)> f(F);
    reinterpret_cast<FunctionLayout*>(&f)->invoker = reinterpret_cast<void*>(&invoke);
    return f;
  }
};
// A std::function libmxnet can call, wrapping the plain function F.
#define OLD_ABI(F) OldAbi<decltype(F), F>::make()

// What nnvm's Op::set_attr does, minus its updater: every attribute used here
// already has a map in libmxnet. Priority 11 overrides nothing of MXNet's.
template <typename T> void set_attr(nnvm::Op* op, const char* key, const T& value) {
  const dmlc::any* map = nnvm::Op::GetAttrMap(key);
  CHECK(map != nullptr) << "gluon_syncbn: MXNet has no operator attribute " << key;
  auto& values = const_cast<nnvm::OpMap<T>&>(nnvm::get<nnvm::OpMap<T>>(*map)).data_;
  if (values.size() <= op->index_) values.resize(op->index_ + 1, std::make_pair(T(), 0));
  values[op->index_] = std::make_pair(value, 11);
}

// nnvm::Node as libmxnet lays it out.
struct NodeLayout {
  const nnvm::Op* op;
  std::string name;
  char dict[48];
  dmlc::any parsed;
  std::vector<std::shared_ptr<nnvm::Symbol>> subgraphs;
  std::vector<nnvm::NodeEntry> inputs;
  std::vector<nnvm::ObjectPtr> control_deps;
};

// A node's inputs and control dependencies, read through libmxnet's layout.
const std::vector<nnvm::NodeEntry>& node_inputs(const nnvm::ObjectPtr& node) {
  return reinterpret_cast<const NodeLayout*>(node.get())->inputs;
}
const std::vector<nnvm::ObjectPtr>& node_control_deps(const nnvm::ObjectPtr& node) {
  return reinterpret_cast<const NodeLayout*>(node.get())->control_deps;
}

// A node of operator `op_name` made by libmxnet, with these inputs and
// control dependencies.
nnvm::ObjectPtr make_node(const char* op_name, const std::vector<nnvm::NodeEntry>& inputs,
                          const std::vector<nnvm::ObjectPtr>& control_deps) {
  void* op = nullptr;
  SymbolHandle symbol = nullptr;
  CHECK_EQ(NNGetOpHandle(op_name, &op), 0) << op_name;
  CHECK_EQ(NNSymbolCreateAtomicSymbol(op, 0, nullptr, nullptr, &symbol), 0) << op_name;
  nnvm::ObjectPtr node = static_cast<nnvm::Symbol*>(symbol)->outputs[0].node;
  NNSymbolFree(symbol);
  auto* layout = reinterpret_cast<NodeLayout*>(node.get());
  layout->inputs = inputs;
  layout->control_deps = control_deps;
  return node;
}

void ignore_run_context(mxnet::RunContext) {}

// OpStatePtr::Create<T>, with a deleter libmxnet can call. MXNet orders
// every operation on a state after the earlier ones through the state's
// engine variable: `var` (kept, not deleted with the state) or a new one.
template <typename T> mxnet::OpStatePtr make_state(T* object,
                                                   mxnet::Engine::VarHandle var = nullptr) {
  mxnet::OpStatePtr state;
  const bool own = var == nullptr;
  if (own) var = mxnet::Engine::Get()->NewVariable();
  state.ptr_.reset(new mxnet::OpStatePtr::OpState(var, object),
                   [own](mxnet::OpStatePtr::OpState* p) {
                     if (own)
                       mxnet::Engine::Get()->DeleteVariable(OLD_ABI(ignore_run_context),
                                                            mxnet::Context::CPU(), p->var);
                     delete reinterpret_cast<T*>(p->state);
                     delete p;
                   });
  return state;
}

// A new engine variable that lives as long as the process, or until
// delete_engine_variable.
mxnet::Engine::VarHandle new_engine_variable() { return mxnet::Engine::Get()->NewVariable(); }

// Deletes `var` once every operation pushed on it so far has run.
void delete_engine_variable(mxnet::Engine::VarHandle var) {
  mxnet::Engine::Get()->DeleteVariable(OLD_ABI(ignore_run_context), mxnet::Context::CPU(), var);
}

// The engine variable of an NDArray handed to us by handle.
mxnet::Engine::VarHandle array_variable(void* array) {
  return static_cast<mxnet::NDArray*>(array)->var();
}

// Waits for every operation pushed so far on `var`, and clears the error a
// failed one left on it: Engine::WaitForVar rethrows it and nulls the
// exception_ptr that every array the failure reached shares
// (ThreadedEngine::ThrowException), so those are clear too. False if there
// was one.
bool settle_engine_variable(mxnet::Engine::VarHandle var) {
  try {
    mxnet::Engine::Get()->WaitForVar(var);
  } catch (...) {
    return false;
  }
  return true;
}

// f(key, value) for each of the node's string arguments (NodeAttrs::dict,
// iterated only).
template <typename F> void for_each_argument(const nnvm::NodeAttrs& attrs, F f) {
  for (const auto& kv : attrs.dict) f(kv.first, kv.second);
}

// ------------------------------------------------- the resource manager --
// resource.cc's SpaceAllocator, as libmxnet's get_space_internal and
// get_host_space_internal read and grow it.
struct SpaceAllocatorLayout {
  mxnet::Context ctx;
  mxnet::Storage::Handle handle;
  mxnet::Storage::Handle host_handle;
};

// A CPU temp-space slot as MXNet's own: an engine variable of its own, and
// space libmxnet allocates at the first request and grows on demand.
mxnet::Resource make_temp_space_slot(int id) {
  auto* space = new SpaceAllocatorLayout();  // lives as long as the process
  space->ctx = mxnet::Context::CPU();         // what MXNet's own CPU slots allocate with
  space->handle.dptr = space->host_handle.dptr = nullptr;
  space->handle.size = space->host_handle.size = 0;
  mxnet::Resource r;
  r.req = mxnet::ResourceRequest(mxnet::ResourceRequest::kTempSpace);
  r.var = mxnet::Engine::Get()->NewVariable();
  r.id = id;
  r.ptr_ = space;
  return r;
}

typedef mxnet::Resource (*ResourceRequestFunction)(mxnet::ResourceManager*, mxnet::Context,
                                                   const mxnet::ResourceRequest&);

// ResourceManager's virtual functions as ResourceManagerImpl's table has
// them (include/mxnet/resource.h's order): Request, SeedRandom(uint32_t),
// SeedRandom(Context, uint32_t), then the destructor's two entries.
const char* const kResourceManagerVirtuals[] = {
    "_ZN5mxnet8resource19ResourceManagerImpl7RequestENS_7ContextERKNS_15ResourceRequestE",
    "_ZN5mxnet8resource19ResourceManagerImpl10SeedRandomEj",
    "_ZN5mxnet8resource19ResourceManagerImpl10SeedRandomENS_7ContextEj",
};
const int kVirtualTableWords = 2 + 5;  // offset to top, type info, five entries

// The mangled name of the function at `address`, or "".
std::string symbol_at(void* address) {
  Dl_info info;
  if (address == nullptr || dladdr(address, &info) == 0 || info.dli_sname == nullptr) return "";
  return info.dli_sname;
}

// Every thread's resource manager with Request replaced shares one copy
// of MXNet's virtual table with that entry changed.
struct RequestReplacement {
  void** original = nullptr;  // MXNet's table (its address point)
  void** replaced = nullptr;  // the copy
  ResourceRequestFunction mxnet_request = nullptr;
};

// Replaces Request in the calling thread's resource manager (MXNet keeps
// one per thread: resource.cc 455-458) by `request`, which may forward to
// `r->mxnet_request`; the first call fills `r`. "" on success (also where
// this thread's was replaced already), else why not (nothing changed): a
// table whose entries are not the ones named above is left alone.
std::string replace_resource_request(ResourceRequestFunction request, RequestReplacement* r) {
  void*** vptr = reinterpret_cast<void***>(mxnet::ResourceManager::Get());
  if (*vptr == r->replaced) return "";
  if (r->original == nullptr) {
    void** table = *vptr;
    for (int i = 0; i < 3; ++i) {
      const std::string found = symbol_at(table[i]);
      if (found != kResourceManagerVirtuals[i])
        return "MXNet's resource manager is not the one this library knows (virtual function " +
               std::to_string(i) + " is '" + found + "', expected '" +
               kResourceManagerVirtuals[i] + "')";
    }
    void** copy = new void*[kVirtualTableWords];  // lives as long as the process
    std::memcpy(copy, table - 2, kVirtualTableWords * sizeof(void*));
    copy[2] = reinterpret_cast<void*>(request);
    r->mxnet_request = reinterpret_cast<ResourceRequestFunction>(table[0]);
    r->original = table;
    r->replaced = copy + 2;
  } else if (*vptr != r->original) {
    return "this thread's resource manager has an unknown virtual table";
  }
  *vptr = r->replaced;
  return "";
}

}  // namespace
