/// \file paged_attention.cu
/// Decode attention over the compressed paged cache: split-K (flash-decoding) + merge.
///
/// Design. Each KV head's token list is seen as virtual positions: block j of its CSR list covers
/// positions [j * B, j * B + B) (slots; unwritten slots >= fill and evicted slots are skipped),
/// then its staged tokens. The list is cut into `splits` chunks of whole tiles (kTile positions);
/// CTA (split, kvh) of the partial kernel walks its chunk in tiles clipped to block boundaries
/// (so chunk boundaries may fall inside a block). Per tile it dequantizes the live slots' K and V
/// ONCE into shared memory (the exact expression of CpuKvBackend::read_token: element *
/// (decode_e4m3(scale) * s2), via the THINKV_HD format functions; 16-byte page loads where the
/// row size and alignment allow, key scales loaded 16 at a time), then every query head of the
/// GQA group uses them: scores (one thread per (head, token), channels summed in order with
/// __fmul_rn/__fadd_rn, so no FMA contraction: bit-identical to the CPU reference; the K tile's
/// row stride is D + 1 floats so these reads are free of bank conflicts), an online softmax
/// update in FP32 (one thread per head) and the P.V accumulation (one thread per (head,
/// channel)). The chunk's (m, l, acc[D]) per query head go to the caller's workspace; the merge
/// kernel (one CTA per query head) rescales them to the global max M and writes out.
/// Sparsity, when asked: a counting pass over the same chunks recomputes the scores bit for bit
/// and counts s - M < kSparsityLogThreshold against the merged M (atomic integer sums), then a
/// tiny kernel divides by the token count. Build without fast-math (expf, IEEE division).

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
constexpr int kMergeThreads = 128;
constexpr std::uint32_t kNoRecordId = 0xFFFFFFFFu;
constexpr int kG = kMaxQueryHeadsPerKv;

/// Slots per tile: K and V tiles take about 2 * kTile * D * 4 bytes = 16 KiB.
template <int D>
constexpr int tile_for() {
  return (2048 / D) < 32 ? (2048 / D) : 32;
}

template <int D>
struct SharedState {
  static constexpr int kTile = tile_for<D>();
  static constexpr int kKStride = D + 1;  // padded: conflict-free column reads in tile_scores
  float q[kG][D];
  float acc[kG][D];
  float k[kTile][kKStride];
  float v[kTile][D];
  float p[kG][kTile];      // scores, then probabilities
  float m[kG];             // running row max
  float l[kG];             // running denominator
  float factor[kG];        // rescale of acc for this tile
  int below[kG];           // sparsity counts
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
  int limit;  // end of the tile's slot range (<= fill) or of its staging rows
};

/// Workspace layout (all offsets 16-byte aligned).
struct Workspace {
  float* acc;   // [Hkv * splits * G, D]
  float* ml;    // [Hkv * splits * G, 2] (m, l)
  int* ntok;    // [Hkv * splits] live tokens of each chunk
  float* gmax;  // [Hq] merged row max
  int* count;   // [Hq] sparsity counts
  int* total;   // [Hkv] tokens per KV head
};

__host__ __device__ inline std::size_t align16(std::size_t x) { return (x + 15) & ~std::size_t{15}; }

__host__ __device__ inline std::size_t workspace_bytes(int hq, int hkv, int d, int splits, Workspace* w,
                                                      void* base) {
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
  char* gmax = take(static_cast<std::size_t>(hq) * sizeof(float));
  char* count = take(static_cast<std::size_t>(hq) * sizeof(int));
  char* total = take(static_cast<std::size_t>(hkv) * sizeof(int));
  if (w != nullptr) {
    w->acc = reinterpret_cast<float*>(acc);
    w->ml = reinterpret_cast<float*>(ml);
    w->ntok = reinterpret_cast<int*>(ntok);
    w->gmax = reinterpret_cast<float*>(gmax);
    w->count = reinterpret_cast<int*>(count);
    w->total = reinterpret_cast<int*>(total);
  }
  return off;
}

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

/// Vectorized dequantization of the tile's rows (16-byte units), precision P known at compile
/// time. Same per-element expression as the scalar path.
template <int D, int P>
__device__ void load_rows_vec(const PagedKvView& view, const DecodeAttentionParams& prm, int stream,
                              const TileSource& src, bool with_v, float s2k, float s2v, SharedState<D>& sh) {
  constexpr int kTile = SharedState<D>::kTile;
  constexpr int kBits = P == 0 ? 16 : P == 1 ? 8 : P == 2 ? 4 : 2;
  constexpr int kRb = D * kBits / 8;
  constexpr int kUpr = kRb / 16;      // units per row
  constexpr int kEpu = 128 / kBits;   // elements per unit
  static_assert(kRb % 16 == 0, "vector path needs 16-byte rows");
  const int bs = prm.block_size;
  const int g = prm.group_size;
  const int units = (with_v ? 2 : 1) * kTile * kUpr;
  for (int i = static_cast<int>(threadIdx.x); i < units; i += kThreads) {
    const int r = i / kUpr;
    const int u = i % kUpr;
    const int kv = r / kTile;
    const int t = r % kTile;
    if (!sh.valid[t]) continue;
    const int slot = src.base + t;
    const int c0 = u * kEpu;
    float* dst = kv ? &sh.v[t][c0] : &sh.k[t][c0];
    const uint4* rowp;
    if (src.staged) {
      rowp = reinterpret_cast<const uint4*>(view.staging + ((static_cast<std::size_t>(stream) * 2 + kv) * g + slot) * D);
    } else {
      rowp = reinterpret_cast<const uint4*>(src.page + (static_cast<std::size_t>(kv) * bs + slot) * kRb);
    }
    const uint4 w = __ldg(rowp + u);
    if constexpr (P == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = decode_bf16(static_cast<std::uint16_t>(word_of(w, j >> 1) >> (16 * (j & 1))));
    } else {
      if (kv == 0) {
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
              x = decode_element(Precision::kTernary, static_cast<std::uint8_t>((byte_of(w, e >> 2) >> ((e & 3) * 2)) & 0x3));
            }
            dst[e] = x * (decode_e4m3(byte_of(sc, j)) * s2k);
          }
        }
      } else {
        const std::uint8_t* vs = src.page + 2 * static_cast<std::size_t>(bs) * kRb +
                                 static_cast<std::size_t>(slot) * (D / g);
#pragma unroll
        for (int e = 0; e < kEpu; ++e) {
          float x;
          if constexpr (P == 1) {
            x = decode_e4m3(byte_of(w, e));
          } else if constexpr (P == 2) {
            x = decode_e2m1(static_cast<std::uint8_t>((byte_of(w, e >> 1) >> ((e & 1) * 4)) & 0xF));
          } else {
            x = decode_element(Precision::kTernary, static_cast<std::uint8_t>((byte_of(w, e >> 2) >> ((e & 3) * 2)) & 0x3));
          }
          dst[e] = x * (decode_e4m3(__ldg(vs + (c0 + e) / g)) * s2v);
        }
      }
    }
  }
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
  // 16-byte path: rows a multiple of 16 bytes and a 16-byte aligned page (staging: BF16 rows).
  const bool vec = src.staged ? (D * 2) % 16 == 0 && (reinterpret_cast<std::uintptr_t>(view.staging) & 15) == 0
                              : rb % 16 == 0 && (reinterpret_cast<std::uintptr_t>(src.page) & 15) == 0 &&
                                    (p == Precision::kBf16 || (reinterpret_cast<std::uintptr_t>(view.key_scales) & 15) == 0);
  if (vec) {
    if constexpr (D * 2 % 16 == 0) {
      if (src.staged || p == Precision::kBf16) load_rows_vec<D, 0>(view, prm, stream, src, with_v, s2k_raw, s2v_raw, sh);
    }
    if constexpr (D % 16 == 0) {
      if (!src.staged && p == Precision::kFp8E4M3) load_rows_vec<D, 1>(view, prm, stream, src, with_v, s2k_raw, s2v_raw, sh);
    }
    if constexpr (D % 32 == 0) {
      if (!src.staged && p == Precision::kNvfp4) load_rows_vec<D, 2>(view, prm, stream, src, with_v, s2k_raw, s2v_raw, sh);
    }
    if constexpr (D % 64 == 0) {
      if (!src.staged && p == Precision::kTernary) load_rows_vec<D, 3>(view, prm, stream, src, with_v, s2k_raw, s2v_raw, sh);
    }
    __syncthreads();
    return true;
  }
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
#pragma unroll 16
    for (int c = 0; c < D; ++c) s = __fadd_rn(s, __fmul_rn(sh.q[h][c], sh.k[t][c]));
    sh.p[h][t] = __fmul_rn(s, scale);
  }
  __syncthreads();
}

/// Calls fn(src) for every tile of chunk `split` of the stream's positions (blocks in list order,
/// then staging rows). All threads see the same values (block-uniform).
template <int D, typename Fn>
__device__ void for_each_chunk_tile(const PagedKvView& view, const DecodeAttentionParams& prm, int stream,
                                    int split, int splits, Fn&& fn) {
  constexpr int kTile = SharedState<D>::kTile;
  const int g = prm.group_size;
  const long long bs = prm.block_size;
  const int j_begin = view.block_indptr[stream];
  const long long nb = view.block_indptr[stream + 1] - j_begin;
  const long long staged = view.staged_count[stream];
  const long long block_pos = nb * bs;
  const long long total = block_pos + staged;
  long long chunk = (total + splits - 1) / splits;
  chunk = (chunk + kTile - 1) / kTile * kTile;
  if (chunk < kTile) chunk = kTile;
  const long long lo = static_cast<long long>(split) * chunk;
  const long long hi = lo + chunk < total ? lo + chunk : total;
  if (lo >= hi) return;
  const long long bhi = hi < block_pos ? hi : block_pos;
  for (long long j = lo / bs; j * bs < bhi; ++j) {
    const std::uint32_t b = view.block_indices[j_begin + j];
    int pr = 0;
    for (int q = kNumPrecisions - 1; q > 0; --q) {
      if (b >= view.pool_base[q]) {
        pr = q;
        break;
      }
    }
    const Precision p = static_cast<Precision>(pr);
    const std::size_t page_bytes =
        static_cast<std::size_t>(bs) *
        (2 * static_cast<std::size_t>((D * bits_of(p) + 7) / 8) + (has_group_scale(p) ? D / g : 0));
    const std::uint8_t* page = view.pages[pr] + (b - view.pool_base[pr]) * page_bytes;
    const int fill = view.block_fill[b];
    const long long a = lo > j * bs ? lo - j * bs : 0;
    long long e = bhi - j * bs;
    if (e > bs) e = bs;
    if (e > fill) e = fill;
    for (long long base = a; base < e; base += kTile) {
      fn(TileSource{false, b, pr, page, static_cast<int>(base), static_cast<int>(e)});
    }
  }
  if (hi > block_pos) {
    const long long a = lo > block_pos ? lo - block_pos : 0;
    const long long e = hi - block_pos;
    for (long long base = a; base < e; base += kTile) {
      fn(TileSource{true, 0, static_cast<int>(Precision::kBf16), nullptr, static_cast<int>(base), static_cast<int>(e)});
    }
  }
}

/// Partial attention of one chunk: grid (splits, Hkv).
template <int D>
__global__ void __launch_bounds__(kThreads) paged_decode_partial_kernel(PagedKvView view,
                                                                        DecodeAttentionParams prm,
                                                                        Workspace ws, int splits) {
  constexpr int kTile = SharedState<D>::kTile;
  __shared__ SharedState<D> sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int split = static_cast<int>(blockIdx.x);
  const int kvh = static_cast<int>(blockIdx.y);
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int stream = prm.streams[kvh];
  const float scale = prm.softmax_scale > 0.0f ? prm.softmax_scale
                                               : 1.0f / sqrtf(static_cast<float>(D));
  const std::size_t part = static_cast<std::size_t>(kvh) * splits + split;
  float* acc_out = ws.acc + part * group * D;
  float* ml_out = ws.ml + part * group * 2;
  const bool stream_ok = stream >= 0 && stream < view.num_streams;
  const float* q = prm.q + static_cast<std::size_t>(kvh) * group * D;
  for (int i = tid; i < group * D; i += kThreads) {
    sh.q[i / D][i % D] = q[i];
    sh.acc[i / D][i % D] = 0.0f;
  }
  if (tid < group) {
    sh.m[tid] = -INFINITY;
    sh.l[tid] = 0.0f;
  }
  __syncthreads();

  int n_tokens = 0;  // same in every thread
  if (stream_ok) {
    for_each_chunk_tile<D>(view, prm, stream, split, splits, [&](const TileSource& src) {
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
#pragma unroll
        for (int t = 0; t < kTile; ++t) {
          if (sh.valid[t]) a += sh.p[h][t] * sh.v[t][c];
        }
        sh.acc[h][c] = a;
      }
      __syncthreads();
    });
  }
  for (int i = tid; i < group * D; i += kThreads) acc_out[i] = sh.acc[i / D][i % D];
  if (tid < group) {
    ml_out[2 * tid] = sh.m[tid];
    ml_out[2 * tid + 1] = sh.l[tid];
  }
  if (tid == 0) ws.ntok[part] = n_tokens;
}

/// Merge: one CTA per query head. Rescales the chunks to the global max M and writes out;
/// records M, the token count of the KV head and zeroes the sparsity count.
__global__ void __launch_bounds__(kMergeThreads) paged_decode_merge_kernel(DecodeAttentionParams prm, Workspace ws,
                                                                           int splits, int d) {
  const int qh = static_cast<int>(blockIdx.x);
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int kvh = qh / group;
  const int h = qh % group;
  const int tid = static_cast<int>(threadIdx.x);
  float gm = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    const std::size_t part = static_cast<std::size_t>(kvh) * splits + s;
    gm = fmaxf(gm, ws.ml[(part * group + h) * 2]);
  }
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const std::size_t part = static_cast<std::size_t>(kvh) * splits + s;
    const float ls = ws.ml[(part * group + h) * 2 + 1];
    if (ls > 0.0f) l += ls * expf(ws.ml[(part * group + h) * 2] - gm);
  }
  float* out = prm.out + static_cast<std::size_t>(qh) * d;
  for (int c = tid; c < d; c += kMergeThreads) {
    float a = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const std::size_t part = static_cast<std::size_t>(kvh) * splits + s;
      const float ls = ws.ml[(part * group + h) * 2 + 1];
      if (ls > 0.0f) a += ws.acc[(part * group + h) * d + c] * expf(ws.ml[(part * group + h) * 2] - gm);
    }
    out[c] = a / l;  // no token: 0 / 0 = NaN (the CPU backend refuses such a stream)
  }
  if (tid == 0) {
    ws.gmax[qh] = gm;
    ws.count[qh] = 0;
    if (h == 0) {
      int n = 0;
      for (int s = 0; s < splits; ++s) n += ws.ntok[static_cast<std::size_t>(kvh) * splits + s];
      ws.total[kvh] = n;
    }
  }
}

/// Sparsity: recompute each score of the chunk bit for bit and count s - M < threshold.
template <int D>
__global__ void __launch_bounds__(kThreads) paged_decode_sparsity_kernel(PagedKvView view,
                                                                         DecodeAttentionParams prm,
                                                                         Workspace ws, int splits) {
  constexpr int kTile = SharedState<D>::kTile;
  __shared__ SharedState<D> sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int split = static_cast<int>(blockIdx.x);
  const int kvh = static_cast<int>(blockIdx.y);
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int stream = prm.streams[kvh];
  if (stream < 0 || stream >= view.num_streams) return;
  const float scale = prm.softmax_scale > 0.0f ? prm.softmax_scale
                                               : 1.0f / sqrtf(static_cast<float>(D));
  const float* q = prm.q + static_cast<std::size_t>(kvh) * group * D;
  for (int i = tid; i < group * D; i += kThreads) sh.q[i / D][i % D] = q[i];
  if (tid < group) {
    sh.m[tid] = ws.gmax[kvh * group + tid];
    sh.below[tid] = 0;
  }
  __syncthreads();
  for_each_chunk_tile<D>(view, prm, stream, split, splits, [&](const TileSource& src) {
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
  if (tid < group && sh.below[tid] != 0) atomicAdd(&ws.count[kvh * group + tid], sh.below[tid]);
}

__global__ void paged_decode_sparsity_finish(DecodeAttentionParams prm, Workspace ws) {
  const int qh = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (qh >= prm.num_q_heads) return;
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const int n = ws.total[qh / group];
  prm.sparsity[qh] = n > 0 ? static_cast<float>(ws.count[qh]) / static_cast<float>(n) : NAN;
}

template <int D>
cudaError_t launch_for(const PagedKvView& view, const DecodeAttentionParams& p, int splits, cudaStream_t s) {
  Workspace ws{};
  workspace_bytes(p.num_q_heads, p.num_kv_heads, D, splits, &ws, p.workspace);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.num_kv_heads));
  paged_decode_partial_kernel<D><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  paged_decode_merge_kernel<<<p.num_q_heads, kMergeThreads, 0, s>>>(p, ws, splits, D);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (p.sparsity == nullptr) return cudaSuccess;
  paged_decode_sparsity_kernel<D><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  paged_decode_sparsity_finish<<<(p.num_q_heads + 127) / 128, 128, 0, s>>>(p, ws);
  return cudaGetLastError();
}

bool heads_ok(const DecodeAttentionParams& p) {
  return p.num_kv_heads >= 1 && p.num_q_heads >= 1 && p.num_q_heads % p.num_kv_heads == 0 &&
         p.num_q_heads / p.num_kv_heads <= kMaxQueryHeadsPerKv;
}

}  // namespace

int paged_decode_attention_splits(const DecodeAttentionParams& p) noexcept {
  if (p.num_splits > 0) return p.num_splits < kMaxSplits ? p.num_splits : kMaxSplits;
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      sms < 1) {
    (void)cudaGetLastError();
    sms = 132;
  }
  const int hkv = p.num_kv_heads > 0 ? p.num_kv_heads : 1;
  int splits = (4 * sms + hkv - 1) / hkv;  // ~4 CTAs per SM
  if (splits < 1) splits = 1;
  if (splits > kMaxSplits) splits = kMaxSplits;
  return splits;
}

std::size_t paged_decode_attention_workspace_size(const DecodeAttentionParams& p) noexcept {
  if (!heads_ok(p) || p.head_dim < 1) return 0;
  return workspace_bytes(p.num_q_heads, p.num_kv_heads, p.head_dim, paged_decode_attention_splits(p), nullptr,
                         nullptr);
}

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
  if (p.num_splits < 0 || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (p.workspace == nullptr || (reinterpret_cast<std::uintptr_t>(p.workspace) & 15) != 0) return cudaErrorInvalidValue;
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
  const int splits = paged_decode_attention_splits(p);
  switch (p.head_dim) {
    case 8: return launch_for<8>(view, p, splits, stream);
    case 64: return launch_for<64>(view, p, splits, stream);
    case 128: return launch_for<128>(view, p, splits, stream);
    case 256: return launch_for<256>(view, p, splits, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace thinkv::kernels
