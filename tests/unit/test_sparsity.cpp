// The sparsity signal of the CPU reference attention (thinkv/reference/attention.hpp):
//  - ties: random rows with a nonzero row max in which several scores are constructed to give
//    exactly d_j = s_j - m == kSparsityLogThreshold in the reference's FP32 arithmetic (the
//    documented rule: a tie is not sparse), next to scores one FP32 step either side;
//  - an independent float64 count of p_j < 0.01 * p_max, with p_j = exp(s_j - m) in double, on
//    general random inputs kept away from the threshold by more than the FP32 error bound;
//  - grid inputs on which every score is exact in FP32 and float64 (no ties occur there);
//  - the paged cache's attention over live and staged tokens only.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "thinkv/paged_kv_cache.hpp"
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
  const std::vector<float> s = {0.0f,   thr,  std::nextafter(thr, -INFINITY), std::nextafter(thr, INFINITY),
                                -30.0f, -1.0f};
  std::vector<float> q(d, 0.0f), k(s.size() * d, 0.0f), v(s.size() * d, 1.0f);
  q[0] = 1.0f;
  for (std::size_t j = 0; j < s.size(); ++j) {
    k[j * d] = s[j];
    k[j * d + 1] = 7.0f;  // ignored by q, must not matter
  }
  std::vector<float> out(d), sp(1, NAN);
  thinkv::reference::attend_tokens(q.data(), 1, k.data(), v.data(), static_cast<int>(s.size()), d, 1.0f, out.data(),
                                   sp.data());
  // sparse: nextafter(thr, -inf) and -30 -> 2 of 6; thr itself (tie) and nextafter(thr, +inf) not.
  CHECK(sp[0] == Approx(2.0 / 6.0).margin(0));
  CHECK(sp[0] == static_cast<float>(2.0 / 6.0));
}

namespace {

/// d = s - m as the reference computes it (one FP32 subtraction), obtained independently: the
/// exact float64 difference of the two floats, rounded once to FP32. Exact in float64 here since
/// the operands' exponents differ by far less than 53 - 24 bits (|s|, |m| in [2^-4, 2^4]).
float fp32_diff(float s, float m) { return static_cast<float>(static_cast<double>(s) - static_cast<double>(m)); }

/// Scores near m + kSparsityLogThreshold, classified by the FP32 rule.
struct TieSet {
  std::vector<float> ties;  ///< every s with fp32_diff(s, m) == threshold exactly (not sparse)
  float below = 0.0f;       ///< the largest s with fp32_diff(s, m) < threshold (sparse)
  float above = 0.0f;       ///< the smallest s with fp32_diff(s, m) > threshold (not sparse)
};

TieSet tie_set(float m) {
  const float thr = thinkv::kSparsityLogThreshold;
  const auto centre = static_cast<float>(static_cast<double>(m) + static_cast<double>(thr));
  float lo = centre, hi = centre;
  for (int i = 0; i < 16; ++i) lo = std::nextafter(lo, -INFINITY);
  for (int i = 0; i < 16; ++i) hi = std::nextafter(hi, INFINITY);
  TieSet t;
  t.below = -INFINITY;
  t.above = INFINITY;
  for (float s = lo; s <= hi; s = std::nextafter(s, INFINITY)) {
    const float d = fp32_diff(s, m);
    if (d == thr) {
      t.ties.push_back(s);
    } else if (d < thr) {
      t.below = std::max(t.below, s);
    } else {
      t.above = std::min(t.above, s);
    }
  }
  return t;
}

}  // namespace

TEST_CASE("ties at the threshold in random rows with a nonzero max are not sparse", "[sparsity]") {
  TT_SEEDED_RNG();
  // Layout of a row: d = 16 channels; query head h owns channel h (its "private axis"), the other
  // heads have 0 there; channels n_q..15 are shared. Constructed tokens of head h have a key along
  // channel h only, so the reference computes their score as
  //   (0 + ... + q_h[h] * k[h] + ... + 0) * scale = k[h] * q_h[h] * scale,
  // exact when q_h[h] and scale are powers of two: the score is exactly the float chosen (the row
  // max m_h, ties, one FP32 step below / above the ties), and 0 for every other head. Random
  // tokens use the shared channels on the grid k/8 (exact scores), are kept <= every head's max and
  // > 1e-3 away from the threshold (so float64 classifies them unambiguously).
  const float thr = thinkv::kSparsityLogThreshold;
  const int d = 16;
  std::uniform_int_distribution<int> grid(-16, 16);
  long ties_total = 0, ties_inexact = 0, random_total = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int n_q = tt::uniform_int(rng, 1, 4);
    const float scale = std::ldexp(1.0f, tt::uniform_int(rng, -2, 0));
    std::vector<float> q(static_cast<std::size_t>(n_q) * d, 0.0f), m(static_cast<std::size_t>(n_q));
    std::vector<TieSet> ts(static_cast<std::size_t>(n_q));
    for (int h = 0; h < n_q; ++h) {
      float* qh = q.data() + static_cast<std::ptrdiff_t>(h) * d;
      qh[h] = std::ldexp(1.0f, tt::uniform_int(rng, -1, 1));
      for (int c = n_q; c < d; ++c) qh[c] = static_cast<float>(grid(rng)) / 8.0f;
      // The row max: a float with a random mantissa, nonzero; positive with several heads (their
      // constructed tokens score 0 for the others), away from -thr so that 0 - m is no near tie.
      for (int attempt = 0;; ++attempt) {
        REQUIRE(attempt < 100);
        const bool negative = n_q == 1 && tt::chance(rng, 0.5);
        const double mag = negative ? 0.5 + 2.5 * tt::uniform01(rng) : 0.5 + 7.5 * tt::uniform01(rng);
        const auto mh = static_cast<float>(negative ? -mag : mag);
        if (std::fabs(static_cast<double>(mh) + static_cast<double>(thr)) < 0.1) continue;
        TieSet t = tie_set(mh);
        if (t.ties.empty() || !std::isfinite(t.below) || !std::isfinite(t.above)) continue;
        m[static_cast<std::size_t>(h)] = mh;
        ts[static_cast<std::size_t>(h)] = std::move(t);
        break;
      }
    }
    // Tokens: (owner head or -1 for random, score for the owner / key for random).
    struct Token {
      int owner = -1;
      float score = 0.0f;      // owner's score (constructed tokens)
      std::vector<float> key;  // [d]
    };
    std::vector<Token> tokens;
    std::vector<int> expect_sparse(static_cast<std::size_t>(n_q), 0);
    auto add_constructed = [&](int h, float score, bool sparse) {
      Token t;
      t.owner = h;
      t.score = score;
      t.key.assign(static_cast<std::size_t>(d), 0.0f);
      const float qh = q[static_cast<std::size_t>(h) * d + static_cast<std::size_t>(h)];
      t.key[static_cast<std::size_t>(h)] = score / (qh * scale);  // exact: powers of two
      REQUIRE(t.key[static_cast<std::size_t>(h)] * qh * scale == score);
      tokens.push_back(std::move(t));
      expect_sparse[static_cast<std::size_t>(h)] += sparse ? 1 : 0;
      // 0 for the other heads: sparse there when 0 - m < thr (m > 4.6; never near the threshold).
      for (int o = 0; o < n_q; ++o) {
        if (o != h) {
          expect_sparse[static_cast<std::size_t>(o)] += (0.0 - m[static_cast<std::size_t>(o)]) < thr ? 1 : 0;
        }
      }
    };
    for (int h = 0; h < n_q; ++h) {
      const TieSet& t = ts[static_cast<std::size_t>(h)];
      add_constructed(h, m[static_cast<std::size_t>(h)], false);  // the row max
      const int n_ties = tt::uniform_int(rng, 2, 6);
      for (int i = 0; i < n_ties; ++i) {
        const float s = t.ties[static_cast<std::size_t>(tt::uniform_int(rng, 0, static_cast<int>(t.ties.size()) - 1))];
        add_constructed(h, s, false);
        ++ties_total;
        // A tie in FP32 whose exact difference is not the threshold: a float64 comparison of
        // s - m would call it sparse (or not) by a margin FP32 cannot see.
        ties_inexact +=
            static_cast<double>(s) - static_cast<double>(m[static_cast<std::size_t>(h)]) != static_cast<double>(thr);
      }
      for (int i = tt::uniform_int(rng, 0, 2); i > 0; --i) add_constructed(h, t.below, true);
      for (int i = tt::uniform_int(rng, 0, 2); i > 0; --i) add_constructed(h, t.above, false);
    }
    // Up to 200 random tokens; a draw that no key in 1000 attempts satisfies (a row whose shared
    // channels cannot reach below a negative max, say) is left out.
    const int n_random = tt::uniform_int(rng, 0, 200);
    for (int i = 0; i < n_random; ++i) {
      Token t;
      t.key.assign(static_cast<std::size_t>(d), 0.0f);
      bool found = false;
      for (int attempt = 0; attempt < 1000 && !found; ++attempt) {
        for (int c = n_q; c < d; ++c) { t.key[static_cast<std::size_t>(c)] = static_cast<float>(grid(rng)) / 8.0f; }
        bool ok = true;
        std::vector<int> sparse(static_cast<std::size_t>(n_q));
        for (int h = 0; h < n_q && ok; ++h) {
          double sc = 0.0;
          for (int c = n_q; c < d; ++c) {
            sc += static_cast<double>(q[static_cast<std::size_t>(h) * d + static_cast<std::size_t>(c)]) *
                  t.key[static_cast<std::size_t>(c)];
          }
          sc *= scale;
          const double dd = sc - m[static_cast<std::size_t>(h)];
          ok = dd <= 0.0 && std::fabs(dd - static_cast<double>(thr)) > 1e-3;
          sparse[static_cast<std::size_t>(h)] = dd < static_cast<double>(thr) ? 1 : 0;
        }
        if (!ok) continue;
        for (int h = 0; h < n_q; ++h) {
          expect_sparse[static_cast<std::size_t>(h)] += sparse[static_cast<std::size_t>(h)];
        }
        found = true;
      }
      if (found) {
        tokens.push_back(std::move(t));
        ++random_total;
      }
    }
    std::shuffle(tokens.begin(), tokens.end(), rng);
    const int n = static_cast<int>(tokens.size());
    std::vector<float> k(static_cast<std::size_t>(n) * d), v(k.size());
    for (int j = 0; j < n; ++j) {
      std::copy(tokens[static_cast<std::size_t>(j)].key.begin(), tokens[static_cast<std::size_t>(j)].key.end(),
                k.begin() + static_cast<std::ptrdiff_t>(j) * d);
    }
    for (auto& x : v) x = static_cast<float>(grid(rng)) / 8.0f;
    std::vector<float> out(q.size()), sp(static_cast<std::size_t>(n_q), NAN);
    thinkv::reference::attend_tokens(q.data(), n_q, k.data(), v.data(), n, d, scale, out.data(), sp.data());
    for (int h = 0; h < n_q; ++h) {
      INFO("trial " << trial << " head " << h << " of " << n_q << ", row max " << m[static_cast<std::size_t>(h)] << ", "
                    << n << " tokens, scale " << scale);
      CHECK(sp[static_cast<std::size_t>(h)] ==
            static_cast<float>(expect_sparse[static_cast<std::size_t>(h)]) / static_cast<float>(n));
    }
  }
  // The rows did hold ties, ties that only FP32 rounding makes ties, and random tokens.
  INFO("ties " << ties_total << ", of them inexact in float64 " << ties_inexact << "; random tokens " << random_total);
  CHECK(ties_total >= 600);
  CHECK(ties_inexact > 0);
  CHECK(random_total >= 300 * 100 / 4);
}

TEST_CASE("reference attention sparsity equals a float64 count of p_j < 0.01 p_max via exp", "[sparsity]") {
  TT_SEEDED_RNG();
  // General random inputs (normal q and k, any float scale). The oracle works in float64 from the
  // FP32 inputs: s_j = (sum_c q_c k_c) * scale, p_j = exp(s_j - max_i s_i), and counts
  // p_j < 0.01 * max_i p_i; it shares no constant and no arithmetic with the reference.
  // Why the counts must be equal: the reference's FP32 score differs from s_j by at most
  // E_j = (d + 1) u scale sum_c |q_c k_c| to first order (u = 2^-24; the products, the recursive
  // sum and the scale product; an FMA only makes it smaller), so its d_j = fl(s_j - m) differs
  // from the exact s_j - max_i s_i by at most E_j + max_i E_i + u |d_j|, and its constant from
  // ln 0.01 by 2.4e-7. Every token whose float64 distance to ln 0.01 is within twice that bound
  // (+ 1e-6) has its key redrawn (a few per run), so no token lies where the two computations
  // could disagree; on all the others they agree exactly, hence no tolerance on the count.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const double u = std::ldexp(1.0, -24);
  const double ln001 = std::log(0.01);
  long sparse_total = 0, tokens_total = 0, redrawn = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int d = std::vector<int>{16, 64, 128}[static_cast<std::size_t>(tt::uniform_int(rng, 0, 2))];
    const int n = tt::uniform_int(rng, 1, 400);
    const int n_q = tt::uniform_int(rng, 1, 4);
    const auto scale = static_cast<float>((0.3 + 3.7 * tt::uniform01(rng)) / std::sqrt(static_cast<double>(d)));
    std::vector<float> q(static_cast<std::size_t>(n_q) * d), k(static_cast<std::size_t>(n) * d), v(k.size());
    for (auto& x : q) x = normal(rng);
    for (auto& x : k) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    auto key = [&](int j) { return k.data() + static_cast<std::ptrdiff_t>(j) * d; };
    // Scores and error bounds of one head, in float64.
    auto scores = [&](int h, std::vector<double>& s, std::vector<double>& e) {
      s.assign(static_cast<std::size_t>(n), 0.0);
      e.assign(static_cast<std::size_t>(n), 0.0);
      const float* qh = q.data() + static_cast<std::ptrdiff_t>(h) * d;
      for (int j = 0; j < n; ++j) {
        double acc = 0.0, abs_acc = 0.0;
        for (int c = 0; c < d; ++c) {
          const double p = static_cast<double>(qh[c]) * static_cast<double>(key(j)[c]);
          acc += p;
          abs_acc += std::fabs(p);
        }
        s[static_cast<std::size_t>(j)] = acc * scale;
        e[static_cast<std::size_t>(j)] = (d + 1) * u * abs_acc * scale;
      }
    };
    std::vector<double> s, e;
    // Redraw keys near the threshold for any head until none is left.
    for (bool clean = false; !clean;) {
      clean = true;
      for (int h = 0; h < n_q; ++h) {
        scores(h, s, e);
        const double mx = *std::max_element(s.begin(), s.end());
        const double emax = *std::max_element(e.begin(), e.end());
        for (int j = 0; j < n; ++j) {
          const double dj = s[static_cast<std::size_t>(j)] - mx;
          const double margin = 2.0 * (e[static_cast<std::size_t>(j)] + emax + u * std::fabs(dj)) + 1e-6;
          if (std::fabs(dj - ln001) <= margin) {
            for (int c = 0; c < d; ++c) key(j)[c] = normal(rng);
            clean = false;
            ++redrawn;
          }
        }
      }
    }
    std::vector<float> out(q.size()), sp(static_cast<std::size_t>(n_q), NAN);
    thinkv::reference::attend_tokens(q.data(), n_q, k.data(), v.data(), n, d, scale, out.data(), sp.data());
    for (int h = 0; h < n_q; ++h) {
      scores(h, s, e);
      const double mx = *std::max_element(s.begin(), s.end());
      std::vector<double> p(s.size());
      for (std::size_t j = 0; j < s.size(); ++j) p[j] = std::exp(s[j] - mx);
      const double pmax = *std::max_element(p.begin(), p.end());
      int below = 0;
      for (double pj : p) below += pj < 0.01 * pmax ? 1 : 0;
      sparse_total += below;
      tokens_total += n;
      INFO("trial " << trial << " head " << h << ": d " << d << ", n " << n << ", scale " << scale);
      CHECK(sp[static_cast<std::size_t>(h)] == static_cast<float>(below) / static_cast<float>(n));
    }
  }
  // The inputs spread over both sides of the threshold.
  INFO("sparse " << sparse_total << " of " << tokens_total << " (token, head) pairs; keys redrawn " << redrawn);
  CHECK(sparse_total > tokens_total / 10);
  CHECK(sparse_total < tokens_total * 9 / 10);
}

TEST_CASE("reference attention sparsity equals a float64 count on random exact-score inputs", "[sparsity]") {
  const unsigned seed = static_cast<unsigned>(tt::base_seed());
  INFO("seed " << seed << " (THINKV_TEST_SEED to repeat)");
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> grid(-16, 16);  // values k/8 in [-2, 2]
  for (int trial = 0; trial < 200; ++trial) {
    const int d = 16;
    const int n = 1 + static_cast<int>(rng() % 300);
    const int n_q = 1 + static_cast<int>(rng() % 4);
    const float scale = (trial % 2) ? 1.0f : 0.25f;  // powers of two keep the scores exact
    std::vector<float> q(static_cast<std::size_t>(n_q) * d), k(static_cast<std::size_t>(n) * d), v(k.size());
    for (auto& x : q) x = static_cast<float>(grid(rng)) / 8.0f;
    for (auto& x : k) x = static_cast<float>(grid(rng)) / 8.0f;
    for (auto& x : v) x = static_cast<float>(grid(rng)) / 8.0f;
    std::vector<float> out(q.size()), sp(static_cast<std::size_t>(n_q), NAN);
    thinkv::reference::attend_tokens(q.data(), n_q, k.data(), v.data(), n, d, scale, out.data(), sp.data());
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

TEST_CASE("cache attention emits per-head sparsity over exactly the live and staged tokens", "[sparsity]") {
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
