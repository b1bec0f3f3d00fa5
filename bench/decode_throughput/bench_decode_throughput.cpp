/// \file bench_decode_throughput.cpp
/// End-to-end decoding throughput of the GPU decoder (examples/decoder/gpu_transformer.hpp):
/// a Llama model with random BF16 weights (throughput does not depend on their values), every
/// sequence of a batch decoding greedily, ThinKV's device cache for attention. One configuration
/// per run; one JSON object per run on stdout (and a table line on stderr).
///
///   bench_decode_throughput --method full   --context 16384            [--batch N]
///   bench_decode_throughput --method thinkv --budget 1024 [--warmup W] [--batch N]
///   bench_decode_throughput --method rkv    --budget 1024 [--rkv-overlap] [--batch N]
///
/// FullKV (BF16 pages, no eviction): every sequence is given `context - 1` random keys and values
/// (stored without attention: GpuTransformer::fill), decodes --warmup steps (default 32: the
/// metadata of the whole prompt reaches the device mirror on the first) and then `--steps` timed
/// steps at that context. A step's time grows linearly with the context, so the mean over a
/// generation of 0..2C tokens is the time at C: --context 16384 gives the average of a 32K-token
/// generation.
/// R-KV (rkv_cache.hpp, the token-eviction baseline): BF16 pages, budget + 128 tokens per stream
/// at most, compressed (scores, top-k, gather-compaction) every 128 tokens once past the budget,
/// after the step (sequential) or on a second stream overlapped with the next step, in which the
/// sequence sits out (--rkv-overlap). Joins and warm-up as ThinKV's: past the budget a step no
/// longer depends on the position.
/// ThinKV (R4E4T2, TBE with K-means, at --budget): sequences join one by one over the first 128
/// steps (continuous batching; their refreshes fall on different steps), decode --warmup steps
/// (default budget + 5 segments: past the budget, evicting), then --steps timed steps. Past the
/// budget a step no longer depends on the position: the timed steps are the generation's steady
/// state. The thought of each 128-token window is drawn i.i.d. R 55% / E 24% / T 21%, the shares
/// ThinKV's calibrated classifier gave on the testbed model's chain-of-thought traces at budget
/// 1024 (docs/results-data/2026-12-02-testbed/main.md: R/E/T 72,089 / 31,531 / 26,630 tokens;
/// a new transition at 18.5% of refreshes, 16.6% with this draw); the classifier still asks the
/// attention for its sparsity on layers 0-3 at every refresh, as the calibrated one does.
/// --batch 0 (default): the largest batch whose worst-case cache (max_sequences) fits the device
/// memory left after the weights and the step buffers, capped by --max-batch.
/// --check: runs the configuration twice from the same seed and requires the same tokens.
/// --tp N: tensor parallelism over N GPUs (NCCL; one process per GPU, forked before any CUDA
/// call): rank r on GPU r holds 1/N of every layer's heads and FFN units and of the cache, the
/// batch is the largest that fits on every rank, rank 0 prints the results (KV bytes per rank)
/// with the all-reduces' share of the step. --shape r1-llama-70b: 80 layers, dim 8192, 64 query
/// and 8 KV heads of 128, FFN 28672, vocabulary 128256 (DeepSeek-R1-Distill-Llama-70B's shape).
/// Steps are pipelined (GpuTransformer::launch / collect: the host plans step t + 1 while the
/// device runs step t, each sequence fed its previous greedy token on the device); --sync waits
/// for each step (GpuTransformer::step) instead, host and device work then add up.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "decoder/gpu_transformer.hpp"
#ifdef THINKV_HAVE_NCCL
#include "decoder/nccl_collective.hpp"
#endif
#include "rkv_cache.hpp"
#include "thinkv/policy/cache_policy.hpp"

using namespace thinkv;
using namespace thinkv::decoder;

namespace {

/// Draws each refresh window's thought i.i.d. from fixed shares, mixing the tokens the window
/// decoded (TokenHint) into its state so that sequences draw differently. Asks for the attention
/// sparsity of layers 0..3 like a calibrated classifier (the signal is read and ignored).
class ScheduledClassifier {
 public:
  [[nodiscard]] Status check(int num_layers) const {
    if (num_layers < 1) return {StatusCode::kInvalidArgument, "ScheduledClassifier: no layer"};
    return Status::ok();
  }
  [[nodiscard]] int tau() const noexcept { return 128; }
  [[nodiscard]] bool emits(ThoughtType) const noexcept { return true; }
  [[nodiscard]] bool needs_signal() const noexcept { return true; }
  [[nodiscard]] bool uses_layer(int l) const noexcept { return l < 4; }
  void observe(std::int64_t position, const TokenHint& hint) {
    state_ =
        (state_ ^ static_cast<std::uint64_t>(hint.token + 1)) * 0x100000001B3ull + static_cast<std::uint64_t>(position);
  }
  [[nodiscard]] ThoughtType decide(std::int64_t, std::span<const float>) {
    std::uint64_t s = state_;
    const double u = static_cast<double>(splitmix64(s) >> 11) * 0x1p-53;
    return u < 0.55 ? ThoughtType::kReasoning : u < 0.79 ? ThoughtType::kExecution : ThoughtType::kTransition;
  }
  [[nodiscard]] std::string to_string() const { return "scheduled{R .55, E .24, T .21, tau 128}"; }

 private:
  std::uint64_t state_ = 0x6a09e667f3bcc908ull;
};
static_assert(thought_classifier<ScheduledClassifier>);

struct ScheduledThinKvPolicy : CachePolicy<ScheduledClassifier, PrecisionMap, RetentionSchedule, KmeansSelector> {
  static constexpr std::string_view kName = "thinkv";
};

struct Args {
  std::string method = "thinkv";
  std::string shape = "llama3-8b";
  int budget = 1024;
  int batch = 0;
  int max_batch = 1024;
  int context = 16384;
  int warmup = -1;
  int steps = 32;
  std::uint64_t seed = 1;
  bool check = false;
  bool rkv_overlap = false;
  bool sync = false;  // step() (wait for each step) instead of launch / collect (pipelined)
  int tp = 1;         // tensor-parallel ranks (one GPU each)
};

bool parse(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (k == "--check") {
      a.check = true;
      continue;
    }
    if (k == "--rkv-overlap") {
      a.rkv_overlap = true;
      continue;
    }
    if (k == "--sync") {
      a.sync = true;
      continue;
    }
    if ((v = val()) == nullptr) {
      std::fprintf(stderr, "bench_decode_throughput: %s needs a value\n", k.c_str());
      return false;
    }
    if (k == "--method")
      a.method = v;
    else if (k == "--shape")
      a.shape = v;
    else if (k == "--budget")
      a.budget = std::atoi(v);
    else if (k == "--batch")
      a.batch = std::atoi(v);
    else if (k == "--max-batch")
      a.max_batch = std::atoi(v);
    else if (k == "--context")
      a.context = std::atoi(v);
    else if (k == "--warmup")
      a.warmup = std::atoi(v);
    else if (k == "--steps")
      a.steps = std::atoi(v);
    else if (k == "--seed")
      a.seed = std::strtoull(v, nullptr, 10);
    else if (k == "--tp")
      a.tp = std::atoi(v);
    else {
      std::fprintf(stderr, "bench_decode_throughput: unknown option %s\n", k.c_str());
      return false;
    }
  }
  if (a.method != "full" && a.method != "thinkv" && a.method != "rkv") {
    std::fprintf(stderr, "bench_decode_throughput: --method %s: allowed full, thinkv, rkv\n", a.method.c_str());
    return false;
  }
  if (a.steps < 1 || a.budget < 128 || a.context < 2 || a.max_batch < 1 || a.batch < 0 || a.tp < 1) {
    std::fprintf(stderr,
                 "bench_decode_throughput: --steps >= 1, --budget >= 128, --context >= 2, --batch >= 0, --tp >= 1\n");
    return false;
  }
  if (a.tp > 1 && a.method == "rkv") {
    std::fprintf(stderr, "bench_decode_throughput: --method rkv does not run under tensor parallelism (--tp 1)\n");
    return false;
  }
  if (a.shape != "tiny" && a.shape != "llama3-8b" && a.shape != "r1-llama-70b") {
    std::fprintf(stderr, "bench_decode_throughput: --shape %s: allowed tiny, llama3-8b, r1-llama-70b\n",
                 a.shape.c_str());
    return false;
  }
  return true;
}

ModelConfig shape_config(const std::string& s) {
  ModelConfig c;
  if (s == "tiny") {  // the smoke test's
    c.dim = 256, c.hidden_dim = 512, c.n_layers = 4, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 64,
    c.vocab_size = 1000;
  } else if (s == "r1-llama-70b") {  // DeepSeek-R1-Distill-Llama-70B / Llama-3.3-70B
    c.dim = 8192, c.hidden_dim = 28672, c.n_layers = 80, c.n_heads = 64, c.n_kv_heads = 8, c.head_dim = 128,
    c.vocab_size = 128256, c.rope_theta = 500000.0f;
  } else {  // Llama-3-8B / R1-Llama-8B
    c.dim = 4096, c.hidden_dim = 14336, c.n_layers = 32, c.n_heads = 32, c.n_kv_heads = 8, c.head_dim = 128,
    c.vocab_size = 128256, c.rope_theta = 500000.0f;
  }
  c.rope_dim = c.head_dim;
  c.seq_len = 32768;
  return c;
}

int full_warmup(const Args& a) { return a.warmup >= 0 ? a.warmup : 32; }

bench::RkvOptions rkv_options(const Args& a) {
  bench::RkvOptions o;
  o.budget = a.budget;
  o.overlap = a.rkv_overlap;
  return o;
}

/// The cache of rank `rank` of a.tp (all heads when a.tp is 1).
ThinKvConfig cache_config(const ModelConfig& m, const Args& a, int sequences, int rank = 0) {
  ThinKvConfig c;
  c.num_sequences = sequences;
  c.num_layers = m.n_layers;
  c.num_kv_heads = m.n_kv_heads / a.tp;
  c.num_q_heads = m.n_heads / a.tp;
  c.model_kv_heads = m.n_kv_heads;
  c.kv_head_offset = rank * c.num_kv_heads;
  c.head_dim = m.head_dim;
  c.group_size = 16;
  c.block_size = 16;
  c.segment_len = 128;
  if (a.method == "full") {
    c.max_tokens = a.context + full_warmup(a) + a.steps + 16;
    c.token_budget = 0;
  } else {
    c.max_tokens = 32768;
    c.token_budget = a.budget;
  }
  return c;
}

ScheduledThinKvPolicy thinkv_policy() {
  ScheduledThinKvPolicy p;
  p.precision = kR4E4T2;
  return p;
}

/// A rank's share of the model: its heads and FFN units (the embedding and classifier whole).
ModelConfig rank_slice(ModelConfig c, int tp) {
  c.n_heads /= tp;
  c.n_kv_heads /= tp;
  c.hidden_dim /= tp;
  return c;
}

/// Device bytes a step's buffers take per sequence (gpu_transformer.cpp's layout, rounded up;
/// `c` a rank's slice, plus the partial sums under tensor parallelism).
std::int64_t act_bytes_per_seq(const ModelConfig& c, int tp) {
  const std::int64_t f32 = 4LL * (c.dim + (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() + 2 * c.kv_dim() + c.q_dim() +
                                  2 * c.hidden_dim + c.vocab_size + (tp > 1 ? c.dim : 0));
  return f32 + 2LL * (c.dim + c.q_dim() + c.hidden_dim) + 64;
}
std::int64_t weight_bytes(const ModelConfig& c) {
  const std::int64_t per_layer =
      (std::int64_t{c.q_dim() + 2 * c.kv_dim()} * c.dim + std::int64_t{c.dim} * c.q_dim() + 3LL * c.hidden_dim * c.dim);
  return 2 * (2LL * c.vocab_size * c.dim + c.n_layers * per_layer) + 4LL * c.dim * (2 * c.n_layers + 1);
}

struct Result {
  int batch = 0;
  double step_ms = 0, tokens_per_s = 0, fill_s = 0, warmup_s = 0;
  std::int64_t held_bytes = 0, allocated_bytes = 0, weights = 0, live_tokens = 0;
  GpuStepTimes times;
  CudaKvBackend::DeviceTimes dev;
  bench::RkvTimes rkv;
  std::int64_t tokens = 0;  // generated in the timed steps
  ThinKvStats stats;
  std::uint64_t token_hash = 0;
  std::string error;
};

Result run(const Args& a, const ModelConfig& mc, int batch, Collective* tp) {
  Result r;
  r.batch = batch;
  std::unique_ptr<GpuCache> cache;
  const ThinKvConfig cc = cache_config(mc, a, batch, tp != nullptr ? tp->rank() : 0);
  try {
    if (a.method == "rkv") {
      std::unique_ptr<bench::RkvCache> rc;
      if (Status s = bench::RkvCache::create(cc, rkv_options(a), rc); !s.is_ok()) {
        r.error = s.to_string();
        return r;
      }
      cache = std::move(rc);
    } else if (a.method == "full") {
      cache = std::make_unique<GpuCacheModel<FullKvPolicy>>(cc, FullKvPolicy{});
    } else {
      cache = std::make_unique<GpuCacheModel<ScheduledThinKvPolicy>>(cc, thinkv_policy());
    }
  } catch (const ConfigError& e) {
    r.error = e.status().to_string();
    return r;
  } catch (const BackendError& e) {
    r.error = e.status().to_string();
    return r;
  }
  GpuCache* cp = cache.get();
  std::unique_ptr<GpuTransformer> g;
  GpuDecoderOptions o;
  o.weights = GpuWeightType::kBF16;
  o.reserve = a.method == "full";
  o.tensor_parallel = tp;
  if (Status s = GpuTransformer::create_random(mc, a.seed, std::move(cache), o, g); !s.is_ok()) {
    r.error = s.to_string();
    return r;
  }
  r.weights = g->weight_bytes();
  std::vector<int> seqs, tokens(static_cast<std::size_t>(batch)), next(static_cast<std::size_t>(batch));
  std::vector<int> last(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) last[static_cast<std::size_t>(b)] = 1 + b % (mc.vocab_size - 1);
  std::uint64_t hash = 1469598103934665603ull;
  auto* rkv = dynamic_cast<bench::RkvCache*>(cp);
  // Overlapped R-KV: a sequence whose compression is in flight sits out the step.
  std::vector<int> ready;
  auto runnable = [&](const std::vector<int>& want) -> const std::vector<int>& {
    if (rkv == nullptr || !a.rkv_overlap) return want;
    ready.clear();
    for (int q : want) {
      if (!rkv->busy(q)) ready.push_back(q);
    }
    if (ready.empty()) ready = want;  // nothing else to run: wait on the device
    return ready;
  };
  // Pipelined (default): a step is launched before the previous one is collected, each sequence
  // fed its previous greedy token on the device (its first token from the host).
  std::deque<std::vector<int>> inflight;
  std::vector<char> started(static_cast<std::size_t>(batch), 0);
  auto account = [&](const std::vector<int>& batch_seqs) {
    for (std::size_t i = 0; i < batch_seqs.size(); ++i) {
      last[static_cast<std::size_t>(batch_seqs[i])] = next[i];
      hash = (hash ^ static_cast<std::uint64_t>(batch_seqs[i] + 1) * 0x9E3779B97F4A7C15ull ^
              static_cast<std::uint64_t>(next[i] + 1)) *
             1099511628211ull;
    }
    r.tokens += static_cast<std::int64_t>(batch_seqs.size());
  };
  auto collect_one = [&]() -> Status {
    next.resize(inflight.front().size());
    THINKV_RETURN_IF_ERROR(g->collect(next));
    account(inflight.front());
    inflight.pop_front();
    return Status::ok();
  };
  auto drain = [&]() -> Status {
    while (!inflight.empty()) THINKV_RETURN_IF_ERROR(collect_one());
    return Status::ok();
  };
  auto step = [&](const std::vector<int>& want) -> Status {
    const std::vector<int>& batch_seqs = runnable(want);
    tokens.resize(batch_seqs.size());
    for (std::size_t i = 0; i < batch_seqs.size(); ++i) {
      const auto q = static_cast<std::size_t>(batch_seqs[i]);
      tokens[i] = a.sync || !started[q] ? last[q] : -1;
      started[q] = 1;
    }
    if (a.sync) {
      next.resize(batch_seqs.size());
      THINKV_RETURN_IF_ERROR(g->step(batch_seqs, tokens, next));
      account(batch_seqs);
      return Status::ok();
    }
    THINKV_RETURN_IF_ERROR(g->launch(batch_seqs, tokens));
    inflight.push_back(batch_seqs);
    return inflight.size() >= 2 ? collect_one() : Status::ok();
  };
  auto now = [] { return std::chrono::steady_clock::now(); };
  std::vector<int> all(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) all[static_cast<std::size_t>(b)] = b;
  if (a.method == "full") {
    const auto t0 = now();
    for (int b = 0; b < batch; ++b) {
      if (Status s = g->fill(b, a.context - 1, a.seed * 7919 + static_cast<std::uint64_t>(b)); !s.is_ok()) {
        r.error = "fill of sequence " + std::to_string(b) + ": " + s.to_string();
        return r;
      }
    }
    r.fill_s = std::chrono::duration<double>(now() - t0).count();
    const auto t1 = now();
    for (int t = 0; t < full_warmup(a); ++t) {
      if (Status s = step(all); !s.is_ok()) {
        r.error = "warm-up step " + std::to_string(t) + ": " + s.to_string();
        return r;
      }
    }
    r.warmup_s = std::chrono::duration<double>(now() - t1).count();
  } else {
    const int warm = a.warmup >= 0 ? a.warmup : a.budget + 5 * 128;
    const auto t0 = now();
    for (int t = 0; t < warm; ++t) {
      seqs.clear();
      for (int b = 0; b < batch; ++b) {
        if (t >= b * 128 / batch) seqs.push_back(b);  // joins spread over the first 128 steps
      }
      if (Status s = step(seqs); !s.is_ok()) {
        r.error = "warm-up step " + std::to_string(t) + ": " + s.to_string();
        return r;
      }
    }
    r.warmup_s = std::chrono::duration<double>(now() - t0).count();
  }
  if (Status s = drain(); !s.is_ok()) {
    r.error = "warm-up: " + s.to_string();
    return r;
  }
  const ThinKvStats before = g->stats();
  g->set_timing(true);
  // The backend's device timing (append / attention / TBE selection) on the timed steps.
  auto* backend = [&]() -> CudaKvBackend* {
    if (auto* f = dynamic_cast<GpuCacheModel<FullKvPolicy>*>(cp)) return &f->get().backend();
    if (auto* t = dynamic_cast<GpuCacheModel<ScheduledThinKvPolicy>*>(cp)) return &t->get().backend();
    return nullptr;
  }();
  CudaKvBackend::DeviceTimes d0;
  if (backend != nullptr) {
    backend->set_device_timing(true);
    (void)backend->device_times(d0);
  }
  if (rkv != nullptr) rkv->set_timing(true);
  r.tokens = 0;
  const auto t1 = now();
  for (int t = 0; t < a.steps; ++t) {
    if (Status s = step(all); !s.is_ok()) {
      r.error = "timed step " + std::to_string(t) + ": " + s.to_string();
      return r;
    }
  }
  if (Status s = drain(); !s.is_ok()) {
    r.error = "timed steps: " + s.to_string();
    return r;
  }
  const double secs = std::chrono::duration<double>(now() - t1).count();
  CudaKvBackend::DeviceTimes d1;
  if (backend != nullptr) (void)backend->device_times(d1);
  if (rkv != nullptr) r.rkv = rkv->times();
  r.dev.prepare_ms = (d1.prepare_ms - d0.prepare_ms) / a.steps;
  r.dev.append_ms = (d1.append_ms - d0.append_ms) / a.steps;
  r.dev.attend_ms = (d1.attend_ms - d0.attend_ms) / a.steps;
  r.dev.select_ms = (d1.select_ms - d0.select_ms) / a.steps;
  r.times = g->times();
  r.step_ms = 1e3 * secs / a.steps;
  r.tokens_per_s = static_cast<double>(r.tokens) / secs;
  const ThinKvStats after = g->stats();
  r.stats.eviction_calls = after.eviction_calls - before.eviction_calls;
  r.stats.tokens_evicted = after.tokens_evicted - before.tokens_evicted;
  r.stats.selections = after.selections - before.selections;
  r.stats.transition_events = after.transition_events - before.transition_events;
  const MemoryUsage m = g->memory();
  r.held_bytes = m.physical_bytes();
  r.allocated_bytes = g->cache_device_bytes();
  r.live_tokens = m.live_tokens;
  r.token_hash = hash;
  return r;
}

/// One rank's run (the whole model when tp is nullptr): sizes the batch, runs, and on rank 0
/// prints the results.
int bench_main(const Args& a, Collective* tp) {
  const int rank = tp != nullptr ? tp->rank() : 0;
  cudaDeviceProp prop{};
  int device = 0;
  (void)cudaGetDevice(&device);
  (void)cudaGetDeviceProperties(&prop, device);
  const ModelConfig mc = shape_config(a.shape);
  if (mc.n_kv_heads % a.tp != 0 || mc.hidden_dim % a.tp != 0) {
    std::fprintf(stderr,
                 "bench_decode_throughput: --shape %s has %d KV heads and %d FFN units: --tp %d does not divide them\n",
                 a.shape.c_str(), mc.n_kv_heads, mc.hidden_dim, a.tp);
    return 2;
  }
  const ModelConfig slice = rank_slice(mc, a.tp);
  int batch = a.batch;
  if (batch == 0) {  // the largest batch whose worst-case cache fits beside the weights and buffers
    std::size_t free = 0, total = 0;
    (void)cudaMemGetInfo(&free, &total);
    const std::int64_t margin = std::int64_t{3} << 30;  // cuBLAS, attention workspaces, the context
    std::int64_t left = static_cast<std::int64_t>(free) - weight_bytes(slice) - margin;
    batch = 1;
    for (int it = 0; it < 3; ++it) {
      const std::int64_t kv = left - std::int64_t{batch} * act_bytes_per_seq(slice, a.tp);
      const ThinKvConfig cc = cache_config(mc, a, 1, rank);
      int n = 0;
      if (a.method == "rkv") {
        const bench::RkvOptions ro = rkv_options(a);
        n = static_cast<int>((kv - bench::RkvCache::fixed_bytes(cc, ro)) / bench::RkvCache::bytes_per_sequence(cc, ro));
      } else {
        n = a.method == "full" ? max_sequences(cc, FullKvPolicy{}, kv) : max_sequences(cc, thinkv_policy(), kv);
      }
      batch = std::max(1, std::min(a.max_batch, n));
    }
    if (tp != nullptr) {  // every rank runs the smallest rank's batch
      std::vector<double> each(static_cast<std::size_t>(a.tp), 0.0);
      each[static_cast<std::size_t>(rank)] = batch;
      if (Status s = tp->all_reduce_host(each, nullptr); !s.is_ok()) {
        std::fprintf(stderr, "bench_decode_throughput: rank %d: agreeing on the batch: %s\n", rank,
                     s.to_string().c_str());
        return 1;
      }
      batch = static_cast<int>(*std::min_element(each.begin(), each.end()));
    }
  }
  const Result r = run(a, mc, batch, tp);
  if (!r.error.empty()) {
    std::fprintf(stderr, "bench_decode_throughput: rank %d: %s (batch %d)\n", rank, r.error.c_str(), batch);
    return 1;
  }
  bool same = true;
  if (a.check) {
    const Result again = run(a, mc, batch, tp);
    same = again.error.empty() && again.token_hash == r.token_hash;
    if (!same) std::fprintf(stderr, "bench_decode_throughput: a second run with the same seed gave other tokens\n");
  }
  if (rank != 0) return same ? 0 : 1;
  const double per_seq_held = static_cast<double>(r.held_bytes) / batch;
  const double per_seq_alloc = static_cast<double>(r.allocated_bytes) / batch;
  const double steps = std::max(1, a.steps);
  const double layers = r.times.layers_ms / steps, attn = r.times.attention_ms / steps, head = r.times.head_ms / steps;
  const double hb = r.times.host_begin_ms / steps, he = r.times.host_end_ms / steps, hw = r.times.host_wait_ms / steps;
  const double rkv_score = r.rkv.score_ms / steps, rkv_gather = r.rkv.gather_ms / steps;
  const double allreduce = r.times.allreduce_ms / steps;
  std::fprintf(stderr,
               "%s budget %d context %d batch %d: %.2f ms/step, %.0f tokens/s; KV per sequence held %.1f MiB, "
               "allocated %.1f MiB; device per step: layers (GEMMs + norms) %.2f ms, attention (append + attend) "
               "%.2f ms, head %.2f ms, TBE selection %.3f ms, R-KV scores %.3f ms, R-KV gather %.3f ms; host: "
               "begin_step %.2f ms, end_step %.2f ms, waiting %.2f ms; tensor parallelism %d, all-reduces %.3f ms "
               "(KV per rank)\n",
               a.method.c_str(), a.method == "full" ? 0 : a.budget, a.context, batch, r.step_ms, r.tokens_per_s,
               per_seq_held / 1048576.0, per_seq_alloc / 1048576.0, layers, attn, head, r.dev.select_ms, rkv_score,
               rkv_gather, hb, he, hw, a.tp, allreduce);
  std::printf(
      "{\"method\":\"%s\",\"shape\":\"%s\",\"gpu\":\"%s\",\"budget\":%d,\"context\":%d,\"batch\":%d,\"steps\":%d,"
      "\"step_ms\":%.4f,\"tokens_per_s\":%.1f,\"kv_held_bytes_per_seq\":%.0f,\"kv_allocated_bytes_per_seq\":%.0f,"
      "\"weight_bytes\":%" PRId64 ",\"live_tokens\":%" PRId64
      ",\"layers_ms\":%.4f,\"attention_ms\":%.4f,\"head_ms\":%.4f,"
      "\"dev_append_ms\":%.4f,\"dev_attend_ms\":%.4f,\"dev_prepare_ms\":%.4f,\"dev_select_ms\":%.4f,"
      "\"evictions_per_step\":%.3f,\"tokens_evicted_per_step\":%.1f,\"selections_per_step\":%.1f,"
      "\"transitions_per_step\":%.4f,\"rkv_overlap\":%s,\"rkv_score_ms\":%.4f,\"rkv_gather_ms\":%.4f,"
      "\"compressions_per_step\":%.3f,\"host_begin_ms\":%.4f,\"host_end_ms\":%.4f,\"host_wait_ms\":%.4f,"
      "\"tokens\":%" PRId64 ",\"pipelined\":%s,\"fill_s\":%.2f,\"warmup_s\":%.2f,\"token_hash\":\"%016" PRIx64
      "\",\"repeat_same\":%s,\"tp\":%d,\"allreduce_ms\":%.4f,\"allreduce_share\":%.4f}\n",
      a.method.c_str(), a.shape.c_str(), prop.name, a.method == "full" ? 0 : a.budget, a.context, batch, a.steps,
      r.step_ms, r.tokens_per_s, per_seq_held, per_seq_alloc, r.weights, r.live_tokens, layers, attn, head,
      r.dev.append_ms, r.dev.attend_ms, r.dev.prepare_ms, r.dev.select_ms, r.stats.eviction_calls / steps,
      r.stats.tokens_evicted / steps, r.stats.selections / steps, r.stats.transition_events / steps,
      a.method == "rkv" ? (a.rkv_overlap ? "true" : "false") : "null", rkv_score, rkv_gather,
      static_cast<double>(r.rkv.compressions) / steps, hb, he, hw, r.tokens, a.sync ? "false" : "true", r.fill_s,
      r.warmup_s, r.token_hash, a.check ? (same ? "true" : "false") : "null", a.tp, allreduce,
      r.step_ms > 0 ? allreduce / r.step_ms : 0.0);
  return same ? 0 : 1;
}

/// --tp N: one process per GPU, forked before any CUDA call; rank 0 makes NCCL's group id.
int run_ranks(const Args& a) {
#ifndef THINKV_HAVE_NCCL
  (void)a;
  std::fprintf(stderr, "bench_decode_throughput: --tp %d needs NCCL, and this build found none\n", a.tp);
  return 2;
#else
  const ModelConfig mc = shape_config(a.shape);
  if (mc.n_kv_heads % a.tp != 0 || mc.hidden_dim % a.tp != 0) {
    std::fprintf(stderr,
                 "bench_decode_throughput: --shape %s has %d KV heads and %d FFN units: --tp %d does not divide them\n",
                 a.shape.c_str(), mc.n_kv_heads, mc.hidden_dim, a.tp);
    return 2;
  }
  std::string id;
  if (Status s = NcclCollective::unique_id(id); !s.is_ok()) {
    std::fprintf(stderr, "bench_decode_throughput: %s\n", s.to_string().c_str());
    return 1;
  }
  std::fflush(nullptr);
  std::vector<pid_t> kids;
  for (int r = 0; r < a.tp; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("bench_decode_throughput: fork");
      return 1;
    }
    if (pid == 0) {
      int devices = 0;
      if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < a.tp) {
        if (r == 0)
          std::printf("bench_decode_throughput: --tp %d needs %d GPUs, found %d: skipped\n", a.tp, a.tp, devices);
        std::fflush(nullptr);
        _exit(77);
      }
      int rc = 1;
      if (cudaSetDevice(r) == cudaSuccess) {
        std::unique_ptr<NcclCollective> comm;
        if (Status s = NcclCollective::create(id, r, a.tp, std::chrono::minutes(5), comm); !s.is_ok()) {
          std::fprintf(stderr, "bench_decode_throughput: %s\n", s.to_string().c_str());
        } else {
          rc = bench_main(a, comm.get());
          if (rc != 0) comm->abort("rank " + std::to_string(r) + " failed");
        }
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    kids.push_back(pid);
  }
  int worst = 0;
  bool all_skipped = true;
  for (const pid_t k : kids) {
    int st = 0;
    (void)waitpid(k, &st, 0);
    const int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    all_skipped = all_skipped && rc == 77;
    if (rc != 77) worst = std::max(worst, rc);
  }
  return all_skipped ? 77 : worst;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse(argc, argv, a)) return 2;
  if (a.tp > 1) return run_ranks(a);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: bench_decode_throughput skipped\n");
    return 77;
  }
  return bench_main(a, nullptr);
}
