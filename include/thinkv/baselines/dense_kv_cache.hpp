#pragma once
/// \file dense_kv_cache.hpp
/// The FP16 baselines ThinKV is compared with, behind the same decode protocol
/// (thinkv/decode_cache.hpp), CPU reference implementations:
///
///  - kFullKv       FullKV: every token, K and V in FP16 (llama.cpp's default F16 cache), exact
///                  FP16 storage and FP32 attention. The reference the others are measured against.
///  - kStreamingLlm StreamingLLM (Xiao et al. 2024): the first `sink_tokens` positions (attention
///                  sinks) plus the most recent budget - sinks tokens.
///  - kH2o          H2O (Zhang et al. 2023): heavy hitters plus a recent window. Every token's
///                  score is the attention it has received, summed over the decode steps and the
///                  query heads of its KV head; over budget, the lowest-scored token outside the
///                  recent window (budget - floor(heavy_ratio * budget) positions) is evicted.
///  - kRkv          R-KV (Cai et al. 2025), redundancy-aware compression for reasoning models:
///                  tokens accumulate in a buffer; when `rkv_buffer` new tokens have arrived on
///                  top of the budget, every stream is compressed back to the budget. A token's
///                  score is lambda * I - (1 - lambda) * R: I its attention from the last
///                  `rkv_window` queries (mean over them and the KV head's query heads), R the
///                  softmax over tokens of its mean cosine similarity to the other keys. The
///                  `rkv_window` newest tokens are always kept; the kept tokens are then moved to
///                  the front of the stream (a gather, counted in CacheReport::gather_bytes).
///                  R-KV's max-pooling of the importance over neighbouring tokens is not applied.
///
/// With pinned_prefix > 0 the first positions (the prompt) are never evicted and the budget
/// counts the tokens after them, as ThinKV's pinned prefix does.
/// Keys are stored post-RoPE (as the decoder appends them) and never re-rotated: StreamingLLM's
/// re-positioning inside the cache is not applied, as no other method here re-rotates either.
/// Eviction frees a slot and the next token is written into it (no compaction) except in R-KV.
/// Every method decides per stream (sequence, layer, KV head) except StreamingLLM, whose choice
/// depends on positions only and is the same in every stream.
///
/// Memory (CacheReport): a slot holds K and V (2 x head_dim FP16), its position (int32) and, for
/// H2O, its score (FP32); R-KV also holds the last `rkv_window` queries of every layer (FP32).
/// held_bytes counts live slots, allocated_bytes the slots reserved: max_tokens per stream for
/// FullKV, budget + 1 for StreamingLLM and H2O, budget + rkv_buffer for R-KV.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/decode_cache.hpp"
#include "thinkv/formats/fp16.hpp"
#include "thinkv/kv_values.hpp"
#include "thinkv/reference/attention.hpp"
#include "thinkv/status.hpp"

namespace thinkv {

enum class DenseMethod : std::uint8_t { kFullKv, kStreamingLlm, kH2o, kRkv };

constexpr std::string_view to_string(DenseMethod m) noexcept {
  switch (m) {
    case DenseMethod::kFullKv: return "full";
    case DenseMethod::kStreamingLlm: return "streamingllm";
    case DenseMethod::kH2o: return "h2o";
    case DenseMethod::kRkv: return "rkv";
  }
  return "?";
}

struct DenseKvConfig {
  CacheShape shape{};
  DenseMethod method = DenseMethod::kFullKv;
  int max_tokens = 4096;       ///< positions per sequence
  int token_budget = 0;        ///< live tokens per stream after every step (all methods but FullKV)
  int sink_tokens = 4;         ///< StreamingLLM: attention sinks kept at the start
  float heavy_ratio = 0.5f;    ///< H2O: share of the budget for heavy hitters (the rest is recent)
  int rkv_buffer = 128;        ///< R-KV: new tokens between compressions
  int rkv_window = 8;          ///< R-KV: queries that score importance; the newest tokens kept
  float rkv_lambda = 0.1f;     ///< R-KV: weight of importance against redundancy
  float softmax_scale = 0.0f;  ///< 0 = 1/sqrt(head_dim)
  /// Positions never evicted and not counted against the budget (the prompt, in the decode-stage
  /// setting); 0 = none. The same meaning as ThinKvConfig::pinned_prefix.
  int pinned_prefix = 0;

  [[nodiscard]] bool evicts() const noexcept { return method != DenseMethod::kFullKv; }
  /// Slots reserved per stream.
  [[nodiscard]] int capacity() const noexcept {
    switch (method) {
      case DenseMethod::kFullKv: return max_tokens;
      case DenseMethod::kStreamingLlm:
      case DenseMethod::kH2o: return std::min(max_tokens, pinned_prefix + token_budget + 1);
      case DenseMethod::kRkv: return std::min(max_tokens, pinned_prefix + token_budget + rkv_buffer);
    }
    return max_tokens;
  }
  /// H2O: positions of the recent window (the rest of the budget holds heavy hitters).
  [[nodiscard]] int h2o_recent() const noexcept {
    return token_budget - static_cast<int>(std::floor(heavy_ratio * static_cast<float>(token_budget)));
  }

  [[nodiscard]] Status validate() const {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    THINKV_RETURN_IF_ERROR(shape.validate());
    if (static_cast<int>(method) > static_cast<int>(DenseMethod::kRkv))
      return bad("unknown dense method " + std::to_string(static_cast<int>(method)));
    if (max_tokens < 1 || max_tokens > (1 << 24))
      return bad("max_tokens " + std::to_string(max_tokens) + " is out of range; allowed: 1..16777216");
    if (!(softmax_scale >= 0.0f) || std::isinf(softmax_scale))
      return bad("softmax_scale " + std::to_string(softmax_scale) + " must be finite and >= 0 (0 = 1/sqrt(head_dim))");
    const std::string m(to_string(method));
    if (pinned_prefix < 0 || pinned_prefix > max_tokens) {
      return bad(m + ": pinned_prefix " + std::to_string(pinned_prefix) + " is out of range; allowed: 0..max_tokens (" +
                 std::to_string(max_tokens) + ")");
    }
    if (!evicts()) {
      if (token_budget != 0)
        return bad(m + ": token_budget " + std::to_string(token_budget) + " must be 0 (FullKV keeps every token)");
    } else if (token_budget < 1 || token_budget > (1 << 24)) {
      return bad(m + ": token_budget " + std::to_string(token_budget) + " is out of range; allowed: 1..16777216");
    }
    if (method == DenseMethod::kStreamingLlm && (sink_tokens < 0 || sink_tokens >= token_budget)) {
      return bad("streamingllm: sink_tokens " + std::to_string(sink_tokens) + " must be in 0..token_budget - 1 (" +
                 std::to_string(token_budget - 1) + ")");
    }
    if (method == DenseMethod::kH2o) {
      if (!(heavy_ratio >= 0.0f && heavy_ratio < 1.0f))
        return bad("h2o: heavy_ratio " + std::to_string(heavy_ratio) + " must be in [0, 1)");
    }
    if (method == DenseMethod::kRkv) {
      if (rkv_buffer < 1 || rkv_buffer > (1 << 20))
        return bad("rkv: rkv_buffer " + std::to_string(rkv_buffer) + " is out of range; allowed: 1..1048576");
      if (rkv_window < 1 || rkv_window > token_budget)
        return bad("rkv: rkv_window " + std::to_string(rkv_window) + " must be in 1..token_budget (" +
                   std::to_string(token_budget) + ")");
      if (!(rkv_lambda >= 0.0f && rkv_lambda <= 1.0f))
        return bad("rkv: rkv_lambda " + std::to_string(rkv_lambda) + " must be in [0, 1]");
    }
    const std::int64_t slots = std::int64_t{capacity()} * shape.num_sequences * shape.streams_per_sequence();
    if (slots * shape.head_dim > (std::int64_t{1} << 40)) {
      return bad("the cache would reserve " + std::to_string(slots) + " slots of " + std::to_string(shape.head_dim) +
                 " channels; lower max_tokens, the budget or num_sequences");
    }
    return Status::ok();
  }
};

/// FullKV FP16 and the FP16 eviction baselines (see the file comment).
class DenseKvCache {
 public:
  /// Throws ConfigError naming the bad value.
  explicit DenseKvCache(const DenseKvConfig& config) : config_(checked(config)) {
    const CacheShape& sh = config_.shape;
    protocol_ = TokenProtocol(sh.num_sequences, sh.num_layers);
    const std::size_t streams = static_cast<std::size_t>(sh.num_sequences) * sh.streams_per_sequence();
    const std::size_t cap = static_cast<std::size_t>(config_.capacity());
    const std::size_t d = static_cast<std::size_t>(sh.head_dim);
    streams_.resize(streams);
    for (Stream& s : streams_) {
      s.k.assign(cap * d, 0);
      s.v.assign(cap * d, 0);
      s.pos.assign(cap, -1);
      if (config_.method == DenseMethod::kH2o) s.score.assign(cap, 0.0f);
      reset_free(s);
    }
    seqs_.resize(static_cast<std::size_t>(sh.num_sequences));
    for (Seq& q : seqs_) {
      q.attended.assign(static_cast<std::size_t>(sh.num_layers), 0);
      if (config_.method == DenseMethod::kRkv) {
        q.queries.assign(static_cast<std::size_t>(sh.num_layers) * config_.rkv_window * sh.q_size(), 0.0f);
      }
    }
  }

  [[nodiscard]] const DenseKvConfig& config() const noexcept { return config_; }
  [[nodiscard]] CacheShape shape() const { return config_.shape; }
  [[nodiscard]] std::string method_name() const {
    std::string s(to_string(config_.method));
    if (config_.evicts()) s += " budget " + std::to_string(config_.token_budget);
    return s;
  }
  [[nodiscard]] std::int32_t position(int seq) const { return protocol_.position(seq); }
  [[nodiscard]] int stream_of(int seq, int layer, int kv_head) const noexcept {
    return (seq * config_.shape.num_layers + layer) * config_.shape.num_kv_heads + kv_head;
  }

  [[nodiscard]] Status begin_token(int seq) {
    THINKV_RETURN_IF_ERROR(protocol_.check_begin(seq));
    if (protocol_.position(seq) >= config_.max_tokens) {
      return {StatusCode::kOutOfRange,
              "sequence " + std::to_string(seq) + " reached max_tokens " + std::to_string(config_.max_tokens)};
    }
    protocol_.mark_begin(seq);
    Seq& q = seqs_[static_cast<std::size_t>(seq)];
    std::fill(q.attended.begin(), q.attended.end(), 0);
    return Status::ok();
  }

  /// Stores the current token's post-RoPE K and V of one layer ([num_kv_heads, head_dim] each) in
  /// FP16. All-or-nothing: a wrong shape, NaN/Inf or |x| > 65504 stores nothing.
  [[nodiscard]] Status append(int seq, int layer, std::span<const float> k, std::span<const float> v) {
    THINKV_RETURN_IF_ERROR(protocol_.check_append(seq, layer));
    const CacheShape& sh = config_.shape;
    THINKV_RETURN_IF_ERROR(sh.check_append(layer, k, v));
    THINKV_RETURN_IF_ERROR(check_kv_values(k, v,
                                           "layer " + std::to_string(layer) + " of sequence " + std::to_string(seq),
                                           kFp16Max, "the largest FP16 value, 65504"));
    for (int h = 0; h < sh.num_kv_heads; ++h) {
      if (streams_[static_cast<std::size_t>(stream_of(seq, layer, h))].free.empty()) {
        return {StatusCode::kPoolExhausted, "append layer " + std::to_string(layer) + ": stream of KV head " +
                                                std::to_string(h) + " is full (" + std::to_string(config_.capacity()) +
                                                " slots); this is a bug in the eviction policy"};
      }
    }
    const std::size_t d = static_cast<std::size_t>(sh.head_dim);
    for (int h = 0; h < sh.num_kv_heads; ++h) {
      Stream& s = streams_[static_cast<std::size_t>(stream_of(seq, layer, h))];
      const int slot = s.free.back();
      s.free.pop_back();
      const std::size_t off = static_cast<std::size_t>(slot) * d;
      for (std::size_t c = 0; c < d; ++c) {
        s.k[off + c] = encode_fp16(k[static_cast<std::size_t>(h) * d + c]);
        s.v[off + c] = encode_fp16(v[static_cast<std::size_t>(h) * d + c]);
      }
      s.pos[static_cast<std::size_t>(slot)] = protocol_.position(seq);
      if (!s.score.empty()) s.score[static_cast<std::size_t>(slot)] = 0.0f;
      ++s.live;
    }
    protocol_.mark_append(seq, layer);
    return Status::ok();
  }

  /// Decode attention of the current token in one layer over the layer's live tokens (the current
  /// token included): q and out are [num_q_heads, head_dim].
  [[nodiscard]] Status attend(int seq, int layer, std::span<const float> q, std::span<float> out) {
    THINKV_RETURN_IF_ERROR(protocol_.check_attend(seq, layer));
    const CacheShape& sh = config_.shape;
    if (q.size() != sh.q_size() || out.size() != sh.q_size()) {
      return {StatusCode::kShapeMismatch,
              "attend layer " + std::to_string(layer) +
                  ": q and out need num_q_heads * head_dim = " + std::to_string(sh.q_size()) + " floats"};
    }
    for (float x : q) {
      if (!std::isfinite(x)) {
        return {StatusCode::kNonFinite,
                "attend layer " + std::to_string(layer) + ": the query holds a non-finite value"};
      }
    }
    Seq& sq = seqs_[static_cast<std::size_t>(seq)];
    const bool first = sq.attended[static_cast<std::size_t>(layer)] == 0;
    const int d = sh.head_dim;
    const int group = sh.num_q_heads / sh.num_kv_heads;
    const float scale = softmax_scale();
    for (int h = 0; h < sh.num_kv_heads; ++h) {
      Stream& s = streams_[static_cast<std::size_t>(stream_of(seq, layer, h))];
      gather_live(s, slots_, kf_, vf_);
      const int n = static_cast<int>(slots_.size());
      const bool score = first && config_.method == DenseMethod::kH2o;
      prob_.assign(score ? slots_.size() : 0, 0.0f);
      reference::attend_tokens(q.data() + static_cast<std::ptrdiff_t>(h) * group * d, group, kf_.data(), vf_.data(), n,
                               d, scale, out.data() + static_cast<std::ptrdiff_t>(h) * group * d, nullptr,
                               score ? prob_.data() : nullptr);
      if (score) {
        for (int j = 0; j < n; ++j)
          s.score[static_cast<std::size_t>(slots_[static_cast<std::size_t>(j)])] += prob_[static_cast<std::size_t>(j)];
      }
    }
    if (config_.method == DenseMethod::kRkv) {  // the query joins the observation window
      const std::size_t w = static_cast<std::size_t>(protocol_.position(seq) % config_.rkv_window);
      float* dst = sq.queries.data() + (static_cast<std::size_t>(layer) * config_.rkv_window + w) * sh.q_size();
      std::copy(q.begin(), q.end(), dst);
    }
    sq.attended[static_cast<std::size_t>(layer)] = 1;
    return Status::ok();
  }

  /// Ends the current token: every layer must have been appended. Evicts or compresses as the
  /// method says.
  [[nodiscard]] Status end_token(int seq) {
    THINKV_RETURN_IF_ERROR(protocol_.check_end(seq));
    Seq& sq = seqs_[static_cast<std::size_t>(seq)];
    const std::int32_t pos = protocol_.position(seq);
    std::int64_t evicted = 0;
    if (config_.evicts()) {
      for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) {
        evicted += evict_stream(seq, st, pos, sq);
      }
    }
    if (evicted > 0) {
      ++sq.eviction_calls;
      sq.tokens_evicted += evicted;
    }
    protocol_.mark_end(seq);
    return Status::ok();
  }

  /// Releases every token of a sequence.
  [[nodiscard]] Status reset_sequence(int seq) {
    THINKV_RETURN_IF_ERROR(protocol_.check_seq(seq));
    for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) {
      Stream& s = streams_[static_cast<std::size_t>(st)];
      std::fill(s.pos.begin(), s.pos.end(), -1);
      reset_free(s);
    }
    Seq& q = seqs_[static_cast<std::size_t>(seq)];
    q.eviction_calls = q.tokens_evicted = q.gather_bytes = 0;
    std::fill(q.queries.begin(), q.queries.end(), 0.0f);
    protocol_.reset(seq);
    return Status::ok();
  }

  [[nodiscard]] CacheReport report(int seq) const {
    const CacheShape& sh = config_.shape;
    const Seq& q = seqs_[static_cast<std::size_t>(seq)];
    CacheReport r;
    r.positions = protocol_.position(seq);
    for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) {
      r.live_tokens += streams_[static_cast<std::size_t>(st)].live;
    }
    const std::int64_t method_state = static_cast<std::int64_t>(q.queries.size()) * 4;
    r.held_bytes = r.live_tokens * slot_bytes() + method_state;
    r.allocated_bytes = std::int64_t{config_.capacity()} * sh.streams_per_sequence() * slot_bytes() + method_state;
    r.fullkv_fp16_bytes = sh.fullkv_fp16_bytes(r.positions);
    r.eviction_calls = q.eviction_calls;
    r.tokens_evicted = q.tokens_evicted;
    r.gather_bytes = q.gather_bytes;
    return r;
  }

  /// Bytes of one slot: K and V in FP16, the position, and H2O's score.
  [[nodiscard]] std::int64_t slot_bytes() const noexcept {
    return 4 * std::int64_t{config_.shape.head_dim} + 4 + (config_.method == DenseMethod::kH2o ? 4 : 0);
  }
  /// Live tokens of one stream.
  [[nodiscard]] int live_tokens(int seq, int layer, int kv_head) const {
    return streams_[static_cast<std::size_t>(stream_of(seq, layer, kv_head))].live;
  }
  /// Positions of a stream's live tokens, ascending (tests, inspection).
  [[nodiscard]] std::vector<std::int32_t> live_positions(int seq, int layer, int kv_head) const {
    std::vector<std::int32_t> out;
    for (std::int32_t p : streams_[static_cast<std::size_t>(stream_of(seq, layer, kv_head))].pos) {
      if (p >= 0) out.push_back(p);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  /// The stored (FP16-rounded) key and value of a live position, false when it is not live.
  bool read_token(int seq, int layer, int kv_head, std::int32_t position, std::span<float> k,
                  std::span<float> v) const {
    const Stream& s = streams_[static_cast<std::size_t>(stream_of(seq, layer, kv_head))];
    const std::size_t d = static_cast<std::size_t>(config_.shape.head_dim);
    for (std::size_t j = 0; j < s.pos.size(); ++j) {
      if (s.pos[j] != position) continue;
      for (std::size_t c = 0; c < d && c < k.size() && c < v.size(); ++c) {
        k[c] = decode_fp16(s.k[j * d + c]);
        v[c] = decode_fp16(s.v[j * d + c]);
      }
      return true;
    }
    return false;
  }
  /// H2O's accumulated score of a live position (NaN when not live or not H2O).
  [[nodiscard]] float h2o_score(int seq, int layer, int kv_head, std::int32_t position) const {
    const Stream& s = streams_[static_cast<std::size_t>(stream_of(seq, layer, kv_head))];
    for (std::size_t j = 0; j < s.pos.size(); ++j) {
      if (s.pos[j] == position && !s.score.empty()) return s.score[j];
    }
    return std::numeric_limits<float>::quiet_NaN();
  }

 private:
  struct Stream {
    std::vector<std::uint16_t> k, v;  // [capacity, head_dim] FP16
    std::vector<std::int32_t> pos;    // [capacity], -1 = free
    std::vector<float> score;         // [capacity], H2O only
    std::vector<int> free;            // free slots, the next one at the back
    int live = 0;
  };
  struct Seq {
    std::vector<std::uint8_t> attended;  // [layers] this token
    std::vector<float> queries;          // R-KV: [layers, window, num_q_heads * head_dim]
    std::int64_t eviction_calls = 0, tokens_evicted = 0, gather_bytes = 0;
  };

  static const DenseKvConfig& checked(const DenseKvConfig& c) {
    if (Status s = c.validate(); !s.is_ok()) throw ConfigError(s);
    return c;
  }
  [[nodiscard]] float softmax_scale() const noexcept {
    return config_.softmax_scale > 0.0f ? config_.softmax_scale
                                        : 1.0f / std::sqrt(static_cast<float>(config_.shape.head_dim));
  }
  static void reset_free(Stream& s) {
    const int cap = static_cast<int>(s.pos.size());
    s.free.resize(static_cast<std::size_t>(cap));
    for (int i = 0; i < cap; ++i) s.free[static_cast<std::size_t>(i)] = cap - 1 - i;  // slot 0 first
    s.live = 0;
  }
  static const std::vector<float>& fp16_table() {
    static const std::vector<float> t = [] {
      std::vector<float> x(65536);
      for (std::uint32_t i = 0; i < 65536u; ++i) x[i] = decode_fp16(static_cast<std::uint16_t>(i));
      return x;
    }();
    return t;
  }
  /// Live slots of a stream in slot order, and their K and V decoded to FP32.
  void gather_live(const Stream& s, std::vector<int>& slots, std::vector<float>& k, std::vector<float>& v) const {
    const std::vector<float>& t = fp16_table();
    const std::size_t d = static_cast<std::size_t>(config_.shape.head_dim);
    slots.clear();
    for (std::size_t j = 0; j < s.pos.size(); ++j) {
      if (s.pos[j] >= 0) slots.push_back(static_cast<int>(j));
    }
    k.resize(slots.size() * d);
    v.resize(slots.size() * d);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::size_t off = static_cast<std::size_t>(slots[i]) * d;
      for (std::size_t c = 0; c < d; ++c) {
        k[i * d + c] = t[s.k[off + c]];
        v[i * d + c] = t[s.v[off + c]];
      }
    }
  }
  void free_slot(Stream& s, int slot) {
    s.pos[static_cast<std::size_t>(slot)] = -1;
    s.free.push_back(slot);
    --s.live;
  }

  /// Applies the method's eviction to one stream after the token at `pos`; returns tokens dropped.
  std::int64_t evict_stream(int seq, int st, std::int32_t pos, Seq& sq) {
    Stream& s = streams_[static_cast<std::size_t>(st)];
    // Pinned positions (pos < pinned_prefix) are all live and never candidates: the budget
    // bounds the others.
    const int pinned = std::min(config_.pinned_prefix, pos + 1);
    const int budget = config_.token_budget + pinned;
    const std::int32_t first = config_.pinned_prefix;  // the first evictable position
    std::int64_t dropped = 0;
    switch (config_.method) {
      case DenseMethod::kFullKv: break;
      case DenseMethod::kStreamingLlm:
        while (s.live > budget) {  // the oldest token after the sinks
          int victim = -1;
          for (std::size_t j = 0; j < s.pos.size(); ++j) {
            const std::int32_t p = s.pos[j];
            if (p >= std::max(config_.sink_tokens, first) &&
                (victim < 0 || p < s.pos[static_cast<std::size_t>(victim)])) {
              victim = static_cast<int>(j);
            }
          }
          if (victim < 0) break;
          free_slot(s, victim);
          ++dropped;
        }
        break;
      case DenseMethod::kH2o: {
        const std::int32_t recent_from = pos + 1 - config_.h2o_recent();
        while (s.live > budget) {  // the lowest score outside the recent window (older on ties)
          int victim = -1;
          for (std::size_t j = 0; j < s.pos.size(); ++j) {
            const std::int32_t p = s.pos[j];
            if (p < first || p >= recent_from) continue;
            if (victim < 0) {
              victim = static_cast<int>(j);
              continue;
            }
            const std::size_t vj = static_cast<std::size_t>(victim);
            if (s.score[j] < s.score[vj] || (s.score[j] == s.score[vj] && p < s.pos[vj])) victim = static_cast<int>(j);
          }
          if (victim < 0) break;
          free_slot(s, victim);
          ++dropped;
        }
        break;
      }
      case DenseMethod::kRkv:
        if (s.live >= budget + config_.rkv_buffer) dropped = rkv_compress(seq, st, pos, sq, budget);
        break;
    }
    return dropped;
  }

  /// R-KV: keeps `budget` tokens of the stream (the rkv_window newest and the best-scored rest),
  /// moved to slots 0..budget-1 in position order.
  std::int64_t rkv_compress(int seq, int st, std::int32_t pos, Seq& sq, int budget) {
    (void)seq;
    Stream& s = streams_[static_cast<std::size_t>(st)];
    const CacheShape& sh = config_.shape;
    const int d = sh.head_dim;
    const int layer = (st / sh.num_kv_heads) % sh.num_layers;
    const int kv_head = st % sh.num_kv_heads;
    const int group = sh.num_q_heads / sh.num_kv_heads;
    gather_live(s, slots_, kf_, vf_);
    const int n = static_cast<int>(slots_.size());
    // Importance: attention from the observation window's queries (mean over queries and heads).
    std::vector<float> importance(static_cast<std::size_t>(n), 0.0f), out(static_cast<std::size_t>(group) * d);
    const int window = std::min(config_.rkv_window, pos + 1);
    for (int w = 0; w < window; ++w) {
      const float* qw = sq.queries.data() +
                        (static_cast<std::size_t>(layer) * config_.rkv_window +
                         static_cast<std::size_t>((pos - w) % config_.rkv_window)) *
                            sh.q_size() +
                        static_cast<std::size_t>(kv_head) * group * d;
      reference::attend_tokens(qw, group, kf_.data(), vf_.data(), n, d, softmax_scale(), out.data(), nullptr,
                               importance.data());
    }
    for (float& x : importance) x /= static_cast<float>(window * group);
    // Redundancy: mean cosine similarity to the other keys, softmax over tokens.
    std::vector<float> unit(kf_.size());
    for (int j = 0; j < n; ++j) {
      float nn = 0.0f;
      for (int c = 0; c < d; ++c)
        nn += kf_[static_cast<std::size_t>(j * d + c)] * kf_[static_cast<std::size_t>(j * d + c)];
      const float inv = nn > 0.0f ? 1.0f / std::sqrt(nn) : 0.0f;
      for (int c = 0; c < d; ++c)
        unit[static_cast<std::size_t>(j * d + c)] = kf_[static_cast<std::size_t>(j * d + c)] * inv;
    }
    std::vector<float> redundancy(static_cast<std::size_t>(n), 0.0f);
    for (int i = 0; i < n; ++i) {
      for (int j = i + 1; j < n; ++j) {
        float dot = 0.0f;
        for (int c = 0; c < d; ++c)
          dot += unit[static_cast<std::size_t>(i * d + c)] * unit[static_cast<std::size_t>(j * d + c)];
        redundancy[static_cast<std::size_t>(i)] += dot;
        redundancy[static_cast<std::size_t>(j)] += dot;
      }
    }
    float rmax = -INFINITY;
    for (float& r : redundancy) {
      r /= static_cast<float>(std::max(1, n - 1));
      rmax = std::max(rmax, r);
    }
    float rsum = 0.0f;
    for (float& r : redundancy) {
      r = std::exp(r - rmax);
      rsum += r;
    }
    // Keep the window's newest tokens, then the highest scores (older first on ties).
    std::vector<int> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    auto p_of = [&](int j) { return s.pos[static_cast<std::size_t>(slots_[static_cast<std::size_t>(j)])]; };
    std::vector<float> z(static_cast<std::size_t>(n));
    const float lambda = config_.rkv_lambda;
    for (int j = 0; j < n; ++j) {
      z[static_cast<std::size_t>(j)] = lambda * importance[static_cast<std::size_t>(j)] -
                                       (1.0f - lambda) * (redundancy[static_cast<std::size_t>(j)] / rsum);
    }
    const std::int32_t newest_from = pos + 1 - config_.rkv_window;
    const std::int32_t first = config_.pinned_prefix;  // pinned positions are always kept too
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      const bool na = p_of(a) >= newest_from || p_of(a) < first, nb = p_of(b) >= newest_from || p_of(b) < first;
      if (na != nb) return na;
      if (z[static_cast<std::size_t>(a)] != z[static_cast<std::size_t>(b)])
        return z[static_cast<std::size_t>(a)] > z[static_cast<std::size_t>(b)];
      return p_of(a) < p_of(b);
    });
    const int keep = std::min(n, budget);
    std::vector<int> kept(order.begin(), order.begin() + keep);
    std::sort(kept.begin(), kept.end(), [&](int a, int b) { return p_of(a) < p_of(b); });
    // Compact: kept tokens move to slots 0..keep-1 in position order.
    Stream next;
    const std::size_t cap = s.pos.size(), dd = static_cast<std::size_t>(d);
    next.k.assign(cap * dd, 0);
    next.v.assign(cap * dd, 0);
    next.pos.assign(cap, -1);
    for (int i = 0; i < keep; ++i) {
      const int from = slots_[static_cast<std::size_t>(kept[static_cast<std::size_t>(i)])];
      std::copy_n(s.k.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(from) * dd), dd,
                  next.k.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i) * dd));
      std::copy_n(s.v.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(from) * dd), dd,
                  next.v.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i) * dd));
      next.pos[static_cast<std::size_t>(i)] = s.pos[static_cast<std::size_t>(from)];
      if (from != i) sq.gather_bytes += slot_bytes();
    }
    next.free.clear();
    for (int i = static_cast<int>(cap) - 1; i >= keep; --i) next.free.push_back(i);
    next.live = keep;
    const std::int64_t dropped = s.live - keep;
    s = std::move(next);
    return dropped;
  }

  DenseKvConfig config_;
  TokenProtocol protocol_;
  std::vector<Stream> streams_;
  std::vector<Seq> seqs_;
  // Scratch (attend is not reentrant, as no cache call is).
  std::vector<int> slots_;
  std::vector<float> kf_, vf_, prob_;
};
static_assert(decode_cache<DenseKvCache>);

}  // namespace thinkv
