#pragma once
/// \file attention.hpp
/// CPU reference of single-token decode attention (the ground truth the GPU kernels must match).
/// FP32 throughout, scores and softmax in the order documented in docs/design.md.

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "thinkv/status.hpp"

namespace thinkv {

/// Decode attention of one (sequence, layer): every KV head's stream is read once and serves the
/// num_q_heads / num_kv_heads query heads that share it (GQA; query head h uses KV head
/// h / (num_q_heads / num_kv_heads)). Pointers are in the backend's memory space (host for the
/// CPU backend).
struct DecodeAttentionArgs {
  int num_q_heads = 0;                       ///< query heads, a multiple of num_kv_heads
  int num_kv_heads = 0;                      ///< KV heads (one cache stream each)
  const std::int32_t* kv_streams = nullptr;  ///< [num_kv_heads] cache stream of each KV head
  const float* q = nullptr;                  ///< [num_q_heads, head_dim] queries (post-RoPE)
  float* out = nullptr;                      ///< [num_q_heads, head_dim] attention output
  float softmax_scale = 0.0f;                ///< 0 means 1/sqrt(head_dim)
  /// [num_q_heads] optional: per query head, the share of attended tokens whose softmax
  /// probability is below 1% of the row maximum (see attention_sparsity_threshold). Written only
  /// when non-null, so steps that do not refresh the thought type pay nothing.
  float* sparsity = nullptr;
};

/// A token j is *sparse* for a query row when its probability is below 1% of the row maximum:
/// p_j < 0.01 * p_max  <=>  s_j - m < ln(0.01), with s_j the scaled score and m the row max.
/// The comparison is made in FP32 on d_j = s_j - m (one FP32 subtraction) against this constant
/// (ln 0.01 rounded to FP32), strictly: a tie d_j == threshold is not sparse. Kernels must use the
/// same rule (docs/design.md, "Sparsity signal", says how with split attention).
inline constexpr float kSparsityLogThreshold = -4.60517018598809f;

/// Checks the argument shapes of a decode-attention call against a cache of `num_streams` streams.
inline Status check_attention_args(const DecodeAttentionArgs& a, int num_streams) {
  if (a.num_kv_heads < 1 || a.num_q_heads < 1 || a.num_q_heads % a.num_kv_heads != 0) {
    return {StatusCode::kShapeMismatch, "num_q_heads " + std::to_string(a.num_q_heads) +
                                            " must be a positive multiple of "
                                            "num_kv_heads " +
                                            std::to_string(a.num_kv_heads)};
  }
  if (a.kv_streams == nullptr || a.q == nullptr || a.out == nullptr) {
    return {StatusCode::kInvalidArgument, "kv_streams, q and out must not be null"};
  }
  for (int h = 0; h < a.num_kv_heads; ++h) {
    if (a.kv_streams[h] < 0 || a.kv_streams[h] >= num_streams) {
      return {StatusCode::kOutOfRange, "kv_streams[" + std::to_string(h) + "] = " + std::to_string(a.kv_streams[h]) +
                                           " is out of range; allowed: 0.." + std::to_string(num_streams - 1)};
    }
  }
  if (!(a.softmax_scale >= 0.0f) || std::isinf(a.softmax_scale)) {
    return {StatusCode::kInvalidArgument, "softmax_scale must be finite and >= 0 (0 = 1/sqrt(d))"};
  }
  return Status::ok();
}

namespace reference {

/// Attention of `n_q` query rows over `n` tokens in FP32:
///   s_j = (sum_c q[c] * k[j][c]) * scale   (channels summed in order c = 0..d-1)
///   m = max_j s_j;  p_j = exp(s_j - m);  l = sum_j p_j (j in order)
///   out[c] = (sum_j p_j * v[j][c]) / l
/// q: [n_q, d], k and v: [n, d], out: [n_q, d]; n >= 1.
/// When `sparsity` ([n_q]) is non-null, sparsity[h] = #{j : s_j - m < kSparsityLogThreshold} / n.
/// When `prob_sum` ([n]) is non-null, prob_sum[j] += p_j / l for every query row (the attention
/// each token receives, summed over the rows; H2O and R-KV score tokens by it).
inline void attend_tokens(const float* q, int n_q, const float* k, const float* v, int n, int d, float scale,
                          float* out, float* sparsity = nullptr, float* prob_sum = nullptr) {
  std::vector<float> p(static_cast<std::size_t>(n));
  std::vector<float> acc(static_cast<std::size_t>(d));
  for (int h = 0; h < n_q; ++h) {
    const float* qh = q + static_cast<std::ptrdiff_t>(h) * d;
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) {
      const float* kj = k + static_cast<std::ptrdiff_t>(j) * d;
      float s = 0.0f;
      for (int c = 0; c < d; ++c) s += qh[c] * kj[c];
      s *= scale;
      p[static_cast<std::size_t>(j)] = s;
      m = s > m ? s : m;
    }
    if (sparsity != nullptr) {
      int below = 0;
      for (int j = 0; j < n; ++j) below += (p[static_cast<std::size_t>(j)] - m) < kSparsityLogThreshold;
      sparsity[h] = static_cast<float>(below) / static_cast<float>(n);
    }
    float l = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float e = std::exp(p[static_cast<std::size_t>(j)] - m);
      p[static_cast<std::size_t>(j)] = e;
      l += e;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < n; ++j) {
      const float* vj = v + static_cast<std::ptrdiff_t>(j) * d;
      const float pj = p[static_cast<std::size_t>(j)];
      for (int c = 0; c < d; ++c) acc[static_cast<std::size_t>(c)] += pj * vj[c];
    }
    float* oh = out + static_cast<std::ptrdiff_t>(h) * d;
    for (int c = 0; c < d; ++c) oh[c] = acc[static_cast<std::size_t>(c)] / l;
    if (prob_sum != nullptr) {
      for (int j = 0; j < n; ++j) prob_sum[j] += p[static_cast<std::size_t>(j)] / l;
    }
  }
}

}  // namespace reference
}  // namespace thinkv
