// The arrays a custom-operator callback receives, read and written two ways:
// in place (host memory: CPU contexts) or by copies through MXNet (any
// device: what the device operator does on GPUs, and on CPU contexts under
// GLUON_SYNCBN_DEVICE_PATH=1, so CI runs that code too).
//
// Every element is read and written as the dtype its array has: float16,
// bfloat16, float32 or float64 (MXNet's own half_t and bf16_t conversions, so
// a narrowing write rounds as MXNet's Cast does). Callers refuse any other
// dtype first (dtype_problem); no read assumes one.
#pragma once
#include <mxnet/c_api.h>
#include <mshadow/bfloat.h>
#include <mshadow/half.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <string>
#include <vector>

#include <nnvm/c_api.h>  // NNGetOpHandle

namespace {

typedef int (*Fn)(void);
// mshadow's dtype flags
const int kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kInt32 = 4, kInt64 = 6, kBfloat16 = 12;
const int kNull = 0, kAddTo = 3;                                            // OpReqType
const int kInData = 0, kOutData = 1, kInGrad = 2, kOutGrad = 3, kAux = 4;   // callback tags

typedef mshadow::half::half_t Half;
typedef mshadow::bfloat::bf16_t BFloat16;

bool is_float(int dtype) {
  return dtype == kFloat32 || dtype == kFloat64 || dtype == kFloat16 || dtype == kBfloat16;
}

std::string dtype_label(int dtype) {
  switch (dtype) {
    case kFloat32: return "float32";
    case kFloat64: return "float64";
    case kFloat16: return "float16";
    case kBfloat16: return "bfloat16";
    case kInt32: return "int32";
    case kInt64: return "int64";
  }
  return "dtype flag " + std::to_string(dtype);
}

// Why an array of `dtype` (the layer's `what`: "input", "the output's
// gradient") cannot be used, or "" if it can.
std::string dtype_problem(const std::string& layer, const std::string& what, int dtype) {
  if (is_float(dtype)) return "";
  return "SyncBatchNorm '" + layer + "': " + what + " is " + dtype_label(dtype) +
         "; the layer takes float16, bfloat16, float32 or float64. Cast it to the "
         "network's dtype.";
}

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

// Element i of a, widened to double (NaN for a dtype dtype_problem refuses).
double at(const Array& a, int64_t i) {
  switch (a.dtype) {
    case kFloat32: return static_cast<const float*>(a.data)[i];
    case kFloat64: return static_cast<const double*>(a.data)[i];
    case kFloat16: return static_cast<float>(static_cast<const Half*>(a.data)[i]);
    case kBfloat16: return static_cast<float>(static_cast<const BFloat16*>(a.data)[i]);
  }
  return NAN;
}

// Store v (or add it, req kAddTo) into element i of a, rounded to a's dtype.
template <typename T> void store(void* data, int64_t i, double v, int req) {
  T* p = static_cast<T*>(data) + i;
  *p = T(req == kAddTo ? static_cast<double>(*p) + v : v);
}

void put(const Array& a, int64_t i, double v, int req) {
  switch (a.dtype) {
    case kFloat32: return store<float>(a.data, i, v, req);
    case kFloat64: return store<double>(a.data, i, v, req);
    case kFloat16: return store<Half>(a.data, i, v, req);
    case kBfloat16: return store<BFloat16>(a.data, i, v, req);
  }
}

// The (outer, C, inner) view of an array around the channel axis.
struct Layout {
  int64_t outer = 1, channels = 1, inner = 1;
  Layout() {}
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


// ------------------------------------------------------- copies through MXNet --
// MXNDArraySyncCopyToCPU/FromCPU wait for the array's engine variable. The
// arrays a callback gets have fresh variables of their own (AllocateNDArrayCopy),
// so the waits end at once; on a GPU the copy runs on the engine's copy
// workers. Return false with MXNet's error in `error`.

std::vector<int64_t> shape_of(NDArrayHandle h) {
  int ndim = 0;
  const int64_t* dims = nullptr;
  MXNDArrayGetShapeEx64(h, &ndim, &dims);
  return ndim > 0 ? std::vector<int64_t>(dims, dims + ndim) : std::vector<int64_t>();
}

int64_t size_of(NDArrayHandle h) {
  int64_t s = 1;
  for (auto d : shape_of(h)) s *= d;
  return s;
}

template <typename T> bool copy_in(NDArrayHandle h, int64_t size, std::vector<double>* out,
                                   std::string* error) {
  std::vector<T> buffer(size);
  if (MXNDArraySyncCopyToCPU(h, buffer.data(), size) != 0) {
    *error = MXGetLastError();
    return false;
  }
  out->resize(size);
  for (int64_t i = 0; i < size; ++i) (*out)[i] = static_cast<double>(buffer[i]);
  return true;
}

bool read_copy(NDArrayHandle h, std::vector<double>* out, std::string* error) {
  int dtype = kFloat32;
  MXNDArrayGetDType(h, &dtype);
  const int64_t size = size_of(h);
  switch (dtype) {
    case kFloat32: return copy_in<float>(h, size, out, error);
    case kFloat64: return copy_in<double>(h, size, out, error);
    case kFloat16: return copy_in<Half>(h, size, out, error);
    case kBfloat16: return copy_in<BFloat16>(h, size, out, error);
    case kInt32: return copy_in<int32_t>(h, size, out, error);
    case kInt64: return copy_in<int64_t>(h, size, out, error);
  }
  *error = "unexpected " + dtype_label(dtype);
  return false;
}

// read_copy of several arrays; stops at the first failure.
bool read_copies(std::initializer_list<std::pair<NDArrayHandle, std::vector<double>*>> arrays,
                 std::string* error) {
  for (const auto& a : arrays)
    if (!read_copy(a.first, a.second, error)) return false;
  return true;
}

template <typename T> bool copy_out(NDArrayHandle h, const std::vector<double>& values,
                                    std::string* error) {
  std::vector<T> buffer;
  for (double v : values) buffer.push_back(T(v));
  if (MXNDArraySyncCopyFromCPU(h, buffer.data(), buffer.size()) != 0) {
    *error = MXGetLastError();
    return false;
  }
  return true;
}

// Store `values` (one per element) with request `req` (write or add).
bool write_copy(NDArrayHandle h, std::vector<double> values, int req, std::string* error) {
  if (req == kNull) return true;
  if (req == kAddTo) {
    std::vector<double> old;
    if (!read_copy(h, &old, error)) return false;
    for (size_t i = 0; i < values.size(); ++i) values[i] += old[i];
  }
  int dtype = kFloat32;
  MXNDArrayGetDType(h, &dtype);
  switch (dtype) {
    case kFloat32: return copy_out<float>(h, values, error);
    case kFloat64: return copy_out<double>(h, values, error);
    case kFloat16: return copy_out<Half>(h, values, error);
    case kBfloat16: return copy_out<BFloat16>(h, values, error);
    case kInt32: return copy_out<int32_t>(h, values, error);
    case kInt64: return copy_out<int64_t>(h, values, error);
  }
  *error = "unexpected " + dtype_label(dtype);
  return false;
}

// Invoke MXNet operator `name` on `inputs` into `out`, queued on the engine
// (not waited for). `keys`/`values`: its string arguments.
bool invoke(const char* name, std::vector<NDArrayHandle> inputs, NDArrayHandle out,
            std::vector<const char*> keys, std::vector<const char*> values) {
  void* op = nullptr;
  if (NNGetOpHandle(name, &op) != 0) return false;
  int num_out = 1;
  NDArrayHandle outs[1] = {out};
  NDArrayHandle* out_ptr = outs;
  return MXImperativeInvoke(op, static_cast<int>(inputs.size()), inputs.data(), &num_out,
                            &out_ptr, static_cast<int>(keys.size()), keys.data(),
                            values.data()) == 0;
}

// Queue `running = running * momentum + batch * (1 - momentum)` on `running`
// (any device) with MXNet's own operators, without waiting: the
// read-modify-write runs in engine order, after every operation already
// issued on `running` and before every later one, however far the caller's
// thread runs ahead. (Computing the new value from a read made now and
// queueing a copy of it would lose an update queued in between.)
bool running_update_async(NDArrayHandle running, const std::vector<double>& batch,
                          double momentum, std::string* error) {
  int dtype = kFloat32, dev_type = 1, dev_id = 0;
  MXNDArrayGetDType(running, &dtype);
  MXNDArrayGetContext(running, &dev_type, &dev_id);
  uint32_t shape[1] = {static_cast<uint32_t>(batch.size())};
  std::vector<double> share(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) share[i] = batch[i] * (1.0 - momentum);
  char scalar[32];
  std::snprintf(scalar, sizeof(scalar), "%.17g", momentum);
  NDArrayHandle tmp = nullptr;
  bool ok = MXNDArrayCreateEx(shape, 1, dev_type, dev_id, 0, dtype, &tmp) == 0 &&
            write_copy(tmp, share, 1, error) &&
            invoke("_mul_scalar", {running}, running, {"scalar"}, {scalar}) &&
            invoke("elemwise_add", {running, tmp}, running, {}, {});
  if (!ok && error->empty()) *error = MXGetLastError();
  if (tmp) MXNDArrayFree(tmp);  // the queued addition holds its own reference
  return ok;
}

}  // namespace
