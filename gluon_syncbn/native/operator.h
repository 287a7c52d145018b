// What the asynchronous and the exchange operator share: their string
// arguments, one operator instance (one device's call, or one device's graph
// node in a static graph), and where a call belongs (its device, its step).
// How their failed operations complete: failures.h.
#pragma once
#include <mxnet/c_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "arrays.h"
#include "failures.h"
#include "session.h"

namespace {

// The operator's string arguments, as the block passes them.
struct Params {
  std::string group_id, dtype_name = "float32";
  double eps = 1e-5, momentum = 0.9;
  bool fix_gamma = false, static_shape = false;
  int axis = 1;
};

Params parse_params(int num, const char** keys, const char** values) {
  Params p;
  for (int i = 0; i < num; ++i) {
    std::string key = keys[i], value = values[i];
    bool yes = value == "True" || value == "true" || value == "1";
    if (key == "group") p.group_id = value;
    else if (key == "eps") p.eps = std::stod(value);
    else if (key == "momentum") p.momentum = std::stod(value);
    else if (key == "fix_gamma") p.fix_gamma = yes;
    else if (key == "static_shape") p.static_shape = yes;
    else if (key == "axis") p.axis = std::stoi(value);
    else if (key == "input_dtype") p.dtype_name = value;
  }
  return p;
}

// One operator instance: its arguments, its group and device, and the step it
// was issued in (unused in static graphs, whose instances outlive steps).
struct Op {
  Params params;
  std::shared_ptr<Group> group;
  int device;
  uint64_t token;
};

// Why a backward call cannot be: its forward ran in inference mode.
std::string inference_backward(const std::string& layer) {
  return message("inference_backward", {{"layer", layer}});
}

std::string layer_name(const Params& p) {
  std::string error;
  auto group = find_group(p.group_id, &error);
  return group ? group->name : p.group_id;
}

// The index of device `ctx` ("cpu(1)") in the group, or -1 with the error.
int device_index(const Group& g, const std::string& ctx, std::string* error) {
  for (size_t i = 0; i < g.devices.size(); ++i)
    if (g.devices[i] == ctx) return static_cast<int>(i);
  *error = message("wrong_device", {{"layer", g.name}, {"device", ctx},
                                    {"devices", join(g.devices)}});
  return -1;
}

// The token of a call issued now (imperative and dynamic graphs). A call
// issued after an abort but before the next step begins belongs to the
// failed step.
uint64_t issue_token() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_issue_token;
}

}  // namespace
