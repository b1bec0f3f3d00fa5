#pragma once
/// \file e2m1.hpp
/// FP4 E2M1, the NVFP4 element: 1 sign (bit 3), 2 exponent (bias 1), 1 mantissa bit; magnitudes
/// {0, 0.5, 1, 1.5, 2, 3, 4, 6}; no Inf, no NaN. Encoding matches NVIDIA's
/// __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest) bit for bit (see docs/formats.md).

#include <cstdint>

#include "thinkv/config.hpp"
#include "thinkv/formats/bits.hpp"

namespace thinkv {

/// Largest E2M1 magnitude.
inline constexpr float kE2M1Max = 6.0f;
/// Code of +6 (0b0111); -6 is 0b1111.
inline constexpr std::uint8_t kE2M1MaxCode = 0x7;

/// Rounds `x` to the nearest E2M1 value, ties to even, saturating to +-6 (also for +-Inf); every
/// NaN becomes +6 (0x7); -0 and negative values that round to zero become 0x8 (negative zero),
/// as NVIDIA's conversion does. Returns a code in 0..15.
THINKV_HD constexpr std::uint8_t encode_e2m1(float x) noexcept {
  const std::uint32_t u = float_to_bits(x);
  const std::uint32_t a = u & kFloatAbsMask;
  if (a > kFloatInfBits) return kE2M1MaxCode;
  const auto sign = static_cast<std::uint8_t>((u >> 28) & 0x8u);
  const std::uint32_t fe = a >> 23;  // biased float exponent
  if (fe >= 127u) {
    // |x| >= 1: E2M1 normal range. Keep 1 of 23 mantissa bits, round to nearest even over the
    // whole magnitude (carries ripple into the exponent), rebias 127 -> 1, saturate at 6 (Inf too).
    const std::uint32_t code = shift_right_round_even(a, 22) - ((127u - 1u) << 1);
    return static_cast<std::uint8_t>(sign | (code > kE2M1MaxCode ? kE2M1MaxCode : code));
  }
  if (fe == 0u) return sign;  // float zero or subnormal rounds to (signed) zero
  // Subnormal range: count units of 0.5. |x| = M * 2^(fe - 150), so |x| / 0.5 = M >> (149 - fe);
  // a result of 2 is code 0b010 = 1.0.
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t q = shift_right_round_even(m, 149 - static_cast<int>(fe));
  return static_cast<std::uint8_t>(sign | q);
}

/// The exact value of E2M1 code `c` (only the low 4 bits are read); 0x8 decodes to -0.
THINKV_HD constexpr float decode_e2m1(std::uint8_t c) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(c & 0x8u) << 28;
  const std::uint32_t e = (c >> 1) & 0x3u;
  const std::uint32_t m = c & 0x1u;
  if (e != 0u) return bits_to_float(sign | ((e + 126u) << 23) | (m << 22));
  return bits_to_float(sign | (m != 0u ? (126u << 23) : 0u));  // 0 or 0.5
}

}  // namespace thinkv
