// The tests' entry points, compiled into the library only for the suite:
// tests/conftest.py sets GLUON_SYNCBN_TESTING to this file's path, and the
// build includes it at the end of syncbn.cc (-DGSBN_TESTING, see
// gluon_syncbn/native/__init__.py). Declared for Python in
// tests/native_testing.py.

#include <cstdlib>

namespace {

// For tests: `workers` workers of which the others send what `mode` says, as
// an engine operation on the buffer like a real engine's:
//   "same"     the others send this worker's payload: every worker's row is
//              this one's (and the ownership this one's, workers times)
//   "call"     ... with the call number one ahead (workers out of step)
//   "channels" ... describing each layer with 2 channels more (kKeysKind rows)
//   "float32"  ... through float32 keys, every number rounded to float32 as it
//              is summed (MXNet 1.9.1's kvstore server)
//   "scale"    the sum comes back scaled by 0.45 (an optimizer on the server)
//   "never"    a layer's reduction never completes
//   "fail"     a layer's reduction fails on the buffer (as Horovod reports errors)
class LoopbackTransport : public Transport {
 public:
  LoopbackTransport(int workers_, const std::string& mode) : mode_(mode) {
    workers = workers_;
    name = "loopback";
    read_property_ = kNoSkip;
    float32_keys_ = mode == "float32";
  }

 protected:
  struct Job {
    LoopbackTransport* self;
    Buffer buffer;
    size_t row;  // the numbers each worker fills in its own row (wire.h)
    bool control;
  };
  // The other workers' rows are copies of this one's (row 0); the rest of
  // the sum is this worker's W times, as if every worker had sent its payload.
  static void run(void*, void* on_complete, void* param) {
    auto* job = static_cast<Job*>(param);
    std::vector<double> v = job->buffer.read();
    const size_t size = job->buffer.size, row = job->row;
    const std::string& mode = job->self->mode_;
    const auto& complete = *static_cast<mxnet::engine::CallbackOnComplete*>(on_complete);
    if (mode == "fail" && !job->control)
      return fail_operation(complete, "loopback: the reduction failed");
    const int w = job->self->workers;
    for (int r = 1; r < w; ++r) std::copy(v.begin(), v.begin() + row, v.begin() + r * row);
    for (size_t i = w * row; i < size; ++i) v[i] *= w;
    if (mode == "float32")
      for (double& x : v) x = static_cast<float>(x);
    if (mode == "call" && !job->control)
      for (int r = 1; r < w; ++r) v[r * row + 1] += 1;
    if (mode == "channels" && job->control && v[0] == kKeysKind)
      for (int r = 1; r < w; ++r) v[r * row + 1] += 2;
    if (mode == "scale")
      for (double& x : v) x *= 0.45;
    job->buffer.write(v);
    complete();
  }
  static void delete_job(void* param) { delete static_cast<Job*>(param); }

  void reduce(int slot, int, const Buffer& buffer, std::function<void()> then,
              std::function<void(const std::string&)> failed) override {
    const bool control = slot == kControlSlot;
    if (mode_ == "never" && !control) return;
    NDArrayHandle array = buffer.array;
    if (MXEnginePushAsyncND(run, new Job{this, buffer, buffer.row, control}, delete_job, kCPU0,
                            nullptr, 0, &array, 1, nullptr, 0, "gluon_syncbn_loopback",
                            false) != 0)
      return failed(last_mxnet_error());
    then();
  }

 private:
  std::string mode_;
};

}  // namespace

// A stand-in for the CUDA runtime's functions device_copies.h calls, in
// host memory, counting what it is asked to do: with it, CPU contexts copy
// as GPUs do (GLUON_SYNCBN_DEVICE_PATH=1 on the exchange operator). Each
// function checks what the real one would refuse.
std::atomic<int64_t> g_cuda_calls[5];  // copies up, copies down, waits, streams, failures
std::atomic<int64_t> g_cuda_fail_at{-1};  // the copy that fails (counted from 0), -1: none
thread_local int t_cuda_device = 0;

int cuda_get_device(int* device) { *device = t_cuda_device; return 0; }
int cuda_set_device(int device) { t_cuda_device = device; return 0; }
int cuda_stream_create(void** stream, unsigned flags) {
  ++g_cuda_calls[3];
  *stream = new int(t_cuda_device);  // a stream knows its device
  return flags == kCudaStreamNonBlocking ? 0 : 1;
}
int cuda_memcpy_async(void* to, const void* from, size_t bytes, int kind, void* stream) {
  const int64_t copy = g_cuda_calls[0] + g_cuda_calls[1] + g_cuda_calls[4];
  const bool known_kind = kind == kCudaMemcpyDeviceToHost || kind == kCudaMemcpyHostToDevice;
  if (copy == g_cuda_fail_at || !known_kind || *static_cast<int*>(stream) != t_cuda_device) {
    ++g_cuda_calls[4];
    return 700;  // cudaErrorIllegalAddress
  }
  std::memcpy(to, from, bytes);
  ++g_cuda_calls[kind == kCudaMemcpyDeviceToHost ? 0 : 1];
  return 0;
}
int cuda_stream_synchronize(void*) { ++g_cuda_calls[2]; return 0; }
int cuda_malloc_host(void** p, size_t bytes) { *p = std::malloc(bytes); return *p ? 0 : 2; }
int cuda_free_host(void* p) { std::free(p); return 0; }
const char* cuda_error_string(int status) {
  return status == 700 ? "an illegal memory access was encountered (stand-in)" : "stand-in error";
}

extern "C" {

// The exchange operator's copies on CPU contexts go through the stand-in
// above from now on.
void gsbn_test_cuda_stand_in() {
  CudaRuntime& r = cuda_runtime();
  r.get_device = cuda_get_device;
  r.set_device = cuda_set_device;
  r.stream_create_with_flags = cuda_stream_create;
  r.memcpy_async = cuda_memcpy_async;
  r.stream_synchronize = cuda_stream_synchronize;
  r.malloc_host = cuda_malloc_host;
  r.free_host = cuda_free_host;
  r.get_error_string = cuda_error_string;
  g_copy_host_memory = true;
}

// The stand-in's counters: 0 copies up, 1 copies down, 2 waits, 3 streams
// made, 4 copies refused; with `fail_at` >= 0, the copy of that number
// (counting every copy asked for so far, refused ones too) fails.
int64_t gsbn_test_cuda_calls(int which, int64_t fail_at) {
  if (fail_at >= 0) g_cuda_fail_at = fail_at;
  return g_cuda_calls[which];
}

// A loopback transport (above) of `workers` workers in `mode`; its id.
int gsbn_test_loopback(int workers, const char* mode, double exit_grace) {
  g_exit_grace = exit_grace;
  return add_transport(std::make_shared<LoopbackTransport>(workers, mode));
}

// Counters: (layer, device) pairs holding exchange staging ("staging"),
// meetings the session holds ("meetings"), reductions engine threads left
// to the holder of `transport`'s store lock ("queued").
int64_t gsbn_test_count(const char* what, int transport) {
  const std::string which = what;
  if (which == "staging") return static_cast<int64_t>(staging_layers());
  if (which == "queued") {
    auto t = find_kvstore(transport);
    return t ? t->lock.queued() : -1;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  int64_t n = 0;
  for (auto& layer : live_layers_locked()) n += static_cast<int64_t>(layer->meetings.size());
  return n;
}

// wire.h's combine(dir, a, b) of two vectors of `size` numbers, into `out`.
void gsbn_test_combine(int dir, const double* a, const double* b, int size, double* out) {
  std::copy(a, a + size, out);
  combine(dir, out, b, size);
}

// wire.h's encode_exact of `value` in `numbers` numbers, each then held as a
// float32 key holds it where `numbers` is 4, into out[0 .. numbers), and
// their decode_exact into out[numbers].
void gsbn_test_encode(double value, int numbers, double* out) {
  encode_exact(value, numbers, out);
  for (int i = 0; i < numbers && numbers == 4; ++i) out[i] = static_cast<float>(out[i]);
  out[numbers] = decode_exact(out, numbers);
}

// stats.h on the given per-channel inputs of C channels (tests/test_native_stats.py):
// forward_contribution(count, m1, m2, v), global_statistics(total), then with its
// statistics normalize_coefficients, backward_contribution(d_scale, d_shift)
// and local_moment_grads(backward_total). `out` gets their results one after
// another: 1 + 2C, 1 + 2C (n, mean, var), 2C (scale, shift), 3C
// (contribution, d gamma), 2C (d m2, d v).
void gsbn_test_stats(int C, double count, const double* m1, const double* m2, const double* v,
                     const double* total, const double* gamma, const double* beta, double eps,
                     int fix_gamma, const double* d_scale, const double* d_shift,
                     const double* backward_total, double* out) {
  auto vec = [](const double* a, int n) { return std::vector<double>(a, a + n); };
  auto emit = [&out](const std::vector<double>& a) { out = std::copy(a.begin(), a.end(), out); };
  Params p;
  p.eps = eps;
  p.fix_gamma = fix_gamma != 0;
  const std::vector<double> centre = vec(m1, C);
  emit(forward_contribution(count, centre, vec(m2, C), vec(v, C)));
  const Info stats = global_statistics(vec(total, 1 + 2 * C));
  emit({stats.n});
  emit(stats.mean);
  emit(stats.var);
  std::vector<double> scale, shift, layer = vec(gamma, C), ds = vec(d_scale, C),
                      dsh = vec(d_shift, C), inv_stds, d_gamma, d_m2, d_v;
  normalize_coefficients(p, stats, centre, layer, vec(beta, C), &scale, &shift);
  emit(scale);
  emit(shift);
  emit(backward_contribution(p, stats, centre, count, &layer, &ds, &dsh, &inv_stds, &d_gamma));
  emit(d_gamma);
  std::vector<double> local_mean = centre;
  for (int c = 0; c < C; ++c) local_mean[c] += m2[c];
  local_moment_grads(vec(backward_total, 2 * C), count, stats, local_mean, layer, inv_stds, &d_m2,
                     &d_v);
  emit(d_m2);
  emit(d_v);
}

}  // extern "C"
