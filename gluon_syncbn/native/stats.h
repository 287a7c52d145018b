// The statistics of SyncBatchNorm in float64, in two parts: a whole layer
// call on arrays in host memory (the asynchronous operator, async_op.h), and
// the synchronization step on per-channel vectors, whose local moments
// MXNet's operators computed on the device (the exchange operator,
// exchange_op.h): the C++ twin of gluon_syncbn/stats.py, function for
// function. What crosses devices is only the vectors of wire.h.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "arrays.h"
#include "operator.h"
#include "wire.h"

namespace {

// ------------------------------------------------ whole calls in host memory --

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

// ------------------------------------------------- per-channel vectors --
// The exchange operator's, and gluon_syncbn/stats.py's functions under the
// same names and with the same maths (stats.py documents them). The block
// hands over, per channel, m1 (the centre: a float32 estimate of the mean),
// m2 (mean of x - m1) and v (mean of (x - m1)^2), computed on the device.

// The FORWARD vector this device adds to the sum.
std::vector<double> forward_contribution(double count, const std::vector<double>& m1,
                                         const std::vector<double>& m2,
                                         const std::vector<double>& v) {
  const size_t C = m1.size();
  std::vector<double> mean(C), var(C);
  for (size_t c = 0; c < C; ++c) {
    mean[c] = m1[c] + m2[c];
    var[c] = std::max(v[c] - m2[c] * m2[c], 0.0);
  }
  return pack_forward(count, mean, var);
}

// The global n, mean and (biased) variance from the summed FORWARD vectors;
// the caller has checked that n > 0 (session.h, own_checks).
Info merge(const std::vector<double>& total) {
  Info stats;
  std::vector<double> mean_sq;
  unpack_forward(total, &stats.n, &stats.mean, &mean_sq);
  stats.var.resize(stats.mean.size());
  for (size_t c = 0; c < stats.mean.size(); ++c)
    stats.var[c] = std::max(mean_sq[c] - stats.mean[c] * stats.mean[c], 0.0);
  return stats;
}

// y = (x - m1) * scale + shift with the global statistics; shift absorbs
// mean - m1, so the large offset never meets the data again. gamma is 1
// under fix_gamma.
void normalize_coefficients(const Params& p, const Info& stats, const std::vector<double>& m1,
                            const std::vector<double>& gamma, const std::vector<double>& beta,
                            std::vector<double>* scale, std::vector<double>* shift) {
  const size_t C = m1.size();
  scale->assign(C, 0.0);
  shift->assign(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    double inv_std = 1.0 / std::sqrt(stats.var[c] + p.eps);
    (*scale)[c] = (p.fix_gamma ? 1.0 : gamma[c]) * inv_std;
    (*shift)[c] = beta[c] - (stats.mean[c] - m1[c]) * (*scale)[c];
  }
}

// This device's BACKWARD vector, from the gradients of scale and shift
// (sums of dy*(x - m1) and dy), and its d gamma (d beta is d shift); gamma
// becomes 1 under fix_gamma. An empty slice adds nothing (MXNet leaves
// reductions over size-0 arrays unwritten: its d scale, d shift are not even
// zeros).
std::vector<double> backward_contribution(const Params& p, const Info& stats,
                                          const std::vector<double>& m1, double count,
                                          std::vector<double>* gamma,
                                          std::vector<double>* d_scale,
                                          std::vector<double>* d_shift,
                                          std::vector<double>* inv_std,
                                          std::vector<double>* d_gamma) {
  const size_t C = m1.size();
  if (count == 0) {
    d_scale->assign(C, 0.0);
    d_shift->assign(C, 0.0);
  }
  std::vector<double> sum_dy_xc(C);
  inv_std->assign(C, 0.0);
  d_gamma->assign(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    if (p.fix_gamma) (*gamma)[c] = 1.0;
    (*inv_std)[c] = 1.0 / std::sqrt(stats.var[c] + p.eps);
    sum_dy_xc[c] = (*d_scale)[c] - (*d_shift)[c] * (stats.mean[c] - m1[c]);
    (*d_gamma)[c] = p.fix_gamma ? 0.0 : sum_dy_xc[c] * (*inv_std)[c];
  }
  return pack_backward(*d_shift, sum_dy_xc);
}

// The gradients of this device's m2 and v from the summed BACKWARD vectors
// `total`: through the global mean and variance (m1 is a constant).
void local_moment_grads(const std::vector<double>& total, double count, const Info& stats,
                        const std::vector<double>& m1, const std::vector<double>& gamma,
                        const std::vector<double>& inv_std, std::vector<double>* d_m2,
                        std::vector<double>* d_v) {
  const size_t C = m1.size();
  d_m2->assign(C, 0.0);
  d_v->assign(C, 0.0);
  const double w = count / stats.n;
  for (size_t c = 0; c < C; ++c) {
    double g_delta = -total[c] * gamma[c] * inv_std[c];
    double g_var = -0.5 * total[C + c] * gamma[c] * std::pow(inv_std[c], 3);
    (*d_m2)[c] = g_delta * w + g_var * 2.0 * w * (m1[c] - stats.mean[c]);
    (*d_v)[c] = g_var * w;
  }
}

}  // namespace
