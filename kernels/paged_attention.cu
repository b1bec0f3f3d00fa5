/// \file paged_attention.cu
/// Decode attention over the compressed paged cache: split-K (flash-decoding) + merge.
///
/// Dispatch: head_dim 64, 128 and 256 run the tensor-core main pass (paged_attention_tc.cu);
/// head_dim 8 (the stories260K shapes) runs the CUDA-core main pass below. The merge, the exact
/// sparsity passes, the checks and the split choice live here for both.
///
/// Design. Each KV head's token list is seen as virtual positions: block j of its CSR list covers
/// positions [j * B, j * B + B) (slots; unwritten slots >= fill and evicted slots are skipped),
/// then its staged tokens. The list is cut into `splits` chunks (whole windows of 4 warps);
/// CTA (split, kvh) of the partial kernel walks its chunk in windows clipped to block boundaries.
///
/// CUDA-core main pass (paged_decode_partial_kernel, 4 warps per CTA, no block barrier until the end): the
/// warps take the chunk's windows (16 slot positions; 32 for D = 8) round robin. Per window a
/// ballot over the eviction mask compacts the live slots (an evicted slot costs a mask bit, no
/// load, no math); each lane owns 8 consecutive channels of one token (D / 8 lanes per token),
/// issues all its K/V loads of the window (16, 8, 4 or 2 bytes per row: BF16, FP8, NVFP4,
/// ternary) before any math, dequantizes in registers (E4M3 and E2M1 placed into FP16 bit
/// fields, exact; key scales decoded once per record), computes FP32 FMA dot products for the G
/// query heads of the GQA group reduced by xor shuffles, updates an online softmax in base 2 and
/// accumulates P.V in registers. The warps merge their (m, l, acc) in shared memory; the chunk's
/// partial goes to the caller's workspace and the merge kernel (one CTA per query head) combines
/// the chunks. Its scores are accurate FP32 but not bit-identical to the CPU reference (FMA,
/// other order): the output is compared with a relative tolerance.
///
/// Sparsity, when asked (refresh steps only): two more launches over the same chunks recompute
/// every score exactly as the CPU reference does (channels in order with __fmul_rn/__fadd_rn,
/// the K tile dequantized into shared memory with read_token's expression), the first taking the
/// exact row max M (atomicMax on order-preserving integer keys), the second counting
/// s - M < kSparsityLogThreshold; a tiny kernel divides by the token count. So the counts equal
/// the CPU's exactly. Build without fast-math (IEEE division, exp2f/expf accuracy).

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "thinkv/formats/bf16.hpp"
#include "thinkv/formats/fp16_placement.hpp"
#include "thinkv/formats/group_quant.hpp"
#include "thinkv/kernels/launch_plan.hpp"
#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/reference/attention.hpp"
#include "paged_attention_common.cuh"

namespace thinkv::kernels {
namespace {
using namespace detail;  // paged_attention_common.cuh

constexpr int kMergeThreads = 128;
constexpr int kG = kMaxQueryHeadsPerKv;

/// Slots per tile of the sparsity passes (their K tile takes about kTile * D * 4 bytes = 8 KiB).
template <int D>
constexpr int tile_for() {
  return (2048 / D) < 32 ? (2048 / D) : 32;
}

template <int D>
struct SharedState {
  static constexpr int kTile = tile_for<D>();
  static constexpr int kKStride = D + 1;  // padded: conflict-free column reads in tile_scores
  float q[kG][D];
  float k[kTile][kKStride];
  float p[kG][kTile];  // scores
  float m[kG];         // row max (exact)
  int below[kG];       // sparsity counts
  int valid[kTile];    // slot of the tile holds a live token
  std::uint32_t record[kTile];
};

__device__ inline float element_of(int precision, const std::uint8_t* row, int c) {
  switch (static_cast<Precision>(precision)) {
    case Precision::kFp8E4M3: return decode_e4m3(row[c]);
    case Precision::kNvfp4: return decode_e2m1(static_cast<std::uint8_t>((row[c >> 1] >> ((c & 1) * 4)) & 0xF));
    case Precision::kTernary:
      return decode_element(Precision::kTernary, static_cast<std::uint8_t>((row[c >> 2] >> ((c & 3) * 2)) & 0x3));
    case Precision::kBf16: break;
  }
  return decode_bf16(static_cast<std::uint16_t>(row[2 * c] | (row[2 * c + 1] << 8)));
}

__device__ inline std::uint32_t word_of(const uint4& w, int i) {
  return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}
__device__ inline std::uint8_t byte_of(const uint4& w, int j) {
  return static_cast<std::uint8_t>(word_of(w, j >> 2) >> (8 * (j & 3)));
}

/// Vectorized dequantization of the tile's key rows (16-byte units), precision P known at compile
/// time. Same per-element expression as the scalar path.
template <int D, int P>
__device__ void load_rows_vec(const PagedKvView& view, const DecodeAttentionParams& prm, int stream,
                              const TileSource& src, float s2k, SharedState<D>& sh) {
  constexpr int kTile = SharedState<D>::kTile;
  constexpr int kBits = P == 0 ? 16 : P == 1 ? 8 : P == 2 ? 4 : 2;
  constexpr int kRb = D * kBits / 8;
  constexpr int kUpr = kRb / 16;     // units per row
  constexpr int kEpu = 128 / kBits;  // elements per unit
  static_assert(kRb % 16 == 0, "vector path needs 16-byte rows");
  const int g = prm.group_size;
  for (int i = static_cast<int>(threadIdx.x); i < kTile * kUpr; i += kThreads) {
    const int t = i / kUpr;
    const int u = i % kUpr;
    if (!sh.valid[t]) continue;
    const int slot = src.base + t;
    const int c0 = u * kEpu;
    float* dst = &sh.k[t][c0];
    const uint4* rowp;
    if (src.staged) {
      rowp = reinterpret_cast<const uint4*>(view.staging + (static_cast<std::size_t>(stream) * 2 * g + slot) * D);
    } else {
      rowp = reinterpret_cast<const uint4*>(src.page + static_cast<std::size_t>(slot) * kRb);
    }
    const uint4 w = __ldg(rowp + u);
    if constexpr (P == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        dst[j] = decode_bf16(static_cast<std::uint16_t>(word_of(w, j >> 1) >> (16 * (j & 1))));
    } else {
      const std::uint32_t rec = sh.record[t];
      if (rec == kNoRecordId) {
#pragma unroll
        for (int j = 0; j < kEpu; ++j) dst[j] = NAN;
        continue;
      }
      const uint4* ks = reinterpret_cast<const uint4*>(view.key_scales + static_cast<std::size_t>(rec) * D + c0);
#pragma unroll
      for (int v16 = 0; v16 < kEpu / 16; ++v16) {
        const uint4 sc = __ldg(ks + v16);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int e = v16 * 16 + j;  // element within the unit
          float x;
          if constexpr (P == 1) {
            x = decode_e4m3(byte_of(w, e));
          } else if constexpr (P == 2) {
            x = decode_e2m1(static_cast<std::uint8_t>((byte_of(w, e >> 1) >> ((e & 1) * 4)) & 0xF));
          } else {
            x = decode_element(Precision::kTernary,
                               static_cast<std::uint8_t>((byte_of(w, e >> 2) >> ((e & 3) * 2)) & 0x3));
          }
          dst[e] = x * (decode_e4m3(byte_of(sc, j)) * s2k);
        }
      }
    }
  }
}

/// Marks the tile's live slots and dequantizes their keys into shared memory (the sparsity passes
/// need scores only). Returns (block-uniformly) whether any slot of the tile is live.
template <int D>
__device__ bool load_tile(const PagedKvView& view, const DecodeAttentionParams& prm, int stream, const TileSource& src,
                          SharedState<D>& sh) {
  constexpr int kTile = SharedState<D>::kTile;
  const int tid = static_cast<int>(threadIdx.x);
  const int bs = prm.block_size;
  if (tid < kTile) {
    const int slot = src.base + tid;
    int ok = slot < src.limit;
    std::uint32_t rec = kNoRecordId;
    if (ok && !src.staged) {
      const int words = (bs + 63) / 64;
      const std::uint64_t w = view.evict_mask[static_cast<std::size_t>(src.block) * words + slot / 64];
      ok = ((w >> (slot % 64)) & 1u) == 0;
      if (ok) rec = view.slot_record[static_cast<std::size_t>(src.block) * bs + slot];
    }
    sh.valid[tid] = ok;
    sh.record[tid] = rec;
  }
  const int any = __syncthreads_or(tid < kTile && sh.valid[tid]);
  if (!any) return false;
  const int g = prm.group_size;
  const Precision p = static_cast<Precision>(src.precision);
  const int rb = (D * bits_of(p) + 7) / 8;
  const float s2k_raw =
      src.staged ? 0.0f : view.s2[(static_cast<std::size_t>(stream) * 2 + 0) * kNumPrecisions + src.precision];
  // 16-byte path: rows a multiple of 16 bytes and a 16-byte aligned page (staging: BF16 rows).
  const bool vec = src.staged
                       ? (D * 2) % 16 == 0 && (reinterpret_cast<std::uintptr_t>(view.staging) & 15) == 0
                       : rb % 16 == 0 && (reinterpret_cast<std::uintptr_t>(src.page) & 15) == 0 &&
                             (p == Precision::kBf16 || (reinterpret_cast<std::uintptr_t>(view.key_scales) & 15) == 0);
  if (vec) {
    if constexpr (D * 2 % 16 == 0) {
      if (src.staged || p == Precision::kBf16) load_rows_vec<D, 0>(view, prm, stream, src, s2k_raw, sh);
    }
    if constexpr (D % 16 == 0) {
      if (!src.staged && p == Precision::kFp8E4M3) load_rows_vec<D, 1>(view, prm, stream, src, s2k_raw, sh);
    }
    if constexpr (D % 32 == 0) {
      if (!src.staged && p == Precision::kNvfp4) load_rows_vec<D, 2>(view, prm, stream, src, s2k_raw, sh);
    }
    if constexpr (D % 64 == 0) {
      if (!src.staged && p == Precision::kTernary) load_rows_vec<D, 3>(view, prm, stream, src, s2k_raw, sh);
    }
    __syncthreads();
    return true;
  }
  for (int i = tid; i < kTile * D; i += kThreads) {
    const int t = i / D;
    const int c = i % D;
    if (!sh.valid[t]) continue;
    const int slot = src.base + t;
    float kx;
    if (src.staged) {
      const std::uint16_t* sk = view.staging + (static_cast<std::size_t>(stream) * 2 * g + slot) * D;
      kx = decode_bf16(sk[c]);
    } else {
      const std::uint8_t* kr = src.page + static_cast<std::size_t>(slot) * rb;
      if (p == Precision::kBf16) {
        kx = element_of(src.precision, kr, c);
      } else {
        // read_token: element * (decode_e4m3(scale) * s2), s2 as stored (0 only when every
        // group so far was all zero, whose codes decode to 0 for any s2).
        const std::uint32_t rec = sh.record[t];
        kx = rec == kNoRecordId ? NAN
                                : element_of(src.precision, kr, c) *
                                      (decode_e4m3(view.key_scales[static_cast<std::size_t>(rec) * D + c]) * s2k_raw);
      }
    }
    sh.k[t][c] = kx;
  }
  __syncthreads();
  return true;
}

/// Scores of the tile's live slots for the G query heads: sh.p[h][t] = (sum_c q[c] * k[c]) * scale,
/// channels in order, no contraction (the CPU reference's expression).
template <int D>
__device__ void tile_scores(int group, float scale, SharedState<D>& sh) {
  constexpr int kTile = SharedState<D>::kTile;
  for (int i = static_cast<int>(threadIdx.x); i < group * kTile; i += kThreads) {
    const int h = i / kTile;
    const int t = i % kTile;
    if (!sh.valid[t]) continue;
    float s = 0.0f;
#pragma unroll 16
    for (int c = 0; c < D; ++c) s = __fadd_rn(s, __fmul_rn(sh.q[h][c], sh.k[t][c]));
    sh.p[h][t] = __fmul_rn(s, scale);
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Main pass: warp-level partial attention (no block barrier per tile).
//
// Each lane owns 8 consecutive channels (c0 = 8 * (lane % kLpt)); kLpt = D / 8 lanes hold one
// token, so a warp takes kTpi = 32 / kLpt tokens per iteration. A warp tile is a window of kWin
// consecutive slot positions of one block (or of the staging rows), its live slots compacted by a
// ballot (an evicted slot costs one mask bit, no load, no math), processed as kIters iterations
// whose loads are all issued before any math. Per token and lane: raw bits of K and V (16, 8, 4
// or 2 bytes: BF16, FP8, NVFP4, ternary), dequantized in registers (E4M3 and E2M1 through
// half-precision bit placement: exact, see dequant_*), scores = FP32 FMA dot products reduced
// across the kLpt lanes by xor shuffles, an online softmax in base 2 (warp-uniform running max),
// and P.V into per-lane accumulators acc[G][8]. The CTA's kWarps warps take the chunk's windows
// round robin and merge their (m, l, acc) through shared memory at the end. m is stored in log2
// units (the merge kernel uses exp2f). Scores here are NOT bit-identical to the CPU reference
// (FMA, different order): the sparsity pass recomputes them exactly (paged_decode_sparsity_kernel).
// ---------------------------------------------------------------------------------------------

template <int D, int G>
struct WarpShared {
  float acc[kWarps][G][D];
  float m[kWarps][G];
  float l[kWarps][G];
  int ntok[kWarps];
  int slot[kWarps][32];
  std::uint32_t record[kWarps][32];
};

/// One warp's state: running max (log2 units, warp-uniform), per-lane partial denominators and
/// accumulators of the lane's token slot and channels.
template <int D, int G>
struct WarpState {
  float q[G][8];
  float acc[G][8];
  float m[G];
  float l[G];
  int ntok;
  std::uint32_t cached_rec;
  float kscale[8];  // key scales (times s2 / elem factor) of cached_rec
};

/// Where a warp tile's rows are: K row of slot s at kbase + s * row_stride, V row at
/// vbase + s * row_stride; value scales (quantized pages) at vscales + s * (D / g).
struct RowSource {
  const std::uint8_t* kbase;
  const std::uint8_t* vbase;
  const std::uint8_t* vscales;
  int row_stride;
  bool vec;  // rows and base aligned for raw_bytes<P>() vector loads
  float s2k, s2v;
};

template <int D, int G, int P>
__device__ __forceinline__ void warp_tile(const PagedKvView& view, const DecodeAttentionParams& prm,
                                          const RowSource& rs, int n, const int* slots, const std::uint32_t* records,
                                          float scale_log2, WarpState<D, G>& st) {
  using S = WarpShape<D>;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int ts = lane / S::kLpt;  // token slot of the lane within an iteration
  const int c0 = (lane % S::kLpt) * 8;
  constexpr int kRawOff = raw_bytes<P>();  // bytes per 8 channels
  const int g = prm.group_size;
  Raw<P> kr[S::kIters], vr[S::kIters];
  float vsc[S::kIters];
  std::uint32_t rec[S::kIters];
  uint2 ksr[S::kIters];  // raw key-scale codes of the token's record (loaded with K/V)
  // Loads first (all iterations), math after: up to 2 * kIters loads in flight per lane.
#pragma unroll
  for (int i = 0; i < S::kIters; ++i) {
    const int k = i * S::kTpi + ts;
    vsc[i] = 1.0f;
    rec[i] = 0u;
    kr[i].w = vr[i].w = make_uint4(0u, 0u, 0u, 0u);
    ksr[i] = make_uint2(0u, 0u);
    if (i * S::kTpi < n && k < n) {
      const int slot = slots[k];
      const std::size_t row =
          static_cast<std::size_t>(slot) * rs.row_stride + static_cast<std::size_t>(c0 / 8) * kRawOff;
      kr[i] = load_raw<P>(rs.kbase + row, rs.vec);
      vr[i] = load_raw<P>(rs.vbase + row, rs.vec);
      if constexpr (P != 0) {
        // E4M3 value scale times 2^-8 (exact bit placement; the 2^8 is folded into vs below).
        vsc[i] = e4m3x2_scaled(__ldg(rs.vscales + static_cast<std::size_t>(slot) * (D / g) + c0 / g)).x;
        rec[i] = records[k];
        if (rec[i] != kNoRecordId) {
          const std::uint8_t* ks = view.key_scales + static_cast<std::size_t>(rec[i]) * D + c0;
          const Raw<1> sr = load_raw<1>(ks, (reinterpret_cast<std::uintptr_t>(ks) & 7u) == 0);
          ksr[i] = make_uint2(sr.w.x, sr.w.y);
        }
      }
    }
  }
  // Scores (log2 units).
  float s[S::kIters][G];
#pragma unroll
  for (int i = 0; i < S::kIters; ++i) {
#pragma unroll
    for (int h = 0; h < G; ++h) s[i][h] = -INFINITY;
    if (i * S::kTpi >= n) continue;  // warp-uniform
    const bool act = i * S::kTpi + ts < n;
    float x[8];
    decode_raw<P>(kr[i], x);
    if constexpr (P != 0) {
      if (act && rec[i] != st.cached_rec) {
        st.cached_rec = rec[i];
        if (rec[i] == kNoRecordId) {
#pragma unroll
          for (int j = 0; j < 8; ++j) st.kscale[j] = NAN;
        } else {
          Raw<1> sr;
          sr.w = make_uint4(ksr[i].x, ksr[i].y, 0u, 0u);
          float f[8];
          decode_raw<1>(sr, f);  // scale codes times 2^-8
#pragma unroll
          for (int j = 0; j < 8; ++j) st.kscale[j] = f[j] * (rs.s2k * (kE4M3Fp16Unscale * elem_unscale<P>()));
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] *= st.kscale[j];
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float a = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) a = fmaf(st.q[h][j], x[j], a);
#pragma unroll
      for (int o = S::kLpt / 2; o >= 1; o /= 2) a += __shfl_xor_sync(0xFFFFFFFFu, a, o);
      s[i][h] = act ? a * scale_log2 : -INFINITY;
    }
  }
  // Online softmax: warp-uniform tile max per head.
  float f[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < S::kIters; ++i) mx = fmaxf(mx, s[i][h]);
#pragma unroll
    for (int o = S::kLpt; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    const float m_new = fmaxf(st.m[h], mx);
    f[h] = exp2f(st.m[h] - m_new);  // m = -inf at first: 0 (m_new finite)
    st.m[h] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < S::kIters; ++i) {
      const float p = s[i][h] == -INFINITY ? 0.0f : exp2f(s[i][h] - m_new);
      s[i][h] = p;
      sum += p;
    }
    st.l[h] = st.l[h] * f[h] + sum;
#pragma unroll
    for (int j = 0; j < 8; ++j) st.acc[h][j] *= f[h];
  }
  // P.V.
#pragma unroll
  for (int i = 0; i < S::kIters; ++i) {
    if (i * S::kTpi >= n) continue;  // warp-uniform
    if (i * S::kTpi + ts >= n) continue;
    float x[8];
    decode_raw<P>(vr[i], x);
    const float vs = P == 0 ? 1.0f : vsc[i] * (rs.s2v * (kE4M3Fp16Unscale * elem_unscale<P>()));
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float w = s[i][h] * vs;
#pragma unroll
      for (int j = 0; j < 8; ++j) st.acc[h][j] = fmaf(w, x[j], st.acc[h][j]);
    }
  }
  st.ntok += n;
}

/// Partial attention of one chunk: grid (splits, Hkv), kWarps warps taking the chunk's windows
/// round robin.
template <int D, int G>
__global__ void __launch_bounds__(kThreads)
    paged_decode_partial_kernel(PagedKvView view, DecodeAttentionParams prm, Workspace ws, int splits) {
  using S = WarpShape<D>;
  __shared__ WarpShared<D, G> sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int c0 = (lane % S::kLpt) * 8;
  const int split = static_cast<int>(blockIdx.x);
  const int kvh = static_cast<int>(blockIdx.y);
  const int stream = prm.streams[kvh];
  const float scale = prm.softmax_scale > 0.0f ? prm.softmax_scale : 1.0f / sqrtf(static_cast<float>(D));
  const float scale_log2 = scale * kLog2e;
  const std::size_t part = static_cast<std::size_t>(kvh) * splits + split;
  float* acc_out = ws.acc + part * (prm.num_q_heads / prm.num_kv_heads) * D;
  float* ml_out = ws.ml + part * (prm.num_q_heads / prm.num_kv_heads) * 2;
  const bool stream_ok = stream >= 0 && stream < view.num_streams;

  WarpState<D, G> st;
  const int group = prm.num_q_heads / prm.num_kv_heads;  // <= G; heads >= group are padding
  const float* q = prm.q + static_cast<std::size_t>(kvh) * group * D;
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      st.q[h][j] = h < group ? q[h * D + c0 + j] : 0.0f;
      st.acc[h][j] = 0.0f;
    }
    st.m[h] = -INFINITY;
    st.l[h] = 0.0f;
  }
  st.ntok = 0;
  st.cached_rec = kNoRecordId - 1u;  // matches no record id (nor kNoRecordId)

  if (stream_ok) {
    const int g = prm.group_size;
    const int bs = prm.block_size;
    for_each_chunk_tile<D, S::kWin, S::kWin * kWarps, true>(
        view, prm, stream, split, splits, [&](const TileSource& src) {
          // Live slots of the window, compacted by a ballot.
          const int slot = src.base + lane;
          bool valid = lane < S::kWin && slot < src.limit;
          std::uint32_t rec = kNoRecordId;
          if (valid && !src.staged) {
            // Mask word and record id loaded together (one memory round trip, not two).
            const int words = (bs + 63) / 64;
            const std::uint64_t w = view.evict_mask[static_cast<std::size_t>(src.block) * words + slot / 64];
            if (src.precision != 0) rec = view.slot_record[static_cast<std::size_t>(src.block) * bs + slot];
            valid = ((w >> (slot % 64)) & 1u) == 0;
          }
          const unsigned vm = __ballot_sync(0xFFFFFFFFu, valid);
          if (vm == 0u) return;
          if (valid) {
            const int r = __popc(vm & ((1u << lane) - 1u));
            sh.slot[warp][r] = slot;
            sh.record[warp][r] = rec;
          }
          __syncwarp();
          const int n = __popc(vm);
          st.cached_rec = kNoRecordId - 1u;  // key scales depend on the pool's s2: reload per window
          RowSource rs;
          int lb = 16;
          if (src.staged) {
            const std::uint8_t* base = reinterpret_cast<const std::uint8_t*>(view.staging);
            rs.kbase = base + (static_cast<std::size_t>(stream) * 2 + 0) * g * D * 2;
            rs.vbase = base + (static_cast<std::size_t>(stream) * 2 + 1) * g * D * 2;
            rs.vscales = nullptr;
            rs.row_stride = 2 * D;
            rs.s2k = rs.s2v = 1.0f;
          } else {
            const Precision p = static_cast<Precision>(src.precision);
            const int rb = D * bits_of(p) / 8;
            lb = src.precision == 0 ? 16 : src.precision == 1 ? 8 : src.precision == 2 ? 4 : 2;
            rs.kbase = src.page;
            rs.vbase = src.page + static_cast<std::size_t>(bs) * rb;
            rs.vscales = src.page + 2 * static_cast<std::size_t>(bs) * rb;
            rs.row_stride = rb;
            rs.s2k = view.s2[(static_cast<std::size_t>(stream) * 2 + 0) * kNumPrecisions + src.precision];
            rs.s2v = view.s2[(static_cast<std::size_t>(stream) * 2 + 1) * kNumPrecisions + src.precision];
          }
          rs.vec = ((reinterpret_cast<std::uintptr_t>(rs.kbase) | reinterpret_cast<std::uintptr_t>(rs.vbase) |
                     static_cast<std::uintptr_t>(rs.row_stride)) %
                    static_cast<std::uintptr_t>(lb)) == 0;
          switch (src.staged ? 0 : src.precision) {
            case 0: warp_tile<D, G, 0>(view, prm, rs, n, sh.slot[warp], sh.record[warp], scale_log2, st); break;
            case 1: warp_tile<D, G, 1>(view, prm, rs, n, sh.slot[warp], sh.record[warp], scale_log2, st); break;
            case 2: warp_tile<D, G, 2>(view, prm, rs, n, sh.slot[warp], sh.record[warp], scale_log2, st); break;
            default: warp_tile<D, G, 3>(view, prm, rs, n, sh.slot[warp], sh.record[warp], scale_log2, st); break;
          }
          __syncwarp();  // the slot list is rewritten by the next window
        });
  }
  // Reduce the lanes' token slots (l and acc), then merge the warps through shared memory.
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int o = S::kLpt; o < 32; o *= 2) {
      st.l[h] += __shfl_xor_sync(0xFFFFFFFFu, st.l[h], o);
#pragma unroll
      for (int j = 0; j < 8; ++j) st.acc[h][j] += __shfl_xor_sync(0xFFFFFFFFu, st.acc[h][j], o);
    }
  }
  if (lane < S::kLpt) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sh.acc[warp][h][c0 + j] = st.acc[h][j];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      sh.m[warp][h] = st.m[h];
      sh.l[warp][h] = st.l[h];
    }
    sh.ntok[warp] = st.ntok;
  }
  __syncthreads();
  merge_warps_to_workspace(sh.m, sh.l, sh.acc, sh.ntok, group, acc_out, ml_out, ws.ntok + part,
                           ws.out != nullptr ? ws.out + static_cast<std::size_t>(kvh) * group * D : nullptr);
}

/// Merge: one CTA per query head. Rescales the chunks (m in log2 units) to the global max and
/// writes out; records the token count of the KV head and resets the sparsity accumulators.
/// Latency, not bandwidth, is its cost (a few KB per head): every chunk's (m, l) is loaded at
/// once (two per thread), their weights exp2(m - max) go to shared memory, then each thread
/// loads its channel's chunk partials with the loads unrolled ahead of the sums. The sums run
/// over the chunks in order, as the CPU-ordered definition below: a chunk takes part iff l > 0.
__global__ void __launch_bounds__(kMergeThreads)
    paged_decode_merge_kernel(DecodeAttentionParams prm, Workspace ws, int splits, int d) {
  static_assert(kMaxSplits % kMergeThreads == 0, "chunks per thread");
  constexpr int kPer = kMaxSplits / kMergeThreads;
  __shared__ float sw[kMaxSplits];  // exp2(m_s - gm), chunks with l_s > 0
  __shared__ float sl[kMaxSplits];  // l_s
  __shared__ float red[kMergeThreads / 32];
  const int qh = static_cast<int>(blockIdx.x);
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int kvh = qh / group;
  const int h = qh % group;
  const int tid = static_cast<int>(threadIdx.x);
  const std::size_t base = static_cast<std::size_t>(kvh) * splits;  // first chunk of this KV head
  const float2* ml = reinterpret_cast<const float2*>(ws.ml);        // (m, l) pairs, 8-byte aligned
  float ms[kPer], ls[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int s = tid + k * kMergeThreads;
    ms[k] = -INFINITY;
    ls[k] = 0.0f;
    if (s < splits) {
      const float2 v = ml[(base + s) * group + h];
      ms[k] = v.x;
      ls[k] = v.y;
      if (v.y > 0.0f) mx = fmaxf(mx, v.x);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
  if ((tid & 31) == 0) red[tid / 32] = mx;
  __syncthreads();
  float gm = red[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) gm = fmaxf(gm, red[w]);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int s = tid + k * kMergeThreads;
    if (s < splits) {
      sw[s] = ls[k] > 0.0f ? exp2f(ms[k] - gm) : 0.0f;
      sl[s] = ls[k];
    }
  }
  __syncthreads();
  float* out = prm.out + static_cast<std::size_t>(qh) * d;
  const float* acc = ws.acc + (base * group + h) * d;  // chunk s: + s * group * d
  const std::size_t stride = static_cast<std::size_t>(group) * d;
  for (int c = tid; c < d; c += kMergeThreads) {
    float a = 0.0f, l = 0.0f;
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float x = acc[s * stride + c];
      const float lv = sl[s];
      const float w = sw[s];
      if (lv > 0.0f) {
        a += x * w;
        l += lv * w;
      }
    }
    out[c] = a / l;  // no token: 0 / 0 = NaN (the CPU backend refuses such a stream)
  }
  if (tid == 0) {
    ws.smax[qh] = 0u;  // below the key of every float (ordered_key)
    ws.count[qh] = 0;
    if (h == 0) {
      int n = 0;
      for (int s = 0; s < splits; ++s) n += ws.ntok[base + s];
      ws.total[kvh] = n;
    }
  }
}

/// Monotone map float -> unsigned (x < y <=> key(x) < key(y) for non-NaN x, y).
__device__ inline unsigned ordered_key(float x) {
  const unsigned b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ inline float from_ordered_key(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

/// Sparsity, two launches over the same chunks with the exact scores of the CPU reference
/// (channels in order, __fmul_rn/__fadd_rn): kMax = true takes the exact row max (atomicMax on
/// ordered keys), kMax = false counts s - M < kSparsityLogThreshold against it.
template <int D, bool kMax>
__global__ void __launch_bounds__(kThreads)
    paged_decode_sparsity_kernel(PagedKvView view, DecodeAttentionParams prm, Workspace ws, int splits) {
  constexpr int kTile = SharedState<D>::kTile;
  __shared__ SharedState<D> sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int split = static_cast<int>(blockIdx.x);
  const int kvh = static_cast<int>(blockIdx.y);
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int stream = prm.streams[kvh];
  if (stream < 0 || stream >= view.num_streams) return;
  if (prm.sparsity_heads != nullptr && prm.sparsity_heads[kvh] == 0) return;  // not asked for this KV head
  const float scale = prm.softmax_scale > 0.0f ? prm.softmax_scale : 1.0f / sqrtf(static_cast<float>(D));
  const float* q = prm.q + static_cast<std::size_t>(kvh) * group * D;
  for (int i = tid; i < group * D; i += kThreads) sh.q[i / D][i % D] = q[i];
  if (tid < group) {
    sh.m[tid] = kMax ? -INFINITY : from_ordered_key(ws.smax[kvh * group + tid]);
    sh.below[tid] = 0;
  }
  __syncthreads();
  for_each_chunk_tile<D, kTile, kTile>(view, prm, stream, split, splits, [&](const TileSource& src) {
    if (!load_tile<D>(view, prm, stream, src, sh)) return;
    tile_scores<D>(group, scale, sh);
    if (tid < group) {
      const int h = tid;
      if constexpr (kMax) {
        float m = sh.m[h];
        for (int t = 0; t < kTile; ++t) {
          if (sh.valid[t]) m = fmaxf(m, sh.p[h][t]);
        }
        sh.m[h] = m;
      } else {
        int below = 0;
        for (int t = 0; t < kTile; ++t) {
          if (sh.valid[t]) below += __fsub_rn(sh.p[h][t], sh.m[h]) < kSparsityLogThreshold;
        }
        sh.below[h] += below;
      }
    }
    __syncthreads();
  });
  if (tid < group) {
    if constexpr (kMax) {
      if (sh.m[tid] != -INFINITY) atomicMax(&ws.smax[kvh * group + tid], ordered_key(sh.m[tid]));
    } else {
      if (sh.below[tid] != 0) atomicAdd(&ws.count[kvh * group + tid], sh.below[tid]);
    }
  }
}

__global__ void paged_decode_sparsity_finish(DecodeAttentionParams prm, Workspace ws) {
  const int qh = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (qh >= prm.num_q_heads) return;
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int n = ws.total[qh / group];
  const bool asked = prm.sparsity_heads == nullptr || prm.sparsity_heads[qh / group] != 0;
  prm.sparsity[qh] = n > 0 && asked ? static_cast<float>(ws.count[qh]) / static_cast<float>(n) : NAN;
}

template <int D, int G>
cudaError_t launch_for_group(const PagedKvView& view, const DecodeAttentionParams& p, const Workspace& ws, int splits,
                             cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.num_kv_heads));
  paged_decode_partial_kernel<D, G><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_for(const PagedKvView& view, const DecodeAttentionParams& p, int splits, cudaStream_t s) {
  Workspace ws{};
  workspace_bytes(p.num_q_heads, p.num_kv_heads, D, splits, &ws, p.workspace);
  // One chunk and no sparsity: the main pass writes the output itself and the merge is skipped.
  if (splits == 1 && p.sparsity == nullptr) ws.out = p.out;
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.num_kv_heads));
  cudaError_t e = cudaSuccess;
  // One instance per power-of-two bound on G (G = 3 runs as 4, 5..7 as 8: padded heads have
  // zero queries and are not written), to keep the number of instances (and nvcc time) down.
  const int group = p.num_q_heads / p.num_kv_heads;
  if constexpr (D >= 64) {
    // Tensor cores (paged_attention_tc.cu): all 8 query-head columns in one mma, so no G bound.
    (void)group;
    e = launch_partial_tc<D>(view, p, ws, splits, s);
  } else if (group <= 1) {
    e = launch_for_group<D, 1>(view, p, ws, splits, s);
  } else if (group <= 2) {
    e = launch_for_group<D, 2>(view, p, ws, splits, s);
  } else if (group <= 4) {
    e = launch_for_group<D, 4>(view, p, ws, splits, s);
  } else {
    e = launch_for_group<D, 8>(view, p, ws, splits, s);
  }
  if (e != cudaSuccess) return e;
  if (ws.out != nullptr) return cudaSuccess;
  paged_decode_merge_kernel<<<p.num_q_heads, kMergeThreads, 0, s>>>(p, ws, splits, D);
  if (e = cudaGetLastError(); e != cudaSuccess) return e;
  if (p.sparsity == nullptr) return cudaSuccess;
  paged_decode_sparsity_kernel<D, true><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
  if (e = cudaGetLastError(); e != cudaSuccess) return e;
  paged_decode_sparsity_kernel<D, false><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
  if (e = cudaGetLastError(); e != cudaSuccess) return e;
  paged_decode_sparsity_finish<<<(p.num_q_heads + 127) / 128, 128, 0, s>>>(p, ws);
  return cudaGetLastError();
}

bool heads_ok(const DecodeAttentionParams& p) {
  return p.num_kv_heads >= 1 && p.num_q_heads >= 1 && p.num_q_heads % p.num_kv_heads == 0 &&
         p.num_q_heads / p.num_kv_heads <= kMaxQueryHeadsPerKv;
}

}  // namespace

namespace {

/// Resident CTAs per SM of the main pass that a launch with head_dim d and group size `group`
/// runs (occupancy API, cached per device; 0 when it cannot be queried).
int main_pass_ctas_per_sm(int dev, int d, int group) noexcept {
  constexpr int kDevs = 16;
  static std::atomic<int> cache[kDevs][5][4] = {};  // [device][D 8/32/64/128/256][G bound 1/2/4/8]
  const int di = d == 8 ? 0 : d == 32 ? 4 : d == 64 ? 1 : d == 128 ? 2 : d == 256 ? 3 : -1;
  const int gi = group <= 1 ? 0 : group <= 2 ? 1 : group <= 4 ? 2 : 3;
  if (di < 0) return 0;
  std::atomic<int>* slot = dev >= 0 && dev < kDevs ? &cache[dev][di][gi] : nullptr;
  if (slot != nullptr) {
    if (const int v = slot->load(std::memory_order_relaxed); v > 0) return v;
  }
  int n = 0;
  cudaError_t e = cudaSuccess;
  switch (di) {
    case 0: {
      static constexpr void (*kKernels[4])(PagedKvView, DecodeAttentionParams, Workspace, int) = {
          paged_decode_partial_kernel<8, 1>, paged_decode_partial_kernel<8, 2>, paged_decode_partial_kernel<8, 4>,
          paged_decode_partial_kernel<8, 8>};
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernels[gi], kThreads, 0);
      break;
    }
    case 4: {
      static constexpr void (*kKernels[4])(PagedKvView, DecodeAttentionParams, Workspace, int) = {
          paged_decode_partial_kernel<32, 1>, paged_decode_partial_kernel<32, 2>, paged_decode_partial_kernel<32, 4>,
          paged_decode_partial_kernel<32, 8>};
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernels[gi], kThreads, 0);
      break;
    }
    case 1: n = partial_tc_ctas_per_sm<64>(); break;
    case 2: n = partial_tc_ctas_per_sm<128>(); break;
    default: n = partial_tc_ctas_per_sm<256>(); break;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (slot != nullptr && n > 0) slot->store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace

int paged_decode_attention_splits(const DecodeAttentionParams& p) noexcept {
  if (p.num_splits > 0) return p.num_splits < kMaxSplits ? p.num_splits : kMaxSplits;
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) {
    (void)cudaGetLastError();
    sms = 132;
  }
  const int hkv = p.num_kv_heads > 0 ? p.num_kv_heads : 1;
  const int group = p.num_q_heads / hkv;
  int per_sm = main_pass_ctas_per_sm(dev, p.head_dim, group);
  if (per_sm < 1) per_sm = 4;
  const long long resident = static_cast<long long>(per_sm) * sms;
  // With the longest stream known (tensor-core pass): waves x (CTA start-up + chunk length), the
  // chunks cut in whole kTcChunkPiece-position pieces (launch_plan.hpp).
  if (p.max_positions > 0 && p.head_dim >= 64) {
    // Without sparsity one chunk needs no merge kernel (the main pass writes the output).
    return plan_decode_splits_for_length(hkv, resident, kMaxSplits, p.max_positions, kTcChunkPiece,
                                         p.sparsity == nullptr ? kSplitMergeHalfPieces : 0);
  }
  // The fewest chunks whose CTAs fill the last wave of resident ones to >= 90% (launch_plan.hpp).
  return plan_decode_splits(hkv, resident, kMaxSplits);
}

std::size_t paged_decode_attention_workspace_size(const DecodeAttentionParams& p) noexcept {
  if (!heads_ok(p) || p.head_dim < 1) return 0;
  return workspace_bytes(p.num_q_heads, p.num_kv_heads, p.head_dim, paged_decode_attention_splits(p), nullptr, nullptr);
}

cudaError_t check_paged_decode_attention(const PagedKvView& v, const DecodeAttentionParams& p) noexcept {
  const bool dim_ok = p.head_dim == 8 || p.head_dim == 32 || p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256;
  const bool group_ok =
      (p.group_size == 8 || p.group_size == 16 || p.group_size == 32) && p.head_dim % p.group_size == 0;
  if (!dim_ok || !group_ok || p.block_size < 1 || p.block_size > 4096) return cudaErrorInvalidValue;
  if (p.num_kv_heads < 1 || p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.num_q_heads / p.num_kv_heads > kMaxQueryHeadsPerKv) {
    return cudaErrorInvalidValue;
  }
  if (!(p.softmax_scale >= 0.0f) || std::isinf(p.softmax_scale)) return cudaErrorInvalidValue;
  if (p.streams == nullptr || p.q == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  if (p.num_splits < 0 || p.num_splits > kMaxSplits || p.max_positions < 0) return cudaErrorInvalidValue;
  if (p.workspace == nullptr || (reinterpret_cast<std::uintptr_t>(p.workspace) & 15) != 0) return cudaErrorInvalidValue;
  if (v.num_streams < 1 || v.s2 == nullptr || v.block_fill == nullptr || v.evict_mask == nullptr ||
      v.slot_record == nullptr || v.block_indptr == nullptr || v.staging == nullptr || v.staged_count == nullptr) {
    return cudaErrorInvalidValue;
  }
  std::uint64_t total = 0;
  bool quantized = false;
  for (int i = 0; i < kNumPrecisions; ++i) {
    if (v.pool_count[i] > 0 && v.pages[i] == nullptr) return cudaErrorInvalidValue;
    if (v.pool_base[i] != total) return cudaErrorInvalidValue;  // pools are consecutive (PoolMap)
    total += v.pool_count[i];
    quantized = quantized || (i != static_cast<int>(Precision::kBf16) && v.pool_count[i] > 0);
  }
  if (total != v.total_blocks) return cudaErrorInvalidValue;
  if (quantized && v.key_scales == nullptr) return cudaErrorInvalidValue;
  if (total > 0 && v.block_indices == nullptr) return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t launch_paged_decode_attention(const PagedKvView& view, const DecodeAttentionParams& p,
                                          cudaStream_t stream) noexcept {
  if (cudaError_t e = check_paged_decode_attention(view, p); e != cudaSuccess) return e;
  const int splits = paged_decode_attention_splits(p);
  switch (p.head_dim) {
    case 8: return launch_for<8>(view, p, splits, stream);
    case 32: return launch_for<32>(view, p, splits, stream);
    case 64: return launch_for<64>(view, p, splits, stream);
    case 128: return launch_for<128>(view, p, splits, stream);
    case 256: return launch_for<256>(view, p, splits, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace thinkv::kernels
