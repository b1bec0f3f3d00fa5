// The R-KV-style baseline of the throughput benchmark (bench/decode_throughput/rkv_cache.hpp)
// against a float64 host model of the same method: the tokens a compression keeps (the window
// always, the others by score), the gather-compaction (the pages hold exactly the kept rows, in
// order), and the attention over the compacted stream. Random K/V with correlated keys, so that
// similarities cross the redundancy threshold. Tolerances: kept sets may differ by 2 tokens per
// stream at the cut (the device's similarities come from BF16 keys through a BF16 GEMM, the
// host's from the same BF16 keys in float64); attention within 2e-3 of max|out|.

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "rkv_cache.hpp"
#include "thinkv/formats/bf16.hpp"

using namespace thinkv;

namespace {

/// x rounded to BF16, as the cache stores it (the library's format).
float bf16_round(float x) { return decode_bf16(encode_bf16(x)); }

struct Dev {
  float* p = nullptr;
  explicit Dev(std::size_t n) { REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), n * 4) == cudaSuccess); }
  ~Dev() { cudaFree(p); }
};

/// The kept old indices of one stream, in order (float64 model of rkv_cache.hpp's method).
std::vector<int> reference_keep(const std::vector<std::vector<double>>& keys,
                                const std::vector<std::vector<double>>& win_q, const std::vector<int>& win_idx,
                                const bench::RkvOptions& o) {
  const int n = static_cast<int>(keys.size()), W = o.window, m = n - W;
  const int D = static_cast<int>(keys[0].size());
  // importance: rows = query heads x window, softmax over keys <= the row's index
  std::vector<double> imp(static_cast<std::size_t>(m), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (std::size_t r = 0; r < win_q.size(); ++r) {
    const int lim = win_idx[r];
    std::vector<double> x(static_cast<std::size_t>(lim + 1));
    double mx = -1e300;
    for (int j = 0; j <= lim; ++j) {
      double d = 0;
      for (int c = 0; c < D; ++c)
        d += win_q[r][static_cast<std::size_t>(c)] * keys[static_cast<std::size_t>(j)][static_cast<std::size_t>(c)];
      x[static_cast<std::size_t>(j)] = d * scale;
      mx = std::max(mx, x[static_cast<std::size_t>(j)]);
    }
    double z = 0;
    for (double& v : x) z += (v = std::exp(v - mx));
    for (int j = 0; j < m && j <= lim; ++j)
      imp[static_cast<std::size_t>(j)] += x[static_cast<std::size_t>(j)] / z / static_cast<double>(win_q.size());
  }
  // redundancy over normalised BF16 keys
  std::vector<std::vector<double>> kn(static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j) {
    double ss = 0;
    for (double v : keys[static_cast<std::size_t>(j)]) ss += v * v;
    const double inv = 1.0 / (std::sqrt(ss) + 1e-8);
    for (double v : keys[static_cast<std::size_t>(j)])
      kn[static_cast<std::size_t>(j)].push_back(bf16_round(static_cast<float>(v * inv)));
  }
  std::vector<double> red(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    double sum = 0, lastv = 0;
    for (int j = 0; j < n; ++j) {
      if (j == i) continue;
      double d = 0;
      for (int c = 0; c < D; ++c)
        d += kn[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)] *
             kn[static_cast<std::size_t>(j)][static_cast<std::size_t>(c)];
      sum += d;
      if (d > o.threshold) lastv = d;
    }
    red[static_cast<std::size_t>(i)] = (sum - lastv) / n;
  }
  const double rmx = *std::max_element(red.begin(), red.end());
  double rz = 0;
  for (double r : red) rz += std::exp(r - rmx);
  std::vector<double> score(static_cast<std::size_t>(m));
  for (int j = 0; j < m; ++j) {
    double a = -1e300;
    for (int t = std::max(0, j - o.kernel / 2); t <= std::min(m - 1, j + o.kernel / 2); ++t)
      a = std::max(a, imp[static_cast<std::size_t>(t)]);
    score[static_cast<std::size_t>(j)] =
        o.lambda * a - (1.0 - o.lambda) * std::exp(red[static_cast<std::size_t>(j)] - rmx) / rz;
  }
  std::vector<int> order(static_cast<std::size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return score[static_cast<std::size_t>(x)] > score[static_cast<std::size_t>(y)];
  });
  std::vector<int> keep(order.begin(), order.begin() + (o.budget - W));
  for (int j = m; j < n; ++j) keep.push_back(j);
  std::sort(keep.begin(), keep.end());
  return keep;
}

}  // namespace

TEST_CASE("R-KV baseline: kept tokens, gather-compaction and attention against a float64 model", "[rkv]") {
  ThinKvConfig shape;
  shape.num_sequences = 2;
  shape.num_layers = 2;
  shape.num_kv_heads = 2;
  shape.num_q_heads = 8;
  shape.head_dim = 64;
  bench::RkvOptions o;
  o.budget = 64;
  o.buffer = 32;
  o.window = 8;
  o.chunk_streams = 3;  // chunks that split a sequence's streams unevenly
  const int B = 2, L = 2, H = 2, Hq = 8, G = 4, D = 64, cap = o.budget + o.buffer;
  std::unique_ptr<bench::RkvCache> cache;
  REQUIRE(bench::RkvCache::create(shape, o, cache).is_ok());
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  REQUIRE(cache->set_stream(stream).is_ok());

  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // Host copies: rows[s][token] K and V (BF16-rounded), queries[seq][layer][token][Hq * D].
  const int S = B * L * H;
  std::vector<std::vector<std::vector<double>>> hk(static_cast<std::size_t>(S)), hv(static_cast<std::size_t>(S));
  std::vector<std::vector<std::vector<float>>> hq(static_cast<std::size_t>(B * L));
  std::vector<float> base(static_cast<std::size_t>(S * D));
  for (float& x : base) x = nd(rng);
  Dev dk(B * H * D), dv(B * H * D), dq(B * Hq * D), dout(B * Hq * D);
  const std::vector<int> seqs = {0, 1};
  std::vector<float> out(static_cast<std::size_t>(B * Hq * D));
  const int steps = cap + 1;  // one compression (at cap), then one step attending the compacted streams
  for (int t = 0; t < steps; ++t) {
    REQUIRE(cache->begin_step(seqs, {}).is_ok());
    for (int l = 0; l < L; ++l) {
      std::vector<float> k(static_cast<std::size_t>(B * H * D)), v(k.size()), q(static_cast<std::size_t>(B * Hq * D));
      for (int b = 0; b < B; ++b) {
        for (int h = 0; h < H; ++h) {
          const int s = (b * L + l) * H + h;
          // Every third token near the stream's base direction: similarities above 0.5.
          const bool near = (t % 3) == 0;
          for (int d = 0; d < D; ++d) {
            const float x = near ? base[static_cast<std::size_t>(s * D + d)] + 0.4f * nd(rng) : nd(rng);
            k[static_cast<std::size_t>((b * H + h) * D + d)] = x;
            v[static_cast<std::size_t>((b * H + h) * D + d)] = nd(rng);
          }
        }
      }
      for (float& x : q) x = nd(rng);
      REQUIRE(cudaMemcpy(dk.p, k.data(), k.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dv.p, v.data(), v.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dq.p, q.data(), q.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemset(dout.p, 0xFF, out.size() * 4) == cudaSuccess);  // poison
      REQUIRE(
          cache->append_batch(l, seqs, TensorRef{dk.p, ElementType::kF32}, TensorRef{dv.p, ElementType::kF32}).is_ok());
      REQUIRE(
          cache->attend_batch(l, seqs, TensorRef{dq.p, ElementType::kF32}, MutableTensorRef{dout.p, ElementType::kF32})
              .is_ok());
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      REQUIRE(cudaMemcpy(out.data(), dout.p, out.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      for (int b = 0; b < B; ++b) {
        std::vector<float> qb(q.begin() + b * Hq * D, q.begin() + (b + 1) * Hq * D);
        hq[static_cast<std::size_t>(b * L + l)].push_back(qb);
        for (int h = 0; h < H; ++h) {
          const int s = (b * L + l) * H + h;
          std::vector<double> kr(static_cast<std::size_t>(D)), vr(static_cast<std::size_t>(D));
          for (int d = 0; d < D; ++d) {
            kr[static_cast<std::size_t>(d)] = bf16_round(k[static_cast<std::size_t>((b * H + h) * D + d)]);
            vr[static_cast<std::size_t>(d)] = bf16_round(v[static_cast<std::size_t>((b * H + h) * D + d)]);
          }
          hk[static_cast<std::size_t>(s)].push_back(kr);
          hv[static_cast<std::size_t>(s)].push_back(vr);
          // Attention of this step against the host's rows of the stream (all of them before
          // the compression, the compacted ones after).
          double worst = 0, mag = 0;
          for (int g = 0; g < G; ++g) {
            const int qh = h * G + g;
            const auto& rows = hk[static_cast<std::size_t>(s)];
            std::vector<double> w(rows.size());
            double mx = -1e300;
            for (std::size_t j = 0; j < rows.size(); ++j) {
              double dd = 0;
              for (int d = 0; d < D; ++d)
                dd += qb[static_cast<std::size_t>(qh * D + d)] * rows[j][static_cast<std::size_t>(d)];
              w[j] = dd / std::sqrt(static_cast<double>(D));
              mx = std::max(mx, w[j]);
            }
            double z = 0;
            for (double& x : w) z += (x = std::exp(x - mx));
            for (int d = 0; d < D; ++d) {
              double acc = 0;
              for (std::size_t j = 0; j < rows.size(); ++j)
                acc += w[j] / z * hv[static_cast<std::size_t>(s)][j][static_cast<std::size_t>(d)];
              const double got = out[static_cast<std::size_t>((b * Hq + qh) * D + d)];
              worst = std::max(worst, std::abs(got - acc));
              mag = std::max(mag, std::abs(acc));
            }
          }
          INFO("step " << t << " stream " << s);
          CHECK(worst <= 2e-3 * std::max(mag, 1e-3));
        }
      }
    }
    REQUIRE(cache->end_step(seqs).is_ok());
    if (t == cap - 1) {
      // The compression ran: compare with the model, then replace the host rows by the kept.
      for (int b = 0; b < B; ++b) {
        for (int l = 0; l < L; ++l) {
          const auto& queries = hq[static_cast<std::size_t>(b * L + l)];
          for (int h = 0; h < H; ++h) {
            const int s = (b * L + l) * H + h;
            std::vector<std::vector<double>> wq;
            std::vector<int> widx;
            for (int g = 0; g < G; ++g) {
              for (int w = 0; w < o.window; ++w) {
                const int idx = cap - o.window + w;
                std::vector<double> row(static_cast<std::size_t>(D));
                for (int d = 0; d < D; ++d)
                  row[static_cast<std::size_t>(d)] =
                      queries[static_cast<std::size_t>(idx)][static_cast<std::size_t>((h * G + g) * D + d)];
                wq.push_back(row);
                widx.push_back(idx);
              }
            }
            const std::vector<int> want = reference_keep(hk[static_cast<std::size_t>(s)], wq, widx, o);
            std::vector<std::int32_t> got;
            REQUIRE(cache->kept_indices(b, l, h, got).is_ok());
            REQUIRE(static_cast<int>(got.size()) == o.budget);
            INFO("sequence " << b << " layer " << l << " head " << h);
            CHECK(std::is_sorted(got.begin(), got.end()));
            for (int w = 0; w < o.window; ++w)
              CHECK(got[static_cast<std::size_t>(o.budget - o.window + w)] == cap - o.window + w);
            std::vector<int> common;
            std::set_intersection(got.begin(), got.end(), want.begin(), want.end(), std::back_inserter(common));
            CHECK(static_cast<int>(common.size()) >= o.budget - 2);
            // The pages hold exactly the kept rows, in order.
            std::vector<std::uint16_t> k, v;
            REQUIRE(cache->read_stream(b, l, h, k, v).is_ok());
            REQUIRE(static_cast<int>(k.size()) == o.budget * D);
            int mismatched = 0;
            std::vector<std::vector<double>> nk, nv;
            for (int t2 = 0; t2 < o.budget; ++t2) {
              const int j = got[static_cast<std::size_t>(t2)];
              for (int d = 0; d < D; ++d) {
                mismatched += decode_bf16(k[static_cast<std::size_t>(t2 * D + d)]) !=
                              hk[static_cast<std::size_t>(s)][static_cast<std::size_t>(j)][static_cast<std::size_t>(d)];
                mismatched += decode_bf16(v[static_cast<std::size_t>(t2 * D + d)]) !=
                              hv[static_cast<std::size_t>(s)][static_cast<std::size_t>(j)][static_cast<std::size_t>(d)];
              }
              nk.push_back(hk[static_cast<std::size_t>(s)][static_cast<std::size_t>(j)]);
              nv.push_back(hv[static_cast<std::size_t>(s)][static_cast<std::size_t>(j)]);
            }
            CHECK(mismatched == 0);
            hk[static_cast<std::size_t>(s)] = nk;
            hv[static_cast<std::size_t>(s)] = nv;
          }
        }
        CHECK(cache->stored(b) == o.budget);
      }
      CHECK(cache->stats().eviction_calls == B);
      CHECK(cache->stats().tokens_evicted == static_cast<std::int64_t>(B) * L * H * o.buffer);
    }
  }
  CHECK(cache->position(0) == steps);
  cache.reset();
  cudaStreamDestroy(stream);
}

TEST_CASE("R-KV baseline refuses bad options naming them", "[rkv][bad_input]") {
  ThinKvConfig shape;
  shape.num_sequences = 1;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.num_q_heads = 4;
  shape.head_dim = 64;
  std::unique_ptr<bench::RkvCache> cache;
  bench::RkvOptions o;
  o.budget = 1000;  // not a multiple of 16
  const Status s = bench::RkvCache::create(shape, o, cache);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("budget 1000") != std::string::npos);
  o = {};
  o.kernel = 6;
  CHECK(bench::RkvCache::create(shape, o, cache).code() == StatusCode::kInvalidArgument);
  shape.head_dim = 96;
  CHECK(bench::RkvCache::create(shape, {}, cache).message().find("head_dim 96") != std::string::npos);
  CHECK(cache == nullptr);
}
