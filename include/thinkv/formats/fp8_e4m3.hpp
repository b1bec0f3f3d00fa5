#pragma once
/// \file fp8_e4m3.hpp
/// OCP FP8 E4M3 ("E4M3FN"): 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities,
/// NaN = S.1111.111, max finite 448, min subnormal 2^-9. Encoding matches NVIDIA's
/// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) bit for bit (see docs/formats.md).

#include <cstdint>

#include "thinkv/config.hpp"
#include "thinkv/formats/bits.hpp"

namespace thinkv {

/// Largest finite E4M3 magnitude.
inline constexpr float kE4M3Max = 448.0f;
/// Code of +448 (the largest finite positive code); -448 is 0xFE.
inline constexpr std::uint8_t kE4M3MaxCode = 0x7E;
/// The NaN code produced by encode_e4m3 for every NaN input (0xFF is the other NaN code).
inline constexpr std::uint8_t kE4M3NanCode = 0x7F;
/// Smallest positive E4M3 value (subnormal 0.000.001 = 2^-9).
inline constexpr float kE4M3MinSubnormal = 0x1p-9f;
/// Smallest positive normal E4M3 value (0.0001.000 = 2^-6).
inline constexpr float kE4M3MinNormal = 0x1p-6f;

/// Rounds `x` to the nearest E4M3 value, ties to even, saturating: finite results beyond 448 and
/// +-Inf become +-448 (0x7E/0xFE); every NaN (either sign, any payload) becomes 0x7F; -0 and
/// negative values that round to zero become 0x80 (negative zero), as NVIDIA's SATFINITE
/// conversion does.
THINKV_HD constexpr std::uint8_t encode_e4m3(float x) noexcept {
  // Branch-free (minifloat_magnitude_code); tested against the branchy definition (test_formats:
  // exhaustively under [.exhaustive], sampled by default). Subnormal range: units of 2^-9, so
  // 0..8 (8 is the smallest normal code 0x08 = 2^-6).
  const std::uint32_t u = float_to_bits(x);
  const std::uint32_t a = u & kFloatAbsMask;
  const std::uint32_t code = ((u >> 24) & 0x80u) | minifloat_magnitude_code<3, 7>(a, kE4M3MaxCode);
  return static_cast<std::uint8_t>(a > kFloatInfBits ? kE4M3NanCode : code);
}

/// The exact value of E4M3 code `c`; 0x7F and 0xFF decode to a quiet NaN (sign dropped, as in
/// NVIDIA's __nv_cvt_fp8_to_halfraw); 0x80 decodes to -0.
THINKV_HD constexpr float decode_e4m3(std::uint8_t c) noexcept {
  if ((c & 0x7Fu) == 0x7Fu) return bits_to_float(kFloatQuietNanBits);
  const std::uint32_t sign = static_cast<std::uint32_t>(c & 0x80u) << 24;
  const std::uint32_t e = (c >> 3) & 0xFu;
  const std::uint32_t m = c & 0x7u;
  if (e != 0u) return bits_to_float(sign | ((e + 120u) << 23) | (m << 20));
  if (m == 0u) return bits_to_float(sign);
  // Subnormal m * 2^-9: normalise around the leading set bit p of m (p in 0..2).
  const std::uint32_t p = m >= 4u ? 2u : (m >= 2u ? 1u : 0u);
  return bits_to_float(sign | ((p + 118u) << 23) | ((m ^ (1u << p)) << (23u - p)));
}

}  // namespace thinkv
