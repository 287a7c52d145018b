// The statistics of SyncBatchNorm in float64: the tests' oracle
// tests/stats.py's functions under the same names and with the same maths
// (it documents them), on per-channel vectors; then the elementwise loops of the
// asynchronous operator's whole calls on host arrays around them. What
// crosses devices is only the vectors of wire.h.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "arrays.h"
#include "params.h"
#include "wire.h"

namespace {

// ------------------------------------------------- per-channel vectors --
// Per channel, m1 is the centre (the exchange operator's: a float32
// estimate of the mean, computed on the device), m2 the mean of x - m1 and
// v its (biased) variance, the local variance.

double inv_std(const Params& p, double var) { return 1.0 / std::sqrt(var + p.eps); }

// This device's FORWARD vector.
std::vector<double> forward_contribution(double count, const std::vector<double>& m1,
                                         const std::vector<double>& m2,
                                         const std::vector<double>& v) {
  const size_t C = m1.size();
  std::vector<double> mean(C), var(C);
  for (size_t c = 0; c < C; ++c) {
    mean[c] = m1[c] + m2[c];
    var[c] = std::max(v[c], 0.0);
  }
  return pack_forward(count, mean, var);
}

// The global n, mean and (biased) variance from the combined FORWARD
// vectors; the meeting has refused n == 0 first (session.h, empty_batch).
Info global_statistics(const std::vector<double>& total) {
  Info stats;
  const size_t C = forward_channels(total.size());
  stats.n = total[0];
  stats.mean.assign(total.begin() + 1, total.begin() + 1 + C);
  stats.var.resize(C);
  for (size_t c = 0; c < C; ++c) stats.var[c] = std::max(total[1 + C + c] / stats.n, 0.0);
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
    (*scale)[c] = (p.fix_gamma ? 1.0 : gamma[c]) * inv_std(p, stats.var[c]);
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
                                          std::vector<double>* inv_stds,
                                          std::vector<double>* d_gamma) {
  const size_t C = m1.size();
  if (count == 0) {
    d_scale->assign(C, 0.0);
    d_shift->assign(C, 0.0);
  }
  std::vector<double> sum_dy_xc(C);
  inv_stds->assign(C, 0.0);
  d_gamma->assign(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    if (p.fix_gamma) (*gamma)[c] = 1.0;
    (*inv_stds)[c] = inv_std(p, stats.var[c]);
    sum_dy_xc[c] = (*d_scale)[c] - (*d_shift)[c] * (stats.mean[c] - m1[c]);
    (*d_gamma)[c] = p.fix_gamma ? 0.0 : sum_dy_xc[c] * (*inv_stds)[c];
  }
  return pack_backward(*d_shift, sum_dy_xc);
}

// The gradients of this device's m2 and v from the summed BACKWARD vectors
// `total`: through the global mean and variance (m1 is a constant;
// local_mean is m1 + m2).
void local_moment_grads(const std::vector<double>& total, double count, const Info& stats,
                        const std::vector<double>& local_mean, const std::vector<double>& gamma,
                        const std::vector<double>& inv_stds, std::vector<double>* d_m2,
                        std::vector<double>* d_v) {
  const size_t C = local_mean.size();
  d_m2->assign(C, 0.0);
  d_v->assign(C, 0.0);
  const double w = count / stats.n;
  for (size_t c = 0; c < C; ++c) {
    double g_delta = -total[c] * gamma[c] * inv_stds[c];
    double g_var = -0.5 * total[C + c] * gamma[c] * std::pow(inv_stds[c], 3);
    (*d_m2)[c] = g_delta * w + g_var * 2.0 * w * (local_mean[c] - stats.mean[c]);
    (*d_v)[c] = g_var * w;
  }
}

// A device's tally (gluon_syncbn.update_bn_stats): over the training calls
// it saw, their number and the sums of each call's global n, n * mean and
// n * var; gluon_syncbn/tally.py's Tally.
struct Tally {
  double calls = 0, n = 0;
  std::vector<double> mean_sum, var_sum;

  void add(const Info& stats) {
    const size_t C = stats.mean.size();
    if (mean_sum.size() != C) {
      mean_sum.assign(C, 0.0);
      var_sum.assign(C, 0.0);
    }
    calls += 1;
    n += stats.n;
    for (size_t c = 0; c < C; ++c) {
      mean_sum[c] += stats.n * stats.mean[c];
      var_sum[c] += stats.n * stats.var[c];
    }
  }
};

// ------------------------------------------------ whole calls in host memory --
// The asynchronous operator's, with the maths above: its FORWARD vector is
// centred on the slice's own mean (m1 = mean, m2 = 0, v = var), and y on 0
// (m1 = 0: y = x * scale + shift). Bit for bit as without them: mean + 0
// and mean - 0 are mean (no sum is -0).

// Elements [begin, end) of a 1-D array (end < 0: all).
std::vector<double> values(const Array& a, int64_t begin = 0, int64_t end = -1) {
  std::vector<double> out;
  for (int64_t i = begin; i < (end < 0 ? a.size() : end); ++i) out.push_back(at(a, i));
  return out;
}

// This slice's FORWARD vector: the mean first, then squared deviations from
// it, so |mean| >> std loses nothing before the float64 merge. An empty
// slice takes part with count 0.
std::vector<double> slice_contribution(const Layout& l, const Array& x) {
  std::vector<double> mean(l.channels, 0.0), var(l.channels, 0.0);
  for_each(l, [&](int64_t c, int64_t i) { mean[c] += at(x, i); });
  const double count = static_cast<double>(l.count());
  for (int64_t c = 0; c < l.channels && count > 0; ++c) mean[c] /= count;
  for_each(l, [&](int64_t c, int64_t i) { double d = at(x, i) - mean[c]; var[c] += d * d; });
  for (int64_t c = 0; c < l.channels && count > 0; ++c) var[c] /= count;
  return forward_contribution(count, mean, std::vector<double>(l.channels, 0.0), var);
}

// Predict mode: the running statistics, as the statistics to normalize with.
Info running_statistics(const Array& rmean, const Array& rvar) {
  Info stats;  // call < 0: no backward through it
  stats.mean = values(rmean);
  stats.var = values(rvar);
  return stats;
}

// Every element of `a` set to `value`.
void fill(const Array& a, double value) {
  for (int64_t i = 0; i < a.size(); ++i) put(a, i, value, 1);
}

// running = momentum * running + (1 - momentum) * batch; the caller holds
// write access to the arrays.
void update_running(const Params& p, const Array& rmean, const Array& rvar, const Info& stats) {
  for (int64_t c = 0; c < rmean.size(); ++c) {
    put(rmean, c, at(rmean, c) * p.momentum + stats.mean[c] * (1.0 - p.momentum), 1);
    put(rvar, c, at(rvar, c) * p.momentum + stats.var[c] * (1.0 - p.momentum), 1);
  }
}

// y = gamma * (x - mean) / sqrt(var + eps) + beta, as x * scale + shift.
void normalize(const Params& p, const Layout& l, const Array& x, const Array& gamma,
               const Array& beta, const Info& stats, const Array& y, int req) {
  if (req == kNull) return;
  std::vector<double> scale, shift;
  normalize_coefficients(p, stats, std::vector<double>(l.channels, 0.0), values(gamma),
                         values(beta), &scale, &shift);
  for_each(l, [&](int64_t c, int64_t i) { put(y, i, at(x, i) * scale[c] + shift[c], req); });
}

// This slice's BACKWARD sums: sum dy and sum dy * (x - mean), per channel.
// Not backward_contribution with m1 = mean: its d_shift * (mean - m1) is
// NaN, not 0, where sum dy is infinite.
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
// dx = a*dy - b - k*(x - mean), with a the normalizing scale; gamma's and
// beta's stay per device (the Trainer sums them). Not local_moment_grads:
// its products, in another order, round differently. req: dx, dgamma, dbeta.
void write_gradients(const Params& p, const Layout& l, const Array& dy, const Array& x,
                     const Array& gamma, const Info& stats, const std::vector<double>& total,
                     const std::vector<double>& sum_dy, const std::vector<double>& sum_dy_xc,
                     const Array& dx, const Array& dgamma, const Array& dbeta, const int* req) {
  const int64_t C = l.channels;
  const double n = stats.n;
  std::vector<double> is(C), a(C), b(C), k(C);
  for (int64_t c = 0; c < C; ++c) {
    is[c] = inv_std(p, stats.var[c]);
    a[c] = (p.fix_gamma ? 1.0 : at(gamma, c)) * is[c];
    b[c] = a[c] * total[c] / n;
    k[c] = a[c] * is[c] * is[c] * total[C + c] / n;
  }
  if (req[0] != kNull)
    for_each(l, [&](int64_t c, int64_t i) {
      put(dx, i, a[c] * at(dy, i) - b[c] - k[c] * (at(x, i) - stats.mean[c]), req[0]);
    });
  for (int64_t c = 0; c < C; ++c) {
    if (req[1] != kNull) put(dgamma, c, p.fix_gamma ? 0.0 : sum_dy_xc[c] * is[c], req[1]);
    if (req[2] != kNull) put(dbeta, c, sum_dy[c], req[2]);
  }
}

}  // namespace
