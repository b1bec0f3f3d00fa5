#pragma once
/// \file gpu_cache.hpp
/// The cache the GPU decoder (gpu_transformer.hpp) drives: ThinKV's BasicThinKvCache over
/// CudaKvBackend for any policy set, behind one small interface, so that the decoder is compiled
/// once and a program can hand it a cache of its own policies (a benchmark's scheduled
/// classifier, a user's classifier reading the tokens). CUDA-free: the backend keeps its device
/// state behind a pointer. make_gpu_cache() builds the cache a ThinKvSpec (the CLI's sets)
/// describes; GpuCacheModel<P> any other.

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "thinkv/backend/cuda_backend.hpp"
#include "thinkv/thinkv_cache.hpp"
#include "thinkv_spec.hpp"

namespace thinkv::decoder {

/// What the GPU decoder needs of its cache (the calls of BasicThinKvCache it makes).
class GpuCache {
 public:
  virtual ~GpuCache() = default;
  [[nodiscard]] virtual const ThinKvConfig& config() const = 0;
  /// The stream every batched call is enqueued on (CudaKvBackend::set_stream).
  [[nodiscard]] virtual Status set_stream(CUstream_st* stream) = 0;
  /// CudaKvBackend::reserve_storage and reserve_host_metadata: every pool's range allocated now,
  /// once, on the device and in the host's block table.
  [[nodiscard]] virtual Status reserve_storage() = 0;
  [[nodiscard]] virtual Status begin_step(std::span<const int> seqs, std::span<const TokenHint> hints) = 0;
  [[nodiscard]] virtual Status append_batch(int l, std::span<const int> seqs, TensorRef k, TensorRef v) = 0;
  [[nodiscard]] virtual Status attend_batch(int l, std::span<const int> seqs, TensorRef q, MutableTensorRef out) = 0;
  [[nodiscard]] virtual Status end_step(std::span<const int> seqs) = 0;
  [[nodiscard]] virtual Status begin_prompt(int seq, int tokens) = 0;
  [[nodiscard]] virtual Status prefill(int l, int seq, TensorRef q, TensorRef k, TensorRef v, MutableTensorRef out) = 0;
  [[nodiscard]] virtual Status end_prompt(int seq) = 0;
  [[nodiscard]] virtual Status poll_faults(bool wait) = 0;
  [[nodiscard]] virtual bool faulted(int seq) const = 0;
  [[nodiscard]] virtual Status reset_sequence(int seq) = 0;
  [[nodiscard]] virtual Status settle() = 0;
  [[nodiscard]] virtual std::int32_t position(int seq) const = 0;
  [[nodiscard]] virtual std::int64_t live_tokens(int seq) const = 0;
  [[nodiscard]] virtual MemoryUsage memory(int seq) const = 0;
  [[nodiscard]] virtual MemoryUsage memory() const = 0;
  [[nodiscard]] virtual const ThinKvStats& stats() const = 0;
  /// Bytes the backend holds on the device (BackendStats::bytes_allocated; waits for the stream).
  [[nodiscard]] virtual std::int64_t device_bytes() const = 0;
  [[nodiscard]] virtual std::string method_name() const = 0;
  [[nodiscard]] virtual CacheReport report(int seq) const = 0;
  [[nodiscard]] virtual BlockTableStats table_stats() const = 0;
  [[nodiscard]] virtual ThoughtStats thought_stats(int seq) const = 0;
  [[nodiscard]] virtual std::vector<SegmentState> segments(int seq) const = 0;
  [[nodiscard]] virtual std::span<const float> layer_sparsity(int seq) const = 0;
  /// Tensor parallelism: BasicThinKvCache::set_signal_reduction (the thought signal summed over
  /// the ranks). A cache without ThinKV's signal refuses with kUnsupported.
  [[nodiscard]] virtual Status set_signal_reduction(int total_q_heads,
                                                    std::function<Status(std::span<double>)> all_reduce) {
    (void)total_q_heads;
    (void)all_reduce;
    return {StatusCode::kUnsupported, method_name() + " cannot be sharded by tensor parallelism"};
  }
};

/// GpuCache over BasicThinKvCache<P, CudaKvBackend>.
template <class P>
class GpuCacheModel final : public GpuCache {
 public:
  /// Throws ConfigError (a bad configuration) or BackendError (no device), as the cache does.
  GpuCacheModel(const ThinKvConfig& cfg, P policy) : c_(cfg, std::move(policy)) {}
  [[nodiscard]] BasicThinKvCache<P, CudaKvBackend>& get() noexcept { return c_; }
  const ThinKvConfig& config() const override { return c_.config(); }
  Status set_stream(CUstream_st* stream) override { return c_.backend().set_stream(stream); }
  Status reserve_storage() override {
    THINKV_RETURN_IF_ERROR(c_.backend().reserve_storage());
    (void)c_.reserve_host_metadata();
    return Status::ok();
  }
  Status begin_step(std::span<const int> seqs, std::span<const TokenHint> hints) override {
    return c_.begin_step(seqs, hints);
  }
  Status append_batch(int l, std::span<const int> seqs, TensorRef k, TensorRef v) override {
    return c_.append_batch(l, seqs, k, v);
  }
  Status attend_batch(int l, std::span<const int> seqs, TensorRef q, MutableTensorRef out) override {
    return c_.attend_batch(l, seqs, q, out);
  }
  Status end_step(std::span<const int> seqs) override { return c_.end_step(seqs); }
  Status begin_prompt(int seq, int tokens) override { return c_.begin_prompt(seq, tokens); }
  Status prefill(int l, int seq, TensorRef q, TensorRef k, TensorRef v, MutableTensorRef out) override {
    return c_.prefill(l, seq, q, k, v, out);
  }
  Status end_prompt(int seq) override { return c_.end_prompt(seq); }
  Status poll_faults(bool wait) override { return c_.poll_faults(wait); }
  bool faulted(int seq) const override { return c_.faulted(seq); }
  Status reset_sequence(int seq) override { return c_.reset_sequence(seq); }
  Status settle() override { return c_.settle(); }
  std::int32_t position(int seq) const override { return c_.position(seq); }
  std::int64_t live_tokens(int seq) const override { return c_.live_tokens(seq); }
  MemoryUsage memory(int seq) const override { return c_.memory(seq); }
  MemoryUsage memory() const override { return c_.memory(); }
  const ThinKvStats& stats() const override { return c_.stats(); }
  std::int64_t device_bytes() const override { return c_.backend().stats().bytes_allocated; }
  std::string method_name() const override { return c_.method_name(); }
  CacheReport report(int seq) const override { return c_.report(seq); }
  BlockTableStats table_stats() const override { return c_.paged().table().stats(); }
  ThoughtStats thought_stats(int seq) const override { return c_.tracker(seq).stats(); }
  std::vector<SegmentState> segments(int seq) const override { return c_.segments(seq); }
  std::span<const float> layer_sparsity(int seq) const override { return c_.layer_sparsity(seq); }
  Status set_signal_reduction(int total_q_heads, std::function<Status(std::span<double>)> all_reduce) override {
    return c_.set_signal_reduction(total_q_heads, std::move(all_reduce));
  }

 private:
  BasicThinKvCache<P, CudaKvBackend> c_;
};

/// The cache `spec` describes (its policy set and settings), on the current CUDA device.
[[nodiscard]] inline Status make_gpu_cache(const ThinKvSpec& spec, std::unique_ptr<GpuCache>& out) {
  try {
    with_policy(spec,
                [&]<class P>(const P& policy) { out = std::make_unique<GpuCacheModel<P>>(spec.config(), policy); });
  } catch (const ConfigError& e) { return e.status(); } catch (const BackendError& e) {
    return e.status();
  }
  return Status::ok();
}

}  // namespace thinkv::decoder
