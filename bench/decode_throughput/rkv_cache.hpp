#pragma once
/// \file rkv_cache.hpp
/// thinkv::bench::RkvCache: an R-KV-style KV cache on the GPU (Cai et al., "R-KV: Redundancy-aware
/// KV Cache Compression for Reasoning Models", 2025), the token-eviction baseline of the
/// end-to-end throughput benchmark. It is not part of the library: it exists so that
/// bench_decode_throughput can put ThinKV beside a well-implemented R-KV on the same decoder,
/// the same attention kernel and the same GPU.
///
/// What it does (written from the paper's description, not from its code):
///  - Each (sequence, layer, KV head) stream holds at most budget + buffer tokens in BF16, in
///    fixed pages of 16 tokens (the library's BF16 page layout), attended by the library's paged
///    decode-attention kernel over the whole batch in one launch per layer.
///  - When a sequence's streams reach budget + buffer tokens (every `buffer` = 128 decoded tokens
///    once past the budget), the sequence is compressed, every stream on its own:
///      importance  a_j = the softmax attention of the last `window` queries of the stream's query
///                  heads to key j (causal within the window), averaged over those queries and heads,
///                  max-pooled over `kernel` neighbouring keys;
///      redundancy  r_j = the mean over i of cos(k_j, k_i) (i != j), the largest-index i with a
///                  similarity above `threshold` left out, then a softmax over j;
///      score       lambda a_j - (1 - lambda) r_j; the last `window` tokens are always kept, the
///                  other budget - window are the highest scores;
///    and the kept tokens are gathered, in their order, to the front of the stream's pages (the
///    gather-compaction that Continuous Thinking avoids). The pairwise similarities are one
///    batched BF16 GEMM (cuBLAS, FP32 accumulation) per 64 streams.
///  - Sequential mode compresses on the decoder's stream right after the step that filled the
///    buffer; overlapped mode compresses on a second stream while the next step runs without the
///    sequence (busy(seq) is true until then; the bench leaves it out of that step, and a step
///    that includes it waits for the compression on the device).
/// Limits (a benchmark's): K/V and queries in FP32 only, no prompt (prefill is refused), no
/// NaN/Inf check, head_dim 128 or 64, block size 16.

#include <cstdint>
#include <memory>
#include <vector>

#include "decoder/gpu_cache.hpp"

namespace thinkv::bench {

struct RkvOptions {
  int budget = 1024;       ///< tokens a stream keeps after a compression (multiple of 16)
  int buffer = 128;        ///< tokens decoded between compressions (multiple of 16 and of window)
  int window = 8;          ///< observation window: queries scored, newest keys always kept
  int kernel = 7;          ///< max-pool width of the importance (odd)
  float lambda = 0.1f;     ///< weight of the importance against the redundancy
  float threshold = 0.5f;  ///< cosine similarity above which two keys count as redundant
  bool overlap = false;    ///< compress on a second stream, overlapped with the next step
  int chunk_streams = 64;  ///< streams per batched GEMM and selection launch (scratch size)
};

/// Compressions since set_timing(true), and their device time (CUDA events; sequential mode
/// only, where timing them costs nothing: overlapped, the times stay 0).
struct RkvTimes {
  double score_ms = 0;            ///< key normalisation, similarities (GEMM), importance, redundancy
  double gather_ms = 0;           ///< selection (sort) and gather-compaction
  std::int64_t compressions = 0;  ///< sequences compressed
};

class RkvCache final : public decoder::GpuCache {
 public:
  /// `shape`: num_sequences, num_layers, num_kv_heads, num_q_heads, head_dim (the rest unused).
  /// Allocates everything on the current device now. kInvalidArgument naming a bad option,
  /// kBackend when the device memory runs out.
  [[nodiscard]] static Status create(const ThinKvConfig& shape, const RkvOptions& options,
                                     std::unique_ptr<RkvCache>& out);
  /// Device bytes one sequence's storage takes (pages, metadata, window queries).
  [[nodiscard]] static std::int64_t bytes_per_sequence(const ThinKvConfig& shape, const RkvOptions& options);
  /// Device bytes independent of the batch (compression scratch, attention workspace bound).
  [[nodiscard]] static std::int64_t fixed_bytes(const ThinKvConfig& shape, const RkvOptions& options);
  ~RkvCache() override;

  [[nodiscard]] const RkvOptions& options() const noexcept;
  /// Overlapped mode: the sequence's compression has not finished on the device.
  [[nodiscard]] bool busy(int seq) const;
  void set_timing(bool on);
  [[nodiscard]] RkvTimes times() const;
  /// For tests: the old token indices the last compression of a stream kept, in their new order
  /// (budget entries), and a stream's live K and V rows as BF16 bits ([tokens, D] each).
  [[nodiscard]] Status kept_indices(int seq, int layer, int kv_head, std::vector<std::int32_t>& out) const;
  [[nodiscard]] Status read_stream(int seq, int layer, int kv_head, std::vector<std::uint16_t>& k,
                                   std::vector<std::uint16_t>& v) const;
  /// For tests: the window queries of (seq, layer) in ring order ([window, Hq, D] FP32; ring
  /// slot r holds the query of the token at cache index i with i % window == r).
  [[nodiscard]] Status read_window(int seq, int layer, std::vector<float>& q) const;
  /// Tokens a sequence's streams hold now.
  [[nodiscard]] int stored(int seq) const;

  // decoder::GpuCache
  const ThinKvConfig& config() const override;
  Status set_stream(CUstream_st* stream) override;
  Status reserve_storage() override;
  Status begin_step(std::span<const int> seqs, std::span<const TokenHint> hints) override;
  Status append_batch(int l, std::span<const int> seqs, TensorRef k, TensorRef v) override;
  Status attend_batch(int l, std::span<const int> seqs, TensorRef q, MutableTensorRef out) override;
  Status end_step(std::span<const int> seqs) override;
  Status begin_prompt(int seq, int tokens) override;
  Status prefill(int l, int seq, TensorRef q, TensorRef k, TensorRef v, MutableTensorRef out) override;
  Status end_prompt(int seq) override;
  Status poll_faults(bool wait) override;
  bool faulted(int seq) const override;
  Status reset_sequence(int seq) override;
  Status settle() override;
  std::int32_t position(int seq) const override;
  std::int64_t live_tokens(int seq) const override;
  MemoryUsage memory(int seq) const override;
  MemoryUsage memory() const override;
  const ThinKvStats& stats() const override;
  std::int64_t device_bytes() const override;
  std::string method_name() const override;
  CacheReport report(int seq) const override;
  BlockTableStats table_stats() const override;
  ThoughtStats thought_stats(int seq) const override;
  std::vector<SegmentState> segments(int seq) const override;
  std::span<const float> layer_sparsity(int seq) const override;

  struct Impl;

 private:
  RkvCache();
  std::unique_ptr<Impl> impl_;
};

}  // namespace thinkv::bench
