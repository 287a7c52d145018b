// The native operators' string arguments, and the key of a layer's tables.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

namespace {

// A layer: the handle gsbn_layer_create returned (find_layer), which
// also keys per-layer tables. Handles are never reused.
typedef int64_t LayerId;
typedef std::pair<LayerId, int> LayerKey;

LayerKey layer_key(const LayerId& layer, int device) { return LayerKey(layer, device); }

// The operator's string arguments, as the block passes them (eps and
// momentum as the layer has them when the call, or the graph, is made, as
// for MXNet's BatchNorm). running_at_backward: the exchange operator
// updates the running statistics in its backward call (CPU contexts), not
// its forward (GPUs).
struct Params {
  LayerId layer_id = 0;
  std::string dtype_name = "float32";
  double eps = 1e-5, momentum = 0.9;
  bool fix_gamma = false, static_shape = false, running_at_backward = false;
  int axis = 1;
};

// Sets the argument `key` of `p` from its string `value`; ignores others.
void set_param(Params* p, const std::string& key, const std::string& value) {
  const bool yes = value == "True" || value == "true" || value == "1";
  if (key == "layer") p->layer_id = std::stoll(value);
  else if (key == "fix_gamma") p->fix_gamma = yes;
  else if (key == "static_shape") p->static_shape = yes;
  else if (key == "running_update") p->running_at_backward = value == "backward";
  else if (key == "axis") p->axis = std::stoi(value);
  else if (key == "eps") p->eps = std::stod(value);
  else if (key == "momentum") p->momentum = std::stod(value);
  else if (key == "input_dtype") p->dtype_name = value;
}

}  // namespace
