#pragma once
/// \file methods.hpp
/// The KV-cache methods the decoder runs, by name (the CLI's --mode and `thinkv eval --methods`),
/// and how each is configured for a model: ThinKV's modes on ThinKvCache, and the baselines of
/// include/thinkv/baselines/ behind the same decode protocol.

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "model.hpp"
#include "thinkv/baselines/dense_kv_cache.hpp"
#include "thinkv/baselines/kivi_cache.hpp"
#include "thinkv/thinkv_cache.hpp"
#include "transformer.hpp"

namespace thinkv::decoder {

enum class Method : std::uint8_t {
  kFull,          ///< FullKV, FP16 (the reference)
  kFullBf16,      ///< ThinKvCache in mode full: BF16 pages, nothing else
  kTbq,           ///< ThinKV's thought-based quantization only
  kTbe,           ///< ThinKV's thought-based eviction only (BF16 pages)
  kThinKv,        ///< TBQ + TBE
  kTbeFirst,      ///< TBE keeping each segment's first K tokens instead of K-means (ablation)
  kThinKvFirst,   ///< ThinKV keeping the first K tokens (ablation)
  kNvfp4,         ///< uniform NVFP4 for every token (ThinKvCache, map R4E4T4, no eviction)
  kKivi2,         ///< KIVI, 2 bits
  kKivi4,         ///< KIVI, 4 bits
  kStreamingLlm,  ///< attention sinks + recent window (FP16)
  kH2o,           ///< heavy hitters + recent window (FP16)
  kRkv,           ///< R-KV: attention importance minus key redundancy, every 128 steps (FP16)
};

struct MethodInfo {
  Method method;
  std::string_view name;
  bool budget;        ///< takes a token budget
  bool thinkv_cache;  ///< runs on ThinKvCache (any KV backend, thought signal)
  std::string_view summary;
};

inline constexpr std::array<MethodInfo, 13> kMethods = {{
    {Method::kFull, "full", false, false, "FullKV in FP16 (the reference)"},
    {Method::kFullBf16, "full-bf16", false, true, "ThinKV's paged cache with BF16 pages, no compression"},
    {Method::kTbq, "tbq", false, true, "thought-based quantization (--precision per thought), no eviction"},
    {Method::kTbe, "tbe", true, true, "thought-based eviction (K-means retention), BF16 pages"},
    {Method::kThinKv, "thinkv", true, true, "TBQ + TBE: ThinKV"},
    {Method::kTbeFirst, "tbe-first", true, true, "TBE keeping each segment's first K tokens (ablation)"},
    {Method::kThinKvFirst, "thinkv-first", true, true, "ThinKV keeping each segment's first K tokens (ablation)"},
    {Method::kNvfp4, "nvfp4", false, true, "uniform NVFP4 for every token, no eviction"},
    {Method::kKivi2, "kivi2", false, false, "KIVI 2-bit: keys per channel, values per token, FP16 residual"},
    {Method::kKivi4, "kivi4", false, false, "KIVI 4-bit"},
    {Method::kStreamingLlm, "streamingllm", true, false, "StreamingLLM: 4 attention sinks + recent window"},
    {Method::kH2o, "h2o", true, false, "H2O: heavy hitters (accumulated attention) + recent window"},
    {Method::kRkv, "rkv", true, false, "R-KV: every 128 steps keep the budget by importance - redundancy"},
}};

inline const MethodInfo& method_info(Method m) { return kMethods[static_cast<std::size_t>(m)]; }
inline std::string_view to_string(Method m) { return method_info(m).name; }
inline std::optional<Method> parse_method(std::string_view s) {
  for (const MethodInfo& i : kMethods) {
    if (i.name == s) return i.method;
  }
  return std::nullopt;
}
/// "full, full-bf16, tbq, ..." for messages.
inline std::string method_names() {
  std::string s;
  for (const MethodInfo& i : kMethods) s += (s.empty() ? "" : ", ") + std::string(i.name);
  return s;
}
inline bool has_budget(Method m) { return method_info(m).budget; }
inline bool on_thinkv_cache(Method m) { return method_info(m).thinkv_cache; }
/// The ThinKvCache mode of a method that runs on it.
inline CacheMode thinkv_mode(Method m) {
  switch (m) {
    case Method::kFullBf16: return CacheMode::kFull;
    case Method::kTbq:
    case Method::kNvfp4: return CacheMode::kTbq;
    case Method::kTbe:
    case Method::kTbeFirst: return CacheMode::kTbe;
    default: return CacheMode::kThinKv;
  }
}

/// A cache to build: ThinKV's, or a baseline's.
using CacheSpec = std::variant<ThinKvSpec, DenseKvConfig, KiviConfig>;

/// The shape of a spec.
inline CacheShape spec_shape(const CacheSpec& s) {
  if (const auto* t = std::get_if<ThinKvSpec>(&s)) {
    return {t->num_sequences, t->num_layers, t->num_kv_heads, t->num_q_heads, t->head_dim};
  }
  if (const auto* d = std::get_if<DenseKvConfig>(&s)) return d->shape;
  return std::get<KiviConfig>(s).shape;
}
inline int spec_max_tokens(const CacheSpec& s) {
  return std::visit([](const auto& c) { return c.max_tokens; }, s);
}

/// What a user chooses about the method; everything else follows from the model.
struct MethodOptions {
  Method method = Method::kFull;
  CacheOptions cache;  ///< budget, group, segment, tau, precision, classifier (ThinKV's; the
                       ///< budget applies to the baselines too); cache.mode is set from method
  SegmentSelection selection = SegmentSelection::kKmeans;  ///< for tbe / thinkv
};

/// Builds the cache spec of a method for a model; the Status names any value that does not fit.
inline Status make_cache_spec(const ModelConfig& c, const MethodOptions& o, CacheSpec& out) {
  const CacheShape shape{1, c.n_layers, c.n_kv_heads, c.n_heads, c.head_dim};
  if (o.cache.max_tokens < 1) return {StatusCode::kInvalidArgument, "max_tokens must be >= 1"};
  const int budget = o.cache.budget > 0 ? o.cache.budget : default_budget(c);
  if (o.cache.no_budget && has_budget(o.method) && !on_thinkv_cache(o.method)) {
    return {StatusCode::kInvalidArgument, std::string(to_string(o.method)) +
                                              " keeps a fixed number of tokens: it needs a budget >= 1 (budget 0, "
                                              "no budget, is ThinKV's tbe/thinkv only)"};
  }
  switch (o.method) {
    case Method::kFull: {
      DenseKvConfig d;
      d.shape = shape;
      d.max_tokens = o.cache.max_tokens;
      THINKV_RETURN_IF_ERROR(d.validate());
      out = d;
      return Status::ok();
    }
    case Method::kStreamingLlm:
    case Method::kH2o:
    case Method::kRkv: {
      DenseKvConfig d;
      d.shape = shape;
      d.max_tokens = o.cache.max_tokens;
      d.method = o.method == Method::kStreamingLlm ? DenseMethod::kStreamingLlm
                 : o.method == Method::kH2o        ? DenseMethod::kH2o
                                                   : DenseMethod::kRkv;
      d.token_budget = budget;
      d.pinned_prefix = std::min(o.cache.pinned_prefix, d.max_tokens);
      d.rkv_window = std::min(d.rkv_window, budget);
      d.sink_tokens = std::min(d.sink_tokens, budget - 1);
      THINKV_RETURN_IF_ERROR(d.validate());
      out = d;
      return Status::ok();
    }
    case Method::kKivi2:
    case Method::kKivi4: {
      KiviConfig k;
      k.shape = shape;
      k.max_tokens = o.cache.max_tokens;
      k.bits = o.method == Method::kKivi2 ? 2 : 4;
      k.group_size = std::min(32, c.head_dim);
      while (c.head_dim % k.group_size != 0) --k.group_size;
      k.residual = std::max(32 / k.group_size, 1) * k.group_size;
      THINKV_RETURN_IF_ERROR(k.validate());
      out = k;
      return Status::ok();
    }
    default: break;
  }
  CacheOptions co = o.cache;
  co.mode = thinkv_mode(o.method);
  if (o.method == Method::kNvfp4) {
    co.precision = PrecisionMap(Precision::kNvfp4, Precision::kNvfp4, Precision::kNvfp4);
    co.classifier = ThoughtClassifier{};
  }
  ThinKvSpec k;
  THINKV_RETURN_IF_ERROR(make_cache_config(c, co, k));
  k.selection =
      (o.method == Method::kTbeFirst || o.method == Method::kThinKvFirst) ? SegmentSelection::kFirst : o.selection;
  THINKV_RETURN_IF_ERROR(k.validate());
  out = k;
  return Status::ok();
}

}  // namespace thinkv::decoder
