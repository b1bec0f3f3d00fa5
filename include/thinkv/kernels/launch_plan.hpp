#pragma once
/// \file launch_plan.hpp
/// Host-side launch planning of the decode-attention kernels, kept free of CUDA so that it is
/// unit-tested on any machine (tests/unit/test_launch_plan.cpp). paged_attention.cu feeds it the
/// device's resident CTAs (occupancy API x SMs).

#include <cstdint>

namespace thinkv::kernels {

/// Split-K plan: the fewest chunks per KV head, 1..max_splits, whose num_kv_heads * splits CTAs
/// fill the last wave of `resident_ctas` (CTAs the device keeps resident at once) to at least 90%:
/// waves = Hkv * s / R and the efficiency waves / ceil(waves) >= 0.9 (a grid of 1.3 waves takes
/// about as long as one of 2). When no s reaches 90%, the most efficient one (the fewest among
/// equals). Integer arithmetic only, so the choice is exact and the same on every host.
/// resident_ctas < 1 is treated as 1; num_kv_heads < 1 as 1; max_splits < 1 as 1.
[[nodiscard]] constexpr int plan_decode_splits(int num_kv_heads, long long resident_ctas, int max_splits) noexcept {
  const long long h = num_kv_heads > 0 ? num_kv_heads : 1;
  const long long r = resident_ctas > 0 ? resident_ctas : 1;
  const int smax = max_splits > 0 ? max_splits : 1;
  int best = 1;
  long long best_num = 0, best_den = 1;  // efficiency of `best` as a fraction
  for (int s = 1; s <= smax; ++s) {
    const long long ctas = h * s;
    const long long waves = (ctas + r - 1) / r;  // ceil
    // efficiency = ctas / (r * waves)
    if (10 * ctas >= 9 * r * waves) return s;
    if (ctas * best_den > best_num * (r * waves)) {
      best = s;
      best_num = ctas;
      best_den = r * waves;
    }
  }
  return best;
}

}  // namespace thinkv::kernels
