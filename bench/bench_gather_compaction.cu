/// \file bench_gather_compaction.cu
/// Google Benchmark of thinkv::bench::launch_gather_compaction: the copy a token-level eviction
/// method (R-KV style) must make after each eviction to keep its paged cache compact. ThinKV does
/// not make it (Continuous Thinking masks evicted slots and overwrites them in place: 0 bytes,
/// 0 us); this benchmark prices what that avoids, on the same page layout.
///
/// Shapes: Llama-3-8B attention, 8 KV heads per sequence and layer, head_dim 128, group 16,
/// block 16. Arguments: tokens = slots written per stream before eviction (1024, 4096), all
/// blocks full; exactly 50% of every block's slots evicted (8 of 16, random), so tokens / 2 live
/// tokens per stream are copied into tokens / 32 fresh destination blocks of the same pool;
/// batch = sequences (1, 8, 32, 64); mode = BF16, NVFP4 (R4E4T4) or R4E4T2 (every third stream
/// ternary, the others NVFP4: compaction needs one pool per stream, so the mix is per stream
/// here, not per block as in bench_paged_attention); layers = 1 (one compaction of every stream
/// of one layer: 8 x batch streams in one launch) or 32 (every layer of one decode step in ONE
/// launch, 256 x batch streams; configurations above 64 GiB of pages are skipped).
/// Source and destination block ids are shuffled together inside each pool (paged, not
/// contiguous).
///
/// Timing: CUDA events around each launch (UseManualTime); before each launch, outside the timed
/// region, a 2 x 60 MiB buffer is written with cudaMemsetAsync so every launch reads from HBM.
/// Iterations(10), Repetitions(5), ReportAggregatesOnly: use the *_median rows; the counters are
/// from each repetition's median launch. The copy is idempotent (sources are not modified), so
/// repeated launches do the same work.
/// Counters: bytes = bytes the kernel reads + writes (live tokens x 2 x (2 row_bytes + D/g value
/// scales + 4 record id), plus block metadata: see bytes_moved), GBps = bytes / median time,
/// frac_4p3TBs = GBps / 4300, med_us, step_us = the compaction cost of one decode step of all 32
/// layers (layers = 1: 32 x med_us, one launch per layer; layers = 32: med_us), tokens_moved,
/// ctas. ThinKV's cost for the same eviction: 0.
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
#include "gather_compaction/gather_compaction.hpp"
#include "thinkv/types.hpp"

namespace {

using thinkv::kNumPrecisions;
namespace tk = thinkv::kernels;
namespace tb = thinkv::bench;
using thinkv::bench::kL2FlushBytes;
using thinkv::bench::splitmix;

const thinkv::bench::NoGpuSkip g_no_gpu_skip{"bench_gather_compaction"};

constexpr int kD = 128;
constexpr int kG = 16;  // group size
constexpr int kB = 16;  // block size
constexpr int kKvPerSeq = 8;
constexpr double kMaxPageBytes = 64.0 * 1024 * 1024 * 1024;  // skip configurations above this

enum Mode : int { kModeBf16 = 0, kModeNvfp4, kModeR4E4T2, kNumModes };
const char* const kModeName[kNumModes] = {"BF16", "R4E4T4", "R4E4T2"};

int bits_of(int p) { return p == 0 ? 16 : p == 1 ? 8 : p == 2 ? 4 : 2; }
std::size_t row_bytes(int p) { return static_cast<std::size_t>(kD * bits_of(p) / 8); }
std::size_t vs_bytes(int p) { return p == 0 ? 0 : kD / kG; }
std::size_t page_bytes(int p) { return kB * (2 * row_bytes(p) + vs_bytes(p)); }

/// Precision pool of stream s in a mode.
int stream_precision(int mode, long s) {
  switch (mode) {
    case kModeBf16: return 0;
    case kModeNvfp4: return 2;
    default: return s % 3 == 2 ? 3 : 2;
  }
}

__global__ void fill_random(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  // 8 bytes per thread step; the tail byte by byte. Contents do not matter to a copy.
  const std::size_t words = n / 8;
  auto* w = reinterpret_cast<std::uint64_t*>(p);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t x = seed ^ (i * 0x9E3779B97F4A7C15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    w[i] = x;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (std::size_t i = words * 8; i < n; ++i) p[i] = static_cast<std::uint8_t>(i);
  }
}

struct Setup : thinkv::bench::DeviceAllocs {
  long tokens = 0, batch = 0, mode = 0, layers = 0;
  tb::GatherCompactionParams prm{};
  double bytes_read = 0, bytes_written = 0, tokens_moved = 0;
  int splits = 1;
  void* flush = nullptr;
  std::int32_t* live_counts = nullptr;
  std::string skip;  // non-empty: configuration skipped (too large)

  cudaError_t build() {
    std::uint64_t rng = 0xC0FFEEull + static_cast<std::uint64_t>(tokens * 131 + batch * 17 + mode * 7 + layers);
    const long S = batch * kKvPerSeq * layers;  // streams compacted by the launch
    const std::size_t src_per_stream = static_cast<std::size_t>(tokens / kB);
    const long live_per_stream = tokens / 2;
    const std::size_t dst_per_stream = static_cast<std::size_t>((live_per_stream + kB - 1) / kB);
    std::size_t count[kNumPrecisions] = {};
    for (long s = 0; s < S; ++s) count[stream_precision(static_cast<int>(mode), s)] += src_per_stream + dst_per_stream;
    double total_page_bytes = 0;
    for (int p = 0; p < kNumPrecisions; ++p) total_page_bytes += static_cast<double>(count[p]) * page_bytes(p);
    if (total_page_bytes > kMaxPageBytes) {
      skip = "pages above 64 GiB";
      return cudaSuccess;
    }
    tk::PagedKvView& view = prm.src;
    view.num_streams = static_cast<int>(S);
    std::uint32_t base = 0;
    for (int p = 0; p < kNumPrecisions; ++p) {
      view.pool_base[p] = base;
      view.pool_count[p] = static_cast<std::uint32_t>(count[p]);
      base += static_cast<std::uint32_t>(count[p]);
      if (count[p] > 0) {
        std::uint8_t* pg = nullptr;
        const std::size_t n = count[p] * page_bytes(p);
        BENCH_CUDA(alloc(pg, n));
        fill_random<<<4096, 256>>>(pg, n, splitmix(rng));
        BENCH_CUDA(cudaGetLastError());
        view.pages[p] = pg;
        prm.dst_pages[p] = pg;  // destinations are free blocks of the same pools
      }
    }
    const std::uint32_t N = base;
    view.total_blocks = N;
    std::vector<std::vector<std::uint32_t>> free_ids(kNumPrecisions);
    for (int p = 0; p < kNumPrecisions; ++p) {
      free_ids[p].resize(count[p]);
      std::iota(free_ids[p].begin(), free_ids[p].end(), view.pool_base[p]);
      for (std::size_t i = free_ids[p].size(); i > 1; --i)
        std::swap(free_ids[p][i - 1], free_ids[p][splitmix(rng) % i]);
    }
    std::vector<std::int32_t> indptr(static_cast<std::size_t>(S) + 1, 0), dindptr(indptr.size(), 0);
    std::vector<std::uint32_t> indices, dindices;
    indices.reserve(static_cast<std::size_t>(S) * src_per_stream);
    dindices.reserve(static_cast<std::size_t>(S) * dst_per_stream);
    std::vector<std::uint16_t> fill(N, 0);
    std::vector<std::uint64_t> mask(N, 0);
    std::vector<std::uint32_t> slot_rec(static_cast<std::size_t>(N) * kB, 0xFFFFFFFFu);
    std::size_t pos[kNumPrecisions] = {};
    std::uint32_t records = 0;
    for (long s = 0; s < S; ++s) {
      const int p = stream_precision(static_cast<int>(mode), s);
      for (std::size_t k = 0; k < src_per_stream; ++k) {
        const std::uint32_t b = free_ids[p][pos[p]++];
        indices.push_back(b);
        fill[b] = kB;
        int slots[kB];
        std::iota(slots, slots + kB, 0);
        for (int i = kB; i > 1; --i) std::swap(slots[i - 1], slots[splitmix(rng) % i]);
        std::uint64_t m = 0;
        for (int i = 0; i < kB / 2; ++i) m |= 1ull << slots[i];
        mask[b] = m;
        if (p != 0) {  // one key-scale record per group of 16 written slots
          for (int i = 0; i < kB; ++i)
            slot_rec[static_cast<std::size_t>(b) * kB + i] = records + static_cast<std::uint32_t>(k * kB / kG);
        }
      }
      if (p != 0) records += static_cast<std::uint32_t>(src_per_stream * kB / kG);
      for (std::size_t k = 0; k < dst_per_stream; ++k) dindices.push_back(free_ids[p][pos[p]++]);
      indptr[static_cast<std::size_t>(s) + 1] = static_cast<std::int32_t>(indices.size());
      dindptr[static_cast<std::size_t>(s) + 1] = static_cast<std::int32_t>(dindices.size());
      // Bytes: live tokens x (K row + V row + value scales + record id), read and written.
      const double per_tok = static_cast<double>(2 * row_bytes(p) + vs_bytes(p) + 4);
      bytes_read += live_per_stream * per_tok;
      bytes_written += live_per_stream * per_tok;
      tokens_moved += static_cast<double>(live_per_stream);
    }
    BENCH_CUDA(put(view.block_fill, fill));
    BENCH_CUDA(put(view.evict_mask, mask));
    BENCH_CUDA(put(view.slot_record, slot_rec));
    BENCH_CUDA(put(view.block_indptr, indptr));
    BENCH_CUDA(put(view.block_indices, indices));
    std::vector<std::int32_t> streams(static_cast<std::size_t>(S));
    std::iota(streams.begin(), streams.end(), 0);
    BENCH_CUDA(put(prm.streams, streams));
    BENCH_CUDA(put(prm.dst_indptr, dindptr));
    BENCH_CUDA(put(prm.dst_indices, dindices));
    // Destination metadata: the cache's own arrays (destinations are free blocks of the pools).
    prm.dst_block_fill = const_cast<std::uint16_t*>(view.block_fill);
    prm.dst_evict_mask = const_cast<std::uint64_t*>(view.evict_mask);
    prm.dst_slot_record = const_cast<std::uint32_t*>(view.slot_record);
    BENCH_CUDA(alloc(live_counts, static_cast<std::size_t>(S)));
    prm.live_counts = live_counts;
    prm.head_dim = kD;
    prm.group_size = kG;
    prm.block_size = kB;
    prm.num_streams = static_cast<int>(S);
    splits = tb::gather_compaction_splits(prm);
    // Metadata bytes (bytes_moved): per source block its list entry, fill and mask word, read
    // (counted once, although each of the stream's CTAs reads them, from L2 after the first); per
    // destination block its list entry read, fill and mask written (all destination blocks are
    // full: no record ids past the fill); per stream its id, two indptr pairs, live count.
    const double src_blocks = static_cast<double>(S) * static_cast<double>(src_per_stream);
    const double dst_blocks = static_cast<double>(S) * static_cast<double>(dst_per_stream);
    bytes_read += src_blocks * (4 + 2 + 8) + dst_blocks * 4 + static_cast<double>(S) * (4 + 8 + 8);
    bytes_written += dst_blocks * (2 + 8) + static_cast<double>(S) * 4;
    BENCH_CUDA(alloc(reinterpret_cast<std::uint8_t*&>(flush), kL2FlushBytes));
    BENCH_CUDA(cudaDeviceSynchronize());
    // Warm-up launch and a sanity check: every stream found tokens / 2 live tokens.
    BENCH_CUDA(tb::launch_gather_compaction(prm, nullptr));
    BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<std::int32_t> got(static_cast<std::size_t>(S));
    BENCH_CUDA(cudaMemcpy(got.data(), live_counts, got.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    for (std::int32_t x : got) {
      if (x != live_per_stream) {
        std::fprintf(stderr, "bench_gather_compaction: live count %d, expected %ld\n", x, live_per_stream);
        return cudaErrorUnknown;
      }
    }
    return cudaSuccess;
  }
};

thinkv::bench::SetupCache<Setup> g_setups;  // kept across the repetitions of one configuration

void BM_GatherCompaction(benchmark::State& state) {
  const long tokens = state.range(0), batch = state.range(1), mode = state.range(2), layers = state.range(3);
  Setup* setup = g_setups.get(state, {tokens, batch, mode, layers}, [&](Setup& s) {
    s.tokens = tokens;
    s.batch = batch;
    s.mode = mode;
    s.layers = layers;
  });
  if (setup == nullptr) return;
  Setup& su = *setup;
  if (!su.skip.empty()) {
    state.SkipWithError(su.skip.c_str());
    return;
  }
  const double med_s = thinkv::bench::time_launches(
      state, [&] { return tb::launch_gather_compaction(su.prm, nullptr); }, su.flush);
  if (med_s == 0.0) return;
  thinkv::bench::bandwidth_counters(state, su.bytes_read + su.bytes_written, med_s);
  state.counters["step_us"] = layers == 1 ? 32.0 * med_s * 1e6 : med_s * 1e6;
  state.counters["tokens_moved"] = su.tokens_moved;
  state.counters["ctas"] = static_cast<double>(su.prm.num_streams) * su.splits;
  state.SetLabel(std::string(kModeName[mode]) + (layers == 1 ? " 1 layer" : " 32 layers/launch") +
                 " evict50 (ThinKV: 0 B, 0 us)");
}

void Args(benchmark::internal::Benchmark* b) {
  for (long layers : {1L, 32L}) {
    for (long t : {1024L, 4096L}) {
      for (long batch : {1L, 8L, 32L, 64L}) {
        for (long mode = 0; mode < kNumModes; ++mode) b->Args({t, batch, mode, layers});
      }
    }
  }
}

BENCHMARK(BM_GatherCompaction)
    ->ArgNames({"tokens", "batch", "mode", "layers"})
    ->Apply(Args)
    ->UseManualTime()
    ->Iterations(10)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
