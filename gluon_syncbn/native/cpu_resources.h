// Temp space of its own for each CPU context, as each GPU has: why a
// static_shape graph on several CPU contexts stalls without it, why nothing
// public does it, and what checks it, is the catalogue's entry "the
// resource manager's virtual table" (gluon_syncbn/mxnet_private.py). In each
// thread that issues a step, Request is replaced (mxnet_abi.h,
// replace_resource_request) by one that answers temp-space requests for
// cpu(i) from pool i, with slots of MXNet's own kind (make_temp_space_slot),
// and forwards every other request (random numbers, GPUs, pinned memory) to
// MXNet's; an operation of device 0 then never waits for a slot device 1's
// work holds, whatever the graphs keep.
#pragma once
#include "mxnet_abi.h"

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

namespace {

// One set of temp-space slots. Kept for the process's life (an operation
// may hold a slot until the engine stops; a request racing with a retire
// may still read a set that was retired).
struct SlotSet {
  std::vector<mxnet::Resource> slots;
  std::atomic<size_t> next{0};

  explicit SlotSet(int count) {
    for (int i = 0; i < count; ++i) slots.push_back(make_temp_space_slot(i));
  }

  mxnet::Resource take() { return slots[next.fetch_add(1) % slots.size()]; }
};

// One CPU context's temp space: the set it hands out now, round-robin.
struct ContextTempSpace {
  std::atomic<SlotSet*> current;
  std::vector<SlotSet*> retired, spare;  // under CpuTempSpaces::mutex
  explicit ContextTempSpace(SlotSet* set) : current(set) {}
};

const int kMaxCpuContexts = 1024;

struct CpuTempSpaces {
  std::mutex mutex;
  int slots_per_context = 0;
  std::atomic<ContextTempSpace*> pools[kMaxCpuContexts];
  RequestReplacement replacement;

  CpuTempSpaces() {
    for (auto& p : pools) p.store(nullptr);
  }

  ContextTempSpace* pool(int dev_id) {
    ContextTempSpace* p = pools[dev_id].load();
    if (p != nullptr) return p;
    std::lock_guard<std::mutex> lock(mutex);
    p = pools[dev_id].load();
    if (p == nullptr) {
      p = new ContextTempSpace(new SlotSet(slots_per_context));
      pools[dev_id].store(p);
    }
    return p;
  }
};

CpuTempSpaces& cpu_temp_spaces() {
  static CpuTempSpaces& spaces = *new CpuTempSpaces();  // never destroyed: used until exit
  return spaces;
}

// After an abort: every CPU context hands out a set no operation of the
// failed step holds. A failed (or skipped) operation leaves its error on
// every engine variable it writes, its temp-space slot's included, and MXNet
// skips every later operation on that slot with that error until the error
// is cleared (threaded_engine.h OnStart 472-489; the next step's first
// synchronized call clears them all, Session.clear_failed_arrays). With a few
// slots per context the next step's first operations, issued before that,
// would land on them, be skipped, and read back as garbage once the error
// was cleared; MXNet's one pool of hundreds of slots only made that rare.
void retire_cpu_temp_space() {
  CpuTempSpaces& s = cpu_temp_spaces();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& entry : s.pools) {
    ContextTempSpace* p = entry.load();
    if (p == nullptr) continue;
    SlotSet* fresh;
    if (p->spare.empty()) {
      fresh = new SlotSet(s.slots_per_context);
    } else {
      fresh = p->spare.back();
      p->spare.pop_back();
    }
    p->retired.push_back(p->current.exchange(fresh));
  }
}

// Once the engine has been drained and the errors cleared (after an
// abort, Session.clear_failed_arrays): the retired sets are clean and idle,
// kept for the next retire.
void recycle_cpu_temp_space() {
  CpuTempSpaces& s = cpu_temp_spaces();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& entry : s.pools) {
    ContextTempSpace* p = entry.load();
    if (p == nullptr) continue;
    p->spare.insert(p->spare.end(), p->retired.begin(), p->retired.end());
    p->retired.clear();
  }
}

// The Request of a separated resource manager.
mxnet::Resource request_per_context(mxnet::ResourceManager* self, mxnet::Context ctx,
                                    const mxnet::ResourceRequest& req) {
  CpuTempSpaces& s = cpu_temp_spaces();
  if (req.type == mxnet::ResourceRequest::kTempSpace && ctx.dev_type == mxnet::Context::kCPU &&
      ctx.dev_id >= 0 && ctx.dev_id < kMaxCpuContexts)
    return s.pool(ctx.dev_id)->current.load()->take();
  return s.replacement.mxnet_request(self, ctx, req);
}

// Gives the calling thread's resource manager a temp-space pool per CPU
// context, `slots` slots each (the first call fixes the number). Returns ""
// on success (also when this thread's was separated already), else why not
// (nothing changed).
std::string separate_cpu_temp_space(int slots) {
  CpuTempSpaces& s = cpu_temp_spaces();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.slots_per_context == 0) s.slots_per_context = slots > 0 ? slots : 4;
  return replace_resource_request(&request_per_context, &s.replacement);
}

// The temp-space slots of CPU context `dev_id` so far (0: none made yet), for tests.
int cpu_temp_slots(int dev_id) {
  if (dev_id < 0 || dev_id >= kMaxCpuContexts) return 0;
  ContextTempSpace* p = cpu_temp_spaces().pools[dev_id].load();
  return p ? static_cast<int>(p->current.load()->slots.size()) : 0;
}

}  // namespace
