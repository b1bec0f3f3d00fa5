#pragma once
/// \file user_policies.hpp
/// Three policies written the way a user of the library writes them, against the concepts of
/// include/thinkv (nothing here is part of the library):
///  - WaitLineClassifier: a thought classifier that reads the text, not the attention: a line
///    that starts with "Wait" (the cue reasoning models print when they reconsider) makes the
///    next refresh window a transition (T), anything else reasoning (R);
///  - LinearRetention: a TBE schedule that shrinks by a fixed step (first, first - step, ...);
///  - KeepMostRecent: a token selector that keeps a segment's latest tokens (no keys read).
/// examples/custom_policies/main.cpp runs them through BasicThinKvCache; tests/unit/
/// test_user_policies.cpp checks them against the built-in equivalents and an independent
/// model of which tokens must be T.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/status.hpp"
#include "thinkv/tbe/token_selector.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/types.hpp"

namespace user {

/// Marks the tau tokens after a refresh T when a line starting with "Wait" began in the window
/// before it. Needs the token's text (begin_token's TokenHint); no attention signal.
class WaitLineClassifier {
 public:
  explicit WaitLineClassifier(int tau = 32) : tau_(tau) {}

  [[nodiscard]] thinkv::Status check(int /*num_layers*/) const {
    if (tau_ < 1) {
      return {thinkv::StatusCode::kInvalidArgument, "WaitLineClassifier tau " + std::to_string(tau_) + " must be >= 1"};
    }
    return thinkv::Status::ok();
  }
  [[nodiscard]] int tau() const noexcept { return tau_; }
  [[nodiscard]] bool emits(thinkv::ThoughtType t) const noexcept {
    return t == thinkv::ThoughtType::kReasoning || t == thinkv::ThoughtType::kTransition;
  }
  [[nodiscard]] bool needs_signal() const noexcept { return false; }
  [[nodiscard]] bool uses_layer(int) const noexcept { return false; }
  /// Every token, in order: remembers whether a line began with "Wait" since the last refresh.
  void observe(std::int64_t /*position*/, const thinkv::TokenHint& hint) {
    std::string_view t = hint.text;
    if (at_line_start_) {
      const std::size_t first = t.find_first_not_of(' ');
      if (first != std::string_view::npos && t.substr(first).starts_with("Wait")) wait_seen_ = true;
    }
    if (!t.empty()) at_line_start_ = t.back() == '\n';
  }
  [[nodiscard]] thinkv::ThoughtType decide(std::int64_t /*position*/, std::span<const float> /*sparsity*/) {
    const thinkv::ThoughtType t = wait_seen_ ? thinkv::ThoughtType::kTransition : thinkv::ThoughtType::kReasoning;
    wait_seen_ = false;
    return t;
  }
  [[nodiscard]] std::string to_string() const { return "WaitLineClassifier{tau=" + std::to_string(tau_) + "}"; }

 private:
  int tau_;
  bool at_line_start_ = true;
  bool wait_seen_ = false;
};

/// first, first - step, first - 2 step, ... (`levels` sizes).
struct LinearRetention {
  int first = 24;
  int step = 8;
  int levels = 3;

  [[nodiscard]] int num_levels() const noexcept { return levels; }
  [[nodiscard]] int retained(int level) const noexcept { return first - step * (level - 1); }
  [[nodiscard]] std::string to_string() const {
    return "linear{" + std::to_string(first) + " - " + std::to_string(step) + " x " + std::to_string(levels) + "}";
  }
};

/// Keeps the `keep` tokens of a segment with the highest positions.
struct KeepMostRecent {
  [[nodiscard]] thinkv::Status check() const { return thinkv::Status::ok(); }
  [[nodiscard]] bool reads_keys() const noexcept { return false; }
  [[nodiscard]] std::vector<int> select(const thinkv::SegmentTokens& t, int keep) const {
    std::vector<int> idx(static_cast<std::size_t>(t.count()));
    for (int j = 0; j < t.count(); ++j) idx[static_cast<std::size_t>(j)] = j;
    // Latest first, then the `keep` latest back in ascending index order.
    std::sort(idx.begin(), idx.end(), [&](int a, int b) {
      return t.positions[static_cast<std::size_t>(a)] > t.positions[static_cast<std::size_t>(b)];
    });
    idx.resize(static_cast<std::size_t>(std::min(keep, t.count())));
    std::sort(idx.begin(), idx.end());
    return idx;
  }
  [[nodiscard]] std::string to_string() const { return "keep most recent"; }
};

}  // namespace user
