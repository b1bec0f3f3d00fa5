/// \file bench_batched_decode.cu
/// The cache's share of a batched decode step on the GPU: ThinKvCache<CudaKvBackend> driven
/// through begin_step / append_batch / attend_batch / end_step with device tensors on one stream,
/// at the shape of docs/perf.md's "Batched decode step" (batch 64, 32 layers, 8 KV heads, 32 query
/// heads, head_dim 128, budget 1024, R4E4T2, g = 16, 128-token segments, K-means on the device).
///
/// BM_BatchedDecodeStep: each iteration is one decode step of every sequence, in one of four modes
/// (argument `mode`):
///   0 drained   the step timed on the host from begin_step to the end of end_step, the stream
///               drained (what a decoder that waits for every step sees)
///   1 drained, the per-layer calls replayed from a captured CUDA graph (capturable steps)
///   2 pipelined the step timed on the host from begin_step to the return of end_step, without
///               draining: the next step's host work overlaps this step's device work wherever the
///               cache does not wait (a decoder that samples on the device)
///   3 pipelined, replayed from a CUDA graph
/// The attention alone is the same state's 32 attention launches, timed with CUDA events on
/// every 8th iteration, outside the step (the attention the step needs anyway). Counters:
///   step_ms       time of the step as above (refreshes and evictions at the rate they occur)
///   attention_ms  GPU time of the step's 32 attention launches alone
///   overhead      (step_ms - attention_ms) / attention_ms: the cache's cost beyond attention
///   host_ms       CPU time of the calling thread in the cache's calls per step (spin-waits for
///                 the device included: the CUDA runtime's default)
///   h2d_B, d2h_B  bytes the cache copied host to device / device to host per step
///   evictions     sequences whose segments stepped down, per step
///   end_ms, end_ms_max  host time of end_step (classification and TBE), mean and largest
///   reallocs      storage reallocations per step (BackendStats::storage_reallocations: a pool
///                 or the records grew or shrank; each waits for the stream inside begin_step)
///   meta_full     whole uploads of the pools' metadata per step (BackendStats::
///                 metadata_full_uploads: a change log that no longer reached back, or storage
///                 that moved; each waits for the stream)
///   captures      CUDA graphs captured in the run (graph modes: the first, and again whenever the
///                 cache's graph_epoch changed)
/// "staggered": sequences started 2 positions apart (segment boundaries spread over the steps);
/// "lockstep": every sequence at the same position, so each segment boundary past the budget
/// makes all 64 sequences evict at once: end_ms_max is that whole-batch eviction's latency.
///
/// BM_Transition: the latency of one step in which thought transitions happen (case 1: every
/// closed segment steps down one level, K-means on every stream of the transitioning sequences):
/// `seqs` = 64 all at once (a whole-batch transition), or 1 (one sequence's). The queries of the
/// transitioning sequences are made peaked (scale 8) for the refresh step, so their attention is
/// sparse and the classifier labels them T. Counters: step_ms, end_ms (drained), transitions
/// (case-1 events in the step), steps_down (segment step-downs), selections (K-means runs).
/// bench_batched_decode --benchmark_filter=... ; docs/perf.md has the H200 numbers.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <time.h>

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

/// The queries of one step, [layers][batch][row]: normal-ish values times a scale per sequence
/// that sets how peaked its attention is, hence its sparsity and thought type (the classifier
/// below: scale 0.5 -> E, 1.7 -> R, 8 -> T). who < 0: a schedule, each sequence drawing a type
/// for every 128 steps (E 35%, R 50%, T 15%), independently; who >= 0: sequences 0 .. who - 1 at
/// scale 8 (they refresh to T), the others at 0.5.
__global__ void fill_queries(float* q, std::size_t n, std::size_t row, int batch, std::uint64_t step, int who) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int b = static_cast<int>((i / row) % static_cast<std::size_t>(batch));
  float scale = 0.5f;
  if (who >= 0) {
    scale = b < who ? 8.0f : 0.5f;
  } else {
    const std::uint32_t h = thinkv::bench::hash32((static_cast<std::uint64_t>(b) << 32) ^ ((step + 37u * b) / 128));
    const std::uint32_t pick = h % 100u;
    scale = pick < 35u ? 0.5f : pick < 85u ? 1.7f : 8.0f;
  }
  float s = 0.0f;
  for (int r = 0; r < 4; ++r)
    s += static_cast<float>(thinkv::bench::hash32((step * 0x51ED27ull + 3) * 4 + r + i * 0x9E3779B9ull)) * 0x1p-32f;
  q[i] = (s - 2.0f) * 1.7f * scale;
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
double thread_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

struct StepSetup : thinkv::bench::DeviceAllocs {
  int batch = 64, layers = 32, budget = 1024;
  bool lockstep = false;
  bool graphs = false;  // capturable steps, per-layer calls replayed from a CUDA graph
  ThinKvConfig cfg;
  std::unique_ptr<ThinKvCache<CudaKvBackend>> cache;
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  float *k = nullptr, *v = nullptr, *q = nullptr, *out = nullptr;
  std::uint64_t inputs = 0;  // steps whose inputs were written (their seed)
  std::vector<int> seqs;
  std::size_t kv_layer = 0, q_layer = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::uint64_t captured_epoch = 0;
  std::size_t captured_batch = 0;
  int captures = 0;

  ~StepSetup() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
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
    if (!cache->set_capturable_steps(graphs).is_ok()) return cudaErrorUnknown;
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
    BENCH_CUDA(cudaStreamSynchronize(stream));
    // Warm up: every sequence past the budget (staggered: sequence s starts at step 2 s).
    const int warm = budget + 3 * cfg.segment_len + (lockstep ? 0 : 2 * batch);
    auto t0 = Clock::now();
    for (int t = 0; t < warm; ++t) {
      seqs.clear();
      for (int s = 0; s < batch; ++s) {
        if (lockstep || t >= 2 * s) seqs.push_back(s);
      }
      if (Status e = step(seqs); !e.is_ok()) {
        std::fprintf(stderr, "bench_batched_decode: warm-up step %d: %s\n", t, e.to_string().c_str());
        return cudaErrorUnknown;
      }
      if (std::getenv("THINKV_BENCH_VERBOSE") != nullptr && (t + 1) % 128 == 0) {
        (void)cudaStreamSynchronize(stream);
        std::fprintf(stderr, "warm-up %d/%d: %.2f ms/step\n", t + 1, warm, ms_since(t0) / 128);
        t0 = Clock::now();
      }
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    seqs.resize(static_cast<std::size_t>(batch));
    for (int s = 0; s < batch; ++s) seqs[static_cast<std::size_t>(s)] = s;
    return cudaSuccess;
  }

  /// Writes the next step's K, V (fresh random values: every position its own key) and queries
  /// (fill_queries' schedule, or `who`) on the stream, before the step's calls.
  void write_inputs(int who = -1) {
    const std::uint64_t seed = ++inputs;
    const std::size_t nkv = kv_layer * static_cast<std::size_t>(layers),
                      nq = q_layer * static_cast<std::size_t>(layers);
    fill_normalish<<<static_cast<unsigned>((nkv + 255) / 256), 256, 0, stream>>>(k, nkv, seed * 2, 1.0f);
    fill_normalish<<<static_cast<unsigned>((nkv + 255) / 256), 256, 0, stream>>>(v, nkv, seed * 2 + 1, 1.0f);
    fill_queries<<<static_cast<unsigned>((nq + 255) / 256), 256, 0, stream>>>(
        q, nq, static_cast<std::size_t>(cfg.num_q_heads) * cfg.head_dim, batch, seed, who);
  }

  /// The step's per-layer calls (the model's layers would interleave with them).
  Status layer_calls(const std::vector<int>& b) {
    for (int l = 0; l < layers; ++l) {
      THINKV_RETURN_IF_ERROR(
          cache->append_batch(l, b, {k + kv_layer * l, ElementType::kF32}, {v + kv_layer * l, ElementType::kF32}));
      THINKV_RETURN_IF_ERROR(cache->attend_batch(l, b, {q + q_layer * l, ElementType::kF32}, {out, ElementType::kF32}));
    }
    return Status::ok();
  }

  /// begin_step, the layers (direct, or from the graph: captured when there is none for this
  /// batch size and epoch), but not end_step. The step's inputs must have been written.
  Status run_layers(const std::vector<int>& b) {
    THINKV_RETURN_IF_ERROR(cache->begin_step(b));
    if (!graphs) return layer_calls(b);
    if (exec == nullptr || cache->graph_epoch() != captured_epoch || b.size() != captured_batch) {
      if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      exec = nullptr;
      graph = nullptr;
      if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        return {StatusCode::kCudaError, "cudaStreamBeginCapture"};
      }
      const Status e = layer_calls(b);
      if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || !e.is_ok()) {
        return e.is_ok() ? Status{StatusCode::kCudaError, "cudaStreamEndCapture"} : e;
      }
      if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
        return {StatusCode::kCudaError, "cudaGraphInstantiate"};
      }
      captured_epoch = cache->graph_epoch();
      captured_batch = b.size();
      ++captures;
    } else {
      THINKV_RETURN_IF_ERROR(cache->replay_step());
    }
    if (cudaGraphLaunch(exec, stream) != cudaSuccess) return {StatusCode::kCudaError, "cudaGraphLaunch"};
    return Status::ok();
  }

  Status step(const std::vector<int>& b, int who = -1) {
    write_inputs(who);
    THINKV_RETURN_IF_ERROR(run_layers(b));
    return cache->end_step(b);
  }

  /// The attention alone in the open step's state, timed with events (ms), outside any graph.
  Status attention_alone(const std::vector<int>& b, float& ms) {
    const bool timing = timing_on;
    cache->backend().set_device_timing(false);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return {StatusCode::kCudaError, "sync"};
    (void)cudaEventRecord(e0, stream);
    for (int l = 0; l < layers; ++l) {
      THINKV_RETURN_IF_ERROR(cache->attend_batch(l, b, {q + q_layer * l, ElementType::kF32}, {out, ElementType::kF32}));
    }
    (void)cudaEventRecord(e1, stream);
    (void)cudaEventSynchronize(e1);
    (void)cudaEventElapsedTime(&ms, e0, e1);
    cache->backend().set_device_timing(timing);
    return Status::ok();
  }
  bool timing_on = false;
};

void BM_BatchedDecodeStep(benchmark::State& state) {
  static thinkv::bench::SetupCache<StepSetup> setups;
  const bool lockstep = state.range(3) != 0;
  const int mode = static_cast<int>(state.range(4));
  const bool graphs = mode == 1 || mode == 3, drained = mode <= 1 || mode == 4, timed = mode == 4;
  StepSetup* s = setups.get(state, {state.range(0), state.range(1), state.range(2), state.range(3), graphs ? 1 : 0},
                            [&](StepSetup& x) {
                              x.batch = static_cast<int>(state.range(0));
                              x.layers = static_cast<int>(state.range(1));
                              x.budget = static_cast<int>(state.range(2));
                              x.lockstep = lockstep;
                              x.graphs = graphs;
                            });
  if (s == nullptr) return;
  double step = 0, end = 0, end_max = 0, host = 0, attn = 0;
  std::int64_t h2d = 0, d2h = 0, evictions = 0, n = 0, attn_n = 0;
  const int captures0 = s->captures;
  const ThinKvStats st0 = s->cache->stats();
  const BackendStats b0 = s->cache->backend().stats();  // stats() waits for the stream: only outside the loop
  CudaKvBackend::DeviceTimes dt0;
  s->timing_on = timed;
  s->cache->backend().set_device_timing(timed);
  if (timed && !s->cache->backend().device_times(dt0).is_ok()) {
    state.SkipWithError("device_times");
    return;
  }
  for (auto _ : state) {
    s->write_inputs();  // outside the host timing (the device runs it first)
    const std::int64_t ev0 = s->cache->stats().eviction_calls;
    float attn_ms = -1.0f;
    double skip = 0, skip_c = 0;
    const double c0 = thread_ms();
    const auto t0 = Clock::now();
    Status e = s->run_layers(s->seqs);
    if (e.is_ok() && n % 8 == 0) {
      // The attention alone in this state, left out of both clocks (every 8th step).
      const double pause_c = thread_ms();
      const auto pause = Clock::now();
      (void)(e = s->attention_alone(s->seqs, attn_ms));
      skip = ms_since(pause);
      skip_c = thread_ms() - pause_c;
    }
    const auto t2 = Clock::now();
    if (e.is_ok()) (void)(e = s->cache->end_step(s->seqs));
    if (e.is_ok() && drained && cudaStreamSynchronize(s->stream) != cudaSuccess) {
      (void)(e = {StatusCode::kCudaError, "sync"});
    }
    if (!e.is_ok()) {
      state.SkipWithError(e.to_string().c_str());
      return;
    }
    const double end_ms = ms_since(t2);
    const double ms = ms_since(t0) - skip;
    host += thread_ms() - c0 - skip_c;
    step += ms;
    end += end_ms;
    end_max = std::max(end_max, end_ms);
    state.SetIterationTime(ms * 1e-3);
    if (attn_ms >= 0.0f) {
      attn += attn_ms;
      ++attn_n;
    }
    evictions += s->cache->stats().eviction_calls - ev0;
    ++n;
  }
  s->cache->backend().set_device_timing(false);
  s->timing_on = false;
  if (n == 0 || attn_n == 0) return;
  const BackendStats b1 = s->cache->backend().stats();
  h2d = b1.host_to_device_bytes - b0.host_to_device_bytes;
  d2h = b1.device_to_host_bytes - b0.device_to_host_bytes;
  const double dn = static_cast<double>(n);
  const double attention = attn / static_cast<double>(attn_n);
  state.counters["step_ms"] = step / dn;
  state.counters["attention_ms"] = attention;
  state.counters["overhead"] = (step / dn - attention) / attention;
  state.counters["host_ms"] = host / dn;
  state.counters["end_ms"] = end / dn;
  state.counters["end_ms_max"] = end_max;
  state.counters["h2d_B"] = static_cast<double>(h2d) / dn;
  state.counters["d2h_B"] = static_cast<double>(d2h) / dn;
  state.counters["meta_full"] = static_cast<double>(b1.metadata_full_uploads - b0.metadata_full_uploads) / dn;
  state.counters["reallocs"] = static_cast<double>(b1.storage_reallocations - b0.storage_reallocations) / dn;
  state.counters["evictions"] = static_cast<double>(evictions) / dn;
  const ThinKvStats st1 = s->cache->stats();
  state.counters["transitions"] = static_cast<double>(st1.transition_events - st0.transition_events) / dn;
  state.counters["selections"] = static_cast<double>(st1.selections - st0.selections) / dn;
  state.counters["tokens_per_s"] = s->batch * dn / (step * 1e-3);
  state.counters["captures"] = s->captures - captures0;
  if (timed) {
    // The cache's device work by part (CUDA events around each), per step, and the overhead the
    // issue defines: (append + metadata updates + eviction) / attention, all device time.
    CudaKvBackend::DeviceTimes dt1;
    if (!s->cache->backend().device_times(dt1).is_ok()) {
      state.SkipWithError("device_times");
      return;
    }
    const double prep = (dt1.prepare_ms - dt0.prepare_ms) / dn, app = (dt1.append_ms - dt0.append_ms) / dn;
    const double att = (dt1.attend_ms - dt0.attend_ms) / dn, sel = (dt1.select_ms - dt0.select_ms) / dn;
    state.counters["dev_prepare_ms"] = prep;
    state.counters["dev_append_ms"] = app;
    state.counters["dev_attend_ms"] = att;
    state.counters["dev_select_ms"] = sel;
    state.counters["dev_overhead"] = (prep + app + sel) / att;
  }
  static const char* const kModes[] = {"drained", "drained, graph", "pipelined", "pipelined, graph",
                                       "drained, device timing"};
  state.SetLabel(std::string(lockstep ? "lockstep, " : "staggered, ") + kModes[mode]);
}

// batch, layers, budget, lockstep, mode. The first rows are the issue's configuration; the small
// one keeps the ctest smoke run short.
BENCHMARK(BM_BatchedDecodeStep)
    ->ArgNames({"batch", "layers", "budget", "lockstep", "mode"})
    ->Args({64, 32, 1024, 0, 0})
    ->Args({64, 32, 1024, 0, 4})
    ->Args({64, 32, 1024, 0, 2})
    ->Args({64, 32, 1024, 0, 1})
    ->Args({64, 32, 1024, 0, 3})
    ->Args({64, 32, 1024, 1, 0})
    ->Args({8, 4, 256, 0, 0})
    ->Args({8, 4, 256, 0, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(384);

/// One step with thought transitions (see the file comment): lockstep sequences past the budget,
/// at a refresh step the queries of `seqs` of them peaked so that they refresh to T.
void BM_Transition(benchmark::State& state) {
  static thinkv::bench::SetupCache<StepSetup> setups;
  const int who = static_cast<int>(state.range(0));
  StepSetup* s = setups.get(state, {64, 32, 1024, 1, who}, [&](StepSetup& x) {
    x.batch = 64;
    x.layers = 32;
    x.budget = 1024;
    x.lockstep = true;
  });
  if (s == nullptr) return;
  double step = 0, end = 0;
  std::int64_t transitions = 0, steps_down = 0, selections = 0, n = 0;
  for (auto _ : state) {
    // Every sequence on E (flat attention) for two refresh periods, up to the next refresh step.
    Status e;
    for (int i = 0; e.is_ok() && i < 2 * 128; ++i) (void)(e = s->step(s->seqs, 0));
    while (e.is_ok() && s->cache->position(0) % 128 != 0) (void)(e = s->step(s->seqs, 0));
    if (!e.is_ok() || cudaStreamSynchronize(s->stream) != cudaSuccess) {
      state.SkipWithError(e.is_ok() ? "sync" : e.to_string().c_str());
      return;
    }
    // The refresh step: sequences 0 .. who - 1 attend with peaked queries and turn T.
    s->write_inputs(who);
    if (cudaStreamSynchronize(s->stream) != cudaSuccess) {
      state.SkipWithError("sync");
      return;
    }
    const ThinKvStats st0 = s->cache->stats();
    const auto t0 = Clock::now();
    (void)(e = s->run_layers(s->seqs));
    const auto t1 = Clock::now();
    if (e.is_ok()) (void)(e = s->cache->end_step(s->seqs));
    if (!e.is_ok() || cudaStreamSynchronize(s->stream) != cudaSuccess) {
      state.SkipWithError(e.is_ok() ? "sync" : e.to_string().c_str());
      return;
    }
    const double ms = ms_since(t0);
    step += ms;
    end += std::chrono::duration<double, std::milli>(Clock::now() - t1).count();
    state.SetIterationTime(ms * 1e-3);
    const ThinKvStats st1 = s->cache->stats();
    transitions += st1.transition_events - st0.transition_events;
    steps_down += st1.segment_steps - st0.segment_steps;
    selections += st1.selections - st0.selections;
    ++n;
  }
  if (n == 0) return;
  const double dn = static_cast<double>(n);
  state.counters["step_ms"] = step / dn;
  state.counters["end_ms"] = end / dn;
  state.counters["transitions"] = static_cast<double>(transitions) / dn;
  state.counters["steps_down"] = static_cast<double>(steps_down) / dn;
  state.counters["selections"] = static_cast<double>(selections) / dn;
  state.SetLabel(who == 1 ? "one sequence" : "whole batch");
}
BENCHMARK(BM_Transition)
    ->ArgNames({"seqs"})
    ->Arg(64)
    ->Arg(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(4);

/// Prefill of one prompt: begin_prompt, prefill of every layer (append: one stage and one commit
/// launch per 16 tokens; causal attention: launch_prefill_attention), end_prompt, stream drained;
/// the sequence is reset between iterations (not timed). Same shape per layer as above, FP32
/// tensors. Counters: prefill_ms (host time of the whole prompt), attention_ms (GPU time of the
/// layers' attention kernels alone, timed with events in a second pass), append_ms (the rest),
/// tokens_per_s = tokens / prefill time.
struct PrefillSetup : thinkv::bench::DeviceAllocs {
  int tokens = 0, layers = 0;
  int max_tokens = 0;  ///< positions the cache must hold beyond `tokens` (0: tokens + 1)
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
    cfg.max_tokens = std::max({8192, tokens + 1, max_tokens});
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

/// A prompt's later chunk (llama.cpp's next ubatch): `stored` prompt tokens are in the cache
/// (stored without attention, not timed; the sequence is reset and refilled before every
/// iteration), then one chunk of `chunk` tokens is timed: begin_prompt, prefill of every layer,
/// end_prompt, stream drained. attend = 1: the chunk's queries attend the stored tokens and the
/// chunk (CudaKvBackend::attend_chunk: address upload, dequantizing gather, prefill kernel with a
/// prefix); attend = 0: the chunk is stored only (q and out null), so the difference is the
/// attention's cost. Counters: chunk_ms, tokens_per_s = chunk / chunk_ms, h2d_B (bytes copied to
/// the device during the chunk: the stored tokens' addresses, the commit jobs).
void BM_PromptChunk(benchmark::State& state) {
  static thinkv::bench::SetupCache<PrefillSetup> setups;
  const int stored = static_cast<int>(state.range(0)), chunk = static_cast<int>(state.range(1));
  const bool attend = state.range(3) != 0;
  PrefillSetup* s = setups.get(state, {state.range(0), state.range(1), state.range(2)}, [&](PrefillSetup& x) {
    x.tokens = std::max(stored, chunk);
    x.max_tokens = stored + chunk + 1;
    x.layers = static_cast<int>(state.range(2));
  });
  if (s == nullptr) return;
  const TensorRef none{nullptr, ElementType::kF32};
  auto fill = [&](int tokens, bool with_attention) -> Status {
    THINKV_RETURN_IF_ERROR(s->cache->begin_prompt(0, tokens));
    for (int l = 0; l < s->layers; ++l) {
      THINKV_RETURN_IF_ERROR(s->cache->prefill(l, 0, with_attention ? TensorRef{s->q, ElementType::kF32} : none,
                                               {s->k, ElementType::kF32}, {s->v, ElementType::kF32},
                                               MutableTensorRef{with_attention ? s->out : nullptr, ElementType::kF32}));
    }
    THINKV_RETURN_IF_ERROR(s->cache->end_prompt(0));
    return s->cache->backend().synchronize();
  };
  double total = 0;
  std::int64_t n = 0, h2d = 0;
  for (auto _ : state) {
    if (Status e = s->cache->reset_sequence(0); !e.is_ok() || !(e = fill(stored, false)).is_ok()) {
      state.SkipWithError(e.to_string().c_str());
      return;
    }
    const std::int64_t h0 = s->cache->paged().backend().stats().host_to_device_bytes;
    const auto t0 = Clock::now();
    if (Status e = fill(chunk, attend); !e.is_ok()) {
      state.SkipWithError(e.to_string().c_str());
      return;
    }
    const double ms = ms_since(t0);
    state.SetIterationTime(ms * 1e-3);
    h2d += s->cache->paged().backend().stats().host_to_device_bytes - h0;
    total += ms;
    ++n;
  }
  if (n == 0) return;
  const double dn = static_cast<double>(n);
  state.counters["chunk_ms"] = total / dn;
  state.counters["tokens_per_s"] = chunk * dn / (total * 1e-3);
  state.counters["h2d_B"] = static_cast<double>(h2d) / dn;
}

// stored, chunk, layers, attend; the last keeps the ctest smoke run short.
BENCHMARK(BM_PromptChunk)
    ->ArgNames({"stored", "chunk", "layers", "attend"})
    ->Args({4096, 512, 32, 1})
    ->Args({4096, 512, 32, 0})
    ->Args({1024, 512, 32, 1})
    ->Args({1024, 512, 32, 0})
    ->Args({4096, 64, 32, 1})
    ->Args({4096, 64, 32, 0})
    ->Args({64, 16, 2, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

}  // namespace
