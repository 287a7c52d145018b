// Arrays in host memory, read and written in place by the native operators
// (the asynchronous operator's data, the exchange operator's host staging).
//
// Every element is read and written as the dtype its array has: float16,
// bfloat16, float32 or float64 (MXNet's own half_t and bf16_t conversions, so
// a narrowing write rounds as MXNet's Cast does). Callers refuse any other
// dtype first (dtype_problem); no read assumes one.
#pragma once
#include <mshadow/bfloat.h>
#include <mshadow/half.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// mshadow's dtype flags
const int kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kInt32 = 4, kInt64 = 6, kBfloat16 = 12;
const int kNull = 0, kAddTo = 3;  // OpReqType

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

}  // namespace
