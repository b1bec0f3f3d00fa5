#pragma once
/// \file batch.hpp
/// The batched half of the KV-backend interface: one call per layer for a whole batch of
/// sequences, tensors in the backend's memory (host memory for CpuKvBackend, device memory for
/// CudaKvBackend) in FP32, FP16 or BF16. BasicThinKvCache's begin_step / append_batch /
/// attend_batch / end_step drive it (docs/design.md, "Batched decode").
///
/// A backend that models `batched_kv_backend` may run the calls asynchronously (the CUDA backend
/// enqueues them on its stream and returns): results the host reads (sparsity, faults) are in
/// place after synchronize(). Errors a backend can only see while executing (a non-finite K/V
/// value on the device) are reported as faults, per sequence, by poll_faults.

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/backend/kv_backend.hpp"

namespace thinkv {

/// Element type of a batched call's tensors.
enum class ElementType : std::uint8_t { kF32 = 0, kF16 = 1, kBf16 = 2 };

[[nodiscard]] constexpr int element_bytes(ElementType t) noexcept { return t == ElementType::kF32 ? 4 : 2; }
[[nodiscard]] constexpr std::string_view to_string(ElementType t) noexcept {
  switch (t) {
    case ElementType::kF32: return "f32";
    case ElementType::kF16: return "f16";
    case ElementType::kBf16: return "bf16";
  }
  return "?";
}

/// A read-only tensor of a batched call: rows of head_dim contiguous elements of `type`, in the
/// backend's memory.
struct TensorRef {
  const void* data = nullptr;
  ElementType type = ElementType::kF32;
};
/// A tensor a batched call writes.
struct MutableTensorRef {
  void* data = nullptr;
  ElementType type = ElementType::kF32;
};

/// One row of a batched stage: input row `src` of k and v (head_dim elements each) goes into
/// staging row `row` of `stream`. A value that is not finite or exceeds kMaxKvMagnitude stages
/// the row as zeros and raises fault `fault` (with `tag`, the cache passes the position) once,
/// until reset_stream(fault).
struct StageRow {
  std::int32_t stream = kNoStream;
  std::int32_t row = 0;
  std::int32_t src = 0;
  std::int32_t fault = 0;  ///< a stream id: the cache names the sequence's first stream
  std::int32_t tag = 0;
};

/// A fault a backend raised: StageRow::fault and StageRow::tag of the first bad row.
struct BackendFault {
  std::int32_t fault = 0;
  std::int32_t tag = 0;
  friend bool operator==(const BackendFault&, const BackendFault&) = default;
};

/// One sequence of a decode step (StepView): its stream of layer l, KV head h is first_stream +
/// l * num_kv_heads + h (ThinKvCache's numbering), and the step's token goes into staging row
/// `row` of every one of them.
struct StepSequence {
  std::int32_t first_stream = 0;  ///< the stream of layer 0, KV head 0; also the fault id (StageRow::fault)
  std::int32_t row = 0;           ///< staging row of the step's token (0 .. group_size - 1)
  std::int32_t tag = 0;           ///< fault tag (StageRow::tag)
  std::int32_t sparsity = 0;      ///< 1: the step's sparsity layers compute this sequence's sparsity
};

/// A decode step as BasicThinKvCache::begin_step planned it, for the backend's prepare_step: the
/// batch's sequences, every layer's commits (already applied to the table, whose views `table`
/// reads), and what the attentions compute. Its spans stay valid, and the table unchanged for the
/// step's streams, until the step ends (end_step).
struct StepView {
  int num_layers = 0;
  int num_kv_heads = 0;  ///< per sequence
  int num_q_heads = 0;   ///< per sequence
  float softmax_scale = 0.0f;
  std::span<const StepSequence> seqs;  ///< the batch, in order (row b of every tensor)
  /// Every layer's commits, layer by layer: layer l's are commits[layer_commits[l] ..
  /// layer_commits[l + 1]), plans of distinct streams of that layer.
  std::span<const CommitPlan> commits;
  std::span<const std::uint32_t> layer_commits;  ///< [num_layers + 1]
  /// [num_layers]: -1, or the index of the layer among those whose attention computes sparsity.
  std::span<const std::int8_t> sparsity_slot;
  /// HOST [sparsity layers, batch, num_q_heads]: each query row's sparsity for the sequences that
  /// ask (StepSequence::sparsity), in place after wait_sparsity(); the others' rows are NaN.
  float* sparsity = nullptr;
  /// The most slot positions (block list x block_size + staged) any stream of the step can hold:
  /// an upper bound, a planning hint for attention launches (results never depend on it).
  long long max_positions = 0;
  /// The per-layer launches must not change from step to step for a batch of this size: a CUDA
  /// graph captured around append_step / attend_step calls replays them (docs/design.md,
  /// "Capturing a step in a CUDA graph"). A device backend then reads everything a step varies
  /// (its sequences, each layer's commits, who asks for sparsity) from device memory it rewrites
  /// at prepare_step, fixes the attention's split count, and lays out sparsity_slot as given
  /// (the same layers every step).
  bool capturable = false;
  TableView table;  ///< the table's streams and pools, and the list change log
};

/// A backend that serves batched calls: a decode step of a whole batch, one call per layer
/// (prepare_step, then per layer append_step and attend_step), and prompts (stage_batch,
/// commit_batch). Tensors are in the backend's memory.
template <class B>
concept batched_kv_backend = kv_backend<B> &&
    requires(B& b, const B& cb, std::span<const StageRow> rows, TensorRef t, MutableTensorRef o,
             std::span<const CommitPlan> plans, const StepView& step, int layer, std::vector<BackendFault>& faults,
             bool wait) {
  /// Stages rows.size() tokens from k and v: one row per stream, or several rows of a stream
  /// adjacent and in row order (a prompt). Already-staged rows are untouched.
  { b.stage_batch(rows, t, t) } -> std::same_as<Status>;
  /// Commits full staging groups of distinct streams (plans in the order they were made).
  { b.commit_batch(plans) } -> std::same_as<Status>;
  /// Takes a step's plan (storage for its commits is in place): a device backend brings its
  /// mirror of the block metadata up to date here and uploads what the step's launches read.
  { b.prepare_step(step) } -> std::same_as<Status>;
  /// Layer `layer` of the step: each sequence's K and V (k, v: [batch, num_kv_heads, head_dim])
  /// staged into its row, and the layer's commits. K/V values are checked (StageRow).
  { b.append_step(layer, t, t) } -> std::same_as<Status>;
  /// Decode attention of layer `layer` for the whole batch (q, out: [batch, num_q_heads,
  /// head_dim]), with the sparsity the step asks for.
  { b.attend_step(layer, t, o) } -> std::same_as<Status>;
  /// Waits until the step's sparsity results are in place (StepView::sparsity).
  { b.wait_sparsity() } -> std::same_as<Status>;
  /// Appends the faults raised since the last poll whose results have reached the host
  /// (with `wait`, after waiting for all work enqueued so far).
  { b.poll_faults(faults, wait) } -> std::same_as<Status>;
  /// Waits until every host result of earlier calls is in place.
  { b.synchronize() } -> std::same_as<Status>;
};

/// Causal self-attention of a prompt (BasicThinKvCache::prefill), one call per layer: query row
/// (t, h) of q attends the prompt's own keys and values 0..t of KV head h / G (G = num_q_heads /
/// num_kv_heads), as given in k and v, not as the cache stores them (the prompt attends to itself
/// at its input precision, as a runtime's prefill does), in FP32:
///   s_j = (sum_c q[c] * k_j[c]) * scale,  p_j = exp(s_j - max s),  out = sum_j p_j v_j / sum_j p_j.
/// q and out are [tokens, num_q_heads, head_dim], k and v [tokens, num_kv_heads, head_dim], in the
/// backend's memory.
struct PromptAttendArgs {
  int tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  TensorRef q;
  TensorRef k;
  TensorRef v;
  MutableTensorRef out;
  float softmax_scale = 0.0f;  ///< 0 means 1/sqrt(head_dim)
};

/// A backend that runs a prompt's causal attention (prefill).
template <class B>
concept prompt_attending_backend = requires(const B& b, const PromptAttendArgs& a) {
  { b.attend_prompt(a) } -> std::same_as<Status>;
};

/// A prompt continued past tokens already stored (BasicThinKvCache::begin_prompt at a position
/// P > 0: a prompt a runtime feeds in several ubatches), one call per layer: query row (t, h)
/// attends the tokens stored in stream view.streams[h / G] (as the cache stores them: quantized
/// pages dequantized, staged rows in BF16; all of them precede the chunk) and then the chunk's own
/// keys and values 0..t of KV head h / G as given in k and v, in one softmax, in FP32 (the
/// formula of PromptAttendArgs over the concatenation). `view` lists one stream per KV head.
template <class B>
concept chunk_attending_backend = requires(const B& b, const AttendView& view, const PromptAttendArgs& a) {
  { b.attend_chunk(view, a) } -> std::same_as<Status>;
};

/// Checks a prompt attention's shape: tokens >= 1, head counts (GQA), head_dim >= 1, non-null
/// tensors, a finite non-negative scale. kInvalidArgument naming the bad value.
[[nodiscard]] inline Status check_prompt_attend(const PromptAttendArgs& a) {
  auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, "attend_prompt: " + std::move(m)); };
  if (a.tokens < 1) return bad("tokens " + std::to_string(a.tokens) + " must be >= 1");
  if (a.num_kv_heads < 1 || a.num_q_heads < 1 || a.num_q_heads % a.num_kv_heads != 0) {
    return bad("num_q_heads " + std::to_string(a.num_q_heads) + " must be a positive multiple of num_kv_heads " +
               std::to_string(a.num_kv_heads));
  }
  if (a.head_dim < 1) return bad("head_dim " + std::to_string(a.head_dim) + " must be >= 1");
  if (a.q.data == nullptr || a.k.data == nullptr || a.v.data == nullptr || a.out.data == nullptr) {
    return bad("q, k, v and out must not be null");
  }
  if (!(a.softmax_scale >= 0.0f) || a.softmax_scale > 3.0e38f) {
    return bad("softmax_scale " + std::to_string(a.softmax_scale) + " must be finite and >= 0");
  }
  return Status::ok();
}

/// One selection of TBE (docs/design.md, "K-means retention"): of the live tokens of thought
/// segment `segment` in stream `stream`, in attention order (the stream's blocks in list order,
/// slots in order: BlockTable::live_segment_slots), keep the `keep` that kmeans_select picks from
/// their dequantized keys with {max_iterations, seed}; the others are the victims. `count` is the
/// number of live tokens the caller expects (the segment's size; every stream of a sequence holds
/// the same): a backend refuses jobs beyond what it serves by it, and reports a segment found
/// with another count as an error.
struct SegmentSelect {
  std::int32_t stream = kNoStream;
  std::uint32_t segment = 0;
  std::int32_t keep = 0;
  std::int32_t count = 0;
  std::uint64_t seed = 0;
};

/// A backend that runs TBE's selections itself, over the keys and metadata it holds (a device: no
/// key leaves it): for each job it finds the segment's live tokens (reading `table`, or its own
/// copy of the metadata brought up to date from it), runs kmeans_select on their keys, marks the
/// victims evicted in its own copy of the metadata (a device mirror; the cache then evicts them in
/// the table, which the next sync sends again unchanged) and returns them: job j's victims are
/// victims[offsets[j] .. offsets[j + 1]), in attention order. The answers are exactly
/// kmeans_select's. kUnsupported when a job is beyond what the backend serves (the cache then
/// selects on the host), with nothing marked.
template <class B>
concept segment_selecting_backend = requires(B& b, const TableView& table, std::span<const SegmentSelect> jobs,
                                             int max_iterations, std::vector<SlotRef>& victims,
                                             std::vector<std::uint32_t>& offsets) {
  { b.select_segments(table, jobs, max_iterations, victims, offsets) } -> std::same_as<Status>;
};

/// A backend whose selections can run while the host goes on: launch_selection enqueues them
/// (the victims marked in the backend's own copy of the metadata before anything enqueued later
/// reads it) and returns a ticket; collect_selection returns their victims once they reached the
/// host (ready = false without waiting, when `wait` is false and they have not), each ticket once.
/// The cache evicts them in its table when it collects them (docs/design.md, "Batched decode on
/// the device": the evictions of a step are recorded on the host by the next step at the latest).
template <class B>
concept async_selecting_backend = segment_selecting_backend<B> &&
    requires(B& b, const TableView& table, std::span<const SegmentSelect> jobs, int max_iterations,
             std::uint64_t& ticket, bool wait, bool& ready, std::vector<SlotRef>& victims,
             std::vector<std::uint32_t>& offsets) {
  { b.launch_selection(table, jobs, max_iterations, ticket) } -> std::same_as<Status>;
  { b.collect_selection(ticket, wait, ready, victims, offsets) } -> std::same_as<Status>;
};

/// Host conversion of one element of a batched tensor to FP32.
[[nodiscard]] float load_element(const void* data, ElementType type, std::size_t i) noexcept;
/// Host conversion of an FP32 value into a batched tensor (round to nearest even).
void store_element(void* data, ElementType type, std::size_t i, float x) noexcept;

}  // namespace thinkv

#include "thinkv/formats/bf16.hpp"
#include "thinkv/formats/fp16.hpp"

namespace thinkv {

inline float load_element(const void* data, ElementType type, std::size_t i) noexcept {
  switch (type) {
    case ElementType::kF32: return static_cast<const float*>(data)[i];
    case ElementType::kF16: return decode_fp16(static_cast<const std::uint16_t*>(data)[i]);
    case ElementType::kBf16: return decode_bf16(static_cast<const std::uint16_t*>(data)[i]);
  }
  return 0.0f;
}

inline void store_element(void* data, ElementType type, std::size_t i, float x) noexcept {
  switch (type) {
    case ElementType::kF32: static_cast<float*>(data)[i] = x; return;
    case ElementType::kF16: static_cast<std::uint16_t*>(data)[i] = encode_fp16(x); return;
    case ElementType::kBf16: static_cast<std::uint16_t*>(data)[i] = encode_bf16(x); return;
  }
}

}  // namespace thinkv
