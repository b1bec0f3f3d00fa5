// ThoughtClassifier policy, its POD lowering, and ThoughtTracker driving a cache with
// group-aligned refreshes.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <type_traits>
#include <vector>

#include "thinkv/paged_kv_cache.hpp"
#include "thinkv/thought/classifier.hpp"

#include "test_util.hpp"

using thinkv::ThoughtClassifier;
using thinkv::ThoughtType;

namespace {
std::string error_of(const std::vector<float>& th, const std::vector<int>& layers, int tau,
                     const std::vector<ThoughtType>& bands, int num_layers) {
  try {
    ThoughtClassifier c(th, layers, tau, bands, num_layers);
  } catch (const thinkv::ConfigError& e) { return e.what(); }
  return "";
}
const std::vector<ThoughtType> kERT = {ThoughtType::kExecution, ThoughtType::kReasoning, ThoughtType::kTransition};
}  // namespace

static_assert(std::is_trivially_copyable_v<thinkv::ThoughtClassifierDesc>);
static_assert(std::is_standard_layout_v<thinkv::ThoughtClassifierDesc>);

TEST_CASE("default band mapping: least sparse E, middle R, most sparse T, ties go up", "[classifier]") {
  const auto c = ThoughtClassifier::three_types(0.3f, 0.6f, {1, 3}, 128, 5);
  CHECK(c.classify(0.0f) == ThoughtType::kExecution);
  CHECK(c.classify(std::nextafter(0.3f, 0.0f)) == ThoughtType::kExecution);
  CHECK(c.classify(0.3f) == ThoughtType::kReasoning);
  CHECK(c.classify(std::nextafter(0.6f, 0.0f)) == ThoughtType::kReasoning);
  CHECK(c.classify(0.6f) == ThoughtType::kTransition);
  CHECK(c.classify(1.0f) == ThoughtType::kTransition);
  INFO(c);
  CHECK(c.to_string().find("E|0.3") != std::string::npos);
}

TEST_CASE("uncalibrated classifier labels everything R", "[classifier]") {
  const ThoughtClassifier c;
  CHECK(c.num_bands() == 1);
  CHECK_FALSE(c.needs_signal());
  for (float s : {0.0f, 0.5f, 1.0f}) CHECK(c.classify(s) == ThoughtType::kReasoning);
}

TEST_CASE("lowered descriptor classifies exactly like the policy", "[classifier]") {
  const unsigned seed = static_cast<unsigned>(tt::base_seed());
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const auto c = ThoughtClassifier::three_types(0.25f, 0.7f, {0, 2, 63, 64, 200}, 64, 256);
  const auto d = c.lower();
  CHECK(d.num_bands == 3);
  CHECK(d.tau == 64);
  CHECK(d.num_selected_layers == 5);
  CHECK(d.layer_mask[0] == ((1ull << 0) | (1ull << 2) | (1ull << 63)));
  CHECK(d.layer_mask[1] == 1ull);
  CHECK(d.layer_mask[3] == (1ull << (200 - 192)));
  for (int i = 0; i < 10000; ++i) {
    const float s = (i < 4) ? std::vector<float>{0.25f, 0.7f, 0.0f, 1.0f}[static_cast<std::size_t>(i)] : u(rng);
    REQUIRE(thinkv::classify(d, s) == c.classify(s));
  }
}

TEST_CASE("classifier validation names the bad value", "[classifier]") {
  CHECK(error_of({0.6f, 0.3f}, {0}, 128, kERT, 4).find("strictly ascending") != std::string::npos);
  CHECK(error_of({0.0f, 0.3f}, {0}, 128, kERT, 4).find("outside the open interval") != std::string::npos);
  CHECK(error_of({0.3f, 1.5f}, {0}, 128, kERT, 4).find("1.5") != std::string::npos);
  CHECK(error_of({0.3f}, {0}, 128, kERT, 4).find("need exactly 2") != std::string::npos);
  CHECK(error_of({0.3f, 0.6f}, {4}, 128, kERT, 4).find("layer 4 in L* is out of range; allowed: 0..3") !=
        std::string::npos);
  CHECK(error_of({0.3f, 0.6f}, {1, 1}, 128, kERT, 4).find("listed twice") != std::string::npos);
  CHECK(error_of({0.3f, 0.6f}, {1}, 0, kERT, 4).find("tau 0") != std::string::npos);
  CHECK(
      error_of({0.3f, 0.6f}, {1}, 128, {ThoughtType::kExecution, ThoughtType::kExecution, ThoughtType::kTransition}, 4)
          .find("both map to thought type E") != std::string::npos);
  CHECK(error_of({0.3f, 0.6f}, {}, 128, kERT, 4).find("empty") != std::string::npos);
  CHECK(error_of({0.3f, 0.6f}, {0}, 128, kERT, 4).empty());
}

TEST_CASE("refresh period must align with quantization groups", "[classifier]") {
  const auto c100 = ThoughtClassifier::three_types(0.3f, 0.6f, {0}, 100, 2);
  const thinkv::Status s = c100.check_alignment(16);
  CHECK(s.code() == thinkv::StatusCode::kInvalidArgument);
  CHECK(s.message().find("tau 100 is not a multiple of group_size 16") != std::string::npos);
  CHECK(ThoughtClassifier::three_types(0.3f, 0.6f, {0}, 128, 2).check_alignment(16).is_ok());
  CHECK(ThoughtClassifier::three_types(0.3f, 0.6f, {0}, 8, 2).check_alignment(8).is_ok());
}

TEST_CASE("signal is the mean over L* only", "[classifier]") {
  const auto c = ThoughtClassifier::three_types(0.3f, 0.6f, {1, 3}, 128, 5);
  const std::vector<float> per_layer = {0.9f, 0.2f, 0.9f, 0.4f, 0.9f};
  CHECK(c.signal(per_layer) == Approx(0.3f));
  CHECK(c.uses_layer(3));
  CHECK_FALSE(c.uses_layer(0));
}

TEST_CASE("tracker holds the type between refreshes and counts", "[classifier]") {
  thinkv::ThoughtTracker tr(ThoughtClassifier::three_types(0.3f, 0.6f, {0}, 16, 1));
  CHECK(tr.current() == ThoughtType::kReasoning);
  const std::vector<float> hi = {0.9f}, lo = {0.1f}, mid = {0.5f};
  // Position 0 is not a refresh step (the first token sees only itself): 0..15 stay R.
  CHECK_FALSE(tr.is_refresh_step(0));
  CHECK(tr.refresh(0, hi).code() == thinkv::StatusCode::kInvalidArgument);
  for (int p = 0; p < 16; ++p) CHECK(tr.type_for(p) == ThoughtType::kReasoning);
  (void)tr.type_for(16);
  REQUIRE(tr.refresh(16, hi).is_ok());  // -> T
  CHECK(tr.current() == ThoughtType::kTransition);
  for (int p = 17; p < 32; ++p) CHECK(tr.type_for(p) == ThoughtType::kTransition);
  // A refresh on a non-refresh step is refused and changes nothing.
  const auto before = tr.stats();
  CHECK(tr.refresh(21, lo).code() == thinkv::StatusCode::kInvalidArgument);
  CHECK(tr.stats().refreshes == before.refreshes);
  CHECK(tr.current() == ThoughtType::kTransition);
  // Bad signals are refused too.
  (void)tr.type_for(32);
  CHECK(tr.refresh(32, std::vector<float>{NAN}).code() == thinkv::StatusCode::kNonFinite);
  CHECK(tr.refresh(32, std::vector<float>{}).code() == thinkv::StatusCode::kShapeMismatch);
  CHECK(tr.current() == ThoughtType::kTransition);
  REQUIRE(tr.refresh(32, lo).is_ok());  // -> E
  for (int p = 33; p < 48; ++p) (void)tr.type_for(p);
  (void)tr.type_for(48);
  REQUIRE(tr.refresh(48, lo).is_ok());  // E again: no change
  (void)tr.type_for(64);
  REQUIRE(tr.refresh(64, mid).is_ok());  // -> R
  const auto& st = tr.stats();
  CHECK(st.refreshes == 4);
  CHECK(st.changes == 3);  // R->T, T->E, E->R
  CHECK(st.refresh_histogram[static_cast<int>(ThoughtType::kTransition)] == 1);
  CHECK(st.refresh_histogram[static_cast<int>(ThoughtType::kExecution)] == 2);
  CHECK(st.refresh_histogram[static_cast<int>(ThoughtType::kReasoning)] == 1);
  // tokens: 0..15 R (16), 16..31 T (16), 32..48 E (17), 64 R (1)
  CHECK(st.tokens[static_cast<int>(ThoughtType::kReasoning)] == 17);
  CHECK(st.tokens[static_cast<int>(ThoughtType::kTransition)] == 16);
  CHECK(st.tokens[static_cast<int>(ThoughtType::kExecution)] == 17);
  CHECK(st.refresh_ns >= 0);
}

TEST_CASE("tracker-driven decoding never mixes thought types in a quantization group", "[classifier][cache]") {
  const unsigned seed = static_cast<unsigned>(tt::base_seed());
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const int g = 8, tau = 32, streams = 3, d = 16;
  thinkv::CacheConfig cfg;
  cfg.num_streams = streams;
  cfg.head_dim = d;
  cfg.group_size = g;
  cfg.block_size = 16;
  cfg.precision = thinkv::kR8E4T2;       // R fp8, E nvfp4, T ternary
  cfg.pool_blocks = {0, 128, 128, 128};  // enough for 600 tokens x 3 streams of one type
  thinkv::PagedKvCache<> cache(cfg);
  const auto cls = ThoughtClassifier::three_types(0.3f, 0.6f, {0}, tau, 1);
  REQUIRE(cls.check_alignment(g).is_ok());
  thinkv::ThoughtTracker tr(cls);
  std::map<int, ThoughtType> expected;  // position -> type decided for it
  std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
  for (int p = 0; p < 600; ++p) {
    const ThoughtType t = tr.type_for(p);
    for (int s = 0; s < streams; ++s) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      const thinkv::Status st = cache.append(s, k, v, t);
      INFO(st);
      REQUIRE(st.is_ok());
    }
    ThoughtType now = t;
    if (tr.is_refresh_step(p)) {
      const std::vector<float> sp = {u(rng)};
      REQUIRE(tr.refresh(p, sp, &now).is_ok());
      for (int s = 0; s < streams; ++s) REQUIRE(cache.relabel_staged(s, now).is_ok());
    }
    expected[p] = now;
  }
  // Every committed token sits in a block of the type decided for its position, and that type
  // is constant over each refresh interval [k*tau, (k+1)*tau).
  for (int s = 0; s < streams; ++s) {
    for (auto r : cache.table().live_slot_list(s)) {
      const int pos = cache.table().slot_position(r);
      INFO("stream " << s << " position " << pos);
      CHECK(cache.table().block_thought(r.block) == expected.at(pos));
      CHECK(expected.at(pos) == expected.at(pos - pos % tau));
      CHECK(cache.table().block_precision(r.block) == cfg.precision.precision_of(expected.at(pos)));
    }
  }
  CHECK(tr.stats().refreshes == (600 - 1) / tau);  // positions tau, 2 tau, ... < 600
}

#include "thinkv/thought/calibration_file.hpp"

TEST_CASE("a calibration file becomes the classifier it describes", "[classifier][calibration]") {
  thinkv::CalibrationFile f;
  f.model_name = "m";
  f.num_layers = 6;
  f.thresholds = {0.35f, 0.72f};
  f.layers = {1, 4, 5};
  f.tau = 64;
  f.num_types = 3;
  REQUIRE(thinkv::validate_calibration(f).is_ok());
  const ThoughtClassifier c = thinkv::classifier_from_calibration(f);
  CHECK(c == ThoughtClassifier::three_types(0.35f, 0.72f, {1, 4, 5}, 64, 6));
  CHECK(c.classify(0.5f) == ThoughtType::kReasoning);
  // A JSON round trip gives the same classifier.
  std::stringstream ss;
  REQUIRE(thinkv::write_calibration_json(ss, f).is_ok());
  thinkv::CalibrationFile g;
  REQUIRE(thinkv::read_calibration_json(ss, "mem", g).is_ok());
  CHECK(thinkv::classifier_from_calibration(g) == c);
  // Two types: E below the threshold, T above.
  f.num_types = 2;
  f.thresholds = {0.5f};
  f.band_types = {ThoughtType::kExecution, ThoughtType::kTransition, ThoughtType::kTransition};
  REQUIRE(thinkv::validate_calibration(f).is_ok());
  const ThoughtClassifier c2 = thinkv::classifier_from_calibration(f);
  CHECK(c2.num_bands() == 2);
  CHECK(c2.classify(0.4f) == ThoughtType::kExecution);
  CHECK(c2.classify(0.6f) == ThoughtType::kTransition);
}
