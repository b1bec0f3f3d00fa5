// The thought signal inside ThinKvCache: sparsity is computed only when it is due, i.e. on refresh
// steps (positive multiples of tau) and for the layers of L*; everywhere else layer_sparsity()
// stays NaN (the attention was asked for no sparsity). The refresh classifies the mean of the L*
// values that were recorded, by the thresholds written out here (not by the classifier under
// test). The values themselves are checked against an oracle computed in FP64 from the definition
// (share of softmax probabilities below 1 % of the row maximum, mean over query heads, GQA) over
// the keys as BF16 pages store them.

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "test_util.hpp"
#include "thinkv/formats/bf16.hpp"
#include "../../examples/decoder/thinkv_spec.hpp"
#include "thinkv/thinkv_cache.hpp"

using thinkv::ThoughtType;
using thinkv::decoder::CacheMode;
using thinkv::decoder::ThinKvSpec;

namespace {

constexpr int kLayers = 5;
constexpr int kTau = 32;
const std::vector<int> kLstar = {1, 3};

ThinKvSpec signal_config(CacheMode mode) {
  ThinKvSpec c;
  c.mode = mode;
  c.num_sequences = 2;
  c.num_layers = kLayers;
  c.num_kv_heads = 2;
  c.num_q_heads = 4;
  c.head_dim = 16;
  c.group_size = 8;
  c.block_size = 16;
  c.max_tokens = 300;
  c.segment_len = 64;
  c.retention = thinkv::RetentionSchedule({32, 16, 8, 4});
  c.token_budget = mode == CacheMode::kThinKv ? 160 : 0;
  c.precision = thinkv::kR8E4T2;
  c.classifier = thinkv::ThoughtClassifier::three_types(0.3f, 0.6f, kLstar, kTau, kLayers);
  return c;
}

bool in_lstar(int layer) { return std::set<int>(kLstar.begin(), kLstar.end()).count(layer) != 0; }

// three_types(0.3, 0.6): E below 0.3, R in [0.3, 0.6), T from 0.6 (T > R > E in sparsity).
ThoughtType expected_type(float signal) {
  if (signal < 0.3f) return ThoughtType::kExecution;
  if (signal < 0.6f) return ThoughtType::kReasoning;
  return ThoughtType::kTransition;
}

// The layer's sparsity by definition, in FP64: for each query head h (KV head h / (n_q / n_kv)),
// s_j = q_h . k_j / sqrt(d) over every stored key j, p_j / p_max = exp(s_j - max s); the share of
// j with p_j < 0.01 p_max, averaged over the heads. `ambiguous` counts, over the heads, the keys
// within 1e-3 of the threshold, where FP32 and FP64 may disagree.
struct OracleSparsity {
  double value = 0.0;
  double tolerance = 0.0;
};
OracleSparsity oracle_sparsity(const std::vector<float>& q, const std::vector<std::vector<float>>& keys, int n_q,
                               int n_kv, int d) {
  const int n = static_cast<int>(keys.size());
  const double log_threshold = std::log(0.01);
  double sum = 0.0, ambiguous = 0.0;
  for (int h = 0; h < n_q; ++h) {
    const int kvh = h / (n_q / n_kv);
    std::vector<double> s(static_cast<std::size_t>(n));
    double m = -INFINITY;
    for (int j = 0; j < n; ++j) {
      double dot = 0.0;
      for (int c = 0; c < d; ++c) {
        dot += static_cast<double>(q[static_cast<std::size_t>(h * d + c)]) *
               static_cast<double>(keys[static_cast<std::size_t>(j)][static_cast<std::size_t>(kvh * d + c)]);
      }
      s[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
      m = std::max(m, s[static_cast<std::size_t>(j)]);
    }
    int below = 0;
    for (int j = 0; j < n; ++j) {
      const double x = s[static_cast<std::size_t>(j)] - m - log_threshold;
      below += x < 0.0;
      ambiguous += std::abs(x) < 1e-3;
    }
    sum += static_cast<double>(below) / n;
  }
  return {sum / n_q, (ambiguous / n) / n_q + 1e-6};
}

}  // namespace

TEST_CASE("ThinKvCache computes sparsity only on refresh steps and only for L*", "[classifier][cache]") {
  TT_SEEDED_RNG();
  std::normal_distribution<float> normal;
  std::set<ThoughtType> types_seen;  // over both classifying modes
  for (CacheMode mode : {CacheMode::kTbq, CacheMode::kThinKv, CacheMode::kFull}) {
    thinkv::decoder::with_cache(signal_config(mode), [&](auto& cache) {
      const auto& cfg = cache.config();
      const bool classifies = mode != CacheMode::kFull;  // FullKV runs uncalibrated: no signal at all
      std::vector<float> k(static_cast<std::size_t>(cfg.num_kv_heads * cfg.head_dim)), v(k.size());
      std::vector<float> q(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim)), out(q.size());
      std::int64_t refresh_steps = 0, finite_values = 0;
      for (int p = 0; p < 200; ++p) {
        for (int seq = 0; seq < cfg.num_sequences; ++seq) {
          INFO("mode " << thinkv::decoder::to_string(mode) << ", sequence " << seq << ", position " << p);
          REQUIRE(cache.position(seq) == p);
          REQUIRE(cache.begin_token(seq).is_ok());
          const bool refresh = p > 0 && p % kTau == 0;
          if (classifies) CHECK(cache.tracker(seq).is_refresh_step(p) == refresh);
          // Query scales by window and sequence spread the sparsity over [0,1] (all three types).
          constexpr float kSharp[] = {0.3f, 1.4f, 2.0f, 4.0f};
          const float sharp = kSharp[(p / kTau + seq) % 4];
          for (int l = 0; l < kLayers; ++l) {
            for (auto& x : k) x = normal(rng);
            for (auto& x : v) x = normal(rng);
            for (auto& x : q) x = normal(rng) * sharp;
            REQUIRE(cache.append(seq, l, k, v).is_ok());
            CHECK(cache.wants_sparsity(seq, l) == (classifies && refresh && in_lstar(l)));
            REQUIRE(cache.attend(seq, l, q, out).is_ok());
          }
          const std::vector<float> sp(cache.layer_sparsity(seq).begin(), cache.layer_sparsity(seq).end());
          REQUIRE(static_cast<int>(sp.size()) == kLayers);
          float sum = 0.0f;
          for (int l = 0; l < kLayers; ++l) {
            INFO("layer " << l << " sparsity " << sp[static_cast<std::size_t>(l)]);
            if (classifies && refresh && in_lstar(l)) {
              CHECK(std::isfinite(sp[static_cast<std::size_t>(l)]));
              CHECK(sp[static_cast<std::size_t>(l)] >= 0.0f);
              CHECK(sp[static_cast<std::size_t>(l)] <= 1.0f);
              sum += sp[static_cast<std::size_t>(l)];
              ++finite_values;
            } else {
              CHECK(std::isnan(sp[static_cast<std::size_t>(l)]));
            }
          }
          const std::int64_t refreshes_before = cache.tracker(seq).stats().refreshes;
          REQUIRE(cache.end_token(seq).is_ok());
          if (classifies && refresh) {
            ++refresh_steps;
            // The refresh classified exactly the mean of the recorded L* values.
            CHECK(cache.tracker(seq).stats().refreshes == refreshes_before + 1);
            CHECK(cache.tracker(seq).current() == expected_type(sum / static_cast<float>(kLstar.size())));
            types_seen.insert(cache.tracker(seq).current());
          } else {
            CHECK(cache.tracker(seq).stats().refreshes == refreshes_before);
          }
        }
      }
      INFO("mode " << thinkv::decoder::to_string(mode));
      CHECK(cache.stats().refreshes == refresh_steps);
      if (classifies) {
        CHECK(refresh_steps == 2 * (199 / kTau));  // positions 32, 64, ..., 192, both sequences
        CHECK(finite_values == refresh_steps * static_cast<std::int64_t>(kLstar.size()));
      } else {
        CHECK(refresh_steps == 0);
      }
    });
  }
  CHECK(types_seen.size() == 3);  // the refreshes reached every band of the classifier
}

TEST_CASE("ThinKvCache records every layer's sparsity on every step when tracing, as defined", "[classifier][cache]") {
  TT_SEEDED_RNG();
  std::normal_distribution<float> normal;
  thinkv::ThinKvConfig c = signal_config(CacheMode::kFull).config();
  c.trace_all_layers = true;
  thinkv::FullKvCache<> cache(c);
  std::vector<float> k(static_cast<std::size_t>(c.num_kv_heads * c.head_dim)), v(k.size());
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads * c.head_dim)), out(q.size());
  // Every key as the BF16 pages hold it, per layer (FullKV: nothing is evicted).
  std::vector<std::vector<std::vector<float>>> stored(kLayers);
  double spread_min = 1.0, spread_max = 0.0;
  for (int p = 0; p < 70; ++p) {
    REQUIRE(cache.begin_token(0).is_ok());
    std::vector<float> queries[kLayers];
    for (int l = 0; l < kLayers; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      // Query scales from 0.5 to 4 spread the sparsity over [0, 1].
      const float sharp = 0.5f + 3.5f * static_cast<float>((p + l) % 8) / 7.0f;
      for (auto& x : q) x = normal(rng) * sharp;
      REQUIRE(cache.append(0, l, k, v).is_ok());
      REQUIRE(cache.attend(0, l, q, out).is_ok());
      std::vector<float> kb(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) { kb[i] = thinkv::decode_bf16(thinkv::encode_bf16(k[i])); }
      stored[static_cast<std::size_t>(l)].push_back(std::move(kb));
      queries[l] = q;
    }
    for (int l = 0; l < kLayers; ++l) {
      const float s = cache.layer_sparsity(0)[static_cast<std::size_t>(l)];
      const OracleSparsity o =
          oracle_sparsity(queries[l], stored[static_cast<std::size_t>(l)], c.num_q_heads, c.num_kv_heads, c.head_dim);
      INFO("position " << p << " layer " << l << " sparsity " << s << ", oracle " << o.value << " +- " << o.tolerance);
      CHECK(std::abs(static_cast<double>(s) - o.value) <= o.tolerance);
      spread_min = std::min(spread_min, o.value);
      spread_max = std::max(spread_max, o.value);
    }
    REQUIRE(cache.end_token(0).is_ok());
  }
  // The inputs exercise the signal's range (a check on the test, not the cache).
  CHECK(spread_min < 0.2);
  CHECK(spread_max > 0.8);
}
