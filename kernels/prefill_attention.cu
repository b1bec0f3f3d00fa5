/// \file prefill_attention.cu
/// Causal prompt attention (thinkv/kernels/prefill_attention.hpp).

#include "thinkv/kernels/prefill_attention.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstddef>

namespace thinkv::kernels {
namespace {

constexpr int kWarps = 4;  // query heads per CTA

__device__ __forceinline__ float load(const void* p, ElementType t, std::size_t i) {
  switch (t) {
    case ElementType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    case ElementType::kBf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store(void* p, ElementType t, std::size_t i, float x) {
  switch (t) {
    case ElementType::kF16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    case ElementType::kBf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

/// One warp per (query token t = blockIdx.x, query head). NC = channels per lane (D <= 32 * NC).
template <int NC>
__global__ void __launch_bounds__(kWarps * 32) prefill_attention_kernel(PrefillAttentionParams p, float scale) {
  __shared__ float qs[kWarps][kPrefillMaxHeadDim];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int t = blockIdx.x, h = blockIdx.y * kWarps + w;
  if (h >= p.num_q_heads) return;  // the whole warp: no barrier below spans warps
  const int d = p.head_dim, kvh = h / (p.num_q_heads / p.num_kv_heads);
  const std::size_t qrow = (static_cast<std::size_t>(t) * p.num_q_heads + h) * d;
  for (int c = lane; c < d; c += 32) qs[w][c] = load(p.q, p.q_type, qrow + c);
  __syncwarp();
  float m = -INFINITY, l = 0.0f, acc[NC];
#pragma unroll
  for (int i = 0; i < NC; ++i) acc[i] = 0.0f;
  const std::size_t row_stride =
      p.kv_row_stride > 0 ? static_cast<std::size_t>(p.kv_row_stride) : static_cast<std::size_t>(p.num_kv_heads) * d;
  const std::size_t head_off =
      static_cast<std::size_t>(kvh) *
      (p.kv_head_stride > 0 ? static_cast<std::size_t>(p.kv_head_stride) : static_cast<std::size_t>(d));
  const int last = (p.prefix != nullptr ? p.prefix[kvh] : 0) + t;  // rows 0..last are visible
  for (int base = 0; base <= last; base += 32) {
    const int j = base + lane;
    float s = -INFINITY;
    if (j <= last) {
      const std::size_t krow = static_cast<std::size_t>(j) * row_stride + head_off;
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot = fmaf(qs[w][c], load(p.k, p.k_type, krow + c), dot);
      s = dot * scale;
    }
    const float m_new = fmaxf(m, warp_max(s));  // finite: key `base` is always visible
    const float corr = expf(m - m_new);         // 0 on the first chunk (m = -inf)
    const float e = j <= last ? expf(s - m_new) : 0.0f;
    l = l * corr + warp_sum(e);
#pragma unroll
    for (int i = 0; i < NC; ++i) acc[i] *= corr;
    const int n = min(32, last - base + 1);
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xFFFFFFFFu, e, jj);
      const std::size_t vrow = static_cast<std::size_t>(base + jj) * row_stride + head_off;
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const int c = lane + 32 * i;
        if (c < d) acc[i] = fmaf(pj, load(p.v, p.v_type, vrow + c), acc[i]);
      }
    }
    m = m_new;
  }
#pragma unroll
  for (int i = 0; i < NC; ++i) {
    const int c = lane + 32 * i;
    if (c < d) store(p.out, p.out_type, qrow + c, acc[i] / l);
  }
}

template <int NC>
cudaError_t launch_nc(const PrefillAttentionParams& p, float scale, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.tokens), static_cast<unsigned>((p.num_q_heads + kWarps - 1) / kWarps));
  prefill_attention_kernel<NC><<<grid, kWarps * 32, 0, stream>>>(p, scale);
  return cudaGetLastError();
}

}  // namespace

cudaError_t check_prefill_attention(const PrefillAttentionParams& p) noexcept {
  if (p.tokens < 1 || p.num_kv_heads < 1 || p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.head_dim < 1 || p.head_dim > kPrefillMaxHeadDim || p.q == nullptr || p.k == nullptr || p.v == nullptr ||
      p.out == nullptr || !(p.softmax_scale >= 0.0f) || std::isinf(p.softmax_scale) || p.kv_row_stride < 0 ||
      p.kv_head_stride < 0 || static_cast<long long>(p.num_q_heads + kWarps - 1) / kWarps > 65535) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t launch_prefill_attention(const PrefillAttentionParams& p, cudaStream_t stream) noexcept {
  if (const cudaError_t e = check_prefill_attention(p); e != cudaSuccess) return e;
  const float scale = p.softmax_scale > 0.0f ? p.softmax_scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  const int nc = (p.head_dim + 31) / 32;
  if (nc <= 1) return launch_nc<1>(p, scale, stream);
  if (nc <= 2) return launch_nc<2>(p, scale, stream);
  if (nc <= 4) return launch_nc<4>(p, scale, stream);
  if (nc <= 8) return launch_nc<8>(p, scale, stream);
  if (nc <= 16) return launch_nc<16>(p, scale, stream);
  return launch_nc<32>(p, scale, stream);
}

}  // namespace thinkv::kernels
