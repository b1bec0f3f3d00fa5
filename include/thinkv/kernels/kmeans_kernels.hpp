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

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "thinkv/tbe/kmeans.hpp"

namespace thinkv::kernels {

/// Largest per-segment point capacity (max_points) one CTA holds: the default segment_len.
inline constexpr int kKmeansMaxPoints = 128;
/// Largest number of centres (max_k) one CTA holds.
inline constexpr int kKmeansMaxK = 64;

/// num_segments independent selections in one launch. All pointers are device pointers.
///
/// Limits (checked on the host, cudaErrorInvalidValue otherwise): head_dim 8, 32, 64, 128 or 256;
/// 1 <= max_points <= 128; 1 <= max_k <= 64; max_iterations >= 0; num_segments >= 0.
/// Shared memory per CTA is kmeans_select_shared_bytes(p): ~200 KiB at head_dim 256,
/// max_points 128, max_k 64 (fits the 227 KiB of sm_90; ~106 KiB at head_dim 128, two CTAs per
/// SM). A launch needing more than the device's opt-in maximum is refused (cudaErrorInvalidValue).
///
/// Device-side values: segment s is valid when 1 <= num_points[s] <= max_points and
/// 1 <= k[s] <= max_k. An invalid segment's row of `kept` is all -1 (other segments unaffected).
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
