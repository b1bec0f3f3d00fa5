// GPU test: tensor parallelism of the device cache. A model's KV heads are split over two ranks,
// each a ThinKvCache over CudaKvBackend holding its slice (2 of 4 KV heads, 4 of 8 query heads)
// on its own stream and thread (one GPU here: what a rank does on its own GPU), driven by the
// batched calls with device tensors, the thought signal summed over the ranks through
// set_signal_reduction (an in-process all-reduce; NCCL's across GPUs). Against the unsharded
// device cache fed the same K/V/Q, every rank must take the same decisions exactly (the thought
// after every step, the positions each of its streams holds at the end) and give its heads'
// attention outputs within the decode kernel's tolerance ((1e-5 + 16 sqrt(n) 2^-24) max|ref| +
// 1e-6, tests/kernels/test_paged_attention.cpp says why; the launch shape may differ with the
// head count). The control: a rank whose signal is its own heads' alone (no all-reduce) decides
// otherwise on these inputs, so the test can see a missing reduction.

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../unit/local_all_reduce.hpp"
#include "../unit/sequence_test_util.hpp"
#include "../unit/test_util.hpp"
#include "thinkv/backend/cuda_backend.hpp"
#include "thinkv/thinkv_cache.hpp"

using namespace thinkv;

namespace {

constexpr int kSeqs = 3, kLayers = 2, kKvHeads = 4, kQHeads = 8, kDim = 64;

ThinKvConfig config(int ranks, int rank) {
  ThinKvConfig c;
  c.num_sequences = kSeqs;
  c.num_layers = kLayers;
  c.num_kv_heads = kKvHeads / ranks;
  c.num_q_heads = kQHeads / ranks;
  c.model_kv_heads = kKvHeads;
  c.kv_head_offset = rank * c.num_kv_heads;
  c.head_dim = kDim;
  c.group_size = 16;
  c.block_size = 16;
  c.max_tokens = 800;
  c.segment_len = 64;
  c.token_budget = 160;
  return c;
}

ThinKvPolicy policy() {
  ThinKvPolicy p;
  p.retention = RetentionSchedule({32, 16, 8, 4});
  p.precision = kR4E4T2;
  p.classifier = ThoughtClassifier::three_types(0.3f, 0.6f, {0, 1}, 64, 2);
  return p;
}

/// Per step, per sequence, per layer: K, V of all KV heads and Q of all query heads.
struct Inputs {
  int steps = 0;
  std::vector<float> k, v, q;
  [[nodiscard]] std::size_t at(int t, int s, int l) const {
    return (static_cast<std::size_t>(t) * kSeqs + static_cast<std::size_t>(s)) * kLayers + static_cast<std::size_t>(l);
  }
};

struct Trace {
  std::vector<ThoughtType> types;            // per step and sequence, the thought after the step
  std::vector<float> out;                    // per step, layer, sequence: this rank's heads' outputs
  std::vector<std::set<std::int32_t>> held;  // at the end, per sequence and stream
  std::int64_t evicted = 0;
};

/// Runs the steps on a cache holding KV heads [k0, k0 + kh) and query heads [q0, q0 + qh).
std::string run(ThinKvCache<CudaKvBackend>& cache, const Inputs& in, int k0, int q0, Trace& tr) {
  const int kh = cache.config().num_kv_heads, qh = cache.config().num_q_heads, d = kDim;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return "cudaStreamCreate";
  if (Status s = cache.backend().set_stream(stream); !s.is_ok()) return s.to_string();
  const std::size_t kvn = static_cast<std::size_t>(kSeqs * kh * d), qn = static_cast<std::size_t>(kSeqs * qh * d);
  float *dk = nullptr, *dv = nullptr, *dq = nullptr, *dout = nullptr;
  std::string err;
  if (cudaMalloc(&dk, kvn * 4) != cudaSuccess || cudaMalloc(&dv, kvn * 4) != cudaSuccess ||
      cudaMalloc(&dq, qn * 4) != cudaSuccess || cudaMalloc(&dout, qn * 4) != cudaSuccess) {
    err = "cudaMalloc";
  }
  std::vector<float> hk(kvn), hv(kvn), hq(qn), hout(qn);
  const int seqs[kSeqs] = {0, 1, 2};
  const std::size_t KV = static_cast<std::size_t>(kKvHeads * d), Q = static_cast<std::size_t>(kQHeads * d);
  for (int t = 0; err.empty() && t < in.steps; ++t) {
    if (Status s = cache.begin_step(seqs); !s.is_ok()) {
      err = "begin_step: " + s.to_string();
      break;
    }
    for (int l = 0; err.empty() && l < kLayers; ++l) {
      for (int s = 0; s < kSeqs; ++s) {
        const std::size_t i = in.at(t, s, l);
        std::copy_n(in.k.begin() + static_cast<std::ptrdiff_t>(i * KV + static_cast<std::size_t>(k0 * d)), kh * d,
                    hk.begin() + s * kh * d);
        std::copy_n(in.v.begin() + static_cast<std::ptrdiff_t>(i * KV + static_cast<std::size_t>(k0 * d)), kh * d,
                    hv.begin() + s * kh * d);
        std::copy_n(in.q.begin() + static_cast<std::ptrdiff_t>(i * Q + static_cast<std::size_t>(q0 * d)), qh * d,
                    hq.begin() + s * qh * d);
      }
      std::fill(hout.begin(), hout.end(), NAN);
      if (cudaMemcpyAsync(dk, hk.data(), kvn * 4, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
          cudaMemcpyAsync(dv, hv.data(), kvn * 4, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
          cudaMemcpyAsync(dq, hq.data(), qn * 4, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
          cudaMemcpyAsync(dout, hout.data(), qn * 4, cudaMemcpyHostToDevice, stream) != cudaSuccess) {
        err = "cudaMemcpyAsync";
        break;
      }
      if (Status s = cache.append_batch(l, seqs, TensorRef{dk, ElementType::kF32}, TensorRef{dv, ElementType::kF32});
          !s.is_ok()) {
        err = "append_batch: " + s.to_string();
        break;
      }
      if (Status s =
              cache.attend_batch(l, seqs, TensorRef{dq, ElementType::kF32}, MutableTensorRef{dout, ElementType::kF32});
          !s.is_ok()) {
        err = "attend_batch: " + s.to_string();
        break;
      }
      if (cudaMemcpyAsync(hout.data(), dout, qn * 4, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
          cudaStreamSynchronize(stream) != cudaSuccess) {
        err = "cudaMemcpyAsync back";
        break;
      }
      tr.out.insert(tr.out.end(), hout.begin(), hout.end());
    }
    if (!err.empty()) break;
    if (Status s = cache.end_step(seqs); !s.is_ok()) {
      err = "end_step: " + s.to_string();
      break;
    }
    for (int s = 0; s < kSeqs; ++s) tr.types.push_back(cache.tracker(s).current());
  }
  if (err.empty()) {
    if (Status s = cache.settle(); !s.is_ok()) err = "settle: " + s.to_string();
  }
  if (err.empty()) {
    for (int s = 0; s < kSeqs; ++s) {
      for (auto& h : tt::held_positions(cache, s)) tr.held.push_back(std::move(h));
    }
    tr.evicted = cache.stats().tokens_evicted;
  }
  (void)cudaStreamSynchronize(stream);
  for (float* p : {dk, dv, dq, dout}) {
    if (p != nullptr) (void)cudaFree(p);
  }
  (void)cudaStreamDestroy(stream);
  return err;
}

}  // namespace

TEST_CASE("Tensor parallelism on the GPU: two ranks' device caches, the signal all-reduced, decide as one cache",
          "[cuda_tensor_parallel]") {
  TT_SEEDED_RNG();
  const int ranks = 2;
  Inputs in;
  in.steps = tt::small_run() ? 200 : 420;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.2f, 4.0f);
  const std::size_t n = static_cast<std::size_t>(in.steps) * kSeqs * kLayers;
  in.k.resize(n * kKvHeads * kDim);
  in.v.resize(in.k.size());
  in.q.resize(n * kQHeads * kDim);
  for (float& x : in.k) x = nd(rng);
  for (float& x : in.v) x = nd(rng);
  // Queries of one scale per 64-step window and sequence: the scale sets the attention's
  // sparsity, hence the thought, and differs by head so that no rank's heads alone say it.
  for (int t = 0; t < in.steps; ++t) {
    for (int s = 0; s < kSeqs; ++s) {
      std::mt19937_64 w(tt::base_seed() ^ (static_cast<std::uint64_t>(t / 64) * 131 + static_cast<std::uint64_t>(s)));
      float hs[kQHeads];
      for (float& h : hs) h = scale(w);
      for (int l = 0; l < kLayers; ++l) {
        float* q = in.q.data() + in.at(t, s, l) * kQHeads * kDim;
        for (int h = 0; h < kQHeads; ++h) {
          for (int i = 0; i < kDim; ++i) q[h * kDim + i] = hs[h] * nd(rng);
        }
      }
    }
  }
  Trace want;
  {
    ThinKvCache<CudaKvBackend> one(config(1, 0), policy());
    const std::string e = run(one, in, 0, 0, want);
    INFO(e);
    REQUIRE(e.empty());
  }
  std::printf("unsharded: %lld tokens evicted\n", static_cast<long long>(want.evicted));
  REQUIRE(want.evicted > 0);
  std::set<ThoughtType> seen(want.types.begin(), want.types.end());
  CHECK(seen.size() >= 2);

  for (const bool reduce : {true, false}) {
    INFO((reduce ? "signal all-reduced" : "control: each rank's own heads' signal"));
    Trace got[ranks];
    std::string failed[ranks];
    tt::LocalAllReduce all_reduce(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        ThinKvCache<CudaKvBackend> c(config(ranks, r), policy());
        if (reduce) {
          const Status s = c.set_signal_reduction(kQHeads, [&, r](std::span<double> x) { return all_reduce(r, x); });
          if (!s.is_ok()) {
            failed[r] = s.to_string();
            return;
          }
        }
        failed[r] = run(c, in, r * (kKvHeads / ranks), r * (kQHeads / ranks), got[r]);
      });
    }
    for (std::thread& t : threads) t.join();
    int types_differ = 0;
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r << ": " << failed[r]);
      REQUIRE(failed[r].empty());
      REQUIRE(got[r].types.size() == want.types.size());
      for (std::size_t i = 0; i < want.types.size(); ++i) types_differ += got[r].types[i] != want.types[i] ? 1 : 0;
    }
    if (!reduce) {
      std::printf("control (no all-reduce): %d thoughts differ from the unsharded cache's\n", types_differ);
      CHECK(types_differ > 0);
      continue;
    }
    CHECK(types_differ == 0);
    // Each rank's streams are the unsharded cache's streams of its heads, in stream order
    // (layer-major, then KV head).
    const int kh = kKvHeads / ranks, qh = kQHeads / ranks;
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r);
      int held_differ = 0;
      for (int s = 0; s < kSeqs; ++s) {
        for (int l = 0; l < kLayers; ++l) {
          for (int h = 0; h < kh; ++h) {
            const auto& mine = got[r].held[static_cast<std::size_t>((s * kLayers + l) * kh + h)];
            const auto& ref = want.held[static_cast<std::size_t>((s * kLayers + l) * kKvHeads + r * kh + h)];
            held_differ += mine != ref ? 1 : 0;
          }
        }
      }
      CHECK(held_differ == 0);
      CHECK(got[r].evicted * ranks == want.evicted);
      // Outputs: per step and layer, [kSeqs, qh, d] against the unsharded [kSeqs, kQHeads, d].
      double worst = 0.0;
      int over = 0;
      std::int64_t bitwise_same = 0, values = 0;
      const std::size_t per_rank = static_cast<std::size_t>(kSeqs * qh * kDim);
      const std::size_t per_one = static_cast<std::size_t>(kSeqs * kQHeads * kDim);
      for (std::size_t blk = 0; blk < got[r].out.size() / per_rank; ++blk) {
        const int t = static_cast<int>(blk / kLayers);
        for (int s = 0; s < kSeqs; ++s) {
          double mx = 0.0, diff = 0.0;
          for (int h = 0; h < qh; ++h) {
            for (int i = 0; i < kDim; ++i) {
              const float a = got[r].out[blk * per_rank + static_cast<std::size_t>((s * qh + h) * kDim + i)];
              const float b = want.out[blk * per_one + static_cast<std::size_t>((s * kQHeads + r * qh + h) * kDim + i)];
              mx = std::max(mx, std::fabs(static_cast<double>(b)));
              diff = std::max(diff, std::fabs(static_cast<double>(a) - b));
              bitwise_same += a == b ? 1 : 0;
              ++values;
            }
          }
          const double tol = (1e-5 + 16.0 * std::sqrt(static_cast<double>(t + 1)) * 0x1p-24) * mx + 1e-6;
          worst = std::max(worst, diff / std::max(mx, 1e-30));
          over += diff > tol ? 1 : 0;
        }
      }
      std::printf(
          "rank %d: worst |out - unsharded| / max|out| %.3g, %d rows over the tolerance, %lld/%lld values "
          "bit for bit\n",
          r, worst, over, static_cast<long long>(bitwise_same), static_cast<long long>(values));
      CHECK(over == 0);
    }
  }
}
