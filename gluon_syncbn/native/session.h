// The session of the native operators: the layers' native state, which step
// a call belongs to (the step token) and how a step fails (abort_locked,
// and across processes fatal_locked). How the k-th calls of the devices meet
// is meeting.h's; the remote phase and the setup across processes are
// remote.h's. Included once, by syncbn.cc (through sync_call.h).
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

// A step as its calls see it: the token they are numbered in and whether an
// abort failed it. Calls and meetings hold theirs, so that an abort from
// Python fails the current step's calls and leaves an earlier step's, still
// queued in the engine, to meet one another under their own token.
struct Step {
  uint64_t token;
  bool failed;
};

// Never destroyed: the watchdog thread and MXNet's engine threads may still
// use them while the process exits.
std::mutex& g_mutex = *new std::mutex();  // guards every structure below and every Layer
uint64_t g_token = 0;  // the token of the next step begun; advanced by every abort
// What calls issued now get: the step begun last (gsbn_step), with g_token
// as of its start. A new one begins only where every layer has had as many
// calls issued on each device since its token began (balanced_locked): a
// loop of one record() block per device stays one step, so an abort fails
// every device's calls of it.
std::shared_ptr<Step>& g_step = *new std::shared_ptr<Step>(new Step{0, false});
uint64_t g_failed_below = 0;  // every call of a lower token failed (a whole abort)
std::string& g_cause = *new std::string();       // why the last abort was
std::string& g_cause_kind = *new std::string();  // and the exception it is raised as
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
// What each thread waits in now, where it waits for an output, and whether
// it is the only thread in the step, which then issues every device's calls
// (gsbn_reading).
struct Read {
  std::string what;
  bool sole;
};
std::map<std::thread::id, Read>& g_reads = *new std::map<std::thread::id, Read>();

// The watchdog (see watchdog()). When it wakes next (at the latest a second
// from its last look): only a meeting with an earlier deadline needs to
// wake it, so a call with the usual timeout of many seconds costs no thread
// wake-up.
std::condition_variable& g_watchdog_cv = *new std::condition_variable();
bool g_watchdog_started = false;
std::chrono::steady_clock::time_point g_watchdog_wake;

typedef std::tuple<int, uint64_t, int64_t> Key;  // (0 fwd / 1 bwd, token, call number)

// Whether calls of `step` may still run (lock held).
bool current_locked(const Step& step) { return !step.failed && step.token >= g_failed_below; }

// A device's continuation: called once, with the error (failure_text's) or
// with its sync group's sum, after the lock is released (run_pending).
typedef std::function<void(const std::string& error, const std::vector<double>& sum)> Waiter;

struct Meeting {
  std::shared_ptr<Step> step;               // its calls' (the k-th of each device share one)
  std::vector<std::vector<double>> values;  // one vector per device
  std::vector<std::string> dtypes;
  int arrived = 0, taken = 0;
  bool done = false;
  std::string error, kind;                  // non-empty: failed with this cause, raised as kind
  std::vector<double> result;
  std::vector<std::pair<int, Waiter>> waiters;  // the devices' continuations
  std::chrono::steady_clock::time_point deadline;
  bool remote = false;                      // in the remote phase (across processes)
  Meeting(const std::shared_ptr<Step>& s, int n) : step(s), values(n), dtypes(n) {}
};

struct Layer : std::enable_shared_from_this<Layer> {
  std::string name, hint;
  std::vector<std::string> devices;
  std::vector<int> sync_group_of;  // each device's sync group (sync_groups), 0 by default
  int num_sync_groups = 1;
  // Seconds a device waits for the others in this process, and a process
  // for the other workers (the remote phase, and the setup at a first call).
  double timeout, remote_timeout;
  // Per device, the step token its calls are numbered in and its next
  // number (per device: an earlier token's calls may still run on one
  // device after another's began the next token).
  std::vector<uint64_t> numbered_token;
  std::vector<int64_t> next_call;
  // Per device, the calls issued since token `issued_token` began (balanced_locked).
  uint64_t issued_token = 0;
  std::vector<int64_t> issued;
  std::map<Key, std::shared_ptr<Meeting>> meetings;
  // Across processes, where a sync group spans workers: the transport, the
  // layer's slot in it (-1 until its first call), and this worker's entries
  // of the global device ownership vector (empty without sync_groups).
  std::shared_ptr<Transport> transport;
  int slot = -1;
  std::vector<double> ownership;
  // Static graphs: per device, the step its next calls were issued in, as
  // the last stamp set it (gsbn_stamp_static; null before the first).
  std::vector<std::shared_ptr<Step>> stamped_step;
  // Per device, the thread that issued its last call (issue_step).
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
    if (auto layer = weak.lock()) {
      live.push_back(layer);
      g_live[kept++] = weak;
    }
  g_live.resize(kept);
  return live;
}

// Continuations to run once g_mutex is released, with their error or sum.
std::vector<std::tuple<Waiter, std::string, std::vector<double>>>& g_pending =
    *new std::vector<std::tuple<Waiter, std::string, std::vector<double>>>();

void release_locked(Layer& layer, const Key& key, const std::shared_ptr<Meeting>& meeting);

// Hand a meeting's devices their outcome (lock held).
void dispatch_locked(Layer& layer, const Key& key, const std::shared_ptr<Meeting>& meeting) {
  const size_t size = meeting->error.empty() ? meeting->result.size() / layer.num_sync_groups : 0;
  const std::string failure = meeting->error.empty() ? "" : failure_text(meeting->error, meeting->kind);
  for (auto& w : meeting->waiters) {
    std::vector<double> sum;
    if (meeting->error.empty())
      sum.assign(meeting->result.begin() + layer.sync_group_of[w.first] * size,
                 meeting->result.begin() + (layer.sync_group_of[w.first] + 1) * size);
    g_pending.emplace_back(std::move(w.second), failure, std::move(sum));
    release_locked(layer, key, meeting);
  }
  meeting->waiters.clear();
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
  for (auto& layer : live_layers_locked())
    for (auto& e : layer->meetings)
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

void retire_cpu_temp_space();  // cpu_resources.h

// Fail the current step (`whole`: every call issued so far), its waiting
// meetings at once (lock held); the next step numbers its calls afresh.
// Python's aborts fail the current step only: an earlier step's calls still
// queued run and meet as usual. The library's (a timeout, devices that
// disagree, a refused copy) and the exit's are whole: their cause may hold
// up any call, and every wait must end. Fatal where other workers wait for this
// one's reductions, except at interpreter exit. A failed call that arrives
// later is refused by its step (meet_async), so no failed meeting is joined again.
void abort_locked(const std::string& cause, const std::string& kind = kSyncBatchNormError,
                  bool exiting = false, bool whole = true) {
  if (!exiting && g_remote_rank >= 0 && others_wait_locked())
    fatal_locked(message("worker_step_failed",
                         {{"rank", std::to_string(g_remote_rank)}, {"cause", cause}}));
  g_step->failed = true;
  if (whole) g_failed_below = g_token + 1;
  ++g_token;
  g_cause = cause;
  g_cause_kind = kind;
  retire_cpu_temp_space();  // what runs from now on takes slots the failed step's do not poison
  for (auto& layer : live_layers_locked()) {
    std::vector<std::pair<Key, std::shared_ptr<Meeting>>> failed;
    for (auto it = layer->meetings.begin(); it != layer->meetings.end();)
      if (current_locked(*it->second->step)) {
        ++it;
      } else {
        failed.emplace_back(*it);
        it = layer->meetings.erase(it);
      }
    for (auto& e : failed)
      if (!e.second->done && e.second->error.empty()) {
        e.second->error = in_layer(layer->name, cause);
        e.second->kind = kind;
        dispatch_locked(*layer, e.first, e.second);
      }
  }
}

// Abort the step from outside a meeting (a call that cannot take part,
// Python's failures): the other devices' calls fail at once.
void abort_step(const std::string& cause, bool exiting = false, bool whole = true) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    abort_locked(cause, kSyncBatchNormError, exiting, whole);
  }
  run_pending();
}

// Whether every layer has had as many calls issued on each device since its
// token began: where a new step may begin (lock held).
bool balanced_locked() {
  for (auto& layer : live_layers_locked())
    if (layer->issued_token == g_step->token)
      for (int64_t n : layer->issued)
        if (n != layer->issued[0]) return false;
  return true;
}

// Why a call of `layer`, whose sums leave the process, cannot run once
// synchronization across processes broke.
std::string broken_message(const Layer& layer) {
  return message("broken", {{"transport", layer.transport->name}, {"cause", g_broken}});
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

std::shared_ptr<Layer> find_layer(int64_t id, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_layers.find(id);
  if (it != g_layers.end()) return it->second;
  *error = message("unknown_layer", {{"layer", std::to_string(id)}});
  return nullptr;
}

// Adds the global statistics of a training call of `device` to the
// device's tally, if one is on.
void add_to_tally(Layer& layer, int device, const Info& stats) {
  if (!layer.tallying) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (layer.tallying) layer.tallies[device].add(stats);
}

// Numbers a forward call of `device`: sets its step (`step`: the one it got
// when it was issued; static graphs create their operators once, so there
// the one stamped before it, gsbn_stamp_static, or, where no stamp ran, a
// current one) and call number, or returns false with `error` set for a
// call of a step that failed.
bool number_call(Layer& layer, int device, bool static_graph, std::shared_ptr<Step>* step,
                 int64_t* call, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (static_graph) {
    *step = layer.stamped_step[device];
    if (!*step) step->reset(new Step{g_token, false});
  }
  if (!current_locked(**step)) {
    *error = stale_message(layer.name);
    return false;
  }
  if ((*step)->token != layer.numbered_token[device]) {
    layer.numbered_token[device] = (*step)->token;
    layer.next_call[device] = 0;
  }
  *call = layer.next_call[device]++;
  return true;
}

// False with `error` set if a backward call of `layer` whose forward was
// of `step` belongs to a step that failed since.
bool backward_current(const Layer& layer, const Step& step, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (current_locked(step)) return true;
  *error = stale_message(layer.name);
  return false;
}

}  // namespace
