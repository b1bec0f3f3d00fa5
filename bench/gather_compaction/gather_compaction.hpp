#pragma once
/// \file gather_compaction.hpp
/// The baseline thinkv::bench::launch_gather_compaction: gather-compaction of the paged cache, the
/// copy that a token-level eviction method (R-KV style) must make after evicting tokens so that a
/// stream's live tokens are contiguous again. It lives in bench/, built only for the benchmarks and
/// their tests (library thinkv_gather_compaction), and is not part of thinkv::kernels.
///
/// ThinKV does NOT use this kernel: Continuous Thinking only marks evicted slots in the eviction
/// mask and later overwrites them in place (PagedKvCache::moved_bytes() stays 0). It exists so
/// that bench/bench_gather_compaction.cu can measure the cost that ThinKV avoids, on the very same
/// page layout (PagedKvView, thinkv/kernels/paged_attention.hpp).
///
/// What it does, per listed stream: its live slots (written, slot < block_fill, and not evicted),
/// in the attention's token order (blocks in list order, slots in slot order), are copied to
/// slots 0, 1, ... of the caller's destination blocks (B slots each, in list order): K row bytes,
/// V row bytes and value-scale bytes of the page, and the slot's key-scale record id
/// (slot_record; the records themselves are shared and not copied). The kernel also writes the
/// metadata of every listed destination block: block_fill = tokens it received (0..B), eviction
/// mask = 0, slot_record = ~0u for its slots past the fill. It does not touch the source blocks,
/// the block lists, the staging buffers or the key-scale records: swapping the stream's block list
/// for the destination list and freeing the source blocks is the caller's (host) work.
///
/// Bytes moved, per live token copied (rb = row_bytes(p) = ceil(D * bits(p) / 8),
/// vs = value_scale_bytes(p) = D / g, 0 for BF16): read 2 rb + vs + 4 (slot_record), written the
/// same. Per source block: read its list entry (4), block_fill (2) and eviction mask
/// (8 ceil(B / 64)) once per CTA of its stream (L2 hits after the first). Per destination block:
/// read its list entry (4), write block_fill (2), the mask (8 ceil(B / 64)) and 4 bytes per
/// slot past its fill. For Llama-3-8B shapes (D = 128, g = 16): 2 x 516 bytes per BF16 token,
/// 2 x 140 per NVFP4 token, 2 x 76 per ternary token.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/types.hpp"

namespace thinkv::bench {

using kernels::PagedKvView;

/// Largest number of CTAs per listed stream.
inline constexpr int kMaxGatherSplits = 256;

/// Parameters of one gather-compaction launch. All pointers are device pointers.
///
/// Requirements the host cannot check (device memory is not read on the host):
///  - all source blocks of a listed stream lie in one precision pool, and its destination blocks
///    in the same pool. A stream that breaks this (or names a block id >= total_blocks, or is out
///    of range 0..src.num_streams-1) is skipped by the kernel: nothing of it is written (neither
///    pages nor destination metadata) and live_counts (when given) gets -1 for it;
///  - destination blocks are distinct, and none is a source block of any stream of the launch
///    (the copy is not in place; the destination buffers may alias the source ones, i.e. the
///    destination blocks may be free blocks of the same cache);
///  - a stream is listed at most once.
/// A destination list too short for a stream's live tokens receives the first
/// (its blocks x B) of them; live_counts tells the caller.
struct GatherCompactionParams {
  /// The cache read: pages, block_fill, evict_mask, slot_record, block_indptr and block_indices
  /// (and the pool map) are used; key_scales, s2, staging and staged_count are not read.
  PagedKvView src{};
  int head_dim = 128;                     ///< D: 1..1024, a multiple of group_size
  int group_size = 16;                    ///< g: 8, 16 or 32
  int block_size = 16;                    ///< B: 1..4096
  int num_streams = 0;                    ///< streams compacted by this launch (entries of `streams`), >= 1
  const std::int32_t* streams = nullptr;  // [num_streams] stream ids of src (0..S-1)
  /// Destination blocks of streams[i]: dst_indices[dst_indptr[i] .. dst_indptr[i + 1]), global
  /// block ids under src's pool map (CSR indexed by position in `streams`, not by stream id).
  const std::int32_t* dst_indptr = nullptr;    // [num_streams + 1]
  const std::uint32_t* dst_indices = nullptr;  // [dst_indptr[num_streams]]
  /// Destination pages per pool, laid out like src.pages (same pool sizes; may be the same
  /// buffers). May be null when src.pool_count[p] == 0.
  std::uint8_t* dst_pages[kNumPrecisions] = {};
  std::uint16_t* dst_block_fill = nullptr;   // [N] (may be src.block_fill's buffer)
  std::uint64_t* dst_evict_mask = nullptr;   // [N, (B + 63) / 64]
  std::uint32_t* dst_slot_record = nullptr;  // [N * B]
  /// Optional: live tokens found in each listed stream (even beyond the destination capacity),
  /// or -1 for a stream skipped as invalid (see above).
  std::int32_t* live_counts = nullptr;  // [num_streams] or null
  /// CTAs per listed stream; 0 = automatic (about one wave: 8 CTAs per SM in all). A stream's block list is
  /// cut into this many chunks of whole blocks; each CTA counts the live slots of the whole list
  /// (to place its chunk and to size the destination), then copies its chunk.
  int num_splits = 0;
};

/// CTAs per listed stream that a launch with these parameters uses (num_splits, or the automatic
/// choice from the current device's SM count when 0); 1..kMaxGatherSplits.
[[nodiscard]] int gather_compaction_splits(const GatherCompactionParams& p) noexcept;

/// Checks parameters without launching: cudaErrorInvalidValue on an unsupported head_dim /
/// group_size / block_size, num_streams < 1, num_splits outside 0..kMaxGatherSplits, a pool map
/// that is not consecutive (PoolMap) or holds 2^31 slots or more, or a null pointer the call
/// needs (source or destination pages of a non-empty pool, metadata, block lists, streams,
/// destination CSR). Needs no workspace: nothing to allocate. Device memory is not read.
[[nodiscard]] cudaError_t check_gather_compaction(const GatherCompactionParams& p) noexcept;

/// Launches the compaction on `stream`: one kernel, grid (num_streams, splits). Returns
/// cudaErrorInvalidValue for bad parameters (nothing launched), else the launch status.
[[nodiscard]] cudaError_t launch_gather_compaction(const GatherCompactionParams& p, cudaStream_t stream) noexcept;

}  // namespace thinkv::bench
