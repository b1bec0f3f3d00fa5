/// \file bench_kmeans.cu
/// Google Benchmark of thinkv::kernels::launch_kmeans_select (TBE K-means segment selection, one
/// CTA per segment) at the default eviction shape: full segments (n = 128 points), head_dim 128,
/// K in {64, 32, 4} (retention levels), and num_segments in {8, 512, 16384}: one stream's worth
/// of KV heads (8), a layer of batch 64 (8 x 64), one eviction across batch 64 x 32 layers x 8
/// KV heads (8 x 64 x 32).
///
/// Points: key-like synthetic data generated on the device (sum of four uniforms, i.e. roughly
/// Gaussian, with every 32nd channel scaled by 20 and offset, as RoPE'd keys have a few
/// large-magnitude channels); a fresh seed per segment; max_k = K (output rows of K indices).
/// The kernel is compute-bound (64 KiB of points per segment read once), so no L2 flush.
///
/// Timing: CUDA events around each launch (UseManualTime), 10 iterations x 3 repetitions,
/// ReportAggregatesOnly: use the *_median rows. Counters: us_launch = median launch time,
/// us_segment = us_launch / num_segments, Msegments_s = segments per second / 1e6,
/// smem_KiB = dynamic shared memory per CTA. Exits 77 (skip) when no CUDA device is present.
///
/// BM_KmeansMixed: a decode step's mixed selections (128 -> 64, 64 -> 32, 32 -> 16, 16 -> 8,
/// 8 -> 4; 650 segments as one launch of a step holds, and 16 times as many), run as one launch
/// sized for the largest segment (mode 0), the same with the largest segments first (mode 1: what
/// CudaKvBackend launches below set_kmeans_split_jobs' threshold), one launch per size class with
/// small shared-memory layouts (mode 2: what it launches from the threshold on), and those class
/// launches on three streams (mode 3). Every mode's rows are checked equal to mode 0's.
/// Run it alone with --benchmark_filter=BM_KmeansMixed.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "gpu_bench.cuh"
#include "thinkv/kernels/kmeans_kernels.hpp"
#include "thinkv/tbe/kmeans.hpp"

namespace {

namespace tk = thinkv::kernels;
using thinkv::bench::hash32;

const thinkv::bench::NoGpuSkip g_no_gpu_skip{"bench_kmeans"};

constexpr int kD = 128;
constexpr int kN = 128;

/// Key-like points: ~N(0, 1/3) per channel, every 32nd channel x20 + 5.
__global__ void fill_points(float* x, std::size_t count, int d, std::uint64_t seed) {
  for (std::size_t e = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float v = -2.0f;
    for (int r = 0; r < 4; ++r) {
      v += static_cast<float>(hash32(seed ^ ((e * 4 + static_cast<std::size_t>(r)) * 0x9E3779B97F4A7C15ull)) >> 8) *
           0x1p-24f;
    }
    const int c = static_cast<int>(e % static_cast<std::size_t>(d));
    if (c % 32 == 7) v = v * 20.0f + 5.0f;
    x[e] = v;
  }
}

struct Setup : thinkv::bench::DeviceAllocs {
  long segments = 0, k = 0;
  tk::KmeansSelectParams prm{};

  cudaError_t build() {
    const auto S = static_cast<std::size_t>(segments);
    std::uint64_t rng = 0x6B6D65616E73ull + static_cast<std::uint64_t>(segments * 131 + k);
    float* pts = nullptr;
    BENCH_CUDA(alloc(pts, S * kN * kD));
    fill_points<<<2048, 256>>>(pts, S * kN * kD, kD, thinkv::splitmix64(rng));
    BENCH_CUDA(cudaGetLastError());
    std::vector<int> n(S, kN), kk(S, static_cast<int>(k));
    std::vector<std::uint64_t> seeds(S);
    for (auto& s : seeds) s = thinkv::splitmix64(rng);
    int *dn = nullptr, *dk = nullptr, *kept = nullptr;
    std::uint64_t* ds = nullptr;
    BENCH_CUDA(alloc(dn, S));
    BENCH_CUDA(alloc(dk, S));
    BENCH_CUDA(alloc(ds, S));
    BENCH_CUDA(alloc(kept, S * static_cast<std::size_t>(k)));
    BENCH_CUDA(cudaMemcpy(dn, n.data(), S * sizeof(int), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(dk, kk.data(), S * sizeof(int), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(ds, seeds.data(), S * sizeof(std::uint64_t), cudaMemcpyHostToDevice));
    prm.num_segments = static_cast<int>(segments);
    prm.max_points = kN;
    prm.head_dim = kD;
    prm.max_k = static_cast<int>(k);
    prm.points = pts;
    prm.num_points = dn;
    prm.k = dk;
    prm.seeds = ds;
    prm.kept = kept;
    BENCH_CUDA(cudaDeviceSynchronize());
    // Warm-up launch, and a sanity check of its output (k distinct ascending indices).
    BENCH_CUDA(tk::launch_kmeans_select(prm, nullptr));
    BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<int> h(S * static_cast<std::size_t>(k));
    BENCH_CUDA(cudaMemcpy(h.data(), kept, h.size() * sizeof(int), cudaMemcpyDeviceToHost));
    for (std::size_t s = 0; s < S; ++s) {
      for (long t = 0; t < k; ++t) {
        const int v = h[s * static_cast<std::size_t>(k) + static_cast<std::size_t>(t)];
        const int prev = t > 0 ? h[s * static_cast<std::size_t>(k) + static_cast<std::size_t>(t) - 1] : -1;
        if (v < 0 || v >= kN || v <= prev) {
          std::fprintf(stderr, "bench_kmeans: bad output (segment %zu)\n", s);
          return cudaErrorUnknown;
        }
      }
    }
    return cudaSuccess;
  }
};

thinkv::bench::SetupCache<Setup> g_setups;  // kept across the repetitions of one configuration

void BM_KmeansSelect(benchmark::State& state) {
  const long segments = state.range(0), k = state.range(1);
  Setup* setup = g_setups.get(state, {segments, k}, [&](Setup& s) {
    s.segments = segments;
    s.k = k;
  });
  if (setup == nullptr) return;
  Setup& su = *setup;
  const double med_s = thinkv::bench::time_launches(
      state, [&] { return tk::launch_kmeans_select(su.prm, nullptr); }, nullptr);  // no L2 flush
  if (med_s == 0.0) return;
  const double med_us = med_s * 1e6;
  state.counters["us_launch"] = med_us;
  state.counters["us_segment"] = med_us / static_cast<double>(segments);
  state.counters["Msegments_s"] = static_cast<double>(segments) / med_us;
  state.counters["smem_KiB"] = static_cast<double>(tk::kmeans_select_shared_bytes(su.prm)) / 1024.0;
}

void Args(benchmark::internal::Benchmark* b) {
  for (long segments : {8L, 8L * 64, 8L * 64 * 32}) {
    for (long k : {64L, 32L, 4L}) b->Args({segments, k});
  }
}

BENCHMARK(BM_KmeansSelect)
    ->ArgNames({"segments", "K"})
    ->Apply(Args)
    ->UseManualTime()
    ->Iterations(10)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

// ---- Mixed sizes: the selections of a decode step -----------------------------------------------

/// Segment levels n -> n / 2 and their weights: mix 0 as a decode step asks for them (docs/perf.md,
/// "Which selections a decode step runs": 23, 20, 19, 19, 18 %), mix 1 small-heavy.
constexpr int kLevels[5] = {128, 64, 32, 16, 8};
constexpr int kMixWeights[2][5] = {{23, 20, 19, 19, 18}, {10, 15, 20, 25, 30}};

/// How a mixed batch runs: one launch sized for its largest segment (segments in arrival order);
/// the same, largest segments first (segment_ids); one launch per size class (kmeans_size_class,
/// layouts sized for the class), largest class first, in one stream as
/// CudaKvBackend::launch_selection runs them; the same classes on three streams forked from and
/// joined to the timed one (what overlapping the class launches would give).
enum Mode : long { kOneLaunch = 0, kOneSorted = 1, kClasses = 2, kClassStreams = 3, kModes = 4 };

struct MixedSetup : thinkv::bench::DeviceAllocs {
  long segments = 0, mix = 0;
  std::vector<tk::KmeansSelectParams> plans[kModes];
  cudaStream_t streams[3] = {};
  cudaEvent_t fork = nullptr, join[3] = {};
  int* kept = nullptr;
  int max_k = 1;

  MixedSetup() = default;
  MixedSetup(const MixedSetup&) = delete;
  MixedSetup& operator=(const MixedSetup&) = delete;
  ~MixedSetup() {
    (void)cudaDeviceSynchronize();
    for (cudaStream_t s : streams) {
      if (s != nullptr) (void)cudaStreamDestroy(s);
    }
    for (cudaEvent_t e : join) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    if (fork != nullptr) (void)cudaEventDestroy(fork);
  }

  /// Enqueues one run of `mode` on `stream`.
  cudaError_t run(long mode, cudaStream_t stream) {
    const std::vector<tk::KmeansSelectParams>& plan = plans[mode];
    if (mode != kClassStreams) {
      for (const tk::KmeansSelectParams& p : plan) {
        if (cudaError_t e = tk::launch_kmeans_select(p, stream); e != cudaSuccess) return e;
      }
      return cudaSuccess;
    }
    if (cudaError_t e = cudaEventRecord(fork, stream); e != cudaSuccess) return e;
    for (std::size_t c = 0; c < plan.size(); ++c) {
      if (cudaError_t e = cudaStreamWaitEvent(streams[c], fork, 0); e != cudaSuccess) return e;
      if (cudaError_t e = tk::launch_kmeans_select(plan[c], streams[c]); e != cudaSuccess) return e;
      if (cudaError_t e = cudaEventRecord(join[c], streams[c]); e != cudaSuccess) return e;
      if (cudaError_t e = cudaStreamWaitEvent(stream, join[c], 0); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  cudaError_t build() {
    const auto S = static_cast<std::size_t>(segments);
    std::uint64_t rng = 0x6D69786564ull + static_cast<std::uint64_t>(segments * 7 + mix);
    float* pts = nullptr;
    BENCH_CUDA(alloc(pts, S * kN * kD));
    fill_points<<<2048, 256>>>(pts, S * kN * kD, kD, thinkv::splitmix64(rng));
    BENCH_CUDA(cudaGetLastError());
    std::vector<int> n(S), kk(S);
    std::vector<std::uint64_t> seeds(S);
    int total_weight = 0;
    for (int w : kMixWeights[mix]) total_weight += w;
    int max_n = 1;
    for (std::size_t s = 0; s < S; ++s) {
      int r = static_cast<int>(thinkv::splitmix64(rng) % static_cast<std::uint64_t>(total_weight));
      int level = 0;
      while (r >= kMixWeights[mix][level]) r -= kMixWeights[mix][level++];
      n[s] = kLevels[level];
      kk[s] = n[s] / 2;
      seeds[s] = thinkv::splitmix64(rng);
      max_n = std::max(max_n, n[s]);
      max_k = std::max(max_k, kk[s]);
    }
    // Largest first (stable), then cut at the size classes.
    std::vector<int> sorted(S);
    for (std::size_t s = 0; s < S; ++s) sorted[s] = static_cast<int>(s);
    std::stable_sort(sorted.begin(), sorted.end(),
                     [&](int a, int b) { return n[static_cast<std::size_t>(a)] > n[static_cast<std::size_t>(b)]; });
    int *dn = nullptr, *dk = nullptr, *dsorted = nullptr;
    std::uint64_t* ds = nullptr;
    BENCH_CUDA(put(dn, n));
    BENCH_CUDA(put(dk, kk));
    BENCH_CUDA(put(ds, seeds));
    BENCH_CUDA(put(dsorted, sorted));
    BENCH_CUDA(alloc(kept, S * static_cast<std::size_t>(max_k)));
    tk::KmeansSelectParams one;
    one.num_segments = static_cast<int>(segments);
    one.max_points = max_n;
    one.head_dim = kD;
    one.max_k = max_k;
    one.points = pts;
    one.num_points = dn;
    one.k = dk;
    one.seeds = ds;
    one.kept = kept;
    plans[kOneLaunch] = {one};
    tk::KmeansSelectParams sorted_one = one;
    sorted_one.segment_ids = dsorted;
    plans[kOneSorted] = {sorted_one};
    for (std::size_t r = 0; r < S;) {
      const int cls = tk::kmeans_size_class(n[static_cast<std::size_t>(sorted[r])]);
      tk::KmeansSelectParams p = one;
      p.segment_ids = dsorted + r;
      p.layout_points = n[static_cast<std::size_t>(sorted[r])];  // the class's largest
      p.layout_k = 0;
      std::size_t e = r;
      for (; e < S && tk::kmeans_size_class(n[static_cast<std::size_t>(sorted[e])]) == cls; ++e) {
        p.layout_k = std::max(p.layout_k, kk[static_cast<std::size_t>(sorted[e])]);
      }
      p.num_segments = static_cast<int>(e - r);
      plans[kClasses].push_back(p);
      r = e;
    }
    plans[kClassStreams] = plans[kClasses];
    for (std::size_t c = 0; c < 3; ++c) {
      BENCH_CUDA(cudaStreamCreateWithFlags(&streams[c], cudaStreamNonBlocking));
      BENCH_CUDA(cudaEventCreateWithFlags(&join[c], cudaEventDisableTiming));
    }
    BENCH_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    BENCH_CUDA(cudaDeviceSynchronize());
    // Warm-up run of every mode, and a sanity check: well-formed rows (k ascending indices < n,
    // then -1) in the first mode, the same rows bit for bit in every other.
    const std::size_t row = static_cast<std::size_t>(max_k);
    std::vector<int> first(S * row), h(S * row);
    for (long mode = 0; mode < kModes; ++mode) {
      BENCH_CUDA(cudaMemset(kept, 0x7F, S * row * sizeof(int)));
      BENCH_CUDA(run(mode, nullptr));
      BENCH_CUDA(cudaDeviceSynchronize());
      BENCH_CUDA(cudaMemcpy(h.data(), kept, h.size() * sizeof(int), cudaMemcpyDeviceToHost));
      if (mode == 0) {
        first = h;
        for (std::size_t s = 0; s < S; ++s) {
          for (std::size_t t = 0; t < row; ++t) {
            const int v = h[s * row + t];
            const bool want_index = static_cast<int>(t) < kk[s];
            const bool ok = want_index ? v >= 0 && v < n[s] && (t == 0 || v > h[s * row + t - 1]) : v == -1;
            if (!ok) {
              std::fprintf(stderr, "bench_kmeans: bad output (segment %zu)\n", s);
              return cudaErrorUnknown;
            }
          }
        }
      } else if (h != first) {
        std::fprintf(stderr, "bench_kmeans: mode %ld selects otherwise than one launch\n", mode);
        return cudaErrorUnknown;
      }
    }
    return cudaSuccess;
  }
};

thinkv::bench::SetupCache<MixedSetup> g_mixed;  // kept across the modes of one batch

/// A decode step's selections in one batch: `segments` of head_dim 128 drawn from the levels
/// 128 -> 64 .. 8 -> 4 with the weights of `mix`, run as `mode` (see Mode). Counters as above,
/// plus launches and smem_KiB_max / smem_KiB_min (per CTA, over the mode's launches).
void BM_KmeansMixed(benchmark::State& state) {
  const long segments = state.range(0), mix = state.range(1), mode = state.range(2);
  MixedSetup* setup = g_mixed.get(state, {segments, mix}, [&](MixedSetup& s) {
    s.segments = segments;
    s.mix = mix;
  });
  if (setup == nullptr) return;
  MixedSetup& su = *setup;
  const double med_s = thinkv::bench::time_launches(
      state, [&] { return su.run(mode, nullptr); }, nullptr);
  if (med_s == 0.0) return;
  const double med_us = med_s * 1e6;
  std::size_t most = 0, least = ~std::size_t{0};
  for (const tk::KmeansSelectParams& p : su.plans[mode]) {
    most = std::max(most, tk::kmeans_select_shared_bytes(p));
    least = std::min(least, tk::kmeans_select_shared_bytes(p));
  }
  state.counters["us_launch"] = med_us;
  state.counters["us_segment"] = med_us / static_cast<double>(segments);
  state.counters["launches"] = static_cast<double>(su.plans[mode].size());
  state.counters["smem_KiB_max"] = static_cast<double>(most) / 1024.0;
  state.counters["smem_KiB_min"] = static_cast<double>(least) / 1024.0;
}

void MixedArgs(benchmark::internal::Benchmark* b) {
  for (long segments : {650L, 650L * 16}) {  // a decode step's launch; sixteen of them at once
    for (long mix : {0L, 1L}) {
      for (long mode = 0; mode < kModes; ++mode) b->Args({segments, mix, mode});
    }
  }
}

BENCHMARK(BM_KmeansMixed)
    ->ArgNames({"segments", "mix", "mode"})
    ->Apply(MixedArgs)
    ->UseManualTime()
    ->Iterations(10)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
