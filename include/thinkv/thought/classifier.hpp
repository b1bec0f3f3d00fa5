#pragma once
/// \file classifier.hpp
/// Thought decomposition at run time: the ThoughtClassifier policy (thresholds, layer subset L*,
/// refresh period tau, band -> thought mapping), its POD lowering for kernels, and the
/// per-sequence ThoughtTracker that holds the current type between refreshes and counts.
///
/// Signal: per layer, the sparsity of the decoded token's attention averaged over query heads
/// (DecodeAttentionArgs::sparsity); the token's signal is the mean over the layers in L*.
/// Bands: with ascending thresholds t_0 < t_1, band 0 is signal < t_0, band 1 is t_0 <= signal < t_1,
/// band 2 is signal >= t_1 (a value equal to a threshold goes to the upper band). By default band
/// 0 (least sparse) is E, band 1 is R, band 2 (most sparse) is T.

#include <array>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/config.hpp"
#include "thinkv/status.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

inline constexpr int kMaxThoughtBands = 3;
inline constexpr int kMaxClassifierLayers = 256;

/// The classifier lowered to a plain struct for device code (trivially copyable).
struct ThoughtClassifierDesc {
  float thresholds[kMaxThoughtBands - 1];               ///< [num_bands - 1] ascending
  std::uint8_t band_types[kMaxThoughtBands];            ///< [num_bands] ThoughtType of each band
  std::int32_t num_bands;                               ///< 1..3
  std::int32_t tau;                                     ///< refresh period in tokens
  std::uint64_t layer_mask[kMaxClassifierLayers / 64];  ///< bit l set: layer l is in L*
  std::int32_t num_selected_layers;                     ///< |L*|
};

/// Band of a signal value: the number of thresholds it is >= to.
THINKV_HD constexpr int thought_band(const ThoughtClassifierDesc& d, float signal) noexcept {
  int band = 0;
  for (int i = 0; i + 1 < d.num_bands; ++i) band += signal >= d.thresholds[i] ? 1 : 0;
  return band;
}
THINKV_HD constexpr ThoughtType classify(const ThoughtClassifierDesc& d, float signal) noexcept {
  return static_cast<ThoughtType>(d.band_types[thought_band(d, signal)]);
}

/// What a decoder knows about the token being decoded, beyond its K/V: passed to
/// BasicThinKvCache::begin_token and from there to the classifier's observe(). Either field may be
/// empty (token -1, text ""); the built-in ThoughtClassifier reads neither.
struct TokenHint {
  std::int32_t token = -1;  ///< vocabulary id of the token at this position, -1 = unknown
  std::string_view text;    ///< its text (valid only during the call)
};

/// The thought classifier policy: a regular value type.
class ThoughtClassifier {
 public:
  /// Uncalibrated: one band, every token is R (the most important type), refresh every 128
  /// tokens. A cache driven by it never stores anything below the R precision.
  ThoughtClassifier() = default;

  /// Throws ConfigError naming the bad value (see check()).
  ThoughtClassifier(std::vector<float> thresholds, std::vector<int> layers, int tau,
                    std::vector<ThoughtType> band_types, int num_layers)
      : thresholds_(std::move(thresholds)),
        layers_(std::move(layers)),
        band_types_(std::move(band_types)),
        tau_(tau),
        num_layers_(num_layers) {
    if (Status s = check(thresholds_, layers_, tau_, band_types_, num_layers_); !s.is_ok()) { throw ConfigError(s); }
  }

  /// The paper's three types with the default band mapping (E, R, T from least to most sparse).
  static ThoughtClassifier three_types(float t0, float t1, std::vector<int> layers, int tau, int num_layers) {
    return ThoughtClassifier({t0, t1}, std::move(layers), tau,
                             {ThoughtType::kExecution, ThoughtType::kReasoning, ThoughtType::kTransition}, num_layers);
  }

  static Status check(const std::vector<float>& thresholds, const std::vector<int>& layers, int tau,
                      const std::vector<ThoughtType>& band_types, int num_layers) {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    const int bands = static_cast<int>(band_types.size());
    if (bands < 1 || bands > kMaxThoughtBands) {
      return bad("classifier has " + std::to_string(bands) + " bands; allowed: 1..3");
    }
    if (static_cast<int>(thresholds.size()) != bands - 1) {
      return bad("classifier has " + std::to_string(thresholds.size()) + " thresholds for " + std::to_string(bands) +
                 " bands; need exactly " + std::to_string(bands - 1));
    }
    for (std::size_t i = 0; i < thresholds.size(); ++i) {
      const float t = thresholds[i];
      if (!(t > 0.0f && t < 1.0f)) {
        return bad("threshold " + std::to_string(i) + " = " + std::to_string(t) +
                   " is outside the open interval (0, 1)");
      }
      if (i > 0 && !(t > thresholds[i - 1])) {
        return bad("thresholds must be strictly ascending, but threshold " + std::to_string(i) + " = " +
                   std::to_string(t) + " <= threshold " + std::to_string(i - 1) + " = " +
                   std::to_string(thresholds[i - 1]));
      }
    }
    for (int i = 0; i < bands; ++i) {
      if (static_cast<int>(band_types[static_cast<std::size_t>(i)]) >= kNumThoughtTypes) {
        return bad("band " + std::to_string(i) + " has an unknown thought type");
      }
      for (int j = 0; j < i; ++j) {
        if (band_types[static_cast<std::size_t>(i)] == band_types[static_cast<std::size_t>(j)]) {
          return bad("bands " + std::to_string(j) + " and " + std::to_string(i) + " both map to thought type " +
                     std::string(thinkv::to_string(band_types[static_cast<std::size_t>(i)])));
        }
      }
    }
    if (tau < 1) return bad("tau " + std::to_string(tau) + " is out of range; allowed: >= 1");
    if (num_layers < 1 || num_layers > kMaxClassifierLayers) {
      return bad("num_layers " + std::to_string(num_layers) + " is out of range; allowed: 1.." +
                 std::to_string(kMaxClassifierLayers));
    }
    if (layers.empty() && bands > 1) return bad("the layer subset L* is empty");
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (layers[i] < 0 || layers[i] >= num_layers) {
        return bad("layer " + std::to_string(layers[i]) + " in L* is out of range; allowed: 0.." +
                   std::to_string(num_layers - 1));
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (layers[j] == layers[i]) { return bad("layer " + std::to_string(layers[i]) + " is listed twice in L*"); }
      }
    }
    return Status::ok();
  }

  /// tau must be a multiple of the quantization group so that a type change (a refresh) always
  /// falls on a group boundary and a group never mixes thought types.
  [[nodiscard]] Status check_alignment(int group_size) const {
    if (group_size < 1 || tau_ % group_size != 0) {
      return {StatusCode::kInvalidArgument, "tau " + std::to_string(tau_) + " is not a multiple of group_size " +
                                                std::to_string(group_size) +
                                                "; thought refreshes must fall on quantization "
                                                "group boundaries (use tau = k * group_size, e.g. 128)"};
    }
    return Status::ok();
  }

  [[nodiscard]] const std::vector<float>& thresholds() const noexcept { return thresholds_; }
  [[nodiscard]] const std::vector<int>& layers() const noexcept { return layers_; }
  [[nodiscard]] const std::vector<ThoughtType>& band_types() const noexcept { return band_types_; }
  [[nodiscard]] int tau() const noexcept { return tau_; }
  [[nodiscard]] int num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] int num_bands() const noexcept { return static_cast<int>(band_types_.size()); }
  /// True when the classifier needs the sparsity signal (it has more than one band).
  [[nodiscard]] bool needs_signal() const noexcept { return num_bands() > 1; }
  /// True when `layer` is in L* (its attention must emit sparsity on refresh steps).
  [[nodiscard]] bool uses_layer(int layer) const noexcept {
    for (int l : layers_) {
      if (l == layer) return true;
    }
    return false;
  }

  /// Refresh steps: positive multiples of tau. Position 0 is not one: the first token attends
  /// only to itself, so its sparsity is 0 whatever the model does; the first tau tokens keep the
  /// tracker's initial type (R, the most important).
  [[nodiscard]] bool is_refresh_step(std::int64_t position) const noexcept {
    return position > 0 && position % tau_ == 0;
  }

  /// The token signal: mean over L* of per-layer sparsity (`layer_sparsity` indexed by layer,
  /// num_layers entries; only L* entries are read).
  [[nodiscard]] float signal(std::span<const float> layer_sparsity) const noexcept {
    if (layers_.empty()) return 0.0f;
    float sum = 0.0f;
    for (int l : layers_) sum += layer_sparsity[static_cast<std::size_t>(l)];
    return sum / static_cast<float>(layers_.size());
  }

  [[nodiscard]] ThoughtType classify(float signal) const noexcept {
    int band = 0;
    for (float t : thresholds_) band += signal >= t ? 1 : 0;
    return band_types_[static_cast<std::size_t>(band)];
  }

  /// The thought_classifier calls. check: a calibrated classifier must have been calibrated for
  /// this model's layer count.
  [[nodiscard]] Status check(int model_layers) const {
    if (needs_signal() && num_layers_ != model_layers) {
      return {StatusCode::kInvalidArgument, "the thought classifier was calibrated for " + std::to_string(num_layers_) +
                                                " layers; this model has " + std::to_string(model_layers) +
                                                " (recalibrate with `thinkv calibrate`)"};
    }
    return Status::ok();
  }
  /// True when some band maps to t.
  [[nodiscard]] bool emits(ThoughtType t) const noexcept {
    for (ThoughtType b : band_types_) {
      if (b == t) return true;
    }
    return false;
  }
  /// Reads nothing of the token: the signal is the attention sparsity alone.
  void observe(std::int64_t /*position*/, const TokenHint& /*hint*/) noexcept {}
  /// classify(signal(layer_sparsity)).
  [[nodiscard]] ThoughtType decide(std::int64_t /*position*/, std::span<const float> layer_sparsity) const noexcept {
    return classify(signal(layer_sparsity));
  }

  [[nodiscard]] ThoughtClassifierDesc lower() const noexcept {
    ThoughtClassifierDesc d{};
    for (std::size_t i = 0; i < thresholds_.size(); ++i) d.thresholds[i] = thresholds_[i];
    for (std::size_t i = 0; i < band_types_.size(); ++i) {
      d.band_types[i] = static_cast<std::uint8_t>(band_types_[i]);
    }
    d.num_bands = num_bands();
    d.tau = tau_;
    for (int l : layers_) d.layer_mask[l / 64] |= std::uint64_t{1} << (l % 64);
    d.num_selected_layers = static_cast<std::int32_t>(layers_.size());
    return d;
  }

  [[nodiscard]] std::string to_string() const {
    // Appended piece by piece: `const char* + std::string&&` trips GCC 12's -Wrestrict at -O3.
    std::string s = "ThoughtClassifier{bands=";
    for (std::size_t i = 0; i < band_types_.size(); ++i) {
      if (i) {
        s += '|';
        s += std::to_string(thresholds_[i - 1]);
        s += '|';
      }
      s += thinkv::to_string(band_types_[i]);
    }
    s += ", L*={";
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(layers_[i]);
    }
    s += "}, tau=";
    s += std::to_string(tau_);
    s += ", layers=";
    s += std::to_string(num_layers_);
    s += '}';
    return s;
  }
  friend bool operator==(const ThoughtClassifier&, const ThoughtClassifier&) = default;
  friend std::ostream& operator<<(std::ostream& os, const ThoughtClassifier& c) { return os << c.to_string(); }

 private:
  std::vector<float> thresholds_;
  std::vector<int> layers_;
  std::vector<ThoughtType> band_types_{ThoughtType::kReasoning};
  int tau_ = 128;
  int num_layers_ = 1;
};

/// A thought classifier policy: what BasicThinKvCache calls on it (every call is listed here).
/// The cache keeps one copy per sequence, so a classifier may hold per-sequence state.
///  - check(num_layers): can it serve a model of that many layers (the Status names what not);
///  - tau(): refresh period in tokens; refresh steps are the positive multiples of tau, which the
///    cache requires to be a multiple of group_size (a group never mixes thought types);
///  - emits(t): can it ever label a token t (sizes the memory bound; R is always possible: the
///    first tau tokens and a pinned prefix are R);
///  - needs_signal() / uses_layer(l): on refresh steps, attend() of layer l computes the attention
///    sparsity when both are true;
///  - observe(position, hint): every token, at begin_token, before its K/V is appended;
///  - decide(position, layer_sparsity): on refresh steps, after every layer was attended: the
///    type of the next tau tokens (layer_sparsity has one entry per layer, NaN where not computed).
///  - to_string(): for messages.
template <class C>
concept thought_classifier = std::copy_constructible<C> &&
    requires(C& c, const C& cc, int n, ThoughtType t, std::int64_t pos, const TokenHint& hint,
             std::span<const float> sparsity) {
  { cc.check(n) } -> std::same_as<Status>;
  { cc.tau() } -> std::convertible_to<int>;
  { cc.emits(t) } -> std::same_as<bool>;
  { cc.needs_signal() } -> std::same_as<bool>;
  { cc.uses_layer(n) } -> std::same_as<bool>;
  {c.observe(pos, hint)};
  { c.decide(pos, sparsity) } -> std::same_as<ThoughtType>;
  { cc.to_string() } -> std::convertible_to<std::string>;
};
static_assert(thought_classifier<ThoughtClassifier>);

/// Counters of a ThoughtTracker.
struct ThoughtStats {
  std::int64_t refreshes = 0;   ///< refresh() calls
  std::int64_t refresh_ns = 0;  ///< wall time spent inside refresh()
  std::int64_t changes = 0;     ///< refreshes whose type differs from the type before
  std::array<std::int64_t, kNumThoughtTypes> refresh_histogram{};  ///< refresh outcomes by type
  std::array<std::int64_t, kNumThoughtTypes> tokens{};             ///< tokens labelled, by type
  friend bool operator==(const ThoughtStats&, const ThoughtStats&) = default;
};

/// Per-sequence run-time state: a classifier's copy and the current thought type, held between
/// refreshes.
///
/// Protocol for a decoder at position p (the position of the token being decoded):
///   1. t = tracker.type_for(p): the type to append token p with;
///   2. append token p's K/V with type t in every stream, attend (asking for sparsity on the
///      layers in L* when tracker.is_refresh_step(p));
///   3. if is_refresh_step(p): t' = tracker.refresh(p, per_layer_sparsity); then relabel the
///      staging group of every stream with t' (PagedKvCache::relabel_staged). Because tau is a
///      multiple of g and p is a multiple of tau, that group holds token p alone, so the new type
///      covers tokens p .. p + tau - 1 and no group ever mixes types.
template <thought_classifier C>
class BasicThoughtTracker {
 public:
  BasicThoughtTracker() : BasicThoughtTracker(C{}) {}
  explicit BasicThoughtTracker(C classifier, ThoughtType initial = ThoughtType::kReasoning)
      : classifier_(std::move(classifier)), current_(initial) {}

  [[nodiscard]] const C& classifier() const noexcept { return classifier_; }
  [[nodiscard]] C& classifier() noexcept { return classifier_; }
  [[nodiscard]] ThoughtType current() const noexcept { return current_; }
  [[nodiscard]] const ThoughtStats& stats() const noexcept { return stats_; }
  /// Positive multiples of the classifier's tau. Position 0 is not one: the first token attends
  /// only to itself, so its sparsity is 0 whatever the model does; the first tau tokens keep the
  /// tracker's initial type (R, the most important).
  [[nodiscard]] bool is_refresh_step(std::int64_t position) const noexcept {
    const std::int64_t tau = classifier_.tau();
    return position > 0 && tau > 0 && position % tau == 0;
  }
  /// True when the classifier can ever change the type (it labels some token other than R).
  [[nodiscard]] bool refreshes() const noexcept {
    return classifier_.emits(ThoughtType::kExecution) || classifier_.emits(ThoughtType::kTransition);
  }
  /// The type token `position` is appended with (before its refresh, if any), counted.
  ThoughtType type_for(std::int64_t position) noexcept {
    (void)position;
    ++stats_.tokens[static_cast<std::size_t>(current_)];
    return current_;
  }
  /// Sets the current type and the counters (a saved sequence state being restored); the
  /// classifier itself is this tracker's (it keeps no per-sequence state beyond observe()).
  void restore(ThoughtType current, const ThoughtStats& stats) noexcept {
    current_ = current;
    stats_ = stats;
  }
  /// Passes a token's hint to the classifier (every token, before its K/V).
  void observe(std::int64_t position, const TokenHint& hint) { classifier_.observe(position, hint); }
  /// Classifies a refresh step and makes the result the current type. Returns kInvalidArgument
  /// (state unchanged) when `position` is not a refresh step; when the classifier needs the signal,
  /// kShapeMismatch when the span is shorter than its layers and kNonFinite when a layer it uses
  /// is NaN or outside [0, 1].
  [[nodiscard]] Status refresh(std::int64_t position, std::span<const float> layer_sparsity,
                               ThoughtType* new_type = nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!is_refresh_step(position)) {
      return {StatusCode::kInvalidArgument, "position " + std::to_string(position) + " is not a refresh step (tau = " +
                                                std::to_string(classifier_.tau()) + ")"};
    }
    if (classifier_.needs_signal()) {
      if constexpr (requires { classifier_.num_layers(); }) {
        if (static_cast<int>(layer_sparsity.size()) < classifier_.num_layers()) {
          return {StatusCode::kShapeMismatch, "refresh got sparsity for " + std::to_string(layer_sparsity.size()) +
                                                  " layers; the classifier was calibrated for " +
                                                  std::to_string(classifier_.num_layers())};
        }
      }
      for (std::size_t l = 0; l < layer_sparsity.size(); ++l) {
        if (!classifier_.uses_layer(static_cast<int>(l))) continue;
        const float s = layer_sparsity[l];
        if (!(s >= 0.0f && s <= 1.0f)) {
          return {StatusCode::kNonFinite, "sparsity of layer " + std::to_string(l) + " is " + std::to_string(s) +
                                              "; expected a share in [0, 1]"};
        }
      }
    }
    const ThoughtType t = classifier_.decide(position, layer_sparsity);
    if (static_cast<int>(t) >= kNumThoughtTypes) {
      return {StatusCode::kInvalidArgument, "the thought classifier " + std::string(classifier_.to_string()) +
                                                " returned thought type " + std::to_string(static_cast<int>(t)) +
                                                " at position " + std::to_string(position) + "; allowed: R, E, T"};
    }
    // The token at `position` was counted under the old type by type_for(); move it.
    if (stats_.tokens[static_cast<std::size_t>(current_)] > 0) {
      --stats_.tokens[static_cast<std::size_t>(current_)];
      ++stats_.tokens[static_cast<std::size_t>(t)];
    }
    if (t != current_) ++stats_.changes;
    current_ = t;
    ++stats_.refreshes;
    ++stats_.refresh_histogram[static_cast<std::size_t>(t)];
    stats_.refresh_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    if (new_type) *new_type = t;
    return Status::ok();
  }

 private:
  C classifier_;
  ThoughtType current_;
  ThoughtStats stats_;
};

/// The tracker of the built-in classifier.
using ThoughtTracker = BasicThoughtTracker<ThoughtClassifier>;

}  // namespace thinkv
