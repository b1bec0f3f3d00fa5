#pragma once
/// \file retention_schedule.hpp
/// TBE retention schedule: how many tokens a thought segment keeps after n step-downs.
/// (The eviction planner that uses it is built on top of this policy.)

#include <concepts>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include "thinkv/status.hpp"

namespace thinkv {

/// Strictly decreasing positive sizes, e.g. {64, 32, 16, 8, 4}; the last is the minimum a segment
/// keeps. Level n (n >= 1 step-downs) keeps at most levels()[n-1] tokens; level 0 keeps the whole
/// segment.
class RetentionSchedule {
 public:
  RetentionSchedule() : RetentionSchedule({64, 32, 16, 8, 4}) {}
  /// Throws ConfigError when the sizes are empty, non-positive or not strictly decreasing.
  RetentionSchedule(std::initializer_list<int> sizes) : RetentionSchedule(std::vector<int>(sizes)) {}
  explicit RetentionSchedule(std::vector<int> sizes) : sizes_(std::move(sizes)) {
    if (Status s = check(sizes_); !s.is_ok()) throw ConfigError(s);
  }

  static Status check(const std::vector<int>& sizes) {
    if (sizes.empty()) {
      return {StatusCode::kInvalidArgument, "retention schedule is empty; give e.g. {64,32,16,8,4}"};
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 1) {
        return {StatusCode::kInvalidArgument, "retention schedule entry " + std::to_string(i) + " is " +
                                                  std::to_string(sizes[i]) + "; allowed: >= 1"};
      }
      if (i > 0 && sizes[i] >= sizes[i - 1]) {
        return {StatusCode::kInvalidArgument, "retention schedule must be strictly decreasing, but entry " +
                                                  std::to_string(i) + " (" + std::to_string(sizes[i]) + ") >= entry " +
                                                  std::to_string(i - 1) + " (" + std::to_string(sizes[i - 1]) + ")"};
      }
    }
    return Status::ok();
  }

  [[nodiscard]] const std::vector<int>& levels() const noexcept { return sizes_; }
  [[nodiscard]] int num_levels() const noexcept { return static_cast<int>(sizes_.size()); }
  /// The minimum number of tokens a segment keeps (the last entry).
  [[nodiscard]] int min_retention() const noexcept { return sizes_.back(); }
  [[nodiscard]] std::string to_string() const {
    std::string s = "{";
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      // Appended piece by piece: `const char* + std::string&&` trips GCC 12's -Wrestrict at -O3.
      if (i != 0) s += ',';
      s += std::to_string(sizes_[i]);
    }
    s += '}';
    return s;
  }
  friend bool operator==(const RetentionSchedule&, const RetentionSchedule&) = default;
  friend std::ostream& operator<<(std::ostream& os, const RetentionSchedule& r) { return os << r.to_string(); }

 private:
  std::vector<int> sizes_;
};

/// A TBE retention schedule policy.
template <class R>
concept retention_schedule = std::regular<R> && requires(const R& r) {
  { r.min_retention() } -> std::convertible_to<int>;
  { r.num_levels() } -> std::convertible_to<int>;
};
static_assert(retention_schedule<RetentionSchedule>);

}  // namespace thinkv
