#pragma once
/// \file quantize_append.hpp
/// Kernel API (thinkv::kernels): quantize-append. Flushes the full staging groups of many streams
/// in one launch: each group of g staged BF16 tokens is quantized at its thought's precision and
/// written, in place, into the (possibly reused, non-contiguous) slots the host's block table
/// planned, bit for bit as CpuKvBackend::commit writes them:
///  - keys per channel (a group = the g tokens of one channel), one E4M3 scale per channel into
///    the group's key-scale record;
///  - values per token (a group = g consecutive channels), D/g E4M3 scales into the slot's
///    value-scale area of the page;
///  - codes packed into the slot's K and V rows (docs/formats.md §5: lowest element in the lowest
///    bits; NVFP4 element 2j in the low nibble of byte j);
///  - BF16 groups (full-precision thoughts) copied as little-endian BF16 rows;
///  - the FP32 second-level scale s2 of (stream, K or V, precision), when still unset (0), fixed
///    from the group exactly as the CPU backend does: s2 = choose_stream_scale(P, amax over the
///    g x D staged values) if that amax is nonzero; an all-zero group leaves it unset.
///
/// Division of labour (docs/design.md, "Commit placement"): the HOST keeps all metadata. Per
/// flushed stream it runs BlockTable::plan_commit, turns the plan into a QuantizeAppendJob plus g
/// destination slot ids, and runs apply_commit (in stream order: a plan depends on the applies
/// before it, fresh blocks and records included). The kernel writes only data: page bytes of the
/// planned slots, the planned key-scale records, and unset s2 entries. It never touches block
/// fill, eviction masks, slot records, block lists or staged counts, and it does not clear the
/// staging buffer: after the launch the host marks the streams' staging empty (apply_commit
/// already did on the host; a device mirror of staged_count / block metadata, such as the one
/// PagedKvView reads, is the host's to update). The staging rows must stay unchanged until the
/// launch has completed.
///
/// Nothing is allocated: every pointer is caller-owned device memory.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "thinkv/types.hpp"

namespace thinkv::kernels {

/// Largest head_dim the kernel serves (= CacheConfig::kMaxHeadDim).
inline constexpr int kQuantizeAppendMaxHeadDim = 1024;
/// Largest block_size the kernel serves (= CacheConfig::kMaxBlockSize).
inline constexpr int kQuantizeAppendMaxBlockSize = 4096;
/// Largest num_streams the kernel serves (= CacheConfig::kMaxStreams).
inline constexpr int kQuantizeAppendMaxStreams = 1 << 24;

/// Mutable device view of the cache bytes a flush reads and writes: the same layout as
/// CpuKvBackend and PagedKvView (thinkv/paged/layout.hpp). D = head_dim, g = group_size,
/// B = block_size, P = kNumPrecisions (4), S = num_streams. All pointers are device pointers.
struct QuantizeAppendView {
  int num_streams = 0;  ///< S: 1..kQuantizeAppendMaxStreams
  int head_dim = 128;   ///< D: 8..kQuantizeAppendMaxHeadDim, a multiple of group_size
  int group_size = 16;  ///< g: 8, 16 or 32
  int block_size = 16;  ///< B: 1..kQuantizeAppendMaxBlockSize
  /// Per precision pool (indexed by Precision): pool_count[p] pages of page_bytes(p) =
  /// B * (2 * row_bytes(p) + value_scale_bytes(p)) bytes, page i holding global block
  /// pool_base[p] + i:  [B x row_bytes(p)] K rows | [B x row_bytes(p)] V rows | [B x D/g] value
  /// scales (E4M3; none for BF16). row_bytes(p) = D * bits(p) / 8. Null allowed when
  /// pool_count[p] == 0.
  std::uint8_t* pages[kNumPrecisions] = {};
  /// Global block ids: pool p owns [pool_base[p], pool_base[p] + pool_count[p]); the pools are
  /// consecutive in precision order (PoolMap), total_blocks = sum of pool_count, and
  /// total_blocks * B < 2^31 (CacheConfig's limit; slot ids are 32-bit).
  std::uint32_t pool_base[kNumPrecisions] = {};
  std::uint32_t pool_count[kNumPrecisions] = {};
  std::uint32_t total_blocks = 0;
  std::uint8_t* key_scales = nullptr;      ///< [num_records, D] E4M3 key scales per record
  std::uint32_t num_records = 0;           ///< records in key_scales (>= 1 when a quantized pool exists)
  float* s2 = nullptr;                     ///< [S, 2 (K, V), P] second-level scales, 0 = unset
  const std::uint16_t* staging = nullptr;  ///< [S, 2 (K, V), g, D] staged tokens, BF16 bits
};

/// One flushed staging group: stream `stream`'s g staged tokens (rows 0..g-1 of its staging
/// buffer), quantized at `precision`, staged token i going to the global slot dest_slots[job * g
/// + i]. Built from a CommitPlan: stream, precision, record = plan.record, and dest slot i =
/// plan.slots[i].block * B + plan.slots[i].slot.
struct QuantizeAppendJob {
  std::int32_t stream = -1;                ///< 0..S-1; at most one job per stream in a launch
  std::uint32_t record = 0xFFFFFFFFu;      ///< key-scale record (< num_records); ignored for kBf16
  Precision precision = Precision::kBf16;  ///< must have a non-empty pool
  std::uint8_t reserved[3] = {};
};
static_assert(std::is_trivially_copyable_v<QuantizeAppendJob> && sizeof(QuantizeAppendJob) == 12);

/// One launch: `num_jobs` groups of distinct streams.
struct QuantizeAppendParams {
  QuantizeAppendView cache{};
  int num_jobs = 0;                         ///< 0..cache.num_streams (0: nothing launched)
  const QuantizeAppendJob* jobs = nullptr;  ///< [num_jobs] device
  /// [num_jobs, g] device: global slot id (block * B + slot) of each staged token. Every slot must
  /// lie in a block of the job's precision pool; no slot may appear twice in a launch.
  const std::uint32_t* dest_slots = nullptr;
  /// Optional (null: not counted): incremented (atomically) by the number of groups whose E4M3
  /// scale saturates, counted exactly as CpuKvBackend counts BackendStats::scale_saturations
  /// (group_scale_saturates(P, group amax, s2) per key channel and per value group).
  unsigned long long* scale_saturations = nullptr;
  /// Optional (null: not counted): incremented once per job the kernel refused, writing nothing
  /// for it: stream out of range, precision unknown or with an empty pool, record >= num_records
  /// (quantized precisions), or a destination slot outside the precision's pool.
  unsigned int* rejected_jobs = nullptr;
  /// Optional (device, [2]): the launch takes jobs[job_range[0] .. job_range[1]) (and their
  /// dest_slots rows) instead of jobs[0 .. num_jobs); num_jobs is then the most it may take (the
  /// grid), the rest of the grid exits at once. A launch whose parameters must not change from
  /// call to call (a captured CUDA graph) reads its share of a batch's jobs this way.
  const std::uint32_t* job_range = nullptr;
};

/// Checks the parameters without launching and without reading device memory: returns
/// cudaErrorInvalidValue when num_streams, head_dim, group_size or block_size is outside the
/// limits above (head_dim a multiple of group_size), the pools are not consecutive or
/// total_blocks * block_size >= 2^31, a non-empty pool has no page pointer, staging is null, a
/// quantized pool exists without s2, key_scales or records, num_jobs is negative or above
/// num_streams, or jobs / dest_slots is null while num_jobs > 0. Job contents live in device memory
/// and are checked by the kernel (rejected_jobs) or, from a host copy, by
/// check_quantize_append_jobs.
[[nodiscard]] cudaError_t check_quantize_append(const QuantizeAppendParams& p) noexcept;

/// Host-side check of a launch's job list (host copies of jobs [num_jobs] and dest_slots
/// [num_jobs, g]; p.jobs / p.dest_slots are not read): everything the kernel rejects, plus what it
/// cannot see: a stream named twice, a destination slot named twice, a record named twice.
/// cudaErrorInvalidValue on any of these or when check_quantize_append fails; cudaErrorMemoryAllocation
/// when its host scratch (O(num_jobs * g)) cannot be allocated. A debugging aid; launches do not
/// call it.
[[nodiscard]] cudaError_t check_quantize_append_jobs(const QuantizeAppendParams& p, const QuantizeAppendJob* host_jobs,
                                                     const std::uint32_t* host_dest_slots) noexcept;

/// Launches quantize-append on `stream`: one CTA per (job, K or V), min(256, D rounded up to 32)
/// threads, no dynamic shared memory. Returns cudaErrorInvalidValue for bad parameters (nothing
/// launched), cudaSuccess without launching when num_jobs == 0, else the launch status. Jobs may
/// be in any order; the result does not depend on it.
[[nodiscard]] cudaError_t launch_quantize_append(const QuantizeAppendParams& p, cudaStream_t stream) noexcept;

}  // namespace thinkv::kernels
