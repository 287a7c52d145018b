// The numbers that leave one device's call: the layouts of gluon_syncbn/wire.py
// (which documents them), packed and unpacked here for the native operators.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// FORWARD: [n, n*mean (C), n*(var + mean^2) (C)]
std::vector<double> pack_forward(double count, const std::vector<double>& mean,
                                 const std::vector<double>& var) {
  const size_t C = mean.size();
  std::vector<double> v(1 + 2 * C);
  v[0] = count;
  for (size_t c = 0; c < C; ++c) {
    v[1 + c] = count * mean[c];
    v[1 + C + c] = count * (var[c] + mean[c] * mean[c]);
  }
  return v;
}

// (n, sum x / n, sum x^2 / n) from a summed FORWARD vector.
void unpack_forward(const std::vector<double>& total, double* n, std::vector<double>* mean,
                    std::vector<double>* mean_sq) {
  const size_t C = (total.size() - 1) / 2;
  *n = total[0];
  mean->resize(C);
  mean_sq->resize(C);
  for (size_t c = 0; c < C; ++c) {
    (*mean)[c] = total[1 + c] / *n;
    (*mean_sq)[c] = total[1 + C + c] / *n;
  }
}

size_t forward_channels(size_t size) { return (size - 1) / 2; }
size_t backward_channels(size_t size) { return size / 2; }

// BACKWARD: [sum dy (C), sum dy*(x - mean) (C)]; unpacked by index: total[c]
// and total[C + c].
std::vector<double> pack_backward(const std::vector<double>& sum_dy,
                                  const std::vector<double>& sum_dy_xc) {
  std::vector<double> v(sum_dy);
  v.insert(v.end(), sum_dy_xc.begin(), sum_dy_xc.end());
  return v;
}

// Across processes every vector starts with one row per worker, in rank
// order, each worker filling its own (the others' come back with the sum):
// CHECKED, [rows of kCheckRow: channels, call number, dtype][vector][ownership];
// LAYER, rows of kLayerRow describing a layer at its first call:
// [channels, dtype, sync groups, ownership entries, name length, name bytes].
const size_t kCheckRow = 3;
const size_t kNameBytes = 48;
const size_t kLayerRow = 5 + kNameBytes;

// The dtypes of a layer's input by code (0: none; wire.py's DTYPES).
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

// A LAYER row: `name` cut to kNameBytes bytes.
std::vector<double> pack_layer(double channels, const std::string& dtype, int sync_groups,
                               size_t ownership, const std::string& name) {
  std::vector<double> row(kLayerRow, 0.0);
  const size_t length = std::min(name.size(), kNameBytes);
  row[0] = channels;
  row[1] = dtype_code(dtype);
  row[2] = sync_groups;
  row[3] = static_cast<double>(ownership);
  row[4] = static_cast<double>(length);
  for (size_t i = 0; i < length; ++i) row[5 + i] = static_cast<unsigned char>(name[i]);
  return row;
}

// The name in a LAYER row (bytes that are no byte read as '?').
std::string layer_name_of(const double* row) {
  std::string name;
  const double length = std::min(row[4], static_cast<double>(kNameBytes));
  for (size_t i = 0; i < length; ++i) {
    const double c = row[5 + i];
    name += c >= 1 && c < 256 && c == static_cast<int>(c) ? static_cast<char>(c) : '?';
  }
  return name;
}

// Across processes a FORWARD row [n, sum x, sum x^2] (one per sync group)
// travels about a shift common to every worker, the per-channel means of
// the layer's previous call, as [n, sum (x - s), sum (x - s)^2]: close to
// the mean, its sums lose nothing where the engine sums in float32 (MXNet
// 1.9.1's kvstore server does, where its multi_precision_ flag is left
// uninitialized). `shift` holds C numbers per row; `sign` -1 makes the
// rows that travel, +1 turns them back: moving the data by d = sign * s,
// [n, s1, s2] becomes [n, s1 + n d, s2 + 2 d s1 + n d^2].
void shift_forward(std::vector<double>* rows, size_t begin, size_t num_rows,
                   const std::vector<double>& shift, int sign) {
  const size_t C = shift.size() / num_rows, size = 1 + 2 * C;
  for (size_t r = 0; r < num_rows; ++r) {
    double* v = rows->data() + begin + r * size;
    for (size_t c = 0; c < C; ++c) {
      const double d = sign * shift[r * C + c], n = v[0], s1 = v[1 + c];
      v[1 + c] = s1 + n * d;
      v[1 + C + c] += 2 * d * s1 + n * d * d;
    }
  }
}

// The per-channel means of summed FORWARD rows (0 where a row has no
// samples): the next call's shift.
std::vector<double> forward_means(const std::vector<double>& rows, size_t begin,
                                  size_t num_rows, size_t channels) {
  std::vector<double> means(num_rows * channels, 0.0);
  const size_t size = 1 + 2 * channels;
  for (size_t r = 0; r < num_rows; ++r) {
    const double* v = rows.data() + begin + r * size;
    for (size_t c = 0; c < channels && v[0] > 0; ++c) means[r * channels + c] = v[1 + c] / v[0];
  }
  return means;
}

struct Info {
  double token = -1, call = -1, n = 0;  // call < 0: a call made in inference mode
  std::vector<double> mean, var;
};

}  // namespace
