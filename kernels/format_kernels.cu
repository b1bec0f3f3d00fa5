/// \file format_kernels.cu
/// Batched group quantization: one thread per group, calling the same THINKV_HD reference
/// functions as the CPU path, so codes and scales are bit-identical by construction (and tested
/// to be, on the GPU, by tests/kernels/test_format_kernels.cpp). Build without fast-math.

#include <cuda_runtime.h>

#include "thinkv/formats/group_quant.hpp"
#include "thinkv/kernels/format_kernels.hpp"

namespace thinkv::kernels {
namespace {

__global__ void quantize_groups_kernel(QuantizeGroupsParams p) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= p.num_groups) return;
  const float* x = p.x + static_cast<std::ptrdiff_t>(i) * p.group_stride;
  std::uint8_t* codes = p.codes + static_cast<std::ptrdiff_t>(i) * p.group_size;
  p.scales[i] = quantize_group(p.precision, x, p.element_stride, p.group_size, p.s2, codes, 1);
}

}  // namespace

cudaError_t check_quantize_groups(const QuantizeGroupsParams& p) noexcept {
  const bool precision_ok =
      p.precision == Precision::kFp8E4M3 || p.precision == Precision::kNvfp4 || p.precision == Precision::kTernary;
  if (!precision_ok || p.num_groups < 0 || p.group_size < 1 || p.group_size > kMaxGroupSize || p.element_stride < 1 ||
      p.group_stride < 0 || !(p.s2 > 0.0f)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_groups > 0 && (p.x == nullptr || p.codes == nullptr || p.scales == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t launch_quantize_groups(const QuantizeGroupsParams& p, cudaStream_t stream) noexcept {
  if (cudaError_t e = check_quantize_groups(p); e != cudaSuccess) return e;
  if (p.num_groups == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  const int blocks = (p.num_groups + kThreads - 1) / kThreads;
  quantize_groups_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace thinkv::kernels
