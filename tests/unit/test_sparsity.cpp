// The sparsity signal of the CPU reference attention against a direct float64 count.
// Inputs are drawn on grids on which every score is exact in both FP32 and float64, so the two
// counts must agree exactly, ties at the threshold included.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "thinkv/paged/paged_kv_cache.hpp"
#include "thinkv/reference/attention.hpp"

#include "test_util.hpp"

namespace {


// Count of j with (s_j - m) < ln(0.01)_f32 in float64, from float64 scores.
double count_sparse_f64(const std::vector<double>& scores) {
  double m = -INFINITY;
  for (double s : scores) m = std::max(m, s);
  int below = 0;
  for (double s : scores) below += (s - m) < static_cast<double>(thinkv::kSparsityLogThreshold);
  return static_cast<double>(below) / static_cast<double>(scores.size());
}

}  // namespace

TEST_CASE("sparsity threshold constant is ln(0.01) rounded to FP32", "[sparsity]") {
  CHECK(thinkv::kSparsityLogThreshold == static_cast<float>(std::log(0.01)));
}

TEST_CASE("sparsity counts ties at the threshold as not sparse", "[sparsity]") {
  const float thr = thinkv::kSparsityLogThreshold;
  // q = e0, so s_j = k_j[0] exactly; the max token has score 0, so d_j = s_j exactly.
  const int d = 4;
  const std::vector<float> s = {0.0f, thr, std::nextafter(thr, -INFINITY),
                                std::nextafter(thr, INFINITY), -30.0f, -1.0f};
  std::vector<float> q(d, 0.0f), k(s.size() * d, 0.0f), v(s.size() * d, 1.0f);
  q[0] = 1.0f;
  for (std::size_t j = 0; j < s.size(); ++j) {
    k[j * d] = s[j];
    k[j * d + 1] = 7.0f;  // ignored by q, must not matter
  }
  std::vector<float> out(d), sp(1, NAN);
  thinkv::reference::attend_tokens(q.data(), 1, k.data(), v.data(), static_cast<int>(s.size()), d,
                                   1.0f, out.data(), sp.data());
  // sparse: nextafter(thr, -inf) and -30 -> 2 of 6; thr itself (tie) and nextafter(thr, +inf) not.
  CHECK(sp[0] == Approx(2.0 / 6.0).margin(0));
  CHECK(sp[0] == static_cast<float>(2.0 / 6.0));
}

TEST_CASE("reference attention sparsity equals a float64 count on random exact-score inputs",
          "[sparsity]") {
  const unsigned seed = static_cast<unsigned>(tt::base_seed());
  INFO("seed " << seed << " (THINKV_TEST_SEED to repeat)");
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> grid(-16, 16);  // values k/8 in [-2, 2]
  for (int trial = 0; trial < 200; ++trial) {
    const int d = 16;
    const int n = 1 + static_cast<int>(rng() % 300);
    const int n_q = 1 + static_cast<int>(rng() % 4);
    const float scale = (trial % 2) ? 1.0f : 0.25f;  // powers of two keep the scores exact
    std::vector<float> q(static_cast<std::size_t>(n_q) * d), k(static_cast<std::size_t>(n) * d),
        v(k.size());
    for (auto& x : q) x = static_cast<float>(grid(rng)) / 8.0f;
    for (auto& x : k) x = static_cast<float>(grid(rng)) / 8.0f;
    for (auto& x : v) x = static_cast<float>(grid(rng)) / 8.0f;
    std::vector<float> out(q.size()), sp(static_cast<std::size_t>(n_q), NAN);
    thinkv::reference::attend_tokens(q.data(), n_q, k.data(), v.data(), n, d, scale, out.data(),
                                     sp.data());
    for (int h = 0; h < n_q; ++h) {
      std::vector<double> scores(static_cast<std::size_t>(n));
      for (int j = 0; j < n; ++j) {
        double acc = 0;
        for (int c = 0; c < d; ++c) {
          acc += static_cast<double>(q[static_cast<std::size_t>(h * d + c)]) *
                 static_cast<double>(k[static_cast<std::size_t>(j * d + c)]);
        }
        scores[static_cast<std::size_t>(j)] = acc * scale;
      }
      INFO("trial " << trial << " head " << h << " n " << n);
      CHECK(sp[static_cast<std::size_t>(h)] == static_cast<float>(count_sparse_f64(scores)));
    }
  }
}

TEST_CASE("cache attention emits per-head sparsity over exactly the live and staged tokens",
          "[sparsity]") {
  const unsigned seed = static_cast<unsigned>(tt::base_seed());
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> grid(-16, 16);
  thinkv::CacheConfig cfg;
  cfg.num_streams = 2;
  cfg.head_dim = 16;
  cfg.group_size = 8;
  cfg.block_size = 16;
  cfg.precision = thinkv::kFullKvMap;  // BF16 pages: grid values k/8 are stored exactly
  cfg.pool_blocks[static_cast<int>(thinkv::Precision::kBf16)] = 64;
  thinkv::PagedKvCache<> cache(cfg);
  const int d = cfg.head_dim;
  std::vector<std::vector<float>> keys(2);  // per stream, by position
  for (int t = 0; t < 203; ++t) {
    for (int s = 0; s < 2; ++s) {
      std::vector<float> k(static_cast<std::size_t>(d)), v(static_cast<std::size_t>(d));
      for (auto& x : k) x = static_cast<float>(grid(rng)) / 8.0f;
      for (auto& x : v) x = static_cast<float>(grid(rng)) / 8.0f;
      keys[static_cast<std::size_t>(s)].insert(keys[static_cast<std::size_t>(s)].end(), k.begin(), k.end());
      REQUIRE(cache.append(s, k, v, thinkv::ThoughtType::kReasoning).is_ok());
    }
  }
  // Evict a random third of stream 1's slots: they must leave numerator and denominator.
  std::vector<thinkv::SlotRef> victims;
  for (auto r : cache.table().live_slot_list(1)) {
    if (rng() % 3 == 0) victims.push_back(r);
  }
  REQUIRE(cache.evict(1, victims).is_ok());
  const int n_q = 6;  // 3 query heads per KV head
  std::vector<float> q(static_cast<std::size_t>(n_q) * d), out(q.size()), sp(n_q, NAN);
  for (auto& x : q) x = static_cast<float>(grid(rng)) / 8.0f;
  const std::int32_t streams[2] = {1, 0};  // KV head 0 -> stream 1, KV head 1 -> stream 0
  thinkv::DecodeAttentionArgs a;
  a.num_q_heads = n_q;
  a.num_kv_heads = 2;
  a.kv_streams = streams;
  a.q = q.data();
  a.out = out.data();
  a.softmax_scale = 0.25f;
  a.sparsity = sp.data();
  REQUIRE(cache.attend(a).is_ok());
  for (int h = 0; h < n_q; ++h) {
    const int s = streams[h / 3];
    std::vector<int> positions;
    for (auto r : cache.table().live_slot_list(s)) positions.push_back(cache.table().slot_position(r));
    for (int r = 0; r < cache.table().staged_count(s); ++r) positions.push_back(cache.table().staged_position(s, r));
    std::vector<double> scores;
    for (int pos : positions) {
      double acc = 0;
      for (int c = 0; c < d; ++c) {
        acc += static_cast<double>(q[static_cast<std::size_t>(h * d + c)]) *
               keys[static_cast<std::size_t>(s)][static_cast<std::size_t>(pos * d + c)];
      }
      scores.push_back(acc * 0.25);
    }
    INFO("head " << h << " stream " << s << " tokens " << scores.size());
    CHECK(sp[static_cast<std::size_t>(h)] == static_cast<float>(count_sparse_f64(scores)));
  }
  // Without a sparsity pointer the call still works and writes no sparsity.
  std::vector<float> sp2(n_q, -7.0f);
  a.sparsity = nullptr;
  REQUIRE(cache.attend(a).is_ok());
  CHECK(sp2[0] == -7.0f);
}
