#pragma once
/// \file transformer.hpp
/// The Llama forward pass for one token, with every attention inside the KV cache (any
/// thinkv::decode_cache: ThinKvCache, a baseline, or a DecodeCache chosen at run time):
///
///   x = embedding[token]
///   cache.begin_token(seq)
///   per layer:  xb = RMSNorm(x) -> q, k, v -> RoPE(q, k)
///               cache.append(seq, layer, k_all_kv_heads, v_all_kv_heads)
///               cache.attend(seq, layer, q_all_heads, att)      (the attention, GQA, softmax)
///               x += wo att;  x += w2 (silu(w1 RMSNorm(x)) * w3 RMSNorm(x))
///   cache.end_token(seq)                                          (thought refresh, TBE)
///   logits = classifier(RMSNorm(x))
///
/// RoPE is llama2.c's: rotation of adjacent pairs (2i, 2i+1) of each head by pos * freq_i with
/// freq_i = 1 / theta^(2i / head_dim) (optionally divided by a GGUF's rope_freqs factors).
/// Nothing depends on the model's size; the matrix-vector products use `threads` threads when a
/// matrix is large enough to pay for them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "model.hpp"
#include "thinkv/decode_cache.hpp"
#include "thinkv/thinkv_cache.hpp"
#include "thinkv_spec.hpp"

namespace thinkv::decoder {

/// Optional hook between RoPE and the cache append (tests use it to feed a deliberately broken
/// cache, e.g. zero keys). k is [n_kv_heads * head_dim] post-RoPE, v likewise.
using KvHook = std::function<void(int layer, std::int32_t pos, std::span<float> k, std::span<float> v)>;

class Transformer {
 public:
  explicit Transformer(const Model& model, int threads = 1) : m_(model), threads_(std::max(1, threads)) {
    const ModelConfig& c = m_.config;
    x_.resize(static_cast<std::size_t>(c.dim));
    xb_.resize(static_cast<std::size_t>(c.dim));
    xb2_.resize(static_cast<std::size_t>(c.dim));
    q_.resize(static_cast<std::size_t>(c.q_dim()));
    att_.resize(static_cast<std::size_t>(c.q_dim()));
    k_.resize(static_cast<std::size_t>(c.kv_dim()));
    v_.resize(static_cast<std::size_t>(c.kv_dim()));
    hb_.resize(static_cast<std::size_t>(c.hidden_dim));
    hb2_.resize(static_cast<std::size_t>(c.hidden_dim));
    // Rotation frequencies per pair of a head.
    freqs_.resize(static_cast<std::size_t>(c.rope_dim / 2));
    for (int i = 0; i < c.rope_dim; i += 2) {
      float f = 1.0f / std::pow(c.rope_theta, static_cast<float>(i) / static_cast<float>(c.rope_dim));
      if (!m_.rope_freq_factors.empty()) f /= m_.rope_freq_factors[static_cast<std::size_t>(i / 2)];
      freqs_[static_cast<std::size_t>(i / 2)] = f;
    }
  }

  [[nodiscard]] const Model& model() const noexcept { return m_; }
  void set_kv_hook(KvHook hook) { hook_ = std::move(hook); }
  void set_threads(int threads) noexcept { threads_ = std::max(1, threads); }

  /// Checks that a cache was configured for this model (layers, heads, head_dim).
  template <decode_cache C>
  [[nodiscard]] Status check_cache(const C& cache) const {
    const CacheShape k = cache.shape();
    const ModelConfig& c = m_.config;
    if (k.num_layers != c.n_layers || k.num_kv_heads != c.n_kv_heads || k.num_q_heads != c.n_heads ||
        k.head_dim != c.head_dim) {
      return {StatusCode::kShapeMismatch,
              "the cache is configured for layers=" + std::to_string(k.num_layers) +
                  " kv_heads=" + std::to_string(k.num_kv_heads) + " q_heads=" + std::to_string(k.num_q_heads) +
                  " head_dim=" + std::to_string(k.head_dim) + "; the model has " + c.to_string()};
    }
    return Status::ok();
  }

  /// Runs `token` at the cache's current position of sequence `seq` and writes the next-token
  /// logits ([vocab]). The position advances by one (end_token). Any decode_cache works: ThinKV's
  /// cache, a baseline, or a DecodeCache chosen at run time.
  template <decode_cache C>
  [[nodiscard]] Status forward(C& cache, int seq, int token, std::span<float> logits) {
    const ModelConfig& c = m_.config;
    THINKV_RETURN_IF_ERROR(check_cache(cache));
    if (token < 0 || token >= c.vocab_size) {
      return {StatusCode::kOutOfRange,
              "token " + std::to_string(token) + " is outside the vocabulary 0.." + std::to_string(c.vocab_size - 1)};
    }
    if (static_cast<int>(logits.size()) != c.vocab_size) {
      return {StatusCode::kShapeMismatch, "logits need " + std::to_string(c.vocab_size) + " floats"};
    }
    const std::int32_t pos = cache.position(seq);
    m_.tok_embeddings.row(token, x_.data());
    THINKV_RETURN_IF_ERROR(cache.begin_token(seq));
    for (int l = 0; l < c.n_layers; ++l) {
      const LayerWeights& w = m_.layers[static_cast<std::size_t>(l)];
      rmsnorm(xb_.data(), x_.data(), w.attn_norm, c.dim, c.rms_eps);
      w.wq.matvec(xb_.data(), q_.data(), threads_);
      w.wk.matvec(xb_.data(), k_.data(), threads_);
      w.wv.matvec(xb_.data(), v_.data(), threads_);
      rope(q_.data(), c.n_heads, pos);
      rope(k_.data(), c.n_kv_heads, pos);
      if (hook_) hook_(l, pos, k_, v_);
      if (Status s = cache.append(seq, l, k_, v_); !s.is_ok()) return bad_numbers(s, l, pos);
      if (Status s = cache.attend(seq, l, q_, att_); !s.is_ok()) return bad_numbers(s, l, pos);
      w.wo.matvec(att_.data(), xb2_.data(), threads_);
      for (int i = 0; i < c.dim; ++i) x_[static_cast<std::size_t>(i)] += xb2_[static_cast<std::size_t>(i)];
      rmsnorm(xb_.data(), x_.data(), w.ffn_norm, c.dim, c.rms_eps);
      w.w1.matvec(xb_.data(), hb_.data(), threads_);
      w.w3.matvec(xb_.data(), hb2_.data(), threads_);
      for (int i = 0; i < c.hidden_dim; ++i) {
        float g = hb_[static_cast<std::size_t>(i)];
        g *= 1.0f / (1.0f + std::exp(-g));  // SiLU
        hb_[static_cast<std::size_t>(i)] = g * hb2_[static_cast<std::size_t>(i)];
      }
      w.w2.matvec(hb_.data(), xb_.data(), threads_);
      for (int i = 0; i < c.dim; ++i) x_[static_cast<std::size_t>(i)] += xb_[static_cast<std::size_t>(i)];
    }
    THINKV_RETURN_IF_ERROR(cache.end_token(seq));
    rmsnorm(x_.data(), x_.data(), m_.final_norm, c.dim, c.rms_eps);
    m_.output.matvec(x_.data(), logits.data(), threads_);
    for (float x : logits) {
      if (!std::isfinite(x)) {
        return {StatusCode::kNonFinite, m_.name + ": the forward pass at position " + std::to_string(pos) +
                                            " produced non-finite logits: the model file holds NaN or Inf "
                                            "weights (or values that overflow); it is corrupt"};
      }
    }
    return Status::ok();
  }

 private:
  /// llama2.c's rmsnorm: o = w * (x / sqrt(mean(x^2) + eps)).
  static void rmsnorm(float* o, const float* x, const float* w, int n, float eps) noexcept {
    float ss = 0.0f;
    for (int j = 0; j < n; ++j) ss += x[j] * x[j];
    ss /= static_cast<float>(n);
    ss += eps;
    ss = 1.0f / std::sqrt(ss);
    for (int j = 0; j < n; ++j) o[j] = w[j] * (ss * x[j]);
  }

  /// A cache refusal of the model's own keys, values or queries (NaN, Inf, beyond the format)
  /// means the model computed them: say so, naming the layer and position.
  Status bad_numbers(const Status& s, int layer, std::int32_t pos) const {
    if (s.code() != StatusCode::kNonFinite) return s;
    return {StatusCode::kNonFinite, m_.name + ": the forward pass at position " + std::to_string(pos) + ", layer " +
                                        std::to_string(layer) + " produced a non-finite key, value or query (" +
                                        s.message() +
                                        "): the model file holds NaN or Inf weights, or values "
                                        "that overflow; it is corrupt"};
  }

  void rope(float* vec, int heads, std::int32_t pos) const noexcept {
    const int hd = m_.config.head_dim;
    for (int h = 0; h < heads; ++h) {
      float* v = vec + static_cast<std::ptrdiff_t>(h) * hd;
      for (int i = 0; i < m_.config.rope_dim; i += 2) {
        const float val = static_cast<float>(pos) * freqs_[static_cast<std::size_t>(i / 2)];
        const float fcr = std::cos(val), fci = std::sin(val);
        const float v0 = v[i], v1 = v[i + 1];
        v[i] = v0 * fcr - v1 * fci;
        v[i + 1] = v0 * fci + v1 * fcr;
      }
    }
  }

  const Model& m_;
  int threads_;
  KvHook hook_;
  std::vector<float> x_, xb_, xb2_, q_, att_, k_, v_, hb_, hb2_, freqs_;
};

/// What a user chooses about the cache; everything else follows from the model.
struct CacheOptions {
  CacheMode mode = CacheMode::kFull;
  int max_tokens = 0;   ///< required: prompt + steps
  int budget = 0;       ///< 0 = default: seq_len / 4 (at least the retention minimum)
  int group_size = 0;   ///< 0 = default: 16 unless head_dim % 16 != 0, then 8
  int segment_len = 0;  ///< 0 = default: min(128, seq_len / 4, and in eviction modes the budget),
                        ///< rounded down to a multiple of the group;
                        ///< under 64 the retention schedule keeps only its levels <= segment_len
  int tau = 0;          ///< 0 = the calibration's tau, or the segment default when uncalibrated
  PrecisionMap precision{};
  ThoughtClassifier classifier{};  ///< uncalibrated by default
  bool trace_all_layers = false;
  std::uint64_t kmeans_seed = 0;  ///< 0 = the library default
  int pinned_prefix = 0;          ///< positions never evicted (the prompt); ThinKvConfig::pinned_prefix
  bool no_budget = false;         ///< token_budget 0 (ThinKvConfig's "no budget"), whatever `budget` says
};

/// The defaults that scale with the model (documented in examples/thinkv/README.md).
inline int default_group_size(const ModelConfig& c) { return c.head_dim % 16 == 0 ? 16 : 8; }
inline int default_segment_len(const ModelConfig& c, int group) {
  const int quarter = c.seq_len / 4 / group * group;
  return std::max(group, std::min(128, quarter));
}
inline int default_budget(const ModelConfig& c, const RetentionSchedule& r = {}) {
  return std::max(c.seq_len / 4, r.min_retention());
}

/// Builds the ThinKV cache spec for a model; the Status names any value that does not fit.
inline Status make_cache_config(const ModelConfig& c, const CacheOptions& o, ThinKvSpec& out) {
  ThinKvSpec k;
  k.mode = o.mode;
  k.num_sequences = 1;
  k.num_layers = c.n_layers;
  k.num_kv_heads = c.n_kv_heads;
  k.num_q_heads = c.n_heads;
  k.head_dim = c.head_dim;
  if (o.max_tokens < 1) return {StatusCode::kInvalidArgument, "max_tokens must be >= 1"};
  k.max_tokens = o.max_tokens;
  k.group_size = o.group_size > 0 ? o.group_size : default_group_size(c);
  k.block_size = 16;
  k.precision = o.precision;
  k.segment_len = o.segment_len > 0 ? o.segment_len : default_segment_len(c, k.group_size);
  // The default budget is never below the default segment (a short context's quarter can be),
  // so defaults a user never gave cannot make an impossible configuration.
  k.token_budget = o.no_budget ? 0 : o.budget > 0 ? o.budget : std::max(default_budget(c, k.retention), k.segment_len);
  // The open segment is never evicted, so a budget below the segment could never be met: by
  // default the segment shrinks to fit the budget (an explicit --segment is kept and checked).
  if (o.segment_len <= 0 && evicts(k.mode) && k.token_budget > 0 && k.token_budget < k.segment_len) {
    k.segment_len = std::max(k.group_size, k.token_budget / k.group_size * k.group_size);
  }
  // Short contexts (segments under 64 tokens): keep the retention levels that fit a segment.
  if (k.segment_len < k.retention.levels().front()) {
    std::vector<int> levels;
    for (int v : k.retention.levels()) {
      if (v <= k.segment_len) levels.push_back(v);
    }
    if (levels.empty()) levels.push_back(k.segment_len);
    k.retention = RetentionSchedule(std::move(levels));
  }
  k.trace_all_layers = o.trace_all_layers;
  k.pinned_prefix = std::min(o.pinned_prefix, k.max_tokens);
  if (o.kmeans_seed != 0) k.kmeans.seed = o.kmeans_seed;
  // The classifier's refresh period: explicit tau, else the calibration's, else the segment length.
  const ThoughtClassifier& cl = o.classifier;
  int tau = o.tau > 0 ? o.tau : (cl.needs_signal() ? cl.tau() : k.segment_len);
  try {
    k.classifier = ThoughtClassifier(cl.thresholds(), cl.layers(), tau, cl.band_types(),
                                     cl.needs_signal() ? cl.num_layers() : c.n_layers);
  } catch (const ConfigError& e) { return e.status(); }
  THINKV_RETURN_IF_ERROR(k.validate());
  out = k;
  return Status::ok();
}

}  // namespace thinkv::decoder
