#pragma once
/// \file token_selector.hpp
/// TBE token selectors: which live tokens a shrinking thought segment keeps. The policy concept
/// (`token_selector`), ThinKV's own (KmeansSelector: the K-means centroids of the segment's
/// post-RoPE keys), the ablations (KeepFirst, KeepLast), and SegmentSelector, which picks one
/// of the three at run time (a CLI flag).

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/status.hpp"
#include "thinkv/tbe/kmeans.hpp"

namespace thinkv {

/// The live tokens of one segment of one stream, as a selector sees them. Row j of `keys` and
/// entry j of `positions` are the same token; rows are in block-table slot order, not position
/// order.
struct SegmentTokens {
  std::span<const float> keys;              ///< [count(), head_dim] post-RoPE keys as stored
                                            ///< (dequantized); empty when the selector reads none
  std::span<const std::int32_t> positions;  ///< [count()] each token's position
  int head_dim = 0;
  int stream = 0;             ///< the stream (sequence, layer, KV head) the segment belongs to
  std::uint32_t segment = 0;  ///< the segment's id
  /// The stream's index within its sequence (layer * num_kv_heads + KV head), or -1 when the
  /// caller has no sequences (then `stream` stands for it). Selections are seeded by it, not by
  /// the stream, so a sequence takes the same decisions in whichever sequence slot it runs (a
  /// loaded state continues as it was saved).
  int lane = -1;
  [[nodiscard]] int count() const noexcept { return static_cast<int>(positions.size()); }
};

/// The seed of a segment's K-means selection (KmeansSelector and the backends' selection jobs):
/// the selector's seed mixed with the stream's lane and the segment id.
constexpr std::uint64_t selection_seed(std::uint64_t seed, std::int64_t lane, std::uint32_t segment) noexcept {
  std::uint64_t mix = seed ^ (static_cast<std::uint64_t>(lane) << 32) ^ segment;
  return splitmix64(mix);
}

/// A TBE token selector policy: what BasicThinKvCache calls on it.
///  - check(): are its settings valid (the Status names the bad one; called at construction);
///  - reads_keys(): does select() read the keys (when false the cache does not dequantize them);
///  - select(tokens, keep): the indices of the `keep` tokens to keep, keep < tokens.count();
///    exactly `keep` distinct indices into the segment, ascending (the cache checks the answer
///    and refuses one that breaks this, evicting nothing);
///  - to_string(): for messages and method names.
template <class S>
concept token_selector = std::copy_constructible<S> && requires(const S& s, const SegmentTokens& tokens, int keep) {
  { s.check() } -> std::same_as<Status>;
  { s.reads_keys() } -> std::same_as<bool>;
  { s.select(tokens, keep) } -> std::convertible_to<std::vector<int>>;
  { s.to_string() } -> std::convertible_to<std::string>;
};

/// Checks a selector's answer: exactly `keep` distinct indices into `count` tokens, ascending.
/// `selector` and `what` (e.g. "segment 3 in stream 7") name it in the message of the
/// kInvalidArgument it returns otherwise.
inline Status check_selection(std::span<const int> kept, int count, int keep, std::string_view selector,
                              std::string_view what) {
  auto bad = [&](const std::string& why) {
    return Status(StatusCode::kInvalidArgument,
                  "token selector " + std::string(selector) + " asked to keep " + std::to_string(keep) + " of the " +
                      std::to_string(count) + " tokens of " + std::string(what) + " " + why + "; nothing was evicted");
  };
  if (static_cast<int>(kept.size()) != keep) return bad("returned " + std::to_string(kept.size()) + " indices");
  for (std::size_t i = 0; i < kept.size(); ++i) {
    if (kept[i] < 0 || kept[i] >= count) return bad("returned index " + std::to_string(kept[i]));
    if (i > 0 && kept[i] <= kept[i - 1]) return bad("returned indices that are not ascending and distinct");
  }
  return Status::ok();
}

/// The tag of a policy set that never evicts, so never selects.
struct NoSelection {
  friend bool operator==(NoSelection, NoSelection) = default;
};

/// ThinKV's selector: the tokens nearest the K-means centroids of the segment's keys
/// (kmeans_select), seeded per stream lane and segment so that every run makes the same choice.
struct KmeansSelector {
  KmeansOptions options{};

  [[nodiscard]] Status check() const {
    if (options.max_iterations < 0 || options.max_iterations > 1000) {
      return {StatusCode::kInvalidArgument, "kmeans.max_iterations " + std::to_string(options.max_iterations) +
                                                " is out of range; allowed: 0..1000 (0 = k-means++ seeding only)"};
    }
    return Status::ok();
  }
  [[nodiscard]] bool reads_keys() const noexcept { return true; }
  [[nodiscard]] std::vector<int> select(const SegmentTokens& t, int keep) const {
    KmeansOptions ko = options;
    ko.seed = selection_seed(ko.seed, t.lane >= 0 ? t.lane : t.stream, t.segment);
    return kmeans_select(t.keys.data(), t.count(), t.head_dim, keep, ko);
  }
  [[nodiscard]] std::string to_string() const { return "kmeans"; }
  friend bool operator==(const KmeansSelector& a, const KmeansSelector& b) noexcept {
    return a.options.max_iterations == b.options.max_iterations && a.options.seed == b.options.seed;
  }
};

/// Indices (ascending) of the `keep` tokens with the lowest (`last` false) or highest positions.
inline std::vector<int> keep_by_position(std::span<const std::int32_t> positions, int keep, bool last) {
  std::vector<int> idx(positions.size());
  for (std::size_t j = 0; j < idx.size(); ++j) idx[j] = static_cast<int>(j);
  std::sort(idx.begin(), idx.end(), [&](int a, int b) {
    return positions[static_cast<std::size_t>(a)] < positions[static_cast<std::size_t>(b)];
  });
  const std::size_t n = std::min(idx.size(), static_cast<std::size_t>(std::max(0, keep)));
  std::vector<int> kept = last ? std::vector<int>(idx.end() - static_cast<std::ptrdiff_t>(n), idx.end())
                               : std::vector<int>(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n));
  std::sort(kept.begin(), kept.end());
  return kept;
}

/// The ablation that keeps each segment's first tokens (what K-means buys: docs/results.md).
struct KeepFirst {
  [[nodiscard]] Status check() const { return Status::ok(); }
  [[nodiscard]] bool reads_keys() const noexcept { return false; }
  [[nodiscard]] std::vector<int> select(const SegmentTokens& t, int keep) const {
    return keep_by_position(t.positions, keep, false);
  }
  [[nodiscard]] std::string to_string() const { return "keep first"; }
  friend bool operator==(KeepFirst, KeepFirst) = default;
};

/// The ablation that keeps each segment's last tokens.
struct KeepLast {
  [[nodiscard]] Status check() const { return Status::ok(); }
  [[nodiscard]] bool reads_keys() const noexcept { return false; }
  [[nodiscard]] std::vector<int> select(const SegmentTokens& t, int keep) const {
    return keep_by_position(t.positions, keep, true);
  }
  [[nodiscard]] std::string to_string() const { return "keep last"; }
  friend bool operator==(KeepLast, KeepLast) = default;
};

/// Which built-in selector SegmentSelector runs.
enum class SegmentSelection : std::uint8_t { kKmeans, kFirst, kLast };

constexpr std::string_view to_string(SegmentSelection s) noexcept {
  switch (s) {
    case SegmentSelection::kKmeans: return "kmeans";
    case SegmentSelection::kFirst: return "first";
    case SegmentSelection::kLast: return "last";
  }
  return "?";
}
/// Parses "kmeans", "first", "last".
inline std::optional<SegmentSelection> parse_segment_selection(std::string_view s) noexcept {
  for (SegmentSelection m : {SegmentSelection::kKmeans, SegmentSelection::kFirst, SegmentSelection::kLast}) {
    if (s == to_string(m)) return m;
  }
  return std::nullopt;
}

/// One of the built-in selectors, chosen at run time (the CLI's --selection): it answers exactly
/// as the selector it names.
struct SegmentSelector {
  SegmentSelection selection = SegmentSelection::kKmeans;
  KmeansSelector kmeans{};

  [[nodiscard]] Status check() const {
    if (static_cast<int>(selection) > static_cast<int>(SegmentSelection::kLast)) {
      return {StatusCode::kInvalidArgument,
              "selection " + std::to_string(static_cast<int>(selection)) + " is unknown; allowed: kmeans, first, last"};
    }
    return kmeans.check();
  }
  [[nodiscard]] bool reads_keys() const noexcept { return selection == SegmentSelection::kKmeans; }
  [[nodiscard]] std::vector<int> select(const SegmentTokens& t, int keep) const {
    switch (selection) {
      case SegmentSelection::kFirst: return KeepFirst{}.select(t, keep);
      case SegmentSelection::kLast: return KeepLast{}.select(t, keep);
      default: return kmeans.select(t, keep);
    }
  }
  [[nodiscard]] std::string to_string() const {
    switch (selection) {
      case SegmentSelection::kFirst: return KeepFirst{}.to_string();
      case SegmentSelection::kLast: return KeepLast{}.to_string();
      default: return kmeans.to_string();
    }
  }
  friend bool operator==(const SegmentSelector&, const SegmentSelector&) = default;
};

static_assert(token_selector<KmeansSelector> && token_selector<KeepFirst> && token_selector<KeepLast> &&
              token_selector<SegmentSelector>);

}  // namespace thinkv
