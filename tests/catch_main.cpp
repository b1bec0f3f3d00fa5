/// \file catch_main.cpp
/// The Catch2 v2 main shared by every thinkv test executable; test files contain no main.
///
/// Compiled twice (tests/CMakeLists.txt):
///  - thinkv_catch_main: Catch2's implementation and main(), once for all test executables;
///  - thinkv_catch_cuda_gate, with THINKV_TEST_CUDA_DEVICE_GATE: only thinkv_test_gate(), linked
///    into the GPU tests. Without a CUDA device it prints "no CUDA device: GPU tests skipped (...)"
///    and main() exits with 77, which ctest reports as skipped (SKIP_RETURN_CODE 77). Listing
///    requests (catch_discover_tests runs them at build time) need no device.
/// main() calls the gate through a weak reference, so the Catch implementation is compiled once.

/// ctest's SKIP_RETURN_CODE for tests that cannot run here (no GPU).
#define THINKV_TEST_SKIP_RETURN_CODE 77

#if defined(THINKV_TEST_CUDA_DEVICE_GATE)

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string_view>

namespace {

/// True when the command line only asks Catch for a listing or help, which needs no device.
bool is_listing_request(int argc, char* argv[]) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--list") || arg == "-l" || arg == "-t" || arg == "-h" || arg == "-?" || arg == "--help") {
      return true;
    }
  }
  return false;
}

}  // namespace

/// 0 when a CUDA device is usable (or none is needed); otherwise says why on stdout and returns
/// the skip code.
extern "C" int thinkv_test_gate(int argc, char* argv[]) {
  if (is_listing_request(argc, argv)) return 0;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    std::printf("no CUDA device: GPU tests skipped (cudaGetDeviceCount: %s: %s)\n", cudaGetErrorName(err),
                cudaGetErrorString(err));
    return THINKV_TEST_SKIP_RETURN_CODE;
  }
  if (count == 0) {
    std::printf("no CUDA device: GPU tests skipped (cudaGetDeviceCount found 0 devices)\n");
    return THINKV_TEST_SKIP_RETURN_CODE;
  }
  return 0;
}

#else  // Catch2 implementation and main

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

/// Defined only in executables that link thinkv_catch_cuda_gate (null elsewhere).
extern "C" int thinkv_test_gate(int argc, char* argv[]) __attribute__((weak));

int main(int argc, char* argv[]) {
  if (thinkv_test_gate != nullptr) {
    if (const int rc = thinkv_test_gate(argc, argv); rc != 0) return rc;
  }
  const int result = Catch::Session().run(argc, argv);
  // Catch returns the number of failed assertions (capped at 255); 77 of them must not read as
  // "skipped" to ctest.
  return result == THINKV_TEST_SKIP_RETURN_CODE ? 1 : result;
}

#endif
