#pragma once
/// \file llama_thinkv.hpp
/// ThinKV inside a stock llama.cpp, through its public C API only (llama.h, ggml.h,
/// ggml-backend.h): llama.cpp keeps its own KV cells; this adapter watches each decode step
/// through the context's eval callback (each layer's post-RoPE K, and on refresh steps the
/// attention probabilities, flash attention off), feeds ThinKV's thought decomposition and TBE
/// at position granularity (thinkv::seq::PositionEvictor), and frees the positions TBE drops with
/// llama_memory_seq_rm(mem, seq, p, p + 1); llama.cpp refills the freed cells in place.
///
/// Use:
///   thinkv::llama_cpp::Adapter adapter(model, options);   // checks the model's geometry
///   llama_context_params cp = llama_context_default_params();
///   adapter.prepare(cp);                                  // eval callback, flash attention off
///   llama_context* ctx = llama_init_from_model(model, cp);
///   adapter.attach(ctx);
///   adapter.decode_prompt(seq, prompt_tokens);            // positions 0..n-1, pinned
///   adapter.decode_token(seq, token);                     // then one token per call
///   llama_get_logits_ith(ctx, -1) ...
/// Scope: one sequence per llama_decode call (several sequences may live in one context; each
/// call decodes one of them). The prompt is pinned (never evicted, outside the budget).

#include <llama.h>

#include <ggml-backend.h>
#include <ggml.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "thinkv/policy/retention_schedule.hpp"
#include "thinkv/seq/position_evictor.hpp"
#include "thinkv/status.hpp"
#include "thinkv/tbe/token_selector.hpp"
#include "thinkv/thought/classifier.hpp"

namespace thinkv::llama_cpp {

/// Decodes `tokens` of sequence `seq` at positions pos0, pos0 + 1, ... in one llama_decode call
/// (logits for the last one only). False when llama_decode fails.
inline bool decode_tokens(llama_context* ctx, llama_seq_id seq, std::span<const llama_token> tokens, llama_pos pos0) {
  llama_batch b = llama_batch_init(static_cast<std::int32_t>(tokens.size()), 0, 1);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    b.token[i] = tokens[i];
    b.pos[i] = pos0 + static_cast<llama_pos>(i);
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = seq;
    b.logits[i] = i + 1 == tokens.size();
  }
  b.n_tokens = static_cast<std::int32_t>(tokens.size());
  const int rc = llama_decode(ctx, b);
  llama_batch_free(b);
  return rc == 0;
}

struct AdapterOptions {
  std::int32_t token_budget = 1024;  ///< live generated positions per sequence (0 = no budget)
  int segment_len = 128;
  std::vector<int> key_layers;  ///< layers whose keys are K-means features; empty = every layer
  ThoughtClassifier classifier{};
  RetentionSchedule retention{};
  SegmentSelector selector{};
  /// Read every layer's sparsity on every decoded token (last_sparsity()), not only what the
  /// classifier needs on refresh steps: for traces and checks; costs a pass over the softmax rows.
  bool trace_sparsity = false;
};

/// What the adapter did and what it cost (cumulative).
struct AdapterStats {
  std::int64_t tokens = 0;          ///< tokens decoded through decode_token
  std::int64_t evicted = 0;         ///< positions freed with llama_memory_seq_rm
  std::int64_t peak_live = 0;       ///< most cells one sequence held
  std::int64_t decode_ns = 0;       ///< inside llama_decode (the callback included)
  std::int64_t callback_ns = 0;     ///< copying K and computing sparsity in the eval callback
  std::int64_t evictor_ns = 0;      ///< PositionEvictor::add_token (classifier, planner, K-means)
  std::int64_t seq_rm_ns = 0;       ///< llama_memory_seq_rm calls
  std::int64_t sparsity_steps = 0;  ///< steps that read the attention probabilities
  std::int64_t refreshes = 0;       ///< classifier refreshes (every sequence, past and present)
  std::int64_t transitions = 0;     ///< new transition thoughts (TBE case 1 events)
};

class Adapter {
 public:
  /// Reads the model's geometry; throws ConfigError when the options do not fit it (a key layer
  /// out of range, a classifier calibrated for another number of layers, ...).
  Adapter(const llama_model* model, AdapterOptions options) : options_(std::move(options)) {
    n_layer_ = llama_model_n_layer(model);
    n_head_ = llama_model_n_head(model);
    n_head_kv_ = llama_model_n_head_kv(model);
    head_dim_ = llama_model_n_embd(model) / std::max(1, n_head_);
    base_.num_layers = n_layer_;
    base_.num_kv_heads = n_head_kv_;
    base_.head_dim = head_dim_;
    base_.key_layers = options_.key_layers;
    base_.segment_len = options_.segment_len;
    base_.token_budget = options_.token_budget;
    // Validates everything once (the per-sequence evictors differ only in the pinned prefix).
    seq::PositionEvictor probe(base_, options_.classifier, options_.retention, options_.selector);
    feature_layer_.assign(static_cast<std::size_t>(n_layer_), -1);
    for (int i = 0; i < base_.feature_layers(); ++i) {
      const int l = base_.key_layers.empty() ? i : base_.key_layers[static_cast<std::size_t>(i)];
      feature_layer_[static_cast<std::size_t>(l)] = i;
    }
  }
  Adapter(const Adapter&) = delete;
  Adapter& operator=(const Adapter&) = delete;

  /// Installs the eval callback and turns flash attention off (the callback reads the softmax
  /// probabilities, which the fused kernel never materialises). Call before llama_init_from_model.
  void prepare(llama_context_params& p) {
    p.cb_eval = &Adapter::eval_callback;
    p.cb_eval_user_data = this;
    p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  }
  void attach(llama_context* ctx) { ctx_ = ctx; }

  /// Totals over every sequence decoded so far (the live ones' evictor counts included).
  [[nodiscard]] AdapterStats stats() const {
    AdapterStats s = stats_;
    for (const auto& [seq, e] : seqs_) {
      s.refreshes += e->stats().refreshes;
      s.transitions += e->stats().transitions;
    }
    return s;
  }
  [[nodiscard]] int num_layers() const noexcept { return n_layer_; }
  [[nodiscard]] int num_kv_heads() const noexcept { return n_head_kv_; }
  [[nodiscard]] int head_dim() const noexcept { return head_dim_; }
  /// The evictor of a sequence (nullptr before decode_prompt).
  [[nodiscard]] const seq::PositionEvictor* evictor(llama_seq_id seq) const {
    auto it = seqs_.find(seq);
    return it == seqs_.end() ? nullptr : it->second.get();
  }
  /// Each layer's sparsity at the last decode_token (NaN for layers not read on that step).
  [[nodiscard]] std::span<const float> last_sparsity() const noexcept { return sparsity_; }
  /// Cells the sequence holds in llama.cpp (its live positions).
  [[nodiscard]] std::int64_t live(llama_seq_id seq) const {
    const seq::PositionEvictor* e = evictor(seq);
    return e ? e->live_count() : 0;
  }

  /// Decodes a prompt of `tokens` at positions 0..n-1 of `seq` (a fresh sequence: its old cells
  /// and evictor are removed first). The prompt is pinned. Returns llama_decode's failure as
  /// kInternal; the sequence then has no evictor (decode_prompt again).
  [[nodiscard]] Status decode_prompt(llama_seq_id seq, std::span<const llama_token> tokens) {
    if (ctx_ == nullptr) return {StatusCode::kInvalidArgument, "decode_prompt: attach() a context first"};
    if (tokens.empty()) return {StatusCode::kInvalidArgument, "decode_prompt: the prompt is empty"};
    llama_memory_seq_rm(llama_get_memory(ctx_), seq, -1, -1);
    if (auto old = seqs_.find(seq); old != seqs_.end()) {  // its cells are gone: retire its evictor
      stats_.refreshes += old->second->stats().refreshes;
      stats_.transitions += old->second->stats().transitions;
      seqs_.erase(old);
    }
    seq::PositionEvictorConfig c = base_;
    c.pinned_prefix = static_cast<std::int32_t>(tokens.size());
    c.seed_stream = seq;
    auto e = std::make_unique<seq::PositionEvictor>(c, options_.classifier, options_.retention, options_.selector);
    want_keys_ = false;  // pinned positions are never selected: their keys are not needed
    want_sparsity_ = false;
    if (!decode_tokens(ctx_, seq, tokens, 0)) return {StatusCode::kInternal, "llama_decode failed on the prompt"};
    std::vector<std::int32_t> evict;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      THINKV_RETURN_IF_ERROR(e->add_token(static_cast<std::int32_t>(i), {}, {}, evict));
    }
    seqs_[seq] = std::move(e);
    return Status::ok();
  }

  /// Decodes one token of `seq` at its next position, then frees what TBE drops. The logits are
  /// llama_get_logits_ith(ctx, -1). On an error the token is not kept (removed from llama.cpp
  /// again when it was decoded) and nothing was freed: the sequence is as before the call.
  [[nodiscard]] Status decode_token(llama_seq_id seq, llama_token token) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) {
      return {StatusCode::kInvalidArgument,
              "decode_token: sequence " + std::to_string(seq) + " has no prompt (decode_prompt first)"};
    }
    seq::PositionEvictor& e = *it->second;
    const std::int32_t pos = e.next_position();
    want_keys_ = e.reads_features();
    want_sparsity_ = options_.trace_sparsity || e.wants_sparsity(pos);
    sparsity_evictor_ = &e;
    visible_ = e.live_count() + 1;  // the cells this token attends to: the sequence's and its own
    features_.assign(static_cast<std::size_t>(want_keys_ ? base_.feature_dim() : 0), 0.0f);
    sparsity_.assign(static_cast<std::size_t>(n_layer_), std::numeric_limits<float>::quiet_NaN());
    callback_error_.clear();
    llama_token tok = token;
    llama_pos p = pos;
    llama_batch b = llama_batch_get_one(&tok, 1);
    b.pos = &p;
    llama_seq_id sid = seq;
    llama_seq_id* sids = &sid;
    std::int32_t nsid = 1;
    b.seq_id = &sids;
    b.n_seq_id = &nsid;
    const auto t0 = clock::now();
    const int rc = llama_decode(ctx_, b);
    stats_.decode_ns += ns_since(t0);
    if (rc != 0)
      return {StatusCode::kInternal,
              "llama_decode failed at position " + std::to_string(pos) + " (" + std::to_string(rc) + ")"};
    Status s = callback_error_.empty() ? Status::ok() : Status{StatusCode::kInternal, callback_error_};
    std::vector<std::int32_t> evict;
    const auto t1 = clock::now();
    if (s.is_ok()) s = e.add_token(pos, features_, sparsity_, evict);
    stats_.evictor_ns += ns_since(t1);
    if (!s.is_ok()) {  // the token leaves llama.cpp too: both are as before the call
      llama_memory_seq_rm(llama_get_memory(ctx_), seq, pos, pos + 1);
      return s;
    }
    const auto t2 = clock::now();
    for (std::int32_t q : evict) {
      if (!llama_memory_seq_rm(llama_get_memory(ctx_), seq, q, q + 1)) {
        return {StatusCode::kInternal, "llama_memory_seq_rm refused position " + std::to_string(q)};
      }
    }
    stats_.seq_rm_ns += ns_since(t2);
    ++stats_.tokens;
    stats_.evicted += static_cast<std::int64_t>(evict.size());
    stats_.peak_live = std::max(stats_.peak_live, e.live_count());
    stats_.sparsity_steps += want_sparsity_ ? 1 : 0;
    return Status::ok();
  }

 private:
  using clock = std::chrono::steady_clock;
  static std::int64_t ns_since(clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t).count();
  }
  /// "Kcur-12" -> 12 when `name` starts with `prefix` + "-", else -1.
  static int layer_of(const char* name, const char* prefix) {
    const std::size_t n = std::strlen(prefix);
    if (std::strncmp(name, prefix, n) != 0 || name[n] != '-') return -1;
    char* end = nullptr;
    const long l = std::strtol(name + n + 1, &end, 10);
    return (end != nullptr && *end == '\0' && l >= 0) ? static_cast<int>(l) : -1;
  }

  static bool eval_callback(ggml_tensor* t, bool ask, void* user) {
    auto* self = static_cast<Adapter*>(user);
    const int kl = layer_of(t->name, "Kcur");
    const int sl = layer_of(t->name, "kq_soft_max");
    // Several nodes carry the name Kcur-<l> (the projection, its reshape, the RoPE): the RoPE's
    // output is the post-RoPE key.
    const bool key = self->want_keys_ && kl >= 0 && kl < self->n_layer_ && t->op == GGML_OP_ROPE &&
                     self->feature_layer_[static_cast<std::size_t>(kl)] >= 0;
    const bool soft = self->want_sparsity_ && sl >= 0 && sl < self->n_layer_ && t->op == GGML_OP_SOFT_MAX &&
                      (self->options_.trace_sparsity ||
                       self->sparsity_evictor_->wants_layer_sparsity(self->sparsity_evictor_->next_position(), sl));
    if (ask) return key || soft;
    if (!key && !soft) return true;
    const auto t0 = clock::now();
    if (t->type != GGML_TYPE_F32) {
      self->callback_error_ = std::string("eval callback: ") + t->name + " is not F32";
      return true;
    }
    self->host_.resize(ggml_nbytes(t) / sizeof(float));
    ggml_backend_tensor_get(t, self->host_.data(), 0, ggml_nbytes(t));
    if (key) self->copy_key(t, kl);
    if (soft) self->read_sparsity(t, sl);
    self->stats_.callback_ns += ns_since(t0);
    return true;
  }
  /// Kcur: [head_dim, n_head_kv, n_tokens = 1] -> the layer's slot of the feature row.
  void copy_key(const ggml_tensor* t, int layer) {
    if (t->ne[0] != head_dim_ || t->ne[1] != n_head_kv_ || t->ne[2] != 1) {
      callback_error_ = std::string("eval callback: ") + t->name + " has shape [" + std::to_string(t->ne[0]) + ", " +
                        std::to_string(t->ne[1]) + ", " + std::to_string(t->ne[2]) + "]; expected [" +
                        std::to_string(head_dim_) + ", " + std::to_string(n_head_kv_) + ", 1]";
      return;
    }
    const std::size_t slot = static_cast<std::size_t>(feature_layer_[static_cast<std::size_t>(layer)]);
    float* dst = features_.data() + slot * static_cast<std::size_t>(n_head_kv_ * head_dim_);
    const char* base = reinterpret_cast<const char*>(host_.data());
    for (int h = 0; h < n_head_kv_; ++h) {
      for (int i = 0; i < head_dim_; ++i) {
        dst[h * head_dim_ + i] = *reinterpret_cast<const float*>(base + h * t->nb[1] + i * t->nb[0]);
      }
    }
  }
  /// kq_soft_max: [n_kv, n_tokens = 1, n_head] probabilities; masked cells (holes, other
  /// sequences) are exactly 0. The layer's sparsity: the share of the token's visible cells whose
  /// probability is below 1% of the row max, averaged over query heads (the rule of
  /// kSparsityLogThreshold, applied to probabilities: only a cell at the threshold within
  /// rounding can count differently).
  void read_sparsity(const ggml_tensor* t, int layer) {
    const std::int64_t n_kv = t->ne[0];
    if (t->ne[1] != 1 || n_kv < visible_) {
      callback_error_ = std::string("eval callback: ") + t->name + " has " + std::to_string(t->ne[1]) + " rows of " +
                        std::to_string(n_kv) + " cells; expected 1 row of >= " + std::to_string(visible_);
      return;
    }
    const char* base = reinterpret_cast<const char*>(host_.data());
    double sum = 0.0;
    for (std::int64_t h = 0; h < t->ne[2]; ++h) {
      const float* p = reinterpret_cast<const float*>(base + h * t->nb[2]);
      float m = 0.0f;
      for (std::int64_t j = 0; j < n_kv; ++j) m = std::max(m, p[j]);
      std::int64_t below = 0;
      for (std::int64_t j = 0; j < n_kv; ++j) below += p[j] < 0.01f * m;
      below -= n_kv - visible_;  // the masked cells (probability 0) are not the token's
      sum += static_cast<double>(std::max<std::int64_t>(0, below)) / static_cast<double>(visible_);
    }
    sparsity_[static_cast<std::size_t>(layer)] = static_cast<float>(sum / static_cast<double>(t->ne[2]));
  }

  AdapterOptions options_;
  seq::PositionEvictorConfig base_;
  int n_layer_ = 0, n_head_ = 0, n_head_kv_ = 0, head_dim_ = 0;
  std::vector<int> feature_layer_;  // model layer -> its index among the feature layers, or -1
  llama_context* ctx_ = nullptr;
  std::map<llama_seq_id, std::unique_ptr<seq::PositionEvictor>> seqs_;
  // The step in flight (read by the eval callback).
  bool want_keys_ = false, want_sparsity_ = false;
  const seq::PositionEvictor* sparsity_evictor_ = nullptr;
  std::int64_t visible_ = 0;
  std::vector<float> features_, sparsity_, host_;
  std::string callback_error_;
  AdapterStats stats_;
};

}  // namespace thinkv::llama_cpp
