#pragma once
/// \file kmeans.hpp
/// K-means retention: which tokens a segment keeps when it shrinks to K. Deterministic for a given
/// seed, FP32 throughout, every loop in a fixed order so a GPU kernel can reproduce it exactly.
///
/// Algorithm (docs/design.md, "TBE"):
///  1. k-means++ initialisation driven by splitmix64(seed): the first centre is point
///     (r % n); each next centre is the first point i (ascending) not yet chosen whose prefix sum
///     R_i of D(x)^2 exceeds u * R_{n-1}, u = (r >> 40) * 2^-24 in [0, 1); D(x) = distance to
///     the nearest chosen centre. When R_{n-1} is 0 (all remaining D(x) are 0), or no point
///     qualifies, the lowest-index unchosen point is taken. R is the blocked scan below.
///  2. Lloyd iterations (at most max_iterations, 10 by default; stop early when no assignment
///     changes): assign each point to its nearest centre (squared L2, ties -> lower centre index);
///     each centre becomes the FP32 mean of its points summed in index order (an empty cluster
///     keeps its centre).
///  3. Selection: for centres 0..K-1 in order, keep the not-yet-kept point nearest to the centre
///     (ties -> lower index). Returns K distinct indices, ascending.
/// If K >= n every point is kept.
///
/// The two FP32 sums are defined in the order a GPU runs them in parallel (each step rounded, no
/// FMA), not as one left-to-right chain, so neither is a long dependent chain on either side:
///  - squared_distance(a, b, d): eight partial sums, P_j = sum over channels c = j, j + 8, ... < d
///    (ascending) of (a_c - b_c)^2, each term t = a_c - b_c, P_j = P_j + t * t; then
///    ((P_0 + P_4) + (P_2 + P_6)) + ((P_1 + P_5) + (P_3 + P_7)).
///  - prefix sums R_i of v_i = D(x_i)^2 (kmeanspp_prefix_sums): the points in tiles of 128, a tile
///    in 32 lanes of 4 consecutive points (v_i = 0 past n). Within a lane, a_i = running sum of
///    its points in order; lane sums s_L = a of its last point; X = the inclusive Hillis-Steele
///    scan of s over the tile's 32 lanes (for off = 1, 2, 4, 8, 16: X_L = X_{L-off} + X_L where
///    L >= off, all lanes at once); E_L = X_{L-1} (E_0 = 0); tile base B_0 = 0, B_{w+1} = B_w +
///    X_31 of tile w. Then R_i = (B_w + E_L) + a_i. Every v_i >= +0, so the zero terms change
///    nothing.
///
/// Neither compiler contraction nor fast-math may touch these sums: the functions below are
/// compiled with FP contraction off under GCC and Clang (a caller's -mfma with
/// -ffp-contract=fast would otherwise fuse t * t + P_j into an FMA and change the rounding).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace thinkv {

struct KmeansOptions {
  int max_iterations = 10;
  std::uint64_t seed = 0x7468696E6B76ull;  // "thinkv"
};

/// splitmix64: a tiny, well-mixed, reproducible generator (host and device).
constexpr std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FP contraction off for the functions of this header (see the file comment). GCC has no
// STDC FP_CONTRACT pragma; its optimize attribute is set on every function below (they inline
// into each other, which needs equal options). nvcc's front end sees none of it (device code
// uses the _rn intrinsics; a CUDA TU's host code is compiled without FMA by default).
#if defined(__clang__)
#define THINKV_KMEANS_NO_CONTRACT_FN
#define THINKV_KMEANS_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__) && !defined(__CUDACC__) && !defined(__INTEL_LLVM_COMPILER)
#define THINKV_KMEANS_NO_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#define THINKV_KMEANS_NO_CONTRACT_BODY
#else
#define THINKV_KMEANS_NO_CONTRACT_FN
#define THINKV_KMEANS_NO_CONTRACT_BODY
#endif

/// Squared L2 distance in FP32: eight partial sums over channels c = j mod 8, combined as a
/// tree (see the file comment).
THINKV_KMEANS_NO_CONTRACT_FN inline float squared_distance(const float* a, const float* b, int d) noexcept {
  THINKV_KMEANS_NO_CONTRACT_BODY
  float p[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int c = 0;
  for (; c + 8 <= d; c += 8) {
    for (int j = 0; j < 8; ++j) {
      const float t = a[c + j] - b[c + j];
      const float sq = t * t;
      p[j] = p[j] + sq;
    }
  }
  for (int j = 0; c + j < d; ++j) {
    const float t = a[c + j] - b[c + j];
    const float sq = t * t;
    p[j] = p[j] + sq;
  }
  const float r0 = (p[0] + p[4]) + (p[2] + p[6]);
  const float r1 = (p[1] + p[5]) + (p[3] + p[7]);
  return r0 + r1;
}

/// k-means++'s prefix sums R[0..n) of v[0..n) (all >= +0) as the blocked scan of the file comment.
THINKV_KMEANS_NO_CONTRACT_FN inline void kmeanspp_prefix_sums(const float* v, int n, float* out) noexcept {
  THINKV_KMEANS_NO_CONTRACT_BODY
  float base = 0.0f;  // B_w
  for (int t0 = 0; t0 < n; t0 += 128) {
    float a[128];  // lane L: a[4L .. 4L + 3]
    float x[32];
    for (int lane = 0; lane < 32; ++lane) {
      float run = 0.0f;
      for (int q = 0; q < 4; ++q) {
        const int i = t0 + 4 * lane + q;
        run = run + (i < n ? v[i] : 0.0f);
        a[4 * lane + q] = run;
      }
      x[lane] = run;
    }
    for (int off = 1; off < 32; off <<= 1) {
      for (int lane = 31; lane >= off; --lane) x[lane] = x[lane - off] + x[lane];  // reads the previous round's x
    }
    for (int lane = 0; lane < 32; ++lane) {
      const float lane_base = base + (lane > 0 ? x[lane - 1] : 0.0f);
      for (int q = 0; q < 4; ++q) {
        const int i = t0 + 4 * lane + q;
        if (i < n) out[i] = lane_base + a[4 * lane + q];
      }
    }
    base = base + x[31];
  }
}

/// Selects k of the n points (rows of `points`, [n, d]) as described above.
THINKV_KMEANS_NO_CONTRACT_FN inline std::vector<int> kmeans_select(const float* points, int n, int d, int k,
                                                                   const KmeansOptions& opt = {}) {
  THINKV_KMEANS_NO_CONTRACT_BODY
  std::vector<int> kept;
  if (n <= 0 || k <= 0) return kept;
  if (k >= n) {
    kept.resize(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) kept[static_cast<std::size_t>(i)] = i;
    return kept;
  }
  const auto row = [&](int i) { return points + static_cast<std::ptrdiff_t>(i) * d; };
  std::uint64_t state = opt.seed;
  // 1. k-means++ initialisation
  std::vector<float> centres(static_cast<std::size_t>(k) * d);
  std::vector<float> dist(static_cast<std::size_t>(n), std::numeric_limits<float>::infinity());
  std::vector<char> chosen(static_cast<std::size_t>(n), 0);
  std::vector<float> prefix(static_cast<std::size_t>(n));
  int first = static_cast<int>(splitmix64(state) % static_cast<std::uint64_t>(n));
  for (int c = 0; c < k; ++c) {
    int pick = first;
    if (c > 0) {
      kmeanspp_prefix_sums(dist.data(), n, prefix.data());
      const float total = prefix[static_cast<std::size_t>(n - 1)];
      pick = -1;
      if (total > 0.0f) {
        const float u = static_cast<float>(splitmix64(state) >> 40) * 0x1p-24f;
        const float target = u * total;
        for (int i = 0; i < n; ++i) {
          if (prefix[static_cast<std::size_t>(i)] > target && !chosen[static_cast<std::size_t>(i)]) {
            pick = i;
            break;
          }
        }
      }
      if (pick < 0) {  // all distances 0 (duplicates) or rounding: lowest unchosen index
        for (int i = 0; i < n; ++i) {
          if (!chosen[static_cast<std::size_t>(i)]) {
            pick = i;
            break;
          }
        }
      }
    }
    chosen[static_cast<std::size_t>(pick)] = 1;
    std::copy_n(row(pick), d, centres.begin() + static_cast<std::ptrdiff_t>(c) * d);
    for (int i = 0; i < n; ++i) {
      const float di = squared_distance(row(i), centres.data() + static_cast<std::ptrdiff_t>(c) * d, d);
      dist[static_cast<std::size_t>(i)] = std::min(dist[static_cast<std::size_t>(i)], di);
    }
  }
  // 2. Lloyd iterations
  std::vector<int> assign(static_cast<std::size_t>(n), -1);
  std::vector<float> sums(centres.size());
  std::vector<int> counts(static_cast<std::size_t>(k));
  for (int it = 0; it < opt.max_iterations; ++it) {
    bool changed = false;
    for (int i = 0; i < n; ++i) {
      int best = 0;
      float best_d = squared_distance(row(i), centres.data(), d);
      for (int c = 1; c < k; ++c) {
        const float dc = squared_distance(row(i), centres.data() + static_cast<std::ptrdiff_t>(c) * d, d);
        if (dc < best_d) {
          best_d = dc;
          best = c;
        }
      }
      if (assign[static_cast<std::size_t>(i)] != best) {
        assign[static_cast<std::size_t>(i)] = best;
        changed = true;
      }
    }
    if (!changed) break;
    std::fill(sums.begin(), sums.end(), 0.0f);
    std::fill(counts.begin(), counts.end(), 0);
    for (int i = 0; i < n; ++i) {
      const int c = assign[static_cast<std::size_t>(i)];
      ++counts[static_cast<std::size_t>(c)];
      for (int j = 0; j < d; ++j) sums[static_cast<std::size_t>(c * d + j)] += row(i)[j];
    }
    for (int c = 0; c < k; ++c) {
      if (counts[static_cast<std::size_t>(c)] == 0) continue;
      const float count_f = static_cast<float>(counts[static_cast<std::size_t>(c)]);
      for (int j = 0; j < d; ++j) {
        centres[static_cast<std::size_t>(c * d + j)] = sums[static_cast<std::size_t>(c * d + j)] / count_f;
      }
    }
  }
  // 3. Selection: nearest distinct point per centre
  std::vector<char> taken(static_cast<std::size_t>(n), 0);
  kept.reserve(static_cast<std::size_t>(k));
  for (int c = 0; c < k; ++c) {
    int best = -1;
    float best_d = std::numeric_limits<float>::infinity();
    for (int i = 0; i < n; ++i) {
      if (taken[static_cast<std::size_t>(i)]) continue;
      const float di = squared_distance(row(i), centres.data() + static_cast<std::ptrdiff_t>(c) * d, d);
      if (best < 0 || di < best_d) {
        best_d = di;
        best = i;
      }
    }
    taken[static_cast<std::size_t>(best)] = 1;
    kept.push_back(best);
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}

}  // namespace thinkv

#undef THINKV_KMEANS_NO_CONTRACT_FN
#undef THINKV_KMEANS_NO_CONTRACT_BODY
