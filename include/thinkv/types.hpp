#pragma once
/// \file types.hpp
/// Vocabulary types: thought types and storage precisions.

#include <array>
#include <cstdint>
#include <ostream>
#include <string_view>

#include "thinkv/config.hpp"

namespace thinkv {

/// The three thought types of ThinKV, ordered by importance: R > E > T.
enum class ThoughtType : std::uint8_t {
  kReasoning = 0,   ///< R: most important
  kExecution = 1,   ///< E
  kTransition = 2,  ///< T: least important
};
inline constexpr int kNumThoughtTypes = 3;
inline constexpr std::array<ThoughtType, kNumThoughtTypes> kAllThoughtTypes = {
    ThoughtType::kReasoning, ThoughtType::kExecution, ThoughtType::kTransition};

/// Importance rank: larger is more important (R = 2, E = 1, T = 0).
constexpr int importance(ThoughtType t) noexcept { return 2 - static_cast<int>(t); }

constexpr std::string_view to_string(ThoughtType t) noexcept {
  switch (t) {
    case ThoughtType::kReasoning: return "R";
    case ThoughtType::kExecution: return "E";
    case ThoughtType::kTransition: return "T";
  }
  return "?";
}
inline std::ostream& operator<<(std::ostream& os, ThoughtType t) { return os << to_string(t); }

/// Storage precision of a quantized page. Every quantized precision carries one FP8 E4M3 scale per
/// group and an FP32 second-level scale per stream (see docs/formats.md); kBf16 carries none.
enum class Precision : std::uint8_t {
  kBf16 = 0,     ///< 16 bits, full-precision pages (FullKV) and the staging format
  kFp8E4M3 = 1,  ///< 8 bits, OCP E4M3
  kNvfp4 = 2,    ///< 4 bits, E2M1 codes
  kTernary = 3,  ///< 2 bits, {-1, 0, +1}
};
inline constexpr int kNumPrecisions = 4;
inline constexpr std::array<Precision, kNumPrecisions> kAllPrecisions = {Precision::kBf16, Precision::kFp8E4M3,
                                                                         Precision::kNvfp4, Precision::kTernary};

/// Bits of one stored element (excluding scales).
THINKV_HD constexpr int bits_of(Precision p) noexcept {
  switch (p) {
    case Precision::kBf16: return 16;
    case Precision::kFp8E4M3: return 8;
    case Precision::kNvfp4: return 4;
    case Precision::kTernary: return 2;
  }
  return 0;
}
/// True when elements share an FP8 group scale (every precision but kBf16).
THINKV_HD constexpr bool has_group_scale(Precision p) noexcept { return p != Precision::kBf16; }

constexpr std::string_view to_string(Precision p) noexcept {
  switch (p) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp8E4M3: return "fp8_e4m3";
    case Precision::kNvfp4: return "nvfp4";
    case Precision::kTernary: return "ternary";
  }
  return "?";
}
inline std::ostream& operator<<(std::ostream& os, Precision p) { return os << to_string(p); }

}  // namespace thinkv
