// plan_decode_splits (include/thinkv/kernels/launch_plan.hpp): the split-K choice of the
// decode-attention kernels, checked against hand-computed plans (H200: 132 SMs, 3 resident CTAs per
// SM for the head_dim-128 pass = 396) and against its definition by brute force.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "thinkv/kernels/launch_plan.hpp"

using thinkv::kernels::plan_decode_splits;
using thinkv::kernels::plan_decode_splits_for_length;

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
  CHECK(plan_decode_splits(8, 2 * 132, 256) == 30);   // D = 256, 8 KV heads
  CHECK(plan_decode_splits(4, 4 * 132, 256) == 119);  // D = 64, 4 KV heads
  CHECK(plan_decode_splits(2, 4 * 132, 256) == 238);  // D = 64, 2 KV heads
  CHECK(plan_decode_splits(2, 3 * 132, 256) == 179);  // D = 128, 2 KV heads
  CHECK(plan_decode_splits(1, 3 * 132, 256) == 256);  // D = 128, 1 KV head: capped
  CHECK(plan_decode_splits(4, 5 * 132, 256) == 149);  // stories260K, 4 KV heads
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

TEST_CASE("plan_decode_splits_for_length: waves x (start-up + chunk), hand-computed H200 plans", "[launch_plan]") {
  // Costs in half-pieces, ceil(Hkv s / 396) x (12 + 2 ceil(pieces / s)) (start-up 12).
  REQUIRE(thinkv::kernels::kSplitStartupHalfPieces == 12);
  // The 32-layer step's layer: batch 64 (512 KV heads), 1,024 positions = 8 pieces of 128:
  // s = 1: 2 x 28 = 56, s = 2: 3 x 20 = 60, s = 3: 4 x 18 = 72, s = 4: 6 x 16 = 96 -> 1 (the
  // waves-only plan says 3). Measured on an H100: 1 split 4-8% faster than 2.
  CHECK(plan_decode_splits_for_length(512, 396, 256, 1024, 128) == 1);
  CHECK(plan_decode_splits(512, 396, 256) == 3);
  // Batch 64 x 512 positions (4 pieces): s = 1: 2 x 20 = 40, s = 2: 3 x 16 = 48 -> 1.
  CHECK(plan_decode_splits_for_length(512, 396, 256, 512, 128) == 1);
  // Batch 64 x 2,048 (16 pieces): s = 1: 2 x 44 = 88, s = 2: 3 x 28 = 84 (88 > 84 x 33/32) -> 2.
  CHECK(plan_decode_splits_for_length(512, 396, 256, 2048, 128) == 2);
  // Batch 32 x 4,096 (32 pieces): s = 1: 76, s = 2: 2 x 44 = 88, s = 3: 2 x 34 = 68, s = 4: 3 x 28
  // = 84 -> 3, the same as the waves-only plan; likewise batch 32 x 32K (256 pieces: s = 3: 2 x 184
  // = 368, s = 6: 4 x 98 = 392, s = 1: 524).
  CHECK(plan_decode_splits_for_length(256, 396, 256, 4096, 128) == 3);
  CHECK(plan_decode_splits_for_length(256, 396, 256, 32768, 128) == 3);
  // Batch 1 x 512 (8 KV heads, 4 pieces): one wave at any s <= 4: 20, 16, 16, 14 -> 4 chunks of
  // one piece (the waves-only plan cuts 45 chunks, 41 of them empty).
  CHECK(plan_decode_splits_for_length(8, 396, 256, 512, 128) == 4);
  CHECK(plan_decode_splits(8, 396, 256) == 45);
  // Batch 1 x 32K: one wave up to s = 49; ceil(256 / s) = 6 from s = 43 on -> 43.
  CHECK(plan_decode_splits_for_length(8, 396, 256, 32768, 128) == 43);
  // Batch 256 x 8,192 positions (64 pieces): s = 1: 6 x 140 = 840, s = 2: 11 x 76 = 836, s = 3:
  // 16 x 56 = 896, s = 4: 21 x 44 = 924: 1 is within 1/32 of the least -> 1.
  CHECK(plan_decode_splits_for_length(2048, 396, 256, 8192, 128) == 1);
  // Batch 256 x 512 (2,048 KV heads, 4 pieces): s = 1: 6 x 20 = 120, s = 2: 11 x 16 = 176 -> 1.
  CHECK(plan_decode_splits_for_length(2048, 396, 256, 512, 128) == 1);
  // A partial last piece counts as a piece; one position is one piece and one split.
  CHECK(plan_decode_splits_for_length(256, 396, 256, 4097, 128) ==
        plan_decode_splits_for_length(256, 396, 256, 4224, 128));
  CHECK(plan_decode_splits_for_length(512, 396, 256, 1, 128) == 1);
  // With the merge term (one chunk skips the merge kernel: + 2 half-pieces for s > 1): batch 64 x
  // 2,048 positions: s = 1: 88, s = 2: 84 + 2 = 86 (88 <= 86 x 33/32) -> 1 where it was 2; the
  // step's layer keeps 1; batch 1 x 512 keeps 4 (s = 1: 20, s = 4: 14 + 2 = 16, s = 2 and 3: 18).
  using thinkv::kernels::kSplitMergeHalfPieces;
  REQUIRE(kSplitMergeHalfPieces == 2);
  CHECK(plan_decode_splits_for_length(512, 396, 256, 2048, 128, kSplitMergeHalfPieces) == 1);
  CHECK(plan_decode_splits_for_length(512, 396, 256, 1024, 128, kSplitMergeHalfPieces) == 1);
  CHECK(plan_decode_splits_for_length(8, 396, 256, 512, 128, kSplitMergeHalfPieces) == 4);
  CHECK(plan_decode_splits_for_length(256, 396, 256, 4096, 128, kSplitMergeHalfPieces) == 3);
  // Unknown length (0 or negative): the waves-only plan.
  CHECK(plan_decode_splits_for_length(512, 396, 256, 0, 128) == plan_decode_splits(512, 396, 256));
  CHECK(plan_decode_splits_for_length(8, 396, 256, -5, 128) == plan_decode_splits(8, 396, 256));
}

TEST_CASE("plan_decode_splits_for_length: the cheapest plan by brute force, within bounds", "[launch_plan]") {
  // The definition in doubles: cost(s) = ceil(H s / R) (start-up / 2 + ceil(pieces / s)) + (s > 1 ? merge / 2 : 0)
  // over s = 1..min(max, pieces); the plan is the fewest splits within 1/32 of the least cost.
  auto check = [](int hkv, long long resident, int smax, long long positions, long long merge) {
    const int s = plan_decode_splits_for_length(hkv, resident, smax, positions, 128, merge);
    INFO("hkv " << hkv << " resident " << resident << " max " << smax << " positions " << positions << " merge "
                << merge << " -> " << s);
    const long long pieces = (positions + 127) / 128;
    REQUIRE(s >= 1);
    REQUIRE(s <= smax);
    REQUIRE(s <= pieces);
    auto cost = [&](long long k) {
      const double waves = std::ceil(static_cast<double>(hkv) * static_cast<double>(k) / static_cast<double>(resident));
      return waves * (static_cast<double>(thinkv::kernels::kSplitStartupHalfPieces) / 2.0 +
                      std::ceil(static_cast<double>(pieces) / static_cast<double>(k))) +
             (k > 1 ? static_cast<double>(merge) / 2.0 : 0.0);
    };
    const long long top = std::min<long long>(smax, pieces);
    double least = cost(1);
    for (long long k = 2; k <= top; ++k) least = std::min(least, cost(k));
    CHECK(cost(s) <= least * 33.0 / 32.0 + 1e-9);                                   // within 1/32 of the least
    for (long long k = 1; k < s; ++k) CHECK(cost(k) > least * 33.0 / 32.0 - 1e-9);  // the fewest such
  };
  for (int hkv : {1, 8, 64, 255, 512, 2048}) {
    for (long long resident : {1LL, 132LL, 396LL, 528LL}) {
      for (int smax : {1, 3, 256}) {
        for (long long positions : {1LL, 127LL, 128LL, 129LL, 512LL, 1024LL, 5000LL, 32768LL, 131072LL}) {
          for (long long merge : {0LL, 2LL, 7LL}) check(hkv, resident, smax, positions, merge);
        }
      }
    }
  }
}
