// The native SyncBatchNorm operator for CPU contexts: one custom operator per
// layer call that computes the local moments, meets the other devices at the
// call-order barrier, and normalizes, all without Python or the GIL.
//
// It is registered through MXNet's C API (MXCustomOpRegister, include/mxnet/
// c_api.h in the mxnet wheel), so it runs on MXNet's custom-operator threads
// exactly as the Python operator in op.py does: blocking there is safe for the
// same reason (see docs/design.md, "The engine hazard"). What it removes is the
// Python interpreter from every call, and the ~8 MXNet operators per call the
// Python path needs around its operator (each of which may hold a CPU
// temp-space slot while it waits: the deadlock bound at depth).
//
// Data path of one training call on device d (forward):
//   x --local float64 sums--> forward vector --barrier (call #k, all devices)-->
//   sum in device order --> global mean/var --> y, running stats, info output
// and of its backward:
//   dy, x --local sums--> backward vector --barrier (key of call #k)--> dx,
//   d gamma, d beta
//
// Wire formats (the same as gluon_syncbn/wire.py's, which the Python path uses):
//   forward vector  [n, n*mean (C), n*(var + mean^2) (C)]   float64
//   backward vector [sum dy (C), sum dy*(x - mean) (C)]      float64
//   info output     [token, call, n, mean (C), var (C)]      float64
//
// Recovery: every failure (a timeout, devices that disagree, a call of an
// aborted step) aborts the *step*: the process-wide token advances, every
// waiting exchange fails at once with the cause, and the cause is queued for
// Python (gsbn_take_errors) to append to MXNet's generic error. Python's
// Session calls gsbn_abort for failures it sees first. One token, one path.
//
// Reliance on MXNet 1.9.1 behaviour (listed with the Python ones in
// gluon_syncbn/mxnet_private.py): the arrays a callback gets are fresh
// NDArrays over the operator's own default-layout memory (custom.cc
// AllocateNDArrayCopy after CreateDefaultInputs), so raw pointers are safe and
// waiting on them cannot deadlock; a callback returns 1 for success and must
// MXNDArrayFree every handle; mxnet::Context is {int32 dev_type, int32 dev_id}.
#include <mxnet/c_api.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

typedef int (*Fn)(void);
const int kFloat32 = 0, kFloat64 = 1;         // mshadow type flags
const int kNull = 0, kAddTo = 3;                // OpReqType
const int kInData = 0, kOutData = 1, kInGrad = 2, kOutGrad = 3, kAux = 4;  // callback tags
const int kInfoHead = 3;                        // token, call, n

// ---------------------------------------------------------------- session --
// Shared by every layer of the process: the current step's token, the cause of
// the last abort, and failures waiting to be reported to Python.

struct Exchange;
struct Group;

std::mutex g_mutex;  // guards every structure below and every Group
uint64_t g_token = 0;        // the current step; advanced by every abort
uint64_t g_issue_token = 0;  // what calls issued now get: g_token as of the step's start
std::string g_cause = "";
std::deque<std::string> g_errors;  // "Kind\tmessage", oldest first
std::map<std::string, std::shared_ptr<Group>> g_groups;

void record_locked(const std::string& kind, const std::string& message) {
  std::string entry = kind + "\t" + message;
  for (const auto& e : g_errors) if (e == entry) return;
  if (g_errors.size() >= 8) g_errors.pop_front();
  g_errors.push_back(entry);
}

struct Exchange {
  uint64_t token;
  std::vector<std::vector<double>> values;  // one vector per device
  std::vector<std::string> dtypes;
  int arrived = 0, taken = 0;
  bool done = false;
  std::string error, kind;                  // non-empty: failed with this cause
  std::vector<double> result;
  std::condition_variable cv;
  Exchange(uint64_t t, int n) : token(t), values(n), dtypes(n) {}
};

typedef std::tuple<int, uint64_t, int64_t> Key;  // (0 fwd / 1 bwd, token, call number)

struct Group {
  std::string name, hint;
  std::vector<std::string> devices;
  double timeout;
  uint64_t counter_token = 0;
  std::vector<int64_t> next_call;
  std::map<Key, std::shared_ptr<Exchange>> exchanges;
  // static_shape graphs only: each device's running mean and variance arrays
  // (the Parameter's own NDArrays, kept alive by the Python group).
  std::vector<std::vector<NDArrayHandle>> running;
};

// Fail every waiting exchange: the step is over (lock held).
void abort_locked(const std::string& cause, const std::string& kind = "SyncBatchNormError") {
  ++g_token;
  g_cause = cause;
  for (auto& g : g_groups)
    for (auto& e : g.second->exchanges)
      if (!e.second->done && e.second->error.empty()) {
        e.second->error = cause;
        e.second->kind = kind;
        e.second->cv.notify_all();
      }
}

std::string stale_message() {
  return "this SyncBatchNorm call belongs to a step that failed earlier: " + g_cause;
}

std::string join(const std::vector<std::string>& items, const std::vector<int>& which) {
  std::string out;
  for (int i : which) out += (out.empty() ? "" : ", ") + items[i];
  return out;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// ---------------------------------------------------------------- barrier --
// The k-th call of a layer on each device meets the k-th call on the others.
// The last device to arrive checks that they agree and sums their vectors in
// device order (the same rounding whatever the arrival order). Every wait ends
// at the layer's timeout. Returns false with `error` set on failure.

bool exchange(Group& g, const Key& key, int device, std::vector<double> value,
              const std::string& dtype, std::vector<double>* result, std::string* error) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(g.timeout));
  std::unique_lock<std::mutex> lock(g_mutex);
  if (std::get<1>(key) != g_token) {
    *error = stale_message();
    record_locked("SyncBatchNormError", *error);
    return false;
  }
  const int n = static_cast<int>(g.devices.size());
  auto& slot = g.exchanges[key];
  if (!slot) slot = std::make_shared<Exchange>(std::get<1>(key), n);
  std::shared_ptr<Exchange> ex = slot;
  ex->values[device] = std::move(value);
  ex->dtypes[device] = dtype;
  std::string failure, kind = "SyncBatchNormError";
  if (++ex->arrived == n && ex->error.empty()) {
    size_t size = ex->values[0].size();
    bool same_size = true, same_dtype = true;
    for (int i = 1; i < n; ++i) {
      same_size = same_size && ex->values[i].size() == size;
      same_dtype = same_dtype && ex->dtypes[i] == ex->dtypes[0];
    }
    if (!same_size || !same_dtype) {
      std::string what;
      for (int i = 0; i < n; ++i) {
        size_t s = ex->values[i].size();
        size_t channels = std::get<0>(key) == 0 ? (s - 1) / 2 : s / 2;
        what += (i ? ", " : "") + g.devices[i] + ": " +
                (same_size ? ex->dtypes[i] : std::to_string(channels));
      }
      failure = same_size
          ? "SyncBatchNorm '" + g.name + "': devices disagree on the input dtype: " + what +
                ". Cast every slice to the same dtype."
          : "SyncBatchNorm '" + g.name + "': devices disagree on the channel count: " + what +
                ". Every device must feed the same number of channels.";
    } else {
      ex->result.assign(size, 0.0);
      for (int i = 0; i < n; ++i)
        for (size_t j = 0; j < size; ++j) ex->result[j] += ex->values[i][j];
      ex->done = true;
      ex->cv.notify_all();
    }
  }
  while (failure.empty() && !ex->done && ex->error.empty()) {
    if (ex->cv.wait_until(lock, deadline) == std::cv_status::timeout &&
        !ex->done && ex->error.empty()) {
      std::vector<int> arrived, missing;
      for (int i = 0; i < n; ++i) (ex->values[i].empty() ? missing : arrived).push_back(i);
      char head[256];
      std::snprintf(head, sizeof(head), "only %d of %d devices (", ex->arrived, n);
      failure = "SyncBatchNorm '" + g.name + "': " + head + join(g.devices, arrived) +
                ") reached " + (std::get<0>(key) == 0 ? "forward" : "backward") + " call #" +
                std::to_string(std::get<2>(key)) + " within " + std::to_string(g.timeout) +
                "s; missing: " + join(g.devices, missing) + ". " + g.hint;
      kind = "SyncBatchNormTimeout";
    }
  }
  if (!failure.empty()) {
    abort_locked(failure, kind);  // this exchange and every other waiting call of the step
  }
  // A failed exchange stays until every device has passed it, so a late
  // device fails at once instead of waiting.
  if (++ex->taken == n) {
    auto it = g.exchanges.find(key);
    if (it != g.exchanges.end() && it->second == ex) g.exchanges.erase(it);
  }
  if (!ex->error.empty()) {
    record_locked(ex->kind, ex->error);  // each device's MXNetError names the cause
    *error = ex->error;
    return false;
  }
  *result = ex->result;
  return true;
}

// ----------------------------------------------------------------- arrays --

struct Array {
  void* data = nullptr;
  int dtype = kFloat32;
  std::vector<int64_t> shape;
  int64_t size() const { int64_t s = 1; for (auto d : shape) s *= d; return s; }
};

Array view(NDArrayHandle h) {
  Array a;
  int ndim = 0;
  const int64_t* dims = nullptr;
  MXNDArrayGetShapeEx64(h, &ndim, &dims);
  if (ndim > 0) a.shape.assign(dims, dims + ndim);
  MXNDArrayGetDType(h, &a.dtype);
  if (ndim > 0 && a.size() > 0) MXNDArrayGetData(h, &a.data);
  return a;
}

double at(const Array& a, int64_t i) {
  return a.dtype == kFloat64 ? static_cast<const double*>(a.data)[i]
                             : static_cast<const float*>(a.data)[i];
}

void put(const Array& a, int64_t i, double v, int req) {
  if (a.dtype == kFloat64) {
    double* p = static_cast<double*>(a.data) + i;
    *p = req == kAddTo ? *p + v : v;
  } else {
    float* p = static_cast<float*>(a.data) + i;
    *p = static_cast<float>(req == kAddTo ? *p + v : v);
  }
}

// The (outer, C, inner) view of an array around the channel axis.
struct Layout {
  int64_t outer = 1, channels = 1, inner = 1;
  Layout(const std::vector<int64_t>& shape, int axis) {
    if (axis < 0) axis += static_cast<int>(shape.size());
    for (int i = 0; i < static_cast<int>(shape.size()); ++i)
      (i < axis ? outer : i > axis ? inner : channels) *= shape[i];
  }
  int64_t count() const { return outer * inner; }
};

// Calls f(channel, element index) over every element, channel-major order
// within each outer block: contiguous runs of `inner` elements.
template <typename F> void for_each(const Layout& l, F f) {
  for (int64_t o = 0; o < l.outer; ++o)
    for (int64_t c = 0; c < l.channels; ++c) {
      int64_t base = (o * l.channels + c) * l.inner;
      for (int64_t i = 0; i < l.inner; ++i) f(c, base + i);
    }
}

// --------------------------------------------------------------- operator --

struct Op {
  std::shared_ptr<Group> group;
  int device;
  double eps, momentum;
  bool fix_gamma, static_shape;
  int axis;
  std::string dtype_name;
  uint64_t token;  // the step the call was issued in (unused in static graphs)
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

int fail(const std::string& kind, const std::string& message) {
  std::lock_guard<std::mutex> lock(g_mutex);
  record_locked(kind, message);
  return 0;  // MXNet raises its generic custom-op error; Python appends ours
}

// What a forward/backward callback returns when its call failed. MXNet 1.9.1
// keeps a failed custom operator's exception in one process-wide slot until
// an engine operation rethrows it, so two failures at the same moment can
// swap or lose their errors (and one can land on a healthy call). Failing
// calls of one step arrive together; spacing their returns 100 ms apart lets
// each error reach its own operation first (20 ms was not enough on a loaded
// 2-core machine).
int failed_call() {
  static std::mutex spacing;
  static auto last = std::chrono::steady_clock::time_point();
  std::lock_guard<std::mutex> lock(spacing);
  auto next = last + std::chrono::milliseconds(100);
  if (std::chrono::steady_clock::now() < next) std::this_thread::sleep_until(next);
  last = std::chrono::steady_clock::now();
  return 0;
}

// static_shape graphs register auxiliary states as read-only inputs, so a raw
// write there would not order later readers. This engine operation mutates
// the Parameter's own arrays instead, after every reader issued before it.
struct RunningUpdate {
  NDArrayHandle arrays[2];
  std::vector<double> mean, var;
  double momentum;
};

void run_running_update(void*, void* param) {
  auto* u = static_cast<RunningUpdate*>(param);
  const std::vector<double>* values[2] = {&u->mean, &u->var};
  for (int k = 0; k < 2; ++k) {
    Array a = view(u->arrays[k]);
    for (int64_t c = 0; c < a.size(); ++c)
      put(a, c, at(a, c) * u->momentum + (*values[k])[c] * (1.0 - u->momentum), 1);
  }
}

void delete_running_update(void* param) { delete static_cast<RunningUpdate*>(param); }

int op_forward(int size, void** ptrs, int* tags, const int* req, const int is_train,
               void* state) {
  Handles h(size, ptrs, tags);
  Op& op = *static_cast<Op*>(state);
  Group& g = *op.group;
  Array x = view(h.by_tag[kInData][0]), gamma = view(h.by_tag[kInData][1]),
        beta = view(h.by_tag[kInData][2]);
  Array y = view(h.by_tag[kOutData][0]), info = view(h.by_tag[kOutData][1]);
  Array rmean = view(h.by_tag[kAux][0]), rvar = view(h.by_tag[kAux][1]);
  Layout l(x.shape, op.axis);
  const int64_t C = l.channels;
  std::vector<double> mean(C), var(C);
  double head[kInfoHead] = {-1, -1, 0};
  if (!is_train) {  // predict mode inside a graph: the running statistics
    for (int64_t c = 0; c < C; ++c) { mean[c] = at(rmean, c); var[c] = at(rvar, c); }
  } else {
    // Local moments in float64: the mean first, then squared deviations from
    // it, so |mean| >> std loses nothing before the float64 merge.
    std::vector<double> sum(C, 0.0), sq(C, 0.0);
    for_each(l, [&](int64_t c, int64_t i) { sum[c] += at(x, i); });
    const double n_local = static_cast<double>(l.count());
    for (int64_t c = 0; c < C; ++c) sum[c] /= n_local;  // local mean
    for_each(l, [&](int64_t c, int64_t i) { double d = at(x, i) - sum[c]; sq[c] += d * d; });
    std::vector<double> contribution(1 + 2 * C);
    contribution[0] = n_local;
    for (int64_t c = 0; c < C; ++c) {
      contribution[1 + c] = n_local * sum[c];
      contribution[1 + C + c] = sq[c] + n_local * sum[c] * sum[c];
    }
    uint64_t token;
    int64_t call = -1;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      token = op.static_shape ? g_token : op.token;
      if (token != g_token) {
        record_locked("SyncBatchNormError", stale_message());
      } else {
        if (token != g.counter_token) {
          g.counter_token = token;
          g.next_call.assign(g.devices.size(), 0);
        }
        call = g.next_call[op.device]++;
      }
    }
    if (call < 0) return failed_call();
    std::vector<double> total;
    std::string error;
    if (!exchange(g, Key(0, token, call), op.device, contribution, op.dtype_name, &total,
                  &error))
      return failed_call();
    const double n = total[0];
    for (int64_t c = 0; c < C; ++c) {
      mean[c] = total[1 + c] / n;
      var[c] = std::max(total[1 + C + c] / n - mean[c] * mean[c], 0.0);
    }
    head[0] = static_cast<double>(token);
    head[1] = static_cast<double>(call);
    head[2] = n;
    if (op.static_shape && g.running.size() == g.devices.size()) {
      auto* u = new RunningUpdate{{g.running[op.device][0], g.running[op.device][1]},
                                  mean, var, op.momentum};
      int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}: where the update runs
      if (MXEnginePushSyncND(run_running_update, u, delete_running_update, ctx, nullptr, 0,
                             u->arrays, 2, nullptr, 0, "gluon_syncbn_running") != 0)
        return failed_call(), fail("SyncBatchNormError", std::string("SyncBatchNorm '") + g.name +
                    "': could not update the running statistics: " + MXGetLastError());
    } else {  // this call holds write access to its auxiliary states (or, in a
              // static graph traced before its shapes were known, the next one will)
      for (int64_t c = 0; c < C; ++c) {
        put(rmean, c, at(rmean, c) * op.momentum + mean[c] * (1.0 - op.momentum), 1);
        put(rvar, c, at(rvar, c) * op.momentum + var[c] * (1.0 - op.momentum), 1);
      }
    }
  }
  std::vector<double> scale(C), shift(C);
  for (int64_t c = 0; c < C; ++c) {
    double inv_std = 1.0 / std::sqrt(var[c] + op.eps);
    scale[c] = (op.fix_gamma ? 1.0 : at(gamma, c)) * inv_std;
    shift[c] = at(beta, c) - mean[c] * scale[c];
  }
  if (req[0] != kNull)
    for_each(l, [&](int64_t c, int64_t i) { put(y, i, at(x, i) * scale[c] + shift[c], req[0]); });
  for (int k = 0; k < kInfoHead; ++k) put(info, k, head[k], 1);
  for (int64_t c = 0; c < C; ++c) {
    put(info, kInfoHead + c, mean[c], 1);
    put(info, kInfoHead + C + c, var[c], 1);
  }
  return 1;
}

int op_backward(int size, void** ptrs, int* tags, const int* req, const int,
                void* state) {
  Handles h(size, ptrs, tags);
  Op& op = *static_cast<Op*>(state);
  Group& g = *op.group;
  // Declared dependencies (see bwd_dep): dy, x, gamma and the info output.
  Array dy = view(h.by_tag[kOutGrad][0]), x = view(h.by_tag[kInData][0]),
        gamma = view(h.by_tag[kInData][1]), info = view(h.by_tag[kOutData][1]);
  Array dx = view(h.by_tag[kInGrad][0]), dgamma = view(h.by_tag[kInGrad][1]),
        dbeta = view(h.by_tag[kInGrad][2]);
  Layout l(x.shape, op.axis);
  const int64_t C = l.channels;
  const uint64_t token = static_cast<uint64_t>(at(info, 0));
  const double call = at(info, 1), n = at(info, 2);
  if (call < 0)
    return failed_call(), fail("SyncBatchNormError", "SyncBatchNorm '" + g.name + "': backward through a "
                "call made in inference mode; record the forward pass under autograd.record() "
                "(train_mode=True).");
  bool stale = false;
  if (!op.static_shape) {
    std::lock_guard<std::mutex> lock(g_mutex);
    stale = op.token != g_token;
    if (stale) record_locked("SyncBatchNormError", stale_message());
  }
  if (stale) return failed_call();
  std::vector<double> mean(C), inv_std(C), local(2 * C, 0.0);
  for (int64_t c = 0; c < C; ++c) {
    mean[c] = at(info, kInfoHead + c);
    inv_std[c] = 1.0 / std::sqrt(at(info, kInfoHead + C + c) + op.eps);
  }
  for_each(l, [&](int64_t c, int64_t i) {
    double d = at(dy, i);
    local[c] += d;
    local[C + c] += d * (at(x, i) - mean[c]);
  });
  std::vector<double> total;
  std::string error;
  if (!exchange(g, Key(1, token, static_cast<int64_t>(call)), op.device, local,
                op.dtype_name, &total, &error))
    return failed_call();
  std::vector<double> a(C), b(C), k(C);  // dx = a*dy - b - k*(x - mean)
  for (int64_t c = 0; c < C; ++c) {
    double gscale = (op.fix_gamma ? 1.0 : at(gamma, c)) * inv_std[c];
    a[c] = gscale;
    b[c] = gscale * total[c] / n;
    k[c] = gscale * inv_std[c] * inv_std[c] * total[C + c] / n;
  }
  if (req[0] != kNull)
    for_each(l, [&](int64_t c, int64_t i) {
      put(dx, i, a[c] * at(dy, i) - b[c] - k[c] * (at(x, i) - mean[c]), req[0]);
    });
  // gamma and beta gradients stay per device; the Trainer sums them.
  for (int64_t c = 0; c < C; ++c) {
    if (req[1] != kNull) put(dgamma, c, op.fix_gamma ? 0.0 : local[C + c] * inv_std[c], req[1]);
    if (req[2] != kNull) put(dbeta, c, local[c], req[2]);
  }
  return 1;
}

int op_delete(void* state) { delete static_cast<Op*>(state); return 1; }

// --------------------------------------------------------------- property --
// MXNet asks the property for names, shapes, types and backward dependencies
// (on the main thread, when the graph is built or the call is issued), and
// for one operator instance per device and call (per graph in static ones).

const char* ARGS[] = {"data", "gamma", "beta", nullptr};
const char* OUTS[] = {"output", "info", nullptr};
const char* AUXS[] = {"running_mean", "running_var", nullptr};

struct Prop {
  std::string group_id, dtype_name = "float32";
  double eps = 1e-5, momentum = 0.9;
  bool fix_gamma = false, static_shape = false;
  int axis = 1;
  std::vector<int> shape_buffer[3];  // shapes handed back from infer_shape: (C,), x, info
  Fn callbacks[10];
  void* contexts[10];
};

std::shared_ptr<Group> find_group(const std::string& id, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(id);
  if (it != g_groups.end()) return it->second;
  *error = "SyncBatchNorm group '" + id + "' is unknown: the layer was deleted or its graph "
           "was loaded into another process. Use revert_model() before export.";
  return nullptr;
}

int list_args(char*** out, void*) { *out = const_cast<char**>(ARGS); return 1; }
int list_outs(char*** out, void*) { *out = const_cast<char**>(OUTS); return 1; }
int list_auxs(char*** out, void*) { *out = const_cast<char**>(AUXS); return 1; }

// Order of shapes: data, gamma, beta | output, info | running_mean, running_var.
int infer_shape(int num, int* ndims, int** shapes, void* state) {
  Prop& p = *static_cast<Prop*>(state);
  std::string error;
  auto group = find_group(p.group_id, &error);
  if (!group) return fail("SyncBatchNormError", error);
  const int ndim = ndims[0];
  if (ndim <= 0) return 1;  // not known yet
  if (ndim < 2 || ndim > 5)
    return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "' expects input of 2 "
                "to 5 dimensions, got " + std::to_string(ndim) + ". Reshape the input, e.g. "
                "to (N, C, L).");
  int axis = p.axis < 0 ? p.axis + ndim : p.axis;
  if (axis < 0 || axis >= ndim)
    return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "': axis=" +
                std::to_string(p.axis) + " is out of range for input of " +
                std::to_string(ndim) + " dimensions.");
  const int channels = shapes[0][axis];
  const char* names[] = {"", "gamma", "beta", "", "", "running_mean", "running_var"};
  for (int i : {1, 2, 5, 6}) {
    if (i >= num || ndims[i] != 1 || shapes[i][0] <= 0) continue;
    if (shapes[i][0] != channels)
      return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "': input has " +
                  std::to_string(channels) + " channels on axis " + std::to_string(p.axis) +
                  " but " + names[i] + " has shape (" + std::to_string(shapes[i][0]) +
                  ",). Set in_channels=" + std::to_string(channels) + " or feed " +
                  std::to_string(shapes[i][0]) + " channels.");
  }
  p.shape_buffer[0].assign(1, channels);
  p.shape_buffer[1].assign(shapes[0], shapes[0] + ndim);
  p.shape_buffer[2].assign(1, kInfoHead + 2 * channels);
  for (int i : {1, 2, 5, 6}) { ndims[i] = 1; shapes[i] = p.shape_buffer[0].data(); }
  ndims[3] = ndim; shapes[3] = p.shape_buffer[1].data();
  ndims[4] = 1; shapes[4] = p.shape_buffer[2].data();
  return 1;
}

// Order of types: as for shapes. Parameters keep their own dtype (float32
// unless the network was cast to float64); info is float64.
int infer_type(int, int* types, void*) {
  int param = types[1] >= 0 ? types[1] : kFloat32;
  types[1] = types[2] = types[5] = types[6] = param;
  types[3] = types[0];
  types[4] = kFloat64;
  return 1;
}

int infer_stype(int num, int* stypes, void*) {
  for (int i = 0; i < num; ++i) stypes[i] = 0;  // default storage only
  return 1;
}

int infer_stype_backward(int num, int* stypes, int*, void*) {
  for (int i = 0; i < num; ++i) stypes[i] = 0;
  return 1;
}

int bwd_dep(const int* out_grad, const int* in_data, const int* out_data, int* num,
            int** deps, void*) {
  static thread_local int buffer[4];
  buffer[0] = out_grad[0];  // dy
  buffer[1] = in_data[0];   // x
  buffer[2] = in_data[1];   // gamma
  buffer[3] = out_data[1];  // info: the global mean and variance, token and call
  *num = 4;
  *deps = buffer;
  return 1;
}

int create_operator(const char* ctx, int, unsigned**, const int*, const int* dtypes,
                    MXCallbackList* ret, void* state) {
  Prop& p = *static_cast<Prop*>(state);
  std::string error;
  auto group = find_group(p.group_id, &error);
  if (!group) return fail("SyncBatchNormError", error);
  int device = -1;
  for (size_t i = 0; i < group->devices.size(); ++i)
    if (group->devices[i] == ctx) device = static_cast<int>(i);
  if (device < 0)
    return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "' was called on " +
                ctx + ", but its parameters live on " + join(group->devices) + ". Initialize the network on every context you feed.");
  const int dtype = dtypes[0];
  if (dtype != kFloat32 && dtype != kFloat64)
    return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "': the native "
                "operator takes float32 or float64 input; this is a bug in gluon_syncbn "
                "(the layer should have chosen the Python operator), please report it.");
  Op* op = new Op();
  op->group = group;
  op->device = device;
  op->eps = p.eps;
  op->momentum = p.momentum;
  op->fix_gamma = p.fix_gamma;
  op->static_shape = p.static_shape;
  op->axis = p.axis;
  op->dtype_name = p.dtype_name;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    // Issued now (imperative and dynamic graphs). A call issued after an abort
    // but before the next step begins belongs to the failed step.
    op->token = g_issue_token;
  }
  op->callbacks[0] = reinterpret_cast<Fn>(op_delete);
  op->callbacks[1] = reinterpret_cast<Fn>(op_forward);
  op->callbacks[2] = reinterpret_cast<Fn>(op_backward);
  for (auto& c : op->contexts) c = op;
  ret->num_callbacks = 3;
  ret->callbacks = op->callbacks;
  ret->contexts = op->contexts;
  return 1;
}

int prop_delete(void* state) { delete static_cast<Prop*>(state); return 1; }

int prop_creator(const char*, const int num_kwargs, const char** keys, const char** values,
                 MXCallbackList* ret) {
  Prop* p = new Prop();
  for (int i = 0; i < num_kwargs; ++i) {
    std::string key = keys[i], value = values[i];
    bool yes = value == "True" || value == "true" || value == "1";
    if (key == "group") p->group_id = value;
    else if (key == "eps") p->eps = std::stod(value);
    else if (key == "momentum") p->momentum = std::stod(value);
    else if (key == "fix_gamma") p->fix_gamma = yes;
    else if (key == "static_shape") p->static_shape = yes;
    else if (key == "axis") p->axis = std::stoi(value);
    else if (key == "input_dtype") p->dtype_name = value;
  }
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

// ----------------------------------------------------- interface to Python --
// Loaded with ctypes by gluon_syncbn/native.py. Strings are UTF-8.

extern "C" {

int gsbn_register(const char* op_type) { return MXCustomOpRegister(op_type, prop_creator); }

void gsbn_group_create(const char* id, const char* name, const char* devices, int num_devices,
                       double timeout, const char* hint) {
  auto g = std::make_shared<Group>();
  g->name = name;
  g->hint = hint;
  g->timeout = timeout;
  const char* d = devices;  // num_devices NUL-separated names
  for (int i = 0; i < num_devices; ++i, d += std::strlen(d) + 1) g->devices.emplace_back(d);
  g->next_call.assign(num_devices, 0);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_groups[id] = g;
}

void gsbn_group_set_running(const char* id, int device, NDArrayHandle mean, NDArrayHandle var) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(id);
  if (it == g_groups.end()) return;
  auto& running = it->second->running;
  if (running.size() <= static_cast<size_t>(device)) running.resize(device + 1);
  running[device] = {mean, var};
}

void gsbn_group_remove(const char* id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_groups.erase(id);
}

uint64_t gsbn_token() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_token;
}

// A training step begins (Python's record()/train_mode() scope is entered).
void gsbn_begin_step() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_issue_token = g_token;
}

void gsbn_abort(const char* cause) {
  std::lock_guard<std::mutex> lock(g_mutex);
  abort_locked(cause);
}

// The cause of the last abort, copied into buf (at most size bytes).
int gsbn_cause(char* buf, int size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::snprintf(buf, size, "%s", g_cause.c_str());
  return static_cast<int>(g_cause.size());
}

// Failures since the last call, "Kind\tmessage" lines, oldest first.
int gsbn_take_errors(char* buf, int size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::string out;
  for (const auto& e : g_errors) out += e + "\n";
  g_errors.clear();
  std::snprintf(buf, size, "%s", out.c_str());
  return static_cast<int>(out.size());
}

}  // extern "C"
