/// \file bench_paged_attention.cu
/// Google Benchmark of thinkv::kernels::launch_paged_decode_attention (decode, one token per
/// query head) on a synthetic compressed paged cache of Llama-3-8B attention shapes:
/// 32 query heads, 8 KV heads, head_dim 128, group 16, block 16.
///
/// Batch: DecodeAttentionParams covers one launch over num_kv_heads KV heads, KV head h reading cache
/// stream streams[h] with its own GQA group of query heads. A batch of B sequences is therefore
/// ONE launch with num_kv_heads = 8 * B, num_q_heads = 32 * B, streams[h] = h (each KV head's
/// query group is independent, so this is exactly B sequences' decode attention of one layer).
///
/// The cache is built directly on the device (no CPU PagedKvCache appends): pages are filled
/// with random bytes that decode to finite values (BF16 in +-[0.5, 2), E4M3 codes with the
/// exponent's top bit cleared, E4M3 scales in [0.5, 1)); s2 = 1; one key-scale record per 16
/// consecutive slots of a stream; block ids shuffled inside each pool (paged, not contiguous).
/// Eviction: 0% or 50% of every block's slots (exactly 8 of 16, random); the number of LIVE
/// tokens per stream is the benchmark argument, so 50% eviction doubles the slots walked.
/// No staged tokens (staged_count = 0). Sparsity output not requested.
///
/// Timing: CUDA events around each launch (UseManualTime); before each launch, outside the timed
/// region, a 2 x L2 (120 MiB) buffer is written with cudaMemsetAsync so every launch reads the
/// cache from HBM. Repetitions(5) + ReportAggregatesOnly: use the *_median rows.
/// Counters: bytes = bytes the kernel reads + writes (see bytes_moved() and docs/perf.md),
/// GBps = bytes / median event time of the repetition, frac_4p3TBs = GBps / 4300; splits (chunks per
/// KV head), kv_heads (per launch) and positions (slot positions per stream, the split plan's length
/// hint): the inputs and the choice of the split plan, for bench/tools/split_sweep.py.
/// Split-K: the automatic number of chunks per KV head (paged_decode_attention_splits), workspace
/// allocated once per configuration; the partial (m, l, acc) traffic through the workspace and the
/// merge kernel are inside the timed region but not counted in `bytes`. THINKV_BENCH_SPLITS=N
/// (1..kMaxSplits) sets the number of chunks instead, to measure the plan's choice against its
/// neighbours; THINKV_BENCH_SPLIT_HINT=0 plans without the length hint (waves only).
/// Exits 77 (skip) when no CUDA device is present.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_bench.cuh"
#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/types.hpp"

namespace {

using thinkv::kNumPrecisions;
using thinkv::Precision;
namespace tk = thinkv::kernels;

constexpr int kD = 128;
constexpr int kG = 16;  // group size
constexpr int kB = 16;  // block size
constexpr int kQPerSeq = 32;
constexpr int kKvPerSeq = 8;
using thinkv::bench::hash32;
using thinkv::bench::kCeilingGBps;
using thinkv::bench::kL2FlushBytes;
using thinkv::bench::splitmix;

const thinkv::bench::NoGpuSkip g_no_gpu_skip{"bench_paged_attention"};

// Precision modes of the benchmark (argument 2).
enum Mode : int { kModeBf16 = 0, kModeFp8, kModeNvfp4, kModeTernary, kModeR4E4T2, kNumModes };
const char* const kModeName[kNumModes] = {"BF16", "R8E8T8", "R4E4T4", "R2E2T2", "R4E4T2"};
/// Not in the matrix (BM_ModelStep's layout 1): R4E4T2 with the precision changing only at
/// thought-segment edges, as ThinKV's caches do: runs of 8 blocks (128 tokens, one segment) whose
/// thought cycles R, E, T, so every third segment is ternary (the same 2:1 byte mix as kModeR4E4T2,
/// whose every third *block* is ternary: a worst case for the kernels' per-precision grouping).
constexpr int kModeR4E4T2Segments = kNumModes;
constexpr int kSegmentBlocks = 8;

int bits_of(int p) { return p == 0 ? 16 : p == 1 ? 8 : p == 2 ? 4 : 2; }
std::size_t row_bytes(int p) { return static_cast<std::size_t>(kD * bits_of(p) / 8); }
std::size_t page_bytes(int p) { return kB * (2 * row_bytes(p) + (p == 0 ? 0 : kD / kG)); }

/// Block precision of the k-th block of a stream in a mode. R4E4T2: every third block ternary
/// (transition thoughts), the others NVFP4; R4E4T2 segments: every third 8-block segment ternary.
int block_precision(int mode, std::size_t k) {
  switch (mode) {
    case kModeBf16: return 0;
    case kModeFp8: return 1;
    case kModeNvfp4: return 2;
    case kModeTernary: return 3;
    case kModeR4E4T2Segments: return (k / kSegmentBlocks) % 3 == 2 ? 3 : 2;
    default: return k % 3 == 2 ? 3 : 2;
  }
}

/// Random page bytes that decode to finite values; E4M3 scale bytes in [0.5, 1).
__global__ void fill_pages(std::uint8_t* pages, std::size_t n, std::size_t pb, std::size_t data_bytes, int precision,
                           std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t r = hash32(seed ^ (i * 0x9E3779B97F4A7C15ull));
    const std::size_t off = i % pb;
    std::uint8_t b;
    if (off >= data_bytes) {
      b = static_cast<std::uint8_t>(0x30 | (r & 0x07));  // E4M3 exponent 6: [0.5, 1)
    } else if (precision == 0) {
      // little-endian BF16: high byte = sign | 0x3F -> exponent 0x7E or 0x7F, |x| in [0.5, 2)
      b = (off & 1) ? static_cast<std::uint8_t>((r & 0x80) | 0x3F) : static_cast<std::uint8_t>(r);
    } else if (precision == 1) {
      b = static_cast<std::uint8_t>(r & 0xBF);  // E4M3, exponent top bit cleared: never NaN
    } else {
      b = static_cast<std::uint8_t>(r);  // E2M1 / ternary codes: all finite
    }
    pages[i] = b;
  }
}

__global__ void fill_bytes_sane_e4m3(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<std::uint8_t>(0x30 | (hash32(seed ^ (i * 0x9E3779B97F4A7C15ull)) & 0x07));
  }
}

/// The synthetic cache, the launch parameters and the byte count of one configuration.
struct Setup : thinkv::bench::DeviceAllocs {
  long tokens = 0, batch = 0, mode = 0, evict_pct = 0;
  long long positions = 0;  // slot positions per stream (the split plan's length hint)
  tk::PagedKvView view{};
  tk::DecodeAttentionParams prm{};
  double bytes_read = 0, bytes_written = 0;
  int splits = 1;
  void* flush = nullptr;

  cudaError_t build() {
    std::uint64_t rng = 0x5EEDull + static_cast<std::uint64_t>(tokens * 131 + batch * 17 + mode * 7 + evict_pct);
    const int S = static_cast<int>(batch * kKvPerSeq);
    const int live_per_block = evict_pct == 50 ? kB / 2 : kB;
    const std::size_t blocks_per_stream = static_cast<std::size_t>((tokens + live_per_block - 1) / live_per_block);
    // Blocks per precision over all streams.
    std::size_t count[kNumPrecisions] = {};
    std::vector<std::uint8_t> bprec(static_cast<std::size_t>(S) * blocks_per_stream);
    for (int s = 0; s < S; ++s) {
      for (std::size_t k = 0; k < blocks_per_stream; ++k) {
        const int p = block_precision(static_cast<int>(mode), k);
        bprec[static_cast<std::size_t>(s) * blocks_per_stream + k] = static_cast<std::uint8_t>(p);
        ++count[p];
      }
    }
    view.num_streams = S;
    std::uint32_t base = 0;
    for (int p = 0; p < kNumPrecisions; ++p) {
      view.pool_base[p] = base;
      view.pool_count[p] = static_cast<std::uint32_t>(count[p]);
      base += static_cast<std::uint32_t>(count[p]);
      if (count[p] > 0) {
        std::uint8_t* pg = nullptr;
        const std::size_t n = count[p] * page_bytes(p);
        BENCH_CUDA(alloc(pg, n));
        fill_pages<<<2048, 256>>>(pg, n, page_bytes(p), 2 * kB * row_bytes(p), p, splitmix(rng));
        BENCH_CUDA(cudaGetLastError());
        view.pages[p] = pg;
      }
    }
    const std::uint32_t N = base;
    view.total_blocks = N;
    // Shuffled block ids inside each pool.
    std::vector<std::vector<std::uint32_t>> free_ids(kNumPrecisions);
    for (int p = 0; p < kNumPrecisions; ++p) {
      free_ids[p].resize(count[p]);
      std::iota(free_ids[p].begin(), free_ids[p].end(), view.pool_base[p]);
      for (std::size_t i = free_ids[p].size(); i > 1; --i) {
        std::swap(free_ids[p][i - 1], free_ids[p][splitmix(rng) % i]);
      }
    }
    std::vector<std::int32_t> indptr(static_cast<std::size_t>(S) + 1, 0);
    std::vector<std::uint32_t> indices(static_cast<std::size_t>(S) * blocks_per_stream);
    std::vector<std::uint16_t> fill(N, kB);
    std::vector<std::uint64_t> mask(N, 0);
    std::vector<std::uint32_t> slot_rec(static_cast<std::size_t>(N) * kB, 0xFFFFFFFFu);
    std::uint32_t records = 0;
    std::size_t live_slots = 0, quant_live_slots = 0, blocks_total = 0;
    std::size_t pos[kNumPrecisions] = {};
    for (int s = 0; s < S; ++s) {
      long remaining = tokens;
      const std::uint32_t rec_base = records;
      std::size_t slot_in_stream = 0;
      bool quant_stream = false;
      for (std::size_t k = 0; k < blocks_per_stream; ++k) {
        const int p = bprec[static_cast<std::size_t>(s) * blocks_per_stream + k];
        const std::uint32_t b = free_ids[p][pos[p]++];
        indices[static_cast<std::size_t>(s) * blocks_per_stream + k] = b;
        // Slots of the block: all 16 written; live = min(live_per_block, remaining) of them.
        const int live = static_cast<int>(std::min<long>(live_per_block, remaining));
        remaining -= live;
        std::uint64_t m = 0;
        if (live < kB) {  // evict kB - live random slots
          int slots[kB];
          std::iota(slots, slots + kB, 0);
          for (int i = kB; i > 1; --i) std::swap(slots[i - 1], slots[splitmix(rng) % i]);
          for (int i = 0; i < kB - live; ++i) m |= 1ull << slots[i];
        }
        mask[b] = m;
        for (int i = 0; i < kB; ++i, ++slot_in_stream) {
          if (p != 0) {
            slot_rec[static_cast<std::size_t>(b) * kB + i] = rec_base + static_cast<std::uint32_t>(slot_in_stream / kG);
            quant_stream = true;
          }
        }
        live_slots += live;
        if (p != 0) quant_live_slots += live;
        bytes_read += static_cast<double>(live) * (2.0 * row_bytes(p) + (p == 0 ? 0 : kD / kG));
        ++blocks_total;
      }
      if (quant_stream) records += static_cast<std::uint32_t>((slot_in_stream + kG - 1) / kG);
      indptr[static_cast<std::size_t>(s) + 1] = static_cast<std::int32_t>((s + 1) * blocks_per_stream);
    }
    // Key scales: every record has a live slot (a record spans 16 slots, at most 8 evicted).
    // Records of all-BF16 streams are never read; R4E4T2 streams read only their quantized blocks'
    // records (those spanning a BF16 block do not exist there: no BF16 blocks in any mode but BF16).
    if (records > 0) {
      std::uint8_t* ks = nullptr;
      BENCH_CUDA(alloc(ks, static_cast<std::size_t>(records) * kD));
      fill_bytes_sane_e4m3<<<1024, 256>>>(ks, static_cast<std::size_t>(records) * kD, splitmix(rng));
      BENCH_CUDA(cudaGetLastError());
      view.key_scales = ks;
    }
    bytes_read += static_cast<double>(records) * kD;
    std::vector<float> s2(static_cast<std::size_t>(S) * 2 * kNumPrecisions, 1.0f);
    std::vector<std::uint16_t> staging(static_cast<std::size_t>(S) * 2 * kG * kD, 0x3F80);
    std::vector<std::int32_t> staged(static_cast<std::size_t>(S), 0);
    BENCH_CUDA(put(view.s2, s2));
    BENCH_CUDA(put(view.block_fill, fill));
    BENCH_CUDA(put(view.evict_mask, mask));
    BENCH_CUDA(put(view.slot_record, slot_rec));
    BENCH_CUDA(put(view.block_indptr, indptr));
    BENCH_CUDA(put(view.block_indices, indices));
    BENCH_CUDA(put(view.staging, staging));
    BENCH_CUDA(put(view.staged_count, staged));
    // Metadata the kernel reads: per live slot of a quantized block its record id (u32; BF16
    // blocks have no key-scale record); per block its list entry (u32), fill (u16), evict-mask word (u64); per KV head
    // indptr[s], indptr[s + 1], staged_count[s], streams[h], s2 K and V of its precisions.
    const int precisions_used = mode == kModeR4E4T2 || mode == kModeR4E4T2Segments ? 2 : 1;
    bytes_read += static_cast<double>(quant_live_slots) * 4 + static_cast<double>(blocks_total) * (4 + 2 + 8) +
                  static_cast<double>(S) * (8 + 4 + 4 + 8.0 * precisions_used);
    (void)live_slots;

    const int Hq = static_cast<int>(batch * kQPerSeq);
    std::vector<float> q(static_cast<std::size_t>(Hq) * kD);
    for (auto& x : q) x = static_cast<float>(static_cast<double>(splitmix(rng) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    std::vector<std::int32_t> streams(static_cast<std::size_t>(S));
    std::iota(streams.begin(), streams.end(), 0);
    float* out = nullptr;
    BENCH_CUDA(alloc(out, static_cast<std::size_t>(Hq) * kD));
    prm.num_q_heads = Hq;
    prm.num_kv_heads = S;
    prm.head_dim = kD;
    prm.group_size = kG;
    prm.block_size = kB;
    BENCH_CUDA(put(prm.streams, streams));
    BENCH_CUDA(put(prm.q, q));
    prm.out = out;
    bytes_read += static_cast<double>(Hq) * kD * 4;    // q
    bytes_written = static_cast<double>(Hq) * kD * 4;  // out
    positions = static_cast<long long>(blocks_per_stream) * kB;
    // The split plan's hint (the longest stream's slot positions), as CudaKvBackend passes it;
    // THINKV_BENCH_SPLIT_HINT=0 plans without it (waves only), for comparison.
    const char* hint = std::getenv("THINKV_BENCH_SPLIT_HINT");
    if (hint == nullptr || std::strcmp(hint, "0") != 0) { prm.max_positions = positions; }
    // A fixed number of chunks (THINKV_BENCH_SPLITS), else the launch's automatic plan.
    if (const char* fixed = std::getenv("THINKV_BENCH_SPLITS"); fixed != nullptr && *fixed != '\0') {
      char* end = nullptr;
      const long n = std::strtol(fixed, &end, 10);
      if (*end != '\0' || n < 1 || n > tk::kMaxSplits) {
        std::fprintf(stderr, "bench_paged_attention: THINKV_BENCH_SPLITS=%s is not a number in 1..%d\n", fixed,
                     tk::kMaxSplits);
        return cudaErrorInvalidValue;
      }
      prm.num_splits = static_cast<int>(n);
    }
    // Split-K workspace, allocated once per configuration.
    std::uint8_t* ws = nullptr;
    BENCH_CUDA(alloc(ws, tk::paged_decode_attention_workspace_size(prm)));
    prm.workspace = ws;
    splits = tk::paged_decode_attention_splits(prm);
    BENCH_CUDA(alloc(reinterpret_cast<std::uint8_t*&>(flush), kL2FlushBytes));
    BENCH_CUDA(cudaDeviceSynchronize());
    // Warm-up launch, and a finiteness check of its output.
    BENCH_CUDA(tk::launch_paged_decode_attention(view, prm, nullptr));
    BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<float> h(static_cast<std::size_t>(Hq) * kD);
    BENCH_CUDA(cudaMemcpy(h.data(), out, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (float x : h) {
      if (!(x == x) || x > 1e30f || x < -1e30f) {
        std::fprintf(stderr, "bench_paged_attention: non-finite output\n");
        return cudaErrorUnknown;
      }
    }
    return cudaSuccess;
  }
};

thinkv::bench::SetupCache<Setup> g_setups;  // kept across the repetitions of one configuration

void BM_PagedDecodeAttention(benchmark::State& state) {
  const long tokens = state.range(0), batch = state.range(1), mode = state.range(2), ev = state.range(3);
  Setup* setup = g_setups.get(state, {tokens, batch, mode, ev}, [&](Setup& s) {
    s.tokens = tokens;
    s.batch = batch;
    s.mode = mode;
    s.evict_pct = ev;
  });
  if (setup == nullptr) return;
  Setup& su = *setup;
  const double med_s = thinkv::bench::time_launches(
      state, [&] { return tk::launch_paged_decode_attention(su.view, su.prm, nullptr); }, su.flush);
  if (med_s == 0.0) return;
  thinkv::bench::bandwidth_counters(state, su.bytes_read + su.bytes_written, med_s);
  state.counters["ctas"] = static_cast<double>(su.prm.num_kv_heads) * su.splits;
  state.counters["splits"] = static_cast<double>(su.splits);
  state.counters["kv_heads"] = static_cast<double>(su.prm.num_kv_heads);
  state.counters["positions"] = static_cast<double>(su.positions);
  state.SetLabel(kModeName[mode] + std::string(ev ? " evict50" : " evict0"));
}

void Args(benchmark::internal::Benchmark* b) {
  for (long t : {512L, 4096L, 32768L}) {
    for (long batch : {1L, 8L, 32L, 64L, 256L}) {
      if (batch == 256 && t > 4096) continue;  // 34-68 GB of BF16 pages: skipped
      for (long mode = 0; mode < kNumModes; ++mode) {
        for (long ev : {0L, 50L}) b->Args({t, batch, mode, ev});
      }
    }
  }
}

BENCHMARK(BM_PagedDecodeAttention)
    ->ArgNames({"tokens", "batch", "mode", "evict"})
    ->Apply(Args)
    ->UseManualTime()
    ->Iterations(10)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

/// One decode step's attention of the whole model: 32 layers of Llama-3-8B attention at batch
/// 64, 1024 live tokens per stream (the budget), R4E4T2 (argument 0: 0% or 50% evicted slots),
/// as 32 launches in sequence (each layer reads its own 512 streams: the cache of all layers is
/// one synthetic cache of 64 x 32 sequences), L2 flushed once before the step. Argument 1:
/// 0 = plain launches, 1 = the 32 launches captured once in a CUDA graph and replayed. Argument 2
/// (layout): 0 = every third block ternary (kModeR4E4T2, the matrix's mix), 1 = every third
/// 128-token thought segment ternary (kModeR4E4T2Segments, how ThinKV lays a stream out).
void BM_ModelStep(benchmark::State& state) {
  constexpr int kLayers = 32;
  const long ev = state.range(0), graph = state.range(1), layout = state.range(2);
  const long batch = 64, tokens = 1024;
  const long mode = layout ? kModeR4E4T2Segments : kModeR4E4T2;
  Setup* setup = g_setups.get(state, {tokens, batch * kLayers, mode, ev}, [&](Setup& s) {
    s.tokens = tokens;
    s.batch = batch * kLayers;
    s.mode = mode;
    s.evict_pct = ev;
  });
  if (setup == nullptr) return;
  Setup& su = *setup;
  const int hkv = static_cast<int>(batch * kKvPerSeq), hq = static_cast<int>(batch * kQPerSeq);
  std::vector<tk::DecodeAttentionParams> layer(kLayers, su.prm);
  void* ws = nullptr;
  for (int l = 0; l < kLayers; ++l) {
    auto& p = layer[static_cast<std::size_t>(l)];
    p.num_kv_heads = hkv;
    p.num_q_heads = hq;
    p.streams = su.prm.streams + static_cast<std::size_t>(l) * hkv;
    p.q = su.prm.q + static_cast<std::size_t>(l) * hq * kD;
    p.out = su.prm.out + static_cast<std::size_t>(l) * hq * kD;
  }
  const std::size_t ws_bytes = tk::paged_decode_attention_workspace_size(layer[0]);
  if (cudaMalloc(&ws, ws_bytes) != cudaSuccess) {
    state.SkipWithError("workspace");
    return;
  }
  for (auto& p : layer) p.workspace = ws;  // launches are serial on one stream
  cudaStream_t stream = nullptr;
  (void)cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  auto step = [&]() -> cudaError_t {
    for (const auto& p : layer) {
      if (cudaError_t e = tk::launch_paged_decode_attention(su.view, p, stream); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaGraph_t g = nullptr;
    (void)cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
    const cudaError_t e = step();
    (void)cudaStreamEndCapture(stream, &g);
    if (e != cudaSuccess || g == nullptr || cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) {
      state.SkipWithError("graph capture failed");
      (void)cudaGetLastError();
      return;
    }
    (void)cudaGraphDestroy(g);
  }
  const double med_s = thinkv::bench::time_launches(
      state, [&] { return graph ? cudaGraphLaunch(exec, stream) : step(); }, su.flush, stream);
  if (exec) (void)cudaGraphExecDestroy(exec);
  (void)cudaStreamDestroy(stream);
  (void)cudaFree(ws);
  if (med_s == 0.0) return;
  const double bytes = su.bytes_read + su.bytes_written;  // all 32 layers
  thinkv::bench::bandwidth_counters(state, bytes, med_s);
  state.counters["roofline_us"] = bytes / (kCeilingGBps * 1e9) * 1e6;
  state.counters["splits"] = static_cast<double>(tk::paged_decode_attention_splits(layer[0]));
  state.counters["kv_heads"] = static_cast<double>(hkv);  // per launch (layer)
  state.counters["positions"] = static_cast<double>(su.positions);
  state.SetLabel(std::string("32 layers R4E4T2 batch 64 budget 1024") + (layout ? " segments" : " per-block") +
                 (ev ? " evict50" : " evict0") + (graph ? " graph" : " launches"));
}

BENCHMARK(BM_ModelStep)
    ->ArgNames({"evict", "graph", "layout"})
    ->Args({0, 0, 0})
    ->Args({0, 1, 0})
    ->Args({50, 0, 0})
    ->Args({50, 1, 0})
    ->Args({0, 0, 1})
    ->Args({0, 1, 1})
    ->Args({50, 0, 1})
    ->Args({50, 1, 1})
    ->UseManualTime()
    ->Iterations(10)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
