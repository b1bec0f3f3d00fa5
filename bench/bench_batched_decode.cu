/// \file bench_batched_decode.cu
/// The cache's share of a batched decode step on the GPU: ThinKvCache<CudaKvBackend> driven
/// through begin_step / append_batch / attend_batch / end_step with device tensors on one stream,
/// at the shape of docs/perf.md's "Batched decode step" (batch 64, 32 layers, 8 KV heads, 32 query
/// heads, head_dim 128, budget 1024, R4E4T2, g = 16, 128-token segments, K-means on the device).
///
/// Each benchmark iteration is one decode step of every sequence, timed on the host from
/// begin_step to the end of end_step with the stream drained (what a decoder waits for), plus,
/// in the same state and not counted in the step, one more attend_batch of every layer timed
/// with CUDA events (the attention the step needs anyway). Counters:
///   step_ms       host time of the step (appends, metadata updates, attention, refreshes and
///                 evictions at the rate they occur, every host-side decision)
///   attention_ms  GPU time of the step's 32 attention launches alone
///   overhead      (step_ms - attention_ms) / attention_ms: the cache's cost beyond attention
///   h2d_B, d2h_B  bytes the cache copied host to device / device to host per step
///   evictions     sequences whose segments stepped down, per step
///   end_ms        host time of end_step (classification and TBE)
/// "staggered": sequences started 2 positions apart (segment boundaries spread over the steps);
/// "lockstep": every sequence at the same position, so each segment boundary past the budget
/// makes all 64 sequences evict at once: end_ms_max is that whole-batch eviction's latency.
/// bench_batched_decode --benchmark_filter=... ; docs/perf.md has the H200 numbers.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "gpu_bench.cuh"
#include "thinkv/backend/cuda_backend.hpp"
#include "thinkv/thinkv_cache.hpp"

namespace {

using namespace thinkv;
using Clock = std::chrono::steady_clock;

const thinkv::bench::NoGpuSkip g_skip{"bench_batched_decode"};

__global__ void fill_normalish(float* x, std::size_t n, std::uint64_t seed, float scale) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  // Sum of 4 uniforms, centred: close enough to normal for attention scores.
  float s = 0.0f;
  for (int r = 0; r < 4; ++r)
    s += static_cast<float>(thinkv::bench::hash32(seed * 4 + r + i * 0x9E3779B9ull)) * 0x1p-32f;
  x[i] = (s - 2.0f) * 1.7f * scale;
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct StepSetup : thinkv::bench::DeviceAllocs {
  int batch = 64, layers = 32, budget = 1024;
  bool lockstep = false;
  ThinKvConfig cfg;
  std::unique_ptr<ThinKvCache<CudaKvBackend>> cache;
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  float *k = nullptr, *v = nullptr, *q = nullptr, *out = nullptr;
  std::vector<int> seqs;
  std::size_t kv_layer = 0, q_layer = 0;

  ~StepSetup() {
    cache.reset();
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
    if (e0 != nullptr) (void)cudaEventDestroy(e0);
    if (e1 != nullptr) (void)cudaEventDestroy(e1);
  }

  cudaError_t build() {
    cfg.num_sequences = batch;
    cfg.num_layers = layers;
    cfg.num_kv_heads = 8;
    cfg.num_q_heads = 32;
    cfg.head_dim = 128;
    cfg.group_size = 16;
    cfg.block_size = 16;
    cfg.max_tokens = 8192;
    cfg.segment_len = 128;
    cfg.token_budget = budget;
    ThinKvPolicy p;
    p.precision = kR4E4T2;
    p.classifier = ThoughtClassifier::three_types(0.55f, 0.75f, {0, 1, 2, 3}, 128, layers);
    cache = std::make_unique<ThinKvCache<CudaKvBackend>>(cfg, p);
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    if (!cache->backend().set_stream(stream).is_ok()) return cudaErrorUnknown;
    kv_layer = static_cast<std::size_t>(batch) * cfg.num_kv_heads * cfg.head_dim;
    q_layer = static_cast<std::size_t>(batch) * cfg.num_q_heads * cfg.head_dim;
    BENCH_CUDA(alloc(k, kv_layer * layers));
    BENCH_CUDA(alloc(v, kv_layer * layers));
    BENCH_CUDA(alloc(q, q_layer * layers));
    BENCH_CUDA(alloc(out, q_layer));
    const auto fill = [&](float* x, std::size_t n, std::uint64_t seed, float scale) {
      fill_normalish<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(x, n, seed, scale);
      return cudaGetLastError();
    };
    BENCH_CUDA(fill(k, kv_layer * layers, 1, 1.0f));
    BENCH_CUDA(fill(v, kv_layer * layers, 2, 1.0f));
    BENCH_CUDA(fill(q, q_layer * layers, 3, 0.5f));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    // Warm up: every sequence past the budget (staggered: sequence s starts at step 2 s).
    const int warm = budget + 3 * cfg.segment_len + (lockstep ? 0 : 2 * batch);
    auto t0 = Clock::now();
    for (int t = 0; t < warm; ++t) {
      seqs.clear();
      for (int s = 0; s < batch; ++s) {
        if (lockstep || t >= 2 * s) seqs.push_back(s);
      }
      if (Status e = step(seqs, nullptr); !e.is_ok()) {
        std::fprintf(stderr, "bench_batched_decode: warm-up step %d: %s\n", t, e.to_string().c_str());
        return cudaErrorUnknown;
      }
      if (std::getenv("THINKV_BENCH_VERBOSE") != nullptr && (t + 1) % 128 == 0) {
        (void)cudaStreamSynchronize(stream);
        std::fprintf(stderr, "warm-up %d/%d: %.2f ms/step\n", t + 1, warm, ms_since(t0) / 128);
        t0 = Clock::now();
      }
    }
    seqs.resize(static_cast<std::size_t>(batch));
    for (int s = 0; s < batch; ++s) seqs[static_cast<std::size_t>(s)] = s;
    return cudaSuccess;
  }

  struct Times {
    double step_ms = 0, end_ms = 0, attention_ms = 0;
  };

  /// One decode step of `batch`; with `times`, also the attention-only pass (not in step_ms).
  Status step(const std::vector<int>& b, Times* times) {
    const auto t0 = Clock::now();
    THINKV_RETURN_IF_ERROR(cache->begin_step(b));
    for (int l = 0; l < layers; ++l) {
      THINKV_RETURN_IF_ERROR(
          cache->append_batch(l, b, {k + kv_layer * l, ElementType::kF32}, {v + kv_layer * l, ElementType::kF32}));
      THINKV_RETURN_IF_ERROR(cache->attend_batch(l, b, {q + q_layer * l, ElementType::kF32}, {out, ElementType::kF32}));
    }
    if (times == nullptr) return cache->end_step(b);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return {StatusCode::kCudaError, "sync"};
    const double part1 = ms_since(t0);
    // The attention alone, in the same state (nothing changed since the step's attends).
    (void)cudaEventRecord(e0, stream);
    for (int l = 0; l < layers; ++l) {
      THINKV_RETURN_IF_ERROR(cache->attend_batch(l, b, {q + q_layer * l, ElementType::kF32}, {out, ElementType::kF32}));
    }
    (void)cudaEventRecord(e1, stream);
    (void)cudaEventSynchronize(e1);
    float ms = 0;
    (void)cudaEventElapsedTime(&ms, e0, e1);
    times->attention_ms = ms;
    const auto t2 = Clock::now();
    THINKV_RETURN_IF_ERROR(cache->end_step(b));
    if (cudaStreamSynchronize(stream) != cudaSuccess) return {StatusCode::kCudaError, "sync"};
    times->end_ms = ms_since(t2);
    times->step_ms = part1 + times->end_ms;
    return Status::ok();
  }
};

void BM_BatchedDecodeStep(benchmark::State& state) {
  static thinkv::bench::SetupCache<StepSetup> setups;
  const bool lockstep = state.range(3) != 0;
  StepSetup* s = setups.get(state, {state.range(0), state.range(1), state.range(2), state.range(3)}, [&](StepSetup& x) {
    x.batch = static_cast<int>(state.range(0));
    x.layers = static_cast<int>(state.range(1));
    x.budget = static_cast<int>(state.range(2));
    x.lockstep = lockstep;
  });
  if (s == nullptr) return;
  double step = 0, attn = 0, end = 0, end_max = 0;
  std::int64_t h2d = 0, d2h = 0, evictions = 0, n = 0;
  for (auto _ : state) {
    const BackendStats b0 = s->cache->backend().stats();
    const std::int64_t ev0 = s->cache->stats().eviction_calls;
    StepSetup::Times t;
    if (Status e = s->step(s->seqs, &t); !e.is_ok()) {
      state.SkipWithError(e.to_string().c_str());
      return;
    }
    const BackendStats b1 = s->cache->backend().stats();
    state.SetIterationTime(t.step_ms * 1e-3);
    step += t.step_ms;
    attn += t.attention_ms;
    end += t.end_ms;
    end_max = std::max(end_max, t.end_ms);
    // The attention-only pass uploads the attended streams (4 bytes each per layer): not the step's.
    h2d += b1.host_to_device_bytes - b0.host_to_device_bytes -
           static_cast<std::int64_t>(s->layers) * s->batch * s->cfg.num_kv_heads * 4;
    d2h += b1.device_to_host_bytes - b0.device_to_host_bytes;
    evictions += s->cache->stats().eviction_calls - ev0;
    ++n;
  }
  if (n == 0) return;
  const double dn = static_cast<double>(n);
  state.counters["step_ms"] = step / dn;
  state.counters["attention_ms"] = attn / dn;
  state.counters["overhead"] = (step - attn) / attn;
  state.counters["end_ms"] = end / dn;
  state.counters["end_ms_max"] = end_max;
  state.counters["h2d_B"] = static_cast<double>(h2d) / dn;
  state.counters["d2h_B"] = static_cast<double>(d2h) / dn;
  state.counters["evictions"] = static_cast<double>(evictions) / dn;
  state.counters["tokens_per_s"] = s->batch * dn / (step * 1e-3);
  state.SetLabel(lockstep ? "lockstep" : "staggered");
}

// batch, layers, budget, lockstep. The first pair is the issue's configuration; the small one
// keeps the ctest smoke run short.
BENCHMARK(BM_BatchedDecodeStep)
    ->ArgNames({"batch", "layers", "budget", "lockstep"})
    ->Args({64, 32, 1024, 0})
    ->Args({64, 32, 1024, 1})
    ->Args({8, 4, 256, 0})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(384);

/// Prefill of one prompt: begin_prompt, prefill of every layer (append: one stage and one commit
/// launch per 16 tokens; causal attention: launch_prefill_attention), end_prompt, stream drained;
/// the sequence is reset between iterations (not timed). Same shape per layer as above, FP32
/// tensors. Counters: prefill_ms (host time of the whole prompt), attention_ms (GPU time of the
/// layers' attention kernels alone, timed with events in a second pass), append_ms (the rest),
/// tokens_per_s = tokens / prefill time.
struct PrefillSetup : thinkv::bench::DeviceAllocs {
  int tokens = 0, layers = 0;
  ThinKvConfig cfg;
  std::unique_ptr<ThinKvCache<CudaKvBackend>> cache;
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  float *k = nullptr, *v = nullptr, *q = nullptr, *out = nullptr;
  ~PrefillSetup() {
    cache.reset();
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
    if (e0 != nullptr) (void)cudaEventDestroy(e0);
    if (e1 != nullptr) (void)cudaEventDestroy(e1);
  }
  cudaError_t build() {
    cfg.num_sequences = 1;
    cfg.num_layers = layers;
    cfg.num_kv_heads = 8;
    cfg.num_q_heads = 32;
    cfg.head_dim = 128;
    cfg.group_size = 16;
    cfg.block_size = 16;
    cfg.max_tokens = std::max(8192, tokens + 1);
    cfg.segment_len = 128;
    cfg.token_budget = 1024;
    ThinKvPolicy p;
    p.precision = kR4E4T2;
    std::vector<int> lstar;
    for (int l = 0; l < std::min(4, layers); ++l) lstar.push_back(l);
    p.classifier = ThoughtClassifier::three_types(0.55f, 0.75f, lstar, 128, layers);
    cache = std::make_unique<ThinKvCache<CudaKvBackend>>(cfg, p);
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    if (!cache->backend().set_stream(stream).is_ok()) return cudaErrorUnknown;
    const std::size_t kv = static_cast<std::size_t>(tokens) * 8 * 128, qn = static_cast<std::size_t>(tokens) * 32 * 128;
    BENCH_CUDA(alloc(k, kv));
    BENCH_CUDA(alloc(v, kv));
    BENCH_CUDA(alloc(q, qn));
    BENCH_CUDA(alloc(out, qn));
    fill_normalish<<<static_cast<unsigned>((kv + 255) / 256), 256, 0, stream>>>(k, kv, 1, 1.0f);
    fill_normalish<<<static_cast<unsigned>((kv + 255) / 256), 256, 0, stream>>>(v, kv, 2, 1.0f);
    fill_normalish<<<static_cast<unsigned>((qn + 255) / 256), 256, 0, stream>>>(q, qn, 3, 0.5f);
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaStreamSynchronize(stream));
    return cudaSuccess;
  }
  Status prompt() {
    THINKV_RETURN_IF_ERROR(cache->begin_prompt(0, tokens));
    for (int l = 0; l < layers; ++l) {
      THINKV_RETURN_IF_ERROR(cache->prefill(l, 0, {q, ElementType::kF32}, {k, ElementType::kF32},
                                            {v, ElementType::kF32}, {out, ElementType::kF32}));
    }
    THINKV_RETURN_IF_ERROR(cache->end_prompt(0));
    return cache->backend().synchronize();
  }
};

void BM_Prefill(benchmark::State& state) {
  static thinkv::bench::SetupCache<PrefillSetup> setups;
  PrefillSetup* s = setups.get(state, {state.range(0), state.range(1)}, [&](PrefillSetup& x) {
    x.tokens = static_cast<int>(state.range(0));
    x.layers = static_cast<int>(state.range(1));
  });
  if (s == nullptr) return;
  double total = 0, attn = 0;
  std::int64_t n = 0;
  for (auto _ : state) {
    if (!s->cache->reset_sequence(0).is_ok()) {
      state.SkipWithError("reset_sequence failed");
      return;
    }
    const auto t0 = Clock::now();
    if (Status e = s->prompt(); !e.is_ok()) {
      state.SkipWithError(e.to_string().c_str());
      return;
    }
    const double ms = ms_since(t0);
    state.SetIterationTime(ms * 1e-3);
    total += ms;
    // The attention alone, as the prefill launched it, every layer.
    PromptAttendArgs a;
    a.tokens = s->tokens;
    a.num_q_heads = 32;
    a.num_kv_heads = 8;
    a.head_dim = 128;
    a.q = {s->q, ElementType::kF32};
    a.k = {s->k, ElementType::kF32};
    a.v = {s->v, ElementType::kF32};
    a.out = {s->out, ElementType::kF32};
    (void)cudaEventRecord(s->e0, s->stream);
    for (int l = 0; l < s->layers; ++l) {
      if (!s->cache->backend().attend_prompt(a).is_ok()) {
        state.SkipWithError("attend_prompt failed");
        return;
      }
    }
    (void)cudaEventRecord(s->e1, s->stream);
    (void)cudaEventSynchronize(s->e1);
    float am = 0;
    (void)cudaEventElapsedTime(&am, s->e0, s->e1);
    attn += am;
    ++n;
  }
  if (n == 0) return;
  const double dn = static_cast<double>(n);
  state.counters["prefill_ms"] = total / dn;
  state.counters["attention_ms"] = attn / dn;
  state.counters["append_ms"] = (total - attn) / dn;
  state.counters["tokens_per_s"] = s->tokens * dn / (total * 1e-3);
}

// tokens, layers; the last keeps the ctest smoke run short.
BENCHMARK(BM_Prefill)
    ->ArgNames({"tokens", "layers"})
    ->Args({512, 32})
    ->Args({2048, 32})
    ->Args({4096, 32})
    ->Args({64, 2})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

}  // namespace
