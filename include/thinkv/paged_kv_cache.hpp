#pragma once
/// \file paged_kv_cache.hpp
/// PagedKvCache: the compressed paged KV cache (TBQ quantization + the CT block table) over a
/// KV backend. A decoder calls append() once per stream per step with the new token's post-RoPE
/// key and value, and attend() for the step's queries. Eviction marks slots; new tokens of the
/// same thought type are written into them in place.
///
/// Every mutating call is all-or-nothing: a wrong shape, NaN/Inf in K/V, an unknown stream, or a
/// full pool returns an error and leaves the cache exactly as it was.

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thinkv/backend/batch.hpp"
#include "thinkv/backend/cpu_backend.hpp"
#include "thinkv/backend/kv_backend.hpp"
#include "thinkv/kv_values.hpp"
#include "thinkv/paged/block_table.hpp"
#include "thinkv/paged/layout.hpp"
#include "thinkv/seq/rope.hpp"
#include "thinkv/status.hpp"

namespace thinkv {

/// Exact memory held, per stream or summed over streams. "Physical" counts what is allocated to
/// the streams: whole pages of held blocks (holes and unwritten slots included), block metadata,
/// block-table entries, stream headers, key-scale records and staging buffers.
struct MemoryUsage {
  std::int64_t live_tokens = 0;    ///< non-evicted tokens in pages + staged tokens
  std::int64_t staged_tokens = 0;  ///< tokens in staging (full precision)
  std::int64_t hole_slots = 0;     ///< evicted slots still held (awaiting reuse)
  std::int64_t blocks_held = 0;
  /// blocks the stream reads that another stream holds and counts (a shared prompt prefix,
  /// copy_sequence): not in blocks_held nor in the bytes
  std::int64_t blocks_shared = 0;
  std::int64_t records_held = 0;
  std::int64_t page_bytes = 0;          ///< K/V codes and value scales of held blocks
  std::int64_t metadata_bytes = 0;      ///< block headers, masks, slot metadata, table, headers
  std::int64_t scale_record_bytes = 0;  ///< key-scale records
  std::int64_t staging_bytes = 0;       ///< staging buffers (always allocated per stream)
  std::int64_t fullkv_fp16_bytes = 0;   ///< what FullKV in FP16 would hold for live_tokens

  [[nodiscard]] std::int64_t physical_bytes() const noexcept {
    return page_bytes + metadata_bytes + scale_record_bytes + staging_bytes;
  }
  /// physical / FullKV-FP16 (0 when no token is live).
  [[nodiscard]] double ratio() const noexcept {
    return fullkv_fp16_bytes > 0 ? static_cast<double>(physical_bytes()) / static_cast<double>(fullkv_fp16_bytes) : 0.0;
  }
  MemoryUsage& operator+=(const MemoryUsage& o) noexcept {
    live_tokens += o.live_tokens;
    staged_tokens += o.staged_tokens;
    hole_slots += o.hole_slots;
    blocks_held += o.blocks_held;
    blocks_shared += o.blocks_shared;
    records_held += o.records_held;
    page_bytes += o.page_bytes;
    metadata_bytes += o.metadata_bytes;
    scale_record_bytes += o.scale_record_bytes;
    staging_bytes += o.staging_bytes;
    fullkv_fp16_bytes += o.fullkv_fp16_bytes;
    return *this;
  }
  friend bool operator==(const MemoryUsage&, const MemoryUsage&) = default;
};

/// A stream's stored state, bit for bit (PagedKvCache::save_stream / load_streams): its blocks'
/// metadata and the bytes behind them. Valid only for a cache of the same geometry and
/// precision map.
struct StreamSnapshot {
  StreamImage image;
  std::vector<std::uint8_t> pages;                 ///< each block's page, in image order (page_bytes of its precision)
  std::vector<std::uint8_t> records;               ///< each record's head_dim key-scale bytes, in the image's numbering
  std::array<float, 2 * kNumPrecisions> scales{};  ///< second-level scales, K then V, by Precision
  std::vector<float> staged;  ///< the staged tokens, [staged][K head_dim, V head_dim] (BF16 values)
};
/// A staging set's open group: the type, segment of each staged token, and the set's next position.
struct StageSnapshot {
  ThoughtType thought = ThoughtType::kReasoning;
  std::vector<std::uint32_t> segments;
  std::int32_t next_position = 0;
};

/// The compressed paged KV cache over backend B (the CPU reference backend by default).
template <kv_backend B = CpuKvBackend>
class PagedKvCache {
 public:
  /// Throws ConfigError when `config` is invalid (the message names the value and the allowed
  /// range), BackendError (a std::runtime_error carrying the backend's Status) when the backend
  /// cannot set up its pools.
  explicit PagedKvCache(const CacheConfig& config, B backend = B{}) : table_(config), backend_(std::move(backend)) {
    if (Status s = backend_.init(config); !s.is_ok()) {
      if (s.code() == StatusCode::kInvalidArgument) throw ConfigError(s);
      throw BackendError(Status{
          s.code(), "thinkv: backend '" + std::string(backend_.name()) + "' failed to initialise: " + s.message()});
    }
  }

  [[nodiscard]] const CacheConfig& config() const noexcept { return table_.config(); }
  [[nodiscard]] const CacheLayout& layout() const noexcept { return table_.layout(); }
  [[nodiscard]] const BlockTable& table() const noexcept { return table_; }
  /// BlockTable::reserve_host_metadata: the table's host arrays sized for every pool's range now.
  std::int64_t reserve_host_metadata() { return table_.reserve_host_metadata(); }
  [[nodiscard]] const B& backend() const noexcept { return backend_; }
  [[nodiscard]] B& backend() noexcept { return backend_; }

  /// Appends one token's post-RoPE key and value (head_dim floats each) to a stream as thought
  /// `thought`, in thought segment `segment`. The token is staged in BF16; when its staging group
  /// is full (group_size tokens), the group is quantized at the thought's precision into evicted
  /// slots of the same thought type first, then into fresh slots.
  /// Errors (cache unchanged): kOutOfRange (stream), kShapeMismatch (k/v size), kNonFinite (NaN or
  /// Inf in k/v), kInvalidArgument (thought type changes inside a group), kPoolExhausted.
  [[nodiscard]] Status append(int stream, std::span<const float> k, std::span<const float> v, ThoughtType thought,
                              std::uint32_t segment = 0) {
    return append_impl(stream, k, v, thought, segment, nullptr);
  }
  /// The same with the commit already planned by the caller: `plan` comes from
  /// table().plan_commit(stream, thought, plan, &claims) for a token that completes the stream's
  /// staging group, made against the table as it is now (a batch of streams planned together with
  /// PlanClaims is applied in the order it was planned). It is applied as given, not planned
  /// again. A plan for another stream or thought, or one given for a token that does not complete
  /// a group, is a kInvalidArgument error (nothing changes).
  [[nodiscard]] Status append(int stream, std::span<const float> k, std::span<const float> v, ThoughtType thought,
                              std::uint32_t segment, const CommitPlan& plan) {
    return append_impl(stream, k, v, thought, segment, &plan);
  }

 private:
  [[nodiscard]] Status append_impl(int stream, std::span<const float> k, std::span<const float> v, ThoughtType thought,
                                   std::uint32_t segment, const CommitPlan* given) {
    THINKV_RETURN_IF_ERROR(check_own_staging("append"));
    THINKV_RETURN_IF_ERROR(check_token_kv(stream, k, v));
    THINKV_RETURN_IF_ERROR(table_.check_stage(stream, thought));
    const bool fills_group = table_.staged_count(stream) + 1 == config().group_size;
    if (given != nullptr && (!fills_group || given->stream != stream || given->thought != thought ||
                             static_cast<int>(given->slots.size()) != config().group_size)) {
      return {StatusCode::kInvalidArgument,
              "append to stream " + std::to_string(stream) + " with a commit plan " +
                  (!fills_group ? std::string("although the token does not complete a group")
                                : "for stream " + std::to_string(given->stream) + ", thought " +
                                      std::string(to_string(given->thought)) + ", " +
                                      std::to_string(given->slots.size()) + " slots")};
    }
    CommitPlan own;  // planned here when the caller gave no plan
    const CommitPlan* plan = given;
    if (fills_group && plan == nullptr) {
      THINKV_RETURN_IF_ERROR(table_.plan_commit(stream, thought, own));
      plan = &own;
    }
    // From here on nothing can fail but the backend; undo the staging record (and any storage
    // given for the commit) if it does.
    if (fills_group) THINKV_RETURN_IF_ERROR(give_storage(*plan));
    if (Status s = backend_.stage(stream, table_.staged_count(stream), k.data(), v.data()); !s.is_ok()) {
      (void)follow_table();
      return s;
    }
    table_.push_staged(stream, thought, segment);
    if (fills_group) {
      if (Status s = backend_.commit(*plan); !s.is_ok()) {
        table_.pop_staged(stream);
        (void)follow_table();
        return s;
      }
      table_.apply_commit(*plan);
      planned_bytes_ += layout().commit_bytes(plan->precision);
    }
    return Status::ok();
  }

 public:
  /// One token of a batched append (append_batch): row `src` of the batch's k and v goes to
  /// `stream` as thought `thought` in segment `segment`; `fault` / `tag` as StageRow says.
  struct BatchToken {
    std::int32_t stream = kNoStream;
    std::int32_t src = 0;
    ThoughtType thought = ThoughtType::kReasoning;
    std::uint32_t segment = 0;
    std::int32_t fault = 0;
    std::int32_t tag = 0;
  };

  /// Appends tokens to tokens' streams from tensors k and v in the backend's memory ([rows,
  /// head_dim] of their element type), with one stage and one commit call for the batch. A
  /// stream takes one token (a decode step) or several consecutive ones (a prompt), as many as
  /// its staging group has room for: its tokens are adjacent in `tokens`, in position order,
  /// of one thought type. `plans` are the commits of the streams whose tokens complete their
  /// group, planned together with PlanClaims against the table as it is now, in the order they
  /// were planned (at most one per stream). K/V values are checked by the backend (StageRow: a
  /// bad row is staged as zeros and raises its fault), not here.
  /// Errors (nothing changes): kOutOfRange (stream), kInvalidArgument (a stream's tokens not
  /// adjacent or more than its group has room for, a thought type change inside a group, a plan
  /// for no stream of the batch that completes a group or missing for one), the backend's errors.
  [[nodiscard]] Status append_batch(std::span<const BatchToken> tokens, TensorRef k, TensorRef v,
                                    std::span<const CommitPlan> plans) requires batched_kv_backend<B> {
    THINKV_RETURN_IF_ERROR(check_own_staging("append_batch"));
    const int g = config().group_size;
    std::size_t completing = 0;
    // batch_index_[stream] = 1 + the stream's token in this batch (0: none), cleared on the way out.
    batch_index_.resize(static_cast<std::size_t>(config().num_streams), 0);
    struct Clear {
      std::vector<std::uint32_t>& v;
      std::span<const BatchToken> t;
      ~Clear() {
        for (const BatchToken& x : t) {
          if (x.stream >= 0 && static_cast<std::size_t>(x.stream) < v.size()) v[static_cast<std::size_t>(x.stream)] = 0;
        }
      }
    } clear{batch_index_, tokens};
    // A stream's tokens: tokens[mark - 1 .. i] (adjacent); taken(i) = how many of them so far.
    auto taken = [&](std::size_t i) {
      return static_cast<int>(i + 1 - batch_index_[static_cast<std::size_t>(tokens[i].stream)] + 1);
    };
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const BatchToken& t = tokens[i];
      THINKV_RETURN_IF_ERROR(table_.check_stream(t.stream));
      THINKV_RETURN_IF_ERROR(table_.check_stage(t.stream, t.thought));
      std::uint32_t& mark = batch_index_[static_cast<std::size_t>(t.stream)];
      if (mark != 0) {
        if (tokens[i - 1].stream != t.stream) {
          return {StatusCode::kInvalidArgument, "append_batch: stream " + std::to_string(t.stream) +
                                                    " is named twice in one batch, not in adjacent tokens"};
        }
        if (tokens[i - 1].thought != t.thought) {
          return {StatusCode::kInvalidArgument, "append_batch: the tokens of stream " + std::to_string(t.stream) +
                                                    " change thought type inside one group"};
        }
      } else {
        mark = static_cast<std::uint32_t>(i) + 1;
      }
      const int filled = table_.staged_count(t.stream) + taken(i);
      if (filled > g) {
        return {StatusCode::kInvalidArgument, "append_batch: stream " + std::to_string(t.stream) + " takes " +
                                                  std::to_string(taken(i)) + " tokens with " +
                                                  std::to_string(table_.staged_count(t.stream)) +
                                                  " staged: more than its group of " + std::to_string(g) + " holds"};
      }
      if (filled == g) ++completing;
    }
    for (const CommitPlan& plan : plans) {
      const std::uint32_t first = plan.stream >= 0 && plan.stream < config().num_streams
                                      ? batch_index_[static_cast<std::size_t>(plan.stream)]
                                      : 0;
      std::size_t last = first;  // 1 + the stream's last token
      while (first != 0 && last < tokens.size() && tokens[last].stream == plan.stream) ++last;
      if (first == 0 || table_.staged_count(plan.stream) + static_cast<int>(last - first + 1) != g ||
          tokens[last - 1].thought != plan.thought || static_cast<int>(plan.slots.size()) != g) {
        return {StatusCode::kInvalidArgument, "append_batch: the commit plan of stream " + std::to_string(plan.stream) +
                                                  " matches no token of the batch that completes a group"};
      }
    }
    if (plans.size() != completing) {
      return {StatusCode::kInvalidArgument, "append_batch: " + std::to_string(completing) +
                                                " tokens complete a group but " + std::to_string(plans.size()) +
                                                " commit plans were given"};
    }
    // Storage for every plan, then stage, then commit; undo the table's records and the storage
    // if the backend fails.
    THINKV_RETURN_IF_ERROR(give_storage(plans));
    rows_.resize(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const BatchToken& t = tokens[i];
      rows_[i] = StageRow{t.stream, table_.staged_count(t.stream) + taken(i) - 1, t.src, t.fault, t.tag};
    }
    if (Status e = backend_.stage_batch(rows_, k, v); !e.is_ok()) {
      (void)follow_table();
      return e;
    }
    for (const BatchToken& t : tokens) table_.push_staged(t.stream, t.thought, t.segment);
    if (!plans.empty()) {
      if (Status e = backend_.commit_batch(plans); !e.is_ok()) {
        for (const BatchToken& t : tokens) table_.pop_staged(t.stream);
        (void)follow_table();
        return e;
      }
    }
    for (const CommitPlan& plan : plans) {
      table_.apply_commit(plan);
      planned_bytes_ += layout().commit_bytes(plan.precision);
    }
    return Status::ok();
  }

  // ---- staging sets (CacheConfig::stage_set_streams) ------------------------------------------
  // The calls ThinKvCache makes: a token is pushed once for its staging set (push_staged), then
  // each stream of the set gets its K/V for it (append_pushed, or write_batch for many streams at
  // once), committing the group when the token completes it. They work for any set size.

  /// Pushes the next token of the staging set of `stream` (its position, thought and segment)
  /// for every stream of the set. Errors (nothing changes): kOutOfRange (stream), kInvalidArgument
  /// (a thought type change inside a group).
  [[nodiscard]] Status push_staged(int stream, ThoughtType thought, std::uint32_t segment) {
    THINKV_RETURN_IF_ERROR(table_.check_stage(stream, thought));
    table_.push_staged(stream, thought, segment);
    return Status::ok();
  }

  /// The stream's K and V (head_dim floats each, host memory: the one-token backend calls) for the
  /// token its staging set pushed last; when that token completes the group, the group is
  /// committed, with `plan` (from table().plan_commit for this stream, made against the table as
  /// it is now) or a plan made here. Once per stream and pushed token (the caller keeps count).
  /// Errors (the table unchanged): kOutOfRange, kShapeMismatch, kNonFinite, kInvalidArgument (a
  /// plan for another stream, or given for a token that completes no group), kPoolExhausted,
  /// the backend's.
  [[nodiscard]] Status append_pushed(int stream, std::span<const float> k, std::span<const float> v,
                                     const CommitPlan* given = nullptr) {
    THINKV_RETURN_IF_ERROR(check_token_kv(stream, k, v));
    const int staged = table_.staged_count(stream);
    if (staged == 0) {
      return {StatusCode::kInvalidArgument,
              "append to stream " + std::to_string(stream) + ": its staging set has no pushed token"};
    }
    const bool full = staged == config().group_size;
    const ThoughtType thought = table_.staged_thought(stream);
    if (given != nullptr && (!full || given->stream != stream || given->thought != thought ||
                             static_cast<int>(given->slots.size()) != config().group_size)) {
      return {StatusCode::kInvalidArgument,
              "append to stream " + std::to_string(stream) + " with a commit plan that does not match its group"};
    }
    CommitPlan own;
    const CommitPlan* plan = given;
    if (full && plan == nullptr) {
      THINKV_RETURN_IF_ERROR(table_.plan_commit(stream, thought, own));
      plan = &own;
    }
    if (full) THINKV_RETURN_IF_ERROR(give_storage(*plan));
    if (Status s = backend_.stage(stream, staged - 1, k.data(), v.data()); !s.is_ok()) {
      (void)follow_table();
      return s;
    }
    if (full) {
      if (Status s = backend_.commit(*plan); !s.is_ok()) {
        (void)follow_table();
        return s;
      }
      table_.apply_commit(*plan);
      planned_bytes_ += layout().commit_bytes(plan->precision);
    }
    return Status::ok();
  }

  /// Many streams' K/V from tensors in the backend's memory, in one stage and one commit call:
  /// `rows` say where each input row goes (its stream's staging row: the pushed token's row, or,
  /// for a prompt, rows 0.. of groups the caller commits with explicit metadata); `plans` commit
  /// full groups (made with PlanClaims against the table as it is now, in the order made).
  /// `segments` / `positions` ([plans.size() x group_size]) give the plans' token metadata, or are
  /// empty: the staging sets' groups. The caller has checked that rows and plans agree (this call
  /// checks ranges only). Errors (the table unchanged): kInvalidArgument (a row or plan out of
  /// range), the backend's.
  [[nodiscard]] Status write_batch(std::span<const StageRow> rows, TensorRef k, TensorRef v,
                                   std::span<const CommitPlan> plans, std::span<const std::uint32_t> segments = {},
                                   std::span<const std::int32_t> positions = {}) requires batched_kv_backend<B> {
    const int g = config().group_size;
    for (const StageRow& r : rows) {
      if (!table_.check_stream(r.stream).is_ok() || r.row < 0 || r.row >= g) {
        return {StatusCode::kInvalidArgument, "write_batch: a row for stream " + std::to_string(r.stream) +
                                                  ", staging row " + std::to_string(r.row) + " is out of range"};
      }
    }
    for (const CommitPlan& plan : plans) {
      if (!table_.check_stream(plan.stream).is_ok() || static_cast<int>(plan.slots.size()) != g) {
        return {StatusCode::kInvalidArgument,
                "write_batch: the commit plan of stream " + std::to_string(plan.stream) + " is not a group"};
      }
    }
    const bool explicit_meta = !segments.empty();
    if (explicit_meta &&
        (segments.size() != plans.size() * static_cast<std::size_t>(g) || positions.size() != segments.size())) {
      return {StatusCode::kInvalidArgument,
              "write_batch: segments and positions must hold group_size entries per plan"};
    }
    THINKV_RETURN_IF_ERROR(give_storage(plans));
    if (!rows.empty()) {
      if (Status e = backend_.stage_batch(rows, k, v); !e.is_ok()) {
        (void)follow_table();
        return e;
      }
    }
    if (!plans.empty()) {
      if (Status e = backend_.commit_batch(plans); !e.is_ok()) {
        (void)follow_table();
        return e;
      }
    }
    for (std::size_t i = 0; i < plans.size(); ++i) {
      if (explicit_meta) {
        const auto off = i * static_cast<std::size_t>(g);
        table_.apply_commit(plans[i], segments.subspan(off, static_cast<std::size_t>(g)),
                            positions.subspan(off, static_cast<std::size_t>(g)));
      } else {
        table_.apply_commit(plans[i]);
      }
      planned_bytes_ += layout().commit_bytes(plans[i].precision);
    }
    return Status::ok();
  }

  /// Records commits whose data the backend writes later, in the order they were planned (with
  /// PlanClaims, against the table as it is now): storage for all of them first (nothing changes
  /// when that fails), then each applied to the table. A decode step uses it: begin_step applies
  /// every layer's commits at once, and the backend's append_step writes each layer's data
  /// (StepView) before that layer's attention reads it.
  [[nodiscard]] Status apply_plans(std::span<const CommitPlan> plans) {
    const int g = config().group_size;
    for (const CommitPlan& plan : plans) {
      if (!table_.check_stream(plan.stream).is_ok() || static_cast<int>(plan.slots.size()) != g ||
          table_.staged_count(plan.stream) != g) {
        return {StatusCode::kInvalidArgument, "apply_plans: the commit plan of stream " + std::to_string(plan.stream) +
                                                  " does not match a full staging group"};
      }
    }
    THINKV_RETURN_IF_ERROR(give_storage(plans));
    for (const CommitPlan& plan : plans) {
      table_.apply_commit(plan);
      planned_bytes_ += layout().commit_bytes(plan.precision);
    }
    return Status::ok();
  }
  /// Gives the backend the storage plans made together (PlanClaims) will write, before anything
  /// is recorded (apply_plans then finds it in place). Nothing changes on an error.
  [[nodiscard]] Status provide_storage(std::span<const CommitPlan> plans) { return give_storage(plans); }

  /// Bytes the commit plans of new tokens account for: g slots' K/V rows and value scales, plus
  /// the record's key scales when quantized. Every byte the cache stores is one of these.
  [[nodiscard]] std::int64_t planned_bytes() const noexcept { return planned_bytes_; }
  /// Bytes the backend wrote beyond what new tokens account for: data moved to gather or compact
  /// (the backend counts where it writes). Continuous Thinking evicts by marking and refills
  /// slots in place, so this is 0; a test fails if anything else is ever written.
  [[nodiscard]] std::int64_t moved_bytes() const { return backend_.stats().page_bytes_written - planned_bytes_; }

  /// Sets the open group of the staging set of `stream` directly: `segments.size()` tokens
  /// (fewer than group_size) of thought `t` ending at position next - 1, the set's next position
  /// being `next` (BlockTable::set_staged). A prompt's tokens past its last full group.
  [[nodiscard]] Status set_staged(int stream, ThoughtType t, std::span<const std::uint32_t> segments,
                                  std::int32_t next) {
    THINKV_RETURN_IF_ERROR(table_.check_stream(stream));
    if (static_cast<int>(segments.size()) >= config().group_size || next < static_cast<std::int32_t>(segments.size())) {
      return {StatusCode::kInvalidArgument, "set_staged: " + std::to_string(segments.size()) +
                                                " tokens ending before position " + std::to_string(next)};
    }
    table_.set_staged(stream, t, segments, next);
    return Status::ok();
  }

  /// What rotate_keys overwrote, to write back if a later step of a shift fails: the key rows it
  /// rewrote (not whole pages) and the staged rows.
  struct KeyRotationUndo {
    struct PageRows {
      Precision precision;
      std::uint32_t page;
      std::vector<std::uint32_t> rows;  ///< slots whose key row was rewritten
      std::vector<std::uint8_t> keys;   ///< their key rows before, rows.size() x row_bytes
    };
    struct Row {
      int stream, row;
      std::vector<float> k, v;
    };
    std::vector<PageRows> pages;
    std::vector<Row> staged;
  };
  /// Rotates the stored keys of the stream's live tokens at positions [lo, hi) through `delta`
  /// positions of `rope` (RoPE composes: R(p + delta) = R(delta) R(p)): each key is decoded,
  /// rotated in double and rounded to BF16 once (rotate_bf16_key). Only BF16 pages and the
  /// staging buffer (BF16) can be rotated exactly: a quantized page holding such a token is
  /// kUnsupported (callers check first; nothing is written then). What is overwritten goes to
  /// `undo` before it is written; on a backend error the caller writes it back (undo_rotation).
  /// Positions do not change here (shift_positions).
  [[nodiscard]] Status rotate_keys(int stream, std::int32_t lo, std::int32_t hi, std::int32_t delta,
                                   const RopeSpec& rope, KeyRotationUndo& undo) requires state_io_backend<B> {
    THINKV_RETURN_IF_ERROR(table_.check_stream(stream));
    const int d = config().head_dim;
    const auto rb = static_cast<std::size_t>(layout().row_bytes(Precision::kBf16));
    std::vector<double> scratch(static_cast<std::size_t>(d));
    std::vector<std::uint16_t> key(static_cast<std::size_t>(d));
    std::vector<std::uint32_t> rows;
    std::vector<std::uint8_t> bytes;
    const RopeSpec::Turn turn = rope.turn(delta, d);
    for (const std::uint32_t b : table_.blocks(stream)) {
      rows.clear();
      for (int i = 0; i < table_.block_fill(b); ++i) {
        const SlotRef r{b, static_cast<std::uint32_t>(i)};
        const std::int32_t pos = table_.slot_position(r);
        if (pos >= lo && pos < hi && !table_.is_evicted(r)) rows.push_back(r.slot);
      }
      if (rows.empty()) continue;
      const Precision p = table_.block_precision(b);
      if (p != Precision::kBf16) {
        return {StatusCode::kUnsupported, "rotate_keys: stream " + std::to_string(stream) + " holds positions of [" +
                                              std::to_string(lo) + ", " + std::to_string(hi) + ") in a " +
                                              std::string(to_string(p)) + " page"};
      }
      const std::uint32_t page = table_.pools().local_index(b);
      bytes.resize(static_cast<std::size_t>(layout().page_bytes(p)));
      THINKV_RETURN_IF_ERROR(backend_.read_page(p, page, bytes));
      auto& saved = undo.pages.emplace_back();
      saved.precision = p;
      saved.page = page;
      saved.rows = rows;
      saved.keys.reserve(rows.size() * rb);
      for (const std::uint32_t i : rows) {  // key row i: D little-endian BF16 values at i * row_bytes
        std::uint8_t* row = bytes.data() + i * rb;
        saved.keys.insert(saved.keys.end(), row, row + rb);
        for (int c = 0; c < d; ++c)
          key[static_cast<std::size_t>(c)] = static_cast<std::uint16_t>(row[2 * c] | (row[2 * c + 1] << 8));
        rotate_bf16_key(key, turn, scratch);
        for (int c = 0; c < d; ++c) {
          row[2 * c] = static_cast<std::uint8_t>(key[static_cast<std::size_t>(c)] & 0xFF);
          row[2 * c + 1] = static_cast<std::uint8_t>(key[static_cast<std::size_t>(c)] >> 8);
        }
      }
      THINKV_RETURN_IF_ERROR(backend_.write_page(p, page, bytes));
    }
    std::vector<float> k(static_cast<std::size_t>(d)), v(static_cast<std::size_t>(d));
    for (int r = 0; r < table_.staged_count(stream); ++r) {
      const std::int32_t pos = table_.staged_position(stream, r);
      if (pos < lo || pos >= hi) continue;
      THINKV_RETURN_IF_ERROR(backend_.read_staged(stream, r, k.data(), v.data()));
      undo.staged.push_back({stream, r, k, v});
      for (int c = 0; c < d; ++c)
        key[static_cast<std::size_t>(c)] =
            encode_bf16(k[static_cast<std::size_t>(c)]);  // staged values are BF16 values
      rotate_bf16_key(key, turn, scratch);
      for (int c = 0; c < d; ++c) k[static_cast<std::size_t>(c)] = decode_bf16(key[static_cast<std::size_t>(c)]);
      THINKV_RETURN_IF_ERROR(backend_.stage(stream, r, k.data(), v.data()));
    }
    return Status::ok();
  }
  /// One BF16 key turned through a shift: decoded, rotated in double, rounded to BF16 once
  /// (encode_bf16_from_double). `scratch` holds key.size() doubles.
  static void rotate_bf16_key(std::span<std::uint16_t> key, const RopeSpec::Turn& turn, std::span<double> scratch) {
    for (std::size_t c = 0; c < key.size(); ++c) scratch[c] = decode_bf16(key[c]);
    RopeSpec::apply(scratch, turn);
    for (std::size_t c = 0; c < key.size(); ++c) key[c] = encode_bf16_from_double(scratch[c]);
  }
  /// Writes back what rotate_keys overwrote (latest first): each page read, its saved key rows
  /// put back, written. The first backend error, if any (the others are still attempted).
  [[nodiscard]] Status undo_rotation(const KeyRotationUndo& undo) requires state_io_backend<B> {
    Status first = Status::ok();
    auto note = [&first](const Status& e) {
      if (first.is_ok() && !e.is_ok()) first = e;
    };
    for (auto it = undo.staged.rbegin(); it != undo.staged.rend(); ++it) {
      note(backend_.stage(it->stream, it->row, it->k.data(), it->v.data()));
    }
    const auto rb = static_cast<std::size_t>(layout().row_bytes(Precision::kBf16));
    std::vector<std::uint8_t> bytes;
    for (auto it = undo.pages.rbegin(); it != undo.pages.rend(); ++it) {
      bytes.resize(static_cast<std::size_t>(layout().page_bytes(it->precision)));
      if (Status e = backend_.read_page(it->precision, it->page, bytes); !e.is_ok()) {
        note(e);
        continue;
      }
      for (std::size_t j = 0; j < it->rows.size(); ++j) {
        std::memcpy(bytes.data() + it->rows[j] * rb, it->keys.data() + j * rb, rb);
      }
      note(backend_.write_page(it->precision, it->page, bytes));
    }
    return first;
  }
  /// Moves the positions of the stream's written slots in [lo, hi) by `delta` (metadata only;
  /// BlockTable::shift_positions). The staging set's rows move with set_staged.
  [[nodiscard]] Status shift_positions(int stream, std::int32_t lo, std::int32_t hi, std::int32_t delta) {
    THINKV_RETURN_IF_ERROR(table_.check_stream(stream));
    table_.shift_positions(stream, lo, hi, delta);
    return Status::ok();
  }

  /// Gives the stream's staging group (tokens not yet quantized) thought type `t`. On a thought
  /// refresh at a position that is a multiple of tau (itself a multiple of group_size) the group
  /// holds only the token just decoded, so the new type starts exactly at a group boundary.
  [[nodiscard]] Status relabel_staged(int stream, ThoughtType t) {
    THINKV_RETURN_IF_ERROR(table_.check_stream(stream));
    table_.relabel_staged(stream, t);
    return Status::ok();
  }

  /// Marks live slots of a stream evicted (no data moves). All-or-nothing. Chunks left with no
  /// held block at the top of a pool are released (allocated() drops).
  [[nodiscard]] Status evict(int stream, std::span<const SlotRef> slots) {
    THINKV_RETURN_IF_ERROR(table_.evict(stream, slots));
    return follow_table();
  }

  /// Decode attention of one (sequence, layer) over the streams named in args.
  /// The backend sees the attended streams' block lists and the pools' metadata (AttendView).
  [[nodiscard]] Status attend(const DecodeAttentionArgs& args) const {
    THINKV_RETURN_IF_ERROR(check_attention_args(args, config().num_streams));
    std::vector<StreamView> streams;
    streams.reserve(static_cast<std::size_t>(args.num_kv_heads));
    return backend_.attend(
        table_.attend_view(std::span<const std::int32_t>(args.kv_streams, static_cast<std::size_t>(args.num_kv_heads)),
                           streams),
        args);
  }

  /// A prompt chunk's attention (batch.hpp, chunk_attending_backend): `streams` names the stream
  /// of each KV head (a.num_kv_heads), whose stored tokens the chunk's queries attend before its
  /// own K/V.
  [[nodiscard]] Status attend_chunk(std::span<const std::int32_t> streams,
                                    const PromptAttendArgs& a) const requires chunk_attending_backend<B> {
    for (const std::int32_t st : streams) THINKV_RETURN_IF_ERROR(table_.check_stream(st));
    std::vector<StreamView> views;
    views.reserve(streams.size());
    return backend_.attend_chunk(table_.attend_view(streams, views), a);
  }

  /// Dequantizes one live slot of the cache.
  [[nodiscard]] Status read_token(SlotRef slot, std::span<float> k, std::span<float> v) const {
    if (static_cast<int>(k.size()) != config().head_dim || static_cast<int>(v.size()) != config().head_dim) {
      return {StatusCode::kShapeMismatch,
              "read_token: k and v need head_dim = " + std::to_string(config().head_dim) + " floats"};
    }
    if (!table_.is_live(slot)) {
      return {StatusCode::kInvalidArgument, "read_token: slot {block " + std::to_string(slot.block) + ", slot " +
                                                std::to_string(slot.slot) + "} is not live"};
    }
    return backend_.read_token(table_.token_ref(slot), k.data(), v.data());
  }

  /// Releases everything a stream holds (end of its sequence).
  [[nodiscard]] Status reset_stream(int stream) {
    THINKV_RETURN_IF_ERROR(table_.check_stream(stream));
    THINKV_RETURN_IF_ERROR(backend_.reset_stream(stream));
    table_.reset_stream(stream);
    return follow_table();
  }

  /// The stored state of a stream (its pages, records, scales and staged tokens), for
  /// load_streams into this cache or another of the same configuration.
  /// With `first_block`, only the stream's blocks from that index on (BlockTable::export_stream).
  [[nodiscard]] Status save_stream(int stream, StreamSnapshot& out,
                                   std::size_t first_block = 0) const requires state_io_backend<B> {
    THINKV_RETURN_IF_ERROR(table_.check_stream(stream));
    std::vector<std::uint32_t> blocks, records;
    table_.export_stream(stream, out.image, blocks, records, first_block);
    std::size_t bytes = 0;
    for (std::uint32_t b : blocks) bytes += static_cast<std::size_t>(layout().page_bytes(table_.block_precision(b)));
    out.pages.resize(bytes);
    std::size_t at = 0;
    for (std::size_t k = 0; k < blocks.size(); ++k) {
      const std::uint32_t b = blocks[k];
      const Precision p = table_.block_precision(b);
      const auto n = static_cast<std::size_t>(layout().page_bytes(p));
      const std::span<std::uint8_t> page = std::span(out.pages).subspan(at, n);
      THINKV_RETURN_IF_ERROR(backend_.read_page(p, table_.pools().local_index(b), page));
      // Unwritten slots are saved as zeros: a block taken from the pool keeps its previous
      // owner's bytes there (a commit writes only its slots), which are not this stream's.
      for (int i = out.image.blocks[k].fill; i < config().block_size; ++i) layout().clear_slot(page, p, i);
      at += n;
    }
    const auto d = static_cast<std::size_t>(config().head_dim);
    out.records.resize(records.size() * d);
    for (std::size_t j = 0; j < records.size(); ++j) {
      THINKV_RETURN_IF_ERROR(backend_.read_record(records[j], std::span(out.records).subspan(j * d, d)));
    }
    THINKV_RETURN_IF_ERROR(backend_.read_stream_scales(stream, out.scales));
    const int staged = table_.staged_count(stream);
    out.staged.resize(static_cast<std::size_t>(staged) * 2 * d);
    for (int r = 0; r < staged; ++r) {
      float* row = out.staged.data() + static_cast<std::size_t>(r) * 2 * d;
      THINKV_RETURN_IF_ERROR(backend_.read_staged(stream, r, row, row + d));
    }
    return Status::ok();
  }
  /// The open group of the stream's staging set.
  [[nodiscard]] StageSnapshot stage_snapshot(int stream) const {
    StageSnapshot st;
    st.thought = table_.staged_thought(stream);
    const int staged = table_.staged_count(stream);
    for (int r = 0; r < staged; ++r) st.segments.push_back(table_.staged_segment(stream, r));
    st.next_position = table_.next_position(stream);
    return st;
  }

  /// Restores streams first .. first + in.size() - 1, whole staging sets that hold nothing (no
  /// block, no staged token), from snapshots, and their sets' open group from `stage`. All or
  /// nothing: kCorruptData (a snapshot this cache cannot hold: sizes, metadata, non-finite staged
  /// values), kInvalidArgument (streams not empty or not whole sets), kPoolExhausted (with what
  /// `reserved` keeps for open tokens: a load never takes blocks or records an open token was
  /// promised); on any error the streams stay empty and nothing else changes.
  [[nodiscard]] Status load_streams(int first, std::span<const StreamSnapshot> in, const StageSnapshot& stage,
                                    const PlanClaims& reserved = {}) requires state_io_backend<B> {
    const int n = static_cast<int>(in.size());
    const int set = config().stage_set_streams;
    const int g = config().group_size;
    const auto d = static_cast<std::size_t>(config().head_dim);
    if (first < 0 || n <= 0 || first > config().num_streams - n || first % set != 0 || n % set != 0) {
      return {StatusCode::kInvalidArgument, "load_streams: streams " + std::to_string(first) + " .. " +
                                                std::to_string(first + n - 1) +
                                                " are not whole staging sets of this cache's streams"};
    }
    for (int st = first; st < first + n; ++st) {
      if (!table_.blocks(st).empty() || table_.staged_count(st) != 0 || table_.next_position(st) != 0) {
        return {StatusCode::kInvalidArgument, "load_streams: stream " + std::to_string(st) +
                                                  " holds tokens; reset it first (a load replaces nothing)"};
      }
    }
    const int staged = static_cast<int>(stage.segments.size());
    if (static_cast<int>(stage.thought) >= kNumThoughtTypes || staged >= g || stage.next_position < staged) {
      return {StatusCode::kCorruptData, "load_streams: the staging group (" + std::to_string(staged) +
                                            " tokens before position " + std::to_string(stage.next_position) +
                                            ") is not one this cache can hold (group_size " + std::to_string(g) + ")"};
    }
    std::vector<const StreamImage*> images;  // the snapshots' own (no copy)
    images.reserve(in.size());
    for (int k = 0; k < n; ++k) {
      const StreamSnapshot& sn = in[static_cast<std::size_t>(k)];
      auto where = [&](const Status& e) {
        return Status{e.code(), "stream " + std::to_string(k) + " of the snapshot: " + e.message()};
      };
      THINKV_RETURN_IF_ERROR(where(table_.check_image(sn.image)));
      std::size_t bytes = 0;
      for (const BlockImage& bi : sn.image.blocks) {
        bytes += static_cast<std::size_t>(layout().page_bytes(config().precision.precision_of(bi.thought)));
      }
      if (sn.pages.size() != bytes || sn.records.size() != sn.image.records * d ||
          sn.staged.size() != static_cast<std::size_t>(staged) * 2 * d) {
        return where({StatusCode::kCorruptData, "its byte sizes do not match its blocks, records and staged tokens"});
      }
      // A save writes zeros into the slots past a block's fill (save_stream): anything else there
      // is damage, and would not save back to the same bytes.
      std::size_t at = 0;
      for (std::size_t bk = 0; bk < sn.image.blocks.size(); ++bk) {
        const BlockImage& bi = sn.image.blocks[bk];
        const Precision p = config().precision.precision_of(bi.thought);
        const auto page =
            std::span<const std::uint8_t>(sn.pages).subspan(at, static_cast<std::size_t>(layout().page_bytes(p)));
        for (int i = bi.fill; i < config().block_size; ++i) {
          if (!layout().slot_is_clear(page, p, i)) {
            return where({StatusCode::kCorruptData, "block " + std::to_string(bk) +
                                                        " holds bytes in its unwritten slot " + std::to_string(i) +
                                                        " (a save writes zeros past a block's fill)"});
          }
        }
        at += page.size();
      }
      for (float x : sn.scales) {
        if (!std::isfinite(x) || x < 0.0f)
          return where({StatusCode::kCorruptData, "a second-level scale is not finite"});
      }
      for (float x : sn.staged) {
        if (!std::isfinite(x)) return where({StatusCode::kCorruptData, "a staged value is not finite"});
        if ((std::bit_cast<std::uint32_t>(x) & 0xFFFFu) != 0) {  // the staging buffer holds BF16
          return where({StatusCode::kCorruptData, "a staged value is not a BF16 value (staging holds BF16)"});
        }
      }
      images.push_back(&sn.image);
    }
    PlanClaims claims;
    std::vector<std::vector<std::uint32_t>> block_ids, record_ids;
    THINKV_RETURN_IF_ERROR(table_.plan_import(images, claims, block_ids, record_ids));
    THINKV_RETURN_IF_ERROR(table_.check_claims(claims, reserved, "loading a sequence's state"));
    // Storage first (nothing changes when it fails), then the bytes, then the table.
    std::uint32_t blocks[kNumPrecisions];
    for (Precision p : kAllPrecisions) blocks[static_cast<int>(p)] = table_.blocks_needed(p, block_ids);
    THINKV_RETURN_IF_ERROR(grow_storage(blocks, table_.records_needed(record_ids)));
    // The bytes go into pages and records still free in the table (free storage may hold any
    // bytes): a failure takes back the storage and the streams' scales and staging, and the
    // table never saw anything.
    if (Status e = write_snapshots(first, in, block_ids, record_ids); !e.is_ok()) {
      for (int st = first; st < first + n; ++st) (void)backend_.reset_stream(st);
      (void)follow_table();
      return e;
    }
    for (int k = 0; k < n; ++k) {
      table_.import_stream(first + k, *images[static_cast<std::size_t>(k)], block_ids[static_cast<std::size_t>(k)],
                           record_ids[static_cast<std::size_t>(k)]);
    }
    for (int k = 0; k < n; k += set) {
      table_.set_staged(first + k, stage.thought, stage.segments, stage.next_position);
    }
    return Status::ok();
  }

  /// Gives stream `dst` the first `n` blocks of stream `src`, shared (BlockTable::share_prefix:
  /// full, hole-free blocks; no data moves).
  [[nodiscard]] Status share_prefix(int src, int dst, std::size_t n) requires page_sharing_backend<B> {
    return table_.share_prefix(src, dst, n);
  }
  /// Copies shared blocks for the holders named in `which` ((stream, block) pairs: copy on write,
  /// BlockTable::plan_unshare): pages and key-scale records copied through the backend's state
  /// I/O, each stream's list then names its copy. All or nothing: kPoolExhausted (with what
  /// `reserved` keeps for open tokens) or the backend's error, and nothing changes.
  [[nodiscard]] Status unshare(std::span<const std::pair<int, std::uint32_t>> which,
                               const PlanClaims& reserved = {}) requires state_io_backend<B> {
    if (which.empty()) return Status::ok();
    PlanClaims claims;
    std::vector<BlockTable::UnsharePlan> plans(which.size());
    for (std::size_t i = 0; i < which.size(); ++i) {
      THINKV_RETURN_IF_ERROR(table_.plan_unshare(which[i].first, which[i].second, plans[i], claims));
    }
    THINKV_RETURN_IF_ERROR(table_.check_claims(claims, reserved, "copying shared blocks"));
    std::vector<std::vector<std::uint32_t>> block_ids(1), record_ids(1);
    for (const auto& u : plans) {
      block_ids[0].push_back(u.to);
      record_ids[0].insert(record_ids[0].end(), u.records_to.begin(), u.records_to.end());
    }
    std::uint32_t blocks[kNumPrecisions];
    for (Precision p : kAllPrecisions) blocks[static_cast<int>(p)] = table_.blocks_needed(p, block_ids);
    THINKV_RETURN_IF_ERROR(grow_storage(blocks, table_.records_needed(record_ids)));
    // The copies go into pages and records still free in the table: a failure takes back the
    // storage and the table never saw anything.
    std::vector<std::uint8_t> page;
    std::vector<std::uint8_t> record(static_cast<std::size_t>(config().head_dim));
    auto copy = [&]() -> Status {
      for (const auto& u : plans) {
        const Precision p = table_.pools().precision_of(u.from);
        page.resize(static_cast<std::size_t>(layout().page_bytes(p)));
        THINKV_RETURN_IF_ERROR(backend_.read_page(p, table_.pools().local_index(u.from), page));
        THINKV_RETURN_IF_ERROR(backend_.write_page(p, table_.pools().local_index(u.to), page));
        for (std::size_t j = 0; j < u.records_from.size(); ++j) {
          THINKV_RETURN_IF_ERROR(backend_.read_record(u.records_from[j], record));
          THINKV_RETURN_IF_ERROR(backend_.write_record(u.records_to[j], record));
        }
      }
      return Status::ok();
    };
    if (Status e = copy(); !e.is_ok()) {
      (void)follow_table();
      return e;
    }
    table_.apply_unshare(plans);
    return Status::ok();
  }

  /// Exact memory of one stream. Precondition: 0 <= stream < num_streams (check_stream()).
  [[nodiscard]] MemoryUsage memory(int stream) const {
    assert(table_.check_stream(stream).is_ok());
    const CacheLayout& L = layout();
    MemoryUsage m;
    m.staged_tokens = table_.staged_count(stream);
    m.live_tokens = table_.live_slots(stream) + m.staged_tokens;
    m.hole_slots = table_.hole_slots(stream);
    m.records_held = table_.records_held(stream);
    for (std::uint32_t b : table_.blocks(stream)) {
      if (table_.block_owner(b) != stream) {  // a shared block: its owner counts it
        ++m.blocks_shared;
        continue;
      }
      const Precision p = table_.block_precision(b);
      ++m.blocks_held;
      m.page_bytes += L.page_bytes(p);
      m.metadata_bytes += L.block_meta_bytes() + CacheLayout::kBlockTableEntryBytes;
    }
    m.metadata_bytes += CacheLayout::kStreamHeaderBytes;
    m.scale_record_bytes = m.records_held * L.record_bytes();
    m.staging_bytes = L.staging_bytes();
    m.fullkv_fp16_bytes = L.fullkv_fp16_bytes(m.live_tokens);
    return m;
  }
  /// Exact memory summed over all streams.
  [[nodiscard]] MemoryUsage memory() const {
    MemoryUsage total;
    for (int s = 0; s < config().num_streams; ++s) total += memory(s);
    return total;
  }
  /// What the cache has allocated, in the terms of MemoryUsage: allocated blocks (held or
  /// free) with their pages, metadata and table entries, allocated key-scale records, every
  /// stream's header and staging buffer. physical_bytes() is BlockTable::allocated_bytes(), the
  /// figure memory_limit_bytes bounds; memory().physical_bytes() never exceeds it.
  [[nodiscard]] MemoryUsage allocated() const {
    const CacheLayout& L = layout();
    const auto streams = static_cast<std::int64_t>(config().num_streams);
    MemoryUsage m = memory();
    m.blocks_held = 0;
    m.page_bytes = 0;
    m.metadata_bytes = streams * CacheLayout::kStreamHeaderBytes;
    for (Precision p : kAllPrecisions) {
      const std::int64_t n = table_.allocated_blocks(p);
      m.blocks_held += n;
      m.page_bytes += n * L.page_bytes(p);
      m.metadata_bytes += n * (L.block_meta_bytes() + CacheLayout::kBlockTableEntryBytes);
    }
    m.records_held = table_.allocated_records();
    m.scale_record_bytes = m.records_held * L.record_bytes();
    m.staging_bytes = streams * L.staging_bytes();
    return m;
  }
  /// Bytes the cache has allocated (allocated().physical_bytes()).
  [[nodiscard]] std::int64_t allocated_bytes() const noexcept { return table_.allocated_bytes(); }

 private:
  /// Gives the backend storage for what the plan writes (its fresh blocks past the allocated
  /// chunks, its record) before it is written; the table takes the same chunks when it applies
  /// the plan. Nothing changes on an error.
  [[nodiscard]] Status give_storage(const CommitPlan& plan) {
    const int p = static_cast<int>(plan.precision);
    const std::uint32_t blocks = table_.blocks_needed(plan);
    const std::uint32_t records = table_.records_needed(plan);
    if (blocks != backend_blocks_[p]) {
      THINKV_RETURN_IF_ERROR(backend_.resize_pool(plan.precision, blocks));
      backend_blocks_[p] = blocks;
    }
    if (records != backend_records_) {
      if (Status s = backend_.resize_records(records); !s.is_ok()) {
        (void)follow_table();
        return s;
      }
      backend_records_ = records;
    }
    return Status::ok();
  }
  /// give_storage for a batch of plans made together (PlanClaims): the largest need per pool.
  [[nodiscard]] Status give_storage(std::span<const CommitPlan> plans) {
    std::uint32_t blocks[kNumPrecisions];
    for (Precision p : kAllPrecisions) blocks[static_cast<int>(p)] = table_.allocated_blocks(p);
    std::uint32_t records = table_.allocated_records();
    for (const CommitPlan& plan : plans) {
      const int p = static_cast<int>(plan.precision);
      blocks[p] = std::max(blocks[p], table_.blocks_needed(plan));
      records = std::max(records, table_.records_needed(plan));
    }
    return grow_storage(blocks, records);
  }
  /// Gives the backend storage for `blocks[p]` pages of each pool and `records` records where it
  /// has fewer (nothing changes on an error: what grew is taken back to the table's allocation).
  [[nodiscard]] Status grow_storage(const std::uint32_t (&blocks)[kNumPrecisions], std::uint32_t records) {
    for (Precision p : kAllPrecisions) {
      const int i = static_cast<int>(p);
      if (blocks[i] <= backend_blocks_[i]) continue;
      if (Status e = backend_.resize_pool(p, blocks[i]); !e.is_ok()) {
        (void)follow_table();
        return e;
      }
      backend_blocks_[i] = blocks[i];
    }
    if (records > backend_records_) {
      if (Status e = backend_.resize_records(records); !e.is_ok()) {
        (void)follow_table();
        return e;
      }
      backend_records_ = records;
    }
    return Status::ok();
  }
  /// load_streams' writes of the snapshots' bytes into the storage the table gave them.
  [[nodiscard]] Status write_snapshots(
      int first, std::span<const StreamSnapshot> in, const std::vector<std::vector<std::uint32_t>>& block_ids,
      const std::vector<std::vector<std::uint32_t>>& record_ids) requires state_io_backend<B> {
    const auto d = static_cast<std::size_t>(config().head_dim);
    for (std::size_t k = 0; k < in.size(); ++k) {
      const StreamSnapshot& sn = in[k];
      const int stream = first + static_cast<int>(k);
      std::size_t at = 0;
      for (std::uint32_t b : block_ids[k]) {
        const Precision p = table_.pools().precision_of(b);
        const auto bytes = static_cast<std::size_t>(layout().page_bytes(p));
        THINKV_RETURN_IF_ERROR(
            backend_.write_page(p, table_.pools().local_index(b), std::span(sn.pages).subspan(at, bytes)));
        at += bytes;
      }
      for (std::size_t j = 0; j < record_ids[k].size(); ++j) {
        THINKV_RETURN_IF_ERROR(backend_.write_record(record_ids[k][j], std::span(sn.records).subspan(j * d, d)));
      }
      THINKV_RETURN_IF_ERROR(backend_.write_stream_scales(stream, sn.scales));
      for (std::size_t r = 0; r * 2 * d < sn.staged.size(); ++r) {
        const float* row = sn.staged.data() + r * 2 * d;
        THINKV_RETURN_IF_ERROR(backend_.stage(stream, static_cast<int>(r), row, row + d));
      }
    }
    return Status::ok();
  }
  /// One token's K and V for a stream: the stream exists, head_dim values each, all finite.
  [[nodiscard]] Status check_token_kv(int stream, std::span<const float> k, std::span<const float> v) const {
    THINKV_RETURN_IF_ERROR(table_.check_stream(stream));
    const int d = config().head_dim;
    if (static_cast<int>(k.size()) != d || static_cast<int>(v.size()) != d) {
      return {StatusCode::kShapeMismatch, "append to stream " + std::to_string(stream) + ": k has " +
                                              std::to_string(k.size()) + " and v has " + std::to_string(v.size()) +
                                              " values; expected head_dim = " + std::to_string(d)};
    }
    return check_kv_values(k, v, "stream " + std::to_string(stream));
  }
  /// The per-stream appends stage each stream on its own: they need stage_set_streams 1.
  [[nodiscard]] Status check_own_staging(const char* call) const {
    if (config().stage_set_streams == 1) return Status::ok();
    return {StatusCode::kInvalidArgument,
            std::string(call) + ": this cache's streams share staging sets of " +
                std::to_string(config().stage_set_streams) +
                " (CacheConfig::stage_set_streams); push each token once with push_staged, then append_pushed"};
  }
  /// Makes the backend's storage what the table has allocated (after a release, or to undo
  /// give_storage when a later step failed).
  [[nodiscard]] Status follow_table() {
    for (Precision p : kAllPrecisions) {
      const int i = static_cast<int>(p);
      const std::uint32_t n = table_.allocated_blocks(p);
      if (n == backend_blocks_[i]) continue;
      if (Status s = backend_.resize_pool(p, n); !s.is_ok()) {
        return {StatusCode::kInternal, "backend '" + std::string(backend_.name()) + "' failed to release " +
                                           std::string(to_string(p)) + " pages: " + s.message()};
      }
      backend_blocks_[i] = n;
    }
    if (table_.allocated_records() < backend_records_) {
      THINKV_RETURN_IF_ERROR(backend_.resize_records(table_.allocated_records()));
      backend_records_ = table_.allocated_records();
    }
    return Status::ok();
  }

  BlockTable table_;
  B backend_;
  std::int64_t planned_bytes_ = 0;
  std::uint32_t backend_blocks_[kNumPrecisions] = {};  // pages the backend has storage for, per pool
  std::uint32_t backend_records_ = 0;
  std::vector<StageRow> rows_;              // append_batch scratch
  std::vector<std::uint32_t> batch_index_;  // append_batch: [num_streams] token of a stream + 1
};

}  // namespace thinkv
