#pragma once
/// \file status.hpp
/// Error values used at every edge of the library. Library code never calls exit()/abort().

#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace thinkv {

/// What went wrong, as a stable code (device-facing code uses this enum alone).
enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,  ///< a value outside its allowed range (message names it)
  kShapeMismatch,    ///< a tensor/extent does not match the configured layout
  kNonFinite,        ///< NaN or Inf in appended K/V
  kPoolExhausted,    ///< no free block / scale record left in a pool
  kOutOfRange,       ///< index (stream, slot, block) outside the configured extent
  kUnsupported,      ///< a valid request this build or backend does not implement
  kCudaError,        ///< a CUDA runtime call failed (message carries cudaGetErrorString)
  kInternal,         ///< an invariant of the library broke: a bug, please report it
  kCorruptData,      ///< saved data is truncated, damaged or inconsistent (message says where)
};

constexpr std::string_view to_string(StatusCode c) noexcept {
  switch (c) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kShapeMismatch: return "shape mismatch";
    case StatusCode::kNonFinite: return "non-finite value";
    case StatusCode::kPoolExhausted: return "pool exhausted";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kCudaError: return "CUDA error";
    case StatusCode::kInternal: return "internal error";
    case StatusCode::kCorruptData: return "corrupt data";
  }
  return "unknown";
}

/// A status code with a human-readable message that says what to fix.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  [[nodiscard]] bool is_ok() const noexcept { return code_ == StatusCode::kOk; }
  explicit operator bool() const noexcept { return is_ok(); }
  [[nodiscard]] StatusCode code() const noexcept { return code_; }
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  /// "pool exhausted: ..." (or "ok").
  [[nodiscard]] std::string to_string() const {
    std::string s(thinkv::to_string(code_));
    if (!message_.empty()) s += ": " + message_;
    return s;
  }
  friend std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.to_string(); }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

/// Thrown by constructors that reject an invalid configuration; what() names the bad value and the
/// allowed range. Functions that do not construct objects return Status instead.
class ConfigError : public std::invalid_argument {
 public:
  explicit ConfigError(const Status& s) : std::invalid_argument(s.to_string()), status_(s) {}
  [[nodiscard]] const Status& status() const noexcept { return status_; }

 private:
  Status status_;
};

/// Thrown by constructors when a backend cannot set itself up (no device, no memory); carries
/// the backend's Status (its code kept, the message naming the backend).
class BackendError : public std::runtime_error {
 public:
  explicit BackendError(const Status& s) : std::runtime_error(s.to_string()), status_(s) {}
  [[nodiscard]] const Status& status() const noexcept { return status_; }

 private:
  Status status_;
};

/// Returns from the enclosing function when `expr` (a Status) is not ok.
#define THINKV_RETURN_IF_ERROR(expr)                    \
  do {                                                  \
    ::thinkv::Status thinkv_status_ = (expr);           \
    if (!thinkv_status_.is_ok()) return thinkv_status_; \
  } while (0)

}  // namespace thinkv
