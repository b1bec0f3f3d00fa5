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
THINKV_HD constexpr std::uint32_t float_to_bits(float x) noexcept {
  return __builtin_bit_cast(std::uint32_t, x);
}

/// The float whose raw bits are `u` (a bit copy, no conversion).
THINKV_HD constexpr float bits_to_float(std::uint32_t u) noexcept {
  return __builtin_bit_cast(float, u);
}

/// |x| by clearing the sign bit (exact; also for NaN, -0 and subnormals).
THINKV_HD constexpr float abs_float(float x) noexcept {
  return bits_to_float(float_to_bits(x) & kFloatAbsMask);
}

/// True when `x` is a NaN (any payload, either sign).
THINKV_HD constexpr bool is_nan_float(float x) noexcept {
  return (float_to_bits(x) & kFloatAbsMask) > kFloatInfBits;
}

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

}  // namespace thinkv
