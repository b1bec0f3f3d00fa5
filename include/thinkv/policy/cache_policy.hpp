#pragma once
/// \file cache_policy.hpp
/// Policy sets of BasicThinKvCache: which thought classifier, TBQ precision policy, TBE retention
/// schedule and token selector a cache runs, as types (the cache is compiled for them) holding
/// their settings as values. The four methods of the paper's ablation are ready-made sets:
///
///     FullKvPolicy  every token R, BF16 pages, no eviction
///     TbqPolicy     thought classifier + precision map (R4E4T2), no eviction
///     TbePolicy     thought classifier + retention schedule + K-means, BF16 pages
///     ThinKvPolicy  both: ThinKV
///
/// A user set is CachePolicy<Classifier, Precision, Retention, Selector> (or a struct deriving
/// from one, with a `static constexpr std::string_view kName` for method names). Each component
/// must model its concept; the static_asserts below say which call a type lacks:
///   thought_classifier (thought/classifier.hpp), precision_policy (policy/precision_map.hpp),
///   retention_schedule (tbe/eviction_plan.hpp) or NoEviction, token_selector
///   (tbe/token_selector.hpp) or NoSelection.
/// Before anything reaches the paged cache, the backends or the kernels, a set is lowered to
/// plain descriptors: the precision policy to a PrecisionMap (3 bytes), the classifier to the
/// per-step decisions it makes (a type per token, sparsity wanted or not), the retention schedule
/// and the selector to the slots to evict.

#include <concepts>
#include <string>
#include <string_view>

#include "thinkv/policy/precision_map.hpp"
#include "thinkv/policy/retention_schedule.hpp"
#include "thinkv/status.hpp"
#include "thinkv/tbe/token_selector.hpp"
#include "thinkv/thought/classifier.hpp"

namespace thinkv {

/// A classifier that labels every token R and never refreshes (FullKV).
struct SingleThought {
  int period = 128;  ///< segment boundaries still fall on multiples of it (as with any tau)

  [[nodiscard]] Status check(int /*num_layers*/) const {
    if (period < 1) {
      return {StatusCode::kInvalidArgument, "SingleThought period " + std::to_string(period) + " must be >= 1"};
    }
    return Status::ok();
  }
  [[nodiscard]] int tau() const noexcept { return period; }
  [[nodiscard]] bool emits(ThoughtType t) const noexcept { return t == ThoughtType::kReasoning; }
  [[nodiscard]] bool needs_signal() const noexcept { return false; }
  [[nodiscard]] bool uses_layer(int) const noexcept { return false; }
  void observe(std::int64_t, const TokenHint&) noexcept {}
  [[nodiscard]] ThoughtType decide(std::int64_t, std::span<const float>) const noexcept {
    return ThoughtType::kReasoning;
  }
  [[nodiscard]] std::string to_string() const { return "every token R"; }
  friend bool operator==(const SingleThought&, const SingleThought&) = default;
};
static_assert(thought_classifier<SingleThought>);

/// A policy set: the component types and their settings.
template <class Classifier, class Precision_, class Retention, class Selector>
struct CachePolicy {
  static_assert(thought_classifier<Classifier>,
                "ThinKV: the classifier of a CachePolicy must model thinkv::thought_classifier "
                "(include/thinkv/thought/classifier.hpp): copyable, with check(int) -> Status, tau() -> int, "
                "emits(ThoughtType) -> bool, needs_signal() -> bool, uses_layer(int) -> bool, "
                "observe(std::int64_t, const TokenHint&), decide(std::int64_t, std::span<const float>) -> "
                "ThoughtType, to_string()");
  static_assert(precision_policy<Precision_>,
                "ThinKV: the precision policy of a CachePolicy must model thinkv::precision_policy "
                "(include/thinkv/policy/precision_map.hpp): copyable, with precision_of(ThoughtType) -> "
                "thinkv::Precision and to_string()");
  static_assert(std::same_as<Retention, NoEviction> || retention_schedule<Retention>,
                "ThinKV: the retention schedule of a CachePolicy must be thinkv::NoEviction or model "
                "thinkv::retention_schedule (include/thinkv/tbe/eviction_plan.hpp): copyable, with "
                "num_levels() -> int, retained(int level) -> int and to_string()");
  static_assert(std::same_as<Retention, NoEviction> || token_selector<Selector>,
                "ThinKV: a CachePolicy that evicts needs a token selector that models thinkv::token_selector "
                "(include/thinkv/tbe/token_selector.hpp): copyable, with check() -> Status, reads_keys() -> bool, "
                "select(const SegmentTokens&, int keep) -> std::vector<int> and to_string()");

  using classifier_type = Classifier;
  using precision_type = Precision_;
  using retention_type = Retention;
  using selector_type = Selector;
  /// True when the set evicts (TBE): it has a retention schedule.
  static constexpr bool kEvicts = !std::same_as<Retention, NoEviction>;

  Classifier classifier{};
  Precision_ precision{};
  Retention retention{};
  Selector selector{};
};

/// A policy set: a CachePolicy or a type derived from one.
template <class P>
concept cache_policy = requires {
  typename P::classifier_type;
  typename P::precision_type;
  typename P::retention_type;
  typename P::selector_type;
  { P::kEvicts } -> std::convertible_to<bool>;
}
&&std::derived_from<P, CachePolicy<typename P::classifier_type, typename P::precision_type, typename P::retention_type,
                                   typename P::selector_type>>;

/// The name a set gives its method ("thinkv"); "custom" when it names none.
template <cache_policy P>
constexpr std::string_view policy_name() noexcept {
  if constexpr (requires { P::kName; }) {
    return P::kName;
  } else {
    return "custom";
  }
}

/// FullKV: every token R in BF16 pages, nothing evicted (the paged cache's baseline).
struct FullKvPolicy : CachePolicy<SingleThought, Bf16Pages, NoEviction, NoSelection> {
  static constexpr std::string_view kName = "full";
};
/// TBQ only: the calibrated classifier picks each thought's precision (R4E4T2 by default).
struct TbqPolicy : CachePolicy<ThoughtClassifier, PrecisionMap, NoEviction, NoSelection> {
  static constexpr std::string_view kName = "tbq";
};
/// TBE only: thought segments shrink along the schedule, K-means keeps their tokens; BF16 pages.
struct TbePolicy : CachePolicy<ThoughtClassifier, Bf16Pages, RetentionSchedule, KmeansSelector> {
  static constexpr std::string_view kName = "tbe";
};
/// ThinKV: TBQ + TBE.
struct ThinKvPolicy : CachePolicy<ThoughtClassifier, PrecisionMap, RetentionSchedule, KmeansSelector> {
  static constexpr std::string_view kName = "thinkv";
};

static_assert(cache_policy<FullKvPolicy> && cache_policy<TbqPolicy> && cache_policy<TbePolicy> &&
              cache_policy<ThinKvPolicy>);

}  // namespace thinkv
