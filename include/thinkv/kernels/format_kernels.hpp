#pragma once
/// \file format_kernels.hpp
/// Kernel API (thinkv::kernels): batched group quantization on the GPU with the exact rules of
/// the CPU reference (thinkv/formats/group_quant.hpp). Launchers validate on the host and return
/// a cudaError_t; nothing is allocated behind the caller's back.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "thinkv/types.hpp"

namespace thinkv::kernels {

/// Quantizes num_groups groups of group_size floats. Group i, element j is read from
/// x[i * group_stride + j * element_stride]. All pointers are device pointers.
struct QuantizeGroupsParams {
  Precision precision = Precision::kNvfp4;  ///< kFp8E4M3, kNvfp4 or kTernary
  int num_groups = 0;
  int group_size = 16;             ///< 1..64
  int element_stride = 1;          ///< floats between consecutive elements of a group
  int group_stride = 16;           ///< floats between the first elements of consecutive groups
  float s2 = 1.0f;                 ///< second-level scale (power of two, > 0)
  const float* x = nullptr;        ///< [see strides] input
  std::uint8_t* codes = nullptr;   ///< [num_groups, group_size] unpacked element codes
  std::uint8_t* scales = nullptr;  ///< [num_groups] E4M3 group scale codes
};

/// Checks the parameters without launching (cudaErrorInvalidValue on a bad shape or pointer).
[[nodiscard]] cudaError_t check_quantize_groups(const QuantizeGroupsParams& p) noexcept;

/// Launches the batched group quantizer on `stream`. Returns cudaErrorInvalidValue for bad
/// parameters (nothing launched), else the launch status.
[[nodiscard]] cudaError_t launch_quantize_groups(const QuantizeGroupsParams& p, cudaStream_t stream) noexcept;

/// Number of CUDA devices visible (0 when none or when the driver is missing); never fails.
[[nodiscard]] int cuda_device_count() noexcept;

}  // namespace thinkv::kernels
