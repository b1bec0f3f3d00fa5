#pragma once
/// \file fp16_placement.hpp
/// Dequantization by bit placement, as the decode-attention kernel does it (Hopper has no FP4
/// conversion instruction): an E4M3 or E2M1 code's exponent and mantissa bits are copied into the
/// matching bit fields of an IEEE binary16, which then holds the code's exact value times a power
/// of two (the binary16 exponent bias is larger). No table, no branch: two codes per 32-bit word
/// become two FP16 in one word (the low code in the low half), ready for a half2 -> float2
/// conversion. The factor is folded into the scale the element is multiplied by.
///
///   E4M3 s.eeee.mmm  -> FP16 s.0eeee.mmm0000000 = value * 2^-8   (normal and subnormal codes;
///                       the NaN codes 0x7F / 0xFF are never stored: the encoder saturates and
///                       the cache refuses NaN)
///   E2M1 s.ee.m      -> FP16 s.000ee.m000000000 = value * 2^-14
///
/// tests/unit/test_formats.cpp checks every code against decode_e4m3 / decode_e2m1;
/// decode_fp16 (formats/fp16.hpp) is checked against cuda_fp16.h's __half2float on all 65,536
/// patterns (tests/oracle/).

#include <cstdint>

#include "thinkv/config.hpp"
#include "thinkv/formats/bits.hpp"
#include "thinkv/formats/fp16.hpp"  // decode_fp16, the reference the placements are checked with

namespace thinkv {

/// The FP16 of an E4M3 code is its value divided by this.
inline constexpr float kE4M3Fp16Unscale = 256.0f;
/// The FP16 of an E2M1 code is its value divided by this.
inline constexpr float kE2M1Fp16Unscale = 16384.0f;

/// Byte c (c = 0..3) is the high byte of the FP16 of ternary code c times 2^-14 (low byte 0):
/// 0, +2^-14, 0 (code 0b10, never written, reads 0 as decode_element does), -2^-14. The
/// tensor-core attention pass builds an FP16 pair of two codes with one byte permute of it.
inline constexpr std::uint32_t kTernaryFp16HighBytes = 0x84000400u;

/// Bytes 0 and 1 of `w` (E4M3 codes) -> two FP16 (low and high half of the result).
THINKV_HD constexpr std::uint32_t e4m3x2_to_fp16x2(std::uint32_t w) noexcept {
  return ((w & 0x7Fu) << 7) | ((w & 0x80u) << 8) | ((w & 0x7F00u) << 15) | ((w & 0x8000u) << 16);
}

/// Nibbles 0 and 1 of `w` (E2M1 codes) -> two FP16 (low and high half of the result).
THINKV_HD constexpr std::uint32_t e2m1x2_to_fp16x2(std::uint32_t w) noexcept {
  return ((w & 0x7u) << 9) | ((w & 0x8u) << 12) | ((w & 0x70u) << 21) | ((w & 0x80u) << 24);
}

/// The tensor-core attention pass's E2M1 decode: byte k of the result is the FP16 high byte of the
/// E2M1 code in nibble 2k (even) or 2k + 1 (odd) of `w`: sign -> bit 7, the three magnitude bits ->
/// bits 3..1, so that with a zero low byte the FP16 is the code's value x 2^-14 (as
/// e2m1x2_to_fp16x2 places it). One byte permute per pair of codes then builds an FP16 pair.
THINKV_HD constexpr std::uint32_t e2m1_even_fp16_high_bytes(std::uint32_t w) noexcept {
  return ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u);
}
THINKV_HD constexpr std::uint32_t e2m1_odd_fp16_high_bytes(std::uint32_t w) noexcept {
  return ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);
}

}  // namespace thinkv
