#pragma once
/// \file position_evictor.hpp
/// ThinKV's thought decomposition and TBE at *position* granularity, for a runtime that owns its
/// cache cells (llama.cpp and other cell-based caches): the runtime stores K/V as it always does;
/// for each decoded token it hands the evictor that token's post-RoPE keys (of the layers chosen
/// as features) and, on refresh steps, its attention sparsity per layer; the evictor answers with
/// the positions the runtime must free (llama.cpp: llama_memory_seq_rm(mem, seq, p, p + 1)), and
/// the runtime refills the freed cells in place.
///
/// What it decides, and how it differs from BasicThinKvCache (which stores the cache itself):
///  - the same thought segments (every segment_len positions, at refresh steps, and after the
///    pinned prefix), the same classifier and tracker, the same eviction planner (case 1 on a new
///    transition, case 2 over the token budget), so the same *counts* per segment;
///  - but one choice of kept positions per segment for the whole model: the runtime's cell holds
///    every layer and head of a position, so a position is kept or freed everywhere at once. The
///    selector sees one feature row per position, the post-RoPE keys of the feature layers and
///    every KV head concatenated (BasicThinKvCache runs K-means per layer and KV head, so each
///    stream keeps its own tokens). docs/design.md ("Integrating a cell-based runtime") says what
///    that costs;
///  - no quantization: the runtime's cells keep their own format (TBQ needs ThinKV's storage).
/// One evictor per sequence, a value type: llama.cpp's seq_cp is a copy of the source's evictor
/// (then remove() of the cut), its seq_add is shift(), its seq_rm is remove(). Every call that
/// returns an error leaves the evictor as it was.
/// Host-only, header-only, CUDA-free.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thinkv/policy/retention_schedule.hpp"
#include "thinkv/seq/rope.hpp"
#include "thinkv/status.hpp"
#include "thinkv/tbe/eviction_plan.hpp"
#include "thinkv/tbe/token_selector.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/types.hpp"

namespace thinkv::seq {

/// The geometry and TBE settings of one sequence's evictor.
struct PositionEvictorConfig {
  int num_layers = 0;    ///< the model's layers (the classifier's layer indices refer to these)
  int num_kv_heads = 0;  ///< KV heads per layer
  int head_dim = 0;
  /// Layers whose post-RoPE keys form a position's feature row (K-means input), ascending and
  /// distinct; empty = every layer. Fewer layers = a smaller host copy of the keys.
  std::vector<int> key_layers;
  int segment_len = 128;                ///< thought segment length (positions)
  std::int32_t token_budget = 0;        ///< live positions outside the pinned prefix; 0 = no budget
  std::int32_t pinned_prefix = 0;       ///< positions [0, pinned_prefix) are never freed (the prompt)
  std::int32_t max_position = 1 << 30;  ///< positions at or above this are refused
  int seed_stream = 0;                  ///< mixed into the K-means seed (e.g. the sequence id); same seed, same choice

  [[nodiscard]] int feature_layers() const noexcept {
    return key_layers.empty() ? num_layers : static_cast<int>(key_layers.size());
  }
  /// Floats per position in add_token's `features`: feature_layers * num_kv_heads * head_dim.
  [[nodiscard]] int feature_dim() const noexcept { return feature_layers() * num_kv_heads * head_dim; }

  /// Checks every field; the Status names the first bad one and its allowed range.
  [[nodiscard]] Status validate() const {
    auto bad = [](std::string m) { return Status{StatusCode::kInvalidArgument, std::move(m)}; };
    if (num_layers < 1 || num_layers > 4096)
      return bad("num_layers " + std::to_string(num_layers) + "; allowed: 1..4096");
    if (num_kv_heads < 1 || num_kv_heads > 1024) {
      return bad("num_kv_heads " + std::to_string(num_kv_heads) + "; allowed: 1..1024");
    }
    if (head_dim < 1 || head_dim > 1024) return bad("head_dim " + std::to_string(head_dim) + "; allowed: 1..1024");
    for (std::size_t i = 0; i < key_layers.size(); ++i) {
      const int l = key_layers[i];
      if (l < 0 || l >= num_layers) {
        return bad("key_layers[" + std::to_string(i) + "] = " + std::to_string(l) + "; allowed: 0.." +
                   std::to_string(num_layers - 1));
      }
      if (i > 0 && l <= key_layers[i - 1]) {
        return bad("key_layers must be ascending and distinct, but key_layers[" + std::to_string(i) +
                   "] = " + std::to_string(l) + " follows " + std::to_string(key_layers[i - 1]));
      }
    }
    if (segment_len < 1 || segment_len > (1 << 20)) {
      return bad("segment_len " + std::to_string(segment_len) + "; allowed: 1..1048576");
    }
    if (token_budget < 0) return bad("token_budget " + std::to_string(token_budget) + "; allowed: >= 0 (0 = none)");
    if (token_budget > 0 && token_budget < segment_len) {
      return bad("token_budget " + std::to_string(token_budget) + " is below segment_len " +
                 std::to_string(segment_len) + " (the open segment is never freed); raise it or lower segment_len");
    }
    if (pinned_prefix < 0) return bad("pinned_prefix " + std::to_string(pinned_prefix) + "; allowed: >= 0");
    if (max_position < 1) return bad("max_position " + std::to_string(max_position) + "; allowed: >= 1");
    return Status::ok();
  }
};

/// What an evictor has done (cumulative since construction or reset()).
struct PositionEvictorStats {
  std::int64_t tokens = 0;       ///< positions added
  std::int64_t refreshes = 0;    ///< classifier refreshes
  std::int64_t transitions = 0;  ///< new transition thoughts (TBE case 1 events)
  std::int64_t tbe_plans = 0;    ///< non-empty eviction plans applied
  std::int64_t selections = 0;   ///< selector calls
  std::int64_t evicted = 0;      ///< positions freed by TBE
  std::int64_t removed = 0;      ///< positions the runtime removed (remove(), or shifted below 0)
  std::int64_t shifted = 0;      ///< positions the runtime moved (shift())
  std::int64_t budget_unreachable = 0;
  std::int64_t select_ns = 0;                          ///< time in the selector
  std::int64_t tokens_by_type[kNumThoughtTypes] = {};  ///< positions added, by their type
};

/// One thought segment with its live positions (ascending) and their feature rows.
struct PositionSegment {
  SegmentState state;
  std::vector<std::int32_t> positions;
  std::vector<float> features;  ///< [positions.size(), feature_dim] (empty when the selector reads none)
};

template <thought_classifier C = ThoughtClassifier, retention_schedule R = RetentionSchedule,
          token_selector S = SegmentSelector>
class BasicPositionEvictor {
 public:
  using classifier_type = C;
  using tracker_type = BasicThoughtTracker<C>;

  /// Throws ConfigError (naming the bad value) when the config, classifier, schedule or selector
  /// is invalid, or the classifier was calibrated for another number of layers.
  explicit BasicPositionEvictor(PositionEvictorConfig config, C classifier = C{}, R retention = R{}, S selector = S{})
      : config_(std::move(config)),
        retention_(std::move(retention)),
        selector_(std::move(selector)),
        tracker_(classifier) {
    if (Status s = config_.validate(); !s.is_ok()) throw ConfigError(s);
    if (Status s = classifier.check(config_.num_layers); !s.is_ok()) throw ConfigError(s);
    if (Status s = check_retention(retention_); !s.is_ok()) throw ConfigError(s);
    if (Status s = selector_.check(); !s.is_ok()) throw ConfigError(s);
    if (config_.segment_len < retention_.retained(1)) {
      throw ConfigError(Status{StatusCode::kInvalidArgument, "segment_len " + std::to_string(config_.segment_len) +
                                                                 " is below the retention schedule's first level " +
                                                                 std::to_string(retention_.retained(1)) + " (" +
                                                                 retention_.to_string() + ")"});
    }
    initial_tracker_ = tracker_;
  }

  [[nodiscard]] const PositionEvictorConfig& config() const noexcept { return config_; }
  [[nodiscard]] const PositionEvictorStats& stats() const noexcept { return stats_; }
  [[nodiscard]] const tracker_type& tracker() const noexcept { return tracker_; }
  [[nodiscard]] const std::vector<PositionSegment>& segments() const noexcept { return segments_; }
  /// The position add_token expects next (0 after construction or reset()).
  [[nodiscard]] std::int32_t next_position() const noexcept { return next_; }
  /// True when the selector reads feature rows (otherwise add_token accepts an empty span).
  [[nodiscard]] bool reads_features() const noexcept { return selector_.reads_keys(); }
  /// The thought type the next token is appended with (before its refresh, if any).
  [[nodiscard]] ThoughtType current_type() const noexcept { return tracker_.current(); }

  /// True when add_token(pos) needs the token's attention sparsity (a refresh step of a
  /// classifier that reads the signal). Ask before decoding it: a runtime computes the sparsity
  /// only then (llama.cpp: ask the eval callback for kq_soft_max on that step only).
  [[nodiscard]] bool wants_sparsity(std::int32_t pos) const noexcept {
    return refresh_due(pos) && tracker_.classifier().needs_signal();
  }

  /// True when add_token(pos) reads layer `layer`'s sparsity (wants_sparsity and the classifier
  /// uses that layer): the other entries may be NaN.
  [[nodiscard]] bool wants_layer_sparsity(std::int32_t pos, int layer) const noexcept {
    return wants_sparsity(pos) && tracker_.classifier().uses_layer(layer);
  }

  /// Live positions (every segment's, ascending).
  [[nodiscard]] std::vector<std::int32_t> live_positions() const {
    std::vector<std::int32_t> out;
    out.reserve(static_cast<std::size_t>(live_count()));
    for (const PositionSegment& s : segments_) out.insert(out.end(), s.positions.begin(), s.positions.end());
    std::sort(out.begin(), out.end());
    return out;
  }
  [[nodiscard]] std::int64_t live_count() const noexcept {
    std::int64_t n = 0;
    for (const PositionSegment& s : segments_) n += static_cast<std::int64_t>(s.positions.size());
    return n;
  }
  /// Bytes the evictor holds for its feature rows and positions (the host copy of the keys).
  [[nodiscard]] std::int64_t held_bytes() const noexcept {
    std::int64_t b = 0;
    for (const PositionSegment& s : segments_) {
      b += static_cast<std::int64_t>(s.features.capacity() * sizeof(float) +
                                     s.positions.capacity() * sizeof(std::int32_t) + sizeof(PositionSegment));
    }
    return b;
  }

  /// Records the token at `pos` (it must be next_position()) and plans TBE. `features`:
  /// feature_dim() floats, the token's post-RoPE keys laid out [feature layer][KV head][head_dim]
  /// (may be empty when !reads_features() or the position is pinned); `layer_sparsity`: one share in [0, 1] per model
  /// layer (NaN for layers not computed), read only when wants_sparsity(pos). Appends to `evict` the positions the
  /// runtime must now free, ascending. On error `evict` and the evictor are unchanged: kInvalidArgument (wrong
  /// position, or a selector that broke its contract), kOutOfRange (a position at max_position), kShapeMismatch (a
  /// span's size), kNonFinite (a NaN/Inf feature, or a sparsity outside [0, 1]).
  [[nodiscard]] Status add_token(std::int32_t pos, std::span<const float> features,
                                 std::span<const float> layer_sparsity, std::vector<std::int32_t>& evict,
                                 const TokenHint& hint = {}) {
    if (pos != next_) {
      return {StatusCode::kInvalidArgument, "add_token: position " + std::to_string(pos) + " is not the next one (" +
                                                std::to_string(next_) + "); remove() a tail before re-adding it"};
    }
    if (pos >= config_.max_position) {
      return {StatusCode::kOutOfRange, "add_token: position " + std::to_string(pos) + " is above max_position " +
                                           std::to_string(config_.max_position)};
    }
    const auto dim = static_cast<std::size_t>(config_.feature_dim());
    const bool reads = selector_.reads_keys();
    const bool pinned = pos < config_.pinned_prefix;
    // Pinned positions are never selected: their features may be omitted and are not stored.
    const bool store = reads && !pinned;
    if (reads && !(pinned && features.empty()) && features.size() != dim) {
      return {StatusCode::kShapeMismatch,
              "add_token: features has " + std::to_string(features.size()) + " floats; expected feature_dim() = " +
                  std::to_string(dim) + " (" + std::to_string(config_.feature_layers()) + " layers x " +
                  std::to_string(config_.num_kv_heads) + " KV heads x " + std::to_string(config_.head_dim) + ")"};
    }
    if (store) {
      for (std::size_t i = 0; i < dim; ++i) {
        if (!std::isfinite(features[i])) {
          return {StatusCode::kNonFinite, "add_token: feature " + std::to_string(i) + " of position " +
                                              std::to_string(pos) + " is not finite (" + std::to_string(features[i]) +
                                              ")"};
        }
      }
    }
    // The token's thought type. A refresh (which can fail) runs on a copy of the tracker, committed
    // below; other tokens only count and observe, which cannot fail, so they touch the tracker at
    // the commit (no copy on the common step).
    ThoughtType type = tracker_.current();
    const bool refresh = refresh_due(pos);
    std::optional<tracker_type> refreshed;
    if (refresh) {  // refresh_due: never a pinned position
      if (tracker_.classifier().needs_signal() && static_cast<int>(layer_sparsity.size()) != config_.num_layers) {
        return {StatusCode::kShapeMismatch, "add_token: position " + std::to_string(pos) +
                                                " is a refresh step and layer_sparsity has " +
                                                std::to_string(layer_sparsity.size()) + " entries; expected " +
                                                std::to_string(config_.num_layers) + " (one per layer)"};
      }
      refreshed.emplace(tracker_);
      (void)refreshed->type_for(pos);
      refreshed->observe(pos, hint);
      THINKV_RETURN_IF_ERROR(refreshed->refresh(pos, layer_sparsity, &type));
    }
    // The segments as they are once the token is in (states only: the planner's input).
    const bool boundary = segments_.empty() || starts_segment(pos, config_.segment_len, config_.pinned_prefix,
                                                              tracker_.is_refresh_step(pos));
    std::vector<SegmentState> states;
    states.reserve(segments_.size() + 1);
    for (const PositionSegment& s : segments_) states.push_back(s.state);
    if (boundary) {
      for (SegmentState& s : states) s.closed = true;
      SegmentState open;
      open.id = next_segment_;
      open.type = type;
      open.start = pos;
      open.pinned = pinned;
      states.push_back(open);
    }
    SegmentState& open = states.back();
    ++open.size;
    const ThoughtType before = states.size() >= 2 ? states[states.size() - 2].type : ThoughtType::kReasoning;
    if (refresh) open.type = type;
    const bool new_transition = refresh && is_new_transition(type, before, states.size());
    std::int64_t live = 0;
    for (const SegmentState& s : states) live += s.pinned ? 0 : s.size;
    const EvictionPlan plan =
        plan_eviction(std::span<const SegmentState>(states), retention_, new_transition, config_.token_budget, live);
    // Selections (they read closed segments only, which this token does not change).
    std::vector<std::pair<std::size_t, std::vector<int>>> kept;  // segment index, kept indices
    std::int64_t select_ns = 0, selections = 0;
    for (std::size_t i = 0; i < plan.steps.size(); ++i) {
      const SegmentStep& st = plan.steps[i];
      bool last = true;  // only a segment's last step holds its final size
      for (std::size_t j = i + 1; j < plan.steps.size(); ++j) last = last && plan.steps[j].segment != st.segment;
      if (!last) continue;
      const std::size_t si = segment_index(st.segment);
      const PositionSegment& seg = segments_[si];
      if (static_cast<std::int32_t>(seg.positions.size()) <= st.to_size) continue;
      SegmentTokens tokens{reads ? std::span<const float>(seg.features) : std::span<const float>(),
                           std::span<const std::int32_t>(seg.positions), static_cast<int>(dim), config_.seed_stream,
                           seg.state.id};
      if (!reads) tokens.head_dim = 0;
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<int> k = selector_.select(tokens, st.to_size);
      select_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      ++selections;
      THINKV_RETURN_IF_ERROR(check_selection(k, tokens.count(), st.to_size, selector_.to_string(),
                                             "segment " + std::to_string(seg.state.id)));
      kept.emplace_back(si, std::move(k));
    }

    // Commit: nothing below fails.
    const std::size_t evict_from = evict.size();
    if (refreshed) {
      tracker_ = std::move(*refreshed);
    } else if (!pinned) {
      (void)tracker_.type_for(pos);
      tracker_.observe(pos, hint);
    }
    if (refresh) ++stats_.refreshes;
    if (boundary) {
      for (PositionSegment& s : segments_) s.state.closed = true;
      PositionSegment seg;
      seg.state = states.back();
      seg.state.size = 0;
      segments_.push_back(std::move(seg));
      ++next_segment_;
    }
    PositionSegment& o = segments_.back();
    o.state.type = open.type;
    o.positions.push_back(pos);
    if (store) o.features.insert(o.features.end(), features.begin(), features.end());
    o.state.size = static_cast<std::int32_t>(o.positions.size());
    for (auto& [si, k] : kept) keep_only(segments_[si], k, dim, evict);
    for (const SegmentStep& st : plan.steps) segments_[segment_index(st.segment)].state.level = st.to_level;
    drop_empty_closed_segments();
    std::sort(evict.begin() + static_cast<std::ptrdiff_t>(evict_from), evict.end());
    ++next_;
    ++stats_.tokens;
    ++stats_.tokens_by_type[static_cast<int>(pinned ? ThoughtType::kReasoning : o.state.type)];
    stats_.transitions += new_transition ? 1 : 0;
    stats_.tbe_plans += plan.empty() ? 0 : 1;
    stats_.budget_unreachable += plan.budget_unreachable ? 1 : 0;
    stats_.selections += selections;
    stats_.select_ns += select_ns;
    stats_.evicted += static_cast<std::int64_t>(evict.size() - evict_from);
    return Status::ok();
  }

  /// The runtime removed positions [p0, p1) of this sequence (llama.cpp's seq_rm; p1 < 0 = to the
  /// end): they are forgotten. When the range reaches the next position, the sequence rolls back:
  /// next_position() becomes the last live position + 1 (0 when none is left), the segments
  /// starting at or after it are dropped and the last one left is open again (its level kept).
  /// The thought type is not rolled back: the next refresh sets it. Errors
  /// (kInvalidArgument, nothing changed): p0 < 0, or an empty range (p1 >= 0 and p1 <= p0).
  [[nodiscard]] Status remove(std::int32_t p0, std::int32_t p1) {
    if (p0 < 0 || (p1 >= 0 && p1 <= p0)) {
      return {StatusCode::kInvalidArgument,
              "remove: range [" + std::to_string(p0) + ", " + std::to_string(p1) + ") is empty or negative"};
    }
    const std::int32_t end = p1 < 0 ? next_ : std::min(p1, next_);
    const auto dim = static_cast<std::size_t>(selector_.reads_keys() ? config_.feature_dim() : 0);
    std::int64_t removed = 0;
    for (PositionSegment& s : segments_) {
      std::vector<int> keep;
      for (std::size_t j = 0; j < s.positions.size(); ++j) {
        if (s.positions[j] < p0 || s.positions[j] >= end) keep.push_back(static_cast<int>(j));
      }
      if (keep.size() == s.positions.size()) continue;
      removed += static_cast<std::int64_t>(s.positions.size() - keep.size());
      std::vector<std::int32_t> dropped;
      keep_only(s, keep, dim, dropped);
    }
    if (end >= next_ && p0 < next_) {
      // Roll back: the sequence continues after its last live position (what llama.cpp requires
      // of the next batch: pos_max + 1). Segments past it hold nothing live and are dropped.
      std::int32_t tail = 0;
      for (const PositionSegment& s : segments_) {
        if (!s.positions.empty()) tail = std::max(tail, s.positions.back() + 1);
      }
      segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                     [&](const PositionSegment& s) { return s.state.start >= tail; }),
                      segments_.end());
      if (!segments_.empty()) segments_.back().state.closed = false;
      next_ = tail;
      if (segments_.empty()) tracker_ = initial_tracker_;
    }
    drop_empty_closed_segments();
    stats_.removed += removed;
    return Status::ok();
  }

  /// The runtime moved positions [p0, p1) of this sequence by `delta` (llama.cpp's seq_add, e.g.
  /// a context shift: seq_rm(n_keep, n_keep + n), then seq_add(n_keep + n, -1, -n); p0 < 0 = 0,
  /// p1 < 0 = to the end). The evictor follows: the live positions in the range move with their
  /// segments (a segment's start moves with it when it lies in the range), positions that become
  /// negative are forgotten as llama.cpp frees those cells, and when the range holds the last
  /// position the next one is the last live position + 1 again. With `rope` (the model's RoPE),
  /// the stored feature rows of the moved positions (their post-RoPE keys) turn through `delta`
  /// positions as the runtime's cached keys do; nullptr leaves them (a model without RoPE, or a
  /// selector that reads no keys). The classifier's refresh steps and the segment boundaries of
  /// later tokens follow the new positions. Errors (nothing changes): kUnsupported when a
  /// position of the pinned prefix would move or a moved one land in it (the prompt stays put:
  /// llama.cpp's n_keep); kInvalidArgument when the move breaks the order of the live positions
  /// (a moved one at or past a neighbour that stays), or `rope` does not fit head_dim;
  /// kOutOfRange when the next position would pass max_position.
  [[nodiscard]] Status shift(std::int32_t p0, std::int32_t p1, std::int32_t delta, const RopeSpec* rope = nullptr) {
    const std::int32_t lo = std::max<std::int32_t>(p0, 0);
    const std::int32_t hi = p1 < 0 ? std::numeric_limits<std::int32_t>::max() : p1;
    const std::string call =
        "shift(" + std::to_string(p0) + ", " + std::to_string(p1) + ", " + std::to_string(delta) + ")";
    if (rope != nullptr) {
      if (Status r = rope->validate(config_.head_dim); !r.is_ok()) return {r.code(), call + ": " + r.message()};
    }
    if (delta == 0 || lo >= hi) return Status::ok();
    auto moves = [&](std::int32_t p) { return p >= lo && p < hi; };
    std::int64_t in = 0, gone = 0;
    std::int32_t first = std::numeric_limits<std::int32_t>::max(), last = -1;  // moved and kept, after the move
    std::int32_t below = -1, above = std::numeric_limits<std::int32_t>::max(), lowest_in = -1, tail = -1;
    for (const PositionSegment& seg : segments_) {
      for (const std::int32_t p : seg.positions) {
        if (!moves(p)) {
          if (p < lo) below = std::max(below, p);
          if (p >= hi) above = std::min(above, p);
          tail = std::max(tail, p);
          continue;
        }
        ++in;
        if (lowest_in < 0) lowest_in = p;
        const std::int64_t q = static_cast<std::int64_t>(p) + delta;
        if (q < 0) {
          ++gone;
          continue;
        }
        first = std::min(first, static_cast<std::int32_t>(q));
        last = std::max(last, static_cast<std::int32_t>(q));
        tail = std::max(tail, static_cast<std::int32_t>(q));
      }
    }
    if (in == 0) return Status::ok();
    const std::int32_t pin = config_.pinned_prefix;
    if (pin > 0 && (lowest_in < pin || static_cast<std::int64_t>(lowest_in) + delta < pin)) {
      return {StatusCode::kUnsupported, call + ": the pinned prefix (positions below " + std::to_string(pin) +
                                            ") neither moves nor takes moved positions"};
    }
    if (in > gone &&
        ((below >= 0 && first <= below) || (above != std::numeric_limits<std::int32_t>::max() && last >= above))) {
      return {StatusCode::kInvalidArgument, call + ": the moved positions would reach past a position that stays (" +
                                                std::to_string(below >= 0 && first <= below ? below : above) +
                                                "); the live positions keep their order"};
    }
    const bool tail_moves = next_ > 0 && moves(next_ - 1);
    const std::int32_t next = tail_moves ? tail + 1 : next_;
    if (next > config_.max_position) {
      return {StatusCode::kOutOfRange, call + ": the next position " + std::to_string(next) +
                                           " would pass max_position " + std::to_string(config_.max_position)};
    }
    // Commit: nothing below fails.
    const auto dim = static_cast<std::size_t>(selector_.reads_keys() ? config_.feature_dim() : 0);
    const auto d = static_cast<std::size_t>(config_.head_dim);
    const RopeSpec::Turn turn = rope != nullptr ? rope->turn(delta, config_.head_dim) : RopeSpec::Turn{};
    std::vector<double> row(d);
    for (PositionSegment& seg : segments_) {
      std::vector<int> keep;
      for (std::size_t j = 0; j < seg.positions.size(); ++j) {
        std::int32_t& p = seg.positions[j];
        if (!moves(p)) {
          keep.push_back(static_cast<int>(j));
          continue;
        }
        if (static_cast<std::int64_t>(p) + delta < 0) continue;  // freed by the runtime
        p += delta;
        keep.push_back(static_cast<int>(j));
        ++stats_.shifted;
        if (rope == nullptr || seg.features.empty()) continue;
        for (std::size_t h = 0; h * d < dim; ++h) {  // every feature layer's every KV head
          float* x = seg.features.data() + j * dim + h * d;
          for (std::size_t c = 0; c < d; ++c) row[c] = x[c];
          RopeSpec::apply(row, turn);
          for (std::size_t c = 0; c < d; ++c) x[c] = static_cast<float>(row[c]);
        }
      }
      if (keep.size() != seg.positions.size()) {
        std::vector<std::int32_t> dropped;
        keep_only(seg, keep, dim, dropped);
      }
    }
    // Segment starts: moved with the range, then kept at or before their first position and
    // after the positions and starts of the segments before them (as BasicThinKvCache's shift).
    std::int32_t prev_hi = -1, prev_start = -1;
    for (PositionSegment& seg : segments_) {
      std::int32_t ns = seg.state.start;
      if (moves(ns)) ns = static_cast<std::int32_t>(std::max<std::int64_t>(0, static_cast<std::int64_t>(ns) + delta));
      ns = std::max({ns, prev_hi + 1, prev_start + 1});
      if (!seg.positions.empty()) ns = std::min(ns, seg.positions.front());
      seg.state.start = ns;
      prev_start = ns;
      if (!seg.positions.empty()) prev_hi = std::max(prev_hi, seg.positions.back());
    }
    stats_.removed += gone;
    drop_empty_closed_segments();
    if (tail_moves) {
      next_ = next;
      if (!segments_.empty() && segments_.back().positions.empty()) segments_.pop_back();
      if (!segments_.empty()) segments_.back().state.closed = false;
      if (segments_.empty()) {
        next_ = 0;
        tracker_ = initial_tracker_;
      }
    }
    return Status::ok();
  }

  /// Forgets everything (a new sequence); stats are kept.
  void reset() {
    segments_.clear();
    next_ = 0;
    next_segment_ = 0;
    tracker_ = initial_tracker_;
  }

 private:
  /// Closed segments left with no live position are gone (the open one stays: the next token joins it).
  void drop_empty_closed_segments() {
    segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                   [](const PositionSegment& s) { return s.positions.empty() && s.state.closed; }),
                    segments_.end());
  }
  [[nodiscard]] bool refresh_due(std::int32_t pos) const noexcept {
    return pos >= config_.pinned_prefix && tracker_.refreshes() && tracker_.is_refresh_step(pos);
  }
  [[nodiscard]] std::size_t segment_index(std::uint32_t id) const noexcept {
    for (std::size_t i = 0; i < segments_.size(); ++i) {
      if (segments_[i].state.id == id) return i;
    }
    return segments_.size() - 1;  // the open segment (the one this token may have opened)
  }
  /// Keeps the rows `kept` (ascending indices) of `s`; the others' positions go to `dropped`.
  static void keep_only(PositionSegment& s, const std::vector<int>& kept, std::size_t dim,
                        std::vector<std::int32_t>& dropped) {
    if (s.features.empty()) dim = 0;  // a pinned segment, or a selector that reads none
    std::vector<std::int32_t> pos;
    std::vector<float> feat;
    pos.reserve(kept.size());
    feat.reserve(kept.size() * dim);
    std::size_t k = 0;
    for (std::size_t j = 0; j < s.positions.size(); ++j) {
      if (k < kept.size() && static_cast<std::size_t>(kept[k]) == j) {
        pos.push_back(s.positions[j]);
        if (dim != 0) feat.insert(feat.end(), s.features.begin() + j * dim, s.features.begin() + (j + 1) * dim);
        ++k;
      } else {
        dropped.push_back(s.positions[j]);
      }
    }
    s.positions = std::move(pos);
    s.features = std::move(feat);
    s.state.size = static_cast<std::int32_t>(s.positions.size());
  }

  PositionEvictorConfig config_;
  R retention_;
  S selector_;
  tracker_type tracker_;
  tracker_type initial_tracker_;
  std::vector<PositionSegment> segments_;
  std::int32_t next_ = 0;
  std::uint32_t next_segment_ = 0;
  PositionEvictorStats stats_;
};

/// The evictor with ThinKV's built-in policies.
using PositionEvictor = BasicPositionEvictor<>;

}  // namespace thinkv::seq
