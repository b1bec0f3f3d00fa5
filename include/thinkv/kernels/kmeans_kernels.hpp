#pragma once
/// \file kmeans_kernels.hpp
/// Kernel API (thinkv::kernels): batched K-means segment selection on the GPU (TBE, docs/design.md)
/// with the exact rules of the CPU reference thinkv::kmeans_select (thinkv/tbe/kmeans.hpp).
///
/// Segment s (one stream's thought segment: its n post-RoPE keys, d = head_dim) gets exactly the
/// indices kmeans_select(points_s, n, d, k, {max_iterations, seed_s}) returns, bit for bit: the
/// same k-means++ draws (splitmix64), the same Lloyd iterations and early stop, the same
/// selection and tie rules. Every FP32 sum runs in the CPU's order with IEEE round-to-nearest
/// intrinsics (no FMA contraction, no fast-math), so this holds for any input, including
/// duplicate points, ties, overflowing distances and non-finite values.
///
/// One CTA per segment holds the segment's points and centres in shared memory; nothing is
/// allocated by the library and no workspace is needed. Launchers validate on the host and
/// return a cudaError_t.
///
/// Size classes. A launch's shared memory per CTA is sized for its layout (layout_points,
/// layout_k: by default max_points, max_k), so one launch mixing 128-point segments with small
/// ones runs every CTA at the large size (~106 KiB at head_dim 128: two CTAs per SM). A caller
/// with segments of mixed sizes may split them into launches by kmeans_size_class(n) (points <= 32,
/// <= 64, <= 128), each with segment_ids naming its segments (the arrays stay shared, addressed
/// with max_points / max_k) and a layout sized for its largest n and k: ~27 KiB per CTA for 32
/// points keeping 16, so eight CTAs share an SM (up to head_dim 128 the 32-point variant is
/// compiled for 8 CTAs per SM and the 64-point one for 4). The selections are the same bit for bit
/// whichever launch runs a segment. Launches in one stream run one after the other: each class's
/// launch ends with its slowest segment.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "thinkv/tbe/kmeans.hpp"

namespace thinkv::kernels {

/// Largest per-segment point capacity (max_points) one CTA holds: the default segment_len.
inline constexpr int kKmeansMaxPoints = 128;
/// Largest number of centres (max_k) one CTA holds.
inline constexpr int kKmeansMaxK = 64;

/// The size class of a launch whose layout holds num_points points: the point capacity of the
/// kernel variant that runs it (32, 64 or kKmeansMaxPoints). Segments grouped by this value can
/// share a launch whose layout_points is the group's largest n.
[[nodiscard]] constexpr int kmeans_size_class(int num_points) noexcept {
  return num_points <= 32 ? 32 : num_points <= 64 ? 64 : kKmeansMaxPoints;
}

/// num_segments independent selections in one launch (one CTA each). All pointers are device
/// pointers. CTA i selects for segment s = segment_ids[i] (s = i without segment_ids): it reads
/// points, num_points, k and seeds at s and writes row s of `kept`.
///
/// Limits (checked on the host, cudaErrorInvalidValue otherwise): head_dim 8, 32, 64, 128 or 256;
/// 1 <= max_points <= 128; 1 <= max_k <= 64; 0 <= layout_points <= max_points;
/// 0 <= layout_k <= max_k; max_iterations >= 0; num_segments >= 0.
/// Shared memory per CTA is kmeans_select_shared_bytes(p), set by the layout: ~200 KiB at
/// head_dim 256, 128 points, 64 centres (fits the 227 KiB of sm_90; ~106 KiB at head_dim 128,
/// two CTAs per SM; ~27 KiB at head_dim 128, 32 points, 16 centres). A launch needing more than the
/// device's opt-in maximum is refused (cudaErrorInvalidValue).
///
/// Device-side values: segment s is valid when 1 <= num_points[s] <= max_points and
/// 1 <= k[s] <= max_k, and fits the layout: num_points[s] <= layout_points and
/// k[s] <= layout_k. An invalid segment's row of `kept` is all -1 (other segments unaffected); a
/// valid one's row always starts with an index >= 0. Segment ids must be distinct indices into
/// the arrays (below, [num_segments, ...] then reads: as many entries as the largest id needs); a
/// negative id is skipped (its CTA writes nothing).
struct KmeansSelectParams {
  int num_segments = 0;
  int max_points = kKmeansMaxPoints;                    ///< row capacity per segment (1..128)
  int head_dim = 128;                                   ///< d: 8, 32, 64, 128 or 256
  int max_k = kKmeansMaxK;                              ///< columns of `kept` (1..64); every k[s] <= max_k
  int max_iterations = KmeansOptions{}.max_iterations;  ///< Lloyd iterations, as KmeansOptions
  const float* points = nullptr;                        ///< [num_segments, max_points, head_dim]; rows >= n unread
  const int* num_points = nullptr;                      ///< [num_segments] n of each segment
  const int* k = nullptr;                               ///< [num_segments] points to keep (k >= n keeps all n)
  /// [num_segments] KmeansOptions::seed of each segment; null: every segment uses `seed`.
  const std::uint64_t* seeds = nullptr;
  std::uint64_t seed = KmeansOptions{}.seed;
  /// [num_segments, max_k] output: the min(k, n) kept indices in ascending order, then -1.
  int* kept = nullptr;
  /// [num_segments] the segment of each CTA (see above); null: CTA i selects for segment i.
  const int* segment_ids = nullptr;
  /// Shared-memory layout of every CTA: room for layout_points points (0: max_points) and
  /// layout_k centres (0: max_k). Global arrays keep their max_points / max_k strides; a launch
  /// runs the kernel variant of kmeans_size_class(layout_points).
  int layout_points = 0;
  int layout_k = 0;
};

/// Checks the host-visible parameters without launching (cudaErrorInvalidValue on a bad shape,
/// limit or null pointer; pointers may be null when num_segments == 0).
[[nodiscard]] cudaError_t check_kmeans_select(const KmeansSelectParams& p) noexcept;

/// Dynamic shared memory one CTA of this launch uses (bytes); 0 when check_kmeans_select fails.
[[nodiscard]] std::size_t kmeans_select_shared_bytes(const KmeansSelectParams& p) noexcept;

/// Launches the batched selection on `stream` (one CTA of 256 threads per segment). Returns
/// cudaErrorInvalidValue for bad parameters or when the CTA's shared memory exceeds the current
/// device's opt-in limit (nothing launched); cudaSuccess without a launch when num_segments == 0;
/// else the launch status.
[[nodiscard]] cudaError_t launch_kmeans_select(const KmeansSelectParams& p, cudaStream_t stream) noexcept;

}  // namespace thinkv::kernels
