#pragma once
/// \file precision_map.hpp
/// TBQ ("think before you quantize") precision map: the storage precision of each thought type.

#include <array>
#include <concepts>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>

#include "thinkv/status.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

/// Precision of a bit width written in a precision-map string ("R4E4T2": 4 -> NVFP4).
/// Returns nullopt for widths ThinKV has no format for.
constexpr std::optional<Precision> precision_from_bits(int bits) noexcept {
  switch (bits) {
    case 16: return Precision::kBf16;
    case 8: return Precision::kFp8E4M3;
    case 4: return Precision::kNvfp4;
    case 2: return Precision::kTernary;
    default: return std::nullopt;
  }
}

/// Storage precision per thought type. A more important thought never gets fewer bits than a less
/// important one (R >= E >= T); the constructor throws ConfigError otherwise.
class PrecisionMap {
 public:
  /// The paper's default, R4E4T2.
  constexpr PrecisionMap() = default;
  /// Throws ConfigError naming the offending thought when bits(R) >= bits(E) >= bits(T) fails.
  constexpr PrecisionMap(Precision r, Precision e, Precision t) : p_{r, e, t} {
    // Constant-evaluable fast path; the message is only built when the map is rejected.
    const bool valid =
        bits_of(r) > 0 && bits_of(e) > 0 && bits_of(t) > 0 && bits_of(r) >= bits_of(e) && bits_of(e) >= bits_of(t);
    if (!valid) throw ConfigError(check(r, e, t));
  }

  /// Validates a candidate map without constructing it.
  static Status check(Precision r, Precision e, Precision t) {
    const int br = bits_of(r), be = bits_of(e), bt = bits_of(t);
    const Precision ps[kNumThoughtTypes] = {r, e, t};
    for (ThoughtType th : kAllThoughtTypes) {
      const Precision p = ps[static_cast<int>(th)];
      if (!precision_from_bits(bits_of(p))) {
        return {StatusCode::kInvalidArgument, "unknown precision value " + std::to_string(static_cast<int>(p)) +
                                                  " for " + std::string(thinkv::to_string(th)) +
                                                  "; allowed: bf16, fp8_e4m3, nvfp4, ternary (16, 8, 4 or 2 bits)"};
      }
    }
    if (be > br) {
      return {StatusCode::kInvalidArgument, "precision map gives E (" + std::to_string(be) +
                                                " bits) more bits than the more "
                                                "important R (" +
                                                std::to_string(br) + " bits); need bits(R) >= bits(E) >= bits(T)"};
    }
    if (bt > be) {
      return {StatusCode::kInvalidArgument, "precision map gives T (" + std::to_string(bt) +
                                                " bits) more bits than the more "
                                                "important E (" +
                                                std::to_string(be) + " bits); need bits(R) >= bits(E) >= bits(T)"};
    }
    return Status::ok();
  }

  /// Parses "R4E4T2"-style text (bits per thought in the order R, E, T; 16, 8, 4 or 2 each).
  /// On error returns the status and leaves `out` unchanged.
  static Status parse(std::string_view text, PrecisionMap& out) {
    std::array<Precision, 3> got{};
    constexpr std::string_view kLetters = "RET";
    std::size_t i = 0;
    for (int t = 0; t < 3; ++t) {
      if (i >= text.size() || text[i] != kLetters[t]) {
        return {StatusCode::kInvalidArgument, "precision map '" + std::string(text) +
                                                  "' is malformed: expected the form R<bits>E<bits>"
                                                  "T<bits>, e.g. R4E4T2"};
      }
      ++i;
      int bits = 0;
      std::size_t digits = 0;
      while (i < text.size() && text[i] >= '0' && text[i] <= '9' && digits < 3) {
        bits = bits * 10 + (text[i] - '0');
        ++i;
        ++digits;
      }
      auto p = precision_from_bits(bits);
      if (digits == 0 || !p) {
        return {StatusCode::kInvalidArgument, "precision map '" + std::string(text) + "': unknown precision " +
                                                  std::to_string(bits) + " bits for " + std::string(1, kLetters[t]) +
                                                  "; allowed: 16, 8, 4, 2"};
      }
      got[t] = *p;
    }
    if (i != text.size()) {
      return {StatusCode::kInvalidArgument, "precision map '" + std::string(text) + "' has trailing characters"};
    }
    THINKV_RETURN_IF_ERROR(check(got[0], got[1], got[2]));
    out = PrecisionMap(got[0], got[1], got[2]);
    return Status::ok();
  }

  [[nodiscard]] constexpr Precision precision_of(ThoughtType t) const noexcept { return p_[static_cast<int>(t)]; }
  /// "R4E4T2".
  [[nodiscard]] std::string to_string() const {
    return "R" + std::to_string(bits_of(p_[0])) + "E" + std::to_string(bits_of(p_[1])) + "T" +
           std::to_string(bits_of(p_[2]));
  }
  /// True when some thought type is stored at precision p.
  [[nodiscard]] constexpr bool uses(Precision p) const noexcept { return p_[0] == p || p_[1] == p || p_[2] == p; }

  friend constexpr bool operator==(const PrecisionMap&, const PrecisionMap&) = default;
  friend std::ostream& operator<<(std::ostream& os, const PrecisionMap& m) { return os << m.to_string(); }

 private:
  std::array<Precision, 3> p_{Precision::kNvfp4, Precision::kNvfp4, Precision::kTernary};
};

/// A TBQ precision policy: what BasicThinKvCache calls on it.
///  - precision_of(t): the storage precision of thought type t;
///  - to_string(): for messages and method names.
/// The cache lowers it once, at construction, to the PrecisionMap descriptor the paged cache,
/// the backends and the kernels see (lower_precision), so a policy's answers must be fixed and
/// must give a more important thought no fewer bits (R >= E >= T).
template <class P>
concept precision_policy = std::copy_constructible<P> && requires(const P& p, ThoughtType t) {
  { p.precision_of(t) } -> std::same_as<Precision>;
  { p.to_string() } -> std::convertible_to<std::string>;
};
static_assert(precision_policy<PrecisionMap>);

/// The same precision for every thought (BF16 pages: FullKV and TBE-only; uniform NVFP4).
template <Precision P>
struct UniformPrecision {
  [[nodiscard]] constexpr Precision precision_of(ThoughtType) const noexcept { return P; }
  [[nodiscard]] std::string to_string() const {
    return P == Precision::kBf16 ? std::string("BF16 pages") : "uniform " + std::string(thinkv::to_string(P));
  }
  friend constexpr bool operator==(UniformPrecision, UniformPrecision) = default;
};
using Bf16Pages = UniformPrecision<Precision::kBf16>;

/// The PrecisionMap descriptor of a precision policy; the Status names the thought whose
/// precision is unknown or gets more bits than a more important one.
template <precision_policy P>
Status lower_precision(const P& p, PrecisionMap& out) {
  const Precision r = p.precision_of(ThoughtType::kReasoning), e = p.precision_of(ThoughtType::kExecution),
                  t = p.precision_of(ThoughtType::kTransition);
  if (Status s = PrecisionMap::check(r, e, t); !s.is_ok()) {
    return {s.code(), "precision policy " + std::string(p.to_string()) + ": " + s.message()};
  }
  out = PrecisionMap(r, e, t);
  return Status::ok();
}

/// Named maps. kFullKvMap stores every thought in BF16 (the FullKV baseline).
inline constexpr PrecisionMap kR4E4T2{};
inline constexpr PrecisionMap kR8E4T2{Precision::kFp8E4M3, Precision::kNvfp4, Precision::kTernary};
inline constexpr PrecisionMap kR8E8T4{Precision::kFp8E4M3, Precision::kFp8E4M3, Precision::kNvfp4};
inline constexpr PrecisionMap kFullKvMap{Precision::kBf16, Precision::kBf16, Precision::kBf16};

}  // namespace thinkv
