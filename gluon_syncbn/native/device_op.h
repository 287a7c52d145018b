// The device operator: the synchronization step of a layer whose data stays
// on its device (GPUs). MXNet's own operators compute the local moments on
// the device (block.py); this operator gets only per-channel vectors, copies
// them to the host, meets the other devices at the barrier, and copies back
// the scale and shift that normalize the data, the same maths as op.py (the
// Python operator) without Python:
//
//   forward:  m1, m2, v (local moments), shape --> FORWARD vector
//             --barrier, call #k--> global mean/var --> scale, shift, INFO,
//             running stats
//   backward: d scale, d shift --> BACKWARD vector --barrier--> gradients of
//             m2 and v (m1 is a constant), d gamma, d beta
//
// Every array goes through MXNet's copies (arrays.h), never raw memory, so
// the same code runs on CPU contexts under GLUON_SYNCBN_DEVICE_PATH=1: that
// is how CI tests it without a GPU.
#pragma once
#include <mxnet/c_api.h>

#include <cmath>
#include <string>
#include <vector>

#include "operator.h"

namespace {

// Arguments, outputs and auxiliary states, in op.py's order.
enum { kMean, kResidual, kSqdev, kShape, kGamma, kBeta };
enum { kScale, kShift, kInfo };

// The local mean of each row statistic (rows, C): the block hands over one
// value per (sample, channel) row, sums (row_sums) or means of equal rows.
std::vector<double> local_mean(const std::vector<double>& rows, size_t C, double count,
                               bool row_sums) {
  std::vector<double> out(C, 0.0);
  const size_t n_rows = rows.size() / C;
  for (size_t r = 0; r < n_rows; ++r)
    for (size_t c = 0; c < C; ++c) out[c] += rows[r * C + c];
  for (auto& v : out) v /= row_sums ? count : static_cast<double>(n_rows);
  return out;
}

double sample_count(const std::vector<double>& shape, size_t C) {
  double size = 1;
  for (double d : shape) size *= d;
  return size / static_cast<double>(C);
}

// running * momentum + batch * (1 - momentum), rounded as running_update_async's
// MXNet operators round it in an array of `dtype`, so a call that writes
// directly and one that queues the update leave bit-identical replicas.
double momentum_step(double running, double batch, double momentum, int dtype) {
  if (dtype != kFloat32) return running * momentum + batch * (1.0 - momentum);
  const float scaled = static_cast<float>(running) * static_cast<float>(momentum);
  return static_cast<float>(scaled + static_cast<float>(batch * (1.0 - momentum)));
}

// The maths of the synchronization step on per-channel vectors, shared by
// the custom device operator (below) and the exchange operator
// (exchange_op.h).

// This device's mean and variance from the block's moments: m1 (the centre),
// m2 (mean of x - m1) and v (mean of (x - m1)^2), row statistics (rows, C).
void device_moments(const Params& p, const std::vector<double>& m1,
                    const std::vector<double>& m2_rows, const std::vector<double>& v_rows,
                    double count, std::vector<double>* mean, std::vector<double>* var) {
  const size_t C = m1.size();
  std::vector<double> m2 = local_mean(m2_rows, C, count, p.row_sums),
                      v = local_mean(v_rows, C, count, p.row_sums);
  mean->assign(C, 0.0);
  var->assign(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    (*mean)[c] = m1[c] + m2[c];
    (*var)[c] = std::max(v[c] - m2[c] * m2[c], 0.0);
  }
}

// The scale and shift that normalize x - m1 with the group's statistics.
void scale_shift(const Params& p, const Info& stats, const std::vector<double>& m1,
                 const std::vector<double>& gamma, const std::vector<double>& beta,
                 std::vector<double>* scale, std::vector<double>* shift) {
  const size_t C = m1.size();
  scale->assign(C, 0.0);
  shift->assign(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    double inv_std = 1.0 / std::sqrt(stats.var[c] + p.eps);
    (*scale)[c] = (p.fix_gamma ? 1.0 : gamma[c]) * inv_std;
    // Centred on m1: the large offset never meets the data again.
    (*shift)[c] = beta[c] - (stats.mean[c] - m1[c]) * (*scale)[c];
  }
}

// Backward, before the exchange: from d scale and d shift, this device's
// sum dy*(x - mean) and d gamma (gamma becomes 1 under fix_gamma; d beta is
// d shift). An empty slice adds nothing (MXNet leaves reductions over size-0
// arrays unwritten: its d scale, d shift are not even zeros).
void backward_local(const Params& p, const Info& stats, const std::vector<double>& m1,
                    double count, std::vector<double>* gamma, std::vector<double>* d_scale,
                    std::vector<double>* d_shift, std::vector<double>* inv_std,
                    std::vector<double>* sum_dy_xc, std::vector<double>* d_gamma) {
  const size_t C = m1.size();
  if (count == 0) {
    d_scale->assign(C, 0.0);
    d_shift->assign(C, 0.0);
  }
  inv_std->assign(C, 0.0);
  sum_dy_xc->assign(C, 0.0);
  d_gamma->assign(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    if (p.fix_gamma) (*gamma)[c] = 1.0;
    (*inv_std)[c] = 1.0 / std::sqrt(stats.var[c] + p.eps);
    (*sum_dy_xc)[c] = (*d_scale)[c] - (*d_shift)[c] * (stats.mean[c] - m1[c]);
    (*d_gamma)[c] = p.fix_gamma ? 0.0 : (*sum_dy_xc)[c] * (*inv_std)[c];
  }
}

// Backward, after the exchange (`total`: the group's BACKWARD sums): through
// the global mean and variance to this device's m2 and v.
void backward_moments(const Info& stats, const std::vector<double>& m1,
                      const std::vector<double>& gamma, const std::vector<double>& inv_std,
                      const std::vector<double>& total, double count,
                      std::vector<double>* d_m2, std::vector<double>* d_v) {
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

int copy_failed(const Handles& h, const Group& g, const std::string& error) {
  return failed_call(h, "SyncBatchNorm '" + g.name + "': copying the statistics failed: " +
                            error);
}

int device_forward(int size, void** ptrs, int* tags, const int* req, const int is_train,
                   void* state) {
  Handles h(size, ptrs, tags);
  Op& op = *static_cast<Op*>(state);
  const Params& p = op.params;
  Group& g = *op.group;
  const auto& in = h.by_tag[kInData];
  std::vector<double> m1, m2_rows, v_rows, shape, gamma, beta, rmean, rvar;
  std::string error;
  // Static graphs update the running statistics in engine order (below) and
  // never need their values in training.
  const bool ordered = p.static_shape && g.running.size() == g.devices.size();
  if (!read_copies({{in[kMean], &m1}, {in[kResidual], &m2_rows}, {in[kSqdev], &v_rows},
                    {in[kShape], &shape}, {in[kGamma], &gamma}, {in[kBeta], &beta}}, &error) ||
      ((!is_train || !ordered) &&
       !read_copies({{h.by_tag[kAux][0], &rmean}, {h.by_tag[kAux][1], &rvar}}, &error)))
    return copy_failed(h, g, error);
  const size_t C = m1.size();
  const double count = sample_count(shape, C);
  Info stats;
  if (!is_train) {  // predict mode inside a graph: the running statistics
    stats.mean = rmean;
    stats.var = rvar;
  } else {
    std::vector<double> mean, var;
    device_moments(p, m1, m2_rows, v_rows, count, &mean, &var);
    if (!exchange_forward(op, count, mean, var, &stats, &error)) return failed_call(h, error);
    bool ok;
    if (ordered) {
      // Read-only auxiliary states (see host_op.h): the update goes to the
      // Parameter's own arrays, read, scaled and added to in engine order.
      ok = running_update_async(g.running[op.device][0], stats.mean, p.momentum, &error) &&
           running_update_async(g.running[op.device][1], stats.var, p.momentum, &error);
    } else {  // this call holds write access to its auxiliary states
      int dtype = kFloat32;
      MXNDArrayGetDType(h.by_tag[kAux][0], &dtype);
      for (size_t c = 0; c < C; ++c) {
        rmean[c] = momentum_step(rmean[c], stats.mean[c], p.momentum, dtype);
        rvar[c] = momentum_step(rvar[c], stats.var[c], p.momentum, dtype);
      }
      ok = write_copy(h.by_tag[kAux][0], rmean, 1, &error) &&
           write_copy(h.by_tag[kAux][1], rvar, 1, &error);
    }
    if (!ok) return copy_failed(h, g, error);
  }
  std::vector<double> scale, shift;
  scale_shift(p, stats, m1, gamma, beta, &scale, &shift);
  const auto& out = h.by_tag[kOutData];
  if (!write_copy(out[kScale], scale, req[kScale], &error) ||
      !write_copy(out[kShift], shift, req[kShift], &error) ||
      !write_copy(out[kInfo], pack_info(stats), req[kInfo], &error))
    return copy_failed(h, g, error);
  return 1;
}

// A row statistic's gradient: that of the local mean, spread over the rows.
std::vector<double> rows_grad(const std::vector<double>& grad, int64_t size, double count,
                              bool row_sums) {
  const size_t C = grad.size(), n_rows = static_cast<size_t>(size) / C;
  std::vector<double> out(n_rows * C);
  for (size_t r = 0; r < n_rows; ++r)
    for (size_t c = 0; c < C; ++c)
      out[r * C + c] = grad[c] / (row_sums ? count : static_cast<double>(n_rows));
  return out;
}

int device_backward(int size, void** ptrs, int* tags, const int* req, const int,
                    void* state) {
  Handles h(size, ptrs, tags);
  Op& op = *static_cast<Op*>(state);
  const Params& p = op.params;
  Group& g = *op.group;
  // Declared dependencies (see device_bwd_dep): d scale, d shift, m1, shape,
  // gamma and the info output.
  const auto& in = h.by_tag[kInData];
  const auto& grads = h.by_tag[kInGrad];
  std::vector<double> packed, m1, shape, gamma, d_scale, d_shift;
  std::string error;
  if (!read_copies({{h.by_tag[kOutData][kInfo], &packed}, {in[kMean], &m1},
                    {in[kShape], &shape}, {in[kGamma], &gamma},
                    {h.by_tag[kOutGrad][kScale], &d_scale},
                    {h.by_tag[kOutGrad][kShift], &d_shift}}, &error))
    return copy_failed(h, g, error);
  const Info stats = unpack_info(packed);
  const size_t C = m1.size();
  const double count = sample_count(shape, C);
  std::vector<double> inv_std, sum_dy_xc, d_gamma;
  backward_local(p, stats, m1, count, &gamma, &d_scale, &d_shift, &inv_std, &sum_dy_xc,
                 &d_gamma);
  std::vector<double> total;
  if (!exchange_backward(op, stats, d_shift, sum_dy_xc, &total, &error))
    return failed_call(h, error);
  std::vector<double> d_m2, d_v;
  backward_moments(stats, m1, gamma, inv_std, total, count, &d_m2, &d_v);
  const std::vector<double> zeros_mean(C, 0.0), zeros_shape(shape.size(), 0.0);
  if (!write_copy(grads[kMean], zeros_mean, req[kMean], &error) ||  // m1 is a constant
      !write_copy(grads[kResidual],
                  rows_grad(d_m2, size_of(grads[kResidual]), count, p.row_sums),
                  req[kResidual], &error) ||
      !write_copy(grads[kSqdev], rows_grad(d_v, size_of(grads[kSqdev]), count, p.row_sums),
                  req[kSqdev], &error) ||
      !write_copy(grads[kShape], zeros_shape, req[kShape], &error) ||
      !write_copy(grads[kGamma], d_gamma, req[kGamma], &error) ||
      !write_copy(grads[kBeta], d_shift, req[kBeta], &error))  // d beta = sum dy
    return copy_failed(h, g, error);
  return 1;
}

// --------------------------------------------------------------- property --

const char* DEVICE_ARGS[] = {"mean", "residual", "sqdev", "shape", "gamma", "beta", nullptr};
const char* DEVICE_OUTS[] = {"scale", "shift", "info", nullptr};
const char* DEVICE_AUXS[] = {"running_mean", "running_var", nullptr};

// Order of shapes: the 6 arguments | scale, shift, info | running_mean, running_var.
int device_infer_shape(int num, int* ndims, int** shapes, void* state) {
  Prop& p = *static_cast<Prop*>(state);
  auto group = prop_group(state);
  if (!group) return 0;
  if (ndims[kMean] <= 0) return 1;  // not known yet
  int channels = 1;
  for (int i = 0; i < ndims[kMean]; ++i) channels *= shapes[kMean][i];
  const int ndim = ndims[kShape] == 1 ? shapes[kShape][0] : 0;
  if (ndim > 0 && (ndim < 2 || ndim > 5))
    return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "' expects input of 2 "
                "to 5 dimensions, got " + std::to_string(ndim) + ". Reshape the input, e.g. "
                "to (N, C, L).");
  const char* names[] = {"", "", "", "", "gamma", "beta", "", "", "", "running_mean",
                         "running_var"};
  for (int i : {4, 5, 9, 10}) {
    if (i >= num || ndims[i] <= 0) continue;
    int given = 1;
    for (int k = 0; k < ndims[i]; ++k) given *= shapes[i][k];
    if (given > 0 && given != channels)
      return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "': input has " +
                  std::to_string(channels) + " channels on axis " +
                  std::to_string(p.params.axis) + " but " + names[i] + " has " +
                  std::to_string(given) + " elements. Set in_channels=" +
                  std::to_string(channels) + " or feed " + std::to_string(given) +
                  " channels.");
  }
  p.shape_buffer[0].assign(1, channels);
  p.shape_buffer[1].assign(shapes[kMean], shapes[kMean] + ndims[kMean]);
  p.shape_buffer[2].assign(1, kInfoHead + 2 * channels);  // INFO
  for (int i : {4, 5, 9, 10}) { ndims[i] = 1; shapes[i] = p.shape_buffer[0].data(); }
  for (int i : {6, 7}) { ndims[i] = ndims[kMean]; shapes[i] = p.shape_buffer[1].data(); }
  ndims[8] = 1; shapes[8] = p.shape_buffer[2].data();
  return 1;
}

int device_infer_type(int, int* types, void* state) {
  if (types[kMean] == kFloat16)
    return fail("SyncBatchNormError", "SyncBatchNorm '" +
                layer_name(static_cast<Prop*>(state)->params) + "' got float16 statistics "
                "inside a hybridized graph: call net.cast('float16') so the layer knows to "
                "compute its statistics in float32.");
  const int stat = types[kMean] >= 0 ? types[kMean] : kFloat32;
  const int param = types[kGamma] >= 0 ? types[kGamma] : kFloat32;
  types[kMean] = types[kResidual] = types[kSqdev] = stat;
  types[kShape] = kInt64;
  types[kGamma] = types[kBeta] = types[9] = types[10] = param;
  types[6] = types[7] = stat;
  types[8] = kFloat64;
  return 1;
}

int device_bwd_dep(const int* out_grad, const int* in_data, const int* out_data, int* num,
                   int** deps, void*) {
  static thread_local int buffer[6];
  buffer[0] = out_grad[kScale];
  buffer[1] = out_grad[kShift];
  buffer[2] = in_data[kMean];
  buffer[3] = in_data[kShape];
  buffer[4] = in_data[kGamma];
  buffer[5] = out_data[kInfo];
  *num = 6;
  *deps = buffer;
  return 1;
}

const OpType DEVICE_OP = {DEVICE_ARGS, DEVICE_OUTS, DEVICE_AUXS, device_infer_shape,
                          device_infer_type, device_bwd_dep, device_forward, device_backward};

}  // namespace
