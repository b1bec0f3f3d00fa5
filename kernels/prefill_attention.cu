/// \file prefill_attention.cu
/// Causal prompt attention (thinkv/kernels/prefill_attention.hpp): a tiled FP32 flash-attention
/// kernel for head_dim 32, 64, 128 and 256 (prefill_tile_kernel), and the simple warp-per-row
/// kernel for every other head_dim (prefill_attention_kernel).
///
/// The tiled kernel. A CTA (4 warps) takes 64 query rows of one KV head: the rows are the pairs
/// (token t, head g of the KV head's group of G query heads) in the order t * G + g, so the CTA
/// covers 64 / G consecutive tokens of all G heads, and every K/V tile it loads serves all of them.
/// Warp w owns rows 16w .. 16w + 15; lane (row group rg: lane bits 1-2, key group kg: lane bits 0,
/// 3, 4) owns the rows rg + 4i (i < 4) of its warp, the keys kg + 8kk (kk < BK / 8) of a key tile
/// for the scores, and the channels 32 ch + 4 kg .. + 3 (ch < D / 32) of the output: a 4 x 4
/// register tile of S (4 x 2 at D = 256) and a 4 x D / 8 tile of O (64 accumulators at D = 128).
/// Per key tile of BK rows (32; 16 at D = 256):
///   1. K tile in shared memory (FP32, rows padded to D + 4 floats: conflict-free float4 reads);
///      the V tile's load starts (cp.async for 16-byte aligned FP32 K/V, else plain loads);
///   2. S = Q K^T (Q pre-scaled by softmax_scale * log2(e), in shared memory), 4 x BK/8 scores per
///      lane, FP32 FMA over the D channels; keys past the row's limit get -inf;
///   3. online softmax per row (max over the 8 lanes of the row by shuffles; running max m, the
///      lane's partial sum l, the accumulators rescaled by exp2(m_old - m_new)), P to the warp's
///      own shared-memory slice; the next K tile's load starts;
///   4. O += P V from the V tile in shared memory.
/// Three CTA barriers per key tile. Shared-memory reads: the scores take 8 float4 loads (32
/// registers a lane) per 64 FMA, P V 5 (20) per 64; the pipe returns one register a lane per clock
/// per SM against 4 warp FMAs, so the scores phase is shared-memory bound (about half the FMA
/// peak) unless uniform thread pairs halve its loads' cost, as the lane layout lets them.
/// Only key rows 0 .. prefix + (the CTA's last token) are read; tile rows past that are
/// zero-filled in shared memory without touching memory, and a key past a row's own limit gets
/// probability exactly 0 (its data is a row visible to a later token of the CTA, so finite).
/// CTAs are launched heaviest first (latest tokens) to shorten the causal tail.

#include "thinkv/kernels/prefill_attention.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace thinkv::kernels {
namespace {

constexpr int kWarps = 4;  // query heads per CTA of the simple kernel

__device__ __forceinline__ float load(const void* p, ElementType t, std::size_t i) {
  switch (t) {
    case ElementType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    case ElementType::kBf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store(void* p, ElementType t, std::size_t i, float x) {
  switch (t) {
    case ElementType::kF16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    case ElementType::kBf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

// ---- The simple kernel: any head_dim -------------------------------------------------------------

/// One warp per (query token t = blockIdx.x, query head). NC = channels per lane (D <= 32 * NC).
template <int NC>
__global__ void __launch_bounds__(kWarps * 32) prefill_attention_kernel(PrefillAttentionParams p, float scale) {
  __shared__ float qs[kWarps][kPrefillMaxHeadDim];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int t = blockIdx.x, h = blockIdx.y * kWarps + w;
  if (h >= p.num_q_heads) return;  // the whole warp: no barrier below spans warps
  const int d = p.head_dim, kvh = h / (p.num_q_heads / p.num_kv_heads);
  const std::size_t qrow = (static_cast<std::size_t>(t) * p.num_q_heads + h) * d;
  for (int c = lane; c < d; c += 32) qs[w][c] = load(p.q, p.q_type, qrow + c);
  __syncwarp();
  float m = -INFINITY, l = 0.0f, acc[NC];
#pragma unroll
  for (int i = 0; i < NC; ++i) acc[i] = 0.0f;
  const std::size_t row_stride =
      p.kv_row_stride > 0 ? static_cast<std::size_t>(p.kv_row_stride) : static_cast<std::size_t>(p.num_kv_heads) * d;
  const std::size_t head_off =
      static_cast<std::size_t>(kvh) *
      (p.kv_head_stride > 0 ? static_cast<std::size_t>(p.kv_head_stride) : static_cast<std::size_t>(d));
  const int last = (p.prefix != nullptr ? p.prefix[kvh] : 0) + t;  // rows 0..last are visible
  for (int base = 0; base <= last; base += 32) {
    const int j = base + lane;
    float s = -INFINITY;
    if (j <= last) {
      const std::size_t krow = static_cast<std::size_t>(j) * row_stride + head_off;
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot = fmaf(qs[w][c], load(p.k, p.k_type, krow + c), dot);
      s = dot * scale;
    }
    const float m_new = fmaxf(m, warp_max(s));  // finite: key `base` is always visible
    const float corr = expf(m - m_new);         // 0 on the first chunk (m = -inf)
    const float e = j <= last ? expf(s - m_new) : 0.0f;
    l = l * corr + warp_sum(e);
#pragma unroll
    for (int i = 0; i < NC; ++i) acc[i] *= corr;
    const int n = min(32, last - base + 1);
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xFFFFFFFFu, e, jj);
      const std::size_t vrow = static_cast<std::size_t>(base + jj) * row_stride + head_off;
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const int c = lane + 32 * i;
        if (c < d) acc[i] = fmaf(pj, load(p.v, p.v_type, vrow + c), acc[i]);
      }
    }
    m = m_new;
  }
#pragma unroll
  for (int i = 0; i < NC; ++i) {
    const int c = lane + 32 * i;
    if (c < d) store(p.out, p.out_type, qrow + c, acc[i] / l);
  }
}

template <int NC>
cudaError_t launch_nc(const PrefillAttentionParams& p, float scale, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.tokens), static_cast<unsigned>((p.num_q_heads + kWarps - 1) / kWarps));
  prefill_attention_kernel<NC><<<grid, kWarps * 32, 0, stream>>>(p, scale);
  return cudaGetLastError();
}

cudaError_t launch_simple(const PrefillAttentionParams& p, float scale, cudaStream_t stream) {
  const int nc = (p.head_dim + 31) / 32;
  if (nc <= 1) return launch_nc<1>(p, scale, stream);
  if (nc <= 2) return launch_nc<2>(p, scale, stream);
  if (nc <= 4) return launch_nc<4>(p, scale, stream);
  if (nc <= 8) return launch_nc<8>(p, scale, stream);
  if (nc <= 16) return launch_nc<16>(p, scale, stream);
  return launch_nc<32>(p, scale, stream);
}

// ---- The tiled kernel: head_dim 32, 64, 128, 256 -------------------------------------------------

constexpr int kTileWarps = 4;
constexpr int kTileRows = 16 * kTileWarps;  // query rows (token, group head) per CTA
constexpr int kTileThreads = 32 * kTileWarps;
constexpr float kLog2e = 1.4426950408889634f;

/// Tile geometry of head_dim D (shared memory in floats: Q, K, V tiles and the warps' P slices).
template <int D>
struct Tile {
  static constexpr int kKeys = D > 128 ? 16 : 32;  // BK: key rows per tile
  static constexpr int kKeysPerLane = kKeys / 8;   // scores per lane and row
  static constexpr int kChunks = D / 32;           // float4 output chunks per lane and row
  static constexpr int kQkStride = D + 4;          // padded: float4 reads of 4 (8) rows hit all banks
  static constexpr int kVStride = D;
  static constexpr int kQFloats = kTileRows * kQkStride;
  static constexpr int kKFloats = kKeys * kQkStride;
  static constexpr int kVFloats = kKeys * kVStride;
  static constexpr int kPFloats = kTileWarps * kKeys * 16;
  static constexpr std::size_t kSmemBytes = sizeof(float) * (kQFloats + kKFloats + kVFloats + kPFloats);
  static constexpr int kMinBlocks = D <= 64 ? 4 : D <= 128 ? 3 : 2;  // CTAs per SM (register cap)
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

/// load_rows without cp.async: plain loads of element type E, converted, stored to dst.
template <int D, int STRIDE, int ROWS, typename E>
__device__ __forceinline__ void load_rows_sync(float* dst, const E* src, std::size_t row_stride, std::size_t head_off,
                                               int base, int last) {
  const int tid = static_cast<int>(threadIdx.x);
  if constexpr (D <= kTileThreads) {
    static_assert(kTileThreads % D == 0 && ROWS % (kTileThreads / D) == 0, "passes cover whole rows");
    constexpr int kPass = kTileThreads / D;
    const int c = tid % D;
    const E* s = src + head_off + c;
#pragma unroll 8
    for (int i = 0; i < ROWS / kPass; ++i) {
      const int r = tid / D + i * kPass;
      dst[r * STRIDE + c] = base + r <= last ? to_float(s[static_cast<std::size_t>(base + r) * row_stride]) : 0.0f;
    }
  } else {
    static_assert(D % kTileThreads == 0, "a row takes whole passes");
#pragma unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const E* s = src + static_cast<std::size_t>(base + r) * row_stride + head_off;
#pragma unroll
      for (int c = tid; c < D; c += kTileThreads) dst[r * STRIDE + c] = base + r <= last ? to_float(s[c]) : 0.0f;
    }
  }
}

/// Tile rows base .. base + ROWS - 1 of a KV head (row j at j * row_stride + head_off of src) into
/// dst (row stride STRIDE floats) as FP32. Rows past `last` are zero-filled, never read. kAsync:
/// FP32 source, 16-byte aligned rows: cp.async (the caller commits and waits); else loads that
/// convert, stored before returning.
template <int D, int STRIDE, int ROWS, bool kAsync>
__device__ __forceinline__ void load_rows(float* dst, const void* src, ElementType type, std::size_t row_stride,
                                          std::size_t head_off, int base, int last) {
  const int tid = static_cast<int>(threadIdx.x);
  if constexpr (kAsync) {
    constexpr int kVecs = D / 4;  // float4 per row; a pass of the CTA covers kPass whole rows
    static_assert(kTileThreads % kVecs == 0 && ROWS % (kTileThreads / kVecs) == 0, "passes cover whole rows");
    constexpr int kPass = kTileThreads / kVecs;
    const int c = tid % kVecs * 4;
    const float* s = static_cast<const float*>(src) + head_off + c;
#pragma unroll
    for (int i = 0; i < ROWS / kPass; ++i) {
      const int r = tid / kVecs + i * kPass;
      float* d = dst + r * STRIDE + c;
      if (base + r <= last) {
        cp_async16(d, s + static_cast<std::size_t>(base + r) * row_stride);
      } else {
        *reinterpret_cast<float4*>(d) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
  } else {
    switch (type) {  // one loop per type: the loads of a thread's rows issue back to back
      case ElementType::kF16:
        load_rows_sync<D, STRIDE, ROWS>(dst, static_cast<const __half*>(src), row_stride, head_off, base, last);
        break;
      case ElementType::kBf16:
        load_rows_sync<D, STRIDE, ROWS>(dst, static_cast<const __nv_bfloat16*>(src), row_stride, head_off, base, last);
        break;
      default:
        load_rows_sync<D, STRIDE, ROWS>(dst, static_cast<const float*>(src), row_stride, head_off, base, last);
        break;
    }
  }
}

__device__ __forceinline__ void fma4(float4& acc, float a, const float4& b) {
  acc.x = fmaf(a, b.x, acc.x);
  acc.y = fmaf(a, b.y, acc.y);
  acc.z = fmaf(a, b.z, acc.z);
  acc.w = fmaf(a, b.w, acc.w);
}
__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

/// One CTA per (tile of 64 query rows, KV head): blockIdx.x = rank * num_kv_heads + kv head, the
/// tiles taken last-first. qscale = softmax scale * log2(e) (scores in log2 units, exp2).
template <int D, bool kAsync>
__global__ void __launch_bounds__(kTileThreads, Tile<D>::kMinBlocks)
    prefill_tile_kernel(PrefillAttentionParams p, float qscale, std::size_t row_stride, std::size_t head_stride,
                        int tiles) {
  using T = Tile<D>;
  constexpr int BK = T::kKeys, KPL = T::kKeysPerLane, NCH = T::kChunks, QS = T::kQkStride, VS = T::kVStride;
  extern __shared__ float4 smem4[];
  float* const qs = reinterpret_cast<float*>(smem4);
  float* const ks = qs + T::kQFloats;
  float* const vs = ks + T::kKFloats;
  const int lane = static_cast<int>(threadIdx.x) & 31, w = static_cast<int>(threadIdx.x) >> 5;
  // Lane bits 1-2 pick the row group, bits 0, 3, 4 the key (channel) group: the lanes n and n ^ 1
  // read the same Q and P addresses, n and n ^ 2 the same K and V addresses, which lets the
  // shared-memory pipe return a float4 load in 2 passes instead of 4 (uniform thread pairs).
  const int rg = (lane >> 1) & 3, kg = (lane & 1) | ((lane >> 2) & 6);
  float* const ps = vs + T::kVFloats + w * (BK * 16);  // this warp's P: [key][row rg * 4 + i]

  const int hkv = p.num_kv_heads, G = p.num_q_heads / hkv;
  const int kvh = static_cast<int>(blockIdx.x % static_cast<unsigned>(hkv));
  const int tile = tiles - 1 - static_cast<int>(blockIdx.x / static_cast<unsigned>(hkv));
  const int rows_total = p.tokens * G, r0 = tile * kTileRows;
  const int prefix = p.prefix != nullptr ? p.prefix[kvh] : 0;
  const int last = prefix + (min(r0 + kTileRows, rows_total) - 1) / G;  // the CTA's last visible key
  const std::size_t head_off = static_cast<std::size_t>(kvh) * head_stride;

  // Q tile, scaled; rows past the prompt are zeros (computed, never stored).
  for (int e = static_cast<int>(threadIdx.x); e < kTileRows * D; e += kTileThreads) {
    const int r = e / D, c = e % D, row = r0 + r;
    float x = 0.0f;
    if (row < rows_total) {
      const int t = row / G, g = row - t * G;
      const std::size_t qi =
          (static_cast<std::size_t>(t) * p.num_q_heads + static_cast<std::size_t>(kvh) * G + g) * D + c;
      x = load(p.q, p.q_type, qi) * qscale;
    }
    qs[r * QS + c] = x;
  }

  int lim[4];  // key j is visible to the lane's row i iff j <= lim[i]
  float m[4], l[4];
  float4 o[4][NCH];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = min(r0 + w * 16 + rg + 4 * i, rows_total - 1);
    lim[i] = prefix + row / G;
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int ch = 0; ch < NCH; ++ch) o[i][ch] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

  load_rows<D, QS, BK, kAsync>(ks, p.k, p.k_type, row_stride, head_off, 0, last);
  if constexpr (kAsync) cp_async_commit();

  for (int base = 0; base <= last; base += BK) {
    if constexpr (kAsync) cp_async_wait<0>();
    __syncthreads();  // K tile (and Q) complete; every warp is done with the previous V tile
    load_rows<D, VS, BK, kAsync>(vs, p.v, p.v_type, row_stride, head_off, base, last);
    if constexpr (kAsync) cp_async_commit();

    // S = Q K^T: rows rg + 4i, keys kg + 8kk of the tile.
    float s[4][KPL];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int kk = 0; kk < KPL; ++kk) s[i][kk] = 0.0f;
    }
    const float* qrow = qs + (w * 16 + rg) * QS;
    const float* krow = ks + kg * QS;
#pragma unroll 8
    for (int c = 0; c < D; c += 4) {
      float4 qv[4], kv[KPL];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = *reinterpret_cast<const float4*>(qrow + 4 * i * QS + c);
#pragma unroll
      for (int kk = 0; kk < KPL; ++kk) kv[kk] = *reinterpret_cast<const float4*>(krow + 8 * kk * QS + c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int kk = 0; kk < KPL; ++kk) s[i][kk] = dot4(qv[i], kv[kk], s[i][kk]);
      }
    }

    // Causal limit, online softmax, P to this warp's slice.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float mt = -INFINITY;
#pragma unroll
      for (int kk = 0; kk < KPL; ++kk) {
        if (base + kg + 8 * kk > lim[i]) s[i][kk] = -INFINITY;
        mt = fmaxf(mt, s[i][kk]);
      }
      mt = fmaxf(mt, __shfl_xor_sync(0xFFFFFFFFu, mt, 1));  // over the row's 8 lanes (kg bits)
      mt = fmaxf(mt, __shfl_xor_sync(0xFFFFFFFFu, mt, 8));
      mt = fmaxf(mt, __shfl_xor_sync(0xFFFFFFFFu, mt, 16));
      const float mn = fmaxf(m[i], mt);
      const float mu = mn == -INFINITY ? 0.0f : mn;  // no row sees nothing, but never exp(-inf - -inf)
      const float corr = exp2f(m[i] - mu);           // 0 on the first tile (m = -inf)
      m[i] = mn;
      float sum = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KPL; ++kk) {
        s[i][kk] = exp2f(s[i][kk] - mu);  // exactly 0 for an invisible key
        sum += s[i][kk];
      }
      l[i] = fmaf(l[i], corr, sum);
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) {
        o[i][ch].x *= corr;
        o[i][ch].y *= corr;
        o[i][ch].z *= corr;
        o[i][ch].w *= corr;
      }
    }
#pragma unroll
    for (int kk = 0; kk < KPL; ++kk) {
      *reinterpret_cast<float4*>(ps + (kg + 8 * kk) * 16 + rg * 4) =
          make_float4(s[0][kk], s[1][kk], s[2][kk], s[3][kk]);
    }

    __syncthreads();  // every warp is done with the K tile
    if (base + BK <= last) load_rows<D, QS, BK, kAsync>(ks, p.k, p.k_type, row_stride, head_off, base + BK, last);
    if constexpr (kAsync) {
      cp_async_commit();
      cp_async_wait<1>();  // the V tile (the next K tile may still be in flight)
    }
    __syncthreads();  // V tile and P complete

    // O += P V: rows rg + 4i, channels 32 ch + 4 kg .. + 3.
    const float* vcol = vs + kg * 4;
#pragma unroll 8
    for (int j = 0; j < BK; ++j) {
      const float4 pj = *reinterpret_cast<const float4*>(ps + j * 16 + rg * 4);
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) {
        const float4 vv = *reinterpret_cast<const float4*>(vcol + j * VS + 32 * ch);
        fma4(o[0][ch], pj.x, vv);
        fma4(o[1][ch], pj.y, vv);
        fma4(o[2][ch], pj.z, vv);
        fma4(o[3][ch], pj.w, vv);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float li = l[i];  // the lane's keys: the row's sum is over its 8 lanes
    li += __shfl_xor_sync(0xFFFFFFFFu, li, 1);
    li += __shfl_xor_sync(0xFFFFFFFFu, li, 8);
    li += __shfl_xor_sync(0xFFFFFFFFu, li, 16);
    const int row = r0 + w * 16 + rg + 4 * i;
    if (row < rows_total) {
      const int t = row / G, g = row - t * G;
      const std::size_t orow =
          (static_cast<std::size_t>(t) * p.num_q_heads + static_cast<std::size_t>(kvh) * G + g) * D + kg * 4;
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) {
        const std::size_t c = orow + 32 * ch;
        store(p.out, p.out_type, c, o[i][ch].x / li);
        store(p.out, p.out_type, c + 1, o[i][ch].y / li);
        store(p.out, p.out_type, c + 2, o[i][ch].z / li);
        store(p.out, p.out_type, c + 3, o[i][ch].w / li);
      }
    }
  }
}

template <int D, bool kAsync>
cudaError_t launch_tile_for(const PrefillAttentionParams& p, float qscale, std::size_t row_stride,
                            std::size_t head_stride, int tiles, int blocks, cudaStream_t stream) {
  constexpr std::size_t bytes = Tile<D>::kSmemBytes;
  // The size is fixed per instantiation (the same value on every call); the carveout asks for
  // all of the SM's shared memory, room for Tile<D>::kMinBlocks CTAs (the kernel hardly uses L1).
  cudaError_t e = cudaFuncSetAttribute(prefill_tile_kernel<D, kAsync>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes));
  if (e == cudaSuccess) {
    e = cudaFuncSetAttribute(prefill_tile_kernel<D, kAsync>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  prefill_tile_kernel<D, kAsync>
      <<<static_cast<unsigned>(blocks), kTileThreads, bytes, stream>>>(p, qscale, row_stride, head_stride, tiles);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_tile(const PrefillAttentionParams& p, float scale, std::size_t row_stride, std::size_t head_stride,
                        int tiles, int blocks, cudaStream_t stream) {
  const auto aligned = [](const void* x) { return reinterpret_cast<std::uintptr_t>(x) % 16 == 0; };
  const bool vec = p.k_type == ElementType::kF32 && p.v_type == ElementType::kF32 && aligned(p.k) && aligned(p.v) &&
                   row_stride % 4 == 0 && head_stride % 4 == 0;
  const float qscale = scale * kLog2e;
  return vec ? launch_tile_for<D, true>(p, qscale, row_stride, head_stride, tiles, blocks, stream)
             : launch_tile_for<D, false>(p, qscale, row_stride, head_stride, tiles, blocks, stream);
}

/// The tiled kernel's shared memory for head_dim d, 0 when it does not serve d.
std::size_t tile_smem_bytes(int d) {
  switch (d) {
    case 32: return Tile<32>::kSmemBytes;
    case 64: return Tile<64>::kSmemBytes;
    case 128: return Tile<128>::kSmemBytes;
    case 256: return Tile<256>::kSmemBytes;
    default: return 0;
  }
}

}  // namespace

cudaError_t check_prefill_attention(const PrefillAttentionParams& p) noexcept {
  if (p.tokens < 1 || p.num_kv_heads < 1 || p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.head_dim < 1 || p.head_dim > kPrefillMaxHeadDim || p.q == nullptr || p.k == nullptr || p.v == nullptr ||
      p.out == nullptr || !(p.softmax_scale >= 0.0f) || std::isinf(p.softmax_scale) || p.kv_row_stride < 0 ||
      p.kv_head_stride < 0 || static_cast<long long>(p.num_q_heads + kWarps - 1) / kWarps > 65535) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t launch_prefill_attention(const PrefillAttentionParams& p, cudaStream_t stream) noexcept {
  if (const cudaError_t e = check_prefill_attention(p); e != cudaSuccess) return e;
  const float scale = p.softmax_scale > 0.0f ? p.softmax_scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  const int d = p.head_dim, G = p.num_q_heads / p.num_kv_heads;
  const std::size_t row_stride =
      p.kv_row_stride > 0 ? static_cast<std::size_t>(p.kv_row_stride) : static_cast<std::size_t>(p.num_kv_heads) * d;
  const std::size_t head_stride =
      p.kv_head_stride > 0 ? static_cast<std::size_t>(p.kv_head_stride) : static_cast<std::size_t>(d);
  const long long rows = static_cast<long long>(p.tokens) * G;
  const long long tiles = (rows + kTileRows - 1) / kTileRows;
  const long long blocks = tiles * p.num_kv_heads;
  const std::size_t smem = tile_smem_bytes(d);
  bool tiled = smem > 0 && rows <= INT_MAX - kTileRows && blocks <= INT_MAX;
  if (tiled) {  // the device grants the shared memory (sm_80 and sm_90 do; sm_86/89 not 101 KiB at d 256)
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      optin = 0;
    }
    tiled = smem <= static_cast<std::size_t>(optin);
  }
  if (!tiled) return launch_simple(p, scale, stream);
  const auto t = static_cast<int>(tiles), b = static_cast<int>(blocks);
  switch (d) {
    case 32: return launch_tile<32>(p, scale, row_stride, head_stride, t, b, stream);
    case 64: return launch_tile<64>(p, scale, row_stride, head_stride, t, b, stream);
    case 128: return launch_tile<128>(p, scale, row_stride, head_stride, t, b, stream);
    default: return launch_tile<256>(p, scale, row_stride, head_stride, t, b, stream);
  }
}

}  // namespace thinkv::kernels
