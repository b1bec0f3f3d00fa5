// K-means' FP32 sums under a caller's FMA flags. This file is compiled with -mfma and
// -ffp-contract=fast (tests/CMakeLists.txt), flags a downstream runtime may build with. The GPU
// kernel reproduces kmeans_select's decisions only if every product and sum is rounded on its
// own. thinkv/tbe/kmeans.hpp turns contraction off for its own functions; without that, GCC and
// Clang fuse t * t + P_j into an FMA here and the distances below differ from the reference.

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "thinkv/tbe/kmeans.hpp"

#include "../test_util.hpp"

namespace {

// The documented distance with every operation forced through memory (volatile): no
// contraction can apply whatever the flags.
float reference_distance(const float* a, const float* b, int d) {
  volatile float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int c = 0; c < d; ++c) {
    volatile float t = a[c] - b[c];
    volatile float sq = t * t;
    part[c % 8] = part[c % 8] + sq;
  }
  volatile float lo1 = part[0] + part[4];
  volatile float lo2 = part[2] + part[6];
  volatile float hi1 = part[1] + part[5];
  volatile float hi2 = part[3] + part[7];
  volatile float lo = lo1 + lo2;
  volatile float hi = hi1 + hi2;
  return lo + hi;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

bool cpu_has_fma() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace

TEST_CASE("K-means' distances are rounded step by step under -mfma -ffp-contract=fast", "[kmeans]") {
  if (!cpu_has_fma()) {
    std::printf("SKIPPED: this CPU has no FMA instructions, so nothing could be contracted here\n");
    return;
  }
  const auto seed = tt::base_seed();
  INFO("seed " << seed << " (THINKV_TEST_SEED to repeat)");
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  int differ = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int d = 1 + static_cast<int>(rng() % 256);
    std::vector<float> a(static_cast<std::size_t>(d)), b(static_cast<std::size_t>(d));
    for (auto& v : a) v = normal(rng);
    for (auto& v : b) v = normal(rng);
    const float got = thinkv::squared_distance(a.data(), b.data(), d);
    const float want = reference_distance(a.data(), b.data(), d);
    if (!same_bits(got, want)) ++differ;
  }
  CHECK(differ == 0);
}
