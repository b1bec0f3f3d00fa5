#pragma once
// One updating status line on stderr, shared by the thinkv CLI subcommands.

#include <chrono>
#include <cstdio>
#include <string>

namespace thinkv::cli {

/// One updating status line on stderr, at most 10 draws a second (clear() does not reset the
/// clock, so a caller that clears before every write of its own output still draws at most 10
/// times a second).
class Progress {
 public:
  Progress(bool enabled, std::string prefix) : enabled_(enabled), prefix_(std::move(prefix)) {}
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }
  [[nodiscard]] bool shown() const noexcept { return shown_; }
  /// Draws `text` unless the last draw was less than 100 ms ago (`force` draws anyway).
  void update(const std::string& text, bool force = false) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (!force && drawn_ && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    drawn_ = true;
    std::string line = prefix_ + text;
    const std::size_t len = line.size();
    if (len < width_) line.append(width_ - len, ' ');
    width_ = len;
    std::fprintf(stderr, "\r%s", line.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void clear() {
    if (!enabled_ || !shown_) return;
    std::fprintf(stderr, "\r%s\r", std::string(width_, ' ').c_str());
    std::fflush(stderr);
    shown_ = false;
    width_ = 0;
  }

 private:
  bool enabled_;
  std::string prefix_;
  bool shown_ = false;
  bool drawn_ = false;  ///< drawn at least once (the throttle's clock is running)
  std::size_t width_ = 0;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace thinkv::cli
