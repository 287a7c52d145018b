// The exchange operator's small arrays (per-channel vectors, a few
// kilobytes) read and written from the host by the thread that needs them,
// waiting for nothing but the copies themselves: one batch of copies up and
// one down per call and direction, with no engine operation.
//
// On CPU contexts an array's memory is host memory: read and written in
// place. On GPUs, through the CUDA runtime's C API, found in the process
// (libcudart, which MXNet's GPU build loads; dlsym, so this library builds
// without CUDA): cudaMemcpyAsync between the array and pinned host staging on
// a stream of this library's own per device, created non-blocking, so it
// never waits for MXNet's streams or the legacy default stream, then one
// cudaStreamSynchronize per batch. That is the only reliance on CUDA.
//
// Why the data is there to copy: MXNet 1.9.1 completes a GPU operation only
// after the host has synchronized its stream (imperative_utils.h, PushFCompute
// and the static executor's segments; threaded_engine.h for bulked ones), and
// an operator runs only once the operations writing its inputs have
// completed. Why the copies down are seen: the call completes only after
// them, and the operations reading its outputs start only then.
#pragma once
#include <dlfcn.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mxnet_abi.h"
#include "sync_call.h"

namespace {

// The CUDA runtime's functions this file calls (cuda_runtime_api.h's
// signatures, with its enums as int and its handles as void*).
struct CudaRuntime {
  int (*get_device)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*stream_create_with_flags)(void**, unsigned) = nullptr;
  int (*memcpy_async)(void*, const void*, size_t, int, void*) = nullptr;
  int (*stream_synchronize)(void*) = nullptr;
  int (*malloc_host)(void**, size_t) = nullptr;
  int (*free_host)(void*) = nullptr;
  const char* (*get_error_string)(int) = nullptr;
  bool found() const {
    return get_device && set_device && stream_create_with_flags && memcpy_async &&
           stream_synchronize && malloc_host && free_host && get_error_string;
  }
};
const int kCudaMemcpyHostToDevice = 1, kCudaMemcpyDeviceToHost = 2;
const unsigned kCudaStreamNonBlocking = 1;

template <typename F> void resolve(F* f, const char* name) {
  *f = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

CudaRuntime& cuda_runtime() {
  static CudaRuntime* runtime = []() {
    auto* r = new CudaRuntime();
    resolve(&r->get_device, "cudaGetDevice");
    resolve(&r->set_device, "cudaSetDevice");
    resolve(&r->stream_create_with_flags, "cudaStreamCreateWithFlags");
    resolve(&r->memcpy_async, "cudaMemcpyAsync");
    resolve(&r->stream_synchronize, "cudaStreamSynchronize");
    resolve(&r->malloc_host, "cudaMallocHost");
    resolve(&r->free_host, "cudaFreeHost");
    resolve(&r->get_error_string, "cudaGetErrorString");
    return r;
  }();
  return *runtime;
}

// Tests only (tests/native_testing.h): CPU contexts copy through
// cuda_runtime() too, which the tests fill with host-memory stand-ins.
bool g_copy_host_memory = false;

// Pinned host memory, reused by the calls of one layer on one device: MXNet
// runs them one after another, each after the completion of the one before
// (their states share the layer's engine variable, sync_call.h), and a call
// uses its buffers only until it completes.
struct HostBuffer {
  void* data = nullptr;
  size_t bytes = 0;
};

// A call's arrays on one device as host Arrays (images): the arrays
// themselves on CPU contexts, else pinned staging that one batch of copies
// fills (read) or empties (write).
class DeviceCopies {
 public:
  // `staging`: one buffer per array slot, this layer's on this device, kept
  // by the caller; `device`: its name in messages ("gpu(1)").
  DeviceCopies(const mxnet::Context& ctx, const std::string& device,
               std::vector<HostBuffer>* staging)
      : through_cuda_(ctx.dev_type == mxnet::Context::kGPU || g_copy_host_memory),
        dev_id_(ctx.dev_id), device_(device), staging_(staging) {}

  bool through_cuda() const { return through_cuda_; }

  // Flat images of `arrays` in slots first_slot, first_slot + 1, ..., their
  // data not read; false with `error` if staging could not be had.
  bool images(const std::vector<mxnet::NDArray>& arrays, size_t first_slot,
              std::vector<Array>* host, std::string* error) {
    host->clear();
    for (size_t i = 0; i < arrays.size(); ++i) {
      Array h = array_of(arrays[i]);
      h.shape = {h.size()};
      if (through_cuda_ && !buffer(first_slot + i, bytes(h), &h.data, error)) return false;
      host->push_back(h);
    }
    return true;
  }

  // images(), with the arrays' data copied up.
  bool read(const std::vector<mxnet::NDArray>& arrays, size_t first_slot,
            std::vector<Array>* host, std::string* error) {
    if (!images(arrays, first_slot, host, error)) return false;
    if (!through_cuda_) return true;
    Batch batch(this);
    for (size_t i = 0; i < arrays.size(); ++i)
      if (!batch.copy((*host)[i].data, arrays[i].data().dptr_, bytes((*host)[i]),
                      kCudaMemcpyDeviceToHost, error))
        return false;
    return batch.wait(error);
  }

  // Each image in `host` copied down to its array (on CPU contexts the
  // images are the arrays: nothing to do).
  bool write(const std::vector<mxnet::NDArray>& arrays, const std::vector<Array>& host,
             std::string* error) {
    if (!through_cuda_) return true;
    Batch batch(this);
    for (size_t i = 0; i < arrays.size(); ++i)
      if (!batch.copy(arrays[i].data().dptr_, host[i].data, bytes(host[i]),
                      kCudaMemcpyHostToDevice, error))
        return false;
    return batch.wait(error);
  }

 private:
  static size_t bytes(const Array& a) {
    return static_cast<size_t>(a.size()) * mshadow::mshadow_sizeof(a.dtype);
  }

  bool buffer(size_t slot, size_t size, void** data, std::string* error) {
    if (staging_->size() <= slot) staging_->resize(slot + 1);
    HostBuffer& b = (*staging_)[slot];
    if (b.bytes < size) {
      void* p = nullptr;
      if (!runtime(error) ||
          !check(cuda_runtime().malloc_host(&p, size), "cudaMallocHost", error))
        return false;
      if (b.data != nullptr) cuda_runtime().free_host(b.data);
      b.data = p;
      b.bytes = size;
    }
    *data = b.data;
    return true;
  }

  bool runtime(std::string* error) const {
    if (cuda_runtime().found()) return true;
    *error = "on " + device_ + " the CUDA runtime's functions (cudaMemcpyAsync and others) "
             "were not found in this process, though MXNet runs on a GPU here";
    return false;
  }

  bool check(int status, const char* what, std::string* error) const {
    if (status == 0) return true;
    *error = std::string(what) + " on " + device_ + " failed: " +
             cuda_runtime().get_error_string(status);
    return false;
  }

  // One batch of copies on this library's stream of the device, with the
  // calling thread's current device set to it (restored at the end), and
  // one wait for them all.
  class Batch {
   public:
    explicit Batch(const DeviceCopies* owner) : owner_(owner) {
      if (!cuda_runtime().found()) return;
      if (cuda_runtime().get_device(&previous_) != 0) previous_ = -1;
      if (previous_ != owner_->dev_id_) cuda_runtime().set_device(owner_->dev_id_);
    }
    ~Batch() {
      if (previous_ >= 0 && previous_ != owner_->dev_id_) cuda_runtime().set_device(previous_);
    }
    bool copy(void* to, const void* from, size_t size, int kind, std::string* error) {
      if (!stream(error)) return false;
      return size == 0 || owner_->check(cuda_runtime().memcpy_async(to, from, size, kind,
                                                                    stream_),
                                        "cudaMemcpyAsync", error);
    }
    bool wait(std::string* error) {
      return stream_ == nullptr ||
             owner_->check(cuda_runtime().stream_synchronize(stream_), "cudaStreamSynchronize",
                           error);
    }

   private:
    // The device's stream, made at its first use there (on its device, the
    // current one now).
    bool stream(std::string* error) {
      if (stream_ != nullptr) return true;
      if (!owner_->runtime(error)) return false;
      static std::mutex& mutex = *new std::mutex();
      static auto& streams = *new std::map<int, void*>();
      std::lock_guard<std::mutex> lock(mutex);
      void*& made = streams[owner_->dev_id_];
      if (made == nullptr &&
          !owner_->check(cuda_runtime().stream_create_with_flags(&made, kCudaStreamNonBlocking),
                         "cudaStreamCreateWithFlags", error))
        return false;
      stream_ = made;
      return true;
    }

    const DeviceCopies* owner_;
    int previous_ = -1;
    void* stream_ = nullptr;
  };

  const bool through_cuda_;
  const int dev_id_;
  const std::string device_;
  std::vector<HostBuffer>* staging_;
};

}  // namespace
