/// \file bench_position_evictor.cpp
/// The host cost of seq::PositionEvictor, what a cell-based runtime (the llama.cpp adapter) pays
/// per decoded token on top of its own decode: add_token in steady state over the token budget
/// (the classifier's refresh, the planner, K-means when a segment steps down), and a roll-back
/// (remove a tail of 16 positions, add them again: llama.cpp's seq_rm after a rejected draft), and
/// shift (llama.cpp's seq_add after a context shift: every stored key row of the moved positions
/// turned through the RoPE of delta positions; one shift per item).
/// Arguments: feature dim (floats per position: feature layers x KV heads x head_dim) and budget.
/// Llama-3-8B: 32 layers x 8 KV heads x 128 = 32,768 floats with every layer as features, 4,096
/// with 4 feature layers. Counters: positions evicted per token, bytes the evictor holds.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "thinkv/seq/position_evictor.hpp"

namespace {

using thinkv::seq::PositionEvictor;
using thinkv::seq::PositionEvictorConfig;

constexpr int kRows = 512;  // distinct random key rows, reused round robin

PositionEvictorConfig config_for(int dim, int budget) {
  PositionEvictorConfig c;
  c.num_layers = 1;
  c.num_kv_heads = dim / 128;  // dim is a multiple of 128
  c.head_dim = 128;
  c.token_budget = budget;
  c.segment_len = 128;
  c.pinned_prefix = 64;
  return c;
}

std::vector<float> random_rows(int dim) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> n01;
  std::vector<float> rows(static_cast<std::size_t>(kRows) * static_cast<std::size_t>(dim));
  for (float& x : rows) x = n01(rng);
  return rows;
}

std::span<const float> row(const std::vector<float>& rows, int dim, std::int64_t i) {
  return {rows.data() + static_cast<std::size_t>(i % kRows) * static_cast<std::size_t>(dim),
          static_cast<std::size_t>(dim)};
}

/// Adds positions next_position() .. `until` - 1 (the warm-up before the timed loop); false on an error.
bool add_until(PositionEvictor& ev, const std::vector<float>& rows, int dim, std::int32_t until) {
  std::vector<std::int32_t> evict;
  for (std::int32_t p = ev.next_position(); p < until; ++p) {
    evict.clear();
    if (!ev.add_token(p, row(rows, dim, p), {}, evict).is_ok()) return false;
  }
  return true;
}

void BM_AddTokenSteadyState(benchmark::State& state) {
  const int dim = static_cast<int>(state.range(0)), budget = static_cast<int>(state.range(1));
  const std::vector<float> rows = random_rows(dim);
  PositionEvictor ev(config_for(dim, budget));
  std::vector<std::int32_t> evict;
  // Warm up past the budget so every timed token is in steady state.
  if (!add_until(ev, rows, dim, 64 + budget + 256)) state.SkipWithError("add_token failed");
  const std::int64_t evicted0 = ev.stats().evicted;
  std::int64_t tokens = 0;
  for (auto _ : state) {
    evict.clear();
    const std::int32_t p = ev.next_position();
    if (!ev.add_token(p, row(rows, dim, p), {}, evict).is_ok()) state.SkipWithError("add_token failed");
    benchmark::DoNotOptimize(evict.data());
    ++tokens;
  }
  state.counters["evicted_per_token"] =
      static_cast<double>(ev.stats().evicted - evicted0) / static_cast<double>(std::max<std::int64_t>(1, tokens));
  state.counters["held_bytes"] = static_cast<double>(ev.held_bytes());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AddTokenSteadyState)
    ->ArgNames({"dim", "budget"})
    ->Args({4096, 1024})
    ->Args({32768, 1024})
    ->Args({4096, 2048});

void BM_RollBack16(benchmark::State& state) {
  const int dim = static_cast<int>(state.range(0)), budget = 1024;
  const std::vector<float> rows = random_rows(dim);
  PositionEvictor ev(config_for(dim, budget));
  if (!add_until(ev, rows, dim, 64 + budget + 200)) state.SkipWithError("add_token failed");
  for (auto _ : state) {
    const std::int32_t end = ev.next_position();
    if (!ev.remove(end - 16, -1).is_ok() || !add_until(ev, rows, dim, end)) state.SkipWithError("roll back failed");
  }
  state.SetItemsProcessed(state.iterations() * 16);
}
BENCHMARK(BM_RollBack16)->ArgNames({"dim"})->Arg(4096);

void BM_Shift(benchmark::State& state) {
  const int dim = static_cast<int>(state.range(0)), budget = 1024;
  const std::vector<float> rows = random_rows(dim);
  PositionEvictor ev(config_for(dim, budget));
  if (!add_until(ev, rows, dim, 64 + budget + 200)) state.SkipWithError("add_token failed");
  thinkv::RopeSpec rope;
  rope.theta = 500000.0;
  for (auto _ : state) {  // every position after the pinned prefix up 256 and back (two shifts)
    if (!ev.shift(64, -1, 256, &rope).is_ok() || !ev.shift(64 + 256, -1, -256, &rope).is_ok())
      state.SkipWithError("shift failed");
  }
  state.counters["moved_per_shift"] = static_cast<double>(ev.live_count() - 64);
  state.SetItemsProcessed(state.iterations() * 2);
}
BENCHMARK(BM_Shift)->ArgNames({"dim"})->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);

}  // namespace
