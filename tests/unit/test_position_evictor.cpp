/// \file test_position_evictor.cpp
/// seq::PositionEvictor (ThinKV at position granularity, for cell-based runtimes such as
/// llama.cpp): its decisions against BasicThinKvCache's on one stream (same segments, same kept
/// positions from K-means over BF16 pages), its segment sizes against a multi-stream cache,
/// random add / remove sequences against an independent model of a llama.cpp sequence's cells,
/// and the error paths (each leaves the evictor unchanged).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "thinkv/seq/position_evictor.hpp"
#include "thinkv/thinkv_cache.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;

namespace {

/// A classifier that reads a script: refresh k (position k * tau) yields script[k % size]. It
/// needs no signal, so the cache and the evictor see the same types without attention. With
/// `refreshing` false it only ever says R (it never refreshes, but tau still marks segments).
struct ScriptedClassifier {
  std::shared_ptr<const std::vector<ThoughtType>> script;
  int period = 32;
  bool refreshing = true;
  [[nodiscard]] Status check(int) const { return Status::ok(); }
  [[nodiscard]] int tau() const noexcept { return period; }
  [[nodiscard]] bool emits(ThoughtType t) const noexcept { return refreshing || t == ThoughtType::kReasoning; }
  [[nodiscard]] bool needs_signal() const noexcept { return false; }
  [[nodiscard]] bool uses_layer(int) const noexcept { return false; }
  void observe(std::int64_t, const TokenHint&) noexcept {}
  [[nodiscard]] ThoughtType decide(std::int64_t pos, std::span<const float>) const noexcept {
    if (!refreshing) return ThoughtType::kReasoning;
    return (*script)[static_cast<std::size_t>(pos / period) % script->size()];
  }
  [[nodiscard]] std::string to_string() const { return "scripted"; }
};
static_assert(thought_classifier<ScriptedClassifier>);

/// KmeansSelector on the rows in position order. The cache hands a selector its rows in slot
/// order, which differs from position order once freed slots are refilled; K-means++ seeding
/// depends on the order. The evictor's rows are always in position order, so with this selector
/// both see the same input and must keep the same positions.
struct PositionOrderedKmeans {
  KmeansSelector kmeans{};
  [[nodiscard]] Status check() const { return kmeans.check(); }
  [[nodiscard]] bool reads_keys() const noexcept { return true; }
  [[nodiscard]] std::vector<int> select(const SegmentTokens& t, int keep) const {
    const int n = t.count(), d = t.head_dim;
    std::vector<int> order(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j) order[static_cast<std::size_t>(j)] = j;
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      return t.positions[static_cast<std::size_t>(a)] < t.positions[static_cast<std::size_t>(b)];
    });
    std::vector<float> keys(t.keys.size());
    std::vector<std::int32_t> pos(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j) {
      const auto src = static_cast<std::size_t>(order[static_cast<std::size_t>(j)]);
      std::copy_n(t.keys.begin() + static_cast<std::ptrdiff_t>(src * static_cast<std::size_t>(d)), d,
                  keys.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(j) * d));
      pos[static_cast<std::size_t>(j)] = t.positions[src];
    }
    const SegmentTokens sorted{keys, pos, d, t.stream, t.segment, t.lane};
    std::vector<int> kept;
    for (int j : kmeans.select(sorted, keep)) kept.push_back(order[static_cast<std::size_t>(j)]);
    std::sort(kept.begin(), kept.end());
    return kept;
  }
  [[nodiscard]] std::string to_string() const { return "kmeans (position order)"; }
};
static_assert(token_selector<PositionOrderedKmeans>);

struct ScriptedTbe : CachePolicy<ScriptedClassifier, Bf16Pages, RetentionSchedule, PositionOrderedKmeans> {};

std::shared_ptr<const std::vector<ThoughtType>> random_script(std::mt19937_64& rng, int n) {
  auto s = std::make_shared<std::vector<ThoughtType>>();
  for (int i = 0; i < n; ++i) {
    const int r = tt::uniform_int(rng, 0, 9);  // T common enough for many transitions
    s->push_back(r < 4 ? ThoughtType::kReasoning : r < 7 ? ThoughtType::kExecution : ThoughtType::kTransition);
    if (i % 4 == 0) s->back() = ThoughtType::kReasoning;  // at least one new transition every 4 refreshes
    if (i % 4 == 3) s->back() = ThoughtType::kTransition;
  }
  return s;
}

/// Live positions of a cache's stream: committed slots of every segment, plus the staged tail
/// (the open segment's last, not yet quantized tokens, which nothing evicts).
template <class Cache>
std::vector<std::int32_t> cache_live(const Cache& c, int stream, std::int32_t next, int group) {
  std::vector<std::int32_t> out;
  std::vector<SlotRef> slots;
  for (const SegmentState& s : c.segments(0)) {
    c.paged().table().live_segment_slots(stream, s.id, slots);
    for (SlotRef r : slots) out.push_back(c.paged().table().slot_position(r));
  }
  for (std::int32_t p = next / group * group; p < next; ++p) out.push_back(p);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<float> bf16_row(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = tt::bf16_round(x[i]);
  return y;
}

struct Snapshot {
  std::vector<std::int32_t> live;
  std::int32_t next = 0;
  std::vector<SegmentState> segments;
  std::int64_t tokens = 0;
  ThoughtType type = ThoughtType::kReasoning;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};
template <class E>
Snapshot snapshot(const E& e) {
  Snapshot s{e.live_positions(), e.next_position(), {}, e.stats().tokens, e.current_type()};
  for (const auto& seg : e.segments()) s.segments.push_back(seg.state);
  return s;
}

}  // namespace

TEST_CASE("PositionEvictor keeps the positions ThinKvCache keeps on one stream (K-means over the same keys)",
          "[seq][position_evictor]") {
  TT_SEEDED_RNG();
  const int d = 16, tau = 32, budget = 96;
  const int pinned = GENERATE(0, 40);
  // A segment length above tau: segments still start at every multiple of tau, refreshing or not.
  const int seg = GENERATE(32, 64);
  const bool refreshing = GENERATE(true, false);
  INFO("pinned prefix " << pinned << ", segment_len " << seg << ", refreshing " << refreshing);
  auto script = random_script(rng, 64);
  const ScriptedClassifier classifier{script, tau, refreshing};
  ScriptedTbe policy;
  policy.classifier = classifier;
  policy.retention = RetentionSchedule{16, 8, 4, 2};
  ThinKvConfig cfg;
  cfg.head_dim = d;
  cfg.max_tokens = 2048;
  cfg.token_budget = budget;
  cfg.segment_len = seg;
  cfg.pinned_prefix = pinned;
  BasicThinKvCache<ScriptedTbe> cache(cfg, policy);
  if (pinned > 0) REQUIRE(cache.pin_prefix(0, pinned).is_ok());

  seq::PositionEvictorConfig ec;
  ec.num_layers = 1;
  ec.num_kv_heads = 1;
  ec.head_dim = d;
  ec.segment_len = seg;
  ec.token_budget = budget;
  ec.pinned_prefix = pinned;
  seq::BasicPositionEvictor<ScriptedClassifier, RetentionSchedule, PositionOrderedKmeans> ev(
      ec, classifier, RetentionSchedule{16, 8, 4, 2});

  std::set<std::int32_t> model;  // positions added and not evicted
  std::vector<float> out(static_cast<std::size_t>(d));
  std::int64_t evicted = 0;
  for (std::int32_t pos = 0; pos < 700; ++pos) {
    INFO("position " << pos);
    const std::vector<float> k = tt::random_row(rng, d), v = tt::random_row(rng, d), q = tt::random_row(rng, d);
    REQUIRE(cache.begin_token(0).is_ok());
    REQUIRE(cache.append(0, 0, k, v).is_ok());
    REQUIRE(cache.attend(0, 0, q, out).is_ok());
    REQUIRE(cache.end_token(0).is_ok());
    std::vector<std::int32_t> evict;
    REQUIRE(ev.add_token(pos, bf16_row(k), {}, evict).is_ok());
    model.insert(pos);
    for (std::int32_t p : evict) {
      REQUIRE(model.erase(p) == 1);  // only live positions are freed, each once
      REQUIRE(p >= pinned);
    }
    REQUIRE(std::is_sorted(evict.begin(), evict.end()));
    evicted += static_cast<std::int64_t>(evict.size());
    const std::vector<std::int32_t> live = ev.live_positions();
    REQUIRE(live == std::vector<std::int32_t>(model.begin(), model.end()));
    REQUIRE(ev.segments().size() == cache.segments(0).size());
    for (std::size_t i = 0; i < ev.segments().size(); ++i) {
      const SegmentState& a = ev.segments()[i].state;
      const SegmentState& b = cache.segments(0)[i];
      REQUIRE(a.start == b.start);
      REQUIRE(a.id == b.id);
      REQUIRE(a.size == b.size);
      REQUIRE(a.level == b.level);
      REQUIRE(a.type == b.type);
      REQUIRE(a.closed == b.closed);
      REQUIRE(a.pinned == b.pinned);
    }
    REQUIRE(live == cache_live(cache, 0, pos + 1, cfg.group_size));
  }
  // The run exercised both TBE cases (case 1 only when the classifier refreshes).
  CHECK((ev.stats().transitions > 3) == refreshing);
  CHECK(ev.stats().evicted == evicted);
  CHECK(evicted > 300);
  CHECK(ev.stats().selections > 0);
}

TEST_CASE("PositionEvictor's segment sizes match every stream of a multi-layer, multi-head cache",
          "[seq][position_evictor]") {
  TT_SEEDED_RNG();
  const int d = 16, layers = 3, kv = 2, tau = 32;
  auto script = random_script(rng, 32);
  ScriptedTbe policy;
  policy.classifier = ScriptedClassifier{script, tau};
  policy.retention = RetentionSchedule{16, 8, 4, 2};
  ThinKvConfig cfg;
  cfg.num_layers = layers;
  cfg.num_kv_heads = kv;
  cfg.num_q_heads = kv;
  cfg.head_dim = d;
  cfg.max_tokens = 1024;
  cfg.token_budget = 80;
  cfg.segment_len = 32;
  BasicThinKvCache<ScriptedTbe> cache(cfg, policy);
  seq::PositionEvictorConfig ec;
  ec.num_layers = layers;
  ec.num_kv_heads = kv;
  ec.head_dim = d;
  ec.key_layers = {0, 2};
  ec.segment_len = 32;
  ec.token_budget = 80;
  seq::BasicPositionEvictor<ScriptedClassifier, RetentionSchedule, KmeansSelector> ev(
      ec, ScriptedClassifier{script, tau}, RetentionSchedule{16, 8, 4, 2});
  REQUIRE(ec.feature_dim() == 2 * kv * d);
  std::vector<float> out(static_cast<std::size_t>(kv * d));
  for (std::int32_t pos = 0; pos < 400; ++pos) {
    INFO("position " << pos);
    std::vector<float> feat;
    REQUIRE(cache.begin_token(0).is_ok());
    for (int l = 0; l < layers; ++l) {
      const std::vector<float> k = tt::random_row(rng, kv * d), v = tt::random_row(rng, kv * d);
      REQUIRE(cache.append(0, l, k, v).is_ok());
      REQUIRE(cache.attend(0, l, k, out).is_ok());
      if (l != 1) feat.insert(feat.end(), k.begin(), k.end());
    }
    REQUIRE(cache.end_token(0).is_ok());
    std::vector<std::int32_t> evict;
    REQUIRE(ev.add_token(pos, feat, {}, evict).is_ok());
    REQUIRE(ev.segments().size() == cache.segments(0).size());
    for (std::size_t i = 0; i < ev.segments().size(); ++i) {
      REQUIRE(ev.segments()[i].state.size == cache.segments(0)[i].size);
      REQUIRE(ev.segments()[i].state.level == cache.segments(0)[i].level);
    }
    for (int st = 0; st < layers * kv; ++st) {
      REQUIRE(static_cast<std::int64_t>(cache_live(cache, st, pos + 1, cfg.group_size).size()) == ev.live_count());
    }
  }
  CHECK(ev.stats().evicted > 100);
}

namespace {

/// llama.cpp's seq_add on the model's cells (positions in [p0, p1) move by delta; one moved
/// below 0 is freed) and what the evictor answers, from the model alone: kUnsupported when a
/// pinned position moves or a moved one lands below `pinned`, kInvalidArgument when a moved
/// position that stays reaches an unmoved neighbour.
StatusCode shift_outcome(const std::set<std::int32_t>& cells, std::int32_t pinned, std::int32_t p0, std::int32_t p1,
                         std::int32_t delta) {
  const std::int32_t lo = std::max<std::int32_t>(p0, 0);
  const std::int64_t hi = p1 < 0 ? std::numeric_limits<std::int64_t>::max() : p1;
  if (delta == 0 || lo >= hi) return StatusCode::kOk;
  std::vector<std::int32_t> in;
  std::int64_t below = -1, above = std::numeric_limits<std::int64_t>::max();
  for (std::int32_t p : cells) {
    if (p >= lo && p < hi) {
      in.push_back(p);
    } else if (p < lo) {
      below = p;
    } else if (above == std::numeric_limits<std::int64_t>::max()) {
      above = p;
    }
  }
  if (in.empty()) return StatusCode::kOk;
  if (pinned > 0 && (in.front() < pinned || static_cast<std::int64_t>(in.front()) + delta < pinned))
    return StatusCode::kUnsupported;
  std::vector<std::int64_t> kept;
  for (std::int32_t p : in) {
    if (static_cast<std::int64_t>(p) + delta >= 0) kept.push_back(static_cast<std::int64_t>(p) + delta);
  }
  if (!kept.empty() && ((below >= 0 && kept.front() <= below) || kept.back() >= above)) {
    return StatusCode::kInvalidArgument;
  }
  return StatusCode::kOk;
}

}  // namespace

TEST_CASE("PositionEvictor under random add / remove / shift matches a model of a llama.cpp sequence's cells",
          "[seq][position_evictor]") {
  TT_SEEDED_RNG();
  // The model: the set of positions the runtime holds for one sequence (llama.cpp's cells with
  // this seq id). add = a cell at pos_max + 1; the evictor's answer = seq_rm(p, p + 1) each;
  // remove(p0, p1) = seq_rm(p0, p1), after which the next position is pos_max + 1.
  const int d = 4, tau = 32;
  for (int run = 0; run < 20; ++run) {
    auto script = random_script(rng, 16);
    seq::PositionEvictorConfig ec;
    ec.num_layers = 2;
    ec.num_kv_heads = 1;
    ec.head_dim = d;
    ec.segment_len = 32;
    ec.token_budget = tt::chance(rng, 0.3) ? 0 : tt::uniform_int(rng, 32, 128);
    ec.pinned_prefix = tt::uniform_int(rng, 0, 50);
    ec.seed_stream = run;
    seq::BasicPositionEvictor<ScriptedClassifier, RetentionSchedule, KmeansSelector> ev(
        ec, ScriptedClassifier{script, tau}, RetentionSchedule{16, 8, 4, 2});
    std::set<std::int32_t> cells;
    std::int32_t next = 0;
    INFO("run " << run << " budget " << ec.token_budget << " pinned " << ec.pinned_prefix);
    RopeSpec rope;
    rope.style = run % 2 == 0 ? RopeStyle::kAdjacentPairs : RopeStyle::kHalves;
    for (int op = 0; op < 600; ++op) {
      if (tt::chance(rng, 0.04) && next > 0) {
        // seq_add: half of them llama.cpp's context shift (seq_rm(keep, keep + n), then the rest
        // moved down by n), half a random range and delta (refused as the model predicts).
        std::int32_t p0 = 0, p1 = -1, delta = 0;
        if (tt::chance(rng, 0.5) && next - ec.pinned_prefix >= 4) {
          const std::int32_t keep = ec.pinned_prefix, n = tt::uniform_int(rng, 1, (next - keep) / 2);
          REQUIRE(ev.remove(keep, keep + n).is_ok());
          for (auto it = cells.begin(); it != cells.end();) {
            it = (*it >= keep && *it < keep + n) ? cells.erase(it) : std::next(it);
          }
          p0 = keep + n;
          delta = -n;
        } else {
          p0 = tt::uniform_int(rng, -3, next);
          p1 = tt::chance(rng, 0.4) ? -1 : tt::uniform_int(rng, std::max(p0, 0) + 1, next + 5);
          delta = tt::uniform_int(rng, -40, 40);
        }
        INFO("shift [" << p0 << ", " << p1 << ") by " << delta);
        const StatusCode want = shift_outcome(cells, ec.pinned_prefix, p0, p1, delta);
        const auto live_before = ev.live_positions();
        const Status st = ev.shift(p0, p1, delta, &rope);
        INFO(st.to_string());
        REQUIRE(st.code() == want);
        if (st.is_ok()) {
          const std::int32_t lo = std::max(p0, 0);
          auto moves = [&](std::int32_t p) { return p >= lo && (p1 < 0 || p < p1); };
          const bool tail = moves(next - 1);
          std::set<std::int32_t> moved;
          for (std::int32_t p : cells) {
            if (!moves(p)) {
              moved.insert(p);
            } else if (p + delta >= 0) {
              moved.insert(p + delta);
            }
          }
          cells = std::move(moved);
          if (tail) next = cells.empty() ? 0 : *cells.rbegin() + 1;
        } else {
          REQUIRE(ev.live_positions() == live_before);
        }
        // The segments stay in order: starts ascending, each at or before its first position and
        // after the positions of the segments before it.
        std::int32_t prev_hi = -1, prev_start = -1;
        for (const auto& seg : ev.segments()) {
          REQUIRE(seg.state.start > prev_start);
          REQUIRE(seg.state.start > prev_hi);
          if (!seg.positions.empty()) {
            REQUIRE(seg.state.start <= seg.positions.front());
            prev_hi = seg.positions.back();
          }
          prev_start = seg.state.start;
        }
      } else if (tt::chance(rng, 0.03) && next > 0) {
        // seq_rm over a random range; a third of them truncate the tail (p1 = -1).
        const std::int32_t p0 = tt::uniform_int(rng, 0, next - 1);
        const std::int32_t p1 = tt::chance(rng, 0.33) ? -1 : tt::uniform_int(rng, p0 + 1, next + 5);
        INFO("remove [" << p0 << ", " << p1 << ")");
        REQUIRE(ev.remove(p0, p1).is_ok());
        for (auto it = cells.begin(); it != cells.end();) {
          it = (*it >= p0 && (p1 < 0 || *it < p1)) ? cells.erase(it) : std::next(it);
        }
        if (p1 < 0 || p1 >= next) next = cells.empty() ? 0 : *cells.rbegin() + 1;
      } else {
        std::vector<std::int32_t> evict;
        // Pinned positions may come without features (a runtime need not copy the prompt's keys).
        const bool bare = next < ec.pinned_prefix && tt::chance(rng, 0.5);
        const std::vector<float> feat = bare ? std::vector<float>{} : tt::random_row(rng, ev.config().feature_dim());
        REQUIRE(ev.add_token(next, feat, {}, evict).is_ok());
        cells.insert(next);
        ++next;
        for (std::int32_t p : evict) {
          REQUIRE(cells.erase(p) == 1);
          REQUIRE(p >= ec.pinned_prefix);
          REQUIRE(p < next - 1);  // never the token just added (its segment is open)
        }
      }
      REQUIRE(ev.next_position() == next);
      REQUIRE(ev.live_positions() == std::vector<std::int32_t>(cells.begin(), cells.end()));
      // Within budget (plus the open segment) whenever a closed segment could still step down.
      if (ec.token_budget > 0 && ev.stats().budget_unreachable == 0) {
        std::int64_t unpinned = 0;
        for (std::int32_t p : cells) unpinned += p >= ec.pinned_prefix;
        REQUIRE(unpinned <= ec.token_budget);
      }
    }
  }
}

TEST_CASE("PositionEvictor refuses bad calls and configurations, naming the value, and changes nothing",
          "[seq][position_evictor]") {
  TT_SEEDED_RNG();
  seq::PositionEvictorConfig ec;
  ec.num_layers = 4;
  ec.num_kv_heads = 2;
  ec.head_dim = 8;
  ec.segment_len = 128;
  ec.token_budget = 256;
  // A calibrated classifier over layers 1 and 3, tau 16: refresh steps read the sparsity.
  ThoughtClassifier cl({0.3f, 0.6f}, {1, 3}, 16,
                       {ThoughtType::kExecution, ThoughtType::kReasoning, ThoughtType::kTransition}, 4);
  seq::PositionEvictor ev(ec, cl);
  std::vector<std::int32_t> evict;
  for (std::int32_t p = 0; p < 16; ++p) {
    REQUIRE(ev.add_token(p, tt::random_row(rng, ec.feature_dim()), {}, evict).is_ok());
  }
  REQUIRE(ev.wants_sparsity(16));
  CHECK(ev.wants_layer_sparsity(16, 1));
  CHECK_FALSE(ev.wants_layer_sparsity(16, 2));
  CHECK_FALSE(ev.wants_sparsity(17));
  const Snapshot before = snapshot(ev);
  const std::vector<float> feat = tt::random_row(rng, ec.feature_dim());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> sparsity{nan, 0.9f, nan, 0.8f};

  Status s = ev.add_token(17, feat, sparsity, evict);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Contains("position 17") && Contains("(16)"));
  s = ev.add_token(16, std::vector<float>(feat.begin(), feat.end() - 1), sparsity, evict);
  CHECK(s.code() == StatusCode::kShapeMismatch);
  CHECK_THAT(s.message(), Contains("63 floats") && Contains("64"));
  std::vector<float> bad = feat;
  bad[5] = std::numeric_limits<float>::infinity();
  s = ev.add_token(16, bad, sparsity, evict);
  CHECK(s.code() == StatusCode::kNonFinite);
  CHECK_THAT(s.message(), Contains("feature 5"));
  s = ev.add_token(16, feat, std::vector<float>{0.9f, 0.9f}, evict);
  CHECK(s.code() == StatusCode::kShapeMismatch);
  CHECK_THAT(s.message(), Contains("refresh step") && Contains("expected 4"));
  s = ev.add_token(16, feat, std::vector<float>{nan, 1.5f, nan, 0.8f}, evict);
  CHECK(s.code() == StatusCode::kNonFinite);
  CHECK_THAT(s.message(), Contains("layer 1"));
  s = ev.remove(5, 5);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(ev.remove(-1, 4).code() == StatusCode::kInvalidArgument);
  CHECK(evict.empty());
  CHECK(snapshot(ev) == before);
  CHECK(ev.stats().refreshes == 0);
  // The same token, well formed, goes in: sparsity 0.85 -> band 2 (T).
  REQUIRE(ev.add_token(16, feat, sparsity, evict).is_ok());
  CHECK(ev.stats().refreshes == 1);
  CHECK(ev.current_type() == ThoughtType::kTransition);

  auto refused = [](seq::PositionEvictorConfig c) {
    try {
      seq::PositionEvictor e(c);
    } catch (const ConfigError& e) { return std::string(e.what()); }
    return std::string("accepted");
  };
  seq::PositionEvictorConfig c = ec;
  c.key_layers = {0, 4};
  CHECK_THAT(refused(c), Contains("key_layers[1] = 4") && Contains("0..3"));
  c.key_layers = {2, 1};
  CHECK_THAT(refused(c), Contains("ascending"));
  c = ec;
  c.token_budget = 64;
  CHECK_THAT(refused(c), Contains("token_budget 64") && Contains("segment_len 128"));
  c = ec;
  c.segment_len = 32;
  CHECK_THAT(refused(c), Contains("segment_len 32") && Contains("64"));
  c = ec;
  c.head_dim = 0;
  CHECK_THAT(refused(c), Contains("head_dim 0"));
  // A classifier calibrated for another model.
  try {
    seq::PositionEvictor e(ec,
                           ThoughtClassifier({0.5f}, {1}, 16, {ThoughtType::kReasoning, ThoughtType::kTransition}, 6));
    FAIL("accepted a classifier calibrated for 6 layers");
  } catch (const ConfigError& e) { CHECK_THAT(std::string(e.what()), Contains("6")); }
}

TEST_CASE("PositionEvictor refuses a selector that breaks its contract and evicts nothing", "[seq][position_evictor]") {
  TT_SEEDED_RNG();
  // Keeps one index too many (the last index twice).
  struct OneTooMany {
    [[nodiscard]] Status check() const { return Status::ok(); }
    [[nodiscard]] bool reads_keys() const noexcept { return false; }
    [[nodiscard]] std::vector<int> select(const SegmentTokens& t, int keep) const {
      std::vector<int> k = KeepFirst{}.select(t, keep);
      k.push_back(k.back());
      return k;
    }
    [[nodiscard]] std::string to_string() const { return "one too many"; }
  };
  seq::PositionEvictorConfig ec;
  ec.num_layers = 1;
  ec.num_kv_heads = 1;
  ec.head_dim = 4;
  ec.segment_len = 64;
  ec.token_budget = 64;
  seq::BasicPositionEvictor<ThoughtClassifier, RetentionSchedule, OneTooMany> ev(ec);
  std::vector<std::int32_t> evict;
  std::int32_t pos = 0;
  Status s = Status::ok();
  Snapshot before;
  for (; pos < 1000 && s.is_ok(); ++pos) {
    before = snapshot(ev);
    s = ev.add_token(pos, {}, {}, evict);
  }
  REQUIRE_FALSE(s.is_ok());  // the first step-down (over budget) asks the selector
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(),
             Contains("one too many") && Contains("returned 33 indices") && Contains("nothing was evicted"));
  CHECK(evict.empty());
  CHECK(snapshot(ev) == before);
}

TEST_CASE("PositionEvictor::shift turns the moved positions' stored keys through delta positions of the model's RoPE",
          "[seq][position_evictor]") {
  TT_SEEDED_RNG();
  seq::PositionEvictorConfig ec;
  ec.num_layers = 2;
  ec.num_kv_heads = 2;
  ec.head_dim = 8;
  ec.segment_len = 32;
  ec.token_budget = 0;  // no budget and no transition (R only): nothing evicted, every row is checked
  ec.pinned_prefix = 4;
  auto script = random_script(rng, 8);
  seq::BasicPositionEvictor<ScriptedClassifier, RetentionSchedule, KmeansSelector> ev(
      ec, ScriptedClassifier{script, 32, false}, RetentionSchedule{16, 8, 4, 2});
  std::map<std::int32_t, std::vector<float>> rows;
  for (std::int32_t p = 0; p < 100; ++p) {
    std::vector<std::int32_t> evict;
    rows[p] = tt::random_row(rng, ev.config().feature_dim());
    REQUIRE(ev.add_token(p, rows[p], {}, evict).is_ok());
  }
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalves}) {
    RopeSpec rope;
    rope.style = style;
    rope.theta = 500000.0;
    const std::int32_t delta = style == RopeStyle::kAdjacentPairs ? -10 : 7;
    // llama.cpp's context shift: seq_rm(40, 50), then seq_add(50, -1, -10) (and back up by 7 after).
    if (delta < 0) REQUIRE(ev.remove(40, 50).is_ok());
    const std::int32_t from = delta < 0 ? 50 : 40;
    REQUIRE(ev.shift(from, -1, delta, &rope).is_ok());
    std::map<std::int32_t, std::vector<float>> next_rows;
    for (const auto& [p, r] : rows) {
      if (delta < 0 && p >= 40 && p < 50) continue;
      next_rows[p >= from ? p + delta : p] = r;
    }
    // The reference turn, written from RoPE's definition: pair i at angle delta * theta^(-2i/d).
    const int d = ec.head_dim;
    for (auto& [p, r] : next_rows) {
      if (p < from + delta) continue;
      for (std::size_t h = 0; h * d < r.size(); ++h) {
        std::vector<double> x(r.begin() + static_cast<std::ptrdiff_t>(h * d),
                              r.begin() + static_cast<std::ptrdiff_t>((h + 1) * d));
        for (int i = 0; i < d / 2; ++i) {
          const double a = delta * std::pow(rope.theta, -2.0 * i / d);
          const int u = style == RopeStyle::kAdjacentPairs ? 2 * i : i;
          const int v = style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + d / 2;
          const double x0 = x[static_cast<std::size_t>(u)], x1 = x[static_cast<std::size_t>(v)];
          r[h * d + static_cast<std::size_t>(u)] = static_cast<float>(x0 * std::cos(a) - x1 * std::sin(a));
          r[h * d + static_cast<std::size_t>(v)] = static_cast<float>(x0 * std::sin(a) + x1 * std::cos(a));
        }
      }
    }
    rows = std::move(next_rows);
    REQUIRE(ev.next_position() == rows.rbegin()->first + 1);
    std::size_t checked = 0;
    for (const auto& seg : ev.segments()) {
      if (seg.features.empty()) continue;  // the pinned segment stores none
      const auto dim = static_cast<std::size_t>(ev.config().feature_dim());
      for (std::size_t j = 0; j < seg.positions.size(); ++j) {
        const auto& want = rows.at(seg.positions[j]);
        for (std::size_t c = 0; c < dim; ++c) {
          INFO("position " << seg.positions[j] << " channel " << c);
          REQUIRE(seg.features[j * dim + c] == Approx(want[c]).margin(1e-5));
        }
        ++checked;
      }
    }
    CHECK(checked == rows.size() - 4);
    CHECK(ev.stats().shifted > 0);
  }
  // The next token continues at the new end; a shift into the pinned prefix is refused.
  std::vector<std::int32_t> evict;
  REQUIRE(ev.add_token(ev.next_position(), tt::random_row(rng, ev.config().feature_dim()), {}, evict).is_ok());
  const auto live = ev.live_positions();
  const Status e = ev.shift(10, -1, -8);
  CHECK(e.code() == StatusCode::kUnsupported);
  CHECK_THAT(e.message(), Contains("pinned prefix"));
  CHECK(ev.live_positions() == live);
  RopeSpec odd;
  odd.rotary_dims = 3;
  CHECK(ev.shift(10, -1, 4, &odd).code() == StatusCode::kInvalidArgument);
}
