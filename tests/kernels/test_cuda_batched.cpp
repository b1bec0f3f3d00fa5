// GPU test: the batched decode API over CudaKvBackend (device tensors, the caller's stream)
// against ThinKvCache over the CPU backend driven one sequence at a time
// (tests/unit/batched_driver.hpp): continuous batching with joins, finishes and a shuffled batch
// order, every element type of K/V and q/out, the same decisions (segments, types, live slots and
// their positions, counters) exactly, and attention outputs within the decode-attention kernel's
// stated tolerance (plus one rounding of the output type). A NaN or Inf in one sequence's K/V,
// found on the device, faults that sequence alone. Fresh random inputs per run (tt::base_seed;
// THINKV_TEST_SEED pins it).

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../unit/batched_driver.hpp"
#include "../unit/test_util.hpp"
#include "thinkv/backend/cuda_backend.hpp"
#include "thinkv/thinkv_cache.hpp"

using namespace thinkv;

namespace {

// (1e-5 + 16 sqrt(n) 2^-24) max|ref| + 1e-6: tests/kernels/test_paged_attention.cpp says why;
// plus one rounding to the output type (both sides are rounded; they may land one step apart).
double tolerance(ElementType out, double max_ref, std::int64_t n) {
  const double ulp = out == ElementType::kF32 ? 0.0 : out == ElementType::kF16 ? 0x1p-10 : 0x1p-7;
  return (1e-5 + 16.0 * std::sqrt(static_cast<double>(n)) * 0x1p-24 + ulp) * max_ref + 1e-6;
}

ThinKvConfig config() {
  ThinKvConfig c;
  c.num_sequences = 6;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 8;
  c.head_dim = 64;
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

bt::HostKmeansPolicy host_policy() {
  const ThinKvPolicy p = policy();
  bt::HostKmeansPolicy h;
  h.precision = p.precision;
  h.retention = p.retention;
  h.classifier = p.classifier;
  return h;
}

/// The caller's tensors, written and read in order on the cache's stream (as a runtime does:
/// its own kernels and the cache's calls share one stream), poisoned when allocated.
bt::TensorMemory device_memory(cudaStream_t stream = nullptr) {
  return {[](std::size_t n) {
            void* p = nullptr;
            REQUIRE(cudaMalloc(&p, n) == cudaSuccess);
            REQUIRE(cudaMemset(p, 0xA5, n) == cudaSuccess);
            REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
            return p;
          },
          [](void* p) { (void)cudaFree(p); },
          [stream](void* d, const void* s, std::size_t n) {
            REQUIRE(cudaMemcpyAsync(d, s, n, cudaMemcpyHostToDevice, stream) == cudaSuccess);
            REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);  // the host reuses its buffer
          },
          [stream](void* d, const void* s, std::size_t n) {
            REQUIRE(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
            REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
          }};
}

}  // namespace

TEST_CASE("Batched decode on the GPU takes the CPU reference's decisions, every element type", "[cuda_batched]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  const ElementType types[] = {ElementType::kF32, ElementType::kF16, ElementType::kBf16};
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);  // no implicit order
  for (ElementType kv : types) {
    for (ElementType qo : types) {
      INFO("kv " << to_string(kv) << ", q/out " << to_string(qo));
      ThinKvCache<CudaKvBackend> gpu(config(), policy());
      BasicThinKvCache<bt::HostKmeansPolicy> cpu(config(), host_policy());
      REQUIRE(gpu.backend().stream() == nullptr);
      REQUIRE(gpu.backend().set_stream(stream).is_ok());
      REQUIRE(gpu.backend().stream() == stream);
      bt::RunOptions o;
      const bool full = kv == ElementType::kF32 && qo == ElementType::kF32;
      o.steps = small ? 150 : full ? 700 : 200;
      o.kv_type = kv;
      o.q_type = qo;
      o.out_type = qo;
      o.finish = 0.004;
      o.tolerance = [qo](double max_ref, std::int64_t n) { return tolerance(qo, max_ref, n); };
      const bt::TensorMemory mem = device_memory(stream);
      bt::RunReport r;
      const std::string err = bt::run_batched(gpu, cpu, mem, rng, o, r);
      INFO(err);
      REQUIRE(err.empty());
      INFO("worst err / max|out| " << r.worst_rel_err << ", tokens " << r.tokens << ", largest batch " << r.max_batch);
      CHECK(r.max_batch >= 4);
      if (full && !small) {
        CHECK(gpu.stats().tokens_evicted > 0);
        CHECK(gpu.stats().refreshes > 0);
      }
      // The device mirror was copied whole only when storage changed, not per step.
      const BackendStats st = gpu.paged().backend().stats();
      CHECK(st.metadata_full_uploads < r.steps / 4);
      CHECK(gpu.paged().moved_bytes() == 0);
      CHECK(st.groups_quantized == cpu.paged().backend().stats().groups_quantized);
      CHECK(st.scale_saturations == cpu.paged().backend().stats().scale_saturations);
    }
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("Batched decode on the GPU with K-means launched per size class takes the CPU reference's decisions",
          "[cuda_batched]") {
  // set_kmeans_split_jobs(1): every selection goes through the class launches (segment ids,
  // small shared-memory layouts), which a decode step this small never reaches by default.
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  ThinKvCache<CudaKvBackend> gpu(config(), policy());
  BasicThinKvCache<bt::HostKmeansPolicy> cpu(config(), host_policy());
  REQUIRE(gpu.backend().set_stream(stream).is_ok());
  gpu.backend().set_kmeans_split_jobs(1);
  bt::RunOptions o;
  o.steps = small ? 300 : 700;
  o.finish = 0.004;
  o.tolerance = [](double max_ref, std::int64_t n) { return tolerance(ElementType::kF32, max_ref, n); };
  const bt::TensorMemory mem = device_memory(stream);
  bt::RunReport r;
  const std::string err = bt::run_batched(gpu, cpu, mem, rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  if (!small) CHECK(gpu.stats().tokens_evicted > 0);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("Batched decode on the GPU: a NaN or Inf in one sequence's K/V faults that sequence alone",
          "[cuda_batched][bad_input]") {
  TT_SEEDED_RNG();
  ThinKvCache<CudaKvBackend> gpu(config(), policy());
  BasicThinKvCache<bt::HostKmeansPolicy> cpu(config(), host_policy());
  bt::RunOptions o;
  o.steps = tt::small_run() ? 150 : 400;
  o.poison = 0.05;
  o.wait_faults = true;
  o.kv_type = ElementType::kF16;
  o.tolerance = [](double max_ref, std::int64_t n) { return tolerance(ElementType::kF32, max_ref, n); };
  const bt::TensorMemory mem = device_memory();
  bt::RunReport r;
  const std::string err = bt::run_batched(gpu, cpu, mem, rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  CHECK(r.faults > 2);
}

TEST_CASE("Batched decode on the GPU with seq_rm between steps takes the CPU reference's decisions",
          "[cuda_batched][sequence_ops]") {
  // llama.cpp's seq_rm (ThinKvCache::remove) between steps: roll backs, refusals and middle
  // ranges on both caches; the device mirror follows the table's evictions, staging and block
  // releases, and selections after a ragged cut count each stream's tokens.
  TT_SEEDED_RNG();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  {
    ThinKvCache<CudaKvBackend> gpu(config(), policy());
    REQUIRE(gpu.backend().set_stream(stream).is_ok());
    BasicThinKvCache<bt::HostKmeansPolicy> cpu(config(), host_policy());
    bt::RunOptions o;
    o.steps = tt::small_run() ? 200 : 600;
    o.finish = 0.004;
    o.remove = 0.05;
    o.tolerance = [](double max_ref, std::int64_t n) { return tolerance(ElementType::kF32, max_ref, n); };
    const bt::TensorMemory mem = device_memory(stream);
    bt::RunReport r;
    const std::string err = bt::run_batched(gpu, cpu, mem, rng, o, r);
    INFO(err);
    REQUIRE(err.empty());
    INFO("removes " << r.removes << ", refused " << r.removes_refused);
    CHECK(r.removes > 10);
    CHECK(gpu.stats().tokens_removed > 0);
    CHECK(gpu.stats().tokens_evicted > 0);
    CHECK(gpu.paged().moved_bytes() == 0);
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("Prefill on the GPU stores what the CPU reference stores token by token, attends causally",
          "[cuda_batched][prefill]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const ElementType types[] = {ElementType::kF32, ElementType::kF16, ElementType::kBf16};
  for (ElementType t : types) {
    INFO("element type " << to_string(t));
    ThinKvCache<CudaKvBackend> gpu(config(), policy());
    BasicThinKvCache<bt::HostKmeansPolicy> cpu(config(), host_policy());
    REQUIRE(gpu.backend().set_stream(stream).is_ok());
    bt::RunOptions o;
    o.steps = small ? 100 : 300;
    o.kv_type = o.q_type = o.out_type = t;
    o.finish = 0.01;
    o.prompt = 0.7;
    o.max_prompt = 300;
    o.tolerance = [t](double max_ref, std::int64_t n) { return tolerance(t, max_ref, n); };
    const bt::TensorMemory mem = device_memory(stream);
    bt::RunReport r;
    const std::string err = bt::run_batched(gpu, cpu, mem, rng, o, r);
    INFO(err);
    REQUIRE(err.empty());
    INFO("worst prefill err / max|out| " << r.worst_prompt_err << ", prompts " << r.prompts);
    CHECK(r.prompts >= 3);
    const BackendStats st = gpu.paged().backend().stats();
    CHECK(st.groups_quantized == cpu.paged().backend().stats().groups_quantized);
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE(
    "A prompt in chunks on the GPU attends the stored tokens, then the chunk, and stores what the CPU "
    "reference stores",
    "[cuda_batched][prefill]") {
  // Prompts cut into up to 4 chunks anywhere (inside groups, at block and segment boundaries): a
  // chunk at P > 0 attends the tokens stored before it on the device (attend_chunk), checked
  // against float64 over the tokens read back from the cache; every later decode step against
  // the CPU reference, as above.
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const ElementType types[] = {ElementType::kF32, ElementType::kBf16};
  for (ElementType t : types) {
    INFO("element type " << to_string(t));
    ThinKvCache<CudaKvBackend> gpu(config(), policy());
    BasicThinKvCache<bt::HostKmeansPolicy> cpu(config(), host_policy());
    REQUIRE(gpu.backend().set_stream(stream).is_ok());
    bt::RunOptions o;
    o.steps = small ? 100 : 250;
    o.kv_type = o.q_type = o.out_type = t;
    o.finish = 0.01;
    o.prompt = 0.7;
    o.max_prompt = 300;
    o.prompt_chunks = 4;
    o.tolerance = [t](double max_ref, std::int64_t n) { return tolerance(t, max_ref, n); };
    const bt::TensorMemory mem = device_memory(stream);
    bt::RunReport r;
    const std::string err = bt::run_batched(gpu, cpu, mem, rng, o, r);
    INFO(err);
    REQUIRE(err.empty());
    INFO("worst prefill err / max|out| " << r.worst_prompt_err << ", prompts " << r.prompts << " in " << r.prompt_chunks
                                         << " chunks");
    CHECK(r.prompts >= 3);
    CHECK(r.prompt_chunks > r.prompts);  // some prompts came in several chunks
    const BackendStats st = gpu.paged().backend().stats();
    CHECK(st.groups_quantized == cpu.paged().backend().stats().groups_quantized);
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("Capturable steps launched directly take the CPU reference's decisions", "[cuda_batched][graph]") {
  TT_SEEDED_RNG();
  ThinKvCache<CudaKvBackend> gpu(config(), policy());
  BasicThinKvCache<bt::HostKmeansPolicy> cpu(config(), host_policy());
  REQUIRE(gpu.set_capturable_steps(true).is_ok());
  bt::RunOptions o;
  o.steps = tt::small_run() ? 150 : 500;
  o.finish = 0.004;
  o.tolerance = [](double max_ref, std::int64_t n) { return tolerance(ElementType::kF32, max_ref, n); };
  const bt::TensorMemory mem = device_memory();
  bt::RunReport r;
  const std::string err = bt::run_batched(gpu, cpu, mem, rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  CHECK(gpu.stats().refreshes > 0);
}

TEST_CASE("A step captured in a CUDA graph and replayed gives the direct launches' outputs bit for bit",
          "[cuda_batched][graph]") {
  TT_SEEDED_RNG();
  const ThinKvConfig c = config();
  const int n = c.num_sequences, L = c.num_layers, hkv = c.num_kv_heads, hq = c.num_q_heads, d = c.head_dim;
  const int steps = tt::small_run() ? 200 : 450;
  ThinKvCache<CudaKvBackend> direct(c, policy()), graphed(c, policy());
  REQUIRE(direct.set_capturable_steps(true).is_ok());
  REQUIRE(graphed.set_capturable_steps(true).is_ok());
  cudaStream_t sa = nullptr, sb = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(direct.backend().set_stream(sa).is_ok());
  REQUIRE(graphed.backend().set_stream(sb).is_ok());
  // One buffer per layer and tensor: a graph keeps the pointers it was captured with.
  const std::size_t kvn = static_cast<std::size_t>(n) * hkv * d, qn = static_cast<std::size_t>(n) * hq * d;
  std::vector<float*> k(static_cast<std::size_t>(L)), v(k.size()), q(k.size()), oa(k.size()), ob(k.size());
  for (int l = 0; l < L; ++l) {
    for (float** p : {&k[l], &v[l], &q[l], &oa[l], &ob[l]}) {
      REQUIRE(cudaMalloc(reinterpret_cast<void**>(p), (p == &k[l] || p == &v[l] ? kvn : qn) * 4) == cudaSuccess);
    }
  }
  std::vector<int> batch(static_cast<std::size_t>(n));
  for (int s = 0; s < n; ++s) batch[static_cast<std::size_t>(s)] = s;
  std::normal_distribution<float> normal;
  std::vector<float> hk(kvn), hv(kvn), hqv(qn), ra(qn), rb(qn);
  std::vector<float> sharp(static_cast<std::size_t>(n), 1.0f);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::uint64_t captured_epoch = 0;
  int captures = 0, replays = 0;
  for (int t = 0; t < steps; ++t) {
    INFO("step " << t);
    if (t % 64 == 0) {
      for (auto& x : sharp) x = std::vector<float>{0.0f, 1.5f, 6.0f}[rng() % 3];
    }
    for (int l = 0; l < L; ++l) {
      for (auto& x : hk) x = normal(rng);
      for (auto& x : hv) x = normal(rng);
      for (std::size_t i = 0; i < qn; ++i) hqv[i] = normal(rng) * sharp[i / (static_cast<std::size_t>(hq) * d)];
      REQUIRE(cudaMemcpy(k[l], hk.data(), kvn * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(v[l], hv.data(), kvn * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(q[l], hqv.data(), qn * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemset(oa[l], 0xFF, qn * 4) == cudaSuccess);  // NaN: a launch that writes nothing shows
      REQUIRE(cudaMemset(ob[l], 0xFF, qn * 4) == cudaSuccess);
    }
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(direct.begin_step(batch).is_ok());
    for (int l = 0; l < L; ++l) {
      REQUIRE(direct.append_batch(l, batch, {k[l], ElementType::kF32}, {v[l], ElementType::kF32}).is_ok());
      REQUIRE(direct.attend_batch(l, batch, {q[l], ElementType::kF32}, {oa[l], ElementType::kF32}).is_ok());
    }
    REQUIRE(direct.end_step(batch).is_ok());
    REQUIRE(graphed.begin_step(batch).is_ok());
    const bool capture = exec == nullptr || graphed.graph_epoch() != captured_epoch;
    if (capture) {
      if (exec != nullptr) REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
      if (graph != nullptr) REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
      REQUIRE(cudaStreamBeginCapture(sb, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
      for (int l = 0; l < L; ++l) {
        REQUIRE(graphed.append_batch(l, batch, {k[l], ElementType::kF32}, {v[l], ElementType::kF32}).is_ok());
        REQUIRE(graphed.attend_batch(l, batch, {q[l], ElementType::kF32}, {ob[l], ElementType::kF32}).is_ok());
      }
      REQUIRE(cudaStreamEndCapture(sb, &graph) == cudaSuccess);
      REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
      captured_epoch = graphed.graph_epoch();
      ++captures;
    } else {
      REQUIRE(graphed.replay_step().is_ok());
      ++replays;
    }
    REQUIRE(cudaGraphLaunch(exec, sb) == cudaSuccess);
    REQUIRE(graphed.end_step(batch).is_ok());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    for (int l = 0; l < L; ++l) {
      REQUIRE(cudaMemcpy(ra.data(), oa[l], qn * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(rb.data(), ob[l], qn * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      INFO("layer " << l);
      REQUIRE(std::memcmp(ra.data(), rb.data(), qn * 4) == 0);
      for (float x : ra) REQUIRE(std::isfinite(x));
    }
    REQUIRE(direct.settle().is_ok());
    REQUIRE(graphed.settle().is_ok());
    for (int s = 0; s < n; ++s) REQUIRE(direct.segments(s) == graphed.segments(s));
    REQUIRE(direct.memory() == graphed.memory());
    REQUIRE(direct.stats().tokens_evicted == graphed.stats().tokens_evicted);
    REQUIRE(direct.stats().refreshes == graphed.stats().refreshes);
  }
  INFO("captures " << captures << ", replays " << replays);
  CHECK(replays > steps / 2);
  CHECK(direct.stats().tokens_evicted > 0);
  CHECK(direct.stats().refreshes > 0);
  // A replay with a layer already appended by a host call, or on a step that is not capturable,
  // is refused.
  REQUIRE(graphed.begin_step(batch).is_ok());
  REQUIRE(graphed.append_batch(0, batch, {k[0], ElementType::kF32}, {v[0], ElementType::kF32}).is_ok());
  CHECK(graphed.replay_step().code() == StatusCode::kInvalidArgument);
  for (int l = 0; l < L; ++l) {
    if (l > 0) REQUIRE(graphed.append_batch(l, batch, {k[l], ElementType::kF32}, {v[l], ElementType::kF32}).is_ok());
    REQUIRE(graphed.attend_batch(l, batch, {q[l], ElementType::kF32}, {ob[l], ElementType::kF32}).is_ok());
  }
  REQUIRE(graphed.end_step(batch).is_ok());
  REQUIRE(direct.set_capturable_steps(false).is_ok());
  REQUIRE(direct.begin_step(batch).is_ok());
  CHECK(direct.replay_step().message().find("not capturable") != std::string::npos);
  if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  for (int l = 0; l < L; ++l) {
    for (float* p : {k[l], v[l], q[l], oa[l], ob[l]}) (void)cudaFree(p);
  }
  (void)cudaStreamDestroy(sa);
  (void)cudaStreamDestroy(sb);
}
