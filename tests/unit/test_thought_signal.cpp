// The thought signal inside ThinKvCache: sparsity is computed only when it is due, i.e. on refresh
// steps (positive multiples of tau) and for the layers of L*; everywhere else layer_sparsity()
// stays NaN (the attention was asked for no sparsity). The refresh classifies the mean of the L*
// values that were recorded.

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "test_util.hpp"
#include "thinkv/thinkv_cache.hpp"

using thinkv::CacheMode;
using thinkv::ThoughtType;

namespace {

constexpr int kLayers = 5;
constexpr int kTau = 32;
const std::vector<int> kLstar = {1, 3};

thinkv::ThinKvConfig signal_config(CacheMode mode) {
  thinkv::ThinKvConfig c;
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

}  // namespace

TEST_CASE("ThinKvCache computes sparsity only on refresh steps and only for L*",
          "[classifier][cache]") {
  TT_SEEDED_RNG();
  std::normal_distribution<float> normal;
  for (CacheMode mode : {CacheMode::kTbq, CacheMode::kThinKv, CacheMode::kFull}) {
    thinkv::ThinKvCache<> cache(signal_config(mode));
    const auto& cfg = cache.config();
    const bool classifies = mode != CacheMode::kFull;  // FullKV runs uncalibrated: no signal at all
    std::vector<float> k(static_cast<std::size_t>(cfg.num_kv_heads * cfg.head_dim)), v(k.size());
    std::vector<float> q(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim)), out(q.size());
    std::int64_t refresh_steps = 0, finite_values = 0;
    for (int p = 0; p < 200; ++p) {
      for (int seq = 0; seq < cfg.num_sequences; ++seq) {
        INFO("mode " << thinkv::to_string(mode) << ", sequence " << seq << ", position " << p);
        REQUIRE(cache.position(seq) == p);
        REQUIRE(cache.begin_token(seq).is_ok());
        const bool refresh = p > 0 && p % kTau == 0;
        if (classifies) CHECK(cache.tracker(seq).is_refresh_step(p) == refresh);
        // Sharper queries on some tokens spread the sparsity over [0,1].
        const float sharp = (p / kTau) % 2 == 0 ? 0.5f : 4.0f;
        for (int l = 0; l < kLayers; ++l) {
          for (auto& x : k) x = normal(rng);
          for (auto& x : v) x = normal(rng);
          for (auto& x : q) x = normal(rng) * sharp;
          REQUIRE(cache.append(seq, l, k, v).is_ok());
          CHECK(cache.wants_sparsity(seq, l) == (classifies && refresh && in_lstar(l)));
          REQUIRE(cache.attend(seq, l, q, out).is_ok());
        }
        const std::vector<float> sp(cache.layer_sparsity(seq).begin(),
                                    cache.layer_sparsity(seq).end());
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
          CHECK(cache.tracker(seq).current() ==
                cfg.classifier.classify(sum / static_cast<float>(kLstar.size())));
        } else {
          CHECK(cache.tracker(seq).stats().refreshes == refreshes_before);
        }
      }
    }
    INFO("mode " << thinkv::to_string(mode));
    CHECK(cache.stats().refreshes == refresh_steps);
    if (classifies) {
      CHECK(refresh_steps == 2 * (199 / kTau));  // positions 32, 64, ..., 192, both sequences
      CHECK(finite_values == refresh_steps * static_cast<std::int64_t>(kLstar.size()));
    } else {
      CHECK(refresh_steps == 0);
    }
  }
}

TEST_CASE("ThinKvCache records every layer's sparsity on every step when tracing",
          "[classifier][cache]") {
  TT_SEEDED_RNG();
  std::normal_distribution<float> normal;
  thinkv::ThinKvConfig c = signal_config(CacheMode::kFull);
  c.trace_all_layers = true;
  thinkv::ThinKvCache<> cache(c);
  std::vector<float> k(static_cast<std::size_t>(c.num_kv_heads * c.head_dim)), v(k.size());
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads * c.head_dim)), out(q.size());
  for (int p = 0; p < 70; ++p) {
    REQUIRE(cache.begin_token(0).is_ok());
    for (int l = 0; l < kLayers; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      for (auto& x : q) x = normal(rng) * 2.0f;
      REQUIRE(cache.append(0, l, k, v).is_ok());
      REQUIRE(cache.attend(0, l, q, out).is_ok());
    }
    for (int l = 0; l < kLayers; ++l) {
      const float s = cache.layer_sparsity(0)[static_cast<std::size_t>(l)];
      INFO("position " << p << " layer " << l << " sparsity " << s);
      CHECK(s >= 0.0f);
      CHECK(s <= 1.0f);
    }
    REQUIRE(cache.end_token(0).is_ok());
  }
}
