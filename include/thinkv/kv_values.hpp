#pragma once
/// \file kv_values.hpp
/// The check every cache makes on appended keys and values before it stores anything: finite,
/// and within the magnitude its storage format represents.

#include <cmath>
#include <cstdio>
#include <span>
#include <string>

#include "thinkv/status.hpp"

namespace thinkv {

/// Largest |value| a K/V element may have in the compressed cache. Beyond it the FP32 scale
/// arithmetic of the formats could overflow (docs/formats.md); real keys and values are many
/// orders of magnitude smaller.
inline constexpr float kMaxKvMagnitude = 0x1p64f;

/// Checks one token's K and V values: finite and |x| <= max_magnitude (kMaxKvMagnitude for the
/// compressed cache, 65504 for FP16 storage). `where` names the destination in messages and
/// `limit_name` the limit ("2^64", "the largest FP16 value 65504").
inline Status check_kv_values(std::span<const float> k, std::span<const float> v, const std::string& where,
                              float max_magnitude = kMaxKvMagnitude, const char* limit_name = "2^64") {
  for (int kv = 0; kv < 2; ++kv) {
    const std::span<const float> x = kv == 0 ? k : v;
    for (std::size_t c = 0; c < x.size(); ++c) {
      const float xc = x[c];
      if (std::isfinite(xc) && std::fabs(xc) <= max_magnitude) continue;
      char value[64];
      std::snprintf(value, sizeof value, "%g", static_cast<double>(xc));
      const std::string name = std::string(kv == 0 ? "k" : "v") + "[" + std::to_string(c) + "] = " + value;
      if (!std::isfinite(xc)) {
        return {StatusCode::kNonFinite, name + " appended to " + where + " is not finite; the token was not stored"};
      }
      return {StatusCode::kNonFinite, name + " appended to " + where + " exceeds the largest magnitude " +
                                          "this cache stores (" + limit_name + "); the token was not stored"};
    }
  }
  return Status::ok();
}

}  // namespace thinkv
