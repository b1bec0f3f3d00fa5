#pragma once
// Shared by the GPU tests: CHECK_CUDA aborts the test binary with a message when a CUDA call
// fails; gpu_test_start() skips without a GPU (exit 77) and returns the run's seed.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>

#include "thinkv/kernels/format_kernels.hpp"

#define CHECK_CUDA(expr)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

/// Exits 77 (ctest: skipped) with a message when there is no CUDA device; otherwise returns the
/// run's seed (THINKV_TEST_SEED when set, else fresh) after printing it.
inline unsigned gpu_test_start() {
  if (thinkv::kernels::cuda_device_count() == 0) {
    std::printf("no CUDA device: GPU tests skipped (run bench/run_gpu_suite.sh on a GPU machine)\n");
    std::exit(77);
  }
  unsigned seed = std::random_device{}();
  if (const char* s = std::getenv("THINKV_TEST_SEED")) seed = static_cast<unsigned>(std::strtoul(s, nullptr, 10));
  std::printf("seed %u (THINKV_TEST_SEED=%u reproduces)\n", seed, seed);
  return seed;
}
