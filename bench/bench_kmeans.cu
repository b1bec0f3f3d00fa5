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

}  // namespace
