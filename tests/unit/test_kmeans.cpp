// K-means retention: against an independent brute-force implementation of the documented
// algorithm, on planted clusters, and for the set properties (subset, size, distinct, determinism).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "thinkv/tbe/kmeans.hpp"

#include "test_util.hpp"

namespace {

// Brute force, written from the spec in kmeans.hpp's comment, sharing no code with it except the
// generator: full distance matrices, explicit argmins.
std::vector<int> reference_select(const std::vector<float>& x, int n, int d, int k, std::uint64_t seed, int iters) {
  if (k >= n) {
    std::vector<int> all(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = i;
    return all;
  }
  auto dist = [&](const float* a, const float* b) {
    float s = 0.0f;
    for (int c = 0; c < d; ++c) s += (a[c] - b[c]) * (a[c] - b[c]);
    return s;
  };
  std::uint64_t st = seed;
  std::vector<std::vector<float>> cent;
  std::vector<int> chosen;
  chosen.push_back(static_cast<int>(thinkv::splitmix64(st) % static_cast<std::uint64_t>(n)));
  cent.emplace_back(x.begin() + chosen[0] * d, x.begin() + (chosen[0] + 1) * d);
  while (static_cast<int>(cent.size()) < k) {
    std::vector<float> dd(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      float m = std::numeric_limits<float>::infinity();
      for (const auto& c : cent) m = std::min(m, dist(&x[static_cast<std::size_t>(i * d)], c.data()));
      dd[static_cast<std::size_t>(i)] = m;
    }
    float total = 0.0f;
    for (float v : dd) total += v;
    int pick = -1;
    if (total > 0.0f) {
      const float target = static_cast<float>(thinkv::splitmix64(st) >> 40) * 0x1p-24f * total;
      float run = 0.0f;
      for (int i = 0; i < n && pick < 0; ++i) {
        run += dd[static_cast<std::size_t>(i)];
        if (run > target && std::find(chosen.begin(), chosen.end(), i) == chosen.end()) pick = i;
      }
    }
    for (int i = 0; i < n && pick < 0; ++i) {
      if (std::find(chosen.begin(), chosen.end(), i) == chosen.end()) pick = i;
    }
    chosen.push_back(pick);
    cent.emplace_back(x.begin() + pick * d, x.begin() + (pick + 1) * d);
  }
  std::vector<int> assign(static_cast<std::size_t>(n), -1);
  for (int it = 0; it < iters; ++it) {
    std::vector<int> next(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      std::vector<float> row;
      for (const auto& c : cent) row.push_back(dist(&x[static_cast<std::size_t>(i * d)], c.data()));
      next[static_cast<std::size_t>(i)] = static_cast<int>(std::min_element(row.begin(), row.end()) - row.begin());
    }
    if (next == assign) break;
    assign = next;
    for (int c = 0; c < k; ++c) {
      std::vector<float> sum(static_cast<std::size_t>(d), 0.0f);
      int cnt = 0;
      for (int i = 0; i < n; ++i) {
        if (assign[static_cast<std::size_t>(i)] != c) continue;
        ++cnt;
        for (int j = 0; j < d; ++j) sum[static_cast<std::size_t>(j)] += x[static_cast<std::size_t>(i * d + j)];
      }
      if (cnt == 0) continue;
      for (int j = 0; j < d; ++j)
        cent[static_cast<std::size_t>(c)][static_cast<std::size_t>(j)] =
            sum[static_cast<std::size_t>(j)] / static_cast<float>(cnt);
    }
  }
  std::vector<int> kept;
  for (int c = 0; c < k; ++c) {
    int best = -1;
    float bd = 0;
    for (int i = 0; i < n; ++i) {
      if (std::find(kept.begin(), kept.end(), i) != kept.end()) continue;
      const float di = dist(&x[static_cast<std::size_t>(i * d)], cent[static_cast<std::size_t>(c)].data());
      if (best < 0 || di < bd) {
        best = i;
        bd = di;
      }
    }
    kept.push_back(best);
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}
}  // namespace

TEST_CASE("K-means selection equals the brute-force reference on small segments", "[kmeans]") {
  const unsigned seed = static_cast<unsigned>(tt::base_seed());
  INFO("seed " << seed << " (THINKV_TEST_SEED to repeat)");
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 60);
    const int d = 1 + static_cast<int>(rng() % 16);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(n + 2));
    std::vector<float> x(static_cast<std::size_t>(n * d));
    for (auto& v : x) v = normal(rng);
    if (trial % 10 == 0) {  // duplicates: zero distances in the init
      for (int i = 1; i < n; i += 2) std::copy_n(x.begin(), d, x.begin() + i * d);
    }
    thinkv::KmeansOptions opt;
    opt.seed = (static_cast<std::uint64_t>(rng()) << 32) | rng();
    const auto got = thinkv::kmeans_select(x.data(), n, d, k, opt);
    const auto want = reference_select(x, n, d, k, opt.seed, opt.max_iterations);
    INFO("trial " << trial << " n " << n << " d " << d << " k " << k);
    REQUIRE(got == want);
    // set properties
    CHECK(static_cast<int>(got.size()) == std::min(k, n));
    CHECK(std::set<int>(got.begin(), got.end()).size() == got.size());
    CHECK(std::is_sorted(got.begin(), got.end()));
    for (int i : got) CHECK((i >= 0 && i < n));
    // deterministic for a seed
    CHECK(thinkv::kmeans_select(x.data(), n, d, k, opt) == got);
  }
}

TEST_CASE("K-means keeps one token per planted cluster, the one nearest its mean", "[kmeans]") {
  const unsigned seed = static_cast<unsigned>(tt::base_seed());
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int k = 8, per = 16, d = 32, n = k * per;  // a 128-token segment shrinking to 8
  std::vector<float> x(static_cast<std::size_t>(n * d));
  std::vector<int> cluster(static_cast<std::size_t>(n));
  std::vector<std::vector<float>> centre(k, std::vector<float>(d));
  for (auto& c : centre)
    for (auto& v : c) v = normal(rng) * 100.0f;
  // Shuffle membership so clusters are not contiguous in token order.
  std::vector<int> perm(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) perm[static_cast<std::size_t>(i)] = i % k;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int i = 0; i < n; ++i) {
    cluster[static_cast<std::size_t>(i)] = perm[static_cast<std::size_t>(i)];
    for (int j = 0; j < d; ++j) {
      x[static_cast<std::size_t>(i * d + j)] =
          centre[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])][static_cast<std::size_t>(j)] +
          normal(rng);
    }
  }
  const auto kept = thinkv::kmeans_select(x.data(), n, d, k);
  REQUIRE(kept.size() == static_cast<std::size_t>(k));
  std::set<int> seen;
  for (int i : kept) seen.insert(cluster[static_cast<std::size_t>(i)]);
  CHECK(seen.size() == static_cast<std::size_t>(k));
  // Each kept token is its cluster's medoid-by-mean (brute force in float64).
  for (int i : kept) {
    const int c = cluster[static_cast<std::size_t>(i)];
    std::vector<double> mean(static_cast<std::size_t>(d), 0.0);
    for (int t = 0; t < n; ++t) {
      if (cluster[static_cast<std::size_t>(t)] != c) continue;
      for (int j = 0; j < d; ++j) mean[static_cast<std::size_t>(j)] += x[static_cast<std::size_t>(t * d + j)] / per;
    }
    int best = -1;
    double bd = 0;
    for (int t = 0; t < n; ++t) {
      if (cluster[static_cast<std::size_t>(t)] != c) continue;
      double s = 0;
      for (int j = 0; j < d; ++j)
        s += std::pow(x[static_cast<std::size_t>(t * d + j)] - mean[static_cast<std::size_t>(j)], 2);
      if (best < 0 || s < bd) {
        best = t;
        bd = s;
      }
    }
    CHECK(i == best);
  }
}

TEST_CASE("K-means with K >= n keeps everything, and K = 0 keeps nothing", "[kmeans]") {
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  CHECK(thinkv::kmeans_select(x.data(), 3, 2, 3) == std::vector<int>{0, 1, 2});
  CHECK(thinkv::kmeans_select(x.data(), 3, 2, 7) == std::vector<int>{0, 1, 2});
  CHECK(thinkv::kmeans_select(x.data(), 3, 2, 0).empty());
}
