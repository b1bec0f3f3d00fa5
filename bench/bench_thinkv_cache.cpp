// ThinKvCache over long decode runs with shifting thought types (CPU reference backend):
// decode throughput of the cache itself, and the memory it holds. Counters:
//   live          live tokens per stream at the end (budget-bounded in tbe/thinkv modes)
//   hole_share    evicted-but-held slots / (held slots written), at the end of the run
//   hole_peak     the largest hole share seen at any step
//   ratio         physical bytes held / FullKV FP16 bytes of the live tokens
//   ratio_seq     physical bytes held / FullKV FP16 bytes of every decoded position (the paper's
//                 baseline: what an uncompressed cache would hold at the end of the run)
//   evict_per_step, reused_per_token
// Thought types come from a calibrated classifier fed by the real sparsity of the attention:
// every 128-token interval draws a query sharpness (flat, medium, peaked), so R, E and T segments
// alternate at random, as they do in a reasoning trace.
//   bench_thinkv_cache --benchmark_filter='ThinKv/.*' --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "thinkv/thinkv_cache.hpp"

namespace {

// One long decode under policy set P (a TbqCache, TbeCache or ThinKvCache).
template <class P>
void BM_ThinKvLongRun(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  const int tokens = static_cast<int>(state.range(1));
  thinkv::ThinKvConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 8;
  c.head_dim = 64;
  c.max_tokens = tokens;
  c.token_budget = budget;
  P policy;
  policy.classifier = thinkv::ThoughtClassifier::three_types(0.3f, 0.6f, {0, 1}, 128, 2);
  double hole_share = 0, hole_peak = 0, ratio = 0, ratio_seq = 0, live = 0, evict_calls = 0, reused = 0;
  double alloc_seq = 0, alloc_peak_seq = 0;
  for (auto _ : state) {
    thinkv::BasicThinKvCache<P> cache(c, policy);
    std::mt19937 rng(12345);
    std::normal_distribution<float> normal;
    const std::size_t kv = static_cast<std::size_t>(c.num_kv_heads * c.head_dim);
    std::vector<float> k(kv), v(kv), q(static_cast<std::size_t>(c.num_q_heads * c.head_dim)), out(q.size());
    float sharp = 1.0f;
    hole_peak = 0;
    alloc_peak_seq = 0;
    for (int t = 0; t < tokens; ++t) {
      if (t % 128 == 0) sharp = std::vector<float>{0.0f, 0.9f, 4.0f}[rng() % 3];
      if (!cache.begin_token(0).is_ok()) state.SkipWithError("begin_token failed");
      for (int l = 0; l < c.num_layers; ++l) {
        for (auto& x : k) x = normal(rng);
        for (auto& x : v) x = normal(rng);
        for (auto& x : q) x = normal(rng) * sharp;
        if (!cache.append(0, l, k, v).is_ok() || !cache.attend(0, l, q, out).is_ok()) {
          state.SkipWithError("append/attend failed");
        }
      }
      if (!cache.end_token(0).is_ok()) state.SkipWithError("end_token failed");
      alloc_peak_seq = std::max(alloc_peak_seq, static_cast<double>(cache.allocated_bytes()));
      if (t % 64 == 63) {
        const auto m = cache.memory();
        const double held = static_cast<double>(m.live_tokens - m.staged_tokens + m.hole_slots);
        if (held > 0) hole_peak = std::max(hole_peak, static_cast<double>(m.hole_slots) / held);
      }
    }
    const auto m = cache.memory();
    const double held = static_cast<double>(m.live_tokens - m.staged_tokens + m.hole_slots);
    hole_share = held > 0 ? static_cast<double>(m.hole_slots) / held : 0.0;
    ratio = m.ratio();
    ratio_seq = static_cast<double>(m.physical_bytes()) / static_cast<double>(cache.fullkv_sequence_bytes(0));
    alloc_seq = static_cast<double>(cache.allocated_bytes()) / static_cast<double>(cache.fullkv_sequence_bytes(0));
    alloc_peak_seq /= static_cast<double>(cache.fullkv_sequence_bytes(0));  // peak bytes over the end's FullKV
    live = static_cast<double>(cache.live_tokens(0));
    evict_calls = static_cast<double>(cache.stats().eviction_calls);
    reused = static_cast<double>(cache.paged().table().stats().slots_reused);
  }
  state.counters["live"] = live;
  state.counters["hole_share"] = hole_share;
  state.counters["hole_peak"] = hole_peak;
  state.counters["ratio"] = ratio;
  state.counters["ratio_seq"] = ratio_seq;
  // Allocated (pools' chunks, records, staging) over FullKV FP16 of every position, at the end
  // and at its peak; and the proved bound on what the sequence can hold (sequence_footprint).
  state.counters["alloc_seq"] = alloc_seq;
  state.counters["alloc_peak_seq"] = alloc_peak_seq;
  const thinkv::SequenceFootprint bound = thinkv::sequence_footprint(c, policy);
  state.counters["bound_seq"] = static_cast<double>(bound.bytes) / static_cast<double>(bound.fullkv_fp16_bytes);
  state.counters["evict_per_step"] = evict_calls / tokens;
  state.counters["reused_per_token"] = reused / (static_cast<double>(tokens) * c.num_layers * c.num_kv_heads);
  state.SetItemsProcessed(state.iterations() * tokens);
  state.SetLabel(std::string(thinkv::policy_name<P>()));
}

}  // namespace

// One benchmark per ready-made policy set: ThinKv/<set>/budget:<n>/tokens:<n>.
BENCHMARK_TEMPLATE(BM_ThinKvLongRun, thinkv::TbqPolicy)
    ->Name("ThinKv/tbq")
    ->ArgNames({"budget", "tokens"})
    ->Args({0, 2048})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_TEMPLATE(BM_ThinKvLongRun, thinkv::ThinKvPolicy)
    ->Name("ThinKv/thinkv")
    ->ArgNames({"budget", "tokens"})
    ->Args({256, 4096})
    ->Args({1024, 4096})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_TEMPLATE(BM_ThinKvLongRun, thinkv::TbePolicy)
    ->Name("ThinKv/tbe")
    ->ArgNames({"budget", "tokens"})
    ->Args({256, 4096})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
