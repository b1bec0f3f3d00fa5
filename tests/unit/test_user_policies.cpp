// User-written policies (examples/custom_policies/user_policies.hpp) through BasicThinKvCache:
//  - the "Wait"-line classifier labels exactly the tokens an independent model of its rule says
//    (the stored blocks' thought types, every step);
//  - LinearRetention + KeepMostRecent take the same decisions as the library's RetentionSchedule
//    with the same sizes + KeepLast (an independent implementation), bit for bit, and keep each
//    shrunk segment's latest tokens, at the schedule's size;
//  - a selector that answers wrongly is refused with its name and nothing is evicted.

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../../examples/custom_policies/user_policies.hpp"
#include "test_util.hpp"
#include "thinkv/thinkv_cache.hpp"

using namespace thinkv;

namespace {

constexpr int kTau = 16;

ThinKvConfig small_config() {
  ThinKvConfig c;
  c.num_sequences = 2;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 4;
  c.head_dim = 16;
  c.group_size = 8;
  c.block_size = 16;
  c.max_tokens = 900;
  c.segment_len = 64;
  c.token_budget = 96;
  return c;
}

// A random "text": words, newlines, and lines that start with "Wait".
struct Text {
  std::vector<std::string> tokens;
  std::set<int> wait_starts;  // positions of tokens that begin a "Wait" line
};
Text random_text(std::mt19937_64& rng, int n) {
  Text t;
  bool line_start = true;
  for (int i = 0; i < n; ++i) {
    std::string w;
    if (line_start && tt::uniform_int(rng, 0, 3) == 0) {
      w = tt::uniform_int(rng, 0, 1) ? "Wait," : " Wait";
      t.wait_starts.insert(i);
    } else {
      w = tt::uniform_int(rng, 0, 9) == 0 ? "Waiting" : "word";   // "Waiting" mid-line is no cue
      if (line_start && w == "Waiting") t.wait_starts.insert(i);  // ... at a line start it is
    }
    w += tt::uniform_int(rng, 0, 11) == 0 ? "\n" : " ";
    line_start = w.back() == '\n';
    t.tokens.push_back(w);
  }
  return t;
}

// The model of the classifier's rule: the token at x takes the type decided at the refresh p =
// floor(x / tau) * tau: R before the first refresh; else T exactly when a "Wait" line began among
// the tokens the classifier saw since the previous decision (positions (p - tau, p], and from 0
// for the first).
ThoughtType expected_type(const Text& t, int x) {
  const int p = x / kTau * kTau;
  if (p == 0) return ThoughtType::kReasoning;
  const int from = p == kTau ? 0 : p - kTau + 1;
  for (int w : t.wait_starts) {
    if (w >= from && w <= p) return ThoughtType::kTransition;
  }
  return ThoughtType::kReasoning;
}

template <class Cache>
Status decode(Cache& cache, int seq, const std::string& text, std::mt19937_64& rng) {
  const auto& c = cache.config();
  const TokenHint hint{cache.position(seq), text};
  THINKV_RETURN_IF_ERROR(cache.begin_token(seq, hint));
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads * c.head_dim)), out(q.size());
  for (int l = 0; l < c.num_layers; ++l) {
    std::vector<float> k, v;
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const auto kr = tt::random_row(rng, c.head_dim, 1.0), vr = tt::random_row(rng, c.head_dim, 1.0);
      k.insert(k.end(), kr.begin(), kr.end());
      v.insert(v.end(), vr.begin(), vr.end());
    }
    for (auto& x : q) x = static_cast<float>(tt::uniform01(rng) * 2.0 - 1.0);
    THINKV_RETURN_IF_ERROR(cache.append(seq, l, k, v));
    THINKV_RETURN_IF_ERROR(cache.attend(seq, l, q, out));
  }
  return cache.end_token(seq);
}

template <class Cache>
std::vector<std::vector<std::int32_t>> live_positions(const Cache& cache) {
  const auto& table = cache.paged().table();
  std::vector<std::vector<std::int32_t>> out;
  for (int st = 0; st < cache.paged().config().num_streams; ++st) {
    std::vector<std::int32_t> p;
    for (auto r : table.live_slot_list(st)) p.push_back(table.slot_position(r));
    std::sort(p.begin(), p.end());
    out.push_back(std::move(p));
  }
  return out;
}

using UserPolicy = CachePolicy<user::WaitLineClassifier, PrecisionMap, user::LinearRetention, user::KeepMostRecent>;
using BuiltinPolicy = CachePolicy<user::WaitLineClassifier, PrecisionMap, RetentionSchedule, KeepLast>;

}  // namespace

static_assert(thought_classifier<user::WaitLineClassifier> && retention_schedule<user::LinearRetention> &&
              token_selector<user::KeepMostRecent>);

TEST_CASE("user policies: the Wait-line classifier labels the tokens its rule says, in every stream",
          "[policy][user]") {
  TT_SEEDED_RNG();
  const ThinKvConfig cfg = small_config();
  UserPolicy p;
  p.classifier = user::WaitLineClassifier(kTau);
  BasicThinKvCache<UserPolicy> cache(cfg, p);
  const auto& table = cache.paged().table();
  std::vector<Text> texts;
  for (int s = 0; s < cfg.num_sequences; ++s) texts.push_back(random_text(rng, 800));
  std::int64_t checked = 0, transitions = 0;
  for (int t = 0; t < 800; ++t) {
    for (int seq = 0; seq < cfg.num_sequences; ++seq) {
      const Status s =
          decode(cache, seq, texts[static_cast<std::size_t>(seq)].tokens[static_cast<std::size_t>(t)], rng);
      INFO("t " << t << " seq " << seq << ": " << s);
      REQUIRE(s.is_ok());
      // Every live slot of every stream sits in a block of the type the rule gives its position.
      std::string broken;
      for (int st = cache.stream_of(seq, 0, 0); st < cache.stream_of(seq + 1, 0, 0) && broken.empty(); ++st) {
        for (auto r : table.live_slot_list(st)) {
          const int pos = table.slot_position(r);
          const ThoughtType want = expected_type(texts[static_cast<std::size_t>(seq)], pos);
          if (table.block_thought(r.block) != want) {
            broken = "stream " + std::to_string(st) + " position " + std::to_string(pos) + " is stored as " +
                     std::string(to_string(table.block_thought(r.block))) + ", the rule says " +
                     std::string(to_string(want));
            break;
          }
          const Precision stored = table.block_precision(r.block);
          if (stored != kR4E4T2.precision_of(want)) {
            broken = "position " + std::to_string(pos) + " is stored as " + std::string(to_string(stored));
            break;
          }
          ++checked;
          transitions += want == ThoughtType::kTransition;
        }
      }
      REQUIRE(broken.empty());
    }
  }
  CHECK(checked > 0);
  CHECK(transitions > 0);
  CHECK(cache.stats().transition_events > 0);  // case 1 fired on the user's T windows
  CHECK(cache.stats().tokens_evicted > 0);
}

TEST_CASE("user policies: linear retention + keep-most-recent decide as the built-in schedule + KeepLast",
          "[policy][user]") {
  TT_SEEDED_RNG();
  const ThinKvConfig cfg = small_config();
  UserPolicy up;
  up.classifier = user::WaitLineClassifier(kTau);
  up.retention = user::LinearRetention{12, 4, 3};  // 12, 8, 4
  BuiltinPolicy bp;
  bp.classifier = up.classifier;
  bp.retention = RetentionSchedule({12, 8, 4});
  BasicThinKvCache<UserPolicy> mine(cfg, up);
  BasicThinKvCache<BuiltinPolicy> builtin(cfg, bp);
  CHECK(mine.method_name() == "custom budget 96, R4E4T2, keep most recent");
  std::vector<Text> texts;
  for (int s = 0; s < cfg.num_sequences; ++s) texts.push_back(random_text(rng, 700));
  const std::uint64_t kv_seed = rng();
  std::mt19937_64 rng_a(kv_seed), rng_b(kv_seed);
  for (int t = 0; t < 700; ++t) {
    for (int seq = 0; seq < cfg.num_sequences; ++seq) {
      const std::string& w = texts[static_cast<std::size_t>(seq)].tokens[static_cast<std::size_t>(t)];
      REQUIRE(decode(mine, seq, w, rng_a).is_ok());
      REQUIRE(decode(builtin, seq, w, rng_b).is_ok());
    }
    INFO("t " << t);
    REQUIRE(live_positions(mine) == live_positions(builtin));
    REQUIRE(mine.segments(0) == builtin.segments(0));
  }
  CHECK(mine.stats().tokens_evicted > 0);
  CHECK(mine.stats().tokens_evicted == builtin.stats().tokens_evicted);
  // Every shrunk segment keeps its latest tokens, as many as the schedule says.
  const auto& table = mine.paged().table();
  const auto& segs = mine.segments(0);
  int shrunk = 0;
  for (std::size_t i = 0; i + 1 < segs.size(); ++i) {
    const auto& sg = segs[i];
    if (sg.level == 0) continue;
    const int len = segs[i + 1].start - sg.start;
    const int want_size = std::min(len, up.retention.retained(std::min(sg.level, up.retention.num_levels())));
    CHECK(sg.size == want_size);
    for (int st = mine.stream_of(0, 0, 0); st < mine.stream_of(1, 0, 0); ++st) {
      std::vector<std::int32_t> pos, want;
      for (auto r : table.live_slot_list(st)) {
        if (table.slot_segment(r) == sg.id) pos.push_back(table.slot_position(r));
      }
      std::sort(pos.begin(), pos.end());
      for (int j = 0; j < sg.size; ++j) want.push_back(sg.start + len - sg.size + j);
      INFO("segment " << sg.id << " start " << sg.start << " level " << sg.level << " stream " << st);
      REQUIRE(pos == want);
    }
    ++shrunk;
  }
  CHECK(shrunk > 0);
}

namespace {
// Keeps one token too many: the cache must refuse the answer.
struct GreedySelector {
  [[nodiscard]] Status check() const { return Status::ok(); }
  [[nodiscard]] bool reads_keys() const { return true; }
  [[nodiscard]] std::vector<int> select(const SegmentTokens& t, int keep) const {
    std::vector<int> all(static_cast<std::size_t>(std::min(keep + 1, t.count())));
    for (std::size_t j = 0; j < all.size(); ++j) all[j] = static_cast<int>(j);
    return all;
  }
  [[nodiscard]] std::string to_string() const { return "greedy"; }
};
}  // namespace

TEST_CASE("user policies: a selector that keeps the wrong number of tokens is refused, nothing evicted",
          "[policy][user][bad_input]") {
  TT_SEEDED_RNG();
  using Bad = CachePolicy<user::WaitLineClassifier, PrecisionMap, user::LinearRetention, GreedySelector>;
  ThinKvConfig cfg = small_config();
  cfg.num_sequences = 1;
  Bad p;
  p.classifier = user::WaitLineClassifier(kTau);
  p.retention = user::LinearRetention{12, 4, 3};
  BasicThinKvCache<Bad> cache(cfg, p);
  Status s;
  std::vector<std::vector<std::int32_t>> before;
  for (int t = 0; t < 400 && s.is_ok(); ++t) {
    before = live_positions(cache);
    s = decode(cache, 0, "word ", rng);
    if (!s.is_ok()) {
      // decode's end_token failed: the token itself was committed by its appends; no slot was
      // evicted from any stream.
      auto after = live_positions(cache);
      for (std::size_t st = 0; st < after.size(); ++st) {
        for (auto pos : before[st]) CHECK(std::binary_search(after[st].begin(), after[st].end(), pos));
      }
    }
  }
  INFO(s);
  REQUIRE(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Matchers::Contains("token selector greedy"));
  CHECK_THAT(s.message(), Catch::Matchers::Contains("nothing was evicted"));
  CHECK(cache.stats().tokens_evicted == 0);
}

TEST_CASE("user policies: a policy set that does not fit the model is refused naming the value", "[policy][user]") {
  ThinKvConfig cfg = small_config();
  UserPolicy p;
  p.classifier = user::WaitLineClassifier(12);  // not a multiple of group_size 8
  CHECK_THAT(cfg.validate(p).message(), Catch::Matchers::Contains("tau 12 is not a multiple of group_size 8"));
  CHECK_THROWS_AS(BasicThinKvCache<UserPolicy>(cfg, p), ConfigError);
  p.classifier = user::WaitLineClassifier(kTau);
  p.retention = user::LinearRetention{12, 8, 3};  // 12, 4, -4
  CHECK_THAT(cfg.validate(p).message(), Catch::Matchers::Contains("keeps -4 tokens at level 3"));
  p.retention = user::LinearRetention{96, 8, 3};  // more than a segment of 64
  CHECK_THAT(cfg.validate(p).message(),
             Catch::Matchers::Contains("segment_len 64 is below the first retention level 96"));
}
