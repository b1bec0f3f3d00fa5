#pragma once
/// \file prefill_attention.hpp
/// Kernel API (thinkv::kernels): causal self-attention of a prompt (prefill), the GPU half of
/// PromptAttendArgs (thinkv/backend/batch.hpp). Query row (t, h) attends the prompt's keys and
/// values 0..t of KV head h / G (G = num_q_heads / num_kv_heads), read in their element type
/// (FP32, FP16 or BF16) and computed in FP32 with an online softmax:
///   s_j = (sum_c q[c] * k_j[c]) * scale,  out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m).
/// The CPU reference is CpuKvBackend::attend_prompt (reference::attend_tokens per prefix), which
/// sums in another order: outputs agree to FP32 rounding (tests/kernels/test_prefill_attention.cu
/// states the tolerance), plus one rounding of the output type.
///
/// A simple kernel, not a tuned one: one warp per (query token, query head), keys taken 32 at a
/// time (one per lane), each key and value row read from global memory (L2) by every query that
/// sees it, so the cost grows as tokens^2 * num_q_heads * head_dim (docs/perf.md, "Prefill").
/// With a prefix (a continued chunk) the cost is tokens * (prefix + tokens) * num_q_heads *
/// head_dim. Nothing is allocated.

#include <cuda_runtime_api.h>

#include "thinkv/backend/batch.hpp"

namespace thinkv::kernels {

/// Largest head_dim the kernel serves.
inline constexpr int kPrefillMaxHeadDim = 1024;

struct PrefillAttentionParams {
  int tokens = 0;           ///< prompt length, >= 1
  int num_q_heads = 0;      ///< a multiple of num_kv_heads
  int num_kv_heads = 0;     ///< >= 1
  int head_dim = 0;         ///< 1..kPrefillMaxHeadDim
  const void* q = nullptr;  ///< [tokens, num_q_heads, head_dim] device, of q_type
  const void* k = nullptr;  ///< [tokens, num_kv_heads, head_dim] device, of k_type
  const void* v = nullptr;  ///< [tokens, num_kv_heads, head_dim] device, of v_type
  void* out = nullptr;      ///< [tokens, num_q_heads, head_dim] device, of out_type
  ElementType q_type = ElementType::kF32;
  ElementType k_type = ElementType::kF32;
  ElementType v_type = ElementType::kF32;
  ElementType out_type = ElementType::kF32;
  float softmax_scale = 0.0f;  ///< 0 means 1/sqrt(head_dim)
  /// A chunk continuing a sequence (BasicThinKvCache::begin_prompt at P > 0): prefix[h] (device,
  /// one per KV head) rows of k and v precede KV head h's chunk rows, and query row (t, h) attends
  /// rows 0 .. prefix[h / G] + t of its KV head. nullptr: no prefix (a first prompt).
  const int* prefix = nullptr;
  /// Element strides of k and v: row j of KV head h starts at j * kv_row_stride + h *
  /// kv_head_stride. 0 means the packed prompt layout [tokens, num_kv_heads, head_dim]
  /// (num_kv_heads * head_dim and head_dim).
  long long kv_row_stride = 0;
  long long kv_head_stride = 0;
};

/// cudaErrorInvalidValue on a shape outside the limits above, a null pointer, a negative or
/// non-finite scale, or a negative stride; device memory is not read (prefix values included:
/// the caller sizes k and v for them).
[[nodiscard]] cudaError_t check_prefill_attention(const PrefillAttentionParams& p) noexcept;

/// Launches the attention on `stream`: grid (tokens, ceil(num_q_heads / 4)), 128 threads.
/// cudaErrorInvalidValue for bad parameters (nothing launched), else the launch status.
[[nodiscard]] cudaError_t launch_prefill_attention(const PrefillAttentionParams& p, cudaStream_t stream) noexcept;

}  // namespace thinkv::kernels
