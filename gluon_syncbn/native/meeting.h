// The meeting of the native operators: the k-th call of a layer on each
// device meets the k-th call on the others. Nothing waits: a device's call
// hands its vector over with a continuation, which runs once the meeting is
// complete or has failed. The last device to arrive checks that they agree
// and combines their vectors in device order (the same rounding whatever the
// arrival order); across processes the meeting then has a remote phase
// (remote.h). A watchdog thread fails meetings at their deadline: every wait
// ends at the layer's timeout.
#pragma once
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "messages.h"
#include "session.h"
#include "wire.h"

namespace {

// A meeting goes once every device has taken its outcome (lock held).
void release_locked(Layer& layer, const Key& key, const std::shared_ptr<Meeting>& meeting) {
  if (++meeting->taken == static_cast<int>(layer.devices.size())) {
    auto it = layer.meetings.find(key);
    if (it != layer.meetings.end() && it->second == meeting) layer.meetings.erase(it);
  }
}

// When a wait of `seconds` that starts now ends.
std::chrono::steady_clock::time_point deadline_in(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(seconds));
}

// The meeting of `key`, created by its first device, a call of `step` (lock held).
std::shared_ptr<Meeting> meeting_locked(Layer& layer, const Key& key,
                                        const std::shared_ptr<Step>& step) {
  auto& slot = layer.meetings[key];
  if (!slot) {
    slot = std::make_shared<Meeting>(step, static_cast<int>(layer.devices.size()));
    slot->deadline = deadline_in(layer.timeout);
  }
  return slot;
}

// Why a combined FORWARD vector cannot be used: a sync group of this
// process's devices has no samples at all ("" if none).
std::string empty_batch(const Layer& layer, const Key& key, const std::vector<double>& result) {
  if (std::get<0>(key) != 0) return "";
  const size_t size = result.size() / layer.num_sync_groups;
  for (int s : layer.sync_group_of)
    if (result[s * size] <= 0)  // FORWARD: n
      return message("empty_batch",
                     {{"layer", layer.name},
                      {"where", layer.num_sync_groups > 1
                                    ? message("in_sync_group", {{"group", std::to_string(s)}})
                                    : ""}});
  return "";
}

// remote.h: hands a meeting's combination to the other workers.
std::string start_remote_locked(Layer& layer, const Key& key, const std::shared_ptr<Meeting>& meeting);

const char* direction_name(const Key& key) { return std::get<0>(key) == 0 ? "fwd" : "bwd"; }

// The last device to arrive: checks that the devices agree and combines
// their vectors; returns the failure, or "" with the meeting done (lock held).
std::string combine_locked(Layer& layer, const Key& key, const std::shared_ptr<Meeting>& meeting) {
  const int n = static_cast<int>(layer.devices.size());
  size_t size = meeting->values[0].size();
  bool same_size = true, same_dtype = true;
  for (int i = 1; i < n; ++i) {
    same_size = same_size && meeting->values[i].size() == size;
    same_dtype = same_dtype && meeting->dtypes[i] == meeting->dtypes[0];
  }
  if (!same_size || !same_dtype) {
    std::string what;
    for (int i = 0; i < n; ++i) {
      size_t s = meeting->values[i].size();
      size_t channels = std::get<0>(key) == 0 ? forward_channels(s) : backward_channels(s);
      what += (i ? ", " : "") + layer.devices[i] + ": " +
              (same_size ? meeting->dtypes[i] : std::to_string(channels));
    }
    return same_size ? message("dtypes_disagree", {{"layers", "'" + layer.name + "'"},
                                                   {"dtypes", what}})
                     : message("channels_disagree", {{"layer", layer.name}, {"channels", what}});
  }
  // One combination per sync group, each in device order (the same rounding
  // whatever the arrival order); a device takes its sync group's.
  meeting->result.assign(layer.num_sync_groups * size, 0.0);
  for (int i = 0; i < n; ++i)
    combine(std::get<0>(key), &meeting->result[layer.sync_group_of[i] * size], meeting->values[i].data(),
            size);
  if (layer.transport) return start_remote_locked(layer, key, meeting);
  const std::string empty = empty_batch(layer, key, meeting->result);
  if (!empty.empty()) return empty;
  meeting->done = true;
  dispatch_locked(layer, key, meeting);
  return "";
}

std::string timeout_message(const Layer& layer, const Key& key, const Meeting& meeting) {
  const std::string call = std::to_string(std::get<2>(key));
  if (meeting.remote) {
    const std::string gone = layer.transport->helpers_gone();
    return message("remote_timeout",
                   {{"rank", std::to_string(layer.transport->rank)},
                    {"workers", std::to_string(layer.transport->workers)},
                    {"timeout", number(layer.remote_timeout)}, {"direction", direction_name(key)},
                    {"call", call}, {"layer", layer.name}, {"slot", std::to_string(layer.slot)},
                    {"transport", layer.transport->name},
                    {"helpers", gone.empty() ? "" : " Also, " + gone + "."}});
  }
  const int n = static_cast<int>(layer.devices.size());
  std::vector<int> arrived, missing;
  for (int i = 0; i < n; ++i) (meeting.values[i].empty() ? missing : arrived).push_back(i);
  std::string hint = layer.hint;
  // A read that waits for this very call: by the thread that issues the
  // missing device's calls, or, before its first, by the step's only thread.
  for (int i : missing)
    for (const auto& read : g_reads)
      if (layer.issuer[i] != std::thread::id() ? read.first == layer.issuer[i]
                                               : read.second.sole)
        hint = message("early_read", {{"device", layer.devices[i]}, {"read", read.second.what}});
  return message("call_timeout",
                 {{"layer", layer.name}, {"arrived", std::to_string(meeting.arrived)},
                  {"devices", std::to_string(n)}, {"present", join(layer.devices, arrived)},
                  {"direction", std::get<0>(key) == 0 ? "forward" : "backward"},
                  {"call", call}, {"timeout", number(layer.timeout)},
                  {"missing", join(layer.devices, missing)}, {"hint", hint}});
}

// ------------------------------------------------------------- watchdog --
// Fails asynchronous meetings at their deadline: nothing else waits for them.

void watchdog() {
  std::unique_lock<std::mutex> lock(g_mutex);
  for (;;) {
    auto next = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    std::string failure;
    bool remote = false;
    for (auto& layer : live_layers_locked())
      for (auto& e : layer->meetings) {
        const Meeting& meeting = *e.second;
        if (meeting.waiters.empty() || meeting.done || !meeting.error.empty()) continue;
        if (meeting.deadline <= std::chrono::steady_clock::now()) {
          if (failure.empty()) {
            failure = timeout_message(*layer, e.first, meeting);
            remote = meeting.remote;
          }
        } else if (meeting.deadline < next) {
          next = meeting.deadline;
        }
      }
    if (!failure.empty()) {
      if (remote) fatal_locked(failure);  // the other workers: see fatal_locked
      abort_locked(failure, kSyncBatchNormTimeout);
      lock.unlock();
      run_pending();
      lock.lock();
      continue;
    }
    g_watchdog_wake = next;
    g_watchdog_cv.wait_until(lock, next);
  }
}

// `done` runs once, on whichever thread completes the meeting
// (the last device to arrive, an abort, or the watchdog at the deadline).
void meet_async(Layer& layer, const Key& key, const std::shared_ptr<Step>& step, int device,
                std::vector<double> value, const std::string& dtype, Waiter done) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_watchdog_started) {
      g_watchdog_started = true;
      std::thread(watchdog).detach();
    }
    if (!current_locked(*step)) {
      g_pending.emplace_back(std::move(done), failure_text(stale_message(layer.name)),
                             std::vector<double>());
    } else if (layer.transport && !g_broken.empty()) {
      g_pending.emplace_back(std::move(done), failure_text(broken_message(layer)),
                             std::vector<double>());
    } else {
      const int n = static_cast<int>(layer.devices.size());
      std::shared_ptr<Meeting> meeting = meeting_locked(layer, key, step);
      meeting->values[device] = std::move(value);
      meeting->dtypes[device] = dtype;
      meeting->waiters.emplace_back(device, std::move(done));
      if (++meeting->arrived == n) {
        std::string failure = combine_locked(layer, key, meeting);
        if (!failure.empty()) abort_locked(failure);
      } else if (meeting->deadline < g_watchdog_wake) {
        g_watchdog_cv.notify_all();  // a deadline before the watchdog's next look
      }
    }
  }
  run_pending();
}

}  // namespace
