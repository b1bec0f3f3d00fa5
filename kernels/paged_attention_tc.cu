/// \file paged_attention_tc.cu
/// Decode attention main pass on the tensor cores (head_dim 64, 128, 256).
///
/// Same work split as the CUDA-core pass (paged_attention.cu): grid (splits, Hkv), 4 warps per CTA,
/// partial (m, l, acc) per chunk into the workspace, then the merge kernel. The walk goes by
/// units, not slots: a unit is one 64-bit word of a block's eviction mask (the whole block when
/// B <= 64) or the chunk's staging rows. Each warp takes a contiguous quarter of the chunk's
/// units, 32 at a time (one lane loads a unit's block id, fill, pool and mask word and forms its
/// live-slot mask); the live slots of each precision group are written into a per-warp queue by
/// all lanes at once (an inclusive scan of the units' counts places each entry) and the queue
/// runs in full 16-token windows (a partial window only when the group changes or the walk
/// ends). Evicted slots cost a mask bit, not a lane.
/// The math of a window is two mma.sync.m16n8k16 products with FP32 accumulation:
///
///   scores  S[16 tokens x 8 heads]  = K'[16 x D] . Q^T[D x 8]     (A = K', B = Q)
///   output  O^T[D x 8 heads]       += V'^T[D x 16 tokens] . P'^T[16 x 8] (A = V'^T, B = P')
///
/// The 8 mma columns hold the GQA group's query heads in one of two layouts, fixed per launch:
///  - packed (G <= 4, e.g. Llama-3-8B): column 2h + e holds term e of head h's split (below), so
///    one FP16 mma carries both terms (BF16: two mmas, columns (hi, mid) then (lo, 0)); a head's
///    score or output is the sum of its two columns. Each lane then owns one head, not two.
///  - one column per head (4 < G <= 8), padded with zero queries; the terms are separate mmas.
///
/// Exactness: every product is exact and only the FP32 accumulation rounds, as in the CUDA-core
/// pass (the result is not bit-identical to the CPU reference; the sparsity passes recompute
/// exact scores). K' and V' are the stored elements times their E4M3 group scales, exact in the
/// mma's input type; the FP32 second-level scales s2 are applied outside the products (s2k to
/// the scores; s2v as the unit of the output accumulator, below). Two input types:
///  - BF16 pages and staged rows run BF16 mma. Q and P are split into three BF16 terms
///    (x = hi + mid + lo, the residual below 2^-24 |x|).
///  - Quantized pages run FP16 mma, with no table and no FP32 round trip. E4M3 codes and scales
///    become FP16 by the hardware conversion (cvt.rn.f16x2.e4m3x2, exact). NVFP4 and ternary
///    code bits are placed into FP16 fields: an E2M1 code s e1 e0 m becomes sign bit 15, exponent
///    bits 11..10 = e1 e0, mantissa bit 9 = m, i.e. its value x 2^-14 (the E2M1 subnormal maps
///    onto the FP16 subnormal); a ternary code becomes +-2^-14 (or 0) through one byte
///    permute. One FP16x2 multiply by the scales then gives value x scale x 2^-14: at most 6
///    significant bits, a multiple of 2^-24 in [2^-24, 0.17], exact in FP16 including its
///    subnormals. FP8 elements are multiplied by scale x 2^-4 (itself exact): at most 8
///    significant bits, a multiple of 2^-22, at most 448 x 448 / 16 = 12,544: exact. Q is split
///    into two FP16 terms of Q x 2^eq (eq puts max|q| in [2^14, 2^15): no overflow, residual
///    below 2^-22 |q| + 2^-39 max|q|), P into two FP16 terms of p x 2^14 (residual below
///    2^-22 p + 2^-38). Those residuals are the only inexact inputs: each score is off by at most
///    ~2^-22 sum |q_c k_c|, the order of the FP32 accumulation's own rounding.
/// The output accumulator holds O / u, u a power of two per precision group: 1 for BF16 rows;
/// for quantized groups the factor that undoes V' and P' scalings (2^-10 for FP8) times s2v when
/// s2v lies outside [2^-14, 1] (else s2v goes into P', which it would overflow or underflow in
/// FP16). A change of group rescales the accumulator by u_old / u_new together with the
/// online-softmax factor (exact: powers of two).
///
/// Layouts. The dot products do not care about channel order, so each lane takes contiguous
/// channels: for Q.K^T, lane (gq = lane / 4, t = lane % 4) holds tokens gq and gq + 8 and the
/// channels t*D/4 .. t*D/4 + D/4 - 1; for P.V, lane (gq, t) holds tokens 2t, 2t+1, 2t+8, 2t+9 and
/// the channels gq*D/8 .. gq*D/8 + D/8 - 1, so every lane reads whole contiguous pieces of rows
/// (16 + 8 bytes per token and lane for NVFP4 at D = 128). Within a lane's channels, 8-channel
/// block j holds k-steps 2j, 2j+1 of Q.K^T and m-tiles 4j .. 4j+3 of P.V:
///  - Q.K^T, BF16 map (BF16, FP8, staged): k-step 2j+h takes channel pairs (8j+4h, +1) and
///    (8j+4h+2, +3); FP16 map (NVFP4, ternary): pairs (8j+2h, 8j+2h+4) and (8j+2h+1, 8j+2h+5),
///    the pairs one shift apart in the packed codes. Q's fragments exist in BF16 (BF16 map) and
///    FP16 (both maps).
///  - P.V (all precisions): m-tile 4j+u rows gq and gq+8 are channels 8j+u and 8j+u+4.
/// The scores come out as (tokens gq, gq+8) x (heads 2t, 2t+1); they reach P.V's B layout through
/// a 16 x 8 shared-memory transpose per warp.
///
/// Loads are 16/8/4/2-byte vectors when every page, page size, staging row and the key-scale
/// array is 16-byte aligned (always, for caches built by the CUDA backend); a launch over any
/// other layout runs the byte-load instance of the kernel (kVec = false) instead of branching
/// per load.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "paged_attention_common.cuh"

namespace thinkv::kernels::detail {
namespace {

constexpr int kN = 8;  // mma N: the query heads of one KV head, zero-padded
static_assert(kMaxQueryHeadsPerKv <= kN, "the tensor-core pass holds at most 8 query heads per KV head");
constexpr int kWin = 16;                      // tokens per window (mma M of the scores, K of P.V)
constexpr int kStagedGroup = kNumPrecisions;  // precision group of the staged (BF16) rows

/// Bits [a, e) of a 64-bit word (0 <= a; e clamped to 64; empty when e <= a).
__device__ __forceinline__ unsigned long long bit_range(long long a, long long e) {
  if (e > 64) e = 64;
  if (e <= a) return 0ull;
  const unsigned long long below_e = e == 64 ? ~0ull : (1ull << e) - 1ull;
  return below_e & (~0ull << a);
}

/// 2^x by the hardware's ex2.approx (what exp2f compiles to, within 2 ulp), results below 2^-126
/// flushed to 0 (exp2f scales those into the subnormals at three more instructions per call): a
/// probability under 2^-126 of the row's max adds nothing an FP32 sum of it can hold.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// Where entry e (0..15, in the walk's order: consecutive live slots of a unit) of a window sits
/// among the window's 16 token slots: entries 2i and 2i + 1 in slots i and i + 8, the two tokens a
/// lane pairs in Q.K^T (gq, gq + 8). Consecutive live slots usually share a key-scale record, so
/// each lane's two tokens do, and the window takes the one-record path (one load and conversion
/// of the key scales per lane) also when its 16 tokens come from several units (a partly evicted
/// cache). window_entry is the inverse.
__host__ __device__ constexpr int window_slot(int e) { return ((e & 1) << 3) | (e >> 1); }
__host__ __device__ constexpr int window_entry(int x) { return ((x & 7) << 1) | (x >> 3); }
static_assert(window_entry(window_slot(5)) == 5 && window_entry(window_slot(14)) == 14, "inverse");

/// The position of set bit k (0-based, k < popc) of the 64-bit word hi:lo.
__device__ __forceinline__ unsigned nth_set_bit(unsigned lo, unsigned hi, int k) {
  unsigned pos = 0u;
  unsigned w = lo;
  int p = __popc(lo);
  if (k >= p) {
    k -= p;
    w = hi;
    pos = 32u;
  }
#pragma unroll
  for (int n = 16; n >= 1; n >>= 1) {
    p = __popc(w & ((1u << n) - 1u));
    if (k >= p) {
      k -= p;
      w >>= n;
      pos += static_cast<unsigned>(n);
    }
  }
  return pos;
}

/// 4 bytes global -> shared without a register (cp.async, sm_80+); cp_async_wait_all makes the
/// thread's copies complete (a warp barrier after it publishes them to the warp).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

template <int D>
struct TcShape {
  static_assert(D % 64 == 0, "head_dim 64, 128 or 256");
  static constexpr int kNC = D > 128 ? 2 : 1;  // channel chunks (register budget)
  static constexpr int kKSteps = D / 16;       // k16 steps of Q.K^T
  static constexpr int kKStepsPerChunk = kKSteps / kNC;
  static constexpr int kKCh = D / 4 / kNC;  // K channels per lane, token, chunk
  static constexpr int kMTiles = D / 16;    // m16 tiles of O^T
  static constexpr int kMTilesPerChunk = kMTiles / kNC;
  static constexpr int kVCh = D / 8 / kNC;  // V channels per lane, token, chunk
  // CTAs per SM asked of ptxas (Release, sm_90a, CUDA 13.0): D = 64 fits 128 registers; D = 128
  // gets 168 (3 CTAs per SM, no spills; 4 CTAs would spill 160 bytes) and D = 256 255 (12 bytes of
  // spills). Measured on the H200 (2026-11-29, bench_paged_attention): forcing 4 CTAs at D = 128
  // (then 204 bytes of spills) was no faster once the number of waves is accounted for.
  static constexpr int kMinBlocks = D == 64 ? 4 : D == 128 ? 3 : 2;
  // Live slots a warp's queue holds: under 16 carried over plus at least one unit (<= 64 slots);
  // more lets a round of the walk take more units at once. D = 256 keeps the CTA's static shared
  // memory under 48 KB.
  static constexpr int kQueue = D == 256 ? 80 : 128;
  static_assert(kQueue >= kWin - 1 + 64, "the queue must take one whole unit after a partial window");
};

template <int D>
struct TcShared {
  union {
    struct {
      uint2 b[TcShape<D>::kKSteps][3][32];   // BF16 (hi, mid, lo) B fragments of Q, BF16 map
      uint2 h[TcShape<D>::kKSteps][3][32];   // FP16 (hi, mid, lo) of Q x 2^eq, FP16 map (NVFP4, ternary)
      uint2 h8[TcShape<D>::kKSteps][3][32];  // the same in the BF16 map (FP8)
    } qf;                                    // during the walk
    float acc[kWarps][kN][D];                // warps' partial outputs, after it
  } u;
  float m[kWarps][kN];
  float l[kWarps][kN];
  int ntok[kWarps];
  float pt[kWarps][kWin][kN + 1];     // P transpose (padded row)
  float rows_f[kStagedGroup + 1][4];  // TcRows (fk, u, pm, inv_u) of each precision group
  // Per warp, per pool: (pages - pool_base x page bytes, page bytes), so a block's page is one
  // multiply-add (modulo 2^64) after one shared load; written by the warp before its walk.
  ulonglong2 pool_tab[kWarps][kNumPrecisions];
  // The warp's queue of live slots of one precision group (TcShape::kQueue):
  // each slot's K row, V row and value scales (computed once per slot by its lane, not by every
  // lane of a window that reads it) and key-scale record.
  const std::uint8_t* krow[kWarps][TcShape<D>::kQueue];
  const std::uint8_t* vrow[kWarps][TcShape<D>::kQueue];
  const std::uint8_t* vscale[kWarps][TcShape<D>::kQueue];
  std::uint32_t record[kWarps][TcShape<D>::kQueue];
};

/// Two E4M3 codes (bytes 0 and 1 of w) -> FP16x2 of their exact values (hardware
/// cvt.rn.f16x2.e4m3x2 on sm_89+; E4M3 values are exact in FP16).
__device__ __forceinline__ std::uint32_t e4m3x2_f16(std::uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  return static_cast<std::uint32_t>(h.x) | (static_cast<std::uint32_t>(h.y) << 16);
}

constexpr std::uint32_t kF16x2Pow2m4 = 0x2C002C00u;  // FP16x2 (2^-4, 2^-4): FP8 scales are used x 2^-4

/// FP16x2 of (value x 2^-14) of nibbles K and K + 4 (K = 0..3) of x: one byte permute of the
/// even or odd FP16 high bytes (fp16_placement.hpp; nibble K is byte K / 2 of them, K + 4 byte
/// K / 2 + 2) with zero low bytes. The even / odd words are shared by the pairs of a word: 2.75
/// operations per pair instead of 4 (two shifts, two masks) for placing each pair's bits.
template <int K>
__device__ __forceinline__ std::uint32_t e2m1_pair_f16(std::uint32_t x) {
  const std::uint32_t e = K % 2 == 0 ? e2m1_even_fp16_high_bytes(x) : e2m1_odd_fp16_high_bytes(x);
  constexpr unsigned b = K / 2;
  return __byte_perm(e, 0u, 4u | (b << 4) | (4u << 8) | ((b + 2) << 12));
}

/// FP8: FP16x2 of the two E4M3 values of channels (8j + k, 8j + k + 4). NVFP4 and ternary:
/// FP16x2 of (value x 2^-14) of the codes of channels 8j + k and 8j + k + 4 (k = 0..3) of a
/// lane's 8-channel block j: NVFP4 (block j = word j, channel 8j + i in bits 4i..4i+3) by
/// placing the E2M1 bits into the FP16 fields; ternary (block j = half word j % 2 of word j / 2,
/// channel 8j + i in bits 2i..2i+1) through a byte permute of the table {0, +2^-14, 0, -2^-14}
/// (kTernaryFp16HighBytes: high bytes 0x00, 0x04, 0x00, 0x84; low bytes 0).
template <int P, int K, int NW>
__device__ __forceinline__ std::uint32_t code_pair_f16(const std::uint32_t (&w)[NW], int j) {
  if constexpr (P == 1) {  // FP8 (block j = words 2j, 2j + 1): the two E4M3 values, exact
    return e4m3x2_f16(__byte_perm(w[2 * j], w[2 * j + 1], static_cast<unsigned>(K | ((4 + K) << 4))));
  } else if constexpr (P == 2) {
    return e2m1_pair_f16<K>(w[j]);
  } else {
    const std::uint32_t x = w[j / 2];
    const int sh = 16 * (j % 2) + 2 * K - 4;  // codes 8j+K, 8j+K+4 -> selector nibbles 1 and 3
    const std::uint32_t sel = (sh >= 0 ? x >> sh : x << -sh) & 0x3030u;
    return __byte_perm(kTernaryFp16HighBytes, 0u, sel);
  }
}

/// P.V's A operand: FP16x2 of channel 8j + K (K = 0..7) of two tokens, the one with words w0 in
/// the low half, w1 in the high half: FP8 the E4M3 values; NVFP4 and ternary value x 2^-14 (the
/// same placements as code_pair_f16). The two tokens' bytes are interleaved first (one byte
/// permute shared by 4 or 8 channels), so no permute is needed after decoding.
template <int P, int K, int NW>
__device__ __forceinline__ std::uint32_t code_tok_pair_f16(const std::uint32_t (&w0)[NW], const std::uint32_t (&w1)[NW],
                                                           int j) {
  if constexpr (P == 1) {  // channel 8j + K = byte K % 4 of word 2j + K / 4
    constexpr unsigned b = K % 4;
    return e4m3x2_f16(__byte_perm(w0[2 * j + K / 4], w1[2 * j + K / 4], b | ((4 + b) << 4)));
  } else if constexpr (P == 2) {
    // Half K / 4 of word j of each token: token 0's nibbles at bits 0..15, token 1's at 16..31.
    return e2m1_pair_f16<K % 4>(__byte_perm(w0[j], w1[j], K < 4 ? 0x5410u : 0x7632u));
  } else {
    // Half j % 2 of word j / 2 of each token, bytes interleaved (t0 b, t1 b, t0 b+1, t1 b+1): the
    // two codes of a channel are 8 bits apart, as the permute's selector nibbles 1 and 3 need.
    const unsigned h = 2u * static_cast<unsigned>(j % 2);
    const std::uint32_t x = __byte_perm(w0[j / 2], w1[j / 2], h | ((4 + h) << 4) | ((h + 1) << 8) | ((5 + h) << 12));
    constexpr int sh = K < 4 ? 2 * K - 4 : 2 * K + 4;
    const std::uint32_t sel = (sh >= 0 ? x >> sh : x << -sh) & 0x3030u;
    return __byte_perm(kTernaryFp16HighBytes, 0u, sel);
  }
}

template <int D>
struct TcState {
  float o[TcShape<D>::kMTiles][4];  // O^T / u fragments: (ch0, 2t) (ch0, 2t+1) (ch1, 2t) (ch1, 2t+1)
  float m[2];                       // running max of heads 2t, 2t+1 (log2 units, same on all gq)
  float l[2];                       // this lane's share of the denominators
  float u;                          // unit of o (the s2v of the last window's group; 1 at first)
  int ntok;
};

/// The factors of one precision group.
struct TcRows {
  float fk;     // factor applied to the scores' products (s2k, the codes' 2^14, Q's 2^-eq)
  float u;      // unit of the output for this group (s2v; 1 for BF16 rows, or s2v not usable)
  float pm;     // factor applied to the probabilities before the split (s2v / u, x 2^14 for FP16)
  float inv_u;  // 1 / u (exact: u is a power of two)
};

__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

__device__ __forceinline__ std::uint32_t pack_f16(__half lo, __half hi) {
  return static_cast<std::uint32_t>(__half_as_ushort(lo)) | (static_cast<std::uint32_t>(__half_as_ushort(hi)) << 16);
}

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

/// x = hi + mid + lo, each a BF16 value (the residuals are exact in FP32).
__device__ __forceinline__ void split3(float x, float (&s)[3]) {
  s[0] = bf16_round(x);
  const float r = x - s[0];
  s[1] = bf16_round(r);
  s[2] = bf16_round(r - s[1]);
}

/// x ~ hi + mid + lo (N = 3) or hi + lo (N = 2), FP16 terms (the residuals are exact in FP32).
template <int N>
__device__ __forceinline__ void split_f16(float x, __half (&s)[N]) {
  float r = x;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    s[k] = __float2half_rn(r);
    r -= __half2float(s[k]);
  }
}

template <bool kF16>
__device__ __forceinline__ void mma16816(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                         std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  if constexpr (kF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

/// NB bytes (a power of two, 2..64) at p into 32-bit words (little-endian): vector loads when
/// kVec (p aligned to min(NB, 16)), else byte loads.
template <int NB, bool kVec>
__device__ __forceinline__ void load_words(const std::uint8_t* p, std::uint32_t (&w)[(NB + 3) / 4]) {
  if constexpr (kVec) {
    if constexpr (NB >= 16) {
#pragma unroll
      for (int i = 0; i < NB / 16; ++i) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + i);
        w[4 * i] = u.x;
        w[4 * i + 1] = u.y;
        w[4 * i + 2] = u.z;
        w[4 * i + 3] = u.w;
      }
    } else if constexpr (NB == 8) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = u.x;
      w[1] = u.y;
    } else if constexpr (NB == 4) {
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else {
      w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    }
  } else {
#pragma unroll
    for (int i = 0; i < (NB + 3) / 4; ++i) w[i] = 0u;
#pragma unroll
    for (int i = 0; i < NB; ++i) w[i / 4] |= static_cast<std::uint32_t>(__ldg(p + i)) << (8 * (i % 4));
  }
}

/// a * b on FP16x2 pairs (used only where the products are exact).
__device__ __forceinline__ std::uint32_t f16x2_mul(std::uint32_t a, std::uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

template <int NW>
__device__ __forceinline__ void zero_words(std::uint32_t (&w)[NW]) {
#pragma unroll
  for (int i = 0; i < NW; ++i) w[i] = 0u;
}

/// One window of n (1..16) live tokens, precision P (0 = BF16 page or staged rows). kPk: the
/// packed-column layout (GQA group <= 4: mma column 2h + e = term e of head h), else one column
/// per head.
template <int D, int P, bool kVec, bool kPk>
__device__ __forceinline__ void tc_window(const PagedKvView& view, const TcRows& rs, int lg, int n,
                                          const std::uint8_t* const* krows, const std::uint8_t* const* vrows,
                                          const std::uint8_t* const* vscales, const std::uint32_t* records,
                                          float scale_log2, const TcShared<D>& sh, float (*pt)[kN + 1],
                                          TcState<D>& st) {
  using S = TcShape<D>;
  constexpr bool kF16 = P != 0;  // FP16 mma (quantized pages), else BF16
  constexpr int kBits = bits_of(static_cast<Precision>(P));
  constexpr int kKB = S::kKCh * kBits / 8;  // K bytes per lane, token and chunk
  constexpr int kVB = S::kVCh * kBits / 8;  // V bytes per lane, token and chunk
  constexpr int kKW = (kKB + 3) / 4;
  constexpr int kVW = (kVB + 3) / 4;
  constexpr int kKSW = S::kKCh / 4;  // key-scale words per lane, token and chunk
  constexpr int kV8 = S::kVCh / 8;   // 8-channel blocks of V per lane, token and chunk
  // Products per k-step / m-tile: packed, FP16 1 (both terms in the columns), BF16 2 ((hi, mid)
  // then (lo, 0)); one column per head, FP16 2 terms, BF16 3.
  constexpr int kQTerms = kPk ? (kF16 ? 1 : 2) : (kF16 ? 2 : 3);
  constexpr int kPTerms = kQTerms;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int gq = lane >> 2;
  const int t = lane & 3;

  // Token slots of this lane: K side tokens gq, gq + 8; V side tokens 2t, 2t+1, 2t+8, 2t+9. The
  // window's queue entries sit in slot order (window_slot): entry e of the window in slot
  // window_slot(e), so token slot x holds entry window_entry(x), live when that is below n. A
  // token past n reads slot 0's rows (entry 0; finite data: K and V were checked at append), so
  // every row load is unconditional; its score is -inf and its probability 0, so it adds nothing.
  const int kt[2] = {gq, gq + 8};
  const int vt[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
  const int ke[2] = {window_entry(kt[0]), window_entry(kt[1])};
  const int ve[4] = {window_entry(vt[0]), window_entry(vt[1]), window_entry(vt[2]), window_entry(vt[3])};
  const std::uint8_t* krow[2];
  std::uint32_t krec[2];
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const int k = ke[a] < n ? kt[a] : 0;
    krow[a] = krows[k];
    krec[a] = P != 0 ? records[k] : kNoRecordId;
  }
  const std::uint8_t* vrow[4];
  const std::uint8_t* vsrow[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = ve[i] < n ? vt[i] : 0;
    vrow[i] = vrows[k];
    vsrow[i] = vscales[k];
  }
  // V rows (and value-scale codes) of one chunk.
  std::uint32_t vw[4][kVW];
  std::uint32_t vsc[4][kV8 > 0 ? kV8 : 1];
  auto load_v = [&](int c) {
    const int ch = gq * (D / 8) + c * S::kVCh;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      load_words<kVB, kVec>(vrow[i] + ch * kBits / 8, vw[i]);
#pragma unroll
      for (int j = 0; j < kV8; ++j) vsc[i][j] = P != 0 ? __ldg(vsrow[i] + ((ch + 8 * j) >> lg)) : 0u;
    }
  };

  // Scores: K'.Q^T over all chunks. kOne: token gq + 8 shares token gq's key scales (the window
  // has one record, the usual case: a group of g tokens is committed into consecutive slots): one
  // load and one conversion. A warp-uniform branch picks the instance, so the key-scale words stay
  // in registers (indexing them by a run-time token put them in local memory).
  float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  auto scores = [&](auto one_rec_c) {
    [[maybe_unused]] constexpr bool kOne = decltype(one_rec_c)::value;
#pragma unroll
    for (int c = 0; c < S::kNC; ++c) {
      const int ch = t * (D / 4) + c * S::kKCh;
      std::uint32_t kw[2][kKW];
      [[maybe_unused]] std::uint32_t ksw[2][P != 0 ? kKSW : 1];  // ksw[1] unused when kOne
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        load_words<kKB, kVec>(krow[a] + ch * kBits / 8, kw[a]);
        if constexpr (P != 0) {
          if (a == 0 || !kOne) {
            if (krec[a] != kNoRecordId) {
              load_words<S::kKCh, kVec>(view.key_scales + static_cast<std::size_t>(krec[a]) * D + ch, ksw[a]);
            } else {
              zero_words(ksw[a]);
            }
          }
        }
      }
      // The V rows' loads go out after the K rows' (the scores need K first).
      if constexpr (S::kNC == 1) {
        if (c == 0) load_v(0);
      }
#pragma unroll
      for (int j = 0; j < S::kKStepsPerChunk / 2; ++j) {  // 8-channel block j = k-steps 2j, 2j+1
        // kp[a][q]: pair q of block j for token a, the A register (2 (q % 2)) or (2 (q % 2) + 1) of
        // k-step 2j + q / 2 (token gq: a = 0, token gq + 8: a = 1).
        std::uint32_t kp[2][4];
        if constexpr (P == 0) {
          // BF16, pair q = channels (8j + 2q, 8j + 2q + 1): word 4j + q as stored.
#pragma unroll
          for (int a = 0; a < 2; ++a) {
#pragma unroll
            for (int q = 0; q < 4; ++q) kp[a][q] = kw[a][4 * j + q];
          }
        } else if constexpr (P == 1) {
          // FP8, pair q = channels (8j + 2q, 8j + 2q + 1), the BF16 map: the E4M3 values times
          // the key scales x 2^-4, FP16x2 (exact: at most 8 significant bits, multiples of 2^-22
          // up to 448 x 448 / 16 = 12,544).
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const std::uint32_t ks0 = f16x2_mul(e4m3x2_f16(ksw[0][2 * j + q / 2] >> (16 * (q % 2))), kF16x2Pow2m4);
            std::uint32_t ks1 = ks0;
            if constexpr (!kOne) ks1 = f16x2_mul(e4m3x2_f16(ksw[1][2 * j + q / 2] >> (16 * (q % 2))), kF16x2Pow2m4);
            kp[0][q] = f16x2_mul(e4m3x2_f16(kw[0][2 * j + q / 2] >> (16 * (q % 2))), ks0);
            kp[1][q] = f16x2_mul(e4m3x2_f16(kw[1][2 * j + q / 2] >> (16 * (q % 2))), ks1);
          }
        } else {
          // NVFP4 / ternary, pair q = channels (8j + q, 8j + q + 4): codes x 2^-14 times the two
          // channels' key scales, both FP16x2 (exact).
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const unsigned sel = static_cast<unsigned>(q | ((4 + q) << 4));
            const std::uint32_t ks0 = e4m3x2_f16(__byte_perm(ksw[0][2 * j], ksw[0][2 * j + 1], sel));
            std::uint32_t ks1 = ks0;
            if constexpr (!kOne) { ks1 = e4m3x2_f16(__byte_perm(ksw[1][2 * j], ksw[1][2 * j + 1], sel)); }
#pragma unroll
            for (int a = 0; a < 2; ++a) {
              std::uint32_t code;
              switch (q) {
                case 0: code = code_pair_f16<P, 0>(kw[a], j); break;
                case 1: code = code_pair_f16<P, 1>(kw[a], j); break;
                case 2: code = code_pair_f16<P, 2>(kw[a], j); break;
                default: code = code_pair_f16<P, 3>(kw[a], j); break;
              }
              kp[a][q] = f16x2_mul(code, a == 0 ? ks0 : ks1);
            }
          }
        }
        std::uint32_t a2[2][4];  // [k-step 2j + h][A register]
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          a2[h][0] = kp[0][2 * h];
          a2[h][1] = kp[1][2 * h];
          a2[h][2] = kp[0][2 * h + 1];
          a2[h][3] = kp[1][2 * h + 1];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int s = c * S::kKStepsPerChunk + 2 * j + h;
#pragma unroll
          for (int k = kQTerms - 1; k >= 0; --k) {  // small terms first
            const uint2 b = P == 0 ? sh.u.qf.b[s][k][lane] : P == 1 ? sh.u.qf.h8[s][k][lane] : sh.u.qf.h[s][k][lane];
            static_assert(kQTerms <= 3, "Q fragment sets");
            mma16816<kF16>(sc, a2[h][0], a2[h][1], a2[h][2], a2[h][3], b.x, b.y);
          }
        }
      }
    }
  };
  if constexpr (P == 0) {
    scores(std::false_type{});
  } else if (__all_sync(0xFFFFFFFFu, ke[1] >= n || krec[1] == krec[0])) {
    scores(std::true_type{});
  } else {
    scores(std::false_type{});
  }

  // Online softmax (base 2). One column per head: heads 2t, 2t+1 of this lane, sc = (token gq:
  // 2t, 2t+1), (token gq+8: 2t, 2t+1). Packed: head t, its score the sum of the two term columns
  // (p[0] token gq, p[2] token gq + 8).
  constexpr int kHL = kPk ? 1 : 2;  // heads per lane
  const float kf = scale_log2 * rs.fk;
  float p[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int a = i / 2;
    const float v = kPk ? sc[2 * a] + sc[2 * a + 1] : sc[i];
    // A quantized slot without a key-scale record (the CPU reads NaN keys there) scores NaN.
    p[i] = ke[a] >= n ? -INFINITY : (P != 0 && krec[a] == kNoRecordId) ? NAN : v * kf;
  }
  float f[2] = {1.0f, 1.0f};
  const float ratio = st.u * rs.inv_u;  // a power of two; 1 within a precision group
  st.u = rs.u;
#pragma unroll
  for (int hh = 0; hh < kHL; ++hh) {
    float mx = fmaxf(p[hh], p[2 + hh]);
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 16));
    const float m_new = fmaxf(st.m[hh], mx);
    f[hh] = fast_exp2(st.m[hh] - m_new);  // first window: exp2(-inf) = 0
    st.m[hh] = m_new;
    p[hh] = fast_exp2(p[hh] - m_new);  // -inf (no token) -> 0
    p[2 + hh] = fast_exp2(p[2 + hh] - m_new);
    st.l[hh] = st.l[hh] * f[hh] + (p[hh] + p[2 + hh]);
    f[hh] *= ratio;
  }
  if constexpr (kPk) f[1] = f[0];  // both columns are head t's
  // Rescale the accumulator only when a max or the unit moved (most windows after the first
  // few keep both).
  if (!__all_sync(0xFFFFFFFFu, f[0] == 1.0f && f[1] == 1.0f)) {
#pragma unroll
    for (int i = 0; i < S::kMTiles; ++i) {
      st.o[i][0] *= f[0];
      st.o[i][1] *= f[1];
      st.o[i][2] *= f[0];
      st.o[i][3] *= f[1];
    }
  }
  // P to the B layout of P.V: lane (gq, t) needs tokens 2t, 2t+1, 2t+8, 2t+9 of column gq (one
  // column per head: head gq; packed: term gq % 2 of head gq / 2).
  if constexpr (kPk) {
    pt[gq][t] = p[0];
    pt[gq + 8][t] = p[2];
  } else {
    pt[gq][2 * t] = p[0];
    pt[gq][2 * t + 1] = p[1];
    pt[gq + 8][2 * t] = p[2];
    pt[gq + 8][2 * t + 1] = p[3];
  }
  __syncwarp();
  const int ph = kPk ? gq >> 1 : gq;  // the column's head
  const bool odd = (gq & 1) != 0;     // packed: the column's term
  std::uint32_t pb[kPTerms][2];
  if constexpr (kF16) {
    __half xs[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      split_f16<2>(pt[vt[i]][ph] * rs.pm, xs[i]);
      if constexpr (kPk) xs[i][0] = odd ? xs[i][1] : xs[i][0];  // (hi | lo)
    }
#pragma unroll
    for (int k = 0; k < kPTerms; ++k) {
      pb[k][0] = pack_f16(xs[0][k], xs[1][k]);
      pb[k][1] = pack_f16(xs[2][k], xs[3][k]);
    }
  } else {
    float xs[4][3];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      split3(pt[vt[i]][ph] * rs.pm, xs[i]);
      if constexpr (kPk) {  // (hi | mid), then (lo | 0)
        xs[i][0] = odd ? xs[i][1] : xs[i][0];
        xs[i][1] = odd ? 0.0f : xs[i][2];
      }
    }
#pragma unroll
    for (int k = 0; k < kPTerms; ++k) {
      pb[k][0] = pack_bf16(xs[0][k], xs[1][k]);
      pb[k][1] = pack_bf16(xs[2][k], xs[3][k]);
    }
  }
  __syncwarp();  // pt is rewritten by the next window

  // O^T += V'^T . P'; m-tile 4j + u: rows gq, gq + 8 = channels 8j + u, 8j + u + 4.
#pragma unroll
  for (int c = 0; c < S::kNC; ++c) {
    if constexpr (S::kNC > 1) load_v(c);
#pragma unroll
    for (int j = 0; j < S::kVCh / 8; ++j) {
      // FP16: vt2[tp][k] = channel 8j + k of tokens (2tp, 2tp + 1) of this lane, times their
      // value scales (exact).
      std::uint32_t vt2[2][8];
      if constexpr (kF16) {
#pragma unroll
        for (int tp = 0; tp < 2; ++tp) {
          std::uint32_t s2x = e4m3x2_f16(__byte_perm(vsc[2 * tp][j], vsc[2 * tp + 1][j], 0x0040u));  // the 2 scales
          if constexpr (P == 1) s2x = f16x2_mul(s2x, kF16x2Pow2m4);
          vt2[tp][0] = f16x2_mul(code_tok_pair_f16<P, 0>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
          vt2[tp][1] = f16x2_mul(code_tok_pair_f16<P, 1>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
          vt2[tp][2] = f16x2_mul(code_tok_pair_f16<P, 2>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
          vt2[tp][3] = f16x2_mul(code_tok_pair_f16<P, 3>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
          vt2[tp][4] = f16x2_mul(code_tok_pair_f16<P, 4>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
          vt2[tp][5] = f16x2_mul(code_tok_pair_f16<P, 5>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
          vt2[tp][6] = f16x2_mul(code_tok_pair_f16<P, 6>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
          vt2[tp][7] = f16x2_mul(code_tok_pair_f16<P, 7>(vw[2 * tp], vw[2 * tp + 1], j), s2x);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        std::uint32_t a0, a1, a2, a3;
        if constexpr (kF16) {
          a0 = vt2[0][u];
          a1 = vt2[0][u + 4];
          a2 = vt2[1][u];
          a3 = vt2[1][u + 4];
        } else {
          // BF16 words: channel 8j + u is half u % 2 of word 4j + u / 2, 8j + u + 4 of word 4j + 2 + u / 2.
          constexpr unsigned kSel[2] = {0x5410u, 0x7632u};
          const unsigned sel = kSel[u % 2];
          a0 = __byte_perm(vw[0][4 * j + u / 2], vw[1][4 * j + u / 2], sel);
          a1 = __byte_perm(vw[0][4 * j + 2 + u / 2], vw[1][4 * j + 2 + u / 2], sel);
          a2 = __byte_perm(vw[2][4 * j + u / 2], vw[3][4 * j + u / 2], sel);
          a3 = __byte_perm(vw[2][4 * j + 2 + u / 2], vw[3][4 * j + 2 + u / 2], sel);
        }
        float(&o)[4] = st.o[c * S::kMTilesPerChunk + 4 * j + u];
#pragma unroll
        for (int k = kPTerms - 1; k >= 0; --k) mma16816<kF16>(o, a0, a1, a2, a3, pb[k][0], pb[k][1]);
      }
    }
  }
  st.ntok += n;
}

template <int D, int kMinBlocks, bool kVec, bool kPk>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    paged_decode_partial_tc_kernel(PagedKvView view, DecodeAttentionParams prm, Workspace ws, int splits) {
  using S = TcShape<D>;
  __shared__ TcShared<D> sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int gq = lane >> 2;
  const int t = lane & 3;
  const int split = static_cast<int>(blockIdx.x);
  const int kvh = static_cast<int>(blockIdx.y);
  const int stream = prm.streams[kvh];
  const int group = prm.num_q_heads / prm.num_kv_heads;
  const float scale = prm.softmax_scale > 0.0f ? prm.softmax_scale : 1.0f / sqrtf(static_cast<float>(D));
  const float scale_log2 = scale * kLog2e;
  const std::size_t part = static_cast<std::size_t>(kvh) * splits + split;
  float* acc_out = ws.acc + part * group * D;
  float* ml_out = ws.ml + part * group * 2;
  const bool stream_ok = stream >= 0 && stream < view.num_streams;

  // s2 of this thread's precision group (threads 1..3), loaded early (used by the prologue).
  float s2k_pre = 0.0f, s2v_pre = 0.0f;
  if (stream_ok && tid >= 1 && tid < kNumPrecisions) {
    s2k_pre = view.s2[(static_cast<std::size_t>(stream) * 2 + 0) * kNumPrecisions + tid];
    s2v_pre = view.s2[(static_cast<std::size_t>(stream) * 2 + 1) * kNumPrecisions + tid];
  }
  // Q's FP16 terms are of Q x 2^eq, eq putting max|q| of the group in [2^14, 2^15) (every warp
  // computes the same value).
  const float* q = prm.q + static_cast<std::size_t>(kvh) * group * D;
  float qmax = 0.0f;
  for (int i = lane; i < group * D; i += 32) qmax = fmaxf(qmax, fabsf(q[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) qmax = fmaxf(qmax, __shfl_xor_sync(0xFFFFFFFFu, qmax, o));
  int eq = 0;
  if (qmax > 0.0f && qmax <= 3.0e38f) {
    int e = 0;
    (void)frexpf(qmax, &e);  // qmax = f x 2^e, f in [0.5, 1)
    eq = min(max(15 - e, -100), 100);
  }
  const float k_unscale = ldexpf(16384.0f, -eq);  // NVFP4 / ternary scores: codes' 2^-14, Q's 2^eq undone
  const float k_unscale8 = ldexpf(16.0f, -eq);    // FP8 scores: the scales' 2^-4, Q's 2^eq undone

  // The prologue (Q fragments, the precision groups' factors) runs after the walk's first
  // metadata loads are issued (below), so its work overlaps their latency: at short chunks the
  // CTA's start-up chain of dependent loads is a visible share of its life.
  auto prologue = [&]() {
    // Q fragments, k-step s, lane (h = lane / 4, tq = lane % 4), base = tq*D/4 + 8 (s / 2):
    // BF16 map channels (base + 4 (s % 2) + {0, 1}), (+ {2, 3}); FP16 map (base + 2 (s % 2) + {0, 4}),
    // (+ {1, 5}). Only the sets some window can use are built (CTA-uniform): BF16 terms for BF16
    // pages and staged rows, FP16 terms in the BF16 map for FP8 pages, in the FP16 map for NVFP4
    // and ternary pages.
    const bool need_b = view.pool_count[0] > 0 || (stream_ok && view.staged_count[stream] > 0);
    const bool need_h8 = view.pool_count[1] > 0;
    const bool need_h = view.pool_count[2] > 0 || view.pool_count[3] > 0;
    const float p2eq = ldexpf(1.0f, eq);  // x * 2^eq == ldexpf(x, eq) here: |x| 2^eq < 2^15, one rounding
    for (int i = tid; i < S::kKSteps * 32; i += kThreads) {
      const int s = i / 32;
      const int ln = i % 32;
      const int col = ln >> 2;                 // mma column
      const int h = kPk ? col >> 1 : col;      // its head
      const bool odd = kPk && (col & 1) != 0;  // packed: its term (hi, lo / BF16 (hi, mid), (lo, 0))
      const int base = (ln & 3) * (D / 4) + 8 * (s / 2);
      const float* qh = q + h * D;
      auto qv = [&](int c) { return h < group ? qh[c] : 0.0f; };
      // One column per head: set k holds term k. Packed: set 0 holds the column's term of the FP16
      // pair (hi | lo); BF16 set 0 (hi | mid), set 1 (lo | 0).
      auto put_f16 = [&](uint2(&dst)[3][32], const __half(&y)[4][2]) {
        if constexpr (kPk) {
          __half z[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) z[e] = odd ? y[e][1] : y[e][0];
          dst[0][ln] = make_uint2(pack_f16(z[0], z[1]), pack_f16(z[2], z[3]));
        } else {
#pragma unroll
          for (int k = 0; k < 2; ++k) dst[k][ln] = make_uint2(pack_f16(y[0][k], y[1][k]), pack_f16(y[2][k], y[3][k]));
        }
      };
      if (need_b) {
        const int c = base + 4 * (s % 2);
        float x[4][3];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          split3(qv(c + e), x[e]);
          if constexpr (kPk) {
            x[e][0] = odd ? x[e][1] : x[e][0];
            x[e][1] = odd ? 0.0f : x[e][2];
          }
        }
#pragma unroll
        for (int k = 0; k < (kPk ? 2 : 3); ++k)
          sh.u.qf.b[s][k][ln] = make_uint2(pack_bf16(x[0][k], x[1][k]), pack_bf16(x[2][k], x[3][k]));
      }
      if (need_h8) {
        const int c = base + 4 * (s % 2);
        __half y[4][2];
#pragma unroll
        for (int e = 0; e < 4; ++e) split_f16<2>(qv(c + e) * p2eq, y[e]);
        put_f16(sh.u.qf.h8[s], y);
      }
      if (need_h) {
        const int c = base + 2 * (s % 2);
        const int cs[4] = {c, c + 4, c + 1, c + 5};
        __half x[4][2];
#pragma unroll
        for (int e = 0; e < 4; ++e) split_f16<2>(qv(cs[e]) * p2eq, x[e]);
        put_f16(sh.u.qf.h[s], x);
      }
    }
    // The factors of each precision group (TcRows), once per CTA.
    if (tid <= kStagedGroup) {
      float fk = 1.0f, u = 1.0f, pm = 1.0f;
      const int pr = tid;
      if (stream_ok && pr != kStagedGroup && pr != 0) {
        // K' and V' hold exact element x scale products (x 2^-14 for FP16): only s2 is left.
        const float s2v = s2v_pre;
        const bool fp8 = pr == 1;
        fk = s2k_pre * (fp8 ? k_unscale8 : k_unscale);
        // P' = p x s2v / ub x 2^14 must stay inside FP16's range and above its subnormals, so ub
        // becomes s2v (a power of two > 0 once set) when s2v is outside [2^-14, 1]; an unset s2v
        // (0: p scaled by it, as the CPU does) keeps ub = 1. V' carries 2^-14 (NVFP4, ternary
        // codes) or 2^-4 (FP8 scales): the output's unit is ub (x 2^-10 for FP8).
        const float ub = s2v > 0.0f && s2v <= 3.0e38f && (s2v < 0x1p-14f || s2v > 1.0f) ? s2v : 1.0f;
        u = fp8 ? ub * 0x1p-10f : ub;
        pm = (s2v / ub) * 16384.0f;
      }
      sh.rows_f[pr][0] = fk;
      sh.rows_f[pr][1] = u;
      sh.rows_f[pr][2] = pm;
      sh.rows_f[pr][3] = 1.0f / u;
    }
    __syncthreads();
  };

  TcState<D> st;
#pragma unroll
  for (int i = 0; i < S::kMTiles; ++i) st.o[i][0] = st.o[i][1] = st.o[i][2] = st.o[i][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
  st.u = 1.0f;
  st.ntok = 0;

  if (stream_ok) {
    const int g = prm.group_size;
    const int lg = g == 8 ? 3 : g == 16 ? 4 : 5;           // check_paged_decode_attention: g is 8, 16 or 32
    constexpr int kLogD = D == 64 ? 6 : D == 128 ? 7 : 8;  // value scales per row: D >> lg
    const int bs = prm.block_size;
    // This chunk's slot positions (blocks in list order, then the staging rows; whole 128-position
    // pieces, as the CUDA-core pass cuts them) are walked in units: a unit is one 64-slot word of
    // a block's eviction mask (the whole block when B <= 64), or the chunk's staging rows (under
    // g <= 32). The chunk's units are cut into kWarps contiguous ranges, one per warp, and a warp
    // takes 32 units at a time, one per lane: the lane loads its unit's block id, then its fill,
    // pool and eviction-mask word, and forms the 64-bit mask of the unit's live slots in the
    // chunk. Live slots enter the warp's queue in unit order: an inclusive scan of the units'
    // counts places each entry, and all 32 lanes write entries at once (below). The queue runs in
    // 16-token windows. The walk's cost is per unit and per live slot, not per slot position: an
    // evicted slot costs no load and no instruction beyond its mask bit. Precision groups (one per
    // pool, plus the staged rows) are queued one at a time; a partial window runs only when the
    // group changes or the warp's units end.
    const ChunkRange cr = chunk_range(view, stream, bs, split, splits, kTcChunkPiece);
    const long long block_pos = cr.block_pos, lo = cr.lo, hi = cr.hi;
    const long long bend = hi < block_pos ? hi : block_pos;  // end of the chunk's block slots
    const int words = (bs + 63) >> 6;                        // mask words (units) per block
    // Block units: unit (j, w) = word w of block j of the stream; the chunk's first is (j0, w0).
    int j0 = 0, w0 = 0, n_block_units = 0;
    if (lo < bend) {
      const long long jl = lo / bs;
      const long long jh = (bend - 1) / bs;
      j0 = static_cast<int>(jl);  // block list positions are int (block_indptr is int32)
      w0 = static_cast<int>((lo - jl * bs) >> 6);
      const int wh = static_cast<int>((bend - 1 - jh * bs) >> 6);
      n_block_units = static_cast<int>(jh - jl) * words + wh - w0 + 1;
    }
    const long long staged_lo = lo > block_pos ? lo : block_pos;
    const int n_units = n_block_units + (hi > staged_lo ? 1 : 0);  // the staging unit last
    const int u_end = n_units * (warp + 1) / kWarps;               // this warp's units: [.., u_end)
    int u_next = n_units * warp / kWarps;
    if (lane < kNumPrecisions) {
      const std::uint64_t pb = page_bytes_of(static_cast<Precision>(lane), D, bs, g);
      sh.pool_tab[warp][lane] = make_ulonglong2(pool_origin(view, lane, pb), pb);
    }
    __syncwarp();
    const std::uint8_t* staging =
        reinterpret_cast<const std::uint8_t*>(view.staging) + static_cast<std::size_t>(stream) * 2 * g * D * 2;
    // This lane's unit of the warp's current 32.
    struct Unit {
      const std::uint8_t* page;  // the block's page (K rows, V rows, value scales) or the staging rows
      std::uint32_t block;
      int pr;                   // precision group (kStagedGroup: the staging rows)
      int s0;                   // slot (staging row) of mask bit 0
      unsigned long long live;  // live slots of the unit in this chunk
    };
    auto load_unit = [&](int i0) {
      Unit un{staging, 0u, kStagedGroup, 0, 0ull};
      const int i = i0 + lane;
      if (i < u_end) {
        if (i >= n_block_units) {  // the staging rows [staged_lo, hi) - block_pos (under g)
          un.live = bit_range(staged_lo - block_pos, hi - block_pos);
        } else {
          const int q = w0 + i;
          const int dj = words == 1 ? q : q / words;
          const int w = q - dj * words;
          const int j = j0 + dj;
          const std::uint32_t b = view.block_indices[cr.j_begin + j];
          const int fill = view.block_fill[b];
          const std::uint64_t ev = view.evict_mask[static_cast<std::size_t>(b) * words + w];
          un.pr = block_pool(view, b);
          const ulonglong2 tab = sh.pool_tab[warp][un.pr];  // = pool_page(view, b, pr, page bytes)
          un.page = reinterpret_cast<const std::uint8_t*>(tab.x + static_cast<std::uint64_t>(b) * tab.y);
          un.block = b;
          un.s0 = 64 * w;
          const long long p0 = static_cast<long long>(j) * bs + un.s0;  // position of mask bit 0
          long long e = bend - p0;
          if (e > fill - un.s0) e = fill - un.s0;
          un.live = bit_range(lo > p0 ? lo - p0 : 0, e) & ~ev;
          // The unit's key-scale records are copied into the queue after the scan (a dependent
          // load): their first line is asked for now.
          if (un.pr != 0 && un.live != 0ull) {
            asm volatile("prefetch.global.L1 [%0];" ::"l"(view.slot_record + static_cast<std::size_t>(b) * bs + un.s0));
          }
        }
      }
      return un;
    };
    Unit un = load_unit(u_next);  // issued before the prologue, whose work covers the loads' latency
    u_next += 32;
    prologue();
    unsigned pend = __ballot_sync(0xFFFFFFFFu, un.live != 0ull);  // lanes whose unit has slots to queue
    int qn = 0;                                                   // queued slots (warp-uniform)
    int qpr = kStagedGroup;                                       // their precision group
    for (;;) {
      if (pend == 0u && u_next < u_end) {  // the warp's next 32 units
        un = load_unit(u_next);
        u_next += 32;
        pend = __ballot_sync(0xFFFFFFFFu, un.live != 0ull);
        continue;
      }
      int count;  // queued slots to run now, from the front
      if (pend == 0u) {
        if (qn == 0) break;
        count = qn;  // the warp's units are done: run what is queued
      } else {
        const bool mine = ((pend >> lane) & 1u) != 0u;
        // The queued group goes on while a pending unit has it; else the first pending unit's.
        const unsigned same = __ballot_sync(0xFFFFFFFFu, mine && un.pr == qpr);
        const int gp = same != 0u ? qpr : __shfl_sync(0xFFFFFFFFu, un.pr, __ffs(pend) - 1);
        if (qn > 0 && gp != qpr) {
          count = qn;  // the group changes: run what is queued first
        } else {
          qpr = gp;
          // The group's pending units, in lane order, as many as the queue holds (qn < 16 here,
          // a unit has at most 64 live slots: the first always fits).
          const bool cand = mine && un.pr == gp;
          const int c = cand ? __popcll(un.live) : 0;
          int inc = c;  // inclusive scan of c over the lanes
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xFFFFFFFFu, inc, o);
            if (lane >= o) inc += v;
          }
          const bool take = cand && inc <= S::kQueue - qn;
          const unsigned taken = __ballot_sync(0xFFFFFFFFu, take);
          const int n_new = __shfl_sync(0xFFFFFFFFu, inc, 31 - __clz(taken));  // the taken units' slots
          const bool quant = gp != kStagedGroup && gp != 0;                    // rows with key-scale records
          // A block page holds B K rows, B V rows, then the value scales (D / g per row); the staging
          // rows g K rows, then g V rows (BF16, no scales). Offsets fit 32 bits: a page is at most
          // 2 x 4096 rows of 512 bytes plus scales.
          const bool stg = gp == kStagedGroup;
          const unsigned rb = stg ? 2u * D : (2u * D) >> gp;  // D x bits / 8
          const unsigned rows = stg ? static_cast<unsigned>(g) : static_cast<unsigned>(bs);
          const unsigned v_off = rows * rb;
          const unsigned s_off = 2u * rows * rb;
          // The new entries qn + e, 32 at a time, one per lane: entry e is live slot k of the first
          // unit (lane) whose inclusive count exceeds e, k = e - its exclusive count. When every
          // taken unit's live slots form one run (no evicted slot among them: the common case),
          // slot k is the run's start + k, else the k-th set bit of the unit's mask.
          int run0 = -1;  // the unit's first live slot when its live slots are one run
          if (take) {
            const int f = __ffsll(static_cast<long long>(un.live)) - 1;
            const unsigned long long x = un.live >> f;
            if ((x & (x + 1ull)) == 0ull) run0 = f;
          }
          const bool runs = __all_sync(0xFFFFFFFFu, !take || run0 >= 0);
          // Per unit, the addresses of live slot 0 (runs) or of slot s0 (else: an entry's index is
          // then the position of its set bit): K row, value scales, key-scale record.
          const unsigned base = static_cast<unsigned>(un.s0 + (runs && run0 > 0 ? run0 : 0));
          const std::uint8_t* k_base = un.page + base * rb;
          const std::uint8_t* s_base = un.page + s_off + (base << (kLogD - lg));
          const std::uint32_t* r_base = view.slot_record + static_cast<std::size_t>(un.block) * bs + base;
          for (int e0 = 0; e0 < n_new; e0 += 32) {
            const int e = e0 + lane;
            int u = 0;
#pragma unroll
            for (int st2 = 16; st2 >= 1; st2 >>= 1) {
              if (__shfl_sync(0xFFFFFFFFu, inc, u + st2 - 1) <= e) u += st2;
            }
            unsigned idx = static_cast<unsigned>(e - __shfl_sync(0xFFFFFFFFu, inc - c, u));  // live slot k
            if (!runs) {  // k -> the position of the unit's k-th set bit
              const unsigned m_lo = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned>(un.live), u);
              const unsigned m_hi = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned>(un.live >> 32), u);
              idx = nth_set_bit(m_lo, m_hi, static_cast<int>(idx));
            }
            const std::uint8_t* krow = reinterpret_cast<const std::uint8_t*>(
                                           __shfl_sync(0xFFFFFFFFu, reinterpret_cast<unsigned long long>(k_base), u)) +
                                       idx * rb;
            const std::uint8_t* vscale = reinterpret_cast<const std::uint8_t*>(__shfl_sync(
                                             0xFFFFFFFFu, reinterpret_cast<unsigned long long>(s_base), u)) +
                                         (idx << (kLogD - lg));
            const std::uint32_t* rec = nullptr;
            if (quant) {
              rec = reinterpret_cast<const std::uint32_t*>(
                        __shfl_sync(0xFFFFFFFFu, reinterpret_cast<unsigned long long>(r_base), u)) +
                    idx;
            }
            if (e < n_new) {
              const int r = ((qn + e) & ~(kWin - 1)) | window_slot((qn + e) & (kWin - 1));
              sh.krow[warp][r] = krow;
              sh.vrow[warp][r] = krow + v_off;
              sh.vscale[warp][r] = vscale;
              if (quant) cp_async_4(&sh.record[warp][r], rec);  // waited for below
            }
          }
          if (quant) cp_async_wait_all();
          __syncwarp();
          qn += n_new;
          pend &= ~taken;
          count = qn & ~(kWin - 1);  // whole windows
        }
      }
      if (count > 0) {
        TcRows rs;
        rs.fk = sh.rows_f[qpr][0];
        rs.u = sh.rows_f[qpr][1];
        rs.pm = sh.rows_f[qpr][2];
        rs.inv_u = sh.rows_f[qpr][3];
        float(*pt)[kN + 1] = sh.pt[warp];
        for (int k0 = 0; k0 < count; k0 += kWin) {
          const int nk = count - k0 < kWin ? count - k0 : kWin;
          const std::uint8_t* const* kr = sh.krow[warp] + k0;
          const std::uint8_t* const* vr = sh.vrow[warp] + k0;
          const std::uint8_t* const* vs = sh.vscale[warp] + k0;
          const std::uint32_t* rc = sh.record[warp] + k0;
          switch (qpr == kStagedGroup ? 0 : qpr) {
            case 0: tc_window<D, 0, kVec, kPk>(view, rs, lg, nk, kr, vr, vs, rc, scale_log2, sh, pt, st); break;
            case 1: tc_window<D, 1, kVec, kPk>(view, rs, lg, nk, kr, vr, vs, rc, scale_log2, sh, pt, st); break;
            case 2: tc_window<D, 2, kVec, kPk>(view, rs, lg, nk, kr, vr, vs, rc, scale_log2, sh, pt, st); break;
            default: tc_window<D, 3, kVec, kPk>(view, rs, lg, nk, kr, vr, vs, rc, scale_log2, sh, pt, st); break;
          }
        }
        // The rest (< 16 entries, a partial window in slot order) moves to the front of the queue:
        // the window's 16 slots, whether filled or not.
        const int rem = qn - count;
        if (rem > 0) {
          const std::uint8_t* ekr = nullptr;
          const std::uint8_t* evr = nullptr;
          const std::uint8_t* evs = nullptr;
          std::uint32_t erc = 0u;
          if (lane < kWin) {
            ekr = sh.krow[warp][count + lane];
            evr = sh.vrow[warp][count + lane];
            evs = sh.vscale[warp][count + lane];
            erc = sh.record[warp][count + lane];
          }
          __syncwarp();
          if (lane < kWin) {
            sh.krow[warp][lane] = ekr;
            sh.vrow[warp][lane] = evr;
            sh.vscale[warp][lane] = evs;
            sh.record[warp][lane] = erc;
          }
        }
        __syncwarp();
        qn = rem;
      }
    }
  }
  // An invalid stream (CTA-uniform) skips the prologue: nothing below reads the Q fragments or
  // the precision factors, and its partial (m = -inf, l = 0) makes the merge write NaN rows.
  // Denominators: sum the lanes' shares over gq (m is the same on every gq of a t).
  constexpr int kHL = kPk ? 1 : 2;  // heads per lane: 2t, 2t + 1 (packed: t)
#pragma unroll
  for (int hh = 0; hh < kHL; ++hh) {
    st.l[hh] += __shfl_xor_sync(0xFFFFFFFFu, st.l[hh], 4);
    st.l[hh] += __shfl_xor_sync(0xFFFFFFFFu, st.l[hh], 8);
    st.l[hh] += __shfl_xor_sync(0xFFFFFFFFu, st.l[hh], 16);
  }
  __syncthreads();  // every warp is done with the Q fragments: sh.u.acc may overwrite them
#pragma unroll
  for (int hh = 0; hh < kHL; ++hh) {
    const int h = kPk ? t : 2 * t + hh;
    if (h < group) {
      if (gq == 0) {
        sh.m[warp][h] = st.m[hh];
        sh.l[warp][h] = st.l[hh];
      }
#pragma unroll
      for (int i = 0; i < S::kMTiles; ++i) {
        const int c = i / S::kMTilesPerChunk;
        const int r = i % S::kMTilesPerChunk;  // 4j + u
        const int ch0 = gq * (D / 8) + c * S::kVCh + 8 * (r / 4) + r % 4;
        // Packed: the head's output is the sum of its two term columns.
        sh.u.acc[warp][h][ch0] = (kPk ? st.o[i][0] + st.o[i][1] : st.o[i][hh]) * st.u;
        sh.u.acc[warp][h][ch0 + 4] = (kPk ? st.o[i][2] + st.o[i][3] : st.o[i][2 + hh]) * st.u;
      }
    }
  }
  if (lane == 0) sh.ntok[warp] = st.ntok;
  __syncthreads();
  merge_warps_to_workspace(sh.m, sh.l, sh.u.acc, sh.ntok, group, acc_out, ml_out, ws.ntok + part,
                           ws.out != nullptr ? ws.out + static_cast<std::size_t>(kvh) * group * D : nullptr);
}

/// Whether every row load of the pass can be a vector load: pool pages, page sizes, the staging
/// rows and the key-scale records all 16-byte aligned.
bool tc_vector_loads(const PagedKvView& v, const DecodeAttentionParams& p) {
  auto aligned = [](const void* q) { return (reinterpret_cast<std::uintptr_t>(q) & 15u) == 0; };
  if (!aligned(v.staging) || !aligned(v.key_scales)) return false;
  for (int pr = 0; pr < kNumPrecisions; ++pr) {
    if (v.pool_count[pr] == 0) continue;
    if (!aligned(v.pages[pr]) ||
        page_bytes_of(static_cast<Precision>(pr), p.head_dim, p.block_size, p.group_size) % 16 != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace

template <int D>
cudaError_t launch_partial_tc(const PagedKvView& view, const DecodeAttentionParams& p, const Workspace& ws, int splits,
                              cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.num_kv_heads));
  constexpr int mb = TcShape<D>::kMinBlocks;
  const bool vec = tc_vector_loads(view, p);
  if (p.num_q_heads <= 4 * p.num_kv_heads) {  // GQA group <= 4: the packed-column instances
    if (vec) {
      paged_decode_partial_tc_kernel<D, mb, true, true><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
    } else {
      paged_decode_partial_tc_kernel<D, mb, false, true><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
    }
  } else if (vec) {
    paged_decode_partial_tc_kernel<D, mb, true, false><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
  } else {
    paged_decode_partial_tc_kernel<D, mb, false, false><<<grid, kThreads, 0, s>>>(view, p, ws, splits);
  }
  return cudaGetLastError();
}

template <int D>
int partial_tc_ctas_per_sm() noexcept {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &n, paged_decode_partial_tc_kernel<D, TcShape<D>::kMinBlocks, true, true>, kThreads, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

template int partial_tc_ctas_per_sm<64>() noexcept;
template int partial_tc_ctas_per_sm<128>() noexcept;
template int partial_tc_ctas_per_sm<256>() noexcept;

template cudaError_t launch_partial_tc<64>(const PagedKvView&, const DecodeAttentionParams&, const Workspace&, int,
                                           cudaStream_t);
template cudaError_t launch_partial_tc<128>(const PagedKvView&, const DecodeAttentionParams&, const Workspace&, int,
                                            cudaStream_t);
template cudaError_t launch_partial_tc<256>(const PagedKvView&, const DecodeAttentionParams&, const Workspace&, int,
                                            cudaStream_t);

}  // namespace thinkv::kernels::detail
