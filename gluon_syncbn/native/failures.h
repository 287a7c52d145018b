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
//     (reserve_engine_errors), so no append moves it.
// Each failure is raised in Python as the exception its text names first
// (failure_text).
#pragma once
#include <mxnet/c_api.h>
#include <mxnet/engine.h>

#include <mutex>
#include <string>
#include <vector>

namespace {

// The exceptions Python raises for our failed operations, by the names
// gluon_syncbn/errors.py registers them under with MXNet.
const char* const kSyncBatchNormError = "SyncBatchNormError";
const char* const kSyncBatchNormTimeout = "SyncBatchNormTimeout";

// What an operation of ours fails with: `message` after the name of the
// exception Python raises for it ("SyncBatchNormTimeout: SyncBatchNorm
// 'bn2': ..."). MXNet's C API takes what precedes the first ':' of an
// error's first line for its type (c_api_error.cc, NormalizeError), and its
// Python side raises the class registered under that name (base.py,
// get_last_ffi_error) wherever the error surfaces: asnumpy, wait_to_read,
// waitall, a later operation.
std::string failure_text(const std::string& message,
                         const std::string& kind = kSyncBatchNormError) {
  return kind + ": " + message;
}

// Raises `message` where MXNet runs our code as it issues a call (shape and
// type inference, an operator state's creation, a gradient's construction):
// MXNet's C API reads the log line's text after its header the same way.
void refuse(const std::string& message) { LOG(FATAL) << failure_text(message); }

// Completes an engine operation with `error` (failure_text's), one failure
// at a time.
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

}  // namespace
