#pragma once
/// \file bf16.hpp
/// BF16 (bfloat16), the staging and full-precision format: the top 16 bits of an IEEE binary32
/// (1 sign, 8 exponent bits bias 127, 7 mantissa bits). Encoding matches NVIDIA's
/// __float2bfloat16_rn bit for bit (see docs/formats.md).

#include <cmath>
#include <cstdint>

#include "thinkv/config.hpp"
#include "thinkv/formats/bits.hpp"

namespace thinkv {

/// The BF16 code every NaN input becomes (positive, all payload bits set), as in cuda_bf16.h.
inline constexpr std::uint16_t kBf16CanonicalNan = 0x7FFF;

/// Rounds `x` to the nearest BF16 value, ties to even. Finite values beyond the largest BF16
/// magnitude round to +-Inf (IEEE overflow, no saturation); +-Inf and +-0 keep their sign; float
/// subnormals are rounded, not flushed; every NaN (either sign, any payload, quiet or signalling)
/// becomes 0x7FFF.
THINKV_HD constexpr std::uint16_t encode_bf16(float x) noexcept {
  const std::uint32_t u = float_to_bits(x);
  if ((u & kFloatAbsMask) > kFloatInfBits) return kBf16CanonicalNan;
  return static_cast<std::uint16_t>(shift_right_round_even(u, 16));
}

/// The exact float value of BF16 code `h` (NaN codes stay NaN with their payload).
THINKV_HD constexpr float decode_bf16(std::uint16_t h) noexcept {
  return bits_to_float(static_cast<std::uint32_t>(h) << 16);
}

/// Rounds a double to the nearest BF16 value, ties to even, in a single rounding (rounding to
/// float first and then to BF16 rounds twice and can land one BF16 step off). The double goes
/// to float rounded *to odd* (truncated, its last bit set when inexact), which keeps the 16
/// bits below BF16's mantissa honest, then to BF16 as encode_bf16 rounds (specials, overflow to
/// Inf, subnormals alike). Used where the cache computes a stored value in double (the RoPE
/// re-rotation of a position shift).
inline std::uint16_t encode_bf16_from_double(double x) noexcept {
  if (std::isnan(x)) return kBf16CanonicalNan;
  float f = static_cast<float>(x);
  const double back = static_cast<double>(f);
  if (back != x) {
    std::uint32_t u = float_to_bits(f);
    if (std::fabs(back) > std::fabs(x)) --u;  // rounded away from zero: one float step back
    f = bits_to_float(u | 1u);
  }
  return encode_bf16(f);
}

}  // namespace thinkv
