#pragma once
/// \file group_quant.hpp
/// Group quantization with two-level scaling: per element a code of bits_of(P) bits, per group one
/// FP8 E4M3 scale code, per stream (and precision) one FP32 power-of-two scale s2. The dequantized
/// element is decode(code) * (decode_e4m3(scale_code) * s2), evaluated in float in exactly that
/// order; GPU kernels copy these functions and must be compiled without fast-math (no
/// --use_fast_math, no -ftz=true, no -prec-div=false) to agree bit for bit. See docs/formats.md.

#include <cstdint>

#include "thinkv/config.hpp"
#include "thinkv/formats/bf16.hpp"
#include "thinkv/formats/bits.hpp"
#include "thinkv/formats/e2m1.hpp"
#include "thinkv/formats/fp8_e4m3.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

/// Largest supported group size n (group functions do nothing for n outside 1..kMaxGroupSize).
inline constexpr int kMaxGroupSize = 64;
/// Default group size g of the cache.
inline constexpr int kDefaultGroupSize = 16;

/// Ternary element codes (2-bit two's complement). 0b10 is never produced and decodes to 0.
inline constexpr std::uint8_t kTernaryZero = 0x0;
inline constexpr std::uint8_t kTernaryPlus = 0x1;   ///< +1
inline constexpr std::uint8_t kTernaryMinus = 0x3;  ///< -1

/// Q_P, the largest element magnitude of precision `p` in units of the group scale: 448 (FP8),
/// 6 (NVFP4), 1 (ternary); 0 for kBf16, which has no group scale.
THINKV_HD constexpr float quant_max(Precision p) noexcept {
  switch (p) {
    case Precision::kFp8E4M3: return kE4M3Max;
    case Precision::kNvfp4: return kE2M1Max;
    case Precision::kTernary: return 1.0f;
    case Precision::kBf16: break;
  }
  return 0.0f;
}

/// The value of one element code of a quantized precision (before scaling): E4M3 for kFp8E4M3,
/// E2M1 (low 4 bits) for kNvfp4, {0, +1, 0, -1} for ternary codes 0..3 (low 2 bits; 0b10 -> 0).
/// Returns 0 for kBf16.
THINKV_HD constexpr float decode_element(Precision p, std::uint8_t code) noexcept {
  switch (p) {
    case Precision::kFp8E4M3: return decode_e4m3(code);
    case Precision::kNvfp4: return decode_e2m1(code);
    case Precision::kTernary: {
      const unsigned t = code & 0x3u;
      return t == kTernaryPlus ? 1.0f : (t == kTernaryMinus ? -1.0f : 0.0f);
    }
    case Precision::kBf16: break;
  }
  return 0.0f;
}

/// The dequantized element: decode_element(p, code) * (decode_e4m3(scale_code) * s2), in float,
/// in exactly that order (both products are exact unless the result leaves the normal range).
THINKV_HD constexpr float dequantize(Precision p, std::uint8_t code, std::uint8_t scale_code, float s2) noexcept {
  const float group_scale = decode_e4m3(scale_code) * s2;
  return decode_element(p, code) * group_scale;
}

/// The per-stream second-level scale: the power of two s2 with amax / (quant_max(p) * s2) in
/// [8, 16), computed in float exactly as quantize_group computes it. amax == 0, amax below the
/// smallest normal float (2^-126), negative, NaN or Inf give 1; s2 is clamped to [2^-126, 2^127].
/// Returns 1 for kBf16.
THINKV_HD constexpr float choose_stream_scale(Precision p, float amax) noexcept {
  const float q = quant_max(p);
  if (q == 0.0f) return 1.0f;
  if (!(amax >= 0x1p-126f) || !is_finite_float(amax)) return 1.0f;
  // amax / q = (ma / mq) * 2^(ea - eq) with ma, mq in [1, 2), so floor(log2(amax / q)) is
  // ea - eq or ea - eq - 1; start there and fix it up with the float computation itself.
  int e = float_exponent(amax) - float_exponent(q) - 3;
  for (int iter = 0; iter < 4; ++iter) {
    if (e <= -126 || e >= 127) break;
    const float d = amax / (q * pow2_float(e));
    if (d < 8.0f) {
      --e;
    } else if (d >= 16.0f) {
      ++e;
    } else {
      break;
    }
  }
  return pow2_float(e);
}

/// True when a group with largest magnitude `amax` needs a scale the E4M3 scale code cannot reach:
/// amax > 448 * s2 * quant_max(p) (computed in float). For FP8 and NVFP4 this is exactly the case
/// in which quantize_group clips the largest elements. For kTernary the group's scale is the
/// optimal ternary scale alpha <= amax: pass amax for a conservative test or
/// ternary_optimal_scale(...) for the exact one. False for kBf16.
THINKV_HD constexpr bool group_scale_saturates(Precision p, float amax, float s2) noexcept {
  const float q = quant_max(p);
  if (q == 0.0f) return false;
  return amax > kE4M3Max * s2 * q;
}

/// max |x[i*stride]| over i in [0, n) (0 for n <= 0).
THINKV_HD constexpr float group_amax(const float* x, int stride, int n) noexcept {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = abs_float(x[i * stride]);
#if defined(__CUDA_ARCH__)
    amax = fmaxf(amax, a);  // the same result: amax is never NaN (fmaxf keeps it), a >= +0
#else
    if (a > amax) amax = a;
#endif
  }
  return amax;
}

/// The L2-optimal ternary scale from a group's magnitudes already sorted in descending order,
/// v[0] >= v[1] >= ... >= v[n-1] >= 0: with prefix sums S_k (sequential float adds in that order),
/// the k in 1..n maximising S_k * S_k / k (first maximum wins), alpha = S_k / k. Any sort that
/// yields the same sequence of values gives the same result (ternary_optimal_scale's insertion
/// sort on the CPU, a sorting network in the quantize-append kernel). Returns 0 for n < 1.
THINKV_HD constexpr float ternary_scale_of_sorted(const float* v, int n) noexcept {
  if (n < 1) return 0.0f;
  float sum = 0.0f;
  float best_score = -1.0f;
  float best_sum = 0.0f;
  int best_k = 1;
  for (int k = 1; k <= n; ++k) {
    sum = sum + v[k - 1];
    const float score = (sum * sum) / static_cast<float>(k);
    if (score > best_score) {
      best_score = score;
      best_sum = sum;
      best_k = k;
    }
  }
  return best_sum / static_cast<float>(best_k);
}

/// Sorts v[0..N) into descending order with a bitonic network of compare-exchanges (N a power of
/// two, every v[i] finite and >= 0, no -0). Data-independent control flow, so a GPU thread keeps v
/// in registers; it yields the same sequence of values as ternary_optimal_scale's insertion sort
/// (the values are only moved, never computed), so ternary_scale_of_sorted gives the same scale.
/// The CPU keeps the insertion sort: with the network, bench_formats' ternary quantization took
/// 1.3x (g = 16) to 2x (g = 32) as long on x86-64 (2026-11-30).
template <int N>
THINKV_HD constexpr void sort_descending_network(float (&v)[N]) noexcept {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "a power of two");
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 2; k <= N; k <<= 1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int j = k >> 1; j > 0; j >>= 1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int i = 0; i < N; ++i) {
        const int l = i ^ j;
        if (l > i) {
          const float a = v[i];
          const float b = v[l];
#if defined(__CUDA_ARCH__)
          const float hi = fmaxf(a, b);  // one instruction each; equal to the selects for v >= 0
          const float lo = fminf(a, b);
#else
          const float hi = a > b ? a : b;
          const float lo = a > b ? b : a;
#endif
          const bool down = (i & k) == 0;  // the last stage (k = N) sorts all of v downwards
          v[i] = down ? hi : lo;
          v[l] = down ? lo : hi;
        }
      }
    }
  }
}

/// The L2-optimal ternary scale of a group: |x| sorted descending (insertion sort), then
/// ternary_scale_of_sorted. Returns 0 for an all-zero group and for n outside 1..kMaxGroupSize.
THINKV_HD constexpr float ternary_optimal_scale(const float* x, int stride, int n) noexcept {
  if (n < 1 || n > kMaxGroupSize) return 0.0f;
  float v[kMaxGroupSize] = {};
  for (int i = 0; i < n; ++i) {  // insertion sort, descending
    const float a = abs_float(x[i * stride]);
    int j = i;
    while (j > 0 && v[j - 1] < a) {
      v[j] = v[j - 1];
      --j;
    }
    v[j] = a;
  }
  return ternary_scale_of_sorted(v, n);
}

/// The E4M3 scale code of an FP8 or NVFP4 group whose largest magnitude is amax > 0 (s2 > 0):
/// d = amax / (Q * s2), encode_e4m3(d), bumped by one code when decode_e4m3(code) * s2 * Q < amax
/// and code < 0x7E (quantize_group's rule).
THINKV_HD constexpr std::uint8_t fp_group_scale_code(Precision p, float amax, float s2) noexcept {
  const float q = quant_max(p);
  const float d = amax / (q * s2);
  std::uint8_t scale_code = encode_e4m3(d);
  if (decode_e4m3(scale_code) * s2 * q < amax && scale_code < kE4M3MaxCode) ++scale_code;
  return scale_code;
}

/// The code of element x of an FP8 or NVFP4 group with group scale S = decode_e4m3(scale) * s2:
/// encode(x / S) (IEEE division), as quantize_group computes it.
THINKV_HD constexpr std::uint8_t fp_element_code(Precision p, float x, float group_scale) noexcept {
  const float y = x / group_scale;
  return p == Precision::kFp8E4M3 ? encode_e4m3(y) : encode_e2m1(y);
}

/// The code of element x of a ternary group with dequantized scale a = decode_e4m3(scale) * s2:
/// sign(x) when a > 0 and |x| > 0.5f * a, else 0 (quantize_group's rule).
THINKV_HD constexpr std::uint8_t ternary_element_code(float x, float a) noexcept {
  const float threshold = 0.5f * a;
  if (a > 0.0f && abs_float(x) > threshold) return x > 0.0f ? kTernaryPlus : kTernaryMinus;
  return kTernaryZero;
}

/// Quantizes the n-element group x[i*stride] (n in 1..kMaxGroupSize, finite inputs, s2 > 0):
/// writes n unpacked element codes (one per byte, in the low bits_of(p) bits) to
/// codes[i*code_stride] and returns the group's E4M3 scale code (never 0 for a nonzero FP8/NVFP4
/// group, 0 for an all-zero group). For kBf16 or n outside 1..kMaxGroupSize it writes nothing and
/// returns 0. Rules (docs/formats.md):
///  - FP8/NVFP4: d = amax / (Q * s2); scale = encode_e4m3(d), bumped by one code when
///    decode_e4m3(scale) * s2 * Q < amax and scale < 0x7E; code_i = encode(x_i / (S)) with
///    S = decode_e4m3(scale) * s2 (IEEE division).
///  - Ternary: scale = encode_e4m3(ternary_optimal_scale / s2); with a = decode_e4m3(scale) * s2,
///    code_i = sign(x_i) when |x_i| > 0.5f * a, else 0 (all 0 when a == 0).
THINKV_HD constexpr std::uint8_t quantize_group(Precision p, const float* x, int stride, int n, float s2,
                                                std::uint8_t* codes, int code_stride) noexcept {
  if (p == Precision::kBf16 || n < 1 || n > kMaxGroupSize) return 0;
  if (p == Precision::kTernary) {
    const float alpha = ternary_optimal_scale(x, stride, n);
    const std::uint8_t scale_code = encode_e4m3(alpha / s2);
    const float a = decode_e4m3(scale_code) * s2;
    for (int i = 0; i < n; ++i) codes[i * code_stride] = ternary_element_code(x[i * stride], a);
    return scale_code;
  }
  const float amax = group_amax(x, stride, n);
  if (amax == 0.0f) {
    for (int i = 0; i < n; ++i) codes[i * code_stride] = 0;
    return 0;
  }
  const std::uint8_t scale_code = fp_group_scale_code(p, amax, s2);
  const float group_scale = decode_e4m3(scale_code) * s2;
  for (int i = 0; i < n; ++i) codes[i * code_stride] = fp_element_code(p, x[i * stride], group_scale);
  return scale_code;
}

/// Bytes of one packed row of n elements: ceil(n * bits_of(p) / 8) (2n for kBf16, whose rows are
/// raw little-endian uint16 BF16 codes and are not handled by store_code/load_code).
THINKV_HD constexpr int packed_row_bytes(Precision p, int n) noexcept { return (n * bits_of(p) + 7) / 8; }

/// Stores the low bits_of(p) bits of `code` as element `index` of a packed row: bits
/// [s, s + bits) of byte (index * bits) / 8 with s = (index * bits) % 8, lowest bits first (NVFP4
/// element 2j is the low nibble of byte j, as in __nv_fp4x2_storage_t). Other bits are preserved.
/// No-op for kBf16.
THINKV_HD constexpr void store_code(Precision p, std::uint8_t* row, int index, std::uint8_t code) noexcept {
  const int bits = bits_of(p);
  if (bits > 8) return;
  const int bit = index * bits;
  const unsigned shift = static_cast<unsigned>(bit & 7);
  const unsigned mask = ((1u << bits) - 1u) << shift;
  std::uint8_t& byte = row[bit >> 3];
  byte = static_cast<std::uint8_t>((byte & ~mask) | ((static_cast<unsigned>(code) << shift) & mask));
}

/// Loads element `index` of a packed row (inverse of store_code). Returns 0 for kBf16.
THINKV_HD constexpr std::uint8_t load_code(Precision p, const std::uint8_t* row, int index) noexcept {
  const int bits = bits_of(p);
  if (bits > 8) return 0;
  const int bit = index * bits;
  const unsigned shift = static_cast<unsigned>(bit & 7);
  return static_cast<std::uint8_t>((static_cast<unsigned>(row[bit >> 3]) >> shift) & ((1u << bits) - 1u));
}

}  // namespace thinkv
