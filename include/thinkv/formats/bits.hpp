#pragma once
/// \file bits.hpp
/// Bit-level helpers shared by the number-format encoders (host and device, constexpr, no CUDA
/// headers). See docs/formats.md.

#include <cstdint>

#include "thinkv/config.hpp"

namespace thinkv {

/// IEEE-754 binary32 sign bit.
inline constexpr std::uint32_t kFloatSignMask = 0x80000000u;
/// IEEE-754 binary32 magnitude bits (everything but the sign).
inline constexpr std::uint32_t kFloatAbsMask = 0x7FFFFFFFu;
/// Bits of +Inf; a magnitude above this is a NaN.
inline constexpr std::uint32_t kFloatInfBits = 0x7F800000u;
/// Bits of the default quiet NaN returned by our decoders for NaN codes.
inline constexpr std::uint32_t kFloatQuietNanBits = 0x7FC00000u;

/// The raw bits of `x` (a bit copy, no conversion).
THINKV_HD constexpr std::uint32_t float_to_bits(float x) noexcept { return __builtin_bit_cast(std::uint32_t, x); }

/// The float whose raw bits are `u` (a bit copy, no conversion).
THINKV_HD constexpr float bits_to_float(std::uint32_t u) noexcept { return __builtin_bit_cast(float, u); }

/// |x| by clearing the sign bit (exact; also for NaN, -0 and subnormals).
THINKV_HD constexpr float abs_float(float x) noexcept { return bits_to_float(float_to_bits(x) & kFloatAbsMask); }

/// True when `x` is a NaN (any payload, either sign).
THINKV_HD constexpr bool is_nan_float(float x) noexcept { return (float_to_bits(x) & kFloatAbsMask) > kFloatInfBits; }

/// True when `x` is neither NaN nor +-Inf.
THINKV_HD constexpr bool is_finite_float(float x) noexcept {
  return (float_to_bits(x) & kFloatAbsMask) < kFloatInfBits;
}

/// 2^e as a float for e in [-126, 127] (normal range); e is clamped to that range.
THINKV_HD constexpr float pow2_float(int e) noexcept {
  if (e < -126) e = -126;
  if (e > 127) e = 127;
  return bits_to_float(static_cast<std::uint32_t>(e + 127) << 23);
}

/// The unbiased binary exponent floor(log2|x|) of a normal, nonzero, finite float `x`.
THINKV_HD constexpr int float_exponent(float x) noexcept {
  return static_cast<int>((float_to_bits(x) >> 23) & 0xFFu) - 127;
}

/// `m >> shift` rounded to nearest, ties to even (shift >= 0; shift >= 32 gives 0 unless a tie or
/// more, which cannot happen for shift >= 33).
THINKV_HD constexpr std::uint32_t shift_right_round_even(std::uint32_t m, int shift) noexcept {
  if (shift <= 0) return m;
  if (shift >= 33) return 0u;
  if (shift == 32) return m > 0x80000000u ? 1u : 0u;
  const std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return (rem > half || (rem == half && (q & 1u) != 0u)) ? q + 1u : q;
}

/// The magnitude code of a float in a minifloat format with kMantissa mantissa bits, exponent
/// bias kBias and subnormals (E4M3: <3, 7>; E2M1: <1, 1>): `a` is the float's magnitude bits
/// (float_to_bits(|x|), not a NaN). Rounds to nearest, ties to even; magnitudes that round above
/// `max_code` (Inf included) give max_code. Branch-free: both ranges are computed and one is
/// selected, so a GPU thread runs a dozen instructions with no divergent branch.
///  - Normal range (|x| >= 2^(1 - kBias)): keep kMantissa of 23 mantissa bits, rounding to nearest
///    even over the whole magnitude ((a + 2^(s-1) - 1 + lsb) >> s, s = 23 - kMantissa; a carry
///    ripples into the exponent), then rebias 127 -> kBias.
///  - Subnormal range: |x| / 2^(1 - kBias - kMantissa) (exact) rounded to an integer, ties to
///    even, by adding 2^23 in float (the sum's ulp is 1; its low mantissa bits are the integer).
///    The result reaches the smallest normal code when |x| rounds up to it; float zeros and
///    subnormals give 0.
template <int kMantissa, int kBias>
THINKV_HD constexpr std::uint32_t minifloat_magnitude_code(std::uint32_t a, std::uint32_t max_code) noexcept {
  static_assert(kMantissa >= 1 && kMantissa <= 10 && kBias >= 1 && kBias + kMantissa <= 24, "a small float format");
  constexpr int kShift = 23 - kMantissa;
  constexpr std::uint32_t kRebias = static_cast<std::uint32_t>(127 - kBias) << kMantissa;
  constexpr std::uint32_t kNormalMinBits = static_cast<std::uint32_t>(128 - kBias) << 23;  // 2^(1 - kBias)
  constexpr float kSubnormalScale = static_cast<float>(1u << (kBias + kMantissa - 1));
  std::uint32_t normal = ((a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u)) >> kShift) - kRebias;
  normal = normal < max_code ? normal : max_code;
  const std::uint32_t sub = float_to_bits(bits_to_float(a) * kSubnormalScale + 8388608.0f) - 0x4B000000u;
  return a >= kNormalMinBits ? normal : sub;
}

}  // namespace thinkv
