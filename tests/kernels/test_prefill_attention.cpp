// GPU test: launch_prefill_attention (causal prompt attention) against causal attention in
// float64 over the same (encoded) inputs, for head_dim 8..256 (and 40, not a multiple of 32),
// GQA group sizes 1..8, every element type, outputs poisoned before the launch. head_dim 32, 64,
// 128 and 256 take the tiled kernel (64 query rows = 64 / G tokens x G heads per CTA, key tiles of
// 32 rows, 16 at 256): shapes whose tokens * G is not a multiple of 64, groups (3) that split a
// token's heads across two CTAs, FP32 K/V (cp.async) and FP16/BF16 K/V or unaligned strides
// (converting loads); the other head_dims the simple kernel. Tolerance:
// 2^-(mantissa bits of out) * max|out| + 5e-5 * max|v| (FP32 arithmetic, expf within 2 ulp, up to
// 700 terms), per output row. Fresh random inputs per run (THINKV_TEST_SEED pins them).

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../unit/test_util.hpp"
#include "thinkv/kernels/prefill_attention.hpp"

using namespace thinkv;

namespace {

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t n) { REQUIRE(cudaMalloc(&p, n) == cudaSuccess); }
  ~DeviceBuffer() { (void)cudaFree(p); }
};

std::vector<std::uint8_t> encode(std::vector<float>& x, ElementType t) {
  std::vector<std::uint8_t> b(x.size() * static_cast<std::size_t>(element_bytes(t)));
  for (std::size_t i = 0; i < x.size(); ++i) {
    store_element(b.data(), t, i, x[i]);
    x[i] = load_element(b.data(), t, i);
  }
  return b;
}

}  // namespace

TEST_CASE("Prefill attention matches causal attention in float64", "[prefill_attention]") {
  TT_SEEDED_RNG();
  struct Shape {
    int tokens, hq, hkv, d;
    ElementType kv, q, out;
    float sharp;
  };
  const Shape shapes[] = {
      {1, 4, 4, 64, ElementType::kF32, ElementType::kF32, ElementType::kF32, 1.0f},
      {37, 8, 2, 128, ElementType::kF32, ElementType::kF32, ElementType::kF32, 3.0f},
      {700, 8, 1, 128, ElementType::kBf16, ElementType::kBf16, ElementType::kBf16, 2.0f},
      {129, 32, 8, 128, ElementType::kF16, ElementType::kF16, ElementType::kF32, 1.0f},
      {65, 6, 3, 40, ElementType::kF32, ElementType::kBf16, ElementType::kF16, 1.5f},
      {50, 2, 2, 8, ElementType::kF32, ElementType::kF32, ElementType::kF32, 4.0f},
      {90, 8, 8, 256, ElementType::kBf16, ElementType::kF32, ElementType::kF32, 1.0f},
      // The tiled kernel: partial last query tiles, G = 8 sharing a K/V tile, G = 3 splitting a
      // token's heads across CTAs, one token, D = 32.
      {333, 16, 2, 128, ElementType::kF32, ElementType::kF32, ElementType::kF32, 2.0f},
      {201, 6, 2, 64, ElementType::kF16, ElementType::kF16, ElementType::kF16, 1.5f},
      {100, 4, 4, 64, ElementType::kF32, ElementType::kF32, ElementType::kF32, 3.0f},
      {77, 8, 1, 256, ElementType::kF32, ElementType::kF32, ElementType::kBf16, 2.0f},
      {1, 8, 1, 128, ElementType::kF32, ElementType::kF32, ElementType::kF32, 1.0f},
      {45, 3, 1, 32, ElementType::kBf16, ElementType::kF32, ElementType::kF32, 2.0f},
  };
  std::normal_distribution<float> normal;
  for (const Shape& s : shapes) {
    INFO("tokens " << s.tokens << ", Hq " << s.hq << ", Hkv " << s.hkv << ", D " << s.d);
    const auto T = static_cast<std::size_t>(s.tokens);
    std::vector<float> q(T * s.hq * s.d), k(T * s.hkv * s.d), v(k.size());
    for (auto& x : q) x = normal(rng) * s.sharp;
    for (auto& x : k) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    const auto qb = encode(q, s.q), kb = encode(k, s.kv), vb = encode(v, s.kv);
    const std::size_t out_bytes = q.size() * static_cast<std::size_t>(element_bytes(s.out));
    DeviceBuffer dq(qb.size()), dk(kb.size()), dv(vb.size()), dout(out_bytes);
    REQUIRE(cudaMemcpy(dq.p, qb.data(), qb.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dk.p, kb.data(), kb.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dv.p, vb.data(), vb.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemset(dout.p, 0xFF, out_bytes) == cudaSuccess);  // NaN in every type
    kernels::PrefillAttentionParams p;
    p.tokens = s.tokens;
    p.num_q_heads = s.hq;
    p.num_kv_heads = s.hkv;
    p.head_dim = s.d;
    p.q = dq.p;
    p.k = dk.p;
    p.v = dv.p;
    p.out = dout.p;
    p.q_type = s.q;
    p.k_type = p.v_type = s.kv;
    p.out_type = s.out;
    REQUIRE(kernels::launch_prefill_attention(p, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<std::uint8_t> ob(out_bytes);
    REQUIRE(cudaMemcpy(ob.data(), dout.p, out_bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    const double eps = s.out == ElementType::kF32 ? 0x1p-23 : s.out == ElementType::kF16 ? 0x1p-10 : 0x1p-7;
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
    const int G = s.hq / s.hkv;
    double worst = 0;
    std::vector<double> sc(T), acc(static_cast<std::size_t>(s.d));
    for (std::size_t t = 0; t < T; ++t) {
      for (int h = 0; h < s.hq; ++h) {
        const int kvh = h / G;
        double m = -INFINITY, l = 0, vmax = 0;
        for (std::size_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (int c = 0; c < s.d; ++c) dot += double{q[(t * s.hq + h) * s.d + c]} * k[(j * s.hkv + kvh) * s.d + c];
          sc[j] = dot * scale;
          m = std::max(m, sc[j]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::size_t j = 0; j <= t; ++j) {
          const double e = std::exp(sc[j] - m);
          l += e;
          for (int c = 0; c < s.d; ++c) {
            const double x = v[(j * s.hkv + kvh) * s.d + c];
            acc[static_cast<std::size_t>(c)] += e * x;
            vmax = std::max(vmax, std::fabs(x));
          }
        }
        double max_ref = 0, max_err = 0;
        for (int c = 0; c < s.d; ++c) {
          const double want = acc[static_cast<std::size_t>(c)] / l;
          const double got = load_element(ob.data(), s.out, (t * s.hq + h) * s.d + c);
          max_ref = std::max(max_ref, std::fabs(want));
          max_err = std::max(max_err, std::isnan(got) ? INFINITY : std::fabs(got - want));
        }
        INFO("token " << t << ", head " << h);
        REQUIRE(max_err <= eps * max_ref + 5e-5 * vmax);
        worst = std::max(worst, max_err / std::max(max_ref, 1e-30));
      }
    }
    INFO("worst error / max|out| " << worst);
    SUCCEED();
  }
}

TEST_CASE("Prefill attention with a prefix: a continued chunk attends its KV head's stored rows, then its own",
          "[prefill_attention]") {
  // K/V in the scratch layout attend_chunk builds: FP32 [hkv, rows, d] (row stride d, head stride
  // rows * d), KV head h's prefix[h] stored rows first, the chunk's rows after them; unused rows
  // hold NaN, so a row read beyond prefix[h] + t poisons the output. Reference: float64, as above.
  // `pad` widens the row stride to d + pad (pad 1: rows not 16-byte aligned, the tiled kernel's
  // converting loads; pad 4: cp.async with a row stride other than d). Prefixes that end mid key
  // tile, a long prefix (4,000 rows, 300 tokens), head_dim 32, 64, 128, 256, and G = 8.
  TT_SEEDED_RNG();
  struct Shape {
    int tokens, hq, hkv, d;
    std::vector<int> prefix;
    int pad = 0;
  };
  const Shape shapes[] = {
      {1, 4, 2, 64, {0, 33}},           // one token
      {37, 8, 2, 128, {300, 5}},        // prefixes ending mid key tile
      {16, 8, 4, 32, {1, 64, 0, 129}},  // four KV heads, four prefixes
      {70, 4, 1, 40, {250}},            // the simple kernel
      {300, 8, 1, 64, {4000}},          // long prefix, G = 8
      {40, 4, 2, 256, {100, 37}},       // key tiles of 16
      {65, 16, 2, 64, {31, 0}},         // G = 8, a prefix ending mid tile
      {50, 16, 2, 128, {1000, 33}, 1},  // unaligned rows: converting loads
      {29, 24, 3, 32, {40, 3, 77}, 4},  // cp.async, row stride d + 4
  };
  std::normal_distribution<float> normal;
  for (const Shape& s : shapes) {
    INFO("tokens " << s.tokens << ", Hq " << s.hq << ", Hkv " << s.hkv << ", D " << s.d << ", pad " << s.pad);
    const int longest = *std::max_element(s.prefix.begin(), s.prefix.end());
    const auto rows = static_cast<std::size_t>(longest + s.tokens + 3);  // 3 spare rows, poisoned
    const auto T = static_cast<std::size_t>(s.tokens);
    const auto rs = static_cast<std::size_t>(s.d + s.pad);  // row stride
    std::vector<float> q(T * s.hq * s.d), k(s.hkv * rows * rs, NAN), v(k.size(), NAN);
    for (auto& x : q) x = normal(rng) * 2.0f;
    for (int h = 0; h < s.hkv; ++h) {
      for (std::size_t j = 0; j < static_cast<std::size_t>(s.prefix[static_cast<std::size_t>(h)]) + T; ++j) {
        for (int c = 0; c < s.d; ++c) {
          k[(h * rows + j) * rs + c] = normal(rng);
          v[(h * rows + j) * rs + c] = normal(rng);
        }
      }
    }
    const std::size_t out_bytes = q.size() * 4;
    DeviceBuffer dq(q.size() * 4), dk(k.size() * 4), dv(v.size() * 4), dout(out_bytes), dp(s.prefix.size() * 4);
    REQUIRE(cudaMemcpy(dq.p, q.data(), q.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dk.p, k.data(), k.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dv.p, v.data(), v.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dp.p, s.prefix.data(), s.prefix.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemset(dout.p, 0xFF, out_bytes) == cudaSuccess);
    kernels::PrefillAttentionParams p;
    p.tokens = s.tokens;
    p.num_q_heads = s.hq;
    p.num_kv_heads = s.hkv;
    p.head_dim = s.d;
    p.q = dq.p;
    p.k = dk.p;
    p.v = dv.p;
    p.out = dout.p;
    p.prefix = static_cast<const int*>(dp.p);
    p.kv_row_stride = static_cast<long long>(rs);
    p.kv_head_stride = static_cast<long long>(rows * rs);
    REQUIRE(kernels::launch_prefill_attention(p, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<float> out(q.size());
    REQUIRE(cudaMemcpy(out.data(), dout.p, out_bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
    const int G = s.hq / s.hkv;
    std::vector<double> acc(static_cast<std::size_t>(s.d));
    for (std::size_t t = 0; t < T; ++t) {
      for (int h = 0; h < s.hq; ++h) {
        const int kvh = h / G;
        const std::size_t n = static_cast<std::size_t>(s.prefix[static_cast<std::size_t>(kvh)]) + t + 1;
        std::vector<double> sc(n);
        double m = -INFINITY, l = 0, vmax = 0;
        for (std::size_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int c = 0; c < s.d; ++c) dot += double{q[(t * s.hq + h) * s.d + c]} * k[(kvh * rows + j) * rs + c];
          sc[j] = dot * scale;
          m = std::max(m, sc[j]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::size_t j = 0; j < n; ++j) {
          const double e = std::exp(sc[j] - m);
          l += e;
          for (int c = 0; c < s.d; ++c) {
            const double x = v[(kvh * rows + j) * rs + c];
            acc[static_cast<std::size_t>(c)] += e * x;
            vmax = std::max(vmax, std::fabs(x));
          }
        }
        double max_ref = 0, max_err = 0;
        for (int c = 0; c < s.d; ++c) {
          const double want = acc[static_cast<std::size_t>(c)] / l;
          const double got = out[(t * s.hq + h) * s.d + c];
          max_ref = std::max(max_ref, std::fabs(want));
          max_err = std::max(max_err, std::isnan(got) ? INFINITY : std::fabs(got - want));
        }
        INFO("token " << t << ", head " << h << ", attending " << n << " rows");
        REQUIRE(max_err <= 0x1p-23 * max_ref + 5e-5 * vmax);
      }
    }
  }
}

TEST_CASE("Prefill attention refuses bad parameters without launching", "[prefill_attention][bad_input]") {
  kernels::PrefillAttentionParams p;
  float x = 0;
  p.tokens = 4;
  p.num_q_heads = 4;
  p.num_kv_heads = 2;
  p.head_dim = 64;
  p.q = p.k = p.v = &x;
  p.out = &x;
  CHECK(kernels::check_prefill_attention(p) == cudaSuccess);
  auto bad = [&](auto mutate) {
    kernels::PrefillAttentionParams b = p;
    mutate(b);
    return kernels::check_prefill_attention(b) == cudaErrorInvalidValue &&
           kernels::launch_prefill_attention(b, nullptr) == cudaErrorInvalidValue;
  };
  CHECK(bad([](auto& b) { b.tokens = 0; }));
  CHECK(bad([](auto& b) { b.num_q_heads = 3; }));
  CHECK(bad([](auto& b) { b.head_dim = kernels::kPrefillMaxHeadDim + 1; }));
  CHECK(bad([](auto& b) { b.k = nullptr; }));
  CHECK(bad([](auto& b) { b.softmax_scale = -1.0f; }));
  CHECK(bad([](auto& b) { b.kv_row_stride = -1; }));
  CHECK(bad([](auto& b) { b.kv_head_stride = -1; }));
  CHECK(bad([](auto& b) { b.softmax_scale = INFINITY; }));
}
