// The host's share of a batched decode step: ThinKvCache driven through begin_step / append_batch
// / attend_batch / end_step over a backend that does no work at all (host_only_backend.hpp), at
// the shape of docs/perf.md's "Batched decode step" (batch 64, 32 layers, 8 KV heads, 32 query
// heads, head_dim 128, budget 1,024, R4E4T2, g = 16, 128-token segments). What remains is every
// decision and every record the cache keeps on the host, which a GPU decoder's host thread pays
// on top of its own launches. Sequences start two positions apart and are warmed up past the
// budget, as in bench_batched_decode. Counters (per step, host time):
//   step_us    the whole step      begin_us   begin_step
//   append_us  the 32 append_batch calls      attend_us  the 32 attend_batch calls
//   end_us     end_step (refreshes, TBE plans, evictions), without select_segments' scan of the
//              segments' tokens, which a device backend runs on the device
//   scan_us    that scan, on the host here
//   evictions  sequences that evicted, per step
//   bench_host_step --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "host_only_backend.hpp"
#include "thinkv/thinkv_cache.hpp"

namespace {

using namespace thinkv;
using Clock = std::chrono::steady_clock;
using Cache = ThinKvCache<bench::HostOnlyBackend>;

double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

struct HostStep {
  int batch = 64, layers = 32, budget = 1024;
  std::unique_ptr<Cache> cache;
  std::vector<int> seqs;
  float dummy[4] = {};

  struct Times {
    double begin = 0, append = 0, attend = 0, end = 0;
  };

  Status build() {
    ThinKvConfig cfg;
    cfg.num_sequences = batch;
    cfg.num_layers = layers;
    cfg.num_kv_heads = 8;
    cfg.num_q_heads = 32;
    cfg.head_dim = 128;
    cfg.max_tokens = 1 << 16;
    cfg.token_budget = budget;
    ThinKvPolicy p;
    p.precision = kR4E4T2;
    p.classifier = ThoughtClassifier::three_types(0.55f, 0.75f, {0, 1, 2, 3}, 128, layers);
    cache = std::make_unique<Cache>(cfg, p);
    const int warm = budget + 3 * cfg.segment_len + 2 * batch;
    for (int t = 0; t < warm; ++t) {
      seqs.clear();
      for (int s = 0; s < batch; ++s) {
        if (t >= 2 * s) seqs.push_back(s);
      }
      Times ignored;
      THINKV_RETURN_IF_ERROR(step(ignored));
    }
    seqs.resize(static_cast<std::size_t>(batch));
    for (int s = 0; s < batch; ++s) seqs[static_cast<std::size_t>(s)] = s;
    return Status::ok();
  }

  Status step(Times& t) {
    const TensorRef kv{dummy, ElementType::kF32};
    const MutableTensorRef out{dummy, ElementType::kF32};
    auto t0 = Clock::now();
    THINKV_RETURN_IF_ERROR(cache->begin_step(seqs));
    t.begin += us_since(t0);
    for (int l = 0; l < layers; ++l) {
      t0 = Clock::now();
      THINKV_RETURN_IF_ERROR(cache->append_batch(l, seqs, kv, kv));
      t.append += us_since(t0);
      t0 = Clock::now();
      THINKV_RETURN_IF_ERROR(cache->attend_batch(l, seqs, kv, out));
      t.attend += us_since(t0);
    }
    t0 = Clock::now();
    THINKV_RETURN_IF_ERROR(cache->end_step(seqs));
    t.end += us_since(t0);
    return Status::ok();
  }
};

void BM_HostStep(benchmark::State& state) {
  HostStep s;
  s.batch = static_cast<int>(state.range(0));
  s.layers = static_cast<int>(state.range(1));
  s.budget = static_cast<int>(state.range(2));
  if (Status e = s.build(); !e.is_ok()) {
    state.SkipWithError(e.to_string().c_str());
    return;
  }
  HostStep::Times t;
  std::int64_t n = 0;
  const std::int64_t ev0 = s.cache->stats().eviction_calls;
  const double sel0 = s.cache->backend().select_us;
  for (auto _ : state) {
    if (Status e = s.step(t); !e.is_ok()) {
      state.SkipWithError(e.to_string().c_str());
      return;
    }
    ++n;
  }
  if (n == 0) return;
  const double dn = static_cast<double>(n);
  // The segments' token scan of select_segments runs on the device in a device backend.
  const double sel = s.cache->backend().select_us - sel0;
  state.counters["step_us"] = (t.begin + t.append + t.attend + t.end - sel) / dn;
  state.counters["scan_us"] = sel / dn;
  state.counters["begin_us"] = t.begin / dn;
  state.counters["append_us"] = t.append / dn;
  state.counters["attend_us"] = t.attend / dn;
  state.counters["end_us"] = (t.end - sel) / dn;
  state.counters["evictions"] = static_cast<double>(s.cache->stats().eviction_calls - ev0) / dn;
}

// batch, layers, budget: the configuration, a larger batch (the metadata of 8,192
// streams outgrows the CPU's caches), the end-to-end table's batch at budget 1,024 (822: about
// 4 minutes of warm-up), and a small one for the ctest smoke run.
BENCHMARK(BM_HostStep)
    ->ArgNames({"batch", "layers", "budget"})
    ->Args({64, 32, 1024})
    ->Args({256, 32, 1024})
    ->Args({822, 32, 1024})
    ->Args({8, 4, 256})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(256);

}  // namespace
