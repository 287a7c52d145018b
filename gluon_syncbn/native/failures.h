// How failed operations complete, so that MXNet 1.9.1's engine survives them.
//
// The engine keeps failed operations' errors in one plain std::vector per
// process (threaded_engine.h, AddToGlobalExceptions), which waitall walks and
// clears: a failed operation appends its error from the thread that completes
// it, and every operation that starts on a failed array searches the list
// from its own thread, all without a lock. Two appends at once, or an append
// that outgrows the list and moves it under a search (which then misses, and
// appends too), corrupt it, and the next waitall crashes. An aborted step
// fails every device's calls at once, so:
//   * every failure of ours completes one at a time in the process
//     (fail_operation), on the thread that holds the lock;
//   * the list gets room before the first layer's first call
//     (reserve_engine_errors), so no append moves it;
//   * a failed call of the Python operator, a custom operator, is completed
//     by MXNet itself on its device's worker, with a new error of its own
//     (custom-inl.h, CustomOperatorWait): those completions are chained one
//     after another (fail_python_call).
#pragma once
#include <mxnet/c_api.h>
#include <mxnet/engine.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

// Completes an engine operation with `error`, one failure at a time.
void fail_operation(const mxnet::engine::CallbackOnComplete& on_complete,
                    const std::string& error) {
  static std::mutex* one_at_a_time = new std::mutex;  // never destroyed: used at exit
  std::lock_guard<std::mutex> lock(*one_at_a_time);
  dmlc::Error e(error);
  on_complete(&e);
}

void raise_on(void*, void* on_complete, void* message) {
  fail_operation(*static_cast<mxnet::engine::CallbackOnComplete*>(on_complete),
                 *static_cast<std::string*>(message));
}

const int kOnThisThread = static_cast<int>(mxnet::FnProperty::kAsync);  // inline if ready

// The list grows by doubling and keeps its room when waitall clears it:
// 2^k + 1 entries leave room for 2^k - 1 more errors before the next waitall
// and 2^(k+1) after it.
const int kReservedEngineErrors = 4097;

// Grows the list by `n` errors: `n` operations fail on fresh arrays, inline
// on this thread, and their errors are taken at once, which leaves entries
// that waitall skips and clears. Run before the first layer's first call
// (gsbn_init).
void reserve_engine_errors(int n) {
  static std::string why = "gluon_syncbn: making room in the engine's list of errors";
  const uint32_t shape[1] = {1};
  int ctx[2] = {1, 0};  // mxnet::Context{kCPU, 0}
  std::vector<NDArrayHandle> arrays;
  for (int i = 0; i < n; ++i) {
    NDArrayHandle a = nullptr;
    if (MXNDArrayCreateEx(shape, 1, 1, 0, 1, 0, &a) != 0) break;
    arrays.push_back(a);
    MXEnginePushAsyncND(raise_on, &why, nullptr, ctx, nullptr, 0, &a, 1, &kOnThisThread, 0,
                        "gluon_syncbn_reserve", false);
  }
  for (NDArrayHandle a : arrays) {
    MXNDArrayWaitToRead(a);  // takes the error: -1, as expected
    MXNDArrayFree(a);
  }
}

// --------------------------------------------- the Python operator's calls --
// A custom-operator callback that raises leaves its error in the
// custom-operator runtime's one process-wide slot (custom-inl.h,
// CustomOperator::exception_), which the next custom operator to complete
// takes, unlocked: calls failing together take each other's errors, some
// complete as if they had succeeded, and two writes can free the slot twice.
// But CustomOperatorWait, the engine operation that completes a custom call
// on its device's worker once every operation queued on the callback's arrays
// is done, rethrows any error on them (Engine::Throw), each call its own. So a
// failed callback returns success and leaves a held operation writing one of
// its arrays (`hold`): CustomOperatorWait waits for it. One thread completes
// the held operations in turn: it probes another array of the call (`probe`,
// which CustomOperatorWait reads) with an operation writing it, inline if it
// can run at once; run at once, CustomOperatorWait is not queued yet (it
// cannot have run: it waits for the held operation), so it probes again;
// held back, CustomOperatorWait is queued, so the held operation fails now,
// CustomOperatorWait completes the call with its error, and the probe runs
// after it, which lets the next failed call go.

struct HeldCall {
  NDArrayHandle hold = nullptr, probe = nullptr;  // our own handles on the call's arrays
  std::string message;
  std::mutex mutex;
  std::condition_variable cv;
  bool held = false;      // the held operation runs; on_complete is its completion
  bool probed = false;    // the last probe ran
  bool given_up = false;  // the chain moved on before the held operation ran
  mxnet::engine::CallbackOnComplete on_complete;
  ~HeldCall() {
    if (hold) MXNDArrayFree(hold);
    if (probe) MXNDArrayFree(probe);
  }
};
typedef std::shared_ptr<HeldCall> HeldCallPtr;

const auto kProbeInterval = std::chrono::microseconds(200);
// How long one call may keep the others waiting before they go unchained.
const auto kChainPatience = std::chrono::seconds(20);

std::mutex& g_chain_mutex = *new std::mutex();  // never destroyed: the chain's thread
std::condition_variable& g_chain_cv = *new std::condition_variable();
std::deque<HeldCallPtr>& g_chain = *new std::deque<HeldCallPtr>();
bool g_chain_started = false;

void delete_held(void* param) { delete static_cast<HeldCallPtr*>(param); }

void mark(HeldCall& call, bool* flag) {
  std::lock_guard<std::mutex> lock(call.mutex);
  *flag = true;
  call.cv.notify_all();
}

// The held operation: keeps its completion for the chain's thread (or fails
// at once if the chain has moved on).
void run_held(void*, void* on_complete, void* param) {
  HeldCall& call = **static_cast<HeldCallPtr*>(param);
  const auto& complete = *static_cast<mxnet::engine::CallbackOnComplete*>(on_complete);
  {
    std::lock_guard<std::mutex> lock(call.mutex);
    call.on_complete = complete;
    call.held = true;
    call.cv.notify_all();
    if (!call.given_up) return;
  }
  fail_operation(complete, call.message);
}

void run_probe(void*, void* on_complete, void* param) {
  HeldCall& call = **static_cast<HeldCallPtr*>(param);
  mark(call, &call.probed);
  (*static_cast<mxnet::engine::CallbackOnComplete*>(on_complete))();
}

// Pushes `fn` writing `array`, on cpu(0): inline if it can run at once.
bool push_writing(NDArrayHandle array, void (*fn)(void*, void*, void*), const HeldCallPtr& call,
                  const char* name) {
  int ctx[2] = {1, 0};
  return MXEnginePushAsyncND(fn, new HeldCallPtr(call), delete_held, ctx, nullptr, 0, &array, 1,
                             &kOnThisThread, 0, name, false) == 0;
}

bool wait_for(HeldCall& call, bool* flag, std::chrono::steady_clock::time_point until) {
  std::unique_lock<std::mutex> lock(call.mutex);
  return call.cv.wait_until(lock, until, [flag]() { return *flag; });
}

// Fails `call` once its CustomOperatorWait is queued, and returns once that
// has completed it (or the chain's patience ran out).
void settle(const HeldCallPtr& call) {
  const auto until = std::chrono::steady_clock::now() + kChainPatience;
  if (!wait_for(*call, &call->held, until)) {
    std::lock_guard<std::mutex> lock(call->mutex);
    if (!call->held) {
      call->given_up = true;  // it fails at once when it runs
      return;
    }
  }
  bool queued = false;  // CustomOperatorWait is, and a probe waits behind it
  while (!queued && std::chrono::steady_clock::now() < until) {
    {
      std::lock_guard<std::mutex> lock(call->mutex);
      call->probed = false;
    }
    if (!push_writing(call->probe, run_probe, call, "gluon_syncbn_probe")) break;
    {
      std::lock_guard<std::mutex> lock(call->mutex);
      queued = !call->probed;  // held back: CustomOperatorWait is queued
    }
    if (!queued) std::this_thread::sleep_for(kProbeInterval);
  }
  fail_operation(call->on_complete, call->message);
  if (queued) wait_for(*call, &call->probed, std::chrono::steady_clock::now() + kChainPatience);
}

void run_chain() {
  for (;;) {
    HeldCallPtr call;
    {
      std::unique_lock<std::mutex> lock(g_chain_mutex);
      g_chain_cv.wait(lock, []() { return !g_chain.empty(); });
      call = g_chain.front();
      g_chain.pop_front();
    }
    settle(call);
  }
}

// Our own handle on `array`'s memory and engine variable (a whole-array
// slice), alive until we free it; null where there is none.
NDArrayHandle own_handle(NDArrayHandle array) {
  int ndim = 0;
  const int64_t* dims = nullptr;
  NDArrayHandle own = nullptr;
  if (MXNDArrayGetShapeEx64(array, &ndim, &dims) != 0 || ndim < 1 || dims[0] < 1 ||
      MXNDArraySlice64(array, 0, dims[0], &own) != 0)
    return nullptr;
  return own;
}

// Fails the Python operator's call whose callback got `hold` and `probe` (two
// different arrays of it) with `message`, and that call alone, after the
// calls failed before it; the callback then returns success. 0 if queued.
int fail_python_call(NDArrayHandle hold, NDArrayHandle probe, const std::string& message) {
  auto call = std::make_shared<HeldCall>();
  call->message = message;
  call->hold = own_handle(hold);
  call->probe = own_handle(probe);
  if (!call->hold || !call->probe ||
      !push_writing(call->hold, run_held, call, "gluon_syncbn_failed_call"))
    return -1;
  std::lock_guard<std::mutex> lock(g_chain_mutex);
  if (!g_chain_started) {
    g_chain_started = true;
    std::thread(run_chain).detach();
  }
  g_chain.push_back(call);
  g_chain_cv.notify_all();
  return 0;
}

}  // namespace
