#pragma once
/// \file paged_attention.hpp
/// Kernel API (thinkv::kernels): single-token decode attention over the compressed paged cache,
/// read in place on the device (no gather), with the exact dequantization of the CPU backend
/// (CpuKvBackend::read_token) and the sparsity signal of thinkv/reference/attention.hpp.
///
/// PagedKvView is a plain, trivially copyable description of device memory laid out exactly as
/// the CPU backend and the block table lay theirs out (thinkv/paged/layout.hpp); it owns nothing.
/// tests/kernels/device_cache_upload.hpp builds one from a CPU PagedKvCache.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "thinkv/types.hpp"

namespace thinkv::kernels {

/// Device view of a compressed paged KV cache (FlashInfer paged_kv_t style). B = block_size,
/// D = head_dim, g = group_size (given in DecodeAttentionParams), P = kNumPrecisions (4),
/// N = total blocks (sum of pool_count), S = num_streams. All pointers are device pointers.
struct PagedKvView {
  int num_streams = 0;  ///< S
  /// Per precision pool (indexed by Precision): the pool's pages, pool_count[p] pages of
  /// page_bytes(p) = B * (2 * row_bytes(p) + value_scale_bytes(p)) bytes each, page i holding
  /// global block pool_base[p] + i, laid out as
  ///   [B x row_bytes(p)] K rows | [B x row_bytes(p)] V rows | [B x D/g] value scales (E4M3).
  /// BF16 pages (p = kBf16) have no value scales; rows are little-endian BF16. May be null when
  /// pool_count[p] == 0.
  const std::uint8_t* pages[kNumPrecisions] = {};  // [pool_count[p], page_bytes(p)]
  /// Global block ids: pool p owns [pool_base[p], pool_base[p] + pool_count[p]) (PoolMap).
  std::uint32_t pool_base[kNumPrecisions] = {};
  std::uint32_t pool_count[kNumPrecisions] = {};
  std::uint32_t total_blocks = 0;                ///< N
  const std::uint8_t* key_scales = nullptr;      // [records, D] E4M3 key scales per record
  const float* s2 = nullptr;                     // [S, 2 (K, V), P] second-level scales (0 = unset)
  const std::uint16_t* block_fill = nullptr;     // [N] written slots of each block (0..B)
  const std::uint64_t* evict_mask = nullptr;     // [N, (B + 63) / 64] bit i of word i/64 = slot evicted
  const std::uint32_t* slot_record = nullptr;    // [N * B] key-scale record of each slot (~0u: none)
  const std::int32_t* block_indptr = nullptr;    // [S + 1] CSR row pointers into block_indices
  const std::uint32_t* block_indices = nullptr;  // [block_indptr[S]] each stream's blocks, in order
  /// Optional [S]: stream s's blocks are block_indices[block_indptr[s] .. + block_count[s]) instead
  /// of .. block_indptr[s + 1] (fixed-capacity rows a device mirror updates in place; then
  /// block_indptr needs only S entries).
  const std::int32_t* block_count = nullptr;
  const std::uint16_t* staging = nullptr;      // [S, 2 (K, V), g, D] staged tokens, BF16 bits
  const std::int32_t* staged_count = nullptr;  // [S] staged tokens of each stream (0..g-1)
};

/// Decode attention of one (sequence, layer): KV head h attends the cache stream streams[h] and
/// serves query heads h * G .. h * G + G - 1, G = num_q_heads / num_kv_heads (GQA).
/// Tokens are taken in the CPU backend's order: the stream's blocks in list order, written and
/// not evicted slots in slot order, then its staged tokens.
struct DecodeAttentionParams {
  int num_q_heads = 0;                    ///< Hq, a multiple of num_kv_heads, Hq / Hkv <= kMaxQueryHeadsPerKv
  int num_kv_heads = 0;                   ///< Hkv
  int head_dim = 128;                     ///< D: 8, 32, 64, 128 or 256
  int group_size = 16;                    ///< g: 8, 16 or 32, dividing head_dim
  int block_size = 16;                    ///< B: 1..4096
  const std::int32_t* streams = nullptr;  // [Hkv] cache stream of each KV head (0..S-1)
  const float* q = nullptr;               // [Hq, D] queries (post-RoPE)
  float* out = nullptr;                   // [Hq, D] attention output
  float softmax_scale = 0.0f;             ///< 0 means 1/sqrt(D)
  /// Optional: per query head the share of attended tokens with s_j - m < kSparsityLogThreshold
  /// (reference/attention.hpp). The kernel needs no scratch for it: when asked, it makes a second
  /// pass over the keys once the row max m is final, recomputing each score bit for bit.
  float* sparsity = nullptr;  // [Hq] or null
  /// Optional with `sparsity` [Hkv] (device): KV head h's query rows get their sparsity only when
  /// sparsity_heads[h] != 0 (the others' are NaN and cost no pass over their keys); null: all.
  /// A batched step asks only for the sequences whose thought refreshes.
  const std::uint8_t* sparsity_heads = nullptr;
  /// Split-K (flash-decoding): each KV head's token list (its blocks' slot positions, then its
  /// staged tokens) is cut into num_splits chunks of whole tiles, one CTA each, whose partial
  /// (m, l, acc) go to `workspace`; a merge kernel combines them. 0 = automatic: the fewest
  /// chunks whose Hkv * num_splits CTAs fill whole waves of the CTAs the device keeps resident
  /// (occupancy API) to >= 90%, or, when max_positions is given (head_dim 64, 128, 256), the
  /// count that minimises waves x (CTA start-up + chunk length), plus the merge kernel when there
  /// is more than one chunk or sparsity is asked (plan_decode_splits_for_length in
  /// launch_plan.hpp). Chunks of a short stream may be empty (they cost one early exit).
  int num_splits = 0;
  /// Optional planning hint for num_splits = 0: the most slot positions of any KV head's stream in
  /// this launch (its blocks x block_size plus its staged tokens), when the caller knows it on the
  /// host (CudaKvBackend does); 0 = unknown. It only sets the number of chunks: any value gives the
  /// same results, a wrong one only costs time. Short streams then get fewer, longer chunks (the
  /// 32-layer step at batch 64 x 1,024 tokens: 1 split instead of 3; launch_plan.hpp says what
  /// was measured).
  long long max_positions = 0;
  /// Caller-provided device scratch of paged_decode_attention_workspace_size(p) bytes, 16-byte
  /// aligned; the kernels allocate nothing. Must not be shared by launches that may overlap.
  void* workspace = nullptr;
};

/// Largest Hq / Hkv the kernel serves (its shared-memory plan holds that many query rows).
inline constexpr int kMaxQueryHeadsPerKv = 8;

/// Number of chunks per KV head that a launch with these parameters uses (num_splits, or the
/// automatic choice from the current device's SM count when 0). At least 1, at most kMaxSplits.
[[nodiscard]] int paged_decode_attention_splits(const DecodeAttentionParams& p) noexcept;

/// Largest number of chunks per KV head.
inline constexpr int kMaxSplits = 256;

/// Bytes of device workspace a launch with these parameters needs (0 for invalid head counts).
/// Depends on num_q_heads, num_kv_heads, head_dim and the resolved number of splits, which
/// num_splits = 0 derives from max_positions and whether sparsity is asked: size it with the
/// parameters of the launch (a launch without sparsity never needs more than one with it).
[[nodiscard]] std::size_t paged_decode_attention_workspace_size(const DecodeAttentionParams& p) noexcept;

/// Checks parameters and view without launching: cudaErrorInvalidValue on an unsupported
/// head_dim / group_size / block_size, a bad head count, a non-finite or negative scale, a
/// num_splits outside 0..kMaxSplits, a negative max_positions, or a null pointer that the call needs (workspace
/// included). Device memory is not read (stream ids are checked by the kernel: an out-of-range stream, or one holding
/// no token, gives NaN output rows and NaN sparsity, where the CPU backend returns an error).
[[nodiscard]] cudaError_t check_paged_decode_attention(const PagedKvView& view,
                                                       const DecodeAttentionParams& p) noexcept;

/// Launches decode attention on `stream`: a partial kernel (grid splits x Hkv), a merge kernel
/// (one CTA per query head) and, when sparsity is asked, a counting pass over the same chunks
/// against the merged row max plus a tiny finishing kernel. With one chunk per KV head and no
/// sparsity the partial kernel writes the output itself (the same bits the merge would write)
/// and the merge is not launched. Returns
/// cudaErrorInvalidValue for bad parameters (nothing launched), else the launch status.
[[nodiscard]] cudaError_t launch_paged_decode_attention(const PagedKvView& view, const DecodeAttentionParams& p,
                                                        cudaStream_t stream) noexcept;

}  // namespace thinkv::kernels
