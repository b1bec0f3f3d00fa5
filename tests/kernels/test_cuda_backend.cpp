// GPU test: thinkv::CudaKvBackend against the CPU reference backend.
//  - PagedKvCache<CudaKvBackend> and PagedKvCache<CpuKvBackend> fed the same random tokens,
//    thought types, evictions and in-place reuse must hold the very same bytes (every page, every
//    key-scale record, every second-level scale), read back bit-identical tokens, and attend within
//    the decode-attention kernel's stated tolerance with equal sparsity counts.
//  - ThinKvCache<CudaKvBackend> and ThinKvCache<CpuKvBackend> driven by the same decode must take
//    the same decisions (refreshes, thought types, evictions), since the GPU sparsity is exact.
//  - Refusals: use before init, an attention shape the kernel does not serve, device memory
//    exhausted at init; a refused append (NaN / Inf / |x| > 2^64 in K or V, a wrong shape, a
//    thought change inside a group, a full pool) leaves every observable byte of the GPU cache
//    as it was, and the cache usable.
// Fresh random inputs per run (tt::base_seed; THINKV_TEST_SEED pins it).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../unit/test_util.hpp"
#include "thinkv/backend/cuda_backend.hpp"
#include "thinkv/paged_kv_cache.hpp"
#include "thinkv/thinkv_cache.hpp"

namespace {

using thinkv::CacheConfig;
using thinkv::CpuKvBackend;
using thinkv::CudaKvBackend;
using thinkv::PagedKvCache;
using thinkv::Precision;

thinkv::PrecisionMap precision_map(const char* text) {
  thinkv::PrecisionMap m;
  REQUIRE(thinkv::PrecisionMap::parse(text, m).is_ok());
  return m;
}

// (1e-5 + 16 sqrt(n) 2^-24) max|ref| + 1e-6: tests/kernels/test_paged_attention.cpp says why.
double attention_tolerance(int n, double max_ref) {
  return (1e-5 + 16.0 * std::sqrt(static_cast<double>(n)) * 0x1p-24) * max_ref + 1e-6;
}

struct Shape {
  const char* name;
  int d, g, b;
  thinkv::PrecisionMap map;
};

CacheConfig make_config(const Shape& s, int streams, int max_tokens) {
  CacheConfig cfg;
  cfg.num_streams = streams;
  cfg.head_dim = s.d;
  cfg.group_size = s.g;
  cfg.block_size = s.b;
  cfg.precision = s.map;
  const int blocks = streams * (3 * max_tokens / s.b + 8);  // two appends of up to 1.5 max_tokens
  for (int p = 0; p < thinkv::kNumPrecisions; ++p) {
    cfg.pool_blocks[p] = s.map.uses(static_cast<Precision>(p)) ? blocks : 0;
  }
  return cfg;
}

// Appends n random tokens to `stream` of both caches (thought type changes only at group starts).
void append_both(PagedKvCache<CpuKvBackend>& cpu, PagedKvCache<CudaKvBackend>& gpu, int stream, int n,
                 std::mt19937_64& rng) {
  const int d = cpu.config().head_dim;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
  auto t = static_cast<thinkv::ThoughtType>(rng() % 3);
  for (int i = 0; i < n; ++i) {
    const int staged = cpu.table().staged_count(stream);
    if (staged == 0 && rng() % 3 == 0) t = static_cast<thinkv::ThoughtType>(rng() % 3);
    if (staged > 0) t = cpu.table().staged_thought(stream);
    const float amp = 0.25f + static_cast<float>(rng() % 8);
    for (int c = 0; c < d; ++c) {
      k[static_cast<std::size_t>(c)] = nd(rng) * amp;
      v[static_cast<std::size_t>(c)] = (rng() % 17 == 0) ? 0.0f : nd(rng) * amp;
    }
    REQUIRE(cpu.append(stream, k, v, t).is_ok());
    REQUIRE(gpu.append(stream, k, v, t).is_ok());
  }
}

void compare_storage(const PagedKvCache<CpuKvBackend>& cpu, const PagedKvCache<CudaKvBackend>& gpu) {
  const auto& cb = cpu.backend();
  const auto& gb = gpu.backend();
  const auto& pools = cpu.table().pools();
  std::vector<std::uint8_t> bytes;
  int bad_pages = 0, bad_records = 0, bad_scales = 0;
  // Every page and record the cache has storage for (the device may hold more: its buffers grow
  // by doubling).
  for (std::uint32_t b = 0; b < pools.total; ++b) {
    if (pools.local_index(b) >= cpu.table().allocated_blocks(pools.precision_of(b))) continue;
    REQUIRE(gb.copy_page(b, bytes).is_ok());
    const auto want = cb.page(b);
    bad_pages += !std::equal(want.begin(), want.end(), bytes.begin(), bytes.end());
  }
  REQUIRE(cpu.table().allocated_records() == gpu.table().allocated_records());
  const auto records = cpu.table().allocated_records();
  for (std::uint32_t r = 0; r < records; ++r) {
    REQUIRE(gb.copy_record(r, bytes).is_ok());
    const auto want = cb.record_scales(r);
    bad_records += !std::equal(want.begin(), want.end(), bytes.begin(), bytes.end());
  }
  for (int s = 0; s < cpu.config().num_streams; ++s) {
    for (int kv = 0; kv < 2; ++kv) {
      for (Precision p : thinkv::kAllPrecisions) {
        float got = -1.0f;
        REQUIRE(gb.stream_scale(s, kv, p, got).is_ok());
        bad_scales += got != cb.stream_scale(s, kv, p);
      }
    }
  }
  INFO("pages " << pools.total << ", records " << records);
  CHECK(bad_pages == 0);
  CHECK(bad_records == 0);
  CHECK(bad_scales == 0);
  CHECK(gb.stats().groups_quantized == cb.stats().groups_quantized);
  CHECK(gb.stats().scale_saturations == cb.stats().scale_saturations);
  // The device's buffers hold at least what the cache allocated and at most twice that.
  CHECK(gb.stats().bytes_allocated >= cb.stats().bytes_allocated);
  CHECK(gb.stats().bytes_allocated <= 2 * cb.stats().bytes_allocated);
  CHECK(gb.stats().page_bytes_written == cb.stats().page_bytes_written);  // both count every stored byte
  CHECK(cb.stats().page_bytes_written > 0);
}

void compare_tokens(const PagedKvCache<CpuKvBackend>& cpu, const PagedKvCache<CudaKvBackend>& gpu) {
  const int d = cpu.config().head_dim;
  std::vector<float> k1(static_cast<std::size_t>(d)), v1(k1.size()), k2(k1.size()), v2(k1.size());
  int bad = 0, n = 0;
  for (int s = 0; s < cpu.config().num_streams; ++s) {
    for (auto slot : cpu.table().live_slot_list(s)) {
      REQUIRE(cpu.backend().read_token(cpu.table().token_ref(slot), k1.data(), v1.data()).is_ok());
      REQUIRE(gpu.backend().read_token(gpu.table().token_ref(slot), k2.data(), v2.data()).is_ok());
      bad += std::memcmp(k1.data(), k2.data(), k1.size() * 4) != 0 ||
             std::memcmp(v1.data(), v2.data(), v1.size() * 4) != 0;
      ++n;
    }
    for (int r = 0; r < cpu.table().staged_count(s); ++r) {
      REQUIRE(cpu.backend().read_staged(s, r, k1.data(), v1.data()).is_ok());
      REQUIRE(gpu.backend().read_staged(s, r, k2.data(), v2.data()).is_ok());
      bad += std::memcmp(k1.data(), k2.data(), k1.size() * 4) != 0 ||
             std::memcmp(v1.data(), v2.data(), v1.size() * 4) != 0;
      ++n;
    }
  }
  INFO(n << " tokens read back");
  CHECK(n > 0);
  CHECK(bad == 0);
}

void compare_attention(const PagedKvCache<CpuKvBackend>& cpu, const PagedKvCache<CudaKvBackend>& gpu, int group,
                       std::mt19937_64& rng) {
  const int d = cpu.config().head_dim;
  const int hkv = cpu.config().num_streams;
  const int hq = hkv * group;
  std::vector<std::int32_t> streams(static_cast<std::size_t>(hkv));
  for (int h = 0; h < hkv; ++h) streams[static_cast<std::size_t>(h)] = hkv - 1 - h;  // not the identity
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(hq) * d);
  for (auto& x : q) x = nd(rng);
  std::vector<float> o1(q.size()), o2(q.size(), NAN), sp1(static_cast<std::size_t>(hq)), sp2(sp1.size(), NAN);
  thinkv::DecodeAttentionArgs a;
  a.num_q_heads = hq;
  a.num_kv_heads = hkv;
  a.kv_streams = streams.data();
  a.q = q.data();
  a.out = o1.data();
  a.sparsity = sp1.data();
  REQUIRE(cpu.attend(a).is_ok());
  a.out = o2.data();
  a.sparsity = sp2.data();
  const thinkv::Status s = gpu.attend(a);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  double max_ref = 0, max_err = 0;
  for (std::size_t i = 0; i < o1.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(o1[i])));
    max_err = std::max(max_err, std::fabs(static_cast<double>(o1[i]) - o2[i]));
  }
  int n_max = 1;
  for (int h = 0; h < hkv; ++h) {
    const int st = streams[static_cast<std::size_t>(h)];
    n_max = std::max<int>(n_max, static_cast<int>(cpu.table().live_slots(st)) + cpu.table().staged_count(st));
  }
  INFO("max|err| " << max_err << " max|out| " << max_ref << " n " << n_max);
  CHECK(max_err <= attention_tolerance(n_max, max_ref));
  CHECK(sp1 == sp2);  // the sparsity pass is exact
}

}  // namespace

TEST_CASE("CudaKvBackend stores, reads back and attends exactly as CpuKvBackend", "[cuda_backend]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  const Shape shapes[] = {
      {"Llama D=128 g=16 B=16 R4E4T2", 128, 16, 16, thinkv::kR4E4T2},
      {"D=128 g=16 B=128 R8E4T2", 128, 16, 128, precision_map("R8E4T2")},
      {"stories260K D=8 g=8 B=16 R8E8T4", 8, 8, 16, precision_map("R8E8T4")},
      {"D=64 g=32 B=32 BF16+FP8 R16E8T8", 64, 32, 32, precision_map("R16E8T8")},
      {"D=256 g=16 B=16 R4E4T2", 256, 16, 16, thinkv::kR4E4T2},
  };
  for (const Shape& sh : shapes) {
    DYNAMIC_SECTION(sh.name) {
      const int streams = 6;
      const int max_tokens = small ? 96 : 400;
      const CacheConfig cfg = make_config(sh, streams, max_tokens);
      PagedKvCache<CpuKvBackend> cpu(cfg);
      PagedKvCache<CudaKvBackend> gpu(cfg);
      for (int s = 0; s < streams; ++s) append_both(cpu, gpu, s, 1 + static_cast<int>(rng() % max_tokens), rng);
      compare_storage(cpu, gpu);
      // Evict 30-70% of each stream's live slots, then append again: commits reuse them in place.
      for (int s = 0; s < streams; ++s) {
        auto live = cpu.table().live_slot_list(s);
        std::shuffle(live.begin(), live.end(), rng);
        live.resize(live.size() * (3 + rng() % 5) / 10);
        REQUIRE(cpu.evict(s, live).is_ok());
        REQUIRE(gpu.evict(s, live).is_ok());
      }
      // At least half a stream's worth each, so that groups of every thought type commit and
      // some land on the evicted slots of their precision (a short draw could reuse none).
      for (int s = 0; s < streams; ++s) {
        append_both(cpu, gpu, s, max_tokens / 2 + static_cast<int>(rng() % max_tokens), rng);
      }
      CHECK(cpu.table().stats().slots_reused > 0);
      compare_storage(cpu, gpu);
      compare_tokens(cpu, gpu);
      compare_attention(cpu, gpu, 4, rng);
      compare_attention(cpu, gpu, 1, rng);
      // End of a sequence: stream 0 forgets its scales on both sides.
      REQUIRE(cpu.reset_stream(0).is_ok());
      REQUIRE(gpu.reset_stream(0).is_ok());
      compare_storage(cpu, gpu);
    }
  }
}

namespace {

// The ThinKvCache both decision tests run: 2 layers x 2 KV heads (8 query heads), head_dim 64,
// budget 160 in segments of 64, R4E4T2, a three-type classifier (tau 64).
thinkv::ThinKvConfig decision_config(int sequences) {
  thinkv::ThinKvConfig c;
  c.num_sequences = sequences;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 8;
  c.head_dim = 64;
  c.group_size = 16;
  c.block_size = 16;
  c.max_tokens = 1200;
  c.segment_len = 64;
  c.token_budget = 160;
  return c;
}
thinkv::ThinKvPolicy decision_policy() {
  thinkv::ThinKvPolicy p;
  p.retention = thinkv::RetentionSchedule({32, 16, 8, 4});
  p.precision = thinkv::kR4E4T2;
  p.classifier = thinkv::ThoughtClassifier::three_types(0.3f, 0.6f, {0, 1}, 64, 2);
  return p;
}

}  // namespace

TEST_CASE("ThinKvCache over CudaKvBackend takes the CPU backend's decisions", "[cuda_backend]") {
  TT_SEEDED_RNG();
  const thinkv::ThinKvConfig c = decision_config(1);
  const thinkv::ThinKvPolicy p = decision_policy();
  thinkv::ThinKvCache<CpuKvBackend> cpu(c, p);
  thinkv::ThinKvCache<CudaKvBackend> gpu(c, p);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int steps = tt::small_run() ? 200 : 700;
  std::vector<float> k(static_cast<std::size_t>(c.num_kv_heads * c.head_dim)), v(k.size());
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads * c.head_dim)), o1(q.size()), o2(q.size());
  float sharp = 1.0f;
  double worst = 0;
  for (int t = 0; t < steps; ++t) {
    if (t % 64 == 0) sharp = std::vector<float>{0.0f, 1.5f, 6.0f}[rng() % 3];
    REQUIRE(cpu.begin_token(0).is_ok());
    REQUIRE(gpu.begin_token(0).is_ok());
    for (int l = 0; l < c.num_layers; ++l) {
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      for (auto& x : q) x = nd(rng) * sharp;
      REQUIRE(cpu.append(0, l, k, v).is_ok());
      REQUIRE(gpu.append(0, l, k, v).is_ok());
      REQUIRE(cpu.attend(0, l, q, o1).is_ok());
      const thinkv::Status s = gpu.attend(0, l, q, o2);
      INFO("t " << t << " layer " << l << ": " << s.to_string());
      REQUIRE(s.is_ok());
      double max_ref = 0, max_err = 0;
      for (std::size_t i = 0; i < o1.size(); ++i) {
        max_ref = std::max(max_ref, std::fabs(static_cast<double>(o1[i])));
        max_err = std::max(max_err, std::fabs(static_cast<double>(o1[i]) - o2[i]));
      }
      worst = std::max(worst, max_err / std::max(max_ref, 1e-30));
      REQUIRE(max_err <= attention_tolerance(static_cast<int>(cpu.live_tokens(0)), max_ref));
    }
    REQUIRE(cpu.end_token(0).is_ok());
    REQUIRE(gpu.end_token(0).is_ok());
    REQUIRE(cpu.tracker(0).current() == gpu.tracker(0).current());
    REQUIRE(cpu.live_tokens(0) == gpu.live_tokens(0));
  }
  INFO("worst err / max|out| " << worst);
  CHECK(cpu.stats().tokens_evicted == gpu.stats().tokens_evicted);
  CHECK(cpu.stats().tokens_evicted > 0);
  CHECK(cpu.stats().refreshes == gpu.stats().refreshes);
  CHECK(cpu.tracker(0).stats().refresh_histogram == gpu.tracker(0).stats().refresh_histogram);
  compare_storage(cpu.paged(), gpu.paged());
  // The device mirror of the metadata went by changes (every output above was checked against
  // the CPU, so the changes were complete): whole copies only on the first attend and when the
  // storage grew or shrank.
  const thinkv::BackendStats bs = gpu.paged().backend().stats();
  const int attends = steps * c.num_layers;
  INFO("metadata: " << bs.metadata_full_uploads << " whole copies in " << attends << " attends, "
                    << bs.metadata_bytes_uploaded << " bytes");
  std::printf("metadata mirror: %lld whole copies in %d attends, %lld bytes uploaded\n",
              static_cast<long long>(bs.metadata_full_uploads), attends,
              static_cast<long long>(bs.metadata_bytes_uploaded));
  CHECK(bs.metadata_full_uploads >= 1);
  CHECK(bs.metadata_full_uploads * 4 < attends);
  CHECK(cpu.paged().backend().stats().metadata_bytes_uploaded == 0);
}

// Everything a user can observe of a GPU cache: every page, key-scale record and second-level
// scale on the device, every staged token, and the block table's per-stream counts.
struct Observed {
  std::vector<std::vector<std::uint8_t>> pages, records;
  std::vector<float> scales, staged;
  std::vector<std::int64_t> counts;
  bool operator==(const Observed&) const = default;
};

Observed observe(const PagedKvCache<CudaKvBackend>& c) {
  Observed o;
  const auto& gb = c.backend();
  const auto& pools = c.table().pools();
  for (std::uint32_t b = 0; b < pools.total; ++b) {
    if (pools.local_index(b) >= c.table().allocated_blocks(pools.precision_of(b))) continue;
    REQUIRE(gb.copy_page(b, o.pages.emplace_back()).is_ok());
  }
  const auto records = c.table().allocated_records();
  for (std::uint32_t r = 0; r < records; ++r) REQUIRE(gb.copy_record(r, o.records.emplace_back()).is_ok());
  const int d = c.config().head_dim;
  std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
  for (int s = 0; s < c.config().num_streams; ++s) {
    for (int kv = 0; kv < 2; ++kv) {
      for (Precision p : thinkv::kAllPrecisions) REQUIRE(gb.stream_scale(s, kv, p, o.scales.emplace_back()).is_ok());
    }
    for (int r = 0; r < c.table().staged_count(s); ++r) {
      REQUIRE(gb.read_staged(s, r, k.data(), v.data()).is_ok());
      o.staged.insert(o.staged.end(), k.begin(), k.end());
      o.staged.insert(o.staged.end(), v.begin(), v.end());
    }
    o.counts.push_back(c.table().staged_count(s));
    o.counts.push_back(static_cast<std::int64_t>(c.table().live_slots(s)));
    o.counts.push_back(static_cast<std::int64_t>(c.table().blocks(s).size()));
  }
  o.counts.push_back(static_cast<std::int64_t>(gb.stats().groups_quantized));
  return o;
}

TEST_CASE("A refused append leaves the GPU cache as it was", "[cuda_backend]") {
  TT_SEEDED_RNG();
  // Small pools so that one stream can exhaust them: 2 NVFP4 blocks (R and E), 1 ternary (T).
  const Shape sh{"D=64 g=16 B=16 R4E4T2", 64, 16, 16, thinkv::kR4E4T2};
  CacheConfig cfg = make_config(sh, 2, 64);
  for (int p = 0; p < thinkv::kNumPrecisions; ++p) cfg.pool_blocks[p] = 0;
  cfg.pool_blocks[static_cast<int>(Precision::kNvfp4)] = 2;
  cfg.pool_blocks[static_cast<int>(Precision::kTernary)] = 1;
  PagedKvCache<CpuKvBackend> cpu(cfg);
  PagedKvCache<CudaKvBackend> gpu(cfg);
  const int d = sh.d;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto token = [&](std::vector<float>& k, std::vector<float>& v) {
    k.resize(static_cast<std::size_t>(d));
    v.resize(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
  };
  std::vector<float> k, v;
  const auto R = thinkv::ThoughtType::kReasoning;
  // Stream 0: 2 committed groups (both NVFP4 blocks) and 15 staged tokens. Stream 1: 5 staged
  // tokens, its scales still unset.
  for (int i = 0; i < 47; ++i) {
    token(k, v);
    REQUIRE(cpu.append(0, k, v, R).is_ok());
    REQUIRE(gpu.append(0, k, v, R).is_ok());
  }
  for (int i = 0; i < 5; ++i) {
    token(k, v);
    REQUIRE(cpu.append(1, k, v, R).is_ok());
    REQUIRE(gpu.append(1, k, v, R).is_ok());
  }
  const Observed before = observe(gpu);
  auto refused = [&](int stream, const std::vector<float>& kk, const std::vector<float>& vv, thinkv::ThoughtType t,
                     thinkv::StatusCode want, const char* says) {
    const thinkv::Status s = gpu.append(stream, kk, vv, t);
    INFO(s.to_string());
    CHECK(s.code() == want);
    CHECK(s.message().find(says) != std::string::npos);
    CHECK(cpu.append(stream, kk, vv, t).code() == want);  // the CPU backend refuses the same
    CHECK(observe(gpu) == before);
  };
  SECTION("NaN, Inf or a magnitude past 2^64 in K or V") {
    token(k, v);
    k[7] = NAN;
    refused(1, k, v, R, thinkv::StatusCode::kNonFinite, "not finite");
    token(k, v);
    v[0] = -INFINITY;
    refused(1, k, v, R, thinkv::StatusCode::kNonFinite, "not finite");
    token(k, v);
    v[d - 1] = 3.4e38f;  // finite in FP32, past the largest magnitude ThinKV stores (2^64)
    refused(0, k, v, R, thinkv::StatusCode::kNonFinite, "largest magnitude");
    // The comparison sees a change: an accepted token (staged on the device) changes what is
    // observed.
    token(k, v);
    REQUIRE(cpu.append(1, k, v, R).is_ok());
    REQUIRE(gpu.append(1, k, v, R).is_ok());
    CHECK_FALSE(observe(gpu) == before);
  }
  SECTION("a wrong shape") {
    token(k, v);
    k.pop_back();
    refused(1, k, v, R, thinkv::StatusCode::kShapeMismatch, "head_dim = 64");
  }
  SECTION("a thought type change inside a staging group") {
    token(k, v);
    refused(1, k, v, thinkv::ThoughtType::kTransition, thinkv::StatusCode::kInvalidArgument, "group");
  }
  SECTION("a full pool: the 16th token of a group finds no NVFP4 block") {
    token(k, v);
    refused(0, k, v, R, thinkv::StatusCode::kPoolExhausted, "pool");
    // The cache stays usable: evict half of each committed group, then the staged group commits
    // into those slots in place.
    const auto live = cpu.table().live_slot_list(0);
    REQUIRE(live.size() == 32);
    std::vector<thinkv::SlotRef> half;
    for (std::size_t i = 0; i < live.size(); i += 2) half.push_back(live[i]);
    REQUIRE(cpu.evict(0, half).is_ok());
    REQUIRE(gpu.evict(0, half).is_ok());
    REQUIRE(cpu.append(0, k, v, R).is_ok());
    const thinkv::Status s = gpu.append(0, k, v, R);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    CHECK(cpu.table().stats().slots_reused == 16);
    CHECK(gpu.table().stats().slots_reused == 16);
  }
  // Whatever was refused, the GPU cache still equals the CPU cache fed the same calls.
  compare_storage(cpu, gpu);
  compare_tokens(cpu, gpu);
}

TEST_CASE("CudaKvBackend refuses what it cannot do, with a message", "[cuda_backend]") {
  SECTION("use before init") {
    CudaKvBackend b;
    float x[8] = {};
    const thinkv::Status s = b.stage(0, 0, x, x);
    CHECK(s.code() == thinkv::StatusCode::kInvalidArgument);
    CHECK(s.message().find("init") != std::string::npos);
  }
  SECTION("an attention shape the kernel does not serve") {
    const Shape sh{"D=48", 48, 16, 16, thinkv::kR4E4T2};  // 8, 32, 64, 128, 256 are served
    const CacheConfig cfg = make_config(sh, 1, 64);
    PagedKvCache<CudaKvBackend> gpu(cfg);
    std::vector<float> k(48, 0.5f), v(48, 0.25f), q(48, 1.0f), out(48);
    REQUIRE(gpu.append(0, k, v, thinkv::ThoughtType::kReasoning).is_ok());
    std::int32_t stream = 0;
    thinkv::DecodeAttentionArgs a;
    a.num_q_heads = 1;
    a.num_kv_heads = 1;
    a.kv_streams = &stream;
    a.q = q.data();
    a.out = out.data();
    const thinkv::Status s = gpu.attend(a);
    CHECK(s.code() == thinkv::StatusCode::kUnsupported);
    CHECK(s.message().find("head_dim 48") != std::string::npos);
  }
  SECTION("device memory exhausted when a pool grows") {
    if (std::getenv("THINKV_UNDER_SANITIZER") != nullptr) {
      // compute-sanitizer reports the failing cudaMalloc this section provokes as an error.
      WARN("skipped under compute-sanitizer (THINKV_UNDER_SANITIZER): it makes cudaMalloc fail on purpose");
      return;
    }
    CacheConfig cfg;
    cfg.num_streams = 1;
    cfg.head_dim = 256;
    cfg.group_size = 16;
    cfg.block_size = 16;
    cfg.precision = precision_map("R16E16T16");
    cfg.pool_blocks[static_cast<int>(Precision::kBf16)] = 1 << 26;  // 1 TiB of BF16 pages
    CudaKvBackend b;
    REQUIRE(b.init(cfg).is_ok());  // nothing is allocated for the pools up front
    const thinkv::Status s = b.resize_pool(Precision::kBf16, 1u << 26);
    INFO(s.to_string());
    CHECK(b.stats().bytes_allocated < (std::int64_t{1} << 30));  // nothing changed
    CHECK(s.code() == thinkv::StatusCode::kPoolExhausted);
    CHECK(s.message().find("bytes") != std::string::npos);
  }
}

TEST_CASE("CudaKvBackend counts the reallocations of its storage, and none once it is reserved", "[cuda_backend]") {
  const CacheConfig cfg = make_config(Shape{"D=64", 64, 16, 16, precision_map("R4E4T2")}, 2, 512);  // 208 blocks
  CudaKvBackend b;
  REQUIRE(b.init(cfg).is_ok());
  CHECK(b.stats().storage_reallocations == 0);
  REQUIRE(b.resize_pool(Precision::kNvfp4, 8).is_ok());  // grows
  CHECK(b.stats().storage_reallocations == 1);
  REQUIRE(b.resize_pool(Precision::kNvfp4, 8).is_ok());  // same size: nothing moves
  REQUIRE(b.resize_pool(Precision::kNvfp4, 5).is_ok());  // within the capacity (shrinks at half)
  CHECK(b.stats().storage_reallocations == 1);
  REQUIRE(b.resize_pool(Precision::kNvfp4, 40).is_ok());  // grows
  REQUIRE(b.resize_pool(Precision::kNvfp4, 4).is_ok());   // shrinks
  REQUIRE(b.resize_records(3).is_ok());                   // the records grow
  CHECK(b.stats().storage_reallocations == 4);
  REQUIRE(b.reserve_storage().is_ok());  // every range whole: the pools and records that differ move once
  const std::int64_t reserved = b.stats().storage_reallocations;
  CHECK(reserved > 4);
  REQUIRE(b.resize_pool(Precision::kNvfp4, 200).is_ok());
  REQUIRE(b.resize_pool(Precision::kNvfp4, 1).is_ok());
  REQUIRE(b.resize_records(1).is_ok());
  CHECK(b.stats().storage_reallocations == reserved);
}

namespace {

/// A CPU and a GPU cache decoding the same random tokens: after every layer the GPU's attention
/// is within attention_tolerance of the CPU's, after every token their types, segments and live
/// counts are equal. The queries' sharpness changes every 64 tokens (all three thought types).
template <class Rng>
struct TwinCaches {
  thinkv::ThinKvCache<CpuKvBackend>& cpu;
  thinkv::ThinKvCache<CudaKvBackend>& gpu;
  Rng& rng;
  std::normal_distribution<float> nd{0.0f, 1.0f};
  float sharp = 1.0f;
  void step(int t, std::initializer_list<int> seqs) {
    const thinkv::ThinKvConfig& c = cpu.config();
    std::vector<float> k(static_cast<std::size_t>(c.num_kv_heads * c.head_dim)), v(k.size());
    std::vector<float> q(static_cast<std::size_t>(c.num_q_heads * c.head_dim)), o1(q.size()), o2(q.size());
    if (t % 64 == 0) sharp = std::vector<float>{0.0f, 1.5f, 6.0f}[rng() % 3];
    for (int l = 0; l < c.num_layers; ++l) {
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      for (auto& x : q) x = nd(rng) * sharp;
      for (int s : seqs) {
        if (l == 0) {
          REQUIRE(cpu.begin_token(s).is_ok());
          REQUIRE(gpu.begin_token(s).is_ok());
        }
        REQUIRE(cpu.append(s, l, k, v).is_ok());
        REQUIRE(gpu.append(s, l, k, v).is_ok());
        REQUIRE(cpu.attend(s, l, q, o1).is_ok());
        REQUIRE(gpu.attend(s, l, q, o2).is_ok());
        double max_ref = 0, max_err = 0;
        for (std::size_t i = 0; i < o1.size(); ++i) {
          max_ref = std::max(max_ref, std::fabs(static_cast<double>(o1[i])));
          max_err = std::max(max_err, std::fabs(static_cast<double>(o1[i]) - o2[i]));
        }
        INFO("t " << t << " sequence " << s << " layer " << l);
        REQUIRE(max_err <= attention_tolerance(static_cast<int>(cpu.live_tokens(s)), max_ref));
      }
    }
    for (int s : seqs) {
      REQUIRE(cpu.end_token(s).is_ok());
      REQUIRE(gpu.end_token(s).is_ok());
      REQUIRE(cpu.tracker(s).current() == gpu.tracker(s).current());
      REQUIRE(cpu.segments(s) == gpu.segments(s));
      REQUIRE(cpu.live_tokens(s) == gpu.live_tokens(s));
    }
  }
};

}  // namespace

TEST_CASE("A sequence's saved state moves between the CPU and the GPU caches bit for bit", "[cuda_backend]") {
  // Both caches decode sequence 0 alike; each loads the other's saved state into sequence 1. The
  // two caches then hold the same bytes (the GPU's raw writes and reads, and the state's byte
  // layout, are the CPU backend's), saving the GPU's loaded sequence gives the CPU's bytes back,
  // and all four sequences decode on alike.
  TT_SEEDED_RNG();
  const thinkv::ThinKvConfig c = decision_config(2);
  const thinkv::ThinKvPolicy p = decision_policy();
  thinkv::ThinKvCache<CpuKvBackend> cpu(c, p);
  thinkv::ThinKvCache<CudaKvBackend> gpu(c, p);
  TwinCaches<decltype(rng)> twins{cpu, gpu, rng};
  auto step = [&](int t, std::initializer_list<int> seqs) { twins.step(t, seqs); };
  for (int t = 0; t < 500; ++t) step(t, {0});
  REQUIRE(cpu.stats().tokens_evicted > 0);
  std::vector<std::uint8_t> from_cpu, from_gpu, again;
  REQUIRE(cpu.save_sequence(0, from_cpu).is_ok());
  REQUIRE(gpu.save_sequence(0, from_gpu).is_ok());
  const thinkv::Status lg = gpu.load_sequence(1, from_cpu);
  INFO(lg.to_string());
  REQUIRE(lg.is_ok());
  REQUIRE(cpu.load_sequence(1, from_gpu).is_ok());
  REQUIRE(gpu.save_sequence(1, again).is_ok());
  REQUIRE(again == from_cpu);
  compare_storage(cpu.paged(), gpu.paged());
  for (int t = 500; t < 700; ++t) step(t, {0, 1});
  REQUIRE(cpu.segments(0) == cpu.segments(1));
  REQUIRE(gpu.segments(0) == gpu.segments(1));
  compare_storage(cpu.paged(), gpu.paged());
}

TEST_CASE("A sequence copied on the GPU holds the CPU copy's bytes and decodes on alike", "[cuda_backend]") {
  // copy_sequence (llama.cpp's seq_cp) through CudaKvBackend's raw reads and writes: a whole copy
  // and a range copy on both caches give the same storage (compare_storage), the GPU's copy saves
  // the bytes of its source, and all the sequences decode on alike.
  TT_SEEDED_RNG();
  const thinkv::ThinKvConfig c = decision_config(3);
  const thinkv::ThinKvPolicy p = decision_policy();
  thinkv::ThinKvCache<CpuKvBackend> cpu(c, p);
  thinkv::ThinKvCache<CudaKvBackend> gpu(c, p);
  TwinCaches<decltype(rng)> twins{cpu, gpu, rng};
  for (int t = 0; t < 450; ++t) twins.step(t, {0});
  REQUIRE(cpu.stats().tokens_evicted > 0);
  REQUIRE(cpu.copy_sequence(0, 1).is_ok());
  const thinkv::Status cg = gpu.copy_sequence(0, 1);
  INFO(cg.to_string());
  REQUIRE(cg.is_ok());
  const std::int32_t p0 = 32 + static_cast<std::int32_t>(rng() % 64), p1 = 16 * (10 + static_cast<int>(rng() % 12));
  const thinkv::Status rc = cpu.copy_sequence(0, 2, p0, p1);
  INFO(rc.to_string());
  REQUIRE(gpu.copy_sequence(0, 2, p0, p1).code() == rc.code());
  std::vector<std::uint8_t> s0, s1;
  REQUIRE(gpu.save_sequence(0, s0).is_ok());
  REQUIRE(gpu.save_sequence(1, s1).is_ok());
  REQUIRE(s0 == s1);
  REQUIRE(cpu.save_sequence(0, s0).is_ok());  // (the two caches' states differ in the tracker's timings)
  REQUIRE(cpu.save_sequence(1, s1).is_ok());
  REQUIRE(s0 == s1);
  compare_storage(cpu.paged(), gpu.paged());
  for (int t = 450; t < 650; ++t) {
    if (rc.is_ok()) {
      twins.step(t, {0, 1, 2});
    } else {
      twins.step(t, {0, 1});
    }
  }
  REQUIRE(gpu.segments(0) == gpu.segments(1));
  compare_storage(cpu.paged(), gpu.paged());
}

TEST_CASE("A context shift on the GPU stores the keys the CPU's shift stores, and decodes on alike", "[cuda_backend]") {
  // shift_positions (llama.cpp's seq_add) through CudaKvBackend's raw page reads and writes and its
  // staging rows: after llama.cpp's context shift (remove a block, move what follows down by its
  // size) both caches hold the same bytes (compare_storage: the re-rotated BF16 keys included) and
  // decode on alike (TwinCaches compares every attention output).
  TT_SEEDED_RNG();
  const thinkv::ThinKvConfig c = decision_config(2);
  thinkv::ThinKvPolicy p = decision_policy();
  p.precision = thinkv::kFullKvMap;  // BF16 pages: quantized pages refuse a shift
  thinkv::ThinKvCache<CpuKvBackend> cpu(c, p);
  thinkv::ThinKvCache<CudaKvBackend> gpu(c, p);
  TwinCaches<decltype(rng)> twins{cpu, gpu, rng};
  for (int t = 0; t < 300; ++t) twins.step(t, {0, 1});
  REQUIRE(cpu.stats().tokens_evicted > 0);
  const thinkv::RopeSpec rope;
  REQUIRE(cpu.remove(0, 40, 104).is_ok());
  REQUIRE(gpu.remove(0, 40, 104).is_ok());
  REQUIRE(cpu.shift_positions(0, 104, -1, -64, rope).is_ok());
  const thinkv::Status sg = gpu.shift_positions(0, 104, -1, -64, rope);
  INFO(sg.to_string());
  REQUIRE(sg.is_ok());
  REQUIRE(gpu.position(0) == 236);
  REQUIRE(cpu.segments(0) == gpu.segments(0));
  compare_storage(cpu.paged(), gpu.paged());
  for (int t = 300; t < 420; ++t) twins.step(t, {0, 1});
  compare_storage(cpu.paged(), gpu.paged());
}
