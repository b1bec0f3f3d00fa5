// K-means retention: against an independent brute-force implementation of the documented
// algorithm, on planted clusters, and for the set properties (subset, size, distinct, determinism).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "thinkv/tbe/kmeans.hpp"

#include "test_util.hpp"

namespace {

// Distance: eight partial sums over channels c = j mod 8, then ((0+4)+(2+6))+((1+5)+(3+7)).
float reference_distance(const float* a, const float* b, int d) {
  std::vector<float> part(8, 0.0f);
  for (int c = 0; c < d; ++c) {
    volatile float t = a[c] - b[c];  // volatile: each operation rounded on its own
    volatile float sq = t * t;
    part[static_cast<std::size_t>(c % 8)] = part[static_cast<std::size_t>(c % 8)] + sq;
  }
  const float lo = (part[0] + part[4]) + (part[2] + part[6]);
  const float hi = (part[1] + part[5]) + (part[3] + part[7]);
  return lo + hi;
}

// k-means++ prefix sums: tiles of 128 points, lanes of 4; in-lane running sums, a Hillis-Steele
// inclusive scan of the 32 lane sums (double-buffered), tile bases chained.
std::vector<float> reference_prefix_sums(const std::vector<float>& v) {
  const int m = static_cast<int>(v.size());
  std::vector<float> r(v.size());
  float tile_base = 0.0f;
  for (int w = 0; w * 128 < m; ++w) {
    auto val = [&](int i) { return i < m ? v[static_cast<std::size_t>(i)] : 0.0f; };
    std::vector<float> lane_sum(32);
    for (int l = 0; l < 32; ++l) {
      const int b = 128 * w + 4 * l;
      lane_sum[static_cast<std::size_t>(l)] = ((val(b) + val(b + 1)) + val(b + 2)) + val(b + 3);
    }
    std::vector<float> cur = lane_sum;
    for (int off = 1; off < 32; off *= 2) {
      std::vector<float> nxt = cur;
      for (int l = off; l < 32; ++l)
        nxt[static_cast<std::size_t>(l)] = cur[static_cast<std::size_t>(l - off)] + cur[static_cast<std::size_t>(l)];
      cur = nxt;
    }
    for (int l = 0; l < 32; ++l) {
      const float before = tile_base + (l == 0 ? 0.0f : cur[static_cast<std::size_t>(l - 1)]);
      float in_lane = 0.0f;
      for (int q = 0; q < 4; ++q) {
        const int i = 128 * w + 4 * l + q;
        in_lane = in_lane + val(i);
        if (i < m) r[static_cast<std::size_t>(i)] = before + in_lane;
      }
    }
    tile_base = tile_base + cur[31];
  }
  return r;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Brute force, written from the spec in kmeans.hpp's comment, sharing no code with it except the
// generator: full distance matrices, explicit argmins.
std::vector<int> reference_select(const std::vector<float>& x, int n, int d, int k, std::uint64_t seed, int iters) {
  if (k >= n) {
    std::vector<int> all(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = i;
    return all;
  }
  auto dist = [&](const float* a, const float* b) { return reference_distance(a, b, d); };
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
    const std::vector<float> run = reference_prefix_sums(dd);
    const float total = run.back();
    int pick = -1;
    if (total > 0.0f) {
      const float target = static_cast<float>(thinkv::splitmix64(st) >> 40) * 0x1p-24f * total;
      for (int i = 0; i < n && pick < 0; ++i) {
        if (run[static_cast<std::size_t>(i)] > target && std::find(chosen.begin(), chosen.end(), i) == chosen.end())
          pick = i;
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
    // Mostly small segments; every 7th beyond one 128-point tile of the prefix sums, every 5th
    // with a head_dim-like width (several rounds of the eight partial sums).
    const int n = trial % 7 == 3 ? 129 + static_cast<int>(rng() % 200) : 2 + static_cast<int>(rng() % 60);
    const int d = trial % 5 == 1 ? 8 * (2 + static_cast<int>(rng() % 15)) : 1 + static_cast<int>(rng() % 16);
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

TEST_CASE("K-means' two FP32 sums follow the documented order bit for bit", "[kmeans]") {
  // The GPU kernel reproduces these orders; a change to either must fail here, not only when a
  // rounding difference happens to move a pick. Magnitudes spread over 2^-20 .. 2^20 so that
  // different orders round differently.
  const auto seed = tt::base_seed();
  INFO("seed " << seed << " (THINKV_TEST_SEED to repeat)");
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> expo(-20, 20);
  int distances = 0, prefixes = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int d = 1 + static_cast<int>(rng() % 260);
    std::vector<float> a(static_cast<std::size_t>(d)), b(static_cast<std::size_t>(d));
    for (auto& v : a) v = std::ldexp(normal(rng), expo(rng));
    for (auto& v : b) v = std::ldexp(normal(rng), expo(rng));
    const float got = thinkv::squared_distance(a.data(), b.data(), d);
    INFO("distance trial " << trial << " d " << d);
    REQUIRE(same_bits(got, reference_distance(a.data(), b.data(), d)));
    ++distances;

    const int n = 1 + static_cast<int>(rng() % 400);  // up to four 128-point tiles
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = std::ldexp(std::abs(normal(rng)), expo(rng));
    if (trial % 9 == 0) v[static_cast<std::size_t>(rng() % static_cast<unsigned>(n))] = 0.0f;
    std::vector<float> r(static_cast<std::size_t>(n), -1.0f);
    thinkv::kmeanspp_prefix_sums(v.data(), n, r.data());
    const auto want = reference_prefix_sums(v);
    for (int i = 0; i < n; ++i) {
      INFO("prefix trial " << trial << " n " << n << " i " << i);
      REQUIRE(same_bits(r[static_cast<std::size_t>(i)], want[static_cast<std::size_t>(i)]));
    }
    ++prefixes;
  }
  CHECK(distances == 400);
  CHECK(prefixes == 400);
}
