#pragma once
/// \file retention_schedule.hpp
/// TBE retention schedule: how many tokens a thought segment keeps after n step-downs.
/// (The concept it models, retention_schedule, is the eviction planner's: tbe/eviction_plan.hpp.)

#include <concepts>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include "thinkv/status.hpp"
#include "thinkv/tbe/eviction_plan.hpp"

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
  /// Tokens a segment keeps at most after `level` step-downs (1..num_levels()).
  [[nodiscard]] int retained(int level) const noexcept { return sizes_[static_cast<std::size_t>(level - 1)]; }
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

static_assert(retention_schedule<RetentionSchedule>);

/// Checks the retained sizes of any schedule: >= 1 level, each positive, strictly decreasing.
template <retention_schedule R>
Status check_retention(const R& r) {
  const int n = r.num_levels();
  if (n < 1) {
    return {StatusCode::kInvalidArgument, "retention schedule " + std::string(r.to_string()) + " has " +
                                              std::to_string(n) + " levels; allowed: >= 1"};
  }
  for (int l = 1; l <= n; ++l) {
    const int k = r.retained(l);
    if (k < 1 || (l > 1 && k >= r.retained(l - 1))) {
      return {StatusCode::kInvalidArgument, "retention schedule " + std::string(r.to_string()) + " keeps " +
                                                std::to_string(k) + " tokens at level " + std::to_string(l) +
                                                "; sizes must be >= 1 and strictly decreasing"};
    }
  }
  return Status::ok();
}

/// The tag of a policy set that never evicts (FullKV, TBQ): no schedule, no token budget.
struct NoEviction {
  friend bool operator==(NoEviction, NoEviction) = default;
};

}  // namespace thinkv
