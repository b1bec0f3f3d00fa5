#pragma once
/// \file cuda_backend.hpp
/// The CUDA backend: pages, key-scale records, staging buffers and second-level scales live in
/// GPU memory, laid out exactly as the CPU backend lays out its host memory
/// (thinkv/paged/layout.hpp); commits run the quantize-append kernel, attention runs the paged
/// decode-attention kernel (thinkv::kernels). It drops into PagedKvCache / ThinKvCache in place of
/// CpuKvBackend: `ThinKvCache<CudaKvBackend> cache(config, policy);`.
///
/// Declared here without any CUDA header (the class keeps its device state behind a pointer);
/// defined in kernels/cuda_backend.cu, so a program using it links `thinkv::kernels` (CMake
/// component `kernels`; a CPU-only build has the header but not the definitions).
///
/// Two ways in:
///  - the batched calls (thinkv/backend/batch.hpp), which BasicThinKvCache's begin_step /
///    append_batch / attend_batch / end_step drive: K, V, q and out are DEVICE pointers (FP32,
///    FP16 or BF16), every call is enqueued on the backend's stream (set_stream: the caller's
///    cudaStream_t) and returns without waiting. prepare_step (begin_step) sends what changed:
///    the pages whose metadata changed (PoolView's change log), the block lists that changed
///    (TableView's list log; each stream's list is a fixed-capacity device row) and the step's
///    sequences and commit jobs, in one pinned upload into a device area laid out by capacity;
///    the per-layer calls then only launch (a captured CUDA graph can replay them: graph_epoch).
///    Staged counts are kept on the device. The host waits only in wait_sparsity (the last
///    sparsity layer's copy, on refresh steps), select_segments (TBE's victims), poll_faults
///    (wait = true), stats(), when storage grows or shrinks (BackendStats::
///    storage_reallocations; none once reserve_storage), when the metadata is copied whole
///    (metadata_full_uploads), and when a device area of its own (the metadata mirror, the
///    block-list rows, the step's tables, an upload slot) must grow. K/V values are checked on the
///    device: a row holding NaN, Inf or a value beyond 2^64 is staged as zeros and raises a fault
///    for its sequence, copied back asynchronously and reported by poll_faults.
///  - the one-token calls of kv_backend (stage, commit, attend, read_token), with HOST pointers,
///    each synchronous (it copies in, launches, copies out and waits): a drop-in for decoders
///    that run on the CPU and a reference for the device kernels.
/// The pools' block metadata (fill, eviction masks, slot records and segments) is mirrored on the
/// device and kept up to date by changes (one packed upload and one scatter launch), and the
/// whole metadata, about (2 + 8 ceil(B / 64) + 8 B) bytes per block with storage, only on the
/// first sync, after the storage grew or shrank, or when the log no longer reaches back
/// (BackendStats::metadata_bytes_uploaded, metadata_full_uploads). The attended streams' block
/// lists are sent on every one-token attend.
///
/// Shapes: everything StorageConfig accepts is stored; attend needs head_dim 8, 32, 64, 128 or 256 and
/// at most 8 query heads per KV head (the attention kernel's limits) and says so otherwise.
/// Errors: CUDA failures come back as StatusCode::kCudaError naming the call and the CUDA error;
/// an allocation failure at init as kPoolExhausted naming the bytes asked for.

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "thinkv/backend/batch.hpp"
#include "thinkv/backend/kv_backend.hpp"
#include "thinkv/paged/storage_view.hpp"
#include "thinkv/paged/layout.hpp"
#include "thinkv/reference/attention.hpp"
#include "thinkv/status.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st* (cuda_runtime_api.h); no CUDA header here

namespace thinkv {

class CudaKvBackend {
 public:
  CudaKvBackend();
  ~CudaKvBackend();
  CudaKvBackend(CudaKvBackend&&) noexcept;
  CudaKvBackend& operator=(CudaKvBackend&&) noexcept;
  CudaKvBackend(const CudaKvBackend&) = delete;
  CudaKvBackend& operator=(const CudaKvBackend&) = delete;

  [[nodiscard]] std::string_view name() const { return "cuda"; }

  /// Sets up on the current CUDA device: staging and second-level scales; no page yet. Fails
  /// with kCudaError when there is no usable device.
  [[nodiscard]] Status init(const StorageConfig& config);
  /// Device storage for pool p's pages 0 .. blocks - 1: one buffer per pool, grown by doubling
  /// (a device-to-device copy of the pages held, between calls: no kernel sees a page move)
  /// and shrunk when the cache needs half of it or less; new pages poisoned with 0xA5.
  /// bytes_allocated reports the buffers' size. kPoolExhausted when the device is out of memory.
  [[nodiscard]] Status resize_pool(Precision p, std::uint32_t blocks);
  /// The same for the key-scale records.
  [[nodiscard]] Status resize_records(std::uint32_t records);
  /// Allocates every pool's whole block range and the whole record range now, once, and keeps
  /// them (resize_pool / resize_records no longer grow or shrink anything): a runtime that sizes
  /// its KV arena up front (ThinKvConfig::pool_blocks, or the worst case) pays no growth copy,
  /// whose peak is the old and the new buffer together. kPoolExhausted when it does not fit.
  [[nodiscard]] Status reserve_storage();
  /// Converts one token (host floats) to BF16 and writes it into staging row `row` on the device.
  [[nodiscard]] Status stage(int stream, int row, const float* k, const float* v);
  /// Quantizes the stream's full staging group into plan.slots (launch_quantize_append, one job).
  [[nodiscard]] Status commit(const CommitPlan& plan);
  /// Forgets a stream's second-level scales (end of sequence).
  [[nodiscard]] Status reset_stream(int stream);
  /// Dequantizes one stored token into host memory (bit-identical to CpuKvBackend::read_token).
  [[nodiscard]] Status read_token(const TokenRef& token, float* k, float* v) const;
  /// Decodes one staged token into host memory.
  [[nodiscard]] Status read_staged(int stream, int row, float* k, float* v) const;
  /// Decode attention on the GPU (launch_paged_decode_attention): host q in, host out (and
  /// sparsity, when asked) back.
  [[nodiscard]] Status attend(const AttendView& view, const DecodeAttentionArgs& args) const;
  /// Counters; waits for the enqueued work first (the saturation counter lives on the device).
  [[nodiscard]] BackendStats stats() const;

  // ---- batched calls (device tensors, enqueued on stream()) ----------------------------------
  /// The stream the batched calls are enqueued on (nullptr: the legacy default stream). Waits for
  /// the work enqueued on the previous stream first.
  [[nodiscard]] Status set_stream(CUstream_st* stream);
  [[nodiscard]] CUstream_st* stream() const noexcept;
  /// Stages rows from device tensors k and v ([rows, head_dim]); checks every value on the device.
  [[nodiscard]] Status stage_batch(std::span<const StageRow> rows, TensorRef k, TensorRef v);
  /// One quantize-append launch for the plans' groups.
  [[nodiscard]] Status commit_batch(std::span<const CommitPlan> plans);
  /// A decode step (batch.hpp, StepView): brings the device's copy of the block metadata and
  /// block lists up to date by changes, and uploads the step's sequences and every layer's commit
  /// jobs in one copy into a device area the step's launches read.
  [[nodiscard]] Status prepare_step(const StepView& step);
  /// Layer `layer` of the step: one stage launch (every sequence's K/V rows, checked on the
  /// device) and at most one quantize-append launch (the layer's commits).
  [[nodiscard]] Status append_step(int layer, TensorRef k, TensorRef v);
  /// One decode-attention launch for the layer's whole batch (device q and out); on a sparsity
  /// layer of the step, the sparsity of the sequences that ask, copied back asynchronously.
  [[nodiscard]] Status attend_step(int layer, TensorRef q, MutableTensorRef out) const;
  /// Waits for the step's last sparsity copy (not for the rest of the step; a capturable step, for
  /// the stream) and puts the results in place.
  [[nodiscard]] Status wait_sparsity();
  /// Device time of the batched calls, by part, when timing is on (set_device_timing): CUDA events
  /// around each part's work on the stream, summed once they completed (read after the stream
  /// is drained: device_times waits for it). Parts: prepare_step's (the metadata mirror's and the
  /// block lists' updates, the step's tables), append_step's (staging and quantize-append), the
  /// attention (attend_step), select_segments' (TBE: finding the tokens, K-means, marking).
  struct DeviceTimes {
    double prepare_ms = 0, append_ms = 0, attend_ms = 0, select_ms = 0;
  };
  /// Turns the timing events on or off. Not inside a stream capture: the events would be captured.
  void set_device_timing(bool on);
  /// TBE's K-means launches (launch_selection): a selection of at least `jobs` segments is
  /// launched per size class (segments of up to 32, 64 and 128 tokens, each class with a
  /// shared-memory layout for its largest, small CTAs many per SM); a smaller one goes in one
  /// launch, largest segments first. Default kDefaultKmeansSplitJobs (measured in docs/perf.md:
  /// at a decode step's ~650 selections the class launches, which run one after another, cost
  /// more than they gain; at a whole-batch transition's thousands they win). Values < 1 mean 1.
  static constexpr int kDefaultKmeansSplitJobs = 2048;
  void set_kmeans_split_jobs(int jobs) noexcept;
  [[nodiscard]] Status device_times(DeviceTimes& out);
  /// Changes whenever a device buffer or launch shape that a step's per-layer launches read
  /// changes (storage or mirror growth, the step's tables, attention scratch): a CUDA graph
  /// captured around them replays correctly only while it is unchanged (docs/design.md,
  /// "Capturing a step in a CUDA graph").
  [[nodiscard]] std::uint64_t graph_epoch() const noexcept;
  /// A prompt's causal self-attention (PromptAttendArgs; device q, k, v and out): one
  /// launch_prefill_attention on stream().
  [[nodiscard]] Status attend_prompt(const PromptAttendArgs& args) const;
  /// A continued prompt chunk's attention (chunk_attending_backend; device q, k, v and out): the
  /// host resolves each stored token's device addresses from `view` (live slots in attention
  /// order, then staged rows) and uploads them (48 bytes a token and KV head), one kernel
  /// dequantizes them into an FP32 scratch [num_kv_heads, stored + tokens, head_dim] (K and V,
  /// grown on demand and kept) exactly as read_token does, one copies the chunk's K/V after them,
  /// and launch_prefill_attention with a prefix attends each query row to its KV head's stored
  /// rows and the chunk's rows 0..t. Three launches on stream(), no synchronisation.
  [[nodiscard]] Status attend_chunk(const AttendView& view, const PromptAttendArgs& args) const;
  /// Faults whose copy has reached the host; with `wait`, every fault raised so far.
  [[nodiscard]] Status poll_faults(std::vector<BackendFault>& faults, bool wait);
  /// TBE's selections on the device (segment_selecting_backend): brings the device's copy of the
  /// metadata up to date, then per job one CTA finds the segment's live tokens in the stream's
  /// block list and dequantizes their keys as read_token would, launch_kmeans_select picks the
  /// kept tokens (bit for bit kmeans_select's answer), and a last kernel marks the others evicted
  /// in the device's masks and lists them; only the victims come back (one copy; the call waits
  /// for it). kUnsupported for a segment of more than 128 tokens, a keep above 64 or a head_dim the
  /// kernel does not serve (the cache then selects on the host), with nothing marked.
  [[nodiscard]] Status select_segments(const TableView& table, std::span<const SegmentSelect> jobs, int max_iterations,
                                       std::vector<SlotRef>& victims, std::vector<std::uint32_t>& offsets);
  /// select_segments without waiting (async_selecting_backend): enqueues the selections (their
  /// victims marked in the device's masks in stream order, before any later launch reads them)
  /// and the copy back of the victims; `ticket` names them for collect_selection. Until they are
  /// collected, a whole copy of the metadata to the device marks their victims again.
  [[nodiscard]] Status launch_selection(const TableView& table, std::span<const SegmentSelect> jobs, int max_iterations,
                                        std::uint64_t& ticket);
  /// The victims of a launched selection, as select_segments returns them: ready = false (and
  /// nothing else) when `wait` is false and they have not reached the host yet.
  [[nodiscard]] Status collect_selection(std::uint64_t ticket, bool wait, bool& ready, std::vector<SlotRef>& victims,
                                         std::vector<std::uint32_t>& offsets);
  /// Waits for the stream, then puts the host results (sparsity) in place. Reports a commit job
  /// the kernel refused (kInternal) here.
  [[nodiscard]] Status synchronize();

  /// For tests and debugging: a block's page bytes, a record's key-scale codes, a stream scale.
  [[nodiscard]] Status copy_page(std::uint32_t block, std::vector<std::uint8_t>& out) const;
  [[nodiscard]] Status copy_record(std::uint32_t record, std::vector<std::uint8_t>& out) const;
  [[nodiscard]] Status stream_scale(int stream, int kv, Precision p, float& out) const;

  /// Raw storage access (state_io_backend: saving and loading sequence state): synchronous
  /// copies after the backend's stream drained.
  [[nodiscard]] Status read_page(Precision p, std::uint32_t page, std::span<std::uint8_t> out) const;
  [[nodiscard]] Status write_page(Precision p, std::uint32_t page, std::span<const std::uint8_t> in);
  [[nodiscard]] Status read_record(std::uint32_t record, std::span<std::uint8_t> out) const;
  [[nodiscard]] Status write_record(std::uint32_t record, std::span<const std::uint8_t> in);
  [[nodiscard]] Status read_stream_scales(int stream, std::span<float> out) const;
  [[nodiscard]] Status write_stream_scales(int stream, std::span<const float> in);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
static_assert(kv_backend<CudaKvBackend> && batched_kv_backend<CudaKvBackend> &&
              segment_selecting_backend<CudaKvBackend> && async_selecting_backend<CudaKvBackend> &&
              state_io_backend<CudaKvBackend>);

}  // namespace thinkv
