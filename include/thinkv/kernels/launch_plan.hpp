#pragma once
/// \file launch_plan.hpp
/// Host-side launch planning of the decode-attention kernels, kept free of CUDA so that it is
/// unit-tested on any machine (tests/unit/test_launch_plan.cpp). paged_attention.cu feeds it the
/// device's resident CTAs (occupancy API x SMs).

#include <cstdint>

namespace thinkv::kernels {

/// Split-K plan: the fewest chunks per KV head, 1..max_splits, whose num_kv_heads * splits CTAs
/// fill the last wave of `resident_ctas` (CTAs the device keeps resident at once) to at least 90%:
/// waves = Hkv * s / R and the efficiency waves / ceil(waves) >= 0.9 (a grid of 1.3 waves takes
/// about as long as one of 2). When no s reaches 90%, the most efficient one (the fewest among
/// equals). Integer arithmetic only, so the choice is exact and the same on every host.
/// resident_ctas < 1 is treated as 1; num_kv_heads < 1 as 1; max_splits < 1 as 1.
[[nodiscard]] constexpr int plan_decode_splits(int num_kv_heads, long long resident_ctas, int max_splits) noexcept {
  const long long h = num_kv_heads > 0 ? num_kv_heads : 1;
  const long long r = resident_ctas > 0 ? resident_ctas : 1;
  const int smax = max_splits > 0 ? max_splits : 1;
  int best = 1;
  long long best_num = 0, best_den = 1;  // efficiency of `best` as a fraction
  for (int s = 1; s <= smax; ++s) {
    const long long ctas = h * s;
    const long long waves = (ctas + r - 1) / r;  // ceil
    // efficiency = ctas / (r * waves)
    if (10 * ctas >= 9 * r * waves) return s;
    if (ctas * best_den > best_num * (r * waves)) {
      best = s;
      best_num = ctas;
      best_den = r * waves;
    }
  }
  return best;
}

/// Start-up and wind-down of one main-pass CTA, in half-pieces of `piece` slot positions (12 = six
/// pieces of 128 positions): the stream-id, block-list, fill, mask and record loads that precede a
/// CTA's first window, the Q fragments, the write of its partial, and what a wave's ragged end
/// costs beyond them. Fitted to one sweep of forced split counts (1, 2, 3, 4, 6) over every
/// bench_paged_attention shape and the 32-layer step on an NVIDIA H100 (docs/perf-history.md,
/// 2026-12-07 split-plan section; bench/tools/split_sweep.py --fit): start-up 10-14 with a merge
/// of 2-5 loses 0.14% of the measured total against each row's best count, the earlier start-up
/// of 3 lost 1.65% (it cut the step's layers and batch 64 x 512 positions at 50% evicted into 2
/// chunks where one is 4-15% faster).
inline constexpr long long kSplitStartupHalfPieces = 12;

/// The merge kernel a launch of more than one chunk per KV head needs, in the same half-piece
/// units: a launch with one chunk and no sparsity skips it (the main pass writes the output).
/// Measured on the H200 (2026-11-30, 07:15 UTC): with it, batch 64 x 512 positions moved from 2
/// chunks to 1 (NVFP4 53.7 -> 47.4 µs) and batch 32 x 1,024 from 3 to 1 (38.1 -> 29.8 µs).
inline constexpr long long kSplitMergeHalfPieces = 2;

/// Split-K plan when the caller knows the longest stream of the launch (`positions`: its block
/// slot positions plus staged tokens; chunks are cut in whole pieces of `piece` positions). Each
/// CTA costs a start-up plus its chunk's pieces, CTAs run in waves of `resident_ctas`, so the plan
/// takes, among s in 1..min(max_splits, pieces), the fewest splits whose
///     cost(s) = ceil(Hkv * s / resident) x (kSplitStartupHalfPieces + 2 ceil(pieces / s))
///               + (s > 1 ? merge_half_pieces : 0)
/// is within 1/32 of the least cost (merge_half_pieces: kSplitMergeHalfPieces when one chunk
/// would skip the merge kernel, 0 when every plan needs it). Near-ties go to fewer, longer
/// chunks, because at many waves ceil() overstates the tail (CTAs of the next wave start as soon
/// as any ends).
/// Against plan_decode_splits (waves only) it cuts short streams into fewer, longer chunks: batch
/// 64 x 1,024 positions (the step's layer) gets 1 split instead of 3, batch 32 x 512 one instead
/// of 3, batch 1 x 512 four instead of 45; long streams on few KV heads still get many (batch 1 x
/// 32K: 43). positions < 1 (unknown) falls back to plan_decode_splits. Integer arithmetic only.
[[nodiscard]] constexpr int plan_decode_splits_for_length(int num_kv_heads, long long resident_ctas, int max_splits,
                                                          long long positions, long long piece,
                                                          long long merge_half_pieces = 0) noexcept {
  if (positions < 1) return plan_decode_splits(num_kv_heads, resident_ctas, max_splits);
  const long long h = num_kv_heads > 0 ? num_kv_heads : 1;
  const long long r = resident_ctas > 0 ? resident_ctas : 1;
  const long long pc = piece > 0 ? piece : 1;
  const long long pieces = (positions + pc - 1) / pc;
  const long long smax = max_splits > 0 ? (max_splits < pieces ? max_splits : pieces) : 1;
  auto cost = [&](long long s) {
    return (h * s + r - 1) / r * (kSplitStartupHalfPieces + 2 * ((pieces + s - 1) / s)) +
           (s > 1 ? merge_half_pieces : 0);
  };
  long long best = cost(1);
  for (long long s = 2; s <= smax; ++s) best = cost(s) < best ? cost(s) : best;
  for (long long s = 1; s < smax; ++s) {
    if (32 * cost(s) <= 33 * best) return static_cast<int>(s);
  }
  return static_cast<int>(smax);
}

}  // namespace thinkv::kernels
