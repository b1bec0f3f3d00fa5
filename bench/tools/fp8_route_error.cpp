// The FP8 tensor-core route for quantized decode attention: its error against the float64
// reference, emulated on the CPU before any kernel is written. The route (bench/tools/
// fp8_route_probe.cu counts its instructions) multiplies E4M3 bytes on both sides of the mma:
// the NVFP4 codes (exact in E4M3) and B operands that fold the group scales in,
//   scores: B = Q x key scale of the channel's 16-token group,
//   values: B = P x value scale of the token's 16-channel group,
// each rounded to FP16 (the HMUL2 that forms it), scaled by a power of two so the largest
// magnitude of the work item fits E4M3, and stored as one E4M3 term (2^-4 relative) or as two
// (hi + lo, about 2^-8). Products are exact and accumulate in FP32 in channel (token) order; the
// Hopper FP8 mma's own accumulation is modelled as FP32, which it is not quite (see docs/perf.md).
//
// Per case: G = 4 query heads of one KV head, head_dim 128, `tokens` live tokens, keys and
// values drawn N(0, 1) (keys with small per-channel offsets, N(0, 0.25), and every 17th channel
// x4, as post-RoPE keys have outlier channels), quantized to NVFP4 by the library's
// quantize_group (keys per channel, values per token, g = 16, the stream scale by
// choose_stream_scale). Queries N(0, qscale^2): qscale 1 gives flat attention, 4 peaked. Errors
// are max |out - ref| / max |ref| over the heads' outputs, ref the float64 attention over the
// same dequantized K/V; "storage" is the NVFP4 cache's own error (the float64 attention over the
// unquantized K/V against ref), the error a user already accepts.
//
//   fp8_route_error [cases per row, default 20] [seed]

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "thinkv/formats/e2m1.hpp"
#include "thinkv/formats/fp16.hpp"
#include "thinkv/formats/fp8_e4m3.hpp"
#include "thinkv/formats/group_quant.hpp"

namespace {

using namespace thinkv;

constexpr int kD = 128, kG = 4, kGroup = 16;

float f16(float x) { return decode_fp16(encode_fp16(x)); }
float e4m3(float x) { return decode_e4m3(encode_e4m3(x)); }

/// An NVFP4-quantized [tokens x d] matrix: element values (E2M1 codes' values) and the scale of
/// each element's group (decode_e4m3(code) x s2, exact in FP16 up to s2).
struct Quantized {
  std::vector<float> code, scale;  // [tokens * d]
  float s2 = 1.0f;
  [[nodiscard]] double value(std::size_t i) const { return static_cast<double>(code[i]) * scale[i] * s2; }
};

/// per_channel: groups of 16 tokens of one channel (keys); else 16 channels of one token (values).
Quantized quantize(const std::vector<float>& x, int tokens, bool per_channel) {
  Quantized q;
  q.code.resize(x.size());
  q.scale.resize(x.size());
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  q.s2 = choose_stream_scale(Precision::kNvfp4, amax);
  std::uint8_t codes[kGroup];
  float group[kGroup];
  const int groups = per_channel ? tokens / kGroup : tokens;
  const int per = per_channel ? kD : kD / kGroup;
  for (int a = 0; a < groups; ++a) {
    for (int b = 0; b < per; ++b) {
      std::size_t idx[kGroup];
      for (int i = 0; i < kGroup; ++i) {
        idx[i] = per_channel ? static_cast<std::size_t>(a * kGroup + i) * kD + static_cast<std::size_t>(b)
                             : static_cast<std::size_t>(a) * kD + static_cast<std::size_t>(b * kGroup + i);
        group[i] = x[idx[i]];
      }
      const std::uint8_t sc = quantize_group(Precision::kNvfp4, group, 1, kGroup, q.s2, codes, 1);
      for (int i = 0; i < kGroup; ++i) {
        q.code[idx[i]] = decode_e2m1(codes[i]);
        q.scale[idx[i]] = decode_e4m3(sc);
      }
    }
  }
  return q;
}

/// float64 attention of G heads: out[h * d + c].
template <class KAt, class VAt>
std::vector<double> attention64(const std::vector<float>& q, int tokens, KAt k, VAt v) {
  std::vector<double> out(static_cast<std::size_t>(kG) * kD, 0.0), s(static_cast<std::size_t>(tokens));
  for (int h = 0; h < kG; ++h) {
    double m = -INFINITY;
    for (int t = 0; t < tokens; ++t) {
      double acc = 0.0;
      for (int c = 0; c < kD; ++c) acc += static_cast<double>(q[static_cast<std::size_t>(h * kD + c)]) * k(t, c);
      s[static_cast<std::size_t>(t)] = acc / std::sqrt(static_cast<double>(kD));
      m = std::max(m, s[static_cast<std::size_t>(t)]);
    }
    double l = 0.0;
    for (double& e : s) l += (e = std::exp(e - m));
    for (int t = 0; t < tokens; ++t) {
      for (int c = 0; c < kD; ++c)
        out[static_cast<std::size_t>(h * kD + c)] += s[static_cast<std::size_t>(t)] * v(t, c);
    }
    for (int c = 0; c < kD; ++c) out[static_cast<std::size_t>(h * kD + c)] /= l;
  }
  return out;
}

/// The split of one B element x (already the FP16 product): its E4M3 terms times 2^e, summed.
float split(float x, float pow2, int terms) {
  const float y = x * pow2;  // exact: a power of two
  const float hi = e4m3(y);
  if (terms == 1) return hi / pow2;
  const float lo = e4m3(f16(y - hi));  // the HFMA2 that forms the residual rounds to FP16
  return (hi + lo) / pow2;             // the mma multiplies each term exactly; FP32 holds their sum
}

/// The power of two that brings `amax` to at most 448 (the largest with amax * 2^e <= 448).
float fit_pow2(float amax) { return amax > 0.0f ? std::exp2(std::floor(std::log2(448.0f / amax))) : 1.0f; }

/// The FP8 route's attention with tk E4M3 terms per score-side B element and tv per value-side
/// one (1 or 2; 0: exact products in FP32, the FP16 route's model).
std::vector<double> attention_fp8(const std::vector<float>& q, int tokens, const Quantized& k, const Quantized& v,
                                  int tk, int tv) {
  std::vector<double> out(static_cast<std::size_t>(kG) * kD);
  std::vector<float> s(static_cast<std::size_t>(tokens)), bk(static_cast<std::size_t>(kD));
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(kD));
  // The largest key and value scales (the work item's powers of two below are fitted to them).
  float ka = 0.0f, va = 0.0f;
  for (float sc : k.scale) ka = std::max(ka, sc);
  for (float sc : v.scale) va = std::max(va, sc);
  const float pv = fit_pow2(va);  // P <= 1
  for (int h = 0; h < kG; ++h) {
    const float* qh = q.data() + static_cast<std::size_t>(h) * kD;
    // One power of two per work item (head): the largest |Q x key scale| fits.
    float qa = 0.0f;
    for (int c = 0; c < kD; ++c) qa = std::max(qa, std::fabs(f16(qh[c])));
    const float pk = fit_pow2(f16(qa * ka));
    float m = -INFINITY;
    for (int t = 0; t < tokens; ++t) {
      if (t % kGroup == 0) {  // a new key group: B = split(f16(Q x scale))
        for (int c = 0; c < kD; ++c) {
          const float sc = k.scale[static_cast<std::size_t>(t) * kD + static_cast<std::size_t>(c)];
          bk[static_cast<std::size_t>(c)] = tk == 0 ? qh[c] * sc : split(f16(f16(qh[c]) * sc), pk, tk);
        }
      }
      float acc = 0.0f;
      for (int c = 0; c < kD; ++c) {
        acc += k.code[static_cast<std::size_t>(t) * kD + static_cast<std::size_t>(c)] * bk[static_cast<std::size_t>(c)];
      }
      s[static_cast<std::size_t>(t)] = acc * k.s2 * inv_sqrt_d;
      m = std::max(m, s[static_cast<std::size_t>(t)]);
    }
    float l = 0.0f;
    for (float& e : s) l += (e = std::exp(e - m));
    for (int c = 0; c < kD; ++c) {
      float acc = 0.0f;
      for (int t = 0; t < tokens; ++t) {
        const std::size_t i = static_cast<std::size_t>(t) * kD + static_cast<std::size_t>(c);
        const float b = tv == 0 ? s[static_cast<std::size_t>(t)] * v.scale[i]
                                : split(f16(f16(s[static_cast<std::size_t>(t)]) * v.scale[i]), pv, tv);
        acc += v.code[i] * b;
      }
      out[static_cast<std::size_t>(h * kD + c)] = static_cast<double>(acc) * v.s2 / l;
    }
  }
  return out;
}

double rel_err(const std::vector<double>& a, const std::vector<double>& ref) {
  double e = 0.0, m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    e = std::max(e, std::fabs(a[i] - ref[i]));
    m = std::max(m, std::fabs(ref[i]));
  }
  return e / m;
}

}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 20;
  const std::uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::printf("fp8_route_error: %d cases per row, seed %llu; max |out - ref| / max |ref|, worst (mean)\n", cases,
              static_cast<unsigned long long>(seed));
  std::printf(
      "| tokens | qscale | storage (NVFP4 K/V) | FP32, exact products | FP8, two terms | FP8: scores two, values one | "
      "FP8: scores one, values two | FP8, one term |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int tokens : {1024, 4096}) {
    for (float qscale : {1.0f, 4.0f}) {
      constexpr int kCols = 6;
      double worst[kCols] = {}, sum[kCols] = {};
      for (int n = 0; n < cases; ++n) {
        std::vector<float> k(static_cast<std::size_t>(tokens) * kD), v(k.size()), q(static_cast<std::size_t>(kG) * kD),
            offset(kD);
        for (int c = 0; c < kD; ++c) offset[static_cast<std::size_t>(c)] = 0.5f * nd(rng);
        for (std::size_t i = 0; i < k.size(); ++i) {
          const int c = static_cast<int>(i % kD);
          k[i] = offset[static_cast<std::size_t>(c)] + nd(rng) * (c % 17 == 0 ? 4.0f : 1.0f);
          v[i] = nd(rng);
        }
        for (float& x : q) x = qscale * nd(rng);
        const Quantized kq = quantize(k, tokens, true), vq = quantize(v, tokens, false);
        const auto ref = attention64(
            q, tokens, [&](int t, int c) { return kq.value(static_cast<std::size_t>(t) * kD + c); },
            [&](int t, int c) { return vq.value(static_cast<std::size_t>(t) * kD + c); });
        const auto orig = attention64(
            q, tokens, [&](int t, int c) { return static_cast<double>(k[static_cast<std::size_t>(t) * kD + c]); },
            [&](int t, int c) { return static_cast<double>(v[static_cast<std::size_t>(t) * kD + c]); });
        const double e[kCols] = {rel_err(orig, ref),
                                 rel_err(attention_fp8(q, tokens, kq, vq, 0, 0), ref),
                                 rel_err(attention_fp8(q, tokens, kq, vq, 2, 2), ref),
                                 rel_err(attention_fp8(q, tokens, kq, vq, 2, 1), ref),
                                 rel_err(attention_fp8(q, tokens, kq, vq, 1, 2), ref),
                                 rel_err(attention_fp8(q, tokens, kq, vq, 1, 1), ref)};
        for (int j = 0; j < kCols; ++j) {
          worst[j] = std::max(worst[j], e[j]);
          sum[j] += e[j];
        }
      }
      std::printf("| %d | %g |", tokens, static_cast<double>(qscale));
      for (int j = 0; j < kCols; ++j) std::printf(" %.2e (%.2e) |", worst[j], sum[j] / cases);
      std::printf("\n");
    }
  }
  return 0;
}
