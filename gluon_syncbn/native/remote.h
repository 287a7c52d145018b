// Across processes: the remote phase of a meeting and the workers' setup.
// The last device's combination goes to the other workers as wire.h's
// CHECKED vector through the layer's transport (transport.h): this worker's
// row (its check numbers and its vector, one block per sync group) among
// the others' zeros, then its ownership entries; the meeting completes with
// every worker's rows combined in rank order, the same on every worker. A
// failure here is fatal (session.h, fatal_locked).
#pragma once
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meeting.h"
#include "messages.h"
#include "session.h"
#include "transport.h"
#include "wire.h"

namespace {

// ----------------------------------------------------------- remote phase --

// The numbers of a worker's row for vectors of `size`: the check numbers,
// then each number of the vector as the transport carries it exactly.
size_t row_size(const Layer& layer, size_t size) {
  return kCheckRow + layer.num_sync_groups * size * layer.transport->numbers_per_value();
}

// This worker's check numbers for a reduction of vectors of `size`: the
// layer's width, the call's number and dtype, and the step token (as many
// abandoned steps as the others), compared; then `round`, the reduction's
// number on its key (wire.h, CHECKED); whole numbers below 2^24.
std::array<double, kCheckRow> own_checks(const Key& key, size_t size, const std::string& dtype,
                                         int64_t round) {
  return {static_cast<double>(std::get<0>(key) == 0 ? forward_channels(size)
                                                    : backward_channels(size)),
          modulo_2_20(static_cast<uint64_t>(std::get<2>(key))), dtype_code(dtype),
          modulo_2_20(std::get<1>(key)), modulo_2_20(static_cast<uint64_t>(round))};
}

std::string reduction_failed(const Layer& layer, const Key& key, const std::string& why) {
  return message("reduction_failed", {{"direction", direction_name(key)}, {"layer", layer.name},
                                      {"slot", std::to_string(layer.slot)},
                                      {"transport", layer.transport->name}, {"why", why}});
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
// `row` numbers; where the workers abandoned different numbers of steps,
// "worker 0: its call #3 of this layer, after 0 abandoned steps; ...".
std::string describe_checks(const double* rows, int workers, size_t row, bool tokens_differ) {
  std::string out;
  for (int r = 0; r < workers; ++r) {
    const double* checks = rows + r * row;
    out += (r ? "; worker " : "worker ") + std::to_string(r) + ": ";
    if (tokens_differ)
      out += "its call #" + number(checks[4]) + " of this layer, after " + number(checks[3]) +
             " abandoned step" + (checks[3] == 1 ? "" : "s");
    else
      out += number(checks[0]) + " channels, call #" + number(checks[1]) + ", " +
             dtype_of_code(checks[2]);
  }
  return out;
}

// Whether this worker found another's END row: then, where it fails, it
// sends END rows of its own, so that the worker that ended waits no longer.
std::atomic<bool> g_saw_end{false};

// Why worker `r`, which ended (`how`: kEndFinished or kEndFailed; `after`:
// what it did last), cannot take part where worker `rank` is now (`where`).
std::string end_message(int r, double how, const std::string& after, int rank,
                        const std::string& where) {
  g_saw_end = true;
  return message(how == kEndFailed ? "worker_failed" : "worker_ended",
                 {{"worker", std::to_string(r)}, {"after", after},
                  {"rank", std::to_string(rank)}, {"where", where}});
}

// Why worker `r` (whose END row is `checks`, wire.h) cannot take part in
// this worker's reduction `key` of `layer`, the `round`-th on its key.
std::string ended_message(const Layer& layer, const Key& key, int r, const double* checks,
                          int64_t round) {
  const std::string dir = direction_name(key);
  return end_message(r, checks[3], " after " + number(checks[4]) + " " + dir +
                                       " calls of this layer",
                     layer.transport->rank, "makes its " + dir + " call #" + std::to_string(round));
}

void complete_remote(const std::shared_ptr<Layer>& layer, const Key& key,
                     const std::shared_ptr<Meeting>& meeting, const std::string& error,
                     const std::vector<double>& total);

// Hands the meeting's combination to the transport once g_mutex is released,
// with a fresh deadline for the other workers (lock held).
std::string start_remote_locked(Layer& layer, const Key& key, const std::shared_ptr<Meeting>& meeting) {
  if (!g_broken.empty()) return broken_message(layer);
  if (layer.slot < 0)
    return message("no_slot", {{"layer", layer.name}, {"transport", layer.transport->name}});
  Transport& t = *layer.transport;
  const size_t size = meeting->values[0].size(), row = row_size(layer, size);
  const int numbers = t.numbers_per_value();
  std::vector<double> payload(t.workers * row + layer.ownership.size(), 0.0);
  double* own = &payload[t.rank * row];
  const auto checks = own_checks(key, size, meeting->dtypes[0],
                                 t.rounds(layer.slot, std::get<0>(key)) + 1);
  std::copy(checks.begin(), checks.end(), own);
  for (size_t i = 0; i < meeting->result.size(); ++i)
    encode_exact(meeting->result[i], numbers, own + kCheckRow + i * numbers);
  std::copy(layer.ownership.begin(), layer.ownership.end(), payload.end() - layer.ownership.size());
  meeting->remote = true;
  g_remote_in_step = true;
  meeting->deadline = deadline_in(layer.remote_timeout);
  if (meeting->deadline < g_watchdog_wake) g_watchdog_cv.notify_all();
  std::shared_ptr<Layer> self = layer.shared_from_this();
  std::shared_ptr<Transport> transport = layer.transport;
  const int slot = layer.slot, dir = std::get<0>(key);
  g_pending.emplace_back([self, transport, slot, dir, key, meeting, payload](
                             const std::string&, const std::vector<double>&) {
    transport->start(slot, dir, payload, [self, key, meeting](const std::string& error,
                                                         const std::vector<double>& total) {
      complete_remote(self, key, meeting, error, total);
    });
  }, "", std::vector<double>());
  return "";
}

// What is wrong with the workers' rows, or "" with meeting->result set to their
// vectors combined in rank order, per sync group (lock held). `total` has the
// payload's size: Transport::start refuses a payload of another size than its key.
std::string check_remote_locked(const Layer& layer, const Key& key, Meeting& meeting,
                                const std::vector<double>& total) {
  Transport& t = *layer.transport;
  const size_t size = meeting.values[0].size(), row = row_size(layer, size);
  const size_t vectors = layer.num_sync_groups * size, owners = layer.ownership.size();
  const auto own = own_checks(key, size, meeting.dtypes[0], 0);
  bool whole = true, missing = false, differ = false, tokens_differ = false;
  for (int r = 0; r < t.workers; ++r) {
    const double* checks = &total[r * row];
    whole = whole && whole_numbers(checks, kCheckRow);
    if (checks[2] == kEndDtype && r != t.rank)  // that worker ended
      return ended_message(layer, key, r, checks, t.rounds(layer.slot, std::get<0>(key)));
    missing = missing || checks[0] == 0;  // every worker's call has channels
    differ = differ || !std::equal(own.begin(), own.begin() + kCompared, checks);
    tokens_differ = tokens_differ || checks[3] != own[3];
  }
  if (!whole || !whole_numbers(&total[t.workers * row], owners))
    return message("sums_changed", {{"transport", t.name}, {"direction", direction_name(key)},
                                    {"layer", layer.name}, {"slot", std::to_string(layer.slot)}});
  if (missing)
    return reduction_failed(layer, key, "no sum came back (the engine reported an error on it)");
  if (differ)
    return message(tokens_differ ? "step_abandoned" : "out_of_step",
                   {{"layer", layer.name}, {"direction", direction_name(key)},
                    {"call", std::to_string(std::get<2>(key))},
                    {"slot", std::to_string(layer.slot)},
                    {"workers", describe_checks(total.data(), t.workers, row, tokens_differ)}});
  std::string clashes;
  for (size_t i = 0; i < owners; ++i)
    if (total[t.workers * row + i] != 1)
      clashes += (clashes.empty() ? "" : ", ") + std::to_string(i);
  if (!clashes.empty()) return message("numbering_disagrees", {{"layer", layer.name},
                                                               {"devices", clashes}});
  const int numbers = t.numbers_per_value();
  std::vector<double> vector(vectors);
  meeting.result.assign(vectors, 0.0);
  for (int r = 0; r < t.workers; ++r) {
    for (size_t i = 0; i < vectors; ++i)
      vector[i] = decode_exact(&total[r * row + kCheckRow + i * numbers], numbers);
    for (int s = 0; s < layer.num_sync_groups; ++s)
      combine(std::get<0>(key), &meeting.result[s * size], &vector[s * size], size);
  }
  return empty_batch(layer, key, meeting.result);
}

// The transport's answer: completes the meeting, or fails the step (and the
// process: fatal_locked). Ignored if the meeting failed meanwhile (its
// deadline, an abort).
void complete_remote(const std::shared_ptr<Layer>& layer, const Key& key,
                     const std::shared_ptr<Meeting>& meeting, const std::string& error,
                     const std::vector<double>& total) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (meeting->done || !meeting->error.empty()) return;
    const std::string failure = !error.empty() ? reduction_failed(*layer, key, error)
                                               : check_remote_locked(*layer, key, *meeting, total);
    if (!failure.empty()) {
      fatal_locked(failure);
      abort_locked(failure);
    } else {
      meeting->done = true;
      dispatch_locked(*layer, key, meeting);
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
            : row[0] == kEndKind   ? std::string("ending")
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

// Whether CONTROL rows `a` and `b` (wire.h) say the same: their kind, four
// fields, sync_groups' length and bytes; the names, which are for messages,
// aside (a digest of a name to compare is a field).
bool same_control(const double* a, const double* b) {
  return std::equal(a, a + 5, b) && a[6] == b[6] &&
         std::equal(a + kControlHead + kNameBytes, a + kControlRow, b + kControlHead + kNameBytes);
}

// Why the setup step `what` through `t` failed: the transport's `error`, or
// where there is none, that the other workers did not come within `timeout`
// seconds.
std::string setup_error(const Transport& t, const std::string& what, double timeout,
                        const std::string& error) {
  if (!error.empty())
    return "SyncBatchNorm could not " + what + " with the other workers through " + t.name +
           ": " + error;
  return message("setup_timeout", {{"rank", std::to_string(t.rank)},
                                   {"workers", std::to_string(t.workers)},
                                   {"timeout", number(timeout)}, {"what", what},
                                   {"transport", t.name}});
}

// Every worker's next CONTROL row, into `rows`, through `t` within `timeout`
// seconds; `what` (what this worker was to do) and `name` (the layer's, if
// any) are for messages. "" where every row is of `row`'s kind (and, for a
// batch, the same batch); else why not (the process's end started).
std::string gather_setup(const std::shared_ptr<Transport>& t, const std::vector<double>& row,
                         const std::string& what, const std::string& name, double timeout,
                         std::vector<double>* rows) {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_broken.empty()) return message("broken", {{"transport", t->name}, {"cause", g_broken}});
  }
  if (!t->gather_control(row, timeout, rows, &error))
    error = setup_error(*t, what, timeout, error);
  else if (!whole_numbers(rows->data(), rows->size()))
    error = message("sums_changed", {{"transport", t->name}, {"direction", "setup"},
                                     {"layer", name}, {"slot", "-"}});
  for (int r = 0; r < t->workers && error.empty(); ++r)
    if ((*rows)[r * kControlRow] == kEndKind)
      error = end_message(r, (*rows)[r * kControlRow + 1], "", t->rank, "was to " + what);
  for (int r = 0; r < t->workers && error.empty(); ++r) {
    const double* other = &(*rows)[r * kControlRow];
    if (other[0] != row[0] || (row[0] == kBatchKind && other[1] != row[1]))
      error = message("setup_out_of_step", {{"what", what},
                                            {"workers", describe_control(*rows, t->workers)}});
  }
  if (!error.empty()) setup_failed(t, error);
  return error;
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
  std::string error = gather_setup(t, row, what, name, timeout, &rows);
  for (int r = 0; r < t->workers && error.empty(); ++r)
    if (!same_control(row.data(), &rows[r * kControlRow])) {
      error = message("layers_differ", {{"layer", name}, {"number", std::to_string(place)},
                                        {"workers", describe_layers(rows, t->workers)}});
      setup_failed(t, error);
    }
  return error;
}

// When a layer that synchronizes across workers is made: every worker's
// layer made in its place must have the same sync groups (`groups`, as the
// user gave them; `devices`: the devices they number, where they are
// explicit, else 0) and the same name as the workers compare names
// (`matched`: transport.py's matched_name), before they are worked out.
// "" or why not.
std::string compare_layer(const std::shared_ptr<Transport>& t, const std::string& name,
                          const std::string& matched, int devices, const std::string& groups,
                          double timeout) {
  // One layer at a time, in the order they are made, the same on every
  // worker, from whichever thread makes it.
  static std::mutex& one_at_a_time = *new std::mutex();
  std::lock_guard<std::mutex> lock(one_at_a_time);
  const std::vector<double> row = pack_control(
      kLayerKind, {static_cast<double>(devices), digest24(groups), digest24(matched)}, name,
      groups);
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
  const std::string error = gather_setup(
      t, pack_control(kBatchKind, {static_cast<double>(batch), has ? 1.0 : 0.0}, "", ""), what,
      "", timeout, &rows);
  if (!error.empty()) return error;
  lacking->clear();
  for (int r = 0; r < t->workers; ++r)
    if (rows[r * kControlRow + 2] != 1) lacking->push_back(r);
  return "";
}

// At the first call of layer `layer`, whose sums leave the process, with
// `channels` channels of `dtype` (from whichever thread calls first: the
// operators' FCreateOpState): after checking that every worker's next layer
// to make its keys has the same, its keys in the transport, within its
// remote timeout. False with `error` set (and the process's end started)
// if that failed.
bool attach_remote(Layer& layer, int64_t channels, const std::string& dtype, std::string* error) {
  // Set before the layer's first call and never changed: every imperative
  // call's state creation passes here, so a layer of one process takes no lock.
  if (!layer.transport) return true;
  // One layer at a time, each once, even when the devices' threads create
  // their states at once (one Python thread per device): keys are made in
  // the order of the layers' first calls, identically on every worker.
  static std::mutex& attaching = *new std::mutex();
  std::lock_guard<std::mutex> one_at_a_time(attaching);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (layer.slot >= 0 || channels <= 0) return true;
  }
  std::shared_ptr<Transport> t = layer.transport;
  const std::vector<double> row =
      pack_control(kKeysKind, {static_cast<double>(channels), dtype_code(dtype)}, layer.name, "");
  *error = agree_on_layer(t, row, t->num_slots() + 1, layer.name, layer.remote_timeout);
  if (!error->empty()) return false;
  const size_t rows[2] = {row_size(layer, 1 + 2 * channels), row_size(layer, 2 * channels)};
  int slot = -1;
  if (!t->add_slot(rows, layer.ownership.size(), layer.remote_timeout, &slot, error)) {
    *error = setup_error(*t, "make the keys of layer '" + layer.name + "'", layer.remote_timeout,
                         *error);
    return setup_failed(t, *error);
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  layer.slot = slot;
  g_remote_rank = t->rank;
  return true;
}

}  // namespace

// -------------------------------------------------------------------- end --
// A worker that ends tells the others on every key they could wait on: an
// END row (wire.h) on each idle key of its transport, its script finished
// (kEndFinished, once its last step is done) or failed (kEndFailed). A
// worker still calling finds that row among the rows of its next reduction,
// wherever it waits, and fails naming this one (ended_message); once every
// worker ended, each key's END round completes.

// What worker `r`'s row of a finished END round on key `k` says, if it is
// not an END of a finished script: "" or why this worker cannot end cleanly.
std::string seen_at_end(const Transport::KeyState& k, const double* row, int r) {
  const std::string worker = "worker " + std::to_string(r);
  if (k.slot == kControlSlot)
    return row[0] != kEndKind ? worker + " was still setting up layers"
           : row[1] == kEndFailed ? worker + " failed" : "";
  if (row[2] == kEndDtype) return row[3] == kEndFailed ? worker + " failed" : "";
  return worker + " still made training calls (its " + (k.dir ? "bwd" : "fwd") + " call #" +
         number(row[4]) + " of the layer in slot " + std::to_string(k.slot) + ")";
}

// Sends this worker's END rows through `t` (`how`: kEndFinished or
// kEndFailed) and waits at most `timeout` seconds for their rounds. ""
// where every other worker ended its script too; else what the others did
// instead, or, with `late` set, that they did not end in time. A failing
// worker sends none unless another worker ended first and waits for it:
// elsewhere the launcher ends the job, naming the worker that failed first.
std::string end_remote(const std::shared_ptr<Transport>& t, int how, double timeout,
                       bool* late) {
  *late = false;
  if (how == kEndFailed && !g_saw_end) return "";
  struct Rounds {
    std::mutex mutex;
    std::condition_variable cv;
    size_t left = 0;
    std::string seen;
  };
  auto rounds = std::make_shared<Rounds>();
  std::vector<Transport::KeyState> idle;
  if (!t->closed())
    for (const auto& k : t->keys())
      if (!k.busy) idle.push_back(k);
  rounds->left = idle.size();
  for (const auto& k : idle) {
    std::vector<double> payload(k.size, 0.0);
    double* own = &payload[t->rank * k.row];
    if (k.slot == kControlSlot) {
      const auto row = pack_control(kEndKind, {static_cast<double>(how)}, "", "");
      std::copy(row.begin(), row.end(), own);
    } else {
      own[2] = kEndDtype;
      own[3] = how;
      own[4] = modulo_2_20(static_cast<uint64_t>(k.rounds));
    }
    t->start(k.slot, k.dir, payload, [rounds, t, k](const std::string& error,
                                                     const std::vector<double>& total) {
      std::string seen = error.empty() ? "" : "a reduction failed (" + error + ")";
      for (int r = 0; r < t->workers && seen.empty(); ++r)
        if (r != t->rank) seen = seen_at_end(k, &total[r * k.row], r);
      std::lock_guard<std::mutex> lock(rounds->mutex);
      if (rounds->seen.empty()) rounds->seen = seen;
      --rounds->left;
      rounds->cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(rounds->mutex);
  *late = !rounds->cv.wait_for(lock, std::chrono::duration<double>(timeout),
                               [&rounds]() { return rounds->left == 0 || !rounds->seen.empty(); });
  return *late ? "the other workers did not end within " + number(timeout) + "s" : rounds->seen;
}
