/// \file test_attention.cpp
/// Decode attention: reference::attend_tokens and PagedKvCache::attend against a float64
/// attention computed here over the tokens the test's own model says are live (dequantized by the
/// model, staged tokens BF16-rounded), with GQA, arbitrary stream mapping, evictions and reuse.
///
/// Tolerance. Every comparison uses tt::attention_error_bound (test_util.hpp), a forward error
/// bound of the FP32 algorithm of design.md derived from its operations: score error
/// E = scale * sum_c |q_c k_jc| * (gamma_d + 3u), weights perturbed by at most exp(2E) - 1 plus a
/// few u, two sums of n terms (gamma_n) and a division, all times max|v| (doubled for margin).
/// For moderate scores (|s| up to ~10) and n <= a few thousand that is ~1e-5 * max|v|; the tests
/// also assert the simple stated tolerance |out - exact| <= 1e-4 * max|v| there. The measured
/// errors are printed (typically 1e-7 .. 1e-6 of max|v|, i.e. 1-3 orders below the bound).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;
using tt::chance;
using tt::CtModel;
using tt::Diff;
using tt::uniform_int;

namespace {

constexpr ThoughtType R = ThoughtType::kReasoning;
constexpr ThoughtType E = ThoughtType::kExecution;

CacheConfig cache_config(PrecisionMap map, int d, int g, int bs, int streams, int blocks_per_pool) {
  CacheConfig c;
  c.num_streams = streams;
  c.head_dim = d;
  c.group_size = g;
  c.block_size = bs;
  c.precision = map;
  for (Precision p : kAllPrecisions) c.pool_blocks[static_cast<int>(p)] = map.uses(p) ? blocks_per_pool : 0;
  return c;
}

const PrecisionMap kMaps[] = {kR4E4T2, kR8E4T2, kR8E8T4, kFullKvMap};

/// Largest errors seen, printed at the end of a test.
struct ErrorStats {
  double max_over_bound = 0;  // max |err| / bound
  double max_rel = 0;         // max |err| / max|v|
  long compared = 0;
  void print(const char* what) const {
    std::printf("%s: %ld outputs, max |err|/max|v| = %.3g, max |err|/bound = %.3g\n", what, compared, max_rel,
                max_over_bound);
  }
};

/// Compares out[0..d) with float64 attention of q over (k, v); returns the mismatch text or "".
std::string compare_row(const float* out, const float* q, const std::vector<float>& k, const std::vector<float>& v,
                        int d, double scale, ErrorStats& es, bool moderate) {
  const auto want = tt::attend64(q, k, v, d, scale);
  const double bound = tt::attention_error_bound(q, k, v, d, scale);
  double vmax = 0;
  for (float x : v) vmax = std::max(vmax, static_cast<double>(std::fabs(x)));
  for (int c = 0; c < d; ++c) {
    const double err = std::fabs(static_cast<double>(out[c]) - want[static_cast<std::size_t>(c)]);
    es.max_over_bound = std::max(es.max_over_bound, err / bound);
    es.max_rel = std::max(es.max_rel, err / vmax);
    ++es.compared;
    if (!(err <= bound) || (moderate && !(err <= 1e-4 * vmax))) {
      return "channel " + std::to_string(c) + ": got " + std::to_string(out[c]) + ", float64 " +
             std::to_string(want[static_cast<std::size_t>(c)]) + ", err " + std::to_string(err) + ", bound " +
             std::to_string(bound) + ", max|v| " + std::to_string(vmax) + ", tokens " +
             std::to_string(k.size() / static_cast<std::size_t>(d));
    }
  }
  return {};
}

/// Largest |score| of q over k (to tell moderate from large score ranges).
double max_abs_score(const float* q, const std::vector<float>& k, int d, double scale) {
  double m = 0;
  for (std::size_t j = 0; j < k.size() / static_cast<std::size_t>(d); ++j) {
    double s = 0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(q[c]) * k[j * d + c];
    m = std::max(m, std::fabs(s * scale));
  }
  return m;
}

/// Runs cache.attend for the given KV streams and compares every query head with the model.
void check_attend(const PagedKvCache<>& c, const CtModel& m, std::mt19937_64& rng,
                  const std::vector<std::int32_t>& streams, int num_q, float softmax_scale, ErrorStats& es) {
  const int d = m.D;
  const int nkv = static_cast<int>(streams.size());
  std::vector<float> q;
  for (int h = 0; h < num_q; ++h) {
    const auto x = tt::random_row(rng, d, 1.0);
    q.insert(q.end(), x.begin(), x.end());
  }
  std::vector<float> out(static_cast<std::size_t>(num_q) * d, std::numeric_limits<float>::quiet_NaN());
  DecodeAttentionArgs a;
  a.num_q_heads = num_q;
  a.num_kv_heads = nkv;
  a.kv_streams = streams.data();
  a.q = q.data();
  a.out = out.data();
  a.softmax_scale = softmax_scale;
  const Status st = c.attend(a);
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  const double scale = softmax_scale > 0 ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(d));
  const int ratio = num_q / nkv;
  for (int h = 0; h < num_q; ++h) {
    std::vector<float> k, v;
    m.attention_tokens(streams[static_cast<std::size_t>(h / ratio)], k, v);
    const bool moderate = max_abs_score(q.data() + h * d, k, d, scale) < 10;
    const std::string err = compare_row(out.data() + h * d, q.data() + h * d, k, v, d, scale, es, moderate);
    INFO("query head " << h << " -> stream " << streams[static_cast<std::size_t>(h / ratio)] << ": " << err);
    REQUIRE(err.empty());
  }
}

void append_tokens(PagedKvCache<>& c, CtModel& m, std::mt19937_64& rng, int s, ThoughtType th, int count,
                   double magnitude = 0.0, bool outliers = true) {
  Diff d;
  for (int i = 0; i < count; ++i) {
    const auto k = tt::random_row(rng, m.D, magnitude, outliers), v = tt::random_row(rng, m.D, magnitude, outliers);
    REQUIRE(tt::append_both(c, m, s, k, v, th, 0, d).is_ok());
  }
  TT_REQUIRE_OK_DIFF(d);
}

}  // namespace

TEST_CASE("reference::attend_tokens matches float64 attention", "[attention][reference]") {
  TT_SEEDED_RNG();
  ErrorStats moderate_es, large_es;
  for (int n : {1, 2, 7, 100, 1000, 3000}) {
    for (int d : {8, 64, 128}) {
      for (double spread : {1.0, 30.0, 1000.0}) {  // score magnitude: ~1, ~30, ~1000
        CAPTURE(n, d, spread);
        const int nq = uniform_int(rng, 1, 3);
        std::vector<float> q, k, v;
        for (int h = 0; h < nq; ++h) {
          const auto x = tt::random_row(rng, d, spread / std::sqrt(static_cast<double>(d)) * 0.5);
          q.insert(q.end(), x.begin(), x.end());
        }
        for (int j = 0; j < n; ++j) {
          const auto kj = tt::random_row(rng, d, 1.0), vj = tt::random_row(rng, d);
          k.insert(k.end(), kj.begin(), kj.end());
          v.insert(v.end(), vj.begin(), vj.end());
        }
        const bool explicit_scale = chance(rng, 0.5);
        const double scale = explicit_scale ? std::uniform_real_distribution<double>(0.05, 0.5)(rng)
                                            : static_cast<double>(1.0f / std::sqrt(static_cast<float>(d)));
        std::vector<float> out(static_cast<std::size_t>(nq) * d, std::numeric_limits<float>::quiet_NaN());
        reference::attend_tokens(q.data(), nq, k.data(), v.data(), n, d, static_cast<float>(scale), out.data());
        for (int h = 0; h < nq; ++h) {
          const float* qh = q.data() + h * d;
          const bool moderate = max_abs_score(qh, k, d, static_cast<float>(scale)) < 10;
          ErrorStats& es = moderate ? moderate_es : large_es;
          const std::string err = compare_row(out.data() + h * d, qh, k, v, d, static_cast<float>(scale), es, moderate);
          INFO(err);
          REQUIRE(err.empty());
          if (n == 1)  // one token: softmax weight exactly 1, output exactly v
            REQUIRE(std::memcmp(out.data() + h * d, v.data(), sizeof(float) * static_cast<std::size_t>(d)) == 0);
        }
      }
    }
  }
  moderate_es.print("attend_tokens, |scores| < 10");
  large_es.print("attend_tokens, large score ranges");
}

TEST_CASE("reference::attend_tokens: a dominant token and equal scores", "[attention][reference]") {
  TT_SEEDED_RNG();
  const int d = 16, n = 50;
  std::vector<float> k, v;
  for (int j = 0; j < n; ++j) {
    auto kj = tt::random_row(rng, d, 1.0, false);
    const auto vj = tt::random_row(rng, d);
    if (j == 7)
      for (auto& x : kj) x *= 3.0f;
    k.insert(k.end(), kj.begin(), kj.end());
    v.insert(v.end(), vj.begin(), vj.end());
  }
  // q = 100 x k_7: token 7's score exceeds every other by thousands (checked), so every other
  // weight exp(s_j - s_7) underflows to 0 and the output is exactly v_7.
  std::vector<float> q(k.begin() + 7 * d, k.begin() + 8 * d);
  for (auto& x : q) x *= 100.0f;
  for (int j = 0; j < n; ++j) {
    double margin = 0;
    for (int c = 0; c < d; ++c) margin += static_cast<double>(q[c]) * (k[7 * d + c] - k[j * d + c]);
    if (j != 7) REQUIRE(margin > 200);
  }
  std::vector<float> out(d);
  reference::attend_tokens(q.data(), 1, k.data(), v.data(), n, d, 1.0f, out.data());
  for (int c = 0; c < d; ++c) CHECK(out[c] == v[7 * d + c]);
  // q = 0: all scores equal, the output is the mean of v.
  std::vector<float> zero(d, 0.0f);
  reference::attend_tokens(zero.data(), 1, k.data(), v.data(), n, d, 0.25f, out.data());
  for (int c = 0; c < d; ++c) {
    double mean = 0;
    for (int j = 0; j < n; ++j) mean += v[j * d + c];
    mean /= n;
    CHECK(std::fabs(out[c] - mean) <= 1e-5 * (1 + std::fabs(mean)));
  }
}

TEST_CASE("PagedKvCache::attend matches float64 attention over the model's live tokens (GQA)", "[attention][cache]") {
  TT_SEEDED_RNG();
  ErrorStats es;
  for (int round = 0; round < 8; ++round) {
    const PrecisionMap map = kMaps[round % 4];
    const int g = round < 4 ? 16 : 8;
    const int d = g * uniform_int(rng, 1, 8);
    const int bs = uniform_int(rng, 4, 32);
    const int streams = 6;
    CAPTURE(map, g, d, bs);
    PagedKvCache<> c(cache_config(map, d, g, bs, streams, 600));
    CtModel m(c.config());
    Diff diff;
    tt::OpCounts n;
    // Grow, evict, reuse (several rounds of random operations), no resets.
    tt::random_ops(c, m, rng, 150, diff, n, 0.0, false);
    TT_REQUIRE_OK_DIFF(diff);
    for (int s = 0; s < streams; ++s)
      if (m.live_count(s) + static_cast<int>(m.S(s).staged.size()) == 0) append_tokens(c, m, rng, s, R, 3);
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
    for (bool staged : {true, false}) {
      if (!staged) {  // complete every staging group: no staged token left
        for (int s = 0; s < streams; ++s)
          append_tokens(c, m, rng, s, m.S(s).staged_thought, (m.g - static_cast<int>(m.S(s).staged.size())) % m.g);
        for (int s = 0; s < streams; ++s) REQUIRE(c.table().staged_count(s) == 0);
      } else {
        int with_staged = 0;
        for (int s = 0; s < streams; ++s) with_staged += c.table().staged_count(s) > 0;
        if (with_staged == 0) append_tokens(c, m, rng, 0, tt::next_thought(rng, m, 0), 1);
      }
      for (int ratio : {1, 2, 4, 8}) {
        const int nkv = uniform_int(rng, 1, 4);
        std::vector<std::int32_t> kv;
        for (int h = 0; h < nkv; ++h) kv.push_back(uniform_int(rng, 0, streams - 1));  // repeats allowed
        const float sc =
            chance(rng, 0.5) ? 0.0f : static_cast<float>(std::uniform_real_distribution<double>(0.02, 0.3)(rng));
        CAPTURE(staged, ratio, nkv, sc);
        check_attend(c, m, rng, kv, ratio * nkv, sc, es);
      }
    }
  }
  es.print("PagedKvCache::attend vs float64");
}

TEST_CASE("PagedKvCache::attend skips evicted tokens and includes staged ones (sensitivity)", "[attention][cache]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : kMaps) {
    CAPTURE(map);
    const int d = 32, g = 8;
    PagedKvCache<> c(cache_config(map, d, g, 8, 1, 16));
    CtModel m(c.config());
    // Unit-variance tokens without outlier channels, so that a query aligned with one key (score
    // 30) dominates all others (scores ~ N(0, 5.3^2)).
    append_tokens(c, m, rng, 0, R, 4 * g, 1.0, false);
    append_tokens(c, m, rng, 0, E, 3, 1.0, false);  // 3 staged tokens
    // Evict one token; a query aligned with its key gives it a dominant score.
    const auto live = m.live_slots(0);
    const SlotRef victim = live[static_cast<std::size_t>(uniform_int(rng, 0, static_cast<int>(live.size()) - 1))];
    const tt::MSlot vict = *m.find(0, victim);
    REQUIRE(c.evict(0, std::vector<SlotRef>{victim}).is_ok());
    m.evict(0, std::vector<SlotRef>{victim});
    std::vector<float> k_live, v_live;
    m.attention_tokens(0, k_live, v_live);
    std::vector<float> k_with = k_live, v_with = v_live;  // as if the mask were ignored
    k_with.insert(k_with.end(), vict.k.begin(), vict.k.end());
    v_with.insert(v_with.end(), vict.v.begin(), vict.v.end());
    std::vector<float> k_nostage(k_live.begin(), k_live.end() - 3 * d), v_nostage(v_live.begin(), v_live.end() - 3 * d);
    const std::int32_t stream = 0;
    auto run = [&](const std::vector<float>& q) {
      std::vector<float> out(static_cast<std::size_t>(d));
      DecodeAttentionArgs a;
      a.num_q_heads = 1;
      a.num_kv_heads = 1;
      a.kv_streams = &stream;
      a.q = q.data();
      a.out = out.data();
      REQUIRE(c.attend(a).is_ok());
      return out;
    };
    auto max_diff = [&](const std::vector<double>& x, const std::vector<double>& y) {
      double e = 0;
      for (int i = 0; i < d; ++i) e = std::max(e, std::fabs(x[i] - y[i]));
      return e;
    };
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    auto aligned = [&](const float* key) {  // a query whose score with `key` is 30
      double kk = 0;
      for (int i = 0; i < d; ++i) kk += static_cast<double>(key[i]) * key[i];
      std::vector<float> q(key, key + d);
      for (auto& x : q) x = static_cast<float>(x * 30.0 / (kk * scale));
      return q;
    };
    {
      const std::vector<float> q = aligned(vict.k.data());
      const auto out = run(q);
      const auto want = tt::attend64(q.data(), k_live, v_live, d, scale);
      const auto wrong = tt::attend64(q.data(), k_with, v_with, d, scale);
      const double bound = tt::attention_error_bound(q.data(), k_live, v_live, d, scale);
      std::vector<double> outd(out.begin(), out.end());
      CHECK(max_diff(outd, want) <= bound);
      CHECK(max_diff(want, wrong) > 10 * bound);  // an ignored mask would be caught
    }
    {
      const std::vector<float> q = aligned(k_live.data() + k_live.size() - d);  // the last staged key
      const auto out = run(q);
      const auto want = tt::attend64(q.data(), k_live, v_live, d, scale);
      const auto wrong = tt::attend64(q.data(), k_nostage, v_nostage, d, scale);
      const double bound = tt::attention_error_bound(q.data(), k_live, v_live, d, scale);
      std::vector<double> outd(out.begin(), out.end());
      CHECK(max_diff(outd, want) <= bound);
      CHECK(max_diff(want, wrong) > 10 * bound);  // a skipped staging path would be caught
    }
    // Reusing the hole: the new group's token is seen, the old one still not.
    append_tokens(c, m, rng, 0, E, g - 3);
    append_tokens(c, m, rng, 0, R, g);
    ErrorStats es;
    check_attend(c, m, rng, {0}, 4, 0.0f, es);
    check_attend(c, m, rng, {0, 0}, 2, 0.0f, es);
  }
}

TEST_CASE("PagedKvCache::attend over staged tokens only", "[attention][cache]") {
  TT_SEEDED_RNG();
  PagedKvCache<> c(cache_config(kR4E4T2, 16, 16, 16, 3, 4));
  CtModel m(c.config());
  append_tokens(c, m, rng, 1, E, 1);
  append_tokens(c, m, rng, 2, E, 15);
  ErrorStats es;
  check_attend(c, m, rng, {1, 2}, 4, 0.0f, es);
  // One staged token: the output is exactly its BF16 value.
  const auto& v = m.S(1).staged[0].v;
  std::vector<float> q = tt::random_row(rng, 16), out(16);
  const std::int32_t s = 1;
  DecodeAttentionArgs a;
  a.num_q_heads = 1;
  a.num_kv_heads = 1;
  a.kv_streams = &s;
  a.q = q.data();
  a.out = out.data();
  REQUIRE(c.attend(a).is_ok());
  CHECK(tt::same_bits(out, v));
}

TEST_CASE("PagedKvCache::attend: invalid arguments fail before the output is written", "[attention][errors]") {
  TT_SEEDED_RNG();
  const int d = 16;
  PagedKvCache<> c(cache_config(kR4E4T2, d, 8, 8, 4, 8));
  CtModel m(c.config());
  append_tokens(c, m, rng, 0, R, 12);
  append_tokens(c, m, rng, 1, E, 8);
  append_tokens(c, m, rng, 3, R, 8);
  REQUIRE(c.evict(3, m.live_slots(3)).is_ok());  // stream 3: every token evicted
  m.evict(3, m.live_slots(3));
  // stream 2: never written
  const auto before = tt::snapshot_cache(c);
  const std::uint32_t poison_bits = 0x7FC0BEEFu;  // a NaN with a payload
  std::vector<float> q(8 * d), out(8 * d);
  for (auto& x : q) x = static_cast<float>(std::normal_distribution<double>(0, 1)(rng));
  std::int32_t streams[4] = {0, 1, 0, 1};
  struct Case {
    const char* what;
    int nq, nkv;
    std::int32_t s0, s1;
    bool null_streams, null_q, null_out;
    float scale;
    StatusCode code;
    const char* words;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const Case cases[] = {
      {"q heads not a multiple of kv heads", 3, 2, 0, 1, false, false, false, 0, StatusCode::kShapeMismatch,
       "multiple"},
      {"5 q heads over 2", 5, 2, 0, 1, false, false, false, 0, StatusCode::kShapeMismatch, "num_q_heads 5"},
      {"no kv heads", 2, 0, 0, 1, false, false, false, 0, StatusCode::kShapeMismatch, "num_kv_heads 0"},
      {"no q heads", 0, 1, 0, 1, false, false, false, 0, StatusCode::kShapeMismatch, "num_q_heads 0"},
      {"negative heads", -2, -1, 0, 1, false, false, false, 0, StatusCode::kShapeMismatch, "num_q_heads -2"},
      {"fewer q than kv heads", 1, 2, 0, 1, false, false, false, 0, StatusCode::kShapeMismatch, "multiple"},
      {"null kv_streams", 2, 2, 0, 1, true, false, false, 0, StatusCode::kInvalidArgument, "null"},
      {"null q", 2, 2, 0, 1, false, true, false, 0, StatusCode::kInvalidArgument, "null"},
      {"null out", 2, 2, 0, 1, false, false, true, 0, StatusCode::kInvalidArgument, "null"},
      {"stream -1", 4, 2, 0, -1, false, false, false, 0, StatusCode::kOutOfRange, "kv_streams[1] = -1"},
      {"stream past the end", 4, 2, 4, 0, false, false, false, 0, StatusCode::kOutOfRange, "kv_streams[0] = 4"},
      {"never-written stream", 4, 2, 0, 2, false, false, false, 0, StatusCode::kInvalidArgument, "stream 2"},
      {"fully evicted stream", 4, 2, 3, 1, false, false, false, 0, StatusCode::kInvalidArgument, "stream 3"},
      {"negative scale", 2, 2, 0, 1, false, false, false, -0.5f, StatusCode::kInvalidArgument, "softmax_scale"},
      {"NaN scale", 2, 2, 0, 1, false, false, false, nan, StatusCode::kInvalidArgument, "softmax_scale"},
      {"Inf scale", 2, 2, 0, 1, false, false, false, inf, StatusCode::kInvalidArgument, "softmax_scale"},
  };
  for (const Case& k : cases) {
    CAPTURE(k.what);
    for (auto& x : out) x = tt::from_bits(poison_bits);
    streams[0] = k.s0;
    streams[1] = k.s1;
    DecodeAttentionArgs a;
    a.num_q_heads = k.nq;
    a.num_kv_heads = k.nkv;
    a.kv_streams = k.null_streams ? nullptr : streams;
    a.q = k.null_q ? nullptr : q.data();
    a.out = k.null_out ? nullptr : out.data();
    a.softmax_scale = k.scale;
    const Status st = c.attend(a);
    CHECK(st.code() == k.code);
    CHECK_THAT(st.message(), Contains(k.words));
    for (float x : out) REQUIRE(tt::fbits(x) == poison_bits);
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  }
  // The same call with valid streams succeeds (the setup is sound).
  streams[0] = 0;
  streams[1] = 1;
  DecodeAttentionArgs a;
  a.num_q_heads = 4;
  a.num_kv_heads = 2;
  a.kv_streams = streams;
  a.q = q.data();
  a.out = out.data();
  REQUIRE(c.attend(a).is_ok());
  for (int i = 0; i < 4 * d; ++i) CHECK(std::isfinite(out[i]));
}
