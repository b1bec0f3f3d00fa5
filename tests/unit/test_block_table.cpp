/// \file test_block_table.cpp
/// The CT block table alone (no K/V data): placement order, pools, records, eviction, and a long
/// randomized run checked step by step against the independent model of test_util.hpp.

#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "thinkv/paged/flat_block_table.hpp"
#include "thinkv/paged/id_bitset.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;
using tt::chance;
using tt::CtModel;
using tt::Diff;
using tt::uniform01;
using tt::uniform_int;

namespace {

constexpr ThoughtType R = ThoughtType::kReasoning;
constexpr ThoughtType E = ThoughtType::kExecution;
constexpr ThoughtType T = ThoughtType::kTransition;

CacheConfig table_config(int g, int bs, std::array<int, 4> pools, PrecisionMap map = kR4E4T2, int streams = 2,
                         int records = 0) {
  CacheConfig c;
  c.num_streams = streams;
  c.head_dim = 32;
  c.group_size = g;
  c.block_size = bs;
  c.precision = map;
  c.pool_blocks = pools;
  c.record_capacity = records;
  return c;
}

bool same_plan(const CommitPlan& a, const CommitPlan& b) {
  return a.stream == b.stream && a.thought == b.thought && a.precision == b.precision && a.slots == b.slots &&
         a.new_blocks == b.new_blocks && a.record == b.record && a.reused_slots == b.reused_slots;
}

std::string slots_str(const std::vector<SlotRef>& v) {
  std::string s;
  for (auto r : v) s += std::to_string(r.block) + ":" + std::to_string(r.slot) + " ";
  return s;
}

/// One token through the table, in PagedKvCache::append's order (check_stage, plan when it fills
/// the group, push, apply), mirrored in the model. Checks the plan against the model.
Status push_token(BlockTable& t, CtModel& m, int s, ThoughtType th, std::uint32_t seg, Diff& d,
                  CommitPlan* plan_out = nullptr) {
  THINKV_RETURN_IF_ERROR(t.check_stage(s, th));
  const bool fills = t.staged_count(s) + 1 == t.config().group_size;
  CommitPlan plan;
  if (fills) {
    const Status st = t.plan_commit(s, th, plan);
    if (!st.is_ok()) return st;
    int fresh = 0;
    const auto mp = m.plan(s, th, &fresh);
    int reused = 0;
    for (const auto& x : mp) reused += x.reused;
    if (plan.precision != m.prec(th)) d.fail("plan precision ", plan.precision, ", expected ", m.prec(th));
    if (plan.thought != th || plan.stream != s) d.fail("plan names the wrong stream/thought");
    if (plan.reused_slots != reused) d.fail("plan reuses ", plan.reused_slots, " slots, model ", reused);
    if (static_cast<int>(plan.new_blocks.size()) != fresh)
      d.fail("plan takes ", plan.new_blocks.size(), " fresh blocks, model ", fresh);
    // every fresh block's slots are in plan.slots, in new_blocks order
    std::vector<std::uint32_t> seen;
    for (SlotRef r : plan.slots) {
      const bool is_new = std::find(plan.new_blocks.begin(), plan.new_blocks.end(), r.block) != plan.new_blocks.end();
      if (is_new && (seen.empty() || seen.back() != r.block)) seen.push_back(r.block);
    }
    if (seen != plan.new_blocks) d.fail("new_blocks do not match the fresh blocks used by the slots");
  }
  t.push_staged(s, th, seg);
  m.stage(s, th, seg);
  if (fills) {
    t.apply_commit(plan);
    m.commit(s, plan.slots, plan.record, d);
    if (plan_out) *plan_out = plan;
  }
  return Status::ok();
}

/// A whole group of one thought; requires success.
CommitPlan push_group(BlockTable& t, CtModel& m, int s, ThoughtType th, std::uint32_t seg = 0) {
  Diff d;
  CommitPlan plan;
  for (int i = 0; i < t.config().group_size; ++i) {
    const Status st = push_token(t, m, s, th, seg, d, &plan);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
  }
  TT_REQUIRE_OK_DIFF(d);
  return plan;
}

void evict_both(BlockTable& t, CtModel& m, int s, const std::vector<SlotRef>& slots) {
  const Status st = t.evict(s, slots);
  INFO(st.to_string() << " evicting " << slots_str(slots));
  REQUIRE(st.is_ok());
  m.evict(s, slots);
  TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
}

}  // namespace

TEST_CASE("BlockTable: plan_commit is pure", "[block_table]") {
  TT_SEEDED_RNG();
  const int bs = uniform_int(rng, 6, 20);
  BlockTable t(table_config(8, bs, {0, 0, 8, 8}));
  CtModel m(t.config());
  push_group(t, m, 0, R);
  push_group(t, m, 0, R);
  // 5 holes in the first block, which keeps at least one live slot
  std::vector<SlotRef> live;
  for (SlotRef r : m.live_slots(0))
    if (r.block == t.blocks(0)[0]) live.push_back(r);
  std::shuffle(live.begin(), live.end(), rng);
  live.resize(5);
  evict_both(t, m, 0, live);
  Diff d;
  for (int i = 0; i < 7; ++i) REQUIRE(push_token(t, m, 0, R, 3, d).is_ok());
  const auto before = tt::snapshot_table(t);
  CommitPlan a, b;
  REQUIRE(t.plan_commit(0, R, a).is_ok());
  REQUIRE(t.plan_commit(0, R, b).is_ok());
  CHECK(same_plan(a, b));
  CHECK(a.reused_slots == 5);
  CHECK(a.slots.size() == 8u);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
  // A plan for another thought type and for another stream change nothing either.
  CommitPlan c;
  REQUIRE(t.plan_commit(1, T, c).is_ok());
  REQUIRE(t.plan_commit(0, E, c).is_ok());
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
}

TEST_CASE("BlockTable: placement order is holes, then unwritten slots, then fresh blocks", "[block_table]") {
  BlockTable t(table_config(8, 12, {0, 0, 8, 4}));
  CtModel m(t.config());
  const std::uint32_t base = 0;  // the nvfp4 pool is the first non-empty pool: ids 0..7
  CommitPlan p1 = push_group(t, m, 0, R, 1);
  CHECK(p1.new_blocks == std::vector<std::uint32_t>{base});
  CommitPlan p2 = push_group(t, m, 0, R, 2);
  CHECK(p2.new_blocks == std::vector<std::uint32_t>{base + 1});
  // b0 slots 0..11 written, b1 slots 0..3 written
  CHECK(t.block_fill(base) == 12);
  CHECK(t.block_fill(base + 1) == 4);
  evict_both(t, m, 0, {{base + 1, 2}, {base, 5}, {base, 1}});
  CommitPlan p3 = push_group(t, m, 0, R, 3);
  const std::vector<SlotRef> want3 = {{base, 1},     {base, 5},     {base + 1, 2}, {base + 1, 4},
                                      {base + 1, 5}, {base + 1, 6}, {base + 1, 7}, {base + 1, 8}};
  CHECK(slots_str(p3.slots) == slots_str(want3));
  CHECK(p3.reused_slots == 3);
  CHECK(p3.new_blocks.empty());
  CommitPlan p4 = push_group(t, m, 0, R, 4);
  const std::vector<SlotRef> want4 = {{base + 1, 9}, {base + 1, 10}, {base + 1, 11}, {base + 2, 0},
                                      {base + 2, 1}, {base + 2, 2},  {base + 2, 3},  {base + 2, 4}};
  CHECK(slots_str(p4.slots) == slots_str(want4));
  CHECK(p4.new_blocks == std::vector<std::uint32_t>{base + 2});
  CHECK(p4.reused_slots == 0);
  // The reused slots carry the new group's record, segment and position.
  CHECK(t.slot_record({base, 1}) == p3.record);
  CHECK(t.slot_segment({base, 1}) == 3u);
  CHECK(t.slot_position({base, 1}) == 16);
  CHECK(t.slot_record({base, 0}) == p1.record);
  CHECK(t.slot_position({base, 0}) == 0);
  CHECK(p1.record != p3.record);
  TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
}

TEST_CASE("BlockTable: holes are reused only by the same thought type", "[block_table]") {
  TT_SEEDED_RNG();
  // R and E are both NVFP4: they share a pool but never a block.
  BlockTable t(table_config(8, 16, {0, 0, 8, 4}));
  CtModel m(t.config());
  push_group(t, m, 0, R);
  push_group(t, m, 0, E);
  const std::uint32_t rb = t.blocks(0)[0], eb = t.blocks(0)[1];
  REQUIRE(t.block_thought(rb) == R);
  REQUIRE(t.block_thought(eb) == E);
  // Holes in both: 1..7 in R's block, one in E's.
  std::vector<SlotRef> r_holes;
  for (std::uint32_t i = 0; i < 8; ++i)
    if (chance(rng, 0.5)) r_holes.push_back({rb, i});
  if (r_holes.empty()) r_holes.push_back({rb, 0});
  if (r_holes.size() == 8) r_holes.pop_back();
  const SlotRef e_hole{eb, static_cast<std::uint32_t>(uniform_int(rng, 0, 7))};
  std::vector<SlotRef> victims = r_holes;
  victims.push_back(e_hole);
  std::shuffle(victims.begin(), victims.end(), rng);
  evict_both(t, m, 0, victims);
  const auto r_mask = std::vector<std::uint64_t>(t.evict_mask(rb).begin(), t.evict_mask(rb).end());
  // E: its own hole first, then its own unwritten slots; never R's holes.
  const CommitPlan pe = push_group(t, m, 0, E);
  CHECK(pe.reused_slots == 1);
  CHECK(pe.slots[0] == e_hole);
  CHECK(pe.new_blocks.empty());
  for (SlotRef r : pe.slots) CHECK(r.block == eb);
  CHECK(t.hole_slots(0) == static_cast<std::int64_t>(r_holes.size()));
  CHECK(std::vector<std::uint64_t>(t.evict_mask(rb).begin(), t.evict_mask(rb).end()) == r_mask);
  // R: its holes, then its unwritten slots; E's unwritten slots are not used.
  const CommitPlan pr = push_group(t, m, 0, R);
  for (SlotRef r : pr.slots) CHECK(r.block == rb);
  CHECK(pr.reused_slots == static_cast<int>(r_holes.size()));
  CHECK(t.hole_slots(0) == 0);
  // T goes to the ternary pool.
  const CommitPlan pt = push_group(t, m, 0, T);
  REQUIRE(pt.new_blocks.size() == 1u);
  CHECK(t.block_precision(pt.new_blocks[0]) == Precision::kTernary);
  CHECK(pt.new_blocks[0] >= 8u);
  TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
}

TEST_CASE("BlockTable: per-block segment starts and masks follow eviction and reuse", "[block_table]") {
  // g 8, block 16, one stream: segments 10 and 11 fill block b; evicting slots 0, 1 and 9 and
  // reusing them for segment 12 interleaves three segments in one block.
  BlockTable t(table_config(8, 16, {0, 0, 4, 4}, kR4E4T2, 1));
  CtModel m(t.config());
  push_group(t, m, 0, R, 10);
  push_group(t, m, 0, R, 11);
  const std::uint32_t b = t.blocks(0)[0];
  using BS = BlockTable::BlockSegment;
  CHECK(t.block_segments(b) == std::vector<BS>{{10, 0, {0x00FFu}}, {11, 8, {0xFF00u}}});
  evict_both(t, m, 0, {{b, 0}, {b, 1}, {b, 9}});
  CHECK(t.block_segments(b) == std::vector<BS>{{10, 2, {0x00FCu}}, {11, 8, {0xFD00u}}});
  // The next group of R reuses the three holes (lowest slot first), then opens a fresh block.
  push_group(t, m, 0, R, 12);
  CHECK(t.block_segments(b) == std::vector<BS>{{12, 0, {0x0203u}}, {10, 2, {0x00FCu}}, {11, 8, {0xFD00u}}});
  REQUIRE(t.blocks(0).size() == 2u);
  CHECK(t.block_segments(t.blocks(0)[1]) == std::vector<BS>{{12, 0, {0x001Fu}}});
  TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
}

TEST_CASE("BlockTable: blocks come from the pool of the thought's precision", "[block_table]") {
  for (const PrecisionMap& map : {kR4E4T2, kR8E4T2, kR8E8T4, kFullKvMap}) {
    CAPTURE(map);
    BlockTable t(table_config(8, 8, {3, 4, 5, 6}, map));
    CtModel m(t.config());
    const std::uint32_t base[4] = {0, 3, 7, 12};
    const std::uint32_t count[4] = {3, 4, 5, 6};
    for (ThoughtType th : kAllThoughtTypes) {
      const CommitPlan p = push_group(t, m, 1, th);
      const int pi = static_cast<int>(map.precision_of(th));
      CHECK(p.precision == map.precision_of(th));
      REQUIRE(p.new_blocks.size() == 1u);
      CHECK(p.new_blocks[0] >= base[pi]);
      CHECK(p.new_blocks[0] < base[pi] + count[pi]);
      CHECK((p.record == kNoRecord) == (map.precision_of(th) == Precision::kBf16));
    }
    TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
  }
}

TEST_CASE("BlockTable: fresh blocks are taken lowest free id first (design.md)", "[block_table][design]") {
  // design.md, "Commit placement": "3. fresh blocks from the precision's pool (lowest free id first)".
  BlockTable t(table_config(8, 8, {0, 0, 6, 2}, kR4E4T2, 1));
  CtModel m(t.config());
  m.require_lowest_free_id = true;
  for (int i = 0; i < 4; ++i) push_group(t, m, 0, R);  // blocks 0,1,2,3
  REQUIRE(t.blocks(0).size() == 4u);
  std::vector<SlotRef> b1, b3;
  for (std::uint32_t i = 0; i < 8; ++i) {
    b1.push_back({1, i});
    b3.push_back({3, i});
  }
  evict_both(t, m, 0, b1);  // frees block 1
  evict_both(t, m, 0, b3);  // then block 3
  Diff d;
  CommitPlan p;
  for (int i = 0; i < 8; ++i) REQUIRE(push_token(t, m, 0, R, 0, d, &p).is_ok());
  INFO(d.msg);
  CHECK(p.new_blocks == std::vector<std::uint32_t>{1});
  CHECK(d.ok());
}

TEST_CASE("BlockTable: a block whose live count reaches 0 returns to its pool", "[block_table]") {
  TT_SEEDED_RNG();
  const int bs = uniform_int(rng, 4, 16);
  BlockTable t(table_config(8, bs, {0, 0, 6, 2}));
  CtModel m(t.config());
  push_group(t, m, 0, R);
  push_group(t, m, 0, R);
  push_group(t, m, 0, R);
  const std::uint32_t b0 = t.blocks(0)[0];
  const std::size_t free_before = t.free_blocks(Precision::kNvfp4);
  std::vector<SlotRef> slots;
  for (int i = 0; i < t.block_fill(b0); ++i) slots.push_back({b0, static_cast<std::uint32_t>(i)});
  std::shuffle(slots.begin(), slots.end(), rng);
  // All but one: the block stays, holding holes.
  std::vector<SlotRef> most(slots.begin(), slots.end() - 1);
  evict_both(t, m, 0, most);
  CHECK(t.block_owner(b0) == 0);
  CHECK(t.hole_slots(0) == static_cast<std::int64_t>(most.size()));
  CHECK(t.free_blocks(Precision::kNvfp4) == free_before);
  // The last one: the block is freed and its holes are no longer counted.
  evict_both(t, m, 0, {slots.back()});
  CHECK(t.block_owner(b0) == kNoStream);
  CHECK(t.hole_slots(0) == 0);
  CHECK(t.free_blocks(Precision::kNvfp4) == free_before + 1);
  CHECK(std::find(t.blocks(0).begin(), t.blocks(0).end(), b0) == t.blocks(0).end());
  CHECK(t.stats().blocks_freed == 1);
}

TEST_CASE("BlockTable: key-scale records are refcounted and freed with their last live slot", "[block_table]") {
  TT_SEEDED_RNG();
  // block_size 5 < g 8: one group spans two blocks, and its record is shared across them.
  BlockTable t(table_config(8, 5, {0, 0, 8, 2}));
  CtModel m(t.config());
  const CommitPlan p = push_group(t, m, 0, R);
  push_group(t, m, 0, R);
  REQUIRE(p.record != kNoRecord);
  CHECK(t.record_refs(p.record) == 8);
  CHECK(t.record_owner(p.record) == 0);
  CHECK(t.records_held(0) == 2);
  const std::size_t free_records = t.free_records();
  std::vector<SlotRef> group = p.slots;
  std::shuffle(group.begin(), group.end(), rng);
  for (int i = 0; i < 7; ++i) {
    evict_both(t, m, 0, {group[i]});
    CHECK(t.record_refs(p.record) == 7 - i);
    CHECK(t.free_records() == free_records);
  }
  evict_both(t, m, 0, {group[7]});
  CHECK(t.record_refs(p.record) == 0);
  CHECK(t.record_owner(p.record) == kNoStream);
  CHECK(t.free_records() == free_records + 1);
  CHECK(t.records_held(0) == 1);
  CHECK(t.stats().records_freed == 1);
}

TEST_CASE("BlockTable: evict is all-or-nothing", "[block_table][errors]") {
  TT_SEEDED_RNG();
  BlockTable t(table_config(8, 12, {0, 0, 6, 3}, kR4E4T2, 3));
  CtModel m(t.config());
  push_group(t, m, 0, R);
  push_group(t, m, 0, T);
  push_group(t, m, 1, E);
  Diff d;
  for (int i = 0; i < 3; ++i) REQUIRE(push_token(t, m, 0, R, 0, d).is_ok());  // staged, not committed
  auto live0 = m.live_slots(0);
  const SlotRef gone = live0[static_cast<std::size_t>(uniform_int(rng, 0, static_cast<int>(live0.size()) - 1))];
  evict_both(t, m, 0, {gone});
  live0 = m.live_slots(0);
  const SlotRef other = m.live_slots(1)[0];
  const std::uint32_t rblock = t.blocks(0)[0];
  const std::uint32_t free_block = t.free_blocks(Precision::kNvfp4) > 0 ? 5u : 0u;  // ids 3..5 unheld
  REQUIRE(t.block_owner(free_block) == kNoStream);
  struct Case {
    const char* what;
    SlotRef bad;
    StatusCode code;
  };
  const Case cases[] = {
      {"already evicted", gone, StatusCode::kInvalidArgument},
      {"slot of another stream", other, StatusCode::kInvalidArgument},
      {"unwritten slot of an own block", {rblock, 11}, StatusCode::kInvalidArgument},
      {"slot of a free block", {free_block, 0}, StatusCode::kInvalidArgument},
      {"block out of range", {t.pools().total, 0}, StatusCode::kOutOfRange},
      {"block far out of range", {0xFFFFFFF0u, 1}, StatusCode::kOutOfRange},
      {"slot out of range", {rblock, 12}, StatusCode::kOutOfRange},
      {"slot far out of range", {rblock, 0x80000000u}, StatusCode::kOutOfRange},
  };
  const auto before = tt::snapshot_table(t);
  for (const Case& c : cases) {
    CAPTURE(c.what);
    for (int where : {0, 1, 2}) {  // alone, after valid slots, between valid slots
      std::vector<SlotRef> batch;
      if (where == 0) batch = {c.bad};
      if (where == 1) batch = {live0[0], live0[3], c.bad};
      if (where == 2) batch = {live0[1], c.bad, live0[2]};
      const Status st = t.evict(0, batch);
      CHECK(st.code() == c.code);
      CHECK_THAT(st.message(), Contains(std::to_string(c.bad.block)));
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
    }
  }
  SECTION("duplicate slot") {
    for (const auto& batch :
         {std::vector<SlotRef>{live0[2], live0[2]}, std::vector<SlotRef>{live0[0], live0[4], live0[5], live0[4]}}) {
      const Status st = t.evict(0, batch);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_THAT(st.message(), Contains("twice"));
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
    }
  }
  SECTION("stream out of range") {
    for (int s : {-1, 3, 1000}) {
      CHECK(t.evict(s, std::vector<SlotRef>{live0[0]}).code() == StatusCode::kOutOfRange);
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
    }
  }
  SECTION("the same slots evicted correctly afterwards") { evict_both(t, m, 0, {live0[0], live0[3]}); }
}

TEST_CASE("BlockTable: pool exhaustion", "[block_table][errors]") {
  TT_SEEDED_RNG();
  BlockTable t(table_config(8, 5, {0, 0, 3, 1}, kR4E4T2, 2));
  CtModel m(t.config());
  push_group(t, m, 0, R);  // 2 of the 3 NVFP4 blocks (5 + 3 slots)
  Diff d;
  for (int i = 0; i < 7; ++i) REQUIRE(push_token(t, m, 1, E, 0, d).is_ok());
  auto before = tt::snapshot_table(t);
  CommitPlan plan;
  plan.record = 12345;
  Status st = t.plan_commit(1, E, plan);  // needs 2 fresh blocks, 1 free
  CHECK(st.code() == StatusCode::kPoolExhausted);
  CHECK_THAT(st.message(), Contains("nvfp4") && Contains("pool_blocks[nvfp4]"));
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
  CHECK(m.fit(1, E) == StatusCode::kPoolExhausted);
  // R's holes do not help E ...
  evict_both(t, m, 0, {m.live_slots(0)[0], m.live_slots(0)[1]});
  before = tt::snapshot_table(t);
  CHECK(t.plan_commit(1, E, plan).code() == StatusCode::kPoolExhausted);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
  // ... but freeing R's second block does (1 + 1 free blocks).
  auto live = m.live_slots(0);
  std::vector<SlotRef> second;
  for (SlotRef r : live)
    if (r.block == t.blocks(0)[1]) second.push_back(r);
  evict_both(t, m, 0, second);
  REQUIRE(t.free_blocks(Precision::kNvfp4) == 2u);
  REQUIRE(push_token(t, m, 1, E, 0, d).is_ok());
  TT_REQUIRE_OK_DIFF(d);
  TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
  // The ternary pool is separate: one block of 5 slots, g = 8 needs two.
  for (int i = 0; i < 7; ++i) REQUIRE(push_token(t, m, 0, T, 0, d).is_ok());
  before = tt::snapshot_table(t);
  st = t.plan_commit(0, T, plan);
  CHECK(st.code() == StatusCode::kPoolExhausted);
  CHECK_THAT(st.message(), Contains("ternary"));
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
}

TEST_CASE("BlockTable: record pool exhaustion with a small record_capacity", "[block_table][errors]") {
  // R16E4T2: R is BF16 (no record), E and T need one record per group.
  const PrecisionMap map(Precision::kBf16, Precision::kNvfp4, Precision::kTernary);
  BlockTable t(table_config(8, 8, {4, 0, 8, 8}, map, 2, 2));
  CtModel m(t.config());
  CHECK(t.record_capacity() == 2);
  const CommitPlan e1 = push_group(t, m, 0, E);
  push_group(t, m, 1, T);
  CHECK(t.free_records() == 0u);
  Diff d;
  for (int i = 0; i < 7; ++i) REQUIRE(push_token(t, m, 0, T, 0, d).is_ok());
  const auto before = tt::snapshot_table(t);
  CommitPlan plan;
  const Status st = t.plan_commit(0, T, plan);
  CHECK(st.code() == StatusCode::kPoolExhausted);
  CHECK_THAT(st.message(), Contains("record") && Contains("record_capacity"));
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
  // A BF16 group needs no record.
  const CommitPlan r1 = push_group(t, m, 1, R);
  CHECK(r1.record == kNoRecord);
  // Freeing E's group (all 8 slots) frees its record; T then commits.
  evict_both(t, m, 0, e1.slots);
  REQUIRE(push_token(t, m, 0, T, 0, d).is_ok());
  TT_REQUIRE_OK_DIFF(d);
  CHECK(t.slot_record(m.live_slots(0).back()) == e1.record);
  TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
}

TEST_CASE("BlockTable: a thought type change inside a staging group is rejected", "[block_table][errors]") {
  BlockTable t(table_config(8, 8, {0, 0, 4, 4}));
  CtModel m(t.config());
  Diff d;
  for (int i = 0; i < 3; ++i) REQUIRE(push_token(t, m, 0, E, 7, d).is_ok());
  const auto before = tt::snapshot_table(t);
  const Status st = t.check_stage(0, T);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Contains("T") && Contains("E") && Contains("group_size (8)"));
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
  CHECK(t.check_stage(0, E).is_ok());
  CHECK(t.check_stage(1, T).is_ok());  // other streams are independent
  CHECK(t.check_stage(2, E).code() == StatusCode::kOutOfRange);
  CHECK(t.check_stage(-1, E).code() == StatusCode::kOutOfRange);
}

TEST_CASE("BlockTable: streams of a staging set share one staging record", "[block_table][stage_set]") {
  // 6 streams in sets of 3: a token is pushed once for a set; each stream commits the full group
  // on its own, and reads 0 staged once it has, the others g until they do.
  CacheConfig c = table_config(8, 8, {0, 0, 16, 16}, kR4E4T2, 6);
  c.stage_set_streams = 3;
  BlockTable t(c);
  CHECK(t.stage_set(2) == 0);
  CHECK(t.stage_set(3) == 1);
  for (int i = 0; i < 7; ++i) {
    REQUIRE(t.check_stage(0, E).is_ok());
    CHECK(t.push_staged(1, E, 5) == i);  // any stream of the set pushes for all of it
  }
  for (int s = 0; s < 3; ++s) CHECK(t.staged_count(s) == 7);
  for (int s = 3; s < 6; ++s) CHECK(t.staged_count(s) == 0);  // another set
  CHECK(t.next_position(2) == 7);
  CHECK(t.check_stage(2, T).code() == StatusCode::kInvalidArgument);  // one group, one type
  CHECK(t.check_stage(3, T).is_ok());
  CHECK(t.push_staged(0, E, 6) == 7);  // completes the group
  CommitPlan plan;
  REQUIRE(t.plan_commit(1, E, plan).is_ok());
  t.apply_commit(plan);
  CHECK(t.staged_count(1) == 0);
  CHECK(t.staged_count(0) == 8);  // not committed yet
  CHECK(t.staged_count(2) == 8);
  const auto live = t.live_slot_list(1);
  REQUIRE(live.size() == 8);
  for (int i = 0; i < 8; ++i) {
    CHECK(t.slot_position(live[static_cast<std::size_t>(i)]) == i);
    CHECK(t.slot_segment(live[static_cast<std::size_t>(i)]) == (i < 7 ? 5u : 6u));
  }
  for (int s : {0, 2}) {
    REQUIRE(t.plan_commit(s, E, plan).is_ok());
    t.apply_commit(plan);
    CHECK(t.staged_count(s) == 0);
  }
  CHECK(t.check_stage(0, T).is_ok());  // the group is done: a new one may take another type
  CHECK(t.push_staged(2, T, 7) == 0);
  for (int s = 0; s < 3; ++s) CHECK(t.staged_count(s) == 1);
  CHECK(t.staged_position(0, 0) == 8);
  t.pop_staged(0);
  for (int s = 0; s < 3; ++s) CHECK(t.staged_count(s) == 0);
  CHECK(t.next_position(0) == 8);
  // A prompt's tail: the set's group set directly; reset starts the set over.
  const std::uint32_t segs[] = {9, 9};
  t.set_staged(0, R, segs, 10);
  CHECK(t.staged_count(1) == 2);
  CHECK(t.staged_position(1, 0) == 8);
  CHECK(t.staged_position(1, 1) == 9);
  CHECK(t.next_position(2) == 10);
  t.reset_stream(1);
  CHECK(t.staged_count(0) == 0);
  CHECK(t.next_position(0) == 0);
  // stage_set_streams must divide num_streams.
  c.stage_set_streams = 4;
  CHECK_THAT(c.validate().message(), Contains("stage_set_streams 4 must divide num_streams 6"));
  c.stage_set_streams = 0;
  CHECK_FALSE(c.validate().is_ok());
}

TEST_CASE("BlockTable: randomized invariants against an independent model", "[block_table][random]") {
  TT_SEEDED_RNG();
  for (int config_i = 0; config_i < 8; ++config_i) {
    const int gs[] = {8, 16, 32};
    const int g = gs[uniform_int(rng, 0, 2)];
    const int bs_choices[] = {1, 3, 5, 8, 12, 16, 32, 64, 65, 100};
    const int bs = bs_choices[uniform_int(rng, 0, 9)];
    const PrecisionMap maps[] = {kR4E4T2, kR8E4T2, kR8E8T4, kFullKvMap,
                                 PrecisionMap(Precision::kBf16, Precision::kNvfp4, Precision::kTernary)};
    const PrecisionMap map = maps[uniform_int(rng, 0, 4)];
    const int streams = uniform_int(rng, 1, 4);
    std::array<int, 4> pools{};
    const int need = (g + bs - 1) / bs;  // blocks per group, at least
    for (Precision p : kAllPrecisions)
      pools[static_cast<int>(p)] = map.uses(p) ? uniform_int(rng, need, need * 6 + 4) : uniform_int(rng, 0, 2);
    const int records = chance(rng, 0.3) ? uniform_int(rng, 1, 12) : 0;
    CacheConfig cfg = table_config(g, bs, pools, map, streams, records);
    CAPTURE(config_i, cfg);
    BlockTable t(cfg);
    CtModel m(cfg);
    int commits = 0, exhausted = 0, evictions = 0, errors = 0, resets = 0;
    for (int step = 0; step < 1000; ++step) {
      CAPTURE(step);
      const int s = uniform_int(rng, 0, streams - 1);
      const double a = uniform01(rng);
      Diff d;
      if (a < 0.75) {  // append a token (a whole group, most of the time, to keep this fast)
        const int n = chance(rng, 0.7) ? g - static_cast<int>(m.S(s).staged.size()) : 1;
        ThoughtType th = tt::next_thought(rng, m, s);
        for (int i = 0; i < n; ++i) {
          if (!m.S(s).staged.empty() && chance(rng, 0.02)) {  // a wrong type mid-group
            const ThoughtType other = kAllThoughtTypes[(static_cast<int>(th) + 1) % 3];
            REQUIRE(t.check_stage(s, other).code() == StatusCode::kInvalidArgument);
            ++errors;
          }
          const bool fills = static_cast<int>(m.S(s).staged.size()) + 1 == g;
          const StatusCode predicted = fills ? m.fit(s, th) : StatusCode::kOk;
          std::vector<std::string> before;
          const bool snap = fills && ((predicted != StatusCode::kOk && exhausted < 4) || step % 50 == 0);
          if (snap) before = tt::snapshot_table(t);
          CommitPlan p1, p2;
          if (fills) {  // purity: the same plan twice
            const Status s1 = t.plan_commit(s, th, p1);
            const Status s2 = t.plan_commit(s, th, p2);
            REQUIRE(s1.code() == s2.code());
            if (s1.is_ok()) REQUIRE(same_plan(p1, p2));
          }
          const Status st = push_token(t, m, s, th, static_cast<std::uint32_t>(uniform_int(rng, 0, 1000)), d);
          REQUIRE(st.code() == predicted);
          if (!st.is_ok()) {
            ++exhausted;
            if (snap) TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
            break;
          }
          if (snap) {
            const auto after = tt::snapshot_table(t);
            REQUIRE(after != before);
          }
          commits += fills;
        }
      } else if (a < 0.97) {  // evict
        if (m.live_count(s) == 0) continue;
        auto batch = tt::random_live_subset(rng, m, s, chance(rng, 0.2) ? 1000 : 2 * g);
        if (chance(rng, 0.1)) {  // poison the batch: nothing may change
          const int kind = uniform_int(rng, 0, 3);
          SlotRef bad{};
          if (kind == 0) bad = batch[0];                                          // duplicate
          if (kind == 1) bad = {m.total_blocks() + 3, 0};                         // no such block
          if (kind == 2) bad = {t.blocks(s)[0], static_cast<std::uint32_t>(bs)};  // no such slot
          if (kind == 3) {                                                        // not live / not ours
            bad = {m.total_blocks(), 0};
            for (std::uint32_t b = 0; b < m.total_blocks(); ++b)
              if (t.block_owner(b) != s) {
                bad = {b, 0};
                break;
              }
            for (const auto& mb : m.S(s).blocks)
              for (int i = 0; i < mb.fill; ++i)
                if (mb.slots[i].evicted) bad = {mb.real, static_cast<std::uint32_t>(i)};
          }
          batch.insert(batch.begin() + uniform_int(rng, 0, static_cast<int>(batch.size())), bad);
          REQUIRE_FALSE(t.evict(s, batch).is_ok());
          ++errors;
        } else {
          REQUIRE(t.evict(s, batch).is_ok());
          m.evict(s, batch);
          ++evictions;
        }
      } else {  // end of sequence
        t.reset_stream(s);
        m.reset(s);
        ++resets;
      }
      TT_REQUIRE_OK_DIFF(d);
      TT_REQUIRE_OK_DIFF(tt::check_table(t, m));
    }
    CAPTURE(commits, exhausted, evictions, errors, resets);
    CHECK(commits > 10);
    CHECK(evictions > 10);
  }
}

TEST_CASE("flatten_block_table gives the arrays a device kernel reads, equal to the table's view",
          "[block_table][flat]") {
  TT_SEEDED_RNG();
  CacheConfig c = table_config(8, 100, {0, 40, 40, 40}, kR4E4T2, 3);  // 100 slots: 2 mask words
  BlockTable t(c);
  CtModel m(c);
  // Random groups of every type, random evictions: holes, reuse, several blocks per stream.
  for (int i = 0; i < 40; ++i) {
    const int s = uniform_int(rng, 0, 2);
    push_group(t, m, s, static_cast<ThoughtType>(uniform_int(rng, 0, 2)));
    if (chance(rng, 0.4)) {
      auto live = t.live_slot_list(s);
      std::shuffle(live.begin(), live.end(), rng);
      live.resize(live.size() / 3);
      REQUIRE(t.evict(s, live).is_ok());
      m.evict(s, live);
    }
  }
  Diff d;
  REQUIRE(push_token(t, m, 1, R, 0, d).is_ok());  // one staged token
  // The flat arrays number the blocks with storage compactly, pool after pool; a device may
  // give a pool more pages than the table has allocated (its buffer's capacity).
  for (const bool wider : {false, true}) {
    CAPTURE(wider);
    std::uint32_t pages[kNumPrecisions];
    std::uint32_t n = 0;
    for (Precision p : kAllPrecisions) {
      pages[static_cast<int>(p)] = t.allocated_blocks(p) + (wider ? 3u : 0u);
      n += pages[static_cast<int>(p)];
    }
    FlatBlockTable f;
    flatten_block_table(t, f, wider ? pages : nullptr);
    REQUIRE(f.evict_mask_words == 2);
    REQUIRE(f.total_blocks == n);
    REQUIRE(f.block_fill.size() == n);
    REQUIRE(f.evict_mask.size() == static_cast<std::size_t>(n) * 2);
    REQUIRE(f.slot_record.size() == static_cast<std::size_t>(n) * 100);
    std::uint32_t base = 0;
    for (Precision p : kAllPrecisions) {
      const int pi = static_cast<int>(p);
      REQUIRE(f.pool_base[pi] == base);
      REQUIRE(f.pool_count[pi] == pages[pi]);
      for (std::uint32_t i = 0; i < pages[pi]; ++i) {
        const std::uint32_t fb = base + i;  // the flat id
        if (i >= t.allocated_blocks(p)) {   // past the table's storage: an empty block
          if (f.block_fill[fb] != 0) d.fail("fill of flat block ", fb);
          for (std::uint32_t k = 0; k < 100; ++k) {
            if ((f.evict_mask[fb * 2 + k / 64] >> (k % 64)) & 1u) d.fail("mask bit of flat block ", fb);
            if (f.slot_record[fb * 100 + k] != thinkv::kNoRecord) d.fail("record of flat block ", fb);
          }
          continue;
        }
        const std::uint32_t b = t.pools().base[pi] + i;  // the table's id
        if (f.flat_id(t, b) != fb) d.fail("flat id of block ", b);
        if (f.block_fill[fb] != t.block_fill(b)) d.fail("fill of block ", b);
        for (std::uint32_t k = 0; k < 100; ++k) {
          const bool evicted = (f.evict_mask[fb * 2 + k / 64] >> (k % 64)) & 1u;
          if (evicted != t.is_evicted({b, k})) d.fail("mask bit of block ", b, " slot ", k);
          if (f.slot_record[fb * 100 + k] != t.slot_record({b, k})) d.fail("record of block ", b, " slot ", k);
        }
      }
      base += pages[pi];
    }
    for (int s = 0; s < 3; ++s) {
      const auto blocks = t.blocks(s);
      const auto lo = static_cast<std::size_t>(f.block_indptr[static_cast<std::size_t>(s)]);
      const auto hi = static_cast<std::size_t>(f.block_indptr[static_cast<std::size_t>(s) + 1]);
      REQUIRE(hi - lo == blocks.size());
      for (std::size_t j = 0; j < blocks.size(); ++j) {
        const Precision p = t.block_precision(blocks[j]);
        const std::uint32_t want = f.pool_base[static_cast<int>(p)] + (blocks[j] - t.pools().base[static_cast<int>(p)]);
        if (f.block_indices[lo + j] != want) d.fail("block list of stream ", s, " entry ", j);
      }
      if (f.staged_count[static_cast<std::size_t>(s)] != t.staged_count(s)) d.fail("staged count of stream ", s);
    }
    CHECK(f.staged_count[1] == 1);
  }
  CHECK(t.stats().slots_evicted > 0);
  TT_REQUIRE_OK_DIFF(d);
}

TEST_CASE("The pools' change log brings a mirror of the metadata up to date with the pages changed",
          "[block_table][flat][delta]") {
  // A mirror kept as a device backend keeps it (CudaKvBackend::attend): the flat arrays copied
  // whole on the first sync and after the numbering changed (storage grew or shrank) or a log
  // was trimmed, else only the pages flat_changes lists. After every sync it must equal a fresh
  // flattening, and in steady state it must be brought up to date by changes alone.
  TT_SEEDED_RNG();
  // Rounds 6..11 number the mirror over a fixed capacity (a device's storage, CudaKvBackend's
  // cap[]) while the table's pools grow and shrink inside it: growth and release then go by
  // changes too (new pages are logged), and only the pages with storage are compared.
  for (int round = 0; round < 12; ++round) {
    const bool fixed = round >= 6;
    const int bs = std::array{5, 16, 100}[static_cast<std::size_t>(round % 3)];
    CacheConfig c = table_config(8, bs, {0, 60, 60, 60}, kR4E4T2, 3);
    c.chunk_blocks = 4;  // storage grows and shrinks often
    const std::uint32_t caps[kNumPrecisions] = {0, 60, 60, 60};
    const std::uint32_t* pages = fixed ? caps : nullptr;
    CAPTURE(round, bs, fixed);
    BlockTable t(c);
    CtModel m(c);
    FlatBlockTable mirror, fresh;
    FlatBlockDelta delta;
    std::uint64_t rev[kNumPrecisions] = {};
    bool synced = false;
    int full = 0, by_changes = 0, pages_sent = 0, unchanged = 0;
    std::vector<std::int32_t> all{0, 1, 2};
    std::vector<StreamView> views;
    for (int op = 0; op < 400; ++op) {
      CAPTURE(op);
      const int s = uniform_int(rng, 0, 2);
      const double a = uniform01(rng);
      if (a < 0.6) {
        const auto th = static_cast<ThoughtType>(uniform_int(rng, 0, 2));
        if (m.fit(s, th) != StatusCode::kOk) continue;
        push_group(t, m, s, th);
      } else if (a < 0.95) {
        auto live = t.live_slot_list(s);
        if (live.empty()) continue;
        std::shuffle(live.begin(), live.end(), rng);
        live.resize(static_cast<std::size_t>(uniform_int(rng, 1, static_cast<int>(live.size()))));
        REQUIRE(t.evict(s, live).is_ok());
        m.evict(s, live);
      } else {
        t.reset_stream(s);
        m.reset(s);
      }
      if (!chance(rng, 0.4)) continue;  // several operations between syncs, sometimes
      const AttendView view = t.attend_view(all, views);
      FlatBlockTable numbering;
      flat_numbering(view, numbering, pages);
      bool whole = !synced;
      for (int p = 0; p < kNumPrecisions; ++p) whole = whole || numbering.pool_count[p] != mirror.pool_count[p];
      if (!whole) whole = !flat_changes(view, mirror, rev, delta);
      if (whole) {
        flatten_attend_view(view, 3, mirror, pages);
        ++full;
      } else {
        const int words = mirror.evict_mask_words;
        for (std::size_t i = 0; i < delta.size(); ++i) {
          const std::uint32_t b = delta.ids[i];
          mirror.block_fill[b] = delta.fill[i];
          std::copy_n(delta.evict_mask.begin() + static_cast<std::ptrdiff_t>(i * words), words,
                      mirror.evict_mask.begin() + static_cast<std::ptrdiff_t>(b * words));
          std::copy_n(delta.slot_record.begin() + static_cast<std::ptrdiff_t>(i * bs), bs,
                      mirror.slot_record.begin() + static_cast<std::ptrdiff_t>(b * bs));
        }
        ++by_changes;
        pages_sent += static_cast<int>(delta.size());
        unchanged += delta.size() == 0;
        // Each page at most once, and only pages with storage.
        std::vector<std::uint32_t> ids = delta.ids;
        std::sort(ids.begin(), ids.end());
        REQUIRE(std::adjacent_find(ids.begin(), ids.end()) == ids.end());
        if (!ids.empty()) REQUIRE(ids.back() < mirror.total_blocks);
      }
      for (int p = 0; p < kNumPrecisions; ++p) rev[p] = view.pools[p].revision;
      synced = true;
      flatten_attend_view(view, 3, fresh, pages);
      REQUIRE(mirror.total_blocks == fresh.total_blocks);
      if (fixed) {  // pages without storage hold whatever they last held: compare the others
        for (int p = 0; p < kNumPrecisions; ++p) {
          const std::size_t b0 = mirror.pool_base[p], n = view.pools[p].blocks;
          const auto w = static_cast<std::size_t>(mirror.evict_mask_words);
          const auto sb = static_cast<std::size_t>(bs);
          REQUIRE(std::equal(mirror.block_fill.begin() + b0, mirror.block_fill.begin() + b0 + n,
                             fresh.block_fill.begin() + b0));
          REQUIRE(std::equal(mirror.evict_mask.begin() + b0 * w, mirror.evict_mask.begin() + (b0 + n) * w,
                             fresh.evict_mask.begin() + b0 * w));
          REQUIRE(std::equal(mirror.slot_record.begin() + b0 * sb, mirror.slot_record.begin() + (b0 + n) * sb,
                             fresh.slot_record.begin() + b0 * sb));
        }
        continue;
      }
      REQUIRE(mirror.block_fill == fresh.block_fill);
      REQUIRE(mirror.evict_mask == fresh.evict_mask);
      REQUIRE(mirror.slot_record == fresh.slot_record);
    }
    CAPTURE(full, by_changes, pages_sent, unchanged);
    if (fixed) {
      CHECK(full <= 3);  // the first sync, and a trimmed log now and then: growth went by changes
    } else {
      CHECK(full >= 2);  // the first sync, and at least one change of the storage
    }
    CHECK(by_changes > full);  // steady state goes by changes
    CHECK(pages_sent > 0);
  }
}

TEST_CASE("The change log: a mirror too far behind is told to copy the pool", "[block_table][flat][delta]") {
  CacheConfig c =
      table_config(8, 8, {0, 0, 8, 0}, PrecisionMap(Precision::kNvfp4, Precision::kNvfp4, Precision::kNvfp4), 1);
  BlockTable t(c);
  CtModel m(c);
  push_group(t, m, 0, R);
  const PoolView first = t.pool_view(Precision::kNvfp4);
  std::span<const std::uint32_t> pages;
  REQUIRE(first.changes_since(first.revision, pages));
  CHECK(pages.empty());
  CHECK_FALSE(first.changes_since(first.revision + 1, pages));  // from the future
  const std::uint64_t synced = first.revision;
  // Evict and refill one slot many times: the log outgrows its bound and restarts.
  for (int i = 0; i < 3001; ++i) {
    const SlotRef r = t.live_slot_list(0)[0];
    REQUIRE(t.evict(0, std::vector<SlotRef>{r}).is_ok());
    m.evict(0, std::vector<SlotRef>{r});
    if (t.live_slot_list(0).empty()) { push_group(t, m, 0, R); }
  }
  for (int i = 0; i < 3; ++i) {  // three changes the log holds
    const std::vector<SlotRef> one{t.live_slot_list(0)[0]};
    REQUIRE(t.evict(0, one).is_ok());
    m.evict(0, one);
  }
  const PoolView later = t.pool_view(Precision::kNvfp4);
  CHECK(later.revision > synced + 1024);
  CHECK(later.changed.size() <= 1024);
  CHECK_FALSE(later.changes_since(synced, pages));
  REQUIRE(later.changes_since(later.revision - 3, pages));
  CHECK(pages.size() == 3);
}

TEST_CASE("live_segment_slots lists exactly a segment's live slots, in live_slot_list order", "[block_table]") {
  TT_SEEDED_RNG();
  CacheConfig c = table_config(8, 16, {0, 200, 200, 200}, kR4E4T2, 3);
  BlockTable t(c);
  CtModel m(c);
  std::uint32_t next_seg = 0;
  std::vector<SlotRef> got;
  for (int op = 0; op < 600; ++op) {
    CAPTURE(op);
    const int s = uniform_int(rng, 0, 2);
    if (chance(rng, 0.6)) {
      const auto th = static_cast<ThoughtType>(uniform_int(rng, 0, 2));
      if (m.fit(s, th) != StatusCode::kOk) continue;
      if (chance(rng, 0.3)) ++next_seg;  // later groups go to newer segments, reusing older holes
      push_group(t, m, s, th, next_seg);
    } else {
      auto live = t.live_slot_list(s);
      if (live.empty()) continue;
      std::shuffle(live.begin(), live.end(), rng);
      live.resize(static_cast<std::size_t>(uniform_int(rng, 1, static_cast<int>(live.size()))));
      REQUIRE(t.evict(s, live).is_ok());
      m.evict(s, live);
    }
    for (int st = 0; st < 3; ++st) {
      const std::vector<SlotRef> all = t.live_slot_list(st);
      for (std::uint32_t seg = 0; seg <= next_seg; ++seg) {
        std::vector<SlotRef> want;
        for (SlotRef r : all) {
          if (t.slot_segment(r) == seg) want.push_back(r);
        }
        t.live_segment_slots(st, seg, got);
        REQUIRE(got == want);
      }
    }
  }
  CHECK(t.stats().slots_reused > 0);
}

TEST_CASE("BlockTable: a shared block is read by every holder, refused by evict, passed on, copied on write",
          "[block_table][shared]") {
  const int g = 8, bs = 16;
  BlockTable t(table_config(g, bs, {0, 0, 8, 4}, kR4E4T2, 3));
  auto group = [&](int s, ThoughtType th) {
    for (int i = 0; i < g; ++i) {
      REQUIRE(t.check_stage(s, th).is_ok());
      CommitPlan plan;
      const bool fills = t.staged_count(s) + 1 == g;
      if (fills) REQUIRE(t.plan_commit(s, th, plan).is_ok());
      t.push_staged(s, th, 0);
      if (fills) t.apply_commit(plan);
    }
  };
  for (int i = 0; i < 5; ++i) group(0, R);  // positions 0..39: two full blocks and a half one
  const std::vector<std::uint32_t> src(t.blocks(0).begin(), t.blocks(0).end());
  REQUIRE(src.size() == 3);
  CHECK(t.shareable_prefix(0, 1000) == 2);
  CHECK(t.shareable_prefix(0, 24) == 1);  // the second block holds positions 16..31
  CHECK(t.shareable_prefix(0, 15) == 0);
  const std::int64_t allocated = t.allocated_bytes();
  const std::uint32_t rec0 = t.slot_record({src[0], 0});

  REQUIRE(t.share_prefix(0, 1, 2).is_ok());
  REQUIRE(t.share_prefix(0, 2, 1).is_ok());
  CHECK(std::vector<std::uint32_t>(t.blocks(1).begin(), t.blocks(1).end()) ==
        std::vector<std::uint32_t>{src[0], src[1]});
  CHECK(t.live_slots(1) == 2 * bs);
  const std::vector<SlotRef> live0 = t.live_slot_list(0);
  CHECK(t.live_slot_list(1) == std::vector<SlotRef>(live0.begin(), live0.begin() + 2 * bs));
  CHECK(t.records_held(1) == 0);
  CHECK(t.allocated_bytes() == allocated);
  CHECK(t.shared_blocks() == 2);
  CHECK(std::vector<std::int32_t>(t.holders(src[0]).begin(), t.holders(src[0]).end()) ==
        std::vector<std::int32_t>{0, 1, 2});
  // What may not be shared: a partly written block, a block the destination holds.
  CHECK(t.share_prefix(0, 2, 3).code() == StatusCode::kInvalidArgument);
  CHECK(t.share_prefix(0, 1, 1).code() == StatusCode::kInvalidArgument);
  CHECK(t.blocks(2).size() == 1);
  // No holder evicts in a shared block, the owner included.
  for (int s : {0, 1, 2}) {
    const Status e = t.evict(s, std::vector<SlotRef>{{src[0], 3}});
    CHECK(e.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(e.message(), Contains("share"));
  }
  CHECK(t.live_slots(0) == 5 * g);
  // A holder's own commits go to a fresh block (the shared ones are full).
  group(1, R);
  REQUIRE(t.blocks(1).size() == 3);
  CHECK(std::find(src.begin(), src.end(), t.blocks(1)[2]) == src.end());

  // The owner leaves: the next holder owns the blocks and their records; src[1] is no longer shared.
  const std::size_t free_before = t.free_blocks(Precision::kNvfp4);
  t.reset_stream(0);
  CHECK(t.free_blocks(Precision::kNvfp4) == free_before + 1);  // only its own half block
  CHECK(t.block_owner(src[0]) == 1);
  CHECK(t.block_owner(src[1]) == 1);
  CHECK(t.record_owner(rec0) == 1);
  CHECK(t.records_held(1) == 1 + 2 * (bs / g));
  CHECK(t.is_shared(src[0]));
  CHECK_FALSE(t.is_shared(src[1]));
  CHECK(t.holders(src[1]).empty());
  REQUIRE(t.evict(1, std::vector<SlotRef>{{src[1], 0}}).is_ok());

  // Copy on write: stream 2's copy of src[0], its own records; src[0] stays stream 1's.
  BlockTable::UnsharePlan u;
  PlanClaims claims;
  CHECK(t.plan_unshare(0, src[0], u, claims).code() == StatusCode::kInvalidArgument);  // not a holder any more
  REQUIRE(t.plan_unshare(2, src[0], u, claims).is_ok());
  REQUIRE(u.records_from.size() == static_cast<std::size_t>(bs / g));
  t.apply_unshare(std::span(&u, 1));
  CHECK(t.blocks(2)[0] == u.to);
  CHECK(u.to != src[0]);
  CHECK_FALSE(t.is_shared(src[0]));
  CHECK(t.shared_blocks() == 0);
  CHECK(t.block_owner(src[0]) == 1);
  CHECK(t.block_owner(u.to) == 2);
  CHECK(t.records_held(2) == bs / g);
  CHECK(t.live_slots(2) == bs);
  for (int i = 0; i < bs; ++i) {
    const SlotRef a{src[0], static_cast<std::uint32_t>(i)}, b{u.to, static_cast<std::uint32_t>(i)};
    CHECK(t.slot_position(b) == t.slot_position(a));
    CHECK(t.slot_segment(b) == t.slot_segment(a));
    const std::uint32_t r = t.slot_record(b);
    const auto at = std::find(u.records_from.begin(), u.records_from.end(), t.slot_record(a)) - u.records_from.begin();
    REQUIRE(at < static_cast<std::ptrdiff_t>(u.records_to.size()));
    CHECK(r == u.records_to[static_cast<std::size_t>(at)]);
    CHECK(t.record_owner(r) == 2);
    CHECK(t.record_refs(r) == g);
  }
  // Both may now evict in their own block; the last live slot frees it.
  std::vector<SlotRef> all;
  for (int i = 0; i < bs; ++i) all.push_back({u.to, static_cast<std::uint32_t>(i)});
  REQUIRE(t.evict(2, all).is_ok());
  CHECK(t.blocks(2).empty());
  CHECK(t.records_held(2) == 0);
}

TEST_CASE("BlockTable: a copy on write the pool cannot hold fails and changes nothing",
          "[block_table][shared][errors]") {
  const int g = 8, bs = 16;
  BlockTable t(table_config(g, bs, {0, 0, 2, 2}, kR4E4T2, 2));
  for (int i = 0; i < 4; ++i) {  // both R blocks of the pool, full
    for (int j = 0; j < g; ++j) {
      CommitPlan plan;
      const bool fills = t.staged_count(0) + 1 == g;
      if (fills) REQUIRE(t.plan_commit(0, R, plan).is_ok());
      t.push_staged(0, R, 0);
      if (fills) t.apply_commit(plan);
    }
  }
  REQUIRE(t.share_prefix(0, 1, 2).is_ok());
  const auto before = tt::snapshot_table(t);
  BlockTable::UnsharePlan u;
  PlanClaims claims;
  const Status e = t.plan_unshare(1, t.blocks(1)[0], u, claims);
  CHECK(e.code() == StatusCode::kPoolExhausted);
  CHECK_THAT(e.message(), Contains("NVFP4") || Contains("nvfp4"));
  CHECK(claims.blocks[static_cast<int>(Precision::kNvfp4)] == 0);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_table(t));
}

TEST_CASE("IdBitset holds the ids std::set holds, through inserts, erases, growth and truncation",
          "[block_table][id_bitset]") {
  TT_SEEDED_RNG();
  for (int round = 0; round < 20; ++round) {
    IdBitset bits;
    std::set<std::uint32_t> model;
    std::uint32_t n = static_cast<std::uint32_t>(uniform_int(rng, 0, 9000));
    bits.resize(n);
    CAPTURE(round, n);
    for (int op = 0; op < 4000; ++op) {
      const double a = uniform01(rng);
      if (a < 0.01) {  // grow or shrink the universe (word and summary-word boundaries included)
        const std::uint32_t edges[] = {0, 1, 63, 64, 65, 4095, 4096, 4097, 8191, 8192, 8193};
        n = chance(rng, 0.5) ? edges[uniform_int(rng, 0, 10)] : static_cast<std::uint32_t>(uniform_int(rng, 0, 9000));
        bits.resize(n);
        model.erase(model.lower_bound(n), model.end());
      } else if (n > 0) {
        // Mostly near the low end, where a pool's free blocks cluster, and at word edges.
        const std::uint32_t i =
            chance(rng, 0.5)
                ? static_cast<std::uint32_t>(uniform_int(rng, 0, static_cast<int>(n) - 1))
                : std::min<std::uint32_t>(
                      n - 1, static_cast<std::uint32_t>(uniform_int(rng, 0, 3) * 64 + uniform_int(rng, 0, 1) * 63));
        if (a < 0.55) {
          REQUIRE(bits.insert(i) == model.insert(i).second);
        } else {
          REQUIRE(bits.erase(i) == (model.erase(i) == 1));
        }
      }
      REQUIRE(bits.size() == model.size());
      REQUIRE(bits.universe() == n);
      if (op % 97 == 0) {  // a whole walk, and next() from arbitrary points
        std::vector<std::uint32_t> walk;
        for (std::uint32_t i = bits.next(0); i != IdBitset::kNone; i = bits.next(i + 1)) walk.push_back(i);
        REQUIRE(walk == std::vector<std::uint32_t>(model.begin(), model.end()));
        for (int probe = 0; probe < 20; ++probe) {
          const auto from = static_cast<std::uint32_t>(uniform_int(rng, 0, static_cast<int>(n) + 70));
          const auto it = model.lower_bound(from);
          REQUIRE(bits.next(from) == (it == model.end() ? IdBitset::kNone : *it));
          REQUIRE(bits.contains(from) == (model.count(from) == 1));
        }
      }
    }
  }
}
