// The numbers that leave one device's call, and how they cross processes,
// named once. Every vector is float64 and C is the channel count.
//
// FORWARD  [n, mean (C), m2 (C)]
//     a slice's (a device's, a process's, the whole batch's) count, mean and
//     sum of squared deviations from that mean. Vectors are merged with
//     Chan's parallel formula (combine_forward), never summed: exact whatever
//     the means, so a mean that jumps between calls, channels far apart or
//     one slice far from the others lose nothing, and a NaN or an outlier
//     stays in the call it is in (nothing is carried from call to call).
// BACKWARD [sum dy (C), sum dy*(x - mean) (C)]
//     with the global mean; summed.
// CHECKED  [one row per worker: channels, call, dtype, token, round, its vector][ownership]
//     a process's vector across processes. Each worker fills its own row (the
//     others are zeros), so the engine's sum gathers every worker's, which
//     each worker then combines in rank order: the same numbers, in the same
//     order, on every worker. The first four check numbers of every row must
//     be this worker's: the same layer width, call number and dtype, and the
//     same token (as many abandoned steps), or the workers are out of step;
//     the round (the layer's calls in that direction so far, counted from
//     the first) is for messages. The vector's numbers are encoded exactly
//     for the engine (encode_exact); ownership, 1 per global device from its
//     owner, must sum to all ones (explicit sync_groups).
// END      a worker's last row on every idle key, CHECKED or CONTROL, when it
//     ends (remote.h, end_remote): [0 channels, 0, kEndDtype, how it ended
//     (kEndFinished, kEndFailed), its round] or CONTROL kind kEndKind with
//     field `how`. A worker still calling finds it among the rows of its
//     next reduction and learns that the other ended, and how.
// CONTROL  [one row per worker: kind, fields, name bytes, sync_groups bytes]
//     what the workers must agree on outside a layer's calls, through one
//     key in the order they ask: a layer's sync groups when it is made
//     (kLayerKind: devices, their digest, the digest of its name as the
//     workers compare names, its name and its sync groups), its channels
//     and dtype at its first call, before its keys are made (kKeysKind),
//     update_bn_stats' batches (kBatchKind), and a worker's end (kEndKind).
//     Name bytes are for messages, never compared.
//
// Every number an engine adds is a whole number below 2^24 (exact in
// float32: the call number and token modulo 2^20) or a number whose other
// addends are zeros, so the sum is exact whatever precision the engine
// sums in.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// ---------------------------------------------------------------- FORWARD --

std::vector<double> pack_forward(double count, const std::vector<double>& mean,
                                 const std::vector<double>& var) {
  const size_t C = mean.size();
  std::vector<double> v(1 + 2 * C);
  v[0] = count;
  for (size_t c = 0; c < C; ++c) {
    v[1 + c] = mean[c];
    v[1 + C + c] = count * var[c];
  }
  return v;
}

size_t forward_channels(size_t size) { return (size - 1) / 2; }
size_t backward_channels(size_t size) { return size / 2; }

// Merges FORWARD vector `b` into `a` (Chan et al.'s parallel formula): the
// statistics of both slices together. A slice of no samples changes nothing.
void combine_forward(double* a, const double* b, size_t C) {
  const double na = a[0], nb = b[0], n = na + nb;
  if (nb == 0) return;
  if (na == 0) {
    std::copy(b, b + 1 + 2 * C, a);
    return;
  }
  a[0] = n;
  for (size_t c = 0; c < C; ++c) {
    const double delta = b[1 + c] - a[1 + c];
    a[1 + c] += delta * (nb / n);
    a[1 + C + c] = (a[1 + C + c] + b[1 + C + c]) + delta * delta * (na * nb / n);
  }
}

// Combines vector `b` of direction `dir` (0 FORWARD, 1 BACKWARD) into `a`.
void combine(int dir, double* a, const double* b, size_t size) {
  if (dir == 0) return combine_forward(a, b, forward_channels(size));
  for (size_t i = 0; i < size; ++i) a[i] += b[i];
}

// BACKWARD: [sum dy (C), sum dy*(x - mean) (C)]; unpacked by index: total[c]
// and total[C + c].
std::vector<double> pack_backward(const std::vector<double>& sum_dy,
                                  const std::vector<double>& sum_dy_xc) {
  std::vector<double> v(sum_dy);
  v.insert(v.end(), sum_dy_xc.begin(), sum_dy_xc.end());
  return v;
}

// --------------------------------------------------- across processes --

// How a float64 crosses an engine exactly, in `numbers` numbers: itself (1),
// where the engine sums float64 in float64 (Horovod), or four numbers exact
// in float32 (4: the exponent and three pieces of the mantissa, 24 bits
// each), where it may sum in float32 (MXNet 1.9.1's kvstore server, which
// may take float64 keys for float32 ones: see mxnet_private.py). The other
// workers add zeros to them, which changes nothing in any precision.
void encode_exact(double value, int numbers, double* out) {
  if (numbers == 1) {
    out[0] = value;
    return;
  }
  out[0] = out[2] = out[3] = 0;
  out[1] = value;
  if (value == 0 || !std::isfinite(value)) return;
  int exponent = 0;
  const double m = std::frexp(value, &exponent);  // |m| in [0.5, 1)
  const double hi = static_cast<float>(m), rest = m - hi, mid = static_cast<float>(rest);
  out[0] = exponent;
  out[1] = hi;
  out[2] = mid;
  out[3] = static_cast<float>(rest - mid);
}

double decode_exact(const double* in, int numbers) {
  if (numbers == 1) return in[0];
  if (!std::isfinite(in[1])) return in[1];
  return std::ldexp((in[1] + in[2]) + in[3], static_cast<int>(in[0]));
}

// The check numbers at the head of a worker's CHECKED row, the first
// kCompared of them compared across workers.
const size_t kCheckRow = 5, kCompared = 4;

// An END row's dtype code, and how its worker ended.
const double kEndDtype = 255;
enum { kEndFinished = 1, kEndFailed = 2 };

// The dtypes of a layer's input by code (0: none).
const char* const kDtypes[] = {"", "float32", "float64", "float16", "bfloat16"};
const int kNumDtypes = 5;

double dtype_code(const std::string& dtype) {
  for (int i = 1; i < kNumDtypes; ++i)
    if (dtype == kDtypes[i]) return i;
  return kNumDtypes;  // another dtype: refused elsewhere, but still compared
}

std::string dtype_of_code(double code) {
  const int i = static_cast<int>(code);
  return i >= 1 && i < kNumDtypes && i == code ? kDtypes[i] : "dtype #" + std::to_string(i);
}

// A whole number below 2^20, exact in float32 and in every worker's sum.
double modulo_2_20(uint64_t value) { return static_cast<double>(value % (1u << 20)); }

// ------------------------------------------------------------- CONTROL --
// A row: [kind, four fields, name length, sync_groups length, name bytes,
// sync_groups bytes]; names and sync_groups longer than their room are cut
// (a digest of the whole sync_groups is one of the fields).
const size_t kNameBytes = 48, kGroupsBytes = 32;
const size_t kControlHead = 7;
const size_t kControlRow = kControlHead + kNameBytes + kGroupsBytes;
enum { kLayerKind = 1, kBatchKind = 2, kKeysKind = 3, kEndKind = 4 };

// A 24-bit digest of `text` (FNV-1a, folded): a whole number exact in float32.
double digest24(const std::string& text) {
  uint32_t h = 2166136261u;
  for (unsigned char c : text) h = (h ^ c) * 16777619u;
  return static_cast<double>((h >> 24) ^ (h & 0xffffff));
}

std::vector<double> pack_control(int kind, const std::vector<double>& fields,
                                 const std::string& name, const std::string& groups) {
  std::vector<double> row(kControlRow, 0.0);
  row[0] = kind;
  for (size_t i = 0; i < fields.size() && i < 4; ++i) row[1 + i] = fields[i];
  const size_t name_length = std::min(name.size(), kNameBytes);
  const size_t groups_length = std::min(groups.size(), kGroupsBytes);
  row[5] = static_cast<double>(name_length);
  row[6] = static_cast<double>(groups_length);
  for (size_t i = 0; i < name_length; ++i)
    row[kControlHead + i] = static_cast<unsigned char>(name[i]);
  for (size_t i = 0; i < groups_length; ++i)
    row[kControlHead + kNameBytes + i] = static_cast<unsigned char>(groups[i]);
  return row;
}

// The text at `offset` in a CONTROL row, `length` bytes (bytes that are no
// byte read as '?').
std::string control_text(const double* row, size_t offset, double length, size_t room) {
  std::string text;
  for (size_t i = 0; i < std::min(length, static_cast<double>(room)); ++i) {
    const double c = row[offset + i];
    text += c >= 1 && c < 256 && c == static_cast<int>(c) ? static_cast<char>(c) : '?';
  }
  return text;
}
std::string control_name(const double* row) {
  return control_text(row, kControlHead, row[5], kNameBytes);
}
std::string control_groups(const double* row) {
  return control_text(row, kControlHead + kNameBytes, row[6], kGroupsBytes);
}

struct Info {
  double token = -1, call = -1, n = 0;  // call < 0: a call made in inference mode
  std::vector<double> mean, var;
};

}  // namespace
