// How a process's per-layer vectors reach the other worker processes: the
// remote phase of an exchange, as a chain of engine operations on one
// persistent buffer per layer and direction (a "key"):
//
//   write the payload into the buffer (the key is idle: see start)
//     -> the engine's all-reduce of the buffer in place
//        (MXKVStorePushPull, or Horovod's allreduce_async: both only push
//         engine operations)
//     -> an engine operation reading the buffer hands the sum to `done`.
//
// No thread waits for the network; the session's watchdog bounds the wait.
// This file knows nothing of layers or checks: session.h builds the payload
// and checks the sum. A key holds float64 numbers where the engine sums them
// in float64 (Horovod), float32 ones where it may sum in float32 (MXNet
// 1.9.1's kvstore server: see wire.h, encode_exact). Included once, by
// syncbn.cc, before session.h.
#pragma once
#include <mxnet/c_api.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "arrays.h"
#include "failures.h"
#include "messages.h"
#include "wire.h"

namespace {

// The sum of the workers' payloads, or the error that stopped it.
typedef std::function<void(const std::string& error, const std::vector<double>& total)>
    RemoteDone;

const int kCPUPrioritized = 3, kNoSkip = 7;  // mxnet::FnProperty

std::string last_mxnet_error() {
  const char* e = MXGetLastError();
  return e ? e : "unknown MXNet error";
}

// One key's persistent buffer, of float64 or float32 numbers. The engine
// orders every operation on it; our own writes happen only while the key
// is idle.
struct Buffer {
  NDArrayHandle array = nullptr;
  void* data = nullptr;
  size_t size = 0;
  size_t row = 0;  // the numbers each worker fills, in rank order, before the rest
  bool float32 = false;

  void write(const std::vector<double>& numbers) const {
    if (!float32) return (void)std::memcpy(data, numbers.data(), size * sizeof(double));
    float* f = static_cast<float*>(data);
    for (size_t i = 0; i < size; ++i) f[i] = static_cast<float>(numbers[i]);
  }
  std::vector<double> read() const {
    if (!float32) {
      const double* d = static_cast<const double*>(data);
      return std::vector<double>(d, d + size);
    }
    const float* f = static_cast<const float*>(data);
    return std::vector<double>(f, f + size);
  }
};

struct Reduction {  // what the reading operation needs
  Buffer buffer;
  RemoteDone done;
};

void read_buffer(void*, void* param) {
  auto* r = static_cast<Reduction*>(param);
  r->done("", r->buffer.read());
}
void delete_reduction(void* param) { delete static_cast<Reduction*>(param); }

// The slot of the control key (wire.h, CONTROL): one key for what the
// workers agree on outside a layer's calls.
const int kControlSlot = -1;

// What another thread hands over once (an error, or numbers), waited for
// at most a while.
class Awaited {
 public:
  void deliver(const std::string& error, const std::vector<double>& numbers = {}) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = error;
    numbers_ = numbers;
    cv_.notify_all();
  }
  // False if nothing came within `seconds`; else `error` and `numbers` set.
  bool wait(double seconds, std::string* error, std::vector<double>* numbers = nullptr) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this]() { return done_; }))
      return false;
    *error = error_;
    if (numbers) *numbers = numbers_;
    return true;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  std::vector<double> numbers_;
};

// Runs `work`, which may block in a collective of the engine, on a thread of
// its own and waits at most `timeout` seconds for it; false with `error` set
// if it failed or still runs then (nothing can cancel it: it is left to end
// by itself, or with the process), and then `late` too where given.
bool bounded(std::function<bool(std::string*)> work, double timeout, const std::string& what,
             std::string* error, bool* late = nullptr) {
  auto outcome = std::make_shared<Awaited>();
  std::thread([outcome, work]() {
    std::string e;
    outcome->deliver(work(&e) ? "" : e.empty() ? "failed" : e);
  }).detach();
  if (!outcome->wait(timeout, error)) {
    *error = what + " did not end within " + number(timeout) + "s";
    if (late) *late = true;
    return false;
  }
  return error->empty();
}

// -------------------------------------------------------------- transport --
class Transport {
 public:
  std::string name;  // for messages: "kvstore 'dist_sync'", "horovod"
  int rank = 0, workers = 1;

  virtual ~Transport() {}

  // Creates the buffers of a new slot, one per direction, of `rows[dir]`
  // numbers per worker then `extra` more (wire.h's CHECKED), and what the
  // engine needs of them, within `timeout` seconds. Main thread, in network
  // order, the same on every worker: initializing a kvstore key is collective.
  bool add_slot(const size_t rows[2], size_t extra, double timeout, int* slot,
                std::string* error) {
    std::array<KeyRecord, 2> keys;
    for (int dir = 0; dir < 2; ++dir)
      if (!make_buffer(rows[dir], extra, &keys[dir].buffer, error)) return false;
    {
      std::lock_guard<std::mutex> lock(slots_mutex_);
      *slot = static_cast<int>(slots_.size());
    }
    for (int dir = 0; dir < 2; ++dir)
      if (!init_bounded(*slot, dir, keys[dir].buffer, timeout, error)) return false;
    std::lock_guard<std::mutex> lock(slots_mutex_);
    slots_.push_back(keys);  // never freed, like the session's state
    return true;
  }

  // Every worker's CONTROL `row` (wire.h) in rank order, through the control
  // key, within `timeout` seconds; false with `error` set if that failed
  // (empty: a worker did not come). The k-th calls of the workers belong
  // together.
  bool gather_control(const std::vector<double>& row, double timeout,
                      std::vector<double>* rows, std::string* error) {
    if (control_.buffer.array == nullptr) {
      Buffer b;
      bool late = false;
      if (!make_buffer(kControlRow, 0, &b, error)) return false;
      if (!init_bounded(kControlSlot, 0, b, timeout, error, &late)) {
        if (late) error->clear();  // initializing the key waits for every worker
        return false;
      }
      std::lock_guard<std::mutex> lock(slots_mutex_);
      control_.buffer = b;
    }
    std::vector<double> payload(control_.buffer.size, 0.0);
    std::copy(row.begin(), row.end(), payload.begin() + rank * kControlRow);
    auto gathered = std::make_shared<Awaited>();
    start(kControlSlot, 0, payload,
          [gathered](const std::string& e, const std::vector<double>& total) {
      gathered->deliver(e, total);
    });
    if (!gathered->wait(timeout, error, rows)) {
      *error = "";  // the caller names what did not come
      return false;
    }
    return error->empty();
  }

  // Sums `payload` over the workers into `done`, through slot `slot`'s buffer
  // of direction `dir` (0 forward, 1 backward). The key must be idle: its
  // previous reduction's `done` has run (the engine serializes a layer's
  // calls on each device, and a call completes only after its exchange).
  void start(int slot, int dir, const std::vector<double>& payload, RemoteDone done) {
    Buffer b;
    {
      std::lock_guard<std::mutex> lock(slots_mutex_);
      KeyRecord& k = key_locked(slot, dir);
      b = k.buffer;
      if (payload.size() == b.size) {
        ++k.rounds;
        k.busy = true;
      }
    }
    if (payload.size() != b.size)
      return done(name + " got " + std::to_string(payload.size()) + " numbers for a key of " +
                  std::to_string(b.size), {});
    b.write(payload);
    // Idle again once its sum (or error) is handed on.
    auto* r = new Reduction{b, [this, slot, dir, done](const std::string& error,
                                                      const std::vector<double>& total) {
      {
        std::lock_guard<std::mutex> lock(slots_mutex_);
        key_locked(slot, dir).busy = false;
      }
      done(error, total);
    }};
    reduce(slot, dir, b, [r, this]() {
      NDArrayHandle array = r->buffer.array;
      if (MXEnginePushSyncND(read_buffer, r, delete_reduction, kCPU0, &array, 1, nullptr, 0,
                             &read_property_, 0, "gluon_syncbn_remote_sum") != 0) {
        r->done(last_mxnet_error(), {});
        delete_reduction(r);
      }
    }, [r](const std::string& error) {
      r->done(error, {});
      delete_reduction(r);
    });
  }

  // A key as end_remote (remote.h) sees it: where it is, its numbers per
  // worker's row and in all, how many reductions this worker started on
  // it, and whether one is in flight now.
  struct KeyState {
    int slot, dir;
    size_t row, size;
    int64_t rounds;
    bool busy;
  };

  // Every key made so far, the control key first.
  std::vector<KeyState> keys() {
    std::lock_guard<std::mutex> lock(slots_mutex_);
    std::vector<KeyState> out;
    auto add = [&out](int slot, int dir, const KeyRecord& k) {
      out.push_back(KeyState{slot, dir, k.buffer.row, k.buffer.size, k.rounds, k.busy});
    };
    if (control_.buffer.array != nullptr) add(kControlSlot, 0, control_);
    for (size_t slot = 0; slot < slots_.size(); ++slot)
      for (int dir = 0; dir < 2; ++dir) add(static_cast<int>(slot), dir, slots_[slot][dir]);
    return out;
  }

  // How many reductions this worker started on slot `slot`'s key of
  // direction `dir`: the layer's calls in that direction so far.
  int64_t rounds(int slot, int dir) {
    std::lock_guard<std::mutex> lock(slots_mutex_);
    return key_locked(slot, dir).rounds;
  }

  // How many slots there are: the layers whose keys were made.
  int num_slots() {
    std::lock_guard<std::mutex> lock(slots_mutex_);
    return static_cast<int>(slots_.size());
  }

  // How many layers were made to synchronize across workers (some of them
  // need no keys: their sync groups lie within each worker).
  int num_layers() {
    std::lock_guard<std::mutex> lock(slots_mutex_);
    return layers_;
  }
  void count_layer() {
    std::lock_guard<std::mutex> lock(slots_mutex_);
    ++layers_;
  }

  // How many numbers carry one float64 exactly (wire.h, encode_exact).
  int numbers_per_value() const { return float32_keys_ ? 4 : 1; }

  // The store was destroyed: every later reduction fails with `why`.
  virtual void close(const std::string& why) {}
  virtual bool closed() { return false; }

  // Why the engine's own processes cannot answer (a kvstore's scheduler
  // gone), or "": for the messages of a wait that timed out, and a worker's
  // exit (watch_exit).
  virtual std::string helpers_gone() { return ""; }

 protected:
  static int kCPU0[2];
  // How the operation reading the sum runs: engines that report errors on
  // the buffer (Horovod) need it to run anyway (kNoSkip), to see them.
  int read_property_ = kCPUPrioritized;
  // Whether the keys hold float32 numbers (see the file's head).
  bool float32_keys_ = false;

  virtual bool init_key(int slot, int dir, NDArrayHandle buffer, std::string* error) {
    return true;
  }
  // Pushes the reduction of `buffer` in place, then calls `then` (which
  // pushes the reading operation after it); or calls `failed`.
  virtual void reduce(int slot, int dir, const Buffer& buffer, std::function<void()> then,
                      std::function<void(const std::string&)> failed) = 0;

 private:
  // A key: its buffer, the reductions this worker started on it, and
  // whether one is in flight.
  struct KeyRecord {
    Buffer buffer;
    int64_t rounds = 0;
    bool busy = false;
  };
  std::mutex slots_mutex_;  // add_slot (main thread) against start (engine threads)
  std::vector<std::array<KeyRecord, 2>> slots_;
  int layers_ = 0;
  KeyRecord control_;  // the control key (kControlSlot): made at the first layer's first call

  KeyRecord& key_locked(int slot, int dir) {
    return slot == kControlSlot ? control_ : slots_.at(slot)[dir];
  }

  bool make_buffer(size_t row, size_t extra, Buffer* b, std::string* error) {
    const size_t size = workers * row + extra;
    b->size = size;
    b->row = row;
    b->float32 = float32_keys_;
    const uint32_t shape[1] = {static_cast<uint32_t>(size)};
    const std::vector<double> zeros(size, 0.0);
    const std::vector<float> zeros32(size, 0.0f);
    void* data = nullptr;
    if (MXNDArrayCreateEx(shape, 1, 1, 0, 0, b->float32 ? kFloat32 : kFloat64, &b->array) != 0 ||
        MXNDArraySyncCopyFromCPU(b->array, b->float32 ? static_cast<const void*>(zeros32.data())
                                                      : zeros.data(), size) != 0 ||
        MXNDArrayGetData(b->array, &data) != 0) {
      *error = last_mxnet_error();
      return false;
    }
    b->data = data;
    return true;
  }

  // init_key, which waits for the other workers, within `timeout` seconds.
  bool init_bounded(int slot, int dir, const Buffer& b, double timeout, std::string* error,
                    bool* late = nullptr) {
    NDArrayHandle array = b.array;
    return bounded([this, slot, dir, array](std::string* e) {
      return init_key(slot, dir, array, e);
    }, timeout, "initializing the key (every worker takes part)", error, late);
  }
};
int Transport::kCPU0[2] = {1, 0};

// ---------------------------------------------------------------- kvstore --
// MXNet's front end to a kvstore is not thread-safe (unguarded maps per key),
// so every call on the store, ours and the Trainer's (through Python's
// wrappers, transport.py), holds the store's lock. An engine thread never
// waits for it: if the lock is held, its work is queued and the holder runs
// the queue before letting go. Waiting there could deadlock: the main thread
// holds the lock while a collective init waits for an operation on cpu(0)'s
// worker.
class StoreLock {
 public:
  void acquire() {  // may wait: not on an engine thread
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this]() { return !held_; });
    held_ = true;
  }
  void release() {  // runs what was queued meanwhile, then lets go
    for (;;) {
      std::function<void()> work;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (queue_.empty()) {
          held_ = false;
          cv_.notify_one();
          return;
        }
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }
  int64_t queued() {  // how often work was left to the holder
    std::lock_guard<std::mutex> lock(mutex_);
    return queued_;
  }
  void run_or_queue(std::function<void()> work) {  // never waits
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_) {
        queue_.push_back(std::move(work));
        ++queued_;
        return;
      }
      held_ = true;
    }
    work();
    release();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool held_ = false;
  std::deque<std::function<void()>> queue_;
  int64_t queued_ = 0;
};

const int kKeyBase = 1 << 30;  // above any key a Trainer uses (0 .. parameters - 1)

// A slot's kvstore key in direction `dir`, as transport.py numbers them.
int store_key(int slot, int dir) { return kKeyBase + 2 * slot + dir; }

class KVStoreTransport : public Transport {
 public:
  StoreLock lock;

  KVStoreTransport(void* handle, int rank_, int workers_, const std::string& name_)
      : handle_(handle) {
    rank = rank_;
    workers = workers_;
    name = name_;
    float32_keys_ = true;  // its server may sum float64 keys in float32
  }

  // From a finalizer, which may run inside a wrapped store call on the thread
  // holding `lock`: so not under it.
  void close(const std::string& why) override {
    std::lock_guard<std::mutex> guard(closed_mutex_);
    closed_ = why;
  }
  bool closed() override { return !closed_reason().empty(); }

  // ps-lite's scheduler is where the workers' and servers' barriers meet
  // (the store's final one at exit among them): a worker whose scheduler is
  // gone would wait there for ever. It listens at DMLC_PS_ROOT_URI:PORT.
  std::string helpers_gone() override {
    const char* host = std::getenv("DMLC_PS_ROOT_URI");
    const char* port = std::getenv("DMLC_PS_ROOT_PORT");
    if (!host || !port || answers(host, port)) return "";
    return std::string("the kvstore's scheduler at ") + host + ":" + port + " does not answer";
  }

 protected:
  // MXKVStoreInit: rank 0 pushes the zeros and waits, then ps-lite's barrier.
  bool init_key(int slot, int dir, NDArrayHandle buffer, std::string* error) override {
    const int key = store_key(slot, dir);
    const std::string closed = closed_reason();
    if (!closed.empty()) {
      *error = closed;
      return false;
    }
    lock.acquire();
    const int rc = MXKVStoreInit(handle_, 1, &key, &buffer);
    if (rc != 0) *error = explain(last_mxnet_error());
    lock.release();
    return rc == 0;
  }

  void reduce(int slot, int dir, const Buffer& buffer, std::function<void()> then,
              std::function<void(const std::string&)> failed) override {
    const int key = store_key(slot, dir);
    NDArrayHandle array = buffer.array;
    lock.run_or_queue([this, key, array, then, failed]() {
      NDArrayHandle b = array;
      const std::string closed = closed_reason();
      if (!closed.empty()) return failed(closed);
      if (MXKVStorePushPull(handle_, 1, &key, 1, &key, &b, &b, 0) != 0)
        return failed(explain(last_mxnet_error()));
      then();
    });
  }

 private:
  // MXNet's error, with the fix where it is a known conflict: gradient
  // compression applies to every key of a dist kvstore and refuses pushpull.
  std::string explain(const std::string& error) {
    if (error.find("ompression") == std::string::npos) return error;
    return message("compression", {{"transport", name}}) + " (MXNet: " +
           error.substr(0, error.find('\n')) + ")";
  }

  // Whether a TCP connection to host:port is accepted within a second.
  static bool answers(const char* host, const char* port) {
    addrinfo hints{}, *found = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &found) != 0) return true;  // cannot tell
    bool ok = false;
    for (addrinfo* a = found; a && !ok; a = a->ai_next) {
      const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
      if (fd < 0) continue;
      timeval limit{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
      ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      ::close(fd);
    }
    freeaddrinfo(found);
    return ok;
  }

  std::string closed_reason() {
    std::lock_guard<std::mutex> guard(closed_mutex_);
    return closed_;
  }
  void* handle_;
  std::mutex closed_mutex_;
  std::string closed_;
};

// ---------------------------------------------------------------- horovod --
// horovod/mxnet/mpi_ops.cc (0.28): pushes an engine operation that hands the
// tensor to Horovod's background thread; failures land on the buffer.
typedef int (*HorovodAllreduce)(NDArrayHandle const* in, NDArrayHandle const* out,
                                const char* name, int reduce_op, int priority, double prescale,
                                double postscale, int num_tensors, int process_set_id);

class HorovodTransport : public Transport {
 public:
  HorovodTransport(void* allreduce, int sum_op, int rank_, int workers_)
      : allreduce_(reinterpret_cast<HorovodAllreduce>(allreduce)), sum_op_(sum_op) {
    rank = rank_;
    workers = workers_;
    name = "horovod";
    read_property_ = kNoSkip;
  }

 protected:
  void reduce(int slot, int dir, const Buffer& buffer, std::function<void()> then,
              std::function<void(const std::string&)> failed) override {
    // Names must match across workers and never be in flight twice: one per key.
    const std::string key = slot == kControlSlot ? std::string("gluon_syncbn.control")
                            : "gluon_syncbn." + std::to_string(slot) + (dir ? ".bwd" : ".fwd");
    NDArrayHandle array = buffer.array;
    if (allreduce_(&array, &array, key.c_str(), sum_op_, 0, 1.0, 1.0, 1, 0) != 0)
      return failed(last_mxnet_error());
    then();
  }

 private:
  HorovodAllreduce allreduce_;
  int sum_op_;
};

// ------------------------------------------------------------- registry --
// Transports by id, for Python; never destroyed (engine operations and the
// watchdog may use them while the process exits).
std::mutex& g_transport_mutex = *new std::mutex();
std::map<int, std::shared_ptr<Transport>>& g_transports =
    *new std::map<int, std::shared_ptr<Transport>>();

int add_transport(std::shared_ptr<Transport> t) {
  std::lock_guard<std::mutex> lock(g_transport_mutex);
  const int id = static_cast<int>(g_transports.size()) + 1;
  g_transports[id] = std::move(t);
  return id;
}

std::shared_ptr<Transport> find_transport(int id) {
  std::lock_guard<std::mutex> lock(g_transport_mutex);
  auto it = g_transports.find(id);
  return it == g_transports.end() ? nullptr : it->second;
}

std::shared_ptr<KVStoreTransport> find_kvstore(int id) {
  return std::dynamic_pointer_cast<KVStoreTransport>(find_transport(id));
}

}  // namespace
