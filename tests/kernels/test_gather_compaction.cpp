// GPU test: gather-compaction (thinkv::bench::launch_gather_compaction), the copy a token-level
// eviction method must make and ThinKV never does, against a host reference compaction written
// here. Fresh random inputs per run (seed printed; THINKV_TEST_SEED pins it; THINKV_TEST_SMALL=1,
// set under compute-sanitizer, takes 1/4 the tokens): a CPU PagedKvCache with random tokens,
// one thought type (so one precision pool) per stream over maps that use all four pools, random
// evictions followed by in-place reuse; uploaded with DeviceCacheUpload. Checks:
//  - every byte of the destination pools and metadata equals the host reference (poisoned
//    separate buffers; or the uploaded cache's own buffers, compacting into its free blocks,
//    where every other block, source blocks included, must stay untouched);
//  - the destination read back with the CPU's dequantization gives, bit for bit, the source's
//    live tokens in attention order (CpuKvBackend::gather);
//  - live counts; truncation when the destination list is short; streams that break the one-pool
//    rule or name bad blocks are skipped whole (live count -1, nothing written);
//  - parameters the launcher must refuse before launching.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda_check.hpp"
#include "device_cache_upload.hpp"
#include "gather_compaction/gather_compaction.hpp"
#include "thinkv/thinkv.hpp"

namespace {

using thinkv::kNumPrecisions;
using thinkv::Precision;
using Cache = thinkv::PagedKvCache<>;

#define REQUIRE_OK(expr)                     \
  do {                                       \
    const thinkv::Status s_ = (expr);        \
    INFO(#expr << " -> " << s_.to_string()); \
    REQUIRE(s_.is_ok());                     \
  } while (0)

struct Shape {
  const char* name;
  int head_dim, group_size, block_size, streams, min_tokens, max_tokens, num_splits;
};

int small_div() { return std::getenv("THINKV_TEST_SMALL") != nullptr ? 4 : 1; }

/// Appends n tokens to a stream. thought < 0: a random type per group (the stream may then mix
/// pools); else every token has that type.
void append_tokens(Cache& cache, int stream, int n, int thought, std::mt19937& rng) {
  const int d = cache.config().head_dim;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
  auto t = static_cast<thinkv::ThoughtType>(thought >= 0 ? thought : static_cast<int>(rng() % 3));
  for (int i = 0; i < n; ++i) {
    const int staged = cache.table().staged_count(stream);
    if (thought < 0 && staged == 0 && rng() % 3 == 0) t = static_cast<thinkv::ThoughtType>(rng() % 3);
    if (staged > 0) t = cache.table().staged_thought(stream);
    const float amp = 0.25f + static_cast<float>(rng() % 8);
    for (int c = 0; c < d; ++c) {
      k[static_cast<std::size_t>(c)] = nd(rng) * amp;
      v[static_cast<std::size_t>(c)] = nd(rng) * amp;
    }
    REQUIRE_OK(cache.append(stream, k, v, t));
  }
}

void evict_random(Cache& cache, int stream, double share, std::mt19937& rng) {
  auto live = cache.table().live_slot_list(stream);
  std::shuffle(live.begin(), live.end(), rng);
  live.resize(static_cast<std::size_t>(static_cast<double>(live.size()) * share));
  REQUIRE_OK(cache.evict(stream, live));
}

/// A cache of `sh.streams` streams: stream 1 holds staged tokens only (no block); the others get
/// tokens, ~50% evicted, refilled (in-place reuse), evicted again. mixed_every > 0: streams
/// s % mixed_every == 0 take a random thought per group (usually two pools); the others one
/// random thought type each.
std::unique_ptr<Cache> build_cache(const Shape& sh, const thinkv::PrecisionMap& map, int mixed_every,
                                   std::mt19937& rng) {
  thinkv::CacheConfig cfg;
  cfg.num_streams = sh.streams;
  cfg.head_dim = sh.head_dim;
  cfg.group_size = sh.group_size;
  cfg.block_size = sh.block_size;
  cfg.precision = map;
  // Worst case per stream, twice (sources + destinations), all streams possibly in one pool.
  const int per_stream = (2 * sh.max_tokens + 2 * sh.group_size) / sh.block_size + 4;
  for (int p = 0; p < kNumPrecisions; ++p) {
    cfg.pool_blocks[static_cast<std::size_t>(p)] =
        map.uses(static_cast<Precision>(p)) ? 2 * sh.streams * per_stream : 0;
  }
  auto cache = std::make_unique<Cache>(cfg);
  const int div = small_div();
  std::uniform_int_distribution<int> ntok(sh.min_tokens / div, sh.max_tokens / div);
  for (int s = 0; s < sh.streams; ++s) {
    if (s == 1) {
      append_tokens(*cache, s, sh.group_size - 1, 0, rng);
      continue;
    }
    const int thought = mixed_every > 0 && s % mixed_every == 0 ? -1 : static_cast<int>(rng() % 3);
    append_tokens(*cache, s, ntok(rng), thought, rng);
    evict_random(*cache, s, 0.3 + 0.4 * std::uniform_real_distribution<double>(0, 1)(rng), rng);
    append_tokens(*cache, s, ntok(rng) / 2 + 1, thought, rng);
    evict_random(*cache, s, 0.15, rng);
  }
  return cache;
}

/// Host copies of the device buffers a compaction writes.
struct Buffers {
  std::vector<std::uint8_t> pages[kNumPrecisions];
  std::vector<std::uint16_t> fill;
  std::vector<std::uint64_t> mask;
  std::vector<std::uint32_t> record;
};

struct DeviceBuffers {  // separate destination buffers (owned)
  std::uint8_t* pages[kNumPrecisions] = {};
  std::uint16_t* fill = nullptr;
  std::uint64_t* mask = nullptr;
  std::uint32_t* record = nullptr;
  ~DeviceBuffers() {
    for (auto* p : pages) (void)cudaFree(p);
    (void)cudaFree(fill);
    (void)cudaFree(mask);
    (void)cudaFree(record);
  }
};

template <class T>
void download(std::vector<T>& host, const T* dev, std::size_t n) {
  host.resize(n);
  if (n > 0) CHECK_CUDA(cudaMemcpy(host.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost));
}

/// The CPU dequantization of one slot (CpuKvBackend::read_token's expression, from the page bytes).
void dequant_slot(Precision p, const std::uint8_t* page, int bs, int d, int g, int slot, const std::uint8_t* rec,
                  float s2k, float s2v, float* k, float* v) {
  const int rb = (d * thinkv::bits_of(p) + 7) / 8;
  const std::uint8_t* kr = page + static_cast<std::size_t>(slot) * rb;
  const std::uint8_t* vr = page + static_cast<std::size_t>(bs + slot) * rb;
  if (p == Precision::kBf16) {
    for (int c = 0; c < d; ++c) {
      k[c] = thinkv::decode_bf16(static_cast<std::uint16_t>(kr[2 * c] | (kr[2 * c + 1] << 8)));
      v[c] = thinkv::decode_bf16(static_cast<std::uint16_t>(vr[2 * c] | (vr[2 * c + 1] << 8)));
    }
    return;
  }
  const std::uint8_t* vs = page + 2 * static_cast<std::size_t>(bs) * rb + static_cast<std::size_t>(slot) * (d / g);
  for (int c = 0; c < d; ++c) {
    k[c] = thinkv::decode_element(p, thinkv::load_code(p, kr, c)) * (thinkv::decode_e4m3(rec[c]) * s2k);
    v[c] = thinkv::decode_element(p, thinkv::load_code(p, vr, c)) * (thinkv::decode_e4m3(vs[c / g]) * s2v);
  }
}

/// One launch: the listed streams, their destination lists, what the kernel should do.
struct Plan {
  std::vector<std::int32_t> streams;
  std::vector<std::int32_t> indptr{0};
  std::vector<std::uint32_t> indices;
  std::vector<std::int32_t> want_live;  // live count, or -1 for a stream to be skipped
};

/// Pool of a stream's blocks, or -1 when it has none, -2 when they span several pools.
int stream_pool(const thinkv::BlockTable& t, int s) {
  int pool = -1;
  for (std::uint32_t b : t.blocks(s)) {
    const int p = static_cast<int>(t.block_precision(b));
    if (pool == -1) pool = p;
    if (p != pool) return -2;
  }
  return pool;
}

/// Lists a random subset of the streams (shuffled) with fresh destination blocks of their pool,
/// taken from the free blocks: enough for their live tokens, sometimes one more (empty), and one
/// stream one short (truncated). With `bad_entries`: out-of-range stream ids, a stream given a
/// destination block of another pool, a stream given a block id past the pools.
Plan make_plan(const Cache& cache, bool bad_entries, std::mt19937& rng) {
  const thinkv::BlockTable& t = cache.table();
  const int bs = cache.config().block_size;
  std::vector<std::vector<std::uint32_t>> free_blocks(kNumPrecisions);
  for (std::uint32_t b = 0; b < t.pools().total; ++b) {
    if (t.block_owner(b) == thinkv::kNoStream) free_blocks[static_cast<std::size_t>(t.block_precision(b))].push_back(b);
  }
  for (auto& f : free_blocks) std::shuffle(f.begin(), f.end(), rng);
  std::vector<int> used_pools;
  for (int p = 0; p < kNumPrecisions; ++p) {
    if (!free_blocks[static_cast<std::size_t>(p)].empty()) used_pools.push_back(p);
  }
  Plan plan;
  std::vector<std::int32_t> order;
  for (int s = 0; s < cache.config().num_streams; ++s) {
    if (s == 0 || s == 1 || rng() % 5 != 0) order.push_back(s);
  }
  if (bad_entries) {
    order.push_back(cache.config().num_streams + 3);
    order.push_back(-1);
  }
  std::shuffle(order.begin(), order.end(), rng);
  bool truncated = false;
  int wrong_pool = bad_entries ? 1 : 0, past_pools = bad_entries ? 1 : 0;
  auto take = [&](int p) {
    auto& f = free_blocks[static_cast<std::size_t>(p)];
    REQUIRE(!f.empty());
    const std::uint32_t b = f.back();
    f.pop_back();
    return b;
  };
  for (std::int32_t s : order) {
    plan.streams.push_back(s);
    std::int32_t want = -1;
    if (s >= 0 && s < cache.config().num_streams) {
      const int pool = stream_pool(t, s);
      const auto live = static_cast<int>(t.live_slots(s));
      const int need = (live + bs - 1) / bs;
      if (pool == -2) {  // mixed pools: skipped; give it destinations of its first block's pool
        const int p0 = static_cast<int>(t.block_precision(t.blocks(s)[0]));
        for (int j = 0; j < need; ++j) plan.indices.push_back(take(p0));
      } else {
        const int p = pool >= 0 ? pool : used_pools[rng() % used_pools.size()];
        int n = need + (rng() % 3 == 0 ? 1 : 0);
        if (!truncated && need >= 2) {
          n = need - 1;
          truncated = true;
        }
        want = live;
        for (int j = 0; j < n; ++j) plan.indices.push_back(take(p));
        if (pool >= 0 && n > 0 && wrong_pool > 0 && used_pools.size() > 1) {
          const int other = used_pools[(std::find(used_pools.begin(), used_pools.end(), p) - used_pools.begin() + 1) %
                                       used_pools.size()];
          plan.indices.back() = take(other);
          want = -1;
          --wrong_pool;
        } else if (n > 0 && past_pools > 0 && want >= 0) {
          plan.indices[plan.indices.size() - 1] = t.pools().total + 7;
          want = -1;
          --past_pools;
        }
      }
    }
    plan.want_live.push_back(want);
    plan.indptr.push_back(static_cast<std::int32_t>(plan.indices.size()));
  }
  return plan;
}

/// Applies the plan's compaction to `buf` on the host (the reference).
void reference_compaction(const Cache& cache, const Plan& plan, Buffers& buf) {
  const thinkv::BlockTable& t = cache.table();
  const thinkv::CacheLayout& lay = cache.layout();
  const thinkv::PoolMap& pools = t.pools();
  const int bs = lay.block_size;
  const int words = lay.evict_mask_words();
  for (std::size_t i = 0; i < plan.streams.size(); ++i) {
    if (plan.want_live[i] < 0) continue;
    const int s = plan.streams[i];
    const auto live = t.live_slot_list(s);
    const std::int32_t db = plan.indptr[i];
    const std::int32_t nd = plan.indptr[i + 1] - db;
    const std::size_t n_out = std::min<std::size_t>(live.size(), static_cast<std::size_t>(nd) * bs);
    for (std::size_t pos = 0; pos < n_out; ++pos) {
      const thinkv::SlotRef src = live[pos];
      const std::uint32_t d = plan.indices[static_cast<std::size_t>(db) + pos / static_cast<std::size_t>(bs)];
      const auto dslot = static_cast<std::uint32_t>(pos % static_cast<std::size_t>(bs));
      const Precision p = pools.precision_of(src.block);
      const auto rb = static_cast<std::size_t>(lay.row_bytes(p));
      const auto vsb = static_cast<std::size_t>(lay.value_scale_bytes(p));
      const auto pb = static_cast<std::size_t>(lay.page_bytes(p));
      const auto page = cache.backend().page(src.block);
      std::uint8_t* dpage = buf.pages[static_cast<int>(p)].data() + pools.local_index(d) * pb;
      for (int kv = 0; kv < 2; ++kv) {
        std::memcpy(dpage + (static_cast<std::size_t>(kv) * bs + dslot) * rb,
                    page.data() + (static_cast<std::size_t>(kv) * bs + src.slot) * rb, rb);
      }
      std::memcpy(dpage + 2 * static_cast<std::size_t>(bs) * rb + dslot * vsb,
                  page.data() + 2 * static_cast<std::size_t>(bs) * rb + src.slot * vsb, vsb);
      buf.record[static_cast<std::size_t>(d) * bs + dslot] = t.slot_record(src);
    }
    for (std::int32_t j = 0; j < nd; ++j) {
      const std::uint32_t d = plan.indices[static_cast<std::size_t>(db + j)];
      const std::int64_t rest = static_cast<std::int64_t>(n_out) - static_cast<std::int64_t>(j) * bs;
      const int fill = static_cast<int>(std::clamp<std::int64_t>(rest, 0, bs));
      buf.fill[d] = static_cast<std::uint16_t>(fill);
      for (int w = 0; w < words; ++w) buf.mask[static_cast<std::size_t>(d) * words + w] = 0;
      for (int sl = fill; sl < bs; ++sl) buf.record[static_cast<std::size_t>(d) * bs + sl] = thinkv::kNoRecord;
    }
  }
}

template <class T>
std::size_t count_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return a.size() + b.size();
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

/// Builds the plan, launches, compares. in_place: the destination is the uploaded cache itself.
/// Returns the number of tokens copied and checked. With bad_entries, a draw may leave no listed
/// stream to copy (all skipped, or no free block in place): callers check the total over draws.
std::size_t run_case(const Cache& cache, bool in_place, bool bad_entries, int num_splits, std::mt19937& rng) {
  const thinkv::BlockTable& t = cache.table();
  const thinkv::CacheLayout& lay = cache.layout();
  const thinkv::PoolMap& pools = t.pools();
  const int bs = lay.block_size;
  const int d = lay.head_dim;
  const int g = lay.group_size;
  const int words = lay.evict_mask_words();
  const Plan plan = make_plan(cache, bad_entries, rng);
  const std::size_t n = plan.streams.size();

  thinkv::test::DeviceCacheUpload up;
  CHECK_CUDA(up.upload(cache));
  const thinkv::kernels::PagedKvView& view = up.view();
  const std::size_t nblocks = pools.total;

  thinkv::bench::GatherCompactionParams prm;
  prm.src = view;
  prm.head_dim = d;
  prm.group_size = g;
  prm.block_size = bs;
  prm.num_streams = static_cast<int>(n);
  prm.num_splits = num_splits;

  // The buffers before the launch: the upload (in place) or poison (separate, 0x5A everywhere).
  Buffers before;
  DeviceBuffers sep;
  for (int p = 0; p < kNumPrecisions; ++p) {
    const std::size_t bytes =
        static_cast<std::size_t>(pools.count[p]) * static_cast<std::size_t>(lay.page_bytes(static_cast<Precision>(p)));
    if (bytes == 0) continue;
    if (in_place) {
      download(before.pages[p], view.pages[p], bytes);
      prm.dst_pages[p] = const_cast<std::uint8_t*>(view.pages[p]);
    } else {
      before.pages[p].assign(bytes, 0x5A);
      CHECK_CUDA(cudaMalloc(&sep.pages[p], bytes));
      CHECK_CUDA(cudaMemset(sep.pages[p], 0x5A, bytes));
      prm.dst_pages[p] = sep.pages[p];
    }
  }
  if (in_place) {
    download(before.fill, view.block_fill, nblocks);
    download(before.mask, view.evict_mask, nblocks * words);
    download(before.record, view.slot_record, nblocks * bs);
    prm.dst_block_fill = const_cast<std::uint16_t*>(view.block_fill);
    prm.dst_evict_mask = const_cast<std::uint64_t*>(view.evict_mask);
    prm.dst_slot_record = const_cast<std::uint32_t*>(view.slot_record);
  } else {
    before.fill.assign(nblocks, 0x5A5A);
    before.mask.assign(nblocks * words, 0x5A5A5A5A5A5A5A5Aull);
    before.record.assign(nblocks * bs, 0x5A5A5A5Au);
    CHECK_CUDA(cudaMalloc(&sep.fill, nblocks * sizeof(std::uint16_t)));
    CHECK_CUDA(cudaMalloc(&sep.mask, nblocks * words * sizeof(std::uint64_t)));
    CHECK_CUDA(cudaMalloc(&sep.record, nblocks * bs * sizeof(std::uint32_t)));
    CHECK_CUDA(cudaMemset(sep.fill, 0x5A, nblocks * sizeof(std::uint16_t)));
    CHECK_CUDA(cudaMemset(sep.mask, 0x5A, nblocks * words * sizeof(std::uint64_t)));
    CHECK_CUDA(cudaMemset(sep.record, 0x5A, nblocks * bs * sizeof(std::uint32_t)));
    prm.dst_block_fill = sep.fill;
    prm.dst_evict_mask = sep.mask;
    prm.dst_slot_record = sep.record;
  }

  std::int32_t *dstreams = nullptr, *dindptr = nullptr, *dlive = nullptr;
  std::uint32_t* dindices = nullptr;
  CHECK_CUDA(cudaMalloc(&dstreams, n * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMalloc(&dindptr, (n + 1) * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMalloc(&dlive, n * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMalloc(&dindices, std::max<std::size_t>(plan.indices.size(), 1) * sizeof(std::uint32_t)));
  CHECK_CUDA(cudaMemcpy(dstreams, plan.streams.data(), n * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dindptr, plan.indptr.data(), (n + 1) * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  if (!plan.indices.empty()) {
    CHECK_CUDA(
        cudaMemcpy(dindices, plan.indices.data(), plan.indices.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMemset(dlive, 0x5A, n * sizeof(std::int32_t)));
  prm.streams = dstreams;
  prm.dst_indptr = dindptr;
  prm.dst_indices = dindices;
  prm.live_counts = dlive;

  REQUIRE(thinkv::bench::check_gather_compaction(prm) == cudaSuccess);
  CHECK_CUDA(thinkv::bench::launch_gather_compaction(prm, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  Buffers got;
  for (int p = 0; p < kNumPrecisions; ++p) download(got.pages[p], prm.dst_pages[p], before.pages[p].size());
  download(got.fill, prm.dst_block_fill, nblocks);
  download(got.mask, prm.dst_evict_mask, nblocks * words);
  download(got.record, prm.dst_slot_record, nblocks * bs);
  std::vector<std::int32_t> got_live;
  download(got_live, dlive, n);

  Buffers want = before;
  reference_compaction(cache, plan, want);

  std::size_t page_diff = 0;
  for (int p = 0; p < kNumPrecisions; ++p) page_diff += count_diff(got.pages[p], want.pages[p]);
  const std::size_t fill_diff = count_diff(got.fill, want.fill);
  const std::size_t mask_diff = count_diff(got.mask, want.mask);
  const std::size_t rec_diff = count_diff(got.record, want.record);
  std::size_t live_diff = 0, skipped = 0, copied = 0;
  for (std::size_t i = 0; i < n; ++i) {
    live_diff += got_live[i] != plan.want_live[i];
    skipped += plan.want_live[i] < 0;
  }

  // The destination, dequantized as the CPU backend does, against the source's live tokens.
  std::size_t value_diff = 0;
  std::vector<float> k, v, dk(static_cast<std::size_t>(d)), dv(dk.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (plan.want_live[i] < 0) continue;
    const int s = plan.streams[i];
    std::vector<thinkv::StreamView> svs;
    const std::int32_t sid = s;
    const thinkv::AttendView av = t.attend_view(std::span<const std::int32_t>(&sid, 1), svs);
    REQUIRE_OK(cache.backend().gather(av, av.streams[0], k, v));
    const std::size_t live = t.live_slot_list(s).size();
    const std::size_t nd = static_cast<std::size_t>(plan.indptr[i + 1] - plan.indptr[i]);
    const std::size_t n_out = std::min(live, nd * static_cast<std::size_t>(bs));
    for (std::size_t pos = 0; pos < n_out; ++pos) {
      const std::uint32_t db =
          plan.indices[static_cast<std::size_t>(plan.indptr[i]) + pos / static_cast<std::size_t>(bs)];
      const int slot = static_cast<int>(pos % static_cast<std::size_t>(bs));
      const Precision p = pools.precision_of(db);
      const std::uint8_t* page =
          got.pages[static_cast<int>(p)].data() + pools.local_index(db) * static_cast<std::size_t>(lay.page_bytes(p));
      const std::uint32_t r = got.record[static_cast<std::size_t>(db) * bs + slot];
      const bool quant = p != Precision::kBf16;
      if (quant && r >= static_cast<std::uint32_t>(t.record_capacity())) {
        ++value_diff;
        continue;
      }
      dequant_slot(p, page, bs, d, g, slot, quant ? cache.backend().record_scales(r).data() : nullptr,
                   cache.backend().stream_scale(s, 0, p), cache.backend().stream_scale(s, 1, p), dk.data(), dv.data());
      value_diff += std::memcmp(dk.data(), k.data() + pos * d, dk.size() * sizeof(float)) != 0;
      value_diff += std::memcmp(dv.data(), v.data() + pos * d, dv.size() * sizeof(float)) != 0;
      ++copied;
    }
  }
  std::printf(
      "%s %s listed=%zu skipped=%zu tokens=%zu splits=%d: diffs pages %zu fill %zu mask %zu "
      "records %zu live %zu values %zu\n",
      (page_diff | fill_diff | mask_diff | rec_diff | live_diff | value_diff) ? "FAIL" : "ok  ",
      in_place ? "in place" : "separate", n, skipped, copied, thinkv::bench::gather_compaction_splits(prm), page_diff,
      fill_diff, mask_diff, rec_diff, live_diff, value_diff);
  CHECK(page_diff == 0);
  CHECK(fill_diff == 0);
  CHECK(mask_diff == 0);
  CHECK(rec_diff == 0);
  CHECK(live_diff == 0);
  CHECK(value_diff == 0);
  if (!bad_entries) CHECK(copied > 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK_CUDA(cudaFree(dstreams));
  CHECK_CUDA(cudaFree(dindptr));
  CHECK_CUDA(cudaFree(dlive));
  CHECK_CUDA(cudaFree(dindices));
  return copied;
}

// Maps whose per-stream thought types put streams in all four pools.
const thinkv::PrecisionMap kMapBf16Fp8Fp4{Precision::kBf16, Precision::kFp8E4M3, Precision::kNvfp4};
const thinkv::PrecisionMap kMapFp8Fp4Tern{Precision::kFp8E4M3, Precision::kNvfp4, Precision::kTernary};

const Shape kShapes[] = {
    // name, D, g, B, streams, tokens min..max, splits (0 = automatic)
    {"Llama-3-8B D=128 g=16 B=16", 128, 16, 16, 16, 200, 1200, 0},
    {"D=128 g=16 B=16 split=1", 128, 16, 16, 8, 300, 2500, 1},
    {"D=64 g=32 B=32 split=3", 64, 32, 32, 8, 100, 600, 3},
    {"D=8 g=8 B=16 split=7 (2..16-byte rows)", 8, 8, 16, 12, 100, 500, 7},
    {"D=24 g=8 B=7 split=5 (odd sizes)", 24, 8, 7, 8, 50, 400, 5},
    {"D=128 g=8 B=100 (2 mask words)", 128, 8, 100, 6, 300, 2000, 0},
    {"D=256 g=16 B=128 split=64", 256, 16, 128, 4, 100, 900, 64},
    {"D=8 g=8 B=1 split=256", 8, 8, 1, 6, 20, 300, 256},
    {"D=64 g=16 B=4096 (64 mask words)", 64, 16, 4096, 3, 2000, 5000, 2},
};

}  // namespace

TEST_CASE("gather compaction into separate poisoned buffers matches the host reference byte for byte",
          "[gpu][gather]") {
  std::mt19937 rng(gpu_test_start());
  for (const Shape& sh : kShapes) {
    for (const thinkv::PrecisionMap& map : {kMapBf16Fp8Fp4, kMapFp8Fp4Tern}) {
      INFO(sh.name << " map " << map.to_string());
      std::printf("%-40s map=%-7s ", sh.name, map.to_string().c_str());
      const auto cache = build_cache(sh, map, 0, rng);
      run_case(*cache, false, false, sh.num_splits, rng);
    }
  }
}

TEST_CASE("gather compaction in place into free blocks of the same cache leaves every other byte alone",
          "[gpu][gather]") {
  std::mt19937 rng(gpu_test_start());
  for (const Shape& sh : kShapes) {
    const thinkv::PrecisionMap& map = (rng() & 1) ? kMapBf16Fp8Fp4 : kMapFp8Fp4Tern;
    INFO(sh.name << " map " << map.to_string());
    std::printf("%-40s map=%-7s ", sh.name, map.to_string().c_str());
    const auto cache = build_cache(sh, map, 0, rng);
    run_case(*cache, true, false, sh.num_splits, rng);
  }
}

TEST_CASE("gather compaction skips streams that span pools or name bad blocks and only those", "[gpu][gather]") {
  std::mt19937 rng(gpu_test_start());
  const Shape shapes[] = {
      {"Llama-3-8B D=128 g=16 B=16 mixed", 128, 16, 16, 12, 200, 1000, 0},
      {"D=64 g=16 B=32 mixed split=4", 64, 16, 32, 10, 100, 700, 4},
  };
  std::size_t copied = 0;
  for (const Shape& sh : shapes) {
    for (const thinkv::PrecisionMap& map : {thinkv::kR4E4T2, kMapFp8Fp4Tern}) {
      for (const bool in_place : {false, true}) {
        INFO(sh.name << " map " << map.to_string() << (in_place ? " in place" : " separate"));
        std::printf("%-40s map=%-7s ", sh.name, map.to_string().c_str());
        const auto cache = build_cache(sh, map, 3, rng);
        copied += run_case(*cache, in_place, true, sh.num_splits, rng);
      }
    }
  }
  CHECK(copied > 0);  // the eligible streams of the eight draws were copied and checked
}

TEST_CASE("gather compaction refuses bad parameters before launching", "[gpu][gather]") {
  using namespace thinkv::kernels;
  using namespace thinkv::bench;
  std::int32_t dummy_i[2] = {};
  std::uint8_t dummy_b[16] = {};
  std::uint16_t dummy_h[1] = {};
  std::uint32_t dummy_u[1] = {};
  std::uint64_t dummy_w[1] = {};
  GatherCompactionParams good;
  good.src.num_streams = 1;
  good.src.pages[0] = dummy_b;
  good.src.pool_count[0] = 1;
  good.src.total_blocks = 1;
  good.src.pool_base[1] = good.src.pool_base[2] = good.src.pool_base[3] = 1;
  good.src.block_fill = dummy_h;
  good.src.evict_mask = dummy_w;
  good.src.slot_record = dummy_u;
  good.src.block_indptr = dummy_i;
  good.src.block_indices = dummy_u;
  good.head_dim = 64;
  good.group_size = 16;
  good.block_size = 16;
  good.num_streams = 1;
  good.streams = dummy_i;
  good.dst_indptr = dummy_i;
  good.dst_indices = dummy_u;
  good.dst_pages[0] = dummy_b;
  good.dst_block_fill = dummy_h;
  good.dst_evict_mask = dummy_w;
  good.dst_slot_record = dummy_u;
  REQUIRE(check_gather_compaction(good) == cudaSuccess);
  // A stream of an empty pool needs no pages; key scales, s2 and staging are never read.
  {
    GatherCompactionParams p = good;
    p.src.s2 = nullptr;
    p.src.staging = nullptr;
    p.src.staged_count = nullptr;
    p.src.key_scales = nullptr;
    CHECK(check_gather_compaction(p) == cudaSuccess);
  }
  struct Bad {
    const char* what;
    void (*mutate)(GatherCompactionParams&);
  };
  const Bad bad[] = {
      {"head_dim 0", [](GatherCompactionParams& p) { p.head_dim = 0; }},
      {"head_dim 1040", [](GatherCompactionParams& p) { p.head_dim = 1040; }},
      {"head_dim 24 with g 16", [](GatherCompactionParams& p) { p.head_dim = 24; }},
      {"group_size 4", [](GatherCompactionParams& p) { p.group_size = 4; }},
      {"block_size 0", [](GatherCompactionParams& p) { p.block_size = 0; }},
      {"block_size 4097", [](GatherCompactionParams& p) { p.block_size = 4097; }},
      {"num_streams 0", [](GatherCompactionParams& p) { p.num_streams = 0; }},
      {"negative num_splits", [](GatherCompactionParams& p) { p.num_splits = -1; }},
      {"num_splits over kMaxGatherSplits", [](GatherCompactionParams& p) { p.num_splits = kMaxGatherSplits + 1; }},
      {"null streams", [](GatherCompactionParams& p) { p.streams = nullptr; }},
      {"null dst_indptr", [](GatherCompactionParams& p) { p.dst_indptr = nullptr; }},
      {"null dst_indices", [](GatherCompactionParams& p) { p.dst_indices = nullptr; }},
      {"null dst_block_fill", [](GatherCompactionParams& p) { p.dst_block_fill = nullptr; }},
      {"null dst_evict_mask", [](GatherCompactionParams& p) { p.dst_evict_mask = nullptr; }},
      {"null dst_slot_record", [](GatherCompactionParams& p) { p.dst_slot_record = nullptr; }},
      {"null destination page of a used pool", [](GatherCompactionParams& p) { p.dst_pages[0] = nullptr; }},
      {"null source page of a used pool", [](GatherCompactionParams& p) { p.src.pages[0] = nullptr; }},
      {"null block_fill", [](GatherCompactionParams& p) { p.src.block_fill = nullptr; }},
      {"null evict_mask", [](GatherCompactionParams& p) { p.src.evict_mask = nullptr; }},
      {"null slot_record", [](GatherCompactionParams& p) { p.src.slot_record = nullptr; }},
      {"null block_indptr", [](GatherCompactionParams& p) { p.src.block_indptr = nullptr; }},
      {"null block_indices", [](GatherCompactionParams& p) { p.src.block_indices = nullptr; }},
      {"src num_streams 0", [](GatherCompactionParams& p) { p.src.num_streams = 0; }},
      {"pool map not consecutive", [](GatherCompactionParams& p) { p.src.pool_base[2] = 5; }},
      {"total_blocks not the pools' sum", [](GatherCompactionParams& p) { p.src.total_blocks = 2; }},
      {"2^31 slots",
       [](GatherCompactionParams& p) {
         p.block_size = 4096;
         p.src.pool_count[0] = 1u << 19;
         p.src.pool_base[1] = p.src.pool_base[2] = p.src.pool_base[3] = 1u << 19;
         p.src.total_blocks = 1u << 19;
       }},
  };
  for (const Bad& b : bad) {
    GatherCompactionParams p = good;
    b.mutate(p);
    INFO(b.what);
    CHECK(check_gather_compaction(p) == cudaErrorInvalidValue);
    CHECK(launch_gather_compaction(p, nullptr) == cudaErrorInvalidValue);
  }
  // Nothing was launched: no error is pending.
  CHECK(cudaGetLastError() == cudaSuccess);
}
