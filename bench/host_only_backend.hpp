#pragma once
/// \file host_only_backend.hpp
/// A backend that stores nothing and computes nothing: every call of the batched interface
/// returns at once. Driving BasicThinKvCache over it measures the cache's own host work in a
/// batched decode step (checks, staging records, commit plans, metadata views, refreshes, TBE
/// planning and eviction bookkeeping) apart from any device or memory work. Not a storage: its
/// attention writes nothing, its K-means keeps each segment's first tokens, and its sparsity is
/// a fixed pattern per sequence, so thought types still change at refreshes.

#include <chrono>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "thinkv/backend/batch.hpp"
#include "thinkv/backend/kv_backend.hpp"

namespace thinkv::bench {

class HostOnlyBackend {
 public:
  [[nodiscard]] std::string_view name() const { return "host-only"; }
  [[nodiscard]] Status init(const StorageConfig&) { return Status::ok(); }
  [[nodiscard]] Status resize_pool(Precision, std::uint32_t) { return Status::ok(); }
  [[nodiscard]] Status resize_records(std::uint32_t) { return Status::ok(); }
  [[nodiscard]] Status stage(int, int, const float*, const float*) { return Status::ok(); }
  [[nodiscard]] Status commit(const CommitPlan&) { return Status::ok(); }
  [[nodiscard]] Status reset_stream(int) { return Status::ok(); }
  [[nodiscard]] Status read_token(const TokenRef&, float*, float*) const { return Status::ok(); }
  [[nodiscard]] Status read_staged(int, int, float*, float*) const { return Status::ok(); }
  [[nodiscard]] Status attend(const AttendView&, const DecodeAttentionArgs&) const { return Status::ok(); }
  [[nodiscard]] BackendStats stats() const { return {}; }

  [[nodiscard]] Status stage_batch(std::span<const StageRow>, TensorRef, TensorRef) { return Status::ok(); }
  [[nodiscard]] Status commit_batch(std::span<const CommitPlan>) { return Status::ok(); }
  [[nodiscard]] Status prepare_step(const StepView& step) {
    step_ = step;
    return Status::ok();
  }
  [[nodiscard]] Status append_step(int, TensorRef, TensorRef) { return Status::ok(); }
  [[nodiscard]] Status attend_step(int layer, TensorRef, MutableTensorRef) const {
    const int slot = step_.sparsity_slot[static_cast<std::size_t>(layer)];
    if (slot < 0 || step_.sparsity == nullptr) return Status::ok();
    // Sequence s: a sparsity that moves between the classifier's bands every few refreshes,
    // differently per sequence.
    ++calls_;
    const std::size_t n = step_.seqs.size();
    for (std::size_t b = 0; b < n; ++b) {
      const auto seq = static_cast<std::uint64_t>(step_.seqs[b].first_stream) /
                       static_cast<std::uint64_t>(step_.num_layers * step_.num_kv_heads);
      const std::uint64_t h = (seq * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(calls_ / 97)) >> 40;
      const float x = static_cast<float>(h % 1000) / 1000.0f;
      float* out =
          step_.sparsity + (static_cast<std::size_t>(slot) * n + b) * static_cast<std::size_t>(step_.num_q_heads);
      for (int q = 0; q < step_.num_q_heads; ++q) out[q] = x;
    }
    return Status::ok();
  }
  [[nodiscard]] Status wait_sparsity() { return Status::ok(); }
  [[nodiscard]] Status poll_faults(std::vector<BackendFault>&, bool) { return Status::ok(); }
  [[nodiscard]] Status synchronize() { return Status::ok(); }
  /// The segments' live slots found through the table (the scan a device backend runs on the
  /// device: timed apart, select_us), each keeping its first `keep`.
  [[nodiscard]] Status select_segments(const TableView& table, std::span<const SegmentSelect> jobs, int,
                                       std::vector<SlotRef>& victims, std::vector<std::uint32_t>& offsets) {
    const auto t0 = std::chrono::steady_clock::now();
    victims.clear();
    offsets.assign(1, 0);
    for (const SegmentSelect& j : jobs) {
      table.segment_tokens(j.stream, j.segment, tokens_);
      for (std::size_t i = static_cast<std::size_t>(j.keep); i < tokens_.size(); ++i)
        victims.push_back(tokens_[i].slot);
      offsets.push_back(static_cast<std::uint32_t>(victims.size()));
    }
    select_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    return Status::ok();
  }
  /// Host time spent in select_segments (what a device backend does on the device).
  double select_us = 0;

 private:
  StepView step_;
  mutable std::uint64_t calls_ = 0;
  std::vector<TokenRef> tokens_;
};
static_assert(batched_kv_backend<HostOnlyBackend> && segment_selecting_backend<HostOnlyBackend>);

}  // namespace thinkv::bench
