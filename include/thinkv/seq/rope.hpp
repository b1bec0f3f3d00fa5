#pragma once
/// \file rope.hpp
/// Rotary position embedding (RoPE) as the cache needs it: keys are stored after RoPE, so a
/// position shift (llama.cpp's seq_add) must rotate every stored key of the shifted tokens by the
/// shift. Rotations compose, R(p + delta) = R(delta) R(p), so the key's original position is not
/// needed. RopeSpec describes the model's rotation (base, rotated channels, pairing, linear
/// position scaling); ThinKvCache::shift_positions takes one.

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "thinkv/status.hpp"

namespace thinkv {

/// Which channels a RoPE rotation pairs (rotary_dims = n channels rotated, i = 0 .. n/2 - 1).
enum class RopeStyle : std::uint8_t {
  kAdjacentPairs = 0,  ///< (2i, 2i + 1): llama2.c, Meta's Llama, llama.cpp's LLAMA_ROPE_TYPE_NORM
  kHalves = 1,         ///< (i, i + n/2): GPT-NeoX, Hugging Face Llama/Qwen, llama.cpp's LLAMA_ROPE_TYPE_NEOX
};

/// A model's RoPE: channel pair i turns by position * position_scale * theta^(-2i / n), n =
/// rotary_dims (0: head_dim); channels from n on are not rotated. YaRN and other non-linear
/// frequency corrections are not modelled.
struct RopeSpec {
  double theta = 10000.0;                       ///< frequency base (llama.cpp's rope_freq_base)
  int rotary_dims = 0;                          ///< rotated channels, even; 0: all of head_dim
  RopeStyle style = RopeStyle::kAdjacentPairs;  ///< channel pairing
  double position_scale = 1.0;                  ///< linear position scaling (llama.cpp's rope_freq_scale)

  /// kInvalidArgument naming the bad value for a head of `head_dim` channels.
  [[nodiscard]] Status validate(int head_dim) const {
    auto bad = [](const std::string& what) { return Status{StatusCode::kInvalidArgument, "RopeSpec: " + what}; };
    if (!(std::isfinite(theta) && theta > 1.0)) return bad("theta " + std::to_string(theta) + "; allowed: > 1");
    if (!(std::isfinite(position_scale) && position_scale > 0.0)) {
      return bad("position_scale " + std::to_string(position_scale) + "; allowed: > 0");
    }
    if (rotary_dims < 0 || rotary_dims > head_dim || rotary_dims % 2 != 0) {
      return bad("rotary_dims " + std::to_string(rotary_dims) + "; allowed: 0 (all) or even, <= head_dim " +
                 std::to_string(head_dim));
    }
    if (style != RopeStyle::kAdjacentPairs && style != RopeStyle::kHalves) {
      return bad("style " + std::to_string(static_cast<int>(style)) + "; allowed: kAdjacentPairs (0), kHalves (1)");
    }
    return Status::ok();
  }

  /// The rotation through `delta` positions, for rows of `head_dim` channels: each rotated
  /// pair's channels and cosine / sine, computed once and applied to many rows (apply).
  /// Precondition: validate(head_dim) is ok.
  struct Turn {
    std::vector<int> a, b;     ///< the channels of pair i
    std::vector<double> c, s;  ///< cos and sin of pair i's angle
  };
  [[nodiscard]] Turn turn(std::int64_t delta, int head_dim) const {
    const int n = rotary_dims == 0 ? head_dim : rotary_dims;
    const int half = n / 2;
    Turn t;
    for (int i = 0; i < half; ++i) {
      const double angle = static_cast<double>(delta) * position_scale * std::pow(theta, -2.0 * i / n);
      t.a.push_back(style == RopeStyle::kAdjacentPairs ? 2 * i : i);
      t.b.push_back(style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + half);
      t.c.push_back(std::cos(angle));
      t.s.push_back(std::sin(angle));
    }
    return t;
  }
  /// Rotates one head's row in place by a turn made for its head_dim: R(delta) x.
  static void apply(std::span<double> row, const Turn& t) noexcept {
    for (std::size_t i = 0; i < t.c.size(); ++i) {
      const auto a = static_cast<std::size_t>(t.a[i]), b = static_cast<std::size_t>(t.b[i]);
      const double x0 = row[a], x1 = row[b];
      row[a] = x0 * t.c[i] - x1 * t.s[i];
      row[b] = x0 * t.s[i] + x1 * t.c[i];
    }
  }
  /// Rotates one head's row (head_dim values) in place through `delta` positions, in double
  /// precision. Precondition: validate(row.size()) is ok.
  void rotate(std::span<double> row, std::int64_t delta) const {
    apply(row, turn(delta, static_cast<int>(row.size())));
  }
};

}  // namespace thinkv
