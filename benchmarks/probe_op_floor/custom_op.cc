// Probe, not project code: a do-nothing custom operator registered through
// MXNet's C API (MXCustomOpRegister), the machinery gluon_syncbn's native
// operators run on. register_noop(name, args, outs, auxs) gives it that many
// arguments, outputs and auxiliary states, all of the first input's channel
// count except output 0: MXNet wraps every array a callback gets in a fresh
// NDArray, so the cost grows with the signature. See README.md.
#include <mxnet/c_api.h>

typedef int (*Fn)(void);

namespace {

struct Signature { int args, outs, auxs; };
Signature g_signatures[8];
void* g_contexts[8][10];
int g_count = 0;

const char* ARGS[4][4] = {{nullptr}, {"data", nullptr}, {"data", "gamma", nullptr},
                          {"data", "gamma", "beta", nullptr}};
const char* OUTS[3][3] = {{nullptr}, {"output", nullptr}, {"output", "info", nullptr}};
const char* AUXS[3][3] = {{nullptr}, {"mean", nullptr}, {"mean", "var", nullptr}};

const Signature& sig(void* state) { return *static_cast<Signature*>(state); }

int free_all(int size, void** ptrs, int*, const int*, const int, void*) {
  for (int i = 0; i < size; ++i) MXNDArrayFree(ptrs[i]);  // the callee owns them
  return 1;
}
int op_delete(void*) { return 1; }
Fn OP_CALLBACKS[3] = {(Fn)op_delete, (Fn)free_all, (Fn)free_all};
void* OP_CONTEXTS[3] = {nullptr, nullptr, nullptr};

int list_args(char*** out, void* s) { *out = const_cast<char**>(ARGS[sig(s).args]); return 1; }
int list_outs(char*** out, void* s) { *out = const_cast<char**>(OUTS[sig(s).outs]); return 1; }
int list_auxs(char*** out, void* s) { *out = const_cast<char**>(AUXS[sig(s).auxs]); return 1; }

thread_local int g_channels[1];
int infer_shape(int num, int* ndims, int** shapes, void* s) {
  g_channels[0] = shapes[0][1];
  for (int i = 1; i < num; ++i) { ndims[i] = 1; shapes[i] = g_channels; }
  ndims[sig(s).args] = ndims[0];  // output 0: the input's shape
  shapes[sig(s).args] = shapes[0];
  return 1;
}
int infer_type(int num, int* types, void*) { for (int i = 1; i < num; ++i) types[i] = types[0]; return 1; }
int infer_storage(int num, int* types, void*) { for (int i = 0; i < num; ++i) types[i] = 0; return 1; }
int infer_storage_backward(int num, int* types, int*, void*) {
  for (int i = 0; i < num; ++i) types[i] = 0;
  return 1;
}

// Backward needs dy and the arguments, plus the second output if any (as
// gluon_syncbn's host operator needs its info output); one-argument: dy, x, y.
thread_local int g_deps[8];
int backward_deps(const int* out_grad, const int* in_data, const int* out_data, int* num,
                  int** deps, void* s) {
  int k = 0;
  g_deps[k++] = out_grad[0];
  for (int i = 0; i < sig(s).args; ++i) g_deps[k++] = in_data[i];
  if (sig(s).args == 1) g_deps[k++] = out_data[0];
  if (sig(s).outs > 1) g_deps[k++] = out_data[1];
  *num = k;
  *deps = g_deps;
  return 1;
}

int create_operator(const char*, int, unsigned**, const int*, const int*, MXCallbackList* ret,
                    void*) {
  ret->num_callbacks = 3;
  ret->callbacks = OP_CALLBACKS;
  ret->contexts = OP_CONTEXTS;
  return 1;
}
int prop_delete(void*) { return 1; }
Fn PROP_CALLBACKS[10] = {(Fn)prop_delete, (Fn)list_args, (Fn)list_outs, (Fn)list_auxs,
                         (Fn)infer_shape, (Fn)backward_deps, (Fn)create_operator,
                         (Fn)infer_type, (Fn)infer_storage, (Fn)infer_storage_backward};

template <int I> int creator(const char*, const int, const char**, const char**,
                             MXCallbackList* ret) {
  for (int j = 0; j < 10; ++j) g_contexts[I][j] = &g_signatures[I];
  ret->num_callbacks = 10;
  ret->callbacks = PROP_CALLBACKS;
  ret->contexts = g_contexts[I];
  return 1;
}
CustomOpPropCreator CREATORS[8] = {creator<0>, creator<1>, creator<2>, creator<3>,
                                   creator<4>, creator<5>, creator<6>, creator<7>};

}  // namespace

extern "C" int register_noop(const char* name, int args, int outs, int auxs) {
  if (g_count == 8 || args < 1 || args > 3 || outs < 1 || outs > 2 || auxs < 0 || auxs > 2)
    return -1;
  g_signatures[g_count] = {args, outs, auxs};
  return MXCustomOpRegister(name, CREATORS[g_count++]);
}
