// TBE planning on hand-built segment histories: no cache involved.

#include <catch2/catch.hpp>

#include <vector>

#include "thinkv/policy/retention_schedule.hpp"
#include "thinkv/tbe/eviction_plan.hpp"

using thinkv::EvictionPlan;
using thinkv::RetentionSchedule;
using thinkv::SegmentState;
using thinkv::ThoughtType;

namespace {
constexpr ThoughtType R = ThoughtType::kReasoning, E = ThoughtType::kExecution, T = ThoughtType::kTransition;

SegmentState seg(std::uint32_t id, ThoughtType t, int start, int size, int level = 0, bool closed = true) {
  SegmentState s;
  s.id = id;
  s.type = t;
  s.start = start;
  s.size = size;
  s.level = level;
  s.closed = closed;
  return s;
}
// Applies a plan's final levels/sizes to the history (what the cache does after evicting).
void apply(std::vector<SegmentState>& segs, const EvictionPlan& p) {
  for (const auto& st : p.steps) {
    for (auto& s : segs) {
      if (s.id == st.segment) {
        s.level = st.to_level;
        s.size = st.to_size;
      }
    }
  }
}
std::int64_t live(const std::vector<SegmentState>& segs) {
  std::int64_t n = 0;
  for (const auto& s : segs) n += s.size;
  return n;
}
}  // namespace

TEST_CASE("retained size follows the schedule and never goes below the minimum", "[tbe]") {
  const RetentionSchedule r;  // {64,32,16,8,4}
  CHECK(thinkv::retained_size(r, 0, 128) == 128);
  CHECK(thinkv::retained_size(r, 1, 128) == 64);
  CHECK(thinkv::retained_size(r, 2, 128) == 32);
  CHECK(thinkv::retained_size(r, 5, 128) == 4);
  CHECK(thinkv::retained_size(r, 9, 128) == 4);
  CHECK(thinkv::retained_size(r, 1, 20) == 20);  // |S| = min(|S|, R_n)
  CHECK(thinkv::retained_size(r, 2, 20) == 20);
  CHECK(thinkv::retained_size(r, 3, 20) == 16);
}

TEST_CASE("case 1: a new transition steps every earlier segment down once", "[tbe]") {
  const RetentionSchedule r;
  std::vector<SegmentState> segs = {seg(0, R, 0, 128), seg(1, E, 128, 128, 2), seg(2, T, 256, 1, 0, /*closed=*/false)};
  const auto p = thinkv::plan_eviction(segs, r, true, 0, live(segs));
  REQUIRE(p.steps.size() == 2);
  CHECK(p.steps[0] == thinkv::SegmentStep{0, 1, 128, 64});
  CHECK(p.steps[1] == thinkv::SegmentStep{1, 3, 128, 16});
  CHECK(p.transition);
  CHECK_FALSE(p.budget_unreachable);
  CHECK(p.live_after == 64 + 16 + 1);
  CHECK(p.tokens_evicted() == 128 - 64 + 128 - 16);
  // the open segment is untouched
  for (const auto& s : p.steps) CHECK(s.segment != 2);
}

TEST_CASE("case 1: several transitions in a row walk down the schedule and stop at the minimum", "[tbe]") {
  const RetentionSchedule r;
  std::vector<SegmentState> segs = {seg(0, R, 0, 128), seg(1, E, 128, 128)};
  const std::vector<int> want = {64, 32, 16, 8, 4};
  for (int i = 0; i < 5; ++i) {
    const auto p = thinkv::plan_eviction(segs, r, true, 0, live(segs));
    REQUIRE(p.steps.size() == 2);
    apply(segs, p);
    CHECK(segs[0].size == want[static_cast<std::size_t>(i)]);
    CHECK(segs[0].level == i + 1);
  }
  const auto p = thinkv::plan_eviction(segs, r, true, 0, live(segs));
  CHECK(p.empty());
  CHECK(segs[0].size == 4);
}

TEST_CASE("case 2: least important type first, oldest first, until within budget", "[tbe]") {
  const RetentionSchedule r;
  std::vector<SegmentState> segs = {seg(0, R, 0, 128), seg(1, T, 128, 128), seg(2, E, 256, 128), seg(3, T, 384, 128),
                                    seg(4, R, 512, 10, 0, false)};
  // 522 live, budget 400: T@128 -> 64 (458), T@128 -> 32 (426), T@128 -> 16 (410),
  // T@128 -> 8 (402), T@128 -> 4 (398 <= 400).
  const auto p = thinkv::plan_eviction(segs, r, false, 400, live(segs));
  REQUIRE(p.steps.size() == 5);
  for (const auto& s : p.steps) CHECK(s.segment == 1);
  CHECK(p.live_after == 398);
  // Budget 200: every T (oldest first) reaches the minimum before any E, then E before R.
  const auto q = thinkv::plan_eviction(segs, r, false, 200, live(segs));
  std::vector<std::uint32_t> order;
  for (const auto& s : q.steps) order.push_back(s.segment);
  // seg 1 x5, seg 3 x5 -> 522 - 124 - 124 = 274; then E (seg 2): 64 -> 210, 32 -> 178 <= 200.
  const std::vector<std::uint32_t> want = {1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 2, 2};
  CHECK(order == want);
  CHECK(q.live_after == 178);
  CHECK_FALSE(q.budget_unreachable);
}

TEST_CASE("case 1 then case 2 in one plan when the transition alone misses the budget", "[tbe]") {
  const RetentionSchedule r;
  std::vector<SegmentState> segs = {seg(0, R, 0, 128), seg(1, E, 128, 128), seg(2, T, 256, 1, 0, false)};
  const auto p = thinkv::plan_eviction(segs, r, true, 60, live(segs));
  // case 1: 64 + 64 + 1 = 129; case 2: E 64->32 (97), E 32->16 (81), E 16->8 (73),
  // E 8->4 (69), then R 64->32 (37 <= 60).
  REQUIRE(p.steps.size() == 7);
  CHECK(p.steps[2].segment == 1);
  CHECK(p.steps.back() == thinkv::SegmentStep{0, 2, 64, 32});
  CHECK(p.live_after == 37);
}

TEST_CASE("budget below the sum of minimums: stops at the minimum and says so", "[tbe]") {
  const RetentionSchedule r;
  std::vector<SegmentState> segs;
  for (int i = 0; i < 40; ++i) segs.push_back(seg(static_cast<std::uint32_t>(i), i % 3 == 0 ? R : E, i * 128, 128));
  const auto p = thinkv::plan_eviction(segs, r, false, 100, live(segs));  // 40 * 4 = 160 > 100
  CHECK(p.budget_unreachable);
  CHECK(p.live_after == 160);
  CHECK(p.steps.size() == 40 * 5);
  apply(segs, p);
  for (const auto& s : segs) CHECK(s.size == 4);
  // Planning again from the minimum does nothing and still reports it.
  const auto q = thinkv::plan_eviction(segs, r, false, 100, live(segs));
  CHECK(q.empty());
  CHECK(q.budget_unreachable);
}

TEST_CASE("a single very long segment", "[tbe]") {
  const RetentionSchedule r;
  // Open: never evicted, the budget cannot be met.
  std::vector<SegmentState> open = {seg(0, R, 0, 100000, 0, false)};
  const auto p = thinkv::plan_eviction(open, r, true, 1000, 100000);
  CHECK(p.empty());
  CHECK(p.budget_unreachable);
  // Closed: one step takes it straight to R_1.
  std::vector<SegmentState> closed = {seg(0, T, 0, 100000), seg(1, R, 100000, 5, 0, false)};
  const auto q = thinkv::plan_eviction(closed, r, false, 1000, 100005);
  REQUIRE(q.steps.size() == 1);
  CHECK(q.steps[0] == thinkv::SegmentStep{0, 1, 100000, 64});
}

TEST_CASE("plans are pure and order-independent in their input", "[tbe]") {
  const RetentionSchedule r({48, 12, 3});
  std::vector<SegmentState> a = {seg(2, E, 256, 128), seg(0, T, 0, 128), seg(1, T, 128, 128)};
  std::vector<SegmentState> b = {seg(0, T, 0, 128), seg(1, T, 128, 128), seg(2, E, 256, 128)};
  const auto copy = a;
  const auto pa = thinkv::plan_eviction(a, r, false, 150, live(a));
  const auto pb = thinkv::plan_eviction(b, r, false, 150, live(b));
  CHECK(a == copy);
  CHECK(pa.steps == pb.steps);
  REQUIRE(!pa.steps.empty());
  CHECK(pa.steps.front().segment == 0);  // oldest T first
  CHECK(pa.steps.front().to_size == 48);
  // No budget: no case 2.
  CHECK(thinkv::plan_eviction(a, r, false, 0, live(a)).empty());
}
