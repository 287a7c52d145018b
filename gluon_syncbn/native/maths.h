// The maths of a layer call in host memory, in float64, shared by the
// operators that read and write their arrays in place (host_op.h,
// async_op.h). What crosses devices is only the vectors of wire.h.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "arrays.h"
#include "operator.h"
#include "wire.h"

namespace {

// This slice's moments: the mean first, then squared deviations from it, so
// |mean| >> std loses nothing before the float64 merge. Returns the count
// (0: an empty slice takes part).
double local_moments(const Layout& l, const Array& x, std::vector<double>* mean,
                     std::vector<double>* var) {
  mean->assign(l.channels, 0.0);
  var->assign(l.channels, 0.0);
  for_each(l, [&](int64_t c, int64_t i) { (*mean)[c] += at(x, i); });
  const double count = static_cast<double>(l.count());
  for (int64_t c = 0; c < l.channels && count > 0; ++c) (*mean)[c] /= count;
  for_each(l, [&](int64_t c, int64_t i) { double d = at(x, i) - (*mean)[c]; (*var)[c] += d * d; });
  for (int64_t c = 0; c < l.channels && count > 0; ++c) (*var)[c] /= count;
  return count;
}

// Predict mode: the running statistics, as the statistics to normalize with.
Info running_statistics(const Array& rmean, const Array& rvar) {
  Info stats;  // call < 0: no backward through it
  for (int64_t c = 0; c < rmean.size(); ++c) {
    stats.mean.push_back(at(rmean, c));
    stats.var.push_back(at(rvar, c));
  }
  return stats;
}

// running = momentum * running + (1 - momentum) * batch; the caller holds
// write access to the arrays.
void update_running(const Params& p, const Array& rmean, const Array& rvar, const Info& stats) {
  for (int64_t c = 0; c < rmean.size(); ++c) {
    put(rmean, c, at(rmean, c) * p.momentum + stats.mean[c] * (1.0 - p.momentum), 1);
    put(rvar, c, at(rvar, c) * p.momentum + stats.var[c] * (1.0 - p.momentum), 1);
  }
}

// y = gamma * (x - mean) / sqrt(var + eps) + beta, as one scale and shift.
void normalize(const Params& p, const Layout& l, const Array& x, const Array& gamma,
               const Array& beta, const Info& stats, const Array& y, int req) {
  if (req == kNull) return;
  std::vector<double> scale(l.channels), shift(l.channels);
  for (int64_t c = 0; c < l.channels; ++c) {
    double inv_std = 1.0 / std::sqrt(stats.var[c] + p.eps);
    scale[c] = (p.fix_gamma ? 1.0 : at(gamma, c)) * inv_std;
    shift[c] = at(beta, c) - stats.mean[c] * scale[c];
  }
  for_each(l, [&](int64_t c, int64_t i) { put(y, i, at(x, i) * scale[c] + shift[c], req); });
}

// This slice's BACKWARD sums: sum dy and sum dy * (x - mean), per channel.
void backward_sums(const Layout& l, const Array& dy, const Array& x, const Info& stats,
                   std::vector<double>* sum_dy, std::vector<double>* sum_dy_xc) {
  sum_dy->assign(l.channels, 0.0);
  sum_dy_xc->assign(l.channels, 0.0);
  for_each(l, [&](int64_t c, int64_t i) {
    double d = at(dy, i);
    (*sum_dy)[c] += d;
    (*sum_dy_xc)[c] += d * (at(x, i) - stats.mean[c]);
  });
}

// The gradients from the devices' summed BACKWARD vector `total`:
// dx = a*dy - b - k*(x - mean); gamma's and beta's stay per device (the
// Trainer sums them). req: dx, dgamma, dbeta.
void write_gradients(const Params& p, const Layout& l, const Array& dy, const Array& x,
                     const Array& gamma, const Info& stats, const std::vector<double>& total,
                     const std::vector<double>& sum_dy, const std::vector<double>& sum_dy_xc,
                     const Array& dx, const Array& dgamma, const Array& dbeta, const int* req) {
  const int64_t C = l.channels;
  const double n = stats.n;
  std::vector<double> inv_std(C), a(C), b(C), k(C);
  for (int64_t c = 0; c < C; ++c) {
    inv_std[c] = 1.0 / std::sqrt(stats.var[c] + p.eps);
    double gscale = (p.fix_gamma ? 1.0 : at(gamma, c)) * inv_std[c];
    a[c] = gscale;
    b[c] = gscale * total[c] / n;
    k[c] = gscale * inv_std[c] * inv_std[c] * total[C + c] / n;
  }
  if (req[0] != kNull)
    for_each(l, [&](int64_t c, int64_t i) {
      put(dx, i, a[c] * at(dy, i) - b[c] - k[c] * (at(x, i) - stats.mean[c]), req[0]);
    });
  for (int64_t c = 0; c < C; ++c) {
    if (req[1] != kNull) put(dgamma, c, p.fix_gamma ? 0.0 : sum_dy_xc[c] * inv_std[c], req[1]);
    if (req[2] != kNull) put(dbeta, c, sum_dy[c], req[2]);
  }
}

}  // namespace
