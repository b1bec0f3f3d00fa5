#pragma once
/// \file sampler.hpp
/// Next-token choice: greedy (argmax, first maximum on ties, as run.c) or sampling from
/// softmax(logits / temperature) with run.c's xorshift* generator and a seed.

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace thinkv::decoder {

/// Index of the largest logit (the first one on ties).
inline int argmax(std::span<const float> logits) noexcept {
  int best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[static_cast<std::size_t>(best)]) best = static_cast<int>(i);
  }
  return best;
}

/// log softmax in double (for KL divergences).
inline void log_softmax(std::span<const float> logits, std::vector<double>& out) {
  out.resize(logits.size());
  double m = -INFINITY;
  for (float x : logits) m = std::fmax(m, static_cast<double>(x));
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - m);
  const double lse = m + std::log(sum);
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

/// KL(p || q) in nats for two logit vectors of the same vocabulary.
inline double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  std::vector<double> lp, lq;
  log_softmax(p_logits, lp);
  log_softmax(q_logits, lq);
  double kl = 0.0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return kl < 0.0 ? 0.0 : kl;  // rounding can make a ~0 KL slightly negative
}

class Sampler {
 public:
  /// temperature 0 = greedy. A seed of 0 is replaced by a fixed non-zero constant (xorshift
  /// needs a non-zero state).
  explicit Sampler(float temperature = 0.0f, std::uint64_t seed = 0)
      : temperature_(temperature), state_(seed != 0 ? seed : 0x9E3779B97F4A7C15ull) {}

  [[nodiscard]] float temperature() const noexcept { return temperature_; }

  int sample(std::span<const float> logits) {
    if (!(temperature_ > 0.0f)) return argmax(logits);
    probs_.resize(logits.size());
    float m = logits[0];
    for (float x : logits) m = x > m ? x : m;
    float sum = 0.0f;
    for (std::size_t i = 0; i < logits.size(); ++i) {
      probs_[i] = std::exp((logits[i] - m) / temperature_);
      sum += probs_[i];
    }
    const float coin = random_f32() * sum;
    float cdf = 0.0f;
    for (std::size_t i = 0; i < probs_.size(); ++i) {
      cdf += probs_[i];
      if (coin < cdf) return static_cast<int>(i);
    }
    return static_cast<int>(probs_.size()) - 1;  // rounding
  }

 private:
  std::uint32_t random_u32() noexcept {  // run.c's xorshift*
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return static_cast<std::uint32_t>((state_ * 0x2545F4914F6CDD1Dull) >> 32);
  }
  float random_f32() noexcept { return static_cast<float>(random_u32() >> 8) / 16777216.0f; }

  float temperature_;
  std::uint64_t state_;
  std::vector<float> probs_;
};

}  // namespace thinkv::decoder
