// The numbers that leave one device's call: the layouts of gluon_syncbn/wire.py
// (which documents them), packed and unpacked here for the native operators.
#pragma once
#include <algorithm>
#include <cstdint>
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

struct Info {
  double token = -1, call = -1, n = 0;  // call < 0: a call made in inference mode
  std::vector<double> mean, var;
};

}  // namespace
