// GPU test: quantize-append (thinkv::kernels::launch_quantize_append) against the CPU reference
// CpuKvBackend::commit, byte for byte. Fresh random inputs per run (seed printed; THINKV_TEST_SEED
// pins it; THINKV_TEST_SMALL=1 shrinks the runs for compute-sanitizer).
//
// Per scenario (tests/kernels/quantize_append_jobs.hpp): a CPU PagedKvCache with many streams is
// driven with random thought types, evictions and refills; a random subset of its streams gets a
// full staging group (Gaussian, heavy-tailed, all-zero, zero keys, one 10^4 outlier, float-
// subnormal tiny, 1e15 huge), some of them fresh streams whose s2 is still unset. The cache bytes
// are snapshotted, the CPU commits those groups (recording each CommitPlan, in a shuffled stream
// order), and the cache is snapshotted again. The device gets the "before" bytes with every
// destination byte of the flush poisoned (destinations computed independently of the library),
// the staged groups (every other staging row is a BF16 NaN), and the jobs in another shuffled
// order; one launch flushes them all. Then every byte of every pool, every key-scale record and
// every s2 must equal the CPU's "after" bytes, twice, with complementary poisons 0x5A and 0xA5
// (so an unwritten destination byte cannot pass by chance), and the saturation count must equal
// the CPU backend's.

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../unit/test_util.hpp"
#include "cuda_check.hpp"
#include "quantize_append_jobs.hpp"
#include "thinkv/kernels/quantize_append.hpp"
#include "thinkv/thinkv.hpp"

namespace {

using namespace thinkv;
using thinkv::kernels::QuantizeAppendJob;
using thinkv::kernels::QuantizeAppendParams;
using thinkv::kernels::QuantizeAppendView;

#define REQUIRE_CUDA(expr)                           \
  do {                                               \
    const cudaError_t e_ = (expr);                   \
    INFO(#expr << " -> " << cudaGetErrorString(e_)); \
    REQUIRE(e_ == cudaSuccess);                      \
  } while (0)

/// The run's seed (printed once by gpu_test_start) mixed with the test case's name.
std::mt19937_64 case_rng(const char* name) {
  static const unsigned seed = gpu_test_start();
  std::uint64_t h = 1469598103934665603ull;
  for (const char* c = name; *c != '\0'; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  return std::mt19937_64(seed ^ h);
}

const PrecisionMap kR16E8T2{Precision::kBf16, Precision::kFp8E4M3, Precision::kTernary};

/// Device buffers of one scenario: the view's pages, records, s2 and staging, the job list and
/// the two counters. Sizes are fixed by the scenario; upload() may be called again (fresh state).
class DeviceFlush {
 public:
  DeviceFlush() = default;
  DeviceFlush(const DeviceFlush&) = delete;
  DeviceFlush& operator=(const DeviceFlush&) = delete;
  ~DeviceFlush() {
    for (void* p : allocations_) (void)cudaFree(p);
  }

  /// Uploads `bytes` as the cache state, the scenario's staging, and `jobs`; zeroes the counters.
  cudaError_t upload(const test::FlushScenario& sc, const test::CacheBytes& bytes, const test::FlushJobs& jobs) {
    const CacheConfig& cfg = sc.config;
    QuantizeAppendView& v = params_.cache;
    v.num_streams = cfg.num_streams;
    v.head_dim = cfg.head_dim;
    v.group_size = cfg.group_size;
    v.block_size = cfg.block_size;
    std::uint32_t base = 0;
    for (int p = 0; p < kNumPrecisions; ++p) {
      v.pool_base[p] = base;
      v.pool_count[p] = static_cast<std::uint32_t>(cfg.pool_blocks[static_cast<std::size_t>(p)]);
      base += v.pool_count[p];
      if (v.pool_count[p] > 0) {
        if (cudaError_t e = put(bytes.pages[static_cast<std::size_t>(p)], v.pages[p]); e != cudaSuccess) return e;
      }
    }
    v.total_blocks = base;
    v.num_records = static_cast<std::uint32_t>(bytes.records.size() / static_cast<std::size_t>(cfg.head_dim));
    if (cudaError_t e = put(bytes.records, v.key_scales); e != cudaSuccess) return e;
    if (cudaError_t e = put(bytes.s2, v.s2); e != cudaSuccess) return e;
    std::uint16_t* staging = nullptr;
    if (cudaError_t e = put(sc.staging, staging); e != cudaSuccess) return e;
    v.staging = staging;
    QuantizeAppendJob* dj = nullptr;
    std::uint32_t* ds = nullptr;
    if (cudaError_t e = put(jobs.jobs, dj); e != cudaSuccess) return e;
    if (cudaError_t e = put(jobs.dest_slots, ds); e != cudaSuccess) return e;
    params_.num_jobs = jobs.size();
    params_.jobs = dj;
    params_.dest_slots = ds;
    const std::vector<unsigned long long> zero64(1, 0);
    const std::vector<unsigned int> zero32(1, 0);
    if (cudaError_t e = put(zero64, params_.scale_saturations); e != cudaSuccess) return e;
    return put(zero32, params_.rejected_jobs);
  }

  /// Copies pages, records and s2 back into `out` (sized like `like`), and the counters.
  cudaError_t download(const test::CacheBytes& like, test::CacheBytes& out, unsigned long long& saturations,
                       unsigned& rejected) const {
    out = like;
    const QuantizeAppendView& v = params_.cache;
    for (int p = 0; p < kNumPrecisions; ++p) {
      auto& h = out.pages[static_cast<std::size_t>(p)];
      if (!h.empty()) {
        if (cudaError_t e = cudaMemcpy(h.data(), v.pages[p], h.size(), cudaMemcpyDeviceToHost); e != cudaSuccess)
          return e;
      }
    }
    if (!out.records.empty()) {
      if (cudaError_t e = cudaMemcpy(out.records.data(), v.key_scales, out.records.size(), cudaMemcpyDeviceToHost);
          e != cudaSuccess)
        return e;
    }
    if (cudaError_t e = cudaMemcpy(out.s2.data(), v.s2, out.s2.size() * sizeof(float), cudaMemcpyDeviceToHost);
        e != cudaSuccess)
      return e;
    if (cudaError_t e = cudaMemcpy(&saturations, params_.scale_saturations, sizeof saturations, cudaMemcpyDeviceToHost);
        e != cudaSuccess)
      return e;
    return cudaMemcpy(&rejected, params_.rejected_jobs, sizeof rejected, cudaMemcpyDeviceToHost);
  }

  [[nodiscard]] const QuantizeAppendParams& params() const { return params_; }

 private:
  /// Allocates (once per destination pointer) and copies; an empty vector gets a 1-byte buffer.
  template <typename T>
  cudaError_t put(const std::vector<T>& host, T*& dst) {
    const std::size_t n = host.size() * sizeof(T);
    if (dst == nullptr || sizes_.count(static_cast<const void*>(dst)) == 0) {
      void* p = nullptr;
      if (cudaError_t e = cudaMalloc(&p, n == 0 ? 1 : n); e != cudaSuccess) return e;
      allocations_.push_back(p);
      sizes_[p] = n;
      dst = static_cast<T*>(p);
    }
    if (sizes_[static_cast<const void*>(dst)] != n) return cudaErrorInvalidValue;
    return n == 0 ? cudaSuccess : cudaMemcpy(dst, host.data(), n, cudaMemcpyHostToDevice);
  }

  QuantizeAppendParams params_{};
  std::vector<void*> allocations_;
  std::map<const void*, std::size_t> sizes_;
};

/// The scenario's jobs in a shuffled order (jobs and their destination slots together).
test::FlushJobs shuffled(const test::FlushJobs& in, int g, std::mt19937_64& rng) {
  std::vector<std::size_t> order(in.jobs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  test::FlushJobs out;
  for (std::size_t i : order) {
    out.jobs.push_back(in.jobs[i]);
    for (int t = 0; t < g; ++t)
      out.dest_slots.push_back(in.dest_slots[i * static_cast<std::size_t>(g) + static_cast<std::size_t>(t)]);
  }
  return out;
}

/// Builds the scenario, runs the flush twice (complementary poisons) and compares every byte.
/// `extra` jobs (refused by the kernel) may be appended to the launch; `want_rejected` of them.
void run_flush(const test::ScenarioSpec& spec, std::mt19937_64& rng, const test::FlushJobs* extra = nullptr,
               unsigned want_rejected = 0) {
  test::FlushScenario sc = test::build_flush_scenario(spec, rng);
  INFO("scenario " << spec.name << " map " << spec.map.to_string());
  INFO("scenario error: " << sc.error);
  REQUIRE(sc.error.empty());
  // The destinations the device poisons are exactly where the CPU wrote.
  REQUIRE(test::bytes_changed_outside(sc) == 0);
  const int g = spec.group_size;
  test::FlushJobs jobs = shuffled(sc.jobs, g, rng);
  {
    QuantizeAppendParams host;
    host.cache.num_streams = sc.config.num_streams;
    host.cache.head_dim = sc.config.head_dim;
    host.cache.group_size = g;
    host.cache.block_size = sc.config.block_size;
    std::uint32_t base = 0;
    static std::uint8_t dummy = 0;
    static float dummy_f = 0.0f;
    static std::uint16_t dummy_h = 0;
    for (int p = 0; p < kNumPrecisions; ++p) {
      host.cache.pool_base[p] = base;
      host.cache.pool_count[p] = static_cast<std::uint32_t>(sc.config.pool_blocks[static_cast<std::size_t>(p)]);
      base += host.cache.pool_count[p];
      host.cache.pages[p] = &dummy;
    }
    host.cache.total_blocks = base;
    host.cache.key_scales = &dummy;
    host.cache.num_records =
        static_cast<std::uint32_t>(sc.before.records.size() / static_cast<std::size_t>(sc.config.head_dim));
    host.cache.s2 = &dummy_f;
    host.cache.staging = &dummy_h;
    host.num_jobs = jobs.size();
    host.jobs = jobs.jobs.data();
    host.dest_slots = jobs.dest_slots.data();
    REQUIRE(kernels::check_quantize_append_jobs(host, jobs.jobs.data(), jobs.dest_slots.data()) == cudaSuccess);
  }
  if (extra != nullptr) {
    jobs.jobs.insert(jobs.jobs.end(), extra->jobs.begin(), extra->jobs.end());
    jobs.dest_slots.insert(jobs.dest_slots.end(), extra->dest_slots.begin(), extra->dest_slots.end());
  }
  int kind_count[static_cast<int>(test::GroupKind::kCount)] = {};
  for (test::GroupKind k : sc.kinds) ++kind_count[static_cast<int>(k)];
  for (std::uint8_t poison : {std::uint8_t{0x5A}, std::uint8_t{0xA5}}) {
    DeviceFlush dev;
    REQUIRE_CUDA(dev.upload(sc, test::poisoned_before(sc, poison), jobs));
    REQUIRE_CUDA(kernels::launch_quantize_append(dev.params(), nullptr));
    REQUIRE_CUDA(cudaDeviceSynchronize());
    test::CacheBytes got;
    unsigned long long saturations = 0;
    unsigned rejected = 0;
    REQUIRE_CUDA(dev.download(sc.after, got, saturations, rejected));
    std::string report;
    const std::size_t bad = test::compare_bytes(sc, sc.after, got, report);
    const bool ok = bad == 0 && static_cast<long long>(saturations) == sc.saturations && rejected == want_rejected;
    std::printf(
        "%s %-34s map=%-10s poison=0x%02X streams=%d jobs=%d (+%d refused) reused=%d multi-block=%d "
        "unset-s2=%d saturations=%llu/%lld kinds g/h/z/zk/o/t/H=%d/%d/%d/%d/%d/%d/%d mismatches=%zu\n",
        ok ? "ok  " : "FAIL", spec.name, spec.map.to_string().c_str(), poison, spec.streams, sc.jobs.size(),
        static_cast<int>(want_rejected), sc.reused_slots, sc.multi_block_jobs, sc.unset_s2, saturations,
        static_cast<long long>(sc.saturations), kind_count[0], kind_count[1], kind_count[2], kind_count[3],
        kind_count[4], kind_count[5], kind_count[6], bad);
    INFO("poison 0x" << std::hex << static_cast<int>(poison) << std::dec << ", first mismatches:\n" << report);
    CHECK(bad == 0);
    CHECK(static_cast<long long>(saturations) == sc.saturations);
    CHECK(rejected == want_rejected);
  }
}

std::vector<PrecisionMap> all_maps() { return {kR4E4T2, kR8E4T2, kR16E8T2, kR8E8T4, kFullKvMap}; }

}  // namespace

TEST_CASE("quantize-append: Llama-3-8B shape (D 128 g 16 B 16) with many streams in one launch",
          "[gpu][quantize_append]") {
  auto rng = case_rng("llama");
  const int div = tt::small_run() ? 4 : 1;
  for (const PrecisionMap& map : all_maps()) {
    run_flush({"Llama-3-8B D=128 g=16 B=16", 256 / div, 128, 16, 16, map, 300 / div, 0.75}, rng);
  }
  // Every stream flushed at once, block 64 (several groups per block).
  run_flush({"Llama-3-8B D=128 g=16 B=64 all", 128 / div, 128, 16, 64, kR4E4T2, 400 / div, 1.0}, rng);
}

TEST_CASE("quantize-append: small and odd and extreme shapes", "[gpu][quantize_append]") {
  auto rng = case_rng("shapes");
  const int div = tt::small_run() ? 4 : 1;
  for (const PrecisionMap& map : all_maps()) {
    run_flush({"stories260K D=8 g=8 B=16", 48 / div, 8, 8, 16, map, 300 / div, 0.75}, rng);
    run_flush({"D=64 g=32 B=32", 24 / div, 64, 32, 32, map, 300 / div, 0.8}, rng);
    run_flush({"D=256 g=16 B=100", 12 / div, 256, 16, 100, map, 300 / div, 0.9}, rng);
    run_flush({"D=128 g=16 B=4 (group spans blocks)", 24 / div, 128, 16, 4, map, 150 / div, 0.75}, rng);
    run_flush({"D=40 g=8 B=7 (partial warp)", 24 / div, 40, 8, 7, map, 100 / div, 0.75}, rng);
    run_flush({"D=1024 g=32 B=1", 4, 1024, 32, 1, map, 60 / div, 1.0}, rng);
  }
}

TEST_CASE("quantize-append: refused jobs write nothing and the others still flush exactly", "[gpu][quantize_append]") {
  auto rng = case_rng("refused");
  const int streams = tt::small_run() ? 16 : 48;
  // Built twice from the same generator state: once to learn the scenario's layout (which streams
  // are not flushed, a valid job to copy), then the real run with the refused jobs appended.
  const test::ScenarioSpec spec{"refused jobs, R8E4T2 D=64 g=16 B=16", streams, 64, 16, 16, kR8E4T2, 120, 0.5};
  auto probe_rng = rng;
  const test::FlushScenario probe = test::build_flush_scenario(spec, probe_rng);
  REQUIRE(probe.error.empty());
  REQUIRE(probe.unflushed_streams.size() >= 6);
  const int g = spec.group_size;
  const std::uint32_t bs = static_cast<std::uint32_t>(spec.block_size);
  const QuantizeAppendJob good = probe.jobs.jobs.front();
  const std::vector<std::uint32_t> good_slots(probe.jobs.dest_slots.begin(), probe.jobs.dest_slots.begin() + g);
  // Global block ids: pools BF16 (empty), FP8, NVFP4, ternary in that order.
  std::uint32_t base[kNumPrecisions] = {};
  std::uint32_t total = 0;
  for (int p = 0; p < kNumPrecisions; ++p) {
    base[p] = total;
    total += static_cast<std::uint32_t>(probe.config.pool_blocks[static_cast<std::size_t>(p)]);
  }
  const auto records =
      static_cast<std::uint32_t>(probe.before.records.size() / static_cast<std::size_t>(spec.head_dim));
  test::FlushJobs extra;
  auto add = [&](QuantizeAppendJob j, std::vector<std::uint32_t> slots) {
    extra.jobs.push_back(j);
    extra.dest_slots.insert(extra.dest_slots.end(), slots.begin(), slots.end());
  };
  const auto& u = probe.unflushed_streams;
  QuantizeAppendJob j = good;
  j.stream = spec.streams;  // stream out of range, pointing at a real job's slots
  add(j, good_slots);
  j = good;
  j.stream = -1;
  add(j, good_slots);
  j = good;
  j.stream = u[0];
  j.precision = Precision::kBf16;  // empty pool in R8E4T2
  add(j, good_slots);
  j = good;
  j.stream = u[1];
  j.precision = static_cast<Precision>(7);  // not a precision
  add(j, good_slots);
  j = good;
  j.stream = u[2];
  j.record = records;  // record out of range
  add(j, good_slots);
  j = good;
  j.stream = u[3];
  {
    // One destination slot in another precision's pool.
    std::vector<std::uint32_t> s = good_slots;
    const int p = static_cast<int>(good.precision);
    const int other = p == 3 ? 1 : p + 1;
    s[static_cast<std::size_t>(g) - 1] = base[other] * bs;
    add(j, s);
  }
  j = good;
  j.stream = u[4];
  {
    std::vector<std::uint32_t> s = good_slots;
    s[0] = total * bs;  // beyond every pool
    add(j, s);
  }
  run_flush(spec, rng, &extra, static_cast<unsigned>(extra.jobs.size()));
}

TEST_CASE("check_quantize_append refuses bad parameters before launching", "[gpu][quantize_append]") {
  using namespace thinkv::kernels;
  static std::uint8_t bytes[64] = {};
  static float s2[64] = {};
  static std::uint16_t staging[64] = {};
  static QuantizeAppendJob jobs[2] = {};
  static std::uint32_t slots[64] = {};
  QuantizeAppendParams good;
  good.cache.num_streams = 2;
  good.cache.head_dim = 64;
  good.cache.group_size = 16;
  good.cache.block_size = 16;
  good.cache.pool_base[0] = 0;
  good.cache.pool_count[0] = 0;
  good.cache.pool_base[1] = 0;
  good.cache.pool_count[1] = 1;
  good.cache.pool_base[2] = 1;
  good.cache.pool_count[2] = 2;
  good.cache.pool_base[3] = 3;
  good.cache.pool_count[3] = 0;
  good.cache.pages[1] = bytes;
  good.cache.pages[2] = bytes;
  good.cache.total_blocks = 3;
  good.cache.key_scales = bytes;
  good.cache.num_records = 4;
  good.cache.s2 = s2;
  good.cache.staging = staging;
  good.num_jobs = 2;
  good.jobs = jobs;
  good.dest_slots = slots;
  REQUIRE(check_quantize_append(good) == cudaSuccess);
  QuantizeAppendParams none = good;
  none.num_jobs = 0;
  none.jobs = nullptr;
  none.dest_slots = nullptr;
  REQUIRE(check_quantize_append(none) == cudaSuccess);
  REQUIRE(launch_quantize_append(none, nullptr) == cudaSuccess);  // nothing to do, nothing launched

  int refused = 0, total = 0;
  auto refuse = [&](const char* what, auto mutate) {
    QuantizeAppendParams p = good;
    mutate(p);
    ++total;
    const cudaError_t e = launch_quantize_append(p, nullptr);
    if (e == cudaErrorInvalidValue) {
      ++refused;
    } else {
      std::printf("FAIL refusal: %s -> %s\n", what, cudaGetErrorString(e));
    }
    INFO(what);
    CHECK(e == cudaErrorInvalidValue);
  };
  refuse("num_streams 0", [](auto& p) { p.cache.num_streams = 0; });
  refuse("num_streams 2^24 + 1", [](auto& p) { p.cache.num_streams = (1 << 24) + 1; });
  refuse("group_size 4", [](auto& p) { p.cache.group_size = 4; });
  refuse("group_size 64", [](auto& p) { p.cache.group_size = 64; });
  refuse("head_dim 0", [](auto& p) { p.cache.head_dim = 0; });
  refuse("head_dim 72 with group 16", [](auto& p) { p.cache.head_dim = 72; });
  refuse("head_dim 8 with group 16", [](auto& p) { p.cache.head_dim = 8; });
  refuse("head_dim 1056", [](auto& p) { p.cache.head_dim = 1056; });
  refuse("block_size 0", [](auto& p) { p.cache.block_size = 0; });
  refuse("block_size 4097", [](auto& p) { p.cache.block_size = 4097; });
  refuse("pools not consecutive", [](auto& p) { p.cache.pool_base[2] = 2; });
  refuse("total_blocks wrong", [](auto& p) { p.cache.total_blocks = 4; });
  refuse("2^31 slots", [](auto& p) {
    p.cache.pool_count[3] = (1u << 27) - 3;  // 2^27 blocks of 16 slots
    p.cache.pages[3] = p.cache.pages[1];
    p.cache.total_blocks = 1u << 27;
  });
  refuse("null page of a non-empty pool", [](auto& p) { p.cache.pages[2] = nullptr; });
  refuse("null staging", [](auto& p) { p.cache.staging = nullptr; });
  refuse("null s2", [](auto& p) { p.cache.s2 = nullptr; });
  refuse("null key_scales", [](auto& p) { p.cache.key_scales = nullptr; });
  refuse("no records", [](auto& p) { p.cache.num_records = 0; });
  refuse("negative num_jobs", [](auto& p) { p.num_jobs = -1; });
  refuse("more jobs than streams", [](auto& p) { p.num_jobs = 3; });
  refuse("null jobs", [](auto& p) { p.jobs = nullptr; });
  refuse("null dest_slots", [](auto& p) { p.dest_slots = nullptr; });
  // Nothing was launched: no error is pending.
  CHECK(cudaGetLastError() == cudaSuccess);
  std::printf("%s check_quantize_append: %d/%d bad parameter sets refused before launch\n",
              refused == total ? "ok  " : "FAIL", refused, total);

  // A BF16-only cache needs no s2, key scales or records.
  QuantizeAppendParams bf16 = good;
  bf16.cache.pool_count[0] = 3;
  bf16.cache.pool_base[1] = bf16.cache.pool_base[2] = bf16.cache.pool_base[3] = 3;
  bf16.cache.pool_count[1] = bf16.cache.pool_count[2] = 0;
  bf16.cache.pages[0] = bytes;
  bf16.cache.s2 = nullptr;
  bf16.cache.key_scales = nullptr;
  bf16.cache.num_records = 0;
  CHECK(check_quantize_append(bf16) == cudaSuccess);
}

TEST_CASE("check_quantize_append_jobs refuses bad job lists", "[gpu][quantize_append]") {
  using namespace thinkv::kernels;
  static std::uint8_t bytes[64] = {};
  static float s2[64] = {};
  static std::uint16_t staging[64] = {};
  // 4 streams, D 16, g 8, B 4. Pools: FP8 blocks 0..1 (slots 0..7), NVFP4 blocks 2..5 (slots
  // 8..23); 8 records.
  QuantizeAppendParams p;
  p.cache.num_streams = 4;
  p.cache.head_dim = 16;
  p.cache.group_size = 8;
  p.cache.block_size = 4;
  p.cache.pool_base[1] = 0;
  p.cache.pool_count[1] = 2;
  p.cache.pool_base[2] = 2;
  p.cache.pool_count[2] = 4;
  p.cache.pool_base[3] = 6;
  p.cache.pages[1] = bytes;
  p.cache.pages[2] = bytes;
  p.cache.total_blocks = 6;
  p.cache.key_scales = bytes;
  p.cache.num_records = 8;
  p.cache.s2 = s2;
  p.cache.staging = staging;
  std::vector<QuantizeAppendJob> jobs(3);
  jobs[0].stream = 0;
  jobs[0].precision = Precision::kFp8E4M3;
  jobs[0].record = 3;
  jobs[1].stream = 2;
  jobs[1].precision = Precision::kNvfp4;
  jobs[1].record = 5;
  jobs[2].stream = 1;
  jobs[2].precision = Precision::kNvfp4;
  jobs[2].record = 0;
  // Job 0: FP8 slots 0..7; job 1: NVFP4 slots 8..15; job 2: NVFP4 slots 16..23 (not in order).
  std::vector<std::uint32_t> slots = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                                      12, 13, 14, 15, 23, 16, 22, 17, 21, 18, 20, 19};
  p.num_jobs = 3;
  p.jobs = jobs.data();
  p.dest_slots = slots.data();
  REQUIRE(check_quantize_append_jobs(p, jobs.data(), slots.data()) == cudaSuccess);
  int refused = 0, total = 0;
  auto refuse = [&](const char* what, auto mutate) {
    auto j = jobs;
    auto s = slots;
    mutate(j, s);
    ++total;
    const cudaError_t e = check_quantize_append_jobs(p, j.data(), s.data());
    refused += e == cudaErrorInvalidValue;
    if (e != cudaErrorInvalidValue) std::printf("FAIL job refusal: %s -> %s\n", what, cudaGetErrorString(e));
    INFO(what);
    CHECK(e == cudaErrorInvalidValue);
  };
  refuse("stream out of range", [](auto& j, auto&) { j[1].stream = 4; });
  refuse("negative stream", [](auto& j, auto&) { j[1].stream = -1; });
  refuse("stream named twice", [](auto& j, auto&) { j[2].stream = 0; });
  refuse("precision with an empty pool", [](auto& j, auto&) { j[1].precision = Precision::kTernary; });
  refuse("unknown precision", [](auto& j, auto&) { j[1].precision = static_cast<Precision>(9); });
  refuse("record out of range", [](auto& j, auto&) { j[0].record = 8; });
  refuse("record named twice", [](auto& j, auto&) { j[2].record = 3; });
  refuse("slot named twice in a job", [](auto&, auto& s) { s[9] = 8; });
  refuse("slot named by two jobs", [](auto&, auto& s) { s[16] = 8; });
  refuse("slot in another pool", [](auto&, auto& s) { s[3] = 8; });
  refuse("slot beyond every pool", [](auto&, auto& s) { s[23] = 24; });
  std::printf("%s check_quantize_append_jobs: %d/%d bad job lists refused\n", refused == total ? "ok  " : "FAIL",
              refused, total);

  // BF16 jobs carry no record: two of them may both say kNoRecord. Pools: BF16 blocks 0..3
  // (slots 0..15), FP8 blocks 4..5, NVFP4 blocks 6..9.
  QuantizeAppendParams b = p;
  b.cache.pool_count[0] = 4;
  b.cache.pages[0] = bytes;
  b.cache.pool_base[1] = 4;
  b.cache.pool_base[2] = 6;
  b.cache.pool_base[3] = 10;
  b.cache.total_blocks = 10;
  b.num_jobs = 2;
  std::vector<QuantizeAppendJob> bj(2);  // default: precision kBf16, record kNoRecord
  bj[0].stream = 1;
  bj[1].stream = 3;
  std::vector<std::uint32_t> bs = {8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15};
  CHECK(check_quantize_append_jobs(b, bj.data(), bs.data()) == cudaSuccess);
  bs[15] = 16;  // an FP8 slot
  CHECK(check_quantize_append_jobs(b, bj.data(), bs.data()) == cudaErrorInvalidValue);
}
