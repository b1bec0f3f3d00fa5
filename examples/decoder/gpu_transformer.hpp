#pragma once
/// \file gpu_transformer.hpp
/// The Llama forward pass on one GPU for a batch of sequences, with every attention inside
/// ThinKV's device cache (BasicThinKvCache over CudaKvBackend, driven by its batched calls):
///
///   x = embedding[tokens]                                   [batch, dim]
///   cache.begin_step(seqs)
///   per layer:  xb = RMSNorm(x)  ->  qkv = Wqkv xb  (one GEMM: wq, wk, wv stacked)
///               q, k, v = RoPE split of qkv (positions: the cache's, per sequence)
///               cache.append_batch(layer, seqs, k, v); cache.attend_batch(layer, seqs, q, att)
///               x += Wo att;  h = W13 RMSNorm(x) (w1, w3 stacked);  x += W2 (silu(h1) * h3)
///   cache.end_step(seqs)                                    (thought refresh, TBE)
///   logits = Wout RMSNorm(x);  next = argmax(logits)
///
/// The same computation as transformer.hpp (the CPU decoder), row for row. Weights are FP32 or
/// BF16 on the device (GpuWeightType), the GEMMs are cuBLAS's with FP32 accumulation (no TF32),
/// activations are FP32. Continuous batching: a step takes any subset of the cache's sequences,
/// each at its own position; a sequence in its prompt simply ignores its logits; reset_sequence
/// frees one whose generation ended (its blocks return to the shared pools) so a new one can
/// start in its place.
///
/// Declared without CUDA headers (the device state lives behind a pointer); defined in
/// gpu_transformer.cpp and gpu_kernels.cu, target thinkv_gpu_decoder (CUDA builds only).
/// Everything is enqueued on one stream the transformer owns; step() waits for its own results.
/// Errors come back as a Status: kCudaError naming the call, kPoolExhausted for device memory,
/// kNonFinite naming the sequence whose keys, values or logits were not finite.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "collective.hpp"
#include "gpu_cache.hpp"
#include "model.hpp"
#include "session.hpp"
#include "thinkv/status.hpp"
#include "thinkv/thinkv_cache.hpp"
#include "thinkv_spec.hpp"

namespace thinkv::decoder {

/// Element type of the weights on the device.
enum class GpuWeightType : std::uint8_t { kF32, kBF16 };

inline const char* to_string(GpuWeightType t) noexcept { return t == GpuWeightType::kF32 ? "f32" : "bf16"; }

struct GpuDecoderOptions {
  GpuWeightType weights = GpuWeightType::kBF16;
  /// Allocate the cache's whole pool ranges at creation (CudaKvBackend::reserve_storage): for a
  /// batch sized to the device's memory, where growing by copies would need old and new at once.
  bool reserve = false;
  /// Tensor parallelism (collective.hpp): this decoder is rank tp->rank() of tp->size(), one per
  /// GPU (or per stream), each holding a slice of every layer: query, key and value heads
  /// (whole KV heads with their query heads: wq, wk, wv split by rows), the matching columns of
  /// wo, the FFN's hidden units (w1, w3 by rows, w2 by columns); the embedding, the norms and the
  /// classifier are whole on every rank. Attention's and the FFN's partial outputs are summed
  /// over the ranks (Collective::all_reduce, two per layer), so every rank holds the same
  /// residual stream and the same logits. The cache is the rank's slice
  /// (tensor_parallel_slice), its thought signal summed over the ranks on refresh steps, so
  /// every rank takes the same thought, segment and eviction decisions. Every rank must make the
  /// same calls (steps, launches, collects, resets) in the same order. A failure other than a
  /// sequence's non-finite values (kNonFinite) aborts the group (Collective::abort): the other
  /// ranks' next collective fails instead of waiting. nullptr: the whole model on one GPU.
  /// Must outlive the decoder.
  Collective* tensor_parallel = nullptr;
};

/// Device time by part, summed over the steps since set_timing(true) (CUDA events on the stream;
/// layer 0's parts are timed and scaled to all layers' time, the layers being alike).
struct GpuStepTimes {
  double attention_ms = 0.0;  ///< the cache's append_batch + attend_batch
  double layers_ms = 0.0;     ///< everything else of the layers: GEMMs, norms, RoPE, SiLU
  double head_ms = 0.0;       ///< final norm, classifier GEMM, argmax and the copies back
  /// Tensor parallelism: the layers' all-reduces, included in layers_ms (layer 0's two, times the
  /// layers), as this rank's stream sees them: the transfer and the wait for the slowest rank.
  double allreduce_ms = 0.0;
  // Host wall time (std::chrono), summed likewise: where a host-bound step spends it.
  double host_begin_ms = 0.0;  ///< the cache's begin_step (plans, commits, uploads)
  double host_end_ms = 0.0;    ///< the cache's end_step (refreshes, eviction plans, launches)
  double host_wait_ms = 0.0;   ///< waiting for the device at the end of the step
  double wall_ms = 0.0;        ///< the whole step
  int steps = 0;
};

class GpuTransformer {
 public:
  /// Uploads `model`'s weights (converted to options.weights) and builds the cache `cache`
  /// describes (its num_sequences is the largest batch; its shape must be the model's; under
  /// tensor parallelism this rank's slice of it is built).
  [[nodiscard]] static Status create(const Model& model, const ThinKvSpec& cache, const GpuDecoderOptions& options,
                                     std::unique_ptr<GpuTransformer>& out);
  /// The same over a cache of the caller's (any policy set: GpuCacheModel<P>); under tensor
  /// parallelism it must be configured as tensor_parallel_slice says for this rank.
  [[nodiscard]] static Status create(const Model& model, std::unique_ptr<GpuCache> cache,
                                     const GpuDecoderOptions& options, std::unique_ptr<GpuTransformer>& out);
  /// The same with weights drawn uniform in +-1/sqrt(fan-in) from `seed` on the device, for
  /// throughput at shapes whose values do not matter (norm weights 1). Each weight is a hash of
  /// its index in the whole matrix, so ranks of tensor parallelism hold slices of the model one
  /// GPU holds with the same seed.
  [[nodiscard]] static Status create_random(const ModelConfig& config, std::uint64_t seed,
                                            std::unique_ptr<GpuCache> cache, const GpuDecoderOptions& options,
                                            std::unique_ptr<GpuTransformer>& out);
  ~GpuTransformer();
  GpuTransformer(const GpuTransformer&) = delete;
  GpuTransformer& operator=(const GpuTransformer&) = delete;

  [[nodiscard]] const ModelConfig& config() const noexcept;
  /// The largest batch of a step (the cache's num_sequences).
  [[nodiscard]] int max_batch() const noexcept;

  /// One forward pass for a batch: sequence seqs[b] (distinct, each 0 .. max_batch - 1) takes
  /// tokens[b] at its current position. next[b] gets the greedy next token (argmax, first on
  /// ties); `logits`, when not empty, [seqs.size() * vocab] on the host, gets the logits. Waits
  /// for the results. A sequence whose K/V or logits are not finite fails the step with
  /// kNonFinite naming it (the others' tokens are still written; reset_sequence frees it).
  [[nodiscard]] Status step(std::span<const int> seqs, std::span<const int> tokens, std::span<int> next,
                            std::span<float> logits = {});
  /// Pipelined decoding: launch enqueues a step and returns without waiting for the device, so
  /// the host plans the next step (the cache's begin_step / end_step) while this one runs;
  /// collect waits for the oldest launched step and writes its greedy tokens (its batch order).
  /// At most two steps are launched and not collected. `tokens` as in step(), where -1 (or an
  /// empty span: all) makes a sequence take its own previous greedy token, read on the device (no
  /// round trip; 0 before its first step); the cache's token hints are then its last collected.
  /// A launch that fails changes nothing that a collect would see; a K/V fault of a pipelined
  /// step may surface at the next collect (faulted() names the sequence, kNonFinite as step()).
  /// step() is launch + collect and needs nothing in flight.
  [[nodiscard]] Status launch(std::span<const int> seqs, std::span<const int> tokens = {});
  [[nodiscard]] Status collect(std::span<int> next);
  /// Frees a sequence (its blocks return to the pools); it starts again at position 0.
  [[nodiscard]] Status reset_sequence(int seq);
  /// For benchmarks: gives a fresh sequence a prompt of `tokens` random keys and values (drawn
  /// from `seed` on the device), stored without attention and without running the model
  /// (BasicThinKvCache::prefill, store only), to reach a context length without decoding it.
  /// The prompt is pinned like any prompt (never evicted). Waits for it. A sequence that is not at
  /// position 0 is refused (kInvalidArgument): reset_sequence it first.
  [[nodiscard]] Status fill(int seq, int tokens, std::uint64_t seed);
  /// The cache (its state, its statistics).
  [[nodiscard]] GpuCache& cache() noexcept;
  /// Free device memory now (cudaMemGetInfo), -1 when it cannot be read.
  [[nodiscard]] static std::int64_t free_device_bytes();
  /// Waits for the cache's pending work (TBE selections) and applies it.
  [[nodiscard]] Status settle();

  [[nodiscard]] std::int32_t position(int seq) const;
  [[nodiscard]] std::int64_t live_tokens(int seq) const;
  [[nodiscard]] MemoryUsage memory(int seq) const;
  [[nodiscard]] MemoryUsage memory() const;
  [[nodiscard]] const ThinKvStats& stats() const;
  [[nodiscard]] std::int64_t weight_bytes() const noexcept;      ///< device bytes of the weights
  [[nodiscard]] std::int64_t activation_bytes() const noexcept;  ///< device bytes of the step's buffers
  /// Bytes the cache's backend holds on the device (pages, records, staging, metadata mirror).
  [[nodiscard]] std::int64_t cache_device_bytes() const;

  void set_timing(bool on);
  /// Sum of the parts over the steps since set_timing(true) (drains the stream once per step).
  [[nodiscard]] GpuStepTimes times() const noexcept;

 private:
  struct Impl;
  friend EngineFactory gpu_engine(const Model& model, GpuDecoderOptions options);
  explicit GpuTransformer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// A RunOptions::engine (session.hpp) that runs each sequence on the GPU decoder: run_sequence
/// then decodes on the GPU with ThinKV's device cache (the CLI's --backend cuda). `model` must
/// outlive the factory.
[[nodiscard]] EngineFactory gpu_engine(const Model& model, GpuDecoderOptions options = {});

}  // namespace thinkv::decoder
