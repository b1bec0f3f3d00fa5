// GPU test: paged decode attention (thinkv::kernels::launch_paged_decode_attention) against the
// CPU reference PagedKvCache::attend. Fresh random inputs per run (seed printed; THINKV_TEST_SEED
// pins it): random thought types per group, random evictions followed by in-place reuse, staged
// tokens left in every stream; output and sparsity poisoned (NaN) before the launch.
//
// Tolerances.
//  - Output: max |gpu - cpu| <= (1e-5 + 16 sqrt(n) 2^-24) * max|cpu| + 1e-6 per case, n the
//    largest number of tokens a query head attends. Both sides dequantize K/V to the same values
//    (the GPU's bit placement of E4M3/E2M1 into FP16 is exact); the GPU's main pass computes the
//    scores with FP32 FMA in its own channel order (a few ulps from the CPU's sequential sum,
//    relative to sum |q_c k_c|), an online split-K softmax in base 2 (exp2f), FMA in P.V; the CPU
//    a two-pass softmax summing all n terms in sequence. The sequential FP32 sums of n terms
//    carry a rounding error that grows like sqrt(n) eps for random data (n eps in the worst
//    case): a flat 1e-5 failed once at n = 1867 (err 1.25e-5 of max|out|, seed 2618322956). The
//    bound stays ~10x below what one dropped or extra token changes (~1/n of max|out|). The
//    measured worst ratio err / max|cpu| is printed per case.
//  - Sparsity: the sparsity passes (separate from the main pass) recompute the scores
//    bit-identically by construction (channels summed in order with __fmul_rn/__fadd_rn on the GPU; the host reference
//    is compiled as ISO C++ without -march, so no FMA contraction either) and the max is order-independent, so the
//    counts should be exactly equal. The test still allows a difference of at most the number of tokens whose s - m
//    lies within 4 ulps of the threshold (computed here from the CPU's own scores), and prints both the observed
//    difference and that count, so an exactness regression shows.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device_cache_upload.hpp"
#include "cuda_check.hpp"
#include "thinkv/kernels/format_kernels.hpp"
#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/thinkv.hpp"

namespace {

int failures = 0;

#define CHECK_OK(expr)                                                                         \
  do {                                                                                         \
    thinkv::Status s_ = (expr);                                                                \
    if (!s_.is_ok()) {                                                                         \
      std::printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #expr, s_.to_string().c_str()); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct Case {
  const char* name;
  int head_dim, group_size, block_size, num_q_heads, num_kv_heads, layers;
  thinkv::PrecisionMap map;
  int min_tokens, max_tokens;
  float q_spread;               // scales queries: larger = peakier softmax, more sparse tokens
  float softmax_scale;          // 0 = 1/sqrt(head_dim)
  int num_splits = 0;           // split-K chunks per KV head (0 = automatic)
  float v_scale = 1.0f;         // scales values: far from 1, the FP16 pass changes its output unit
  long long max_positions = 0;  // split-plan hint: 0 none, -1 the longest stream's true positions, else this value
  bool bad_streams = false;     // also relaunch with out-of-range stream ids for the first and last KV heads
};

/// Number of representable floats between a and b (a, b finite).
long ulp_distance(float a, float b) {
  auto key = [](float x) {
    std::int32_t i;
    std::memcpy(&i, &x, 4);
    return i < 0 ? static_cast<long>(std::int32_t{INT32_MIN}) - i : static_cast<long>(i);
  };
  return std::labs(key(a) - key(b));
}

thinkv::ThoughtType random_thought(std::mt19937& rng) {
  return static_cast<thinkv::ThoughtType>(std::uniform_int_distribution<int>(0, 2)(rng));
}

/// Appends `n` tokens to a stream: thought types change only at group boundaries.
void append_tokens(thinkv::PagedKvCache<>& cache, int stream, int n, std::mt19937& rng, float v_scale = 1.0f) {
  const int d = cache.config().head_dim;
  const int g = cache.config().group_size;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
  thinkv::ThoughtType t = random_thought(rng);
  for (int i = 0; i < n; ++i) {
    const int staged = cache.table().staged_count(stream);
    if (staged == 0 && (rng() % 3 == 0)) t = random_thought(rng);
    if (staged > 0) t = cache.table().staged_thought(stream);
    const float amp = 0.5f + static_cast<float>(rng() % 4);  // varying magnitudes across tokens
    for (int c = 0; c < d; ++c) {
      k[static_cast<std::size_t>(c)] = nd(rng) * amp;
      v[static_cast<std::size_t>(c)] = nd(rng) * amp * v_scale;
    }
    CHECK_OK(cache.append(stream, k, v, t));
  }
  (void)g;
}

void evict_random(thinkv::PagedKvCache<>& cache, int stream, double share, std::mt19937& rng) {
  auto live = cache.table().live_slot_list(stream);
  std::shuffle(live.begin(), live.end(), rng);
  live.resize(static_cast<std::size_t>(static_cast<double>(live.size()) * share));
  CHECK_OK(cache.evict(stream, live));
}

void run_case(const Case& cs, std::mt19937& rng) {
  using namespace thinkv;
  const int d = cs.head_dim;
  const int streams = cs.layers * cs.num_kv_heads;
  CacheConfig cfg;
  cfg.num_streams = streams;
  cfg.head_dim = d;
  cfg.group_size = cs.group_size;
  cfg.block_size = cs.block_size;
  cfg.precision = cs.map;
  const int blocks = streams * (2 * cs.max_tokens / cs.block_size + 8);
  for (int p = 0; p < kNumPrecisions; ++p) cfg.pool_blocks[p] = cs.map.uses(static_cast<Precision>(p)) ? blocks : 0;
  PagedKvCache<> cache(cfg);

  // Fill, evict part, refill (evicted slots are reused in place), leave some tokens staged.
  // THINKV_TEST_SMALL (set by bench/run_gpu_suite.sh under compute-sanitizer): 1/4 the tokens.
  const int div = std::getenv("THINKV_TEST_SMALL") != nullptr ? 4 : 1;
  std::uniform_int_distribution<int> ntok(cs.min_tokens / div, cs.max_tokens / div);
  for (int s = 0; s < streams; ++s) {
    if (cs.max_tokens == 0) {  // staged tokens only: no block at all
      append_tokens(cache, s, 1 + static_cast<int>(rng() % (cs.group_size - 1)), rng, cs.v_scale);
      continue;
    }
    append_tokens(cache, s, ntok(rng), rng, cs.v_scale);
    evict_random(cache, s, 0.3 + 0.4 * std::uniform_real_distribution<double>(0, 1)(rng), rng);
    append_tokens(cache, s, ntok(rng) / 2 + 1, rng, cs.v_scale);
    evict_random(cache, s, 0.1, rng);
    const int staged = cache.table().staged_count(s);
    append_tokens(cache, s,
                  (cs.group_size - staged) % cs.group_size + 1 + static_cast<int>(rng() % (cs.group_size - 1)), rng,
                  cs.v_scale);
  }
  std::int64_t reused = cache.table().stats().slots_reused;

  // One layer's KV heads, in a shuffled order of streams from a random layer.
  const int layer = static_cast<int>(rng() % cs.layers);
  std::vector<std::int32_t> kv_streams(static_cast<std::size_t>(cs.num_kv_heads));
  for (int h = 0; h < cs.num_kv_heads; ++h) kv_streams[static_cast<std::size_t>(h)] = layer * cs.num_kv_heads + h;
  std::shuffle(kv_streams.begin(), kv_streams.end(), rng);

  std::normal_distribution<float> nd(0.0f, cs.q_spread);
  std::vector<float> q(static_cast<std::size_t>(cs.num_q_heads) * d);
  for (auto& x : q) x = nd(rng);
  std::vector<float> want(q.size()), want_sp(static_cast<std::size_t>(cs.num_q_heads));
  DecodeAttentionArgs args;
  args.num_q_heads = cs.num_q_heads;
  args.num_kv_heads = cs.num_kv_heads;
  args.kv_streams = kv_streams.data();
  args.q = q.data();
  args.out = want.data();
  args.sparsity = want_sp.data();
  args.softmax_scale = cs.softmax_scale;
  CHECK_OK(cache.attend(args));

  // Tokens within 4 ulps of the sparsity threshold, from the CPU's own scores.
  const float scale = cs.softmax_scale > 0.0f ? cs.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  const int group = cs.num_q_heads / cs.num_kv_heads;
  std::vector<int> near(static_cast<std::size_t>(cs.num_q_heads), 0), ntokens(near.size(), 0);
  for (int h = 0; h < cs.num_kv_heads; ++h) {
    std::vector<float> k, v;
    std::vector<thinkv::StreamView> svs;
    const thinkv::AttendView av =
        cache.table().attend_view(std::span<const std::int32_t>(&kv_streams[static_cast<std::size_t>(h)], 1), svs);
    CHECK_OK(cache.backend().gather(av, av.streams[0], k, v));
    const int n = static_cast<int>(k.size()) / d;
    for (int r = 0; r < group; ++r) {
      const int qh = h * group + r;
      std::vector<float> sc(static_cast<std::size_t>(n));
      float m = -INFINITY;
      for (int j = 0; j < n; ++j) {
        float s = 0.0f;
        for (int c = 0; c < d; ++c)
          s += q[static_cast<std::size_t>(qh) * d + c] * k[static_cast<std::size_t>(j) * d + c];
        sc[static_cast<std::size_t>(j)] = s * scale;
        m = std::fmax(m, sc[static_cast<std::size_t>(j)]);
      }
      for (int j = 0; j < n; ++j)
        near[static_cast<std::size_t>(qh)] +=
            ulp_distance(sc[static_cast<std::size_t>(j)] - m, kSparsityLogThreshold) <= 4;
      ntokens[static_cast<std::size_t>(qh)] = n;
    }
  }

  test::DeviceCacheUpload up;
  CHECK_CUDA(up.upload(cache));
  float *dq = nullptr, *dout = nullptr, *dsp = nullptr;
  std::int32_t* dstreams = nullptr;
  CHECK_CUDA(cudaMalloc(&dq, q.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dout, q.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dsp, want_sp.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dstreams, kv_streams.size() * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dstreams, kv_streams.data(), kv_streams.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xFF, q.size() * sizeof(float)));  // poison: NaN
  CHECK_CUDA(cudaMemset(dsp, 0xFF, want_sp.size() * sizeof(float)));
  kernels::DecodeAttentionParams prm;
  prm.num_q_heads = cs.num_q_heads;
  prm.num_kv_heads = cs.num_kv_heads;
  prm.head_dim = d;
  prm.group_size = cs.group_size;
  prm.block_size = cs.block_size;
  prm.streams = dstreams;
  prm.q = dq;
  prm.out = dout;
  prm.sparsity = dsp;
  prm.softmax_scale = cs.softmax_scale;
  prm.num_splits = cs.num_splits;
  prm.max_positions = cs.max_positions;
  if (cs.max_positions < 0) {  // the true hint: the longest of this launch's streams
    prm.max_positions = 0;
    for (const std::int32_t s : kv_streams) {
      const long long pos =
          static_cast<long long>(cache.table().blocks(s).size()) * cs.block_size + cache.table().staged_count(s);
      prm.max_positions = std::max(prm.max_positions, pos);
    }
  }
  // Workspace: exactly the size asked for, poisoned (NaN) so no stale partial can pass.
  const std::size_t ws_bytes = kernels::paged_decode_attention_workspace_size(prm);
  void* dws = nullptr;
  CHECK_CUDA(cudaMalloc(&dws, ws_bytes));
  CHECK_CUDA(cudaMemset(dws, 0xFF, ws_bytes));
  prm.workspace = dws;
  const int splits = kernels::paged_decode_attention_splits(prm);
  CHECK_CUDA(kernels::launch_paged_decode_attention(up.view(), prm, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> got(q.size()), got_sp(want_sp.size());
  CHECK_CUDA(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_sp.data(), dsp, got_sp.size() * sizeof(float), cudaMemcpyDeviceToHost));

  // And once more without sparsity over the same chunks (the one-pass path; one chunk: the main
  // pass writes the output, no merge): same output bits expected.
  CHECK_CUDA(cudaMemset(dout, 0xFF, q.size() * sizeof(float)));
  CHECK_CUDA(cudaMemset(dws, 0xFF, ws_bytes));
  prm.sparsity = nullptr;
  const int case_num_splits = prm.num_splits;  // 0: automatic
  prm.num_splits = splits;
  CHECK_CUDA(kernels::launch_paged_decode_attention(up.view(), prm, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> got2(q.size());
  CHECK_CUDA(cudaMemcpy(got2.data(), dout, got2.size() * sizeof(float), cudaMemcpyDeviceToHost));
  // Without sparsity the automatic plan may take fewer chunks (one chunk needs no merge): that
  // launch, in a workspace sized for the sparsity launch (the plan never takes more chunks without
  // it), is checked against the reference below like the first.
  prm.num_splits = case_num_splits;
  const int splits_nosp = kernels::paged_decode_attention_splits(prm);
  std::vector<float> got4;
  if (splits_nosp != splits) {
    if (kernels::paged_decode_attention_workspace_size(prm) > ws_bytes) {
      std::printf("FAIL %s: the plan without sparsity needs a larger workspace\n", cs.name);
      ++failures;
    } else {
      CHECK_CUDA(cudaMemset(dout, 0xFF, q.size() * sizeof(float)));
      CHECK_CUDA(cudaMemset(dws, 0xFF, ws_bytes));
      CHECK_CUDA(kernels::launch_paged_decode_attention(up.view(), prm, nullptr));
      CHECK_CUDA(cudaDeviceSynchronize());
      got4.resize(q.size());
      CHECK_CUDA(cudaMemcpy(got4.data(), dout, got4.size() * sizeof(float), cudaMemcpyDeviceToHost));
    }
  }

  double max_ref = 0.0, max_err = 0.0;
  bool finite = true;
  int same_bits = 1;
  for (std::size_t i = 0; i < want.size(); ++i) {
    finite = finite && std::isfinite(got[i]);
    max_ref = std::fmax(max_ref, std::fabs(static_cast<double>(want[i])));
    max_err = std::fmax(max_err, std::fabs(static_cast<double>(got[i]) - want[i]));
    same_bits &= std::memcmp(&got[i], &got2[i], 4) == 0;
    if (!got4.empty()) {
      finite = finite && std::isfinite(got4[i]);
      max_err = std::fmax(max_err, std::fabs(static_cast<double>(got4[i]) - want[i]));
    }
  }
  int n_max = 1;
  for (int n : ntokens) n_max = std::max(n_max, n);
  const double tol = (1e-5 + 16.0 * std::sqrt(static_cast<double>(n_max)) * 0x1p-24) * max_ref + 1e-6 * cs.v_scale;
  int sp_diff_max = 0, near_max = 0, sp_bad = 0, sparse_total = 0;
  for (int h = 0; h < cs.num_q_heads; ++h) {
    const int n = ntokens[static_cast<std::size_t>(h)];
    const int want_c = static_cast<int>(std::lround(want_sp[static_cast<std::size_t>(h)] * n));
    const int got_c = static_cast<int>(std::lround(got_sp[static_cast<std::size_t>(h)] * n));
    const int diff = std::abs(want_c - got_c);
    sparse_total += want_c;
    sp_diff_max = std::max(sp_diff_max, diff);
    near_max = std::max(near_max, near[static_cast<std::size_t>(h)]);
    sp_bad += !std::isfinite(got_sp[static_cast<std::size_t>(h)]) || diff > near[static_cast<std::size_t>(h)];
    // Equal counts must give the very same float (same division on both sides).
    if (diff == 0 && got_sp[static_cast<std::size_t>(h)] != want_sp[static_cast<std::size_t>(h)]) ++sp_bad;
  }
  // Out-of-range stream ids (the kernel's documented contract: NaN output rows and NaN sparsity for
  // those KV heads' query heads; every other head bit for bit as before).
  int bad_stream_fail = 0;
  if (cs.bad_streams) {
    std::vector<std::int32_t> bad_ids = kv_streams;
    const int nkv = cs.num_kv_heads;
    bad_ids.front() = static_cast<std::int32_t>(cache.config().num_streams + 3);
    if (nkv > 1) bad_ids.back() = -1;
    CHECK_CUDA(cudaMemcpy(dstreams, bad_ids.data(), bad_ids.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xFF, q.size() * sizeof(float)));
    CHECK_CUDA(cudaMemset(dsp, 0x00, want_sp.size() * sizeof(float)));  // poison: 0, not NaN
    CHECK_CUDA(cudaMemset(dws, 0xFF, ws_bytes));
    prm.sparsity = dsp;
    CHECK_CUDA(kernels::launch_paged_decode_attention(up.view(), prm, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> got3(q.size()), got3_sp(want_sp.size());
    CHECK_CUDA(cudaMemcpy(got3.data(), dout, got3.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got3_sp.data(), dsp, got3_sp.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (int h = 0; h < nkv; ++h) {
      const bool bad_h = h == 0 || (nkv > 1 && h == nkv - 1);
      for (int r = 0; r < group; ++r) {
        const int qh = h * group + r;
        const float sp = got3_sp[static_cast<std::size_t>(qh)];
        bad_stream_fail += bad_h ? !std::isnan(sp) : std::memcmp(&sp, &got_sp[static_cast<std::size_t>(qh)], 4) != 0;
        for (int c = 0; c < d; ++c) {
          const std::size_t i = static_cast<std::size_t>(qh) * d + c;
          bad_stream_fail += bad_h ? !std::isnan(got3[i]) : std::memcmp(&got3[i], &got[i], 4) != 0;
        }
      }
    }
    std::printf(
        "%s %-34s out-of-range stream ids for KV heads 0 and %d: NaN rows there, the rest unchanged (%d mismatches)\n",
        bad_stream_fail == 0 ? "ok  " : "FAIL", cs.name, nkv - 1, bad_stream_fail);
  }
  const bool ok = finite && max_err <= tol && sp_bad == 0 && same_bits && bad_stream_fail == 0;
  std::printf(
      "%s %-34s map=%-7s splits=%-3d (%-3d without sparsity) tokens/head~%d reused=%lld  max|err|=%.3g (%.3g of "
      "max|out| %.3g, tol %.3g)"
      "  sparsity: %d sparse, max count diff %d (near-threshold allowance %d)%s\n",
      ok ? "ok  " : "FAIL", cs.name, cs.map.to_string().c_str(), splits, splits_nosp, ntokens[0],
      static_cast<long long>(reused), max_err, max_err / max_ref, max_ref, tol, sparse_total, sp_diff_max, near_max,
      same_bits ? "" : "  [output differs with sparsity off]");
  failures += !ok;
  CHECK_CUDA(cudaFree(dq));
  CHECK_CUDA(cudaFree(dout));
  CHECK_CUDA(cudaFree(dsp));
  CHECK_CUDA(cudaFree(dstreams));
  CHECK_CUDA(cudaFree(dws));
}

/// Parameters the launcher must refuse before launching anything.
void check_refusals() {
  using namespace thinkv::kernels;
  float dummy_f[1] = {};
  std::int32_t dummy_i[1] = {};
  std::uint8_t dummy_b[1] = {};
  std::uint16_t dummy_h[1] = {};
  std::uint32_t dummy_u[1] = {};
  std::uint64_t dummy_w[1] = {};
  PagedKvView v;
  v.num_streams = 1;
  v.pages[0] = dummy_b;
  v.pool_count[0] = 1;
  v.total_blocks = 1;
  v.pool_base[1] = v.pool_base[2] = v.pool_base[3] = 1;  // PoolMap: consecutive pools
  v.s2 = dummy_f;
  v.block_fill = dummy_h;
  v.evict_mask = dummy_w;
  v.slot_record = dummy_u;
  v.block_indptr = dummy_i;
  v.block_indices = dummy_u;
  v.staging = dummy_h;
  v.staged_count = dummy_i;
  DecodeAttentionParams good;
  good.num_q_heads = 4;
  good.num_kv_heads = 2;
  good.head_dim = 64;
  good.group_size = 16;
  good.block_size = 16;
  good.streams = dummy_i;
  good.q = dummy_f;
  good.out = dummy_f;
  alignas(16) static float dummy_ws[4] = {};
  good.workspace = dummy_ws;
  int bad = 0;
  if (check_paged_decode_attention(v, good) != cudaSuccess) {
    std::printf("FAIL valid parameters refused\n");
    ++bad;
  }
  auto refuse = [&](const char* what, auto mutate) {
    DecodeAttentionParams p = good;
    PagedKvView vv = v;
    mutate(p, vv);
    const cudaError_t e = launch_paged_decode_attention(vv, p, nullptr);
    if (e != cudaErrorInvalidValue) {
      std::printf("FAIL refusal: %s -> %s\n", what, cudaGetErrorString(e));
      ++bad;
    }
  };
  refuse("head_dim 96", [](auto& p, auto&) { p.head_dim = 96; });
  refuse("head_dim 48", [](auto& p, auto&) { p.head_dim = 48; });
  refuse("group_size 4", [](auto& p, auto&) { p.group_size = 4; });
  refuse("group_size 16 with head_dim 8", [](auto& p, auto&) { p.head_dim = 8; });
  refuse("block_size 0", [](auto& p, auto&) { p.block_size = 0; });
  refuse("block_size 4097", [](auto& p, auto&) { p.block_size = 4097; });
  refuse("num_q_heads 3 over 2", [](auto& p, auto&) { p.num_q_heads = 3; });
  refuse("18 q heads per kv head", [](auto& p, auto&) { p.num_q_heads = 36; });
  refuse("num_kv_heads 0", [](auto& p, auto&) { p.num_kv_heads = 0; });
  refuse("negative scale", [](auto& p, auto&) { p.softmax_scale = -1.0f; });
  refuse("NaN scale", [](auto& p, auto&) { p.softmax_scale = NAN; });
  refuse("Inf scale", [](auto& p, auto&) { p.softmax_scale = INFINITY; });
  refuse("null q", [](auto& p, auto&) { p.q = nullptr; });
  refuse("null out", [](auto& p, auto&) { p.out = nullptr; });
  refuse("null streams", [](auto& p, auto&) { p.streams = nullptr; });
  refuse("null workspace", [](auto& p, auto&) { p.workspace = nullptr; });
  refuse("misaligned workspace", [](auto& p, auto&) { p.workspace = static_cast<char*>(p.workspace) + 4; });
  refuse("negative num_splits", [](auto& p, auto&) { p.num_splits = -1; });
  refuse("num_splits over kMaxSplits", [](auto& p, auto&) { p.num_splits = kMaxSplits + 1; });
  refuse("negative max_positions", [](auto& p, auto&) { p.max_positions = -1; });
  refuse("null s2", [](auto&, auto& w) { w.s2 = nullptr; });
  refuse("null staging", [](auto&, auto& w) { w.staging = nullptr; });
  refuse("null page of a used pool", [](auto&, auto& w) { w.pages[0] = nullptr; });
  refuse("quantized pool without key scales", [](auto&, auto& w) {
    w.pool_base[2] = 1;
    w.pool_base[3] = 2;
    w.pool_count[2] = 1;
    w.total_blocks = 2;
    w.pages[2] = w.pages[0];
  });
  refuse("pool map not consecutive", [](auto&, auto& w) { w.pool_base[1] = 5; });
  refuse("num_streams 0", [](auto&, auto& w) { w.num_streams = 0; });
  // Nothing was launched: no error is pending.
  if (cudaGetLastError() != cudaSuccess) {
    std::printf("FAIL a CUDA error is pending after the refusals\n");
    ++bad;
  }
  std::printf("%s bad parameters refused before launch (cudaErrorInvalidValue)\n", bad ? "FAIL" : "ok  ");
  failures += bad != 0;
}

}  // namespace

int main() {
  const unsigned seed = gpu_test_start();
  std::mt19937 rng(seed);
  check_refusals();
  using thinkv::kFullKvMap;
  using thinkv::kR4E4T2;
  using thinkv::kR8E4T2;
  for (const thinkv::PrecisionMap& map : {kR4E4T2, kR8E4T2, kFullKvMap}) {
    // name, D, g, B, Hq, Hkv, layers, map, tokens min..max, q spread
    run_case({"stories260K D=8 g=8 8q/4kv B=16", 8, 8, 16, 8, 4, 2, map, 200, 600, 1.0f, 0.0f}, rng);
    run_case({"stories260K D=8 g=8 8q/4kv B=64", 8, 8, 64, 8, 4, 1, map, 50, 300, 3.0f, 0.0f}, rng);
    // The testbed model's shape (head_dim 32, GQA 3:1; the CUDA-core pass, G = 3 padded to 4).
    run_case({"testbed D=32 g=16 6q/2kv B=16", 32, 16, 16, 6, 2, 3, map, 200, 900, 1.0f, 0.0f}, rng);
    run_case({"D=32 g=8 4q/4kv B=32", 32, 8, 32, 4, 4, 1, map, 100, 500, 2.0f, 0.0f}, rng);
    run_case({"Llama-3-8B D=128 g=16 32q/8kv B=16", 128, 16, 16, 32, 8, 2, map, 300, 1200, 1.0f, 0.0f}, rng);
    run_case({"Llama-3-8B D=128 g=16 32q/8kv B=128", 128, 16, 128, 32, 8, 1, map, 300, 900, 2.0f, 0.0f}, rng);
    run_case({"D=64 g=32 16q/2kv B=32", 64, 32, 32, 16, 2, 2, map, 100, 500, 1.5f, 0.0f}, rng);
    run_case({"D=256 g=16 8q/8kv B=16", 256, 16, 16, 8, 8, 1, map, 100, 400, 1.0f, 0.0f}, rng);
    run_case({"D=128 g=8 8q/1kv B=100", 128, 8, 100, 8, 1, 1, map, 500, 2000, 1.0f, 0.0f}, rng);
    run_case({"D=64 g=16 8q/4kv B=16 scale=0.2", 64, 16, 16, 8, 4, 1, map, 100, 600, 1.0f, 0.2f}, rng);
    run_case({"D=128 g=16 32q/8kv staged only", 128, 16, 16, 32, 8, 1, map, 0, 0, 1.0f, 0.0f}, rng);
    // Pages whose size is not a multiple of 16 bytes (B = 5): the byte-load instance.
    run_case({"D=64 g=16 8q/4kv B=5 unaligned pages", 64, 16, 5, 8, 4, 1, map, 100, 500, 1.0f, 0.0f}, rng);
    // Values far from 1: second-level scales s2v outside [2^-14, 1] (the FP16 pass's output
    // unit changes between staged, BF16 and quantized groups).
    run_case({"D=128 g=16 32q/8kv B=16 |v|x1e5", 128, 16, 16, 32, 8, 1, map, 200, 800, 1.0f, 0.0f, 0, 1e5f}, rng);
    run_case({"D=128 g=16 32q/8kv B=16 |v|x1e-5", 128, 16, 16, 32, 8, 1, map, 200, 800, 1.0f, 0.0f, 0, 1e-5f}, rng);
    // GQA groups that are not powers of two run in the next larger instance with padded heads
    // (Qwen2.5-1.5B: 12q/2kv, G = 6; Qwen2.5-7B: 28q/4kv, G = 7; G = 3, 5).
    run_case({"G=3 D=64 g=16 12q/4kv B=16", 64, 16, 16, 12, 4, 1, map, 100, 500, 1.0f, 0.0f}, rng);
    run_case({"G=5 D=128 g=16 10q/2kv B=32", 128, 16, 32, 10, 2, 1, map, 100, 500, 1.5f, 0.0f}, rng);
    run_case({"G=6 D=128 g=16 12q/2kv B=16", 128, 16, 16, 12, 2, 1, map, 200, 800, 1.0f, 0.0f}, rng);
    run_case({"G=7 D=128 g=16 28q/4kv B=16", 128, 16, 16, 28, 4, 1, map, 200, 800, 1.0f, 0.0f}, rng);
    // Split-K: one chunk (no split), odd chunk counts whose boundaries fall inside blocks
    // (B = 100 and 128 with 16-slot tiles; B = 16 with 32-slot tiles at D = 64), many chunks
    // (most empty for these short streams), and staged-only streams split many ways.
    run_case({"split=1 D=128 32q/8kv B=16", 128, 16, 16, 32, 8, 1, map, 300, 1200, 1.0f, 0.0f, 1}, rng);
    // Long chunks: one chunk of ~150-380 blocks per KV head, so each warp of the tensor-core pass
    // walks more than 32 units (its next 32 are loaded with a partial window of one precision
    // group still queued, and a group can come back after another ran). D = 256 has the shorter
    // queue (80 entries).
    run_case({"split=1 long D=128 32q/8kv B=16", 128, 16, 16, 32, 8, 1, map, 3000, 5000, 1.0f, 0.0f, 1}, rng);
    run_case({"split=1 long D=256 8q/8kv B=16", 256, 16, 16, 8, 8, 1, map, 2500, 4000, 1.0f, 0.0f, 1}, rng);
    run_case({"split=3 D=128 g=8 8q/1kv B=100", 128, 8, 100, 8, 1, 1, map, 500, 2000, 1.5f, 0.0f, 3}, rng);
    run_case({"split=7 D=128 32q/8kv B=128", 128, 16, 128, 32, 8, 1, map, 300, 900, 2.0f, 0.0f, 7}, rng);
    run_case({"split=5 D=64 g=16 8q/4kv B=16", 64, 16, 16, 8, 4, 1, map, 100, 600, 1.0f, 0.0f, 5}, rng);
    run_case({"split=64 D=256 8q/8kv B=16", 256, 16, 16, 8, 8, 1, map, 100, 400, 1.0f, 0.0f, 64}, rng);
    run_case({"split=256 D=8 8q/4kv B=64", 8, 8, 64, 8, 4, 1, map, 50, 300, 3.0f, 0.0f, 256}, rng);
    run_case({"split=13 D=8 8q/4kv B=16", 8, 8, 16, 8, 4, 2, map, 200, 600, 1.0f, 0.0f, 13}, rng);
    run_case({"split=9 staged only D=128", 128, 16, 16, 32, 8, 1, map, 0, 0, 1.0f, 0.0f, 9}, rng);
    // The split plan's length hint (max_positions): true (fewer, longer chunks), far too small
    // (one chunk) and far too large (many empty chunks): the same results every time, only the
    // number of chunks moves.
    run_case({"hint=true D=128 32q/8kv B=16", 128, 16, 16, 32, 8, 2, map, 300, 1200, 1.0f, 0.0f, 0, 1.0f, -1}, rng);
    run_case({"hint=true D=64 g=16 8q/4kv B=16", 64, 16, 16, 8, 4, 1, map, 100, 600, 1.0f, 0.0f, 0, 1.0f, -1}, rng);
    run_case({"hint=true staged only D=128", 128, 16, 16, 32, 8, 1, map, 0, 0, 1.0f, 0.0f, 0, 1.0f, -1}, rng);
    run_case({"hint=1 D=128 32q/8kv B=16", 128, 16, 16, 32, 8, 1, map, 300, 1200, 1.0f, 0.0f, 0, 1.0f, 1}, rng);
    // 129-256 positions on 8 KV heads: 2 chunks with sparsity, 1 without (no merge to pay for).
    run_case({"hint=true short D=128 32q/8kv B=16", 128, 16, 16, 32, 8, 1, map, 60, 100, 1.0f, 0.0f, 0, 1.0f, -1}, rng);
    run_case({"hint=1e7 D=256 8q/8kv B=16", 256, 16, 16, 8, 8, 1, map, 100, 400, 1.0f, 0.0f, 0, 1.0f, 10000000}, rng);
    run_case({"hint=true D=8 8q/4kv B=16 (waves plan)", 8, 8, 16, 8, 4, 2, map, 200, 600, 1.0f, 0.0f, 0, 1.0f, -1},
             rng);
    // Out-of-range stream ids (tensor-core pass and the head_dim-8 pass).
    run_case({"bad ids D=128 32q/8kv B=16", 128, 16, 16, 32, 8, 1, map, 200, 800, 1.0f, 0.0f, 0, 1.0f, -1, true}, rng);
    run_case({"bad ids D=8 8q/4kv B=16", 8, 8, 16, 8, 4, 1, map, 100, 400, 1.0f, 0.0f, 0, 1.0f, 0, true}, rng);
  }
  std::printf("%s\n", failures ? "FAILED" : "all paged attention checks passed");
  return failures ? 1 : 0;
}
