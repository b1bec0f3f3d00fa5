#pragma once
/// \file thinkv_spec.hpp
/// ThinKV's cache as the CLI describes it at run time: a ThinKvConfig, which of the library's
/// ready-made policy sets to run (--mode full | tbq | tbe | thinkv), and the settings of the
/// set's components. with_policy() turns the description into the typed policy set, so the
/// decoder builds BasicThinKvCache<Set, Backend> for exactly the set the user chose.

#include <concepts>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include "thinkv/policy/cache_policy.hpp"
#include "thinkv/thinkv_cache.hpp"

namespace thinkv::decoder {

/// Which ready-made policy set a run uses.
enum class CacheMode : std::uint8_t { kFull, kTbq, kTbe, kThinKv };

constexpr std::string_view to_string(CacheMode m) noexcept {
  switch (m) {
    case CacheMode::kFull: return "full";
    case CacheMode::kTbq: return "tbq";
    case CacheMode::kTbe: return "tbe";
    case CacheMode::kThinKv: return "thinkv";
  }
  return "?";
}
/// Parses "full", "tbq", "tbe", "thinkv".
inline std::optional<CacheMode> parse_cache_mode(std::string_view s) noexcept {
  for (CacheMode m : {CacheMode::kFull, CacheMode::kTbq, CacheMode::kTbe, CacheMode::kThinKv}) {
    if (s == to_string(m)) return m;
  }
  return std::nullopt;
}
constexpr bool quantizes(CacheMode m) noexcept { return m == CacheMode::kTbq || m == CacheMode::kThinKv; }
constexpr bool evicts(CacheMode m) noexcept { return m == CacheMode::kTbe || m == CacheMode::kThinKv; }

/// The CLI's TBE and ThinKV sets: the library's, with the selector chosen at run time
/// (--selection kmeans | first | last; SegmentSelector answers exactly as the one it names).
struct CliTbePolicy : CachePolicy<ThoughtClassifier, Bf16Pages, RetentionSchedule, SegmentSelector> {
  static constexpr std::string_view kName = "tbe";
};
struct CliThinKvPolicy : CachePolicy<ThoughtClassifier, PrecisionMap, RetentionSchedule, SegmentSelector> {
  static constexpr std::string_view kName = "thinkv";
};

/// A ThinKV cache to build: shape and run settings, the set, its components' settings (those
/// the set does not use are ignored: full ignores all of them, tbq the retention and selection,
/// tbe the precision map).
struct ThinKvSpec : ThinKvConfig {
  CacheMode mode = CacheMode::kThinKv;
  PrecisionMap precision{};
  RetentionSchedule retention{};
  ThoughtClassifier classifier{};  ///< uncalibrated by default: every token R
  KmeansOptions kmeans{};
  SegmentSelection selection = SegmentSelection::kKmeans;

  [[nodiscard]] const ThinKvConfig& config() const noexcept { return *this; }
  /// ThinKvConfig::validate(policy) for the set this spec names.
  [[nodiscard]] Status validate() const;
};

/// Policy set P with the settings of `s` its components take: the classifier, the precision map,
/// the retention schedule and the selector, wherever P's component is of the built-in type that
/// setting belongs to (a FullKvPolicy takes none of them).
template <cache_policy P>
P policy_of(const ThinKvSpec& s) {
  P p;
  if constexpr (std::same_as<typename P::classifier_type, ThoughtClassifier>) p.classifier = s.classifier;
  if constexpr (std::same_as<typename P::precision_type, PrecisionMap>) p.precision = s.precision;
  if constexpr (std::same_as<typename P::retention_type, RetentionSchedule>) p.retention = s.retention;
  if constexpr (std::same_as<typename P::selector_type, KmeansSelector>) p.selector = KmeansSelector{s.kmeans};
  if constexpr (std::same_as<typename P::selector_type, SegmentSelector>) {
    p.selector = SegmentSelector{s.selection, KmeansSelector{s.kmeans}};
  }
  return p;
}

/// Calls f(policy) with the typed policy set `s` names and returns what f returns.
template <class F>
decltype(auto) with_policy(const ThinKvSpec& s, F&& f) {
  switch (s.mode) {
    case CacheMode::kFull: return std::forward<F>(f)(policy_of<FullKvPolicy>(s));
    case CacheMode::kTbq: return std::forward<F>(f)(policy_of<TbqPolicy>(s));
    case CacheMode::kTbe: return std::forward<F>(f)(policy_of<CliTbePolicy>(s));
    default: return std::forward<F>(f)(policy_of<CliThinKvPolicy>(s));
  }
}

/// Builds the cache `s` describes over backend B and calls f(cache) (throws ConfigError).
template <kv_backend B = CpuKvBackend, class F>
decltype(auto) with_cache(const ThinKvSpec& s, F&& f, B backend = B{}) {
  return with_policy(s, [&]<class P>(const P& policy) -> decltype(auto) {
    BasicThinKvCache<P, B> cache(s.config(), policy, std::move(backend));
    return f(cache);
  });
}

/// Tensor parallelism: the spec of rank `rank` of `size` ranks for a model whose whole cache
/// `whole` describes. The rank holds KV heads [rank * h, (rank + 1) * h) for h = num_kv_heads /
/// size, and their query heads (num_q_heads / size); model_kv_heads and kv_head_offset say so,
/// which keeps the rank's K-means seeds those of the unsharded cache. kInvalidArgument when the
/// heads do not divide evenly among the ranks or the rank is outside 0 .. size - 1.
[[nodiscard]] inline Status tensor_parallel_slice(const ThinKvSpec& whole, int rank, int size, ThinKvSpec& out) {
  if (size < 1 || rank < 0 || rank >= size) {
    return {StatusCode::kInvalidArgument, "tensor parallelism: rank " + std::to_string(rank) + " of " +
                                              std::to_string(size) + " ranks (allowed: 0 <= rank < size)"};
  }
  if (whole.model_kv_heads != 0 && whole.model_kv_heads != whole.num_kv_heads) {
    return {StatusCode::kInvalidArgument, "tensor parallelism: the spec is already a slice (model_kv_heads " +
                                              std::to_string(whole.model_kv_heads) + ", num_kv_heads " +
                                              std::to_string(whole.num_kv_heads) + ")"};
  }
  if (whole.num_kv_heads % size != 0 || whole.num_q_heads % size != 0) {
    return {StatusCode::kInvalidArgument, "tensor parallelism: " + std::to_string(whole.num_kv_heads) +
                                              " KV heads and " + std::to_string(whole.num_q_heads) +
                                              " query heads do not split evenly over " + std::to_string(size) +
                                              " ranks (each rank holds whole KV heads with their query heads)"};
  }
  out = whole;
  out.num_kv_heads = whole.num_kv_heads / size;
  out.num_q_heads = whole.num_q_heads / size;
  out.model_kv_heads = whole.num_kv_heads;
  out.kv_head_offset = rank * out.num_kv_heads;
  return Status::ok();
}

inline Status ThinKvSpec::validate() const {
  if (static_cast<int>(mode) > static_cast<int>(CacheMode::kThinKv)) {
    return {StatusCode::kInvalidArgument,
            "mode " + std::to_string(static_cast<int>(mode)) + " is unknown; allowed: full, tbq, tbe, thinkv"};
  }
  return with_policy(*this, [this](const auto& policy) { return config().validate(policy); });
}

}  // namespace thinkv::decoder
