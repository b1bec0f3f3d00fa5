#pragma once
/// \file decode_cache.hpp
/// The decode protocol every KV-cache method of the library follows (ThinKV and the baselines it
/// is compared with), so one decoder drives them all the same way:
///
///     cache.begin_token(seq);                           // once per decoded position
///     for each layer l = 0..L-1:
///       cache.append(seq, l, k, v);                     // once: post-RoPE K/V of every KV head
///       cache.attend(seq, l, q, out);                   // after the layer's append
///     cache.end_token(seq);                             // eviction, refresh, bookkeeping
///
///  - `decode_cache<C>`: the C++20 concept (static dispatch; ThinKvCache and the baselines model it);
///  - `DecodeCache`: the same protocol behind one virtual interface, for decoders and evaluations
///    that choose the method at run time, with `DecodeCacheModel<C>` wrapping any concept model;
///  - `TokenProtocol`: the per-sequence state machine that enforces the order above and names the
///    layer and step of a violation (appending a layer twice, attending before the append, ending
///    a token with a layer missing).
///  - `CacheReport`: what every method reports, measured the same way: bytes held and allocated
///    (every byte: codes, scales, metadata, staging) against FullKV in FP16, evictions, bytes
///    moved by compaction.

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thinkv/status.hpp"

namespace thinkv {

/// The attention shape a cache serves: `num_sequences` sequences of a model with `num_layers`
/// layers, `num_kv_heads` KV heads (one stream each per layer and sequence) shared by
/// `num_q_heads` query heads (GQA), `head_dim` channels per head.
struct CacheShape {
  int num_sequences = 1;
  int num_layers = 1;
  int num_kv_heads = 1;
  int num_q_heads = 1;
  int head_dim = 128;

  [[nodiscard]] int streams_per_sequence() const noexcept { return num_layers * num_kv_heads; }
  /// K/V floats of one layer's append ([num_kv_heads, head_dim]).
  [[nodiscard]] std::size_t kv_size() const noexcept {
    return static_cast<std::size_t>(num_kv_heads) * static_cast<std::size_t>(head_dim);
  }
  /// The shape check of every cache's append: k and v of one layer hold kv_size() floats each.
  [[nodiscard]] Status check_append(int layer, std::span<const float> k, std::span<const float> v) const {
    if (k.size() == kv_size() && v.size() == kv_size()) return Status::ok();
    return {StatusCode::kShapeMismatch, "append layer " + std::to_string(layer) + ": k has " +
                                            std::to_string(k.size()) + " and v has " + std::to_string(v.size()) +
                                            " values; expected num_kv_heads * head_dim = " + std::to_string(kv_size())};
  }
  /// Query / output floats of one layer's attend ([num_q_heads, head_dim]).
  [[nodiscard]] std::size_t q_size() const noexcept {
    return static_cast<std::size_t>(num_q_heads) * static_cast<std::size_t>(head_dim);
  }
  /// FullKV FP16 bytes of `positions` tokens of one sequence (K and V, every layer and KV head).
  [[nodiscard]] std::int64_t fullkv_fp16_bytes(std::int64_t positions) const noexcept {
    return positions * streams_per_sequence() * 2 * std::int64_t{head_dim} * 2;
  }
  /// Checks every field; the message names the bad value.
  [[nodiscard]] Status validate() const {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    if (num_sequences < 1 || num_sequences > (1 << 20))
      return bad("num_sequences " + std::to_string(num_sequences) + " is out of range; allowed: 1..1048576");
    if (num_layers < 1 || num_layers > 4096)
      return bad("num_layers " + std::to_string(num_layers) + " is out of range; allowed: 1..4096");
    if (num_kv_heads < 1 || num_kv_heads > 4096)
      return bad("num_kv_heads " + std::to_string(num_kv_heads) + " is out of range; allowed: 1..4096");
    if (num_q_heads < 1 || num_q_heads > 65536 || num_q_heads % num_kv_heads != 0) {
      return bad("num_q_heads " + std::to_string(num_q_heads) + " must be a positive multiple of num_kv_heads " +
                 std::to_string(num_kv_heads));
    }
    if (head_dim < 1 || head_dim > 1024)
      return bad("head_dim " + std::to_string(head_dim) + " is out of range; allowed: 1..1024");
    if (std::int64_t{num_sequences} * num_layers * num_kv_heads > (std::int64_t{1} << 30)) {
      return bad("num_sequences x num_layers x num_kv_heads = " +
                 std::to_string(std::int64_t{num_sequences} * num_layers * num_kv_heads) +
                 " streams; allowed: at most 2^30");
    }
    return Status::ok();
  }
  friend bool operator==(const CacheShape&, const CacheShape&) = default;
};

/// What a cache reports for one sequence, every method measured the same way.
struct CacheReport {
  std::int64_t positions = 0;    ///< tokens decoded in the sequence so far
  std::int64_t live_tokens = 0;  ///< tokens attended to, summed over the sequence's streams
  /// Bytes held for the sequence now: every byte its streams use (K/V codes, scales, positions,
  /// scores, block metadata, staging, residual buffers).
  std::int64_t held_bytes = 0;
  /// Bytes the cache has allocated for the sequence (its share of what the cache allocated,
  /// reserved or grown). A cache that allocates exactly what it holds reports held_bytes.
  std::int64_t allocated_bytes = 0;
  std::int64_t fullkv_fp16_bytes = 0;  ///< FullKV FP16 of `positions` tokens (the baseline)
  std::int64_t eviction_calls = 0;     ///< steps at which the method evicted or compressed
  std::int64_t tokens_evicted = 0;     ///< tokens dropped, summed over streams
  /// Bytes moved to gather or compact the cache, counted where they are written. ThinKvCache: the
  /// bytes its backend wrote beyond what new tokens account for, cache-wide (0: CT reuses slots
  /// in place); the dense baselines: bytes copied to close the holes eviction leaves.
  std::int64_t gather_bytes = 0;

  [[nodiscard]] double held_ratio() const noexcept {
    return fullkv_fp16_bytes > 0 ? static_cast<double>(held_bytes) / static_cast<double>(fullkv_fp16_bytes) : 0.0;
  }
  [[nodiscard]] double allocated_ratio() const noexcept {
    return fullkv_fp16_bytes > 0 ? static_cast<double>(allocated_bytes) / static_cast<double>(fullkv_fp16_bytes) : 0.0;
  }
};

/// The per-sequence order of the decode protocol. Checks are const and name what is wrong; the
/// mark_* calls record a step that succeeded (a refused call changes nothing).
class TokenProtocol {
 public:
  TokenProtocol() = default;
  TokenProtocol(int num_sequences, int num_layers)
      : layers_(num_layers), state_(static_cast<std::size_t>(num_sequences)) {
    for (Seq& s : state_) s.appended.assign(static_cast<std::size_t>(num_layers), 0);
  }

  [[nodiscard]] Status check_seq(int seq) const {
    if (seq < 0 || seq >= static_cast<int>(state_.size())) {
      return {StatusCode::kOutOfRange, "sequence " + std::to_string(seq) + " is out of range; allowed: 0.." +
                                           std::to_string(static_cast<int>(state_.size()) - 1)};
    }
    return Status::ok();
  }
  [[nodiscard]] Status check_begin(int seq) const {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    if (at(seq).in_token) {
      return {StatusCode::kInvalidArgument, "begin_token(" + std::to_string(seq) + ") at position " +
                                                std::to_string(at(seq).position) + " called twice without end_token"};
    }
    return Status::ok();
  }
  [[nodiscard]] Status check_layer(int seq, int layer, const char* call) const {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    if (layer < 0 || layer >= layers_) {
      return {StatusCode::kOutOfRange, std::string(call) + ": layer " + std::to_string(layer) +
                                           " is out of range; allowed: 0.." + std::to_string(layers_ - 1)};
    }
    if (!at(seq).in_token) {
      return {StatusCode::kInvalidArgument, std::string(call) + " layer " + std::to_string(layer) + " of sequence " +
                                                std::to_string(seq) + ": call begin_token(" + std::to_string(seq) +
                                                ") first"};
    }
    return Status::ok();
  }
  [[nodiscard]] Status check_append(int seq, int layer) const {
    THINKV_RETURN_IF_ERROR(check_layer(seq, layer, "append"));
    if (at(seq).appended[static_cast<std::size_t>(layer)]) {
      return {StatusCode::kInvalidArgument, "append: layer " + std::to_string(layer) + " of sequence " +
                                                std::to_string(seq) + " was already appended at position " +
                                                std::to_string(at(seq).position) + " (each layer once per token)"};
    }
    return Status::ok();
  }
  [[nodiscard]] Status check_attend(int seq, int layer) const {
    THINKV_RETURN_IF_ERROR(check_layer(seq, layer, "attend"));
    if (!at(seq).appended[static_cast<std::size_t>(layer)]) {
      return {StatusCode::kInvalidArgument,
              "attend: layer " + std::to_string(layer) + " of sequence " + std::to_string(seq) + " at position " +
                  std::to_string(at(seq).position) + " before its append (append the token's K/V first)"};
    }
    return Status::ok();
  }
  [[nodiscard]] Status check_end(int seq) const {
    THINKV_RETURN_IF_ERROR(check_seq(seq));
    const Seq& s = at(seq);
    if (!s.in_token) {
      return {StatusCode::kInvalidArgument, "end_token(" + std::to_string(seq) + ") without begin_token"};
    }
    for (int l = 0; l < layers_; ++l) {
      if (!s.appended[static_cast<std::size_t>(l)]) {
        return {StatusCode::kInvalidArgument, "end_token(" + std::to_string(seq) + ") at position " +
                                                  std::to_string(s.position) + ": layer " + std::to_string(l) +
                                                  " was never appended (append every layer once per token)"};
      }
    }
    return Status::ok();
  }

  void mark_begin(int seq) { at(seq).in_token = true; }
  void mark_append(int seq, int layer) { at(seq).appended[static_cast<std::size_t>(layer)] = 1; }
  void mark_end(int seq) {
    Seq& s = at(seq);
    s.in_token = false;
    ++s.position;
    std::fill(s.appended.begin(), s.appended.end(), 0);
  }
  /// Forgets the current token (its appends) without advancing the position.
  void abandon(int seq) {
    Seq& s = at(seq);
    s.in_token = false;
    std::fill(s.appended.begin(), s.appended.end(), 0);
  }
  void reset(int seq) {
    Seq& s = at(seq);
    s.in_token = false;
    s.position = 0;
    std::fill(s.appended.begin(), s.appended.end(), 0);
  }

  [[nodiscard]] bool in_token(int seq) const { return at(seq).in_token; }
  [[nodiscard]] bool appended(int seq, int layer) const {
    return at(seq).appended[static_cast<std::size_t>(layer)] != 0;
  }
  /// Position of the token being decoded (or the next one).
  [[nodiscard]] std::int32_t position(int seq) const { return at(seq).position; }
  [[nodiscard]] int num_sequences() const noexcept { return static_cast<int>(state_.size()); }

 private:
  struct Seq {
    std::vector<std::uint8_t> appended;
    std::int32_t position = 0;
    bool in_token = false;
  };
  [[nodiscard]] const Seq& at(int seq) const { return state_[static_cast<std::size_t>(seq)]; }
  Seq& at(int seq) { return state_[static_cast<std::size_t>(seq)]; }

  int layers_ = 0;
  std::vector<Seq> state_;
};

/// A KV-cache method that follows the decode protocol (static dispatch).
template <class C>
concept decode_cache = requires(C& c, const C& cc, int seq, int layer, std::span<const float> in,
                                std::span<float> out) {
  { cc.method_name() } -> std::convertible_to<std::string>;
  { cc.shape() } -> std::convertible_to<CacheShape>;
  { c.begin_token(seq) } -> std::same_as<Status>;
  { c.append(seq, layer, in, in) } -> std::same_as<Status>;
  { c.attend(seq, layer, in, out) } -> std::same_as<Status>;
  { c.end_token(seq) } -> std::same_as<Status>;
  { c.reset_sequence(seq) } -> std::same_as<Status>;
  { cc.position(seq) } -> std::convertible_to<std::int32_t>;
  { cc.report(seq) } -> std::same_as<CacheReport>;
};

/// The decode protocol behind a virtual interface (a method chosen at run time).
class DecodeCache {
 public:
  virtual ~DecodeCache() = default;
  /// The method's name and settings, e.g. "h2o budget 128".
  [[nodiscard]] virtual std::string method_name() const = 0;
  [[nodiscard]] virtual CacheShape shape() const = 0;
  [[nodiscard]] virtual Status begin_token(int seq) = 0;
  [[nodiscard]] virtual Status append(int seq, int layer, std::span<const float> k, std::span<const float> v) = 0;
  [[nodiscard]] virtual Status attend(int seq, int layer, std::span<const float> q, std::span<float> out) = 0;
  [[nodiscard]] virtual Status end_token(int seq) = 0;
  [[nodiscard]] virtual Status reset_sequence(int seq) = 0;
  [[nodiscard]] virtual std::int32_t position(int seq) const = 0;
  [[nodiscard]] virtual CacheReport report(int seq) const = 0;
};

/// Wraps a concept model as a DecodeCache (owns it).
template <decode_cache C>
class DecodeCacheModel : public DecodeCache {
 public:
  template <class... Args>
  explicit DecodeCacheModel(Args&&... args) : c_(std::forward<Args>(args)...) {}
  std::string method_name() const override { return c_.method_name(); }
  CacheShape shape() const override { return c_.shape(); }
  Status begin_token(int seq) override { return c_.begin_token(seq); }
  Status append(int seq, int layer, std::span<const float> k, std::span<const float> v) override {
    return c_.append(seq, layer, k, v);
  }
  Status attend(int seq, int layer, std::span<const float> q, std::span<float> out) override {
    return c_.attend(seq, layer, q, out);
  }
  Status end_token(int seq) override { return c_.end_token(seq); }
  Status reset_sequence(int seq) override { return c_.reset_sequence(seq); }
  std::int32_t position(int seq) const override { return c_.position(seq); }
  CacheReport report(int seq) const override { return c_.report(seq); }
  [[nodiscard]] C& get() noexcept { return c_; }
  [[nodiscard]] const C& get() const noexcept { return c_; }

 private:
  C c_;
};

}  // namespace thinkv
