#pragma once
/// \file fp16.hpp
/// FP16 (IEEE 754 binary16): 1 sign, 5 exponent bits (bias 15), 10 mantissa bits, subnormals,
/// Inf and NaN. The FullKV baseline stores K and V in it, as llama.cpp's default F16 cache does.
/// Encoding matches NVIDIA's __float2half_rn bit for bit (tests/oracle/ checks it against
/// cuda_fp16.h); docs/formats.md gives the rules.

#include <cstdint>

#include "thinkv/config.hpp"
#include "thinkv/formats/bits.hpp"

namespace thinkv {

/// The FP16 code every NaN input becomes (positive, all payload bits set), as in cuda_fp16.h.
inline constexpr std::uint16_t kFp16CanonicalNan = 0x7FFF;
/// The largest finite FP16 magnitude, 65504.
inline constexpr float kFp16Max = 65504.0f;

/// Rounds `x` to the nearest FP16 value, ties to even. Magnitudes that round above 65504 (from
/// 65520 up) become +-Inf (IEEE overflow, no saturation); +-Inf and +-0 keep their sign; values
/// below the smallest FP16 subnormal (2^-24) round to +-0 or to it; every NaN becomes 0x7FFF.
THINKV_HD constexpr std::uint16_t encode_fp16(float x) noexcept {
  const std::uint32_t u = float_to_bits(x);
  const std::uint32_t a = u & kFloatAbsMask;
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (a > kFloatInfBits) return kFp16CanonicalNan;
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520: Inf
  if (a >= 0x38800000u) {  // normal FP16 range (|x| >= 2^-14): rebias 127 -> 15, keep 10 bits
    // Rounding carries into the exponent (e.g. 2047.99 -> 2048), which is the right result.
    return static_cast<std::uint16_t>(sign | shift_right_round_even(a - 0x38000000u, 13));
  }
  // Subnormal range: |x| * 2^24 (exact, a power-of-two scaling) rounded to an integer, ties to
  // even, by adding 2^23 in float; 1024 is the smallest normal code, which is the right result.
  const std::uint32_t m = float_to_bits(bits_to_float(a) * 16777216.0f + 8388608.0f) - 0x4B000000u;
  return static_cast<std::uint16_t>(sign | m);
}

/// The exact float value of an IEEE binary16 (host reference; kernels convert in hardware).
/// Inf stays Inf; NaN becomes a quiet NaN with the payload's top bits.
THINKV_HD constexpr float decode_fp16(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));  // Inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal (or zero): man * 2^-24, exact in float.
  const float v = static_cast<float>(man) * 0x1p-24f;
  return sign ? -v : v;
}

}  // namespace thinkv
