/// \file test_policies.cpp
/// PrecisionMap (TBQ), RetentionSchedule (TBE) and CacheConfig validation, including the messages
/// a user sees when a configuration is rejected.

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "test_util.hpp"
#include "thinkv/thinkv_cache.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;

namespace {

Precision P(int bits) {
  switch (bits) {
    case 16: return Precision::kBf16;
    case 8: return Precision::kFp8E4M3;
    case 4: return Precision::kNvfp4;
    default: return Precision::kTernary;
  }
}

/// A valid configuration for the default map, small enough to construct caches from.
CacheConfig small_config() {
  CacheConfig c;
  c.num_streams = 2;
  c.head_dim = 32;
  c.group_size = 16;
  c.block_size = 16;
  c.pool_blocks = {0, 0, 4, 4};
  return c;
}

/// The validation message, and that BlockTable and PagedKvCache constructors throw ConfigError
/// carrying exactly that status.
std::string rejected(const CacheConfig& c) {
  const Status s = c.validate();
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  try {
    PagedKvCache<> cache(c);
    FAIL("PagedKvCache accepted an invalid configuration: " << c);
  } catch (const ConfigError& e) {
    CHECK(e.status().code() == s.code());
    CHECK(e.status().message() == s.message());
    CHECK_THAT(std::string(e.what()), Contains(s.message()));
  }
  CHECK_THROWS_AS(BlockTable(c), ConfigError);
  return s.message();
}

}  // namespace

TEST_CASE("PrecisionMap default is R4E4T2", "[policy][precision_map]") {
  const PrecisionMap m;
  CHECK(m.precision_of(ThoughtType::kReasoning) == Precision::kNvfp4);
  CHECK(m.precision_of(ThoughtType::kExecution) == Precision::kNvfp4);
  CHECK(m.precision_of(ThoughtType::kTransition) == Precision::kTernary);
  CHECK(m.to_string() == "R4E4T2");
  CHECK(m == kR4E4T2);
  CHECK(m.uses(Precision::kNvfp4));
  CHECK(m.uses(Precision::kTernary));
  CHECK_FALSE(m.uses(Precision::kBf16));
  CHECK_FALSE(m.uses(Precision::kFp8E4M3));
  CHECK(CacheConfig{}.precision == kR4E4T2);
}

TEST_CASE("PrecisionMap named maps", "[policy][precision_map]") {
  CHECK(kR8E4T2.to_string() == "R8E4T2");
  CHECK(kR8E4T2.precision_of(ThoughtType::kReasoning) == Precision::kFp8E4M3);
  CHECK(kR8E4T2.precision_of(ThoughtType::kExecution) == Precision::kNvfp4);
  CHECK(kR8E4T2.precision_of(ThoughtType::kTransition) == Precision::kTernary);
  CHECK(kR8E8T4.to_string() == "R8E8T4");
  CHECK(kFullKvMap.to_string() == "R16E16T16");
  for (ThoughtType t : kAllThoughtTypes) CHECK(kFullKvMap.precision_of(t) == Precision::kBf16);
  CHECK_FALSE(kR8E4T2 == kR4E4T2);
  // Compile-time construction of valid maps.
  static_assert(PrecisionMap(Precision::kFp8E4M3, Precision::kTernary, Precision::kTernary)
                    .precision_of(ThoughtType::kExecution) == Precision::kTernary);
}

TEST_CASE("PrecisionMap: every ordered map is expressible, every inverted one throws", "[policy][precision_map]") {
  const int widths[] = {16, 8, 4, 2};
  int valid = 0;
  for (int r : widths)
    for (int e : widths)
      for (int t : widths) {
        const bool ordered = r >= e && e >= t;  // the rule, stated independently
        const std::string text = "R" + std::to_string(r) + "E" + std::to_string(e) + "T" + std::to_string(t);
        CAPTURE(text);
        PrecisionMap parsed = kR8E8T4;
        const Status s = PrecisionMap::parse(text, parsed);
        CHECK(s.is_ok() == ordered);
        CHECK(PrecisionMap::check(P(r), P(e), P(t)).is_ok() == ordered);
        if (ordered) {
          ++valid;
          const PrecisionMap m(P(r), P(e), P(t));
          CHECK(m.to_string() == text);
          CHECK(parsed == m);
          CHECK(m.precision_of(ThoughtType::kReasoning) == P(r));
          CHECK(m.precision_of(ThoughtType::kExecution) == P(e));
          CHECK(m.precision_of(ThoughtType::kTransition) == P(t));
          for (int b : widths) CHECK(m.uses(P(b)) == (b == r || b == e || b == t));
        } else {
          CHECK(parsed == kR8E8T4);  // unchanged on error
          CHECK(s.code() == StatusCode::kInvalidArgument);
          CHECK_THROWS_AS(PrecisionMap(P(r), P(e), P(t)), ConfigError);
        }
      }
  CHECK(valid == 20);  // multisets of size 3 over 4 widths
}

TEST_CASE("PrecisionMap: a precision value outside the enum is refused, naming value and thought",
          "[policy][precision_map][bad_input]") {
  const auto bad = static_cast<Precision>(7);
  const Status s = PrecisionMap::check(Precision::kNvfp4, bad, Precision::kTernary);
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Matchers::Contains("unknown precision value 7 for E"));
  CHECK_THAT(s.message(), Catch::Matchers::Contains("allowed: bf16, fp8_e4m3, nvfp4, ternary"));
  CHECK_THROWS_AS(PrecisionMap(bad, Precision::kNvfp4, Precision::kTernary), ConfigError);
}

TEST_CASE("PrecisionMap::parse accepts the documented examples", "[policy][precision_map]") {
  PrecisionMap m = kFullKvMap;
  REQUIRE(PrecisionMap::parse("R4E4T2", m).is_ok());
  CHECK(m == kR4E4T2);
  REQUIRE(PrecisionMap::parse("R8E4T2", m).is_ok());
  CHECK(m == kR8E4T2);
  REQUIRE(PrecisionMap::parse("R16E16T16", m).is_ok());
  CHECK(m == kFullKvMap);
  REQUIRE(PrecisionMap::parse("R8E8T4", m).is_ok());
  CHECK(m == kR8E8T4);
}

TEST_CASE("PrecisionMap::parse rejects unknown widths naming the width and the allowed ones",
          "[policy][precision_map]") {
  for (const char* text : {"R3E4T2", "R4E3T2", "R4E4T3", "R0E4T2", "R32E4T2", "R1E1T1"}) {
    CAPTURE(text);
    PrecisionMap m = kR8E4T2;
    const Status s = PrecisionMap::parse(text, m);
    REQUIRE_FALSE(s.is_ok());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(m == kR8E4T2);
    CHECK_THAT(s.message(), Contains("16, 8, 4, 2"));
    CHECK_THAT(s.message(), Contains(text));
  }
  PrecisionMap m;
  const Status s = PrecisionMap::parse("R3E4T2", m);
  CHECK_THAT(s.message(), Contains("3 bits"));
  CHECK_THAT(s.message(), Contains("for R"));
}

TEST_CASE("PrecisionMap::parse rejects E above R naming both", "[policy][precision_map]") {
  PrecisionMap m = kR8E8T4;
  const Status s = PrecisionMap::parse("R4E8T2", m);
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(m == kR8E8T4);
  CHECK_THAT(s.message(), Contains("E (8 bits)"));
  CHECK_THAT(s.message(), Contains("R (4 bits)"));
  const Status s2 = PrecisionMap::parse("R8E4T8", m);
  REQUIRE_FALSE(s2.is_ok());
  CHECK_THAT(s2.message(), Contains("T (8 bits)"));
  CHECK_THAT(s2.message(), Contains("E (4 bits)"));
}

TEST_CASE("PrecisionMap::parse rejects malformed text and leaves the output unchanged", "[policy][precision_map]") {
  for (const char* text : {"",         "R",          "R4",         "R4E4",    "R4E4T",   "RET",      "r4e4t2",
                           "R4T4E2",   "E4R4T2",     " R4E4T2",    "R4E4T2 ", "R4 E4T2", "R4E4T2T2", "R-4E4T2",
                           "R4.0E4T2", "R16E16T16x", "R99999E4T2", "R+4E4T2", "4E4T2",   "R4E4T2\n", "R4e4T2"}) {
    CAPTURE(text);
    PrecisionMap m = kR8E8T4;
    const Status s = PrecisionMap::parse(text, m);
    CHECK_FALSE(s.is_ok());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(m == kR8E8T4);
    CHECK_FALSE(s.message().empty());
  }
  PrecisionMap m;
  CHECK_THAT(PrecisionMap::parse("R4E4", m).message(), Contains("R<bits>E<bits>T<bits>"));
  CHECK_THAT(PrecisionMap::parse("R4E4T2x", m).message(), Contains("trailing"));
}

TEST_CASE("PrecisionMap constructor throws ConfigError on inverted maps", "[policy][precision_map]") {
  try {
    PrecisionMap m(Precision::kNvfp4, Precision::kFp8E4M3, Precision::kTernary);
    FAIL("accepted R4E8T2: " << m);
  } catch (const ConfigError& e) {
    CHECK(e.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(e.what()), Contains("E (8 bits)") && Contains("R (4 bits)"));
  }
  try {
    PrecisionMap m(Precision::kBf16, Precision::kTernary, Precision::kNvfp4);
    FAIL("accepted R16E2T4: " << m);
  } catch (const ConfigError& e) {
    CHECK_THAT(std::string(e.what()), Contains("T (4 bits)") && Contains("E (2 bits)"));
  }
  // A precision value outside the enum is rejected, not silently stored.
  CHECK_THROWS_AS(PrecisionMap(static_cast<Precision>(7), Precision::kNvfp4, Precision::kTernary), ConfigError);
  CHECK_FALSE(PrecisionMap::check(Precision::kNvfp4, static_cast<Precision>(9), Precision::kTernary).is_ok());
}

TEST_CASE("RetentionSchedule validation", "[policy][retention]") {
  const RetentionSchedule d;
  CHECK(d.levels() == std::vector<int>{64, 32, 16, 8, 4});
  CHECK(d.min_retention() == 4);
  CHECK(d.num_levels() == 5);
  CHECK(d.to_string() == "{64,32,16,8,4}");

  const RetentionSchedule one{1};
  CHECK(one.min_retention() == 1);
  const RetentionSchedule two{100, 3};
  CHECK(two.min_retention() == 3);
  CHECK(two.num_levels() == 2);
  CHECK(RetentionSchedule::check({1000, 999, 1}).is_ok());

  struct Bad {
    std::vector<int> sizes;
    std::vector<std::string> words;
  };
  const Bad bad[] = {
      {{}, {"empty"}},
      {{0}, {"entry 0", "is 0", ">= 1"}},
      {{-3}, {"entry 0", "-3"}},
      {{8, -1}, {"entry 1", "-1"}},
      {{8, 8}, {"strictly decreasing", "entry 1", "(8)"}},
      {{4, 8}, {"strictly decreasing", "(8)", "(4)"}},
      {{64, 32, 33, 4}, {"entry 2", "(33)", "(32)"}},
  };
  for (const auto& b : bad) {
    CAPTURE(b.sizes);
    const Status s = RetentionSchedule::check(b.sizes);
    REQUIRE_FALSE(s.is_ok());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    for (const auto& w : b.words) CHECK_THAT(s.message(), Contains(w));
    try {
      RetentionSchedule r(b.sizes);
      FAIL("accepted " << r);
    } catch (const ConfigError& e) { CHECK(e.status().message() == s.message()); }
  }
}

TEST_CASE("CacheConfig: a small valid configuration is accepted", "[policy][config]") {
  const CacheConfig c = small_config();
  REQUIRE(c.validate().is_ok());
  PagedKvCache<> cache(c);
  CHECK(cache.config() == c);
}

TEST_CASE("CacheConfig rejects num_streams out of range", "[policy][config]") {
  for (int n : {0, -1, (1 << 24) + 1}) {
    CacheConfig c = small_config();
    c.num_streams = n;
    CAPTURE(n);
    const Status s = c.validate();
    REQUIRE_FALSE(s.is_ok());
    CHECK_THAT(s.message(), Contains("num_streams " + std::to_string(n)));
    CHECK_THAT(s.message(), Contains("16777216"));
    if (n <= 0) (void)rejected(c);  // constructing 16M streams is too costly for the other value
  }
  CacheConfig c = small_config();
  c.num_streams = 1 << 24;
  CHECK(c.validate().is_ok());
}

TEST_CASE("CacheConfig rejects unsupported group sizes", "[policy][config]") {
  for (int g : {12, 0, -16, 4, 64, 24}) {
    CacheConfig c = small_config();
    c.head_dim = 96;
    c.group_size = g;
    CAPTURE(g);
    const std::string msg = rejected(c);
    CHECK_THAT(msg, Contains("group_size " + std::to_string(g)));
    CHECK_THAT(msg, Contains("8, 16, 32"));
  }
  for (int g : {8, 16, 32}) {
    CacheConfig c = small_config();
    c.head_dim = 96;
    c.group_size = g;
    CHECK(c.validate().is_ok());
  }
}

TEST_CASE("CacheConfig: head_dim 8 needs group_size 8", "[policy][config]") {
  CacheConfig c = small_config();
  c.head_dim = 8;
  c.group_size = 16;
  const std::string msg = rejected(c);
  CHECK_THAT(msg, Contains("head_dim 8"));
  CHECK_THAT(msg, Contains("16"));
  CHECK_THAT(msg, Contains("group_size 8"));
  c.group_size = 8;
  REQUIRE(c.validate().is_ok());
  PagedKvCache<> cache(c);
  CHECK(cache.config().head_dim == 8);
  // 24 is a multiple of 8 but not of 16: the suggestion is given too.
  c.head_dim = 24;
  c.group_size = 16;
  CHECK_THAT(rejected(c), Contains("head_dim 24") && Contains("group_size 8"));
  // 20 is a multiple of no allowed group size: no misleading suggestion.
  c.head_dim = 20;
  c.group_size = 8;
  const std::string m20 = rejected(c);
  CHECK_THAT(m20, Contains("head_dim 20"));
  CHECK_THAT(m20, !Contains("e.g. group_size 8"));
}

TEST_CASE("CacheConfig rejects head_dim out of range", "[policy][config]") {
  for (int d : {0, -8, 1025, 2048}) {
    CacheConfig c = small_config();
    c.head_dim = d;
    c.group_size = 8;
    CAPTURE(d);
    CHECK_THAT(rejected(c), Contains("head_dim " + std::to_string(d)) && Contains("1024"));
  }
  CacheConfig c = small_config();
  c.head_dim = 1024;
  CHECK(c.validate().is_ok());
}

TEST_CASE("CacheConfig rejects block_size out of range", "[policy][config]") {
  for (int b : {0, -1, 4097}) {
    CacheConfig c = small_config();
    c.block_size = b;
    CAPTURE(b);
    CHECK_THAT(rejected(c), Contains("block_size " + std::to_string(b)) && Contains("4096"));
  }
  for (int b : {1, 3, 4096}) {
    CacheConfig c = small_config();
    c.block_size = b;
    CHECK(c.validate().is_ok());
  }
}

TEST_CASE("CacheConfig rejects an empty pool for a precision the map uses", "[policy][config]") {
  CacheConfig c = small_config();  // R4E4T2
  c.pool_blocks = {0, 0, 0, 4};
  std::string msg = rejected(c);
  CHECK_THAT(msg, Contains("pool_blocks[nvfp4] is 0"));
  CHECK_THAT(msg, Contains("R4E4T2"));
  c.pool_blocks = {0, 0, 4, 0};
  CHECK_THAT(rejected(c), Contains("pool_blocks[ternary] is 0"));
  // Unused precisions may have no pool; R8E4T2 needs fp8 too.
  c.pool_blocks = {0, 0, 4, 4};
  CHECK(c.validate().is_ok());
  c.precision = kR8E4T2;
  CHECK_THAT(rejected(c), Contains("pool_blocks[fp8_e4m3] is 0") && Contains("R8E4T2"));
  c.precision = kFullKvMap;
  CHECK_THAT(rejected(c), Contains("pool_blocks[bf16] is 0"));
  c.pool_blocks = {3, 0, 0, 0};
  CHECK(c.validate().is_ok());
}

TEST_CASE("CacheConfig rejects negative or huge pools", "[policy][config]") {
  CacheConfig c = small_config();
  c.pool_blocks = {0, -2, 4, 4};
  CHECK_THAT(rejected(c), Contains("pool_blocks[fp8_e4m3] -2"));
  c.pool_blocks = {0, 0, 4, (1 << 27) + 1};  // block_size 16: at most 2^31 / 16 = 2^27 blocks
  CHECK_THAT(c.validate().message(), Contains("pool_blocks[ternary] 134217729") && Contains("134217728"));
}

TEST_CASE("CacheConfig rejects a negative record capacity", "[policy][config]") {
  CacheConfig c = small_config();
  c.record_capacity = -1;
  CHECK_THAT(rejected(c), Contains("record_capacity -1"));
  c.record_capacity = 0;
  CHECK(c.validate().is_ok());
  c.record_capacity = 1;
  CHECK(c.validate().is_ok());
}

namespace {
// A user schedule that does not shrink: check_retention must name the level.
struct FlatRetention {
  [[nodiscard]] int num_levels() const { return 2; }
  [[nodiscard]] int retained(int) const { return 8; }
  [[nodiscard]] std::string to_string() const { return "flat"; }
};
}  // namespace

TEST_CASE("ThinKvConfig::validate(policy): budget and retention are checked for the sets that evict",
          "[policy][config]") {
  ThinKvConfig c;
  c.num_layers = 2;
  c.head_dim = 16;
  c.max_tokens = 512;
  c.segment_len = 64;
  ThinKvPolicy p;
  p.retention = RetentionSchedule({32, 16, 8, 4});
  c.token_budget = -1;
  CHECK_THAT(c.validate().message(), Contains("token_budget -1"));
  c.token_budget = 32;
  CHECK_THAT(c.validate(p).message(), Contains("token_budget 32 is below segment_len 64"));
  CHECK(c.validate(TbqPolicy{}).is_ok());  // no eviction: the budget is not used
  for (int b : {0, 64, 100000}) {
    c.token_budget = b;
    CHECK(c.validate(p).is_ok());
  }
  p.retention = RetentionSchedule({128, 64});
  CHECK_THAT(c.validate(p).message(), Contains("segment_len 64 is below the first retention level 128"));
  CHECK_THAT(check_retention(FlatRetention{}).message(), Contains("keeps 8 tokens at level 2"));
  CHECK(check_retention(RetentionSchedule{}).is_ok());
}
