#pragma once
/// \file thinkv_cache.hpp
/// ThinKvCache: the object a decoder uses. It ties thought classification, TBQ quantization,
/// TBE eviction and in-place reuse (CT) together over a PagedKvCache, for a batch of sequences
/// of one model (layers x KV heads streams per sequence).
///
/// Per decoded token of a sequence:
///     cache.begin_token(seq);                          // type and segment of this position
///     for each layer: cache.append(seq, layer, k, v);  // post-RoPE K/V of all KV heads
///                     cache.attend(seq, layer, q, out);// also records sparsity when wanted
///     cache.end_token(seq);                            // refresh, relabel, plan + apply TBE
/// What the cache runs is a policy set (policy/cache_policy.hpp): BasicThinKvCache<Policy, Backend>.
/// FullKvCache, TbqCache, TbeCache and ThinKvCache are the paper's ablation as ready-made sets,
/// so every one of them runs with the same decoder; a user set plugs its own classifier,
/// precision policy, retention schedule or token selector into the same cache.

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <deque>
#include <functional>
#include <numeric>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <string_view>
#include <vector>

#include "thinkv/backend/batch.hpp"
#include "thinkv/backend/cpu_backend.hpp"
#include "thinkv/backend/kv_backend.hpp"
#include "thinkv/decode_cache.hpp"
#include "thinkv/paged_kv_cache.hpp"
#include "thinkv/tbe/eviction_plan.hpp"
#include "thinkv/policy/cache_policy.hpp"
#include "thinkv/seq/rope.hpp"
#include "thinkv/seq/state_codec.hpp"
#include "thinkv/tbe/token_selector.hpp"
#include "thinkv/thought/classifier.hpp"

namespace thinkv {

/// The shape and the run-time settings of a BasicThinKvCache; what it does with them is its
/// policy set's (precision, classifier, retention, selection). token_budget and the eviction
/// checks apply only to sets that evict.
struct ThinKvConfig {
  int num_sequences = 1;
  int num_layers = 1;
  int num_kv_heads = 1;
  int num_q_heads = 1;  ///< a multiple of num_kv_heads (GQA)
  int head_dim = 128;
  int max_tokens = 4096;  ///< positions per sequence (bounds the pools' block-id ranges)
  int group_size = 16;
  int block_size = 16;
  int token_budget = 1024;  ///< live tokens per stream, used by policy sets that evict (0 = none)
  int segment_len = 128;    ///< thought segment length (a multiple of group_size)
  /// Block-id range of each precision pool; 0 = the worst case, so that no stream can run out
  /// (paged_config()). Ranges cost nothing: storage is allocated in chunks as blocks are taken.
  int pool_blocks = 0;
  /// The range of one precision pool (indexed by Precision), overriding pool_blocks for it; 0 =
  /// pool_blocks' value. For a runtime that sizes each pool to what its workload was measured to
  /// hold (then reserves them: CudaKvBackend::reserve_storage) instead of the worst case; a pool
  /// that runs out returns kPoolExhausted naming it, and the cache is unchanged.
  std::array<int, kNumPrecisions> pool_blocks_by_precision{0, 0, 0, 0};
  /// Most bytes the cache may allocate for all its sequences (CacheConfig::memory_limit_bytes);
  /// 0 = no limit. max_sequences() says how many sequences fit in a given number of bytes.
  std::int64_t memory_limit_bytes = 0;
  int chunk_blocks = 64;          ///< blocks per allocation chunk (CacheConfig::chunk_blocks)
  float softmax_scale = 0.0f;     ///< 0 = 1/sqrt(head_dim)
  bool trace_all_layers = false;  ///< record sparsity of every layer on every step (for traces)
  /// The first positions of every sequence that are never evicted, stored as R and not
  /// reclassified (the prompt, in the decode-stage setting ThinKV targets: thoughts are the
  /// generated tokens); the token budget counts the tokens after them. Per sequence:
  /// ThinKvCache::pin_prefix. 0 = none (the default: every token is a thought).
  int pinned_prefix = 0;
  /// copy_sequence shares the source's full blocks of pinned prompt tokens with the copy
  /// (reference counted, copied when a remove() writes into one) instead of copying them, with
  /// a backend that reads shared blocks (page_sharing_backend: the CPU backend). false: every
  /// copy is whole.
  bool share_prompt_blocks = true;
  /// Tensor parallelism: this cache holds KV heads [kv_head_offset, kv_head_offset +
  /// num_kv_heads) of a model with model_kv_heads KV heads per layer (0 = num_kv_heads: the whole
  /// model). K-means selections are seeded by the model's (layer, KV head), so each rank selects
  /// what the unsharded cache selects for its heads; ThinKvCache::set_signal_reduction makes the
  /// thought signal the mean over every rank's query heads.
  int model_kv_heads = 0;
  int kv_head_offset = 0;

  static constexpr int kMaxKvHeads = 4096;
  static constexpr int kMaxTokens = 1 << 30;

  /// Streams of one sequence (valid once validate() passed: the product is then bounded).
  [[nodiscard]] int streams_per_sequence() const noexcept { return num_layers * num_kv_heads; }

  [[nodiscard]] Status validate() const {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    if (num_sequences < 1) return bad("num_sequences " + std::to_string(num_sequences) + " must be >= 1");
    if (num_layers < 1 || num_layers > kMaxClassifierLayers) {
      return bad("num_layers " + std::to_string(num_layers) + " is out of range; allowed: 1.." +
                 std::to_string(kMaxClassifierLayers));
    }
    if (num_kv_heads < 1 || num_kv_heads > kMaxKvHeads) {
      return bad("num_kv_heads " + std::to_string(num_kv_heads) + " is out of range; allowed: 1.." +
                 std::to_string(kMaxKvHeads));
    }
    if (num_q_heads < 1 || num_q_heads % num_kv_heads != 0) {
      return bad("num_q_heads " + std::to_string(num_q_heads) + " must be a positive multiple of num_kv_heads " +
                 std::to_string(num_kv_heads));
    }
    // Products in 64 bits: the streams (sequences x layers x KV heads) must fit the paged cache.
    const std::int64_t streams = std::int64_t{num_sequences} * num_layers * num_kv_heads;
    if (streams > CacheConfig::kMaxStreams) {
      return bad("num_sequences " + std::to_string(num_sequences) + " x num_layers " + std::to_string(num_layers) +
                 " x num_kv_heads " + std::to_string(num_kv_heads) + " = " + std::to_string(streams) +
                 " streams; allowed: at most " + std::to_string(CacheConfig::kMaxStreams));
    }
    if (max_tokens < 1 || max_tokens > kMaxTokens) {
      return bad("max_tokens " + std::to_string(max_tokens) + " is out of range; allowed: 1.." +
                 std::to_string(kMaxTokens));
    }
    // group_size and block_size first: the checks below and paged_config() divide by them.
    THINKV_RETURN_IF_ERROR(CacheConfig::check_group_size(group_size));
    THINKV_RETURN_IF_ERROR(CacheConfig::check_block_size(block_size));
    if (segment_len < group_size || segment_len % group_size != 0) {
      return bad("segment_len " + std::to_string(segment_len) +
                 " must be a positive multiple of "
                 "group_size " +
                 std::to_string(group_size));
    }
    if (pool_blocks < 0) return bad("pool_blocks " + std::to_string(pool_blocks) + " must be >= 0");
    for (Precision p : kAllPrecisions) {
      const int n = pool_blocks_by_precision[static_cast<int>(p)];
      if (n < 0) {
        return bad("pool_blocks_by_precision[" + std::string(to_string(p)) + "] " + std::to_string(n) +
                   " must be >= 0 (0 = pool_blocks)");
      }
    }
    if (!(softmax_scale >= 0.0f) || std::isinf(softmax_scale)) {
      return bad("softmax_scale " + std::to_string(softmax_scale) + " must be finite and >= 0 (0 = 1/sqrt(head_dim))");
    }
    if (token_budget < 0) return bad("token_budget " + std::to_string(token_budget) + " must be >= 0");
    if (pinned_prefix < 0 || pinned_prefix > max_tokens) {
      return bad("pinned_prefix " + std::to_string(pinned_prefix) + " is out of range; allowed: 0..max_tokens (" +
                 std::to_string(max_tokens) + ")");
    }
    const int model = model_kv_heads == 0 ? num_kv_heads : model_kv_heads;
    if (model_kv_heads < 0 || kv_head_offset < 0 || kv_head_offset > model - num_kv_heads) {
      return bad("kv_head_offset " + std::to_string(kv_head_offset) + " with model_kv_heads " +
                 std::to_string(model_kv_heads) + " does not hold this cache's " + std::to_string(num_kv_heads) +
                 " KV heads; allowed: model_kv_heads 0 (= num_kv_heads) or >= num_kv_heads, 0 <= kv_head_offset <= "
                 "model_kv_heads - num_kv_heads");
    }
    return paged_config(kFullKvMap).validate();
  }

  /// Checks the configuration (validate()) and a policy set against it: the classifier fits the
  /// model and refreshes on group boundaries, the precision policy lowers to a valid map, the
  /// retention schedule is strictly decreasing and fits a segment, the selector's settings, and
  /// the budget (sets that evict). The message names the bad value.
  template <cache_policy P>
  [[nodiscard]] Status validate(const P& policy) const {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    THINKV_RETURN_IF_ERROR(validate());
    THINKV_RETURN_IF_ERROR(policy.classifier.check(num_layers));
    const int tau = policy.classifier.tau();
    if (tau < 1 || tau % group_size != 0) {
      return bad("tau " + std::to_string(tau) + " is not a multiple of group_size " + std::to_string(group_size) +
                 "; thought refreshes must fall on quantization group boundaries (use tau = k * group_size, e.g. "
                 "128; the classifier: " +
                 std::string(policy.classifier.to_string()) + ")");
    }
    PrecisionMap map;
    THINKV_RETURN_IF_ERROR(lower_precision(policy.precision, map));
    if constexpr (P::kEvicts) {
      THINKV_RETURN_IF_ERROR(check_retention(policy.retention));
      if (segment_len < policy.retention.retained(1)) {
        return bad("segment_len " + std::to_string(segment_len) + " is below the first retention level " +
                   std::to_string(policy.retention.retained(1)) + " of " + policy.retention.to_string());
      }
      THINKV_RETURN_IF_ERROR(policy.selector.check());
      // Only closed segments are evicted, so the open one alone can hold segment_len live tokens:
      // a smaller budget could never be met.
      if (token_budget > 0 && token_budget < segment_len) {
        return bad("token_budget " + std::to_string(token_budget) + " is below segment_len " +
                   std::to_string(segment_len) + " (the open thought segment is never evicted, so it " +
                   "alone can hold that many live tokens); allowed: 0 (no budget) or >= " +
                   std::to_string(segment_len) + ", or lower segment_len");
      }
    }
    return paged_config(map).validate();
  }

  /// The paged-cache configuration this maps to, for a policy set's lowered precision map.
  [[nodiscard]] CacheConfig paged_config(const PrecisionMap& map) const {
    CacheConfig c;
    c.num_streams = num_sequences * streams_per_sequence();
    c.head_dim = head_dim;
    c.group_size = group_size;
    c.block_size = block_size;
    c.precision = map;
    c.chunk_blocks = chunk_blocks;
    c.memory_limit_bytes = memory_limit_bytes;
    c.stage_set_streams = streams_per_sequence();  // a token is pushed once per sequence
    // Worst case per stream: every position live (no eviction yet) plus one partly filled block
    // per thought type; holes never exceed what was once live, so this bound holds with eviction.
    const std::int64_t per_stream = (std::int64_t{max_tokens} + block_size - 1) / block_size + kNumThoughtTypes;
    const std::int64_t auto_blocks = per_stream * c.num_streams;
    // Block and record ids are 32-bit and the pools hold < 2^31 slots in all: share that range.
    const int used = static_cast<int>(
        std::count_if(kAllPrecisions.begin(), kAllPrecisions.end(), [&](Precision p) { return c.precision.uses(p); }));
    const std::int64_t max_blocks = ((std::int64_t{1} << 31) - 1) / block_size / std::max(1, used);
    const int blocks =
        pool_blocks > 0 ? pool_blocks : static_cast<int>(std::min<std::int64_t>(auto_blocks, max_blocks));
    for (Precision p : kAllPrecisions) {
      const int own = pool_blocks_by_precision[static_cast<int>(p)];
      if (c.precision.uses(p)) c.pool_blocks[static_cast<int>(p)] = own > 0 ? own : blocks;
    }
    return c;
  }
};

/// Counters of a ThinKvCache (summed over sequences).
struct ThinKvStats {
  std::int64_t steps = 0;               ///< end_token calls
  std::int64_t eviction_calls = 0;      ///< plans with at least one step-down, applied
  std::int64_t transition_events = 0;   ///< case-1 triggers
  std::int64_t case1_steps = 0;         ///< segment step-downs made by case 1 (a new transition)
  std::int64_t budget_unreachable = 0;  ///< steps over budget with every closed segment at the
                                        ///< minimum (the open one is never evicted; design.md)
  std::int64_t segment_steps = 0;       ///< segment step-downs applied (per sequence)
  std::int64_t tokens_evicted = 0;      ///< slots evicted, all streams
  std::int64_t selections = 0;          ///< token selections run (K-means or the set's selector), all streams
  std::int64_t refreshes = 0;           ///< thought refreshes
  std::int64_t tokens_removed = 0;      ///< slots removed by remove() (seq_rm), all streams
};

/// The ThinKV cache over policy set P (cache_policy.hpp) and KV backend B.
template <class P, kv_backend B = CpuKvBackend>
class BasicThinKvCache {
  static_assert(cache_policy<P>,
                "ThinKV: BasicThinKvCache<P, B> needs a policy set P: thinkv::CachePolicy<Classifier, Precision, "
                "Retention, Selector> or a struct derived from one (include/thinkv/policy/cache_policy.hpp)");

 public:
  using policy_type = P;
  using classifier_type = typename P::classifier_type;
  using tracker_type = BasicThoughtTracker<classifier_type>;
  static constexpr bool kEvicts = P::kEvicts;

  /// Throws ConfigError naming the bad value (ThinKvConfig::validate(policy)).
  explicit BasicThinKvCache(const ThinKvConfig& config, P policy = P{}, B backend = B{})
      : config_(checked(config, policy)),
        policy_(std::move(policy)),
        map_(lowered(policy_)),
        cache_(config_.paged_config(map_), std::move(backend)) {
    seqs_.resize(static_cast<std::size_t>(config_.num_sequences));
    for (auto& s : seqs_) reset_state(s);
    seq_pending_.assign(static_cast<std::size_t>(config_.num_sequences), 0);
  }

  [[nodiscard]] const ThinKvConfig& config() const noexcept { return config_; }
  /// The policy set the cache runs (the classifier here is the prototype each sequence copies).
  [[nodiscard]] const P& policy() const noexcept { return policy_; }
  /// The precision map the policy lowered to (what the pools store each thought type as).
  [[nodiscard]] const PrecisionMap& precision_map() const noexcept { return map_; }
  [[nodiscard]] const PagedKvCache<B>& paged() const noexcept { return cache_; }
  /// The backend (to set a CUDA backend's stream, for one).
  [[nodiscard]] B& backend() noexcept { return cache_.backend(); }
  [[nodiscard]] const B& backend() const noexcept { return cache_.backend(); }
  /// Sizes the block table's host metadata for every pool's whole range now (returns its bytes),
  /// so no later step reallocates it: for a runtime that sizes its batch to memory once (with a
  /// device backend, beside CudaKvBackend::reserve_storage). See BlockTable::reserve_host_metadata.
  std::int64_t reserve_host_metadata() { return cache_.reserve_host_metadata(); }
  [[nodiscard]] const ThinKvStats& stats() const noexcept { return stats_; }
  [[nodiscard]] int stream_of(int seq, int layer, int kv_head) const noexcept {
    return (seq * config_.num_layers + layer) * config_.num_kv_heads + kv_head;
  }
  /// The attention shape (the decode_cache protocol).
  [[nodiscard]] CacheShape shape() const noexcept {
    return {config_.num_sequences, config_.num_layers, config_.num_kv_heads, config_.num_q_heads, config_.head_dim};
  }
  /// "thinkv budget 256, R4E4T2" and the like: the set's name, the budget of a set that evicts,
  /// the precision policy, and the selector unless it is K-means.
  [[nodiscard]] std::string method_name() const {
    std::string s(policy_name<P>());
    if constexpr (kEvicts) s += " budget " + std::to_string(config_.token_budget);
    s += ", " + std::string(policy_.precision.to_string());
    if constexpr (kEvicts) {
      const std::string sel = policy_.selector.to_string();
      if (sel != "kmeans") s += ", " + sel;
    }
    return s;
  }
  /// Bytes the cache has allocated, all sequences together (PagedKvCache::allocated()): the
  /// allocated chunks of every pool (pages, block metadata, table entries), allocated key-scale
  /// records, and every stream's staging buffer and header. It grows and shrinks with what the
  /// sequences hold; memory_limit_bytes bounds it.
  [[nodiscard]] std::int64_t allocated_bytes() const { return cache_.allocated_bytes(); }
  /// What the cache has allocated, itemised (PagedKvCache::allocated()).
  [[nodiscard]] MemoryUsage allocated() const { return cache_.allocated(); }
  /// The decode_cache report of one sequence: held bytes are exact (memory(seq)); allocated bytes
  /// are the sequence's share of allocated_bytes() (allocated / num_sequences).
  [[nodiscard]] CacheReport report(int seq) const {
    const SeqState& s = seq_(seq);
    CacheReport r;
    r.positions = s.position;
    const MemoryUsage m = memory(seq);
    r.live_tokens = m.live_tokens;
    r.held_bytes = m.physical_bytes();
    r.allocated_bytes = allocated_bytes() / config_.num_sequences;
    r.fullkv_fp16_bytes = shape().fullkv_fp16_bytes(s.position);
    r.eviction_calls = s.eviction_calls;
    r.tokens_evicted = s.tokens_evicted;
    r.gather_bytes = cache_.moved_bytes();  // cache-wide: the backend's writes beyond new tokens
    return r;
  }
  /// The thought tracker of a sequence (current type, refresh statistics).
  [[nodiscard]] const tracker_type& tracker(int seq) const { return seq_(seq).tracker; }
  /// Segments of a sequence (sizes and levels are those of every stream of the sequence).
  [[nodiscard]] const std::vector<SegmentState>& segments(int seq) const { return seq_(seq).segments; }
  /// Position of the token being decoded (or next to decode) in a sequence.
  [[nodiscard]] std::int32_t position(int seq) const { return seq_(seq).position; }
  /// Tensor parallelism: this cache holds one rank's slice of the model's heads (its config's
  /// num_kv_heads and num_q_heads are the slice's), and the thought signal must be the mean over
  /// all `total_q_heads` query heads of every rank, so that every rank takes the same thought,
  /// segment and eviction decisions (K-means and eviction stay on each rank's own heads).
  /// `all_reduce` receives, on refresh steps only, every refreshing sequence's per-layer sums of
  /// head sparsities over this rank's heads ([sequences x num_layers], the sequences in
  /// ascending id order; NaN for a layer the classifier does not read) and must replace each
  /// element by its sum over all ranks, the same on every rank (NCCL's all-reduce with ncclSum
  /// does this; in double, the sums of a few shares of one scale are exact, so a rank's signal
  /// equals the unsharded cache's). It is called once per end_token that refreshes, and once per
  /// end_step for all its refreshing sequences: every rank must run the same steps with the same
  /// sequences (a collective's contract). An error it returns (a collective that timed out, a
  /// rank that failed) fails that end_token / end_step with nothing changed: the token or step
  /// stays open; call it again to retry, or reset the sequences. Call between steps, not while a
  /// token is open; nullptr turns it off (total_q_heads must then be num_q_heads).
  /// kInvalidArgument names a bad total_q_heads (below num_q_heads).
  using SignalAllReduce = std::function<Status(std::span<double> layer_sums)>;
  [[nodiscard]] Status set_signal_reduction(int total_q_heads, SignalAllReduce all_reduce) {
    if (total_q_heads < config_.num_q_heads || (!all_reduce && total_q_heads != config_.num_q_heads)) {
      return {StatusCode::kInvalidArgument, "set_signal_reduction: total_q_heads " + std::to_string(total_q_heads) +
                                                " must be at least this rank's num_q_heads (" +
                                                std::to_string(config_.num_q_heads) +
                                                "), and equal to it without an all-reduce"};
    }
    total_q_heads_ = total_q_heads;
    signal_all_reduce_ = std::move(all_reduce);
    return Status::ok();
  }

  /// Keeps the first `tokens` positions of a sequence (its prompt) out of TBE and stores them as R
  /// (ThinKvConfig::pinned_prefix, per sequence). Only before the sequence's first token.
  [[nodiscard]] Status pin_prefix(int seq, std::int32_t tokens) {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    SeqState& s = seq_(seq);
    if (s.position != 0 || s.in_token) {
      return {StatusCode::kInvalidArgument, "pin_prefix(" + std::to_string(seq) + ", " + std::to_string(tokens) +
                                                "): the sequence is at position " + std::to_string(s.position) +
                                                "; pin its prefix before its first token (or after reset_sequence)"};
    }
    if (tokens < 0 || tokens > config_.max_tokens) {
      return {StatusCode::kInvalidArgument, "pin_prefix: " + std::to_string(tokens) +
                                                " tokens is out of range; allowed: 0..max_tokens (" +
                                                std::to_string(config_.max_tokens) + ")"};
    }
    s.pinned = tokens;
    return Status::ok();
  }
  [[nodiscard]] std::int32_t pinned_prefix(int seq) const { return seq_(seq).pinned; }
  /// Per-layer sparsity recorded for the current token ([num_layers]; NaN where not computed).
  [[nodiscard]] std::span<const float> layer_sparsity(int seq) const { return seq_(seq).layer_sparsity; }

  /// Starts the next token of a sequence: fixes its thought type and segment, and reserves the
  /// pool capacity every layer's commit of this token will need, so that once begin_token
  /// succeeded no append of the token can fail on a full pool (a token is all-or-nothing across
  /// its layers). `hint` (the token's id and text, when the decoder knows them) goes to the
  /// classifier's observe() once the token is accepted. Errors (nothing changes, the classifier
  /// sees nothing): sequence out of range, a token already open, max_tokens reached,
  /// kPoolExhausted naming the pool.
  [[nodiscard]] Status begin_token(int seq, const TokenHint& hint = {}) {
    THINKV_RETURN_IF_ERROR(settle_sequence(seq));
    PlanClaims need;
    ThoughtType type{};
    THINKV_RETURN_IF_ERROR(plan_begin(seq, need, type));
    const SeqState& s = seq_(seq);
    // Together with every other open token's reservation it must fit the pools and the limit.
    THINKV_RETURN_IF_ERROR(cache_.table().check_claims(
        need, reserved_ - s.reserved,
        "begin_token(" + std::to_string(seq) + ") at position " + std::to_string(s.position) + " (its commits in all " +
            std::to_string(config_.streams_per_sequence()) + " streams of the sequence)"));
    apply_begin(seq, need, type, hint);
    return Status::ok();
  }

  /// True when attend() on this layer computes sparsity for the current token.
  [[nodiscard]] bool wants_sparsity(int seq, int layer) const {
    const SeqState& s = seq_(seq);
    if (config_.trace_all_layers) return true;
    return refresh_due(s) && s.tracker.classifier().needs_signal() && s.tracker.classifier().uses_layer(layer);
  }

  /// Appends the current token's post-RoPE keys and values of one layer: k and v are
  /// [num_kv_heads, head_dim]. All-or-nothing across the layer's KV heads.
  [[nodiscard]] Status append(int seq, int layer, std::span<const float> k, std::span<const float> v) {
    THINKV_RETURN_IF_ERROR(check_token(seq, layer));
    if (seq_(seq).appended[static_cast<std::size_t>(layer)] != 0) {
      return {StatusCode::kInvalidArgument, "append: layer " + std::to_string(layer) + " of sequence " +
                                                std::to_string(seq) + " was already appended at position " +
                                                std::to_string(seq_(seq).position) + " (each layer once per token)"};
    }
    THINKV_RETURN_IF_ERROR(shape().check_append(layer, k, v));
    THINKV_RETURN_IF_ERROR(check_kv_values(k, v, "layer " + std::to_string(layer)));
    SeqState& s = seq_(seq);
    // One commit plan per KV head whose token completes a group, made once for the whole layer
    // (PlanClaims gives the heads distinct fresh blocks and records) and applied as made: the
    // pools are checked against the plans' total first, so the layer is all-or-nothing.
    const int d = config_.head_dim;
    PlanClaims claims;
    plans_.assign(static_cast<std::size_t>(config_.num_kv_heads), CommitPlan{});
    for (int h = 0; h < config_.num_kv_heads; ++h) {
      const int st = stream_of(seq, layer, h);
      if (cache_.table().staged_count(st) == config_.group_size) {
        if (Status e = cache_.table().plan_commit(st, s.type, plans_[static_cast<std::size_t>(h)], &claims);
            !e.is_ok()) {
          return {e.code(), "append layer " + std::to_string(layer) + " of sequence " + std::to_string(seq) +
                                ", KV head " + std::to_string(h) + ": " + e.message()};
        }
      }
    }
    // The layer's plans and the other open tokens' reservations must fit together.
    THINKV_RETURN_IF_ERROR(cache_.table().check_claims(claims, reserved_ - s.reserved,
                                                       "append layer " + std::to_string(layer) + " of sequence " +
                                                           std::to_string(seq) + " (its " +
                                                           std::to_string(config_.num_kv_heads) + " KV heads)"));
    for (int h = 0; h < config_.num_kv_heads; ++h) {
      const auto hd = static_cast<std::size_t>(h) * d;
      const CommitPlan& plan = plans_[static_cast<std::size_t>(h)];
      const int st = stream_of(seq, layer, h);
      THINKV_RETURN_IF_ERROR(
          cache_.append_pushed(st, k.subspan(hd, d), v.subspan(hd, d), plan.slots.empty() ? nullptr : &plan));
    }
    // The layer's commits took what begin_token reserved for them.
    const PlanClaims used = s.reserved - (s.reserved - claims);  // min(reserved, claims), per term
    s.reserved = s.reserved - used;
    reserved_ = reserved_ - used;
    s.appended[static_cast<std::size_t>(layer)] = 1;
    return Status::ok();
  }

  /// Decode attention of the current token in one layer: q and out are [num_q_heads, head_dim].
  /// Records the layer's sparsity (mean over query heads) when wants_sparsity(seq, layer).
  [[nodiscard]] Status attend(int seq, int layer, std::span<const float> q, std::span<float> out) {
    THINKV_RETURN_IF_ERROR(check_token(seq, layer));
    const std::size_t n = static_cast<std::size_t>(config_.num_q_heads) * config_.head_dim;
    if (q.size() != n || out.size() != n) {
      return {StatusCode::kShapeMismatch, "attend layer " + std::to_string(layer) +
                                              ": q and out need num_q_heads * head_dim = " + std::to_string(n) +
                                              " floats"};
    }
    if (seq_(seq).appended[static_cast<std::size_t>(layer)] == 0) {
      return {StatusCode::kInvalidArgument,
              "attend: layer " + std::to_string(layer) + " of sequence " + std::to_string(seq) + " at position " +
                  std::to_string(seq_(seq).position) + " before its append (append the token's K/V first)"};
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (!std::isfinite(q[i])) {
        return {StatusCode::kNonFinite, "attend layer " + std::to_string(layer) + ": q[" + std::to_string(i) +
                                            "] is not finite; nothing was computed"};
      }
    }
    streams_.resize(static_cast<std::size_t>(config_.num_kv_heads));
    for (int h = 0; h < config_.num_kv_heads; ++h) streams_[static_cast<std::size_t>(h)] = stream_of(seq, layer, h);
    sparsity_.assign(static_cast<std::size_t>(config_.num_q_heads), 0.0f);
    DecodeAttentionArgs a;
    a.num_q_heads = config_.num_q_heads;
    a.num_kv_heads = config_.num_kv_heads;
    a.kv_streams = streams_.data();
    a.q = q.data();
    a.out = out.data();
    a.softmax_scale = config_.softmax_scale;
    const bool want = wants_sparsity(seq, layer);
    a.sparsity = want ? sparsity_.data() : nullptr;
    THINKV_RETURN_IF_ERROR(cache_.attend(a));
    if (want) record_layer_signal(seq_(seq), layer, sparsity_);
    return Status::ok();
  }

  /// Ends the current token: on refresh steps classifies it and relabels the staging groups;
  /// in eviction modes plans and applies TBE.
  [[nodiscard]] Status end_token(int seq) {
    bool new_transition = false;
    THINKV_RETURN_IF_ERROR(end_token_core(seq, new_transition));
    if constexpr (kEvicts) THINKV_RETURN_IF_ERROR(run_tbe(seq, new_transition));
    return Status::ok();
  }

 private:
  /// end_token but TBE: the checks, the refresh and relabel, the position.
  [[nodiscard]] Status end_token_core(int seq, bool& new_transition) {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    SeqState& s = seq_(seq);
    if (!s.in_token) {
      return {StatusCode::kInvalidArgument, "end_token(" + std::to_string(seq) + ") without begin_token"};
    }
    for (int l = 0; l < config_.num_layers; ++l) {
      if (s.appended[static_cast<std::size_t>(l)] == 0) {
        return {StatusCode::kInvalidArgument, "end_token(" + std::to_string(seq) + ") at position " +
                                                  std::to_string(s.position) + ": layer " + std::to_string(l) +
                                                  " was never appended (append every layer once per token)"};
      }
    }
    new_transition = false;
    if (refresh_due(s)) {
      const int one[1] = {seq};
      THINKV_RETURN_IF_ERROR(reduce_signals(one));  // tensor parallelism: this rank's sums to all heads'
      ThoughtType t{};
      THINKV_RETURN_IF_ERROR(s.tracker.refresh(s.position, s.layer_sparsity, &t));
      ++stats_.refreshes;
      const ThoughtType before =
          s.segments.size() >= 2 ? s.segments[s.segments.size() - 2].type : ThoughtType::kReasoning;
      if (t != s.type) {
        THINKV_RETURN_IF_ERROR(cache_.relabel_staged(stream_of(seq, 0, 0), t));  // the sequence's staging set
        s.type = t;
      }
      s.segments.back().type = t;
      new_transition = is_new_transition(t, before, s.segments.size());
    }
    ++s.position;
    s.in_token = false;
    release_reservation(s);  // nothing left once every layer committed; kept for safety
    ++stats_.steps;
    return Status::ok();
  }

 public:
  /// Releases a sequence (all its streams) and resets its state (a fault included).
  [[nodiscard]] Status reset_sequence(int seq) {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    if (step_.open && std::find(step_.seqs.begin(), step_.seqs.end(), seq) != step_.seqs.end()) {
      return {StatusCode::kInvalidArgument,
              "reset_sequence(" + std::to_string(seq) + "): the sequence is in the open step (end_step it first)"};
    }
    THINKV_RETURN_IF_ERROR(settle_sequence(seq));
    for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) {
      THINKV_RETURN_IF_ERROR(cache_.reset_stream(st));
    }
    release_reservation(seq_(seq));
    const std::int32_t generation = seq_(seq).generation + 1;
    reset_state(seq_(seq));
    seq_(seq).generation = generation;
    return Status::ok();
  }

  // ---- llama.cpp-style sequence operations ---------------------------------------------------
  //
  // A sequence's tokens have positions 0, 1, ... in decode order; llama.cpp's operations map as
  //     llama_memory_seq_rm(mem, seq, p0, p1)   ->  cache.remove(seq, p0, p1)
  //     llama_memory_seq_keep(mem, seq)         ->  cache.keep_only(seq)
  //     llama_memory_seq_cp(mem, src, dst, p0, p1) -> cache.copy_sequence(src, dst, p0, p1)
  //     llama_memory_seq_pos_min / _max         ->  cache.pos_min(seq) / cache.pos_max(seq)
  //     llama_memory_seq_add(mem, seq, p0, p1, d) -> cache.shift_positions(seq, p0, p1, d, rope)
  //     llama_memory_seq_div                    ->  not offered (tokens would share positions)
  //     llama_memory_clear / a whole seq_rm     ->  cache.reset_sequence(seq) for each
  // docs/design.md ("Sequence operations") says what each costs and where ThinKV differs.

  /// Removes the sequence's tokens at positions [p0, p1) from every stream (llama.cpp's seq_rm:
  /// p0 < 0 means 0, p1 < 0 means to the end; an empty range removes nothing). Tokens in pages
  /// are marked evicted (their slots are refilled in place later); staged tokens (the open
  /// quantization group) are dropped. When the range reaches the end, the sequence rolls back:
  /// its next position becomes its last live position + 1 in any stream (0 when nothing is left:
  /// the sequence is then reset as by reset_sequence), the segments starting at or after it are
  /// dropped and the last one left is open again; the thought type is not rolled back (the next
  /// refresh sets it). Every segment's size becomes its most live tokens in any stream.
  /// Errors (nothing changes): sequence out of range, faulted, in the open step, or with an open
  /// token or prompt (kInvalidArgument); kUnsupported for what the storage cannot do exactly:
  ///  - removing staged tokens while a later token stays (the open group is not compacted);
  ///  - rolling back to a position that is not a multiple of group_size behind the open group:
  ///    the tokens of its group before it are quantized and cannot return to staging. The message
  ///    names the multiple of group_size to remove from instead (then decode the tokens again).
  /// kPoolExhausted when the range lies in blocks shared with a copy (copy_sequence's shared
  /// prompt) and the pools or memory_limit_bytes cannot hold their copies (copy on write).
  [[nodiscard]] Status remove(int seq, std::int32_t p0, std::int32_t p1) {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    const std::string call =
        "remove(" + std::to_string(seq) + ", " + std::to_string(p0) + ", " + std::to_string(p1) + ")";
    THINKV_RETURN_IF_ERROR(settle_quiet(seq, call));
    SeqState& s = seq_(seq);
    const std::int32_t pend = s.position;
    const std::int32_t lo = std::max<std::int32_t>(p0, 0);
    const std::int32_t end = p1 < 0 ? pend : std::min(p1, pend);
    if (lo >= end) return Status::ok();
    std::int32_t next = pend;
    THINKV_RETURN_IF_ERROR(check_remove(seq, lo, end, call, seq, next));
    const bool tail = end >= pend;
    const int first = stream_of(seq, 0, 0), last = stream_of(seq + 1, 0, 0);
    const BlockTable& table = cache_.table();
    const int staged = table.staged_count(first);  // every stream of the set holds the same rows
    const std::int32_t G = staged > 0 ? table.staged_position(first, 0) : pend;  // first staged position
    auto inside = [&](std::int32_t pos) { return pos >= lo && pos < end; };
    auto seg_end = [&](std::size_t i) { return i + 1 < s.segments.size() ? s.segments[i + 1].start : pend; };
    std::vector<SlotRef> slots;
    if (tail && next == 0) return reset_sequence(seq);  // nothing is left
    // Per segment (in s.segments' order) the most and least tokens any stream holds once the
    // range is gone. A stream holds `size` tokens of every segment but the ragged ones (a remove()
    // cut them unevenly before), so their counts follow from what this call takes; the ragged ones
    // are counted.
    const std::size_t nseg = s.segments.size();
    auto index_of = [&](std::uint32_t id) {
      for (std::size_t i = 0; i < nseg; ++i) {
        if (s.segments[i].id == id) return i;
      }
      return nseg;
    };
    std::vector<std::int32_t> most(nseg, 0), least(nseg, INT32_MAX), cut(nseg + 1), staged_left(nseg + 1, 0);
    std::vector<std::uint8_t> ragged(nseg, 0);
    for (std::size_t i = 0; i < nseg; ++i) {
      ragged[i] = std::find(s.ragged.begin(), s.ragged.end(), s.segments[i].id) != s.ragged.end() ? 1 : 0;
    }
    std::vector<std::int32_t> staged_in(nseg + 1, 0);  // the open group's rows, per segment
    for (int r = 0; r < staged; ++r) ++staged_in[index_of(table.staged_segment(first, r))];
    std::vector<std::uint32_t> keep;  // the open group's rows that stay (their segments)
    for (int r = 0; r < staged; ++r) {
      const std::int32_t pos = table.staged_position(first, r);
      if (tail ? pos < next : true) {
        keep.push_back(table.staged_segment(first, r));
        ++staged_left[index_of(keep.back())];
      }
    }
    // Shared blocks (a copied prompt) the range writes into are copied first, for every stream
    // at once: the one step that can fail (kPoolExhausted), before anything changes.
    if constexpr (state_io_backend<B>) {
      if (table.shared_blocks() > 0 && lo < G) {
        std::vector<std::pair<int, std::uint32_t>> cow;
        for (int st = first; st < last; ++st) {
          for (std::size_t i = 0; i < nseg; ++i) {
            if (s.segments[i].start >= end || seg_end(i) <= lo) continue;
            table.live_segment_slots(st, s.segments[i].id, slots);
            for (const SlotRef r : slots) {
              if (inside(table.slot_position(r)) && table.is_shared(r.block) &&
                  std::find(cow.begin(), cow.end(), std::pair{st, r.block}) == cow.end()) {
                cow.emplace_back(st, r.block);
              }
            }
          }
        }
        if (Status c = cache_.unshare(cow, reserved_); !c.is_ok()) {
          return {c.code(),
                  call + ": the range lies in blocks shared with a copy, which cannot be copied: " + c.message()};
        }
      }
    }
    // Evict what pages hold in the range, stream by stream (the table's evict cannot fail on
    // slots it lists as live); pages hold positions below G only.
    std::int64_t removed = static_cast<std::int64_t>(staged - static_cast<int>(keep.size())) * (last - first);
    for (int st = first; st < last; ++st) {
      std::fill(cut.begin(), cut.end(), 0);
      evict_scratch_.clear();
      for (std::size_t i = 0; i < nseg && lo < G; ++i) {
        if (s.segments[i].start >= end || seg_end(i) <= lo) continue;  // no position of the range
        table.live_segment_slots(st, s.segments[i].id, slots);
        for (const SlotRef r : slots) {
          if (!inside(table.slot_position(r))) continue;
          evict_scratch_.push_back(r);
          ++cut[i];
        }
      }
      if (!evict_scratch_.empty()) {
        THINKV_RETURN_IF_ERROR(cache_.evict(st, evict_scratch_));
        removed += static_cast<std::int64_t>(evict_scratch_.size());
      }
      for (std::size_t i = 0; i < nseg; ++i) {
        std::int32_t held = 0;
        if (ragged[i] != 0) {
          table.live_segment_slots(st, s.segments[i].id, slots);
          held = static_cast<std::int32_t>(slots.size()) + staged_left[i];
        } else {
          held = s.segments[i].size - cut[i] - (staged_in[i] - staged_left[i]);
        }
        most[i] = std::max(most[i], held);
        least[i] = std::min(least[i], held);
      }
    }
    s.ragged.clear();
    for (std::size_t i = 0; i < nseg; ++i) {
      s.segments[i].size = most[i];
      if (least[i] != most[i]) s.ragged.push_back(s.segments[i].id);
    }
    // A roll back: the open group keeps its rows before `next`; segments from `next` on go.
    if (tail) {
      THINKV_RETURN_IF_ERROR(cache_.set_staged(first, table.staged_thought(first), keep, next));
      s.position = next;
      std::erase_if(s.segments, [&](const SegmentState& seg) { return seg.start >= next; });
      if (!s.segments.empty()) s.segments.back().closed = false;
      if (!keep.empty()) s.type = table.staged_thought(first);
    }
    // Closed segments left empty are gone (the open one stays: the next token joins it).
    for (std::size_t i = 0; i + 1 < s.segments.size();) {
      if (s.segments[i].size == 0) {
        s.segments.erase(s.segments.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    stats_.tokens_removed += removed;
    s.tokens_removed += removed;
    return Status::ok();
  }

  /// The lowest position any stream of the sequence holds (live in a page or staged); -1 when
  /// the sequence holds nothing. Segments cover increasing ranges of positions and a segment's
  /// size is the most tokens of it any stream holds, so the answer lies in the first segment of
  /// non-zero size: only the blocks that hold tokens of that segment are walked.
  [[nodiscard]] std::int32_t pos_min(int seq) const {
    if (!check_seq(seq).is_ok()) return -1;
    const BlockTable& table = cache_.table();
    const int first = stream_of(seq, 0, 0);
    std::vector<SlotRef> slots;
    for (const SegmentState& seg : seq_(seq).segments) {
      if (seg.size == 0) continue;  // only the open segment can be empty (remove() drops the others)
      std::int32_t lo = -1;
      for (int row = 0; row < table.staged_count(first); ++row) {  // staged rows: in position order
        if (table.staged_segment(first, row) == seg.id) {
          lo = table.staged_position(first, row);
          break;
        }
      }
      for (int st = first; st < stream_of(seq + 1, 0, 0); ++st) {
        table.live_segment_slots(st, seg.id, slots);
        for (const SlotRef r : slots) {
          const std::int32_t pos = table.slot_position(r);
          if (lo < 0 || pos < lo) lo = pos;
        }
      }
      return lo;
    }
    return -1;
  }
  /// The highest position the sequence holds: position(seq) - 1, held by at least one stream
  /// (a decoded token joins the open segment, which TBE never evicts, and remove() rolls back to
  /// the last position any stream holds); -1 when the sequence holds nothing.
  [[nodiscard]] std::int32_t pos_max(int seq) const {
    if (!check_seq(seq).is_ok()) return -1;
    return seq_(seq).position - 1;
  }
  /// Keeps one sequence and frees every other (llama.cpp's seq_keep). Errors (nothing changes):
  /// `seq` out of range, a step open, or another sequence with an open token or prompt.
  [[nodiscard]] Status keep_only(int seq) {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    if (step_.open) return {StatusCode::kInvalidArgument, "keep_only: a step is open (end_step it first)"};
    for (int other = 0; other < config_.num_sequences; ++other) {
      const SeqState& o = seq_(other);
      if (other != seq && (o.in_token || o.prompt > 0)) {
        return {StatusCode::kInvalidArgument, "keep_only(" + std::to_string(seq) + "): sequence " +
                                                  std::to_string(other) + " has an open token or prompt"};
      }
    }
    for (int other = 0; other < config_.num_sequences; ++other) {
      if (other != seq && (seq_(other).position > 0 || seq_(other).faulted)) {
        THINKV_RETURN_IF_ERROR(reset_sequence(other));
      }
    }
    return Status::ok();
  }

  /// Copies sequence `src`'s positions [p0, p1) into sequence `dst` (llama.cpp's seq_cp: p0 < 0
  /// means 0, p1 < 0 means to the end). `dst` must be empty (never decoded, or reset): unlike
  /// llama.cpp's cells, a ThinKV stream cannot merge two histories. The copy is whole: pages
  /// (holes included), key-scale records, second-level scales, staged tokens, segments, thought
  /// type and tracker, so `dst` then decodes exactly as `src` would (K-means selections are
  /// seeded by a stream's lane in its sequence, not by the sequence). A range that is not the
  /// whole sequence is the copy cut by remove(dst, 0, p0) and remove(dst, p1, -1), with
  /// remove's rules: their refusals (kUnsupported) are found before anything is copied. With
  /// share_prompt_blocks and a page_sharing_backend the source's full blocks of pinned prompt
  /// tokens are shared with the copy, not copied; a later remove() copies one before writing
  /// into it (docs/design.md, "Shared prompt blocks"). src == dst changes nothing. Errors (nothing changes): a sequence
  /// out of range; either faulted, in the open step or with an open token or prompt, or `dst` not empty
  /// (kInvalidArgument); kPoolExhausted when the pools cannot hold the copy beside what other sequences' open tokens
  /// reserved; remove's refusals for the range.
  [[nodiscard]] Status copy_sequence(int src, int dst, std::int32_t p0 = -1,
                                     std::int32_t p1 = -1) requires state_io_backend<B> {
    THINKV_RETURN_IF_ERROR(check_seq(src));
    THINKV_RETURN_IF_ERROR(check_seq(dst));
    const std::string call = "copy_sequence(" + std::to_string(src) + ", " + std::to_string(dst) + ", " +
                             std::to_string(p0) + ", " + std::to_string(p1) + ")";
    THINKV_RETURN_IF_ERROR(settle_quiet(src, call));
    if (src == dst) return Status::ok();
    THINKV_RETURN_IF_ERROR(settle_quiet(dst, call));
    THINKV_RETURN_IF_ERROR(check_empty(dst, call, "a copy"));
    const SeqState& s = seq_(src);
    const std::int32_t lo = std::max<std::int32_t>(p0, 0);
    const std::int32_t hi = p1 < 0 ? s.position : std::min(p1, s.position);
    if (s.position == 0 || lo >= hi || !holds_any(src, lo, hi)) return Status::ok();  // nothing to copy
    // The cuts, checked on the source before anything is copied (the copy is the source's state):
    // remove(dst, 0, lo), then remove(dst, hi, -1). The front cut leaves the open group alone
    // (or is refused), so the tail cut continues where it would on the source: some token of
    // [lo, hi) is held, so the tokens before lo do not decide where.
    std::int32_t next = s.position;
    auto refused = [&](const Status& why) {
      return Status{why.code(), call + ": the range cannot be cut from the copy: " + why.message()};
    };
    if (lo > 0) {
      const std::string cut = "remove(" + std::to_string(dst) + ", 0, " + std::to_string(lo) + ")";
      if (Status c = check_remove(src, 0, lo, cut, dst, next); !c.is_ok()) return refused(c);
    }
    if (hi < s.position) {
      const std::string cut = "remove(" + std::to_string(dst) + ", " + std::to_string(hi) + ", -1)";
      if (Status c = check_remove(src, hi, s.position, cut, dst, next); !c.is_ok()) return refused(c);
    }
    // With a backend that reads shared blocks, each stream's leading blocks of pinned prompt
    // tokens are shared, not copied (the rest is copied, then the shared ones go in front).
    const int first = stream_of(src, 0, 0), streams = stream_of(src + 1, 0, 0) - first;
    std::vector<std::size_t> shared(static_cast<std::size_t>(streams), 0);
    if constexpr (page_sharing_backend<B>) {
      if (config_.share_prompt_blocks && s.pinned > 0) {
        for (int k = 0; k < streams; ++k) {
          shared[static_cast<std::size_t>(k)] = cache_.table().shareable_prefix(first + k, s.pinned);
        }
      }
    }
    std::vector<StreamSnapshot> snaps;
    StageSnapshot stage;
    THINKV_RETURN_IF_ERROR(snapshot_sequence(src, snaps, stage, shared));
    THINKV_RETURN_IF_ERROR(cache_.load_streams(stream_of(dst, 0, 0), snaps, stage, reserved_));
    if constexpr (page_sharing_backend<B>) {
      for (int k = 0; k < streams; ++k) {
        const Status st = cache_.share_prefix(first + k, stream_of(dst, 0, 0) + k, shared[static_cast<std::size_t>(k)]);
        if (!st.is_ok()) {  // checked by shareable_prefix: not reached
          THINKV_RETURN_IF_ERROR(reset_sequence(dst));
          return {StatusCode::kInternal, call + ": sharing the prompt's blocks failed: " + st.message()};
        }
      }
    }
    SeqState copy = seq_(src);
    copy.reserved = PlanClaims{};
    copy.generation = seq_(dst).generation;
    release_reservation(seq_(dst));
    seq_(dst) = std::move(copy);
    // The cuts (checked above). What they drop was never the destination's: not counted as removed.
    const std::int64_t removed = stats_.tokens_removed;
    Status cut = lo > 0 ? remove(dst, 0, lo) : Status::ok();
    if (cut.is_ok() && hi < seq_(dst).position) cut = remove(dst, hi, -1);
    stats_.tokens_removed = removed;
    seq_(dst).tokens_removed = seq_(src).tokens_removed;
    if (!cut.is_ok()) {
      THINKV_RETURN_IF_ERROR(reset_sequence(dst));
      return {StatusCode::kInternal, call + ": a cut checked before failed: " + cut.message()};
    }
    return Status::ok();
  }

  /// Adds `delta` to the positions of the sequence's tokens in [p0, p1) (llama.cpp's seq_add: p0 <
  /// 0 means 0, p1 < 0 means to the end): their stored keys, post-RoPE, are rotated through
  /// `delta` positions of `rope` (R(p + delta) = R(delta) R(p): decoded, rotated in double and
  /// rounded to BF16 once), values are untouched, and slot positions, segment starts and the open
  /// group's positions move. When the range holds the sequence's last position the sequence
  /// continues at position(seq) + delta. A context shift is remove(seq, k, k + n) then
  /// shift_positions(seq, k + n, -1, -n, rope). delta = 0 or a range holding no token changes
  /// nothing. Each key moves by one rounding of BF16 (llama.cpp's F16 cache likewise), so a
  /// shifted key can differ in its last bit from the key decoded at the new position.
  /// Errors (nothing changes): sequence out of range, faulted, in the open step, with an open
  /// token or prompt, or a bad RopeSpec (kInvalidArgument); the moved tokens would reach or pass
  /// a token that stays, in either direction (kInvalidArgument: a stream keeps its positions in
  /// order; llama.cpp would let them collide); a position past max_tokens (kOutOfRange);
  /// kUnsupported for what the storage cannot do:
  ///  - delta not a multiple of group_size (the open group and thought refreshes stay aligned);
  ///  - a token of the range in a quantized page: its keys are quantized per channel over a
  ///    group of tokens, so a rotation, which mixes channel pairs, cannot be stored exactly
  ///    (llama.cpp requantizes a quantized K cache; ThinKV refuses). BF16 pages (FullKV, a
  ///    precision map with BF16) and the open group (staged in BF16) shift;
  ///  - a range holding some tokens of the open group but not all of them;
  ///  - a token of the pinned prefix moved, or a token moved into it;
  ///  - a position moved below 0 (llama.cpp drops such cells: remove them first).
  [[nodiscard]] Status shift_positions(int seq, std::int32_t p0, std::int32_t p1, std::int32_t delta,
                                       const RopeSpec& rope) requires state_io_backend<B> {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    const std::string call = "shift_positions(" + std::to_string(seq) + ", " + std::to_string(p0) + ", " +
                             std::to_string(p1) + ", " + std::to_string(delta) + ")";
    THINKV_RETURN_IF_ERROR(settle_quiet(seq, call));
    if (Status e = rope.validate(config_.head_dim); !e.is_ok()) return {e.code(), call + ": " + e.message()};
    SeqState& s = seq_(seq);
    const std::int32_t pend = s.position;
    const std::int32_t lo = std::max<std::int32_t>(p0, 0);
    const std::int32_t hi = p1 < 0 ? pend : std::min(p1, pend);
    if (delta == 0 || lo >= hi) return Status::ok();
    // Every held token (pages of every stream, the open group): where it is, where it goes.
    const int first = stream_of(seq, 0, 0), last = stream_of(seq + 1, 0, 0);
    const BlockTable& table = cache_.table();
    const std::size_t nseg = s.segments.size();
    constexpr std::int32_t kNone = INT32_MAX;
    std::int32_t below = -1, in_lo = kNone, in_hi = -1, above = kNone;  // held: < lo, in range, >= hi
    std::vector<std::int32_t> seg_lo(nseg, kNone), seg_hi(nseg, -1);    // new positions per segment
    auto index_of = [&](std::uint32_t id) {                             // segment ids grow along s.segments
      const auto it = std::lower_bound(s.segments.begin(), s.segments.end(), id,
                                       [](const SegmentState& a, std::uint32_t b) { return a.id < b; });
      return it != s.segments.end() && it->id == id ? static_cast<std::size_t>(it - s.segments.begin()) : nseg;
    };
    int quantized_stream = -1;
    std::int32_t quantized_pos = 0;
    Precision quantized = Precision::kBf16;
    auto held = [&](std::int32_t pos, std::uint32_t segment) {
      const bool inside = pos >= lo && pos < hi;
      const std::int32_t moved = inside ? pos + delta : pos;
      if (pos < lo) below = std::max(below, pos);
      if (inside) in_lo = std::min(in_lo, pos), in_hi = std::max(in_hi, pos);
      if (pos >= hi) above = std::min(above, pos);
      const std::size_t i = index_of(segment);
      if (i == nseg) return;
      seg_lo[i] = std::min(seg_lo[i], moved);
      seg_hi[i] = std::max(seg_hi[i], moved);
    };
    for (int st = first; st < last; ++st) {
      for (const SlotRef r : table.live_slot_list(st)) {
        const std::int32_t pos = table.slot_position(r);
        held(pos, table.slot_segment(r));
        const Precision p = table.block_precision(r.block);
        if (pos >= lo && pos < hi && p != Precision::kBf16 && quantized_stream < 0) {
          quantized_stream = st;
          quantized_pos = pos;
          quantized = p;
        }
      }
    }
    const int staged = table.staged_count(first);
    int staged_in = 0;
    for (int r = 0; r < staged; ++r) {
      const std::int32_t pos = table.staged_position(first, r);
      held(pos, table.staged_segment(first, r));
      staged_in += pos >= lo && pos < hi ? 1 : 0;
    }
    if (in_hi < 0) return Status::ok();  // the range holds no token
    const int g = config_.group_size;
    if (delta % g != 0) {
      const std::int32_t down = delta / g * g - (delta < 0 && delta % g != 0 ? g : 0);
      return {StatusCode::kUnsupported, call + ": delta " + std::to_string(delta) +
                                            " is not a multiple of group_size (" + std::to_string(g) +
                                            "): quantization groups and thought refreshes are aligned to positions; "
                                            "shift by " +
                                            std::to_string(down) + " or " + std::to_string(down + g)};
    }
    if (quantized_stream >= 0) {
      const int within = quantized_stream - first;
      return {StatusCode::kUnsupported,
              call + ": position " + std::to_string(quantized_pos) + " of layer " +
                  std::to_string(within / config_.num_kv_heads) + ", KV head " +
                  std::to_string(within % config_.num_kv_heads) + " is stored in a " +
                  std::string(to_string(quantized)) +
                  " page: keys quantized per channel cannot be re-rotated exactly (only BF16 pages and the open "
                  "group shift; see docs/design.md, \"Shifting positions\")"};
    }
    if (staged_in != 0 && staged_in != staged) {
      return {StatusCode::kUnsupported,
              call + ": the range holds " + std::to_string(staged_in) + " of the " + std::to_string(staged) +
                  " tokens of the open quantization group (from "
                  "position " +
                  std::to_string(table.staged_position(first, 0)) + "); shift all of them or none"};
    }
    if (s.pinned > 0 && (in_lo < s.pinned || in_lo + delta < s.pinned)) {
      return {StatusCode::kUnsupported, call + ": it would move position " + std::to_string(in_lo) + " to " +
                                            std::to_string(in_lo + delta) + "; the pinned prefix (positions below " +
                                            std::to_string(s.pinned) + ") neither moves nor takes moved tokens"};
    }
    if (in_lo + delta < 0) {
      return {StatusCode::kUnsupported, call + ": it would move position " + std::to_string(in_lo) + " to " +
                                            std::to_string(in_lo + delta) + " (llama.cpp drops such cells; remove(" +
                                            std::to_string(seq) + ", " + std::to_string(lo) + ", " +
                                            std::to_string(lo - delta) + ") first)"};
    }
    if (below >= 0 && in_lo + delta <= below) {
      return {StatusCode::kInvalidArgument, call + ": it would move position " + std::to_string(in_lo) + " to " +
                                                std::to_string(in_lo + delta) + ", not after position " +
                                                std::to_string(below) + ", which stays: positions keep their order"};
    }
    if (above != kNone && in_hi + delta >= above) {
      return {StatusCode::kInvalidArgument, call + ": it would move position " + std::to_string(in_hi) + " to " +
                                                std::to_string(in_hi + delta) + ", not before position " +
                                                std::to_string(above) + ", which stays: positions keep their order"};
    }
    const bool tail = in_hi == pend - 1;  // the last position moves: so does the next one
    const std::int32_t next = tail ? pend + delta : pend;
    if (next > config_.max_tokens) {
      return {StatusCode::kOutOfRange, call + ": the sequence would continue at position " + std::to_string(next) +
                                           ", past max_tokens " + std::to_string(config_.max_tokens)};
    }
    // Segment starts: moved with the range, then kept at or before their first token and after
    // the tokens of the segments before them (a segment whose first tokens were removed may now
    // start past a moved token of its predecessor, or past its own moved tokens).
    std::vector<std::int32_t> starts(nseg);
    std::int32_t prev_hi = -1, prev_start = -1;
    for (std::size_t i = 0; i < nseg; ++i) {
      const std::int32_t st = s.segments[i].start;
      std::int32_t ns = st >= lo && st < hi ? st + delta : st;
      ns = std::max({ns, prev_hi + 1, prev_start + 1});
      if (seg_lo[i] != kNone) ns = std::min(ns, seg_lo[i]);
      if (ns <= prev_start || ns <= prev_hi || ns < 0 || ns >= std::max(next, 1)) {
        return {StatusCode::kInternal, call + ": segment " + std::to_string(s.segments[i].id) + " (start " +
                                           std::to_string(st) + ") has no start in order after the shift"};
      }
      starts[i] = ns;
      prev_start = ns;
      prev_hi = std::max(prev_hi, seg_hi[i]);
    }
    // The data first (undone on a backend error), then the metadata (cannot fail).
    typename PagedKvCache<B>::KeyRotationUndo undo;
    for (int st = first; st < last; ++st) {
      if (Status e = cache_.rotate_keys(st, lo, hi, delta, rope, undo); !e.is_ok()) {
        if (Status u = cache_.undo_rotation(undo); !u.is_ok()) {
          return {StatusCode::kInternal, call + ": " + e.message() + "; writing the keys back failed too (" +
                                             u.message() + "): keys of positions [" + std::to_string(lo) + ", " +
                                             std::to_string(hi) + ") may be partly rotated; reset_sequence(" +
                                             std::to_string(seq) + ")"};
        }
        return {e.code(), call + ": " + e.message()};
      }
    }
    for (int st = first; st < last; ++st) (void)cache_.shift_positions(st, lo, hi, delta);
    if (tail) {
      std::vector<std::uint32_t> segs;
      for (int r = 0; r < staged; ++r) segs.push_back(table.staged_segment(first, r));
      const Status moved = cache_.set_staged(first, table.staged_thought(first), segs, next);
      assert(moved.is_ok());  // staged < group_size and next >= staged
      (void)moved;
    }
    for (std::size_t i = 0; i < nseg; ++i) s.segments[i].start = starts[i];
    s.position = next;
    return Status::ok();
  }

  // ---- saving and loading a sequence's state (llama_state_seq_get_data / set_data) ------------

  /// Writes sequence `seq`'s whole state into `out` (replaced; its capacity is reused, so a
  /// runtime that saves often can keep one buffer): its pages, key-scale records,
  /// second-level scales, staged tokens, block metadata (holes included), segments, thought type
  /// and counters, bit for bit, in the versioned and checksummed format of
  /// seq/state_codec.hpp (docs/formats.md, "Sequence state"). load_sequence restores it into an
  /// empty sequence of this cache or of another with the same geometry and precision map; the
  /// sequence then decodes exactly as the saved one would have. The classifier's own state is
  /// not saved (the built-in ones keep none per sequence). Waits for the sequence's pending
  /// K-means selections. Errors (nothing changes): sequence out of range, faulted, in the open
  /// step, or with an open token or prompt (kInvalidArgument).
  [[nodiscard]] Status save_sequence(int seq, std::vector<std::uint8_t>& out) requires state_io_backend<B> {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    THINKV_RETURN_IF_ERROR(settle_quiet(seq, "save_sequence(" + std::to_string(seq) + ")"));
    const SeqState& s = seq_(seq);
    std::vector<StreamSnapshot> snaps;
    StageSnapshot stage;
    THINKV_RETURN_IF_ERROR(snapshot_sequence(seq, snaps, stage));
    // Nothing below fails: write into `out` itself, so a caller that saves again and again keeps
    // its buffer (its capacity is reused; one reserve instead of growth by copies).
    std::size_t estimate = 4096 + 20 * s.segments.size() + 4 * (s.ragged.size() + stage.segments.size());
    for (const StreamSnapshot& sn : snaps) {
      estimate += 32 + sn.image.blocks.size() * saved_block_bytes() + sn.pages.size() + sn.records.size() +
                  4 * (sn.scales.size() + sn.staged.size());
    }
    std::vector<std::uint8_t>& bytes = out;
    begin_state(bytes);
    bytes.reserve(estimate);
    StateWriter w(bytes);
    write_fingerprint(w);
    w.put(s.position);
    w.put(s.next_segment);
    w.put(s.type);
    w.put(s.pinned);
    w.put(s.eviction_calls);
    w.put(s.tokens_evicted);
    w.put(s.tokens_removed);
    const ThoughtStats& ts = s.tracker.stats();
    w.put(s.tracker.current());
    w.put(ts.refreshes);
    w.put(ts.refresh_ns);
    w.put(ts.changes);
    w.put_span(std::span<const std::int64_t>(ts.refresh_histogram));
    w.put_span(std::span<const std::int64_t>(ts.tokens));
    w.put(static_cast<std::uint32_t>(s.layer_sparsity.size()));
    w.put_span(std::span<const float>(s.layer_sparsity));
    w.put(static_cast<std::uint32_t>(s.segments.size()));
    for (const SegmentState& g : s.segments) {
      w.put(g.id);
      w.put(g.type);
      w.put(g.start);
      w.put(g.size);
      w.put(static_cast<std::int32_t>(g.level));
      w.put(g.closed);
      w.put(g.pinned);
    }
    w.put(static_cast<std::uint32_t>(s.ragged.size()));
    w.put_span(std::span<const std::uint32_t>(s.ragged));
    w.put(stage.thought);
    w.put(static_cast<std::uint32_t>(stage.segments.size()));
    w.put_span(std::span<const std::uint32_t>(stage.segments));
    w.put(stage.next_position);
    w.put(static_cast<std::uint32_t>(snaps.size()));
    for (const StreamSnapshot& sn : snaps) {
      w.put(static_cast<std::uint32_t>(sn.image.blocks.size()));
      w.put(sn.image.records);
      for (const BlockImage& bi : sn.image.blocks) {
        w.put(bi.thought);
        w.put(bi.fill);
        w.put(bi.seg_lo);
        w.put(bi.seg_hi);
        w.put_span(std::span<const std::uint64_t>(bi.mask));
        w.put_span(std::span<const std::uint32_t>(bi.slot_record));
        w.put_span(std::span<const std::uint32_t>(bi.slot_segment));
        w.put_span(std::span<const std::int32_t>(bi.slot_position));
      }
      w.put(static_cast<std::uint64_t>(sn.pages.size()));
      w.put_bytes(sn.pages);
      w.put(static_cast<std::uint64_t>(sn.records.size()));
      w.put_bytes(sn.records);
      w.put_span(std::span<const float>(sn.scales));
      w.put(static_cast<std::uint32_t>(sn.staged.size()));
      w.put_span(std::span<const float>(sn.staged));
    }
    finish_state(bytes);
    return Status::ok();
  }

  /// Restores a state save_sequence wrote into sequence `seq`, which must be empty (never
  /// decoded, or reset: a load replaces nothing; reset_sequence first). All or nothing: on any
  /// error the sequence stays empty and the cache is as it was. Errors: kCorruptData (truncated,
  /// damaged: the checksum, or inconsistent: the message names the field), kUnsupported (another
  /// format version), kInvalidArgument (saved by a cache of another geometry or precision map:
  /// the message names the value; the sequence is not empty, or busy), kOutOfRange (positions
  /// past max_tokens), kPoolExhausted (the pools cannot hold it beside what other sequences' open
  /// tokens reserved: begin_token's promise that the token's commits fit holds across a load).
  [[nodiscard]] Status load_sequence(int seq, std::span<const std::uint8_t> in) requires state_io_backend<B> {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    THINKV_RETURN_IF_ERROR(settle_quiet(seq, "load_sequence(" + std::to_string(seq) + ")"));
    const int first = stream_of(seq, 0, 0), last = stream_of(seq + 1, 0, 0);
    THINKV_RETURN_IF_ERROR(check_empty(seq, "load_sequence(" + std::to_string(seq) + ")", "a load"));
    std::span<const std::uint8_t> body;
    THINKV_RETURN_IF_ERROR(open_state(in, body));
    StateReader r(body);
    THINKV_RETURN_IF_ERROR(check_fingerprint(r));
    SeqState s;
    reset_state(s);
    s.generation = seq_(seq).generation;
    ThoughtType current{};
    ThoughtStats ts;
    THINKV_RETURN_IF_ERROR(r.get(s.position, "position"));
    THINKV_RETURN_IF_ERROR(r.get(s.next_segment, "next segment"));
    THINKV_RETURN_IF_ERROR(r.get(s.type, "thought type"));
    THINKV_RETURN_IF_ERROR(r.get(s.pinned, "pinned prefix"));
    THINKV_RETURN_IF_ERROR(r.get(s.eviction_calls, "eviction calls"));
    THINKV_RETURN_IF_ERROR(r.get(s.tokens_evicted, "tokens evicted"));
    THINKV_RETURN_IF_ERROR(r.get(s.tokens_removed, "tokens removed"));
    THINKV_RETURN_IF_ERROR(r.get(current, "tracker type"));
    THINKV_RETURN_IF_ERROR(r.get(ts.refreshes, "tracker refreshes"));
    THINKV_RETURN_IF_ERROR(r.get(ts.refresh_ns, "tracker time"));
    THINKV_RETURN_IF_ERROR(r.get(ts.changes, "tracker changes"));
    for (auto& h : ts.refresh_histogram) THINKV_RETURN_IF_ERROR(r.get(h, "tracker histogram"));
    for (auto& t : ts.tokens) THINKV_RETURN_IF_ERROR(r.get(t, "tracker tokens"));
    std::uint32_t n = 0;
    THINKV_RETURN_IF_ERROR(r.get(n, "layer count"));
    if (n != static_cast<std::uint32_t>(config_.num_layers)) return r.bad("layer count", std::to_string(n));
    THINKV_RETURN_IF_ERROR(r.get_vector(s.layer_sparsity, n, "layer sparsity"));
    THINKV_RETURN_IF_ERROR(r.get(n, "segment count"));
    if (n > r.left() / 19) return r.bad("segment count", std::to_string(n));
    s.segments.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) {
      if (r.left() < 19) return r.bad("segments", "truncated");
      SegmentState g;
      std::int32_t level = 0;
      THINKV_RETURN_IF_ERROR(r.get(g.id, "segment id"));
      THINKV_RETURN_IF_ERROR(r.get(g.type, "segment type"));
      THINKV_RETURN_IF_ERROR(r.get(g.start, "segment start"));
      THINKV_RETURN_IF_ERROR(r.get(g.size, "segment size"));
      THINKV_RETURN_IF_ERROR(r.get(level, "segment level"));
      THINKV_RETURN_IF_ERROR(r.get(g.closed, "segment closed"));
      THINKV_RETURN_IF_ERROR(r.get(g.pinned, "segment pinned"));
      g.level = level;
      s.segments.push_back(g);
    }
    THINKV_RETURN_IF_ERROR(r.get(n, "ragged count"));
    if (n > s.segments.size()) return r.bad("ragged count", std::to_string(n));
    THINKV_RETURN_IF_ERROR(r.get_vector(s.ragged, n, "ragged segments"));
    StageSnapshot stage;
    THINKV_RETURN_IF_ERROR(r.get(stage.thought, "staged type"));
    THINKV_RETURN_IF_ERROR(r.get(n, "staged count"));
    if (n >= static_cast<std::uint32_t>(config_.group_size)) return r.bad("staged count", std::to_string(n));
    THINKV_RETURN_IF_ERROR(r.get_vector(stage.segments, n, "staged segments"));
    THINKV_RETURN_IF_ERROR(r.get(stage.next_position, "next position"));
    THINKV_RETURN_IF_ERROR(r.get(n, "stream count"));
    if (n != static_cast<std::uint32_t>(last - first)) return r.bad("stream count", std::to_string(n));
    std::vector<StreamSnapshot> snaps(n);
    const auto words = static_cast<std::size_t>(cache_.layout().evict_mask_words());
    const auto bs = static_cast<std::size_t>(config_.block_size);
    for (StreamSnapshot& sn : snaps) {
      std::uint32_t blocks = 0;
      THINKV_RETURN_IF_ERROR(r.get(blocks, "block count"));
      THINKV_RETURN_IF_ERROR(r.get(sn.image.records, "record count"));
      if (blocks > r.left() / saved_block_bytes()) return r.bad("block count", std::to_string(blocks));
      sn.image.blocks.resize(blocks);
      for (BlockImage& bi : sn.image.blocks) {
        THINKV_RETURN_IF_ERROR(r.get(bi.thought, "block type"));
        THINKV_RETURN_IF_ERROR(r.get(bi.fill, "block fill"));
        THINKV_RETURN_IF_ERROR(r.get(bi.seg_lo, "block segments"));
        THINKV_RETURN_IF_ERROR(r.get(bi.seg_hi, "block segments"));
        THINKV_RETURN_IF_ERROR(r.get_vector(bi.mask, words, "eviction mask"));
        THINKV_RETURN_IF_ERROR(r.get_vector(bi.slot_record, bs, "slot records"));
        THINKV_RETURN_IF_ERROR(r.get_vector(bi.slot_segment, bs, "slot segments"));
        THINKV_RETURN_IF_ERROR(r.get_vector(bi.slot_position, bs, "slot positions"));
      }
      std::uint64_t bytes = 0;
      THINKV_RETURN_IF_ERROR(r.get(bytes, "page bytes"));
      if (bytes > r.left()) return r.bad("page bytes", "truncated");
      THINKV_RETURN_IF_ERROR(r.get_bytes(sn.pages, static_cast<std::size_t>(bytes), "pages"));
      THINKV_RETURN_IF_ERROR(r.get(bytes, "record bytes"));
      if (bytes > r.left()) return r.bad("record bytes", "truncated");
      THINKV_RETURN_IF_ERROR(r.get_bytes(sn.records, static_cast<std::size_t>(bytes), "records"));
      for (float& x : sn.scales) THINKV_RETURN_IF_ERROR(r.get(x, "stream scales"));
      THINKV_RETURN_IF_ERROR(r.get(n, "staged values"));
      THINKV_RETURN_IF_ERROR(r.get_vector(sn.staged, n, "staged values"));
    }
    if (r.left() != 0) return r.bad("body", "has " + std::to_string(r.left()) + " bytes past its last stream");
    THINKV_RETURN_IF_ERROR(check_loaded(s, current, stage));
    THINKV_RETURN_IF_ERROR(cache_.load_streams(first, snaps, stage, reserved_));
    s.tracker.restore(current, ts);
    release_reservation(seq_(seq));
    seq_(seq) = std::move(s);
    return Status::ok();
  }

  // ---- batched decode (backends modelling batched_kv_backend) ---------------------------------
  //
  // One step of a batch of sequences, one backend call per layer for the whole batch:
  //     cache.begin_step(seqs);
  //     for each layer: cache.append_batch(layer, seqs, k, v);   // k, v: [batch, Hkv, D]
  //                     cache.attend_batch(layer, seqs, q, out); // q, out: [batch, Hq, D]
  //     cache.end_step(seqs);
  // Tensors are in the backend's memory (device pointers for CudaKvBackend, which enqueues every
  // call on its stream). begin_step does the step's host work for every layer at once: it starts
  // each sequence's token (one staging record per sequence), plans and records every layer's
  // commits, and hands the backend the step (prepare_step: a device backend uploads what changed
  // in one copy). append_batch and attend_batch then only check their arguments and launch: no
  // per-stream host work. The decisions (types, segments, kept tokens, evictions) are exactly
  // those of begin_token / append / attend / end_token called for each sequence in batch order.
  // K/V values are checked by the backend, not on the host: a sequence whose K or V holds a
  // value that is not finite or exceeds 2^64 has that token stored as zeros (no other sequence
  // and no metadata is affected) and is *faulted* once the host learns of it (poll_faults; the
  // CPU backend at once, a device backend when the step's work has finished): from then on
  // begin_step / begin_token naming it fail with kNonFinite, until reset_sequence frees it.

  /// begin_token for every sequence of the batch, all or nothing: any check failing, or the
  /// batch's commits not fitting the pools together, begins none (the error names the sequence
  /// or the pool). Then plans and records every layer's commits and prepares the backend for the
  /// step. Polls the backend's faults first (without waiting). `hints` is empty or one per
  /// sequence. A backend failure after the checks (a device error) faults the batch's sequences.
  [[nodiscard]] Status begin_step(std::span<const int> seqs,
                                  std::span<const TokenHint> hints = {}) requires batched_kv_backend<B> {
    THINKV_RETURN_IF_ERROR(poll_faults(false));
    THINKV_RETURN_IF_ERROR(check_batch(seqs, "begin_step"));
    if (step_.open) {
      return {StatusCode::kInvalidArgument, "begin_step: the step begun before is still open (end_step it first)"};
    }
    if (!hints.empty() && hints.size() != seqs.size()) {
      return {StatusCode::kShapeMismatch, "begin_step: " + std::to_string(hints.size()) + " hints for " +
                                              std::to_string(seqs.size()) + " sequences"};
    }
    const int L = config_.num_layers, hkv = config_.num_kv_heads, g = config_.group_size;
    types_.resize(seqs.size());
    completes_.assign(seqs.size(), 0);
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      PlanClaims unused;
      THINKV_RETURN_IF_ERROR(plan_begin(seqs[b], unused, types_[b], /*count_commits=*/false));
      completes_[b] = cache_.table().staged_count(stream_of(seqs[b], 0, 0)) + 1 == g ? 1 : 0;
    }
    // Evictions still pending: those that reached the host, and those of sequences that commit
    // now (their holes are placed), waiting for them.
    if (!pending_.empty()) {
      std::vector<int> need;
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        if (completes_[b] != 0 && seq_pending_[static_cast<std::size_t>(seqs[b])] != 0) need.push_back(seqs[b]);
      }
      THINKV_RETURN_IF_ERROR(collect_selections(false, need));
    }
    // Every layer's commits, layer by layer (each layer's are what its append_step writes), made
    // with PlanClaims so that they can be recorded in order once they all fit. Nothing changes yet.
    Step& st = step_;
    st.layer_commits.assign(static_cast<std::size_t>(L) + 1, 0);
    PlanClaims claims;
    std::size_t used = 0;  // plans in st.plans (whose vectors are kept from step to step)
    for (int l = 0; l < L; ++l) {
      st.layer_commits[static_cast<std::size_t>(l)] = static_cast<std::uint32_t>(used);
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        if (completes_[b] == 0) continue;
        for (int h = 0; h < hkv; ++h) {
          if (used == st.plans.size()) st.plans.emplace_back();
          CommitPlan& plan = st.plans[used++];
          if (Status e = cache_.table().plan_commit(stream_of(seqs[b], l, h), types_[b], plan, &claims); !e.is_ok()) {
            return {e.code(), "begin_step: sequence " + std::to_string(seqs[b]) + " at position " +
                                  std::to_string(seq_(seqs[b]).position) + ", layer " + std::to_string(l) +
                                  ", KV head " + std::to_string(h) + ": " + e.message()};
          }
        }
      }
    }
    st.layer_commits[static_cast<std::size_t>(L)] = static_cast<std::uint32_t>(used);
    st.commits = std::span<const CommitPlan>(st.plans.data(), used);
    if (Status e = cache_.table().check_claims(
            claims, reserved_, "begin_step of " + std::to_string(seqs.size()) + " sequences (their commits)");
        !e.is_ok()) {
      // Pending evictions may free what is missing: collect them and plan again.
      if (e.code() == StatusCode::kPoolExhausted && !pending_.empty()) {
        THINKV_RETURN_IF_ERROR(collect_selections(true));
        return begin_step(seqs, hints);
      }
      return e;
    }
    THINKV_RETURN_IF_ERROR(cache_.provide_storage(st.commits));
    // From here on the host's records change; only the backend can still fail.
    st.seqs.assign(seqs.begin(), seqs.end());
    st.rows.resize(seqs.size());
    st.sparsity_slot.assign(static_cast<std::size_t>(L), -1);
    long long max_blocks = 0;
    bool any_refresh = false;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const int seq = seqs[b];
      apply_begin(seq, PlanClaims{}, types_[b], hints.empty() ? TokenHint{} : hints[b]);
      const SeqState& s = seq_(seq);
      const int first = stream_of(seq, 0, 0);
      const bool refresh = wants_sparsity_step(s);
      any_refresh = any_refresh || refresh;
      st.rows[b] = StepSequence{first, cache_.table().staged_count(first) - 1, s.generation, refresh ? 1 : 0};
      max_blocks = std::max<long long>(max_blocks, cache_.table().set_max_blocks(first));
    }
    if (Status e = cache_.apply_plans(st.commits); !e.is_ok()) return fail_step(e);
    // The layers whose attention computes sparsity this step (the classifier's L*, or all): when a
    // sequence refreshes, or, capturable, on every step (the launches must not change; the
    // sequences that do not refresh cost no sparsity pass).
    int slots = 0;
    for (int l = 0; l < L; ++l) {
      bool want = config_.trace_all_layers;
      if (capturable_) {
        want = want || (policy_.classifier.needs_signal() && policy_.classifier.uses_layer(l));
      } else if (any_refresh) {
        for (std::size_t b = 0; b < seqs.size() && !want; ++b) want = wants_sparsity(seqs[b], l);
      }
      if (want) st.sparsity_slot[static_cast<std::size_t>(l)] = static_cast<std::int8_t>(slots++);
    }
    if (config_.trace_all_layers) {
      for (std::size_t b = 0; b < seqs.size(); ++b) st.rows[b].sparsity = 1;
    }
    st.sparsity.assign(static_cast<std::size_t>(slots) * seqs.size() * static_cast<std::size_t>(config_.num_q_heads),
                       0.0f);
    StepView v;
    v.num_layers = L;
    v.num_kv_heads = hkv;
    v.num_q_heads = config_.num_q_heads;
    v.softmax_scale = config_.softmax_scale;
    v.seqs = st.rows;
    v.commits = st.commits;
    v.layer_commits = st.layer_commits;
    v.sparsity_slot = st.sparsity_slot;
    v.sparsity = st.sparsity.empty() ? nullptr : st.sparsity.data();
    v.max_positions = (max_blocks + 1) * config_.block_size + g;
    v.capturable = capturable_;
    v.table = cache_.table().table_view();
    if (Status e = cache_.backend().prepare_step(v); !e.is_ok()) return fail_step(e);
    st.appended.assign(static_cast<std::size_t>(L), 0);
    st.open = true;
    return Status::ok();
  }

  // ---- capturing a step in a CUDA graph ---------------------------------------------------
  //
  // With capturable steps on, the per-layer launches of a step (append_batch and attend_batch)
  // are the same for every step of a batch size: everything a step varies is in device memory
  // that begin_step rewrites. A runtime captures them once, inside its own capture of the layers:
  //     cache.begin_step(seqs);                       // host: plans, uploads
  //     cudaStreamBeginCapture(stream, ...);
  //     for each layer: ... cache.append_batch(l, seqs, k, v); cache.attend_batch(l, seqs, q, out); ...
  //     cudaStreamEndCapture(stream, &graph);  cudaGraphInstantiate(&exec, graph, 0);
  //     cudaGraphLaunch(exec, stream);                // the capture itself ran nothing
  //     cache.end_step(seqs);
  // and then, for every later step with the same number of sequences (any of them, any order)
  // and the same tensors:
  //     cache.begin_step(seqs);  cudaGraphLaunch(exec, stream);  cache.replay_step();
  //     cache.end_step(seqs);
  // The graph is stale when graph_epoch() changes (the device storage or the step's tables
  // grew): capture again. docs/design.md, "Capturing a step in a CUDA graph".

  /// Turns capturable steps on or off (between steps).
  [[nodiscard]] Status set_capturable_steps(bool on) {
    if (step_.open) return {StatusCode::kInvalidArgument, "set_capturable_steps: a step is open"};
    capturable_ = on;
    return Status::ok();
  }
  [[nodiscard]] bool capturable_steps() const noexcept { return capturable_; }
  /// The open step's per-layer launches ran from a replayed graph: every layer counts as appended
  /// and attended (end_step follows). Only for capturable steps, before any per-layer call.
  [[nodiscard]] Status replay_step() requires batched_kv_backend<B> {
    if (!step_.open) return {StatusCode::kInvalidArgument, "replay_step: no step is open (begin_step first)"};
    if (!capturable_) {
      return {StatusCode::kInvalidArgument,
              "replay_step: the step is not capturable (set_capturable_steps(true) before begin_step)"};
    }
    if (std::find(step_.appended.begin(), step_.appended.end(), 1) != step_.appended.end()) {
      return {StatusCode::kInvalidArgument, "replay_step: layers of this step were appended by host calls"};
    }
    std::fill(step_.appended.begin(), step_.appended.end(), 1);
    return Status::ok();
  }
  /// The backend's graph epoch (CudaKvBackend::graph_epoch): a captured step is stale once it
  /// changes. 0 for a backend without one.
  [[nodiscard]] std::uint64_t graph_epoch() const noexcept {
    if constexpr (requires(const B& b) { b.graph_epoch(); }) {
      return cache_.backend().graph_epoch();
    } else {
      return 0;
    }
  }

  /// append() of one layer for every sequence of the step: k and v are [batch, num_kv_heads,
  /// head_dim] in the backend's memory, row b of the batch being seqs[b] (the step's batch, in
  /// begin_step's order). Stages the layer's K/V and writes the layer's commits (planned by
  /// begin_step) in one backend call. K/V values are the backend's to check (see above).
  [[nodiscard]] Status append_batch(int layer, std::span<const int> seqs, TensorRef k,
                                    TensorRef v) requires batched_kv_backend<B> {
    THINKV_RETURN_IF_ERROR(check_step_call(layer, seqs, "append_batch"));
    if (k.data == nullptr || v.data == nullptr) {
      return {StatusCode::kInvalidArgument, "append_batch: k and v must not be null"};
    }
    if (step_.appended[static_cast<std::size_t>(layer)] != 0) {
      return {StatusCode::kInvalidArgument, "append_batch: layer " + std::to_string(layer) +
                                                " was already appended in this step (each layer once per step)"};
    }
    THINKV_RETURN_IF_ERROR(cache_.backend().append_step(layer, k, v));
    step_.appended[static_cast<std::size_t>(layer)] = 1;
    return Status::ok();
  }

  /// attend() of one layer for every sequence of the step in one backend call: q and out are
  /// [batch, num_q_heads, head_dim] in the backend's memory. q is not checked on the host (a
  /// non-finite q gives that sequence non-finite output rows, nothing else). The sparsity the
  /// step's refreshes need is recorded at end_step.
  [[nodiscard]] Status attend_batch(int layer, std::span<const int> seqs, TensorRef q,
                                    MutableTensorRef out) requires batched_kv_backend<B> {
    THINKV_RETURN_IF_ERROR(check_step_call(layer, seqs, "attend_batch"));
    if (q.data == nullptr || out.data == nullptr) {
      return {StatusCode::kInvalidArgument, "attend_batch: q and out must not be null"};
    }
    if (step_.appended[static_cast<std::size_t>(layer)] == 0) {
      return {StatusCode::kInvalidArgument, "attend_batch: layer " + std::to_string(layer) +
                                                " before its append_batch (append the layer's K/V first)"};
    }
    return cache_.backend().attend_step(layer, q, out);
  }

  /// end_token for every sequence of the step, in batch order, once every layer was appended:
  /// waits for the sparsity the step's refreshes need (only on refresh steps), then classifies,
  /// relabels and evicts; with K-means on the backend, one select_segments call for every evicting
  /// sequence of the step. A later error (a selector's) names its sequence, the ones before it
  /// having ended.
  [[nodiscard]] Status end_step(std::span<const int> seqs) requires batched_kv_backend<B> {
    if (!step_.open) return {StatusCode::kInvalidArgument, "end_step: no step is open (begin_step first)"};
    THINKV_RETURN_IF_ERROR(check_same_batch(seqs, "end_step"));
    for (int l = 0; l < config_.num_layers; ++l) {
      if (step_.appended[static_cast<std::size_t>(l)] == 0) {
        return {StatusCode::kInvalidArgument,
                "end_step: layer " + std::to_string(l) + " was never appended in this step (append_batch every layer)"};
      }
    }
    if (!step_.sparsity.empty()) {
      THINKV_RETURN_IF_ERROR(cache_.backend().wait_sparsity());
      const int hq = config_.num_q_heads;
      const std::size_t n = step_.seqs.size();
      for (int l = 0; l < config_.num_layers; ++l) {
        const int slot = step_.sparsity_slot[static_cast<std::size_t>(l)];
        if (slot < 0) continue;
        for (std::size_t b = 0; b < n; ++b) {
          if (step_.rows[b].sparsity == 0 || !wants_sparsity(step_.seqs[b], l)) continue;
          const float* x = step_.sparsity.data() + (static_cast<std::size_t>(slot) * n + b) * hq;
          record_layer_signal(seq_(step_.seqs[b]), l, std::span<const float>(x, static_cast<std::size_t>(hq)));
        }
      }
    }
    // Under tensor parallelism: one all-reduce for every sequence of the step that refreshes.
    THINKV_RETURN_IF_ERROR(reduce_signals(step_.seqs));
    step_.open = false;
    for (int seq : step_.seqs) std::fill(seq_(seq).appended.begin(), seq_(seq).appended.end(), 1);
    if constexpr (kEvicts && kAsyncSelect) {
      // Every evicting sequence's selections in one backend launch, not waited for: their victims
      // are marked on the device before the next step reads anything, and evicted in the table
      // when collected (the next begin_step or end_step at the latest, before any plan).
      THINKV_RETURN_IF_ERROR(collect_selections(true));
      std::vector<TbeWork> works;
      THINKV_RETURN_IF_ERROR(end_step_plans(works));
      if (!works.empty()) THINKV_RETURN_IF_ERROR(launch_selections(works));
      return poll_faults(false);
    }
    if constexpr (kEvicts && kBackendKmeans) {
      // Every evicting sequence's K-means in one backend call; evictions applied in batch order.
      std::vector<TbeWork> works;
      THINKV_RETURN_IF_ERROR(end_step_plans(works));
      std::vector<TbeWork*> ptrs;
      for (TbeWork& w : works) ptrs.push_back(&w);
      if (!ptrs.empty()) THINKV_RETURN_IF_ERROR(select_on_backend(ptrs));
      for (TbeWork& w : works) {
        if (!w.selected) THINKV_RETURN_IF_ERROR(select_host(w));
        THINKV_RETURN_IF_ERROR(apply_tbe(w));
      }
    } else {
      for (int seq : step_.seqs) THINKV_RETURN_IF_ERROR(end_token(seq));
    }
    return poll_faults(false);
  }

  /// Takes the faults the backend raised (batched appends) and marks their sequences faulted;
  /// with `wait`, after waiting for all enqueued work (every fault so far then known).
  [[nodiscard]] Status poll_faults(bool wait) requires batched_kv_backend<B> {
    faults_.clear();
    THINKV_RETURN_IF_ERROR(cache_.backend().poll_faults(faults_, wait));
    for (const BackendFault& f : faults_) {
      const int seq = f.fault / config_.streams_per_sequence();
      if (seq < 0 || seq >= config_.num_sequences) continue;
      SeqState& s = seq_(seq);
      if (f.tag == s.generation) s.faulted = true;  // a fault of a sequence since reset is stale
    }
    return Status::ok();
  }
  /// True when a batched append of the sequence stored a bad K/V value (see above).
  [[nodiscard]] bool faulted(int seq) const { return check_seq(seq).is_ok() && seq_(seq).faulted; }

  // ---- prefill (backends modelling batched_kv_backend and prompt_attending_backend) --------
  //
  // A sequence's prompt, every layer in one call:
  //     cache.begin_prompt(seq, tokens);
  //     for each layer: cache.prefill(layer, seq, q, k, v, out); // q, out: [tokens, Hq, D]
  //                                                               // k, v:   [tokens, Hkv, D]
  //     cache.end_prompt(seq);
  // then batched decode steps (or the one-token calls). The prompt is the sequence's first
  // tokens: its positions join the pinned prefix (stored as R, never evicted, not classified),
  // and the cache then holds exactly what begin_token / append / end_token of each prompt token
  // would have stored. Its attention is causal over the prompt's own K/V as given (the input
  // precision, not the cache's), as a runtime's prefill computes it; decode tokens later attend
  // to the prompt as the cache stores it.
  //
  // A prompt may come in several chunks (a runtime's ubatches): begin_prompt / prefill /
  // end_prompt again at the sequence's position P. While every token before P is pinned (no
  // decode token yet) the chunk continues the prompt: its tokens are pinned and stored the same
  // way (the cache holds what the one-token calls would store with pinned_prefix P + tokens).
  // After a decoded token it is a later turn (a user's next message, a tool's output): its tokens
  // are stored with the thought type in force (the tracker's current type), not pinned and not
  // classified (a refresh step inside the chunk is skipped: input is not a thought), segmented
  // as decode tokens are, and end_prompt runs TBE until the sequence is within its budget again.
  // Either way the chunk's queries attend to the P stored tokens as the cache stores them
  // (quantized pages dequantized, the open group in BF16), then causally to the chunk's own K/V
  // as given: what a runtime attending a ubatch over its cache computes. A backend attends a
  // chunk at P > 0 only if it models chunk_attending_backend (the CPU and CUDA backends do); on the
  // others such a chunk can be stored only (q and out null).

  /// Opens a prompt (or the next chunk of one, or a later turn: see above) of `tokens` positions
  /// at the sequence's position P, reserving what every layer's commits will take from the
  /// pools, so that no prefill of it can fail on a full pool. A prompt is pinned:
  /// pinned_prefix(seq) becomes max(pinned_prefix(seq), P + tokens). Errors (nothing changes):
  /// sequence out of range or faulted, a token or prompt open, an open group whose positions do
  /// not end at P (kUnsupported), tokens outside 1..max_tokens - P, kPoolExhausted naming the
  /// pool.
  [[nodiscard]] Status begin_prompt(int seq, int tokens) requires batched_kv_backend<B> && prompt_attending_backend<B> {
    const int one_seq[] = {seq}, one_count[] = {tokens};
    return begin_prompts(one_seq, one_count);
  }

  /// begin_prompt of several sequences at once (a ubatch): sequence seqs[i] opens tokens[i]
  /// positions. All or nothing: every check, and the pools for all of them together, before
  /// anything changes; the errors of begin_prompt, plus a sequence named twice and spans of
  /// different sizes (kInvalidArgument).
  [[nodiscard]] Status begin_prompts(std::span<const int> seqs, std::span<const int> tokens) requires
      batched_kv_backend<B> && prompt_attending_backend<B> {
    THINKV_RETURN_IF_ERROR(poll_faults(false));
    if (seqs.size() != tokens.size()) {
      return {StatusCode::kInvalidArgument, "begin_prompts: " + std::to_string(seqs.size()) + " sequences and " +
                                                std::to_string(tokens.size()) + " token counts"};
    }
    THINKV_RETURN_IF_ERROR(check_batch(seqs, "begin_prompts"));
    for (int seq : seqs) THINKV_RETURN_IF_ERROR(settle_sequence(seq));
    prompt_plans_.resize(seqs.size());
    PlanClaims need, held;
    std::int64_t total = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      THINKV_RETURN_IF_ERROR(plan_prompt(seqs[i], tokens[i], prompt_plans_[i]));
      need += prompt_plans_[i].need;
      held += seq_(seqs[i]).reserved;
      total += tokens[i];
    }
    const std::string call =
        seqs.size() == 1
            ? prompt_call(seqs[0], tokens[0]) + " at position " + std::to_string(seq_(seqs[0]).position)
            : "begin_prompts of " + std::to_string(seqs.size()) + " sequences (" + std::to_string(total) + " tokens)";
    THINKV_RETURN_IF_ERROR(cache_.table().check_claims(need, reserved_ - held, call));
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      THINKV_RETURN_IF_ERROR(apply_prompt(seqs[i], tokens[i], prompt_plans_[i]));
    }
    return Status::ok();
  }

  /// One layer of the open prompt: its causal attention (q, out: [tokens, num_q_heads, head_dim];
  /// at P > 0 over the stored tokens too, see above) in one backend call, then its K/V (k, v:
  /// [tokens, num_kv_heads, head_dim] in the backend's memory), one stage and at most one commit
  /// call per group of group_size rows.
  /// q and out both null: the K/V are stored and nothing is attended (a runtime that computes its
  /// prompt's attention itself, over its own copy of the K/V, hands the cache the K/V only).
  /// K/V values are checked by the backend as in append_batch (a bad value faults the sequence).
  /// Errors before anything is enqueued: no open prompt, layer out of range or already done, null
  /// tensors, kUnsupported for a chunk at P > 0 the backend cannot attend. A backend error after
  /// the first group leaves the layer part-appended: free the sequence with reset_sequence.
  [[nodiscard]] Status prefill(int layer, int seq, TensorRef q, TensorRef k, TensorRef v,
                               MutableTensorRef out) requires batched_kv_backend<B> && prompt_attending_backend<B> {
    THINKV_RETURN_IF_ERROR(check_prefill(layer, seq, q, k, v, out));
    SeqState& s = seq_(seq);
    const bool attend = q.data != nullptr || out.data != nullptr;
    const bool continued = s.prompt_start > 0;
    PromptAttendArgs a;
    a.tokens = s.prompt;
    a.num_q_heads = config_.num_q_heads;
    a.num_kv_heads = config_.num_kv_heads;
    a.head_dim = config_.head_dim;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = out;
    a.softmax_scale = config_.softmax_scale;
    if (!attend) {  // the checks need tensors: stand k in for q and v for out (never written)
      a.q = k;
      a.out = MutableTensorRef{const_cast<void*>(v.data), v.type};
      a.num_q_heads = config_.num_kv_heads;
    }
    THINKV_RETURN_IF_ERROR(check_prompt_attend(a));
    const int hkv = config_.num_kv_heads, g = config_.group_size;
    // The attention first: a continued chunk attends to the tokens stored before it (its own
    // rows, committed below, must not be read back quantized).
    if (attend && continued) {
      if constexpr (chunk_attending_backend<B>) {
        streams_.resize(static_cast<std::size_t>(hkv));
        for (int h = 0; h < hkv; ++h) streams_[static_cast<std::size_t>(h)] = stream_of(seq, layer, h);
        THINKV_RETURN_IF_ERROR(cache_.attend_chunk(streams_, a));
      }
    } else if (attend) {
      THINKV_RETURN_IF_ERROR(cache_.backend().attend_prompt(a));
    }
    // Row i of the open group's run (i < prompt_open: already staged) is position
    // prompt_start - prompt_open + i, staging row i % g; chunk token t is row prompt_open + t.
    const int rows = s.prompt_open + s.prompt;
    for (int lo = 0; lo < rows; lo += g) {
      const int hi = std::min(rows, lo + g);
      rows_.clear();
      batch_plans_.clear();
      meta_segments_.clear();
      meta_positions_.clear();
      PlanClaims claims;
      for (int h = 0; h < hkv; ++h) {
        const int st = stream_of(seq, layer, h);
        for (int i = std::max(lo, s.prompt_open); i < hi; ++i) {
          const int t = i - s.prompt_open;
          rows_.push_back(StageRow{st, i - lo, t * hkv + h, stream_of(seq, 0, 0), s.generation});
        }
        if (hi - lo == g) {  // a full group: committed with its own metadata
          for (int i = lo; i < hi; ++i) {
            meta_segments_.push_back(s.prompt_rows[static_cast<std::size_t>(i)]);
            meta_positions_.push_back(s.prompt_start - s.prompt_open + i);
          }
          CommitPlan& plan = batch_plans_.emplace_back();
          if (Status e = cache_.table().plan_commit(st, s.type, plan, &claims); !e.is_ok()) {
            return {e.code(), "prefill layer " + std::to_string(layer) + " of sequence " + std::to_string(seq) +
                                  ", KV head " + std::to_string(h) + ": " + e.message()};
          }
        }
      }
      THINKV_RETURN_IF_ERROR(cache_.table().check_claims(
          claims, reserved_ - s.reserved,
          "prefill layer " + std::to_string(layer) + " of sequence " + std::to_string(seq)));
      THINKV_RETURN_IF_ERROR(cache_.write_batch(rows_, k, v, batch_plans_, meta_segments_, meta_positions_));
      const PlanClaims used = s.reserved - (s.reserved - claims);  // min(reserved, claims), per term
      s.reserved = s.reserved - used;
      reserved_ = reserved_ - used;
    }
    s.appended[static_cast<std::size_t>(layer)] = 1;
    return Status::ok();
  }

  /// Closes the open prompt once every layer was filled: the sequence is at position P + tokens,
  /// ready to decode; after a later turn, TBE has brought it within its budget. Errors (nothing
  /// changes): no open prompt, a layer not filled.
  [[nodiscard]] Status end_prompt(int seq) requires batched_kv_backend<B> && prompt_attending_backend<B> {
    THINKV_RETURN_IF_ERROR(check_end_prompt(seq));
    SeqState& s = seq_(seq);
    s.position = s.prompt_start + s.prompt;
    stats_.steps += s.prompt;
    s.prompt = 0;
    s.prompt_rows.clear();
    release_reservation(s);
    if constexpr (kEvicts) {
      // A later turn may take the sequence over its budget by many tokens: one TBE plan steps
      // segments down until it is within it, or out of reach (plan_eviction), K-means on each.
      if (s.prompt_start > s.pinned) THINKV_RETURN_IF_ERROR(run_tbe(seq, false));
    }
    return poll_faults(false);
  }

  /// prefill of one layer for several sequences' open prompts (a ubatch): their rows
  /// concatenated in the order of `seqs` (sequence i's prompt tokens after those of 0..i-1), q
  /// and out [rows, num_q_heads, head_dim], k and v [rows, num_kv_heads, head_dim]. The checks of
  /// every sequence come first (nothing is enqueued when one fails); then each sequence's
  /// prefill in turn (a backend's calls per sequence: one attention and the group commits).
  [[nodiscard]] Status prefill_batch(int layer, std::span<const int> seqs, TensorRef q, TensorRef k, TensorRef v,
                                     MutableTensorRef out) requires batched_kv_backend<B> &&
      prompt_attending_backend<B> {
    THINKV_RETURN_IF_ERROR(check_batch(seqs, "prefill_batch"));
    for (int seq : seqs) THINKV_RETURN_IF_ERROR(check_prefill(layer, seq, q, k, v, out));
    const auto hq = static_cast<std::size_t>(config_.num_q_heads) * config_.head_dim;
    const auto hkv = static_cast<std::size_t>(config_.num_kv_heads) * config_.head_dim;
    std::size_t row = 0;
    auto at = [](auto ref, std::size_t elements) {
      if (ref.data == nullptr) return ref;
      using Byte = std::conditional_t<std::is_same_v<decltype(ref), TensorRef>, const char, char>;
      ref.data = static_cast<Byte*>(ref.data) + elements * static_cast<std::size_t>(element_bytes(ref.type));
      return ref;
    };
    for (int seq : seqs) {
      THINKV_RETURN_IF_ERROR(
          prefill(layer, seq, at(q, row * hq), at(k, row * hkv), at(v, row * hkv), at(out, row * hq)));
      row += static_cast<std::size_t>(seq_(seq).prompt);
    }
    return Status::ok();
  }

  /// end_prompt of several sequences: every check first (nothing changes when one fails), then
  /// each in turn.
  [[nodiscard]] Status end_prompts(std::span<const int> seqs) requires batched_kv_backend<B> &&
      prompt_attending_backend<B> {
    THINKV_RETURN_IF_ERROR(check_batch(seqs, "end_prompts"));
    for (int seq : seqs) THINKV_RETURN_IF_ERROR(check_end_prompt(seq));
    for (int seq : seqs) THINKV_RETURN_IF_ERROR(end_prompt(seq));
    return Status::ok();
  }

  /// Live tokens of every stream of a sequence (all equal: every stream sees the same plan).
  [[nodiscard]] std::int64_t live_tokens(int seq) const {
    const int st = stream_of(seq, 0, 0);
    return cache_.table().live_slots(st) + cache_.table().staged_count(st);
  }
  [[nodiscard]] MemoryUsage memory() const { return cache_.memory(); }
  /// What FullKV in FP16 would hold for every position a sequence has decoded so far (all its
  /// streams): the paper's baseline. MemoryUsage::fullkv_fp16_bytes counts live tokens only.
  [[nodiscard]] std::int64_t fullkv_sequence_bytes(int seq) const {
    return cache_.layout().fullkv_fp16_bytes(seq_(seq).position) * config_.streams_per_sequence();
  }
  [[nodiscard]] MemoryUsage memory(int seq) const {
    MemoryUsage m;
    for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) m += cache_.memory(st);
    return m;
  }

 private:
  struct SeqState {
    tracker_type tracker;
    std::vector<std::uint8_t> appended;  ///< [num_layers] this token
    std::vector<SegmentState> segments;
    std::vector<float> layer_sparsity;
    std::vector<double> layer_sum;  ///< [num_layers] this token's head sparsities summed over this cache's heads
    bool signal_reduced = false;    ///< this token's layer sums went through the signal all-reduce
    std::int32_t position = 0;
    std::uint32_t next_segment = 0;
    ThoughtType type = ThoughtType::kReasoning;
    bool in_token = false;
    std::int32_t pinned = 0;          ///< pinned prefix (positions never evicted)
    std::int64_t eviction_calls = 0;  ///< this sequence's applied plans
    std::int64_t tokens_evicted = 0;  ///< this sequence's evicted slots, all its streams
    std::int64_t tokens_removed = 0;  ///< this sequence's slots removed by remove(), all its streams
    /// Segments whose streams hold different counts (a remove() cut through them after K-means
    /// chose per stream): their selections count each stream's tokens (selection_jobs).
    std::vector<std::uint32_t> ragged;
    PlanClaims reserved;            ///< what the open token still holds of the pools
    bool faulted = false;           ///< a batched append stored a bad K/V value
    std::int32_t prompt = 0;        ///< tokens of the open prompt (begin_prompt), 0: none
    std::int32_t prompt_start = 0;  ///< position of the open prompt's first token
    std::int32_t prompt_open = 0;   ///< rows of the open group staged before the open prompt
    /// Segment of each row of the open prompt's run: the open group's prompt_open staged rows,
    /// then the prompt's tokens.
    std::vector<std::uint32_t> prompt_rows;
    std::int32_t generation = 0;  ///< reset_sequence calls (tags the backend's faults)
  };
  /// The open decode step (begin_step .. end_step).
  struct Step {
    bool open = false;
    std::vector<int> seqs;
    std::vector<StepSequence> rows;
    std::vector<CommitPlan> plans;  // storage, reused: the step's are the first commits.size()
    std::span<const CommitPlan> commits;
    std::vector<std::uint32_t> layer_commits;
    std::vector<std::int8_t> sparsity_slot;
    std::vector<float> sparsity;
    std::vector<std::uint8_t> appended;  // [num_layers] append_batch done
  };

  /// remove()'s checks, before anything changes: where sequence `seq` would continue once
  /// [lo, end) is gone (`next`; lo < end <= position), and kUnsupported for what the storage
  /// cannot do exactly. The message starts with `call`; its hint names sequence `named`.
  [[nodiscard]] Status check_remove(int seq, std::int32_t lo, std::int32_t end, const std::string& call, int named,
                                    std::int32_t& next) const {
    const SeqState& s = seq_(seq);
    const std::int32_t pend = s.position;
    const bool tail = end >= pend;
    const int first = stream_of(seq, 0, 0), last = stream_of(seq + 1, 0, 0);
    const BlockTable& table = cache_.table();
    const int staged = table.staged_count(first);  // every stream of the set holds the same rows
    const std::int32_t G = staged > 0 ? table.staged_position(first, 0) : pend;  // first staged position
    auto inside = [&](std::int32_t pos) { return pos >= lo && pos < end; };
    // A slot's segment tells where to look: segment ids grow with position, so only the blocks
    // holding a segment that overlaps a range of positions are walked (live_segment_slots).
    std::vector<SlotRef> slots;
    // Where the sequence continues: its last live position + 1 (staged rows are live everywhere).
    next = pend;
    if (tail) {
      next = 0;
      for (int r = 0; r < staged; ++r) {
        const std::int32_t pos = table.staged_position(first, r);
        if (!inside(pos)) next = std::max(next, pos + 1);
      }
      // Pages hold positions below G and nothing at or after lo stays: the latest segment before
      // lo with a live slot in any stream holds the answer.
      for (std::size_t i = s.segments.size(); i-- > 0 && next < G && next < lo;) {
        if (s.segments[i].start >= lo) continue;
        for (int st = first; st < last && next < lo; ++st) {
          table.live_segment_slots(st, s.segments[i].id, slots);
          for (const SlotRef r : slots) {
            const std::int32_t pos = table.slot_position(r);
            if (!inside(pos)) next = std::max(next, pos + 1);
          }
        }
        if (next > s.segments[i].start) break;  // found in this segment: no earlier one can be later
      }
    }
    // What the storage cannot do exactly, before anything changes.
    if (!tail && staged > 0 && lo < pend && end > G) {
      return {StatusCode::kUnsupported,
              call + ": positions [" + std::to_string(std::max(lo, G)) + ", " + std::to_string(end) +
                  ") are in the open quantization group (staged from position " + std::to_string(G) +
                  ") and later positions stay; remove them together with the end of the sequence (p1 = -1)"};
    }
    const int g = config_.group_size;
    if (tail && next < G && next % g != 0) {
      return {StatusCode::kUnsupported,
              call + ": the sequence would continue at position " + std::to_string(next) +
                  ", inside a quantization group whose first tokens are already quantized (positions " +
                  std::to_string(next / g * g) + ".." + std::to_string(next - 1) +
                  "); remove from a multiple of group_size (" + std::to_string(g) + ") instead, e.g. remove(" +
                  std::to_string(named) + ", " + std::to_string(next / g * g) + ", -1), and decode those tokens again"};
    }
    return Status::ok();
  }

  /// A sequence that receives a whole state (load_sequence, copy_sequence's destination) must
  /// hold nothing: never decoded, or reset. `what` names the operation in the message.
  [[nodiscard]] Status check_empty(int seq, const std::string& call, const char* what) const {
    const SeqState& d = seq_(seq);
    if (d.position != 0 || !d.segments.empty() || cache_.table().staged_count(stream_of(seq, 0, 0)) != 0) {
      return {StatusCode::kInvalidArgument, call + ": sequence " + std::to_string(seq) + " holds " +
                                                std::to_string(d.position) + " positions; reset_sequence it first (" +
                                                what + " replaces nothing)"};
    }
    return Status::ok();
  }
  /// Bytes one block image takes in a saved state (save_sequence writes, load_sequence bounds
  /// the block count with it): thought (1), fill (2), segment range (4 + 4), the eviction mask,
  /// and a record, a segment and a position (4 bytes each) per slot.
  [[nodiscard]] std::size_t saved_block_bytes() const noexcept {
    return 11 + 8 * static_cast<std::size_t>(cache_.layout().evict_mask_words()) +
           12 * static_cast<std::size_t>(config_.block_size);
  }
  /// Every stream of a settled sequence and its open group, as load_streams restores them.
  /// With `skip`, each stream's blocks from skip[k] on (copy_sequence shares the ones before).
  [[nodiscard]] Status snapshot_sequence(int seq, std::vector<StreamSnapshot>& snaps, StageSnapshot& stage,
                                         std::span<const std::size_t> skip = {}) const requires state_io_backend<B> {
    const int first = stream_of(seq, 0, 0), last = stream_of(seq + 1, 0, 0);
    snaps.assign(static_cast<std::size_t>(last - first), StreamSnapshot{});
    for (int st = first; st < last; ++st) {
      const auto k = static_cast<std::size_t>(st - first);
      THINKV_RETURN_IF_ERROR(cache_.save_stream(st, snaps[k], k < skip.size() ? skip[k] : 0));
    }
    stage = cache_.stage_snapshot(first);
    return Status::ok();
  }

  /// The checks of the calls that change or read a whole sequence between tokens (remove,
  /// save_sequence, load_sequence): not in the open step; its pending selections settled; not
  /// faulted; no open token or prompt. `call` names the call in the message.
  [[nodiscard]] Status settle_quiet(int seq, const std::string& call) {
    if (step_.open && std::find(step_.seqs.begin(), step_.seqs.end(), seq) != step_.seqs.end()) {
      return {StatusCode::kInvalidArgument, call + ": the sequence is in the open step (end_step it first)"};
    }
    THINKV_RETURN_IF_ERROR(settle_sequence(seq));
    const SeqState& s = seq_(seq);
    if (s.faulted) return fault_status(seq);
    if (s.in_token || s.prompt > 0) {
      return {StatusCode::kInvalidArgument,
              call + ": the sequence has an open " +
                  (s.in_token ? "token (end_token it first)" : "prompt (end_prompt it first)")};
    }
    return Status::ok();
  }
  /// What a saved state must have been saved by: this cache's geometry and precision map.
  void write_fingerprint(StateWriter& w) const {
    const CacheLayout& L = cache_.layout();
    w.put(static_cast<std::int32_t>(config_.num_layers));
    w.put(static_cast<std::int32_t>(config_.num_kv_heads));
    w.put(static_cast<std::int32_t>(config_.head_dim));
    w.put(static_cast<std::int32_t>(config_.group_size));
    w.put(static_cast<std::int32_t>(config_.block_size));
    w.put(static_cast<std::int32_t>(config_.segment_len));
    w.put(static_cast<std::int32_t>(policy_.classifier.tau()));
    for (ThoughtType t : kAllThoughtTypes) w.put(cache_.config().precision.precision_of(t));
    for (Precision p : kAllPrecisions) w.put(L.page_bytes(p));
  }
  [[nodiscard]] Status check_fingerprint(StateReader& r) const {
    const CacheLayout& L = cache_.layout();
    auto same = [&r](auto want, const char* field) -> Status {
      decltype(want) got{};
      THINKV_RETURN_IF_ERROR(r.get(got, field));
      if (got == want) return Status::ok();
      return {StatusCode::kInvalidArgument, std::string("sequence state: saved by a cache with ") + field + " " +
                                                std::to_string(static_cast<std::int64_t>(got)) + "; this one has " +
                                                std::to_string(static_cast<std::int64_t>(want))};
    };
    THINKV_RETURN_IF_ERROR(same(static_cast<std::int32_t>(config_.num_layers), "num_layers"));
    THINKV_RETURN_IF_ERROR(same(static_cast<std::int32_t>(config_.num_kv_heads), "num_kv_heads"));
    THINKV_RETURN_IF_ERROR(same(static_cast<std::int32_t>(config_.head_dim), "head_dim"));
    THINKV_RETURN_IF_ERROR(same(static_cast<std::int32_t>(config_.group_size), "group_size"));
    THINKV_RETURN_IF_ERROR(same(static_cast<std::int32_t>(config_.block_size), "block_size"));
    THINKV_RETURN_IF_ERROR(same(static_cast<std::int32_t>(config_.segment_len), "segment_len"));
    THINKV_RETURN_IF_ERROR(same(static_cast<std::int32_t>(policy_.classifier.tau()), "tau"));
    const char* names[kNumThoughtTypes] = {"the precision of R (Precision value)",
                                           "the precision of E (Precision value)",
                                           "the precision of T (Precision value)"};
    for (ThoughtType t : kAllThoughtTypes) {
      THINKV_RETURN_IF_ERROR(
          same(static_cast<std::uint8_t>(cache_.config().precision.precision_of(t)), names[static_cast<int>(t)]));
    }
    for (Precision p : kAllPrecisions) THINKV_RETURN_IF_ERROR(same(L.page_bytes(p), "page bytes"));
    return Status::ok();
  }
  /// The sequence-level fields of a state being loaded, against this cache's limits.
  [[nodiscard]] Status check_loaded(const SeqState& s, ThoughtType current, const StageSnapshot& stage) const {
    auto bad = [](const std::string& what) { return Status{StatusCode::kCorruptData, "sequence state: " + what}; };
    if (s.position < 0) return bad("position " + std::to_string(s.position));
    if (s.position > config_.max_tokens) {
      return {StatusCode::kOutOfRange, "sequence state: position " + std::to_string(s.position) +
                                           " is past this cache's max_tokens " + std::to_string(config_.max_tokens)};
    }
    if (stage.next_position != s.position) {
      return bad("the staging set's next position " + std::to_string(stage.next_position) + " is not position " +
                 std::to_string(s.position));
    }
    if (s.pinned < 0 || s.pinned > config_.max_tokens) return bad("pinned prefix " + std::to_string(s.pinned));
    if (static_cast<int>(s.type) >= kNumThoughtTypes || static_cast<int>(current) >= kNumThoughtTypes) {
      return bad("thought type out of range");
    }
    std::int64_t prev = -1;
    for (const SegmentState& g : s.segments) {
      if (static_cast<std::int64_t>(g.id) <= prev || g.id >= s.next_segment ||
          static_cast<int>(g.type) >= kNumThoughtTypes || g.start < 0 || g.start >= std::max(s.position, 1) ||
          g.size < 0 || g.level < 0) {
        return bad("segment " + std::to_string(g.id) + " is not one a sequence at position " +
                   std::to_string(s.position) + " can have");
      }
      prev = g.id;
    }
    for (std::uint32_t id : s.ragged) {
      if (std::none_of(s.segments.begin(), s.segments.end(), [id](const SegmentState& g) { return g.id == id; })) {
        return bad("ragged segment " + std::to_string(id) + " is not a segment");
      }
    }
    for (std::uint32_t id : stage.segments) {
      if (id >= s.next_segment) return bad("staged token of segment " + std::to_string(id) + " past the last");
    }
    return Status::ok();
  }

  void release_reservation(SeqState& s) {
    reserved_ = reserved_ - s.reserved;
    s.reserved = PlanClaims{};
  }

  static const ThinKvConfig& checked(const ThinKvConfig& c, const P& policy) {
    if (Status s = c.validate(policy); !s.is_ok()) throw ConfigError(s);
    return c;
  }
  static PrecisionMap lowered(const P& policy) {
    PrecisionMap m;
    if (Status s = lower_precision(policy.precision, m); !s.is_ok()) throw ConfigError(s);
    return m;
  }
  /// A refresh (classify, relabel) happens at this token: a refresh step after the pinned prefix,
  /// with a classifier that can label something other than R.
  [[nodiscard]] bool refresh_due(const SeqState& s) const {
    return s.position >= s.pinned && s.tracker.refreshes() && s.tracker.is_refresh_step(s.position);
  }
  /// set_signal_reduction's all-reduce over the sequences of `seqs` that refresh at this token
  /// and were not reduced yet (one call for all of them, ascending ids); their layer sparsities
  /// become the all-rank sums over total_q_heads. Nothing changes on an error.
  [[nodiscard]] Status reduce_signals(std::span<const int> seqs) {
    if (!signal_all_reduce_) return Status::ok();
    std::vector<int> due;
    for (int seq : seqs) {
      if (!seq_(seq).signal_reduced && refresh_due(seq_(seq))) due.push_back(seq);
    }
    if (due.empty()) return Status::ok();
    std::sort(due.begin(), due.end());
    const auto L = static_cast<std::size_t>(config_.num_layers);
    std::vector<double> sums(due.size() * L);
    for (std::size_t k = 0; k < due.size(); ++k) {
      const std::vector<double>& x = seq_(due[k]).layer_sum;
      std::copy(x.begin(), x.end(), sums.begin() + static_cast<std::ptrdiff_t>(k * L));
    }
    if (Status r = signal_all_reduce_(sums); !r.is_ok()) {
      return {r.code(), "the thought signal's all-reduce over tensor-parallel ranks failed (" +
                            std::to_string(due.size()) + " sequence(s) refreshing at this step): " + r.message()};
    }
    for (std::size_t k = 0; k < due.size(); ++k) {
      SeqState& s = seq_(due[k]);
      for (std::size_t l = 0; l < L; ++l) {
        s.layer_sparsity[l] = static_cast<float>(sums[k * L + l] / static_cast<double>(total_q_heads_));
      }
      s.signal_reduced = true;
    }
    return Status::ok();
  }
  void reset_state(SeqState& s) const {
    s = SeqState{};
    s.pinned = config_.pinned_prefix;
    s.appended.assign(static_cast<std::size_t>(config_.num_layers), 0);
    s.tracker = tracker_type(policy_.classifier);
    s.layer_sparsity.resize(static_cast<std::size_t>(config_.num_layers));
    s.layer_sum.resize(static_cast<std::size_t>(config_.num_layers));
    clear_signal(s);
  }
  /// No layer's signal measured yet for the sequence's next token (NaN), not all-reduced.
  static void clear_signal(SeqState& s) {
    std::fill(s.layer_sparsity.begin(), s.layer_sparsity.end(), std::numeric_limits<float>::quiet_NaN());
    std::fill(s.layer_sum.begin(), s.layer_sum.end(), std::numeric_limits<double>::quiet_NaN());
    s.signal_reduced = false;
  }
  /// A layer's attention sparsity per query head of this cache: their sum (for the tensor-parallel
  /// all-reduce; exact in double, a few floats of one scale) and their mean, the layer's signal.
  static void record_layer_signal(SeqState& s, int layer, std::span<const float> heads) {
    double sum = 0.0;
    for (float x : heads) sum += x;
    s.layer_sum[static_cast<std::size_t>(layer)] = sum;
    s.layer_sparsity[static_cast<std::size_t>(layer)] = static_cast<float>(sum / static_cast<double>(heads.size()));
  }
  [[nodiscard]] Status check_seq(int seq) const {
    if (seq < 0 || seq >= config_.num_sequences) {
      return {StatusCode::kOutOfRange, "sequence " + std::to_string(seq) + " is out of range; allowed: 0.." +
                                           std::to_string(config_.num_sequences - 1)};
    }
    return Status::ok();
  }
  [[nodiscard]] Status check_token(int seq, int layer) const {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    if (layer < 0 || layer >= config_.num_layers) {
      return {StatusCode::kOutOfRange, "layer " + std::to_string(layer) + " is out of range; allowed: 0.." +
                                           std::to_string(config_.num_layers - 1)};
    }
    if (!seq_(seq).in_token) {
      return {StatusCode::kInvalidArgument, "call begin_token(" + std::to_string(seq) + ") first"};
    }
    return Status::ok();
  }
  [[nodiscard]] const SeqState& seq_(int seq) const { return seqs_[static_cast<std::size_t>(seq)]; }
  SeqState& seq_(int seq) { return seqs_[static_cast<std::size_t>(seq)]; }

  /// begin_token's checks and what the token's commits take from the pools (nothing changes).
  [[nodiscard]] Status plan_begin(int seq, PlanClaims& need, ThoughtType& type, bool count_commits = true) const {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    const SeqState& s = seq_(seq);
    if (s.faulted) return fault_status(seq);
    if (s.in_token) {
      return {StatusCode::kInvalidArgument, "begin_token(" + std::to_string(seq) + ") at position " +
                                                std::to_string(s.position) + " called twice without end_token"};
    }
    if (s.prompt > 0) {
      return {StatusCode::kInvalidArgument, "begin_token(" + std::to_string(seq) +
                                                "): the sequence has an open "
                                                "prompt of " +
                                                std::to_string(s.prompt) + " tokens (end_prompt it first)"};
    }
    if (s.position >= config_.max_tokens) {
      return {StatusCode::kOutOfRange,
              "sequence " + std::to_string(seq) + " reached max_tokens " + std::to_string(config_.max_tokens)};
    }
    const bool pinned = s.position < s.pinned;
    type = pinned ? ThoughtType::kReasoning : s.tracker.current();  // type_for's answer (apply_begin counts it)
    // The token joins the sequence's staging set (one for all its streams).
    const int first = stream_of(seq, 0, 0);
    if (Status e = cache_.table().check_stage(first, type); !e.is_ok()) {
      return {e.code(), "begin_token(" + std::to_string(seq) + ") at position " + std::to_string(s.position) + ": " +
                            e.message()};
    }
    // What this token's commits take from the shared pools: every stream of the sequence has the
    // same staged count, so the token completes a group either in all of them or in none.
    need = PlanClaims{};
    if (count_commits && cache_.table().staged_count(first) + 1 == config_.group_size) {
      for (int st = first; st < stream_of(seq + 1, 0, 0); ++st) {
        CommitPlan plan;
        if (Status e = cache_.table().plan_commit(st, type, plan); !e.is_ok()) {
          if (e.code() != StatusCode::kPoolExhausted) continue;  // append will say why
          return {e.code(), "begin_token(" + std::to_string(seq) + ") at position " + std::to_string(s.position) +
                                ": " + e.message()};
        }
        need.blocks[static_cast<int>(plan.precision)] += plan.new_blocks.size();
        if (plan.record != kNoRecord) ++need.records;
      }
    }
    return Status::ok();
  }
  /// begin_token's changes once its checks and the pools' check passed (cannot fail).
  void apply_begin(int seq, const PlanClaims& need, ThoughtType type, const TokenHint& hint) {
    SeqState& s = seq_(seq);
    const bool pinned = s.position < s.pinned;
    if (!pinned) (void)s.tracker.type_for(s.position);  // counts the token's type (plan_begin read it)
    reserved_ = reserved_ - s.reserved + need;
    s.reserved = need;
    s.type = type;
    open_position(s, s.position, s.type);
    const Status pushed = cache_.push_staged(stream_of(seq, 0, 0), s.type, s.segments.back().id);
    assert(pushed.is_ok());  // plan_begin checked the thought rule
    (void)pushed;
    clear_signal(s);
    std::fill(s.appended.begin(), s.appended.end(), 0);
    s.in_token = true;
    if (!pinned) s.tracker.observe(s.position, hint);
  }
  /// prefill's checks (nothing changes): an open prompt, the layer in range and not filled, k and
  /// v given, q and out both given or both null, and a chunk at P > 0 attended only by a backend
  /// that can.
  [[nodiscard]] Status check_prefill(int layer, int seq, TensorRef q, TensorRef k, TensorRef v,
                                     MutableTensorRef out) const {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    const SeqState& s = seq_(seq);
    if (s.prompt == 0) {
      return {StatusCode::kInvalidArgument,
              "prefill: sequence " + std::to_string(seq) + " has no open prompt (call begin_prompt first)"};
    }
    if (layer < 0 || layer >= config_.num_layers) {
      return {StatusCode::kOutOfRange, "prefill: layer " + std::to_string(layer) + " is out of range; allowed: 0.." +
                                           std::to_string(config_.num_layers - 1)};
    }
    if (s.appended[static_cast<std::size_t>(layer)] != 0) {
      return {StatusCode::kInvalidArgument, "prefill: layer " + std::to_string(layer) + " of sequence " +
                                                std::to_string(seq) + " was already filled (each layer once)"};
    }
    // q and out both null: store the prompt's K/V only (a runtime that attends its prompt itself).
    const bool attend = q.data != nullptr || out.data != nullptr;
    if (k.data == nullptr || v.data == nullptr || (attend && (q.data == nullptr || out.data == nullptr))) {
      return {StatusCode::kInvalidArgument,
              "prefill: k and v must not be null, and q and out both given or both null (store only)"};
    }
    if constexpr (!chunk_attending_backend<B>) {
      if (attend && s.prompt_start > 0) {
        return {StatusCode::kUnsupported,
                "prefill: sequence " + std::to_string(seq) + "'s prompt continues at position " +
                    std::to_string(s.prompt_start) +
                    " and this backend cannot attend a chunk over stored tokens (chunk_attending_backend); pass q "
                    "and out null and attend in the runtime, or prefill the prompt in one begin_prompt"};
      }
    }
    return Status::ok();
  }
  /// end_prompt's checks (nothing changes): an open prompt, every layer filled.
  [[nodiscard]] Status check_end_prompt(int seq) const {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    const SeqState& s = seq_(seq);
    if (s.prompt == 0) {
      return {StatusCode::kInvalidArgument, "end_prompt: sequence " + std::to_string(seq) + " has no open prompt"};
    }
    for (int l = 0; l < config_.num_layers; ++l) {
      if (s.appended[static_cast<std::size_t>(l)] == 0) {
        return {StatusCode::kInvalidArgument, "end_prompt: layer " + std::to_string(l) + " of sequence " +
                                                  std::to_string(seq) + " was never filled (prefill every layer once)"};
      }
    }
    return Status::ok();
  }
  /// Whether some stream of the sequence holds a token (live or staged) at a position in [lo, hi).
  [[nodiscard]] bool holds_any(int seq, std::int32_t lo, std::int32_t hi) const {
    const BlockTable& table = cache_.table();
    for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) {
      for (int r = 0; r < table.staged_count(st); ++r) {
        const std::int32_t pos = table.staged_position(st, r);
        if (pos >= lo && pos < hi) return true;
      }
      for (const SlotRef r : table.live_slot_list(st)) {
        const std::int32_t pos = table.slot_position(r);
        if (pos >= lo && pos < hi) return true;
      }
    }
    return false;
  }
  /// What begin_prompt found for a sequence's chunk (plan_prompt) and applies (apply_prompt).
  struct PromptPlan {
    std::int32_t start = 0;  ///< the sequence's position
    bool later = false;      ///< after a decoded token: a later turn
    ThoughtType type = ThoughtType::kReasoning;
    int open = 0;             ///< rows of the open group
    std::int64_t groups = 0;  ///< full groups the chunk's commits make (the open one included)
    PlanClaims need;          ///< what they take from the pools
  };
  [[nodiscard]] static std::string prompt_call(int seq, int tokens) {
    return "begin_prompt(" + std::to_string(seq) + ") of " + std::to_string(tokens) + " tokens";
  }
  /// begin_prompt's checks of one sequence and what its commits take (nothing changes).
  [[nodiscard]] Status plan_prompt(int seq, int tokens, PromptPlan& plan) const {
    const SeqState& s = seq_(seq);
    const std::string call = prompt_call(seq, tokens);
    if (s.faulted) return fault_status(seq);
    if (s.in_token || s.prompt > 0) {
      return {StatusCode::kInvalidArgument,
              call + ": the sequence has an open " +
                  (s.in_token ? "token (end_token / end_step it first)" : "prompt (end_prompt it first)")};
    }
    const std::int32_t start = s.position;
    plan.start = start;
    // After a decoded token: a later turn, stored with the thought type in force, not pinned.
    plan.later = start > s.pinned;
    plan.type = plan.later ? s.tracker.current() : ThoughtType::kReasoning;
    if (start >= config_.max_tokens) {
      return {StatusCode::kOutOfRange,
              call + ": sequence " + std::to_string(seq) + " reached max_tokens " + std::to_string(config_.max_tokens)};
    }
    if (tokens < 1 || tokens > config_.max_tokens - start) {
      return {StatusCode::kOutOfRange, call + ": tokens " + std::to_string(tokens) + " at position " +
                                           std::to_string(start) + " is out of range; allowed: 1.." +
                                           std::to_string(config_.max_tokens - start) + " (max_tokens " +
                                           std::to_string(config_.max_tokens) + ")"};
    }
    // The open group (the sequence's staging set, the same in every stream) must hold the
    // positions just before `start`: the chunk's first tokens complete it.
    const int first = stream_of(seq, 0, 0), g = config_.group_size;
    const BlockTable& table = cache_.table();
    plan.open = table.staged_count(first);
    for (int r = 0; r < plan.open; ++r) {
      if (table.staged_position(first, r) != start - plan.open + r || table.staged_thought(first) != plan.type) {
        return {StatusCode::kUnsupported,
                call + " at position " + std::to_string(start) + ": the open group (" + std::to_string(plan.open) +
                    " tokens of thought " + std::string(to_string(table.staged_thought(first))) +
                    ", the first at position " + std::to_string(table.staged_position(first, 0)) +
                    ") does not continue at " + std::to_string(start) + " as thought " +
                    std::string(to_string(plan.type)) + "; append these tokens with begin_token"};
      }
    }
    // Every full group (the open one completed, then the chunk's) is committed as `type`: per
    // stream, into its holes of that type and its newest block of that type first, then fresh
    // blocks (plan_commit), one key-scale record per group when the precision is quantized.
    const Precision p = map_.precision_of(plan.type);
    plan.groups = (plan.open + tokens) / g;
    plan.need = PlanClaims{};
    for (int st = first; st < stream_of(seq + 1, 0, 0); ++st) {
      const std::int64_t fresh =
          std::max<std::int64_t>(0, plan.groups * g - table.slots_before_fresh_block(st, plan.type));
      plan.need.blocks[static_cast<int>(p)] +=
          static_cast<std::size_t>((fresh + config_.block_size - 1) / config_.block_size);
      if (has_group_scale(p)) plan.need.records += static_cast<std::size_t>(plan.groups);
    }
    return Status::ok();
  }
  /// begin_prompt's changes once the checks and the pools' check passed.
  [[nodiscard]] Status apply_prompt(int seq, int tokens, const PromptPlan& plan) {
    SeqState& s = seq_(seq);
    const int first = stream_of(seq, 0, 0);
    reserved_ = reserved_ - s.reserved + plan.need;
    s.reserved = plan.need;
    if (!plan.later) s.pinned = std::max(s.pinned, plan.start + tokens);
    s.type = plan.type;
    s.prompt = tokens;
    s.prompt_start = plan.start;
    s.prompt_open = plan.open;
    s.prompt_rows.clear();  // the segment of every row from the open group's first
    for (int r = 0; r < plan.open; ++r) s.prompt_rows.push_back(cache_.table().staged_segment(first, r));
    for (std::int32_t pos = plan.start; pos < plan.start + tokens; ++pos) {  // apply_begin's segments and counts
      if (plan.later) (void)s.tracker.type_for(pos);
      open_position(s, pos, plan.type);
      s.prompt_rows.push_back(s.segments.back().id);
      if (plan.later) s.tracker.observe(pos, TokenHint{});
    }
    // The rows past the last full group stay staged: the sequence's staging set holds them.
    const std::span<const std::uint32_t> tail =
        std::span<const std::uint32_t>(s.prompt_rows)
            .subspan(static_cast<std::size_t>(plan.groups * config_.group_size));
    THINKV_RETURN_IF_ERROR(cache_.set_staged(first, plan.type, tail, plan.start + tokens));
    clear_signal(s);
    std::fill(s.appended.begin(), s.appended.end(), 0);
    return Status::ok();
  }
  /// Position `pos` (the sequence's next) joins its segments: a new one of thought `type` at a
  /// boundary, else the last grows. Segments start every segment_len positions and at refresh
  /// steps; the pinned prefix is segmented the same way, and the first token after it starts a
  /// segment of its own.
  void open_position(SeqState& s, std::int32_t pos, ThoughtType type) const {
    if (s.segments.empty() || starts_segment(pos, config_.segment_len, s.pinned, s.tracker.is_refresh_step(pos))) {
      for (SegmentState& seg : s.segments) seg.closed = true;
      SegmentState seg;
      seg.id = s.next_segment++;
      seg.type = type;
      seg.start = pos;
      seg.pinned = pos < s.pinned;
      s.segments.push_back(seg);
    }
    ++s.segments.back().size;
  }
  [[nodiscard]] Status fault_status(int seq) const {
    const SeqState& s = seq_(seq);
    return {StatusCode::kNonFinite, "sequence " + std::to_string(seq) +
                                        " appended a K/V value that is not finite or exceeds 2^64 (found by " +
                                        "the backend, at a position below " + std::to_string(s.position) +
                                        "); that token was stored as zeros. Free the sequence with reset_sequence(" +
                                        std::to_string(seq) + ")"};
  }
  /// A batch's sequences: each in range, none named twice.
  [[nodiscard]] Status check_batch(std::span<const int> seqs, const char* call) const {
    if (seqs.empty()) return {StatusCode::kInvalidArgument, std::string(call) + ": the batch names no sequence"};
    batch_mark_.assign(static_cast<std::size_t>(config_.num_sequences), 0);
    for (int seq : seqs) {
      THINKV_RETURN_IF_ERROR(check_seq(seq));
      if (batch_mark_[static_cast<std::size_t>(seq)]++ != 0) {
        return {StatusCode::kInvalidArgument,
                std::string(call) + ": sequence " + std::to_string(seq) + " is named twice in one batch"};
      }
    }
    return Status::ok();
  }
  /// A refresh (classify) is due at the sequence's token and its classifier reads a signal: its
  /// sparsity layers compute this step (wants_sparsity for each of its layers in L*).
  [[nodiscard]] bool wants_sparsity_step(const SeqState& s) const {
    return config_.trace_all_layers || (refresh_due(s) && s.tracker.classifier().needs_signal());
  }
  /// A per-layer call of the open step: a step is open, `seqs` is its batch, `layer` in range.
  [[nodiscard]] Status check_step_call(int layer, std::span<const int> seqs, const char* call) const {
    if (!step_.open) {
      return {StatusCode::kInvalidArgument, std::string(call) + ": no step is open (begin_step first)"};
    }
    THINKV_RETURN_IF_ERROR(check_same_batch(seqs, call));
    if (layer < 0 || layer >= config_.num_layers) {
      return {StatusCode::kOutOfRange, std::string(call) + ": layer " + std::to_string(layer) +
                                           " is out of range; allowed: 0.." + std::to_string(config_.num_layers - 1)};
    }
    return Status::ok();
  }
  [[nodiscard]] Status check_same_batch(std::span<const int> seqs, const char* call) const {
    if (seqs.size() != step_.seqs.size() || !std::equal(seqs.begin(), seqs.end(), step_.seqs.begin())) {
      return {StatusCode::kInvalidArgument, std::string(call) + ": the batch is not the one begin_step was given (" +
                                                std::to_string(step_.seqs.size()) + " sequences, in the same order)"};
    }
    return Status::ok();
  }
  /// A backend failure once begin_step had changed the host's records: the step's sequences are
  /// faulted (free them with reset_sequence) and the step closed.
  Status fail_step(const Status& e) {
    for (int seq : step_.seqs) seq_(seq).faulted = true;
    step_.open = false;
    return {e.code(),
            "begin_step: the backend failed to prepare the step (its sequences are faulted; free them with "
            "reset_sequence): " +
                e.message()};
  }

  /// Plans TBE once per sequence (every stream has the same segment sizes) and applies it to
  /// every stream, choosing each stream's kept tokens by K-means on that stream's keys.
  Status run_tbe(int seq, bool new_transition) {
    TbeWork w;
    if (!plan_tbe(seq, new_transition, w)) return Status::ok();
    if constexpr (kBackendKmeans) {
      TbeWork* one = &w;
      THINKV_RETURN_IF_ERROR(select_on_backend(std::span<TbeWork* const>(&one, 1)));
    }
    if (!w.selected) THINKV_RETURN_IF_ERROR(select_host(w));
    return apply_tbe(w);
  }

  /// One sequence's TBE between its plan and its evictions.
  struct TbeWork {
    int seq = 0;
    EvictionPlan plan;
    std::vector<std::pair<std::uint32_t, std::int32_t>> targets;  // final size per segment
    // The selections' victims, stream by stream (a stream's segments adjacent): victim_runs[i]
    // = (stream, end of its victims in victim_slots), the run starting where the one before ends.
    std::vector<SlotRef> victim_slots;
    std::vector<std::pair<int, std::uint32_t>> victim_runs;
    /// Appends a selection's victim to stream st's run (opened when st is not the last run's).
    void add_victim(int st, SlotRef r) {
      if (victim_runs.empty() || victim_runs.back().first != st) victim_runs.emplace_back(st, victim_slots.size());
      victim_slots.push_back(r);
      victim_runs.back().second = static_cast<std::uint32_t>(victim_slots.size());
    }
    std::int64_t selections = 0;
    bool selected = false;
  };
  /// end_token's checks, refresh and position for every sequence of the closing step, in batch
  /// order, and the TBE plan of each that evicts (into `works`).
  Status end_step_plans(std::vector<TbeWork>& works) {
    works.reserve(step_.seqs.size());
    for (int seq : step_.seqs) {
      bool new_transition = false;
      THINKV_RETURN_IF_ERROR(end_token_core(seq, new_transition));
      TbeWork w;
      if (plan_tbe(seq, new_transition, w)) works.push_back(std::move(w));
    }
    return Status::ok();
  }
  /// K-means runs on the backend: the set's selector is K-means and the backend selects.
  static constexpr bool kBackendKmeans =
      std::same_as<typename P::selector_type, KmeansSelector> && segment_selecting_backend<B>;
  /// ... and the backend's selections can run while the host goes on.
  static constexpr bool kAsyncSelect = kBackendKmeans && async_selecting_backend<B>;

  /// A step's selections launched and not yet collected: their jobs and each job's sequence.
  struct PendingSelection {
    std::uint64_t ticket = 0;
    std::vector<SegmentSelect> jobs;
    std::vector<int> job_seq;
  };

  /// Launches the selections of works (their plan state recorded at once) and keeps them
  /// pending; a backend that declines them (kUnsupported) leaves them to the host, at once.
  Status launch_selections(std::vector<TbeWork>& works) requires async_selecting_backend<B> {
    std::vector<TbeWork*> ptrs;
    for (TbeWork& w : works) ptrs.push_back(&w);
    PendingSelection pend;
    std::vector<TbeWork*> job_of;
    selection_jobs(ptrs, pend.jobs, job_of);
    if (!pend.jobs.empty()) {
      const Status e = cache_.backend().launch_selection(cache_.table().table_view(), pend.jobs,
                                                         policy_.selector.options.max_iterations, pend.ticket);
      if (e.code() == StatusCode::kUnsupported) {
        for (TbeWork& w : works) {
          THINKV_RETURN_IF_ERROR(select_host(w));
          THINKV_RETURN_IF_ERROR(apply_tbe(w));
        }
        return Status::ok();
      }
      THINKV_RETURN_IF_ERROR(e);
    }
    for (TbeWork* w : job_of) ++w->selections;
    for (TbeWork& w : works) apply_tbe_state(w);
    if (pend.jobs.empty()) return Status::ok();
    for (TbeWork* w : job_of) {
      pend.job_seq.push_back(w->seq);
      seq_pending_[static_cast<std::size_t>(w->seq)] = 1;
    }
    pending_.push_back(std::move(pend));
    return Status::ok();
  }

 public:
  /// Evicts in the table every selection still pending (waiting for the backend when it must):
  /// afterwards memory(), report() and the table hold every eviction decided so far. The batched
  /// calls collect them themselves (a step's by the next step at the latest); call it before
  /// reading a sequence's memory or slots between steps.
  [[nodiscard]] Status settle() { return collect_selections(true); }

 private:
  /// Collects the pending selections that reached the host and evicts their victims; with
  /// `wait`, every one; otherwise also, waiting for them, those holding a sequence `need` names.
  Status collect_selections(bool wait, std::span<const int> need = {}) {
    if constexpr (kAsyncSelect) {
      std::vector<SlotRef>& victims = collect_victims_;  // reused: no allocation per step
      std::vector<std::uint32_t>& offsets = collect_offsets_;
      std::size_t kept = 0;
      for (std::size_t i = 0; i < pending_.size(); ++i) {
        PendingSelection& pend = pending_[i];
        bool must = wait;
        for (std::size_t j = 0; !must && j < pend.job_seq.size(); ++j) {
          must = std::find(need.begin(), need.end(), pend.job_seq[j]) != need.end();
        }
        bool ready = false;
        THINKV_RETURN_IF_ERROR(cache_.backend().collect_selection(pend.ticket, must, ready, victims, offsets));
        if (!ready) {
          if (kept != i) pending_[kept] = std::move(pend);
          ++kept;
          continue;
        }
        THINKV_RETURN_IF_ERROR(check_victims(pend.jobs, victims, offsets));
        // One evict per stream. A stream's jobs are adjacent and check_victims found each job's
        // range [offsets[j], offsets[j + 1]) in order, so the stream's victims are one range of
        // `victims`, evicted in place.
        for (std::size_t j = 0; j < pend.jobs.size();) {
          const int st = pend.jobs[j].stream;
          const int seq = pend.job_seq[j];
          const std::size_t first = offsets[j];
          while (j < pend.jobs.size() && pend.jobs[j].stream == st) ++j;
          const std::span<const SlotRef> run(victims.data() + first, offsets[j] - first);
          THINKV_RETURN_IF_ERROR(evict_stream(seq, st, run));
        }
      }
      pending_.resize(kept);
      std::fill(seq_pending_.begin(), seq_pending_.end(), 0);
      for (const PendingSelection& pend : pending_) {
        for (int seq : pend.job_seq) seq_pending_[static_cast<std::size_t>(seq)] = 1;
      }
    } else {
      (void)wait;
      (void)need;
    }
    return Status::ok();
  }
  /// A sequence's pending selections collected (waiting), before anything reads its slots.
  Status settle_sequence(int seq) {
    if (seq < 0 || seq >= config_.num_sequences || seq_pending_[static_cast<std::size_t>(seq)] == 0) {
      return Status::ok();
    }
    const int one[] = {seq};
    return collect_selections(false, one);
  }

  /// Plans TBE for a sequence (counting transitions and unreachable budgets); false when nothing
  /// shrinks.
  bool plan_tbe(int seq, bool new_transition, TbeWork& w) {
    SeqState& s = seq_(seq);
    if (new_transition) ++stats_.transition_events;
    std::int64_t pinned_live = 0;
    for (const SegmentState& seg : s.segments) pinned_live += seg.pinned ? seg.size : 0;
    w.seq = seq;
    w.plan = plan_eviction(s.segments, policy_.retention, new_transition, config_.token_budget,
                           live_tokens(seq) - pinned_live);
    if (w.plan.budget_unreachable) ++stats_.budget_unreachable;
    if (w.plan.empty()) return false;
    for (const SegmentStep& st : w.plan.steps) {
      auto it = std::find_if(w.targets.begin(), w.targets.end(), [&](auto& t) { return t.first == st.segment; });
      if (it == w.targets.end())
        w.targets.emplace_back(st.segment, st.to_size);
      else
        it->second = st.to_size;
    }
    return true;
  }

  /// Phase 1 on the host: every stream's victims through the set's selector (reads and
  /// selections, which may fail; nothing changes here).
  Status select_host(TbeWork& w) {
    const int seq = w.seq;
    const int d = config_.head_dim;
    const bool reads_keys = policy_.selector.reads_keys();
    std::vector<float> keys, vbuf(static_cast<std::size_t>(d));
    std::vector<std::int32_t> positions;
    std::vector<SlotRef> slots;
    for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) {
      for (const auto& [segment, size] : w.targets) {
        cache_.table().live_segment_slots(st, segment, slots);
        positions.clear();
        for (SlotRef r : slots) positions.push_back(cache_.table().slot_position(r));
        if (static_cast<std::int32_t>(slots.size()) <= size) continue;
        keys.resize(reads_keys ? slots.size() * static_cast<std::size_t>(d) : 0);
        if (reads_keys) {
          for (std::size_t j = 0; j < slots.size(); ++j) {
            THINKV_RETURN_IF_ERROR(cache_.read_token(slots[j], std::span<float>(keys.data() + j * d, d), vbuf));
          }
        }
        SegmentTokens tokens{keys, positions, d, st, segment, model_lane(st - stream_of(seq, 0, 0))};
        const std::vector<int> kept = policy_.selector.select(tokens, size);
        ++w.selections;
        THINKV_RETURN_IF_ERROR(check_selection(kept, tokens.count(), size, st, segment));
        std::size_t ki = 0;
        for (std::size_t j = 0; j < slots.size(); ++j) {
          if (ki < kept.size() && kept[ki] == static_cast<int>(j)) {
            ++ki;
          } else {
            w.add_victim(st, slots[j]);
          }
        }
      }
    }
    w.selected = true;
    return Status::ok();
  }

  /// Phase 2: evicts the chosen victims (cannot fail on a consistent table) and records the new
  /// levels and sizes.
  Status apply_tbe(TbeWork& w) {
    // One evict call per stream (its segments' victims are adjacent: selections are made stream
    // by stream).
    std::uint32_t begin = 0;
    for (const auto& [st, end] : w.victim_runs) {
      THINKV_RETURN_IF_ERROR(
          evict_stream(w.seq, st, std::span<const SlotRef>(w.victim_slots.data() + begin, end - begin)));
      begin = end;
    }
    apply_tbe_state(w);
    return Status::ok();
  }
  /// A selection's victims of one stream of a sequence, evicted in the table and counted.
  Status evict_stream(int seq, int stream, std::span<const SlotRef> victims) {
    THINKV_RETURN_IF_ERROR(cache_.evict(stream, victims));
    stats_.tokens_evicted += static_cast<std::int64_t>(victims.size());
    seq_(seq).tokens_evicted += static_cast<std::int64_t>(victims.size());
    return Status::ok();
  }
  /// The plan's part of phase 2 (levels, sizes, counters): what the victims' eviction does not
  /// decide, recorded as soon as the selections are launched.
  void apply_tbe_state(const TbeWork& w) {
    SeqState& s = seq_(w.seq);
    stats_.selections += w.selections;
    ++stats_.eviction_calls;
    ++s.eviction_calls;
    stats_.segment_steps += static_cast<std::int64_t>(w.plan.steps.size());
    stats_.case1_steps += w.plan.case1_steps;
    for (const SegmentStep& stp : w.plan.steps) {
      for (SegmentState& seg : s.segments) {
        if (seg.id == stp.segment) {
          seg.level = stp.to_level;
          seg.size = stp.to_size;
        }
      }
    }
  }

  /// Phase 1 through the backend's select_segments for several sequences at once (end_step: one
  /// call for every evicting sequence of the batch): the backend finds each segment's tokens,
  /// runs K-means over their keys where it keeps them, and returns the victims. Works the backend
  /// declines stay unselected (the host selects them).
  Status select_on_backend(std::span<TbeWork* const> works) requires segment_selecting_backend<B> {
    std::vector<SegmentSelect> jobs;
    std::vector<TbeWork*> job_of;
    selection_jobs(works, jobs, job_of);
    std::vector<SlotRef> victims;
    std::vector<std::uint32_t> offsets;
    if (!jobs.empty()) {
      if (Status e = cache_.backend().select_segments(cache_.table().table_view(), jobs,
                                                      policy_.selector.options.max_iterations, victims, offsets);
          !e.is_ok()) {
        if (e.code() == StatusCode::kUnsupported) return Status::ok();  // the host selects
        return e;
      }
    }
    for (TbeWork* w : works) {
      w->victim_slots.clear();
      w->victim_runs.clear();
      w->selections = 0;
    }
    THINKV_RETURN_IF_ERROR(check_victims(jobs, victims, offsets));
    for (std::size_t ji = 0; ji < jobs.size(); ++ji) {
      TbeWork& w = *job_of[ji];
      for (std::uint32_t j = offsets[ji]; j < offsets[ji + 1]; ++j) w.add_victim(jobs[ji].stream, victims[j]);
      ++w.selections;
    }
    for (TbeWork* w : works) w->selected = true;
    return Status::ok();
  }
  /// A backend's answer to a selection: one range of victims per job, count - keep each.
  Status check_victims(std::span<const SegmentSelect> jobs, std::span<const SlotRef> victims,
                       std::span<const std::uint32_t> offsets) const {
    if (jobs.empty()) return Status::ok();
    if (offsets.size() != jobs.size() + 1) {
      return {StatusCode::kInternal, "select_segments answered " + std::to_string(offsets.size()) + " offsets for " +
                                         std::to_string(jobs.size()) + " jobs"};
    }
    for (std::size_t ji = 0; ji < jobs.size(); ++ji) {
      const std::uint32_t first = offsets[ji], last = offsets[ji + 1];
      if (last < first || last > victims.size() ||
          static_cast<std::int32_t>(last - first) != jobs[ji].count - jobs[ji].keep) {
        return {StatusCode::kInternal, "select_segments: segment " + std::to_string(jobs[ji].segment) + " of stream " +
                                           std::to_string(jobs[ji].stream) + " lost " + std::to_string(last - first) +
                                           " of " + std::to_string(jobs[ji].count) + " tokens, keeping " +
                                           std::to_string(jobs[ji].keep)};
      }
    }
    return Status::ok();
  }
  /// The selection jobs of works (stream by stream, then segment), each with its work.
  void selection_jobs(std::span<TbeWork* const> works, std::vector<SegmentSelect>& jobs,
                      std::vector<TbeWork*>& job_of) const {
    jobs.clear();
    job_of.clear();
    std::vector<std::int32_t> counts;
    for (TbeWork* w : works) {
      // Every stream of the sequence holds each segment's current size in live tokens (but the
      // segments a remove() left ragged).
      const SeqState& s = seq_(w->seq);
      counts.assign(w->targets.size(), 0);
      for (std::size_t t = 0; t < w->targets.size(); ++t) {
        for (const SegmentState& seg : s.segments) {
          if (seg.id == w->targets[t].first) counts[t] = seg.size;
        }
      }
      for (int st = stream_of(w->seq, 0, 0); st < stream_of(w->seq + 1, 0, 0); ++st) {
        for (std::size_t t = 0; t < w->targets.size(); ++t) {
          const auto [segment, size] = w->targets[t];
          std::int32_t count = counts[t];
          if (std::find(s.ragged.begin(), s.ragged.end(), segment) != s.ragged.end()) {  // after a remove()
            cache_.table().live_segment_slots(st, segment, ragged_slots_);
            count = static_cast<std::int32_t>(ragged_slots_.size());
          }
          if (count <= size) continue;
          SegmentSelect j;
          j.stream = st;
          j.segment = segment;
          j.keep = size;
          j.count = count;
          // KmeansSelector::select's seed: by the stream's lane in its sequence
          j.seed = selection_seed(policy_.selector.options.seed, model_lane(st - stream_of(w->seq, 0, 0)), segment);
          jobs.push_back(j);
          job_of.push_back(w);
        }
      }
    }
  }

  /// The model's lane (layer x model KV heads + KV head) of a stream's lane in its sequence
  /// (layer x num_kv_heads + KV head): selections are seeded by it (ThinKvConfig::kv_head_offset).
  [[nodiscard]] int model_lane(int lane) const noexcept {
    const int hk = config_.num_kv_heads, model = config_.model_kv_heads == 0 ? hk : config_.model_kv_heads;
    return lane / hk * model + config_.kv_head_offset + lane % hk;
  }
  /// A selector's answer must be `keep` distinct indices into the segment, ascending.
  Status check_selection(const std::vector<int>& kept, int count, int keep, int stream, std::uint32_t segment) const {
    return thinkv::check_selection(kept, count, keep, policy_.selector.to_string(),
                                   "segment " + std::to_string(segment) + " in stream " + std::to_string(stream));
  }

  ThinKvConfig config_;
  P policy_;
  PrecisionMap map_;
  int total_q_heads_ = 0;              // set_signal_reduction: query heads of all ranks
  SignalAllReduce signal_all_reduce_;  // set_signal_reduction's all-reduce (empty: one rank)
  PagedKvCache<B> cache_;
  std::vector<SeqState> seqs_;
  ThinKvStats stats_;
  PlanClaims reserved_;  ///< sum over sequences of their open tokens' reservations
  std::vector<std::int32_t> streams_;
  std::vector<float> sparsity_;
  std::vector<CommitPlan> plans_;  // one layer's commit plans, per KV head (scratch)
  // Batched calls' scratch.
  mutable std::vector<std::uint8_t> batch_mark_;
  std::vector<ThoughtType> types_;
  std::vector<std::uint8_t> completes_;
  Step step_;
  bool capturable_ = false;
  std::vector<SlotRef> evict_scratch_;
  std::vector<SlotRef> collect_victims_;  // collect_selections' answers from the backend
  std::vector<std::uint32_t> collect_offsets_;
  mutable std::vector<SlotRef> ragged_slots_;  // selection_jobs: a ragged segment's slots in one stream
  std::vector<PendingSelection> pending_;      // launched selections, not yet collected
  std::vector<std::uint8_t> seq_pending_;      // [num_sequences] 1: a pending selection holds the sequence
  std::vector<StageRow> rows_;
  std::vector<CommitPlan> batch_plans_;
  std::vector<PromptPlan> prompt_plans_;  // begin_prompts
  std::vector<std::uint32_t> meta_segments_;
  std::vector<std::int32_t> meta_positions_;
  std::vector<BackendFault> faults_;
};
/// The paper's ablation, ready-made: each over the CPU backend unless told otherwise.
template <kv_backend B = CpuKvBackend>
using ThinKvCache = BasicThinKvCache<ThinKvPolicy, B>;
template <kv_backend B = CpuKvBackend>
using TbqCache = BasicThinKvCache<TbqPolicy, B>;
template <kv_backend B = CpuKvBackend>
using TbeCache = BasicThinKvCache<TbePolicy, B>;
template <kv_backend B = CpuKvBackend>
using FullKvCache = BasicThinKvCache<FullKvPolicy, B>;

static_assert(decode_cache<ThinKvCache<>> && decode_cache<FullKvCache<>>);

/// What one sequence of a ThinKvConfig's shape can hold at most, whatever it decodes: a bound
/// proved from how the cache places and evicts (docs/design.md, "How many sequences fit").
///  - Live tokens per stream: with eviction, at most pinned + max(budget, m x segments +
///    segment_len) + 1 (over budget the oldest least important closed segment steps down; only
///    when every closed one is at the minimum m is the budget out of reach; the open segment is
///    never evicted), else max_tokens.
///  - Blocks per stream and thought type: a fresh block of type t is taken only when every
///    held slot of type t is live, so at most ceil(peak live / block_size) per type.
///  - Key-scale records: each holds >= 1 live slot and stands for one committed group, so at
///    most min(live tokens, groups committed).
struct SequenceFootprint {
  std::int64_t live_tokens = 0;        ///< live tokens per stream, at most
  std::int64_t blocks = 0;             ///< blocks per stream, at most (all thought types)
  std::int64_t records = 0;            ///< key-scale records per stream, at most
  std::int64_t bytes = 0;              ///< bytes per sequence, at most (all its streams, fixed parts included)
  std::int64_t fullkv_fp16_bytes = 0;  ///< what FullKV FP16 holds for one sequence at max_tokens
};

/// The footprint bound of one sequence of `c`'s shape under policy set `policy`
/// (c.num_sequences is ignored; c.validate(policy) must pass).
template <cache_policy P>
SequenceFootprint sequence_footprint(const ThinKvConfig& c, const P& policy) {
  ThinKvConfig one = c;
  one.num_sequences = 1;
  PrecisionMap map;
  if (Status s = lower_precision(policy.precision, map); !s.is_ok()) throw ConfigError(s);
  const CacheConfig pc = one.paged_config(map);
  const CacheLayout L = CacheLayout::from(pc);
  const std::int64_t T = c.max_tokens;
  std::int64_t live = T;
  if constexpr (P::kEvicts) {
    if (c.token_budget > 0) {
      // Segments start at positions that are multiples of segment_len, at positive multiples of
      // tau and right after the pinned prefix: count the union of the first two.
      const std::int64_t last = T - 1, seg = c.segment_len, tau = policy.classifier.tau();
      std::int64_t segments = last / seg + 2;  // multiples of segment_len in [0, T), + the pinned end
      segments += last / tau - last / std::lcm(seg, tau);
      const int min_kept = policy.retention.retained(policy.retention.num_levels());
      const std::int64_t floor = std::int64_t{min_kept} * segments + c.segment_len;
      live = std::min<std::int64_t>(T, c.pinned_prefix + std::max<std::int64_t>(c.token_budget, floor) + 1);
    }
  }
  SequenceFootprint f;
  f.live_tokens = live;
  const std::int64_t per_type = (live + c.block_size - 1) / c.block_size;
  std::int64_t stream_bytes = L.stream_fixed_bytes();
  bool quantized = false;
  for (ThoughtType t : kAllThoughtTypes) {
    if (t != ThoughtType::kReasoning && !policy.classifier.emits(t)) continue;
    const Precision p = map.precision_of(t);
    f.blocks += per_type;
    stream_bytes += per_type * L.block_bytes(p);
    quantized = quantized || has_group_scale(p);
  }
  if (quantized) f.records = std::min<std::int64_t>(live, (T + c.group_size - 1) / c.group_size);
  stream_bytes += f.records * L.record_bytes();
  f.bytes = stream_bytes * one.streams_per_sequence();
  f.fullkv_fp16_bytes = L.fullkv_fp16_bytes(T) * one.streams_per_sequence();
  return f;
}

/// How many sequences of `c`'s shape under `policy` always fit in `bytes` of cache memory (what
/// ThinKvConfig::memory_limit_bytes would be set to): the largest n with n x
/// sequence_footprint(c, policy).bytes, plus one allocation chunk per pool and one record chunk
/// (pools grow in whole chunks), <= bytes. With a limit of that many bytes, n sequences never see
/// kPoolExhausted. 0 when not even one fits.
template <cache_policy P>
int max_sequences(const ThinKvConfig& c, const P& policy, std::int64_t bytes) {
  const SequenceFootprint f = sequence_footprint(c, policy);
  ThinKvConfig one = c;
  one.num_sequences = 1;
  PrecisionMap map;
  if (Status s = lower_precision(policy.precision, map); !s.is_ok()) throw ConfigError(s);
  const CacheConfig pc = one.paged_config(map);
  const CacheLayout L = CacheLayout::from(pc);
  std::int64_t slack = std::int64_t{c.chunk_blocks} * c.block_size / c.group_size * L.record_bytes();
  for (Precision p : kAllPrecisions) {
    if (pc.precision.uses(p)) slack += std::int64_t{c.chunk_blocks} * L.block_bytes(p);
  }
  if (bytes <= slack || f.bytes <= 0) return 0;
  const std::int64_t n = (bytes - slack) / f.bytes;
  return static_cast<int>(std::min<std::int64_t>(n, CacheConfig::kMaxStreams / one.streams_per_sequence()));
}

}  // namespace thinkv
