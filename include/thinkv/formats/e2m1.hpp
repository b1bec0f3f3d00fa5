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
  // Branch-free (minifloat_magnitude_code); tested against the branchy definition (test_formats:
  // exhaustively under [.exhaustive], sampled by default). Subnormal range: units of 0.5, so 0,
  // 1 or 2 (code 0b010 = 1.0).
  const std::uint32_t u = float_to_bits(x);
  const std::uint32_t a = u & kFloatAbsMask;
  const std::uint32_t code = ((u >> 28) & 0x8u) | minifloat_magnitude_code<1, 1>(a, kE2M1MaxCode);
  return static_cast<std::uint8_t>(a > kFloatInfBits ? kE2M1MaxCode : code);
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
