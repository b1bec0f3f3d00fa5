#pragma once
/// \file prefill_attention.hpp
/// Kernel API (thinkv::kernels): causal self-attention of a prompt (prefill), the GPU half of
/// PromptAttendArgs (thinkv/backend/batch.hpp). Query row (t, h) attends the prompt's keys and
/// values 0..t (0..prefix + t, see `prefix`) of KV head h / G (G = num_q_heads / num_kv_heads),
/// read in their element type (FP32, FP16 or BF16) and computed in FP32 with an online softmax:
///   s_j = (sum_c q[c] * k_j[c]) * scale,  out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m).
/// The CPU reference is CpuKvBackend::attend_prompt (reference::attend_tokens per prefix), which
/// sums in another order: outputs agree to FP32 rounding (tests/kernels/test_prefill_attention.cpp
/// states the tolerance), plus one rounding of the output type.
///
/// head_dim 32, 64, 128 and 256 take a tiled kernel (FlashAttention-style, FP32 FMA on CUDA cores,
/// no tensor cores): a CTA of 128 threads takes 64 query rows, the pairs (token, query head) of one
/// KV head's group (64 / G tokens of all its G query heads), loads its Q tile once, then walks the
/// KV head's key rows 0 .. prefix + (its last token) in tiles of BK = 32 rows (16 at head_dim 256)
/// loaded once into shared memory as FP32 for all 64 rows (with cp.async when K and V are FP32
/// with 16-byte aligned rows, the V tile arriving during the scores and the next K tile during
/// P V; with converting loads otherwise), and keeps per row a running max, sum and FP32 output
/// accumulator (online softmax, exp2 of log2-scaled scores). Shared memory per CTA:
/// 4 * (64 (d + 4) + BK (2d + 4) + 64 BK) bytes (73.5 KiB at d 128); the heaviest tiles (latest
/// tokens) launch first. A key past a query row's limit gets probability exactly 0, and rows past
/// the CTA's last visible key are never read (they may hold anything, NaN included). Its cost is
/// about 4 * tokens * (prefix + tokens / 2) * num_q_heads * head_dim FLOP at a few tens of TFLOP/s
/// on an H200 (bench/bench_prefill_attention.cu); K and V are read from L2 once per 64 / G tokens.
///
/// Every other head_dim (1..kPrefillMaxHeadDim) takes a simple kernel: one warp per (query token,
/// query head), keys taken 32 at a time (one per lane), each key and value row read from global
/// memory (L2) by every query that sees it, so its cost grows as tokens * (prefix + tokens) *
/// num_q_heads * head_dim at a much lower rate (docs/perf.md, "Prefill"). Nothing is allocated.

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

/// Launches the attention on `stream`, 128 threads per CTA: the tiled kernel (head_dim 32, 64,
/// 128, 256) on ceil(tokens * G / 64) * num_kv_heads CTAs with dynamic shared memory (its size
/// set with cudaFuncSetAttribute on each call), else (other head_dims, or a device granting less
/// shared memory per block) the simple kernel on grid (tokens, ceil(num_q_heads / 4)).
/// cudaErrorInvalidValue for bad parameters (nothing launched), else the launch status.
[[nodiscard]] cudaError_t launch_prefill_attention(const PrefillAttentionParams& p, cudaStream_t stream) noexcept;

}  // namespace thinkv::kernels
