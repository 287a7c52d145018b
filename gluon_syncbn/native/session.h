// The session and the meeting of the native operators: which step a call
// belongs to, how the k-th calls of the devices meet, and how a step fails.
// Nothing here waits: a device's call hands its vector over with a
// continuation, which runs once the meeting is complete or has failed.
// Across processes a meeting has a remote phase: the process's vector goes
// through the layer's transport (transport.h), and the checked combination
// of every worker's completes it; a failure there is fatal (see fatal_locked).
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
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "failures.h"
#include "messages.h"
#include "stats.h"
#include "transport.h"
#include "wire.h"

namespace {

// ---------------------------------------------------------------- session --
// Shared by every layer of the process: the current step's token and the
// cause of the last abort.

struct Meeting;
struct Layer;

// Never destroyed: the watchdog thread and MXNet's engine threads may still
// use them while the process exits.
std::mutex& g_mutex = *new std::mutex();  // guards every structure below and every Layer
uint64_t g_token = 0;        // the current step; advanced by every abort
uint64_t g_issue_token = 0;  // what calls issued now get: g_token as of the step's start
std::string& g_cause = *new std::string();
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
// ends: fatal_locked); this worker's rank once a layer's sums leave it;
// whether a reduction left this worker since the current step began (an
// abort is then fatal: the other workers wait for this step's later ones).
std::string& g_broken = *new std::string();
int g_remote_rank = -1;
double g_exit_grace = 30.0;
bool g_remote_in_step = false;
// What each thread waits in now, where it waits for an output (gsbn_reading).
std::map<std::thread::id, std::string>& g_reads = *new std::map<std::thread::id, std::string>();

// The watchdog (see watchdog()). When it wakes next (at the latest a second
// from its last look): only a meeting with an earlier deadline needs to
// wake it, so a call with the usual timeout of many seconds costs no thread
// wake-up.
std::condition_variable& g_watchdog_cv = *new std::condition_variable();
bool g_watchdog_started = false;
std::chrono::steady_clock::time_point g_watchdog_wake;

typedef std::tuple<int, uint64_t, int64_t> Key;  // (0 fwd / 1 bwd, token, call number)

// A device's continuation: called once, with the error (failure_text's) or
// with its sync group's sum, after the lock is released (run_pending).
typedef std::function<void(const std::string& error, const std::vector<double>& sum)> Waiter;

struct Meeting {
  uint64_t token;
  std::vector<std::vector<double>> values;  // one vector per device
  std::vector<std::string> dtypes;
  int arrived = 0, taken = 0;
  bool done = false;
  std::string error, kind;                  // non-empty: failed with this cause, raised as kind
  std::vector<double> result;
  std::vector<std::pair<int, Waiter>> waiters;  // the devices' continuations
  std::chrono::steady_clock::time_point deadline;
  bool remote = false;                      // in the remote phase (across processes)
  Meeting(uint64_t t, int n) : token(t), values(n), dtypes(n) {}
};

struct Layer : std::enable_shared_from_this<Layer> {
  std::string name, hint;
  std::vector<std::string> devices;
  std::vector<int> sync_group_of;  // each device's sync group (sync_groups), 0 by default
  int num_sync_groups = 1;
  // Seconds a device waits for the others in this process, and a process
  // for the other workers (the remote phase, and the setup at a first call).
  double timeout, remote_timeout;
  // The layer's eps and momentum for the calls that run now: the user may
  // change them between steps (a momentum schedule); each change is an
  // engine operation ordered among the layer's calls (gsbn_set_arguments).
  double eps = 1e-5, momentum = 0.9;
  uint64_t counter_token = 0;
  std::vector<int64_t> next_call;
  std::map<Key, std::shared_ptr<Meeting>> meetings;
  // Across processes, where a sync group spans workers: the transport, the
  // layer's slot in it (-1 until its first call), and this worker's entries
  // of the global device ownership vector (empty without sync_groups).
  std::shared_ptr<Transport> transport;
  int slot = -1;
  std::vector<double> ownership;
  // Static graphs: per device, 1 + the token of the step its next calls
  // were issued in, as the last stamp set it (gsbn_stamp_static; 0: none yet).
  std::vector<uint64_t> static_token;
  // Per device, the thread that issued its last call (issue_token).
  std::vector<std::thread::id> issuer;
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
  const std::string failure = ex->error.empty() ? "" : failure_text(ex->error, ex->kind);
  for (auto& w : ex->waiters) {
    std::vector<double> sum;
    if (ex->error.empty())
      sum.assign(ex->result.begin() + g.sync_group_of[w.first] * size,
                 ex->result.begin() + (g.sync_group_of[w.first] + 1) * size);
    g_pending.emplace_back(std::move(w.second), failure, std::move(sum));
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

// Whether aborting the step now leaves other workers waiting for this one
// (lock held): a reduction of its left this worker since the step began
// (the others wait for its later ones), or one is in flight. A step every
// worker abandons alike before any of its reductions costs nothing more:
// each worker's token advances, and their next reductions agree.
bool others_wait_locked() {
  if (g_remote_in_step) return true;
  for (auto& g : live_layers_locked())
    for (auto& e : g->meetings)
      if (e.second->remote && !e.second->done && e.second->error.empty()) return true;
  return false;
}

// A kvstore worker cannot end cleanly once its job's scheduler is gone:
// ps-lite's barriers meet there, the store's final one (when the store is
// destroyed, at the latest at the process's exit) among them, and would wait
// for ever; nothing else tells the worker. So from the transport's creation
// a thread looks every two seconds whether the engine's own processes can
// still answer; if not, and the process still lives a few seconds later
// (the scheduler also ends once every worker passed that final barrier,
// and a worker past it exits at once), it ends the process, saying why.
void watch_helpers(const std::shared_ptr<Transport>& t) {
  std::thread([t]() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      const std::string gone = t->helpers_gone();
      if (!gone.empty()) {
        std::this_thread::sleep_for(std::chrono::seconds(5));
        const std::string text =
            message("exit_helpers_gone", {{"rank", std::to_string(t->rank)}, {"why", gone}});
        std::fflush(stdout);
        std::fprintf(stderr, "%s\n", text.c_str());
        std::fflush(stderr);
        std::_Exit(1);
      }
    }
  }).detach();
}

// Fail every waiting meeting: the step is over (lock held). Fatal where
// other workers wait for this one's reductions, except at interpreter exit.
// Every meeting goes: a call of the aborted step that arrives later is
// refused by its token (meet_async), so none of them can be joined again.
void abort_locked(const std::string& cause, const std::string& kind = kSyncBatchNormError,
                  bool exiting = false) {
  if (!exiting && g_remote_rank >= 0 && others_wait_locked())
    fatal_locked(message("worker_step_failed",
                         {{"rank", std::to_string(g_remote_rank)}, {"cause", cause}}));
  ++g_token;
  g_cause = cause;
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
    abort_locked(cause, kSyncBatchNormError, exiting);
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

// ---------------------------------------------------------------- meeting --
// The k-th call of a layer on each device meets the k-th call on the others.
// The last device to arrive checks that they agree and combines their vectors
// in device order (the same rounding whatever the arrival order). Every wait
// ends at the layer's timeout.

// A meeting goes once every device has taken its outcome (lock held).
void release_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex) {
  if (++ex->taken == static_cast<int>(g.devices.size())) {
    auto it = g.meetings.find(key);
    if (it != g.meetings.end() && it->second == ex) g.meetings.erase(it);
  }
}

// When a wait of `seconds` that starts now ends.
std::chrono::steady_clock::time_point deadline_in(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(seconds));
}

// The meeting of `key`, created by its first device (lock held).
std::shared_ptr<Meeting> meeting_locked(Layer& g, const Key& key) {
  auto& slot = g.meetings[key];
  if (!slot) {
    slot = std::make_shared<Meeting>(std::get<1>(key), static_cast<int>(g.devices.size()));
    slot->deadline = deadline_in(g.timeout);
  }
  return slot;
}

// Why a combined FORWARD vector cannot be used: a sync group of this
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

// The last device to arrive: checks that the devices agree and combines
// their vectors; returns the failure, or "" with the meeting done (lock held).
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
  // One combination per sync group, each in device order (the same rounding
  // whatever the arrival order); a device takes its sync group's.
  ex->result.assign(g.num_sync_groups * size, 0.0);
  for (int i = 0; i < n; ++i)
    combine(std::get<0>(key), &ex->result[g.sync_group_of[i] * size], ex->values[i].data(),
            size);
  if (g.transport) return start_remote_locked(g, key, ex);
  const std::string empty = empty_batch(g, key, ex->result);
  if (!empty.empty()) return empty;
  ex->done = true;
  dispatch_locked(g, key, ex);
  return "";
}

// ----------------------------------------------------------- remote phase --
// Across processes the last device's combination goes to the other workers
// as wire.h's CHECKED vector: this worker's row (its check numbers and its
// vector, one block per sync group) among the others' zeros, then its
// ownership entries; the meeting completes with every worker's rows
// combined in rank order, the same on every worker.

const char* direction_name(const Key& key) { return std::get<0>(key) == 0 ? "fwd" : "bwd"; }

// The numbers of a worker's row for vectors of `size`: the check numbers,
// then each number of the vector as the transport carries it exactly.
size_t row_size(const Layer& g, size_t size) {
  return kCheckRow + g.num_sync_groups * size * g.transport->numbers_per_value();
}

// This worker's check numbers for a reduction of vectors of `size`: the
// layer's width, the call's number and dtype, and the step token (as many
// abandoned steps as the others); whole numbers below 2^24.
std::array<double, kCheckRow> own_checks(const Key& key, size_t size, const std::string& dtype) {
  return {static_cast<double>(std::get<0>(key) == 0 ? forward_channels(size)
                                                    : backward_channels(size)),
          modulo_2_20(static_cast<uint64_t>(std::get<2>(key))), dtype_code(dtype),
          modulo_2_20(std::get<1>(key))};
}

std::string reduction_failed(const Layer& g, const Key& key, const std::string& why) {
  return message("reduction_failed", {{"direction", direction_name(key)}, {"layer", g.name},
                                      {"slot", std::to_string(g.slot)},
                                      {"transport", g.transport->name}, {"why", why}});
}

std::string broken_message(const Layer& g) {
  return message("broken", {{"transport", g.transport->name}, {"cause", g_broken}});
}

// Whether the numbers every worker fills hold only what workers send: whole
// numbers, none negative (a kvstore that applies an optimizer to its keys
// changes them).
bool whole_numbers(const double* numbers, size_t size) {
  for (size_t i = 0; i < size; ++i)
    if (numbers[i] < 0 || numbers[i] != std::round(numbers[i])) return false;
  return true;
}

// "worker 0: 3 channels, call #2, float32; worker 1: ..." from the rows of
// `row` numbers (each worker's abandoned steps too, where they differ).
std::string describe_checks(const double* rows, int workers, size_t row) {
  bool tokens_differ = false;
  for (int r = 1; r < workers; ++r) tokens_differ = tokens_differ || rows[r * row + 3] != rows[3];
  std::string out;
  for (int r = 0; r < workers; ++r) {
    const double* checks = rows + r * row;
    out += (r ? "; worker " : "worker ") + std::to_string(r) + ": " + number(checks[0]) +
           " channels, call #" + number(checks[1]) + ", " + dtype_of_code(checks[2]);
    if (tokens_differ)
      out += ", after " + number(checks[3]) + " abandoned step" + (checks[3] == 1 ? "" : "s");
  }
  return out;
}

void complete_remote(const std::shared_ptr<Layer>& g, const Key& key,
                     const std::shared_ptr<Meeting>& ex, const std::string& error,
                     const std::vector<double>& total);

// Hands the meeting's combination to the transport once g_mutex is released,
// with a fresh deadline for the other workers (lock held).
std::string start_remote_locked(Layer& g, const Key& key, const std::shared_ptr<Meeting>& ex) {
  if (!g_broken.empty()) return broken_message(g);
  if (g.slot < 0)
    return message("no_slot", {{"layer", g.name}, {"transport", g.transport->name}});
  const Transport& t = *g.transport;
  const size_t size = ex->values[0].size(), row = row_size(g, size);
  const int numbers = t.numbers_per_value();
  std::vector<double> payload(t.workers * row + g.ownership.size(), 0.0);
  double* own = &payload[t.rank * row];
  const auto checks = own_checks(key, size, ex->dtypes[0]);
  std::copy(checks.begin(), checks.end(), own);
  for (size_t i = 0; i < ex->result.size(); ++i)
    encode_exact(ex->result[i], numbers, own + kCheckRow + i * numbers);
  std::copy(g.ownership.begin(), g.ownership.end(), payload.end() - g.ownership.size());
  ex->remote = true;
  g_remote_in_step = true;
  ex->deadline = deadline_in(g.remote_timeout);
  if (ex->deadline < g_watchdog_wake) g_watchdog_cv.notify_all();
  std::shared_ptr<Layer> layer = g.shared_from_this();
  std::shared_ptr<Transport> transport = g.transport;
  const int slot = g.slot, dir = std::get<0>(key);
  g_pending.emplace_back([layer, transport, slot, dir, key, ex, payload](
                             const std::string&, const std::vector<double>&) {
    transport->start(slot, dir, payload, [layer, key, ex](const std::string& error,
                                                          const std::vector<double>& total) {
      complete_remote(layer, key, ex, error, total);
    });
  }, "", std::vector<double>());
  return "";
}

// What is wrong with the workers' rows, or "" with ex->result set to their
// vectors combined in rank order, per sync group (lock held).
std::string check_remote_locked(const Layer& g, const Key& key, Meeting& ex,
                                const std::vector<double>& total) {
  const Transport& t = *g.transport;
  const size_t size = ex.values[0].size(), row = row_size(g, size);
  const size_t vectors = g.num_sync_groups * size, owners = g.ownership.size();
  if (total.size() != t.workers * row + owners)
    return "SyncBatchNorm: the " + std::string(direction_name(key)) + " reduction of layer '" +
           g.name + "' (slot " + std::to_string(g.slot) + ") came back from " + t.name +
           " with " + std::to_string(total.size()) + " numbers instead of " +
           std::to_string(t.workers * row + owners) + "; this is a bug in gluon_syncbn, "
           "please report it.";
  const auto own = own_checks(key, size, ex.dtypes[0]);
  bool whole = true, missing = false, differ = false;
  for (int r = 0; r < t.workers; ++r) {
    const double* checks = &total[r * row];
    whole = whole && whole_numbers(checks, kCheckRow);
    missing = missing || checks[0] == 0;  // every worker's call has channels
    differ = differ || !std::equal(own.begin(), own.end(), checks);
  }
  if (!whole || !whole_numbers(&total[t.workers * row], owners))
    return message("sums_changed", {{"transport", t.name}, {"direction", direction_name(key)},
                                    {"layer", g.name}, {"slot", std::to_string(g.slot)}});
  if (missing)
    return reduction_failed(g, key, "no sum came back (the engine reported an error on it)");
  if (differ)
    return message("out_of_step", {{"layer", g.name}, {"direction", direction_name(key)},
                                   {"call", std::to_string(std::get<2>(key))},
                                   {"slot", std::to_string(g.slot)},
                                   {"workers", describe_checks(total.data(), t.workers, row)}});
  std::string clashes;
  for (size_t i = 0; i < owners; ++i)
    if (total[t.workers * row + i] != 1)
      clashes += (clashes.empty() ? "" : ", ") + std::to_string(i);
  if (!clashes.empty()) return message("numbering_disagrees", {{"layer", g.name},
                                                               {"devices", clashes}});
  const int numbers = t.numbers_per_value();
  std::vector<double> vector(vectors);
  ex.result.assign(vectors, 0.0);
  for (int r = 0; r < t.workers; ++r) {
    for (size_t i = 0; i < vectors; ++i)
      vector[i] = decode_exact(&total[r * row + kCheckRow + i * numbers], numbers);
    for (int s = 0; s < g.num_sync_groups; ++s)
      combine(std::get<0>(key), &ex.result[s * size], &vector[s * size], size);
  }
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
    const std::string failure = !error.empty() ? reduction_failed(*g, key, error)
                                               : check_remote_locked(*g, key, *ex, total);
    if (!failure.empty()) {
      fatal_locked(failure);
      abort_locked(failure);
    } else {
      ex->done = true;
      dispatch_locked(*g, key, ex);
    }
  }
  run_pending();
}

// ------------------------------------------------------------------ setup --
// What the workers must agree on outside a layer's calls (wire.h's CONTROL
// rows, through the transport's control key, in the order they ask): a
// layer's sync groups when its backend is made, before they are worked out
// (kLayerKind); its channels and dtype at its first call, before its keys
// exist (kKeysKind: key sizes follow the channels, and the kvstore server
// aborts on a push of another size); update_bn_stats' batches (kBatchKind).
// A failure here is fatal: the other workers may wait in a collective of the
// engine for ever.

bool setup_failed(const std::shared_ptr<Transport>& t, const std::string& error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_remote_rank = t->rank;
  fatal_locked(error);
  return false;
}

// "worker 0: setting up layer 'bn3'; worker 1: in update_bn_stats, at batch
// #2" from CONTROL rows of different kinds.
std::string describe_control(const std::vector<double>& rows, int workers) {
  std::string out;
  for (int r = 0; r < workers; ++r) {
    const double* row = &rows[r * kControlRow];
    const std::string layer = "'" + control_name(row) + "'";
    out += (r ? "; worker " : "worker ") + std::to_string(r) + ": " +
           (row[0] == kLayerKind   ? "setting up layer " + layer
            : row[0] == kKeysKind  ? "at the first call of layer " + layer
            : row[0] == kBatchKind ? "in update_bn_stats, at batch #" + number(row[1] + 1)
                                   : std::string("no setup it could name"));
  }
  return out;
}

// "worker 0: 'bn2', 4 channels, float32; ..." from kKeysKind rows; "worker
// 0: 'bn2'; worker 1: ..." from kLayerKind ones, with their sync groups
// where those differ.
std::string describe_layers(const std::vector<double>& rows, int workers) {
  bool groups_differ = false;
  for (int r = 1; r < workers; ++r)
    groups_differ = groups_differ || !std::equal(rows.begin() + 1, rows.begin() + 3,
                                                 rows.begin() + r * kControlRow + 1);
  std::string out;
  for (int r = 0; r < workers; ++r) {
    const double* row = &rows[r * kControlRow];
    out += (r ? "; worker " : "worker ") + std::to_string(r) + ": '" + control_name(row) + "'";
    if (row[0] == kKeysKind)
      out += ", " + number(row[1]) + " channels, " + dtype_of_code(row[2]);
    else if (groups_differ)
      out += ", sync_groups=" + control_groups(row) +
             (row[1] > 0 ? " over " + number(row[1]) + " device" + (row[1] == 1 ? "" : "s") : "");
  }
  return out;
}

// Every worker's next CONTROL row must be `row` (a layer's), through `t`
// within `timeout` seconds; `place` and `name` name the layer in messages
// (its place among the layers to synchronize across workers). "" or why
// not (the process's end started).
std::string agree_on_layer(const std::shared_ptr<Transport>& t, const std::vector<double>& row,
                           int place, const std::string& name, double timeout) {
  const std::string what = "set up layer '" + name + "', its layer #" + std::to_string(place) +
                           " to synchronize across workers";
  std::vector<double> rows;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_broken.empty()) return message("broken", {{"transport", t->name}, {"cause", g_broken}});
  }
  if (!t->gather_control(row, timeout, &rows, &error)) {
    error = error.empty() ? message("setup_timeout", {{"rank", std::to_string(t->rank)},
                                                      {"workers", std::to_string(t->workers)},
                                                      {"timeout", number(timeout)},
                                                      {"what", what}, {"transport", t->name}})
                          : "SyncBatchNorm could not " + what + " with the other workers "
                            "through " + t->name + ": " + error;
  } else if (!whole_numbers(rows.data(), rows.size())) {
    error = message("sums_changed", {{"transport", t->name}, {"direction", "setup"},
                                     {"layer", name}, {"slot", "-"}});
  }
  for (int r = 0; r < t->workers && error.empty(); ++r)
    if (rows[r * kControlRow] != row[0])
      error = message("setup_out_of_step", {{"what", what},
                                            {"workers", describe_control(rows, t->workers)}});
  for (int r = 0; r < t->workers && error.empty(); ++r)
    if (!std::equal(row.begin(), row.end(), rows.begin() + r * kControlRow))
      error = message("layers_differ", {{"layer", name}, {"number", std::to_string(place)},
                                        {"workers", describe_layers(rows, t->workers)}});
  if (!error.empty()) setup_failed(t, error);
  return error;
}

// When a layer that synchronizes across workers is made: every worker's
// layer made in its place must have the same sync groups (`groups`, as the
// user gave them; `devices`: the devices they number, where they are
// explicit, else 0), before they are worked out. "" or why not.
std::string compare_layer(const std::shared_ptr<Transport>& t, const std::string& name,
                          int devices, const std::string& groups, double timeout) {
  // One layer at a time, in the order they are made, the same on every
  // worker, from whichever thread makes it.
  static std::mutex& one_at_a_time = *new std::mutex();
  std::lock_guard<std::mutex> lock(one_at_a_time);
  const std::vector<double> row = pack_control(
      kLayerKind, {static_cast<double>(devices), digest24(groups)}, name, groups);
  const std::string error = agree_on_layer(t, row, t->num_layers() + 1, name, timeout);
  if (error.empty()) t->count_layer();
  return error;
}

// Whether every worker has update_bn_stats' batch `batch` (from 0): ""
// with `lacking` the workers without it, or why not (the process's end
// started). Every worker asks once per batch, in the same order.
std::string agree_on_batch(const std::shared_ptr<Transport>& t, int batch, bool has,
                           double timeout, std::vector<int>* lacking) {
  const std::string what = "agree on update_bn_stats' batch #" + std::to_string(batch + 1);
  std::vector<double> rows;
  std::string error;
  if (!t->gather_control(pack_control(kBatchKind, {static_cast<double>(batch), has ? 1.0 : 0.0},
                                      "", ""),
                         timeout, &rows, &error)) {
    error = error.empty() ? message("setup_timeout", {{"rank", std::to_string(t->rank)},
                                                      {"workers", std::to_string(t->workers)},
                                                      {"timeout", number(timeout)},
                                                      {"what", what}, {"transport", t->name}})
                          : "SyncBatchNorm could not " + what + " through " + t->name + ": " +
                            error;
    return setup_failed(t, error), error;
  }
  for (int r = 0; r < t->workers; ++r)
    if (rows[r * kControlRow] != kBatchKind || rows[r * kControlRow + 1] != batch) {
      error = message("setup_out_of_step", {{"what", what},
                                            {"workers", describe_control(rows, t->workers)}});
      return setup_failed(t, error), error;
    }
  lacking->clear();
  for (int r = 0; r < t->workers; ++r)
    if (rows[r * kControlRow + 2] != 1) lacking->push_back(r);
  return "";
}

// At the first call of layer `g`, whose sums leave the process, with
// `channels` channels of `dtype` (from whichever thread calls first: the
// operators' FCreateOpState): after checking that every worker's next layer
// to make its keys has the same, its keys in the transport, within its
// remote timeout. False with `error` set (and the process's end started)
// if that failed.
bool attach_remote(Layer& g, int64_t channels, const std::string& dtype, std::string* error) {
  // Set before the layer's first call and never changed: every imperative
  // call's state creation passes here, so a layer of one process takes no lock.
  if (!g.transport) return true;
  // One layer at a time, each once, even when the devices' threads create
  // their states at once (one Python thread per device): keys are made in
  // the order of the layers' first calls, identically on every worker.
  static std::mutex& attaching = *new std::mutex();
  std::lock_guard<std::mutex> one_at_a_time(attaching);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g.slot >= 0 || channels <= 0) return true;
  }
  std::shared_ptr<Transport> t = g.transport;
  const std::vector<double> row =
      pack_control(kKeysKind, {static_cast<double>(channels), dtype_code(dtype)}, g.name, "");
  *error = agree_on_layer(t, row, t->num_slots() + 1, g.name, g.remote_timeout);
  if (!error->empty()) return false;
  const size_t rows[2] = {row_size(g, 1 + 2 * channels), row_size(g, 2 * channels)};
  int slot = -1;
  if (!t->add_slot(rows, g.ownership.size(), g.remote_timeout, &slot, error)) {
    *error = error->empty()
                 ? message("setup_timeout",
                           {{"rank", std::to_string(t->rank)},
                            {"workers", std::to_string(t->workers)},
                            {"timeout", number(g.remote_timeout)},
                            {"what", "make the keys of layer '" + g.name + "'"},
                            {"transport", t->name}})
                 : "SyncBatchNorm '" + g.name + "' could not set up its " + t->name +
                       " keys: " + *error;
    return setup_failed(t, *error);
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g.slot = slot;
  g_remote_rank = t->rank;
  return true;
}

std::string timeout_message(const Layer& g, const Key& key, const Meeting& ex) {
  const std::string call = std::to_string(std::get<2>(key));
  if (ex.remote) {
    const std::string gone = g.transport->helpers_gone();
    return message("remote_timeout",
                   {{"rank", std::to_string(g.transport->rank)},
                    {"workers", std::to_string(g.transport->workers)},
                    {"timeout", number(g.remote_timeout)}, {"direction", direction_name(key)},
                    {"call", call}, {"layer", g.name}, {"slot", std::to_string(g.slot)},
                    {"transport", g.transport->name},
                    {"helpers", gone.empty() ? "" : " Also, " + gone + "."}});
  }
  const int n = static_cast<int>(g.devices.size());
  std::vector<int> arrived, missing;
  for (int i = 0; i < n; ++i) (ex.values[i].empty() ? missing : arrived).push_back(i);
  std::string hint = g.hint;
  for (int i : missing) {  // a read that waits for this very call
    auto read = g_reads.find(g.issuer[i]);
    if (read != g_reads.end() && g.issuer[i] != std::thread::id())
      hint = message("early_read", {{"device", g.devices[i]}, {"read", read->second}});
  }
  return message("call_timeout",
                 {{"layer", g.name}, {"arrived", std::to_string(ex.arrived)},
                  {"devices", std::to_string(n)}, {"present", join(g.devices, arrived)},
                  {"direction", std::get<0>(key) == 0 ? "forward" : "backward"},
                  {"call", call}, {"timeout", number(g.timeout)},
                  {"missing", join(g.devices, missing)}, {"hint", hint}});
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
void meet_async(Layer& g, const Key& key, int device, std::vector<double> value,
                    const std::string& dtype, Waiter done) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_watchdog_started) {
      g_watchdog_started = true;
      std::thread(watchdog).detach();
    }
    if (std::get<1>(key) != g_token) {
      g_pending.emplace_back(std::move(done), failure_text(stale_message(g.name)),
                             std::vector<double>());
    } else if (g.transport && !g_broken.empty()) {
      g_pending.emplace_back(std::move(done), failure_text(broken_message(g)),
                             std::vector<double>());
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
// returns false with `error` set for a call of a step that failed earlier. `issued` is the token the call got when it was issued;
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
    return false;
  }
  if (*token != g.counter_token) {
    g.counter_token = *token;
    g.next_call.assign(g.devices.size(), 0);
  }
  *call = g.next_call[device]++;
  return true;
}

// False with `error` set if a backward call of `g` issued with `issued`
// belongs to a step that failed since.
bool backward_current(const Layer& g, bool static_graph, uint64_t issued, std::string* error) {
  if (static_graph) return true;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (issued == g_token) return true;
  *error = stale_message(g.name);
  return false;
}

}  // namespace
