// plan_decode_splits (include/thinkv/kernels/launch_plan.hpp): the split-K choice of the
// decode-attention kernels, checked against hand-computed plans (H200: 132 SMs, 3 resident CTAs per
// SM for the head_dim-128 pass = 396) and against its definition by brute force.
#include <catch2/catch.hpp>

#include "thinkv/kernels/launch_plan.hpp"

using thinkv::kernels::plan_decode_splits;

namespace {

// Efficiency of s splits as a double, the definition the plan implements.
double efficiency(int hkv, long long resident, int s) {
  const double waves = static_cast<double>(hkv) * s / static_cast<double>(resident);
  const double full = static_cast<double>((static_cast<long long>(hkv) * s + resident - 1) / resident);
  return waves / full;
}

}  // namespace

TEST_CASE("plan_decode_splits fills whole waves: hand-computed H200 plans", "[launch_plan]") {
  // Llama-3-8B, batch 1 (8 KV heads): 45 x 8 = 360 of 396 resident CTAs = 0.91 of one wave
  // (the GPU test prints splits=45 for this shape).
  CHECK(plan_decode_splits(8, 396, 256) == 45);
  // Batch 32 (256 KV heads): 1 split = 0.65 wave, 2 = 1.29 waves (0.65), 3 = 1.94 waves (0.97).
  CHECK(plan_decode_splits(256, 396, 256) == 3);
  // Batch 64 (512): 1.29 / 2.59 / 3.88 waves -> 3.
  CHECK(plan_decode_splits(512, 396, 256) == 3);
  // Batch 256 (2048): 5.17 waves (0.86) -> 2 splits = 10.3 waves (0.94).
  CHECK(plan_decode_splits(2048, 396, 256) == 2);
  // One CTA more than a wave needs 9 splits to bring the tail to 90%.
  CHECK(plan_decode_splits(397, 396, 256) == 9);
  // Exactly one wave.
  CHECK(plan_decode_splits(396, 396, 256) == 1);
  // The split counts the H200 run of test_paged_attention printed (2026-11-30; resident CTAs per
  // SM of the main pass: 4 at head_dim 64, 3 at 128, 2 at 256, 5 for the head_dim-8 pass at G = 2).
  CHECK(plan_decode_splits(8, 2 * 132, 256) == 30);    // D = 256, 8 KV heads
  CHECK(plan_decode_splits(4, 4 * 132, 256) == 119);   // D = 64, 4 KV heads
  CHECK(plan_decode_splits(2, 4 * 132, 256) == 238);   // D = 64, 2 KV heads
  CHECK(plan_decode_splits(2, 3 * 132, 256) == 179);   // D = 128, 2 KV heads
  CHECK(plan_decode_splits(1, 3 * 132, 256) == 256);   // D = 128, 1 KV head: capped
  CHECK(plan_decode_splits(4, 5 * 132, 256) == 149);   // stories260K, 4 KV heads
}

TEST_CASE("plan_decode_splits: the fewest splits reaching 90%, else the best, within bounds", "[launch_plan]") {
  // A single KV head on a huge device never reaches 90% within 256 splits: the most efficient is
  // the largest.
  CHECK(plan_decode_splits(1, 100000, 256) == 256);
  CHECK(plan_decode_splits(1, 100000, 7) == 7);
  // Degenerate inputs are clamped, never 0 or negative.
  CHECK(plan_decode_splits(0, 396, 256) >= 1);
  CHECK(plan_decode_splits(8, 0, 256) == 1);
  CHECK(plan_decode_splits(8, 396, 0) == 1);
  // Brute force over a grid of shapes: the result is the first s with efficiency >= 0.9, and if
  // none, one of maximal efficiency (compared with a small tolerance for the double arithmetic).
  for (int hkv : {1, 2, 3, 7, 8, 24, 64, 100, 255, 256, 257, 512, 1000, 2048, 4096}) {
    for (long long resident : {1LL, 7LL, 132LL, 264LL, 396LL, 528LL, 1056LL}) {
      for (int smax : {1, 2, 16, 256}) {
        const int s = plan_decode_splits(hkv, resident, smax);
        INFO("hkv " << hkv << " resident " << resident << " max " << smax << " -> " << s);
        REQUIRE(s >= 1);
        REQUIRE(s <= smax);
        int first = 0;
        double best = 0.0;
        for (int k = 1; k <= smax; ++k) {
          const double e = efficiency(hkv, resident, k);
          if (first == 0 && e >= 0.9 - 1e-12) first = k;
          if (e > best) best = e;
        }
        if (first != 0) {
          CHECK(s == first);
        } else {
          CHECK(efficiency(hkv, resident, s) >= best - 1e-12);
        }
      }
    }
  }
}
