#pragma once
/// \file kmeans.hpp
/// K-means retention: which tokens a segment keeps when it shrinks to K. Deterministic for a given
/// seed, FP32 throughout, every loop in a fixed order so a GPU kernel can reproduce it exactly.
///
/// Algorithm (docs/design.md, "TBE"):
///  1. k-means++ initialisation driven by splitmix64(seed): the first centre is point
///     (r % n); each next centre is the first point whose running sum of D(x)^2 (FP32, index
///     order) exceeds u * total, u = (r >> 40) * 2^-24 in [0, 1); D(x) = distance to the nearest
///     chosen centre. When all remaining D(x) are 0 the lowest-index unchosen point is taken.
///  2. Lloyd iterations (at most max_iterations, 10 by default; stop early when no assignment
///     changes): assign each point to its nearest centre (squared L2, ties -> lower centre index);
///     each centre becomes the FP32 mean of its points summed in index order (an empty cluster
///     keeps its centre).
///  3. Selection: for centres 0..K-1 in order, keep the not-yet-kept point nearest to the centre
///     (ties -> lower index). Returns K distinct indices, ascending.
/// If K >= n every point is kept.

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

/// Squared L2 distance in FP32, channels summed in order.
inline float squared_distance(const float* a, const float* b, int d) noexcept {
  float s = 0.0f;
  for (int c = 0; c < d; ++c) {
    const float t = a[c] - b[c];
    s += t * t;
  }
  return s;
}

/// Selects k of the n points (rows of `points`, [n, d]) as described above.
inline std::vector<int> kmeans_select(const float* points, int n, int d, int k, const KmeansOptions& opt = {}) {
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
  int first = static_cast<int>(splitmix64(state) % static_cast<std::uint64_t>(n));
  for (int c = 0; c < k; ++c) {
    int pick = first;
    if (c > 0) {
      float total = 0.0f;
      for (int i = 0; i < n; ++i) total += dist[static_cast<std::size_t>(i)];
      pick = -1;
      if (total > 0.0f) {
        const float u = static_cast<float>(splitmix64(state) >> 40) * 0x1p-24f;
        const float target = u * total;
        float run = 0.0f;
        for (int i = 0; i < n; ++i) {
          run += dist[static_cast<std::size_t>(i)];
          if (run > target && !chosen[static_cast<std::size_t>(i)]) {
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
