#pragma once
/// \file gpu_bench.cuh
/// Shared by the CUDA benchmarks of bench/ (not installed): exit 77 without a GPU, the error macro
/// of the setup code, seeded hashing for device-side fills, and the timed loop every benchmark
/// uses: CUDA events around each launch, an optional L2 flush before it outside the timed region,
/// the iteration time reported to Google Benchmark (UseManualTime), and the median returned.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

namespace thinkv::bench {

/// Twice the H200's 60 MiB L2: writing it evicts whatever the previous launch left there.
inline constexpr std::size_t kL2FlushBytes = 2ull * 60 * 1024 * 1024;
/// Measured streaming ceiling of the H200 (../shared/guides/GPU.md), GB/s.
inline constexpr double kCeilingGBps = 4300.0;

/// At namespace scope of a benchmark (`const NoGpuSkip g_skip{"bench_x"};`): runs before
/// benchmark_main's main() and exits 77 (ctest: skipped) when there is no CUDA device.
struct NoGpuSkip {
  explicit NoGpuSkip(const char* name) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      std::fprintf(stderr, "%s: no CUDA device, skipping (exit 77)\n", name);
      std::exit(77);
    }
  }
};

/// In setup functions returning cudaError_t: returns the error of a failing CUDA call, with a
/// message naming it.
#define BENCH_CUDA(call)                                                                         \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      return e_;                                                                                 \
    }                                                                                            \
  } while (0)

/// splitmix64 step (host): seeds, shuffles.
inline std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// A 64 -> 32 bit mix (murmur3 finalizer) for device-side random fills.
__host__ __device__ inline std::uint32_t hash32(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

/// The device buffers of a benchmark setup (derive from it), freed with it.
struct DeviceAllocs {
  DeviceAllocs() = default;
  DeviceAllocs(const DeviceAllocs&) = delete;
  DeviceAllocs& operator=(const DeviceAllocs&) = delete;
  ~DeviceAllocs() {
    for (void* p : allocs) (void)cudaFree(p);
  }
  /// cudaMalloc of `count` T (at least 1 byte), owned by this setup.
  template <typename T>
  cudaError_t alloc(T*& dst, std::size_t count) {
    void* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, std::max<std::size_t>(count * sizeof(T), 1)));
    allocs.push_back(p);
    dst = static_cast<T*>(p);
    return cudaSuccess;
  }
  /// A device copy of `h`.
  template <typename T>
  cudaError_t put(T*& dst, const std::vector<T>& h) {
    BENCH_CUDA(alloc(dst, h.size()));
    BENCH_CUDA(cudaMemcpy(dst, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return cudaSuccess;
  }
  template <typename T>
  cudaError_t put(const T*& dst, const std::vector<T>& h) {
    T* p = nullptr;
    BENCH_CUDA(put(p, h));
    dst = p;
    return cudaSuccess;
  }
  std::vector<void*> allocs;
};

/// Keeps one benchmark setup (a struct with a `cudaError_t build()`) across the repetitions of a
/// configuration, rebuilding it only when the configuration key changes.
template <class Setup>
class SetupCache {
 public:
  /// The setup for `key`: the cached one, or a new one that `init` configures and build() builds.
  /// Null, with the state skipped and the error named, when building fails.
  template <class Init>
  Setup* get(benchmark::State& state, std::vector<long> key, Init&& init) {
    if (setup_ && key == key_) return setup_.get();
    setup_.reset();
    (void)cudaGetLastError();
    auto s = std::make_unique<Setup>();
    init(*s);
    if (cudaError_t e = s->build(); e != cudaSuccess) {
      state.SkipWithError(cudaGetErrorString(e));
      (void)cudaGetLastError();
      return nullptr;
    }
    setup_ = std::move(s);
    key_ = std::move(key);
    return setup_.get();
  }

 private:
  std::unique_ptr<Setup> setup_;
  std::vector<long> key_;
};

/// Times `launch()` (returning cudaError_t, enqueued on `stream`) once per benchmark iteration
/// with CUDA events. When `flush` is non-null, kL2FlushBytes of it are written before each launch,
/// outside the timed region, and then `prepare()` (when given: untimed per-launch resets). Returns
/// the median time in seconds, or 0 when a launch failed (the state then carries the error).
template <class Launch>
double time_launches(benchmark::State& state, Launch&& launch, void* flush, cudaStream_t stream = nullptr,
                     const std::function<void()>& prepare = {}) {
  cudaEvent_t t0, t1;
  (void)cudaEventCreate(&t0);
  (void)cudaEventCreate(&t1);
  std::vector<float> ms_all;
  int salt = 0;
  for (auto _ : state) {
    if (flush != nullptr) (void)cudaMemsetAsync(flush, ++salt & 0xFF, kL2FlushBytes, stream);
    if (prepare) prepare();
    (void)cudaEventRecord(t0, stream);
    const cudaError_t e = launch();
    (void)cudaEventRecord(t1, stream);
    const cudaError_t e2 = cudaEventSynchronize(t1);
    if (e != cudaSuccess || e2 != cudaSuccess) {
      state.SkipWithError(cudaGetErrorString(e != cudaSuccess ? e : e2));
      ms_all.clear();
      break;
    }
    float ms = 0;
    (void)cudaEventElapsedTime(&ms, t0, t1);
    ms_all.push_back(ms);
    state.SetIterationTime(ms * 1e-3);
  }
  (void)cudaEventDestroy(t0);
  (void)cudaEventDestroy(t1);
  if (ms_all.empty()) return 0.0;
  std::sort(ms_all.begin(), ms_all.end());
  return ms_all[ms_all.size() / 2] * 1e-3;
}

/// The bandwidth counters of a timed launch: bytes, med_us, GBps, frac_4p3TBs.
inline void bandwidth_counters(benchmark::State& state, double bytes, double median_s) {
  state.counters["bytes"] = bytes;
  state.counters["med_us"] = median_s * 1e6;
  state.counters["GBps"] = bytes / median_s * 1e-9;
  state.counters["frac_4p3TBs"] = bytes / median_s * 1e-9 / kCeilingGBps;
}

}  // namespace thinkv::bench
