#pragma once
/// \file eviction_plan.hpp
/// TBE ("think before you evict") planning: a pure function from a stream's thought segments to
/// the step-downs to apply. Nothing here touches a cache; tests check plans on hand-built
/// segment histories.
///
/// A segment at level 0 keeps all its tokens; after n >= 1 step-downs it keeps at most
/// schedule.levels()[n-1] tokens (|S| = min(|S|, R_n)); at level schedule.num_levels() it is at
/// the minimum and never steps further.
///   Case 1: a new transition thought begins  -> every earlier (closed) segment steps down once.
///   Case 2: the stream is over its budget     -> the oldest segment of the least important type
///           (T before E before R) that can still step down steps down; repeated until within
///           budget or until every closed segment is at the minimum (then budget_unreachable).
/// Case 2 also runs after case 1 in the same plan when case 1 alone does not meet the budget, so
/// after every applied plan the stream is within budget whenever that is attainable.
/// Pinned segments (a kept prompt) are never stepped down and their tokens are not counted
/// against the budget: the caller passes the live tokens of the other segments.

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "thinkv/types.hpp"

namespace thinkv {

/// A TBE retention schedule policy: what the eviction planner and BasicThinKvCache call on it.
///  - num_levels(): step-downs a segment can take (>= 1);
///  - retained(level): the most tokens a segment keeps after `level` step-downs, level in
///    1..num_levels(); positive and strictly decreasing in level (the cache checks this at
///    construction, naming the first level that breaks it);
///  - to_string(): for messages and method names.
template <class R>
concept retention_schedule = std::copy_constructible<R> && requires(const R& r, int level) {
  { r.num_levels() } -> std::convertible_to<int>;
  { r.retained(level) } -> std::convertible_to<int>;
  { r.to_string() } -> std::convertible_to<std::string>;
};

/// One thought segment of one stream, as the planner sees it.
struct SegmentState {
  std::uint32_t id = 0;  ///< segment id (as stored per slot in the block table)
  ThoughtType type = ThoughtType::kReasoning;
  std::int32_t start = 0;  ///< position of its first token
  std::int32_t size = 0;   ///< live tokens it holds now
  int level = 0;           ///< step-downs so far (0 = untouched)
  bool closed = false;     ///< a later segment has started; only closed segments are evicted
  bool pinned = false;     ///< never evicted (the prompt, in the decode-stage setting)
  friend bool operator==(const SegmentState&, const SegmentState&) = default;
};

/// Whether the token at `position` opens a thought segment: every `segment_len` positions, at the
/// first position after a pinned prefix of `pinned` tokens, and at refresh steps
/// (`refresh_step`: a positive multiple of the classifier's tau) outside the prefix, whether or
/// not the classifier can change the type there. BasicThinKvCache and seq::PositionEvictor both
/// segment by this rule.
constexpr bool starts_segment(std::int64_t position, int segment_len, std::int64_t pinned, bool refresh_step) noexcept {
  return position % segment_len == 0 || position == pinned || (position >= pinned && refresh_step);
}

/// TBE case 1's event, a new transition thought: a refresh that yields T after a segment that was
/// not T. `segments` counts the stream's segments with the refreshed one (the last), so there is
/// an earlier segment to step down.
constexpr bool is_new_transition(ThoughtType refreshed, ThoughtType previous_segment, std::size_t segments) noexcept {
  return refreshed == ThoughtType::kTransition && previous_segment != ThoughtType::kTransition && segments >= 2;
}

/// One step-down of one segment.
struct SegmentStep {
  std::uint32_t segment = 0;
  int to_level = 0;
  std::int32_t from_size = 0;
  std::int32_t to_size = 0;  ///< tokens the segment keeps after this step
  friend bool operator==(const SegmentStep&, const SegmentStep&) = default;
};

struct EvictionPlan {
  /// Step-downs in order. A segment may appear several times (case 1 then case 2); the last
  /// entry for a segment holds its final level and size.
  std::vector<SegmentStep> steps;
  std::int64_t live_before = 0;
  std::int64_t live_after = 0;
  bool transition = false;          ///< case 1 fired
  std::int64_t case1_steps = 0;     ///< step-downs made by case 1 (the first ones in `steps`)
  bool budget_unreachable = false;  ///< over budget with every closed segment at the minimum
  [[nodiscard]] bool empty() const noexcept { return steps.empty(); }
  [[nodiscard]] std::int64_t tokens_evicted() const noexcept { return live_before - live_after; }
};

inline std::ostream& operator<<(std::ostream& os, const SegmentStep& s) {
  return os << "{seg " << s.segment << " -> level " << s.to_level << ", " << s.from_size << " -> " << s.to_size << "}";
}

/// Tokens a segment keeps at `level` given its current size.
template <retention_schedule R>
std::int32_t retained_size(const R& r, int level, std::int32_t size) {
  if (level <= 0) return size;
  return std::min<std::int32_t>(size, r.retained(std::min<int>(level, r.num_levels())));
}

/// Plans the step-downs for one stream. `segments` in any order (age = start position);
/// `live_tokens` counts every live token of the stream that is not in a pinned segment (closed +
/// open segments + staged);
/// `budget` <= 0 means no budget (case 2 never fires).
template <retention_schedule R>
EvictionPlan plan_eviction(std::span<const SegmentState> segments, const R& schedule, bool new_transition,
                           std::int64_t budget, std::int64_t live_tokens) {
  EvictionPlan plan;
  plan.live_before = live_tokens;
  plan.transition = new_transition;
  std::vector<SegmentState> seg(segments.begin(), segments.end());
  std::sort(seg.begin(), seg.end(), [](const SegmentState& a, const SegmentState& b) {
    return a.start != b.start ? a.start < b.start : a.id < b.id;
  });
  std::int64_t live = live_tokens;
  auto step = [&](SegmentState& s) {
    const int to = s.level + 1;
    const std::int32_t new_size = retained_size(schedule, to, s.size);
    plan.steps.push_back({s.id, to, s.size, new_size});
    live -= s.size - new_size;
    s.level = to;
    s.size = new_size;
  };
  const int max_level = schedule.num_levels();
  if (new_transition) {
    for (SegmentState& s : seg) {
      if (s.closed && !s.pinned && s.level < max_level) step(s);
    }
    plan.case1_steps = static_cast<std::int64_t>(plan.steps.size());
  }
  if (budget > 0) {
    while (live > budget) {
      // Least important type first (T, then E, then R), oldest first within a type.
      SegmentState* victim = nullptr;
      for (SegmentState& s : seg) {
        if (!s.closed || s.pinned || s.level >= max_level) continue;
        if (victim == nullptr || importance(s.type) < importance(victim->type)) victim = &s;
      }
      if (victim == nullptr) {
        plan.budget_unreachable = true;
        break;
      }
      step(*victim);
    }
  }
  plan.live_after = live;
  return plan;
}

}  // namespace thinkv
