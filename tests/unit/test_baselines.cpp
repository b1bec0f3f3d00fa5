/// \file test_baselines.cpp
/// The baselines of include/thinkv/baselines/ (FullKV FP16, StreamingLLM, H2O, R-KV, KIVI) against
/// independent models written from the methods' definitions (none calls the code under test):
/// every step the kept positions are compared, every attention output is checked against a
/// float64 attention over the model's tokens with the FP32 error bound of test_util.hpp, and the
/// eviction choices of H2O and R-KV are checked against float64 scores (within a stated
/// tolerance; the model then follows the cache's choice so the runs stay in step). Bad input and
/// protocol violations must be refused and change nothing: a twin cache that never saw them
/// decodes on bit for bit the same.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "thinkv/baselines/dense_kv_cache.hpp"
#include "thinkv/baselines/kivi_cache.hpp"

namespace {

using namespace thinkv;

/// FP16 rounding through the compiler's _Float16 (independent of thinkv's encode_fp16).
float fp16_round(float x) { return static_cast<float>(static_cast<_Float16>(x)); }

struct MToken {
  std::int32_t pos = 0;
  std::vector<float> k, v;  // as stored (FP16-rounded, or dequantized for KIVI)
  double score = 0;         // H2O: attention received
};

/// Random per-layer K/V/Q for one token.
struct TokenData {
  std::vector<std::vector<float>> k, v, q;  // [layer][kv_size or q_size]
};

TokenData random_token(std::mt19937_64& rng, const CacheShape& sh) {
  TokenData t;
  for (int l = 0; l < sh.num_layers; ++l) {
    std::vector<float> k, v, q;
    for (int h = 0; h < sh.num_kv_heads; ++h) {
      auto a = tt::random_row(rng, sh.head_dim, 1.0);
      auto b = tt::random_row(rng, sh.head_dim, 1.0);
      k.insert(k.end(), a.begin(), a.end());
      v.insert(v.end(), b.begin(), b.end());
    }
    for (int h = 0; h < sh.num_q_heads; ++h) {
      auto a = tt::random_row(rng, sh.head_dim, 1.5);
      q.insert(q.end(), a.begin(), a.end());
    }
    t.k.push_back(k);
    t.v.push_back(v);
    t.q.push_back(q);
  }
  return t;
}

double default_scale(const CacheShape& sh) { return 1.0 / std::sqrt(static_cast<double>(sh.head_dim)); }

/// Checks out (the cache's [num_q_heads, d]) against float64 attention over the model's tokens of
/// each KV head. Returns the number of violations of the error bound.
int check_attention(const CacheShape& sh, const std::vector<float>& q, const std::vector<float>& out,
                    const std::vector<std::vector<MToken>*>& heads, double& worst) {
  const int d = sh.head_dim, group = sh.num_q_heads / sh.num_kv_heads;
  int bad = 0;
  for (int h = 0; h < sh.num_kv_heads; ++h) {
    std::vector<float> k, v;
    for (const MToken& t : *heads[static_cast<std::size_t>(h)]) {
      k.insert(k.end(), t.k.begin(), t.k.end());
      v.insert(v.end(), t.v.begin(), t.v.end());
    }
    for (int g = 0; g < group; ++g) {
      const float* qh = q.data() + static_cast<std::size_t>(h * group + g) * d;
      const auto want = tt::attend64(qh, k, v, d, static_cast<float>(default_scale(sh)));
      const double bound = tt::attention_error_bound(qh, k, v, d, static_cast<float>(default_scale(sh)));
      for (int c = 0; c < d; ++c) {
        const double err =
            std::fabs(out[static_cast<std::size_t>((h * group + g) * d + c)] - want[static_cast<std::size_t>(c)]);
        worst = std::max(worst, err / std::max(bound, 1e-30));
        if (err > bound) ++bad;
      }
    }
  }
  return bad;
}

/// float64 softmax probabilities of query qh over tokens.
std::vector<double> probs64(const float* qh, const std::vector<MToken>& toks, int d, double scale) {
  std::vector<double> s(toks.size());
  double mx = -INFINITY;
  for (std::size_t j = 0; j < toks.size(); ++j) {
    double a = 0;
    for (int c = 0; c < d; ++c) a += static_cast<double>(qh[c]) * toks[j].k[static_cast<std::size_t>(c)];
    s[j] = a * scale;
    mx = std::max(mx, s[j]);
  }
  double l = 0;
  for (double& x : s) l += (x = std::exp(x - mx));
  for (double& x : s) x /= l;
  return s;
}

std::vector<std::int32_t> positions_of(const std::vector<MToken>& toks) {
  std::vector<std::int32_t> p;
  for (const MToken& t : toks) p.push_back(t.pos);
  std::sort(p.begin(), p.end());
  return p;
}

/// Decodes `steps` random tokens of every sequence through a DenseKvCache and an independent
/// model, comparing everything each step.
void run_dense_against_model(DenseKvConfig cfg, int steps, std::mt19937_64& rng) {
  DenseKvCache cache(cfg);
  const CacheShape sh = cfg.shape;
  const int d = sh.head_dim, group = sh.num_q_heads / sh.num_kv_heads;
  const double scale = default_scale(sh);
  const int S = sh.num_sequences * sh.streams_per_sequence();
  std::vector<std::vector<MToken>> model(static_cast<std::size_t>(S));
  // R-KV's observation window: the last rkv_window queries per (sequence, layer).
  std::map<std::pair<int, int>, std::vector<std::vector<float>>> window;
  auto stream = [&](int seq, int l, int h) { return (seq * sh.num_layers + l) * sh.num_kv_heads + h; };
  double worst = 0;
  int attention_bad = 0, evictions = 0;
  std::int64_t expected_evicted = 0;
  for (int step = 0; step < steps; ++step) {
    for (int seq = 0; seq < sh.num_sequences; ++seq) {
      const std::int32_t pos = step;
      INFO("step " << step << " sequence " << seq << " method " << to_string(cfg.method));
      REQUIRE(cache.position(seq) == pos);
      REQUIRE(cache.begin_token(seq).is_ok());
      const TokenData t = random_token(rng, sh);
      for (int l = 0; l < sh.num_layers; ++l) {
        REQUIRE(cache.append(seq, l, t.k[static_cast<std::size_t>(l)], t.v[static_cast<std::size_t>(l)]).is_ok());
        std::vector<std::vector<MToken>*> heads;
        for (int h = 0; h < sh.num_kv_heads; ++h) {
          MToken m;
          m.pos = pos;
          for (int c = 0; c < d; ++c) {
            m.k.push_back(fp16_round(t.k[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * d + c)]));
            m.v.push_back(fp16_round(t.v[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * d + c)]));
          }
          auto& toks = model[static_cast<std::size_t>(stream(seq, l, h))];
          toks.push_back(m);
          heads.push_back(&toks);
        }
        std::vector<float> out(sh.q_size(), std::nanf(""));  // poisoned
        REQUIRE(cache.attend(seq, l, t.q[static_cast<std::size_t>(l)], out).is_ok());
        attention_bad += check_attention(sh, t.q[static_cast<std::size_t>(l)], out, heads, worst);
        if (cfg.method == DenseMethod::kH2o) {  // every token's received attention, summed over heads
          for (int h = 0; h < sh.num_kv_heads; ++h) {
            auto& toks = model[static_cast<std::size_t>(stream(seq, l, h))];
            for (int g = 0; g < group; ++g) {
              const auto p =
                  probs64(t.q[static_cast<std::size_t>(l)].data() + static_cast<std::size_t>(h * group + g) * d, toks,
                          d, scale);
              for (std::size_t j = 0; j < toks.size(); ++j) toks[j].score += p[j];
            }
          }
        }
        if (cfg.method == DenseMethod::kRkv) {
          auto& w = window[{seq, l}];
          w.push_back(t.q[static_cast<std::size_t>(l)]);
          if (static_cast<int>(w.size()) > cfg.rkv_window) w.erase(w.begin());
        }
      }
      REQUIRE(cache.end_token(seq).is_ok());
      // The model's eviction, checked against what the cache kept.
      for (int l = 0; l < sh.num_layers; ++l) {
        for (int h = 0; h < sh.num_kv_heads; ++h) {
          auto& toks = model[static_cast<std::size_t>(stream(seq, l, h))];
          const std::vector<std::int32_t> kept = cache.live_positions(seq, l, h);
          const std::set<std::int32_t> kept_set(kept.begin(), kept.end());
          const int pinned = std::min(cfg.pinned_prefix, pos + 1);  // positions < pinned_prefix are kept
          const int budget = cfg.token_budget + pinned;
          const int n = static_cast<int>(toks.size());
          switch (cfg.method) {
            case DenseMethod::kFullKv: REQUIRE(kept == positions_of(toks)); break;
            case DenseMethod::kStreamingLlm: {
              std::vector<std::int32_t> want;
              const int keep_first = std::min(std::max(cfg.sink_tokens, cfg.pinned_prefix), pos + 1);
              for (std::int32_t p = 0; p <= pos; ++p) {
                if (p < keep_first || p > pos - (budget - keep_first)) want.push_back(p);
              }
              REQUIRE(kept == want);
              break;
            }
            case DenseMethod::kH2o: {
              const int drop = std::max(0, n - budget);
              REQUIRE(static_cast<int>(kept.size()) == n - drop);
              const int tb = cfg.token_budget;
              const std::int32_t recent_from = pos + 1 - (tb - static_cast<int>(std::floor(cfg.heavy_ratio * tb)));
              double max_evicted = -INFINITY, min_kept = INFINITY, top = 0;
              for (const MToken& m : toks) {
                top = std::max(top, m.score);
                if (m.pos < cfg.pinned_prefix) {
                  REQUIRE(kept_set.count(m.pos) == 1);  // the pinned prefix is never evicted
                  continue;
                }
                if (!kept_set.count(m.pos)) {
                  REQUIRE(m.pos < recent_from);  // never the recent window
                  max_evicted = std::max(max_evicted, m.score);
                } else if (m.pos < recent_from) {
                  min_kept = std::min(min_kept, m.score);
                }
              }
              // The evicted tokens are the lowest-scored outside the window (FP32 vs float64:
              // scores are sums of at most `steps` x group probabilities, each within 1e-6).
              if (drop > 0) CHECK(max_evicted <= min_kept + 1e-5 * (1 + top));
              evictions += drop;
              break;
            }
            case DenseMethod::kRkv: {
              if (n < budget + cfg.rkv_buffer) {
                REQUIRE(kept == positions_of(toks));
                break;
              }
              REQUIRE(static_cast<int>(kept.size()) == budget);
              // float64 scores: importance from the window's queries, redundancy softmax.
              const auto& w = window[{seq, l}];
              std::vector<double> imp(static_cast<std::size_t>(n), 0.0);
              for (const auto& qw : w) {
                for (int g = 0; g < group; ++g) {
                  const auto p = probs64(qw.data() + static_cast<std::size_t>(h * group + g) * d, toks, d, scale);
                  for (int j = 0; j < n; ++j) imp[static_cast<std::size_t>(j)] += p[static_cast<std::size_t>(j)];
                }
              }
              for (double& x : imp) x /= static_cast<double>(w.size() * static_cast<std::size_t>(group));
              std::vector<double> red(static_cast<std::size_t>(n), 0.0);
              for (int i = 0; i < n; ++i) {
                for (int j = 0; j < n; ++j) {
                  if (i == j) continue;
                  double dot = 0, ni = 0, nj = 0;
                  for (int c = 0; c < d; ++c) {
                    dot += static_cast<double>(toks[static_cast<std::size_t>(i)].k[static_cast<std::size_t>(c)]) *
                           toks[static_cast<std::size_t>(j)].k[static_cast<std::size_t>(c)];
                    ni += static_cast<double>(toks[static_cast<std::size_t>(i)].k[static_cast<std::size_t>(c)]) *
                          toks[static_cast<std::size_t>(i)].k[static_cast<std::size_t>(c)];
                    nj += static_cast<double>(toks[static_cast<std::size_t>(j)].k[static_cast<std::size_t>(c)]) *
                          toks[static_cast<std::size_t>(j)].k[static_cast<std::size_t>(c)];
                  }
                  red[static_cast<std::size_t>(j)] += dot / std::sqrt(ni * nj);
                }
              }
              double rmax = -INFINITY, rsum = 0;
              for (double& r : red) rmax = std::max(rmax, r /= (n - 1));
              for (double& r : red) rsum += (r = std::exp(r - rmax));
              const double lambda = cfg.rkv_lambda;
              const std::int32_t newest_from = pos + 1 - cfg.rkv_window;
              double max_evicted = -INFINITY, min_kept = INFINITY;
              for (int j = 0; j < n; ++j) {
                const MToken& m = toks[static_cast<std::size_t>(j)];
                const double z =
                    lambda * imp[static_cast<std::size_t>(j)] - (1 - lambda) * red[static_cast<std::size_t>(j)] / rsum;
                if (m.pos >= newest_from || m.pos < cfg.pinned_prefix) {
                  REQUIRE(kept_set.count(m.pos) == 1);  // the window and the pinned prefix are always kept
                } else if (kept_set.count(m.pos)) {
                  min_kept = std::min(min_kept, z);
                } else {
                  max_evicted = std::max(max_evicted, z);
                }
              }
              // Scores are O(1/n); FP32 against float64 differs by ~1e-7 of that.
              CHECK(max_evicted <= min_kept + 1e-6 / n);
              evictions += n - budget;
              break;
            }
          }
          // Follow the cache's choice (checked above).
          std::vector<MToken> next;
          for (MToken& m : toks) {
            if (kept_set.count(m.pos)) next.push_back(std::move(m));
          }
          expected_evicted += static_cast<std::int64_t>(toks.size() - next.size());
          toks = std::move(next);
          REQUIRE(positions_of(toks) == kept);
          // The stored K/V of every kept token is its FP16 rounding.
          std::vector<float> k(static_cast<std::size_t>(d)), v(static_cast<std::size_t>(d));
          for (const MToken& m : toks) {
            REQUIRE(cache.read_token(seq, l, h, m.pos, k, v));
            REQUIRE(tt::same_bits(k, m.k));
            REQUIRE(tt::same_bits(v, m.v));
          }
        }
      }
    }
  }
  CHECK(attention_bad == 0);
  INFO("worst attention error / bound " << worst);
  std::int64_t reported = 0;
  for (int seq = 0; seq < sh.num_sequences; ++seq) {
    const CacheReport r = cache.report(seq);
    reported += r.tokens_evicted;
    CHECK(r.positions == steps);
    std::int64_t live = 0;
    for (int st = 0; st < sh.streams_per_sequence(); ++st)
      live += static_cast<std::int64_t>(model[static_cast<std::size_t>(seq * sh.streams_per_sequence() + st)].size());
    CHECK(r.live_tokens == live);
    CHECK(r.held_bytes == live * cache.slot_bytes() + (cfg.method == DenseMethod::kRkv
                                                           ? std::int64_t{sh.num_layers} * cfg.rkv_window *
                                                                 static_cast<std::int64_t>(sh.q_size()) * 4
                                                           : 0));
    CHECK(r.fullkv_fp16_bytes == std::int64_t{steps} * sh.streams_per_sequence() * sh.head_dim * 4);
    if (cfg.method == DenseMethod::kRkv && evictions > 0) CHECK(r.gather_bytes > 0);
    if (cfg.method != DenseMethod::kRkv) CHECK(r.gather_bytes == 0);
  }
  CHECK(reported == expected_evicted);
  if (cfg.method == DenseMethod::kH2o || cfg.method == DenseMethod::kRkv) CHECK(evictions > 0);
}

DenseKvConfig dense_config(DenseMethod m, int budget) {
  DenseKvConfig c;
  c.shape = {2, 2, 2, 6, 16};
  c.method = m;
  c.max_tokens = 400;
  c.token_budget = m == DenseMethod::kFullKv ? 0 : budget;
  c.rkv_buffer = 12;
  c.rkv_window = 4;
  return c;
}

}  // namespace

TEST_CASE("FullKV FP16 keeps every token in FP16 and attends over all of them", "[baselines]") {
  TT_SEEDED_RNG();
  run_dense_against_model(dense_config(DenseMethod::kFullKv, 0), 60, rng);
}

TEST_CASE("StreamingLLM keeps the sinks and the most recent budget - sinks tokens", "[baselines]") {
  TT_SEEDED_RNG();
  run_dense_against_model(dense_config(DenseMethod::kStreamingLlm, 24), 90, rng);
}

TEST_CASE("H2O evicts the lowest accumulated attention outside the recent window", "[baselines]") {
  TT_SEEDED_RNG();
  run_dense_against_model(dense_config(DenseMethod::kH2o, 24), 90, rng);
  DenseKvConfig c = dense_config(DenseMethod::kH2o, 20);
  c.heavy_ratio = 0.25f;
  run_dense_against_model(c, 70, rng);
}

TEST_CASE("R-KV compresses to the budget by importance minus redundancy every buffer", "[baselines]") {
  TT_SEEDED_RNG();
  run_dense_against_model(dense_config(DenseMethod::kRkv, 24), 100, rng);
}

TEST_CASE("a pinned prefix (the prompt) is never evicted and not counted against the budget", "[baselines]") {
  TT_SEEDED_RNG();
  for (DenseMethod m : {DenseMethod::kStreamingLlm, DenseMethod::kH2o, DenseMethod::kRkv}) {
    INFO("method " << to_string(m));
    DenseKvConfig c = dense_config(m, 20);
    c.pinned_prefix = 13;
    run_dense_against_model(c, 90, rng);
  }
}

TEST_CASE("dense baselines: configurations are validated with the bad value named", "[baselines]") {
  auto refused = [](DenseKvConfig c, const std::string& needle) {
    const Status s = c.validate();
    INFO(s.to_string());
    CHECK(!s.is_ok());
    CHECK(s.message().find(needle) != std::string::npos);
    CHECK_THROWS_AS(DenseKvCache(c), ConfigError);
  };
  DenseKvConfig c = dense_config(DenseMethod::kH2o, 32);
  c.token_budget = 0;
  refused(c, "token_budget 0");
  c = dense_config(DenseMethod::kFullKv, 0);
  c.token_budget = 5;
  refused(c, "token_budget 5");
  c = dense_config(DenseMethod::kStreamingLlm, 8);
  c.sink_tokens = 8;
  refused(c, "sink_tokens 8");
  c = dense_config(DenseMethod::kH2o, 32);
  c.heavy_ratio = 1.0f;
  refused(c, "heavy_ratio");
  c = dense_config(DenseMethod::kRkv, 32);
  c.rkv_window = 0;
  refused(c, "rkv_window 0");
  c = dense_config(DenseMethod::kRkv, 32);
  c.rkv_lambda = std::nanf("");
  refused(c, "rkv_lambda");
  c = dense_config(DenseMethod::kFullKv, 0);
  c.softmax_scale = -1.0f;
  refused(c, "softmax_scale");
  c = dense_config(DenseMethod::kFullKv, 0);
  c.shape.num_q_heads = 5;
  refused(c, "num_q_heads 5");
  c = dense_config(DenseMethod::kFullKv, 0);
  c.max_tokens = 0;
  refused(c, "max_tokens 0");
}

namespace {

/// Decodes on two caches in lockstep; `a` additionally sees refused calls, which must change
/// nothing: afterwards both decode bit for bit the same.
template <class C, class Config>
void check_refusals_change_nothing(const Config& cfg, std::mt19937_64& rng) {
  C a(cfg), b(cfg);
  const CacheShape sh = cfg.shape;
  std::vector<float> oa(sh.q_size()), ob(sh.q_size());
  auto full_token = [&](const TokenData& t) {
    REQUIRE(a.begin_token(0).is_ok());
    REQUIRE(b.begin_token(0).is_ok());
    for (int l = 0; l < sh.num_layers; ++l) {
      REQUIRE(a.append(0, l, t.k[static_cast<std::size_t>(l)], t.v[static_cast<std::size_t>(l)]).is_ok());
      REQUIRE(b.append(0, l, t.k[static_cast<std::size_t>(l)], t.v[static_cast<std::size_t>(l)]).is_ok());
      REQUIRE(a.attend(0, l, t.q[static_cast<std::size_t>(l)], oa).is_ok());
      REQUIRE(b.attend(0, l, t.q[static_cast<std::size_t>(l)], ob).is_ok());
      REQUIRE(tt::same_bits(oa, ob));
    }
    REQUIRE(a.end_token(0).is_ok());
    REQUIRE(b.end_token(0).is_ok());
  };
  for (int i = 0; i < 40; ++i) full_token(random_token(rng, sh));
  const TokenData t = random_token(rng, sh);
  // Protocol violations before begin_token.
  CHECK(a.append(0, 0, t.k[0], t.v[0]).code() == StatusCode::kInvalidArgument);
  CHECK(a.attend(0, 0, t.q[0], oa).code() == StatusCode::kInvalidArgument);
  CHECK(a.end_token(0).code() == StatusCode::kInvalidArgument);
  CHECK(a.begin_token(1).code() == StatusCode::kOutOfRange);
  REQUIRE(a.begin_token(0).is_ok());
  REQUIRE(b.begin_token(0).is_ok());
  CHECK(a.begin_token(0).code() == StatusCode::kInvalidArgument);            // twice
  CHECK(a.attend(0, 0, t.q[0], oa).code() == StatusCode::kInvalidArgument);  // before its append
  CHECK(a.end_token(0).code() == StatusCode::kInvalidArgument);              // no layer appended
  // Bad K/V: NaN, Inf, beyond FP16, wrong shapes, a layer out of range.
  for (float bad : {std::nanf(""), INFINITY, -70000.0f}) {
    std::vector<float> k = t.k[0];
    k[static_cast<std::size_t>(tt::uniform_int(rng, 0, static_cast<int>(k.size()) - 1))] = bad;
    CHECK(a.append(0, 0, k, t.v[0]).code() == StatusCode::kNonFinite);
    CHECK(a.append(0, 0, t.v[0], k).code() == StatusCode::kNonFinite);
  }
  const std::vector<float> short_k(t.k[0].begin(), t.k[0].end() - 1);
  CHECK(a.append(0, 0, short_k, t.v[0]).code() == StatusCode::kShapeMismatch);
  CHECK(a.append(0, sh.num_layers, t.k[0], t.v[0]).code() == StatusCode::kOutOfRange);
  for (C* c : {&a, &b}) REQUIRE(c->append(0, 0, t.k[0], t.v[0]).is_ok());
  CHECK(a.append(0, 0, t.k[0], t.v[0]).code() == StatusCode::kInvalidArgument);  // twice
  std::vector<float> nan_q = t.q[0];
  nan_q[1] = std::nanf("");
  CHECK(a.attend(0, 0, nan_q, oa).code() == StatusCode::kNonFinite);
  std::vector<float> short_out(sh.q_size() - 1);
  CHECK(a.attend(0, 0, t.q[0], short_out).code() == StatusCode::kShapeMismatch);
  if (sh.num_layers > 1) CHECK(a.end_token(0).code() == StatusCode::kInvalidArgument);  // layer 1 missing
  REQUIRE(a.attend(0, 0, t.q[0], oa).is_ok());
  REQUIRE(b.attend(0, 0, t.q[0], ob).is_ok());
  REQUIRE(tt::same_bits(oa, ob));
  for (int l = 1; l < sh.num_layers; ++l) {
    for (C* c : {&a, &b})
      REQUIRE(c->append(0, l, t.k[static_cast<std::size_t>(l)], t.v[static_cast<std::size_t>(l)]).is_ok());
    REQUIRE(a.attend(0, l, t.q[static_cast<std::size_t>(l)], oa).is_ok());
    REQUIRE(b.attend(0, l, t.q[static_cast<std::size_t>(l)], ob).is_ok());
    REQUIRE(tt::same_bits(oa, ob));
  }
  REQUIRE(a.end_token(0).is_ok());
  REQUIRE(b.end_token(0).is_ok());
  for (int i = 0; i < 40; ++i) full_token(random_token(rng, sh));
  const CacheReport ra = a.report(0), rb = b.report(0);
  CHECK(ra.positions == rb.positions);
  CHECK(ra.live_tokens == rb.live_tokens);
  CHECK(ra.held_bytes == rb.held_bytes);
  CHECK(ra.tokens_evicted == rb.tokens_evicted);
}

}  // namespace

TEST_CASE("baselines refuse bad input and protocol violations and change nothing", "[baselines]") {
  TT_SEEDED_RNG();
  for (DenseMethod m : {DenseMethod::kFullKv, DenseMethod::kStreamingLlm, DenseMethod::kH2o, DenseMethod::kRkv}) {
    INFO("method " << to_string(m));
    DenseKvConfig c = dense_config(m, 24);
    c.shape.num_sequences = 1;
    check_refusals_change_nothing<DenseKvCache>(c, rng);
  }
  KiviConfig k;
  k.shape = {1, 2, 2, 4, 32};
  k.max_tokens = 200;
  k.residual = 32;
  check_refusals_change_nothing<KiviCache>(k, rng);
}

// ---- KIVI --------------------------------------------------------------------------------------

namespace {

/// KIVI's asymmetric quantization of one group, written from the paper: min/max, FP16 scale and
/// min, codes rounded to nearest and clamped, dequantized as code * scale + min.
std::vector<float> kivi_model_group(const std::vector<float>& x, int bits) {
  const float mn = *std::min_element(x.begin(), x.end());
  const float mx = *std::max_element(x.begin(), x.end());
  const float s = fp16_round((mx - mn) / static_cast<float>((1 << bits) - 1));
  const float m = fp16_round(mn);
  std::vector<float> out;
  for (float xi : x) {
    double q = s > 0 ? std::round((xi - m) / s) : 0.0;
    q = std::clamp(q, 0.0, static_cast<double>((1 << bits) - 1));
    out.push_back(static_cast<float>(q) * s + m);
  }
  return out;
}

}  // namespace

TEST_CASE("KIVI quantizes keys per channel and values per token behind an FP16 residual", "[baselines]") {
  TT_SEEDED_RNG();
  for (int bits : {2, 4}) {
    KiviConfig cfg;
    cfg.shape = {1, 2, 2, 6, 32};
    cfg.max_tokens = 300;
    cfg.bits = bits;
    cfg.group_size = 16;
    cfg.residual = 32;
    INFO("bits " << bits);
    KiviCache cache(cfg);
    const CacheShape sh = cfg.shape;
    const int d = sh.head_dim, G = cfg.group_size, R = cfg.residual;
    // Model per stream: raw FP16-rounded keys/values and what KIVI attends to.
    std::vector<std::vector<std::vector<float>>> raw_k(4), raw_v(4), att_k(4), att_v(4);
    double worst = 0;
    int bad = 0;
    for (int pos = 0; pos < 150; ++pos) {
      const TokenData t = random_token(rng, sh);
      REQUIRE(cache.begin_token(0).is_ok());
      for (int l = 0; l < sh.num_layers; ++l) {
        REQUIRE(cache.append(0, l, t.k[static_cast<std::size_t>(l)], t.v[static_cast<std::size_t>(l)]).is_ok());
        std::vector<std::vector<MToken>> toks(static_cast<std::size_t>(sh.num_kv_heads));
        std::vector<std::vector<MToken>*> heads;
        for (int h = 0; h < sh.num_kv_heads; ++h) {
          const std::size_t st = static_cast<std::size_t>(l * sh.num_kv_heads + h);
          std::vector<float> k(static_cast<std::size_t>(d)), v(static_cast<std::size_t>(d));
          for (int c = 0; c < d; ++c) {
            k[static_cast<std::size_t>(c)] =
                fp16_round(t.k[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * d + c)]);
            v[static_cast<std::size_t>(c)] =
                fp16_round(t.v[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * d + c)]);
          }
          raw_k[st].push_back(k);
          raw_v[st].push_back(v);
          att_k[st].push_back(k);
          att_v[st].push_back(v);
          const int n = pos + 1;
          if (n % R == 0) {  // the residual is full: its R keys are quantized, per channel in groups of G
            for (int g0 = n - R; g0 < n; g0 += G) {
              for (int c = 0; c < d; ++c) {
                std::vector<float> x;
                for (int i = 0; i < G; ++i)
                  x.push_back(raw_k[st][static_cast<std::size_t>(g0 + i)][static_cast<std::size_t>(c)]);
                const auto q = kivi_model_group(x, bits);
                for (int i = 0; i < G; ++i)
                  att_k[st][static_cast<std::size_t>(g0 + i)][static_cast<std::size_t>(c)] =
                      q[static_cast<std::size_t>(i)];
              }
            }
          }
          if (n > R) {  // the value leaving the FP16 window is quantized per token
            const int j = n - R - 1;
            for (int g = 0; g < d / G; ++g) {
              std::vector<float> x(raw_v[st][static_cast<std::size_t>(j)].begin() + g * G,
                                   raw_v[st][static_cast<std::size_t>(j)].begin() + (g + 1) * G);
              const auto q = kivi_model_group(x, bits);
              std::copy(q.begin(), q.end(), att_v[st][static_cast<std::size_t>(j)].begin() + g * G);
            }
          }
          for (int j = 0; j < n; ++j) {
            MToken m;
            m.pos = j;
            m.k = att_k[st][static_cast<std::size_t>(j)];
            m.v = att_v[st][static_cast<std::size_t>(j)];
            toks[static_cast<std::size_t>(h)].push_back(m);
          }
          // What the cache attends to equals the model, within one FP32 rounding of code * s + m.
          std::vector<float> ck(static_cast<std::size_t>(d)), cv(static_cast<std::size_t>(d));
          for (int j = 0; j < n; j += 7) {
            cache.read_token(0, l, h, j, ck, cv);
            for (int c = 0; c < d; ++c) {
              REQUIRE(ck[static_cast<std::size_t>(c)] ==
                      Approx(att_k[st][static_cast<std::size_t>(j)][static_cast<std::size_t>(c)]).margin(1e-6));
              REQUIRE(cv[static_cast<std::size_t>(c)] ==
                      Approx(att_v[st][static_cast<std::size_t>(j)][static_cast<std::size_t>(c)]).margin(1e-6));
            }
          }
        }
        for (auto& x : toks) heads.push_back(&x);
        std::vector<float> out(sh.q_size(), std::nanf(""));
        REQUIRE(cache.attend(0, l, t.q[static_cast<std::size_t>(l)], out).is_ok());
        bad += check_attention(sh, t.q[static_cast<std::size_t>(l)], out, heads, worst);
      }
      REQUIRE(cache.end_token(0).is_ok());
    }
    CHECK(bad == 0);
    // Memory: 150 tokens = 4 key flushes (128 keys quantized) + 22 in the residual; 118 values
    // quantized + 32 in FP16. Per stream: codes (128 + 118) rows, key min/scale per channel per
    // group of 16 (8 groups), value min/scale per token per group (2 each), FP16 rows 54.
    const CacheReport r = cache.report(0);
    const std::int64_t row = d * bits / 8;
    const std::int64_t per_stream = (128 + 118) * row + 8 * d * 4 + 118 * (d / G) * 4 + (22 + 32) * d * 2;
    CHECK(r.held_bytes == per_stream * sh.streams_per_sequence());
    CHECK(r.positions == 150);
    CHECK(r.held_ratio() < 0.6);
    CHECK(r.eviction_calls == 0);
  }
}
