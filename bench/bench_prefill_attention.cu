/// \file bench_prefill_attention.cu
/// Google Benchmark of thinkv::kernels::launch_prefill_attention (causal prompt attention) at the
/// default model shape: 32 query heads, 8 KV heads, head_dim 128, FP32 q, k, v and out.
///   tokens 512, prefix 4096: a prompt chunk continuing a 4,096-token sequence, K/V in the scratch
///     layout attend_chunk builds (FP32 [hkv, rows, d]: row stride d, head stride rows * d,
///     prefix[h] = 4096 stored rows, then the chunk's);
///   tokens 2048, prefix 0: a first prompt, K/V packed [tokens, hkv, d] (attend_prompt);
///   tokens 64, prefix 0: a small shape (the ctest smoke run takes every configuration).
/// Inputs: roughly N(0, 1) values generated on the device. The setup checks a few output rows
/// against float64 (the tolerance of tests/kernels/test_prefill_attention.cpp) after a warm-up
/// launch. No L2 flush: the kernel is compute-bound, and attend_chunk's K/V scratch has just been
/// written when it runs.
///
/// Timing: CUDA events around each launch (UseManualTime), 10 iterations x 3 repetitions,
/// ReportAggregatesOnly: use the *_median rows. Counters: ms = median launch time, ms_32_layers =
/// 32 x ms (one prompt chunk through a 32-layer model), TFLOPs = 4 * visible pairs * head_dim *
/// num_q_heads / time (visible pairs = tokens * prefix + tokens * (tokens + 1) / 2: two FMA per
/// channel per pair), pairs = visible pairs. Exits 77 (skip) when no CUDA device is present.
///   build/bench/bench_prefill_attention --benchmark_filter=BM_PrefillAttention

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "gpu_bench.cuh"
#include "thinkv/kernels/prefill_attention.hpp"

namespace {

namespace tk = thinkv::kernels;
using thinkv::bench::hash32;

const thinkv::bench::NoGpuSkip g_no_gpu_skip{"bench_prefill_attention"};

constexpr int kHq = 32;
constexpr int kHkv = 8;
constexpr int kD = 128;

/// Roughly N(0, 1): the sum of four uniforms on [-0.5, 0.5), times sqrt(3).
__global__ void fill_normal(float* x, std::size_t count, std::uint64_t seed) {
  for (std::size_t e = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float v = -2.0f;
    for (int r = 0; r < 4; ++r) {
      v += static_cast<float>(hash32(seed ^ ((e * 4 + static_cast<std::size_t>(r)) * 0x9E3779B97F4A7C15ull)) >> 8) *
           0x1p-24f;
    }
    x[e] = v * 1.7320508f;
  }
}

struct Setup : thinkv::bench::DeviceAllocs {
  long tokens = 0, prefix = 0;
  tk::PrefillAttentionParams prm{};

  cudaError_t build() {
    const auto T = static_cast<std::size_t>(tokens);
    const std::size_t rows = static_cast<std::size_t>(prefix) + T;  // KV rows per head
    const std::size_t qn = T * kHq * kD, kvn = rows * kHkv * kD;
    std::uint64_t rng = 0x70726566696C6Cull + static_cast<std::uint64_t>(tokens * 131 + prefix);
    float *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
    BENCH_CUDA(alloc(q, qn));
    BENCH_CUDA(alloc(k, kvn));
    BENCH_CUDA(alloc(v, kvn));
    BENCH_CUDA(alloc(out, qn));
    fill_normal<<<1024, 256>>>(q, qn, thinkv::bench::splitmix(rng));
    fill_normal<<<1024, 256>>>(k, kvn, thinkv::bench::splitmix(rng));
    fill_normal<<<1024, 256>>>(v, kvn, thinkv::bench::splitmix(rng));
    BENCH_CUDA(cudaGetLastError());
    prm.tokens = static_cast<int>(tokens);
    prm.num_q_heads = kHq;
    prm.num_kv_heads = kHkv;
    prm.head_dim = kD;
    prm.q = q;
    prm.k = k;
    prm.v = v;
    prm.out = out;
    std::size_t row_stride = static_cast<std::size_t>(kHkv) * kD, head_stride = kD;  // packed
    if (prefix > 0) {  // attend_chunk's scratch: [hkv, rows, d]
      const int* dprefix = nullptr;
      BENCH_CUDA(put(dprefix, std::vector<int>(kHkv, static_cast<int>(prefix))));
      prm.prefix = dprefix;
      row_stride = kD;
      head_stride = rows * kD;
      prm.kv_row_stride = static_cast<long long>(row_stride);
      prm.kv_head_stride = static_cast<long long>(head_stride);
    }
    BENCH_CUDA(cudaMemset(out, 0xFF, qn * sizeof(float)));
    BENCH_CUDA(cudaDeviceSynchronize());
    // Warm-up launch, and a check of a few output rows against float64.
    BENCH_CUDA(tk::launch_prefill_attention(prm, nullptr));
    BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<float> hq(qn), hk(kvn), hv(kvn), ho(qn);
    BENCH_CUDA(cudaMemcpy(hq.data(), q, qn * sizeof(float), cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hk.data(), k, kvn * sizeof(float), cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hv.data(), v, kvn * sizeof(float), cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(ho.data(), out, qn * sizeof(float), cudaMemcpyDeviceToHost));
    const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
    for (const std::size_t t : {std::size_t{0}, T / 2, T - 1}) {
      for (const int h : {0, kHq / 2 + 1, kHq - 1}) {
        const std::size_t kvh = static_cast<std::size_t>(h / (kHq / kHkv)),
                          n = static_cast<std::size_t>(prefix) + t + 1;
        std::vector<double> sc(n), acc(kD, 0.0);
        double m = -INFINITY, l = 0, vmax = 0, max_ref = 0, max_err = 0;
        for (std::size_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int c = 0; c < kD; ++c) {
            dot += double{hq[(t * kHq + static_cast<std::size_t>(h)) * kD + static_cast<std::size_t>(c)]} *
                   hk[j * row_stride + kvh * head_stride + static_cast<std::size_t>(c)];
          }
          sc[j] = dot * scale;
          m = std::max(m, sc[j]);
        }
        for (std::size_t j = 0; j < n; ++j) {
          const double e = std::exp(sc[j] - m);
          l += e;
          for (int c = 0; c < kD; ++c) {
            const double x = hv[j * row_stride + kvh * head_stride + static_cast<std::size_t>(c)];
            acc[static_cast<std::size_t>(c)] += e * x;
            vmax = std::max(vmax, std::fabs(x));
          }
        }
        for (int c = 0; c < kD; ++c) {
          const double want = acc[static_cast<std::size_t>(c)] / l;
          const double got = ho[(t * kHq + static_cast<std::size_t>(h)) * kD + static_cast<std::size_t>(c)];
          max_ref = std::max(max_ref, std::fabs(want));
          max_err = std::max(max_err, std::isnan(got) ? INFINITY : std::fabs(got - want));
        }
        if (!(max_err <= 0x1p-23 * max_ref + 5e-5 * vmax)) {
          std::fprintf(stderr, "bench_prefill_attention: token %zu head %d off by %g (max|out| %g)\n", t, h, max_err,
                       max_ref);
          return cudaErrorUnknown;
        }
      }
    }
    return cudaSuccess;
  }
};

thinkv::bench::SetupCache<Setup> g_setups;  // kept across the repetitions of one configuration

void BM_PrefillAttention(benchmark::State& state) {
  const long tokens = state.range(0), prefix = state.range(1);
  Setup* setup = g_setups.get(state, {tokens, prefix}, [&](Setup& s) {
    s.tokens = tokens;
    s.prefix = prefix;
  });
  if (setup == nullptr) return;
  Setup& su = *setup;
  const double med_s = thinkv::bench::time_launches(
      state, [&] { return tk::launch_prefill_attention(su.prm, nullptr); }, nullptr);  // no L2 flush
  if (med_s == 0.0) return;
  const double pairs = static_cast<double>(tokens) * static_cast<double>(prefix) +
                       static_cast<double>(tokens) * static_cast<double>(tokens + 1) / 2.0;
  state.counters["ms"] = med_s * 1e3;
  state.counters["ms_32_layers"] = med_s * 1e3 * 32.0;
  state.counters["TFLOPs"] = 4.0 * pairs * kD * kHq / med_s * 1e-12;
  state.counters["pairs"] = pairs;
}

BENCHMARK(BM_PrefillAttention)
    ->ArgNames({"tokens", "prefix"})
    ->Args({512, 4096})
    ->Args({2048, 0})
    ->Args({64, 0})
    ->UseManualTime()
    ->Iterations(10)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMillisecond);

}  // namespace
