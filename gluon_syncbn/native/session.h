// The session and the call-order barrier of the native operators: which step
// a call belongs to, how the k-th calls of the devices meet, and how a step
// fails. Nothing here waits: a device's call hands its vector over with a
// continuation, which runs once the meeting is complete or has failed.
// Across processes a meeting has a remote phase: the process's sum goes
// through the layer's transport (transport.h), and the checked sum over all
// workers completes it; a failure there is fatal (see fatal_locked).
// Included once, by syncbn.cc.
#pragma once
#include <mxnet/c_api.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "messages.h"
#include "stats.h"
#include "transport.h"
#include "wire.h"

namespace {

// ---------------------------------------------------------------- session --
// Shared by every layer of the process: the current step's token, the cause of
// the last abort, and failures waiting to be reported to Python.

struct Meeting;
struct Layer;

// Never destroyed: the watchdog thread and MXNet's engine threads may still
// use them while the process exits.
std::mutex& g_mutex = *new std::mutex();  // guards every structure below and every Layer
uint64_t g_token = 0;        // the current step; advanced by every abort
uint64_t g_issue_token = 0;  // what calls issued now get: g_token as of the step's start
std::string& g_cause = *new std::string();
// (kind, message): the failures not yet handed to Python, oldest first.
std::deque<std::pair<std::string, std::string>>& g_errors =
    *new std::deque<std::pair<std::string, std::string>>();
// Every layer by its handle (the operators' `layer` argument), handed out
// once per layer and never reused.
std::map<int64_t, std::shared_ptr<Layer>>& g_layers =
    *new std::map<int64_t, std::shared_ptr<Layer>>();
int64_t g_next_handle = 1;
// Every layer an operator may still hold, also one g_layers no longer names
// (a layer re-created on other devices, or garbage-collected while a call
// of it waits): the watchdog and aborts reach every waiting meeting.
std::vector<std::weak_ptr<Layer>>& g_live = *new std::vector<std::weak_ptr<Layer>>();
// Across processes: set once a failure broke synchronization with the other
// workers (then every later remote meeting fails at once, and the process
// ends: fatal_locked); this worker's rank once a layer's sums leave it.
std::string& g_broken = *new std::string();
int g_remote_rank = -1;
double g_exit_grace = 30.0;

// The watchdog (see watchdog()). When it wakes next (at the latest a second
// from its last look): only a meeting with an earlier deadline needs to
// wake it, so a call with the usual timeout of many seconds costs no thread
// wake-up.
std::condition_variable& g_watchdog_cv = *new std::condition_variable();
bool g_watchdog_started = false;
std::chrono::steady_clock::time_point g_watchdog_wake;

typedef std::tuple<int, uint64_t, int64_t> Key;  // (0 fwd / 1 bwd, token, call number)

void record_locked(const std::string& kind, const std::string& message) {
  const auto entry = std::make_pair(kind, message);
  for (const auto& e : g_errors) if (e == entry) return;
  if (g_errors.size() >= 8) g_errors.pop_front();
  g_errors.push_back(entry);
}

// A device's continuation: called once, with the error or
// with its sync group's sum, after the lock is released (run_pending).
typedef std::function<void(const std::string& error, const std::vector<double>& sum)> Waiter;

struct Meeting {
  uint64_t token;
  std::vector<std::vector<double>> values;  // one vector per device
  std::vector<std::string> dtypes;
  int arrived = 0, taken = 0;
  bool done = false;
  std::string error, kind;                  // non-empty: failed with this cause
  std::vector<double> result;
  std::vector<std::pair<int, Waiter>> waiters;  // the devices' continuations
  std::chrono::steady_clock::time_point deadline;
  bool remote = false;                      // in the remote phase (across processes)
  // Across processes: this process's sums, and for a forward meeting the
  // round (1: the means, 2: the sums about the shift; see start_remote_locked).
  std::vector<double> local;
  int round = 0;
  Meeting(uint64_t t, int n) : token(t), values(n), dtypes(n) {}
};

struct Layer : std::enable_shared_from_this<Layer> {
  std::string name, hint;
  std::vector<std::string> devices;
  std::vector<int> sync_group_of;  // each device's sync group (sync_groups), 0 by default
  int num_sync_groups = 1;
  double timeout;
  uint64_t counter_token = 0;
  std::vector<int64_t> next_call;
  std::map<Key, std::shared_ptr<Meeting>> meetings;
  // Across processes, where a sync group spans workers: the transport, the
  // layer's slot in it (-1 until its first call), and this worker's entries
  // of the global device ownership vector (empty without sync_groups).
  std::shared_ptr<Transport> transport;
  int slot = -1;
  std::vector<double> ownership;
  // The shift forward sums travel about (wire.h, shift_forward): per sync
  // group and channel, the global means of the layer's last forward call,
  // the same on every worker; empty before its first.
  std::vector<double> shift;
  // Static graphs: per device, 1 + the token of the step its next calls
  // were issued in, as the last stamp set it (gsbn_stamp_static; 0: none yet).
  std::vector<uint64_t> static_token;
  // While a tally is on, each device's forward calls add their global
  // statistics to its tally (add_to_tally).
  std::atomic<bool> tallying{false};
  std::vector<Tally> tallies;
};

// The layers of g_live that still exist, the others forgotten (lock held).
std::vector<std::shared_ptr<Layer>> live_layers_locked() {
  std::vector<std::shared_ptr<Layer>> live;
  size_t kept = 0;
  for (auto& weak : g_live)
    if (auto g = weak.lock()) {
      live.push_back(g);
      g_live[kept++] = weak;
    }
  g_live.resize(kept);
  return live;
}

// Continuations to run once g_mutex is released, with their error or sum.
std::vector<std::tuple<Waiter, std::string, std::vector<double>>>& g_pending =
    *new std::vector<std::tuple<Waiter, std::string, std::vector<double>>>();

void release_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex);

// Hand a meeting's devices their outcome (lock held).
void dispatch_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex) {
  const size_t size = ex->error.empty() ? ex->result.size() / g.num_sync_groups : 0;
  for (auto& w : ex->waiters) {
    std::vector<double> sum;
    if (ex->error.empty())
      sum.assign(ex->result.begin() + g.sync_group_of[w.first] * size,
                 ex->result.begin() + (g.sync_group_of[w.first] + 1) * size);
    else
      record_locked(ex->kind, ex->error);
    g_pending.emplace_back(std::move(w.second), ex->error, std::move(sum));
    release_locked(g, key, ex);
  }
  ex->waiters.clear();
}

// Run the continuations dispatched so far; never with g_mutex held.
void run_pending() {
  std::vector<std::tuple<Waiter, std::string, std::vector<double>>> ready;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    ready.swap(g_pending);
  }
  for (auto& r : ready) std::get<0>(r)(std::get<1>(r), std::get<2>(r));
}

// `message` as the error of layer `layer`: every failure a call raises names
// the layer it surfaced in, also when another layer (or user code) caused it.
std::string in_layer(const std::string& layer, const std::string& message) {
  const std::string head = "SyncBatchNorm '" + layer + "'", bare = "SyncBatchNorm: ";
  if (message.compare(0, head.size(), head) == 0) return message;
  if (message.compare(0, bare.size(), bare) == 0) return head + ": " + message.substr(bare.size());
  return head + ": " + message;
}

// A failure across processes cannot be recovered from: the other workers
// wait for sums this one will not send (ps-lite never gives up) and MXNet
// cannot cancel a pending reduction. The first one breaks the session for
// good, and the process ends at interpreter exit (transport.py's atexit
// hook) or `g_exit_grace` seconds from now, whichever comes first; the
// launcher then stops the other workers.
void fatal_locked(const std::string& cause) {
  if (!g_broken.empty()) return;
  g_broken = cause;
  const double grace = g_exit_grace;
  const std::string text = message("exit_late", {{"rank", std::to_string(g_remote_rank)},
                                                 {"grace", number(grace)}, {"cause", cause}});
  std::thread([text, grace]() {
    std::this_thread::sleep_for(std::chrono::duration<double>(grace));
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", text.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
}

// Fail every waiting meeting: the step is over (lock held). Fatal once
// this worker's sums leave it, except at interpreter exit. Every meeting
// goes: a call of the aborted step that arrives later is refused by its
// token (meet_async), so none of them can be joined again.
void retire_cpu_temp_space();  // cpu_resources.h

void abort_locked(const std::string& cause, const std::string& kind = "SyncBatchNormError",
                  bool exiting = false) {
  if (!exiting && g_remote_rank >= 0)
    fatal_locked(message("worker_step_failed",
                         {{"rank", std::to_string(g_remote_rank)}, {"cause", cause}}));
  ++g_token;
  g_cause = cause;
  retire_cpu_temp_space();  // what runs from now on takes slots the failed step's do not poison
  for (auto& g : live_layers_locked()) {
    std::map<Key, std::shared_ptr<Meeting>> meetings;
    meetings.swap(g->meetings);
    for (auto& e : meetings)
      if (!e.second->done && e.second->error.empty()) {
        e.second->error = in_layer(g->name, cause);
        e.second->kind = kind;
        dispatch_locked(*g, e.first, e.second);
      }
  }
}

// Abort the step from outside the barrier (a call that cannot take part,
// Python's failures): the other devices' calls fail at once.
void abort_step(const std::string& cause, bool exiting = false) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    abort_locked(cause, "SyncBatchNormError", exiting);
  }
  run_pending();
}

// Why a call of `layer` issued in a step that has since failed cannot run.
std::string stale_message(const std::string& layer) {
  return message("stale_call", {{"layer", layer}, {"cause", g_cause}});
}

std::string join(const std::vector<std::string>& items, const std::vector<int>& which) {
  std::string out;
  for (int i : which) out += (out.empty() ? "" : ", ") + items[i];
  return out;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// ---------------------------------------------------------------- barrier --
// The k-th call of a layer on each device meets the k-th call on the others.
// The last device to arrive checks that they agree and sums their vectors in
// device order (the same rounding whatever the arrival order). Every wait ends
// at the layer's timeout. Returns false with `error` set on failure.

// A meeting goes once every device has taken its outcome (lock held).
void release_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex) {
  if (++ex->taken == static_cast<int>(g.devices.size())) {
    auto it = g.meetings.find(key);
    if (it != g.meetings.end() && it->second == ex) g.meetings.erase(it);
  }
}

// When a wait of the layer's timeout that starts now ends.
std::chrono::steady_clock::time_point deadline_of(const Layer& g) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(g.timeout));
}

// The meeting of `key`, created by its first device (lock held).
std::shared_ptr<Meeting> meeting_locked(Layer& g, const Key& key) {
  auto& slot = g.meetings[key];
  if (!slot) {
    slot = std::make_shared<Meeting>(std::get<1>(key), static_cast<int>(g.devices.size()));
    slot->deadline = deadline_of(g);
  }
  return slot;
}

// Why a summed FORWARD vector cannot be used: a sync group of this
// process's devices has no samples at all ("" if none).
std::string empty_batch(const Layer& g, const Key& key, const std::vector<double>& result) {
  if (std::get<0>(key) != 0) return "";
  const size_t size = result.size() / g.num_sync_groups;
  for (int s : g.sync_group_of)
    if (result[s * size] <= 0)  // FORWARD: n
      return message("empty_batch",
                     {{"layer", g.name},
                      {"where", g.num_sync_groups > 1
                                    ? message("in_sync_group", {{"group", std::to_string(s)}})
                                    : ""}});
  return "";
}

std::string start_remote_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex);

// The last device to arrive: checks that the devices agree and sums their
// vectors; returns the failure, or "" with the meeting done (lock held).
std::string combine_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex) {
  const int n = static_cast<int>(g.devices.size());
  size_t size = ex->values[0].size();
  bool same_size = true, same_dtype = true;
  for (int i = 1; i < n; ++i) {
    same_size = same_size && ex->values[i].size() == size;
    same_dtype = same_dtype && ex->dtypes[i] == ex->dtypes[0];
  }
  if (!same_size || !same_dtype) {
    std::string what;
    for (int i = 0; i < n; ++i) {
      size_t s = ex->values[i].size();
      size_t channels = std::get<0>(key) == 0 ? forward_channels(s) : backward_channels(s);
      what += (i ? ", " : "") + g.devices[i] + ": " +
              (same_size ? ex->dtypes[i] : std::to_string(channels));
    }
    return same_size ? message("dtypes_disagree", {{"layers", "'" + g.name + "'"},
                                                   {"dtypes", what}})
                     : message("channels_disagree", {{"layer", g.name}, {"channels", what}});
  }
  // One sum per sync group, each in device order (the same rounding
  // whatever the arrival order); a device takes its sync group's.
  ex->result.assign(g.num_sync_groups * size, 0.0);
  for (int i = 0; i < n; ++i)
    for (size_t j = 0; j < size; ++j) ex->result[g.sync_group_of[i] * size + j] += ex->values[i][j];
  if (g.transport) return start_remote_locked(g, key, ex);
  const std::string empty = empty_batch(g, key, ex->result);
  if (!empty.empty()) return empty;
  ex->done = true;
  dispatch_locked(g, key, ex);
  return "";
}

// ----------------------------------------------------------- remote phase --
// Across processes the last device's sum goes to the other workers as
// wire.py's CHECKED vector, [one row per worker: channels, call, dtype;
// one row per sync group; ownership], and the meeting completes with the
// checked sum.

const char* direction_name(const Key& key) { return std::get<0>(key) == 0 ? "fwd" : "bwd"; }

// This worker's CHECKED row for a reduction of vectors of `size`: whole
// numbers below 2^24, exact in float32 (the call number modulo 2^20).
std::array<double, kCheckRow> own_checks(const Key& key, size_t size, const std::string& dtype) {
  return {static_cast<double>(std::get<0>(key) == 0 ? forward_channels(size)
                                                    : backward_channels(size)),
          static_cast<double>(std::get<2>(key) % (1 << 20)), dtype_code(dtype)};
}

// The rows every worker fills, its own at its rank: the numbers before a
// reduction's vector.
size_t check_rows_size(const Transport& t) { return kCheckRow * t.workers; }

std::string reduction_failed(const Layer& g, const Key& key, const std::string& why) {
  return message("reduction_failed", {{"direction", direction_name(key)}, {"layer", g.name},
                                      {"slot", std::to_string(g.slot)},
                                      {"transport", g.transport->name}, {"why", why}});
}

std::string broken_message(const Layer& g) {
  return message("broken", {{"transport", g.transport->name}, {"cause", g_broken}});
}

// Whether the rows every worker fills hold only what workers send: whole
// numbers, none negative (a kvstore that applies an optimizer to its keys
// changes them).
bool whole_numbers(const double* rows, size_t size) {
  for (size_t i = 0; i < size; ++i)
    if (rows[i] < 0 || rows[i] != std::round(rows[i])) return false;
  return true;
}

// "worker 0: 3 channels, call #2, float32; worker 1: ..." from CHECKED rows.
std::string describe_checks(const double* rows, int workers) {
  std::string out;
  for (int r = 0; r < workers; ++r) {
    const double* row = rows + r * kCheckRow;
    out += (r ? "; worker " : "worker ") + std::to_string(r) + ": " + number(row[0]) +
           " channels, call #" + number(row[1]) + ", " + dtype_of_code(row[2]);
  }
  return out;
}

void complete_remote(const std::shared_ptr<Layer>& g, const Key& key,
                     const std::shared_ptr<Meeting>& ex, const std::string& error,
                     const std::vector<double>& total);

// Hands the meeting's sum to the transport once g_mutex is released, with a
// fresh deadline for the other workers (lock held). Forward sums travel
// about the layer's shift; a layer's first forward call has none yet, so it
// sends them as they are first (round 1), only to learn the means, then
// about those (round 2, complete_remote).
std::string start_remote_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex) {
  if (!g_broken.empty()) return broken_message(g);
  if (g.slot < 0)
    return message("no_slot", {{"layer", g.name}, {"transport", g.transport->name}});
  const int dir = std::get<0>(key);
  if (ex->local.empty()) ex->local = ex->result;
  std::vector<double> sums = ex->local;
  if (dir == 0) {
    ex->round = g.shift.empty() ? 1 : 2;
    if (ex->round == 2) shift_forward(&sums, 0, g.num_sync_groups, g.shift, -1);
  }
  const auto checks = own_checks(key, ex->values[0].size(), ex->dtypes[0]);
  std::vector<double> payload(check_rows_size(*g.transport), 0.0);
  std::copy(checks.begin(), checks.end(), payload.begin() + g.transport->rank * kCheckRow);
  payload.insert(payload.end(), sums.begin(), sums.end());
  payload.insert(payload.end(), g.ownership.begin(), g.ownership.end());
  ex->remote = true;
  ex->deadline = deadline_of(g);
  if (ex->deadline < g_watchdog_wake) g_watchdog_cv.notify_all();
  std::shared_ptr<Layer> layer = g.shared_from_this();
  std::shared_ptr<Transport> transport = g.transport;
  const int slot = g.slot;
  g_pending.emplace_back([layer, transport, slot, dir, key, ex, payload](
                             const std::string&, const std::vector<double>&) {
    transport->start(slot, dir, payload, [layer, key, ex](const std::string& error,
                                                          const std::vector<double>& total) {
      complete_remote(layer, key, ex, error, total);
    });
  }, "", std::vector<double>());
  return "";
}

// What is wrong with the sum over all workers, or "" with ex->result set to
// this worker's rows (lock held).
std::string check_remote_locked(const Layer& g, const Key& key, Meeting& ex,
                                const std::vector<double>& total) {
  const Transport& t = *g.transport;
  const size_t size = ex.values[0].size(), rows = g.num_sync_groups * size;
  const size_t head = check_rows_size(t);
  if (total.size() != head + rows + g.ownership.size())
    return "SyncBatchNorm: the " + std::string(direction_name(key)) + " reduction of layer '" +
           g.name + "' (slot " + std::to_string(g.slot) + ") came back from " + t.name +
           " with " + std::to_string(total.size()) + " numbers instead of " +
           std::to_string(head + rows + g.ownership.size()) + "; this is a bug in "
           "gluon_syncbn, please report it.";
  const auto own = own_checks(key, size, ex.dtypes[0]);
  bool missing = false, differ = false;
  for (int r = 0; r < t.workers; ++r) {
    const double* row = &total[r * kCheckRow];
    missing = missing || row[0] == 0;  // every worker's call has channels
    differ = differ || !std::equal(own.begin(), own.end(), row);
  }
  if (!whole_numbers(total.data(), head))
    return message("sums_changed", {{"transport", t.name}, {"direction", direction_name(key)},
                                    {"layer", g.name}, {"slot", std::to_string(g.slot)}});
  if (missing)
    return reduction_failed(g, key, "no sum came back (the engine reported an error on it)");
  if (differ)
    return message("out_of_step", {{"layer", g.name}, {"direction", direction_name(key)},
                                   {"call", std::to_string(std::get<2>(key))},
                                   {"slot", std::to_string(g.slot)},
                                   {"workers", describe_checks(total.data(), t.workers)}});
  std::vector<int> clashes;
  for (size_t i = 0; i < g.ownership.size(); ++i)
    if (total[head + rows + i] != 1) clashes.push_back(static_cast<int>(i));
  if (!clashes.empty()) {
    std::string which;
    for (int d : clashes) which += (which.empty() ? "" : ", ") + std::to_string(d);
    return message("numbering_disagrees", {{"layer", g.name}, {"devices", which}});
  }
  ex.result.assign(total.begin() + head, total.begin() + head + rows);
  return empty_batch(g, key, ex.result);
}

// The transport's answer: completes the meeting, or fails the step (and the
// process: fatal_locked). Ignored if the meeting failed meanwhile (its
// deadline, an abort).
void complete_remote(const std::shared_ptr<Layer>& g, const Key& key,
                     const std::shared_ptr<Meeting>& ex, const std::string& error,
                     const std::vector<double>& total) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (ex->done || !ex->error.empty()) return;
    std::string failure = !error.empty() ? reduction_failed(*g, key, error)
                                         : check_remote_locked(*g, key, *ex, total);
    bool again = false;  // round 1 of a forward meeting: round 2 follows
    if (failure.empty() && std::get<0>(key) == 0) {
      const size_t rows = g->num_sync_groups;
      const size_t channels = forward_channels(ex->values[0].size());
      if (ex->round == 1) {  // the means: now the sums about them
        g->shift = forward_means(ex->result, 0, rows, channels);
        failure = start_remote_locked(*g, key, ex);
        again = failure.empty();
      } else {
        shift_forward(&ex->result, 0, rows, g->shift, +1);
        g->shift = forward_means(ex->result, 0, rows, channels);
      }
    }
    if (!failure.empty()) {
      fatal_locked(failure);
      abort_locked(failure);
    } else if (!again) {
      ex->done = true;
      dispatch_locked(*g, key, ex);
    }
  }
  run_pending();
}

// "worker 0: 'bn2', 4 channels, float32; worker 1: ..." from LAYER rows
// (sync groups too where they differ).
std::string describe_layers(const std::vector<double>& rows, int workers) {
  bool groups_differ = false;
  for (int r = 1; r < workers; ++r)
    groups_differ = groups_differ || rows[r * kLayerRow + 2] != rows[2] ||
                    rows[r * kLayerRow + 3] != rows[3];
  std::string out;
  for (int r = 0; r < workers; ++r) {
    const double* row = &rows[r * kLayerRow];
    out += (r ? "; worker " : "worker ") + std::to_string(r) + ": '" + layer_name_of(row) +
           "', " + number(row[0]) + " channels, " + dtype_of_code(row[1]);
    if (groups_differ)
      out += ", " + number(row[2]) + " sync groups over " + number(row[3]) + " devices";
  }
  return out;
}

// Why the workers' first calls of a layer do not belong together ("" if
// they do): every worker's LAYER row must be this worker's.
std::string layers_differ(const Layer& g, const std::vector<double>& own,
                          const std::vector<double>& rows, int workers, int before,
                          const Transport& t) {
  if (!whole_numbers(rows.data(), rows.size()))
    return message("sums_changed", {{"transport", t.name}, {"direction", "setup"},
                                    {"layer", g.name}, {"slot", std::to_string(before)}});
  for (int r = 0; r < workers; ++r)
    if (rows[r * kLayerRow] == 0)  // every worker's layer has channels
      return "SyncBatchNorm '" + g.name + "' could not compare its setup with the other "
             "workers: worker " + std::to_string(r) + "'s description did not come back (the "
             "engine reported an error on it). Another worker probably died; see its log.";
  for (int r = 0; r < workers; ++r)
    if (!std::equal(own.begin(), own.end(), rows.begin() + r * kLayerRow))
      return message("layers_differ", {{"layer", g.name}, {"number", std::to_string(before + 1)},
                                       {"workers", describe_layers(rows, workers)}});
  return "";
}

// A layer whose sums leave the process could not be set up: fatal, since
// the other workers may wait in a collective of the engine for ever.
bool setup_failed(const std::shared_ptr<Transport>& t, const std::string& error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_remote_rank = t->rank;
  record_locked("SyncBatchNormError", error);
  fatal_locked(error);
  return false;
}

// Gives a layer whose sums leave the process its slot in the transport, at
// its first call with `channels` channels of `dtype` (in network order, from
// whichever thread calls first: the operators' FCreateOpState), after
// checking with the other workers that their first calls of a layer in this
// order are of the same layer. False with `error` set if that failed.
bool attach_remote(Layer& g, int64_t channels, const std::string& dtype, std::string* error) {
  // Set before the layer's first call and never changed: every imperative
  // call's state creation passes here, so a layer of one process takes no lock.
  if (!g.transport) return true;
  // One layer at a time, each once, even when the devices' threads create
  // their states at once (one Python thread per device): slots are numbered
  // in the order of layers' first calls, identically on every worker.
  static std::mutex& attaching = *new std::mutex();
  std::lock_guard<std::mutex> one_at_a_time(attaching);
  std::shared_ptr<Transport> t;
  size_t sizes[2];
  std::vector<double> row;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g.transport || g.slot >= 0 || channels <= 0) return true;
    if (!g_broken.empty()) {
      *error = broken_message(g);
      return false;
    }
    t = g.transport;
    const size_t head = check_rows_size(*t), owners = g.ownership.size();
    sizes[0] = head + g.num_sync_groups * (1 + 2 * channels) + owners;
    sizes[1] = head + g.num_sync_groups * 2 * channels + owners;
    row = pack_layer(static_cast<double>(channels), dtype, g.num_sync_groups, owners, g.name);
  }
  const int before = t->num_slots();
  std::vector<double> rows;
  if (!t->gather_layer_rows(row, g.timeout, &rows, error)) {
    *error = error->empty()
                 ? message("setup_timeout", {{"rank", std::to_string(t->rank)},
                                             {"workers", std::to_string(t->workers)},
                                             {"timeout", number(g.timeout)},
                                             {"layer", g.name},
                                             {"number", std::to_string(before + 1)},
                                             {"transport", t->name}})
                 : "SyncBatchNorm '" + g.name + "' could not compare its setup with the other "
                   "workers through " + t->name + ": " + *error;
    return setup_failed(t, *error);
  }
  *error = layers_differ(g, row, rows, t->workers, before, *t);
  if (!error->empty()) return setup_failed(t, *error);
  int slot = -1;
  if (!t->add_slot(sizes, g.timeout, &slot, error)) {
    *error = "SyncBatchNorm '" + g.name + "' could not set up its " + t->name + " keys: " +
             *error;
    return setup_failed(t, *error);
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g.slot = slot;
  g_remote_rank = t->rank;
  return true;
}

std::string timeout_message(const Layer& g, const Key& key, const Meeting& ex) {
  const std::string call = std::to_string(std::get<2>(key));
  if (ex.remote)
    return message("remote_timeout",
                   {{"rank", std::to_string(g.transport->rank)},
                    {"workers", std::to_string(g.transport->workers)},
                    {"timeout", number(g.timeout)}, {"direction", direction_name(key)},
                    {"call", call}, {"layer", g.name}, {"slot", std::to_string(g.slot)},
                    {"transport", g.transport->name}});
  const int n = static_cast<int>(g.devices.size());
  std::vector<int> arrived, missing;
  for (int i = 0; i < n; ++i) (ex.values[i].empty() ? missing : arrived).push_back(i);
  return message("call_timeout",
                 {{"layer", g.name}, {"arrived", std::to_string(ex.arrived)},
                  {"devices", std::to_string(n)}, {"present", join(g.devices, arrived)},
                  {"direction", std::get<0>(key) == 0 ? "forward" : "backward"},
                  {"call", call}, {"timeout", number(g.timeout)},
                  {"missing", join(g.devices, missing)}, {"hint", g.hint}});
}

// ------------------------------------------------------------- watchdog --
// Fails asynchronous meetings at their deadline: nothing else waits for them.

void watchdog() {
  std::unique_lock<std::mutex> lock(g_mutex);
  for (;;) {
    auto next = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    std::string failure;
    bool remote = false;
    for (auto& g : live_layers_locked())
      for (auto& e : g->meetings) {
        const Meeting& ex = *e.second;
        if (ex.waiters.empty() || ex.done || !ex.error.empty()) continue;
        if (ex.deadline <= std::chrono::steady_clock::now()) {
          if (failure.empty()) {
            failure = timeout_message(*g, e.first, ex);
            remote = ex.remote;
          }
        } else if (ex.deadline < next) {
          next = ex.deadline;
        }
      }
    if (!failure.empty()) {
      if (remote) fatal_locked(failure);  // the other workers: see fatal_locked
      abort_locked(failure, "SyncBatchNormTimeout");
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
void meet_async(Layer& g, const Key& key, int device, std::vector<double> value,
                    const std::string& dtype, Waiter done) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_watchdog_started) {
      g_watchdog_started = true;
      std::thread(watchdog).detach();
    }
    if (std::get<1>(key) != g_token) {
      record_locked("SyncBatchNormError", stale_message(g.name));
      g_pending.emplace_back(std::move(done), stale_message(g.name), std::vector<double>());
    } else if (g.transport && !g_broken.empty()) {
      record_locked("SyncBatchNormError", broken_message(g));
      g_pending.emplace_back(std::move(done), broken_message(g), std::vector<double>());
    } else {
      const int n = static_cast<int>(g.devices.size());
      std::shared_ptr<Meeting> ex = meeting_locked(g, key);
      ex->values[device] = std::move(value);
      ex->dtypes[device] = dtype;
      ex->waiters.emplace_back(device, std::move(done));
      if (++ex->arrived == n) {
        std::string failure = combine_locked(g, key, ex);
        if (!failure.empty()) abort_locked(failure);
      } else if (ex->deadline < g_watchdog_wake) {
        g_watchdog_cv.notify_all();  // a deadline before the watchdog's next look
      }
    }
  }
  run_pending();
}

std::shared_ptr<Layer> find_layer(int64_t id, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_layers.find(id);
  if (it != g_layers.end()) return it->second;
  *error = message("unknown_layer", {{"layer", std::to_string(id)}});
  return nullptr;
}

// Adds the global statistics of a training call of `device` to the
// device's tally, if one is on.
void add_to_tally(Layer& g, int device, const Info& stats) {
  if (!g.tallying) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g.tallying) g.tallies[device].add(stats);
}

// Numbers a forward call of `device`: sets its step token and call number, or
// returns false with `error` set (and recorded) for a call of a step that
// failed earlier. `issued` is the token the call got when it was issued;
// static graphs create their operators once, so there the call's is the
// token stamped before it (gsbn_stamp_static), or, where no stamp ran, the
// current one.
bool number_call(Layer& g, int device, bool static_graph, uint64_t issued, uint64_t* token,
                 int64_t* call, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const uint64_t stamped = static_graph ? g.static_token[device] : 0;
  *token = !static_graph ? issued : stamped ? stamped - 1 : g_token;
  if (*token != g_token) {
    *error = stale_message(g.name);
    record_locked("SyncBatchNormError", *error);
    return false;
  }
  if (*token != g.counter_token) {
    g.counter_token = *token;
    g.next_call.assign(g.devices.size(), 0);
  }
  *call = g.next_call[device]++;
  return true;
}

// False with `error` set (and recorded) if a backward call of `g` issued
// with `issued` belongs to a step that failed since.
bool backward_current(const Layer& g, bool static_graph, uint64_t issued, std::string* error) {
  if (static_graph) return true;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (issued == g_token) return true;
  *error = stale_message(g.name);
  record_locked("SyncBatchNormError", *error);
  return false;
}

}  // namespace
