// The CPU reference K-means selection (thinkv::kmeans_select, thinkv/tbe/kmeans.hpp) that
// CpuKvBackend runs for every TBE step-down: one segment of n = 2K post-RoPE keys shrinking to
// K (the retention levels 128 -> 64 -> 32 -> 16 -> 8 -> 4), head_dim 128, normal random keys (no
// planted clusters, so Lloyd's runs its iterations rather than converging at once), a fresh seed
// per selection. Time is per selection.
//   bench_kmeans_cpu --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "thinkv/tbe/kmeans.hpp"

namespace {

void BM_KmeansSelectCpu(benchmark::State& state) {
  const int k = static_cast<int>(state.range(0));
  const int n = 2 * k;
  const int d = static_cast<int>(state.range(1));
  constexpr int kSegments = 16;  // distinct segments, cycled
  std::mt19937 rng(12345);
  std::normal_distribution<float> normal;
  std::vector<float> keys(static_cast<std::size_t>(kSegments) * n * d);
  for (float& v : keys) v = normal(rng);
  std::uint64_t seed = 1;
  std::int64_t selections = 0;
  for (auto _ : state) {
    const float* seg = keys.data() + static_cast<std::size_t>(selections % kSegments) * n * d;
    thinkv::KmeansOptions opt;
    opt.seed = seed++;
    auto kept = thinkv::kmeans_select(seg, n, d, k, opt);
    benchmark::DoNotOptimize(kept.data());
    ++selections;
  }
  state.counters["segments"] = kSegments;
}

}  // namespace

BENCHMARK(BM_KmeansSelectCpu)
    ->ArgNames({"K", "head_dim"})
    ->Args({64, 128})
    ->Args({32, 128})
    ->Args({16, 128})
    ->Args({8, 128})
    ->Args({4, 128})
    ->Unit(benchmark::kMicrosecond);
