// The host operator: one custom operator per layer call on CPU contexts that
// computes the local moments, meets the other devices at the barrier and
// normalizes, all in host memory, without Python.
//
//   forward:  x --float64 mean, then squared deviations--> FORWARD vector
//             --barrier, call #k--> global mean/var --> y, running stats, INFO
//   backward: dy, x --sum dy, sum dy*(x - mean)--> BACKWARD vector
//             --barrier, key of call #k--> dx; d gamma, d beta stay per device
//
// x and dy arrive in MXNet's default layout (the block feeds x through Cast to
// float64, see mxnet_private.py), so their raw memory is read in place.
#pragma once
#include <mxnet/c_api.h>

#include <cmath>
#include <string>
#include <vector>

#include "maths.h"
#include "operator.h"

namespace {

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

int host_forward(int size, void** ptrs, int* tags, const int* req, const int is_train,
               void* state) {
  Handles h(size, ptrs, tags);
  Op& op = *static_cast<Op*>(state);
  const Params& p = op.params;
  Group& g = *op.group;
  Array x = view(h.by_tag[kInData][0]), gamma = view(h.by_tag[kInData][1]),
        beta = view(h.by_tag[kInData][2]);
  Array y = view(h.by_tag[kOutData][0]), info = view(h.by_tag[kOutData][1]);
  Array rmean = view(h.by_tag[kAux][0]), rvar = view(h.by_tag[kAux][1]);
  Layout l(x.shape, p.axis);
  Info stats;  // the statistics we normalize with, and (training) the call's step
  if (!is_train) {  // predict mode inside a graph: the running statistics
    stats = running_statistics(rmean, rvar);
  } else {
    std::vector<double> mean, var;
    std::string error;
    const double count = local_moments(l, x, &mean, &var);
    if (!exchange_forward(op, count, mean, var, &stats, &error)) return failed_call(h, error);
    if (p.static_shape && g.running.size() == g.devices.size()) {
      auto* u = new RunningUpdate{{g.running[op.device][0], g.running[op.device][1]},
                                  stats.mean, stats.var, p.momentum};
      int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}: where the update runs
      if (MXEnginePushSyncND(run_running_update, u, delete_running_update, ctx, nullptr, 0,
                             u->arrays, 2, nullptr, 0, "gluon_syncbn_running") != 0)
        return failed_call(h, "SyncBatchNorm '" + g.name +
                              "': could not update the running statistics: " + MXGetLastError());
    } else {  // this call holds write access to its auxiliary states (or, in a
              // static graph traced before its shapes were known, the next one will)
      update_running(p, rmean, rvar, stats);
    }
  }
  normalize(p, l, x, gamma, beta, stats, y, req[0]);
  std::vector<double> packed = pack_info(stats);
  for (size_t k = 0; k < packed.size(); ++k) put(info, k, packed[k], 1);
  return 1;
}

int host_backward(int size, void** ptrs, int* tags, const int* req, const int,
                void* state) {
  Handles h(size, ptrs, tags);
  Op& op = *static_cast<Op*>(state);
  const Params& p = op.params;
  // Declared dependencies (see bwd_dep): dy, x, gamma and the info output.
  Array dy = view(h.by_tag[kOutGrad][0]), x = view(h.by_tag[kInData][0]),
        gamma = view(h.by_tag[kInData][1]), info = view(h.by_tag[kOutData][1]);
  Array dx = view(h.by_tag[kInGrad][0]), dgamma = view(h.by_tag[kInGrad][1]),
        dbeta = view(h.by_tag[kInGrad][2]);
  // A head gradient may have any dtype (autograd.backward does not check).
  std::string error = dtype_problem(op.group->name, "the gradient of its output", dy.dtype);
  if (!error.empty()) {
    abort_step(error);  // the other devices' backward calls would wait for this one
    return failed_call(h, error);
  }
  Layout l(x.shape, p.axis);
  std::vector<double> packed(info.size());
  for (int64_t k = 0; k < info.size(); ++k) packed[k] = at(info, k);
  const Info stats = unpack_info(packed);
  std::vector<double> sum_dy, sum_dy_xc, total;
  backward_sums(l, dy, x, stats, &sum_dy, &sum_dy_xc);
  if (!exchange_backward(op, stats, sum_dy, sum_dy_xc, &total, &error))
    return failed_call(h, error);
  write_gradients(p, l, dy, x, gamma, stats, total, sum_dy, sum_dy_xc, dx, dgamma, dbeta, req);
  return 1;
}

// --------------------------------------------------------------- property --
// Arguments data, gamma, beta; outputs output, info; auxiliary states
// running_mean, running_var.

const char* HOST_ARGS[] = {"data", "gamma", "beta", nullptr};
const char* HOST_OUTS[] = {"output", "info", nullptr};
const char* HOST_AUXS[] = {"running_mean", "running_var", nullptr};

// Order of shapes: data, gamma, beta | output, info | running_mean, running_var.
int host_infer_shape(int num, int* ndims, int** shapes, void* state) {
  Prop& p = *static_cast<Prop*>(state);
  auto group = prop_group(state);
  if (!group) return 0;
  const int ndim = ndims[0];
  if (ndim <= 0) return 1;  // not known yet
  if (ndim < 2 || ndim > 5)
    return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "' expects input of 2 "
                "to 5 dimensions, got " + std::to_string(ndim) + ". Reshape the input, e.g. "
                "to (N, C, L).");
  int axis = p.params.axis < 0 ? p.params.axis + ndim : p.params.axis;
  if (axis < 0 || axis >= ndim)
    return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "': axis=" +
                std::to_string(p.params.axis) + " is out of range for input of " +
                std::to_string(ndim) + " dimensions.");
  const int channels = shapes[0][axis];
  const char* names[] = {"", "gamma", "beta", "", "", "running_mean", "running_var"};
  for (int i : {1, 2, 5, 6}) {
    if (i >= num || ndims[i] != 1 || shapes[i][0] <= 0) continue;
    if (shapes[i][0] != channels)
      return fail("SyncBatchNormError", "SyncBatchNorm '" + group->name + "': input has " +
                  std::to_string(channels) + " channels on axis " + std::to_string(p.params.axis) +
                  " but " + names[i] + " has shape (" + std::to_string(shapes[i][0]) +
                  ",). Set in_channels=" + std::to_string(channels) + " or feed " +
                  std::to_string(shapes[i][0]) + " channels.");
  }
  p.shape_buffer[0].assign(1, channels);
  p.shape_buffer[1].assign(shapes[0], shapes[0] + ndim);
  p.shape_buffer[2].assign(1, kInfoHead + 2 * channels);  // INFO
  for (int i : {1, 2, 5, 6}) { ndims[i] = 1; shapes[i] = p.shape_buffer[0].data(); }
  ndims[3] = ndim; shapes[3] = p.shape_buffer[1].data();
  ndims[4] = 1; shapes[4] = p.shape_buffer[2].data();
  return 1;
}

// Order of types: as for shapes. Parameters keep their own dtype (float32
// unless the network was cast to float64); info is float64.
int host_infer_type(int, int* types, void* state) {
  if (types[0] >= 0 && types[0] != kFloat32 && types[0] != kFloat64)
    return fail("SyncBatchNormError", "SyncBatchNorm '" +
                layer_name(static_cast<Prop*>(state)->params) + "': the host operator takes "
                "float32 or float64 input; this is a bug in gluon_syncbn (the block casts), "
                "please report it.");
  int param = types[1] >= 0 ? types[1] : kFloat32;
  types[1] = types[2] = types[5] = types[6] = param;
  types[3] = types[0];
  types[4] = kFloat64;
  return 1;
}

int host_bwd_dep(const int* out_grad, const int* in_data, const int* out_data, int* num,
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

const OpType HOST_OP = {HOST_ARGS, HOST_OUTS, HOST_AUXS, host_infer_shape, host_infer_type,
                       host_bwd_dep, host_forward, host_backward};

}  // namespace
