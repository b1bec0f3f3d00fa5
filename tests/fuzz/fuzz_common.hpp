#pragma once
/// \file fuzz_common.hpp
/// Shared by the libFuzzer targets of tests/fuzz/ (README.md there): every parser of untrusted
/// input must return a Status for any bytes, never crash, read out of bounds or hit undefined
/// behaviour (the targets build with AddressSanitizer and UndefinedBehaviorSanitizer).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>

/// Stops the process (a finding) when `cond` is false: an invariant of a successful parse broke.
#define FUZZ_CHECK(cond)                                                                      \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}
inline std::span<const std::uint8_t> as_bytes(const std::uint8_t* data, std::size_t size) { return {data, size}; }
