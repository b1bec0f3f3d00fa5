#pragma once
/// \file paged_attention_common.cuh
/// Device pieces shared by the decode-attention translation units (paged_attention.cu: the
/// CUDA-core main pass for small head_dim, the merge and the exact sparsity passes;
/// paged_attention_tc.cu: the tensor-core main pass): the chunk walk over a stream's blocks, the
/// workspace layout, raw row loads and the exact bit-placement dequantization. Private to
/// kernels/ (not installed).

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "thinkv/formats/bf16.hpp"
#include "thinkv/formats/fp16_placement.hpp"
#include "thinkv/formats/group_quant.hpp"
#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/paged/layout.hpp"

namespace thinkv::kernels::detail {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
/// The tensor-core main pass cuts a stream's positions into chunks of whole pieces of this many
/// slot positions; the split plan (plan_decode_splits_for_length) counts its cost in the same
/// pieces, so both read this one constant.
constexpr int kTcChunkPiece = 128;
constexpr std::uint32_t kNoRecordId = 0xFFFFFFFFu;

/// Where one tile's slots come from: a block (slot = base + t) or the staging buffer (row).
struct TileSource {
  bool staged;
  std::uint32_t block;
  int precision;
  const std::uint8_t* page;
  int base;   // first slot / staging row of the tile
  int limit;  // end of the tile's slot range (<= fill) or of its staging rows
};

/// Workspace layout (all offsets 16-byte aligned).
struct Workspace {
  float* acc;      // [Hkv * splits * G, D]
  float* ml;       // [Hkv * splits * G, 2] (m, l)
  int* ntok;       // [Hkv * splits] live tokens of each chunk
  unsigned* smax;  // [Hq] exact row max of the sparsity pass (ordered_key)
  int* count;      // [Hq] sparsity counts
  int* total;      // [Hkv] tokens per KV head
  // Non-null when a launch has one chunk per KV head and no sparsity: the main pass writes the
  // attention output [Hq, D] here itself (acc / l, bit for bit what the merge would write from its
  // one chunk) and no merge kernel runs.
  float* out;
};

__host__ __device__ inline std::size_t align16(std::size_t x) { return (x + 15) & ~std::size_t{15}; }

__host__ __device__ inline std::size_t workspace_bytes(int hq, int hkv, int d, int splits, Workspace* w, void* base) {
  const std::size_t parts = static_cast<std::size_t>(hkv) * splits * (hq / hkv);
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += align16(bytes);
    return static_cast<char*>(base) + at;
  };
  char* acc = take(parts * d * sizeof(float));
  char* ml = take(parts * 2 * sizeof(float));
  char* ntok = take(static_cast<std::size_t>(hkv) * splits * sizeof(int));
  char* smax = take(static_cast<std::size_t>(hq) * sizeof(unsigned));
  char* count = take(static_cast<std::size_t>(hq) * sizeof(int));
  char* total = take(static_cast<std::size_t>(hkv) * sizeof(int));
  if (w != nullptr) {
    w->acc = reinterpret_cast<float*>(acc);
    w->ml = reinterpret_cast<float*>(ml);
    w->ntok = reinterpret_cast<int*>(ntok);
    w->smax = reinterpret_cast<unsigned*>(smax);
    w->count = reinterpret_cast<int*>(count);
    w->total = reinterpret_cast<int*>(total);
    w->out = nullptr;
  }
  return off;
}

/// Chunk `split` of a stream's slot positions (its blocks' slots in list order, then its staged
/// rows): [lo, hi), the stream's total cut into `splits` pieces rounded up to whole `align`-position
/// pieces (the last one shorter; lo >= hi: an empty chunk). block_pos = the stream's block slots.
struct ChunkRange {
  int j_begin;          // first entry of the stream's blocks in block_indices
  long long nb;         // its blocks
  long long block_pos;  // nb * block_size: positions below are block slots, above staging rows
  long long lo, hi;
};

__device__ inline ChunkRange chunk_range(const PagedKvView& view, int stream, long long bs, int split, int splits,
                                         long long align) {
  ChunkRange r;
  r.j_begin = view.block_indptr[stream];
  r.nb = view.block_count != nullptr ? view.block_count[stream] : view.block_indptr[stream + 1] - r.j_begin;
  r.block_pos = r.nb * bs;
  const long long total = r.block_pos + view.staged_count[stream];
  long long chunk = (total + splits - 1) / splits;
  chunk = (chunk + align - 1) / align * align;
  if (chunk < align) chunk = align;
  r.lo = static_cast<long long>(split) * chunk;
  r.hi = r.lo + chunk < total ? r.lo + chunk : total;
  return r;
}

/// The precision pool of global block b (pools are consecutive: PoolMap).
__device__ inline int block_pool(const PagedKvView& view, std::uint32_t b) {
  for (int q = kNumPrecisions - 1; q > 0; --q) {
    if (b >= view.pool_base[q]) return q;
  }
  return 0;
}

/// Bytes of one page of pool p (layout: PagedKvView::pages): CacheLayout's, the one formula.
__host__ __device__ inline std::size_t page_bytes_of(Precision p, int d, long long bs, int g) {
  return static_cast<std::size_t>(CacheLayout{d, g, static_cast<int>(bs)}.page_bytes(p));
}

/// The page of global block b of pool pr, given that pool's page size in bytes.
__device__ inline const std::uint8_t* pool_page(const PagedKvView& view, std::uint32_t b, int pr,
                                                std::size_t page_bytes) {
  return view.pages[pr] + (b - view.pool_base[pr]) * page_bytes;
}

/// Where block 0 of pool pr's numbering would start (pages[pr] - pool_base[pr] x page_bytes,
/// modulo 2^64): the page of block b of that pool is pool_origin + b x page_bytes, the same
/// address as pool_page with one multiply-add (the tensor-core walk keeps it in shared memory).
__device__ inline std::uint64_t pool_origin(const PagedKvView& view, int pr, std::uint64_t page_bytes) {
  return reinterpret_cast<std::uintptr_t>(view.pages[pr]) - static_cast<std::uint64_t>(view.pool_base[pr]) * page_bytes;
}

/// The page of global block b of pool pr (page layout: PagedKvView::pages).
template <int D>
__device__ inline const std::uint8_t* block_page(const PagedKvView& view, std::uint32_t b, int pr, long long bs,
                                                 int g) {
  return pool_page(view, b, pr, page_bytes_of(static_cast<Precision>(pr), D, bs, g));
}

/// Calls fn(src) for every tile of chunk `split` of the stream's positions (blocks in list order,
/// then staging rows). All threads see the same values (block-uniform).
/// kWarpLoads (only when the 32 lanes of a warp call it together): the block ids and fills of 32
/// blocks at a time are loaded by the warp's lanes in parallel and broadcast by shuffles, instead
/// of two dependent global loads per block in every thread's critical path; and the chunk's tiles
/// are dealt round robin to the CTA's kWarps warps (tile i to warp i % kWarps): fn sees only the
/// calling warp's tiles, and a block without one costs two shuffles and a few integer operations.
template <int D, int kTile, int kAlign, bool kWarpLoads = false, typename Fn>
__device__ void for_each_chunk_tile(const PagedKvView& view, const DecodeAttentionParams& prm, int stream, int split,
                                    int splits, Fn&& fn) {
  const int g = prm.group_size;
  const long long bs = prm.block_size;
  const ChunkRange cr = chunk_range(view, stream, bs, split, splits, kAlign);
  const int j_begin = cr.j_begin;
  const long long block_pos = cr.block_pos, lo = cr.lo, hi = cr.hi;
  if (lo >= hi) return;
  const long long bhi = hi < block_pos ? hi : block_pos;
  const long long j_lo = lo / bs;
  const long long j_hi = bhi > 0 ? (bhi + bs - 1) / bs : 0;  // blocks j with j * bs < bhi
  constexpr int kBatch = kWarpLoads ? 32 : 1;
  constexpr long long kStep = kWarpLoads ? static_cast<long long>(kTile) * kWarps : kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  int tile = 0;  // tiles of the chunk so far (kWarpLoads: dealt round robin to the warps)
  (void)warp;
  (void)tile;
  for (long long j0 = j_lo; j0 < j_hi; j0 += kBatch) {
    std::uint32_t lane_block = 0;
    int lane_fill = 0;
    if constexpr (kWarpLoads) {
      const int lane = static_cast<int>(threadIdx.x) & 31;
      if (j0 + lane < j_hi) {
        lane_block = view.block_indices[j_begin + j0 + lane];
        lane_fill = view.block_fill[lane_block];
      }
    }
    const int count = j_hi - j0 < kBatch ? static_cast<int>(j_hi - j0) : kBatch;
    for (int i = 0; i < count; ++i) {
      const long long j = j0 + i;
      std::uint32_t b;
      int fill;
      if constexpr (kWarpLoads) {
        b = __shfl_sync(0xFFFFFFFFu, lane_block, i);
        fill = __shfl_sync(0xFFFFFFFFu, lane_fill, i);
      } else {
        b = view.block_indices[j_begin + j];
        fill = view.block_fill[b];
      }
      const long long a = lo > j * bs ? lo - j * bs : 0;
      long long e = bhi - j * bs;
      if (e > bs) e = bs;
      if (e > fill) e = fill;
      if (e <= a) continue;
      long long first = a;  // first tile of this block to hand to fn
      if constexpr (kWarpLoads) {
        const int nt = static_cast<int>((e - a + kTile - 1) / kTile);
        const int mine = (warp - tile % kWarps + kWarps) % kWarps;  // this warp's first tile here
        tile += nt;
        if (mine >= nt) continue;
        first = a + static_cast<long long>(mine) * kTile;
      }
      const int pr = block_pool(view, b);
      const std::uint8_t* page = block_page<D>(view, b, pr, bs, g);
      for (long long base = first; base < e; base += kStep) {
        fn(TileSource{false, b, pr, page, static_cast<int>(base), static_cast<int>(e)});
      }
    }
  }
  if (hi > block_pos) {
    const long long a = lo > block_pos ? lo - block_pos : 0;
    const long long e = hi - block_pos;
    long long first = a;
    if constexpr (kWarpLoads) first = a + static_cast<long long>((warp - tile % kWarps + kWarps) % kWarps) * kTile;
    for (long long base = first; base < e; base += kStep) {
      fn(TileSource{true, 0, static_cast<int>(Precision::kBf16), nullptr, static_cast<int>(base), static_cast<int>(e)});
    }
  }
}

constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct WarpShape {
  static constexpr int kVec = 8;                      // channels per lane
  static constexpr int kLpt = D / kVec;               // lanes per token
  static constexpr int kTpi = 32 / kLpt;              // tokens per iteration
  static constexpr int kWin = kTpi > 16 ? kTpi : 16;  // slot positions per warp tile
  static constexpr int kIters = kWin / kTpi;
  static_assert(D % kVec == 0 && kLpt >= 1 && kLpt <= 32 && 32 % kLpt == 0, "head_dim");
};

/// Raw bits of one lane's 8 channels of one row.
template <int P>
struct Raw {
  uint4 w;  // BF16: 16 bytes; FP8: .x, .y; NVFP4: .x; ternary: low 16 bits of .x
};

template <int P>
constexpr int raw_bytes() {
  return P == 0 ? 16 : P == 1 ? 8 : P == 2 ? 4 : 2;
}

/// Loads the lane's raw bytes at p (vector load when `vec`, i.e. p is raw_bytes-aligned).
template <int P>
__device__ __forceinline__ Raw<P> load_raw(const std::uint8_t* p, bool vec) {
  Raw<P> r;
  r.w = make_uint4(0u, 0u, 0u, 0u);
  if (vec) {
    if constexpr (P == 0) {
      r.w = __ldg(reinterpret_cast<const uint4*>(p));
    } else if constexpr (P == 1) {
      const uint2 t = __ldg(reinterpret_cast<const uint2*>(p));
      r.w.x = t.x;
      r.w.y = t.y;
    } else if constexpr (P == 2) {
      r.w.x = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else {
      r.w.x = __ldg(reinterpret_cast<const unsigned short*>(p));
    }
    return r;
  }
  std::uint32_t b[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < raw_bytes<P>(); ++i) b[i / 4] |= static_cast<std::uint32_t>(__ldg(p + i)) << (8 * (i % 4));
  r.w = make_uint4(b[0], b[1], b[2], b[3]);
  return r;
}

/// Two E4M3 codes (bytes 0 and 1 of `w`) -> two floats times 2^-8, exactly: the 7 exponent and
/// mantissa bits placed at bits 13..7 of an FP16 (bias 15 instead of 7; E4M3 subnormals land on
/// FP16 subnormals with the same factor). Codes 0x7F / 0xFF (NaN) are never stored (the encoder
/// saturates finite inputs and the cache refuses NaN).
__device__ __forceinline__ float2 e4m3x2_scaled(std::uint32_t w) {
  const std::uint32_t h = e4m3x2_to_fp16x2(w);  // thinkv/formats/fp16_placement.hpp
  return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu))),
                     __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16))));
}

/// Two E2M1 codes (nibbles 0 and 1 of `w`) -> two floats times 2^-14, exactly (exponent and
/// mantissa bits at FP16 bits 11..9).
__device__ __forceinline__ float2 e2m1x2_scaled(std::uint32_t w) {
  const std::uint32_t h = e2m1x2_to_fp16x2(w);
  return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu))),
                     __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16))));
}

/// The lane's 8 elements, before scaling, times elem_factor<P>() (exact).
template <int P>
__device__ __forceinline__ void decode_raw(const Raw<P>& r, float (&x)[8]) {
  if constexpr (P == 0) {
    const std::uint32_t w[4] = {r.w.x, r.w.y, r.w.z, r.w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else if constexpr (P == 1) {
    const std::uint32_t w[2] = {r.w.x, r.w.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = e4m3x2_scaled(w[i / 2] >> (16 * (i % 2)));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else if constexpr (P == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = e2m1x2_scaled(r.w.x >> (8 * i));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t t = (r.w.x >> (2 * i)) & 3u;  // 0 -> 0, 1 -> +1, 3 -> -1 (2 -> -0)
      x[i] = __uint_as_float(((t & 1u) * 0x3F800000u) | ((t & 2u) << 30));
    }
  }
}

/// decode_raw's elements come out DIVIDED by this power of two (2^8 for E4M3, 2^14 for E2M1),
/// so the scales they are multiplied by are multiplied by it (exact: powers of two).
template <int P>
constexpr float elem_unscale() {
  return P == 1 ? kE4M3Fp16Unscale : P == 2 ? kE2M1Fp16Unscale : 1.0f;
}

/// Merges the CTA's kWarps partial (m in log2 units, l, acc) per query head, which the warps left
/// in shared memory (published by a __syncthreads()), and writes the chunk's partial to the
/// workspace: acc_out[h * D + c], ml_out[2h] = m, ml_out[2h + 1] = l for h < group, and the
/// chunk's token count to *ntok_out. A warp without tokens (l = 0) takes no part; NaN propagates.
template <int G, int D>
__device__ void merge_warps_to_workspace(const float (&m)[kWarps][G], const float (&l)[kWarps][G],
                                         const float (&acc)[kWarps][G][D], const int (&ntok)[kWarps], int group,
                                         float* acc_out, float* ml_out, int* ntok_out, float* direct_out = nullptr) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < group * D; i += kThreads) {
    const int h = i / D;
    const int c = i % D;
    float mm = -INFINITY;
    for (int w = 0; w < kWarps; ++w) {
      if (l[w][h] > 0.0f || l[w][h] != l[w][h]) mm = fmaxf(mm, m[w][h]);
    }
    float a = 0.0f, ls = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float lw = l[w][h];
      if (!(lw > 0.0f) && lw == lw) continue;  // no token in this warp (NaN propagates)
      const float fw = exp2f(m[w][h] - mm);
      a += acc[w][h][c] * fw;
      ls += lw * fw;
    }
    if (direct_out != nullptr) {  // the only chunk: the merge's (0 + a x 1) / (0 + ls x 1)
      direct_out[i] = a / ls;
      continue;
    }
    acc_out[i] = a;
    if (c == 0) {
      ml_out[2 * h] = mm;
      ml_out[2 * h + 1] = ls;
    }
  }
  if (tid == 0) {
    int n = 0;
    for (int w = 0; w < kWarps; ++w) n += ntok[w];
    *ntok_out = n;
  }
}

/// Launches the tensor-core main pass (paged_attention_tc.cu) for head_dim D (64, 128, 256):
/// grid (splits, Hkv), partials into ws. Returns the launch status.
template <int D>
cudaError_t launch_partial_tc(const PagedKvView& view, const DecodeAttentionParams& p, const Workspace& ws, int splits,
                              cudaStream_t s);

/// Resident CTAs per SM of the tensor-core main pass for head_dim D (occupancy API; 0 on error).
template <int D>
int partial_tc_ctas_per_sm() noexcept;

}  // namespace thinkv::kernels::detail
