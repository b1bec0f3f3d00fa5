#pragma once
/// \file session.hpp
/// Decoding loops over a Transformer and a KV cache of any method (ThinKV's or a baseline's,
/// methods.hpp), shared by `thinkv generate`, `eval`, `trace` and the tests:
///  - run_sequence: prompt, then `steps` generated tokens (greedy, sampled, or teacher-forced),
///    with per-step hooks and the cache statistics the CLI reports;
///  - measure_fidelity: a mode against FullKV on the same prompt: greedy token agreement
///    (both free-running), mean KL(full || mode) of the next-token distribution teacher-forced
///    on the FullKV tokens, and the first step where the greedy tokens differ.
///
/// Step convention (llama2.c's): a prompt of P tokens (BOS first) and N generated tokens take
/// P + N - 1 forward passes; the logits of the pass at position P - 1 + i choose generated
/// token i. Generation stops early when BOS or EOS is chosen (run.c stops at BOS; EOS ends a
/// text too), unless `stop_at_bos_eos` is off.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "methods.hpp"
#include "model.hpp"
#include "sampler.hpp"
#include "thinkv/backend/kv_backend.hpp"
#include "thinkv/decode_cache.hpp"
#include "thinkv/thinkv_cache.hpp"
#include "transformer.hpp"

namespace thinkv::decoder {

/// What the CLI and the tests read of a session's ThinKV cache, whatever its policy set.
class ThinKvState {
 public:
  virtual ~ThinKvState() = default;
  [[nodiscard]] virtual std::int64_t live_tokens(int seq) const = 0;
  [[nodiscard]] virtual std::int32_t position(int seq) const = 0;
  [[nodiscard]] virtual std::span<const float> layer_sparsity(int seq) const = 0;
  [[nodiscard]] virtual const ThinKvStats& stats() const = 0;
  [[nodiscard]] virtual MemoryUsage memory(int seq) const = 0;
  [[nodiscard]] virtual BlockTableStats table_stats() const = 0;
  [[nodiscard]] virtual ThoughtStats thought_stats(int seq) const = 0;
  [[nodiscard]] virtual std::vector<SegmentState> segments(int seq) const = 0;
};

/// ThinKV's cache as a session builds it: BasicThinKvCache for the spec's policy set over a
/// backend chosen at run time (CPU by default; the CLI's --backend cuda gives CudaKvBackend),
/// behind the DecodeCache interface.
template <cache_policy P>
class ThinKvSession final : public DecodeCacheModel<BasicThinKvCache<P, DynamicBackend>>, public ThinKvState {
  using Base = DecodeCacheModel<BasicThinKvCache<P, DynamicBackend>>;

 public:
  ThinKvSession(const ThinKvConfig& c, P policy, DynamicBackend b) : Base(c, std::move(policy), std::move(b)) {}
  std::int64_t live_tokens(int seq) const override { return this->get().live_tokens(seq); }
  std::int32_t position(int seq) const override { return this->get().position(seq); }
  std::span<const float> layer_sparsity(int seq) const override { return this->get().layer_sparsity(seq); }
  const ThinKvStats& stats() const override { return this->get().stats(); }
  MemoryUsage memory(int seq) const override { return this->get().memory(seq); }
  BlockTableStats table_stats() const override { return this->get().paged().table().stats(); }
  ThoughtStats thought_stats(int seq) const override { return this->get().tracker(seq).stats(); }
  std::vector<SegmentState> segments(int seq) const override { return this->get().segments(seq); }
};
/// Makes the backend of each ThinKV cache a session builds (empty: CpuKvBackend).
using BackendFactory = std::function<std::unique_ptr<KvBackend>()>;

/// The ThinKV cache behind a session's DecodeCache, or null when the method is a baseline.
inline const ThinKvState* thinkv_of(const DecodeCache& c) { return dynamic_cast<const ThinKvState*>(&c); }

/// Builds a session cache; a ConfigError or a backend that cannot initialise becomes a Status.
/// `backend` serves ThinKV's cache; the baselines are CPU reference implementations.
inline Status make_session_cache(const CacheSpec& spec, const BackendFactory& backend,
                                 std::unique_ptr<DecodeCache>& out) {
  try {
    if (const auto* t = std::get_if<ThinKvSpec>(&spec)) {
      std::unique_ptr<KvBackend> b = backend ? backend() : std::make_unique<BackendModel<CpuKvBackend>>();
      if (!b) return {StatusCode::kInvalidArgument, "the backend factory returned no backend"};
      with_policy(*t, [&]<class P>(const P& policy) {
        out = std::make_unique<ThinKvSession<P>>(t->config(), policy, DynamicBackend(std::move(b)));
      });
    } else if (const auto* d = std::get_if<DenseKvConfig>(&spec)) {
      out = std::make_unique<DecodeCacheModel<DenseKvCache>>(*d);
    } else {
      out = std::make_unique<DecodeCacheModel<KiviCache>>(std::get<KiviConfig>(spec));
    }
  } catch (const ConfigError& e) {
    return e.status();
  } catch (const BackendError& e) {  // the backend could not set itself up (no device, no memory)
    return e.status();
  }
  return Status::ok();
}

/// A forward pass that runs elsewhere than the CPU Transformer over a session cache (the CLI's
/// --backend cuda: the GPU decoder, gpu_transformer.hpp), one sequence: forward() takes the
/// token at the next position and writes the next-token logits, as Transformer::forward does.
class ForwardEngine {
 public:
  virtual ~ForwardEngine() = default;
  [[nodiscard]] virtual Status forward(int token, std::span<float> logits) = 0;
  [[nodiscard]] virtual std::string method_name() const = 0;
  [[nodiscard]] virtual CacheReport report() const = 0;
  [[nodiscard]] virtual std::int32_t position() const = 0;
  /// ThinKV's cache state (the engine's cache is always ThinKV's).
  [[nodiscard]] virtual const ThinKvState& state() const = 0;
};
/// Builds the engine of one run for a ThinKV cache spec.
using EngineFactory = std::function<Status(const ThinKvSpec& spec, std::unique_ptr<ForwardEngine>& out)>;

struct RunOptions {
  int steps = 0;             ///< tokens to generate
  float temperature = 0.0f;  ///< 0 = greedy
  std::uint64_t seed = 0;
  /// Teacher forcing: when set, generated token i is forced[i] (the run has forced->size()
  /// steps at most and `steps` is ignored); the logits are still computed and reported.
  const std::vector<int>* forced = nullptr;
  bool stop_at_bos_eos = true;
  int bos_id = 1;
  int eos_id = 2;
  int threads = 1;
  KvHook kv_hook;
  /// Called with each generated token (after it is chosen) and the token before it.
  std::function<void(int prev, int token)> on_token;
  /// Called with the logits that choose generated token `step`.
  std::function<void(int step, std::span<const float> logits)> on_logits;
  /// Called after every forward pass that produced logits for generated token `step`
  /// (thinkv_of(cache) gives ThinKV's own state).
  std::function<Status(int step, const DecodeCache& cache)> after_step;
  /// Called after every forward pass that produced logits, on either path (after after_step).
  std::function<void(int step)> on_step;
  /// Backend of the ThinKV caches the run builds (empty: CpuKvBackend; baselines need it empty).
  BackendFactory backend;
  /// When set, run_sequence runs the model through this engine instead of the CPU Transformer
  /// (ThinKV specs only; after_step and kv_hook are not called, on_step is).
  EngineFactory engine;
};

struct RunStats {
  std::vector<int> tokens;  ///< generated tokens
  int prompt_tokens = 0;
  int forward_passes = 0;
  double seconds = 0.0;                  ///< wall time of all forward passes
  double prompt_seconds = 0.0;           ///< of which the prompt's passes (up to the first generated token's logits)
  std::string method;                    ///< the cache's method_name()
  CacheReport report;                    ///< the cache's report at the end (every method)
  std::int64_t peak_physical_bytes = 0;  ///< largest report().held_bytes after a step
  std::int64_t max_live_tokens = 0;      ///< largest live tokens of one stream (stream 0's for ThinKV)
  std::int64_t steps_over_budget = 0;    ///< steps that ended with more live tokens than the budget
  // ThinKV's cache only (zero for the baselines):
  MemoryUsage final_memory;
  ThinKvStats cache_stats;
  BlockTableStats table_stats;
  ThoughtStats thought_stats;
  std::vector<SegmentState> segments;  ///< the sequence's thought segments at the end
  /// FullKV FP16 bytes of every position the sequence holds (what an uncompressed cache keeps).
  std::int64_t fullkv_fp16_bytes_all_positions = 0;
};

/// FP16 bytes of K and V for `positions` tokens in every layer and KV head.
inline std::int64_t fullkv_fp16_bytes(const ModelConfig& c, std::int64_t positions) {
  return positions * c.n_layers * c.n_kv_heads * 2 * std::int64_t{c.head_dim} * 2;
}

/// Live tokens of one stream of sequence 0: stream 0's for ThinKV (all its streams hold the same
/// number), the mean over streams for the baselines.
inline std::int64_t stream_live_tokens(const DecodeCache& c) {
  if (const ThinKvState* t = thinkv_of(c)) return t->live_tokens(0);
  return c.report(0).live_tokens / std::max(1, c.shape().streams_per_sequence());
}

/// Runs one sequence from `prompt` (non-empty) on a fresh cache built from `spec`.
inline Status run_sequence(const Model& model, const CacheSpec& spec, const std::vector<int>& prompt,
                           const RunOptions& opt, RunStats& out) {
  if (prompt.empty()) return {StatusCode::kInvalidArgument, "the prompt has no tokens (it needs at least BOS)"};
  std::unique_ptr<DecodeCache> cache;
  std::unique_ptr<ForwardEngine> engine;
  if (opt.engine) {
    const auto* t = std::get_if<ThinKvSpec>(&spec);
    if (t == nullptr) return {StatusCode::kInvalidArgument, "this engine runs ThinKV's cache, not a baseline"};
    THINKV_RETURN_IF_ERROR(opt.engine(*t, engine));
  } else {
    THINKV_RETURN_IF_ERROR(make_session_cache(spec, opt.backend, cache));
  }
  Transformer tf(model, opt.threads);
  if (opt.kv_hook) tf.set_kv_hook(opt.kv_hook);
  auto report = [&] { return engine ? engine->report() : cache->report(0); };
  const ThinKvState* state = engine ? &engine->state() : thinkv_of(*cache);
  const int steps = opt.forced != nullptr ? static_cast<int>(opt.forced->size()) : opt.steps;
  const int P = static_cast<int>(prompt.size());
  const int max_tokens = spec_max_tokens(spec);
  if (P + steps - 1 > max_tokens) {
    return {StatusCode::kInvalidArgument, "prompt (" + std::to_string(P) + " tokens) + " + std::to_string(steps) +
                                              " steps exceed the cache's max_tokens " + std::to_string(max_tokens)};
  }
  RunStats st;
  st.prompt_tokens = P;
  st.method = engine ? engine->method_name() : cache->method_name();
  std::vector<float> logits(static_cast<std::size_t>(model.config.vocab_size));
  Sampler sampler(opt.temperature, opt.seed);
  int budget = 0;
  if (const auto* t = std::get_if<ThinKvSpec>(&spec)) budget = evicts(t->mode) ? t->token_budget : 0;
  if (const auto* d = std::get_if<DenseKvConfig>(&spec)) budget = d->token_budget;
  const auto t0 = std::chrono::steady_clock::now();
  int token = prompt[0];
  for (int pos = 0; steps > 0; ++pos) {
    THINKV_RETURN_IF_ERROR(engine ? engine->forward(token, logits) : tf.forward(*cache, 0, token, logits));
    ++st.forward_passes;
    if (pos < P - 1) {
      token = prompt[static_cast<std::size_t>(pos + 1)];
      continue;
    }
    const int step = pos - (P - 1);
    if (step == 0) st.prompt_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (opt.on_logits) opt.on_logits(step, logits);
    st.peak_physical_bytes = std::max(st.peak_physical_bytes, report().held_bytes);
    const std::int64_t live = engine ? state->live_tokens(0) : stream_live_tokens(*cache);
    st.max_live_tokens = std::max(st.max_live_tokens, live);
    if (budget > 0 && live > budget) ++st.steps_over_budget;
    if (opt.after_step && cache) THINKV_RETURN_IF_ERROR(opt.after_step(step, *cache));
    if (opt.on_step) opt.on_step(step);
    const int next = opt.forced != nullptr ? (*opt.forced)[static_cast<std::size_t>(step)] : sampler.sample(logits);
    if (opt.forced == nullptr && opt.stop_at_bos_eos && (next == opt.bos_id || next == opt.eos_id)) break;
    st.tokens.push_back(next);
    if (opt.on_token) opt.on_token(token, next);
    token = next;
    if (static_cast<int>(st.tokens.size()) >= steps) break;
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.report = report();
  if (const ThinKvState* t = state) {
    st.final_memory = t->memory(0);
    st.cache_stats = t->stats();
    st.table_stats = t->table_stats();
    st.thought_stats = t->thought_stats(0);
    st.segments = t->segments(0);
  }
  st.fullkv_fp16_bytes_all_positions =
      fullkv_fp16_bytes(model.config, engine ? engine->position() : cache->position(0));
  out = std::move(st);
  return Status::ok();
}

struct Fidelity {
  int steps = 0;                 ///< generated tokens of the FullKV run (the reference length)
  double token_agreement = 0.0;  ///< share of steps i < steps where both greedy runs chose the same token
  double mean_kl = 0.0;          ///< mean over steps of KL(full || mode), teacher-forced on the FullKV tokens
  double max_kl = 0.0;
  int first_divergence = -1;  ///< first step where the greedy tokens differ (-1: none)
  std::vector<int> full_tokens;
  std::vector<int> mode_tokens;
  std::vector<double> kl;  ///< per step
};

/// Compares `mode_cfg` with `full_cfg` (FullKV) on `prompt` for `steps` greedy tokens. The
/// FullKV run and the mode run teacher-forced on its tokens go in lockstep (no logits are
/// stored); the mode's own free-running greedy tokens come from `mode_tokens` when the caller
/// already has them (a greedy run of the same configuration), else from a third pass.
inline Status measure_fidelity(const Model& model, const CacheSpec& full_cfg, const CacheSpec& mode_cfg,
                               const std::vector<int>& prompt, int steps, const RunOptions& base,
                               const std::vector<int>* mode_tokens, Fidelity& out) {
  if (prompt.empty()) return {StatusCode::kInvalidArgument, "the prompt has no tokens"};
  if (steps < 1) return {StatusCode::kInvalidArgument, "fidelity needs at least one step"};
  std::unique_ptr<DecodeCache> full, mode;
  THINKV_RETURN_IF_ERROR(make_session_cache(full_cfg, base.backend, full));
  THINKV_RETURN_IF_ERROR(make_session_cache(mode_cfg, base.backend, mode));
  Transformer tf(model, base.threads);
  Transformer tm(model, base.threads);
  if (base.kv_hook) tm.set_kv_hook(base.kv_hook);
  Fidelity f;
  std::vector<float> lf(static_cast<std::size_t>(model.config.vocab_size)), lm(lf.size());
  const int P = static_cast<int>(prompt.size());
  int token = prompt[0];
  double kl_sum = 0.0;
  for (int pos = 0;; ++pos) {
    THINKV_RETURN_IF_ERROR(tf.forward(*full, 0, token, lf));
    THINKV_RETURN_IF_ERROR(tm.forward(*mode, 0, token, lm));
    if (pos < P - 1) {
      token = prompt[static_cast<std::size_t>(pos + 1)];
      continue;
    }
    const double kl = kl_divergence(lf, lm);
    f.kl.push_back(kl);
    kl_sum += kl;
    f.max_kl = std::max(f.max_kl, kl);
    const int next = argmax(lf);
    if (base.stop_at_bos_eos && (next == base.bos_id || next == base.eos_id)) break;
    f.full_tokens.push_back(next);
    token = next;
    if (static_cast<int>(f.full_tokens.size()) >= steps) break;
  }
  f.steps = static_cast<int>(f.full_tokens.size());
  f.mean_kl = f.kl.empty() ? 0.0 : kl_sum / static_cast<double>(f.kl.size());
  if (mode_tokens != nullptr) {
    f.mode_tokens = *mode_tokens;
  } else {
    RunOptions o = base;
    o.steps = steps;
    o.temperature = 0.0f;
    o.forced = nullptr;
    o.on_token = nullptr;
    o.on_logits = nullptr;
    o.after_step = nullptr;
    RunStats rs;
    THINKV_RETURN_IF_ERROR(run_sequence(model, mode_cfg, prompt, o, rs));
    f.mode_tokens = std::move(rs.tokens);
  }
  int same = 0;
  const std::size_t n = std::max(f.full_tokens.size(), f.mode_tokens.size());
  for (std::size_t i = 0; i < n; ++i) {
    const bool both = i < f.full_tokens.size() && i < f.mode_tokens.size();
    if (both && f.full_tokens[i] == f.mode_tokens[i]) {
      if (i < f.full_tokens.size()) ++same;
    } else if (f.first_divergence < 0) {
      f.first_divergence = static_cast<int>(i);
    }
  }
  f.token_agreement = f.steps > 0 ? static_cast<double>(same) / f.steps : 1.0;
  out = std::move(f);
  return Status::ok();
}

}  // namespace thinkv::decoder
