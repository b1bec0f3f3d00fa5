/// \file paged_attention.cu
/// Decode attention over the compressed paged cache, correctness first (no tuning yet).
///
/// Design: one CTA (128 threads) per KV head. The CTA walks its stream's blocks (CSR list), then
/// its staged tokens, in tiles of kTile slots. Per tile it dequantizes the live slots' K and V
/// ONCE into shared memory (the exact expression of CpuKvBackend::read_token: element *
/// (decode_e4m3(scale) * s2), via the THINKV_HD format functions), then every query head of the
/// GQA group uses them: scores (one thread per (head, token), channels summed in order with
/// __fmul_rn/__fadd_rn, so no FMA contraction: bit-identical to the CPU reference), an online
/// softmax update in FP32 (one thread per head), and the P.V accumulation (one thread per (head,
/// channel)). Unwritten slots (>= fill) and evicted slots (mask bit) are skipped.
/// Sparsity, when asked: a second pass over the keys after the row max m is final, recomputing
/// the scores bit for bit and counting s - m < kSparsityLogThreshold (no scratch buffer).
/// Build without fast-math (expf, IEEE division).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "thinkv/formats/bf16.hpp"
#include "thinkv/formats/group_quant.hpp"
#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/reference/attention.hpp"

namespace thinkv::kernels {
namespace {

constexpr int kThreads = 128;
constexpr std::uint32_t kNoRecordId = 0xFFFFFFFFu;

/// Slots per tile: K and V tiles take 2 * kTile * D * 4 bytes = 16 KiB (8 slots at D = 256).
template <int D>
constexpr int tile_for() {
  return (2048 / D) < 32 ? (2048 / D) : 32;
}

template <int D>
struct SharedState {
  static constexpr int kTile = tile_for<D>();
  static constexpr int G = kMaxQueryHeadsPerKv;
  float q[G][D];
  float acc[G][D];
  float k[kTile][D];
  float v[kTile][D];
  float p[G][kTile];       // scores, then probabilities
  float m[G];              // running row max
  float l[G];              // running denominator
  float factor[G];         // rescale of acc for this tile
  int below[G];            // sparsity counts
  int valid[kTile];        // slot of the tile holds a live token
  std::uint32_t record[kTile];
};

/// Where one tile's slots come from: a block (slot = base + t) or the staging buffer (row).
struct TileSource {
  bool staged;
  std::uint32_t block;
  int precision;
  const std::uint8_t* page;
  int base;   // first slot / staging row of the tile
  int limit;  // fill (block) or staged count
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

/// Marks the tile's live slots and dequantizes their K (and V when with_v) into shared memory.
/// Returns (block-uniformly) whether any slot of the tile is live.
template <int D>
__device__ bool load_tile(const PagedKvView& view, const DecodeAttentionParams& prm, int stream,
                          const TileSource& src, bool with_v, SharedState<D>& sh) {
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
  const float s2k_raw = src.staged ? 0.0f : view.s2[(static_cast<std::size_t>(stream) * 2 + 0) * kNumPrecisions + src.precision];
  const float s2v_raw = src.staged ? 0.0f : view.s2[(static_cast<std::size_t>(stream) * 2 + 1) * kNumPrecisions + src.precision];
  for (int i = tid; i < kTile * D; i += kThreads) {
    const int t = i / D;
    const int c = i % D;
    if (!sh.valid[t]) continue;
    const int slot = src.base + t;
    float kx, vx = 0.0f;
    if (src.staged) {
      const std::uint16_t* sk = view.staging + ((static_cast<std::size_t>(stream) * 2 + 0) * g + slot) * D;
      const std::uint16_t* sv = view.staging + ((static_cast<std::size_t>(stream) * 2 + 1) * g + slot) * D;
      kx = decode_bf16(sk[c]);
      if (with_v) vx = decode_bf16(sv[c]);
    } else {
      const std::uint8_t* kr = src.page + static_cast<std::size_t>(slot) * rb;
      const std::uint8_t* vr = src.page + (static_cast<std::size_t>(bs) + slot) * rb;
      if (p == Precision::kBf16) {
        kx = element_of(src.precision, kr, c);
        if (with_v) vx = element_of(src.precision, vr, c);
      } else {
        // read_token: element * (decode_e4m3(scale) * s2), s2 as stored (0 only when every
        // group so far was all zero, whose codes decode to 0 for any s2).
        const std::uint32_t rec = sh.record[t];
        kx = rec == kNoRecordId
                 ? NAN
                 : element_of(src.precision, kr, c) *
                       (decode_e4m3(view.key_scales[static_cast<std::size_t>(rec) * D + c]) * s2k_raw);
        if (with_v) {
          const std::uint8_t* vs = src.page + 2 * static_cast<std::size_t>(bs) * rb +
                                   static_cast<std::size_t>(slot) * (D / g);
          vx = element_of(src.precision, vr, c) * (decode_e4m3(vs[c / g]) * s2v_raw);
        }
      }
    }
    sh.k[t][c] = kx;
    if (with_v) sh.v[t][c] = vx;
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
    for (int c = 0; c < D; ++c) s = __fadd_rn(s, __fmul_rn(sh.q[h][c], sh.k[t][c]));
    sh.p[h][t] = __fmul_rn(s, scale);
  }
  __syncthreads();
}

/// Calls fn(src) for every tile of the stream: its blocks in list order, then its staging rows.
template <int D, typename Fn>
__device__ void for_each_tile(const PagedKvView& view, const DecodeAttentionParams& prm, int stream,
                              Fn&& fn) {
  constexpr int kTile = SharedState<D>::kTile;
  const int g = prm.group_size;
  for (int j = view.block_indptr[stream]; j < view.block_indptr[stream + 1]; ++j) {
    const std::uint32_t b = view.block_indices[j];
    int pr = 0;
    for (int q = kNumPrecisions - 1; q > 0; --q) {
      if (b >= view.pool_base[q]) {
        pr = q;
        break;
      }
    }
    const Precision p = static_cast<Precision>(pr);
    const std::size_t page_bytes =
        static_cast<std::size_t>(prm.block_size) *
        (2 * static_cast<std::size_t>((D * bits_of(p) + 7) / 8) + (has_group_scale(p) ? D / g : 0));
    const std::uint8_t* page = view.pages[pr] + (b - view.pool_base[pr]) * page_bytes;
    const int fill = view.block_fill[b];
    for (int base = 0; base < fill; base += kTile) fn(TileSource{false, b, pr, page, base, fill});
  }
  const int staged = view.staged_count[stream];
  for (int base = 0; base < staged; base += kTile) {
    fn(TileSource{true, 0, static_cast<int>(Precision::kBf16), nullptr, base, staged});
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads) paged_decode_attention_kernel(PagedKvView view,
                                                                          DecodeAttentionParams prm) {
  constexpr int kTile = SharedState<D>::kTile;
  __shared__ SharedState<D> sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int kvh = static_cast<int>(blockIdx.x);
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int stream = prm.streams[kvh];
  const float scale = prm.softmax_scale > 0.0f ? prm.softmax_scale
                                               : 1.0f / sqrtf(static_cast<float>(D));
  float* out = prm.out + static_cast<std::size_t>(kvh) * group * D;
  if (stream < 0 || stream >= view.num_streams) {
    for (int i = tid; i < group * D; i += kThreads) out[i] = NAN;
    if (prm.sparsity != nullptr && tid < group) prm.sparsity[kvh * group + tid] = NAN;
    return;
  }
  const float* q = prm.q + static_cast<std::size_t>(kvh) * group * D;
  for (int i = tid; i < group * D; i += kThreads) {
    sh.q[i / D][i % D] = q[i];
    sh.acc[i / D][i % D] = 0.0f;
  }
  if (tid < group) {
    sh.m[tid] = -INFINITY;
    sh.l[tid] = 0.0f;
    sh.below[tid] = 0;
  }
  __syncthreads();

  int n_tokens = 0;  // same in every thread
  for_each_tile<D>(view, prm, stream, [&](const TileSource& src) {
    if (!load_tile<D>(view, prm, stream, src, true, sh)) return;
    for (int t = 0; t < kTile; ++t) n_tokens += sh.valid[t];
    tile_scores<D>(group, scale, sh);
    // Online softmax: one thread per query head.
    if (tid < group) {
      const int h = tid;
      float tmax = -INFINITY;
      for (int t = 0; t < kTile; ++t) {
        if (sh.valid[t]) tmax = fmaxf(tmax, sh.p[h][t]);
      }
      const float m_new = fmaxf(sh.m[h], tmax);
      const float f = expf(sh.m[h] - m_new);  // m = -inf at first: f = 0
      float sum = 0.0f;
      for (int t = 0; t < kTile; ++t) {
        const float e = sh.valid[t] ? expf(sh.p[h][t] - m_new) : 0.0f;
        sh.p[h][t] = e;
        sum += e;
      }
      sh.l[h] = sh.l[h] * f + sum;
      sh.m[h] = m_new;
      sh.factor[h] = f;
    }
    __syncthreads();
    for (int i = tid; i < group * D; i += kThreads) {
      const int h = i / D;
      const int c = i % D;
      float a = sh.acc[h][c] * sh.factor[h];
      for (int t = 0; t < kTile; ++t) {
        if (sh.valid[t]) a += sh.p[h][t] * sh.v[t][c];
      }
      sh.acc[h][c] = a;
    }
    __syncthreads();
  });

  // n_tokens == 0: l == 0, out = 0/0 = NaN (the CPU backend refuses such a stream).
  for (int i = tid; i < group * D; i += kThreads) out[i] = sh.acc[i / D][i % D] / sh.l[i / D];
  if (prm.sparsity == nullptr) return;

  // Second pass: recompute each score bit for bit and compare with the final max.
  for_each_tile<D>(view, prm, stream, [&](const TileSource& src) {
    if (!load_tile<D>(view, prm, stream, src, false, sh)) return;
    tile_scores<D>(group, scale, sh);
    if (tid < group) {
      const int h = tid;
      int below = 0;
      for (int t = 0; t < kTile; ++t) {
        if (sh.valid[t]) below += __fsub_rn(sh.p[h][t], sh.m[h]) < kSparsityLogThreshold;
      }
      sh.below[h] += below;
    }
    __syncthreads();
  });
  if (tid < group) {
    prm.sparsity[kvh * group + tid] =
        n_tokens > 0 ? static_cast<float>(sh.below[tid]) / static_cast<float>(n_tokens) : NAN;
  }
}

template <int D>
cudaError_t launch_for(const PagedKvView& view, const DecodeAttentionParams& p, cudaStream_t s) {
  paged_decode_attention_kernel<D><<<p.num_kv_heads, kThreads, 0, s>>>(view, p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t check_paged_decode_attention(const PagedKvView& v, const DecodeAttentionParams& p) noexcept {
  const bool dim_ok = p.head_dim == 8 || p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256;
  const bool group_ok = (p.group_size == 8 || p.group_size == 16 || p.group_size == 32) &&
                        p.head_dim % p.group_size == 0;
  if (!dim_ok || !group_ok || p.block_size < 1 || p.block_size > 4096) return cudaErrorInvalidValue;
  if (p.num_kv_heads < 1 || p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.num_q_heads / p.num_kv_heads > kMaxQueryHeadsPerKv) {
    return cudaErrorInvalidValue;
  }
  if (!(p.softmax_scale >= 0.0f) || std::isinf(p.softmax_scale)) return cudaErrorInvalidValue;
  if (p.streams == nullptr || p.q == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  if (v.num_streams < 1 || v.s2 == nullptr || v.block_fill == nullptr || v.evict_mask == nullptr ||
      v.slot_record == nullptr || v.block_indptr == nullptr || v.staging == nullptr ||
      v.staged_count == nullptr) {
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
  switch (p.head_dim) {
    case 8: return launch_for<8>(view, p, stream);
    case 64: return launch_for<64>(view, p, stream);
    case 128: return launch_for<128>(view, p, stream);
    case 256: return launch_for<256>(view, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace thinkv::kernels
