/// \file bench_quantize_append.cu
/// Google Benchmark of thinkv::kernels::launch_quantize_append: one flush of a full staging group
/// of EVERY stream of a batch, Llama-3-8B shapes: 32 layers x 8 KV heads per sequence, head_dim
/// 128, group 16, block 16; batch 64 (16384 streams = 16384 jobs in one launch) and batch 1 (256).
///
/// Precision mix R4E4T2: stream s flushes a transition group (ternary) when s % 3 == 2, else a
/// reasoning/execution group (NVFP4). The synthetic cache is built directly on the device:
/// staging = random BF16 values (|x| in [2^-2, 2^2), random signs), s2 = 1 (already fixed, the
/// steady state) unless `fresh_s2` (then every launch is the stream's first group at its
/// precision: s2 is reset to 0, untimed, before each launch, so the kernel also reduces the
/// group's amax and sets s2). Destinations (argument `scatter`):
///   0: each job fills one fresh block (slots 0..15 of a block; block ids shuffled in the pool);
///   1: each job's 16 tokens are scattered as when evicted slots are reused in place: 4 slots
///      (stride 4) in each of 4 random blocks of its pool (4x the blocks of mode 0).
/// One key-scale record per job (shuffled record ids).
///
/// Timing: CUDA events around each launch (UseManualTime); before each launch, outside the timed
/// region, a 2 x L2 (120 MiB) buffer is written with cudaMemsetAsync so every launch reads staging
/// and metadata from HBM. Repetitions(5) + ReportAggregatesOnly: use the *_median rows.
/// Counters: bytes_read = staging (2 x g x D x 2 bytes per job) + dest slot ids (4 g) + job (12)
/// + s2 (8); bytes_written = per job g x (2 x row_bytes + D/g) page bytes + D record bytes (+ 8 s2
/// bytes when fresh_s2); GBps = (read + written) / median event time; us = median event time.
/// Exits 77 (skip) when no CUDA device is present.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_bench.cuh"
#include "thinkv/kernels/quantize_append.hpp"
#include "thinkv/types.hpp"

namespace {

using thinkv::kNumPrecisions;
using thinkv::Precision;
namespace tk = thinkv::kernels;
using thinkv::bench::hash32;
using thinkv::bench::kL2FlushBytes;
using thinkv::bench::splitmix;

const thinkv::bench::NoGpuSkip g_no_gpu_skip{"bench_quantize_append"};

constexpr int kD = 128;
constexpr int kG = 16;  // group size
constexpr int kB = 16;  // block size
constexpr int kLayers = 32;
constexpr int kKvHeads = 8;

int bits_of(int p) { return p == 0 ? 16 : p == 1 ? 8 : p == 2 ? 4 : 2; }
std::size_t row_bytes(int p) { return static_cast<std::size_t>(kD * bits_of(p) / 8); }
std::size_t page_bytes(int p) { return kB * (2 * row_bytes(p) + (p == 0 ? 0 : kD / kG)); }

/// Random BF16 values with exponent 125..128 (|x| in [2^-2, 2^2)), random sign and mantissa.
__global__ void fill_staging(std::uint16_t* x, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t r = hash32(seed ^ (i * 0x9E3779B97F4A7C15ull));
    const std::uint32_t exponent = 125u + (r & 3u);
    x[i] = static_cast<std::uint16_t>(((r >> 2) & 0x8000u) | (exponent << 7) | ((r >> 8) & 0x7Fu));
  }
}

struct Setup : thinkv::bench::DeviceAllocs {
  long batch = 0, scatter = 0, fresh_s2 = 0;
  tk::QuantizeAppendParams prm{};
  std::size_t s2_bytes = 0;
  double bytes_read = 0, bytes_written = 0;
  void* flush = nullptr;

  cudaError_t build() {
    std::uint64_t rng = 0x0A99E2Dull + static_cast<std::uint64_t>(batch * 31 + scatter * 7 + fresh_s2);
    const int S = static_cast<int>(batch * kLayers * kKvHeads);
    std::vector<int> prec(static_cast<std::size_t>(S));
    std::size_t jobs_of[kNumPrecisions] = {};
    for (int s = 0; s < S; ++s) {
      prec[static_cast<std::size_t>(s)] = s % 3 == 2 ? 3 : 2;
      ++jobs_of[prec[static_cast<std::size_t>(s)]];
    }
    tk::QuantizeAppendView& v = prm.cache;
    v.num_streams = S;
    v.head_dim = kD;
    v.group_size = kG;
    v.block_size = kB;
    // Pools: one block per job (scatter 0) or 4 per job (scatter 1), of NVFP4 and ternary only.
    const std::size_t per_job = scatter ? 4 : 1;
    std::uint32_t base = 0;
    for (int p = 0; p < kNumPrecisions; ++p) {
      const std::size_t count = jobs_of[p] * per_job;
      v.pool_base[p] = base;
      v.pool_count[p] = static_cast<std::uint32_t>(count);
      base += static_cast<std::uint32_t>(count);
      if (count > 0) {
        std::uint8_t* pg = nullptr;
        BENCH_CUDA(alloc(pg, count * page_bytes(p)));
        BENCH_CUDA(cudaMemset(pg, 0, count * page_bytes(p)));
        v.pages[p] = pg;
      }
    }
    v.total_blocks = base;
    // Destinations.
    std::vector<std::uint32_t> dest(static_cast<std::size_t>(S) * kG);
    std::vector<std::vector<std::uint32_t>> free_ids(kNumPrecisions);
    for (int p = 0; p < kNumPrecisions; ++p) {
      free_ids[p].resize(v.pool_count[p]);
      std::iota(free_ids[p].begin(), free_ids[p].end(), v.pool_base[p]);
      for (std::size_t i = free_ids[p].size(); i > 1; --i)
        std::swap(free_ids[p][i - 1], free_ids[p][splitmix(rng) % i]);
    }
    std::size_t next[kNumPrecisions] = {};
    // Scatter: the j-th job of a pool owns blocks free_ids[p][4j .. 4j+3]; token i goes to block
    // 4j + i/4, slot (i%4)*4 + j%4 (4 distinct slots per block).
    std::vector<std::uint32_t> pool_job(kNumPrecisions, 0);
    for (int s = 0; s < S; ++s) {
      const int p = prec[static_cast<std::size_t>(s)];
      for (int i = 0; i < kG; ++i) {
        std::uint32_t block, slot;
        if (!scatter) {
          block = free_ids[p][next[p]];
          slot = static_cast<std::uint32_t>(i);
        } else {
          const std::uint32_t j = pool_job[p];
          block = free_ids[p][static_cast<std::size_t>(j) * 4 + static_cast<std::size_t>(i / 4)];
          slot = static_cast<std::uint32_t>((i % 4) * 4 + (j % 4));
        }
        dest[static_cast<std::size_t>(s) * kG + static_cast<std::size_t>(i)] = block * kB + slot;
      }
      if (!scatter) ++next[p];
      ++pool_job[p];
    }
    // Jobs and records (shuffled record ids).
    std::vector<std::uint32_t> rec(static_cast<std::size_t>(S));
    std::iota(rec.begin(), rec.end(), 0u);
    for (std::size_t i = rec.size(); i > 1; --i) std::swap(rec[i - 1], rec[splitmix(rng) % i]);
    std::vector<tk::QuantizeAppendJob> jobs(static_cast<std::size_t>(S));
    for (int s = 0; s < S; ++s) {
      jobs[static_cast<std::size_t>(s)].stream = s;
      jobs[static_cast<std::size_t>(s)].record = rec[static_cast<std::size_t>(s)];
      jobs[static_cast<std::size_t>(s)].precision = static_cast<Precision>(prec[static_cast<std::size_t>(s)]);
    }
    v.num_records = static_cast<std::uint32_t>(S);
    BENCH_CUDA(alloc(v.key_scales, static_cast<std::size_t>(S) * kD));
    std::vector<float> s2(static_cast<std::size_t>(S) * 2 * kNumPrecisions, 1.0f);
    s2_bytes = s2.size() * sizeof(float);
    BENCH_CUDA(put(v.s2, s2));
    std::uint16_t* staging = nullptr;
    const std::size_t staging_n = static_cast<std::size_t>(S) * 2 * kG * kD;
    BENCH_CUDA(alloc(staging, staging_n));
    fill_staging<<<2048, 256>>>(staging, staging_n, splitmix(rng));
    BENCH_CUDA(cudaGetLastError());
    v.staging = staging;
    tk::QuantizeAppendJob* dj = nullptr;
    std::uint32_t* ds = nullptr;
    BENCH_CUDA(put(dj, jobs));
    BENCH_CUDA(put(ds, dest));
    prm.num_jobs = S;
    prm.jobs = dj;
    prm.dest_slots = ds;
    unsigned* rejected = nullptr;
    BENCH_CUDA(alloc(rejected, 1));
    BENCH_CUDA(cudaMemset(rejected, 0, sizeof(unsigned)));
    prm.rejected_jobs = rejected;
    // Byte counts (see the file comment).
    bytes_read = static_cast<double>(staging_n) * 2 + static_cast<double>(dest.size()) * 4 +
                 static_cast<double>(S) * (sizeof(tk::QuantizeAppendJob) + 8);
    bytes_written = 0;
    for (int s = 0; s < S; ++s) {
      const int p = prec[static_cast<std::size_t>(s)];
      bytes_written += static_cast<double>(kG) * static_cast<double>(2 * row_bytes(p) + kD / kG) + kD;
    }
    if (fresh_s2) bytes_written += static_cast<double>(S) * 8;
    BENCH_CUDA(alloc(reinterpret_cast<std::uint8_t*&>(flush), kL2FlushBytes));
    // Warm-up launch; every job must be accepted.
    BENCH_CUDA(tk::launch_quantize_append(prm, nullptr));
    BENCH_CUDA(cudaDeviceSynchronize());
    unsigned h_rejected = 0;
    BENCH_CUDA(cudaMemcpy(&h_rejected, rejected, sizeof h_rejected, cudaMemcpyDeviceToHost));
    if (h_rejected != 0) {
      std::fprintf(stderr, "bench_quantize_append: %u jobs rejected\n", h_rejected);
      return cudaErrorUnknown;
    }
    return cudaSuccess;
  }
};

thinkv::bench::SetupCache<Setup> g_setups;  // kept across the repetitions of one configuration

void BM_QuantizeAppend(benchmark::State& state) {
  const long batch = state.range(0), scatter = state.range(1), fresh = state.range(2);
  Setup* setup = g_setups.get(state, {batch, scatter, fresh}, [&](Setup& s) {
    s.batch = batch;
    s.scatter = scatter;
    s.fresh_s2 = fresh;
  });
  if (setup == nullptr) return;
  Setup& su = *setup;
  const double med_s = thinkv::bench::time_launches(
      state, [&] { return tk::launch_quantize_append(su.prm, nullptr); }, su.flush, nullptr,
      [&] {
        if (su.fresh_s2) (void)cudaMemsetAsync(su.prm.cache.s2, 0, su.s2_bytes, nullptr);  // untimed
      });
  if (med_s == 0.0) return;
  thinkv::bench::bandwidth_counters(state, su.bytes_read + su.bytes_written, med_s);
  state.counters["jobs"] = static_cast<double>(su.prm.num_jobs);
  state.counters["bytes_read"] = su.bytes_read;
  state.counters["bytes_written"] = su.bytes_written;
  state.SetLabel(std::string("R4E4T2") + (scatter ? " scattered" : " fresh-block") + (fresh ? " s2-unset" : ""));
}

BENCHMARK(BM_QuantizeAppend)
    ->ArgNames({"batch", "scatter", "fresh_s2"})
    ->Args({1, 0, 0})
    ->Args({1, 1, 0})
    ->Args({64, 0, 0})
    ->Args({64, 1, 0})
    ->Args({64, 0, 1})
    ->UseManualTime()
    ->Iterations(20)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
