// Memory that follows what is held: pools grow in chunks as commits need blocks and release the
// chunks at their top that hold no block; allocated() and the backend's count are checked against
// the allocator's own count; memory_limit_bytes refuses a commit with the bytes named and changes
// nothing; bytes a pool released serve another precision; sequence_footprint / max_sequences
// bound what a ThinKV cache really allocates.

#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "test_util.hpp"
#include "thinkv/thinkv.hpp"

using namespace thinkv;
using tt::uniform_int;

namespace {

/// A standard allocator that counts the bytes it has handed out and not taken back.
struct AllocCount {
  std::int64_t live = 0;
  std::int64_t peak = 0;
  std::int64_t calls = 0;
};
template <class T>
struct CountingAlloc {
  using value_type = T;
  std::shared_ptr<AllocCount> count;
  explicit CountingAlloc(std::shared_ptr<AllocCount> c) : count(std::move(c)) {}
  template <class U>
  CountingAlloc(const CountingAlloc<U>& o) noexcept : count(o.count) {}  // NOLINT: rebinding
  T* allocate(std::size_t n) {
    count->live += static_cast<std::int64_t>(n * sizeof(T));
    count->peak = std::max(count->peak, count->live);
    ++count->calls;
    return std::allocator<T>{}.allocate(n);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    count->live -= static_cast<std::int64_t>(n * sizeof(T));
    std::allocator<T>{}.deallocate(p, n);
  }
  template <class U>
  bool operator==(const CountingAlloc<U>& o) const noexcept {
    return count == o.count;
  }
};
using CountedBackend = BasicCpuKvBackend<CountingAlloc<std::uint8_t>>;
static_assert(kv_backend<CountedBackend>);

CacheConfig arena_config(int streams, int chunk, int blocks_per_pool) {
  CacheConfig c;
  c.num_streams = streams;
  c.head_dim = 32;
  c.group_size = 8;
  c.block_size = 16;
  c.precision = kR4E4T2;
  c.chunk_blocks = chunk;
  for (Precision p : kAllPrecisions) c.pool_blocks[static_cast<int>(p)] = c.precision.uses(p) ? blocks_per_pool : 0;
  return c;
}

/// Appends one group (g tokens) of thought `t` to a stream.
template <class B>
Status append_group(PagedKvCache<B>& c, std::mt19937_64& rng, int s, ThoughtType t) {
  const int d = c.config().head_dim;
  for (int i = 0; i < c.config().group_size; ++i) {
    const auto k = tt::random_row(rng, d, 1.0), v = tt::random_row(rng, d, 1.0);
    THINKV_RETURN_IF_ERROR(c.append(s, k, v, t));
  }
  return Status::ok();
}

/// The backend's share of allocated(): pages, the records' key scales, staging and second-level
/// scales (the record headers, block metadata and table entries are the block table's).
std::int64_t backend_share(const MemoryUsage& a, const CacheConfig& c) {
  return a.page_bytes + a.records_held * c.head_dim +
         std::int64_t{c.num_streams} * (std::int64_t{2} * c.group_size * c.head_dim * 2 + 2 * kNumPrecisions * 4);
}

}  // namespace

TEST_CASE("arena: allocated memory follows what is held, to the allocator's own count", "[arena]") {
  TT_SEEDED_RNG();
  const int chunk = uniform_int(rng, 1, 5);
  const CacheConfig cfg = arena_config(4, chunk, 60);
  CAPTURE(chunk);
  auto count = std::make_shared<AllocCount>();
  PagedKvCache<CountedBackend> c(cfg, CountedBackend(CountingAlloc<std::uint8_t>(count)));
  const BlockTable& t = c.table();
  const std::int64_t fixed = count->live;
  CHECK(fixed == backend_share(c.allocated(), cfg));  // staging and scales only
  CHECK(c.allocated().blocks_held == 0);
  std::int64_t peak_pages = 0, commits = 0, released = 0;
  for (int op = 0; op < 400; ++op) {
    const int s = uniform_int(rng, 0, 3);
    const double x = tt::uniform01(rng);
    const std::int64_t before = c.allocated_bytes();
    if (x < 0.6) {
      commits += append_group(c, rng, s, static_cast<ThoughtType>(uniform_int(rng, 0, 2))).is_ok();
    } else if (x < 0.95) {
      auto live = t.live_slot_list(s);
      std::shuffle(live.begin(), live.end(), rng);
      live.resize(live.size() * static_cast<std::size_t>(uniform_int(rng, 1, 4)) / 4);
      REQUIRE(c.evict(s, live).is_ok());
    } else {
      REQUIRE(c.reset_stream(s).is_ok());
    }
    released += c.allocated_bytes() < before;
    // The allocator's count, the backend's and the cache's report agree exactly.
    const MemoryUsage a = c.allocated();
    REQUIRE(count->live == c.backend().stats().bytes_allocated);
    REQUIRE(count->live == backend_share(a, cfg));
    REQUIRE(a.physical_bytes() == c.allocated_bytes());
    REQUIRE(c.memory().physical_bytes() <= a.physical_bytes());
    // Each pool has storage exactly up to the chunk of its highest held block (chunks at the top
    // that hold no block are released at once).
    for (Precision p : kAllPrecisions) {
      std::uint32_t top = 0;  // one past the highest held local id
      for (int st = 0; st < cfg.num_streams; ++st)
        for (std::uint32_t b : t.blocks(st))
          if (t.block_precision(b) == p) top = std::max(top, t.pools().local_index(b) + 1);
      const std::uint32_t cp = t.chunk_blocks(p);
      const std::uint32_t want =
          std::min<std::uint32_t>((top + cp - 1) / cp * cp, t.pools().count[static_cast<int>(p)]);
      INFO("op " << op << " pool " << to_string(p));
      REQUIRE(t.allocated_blocks(p) == want);
    }
    peak_pages = std::max(peak_pages, a.page_bytes);
  }
  CAPTURE(commits, released, peak_pages);
  CHECK(commits > 100);
  CHECK(released > 0);  // 4-20 release steps over 400 ops, by seed
  CHECK(t.stats().chunks_released > 0);
  for (int s = 0; s < cfg.num_streams; ++s) REQUIRE(c.reset_stream(s).is_ok());
  CHECK(c.allocated().page_bytes == 0);
  CHECK(c.allocated().blocks_held == 0);
  // Records are kept (they are not released); everything else is back to the fixed part.
  CHECK(count->live == fixed + std::int64_t{t.allocated_records()} * cfg.head_dim);
}

TEST_CASE("arena: pools and records whose range is not a multiple of their chunk end in a shorter chunk", "[arena]") {
  TT_SEEDED_RNG();
  CacheConfig cfg = arena_config(2, 2, 5);  // 5 blocks per pool in chunks of 2: the last holds 1
  cfg.record_capacity = 5;                  // records come in chunks of 2 x 16 / 8 = 4: the last holds 1
  auto count = std::make_shared<AllocCount>();
  PagedKvCache<CountedBackend> c(cfg, CountedBackend(CountingAlloc<std::uint8_t>(count)));
  REQUIRE(c.table().chunk_records() == 4);
  for (int i = 0; i < 5; ++i) {  // 5 NVFP4 groups of 8 tokens: 5 records, 3 blocks of 16 slots
    REQUIRE(append_group(c, rng, i % 2, ThoughtType::kReasoning).is_ok());
    INFO("group " << i);
    REQUIRE(count->live == c.backend().stats().bytes_allocated);
    REQUIRE(count->live == backend_share(c.allocated(), cfg));
  }
  CHECK(c.table().allocated_records() == 5);
  for (int i = 0; i < 8; ++i) {  // fill all 5 blocks (10 groups), with records freed by eviction
    auto live = c.table().live_slot_list(0);
    if (c.table().free_records() == 0) REQUIRE(c.evict(0, live).is_ok());
    if (!append_group(c, rng, 1, ThoughtType::kReasoning).is_ok()) break;
    REQUIRE(count->live == backend_share(c.allocated(), cfg));
  }
  CHECK(c.table().allocated_blocks(Precision::kNvfp4) <= 5);
  REQUIRE(count->live == backend_share(c.allocated(), cfg));
}

TEST_CASE("arena: a commit past memory_limit_bytes is refused with the bytes and changes nothing", "[arena][errors]") {
  TT_SEEDED_RNG();
  CacheConfig cfg = arena_config(2, 2, 40);
  const CacheLayout L = CacheLayout::from(cfg);
  // Room for one chunk of NVFP4 blocks and one chunk of records, nothing more.
  const BlockTable probe(cfg);
  cfg.memory_limit_bytes =
      cfg.fixed_bytes() + 2 * L.block_bytes(Precision::kNvfp4) + std::int64_t{probe.chunk_records()} * L.record_bytes();
  PagedKvCache<> c(cfg);
  // Stream 0 fills the NVFP4 chunk (2 blocks of 16 slots = 4 groups of 8) with R groups.
  for (int i = 0; i < 4; ++i) REQUIRE(append_group(c, rng, 0, ThoughtType::kReasoning).is_ok());
  CHECK(c.allocated_bytes() <= cfg.memory_limit_bytes);
  const int d = cfg.head_dim;
  for (int i = 0; i < cfg.group_size - 1; ++i) {  // the next group, all but its last token
    REQUIRE(c.append(0, tt::random_row(rng, d, 1.0), tt::random_row(rng, d, 1.0), ThoughtType::kReasoning).is_ok());
    REQUIRE(c.append(1, tt::random_row(rng, d, 1.0), tt::random_row(rng, d, 1.0), ThoughtType::kTransition).is_ok());
  }
  const auto before = tt::snapshot_cache(c);
  const std::int64_t allocated = c.allocated_bytes();
  // NVFP4 needs a second chunk; ternary (another stream, another precision) its first.
  for (const auto& [s, type] : {std::pair{0, ThoughtType::kReasoning}, std::pair{1, ThoughtType::kTransition}}) {
    const Status st = c.append(s, tt::random_row(rng, d, 1.0), tt::random_row(rng, d, 1.0), type);
    INFO(st);
    CHECK(st.code() == StatusCode::kPoolExhausted);
    CHECK_THAT(st.message(), Catch::Matchers::Contains("memory_limit_bytes " + std::to_string(cfg.memory_limit_bytes)));
    CHECK_THAT(st.message(), Catch::Matchers::Contains("has allocated " + std::to_string(allocated) + " bytes"));
    CHECK_THAT(st.message(), Catch::Matchers::Contains(s == 0 ? "nvfp4 blocks" : "ternary blocks"));
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  }
  // Stream 0 ends: its NVFP4 chunk is released, and those bytes now hold stream 1's ternary group.
  REQUIRE(c.reset_stream(0).is_ok());
  CHECK(c.table().allocated_blocks(Precision::kNvfp4) == 0);
  const Status st = c.append(1, tt::random_row(rng, d, 1.0), tt::random_row(rng, d, 1.0), ThoughtType::kTransition);
  INFO(st);
  REQUIRE(st.is_ok());
  CHECK(c.table().allocated_blocks(Precision::kTernary) == 2);
  CHECK(c.allocated_bytes() <= cfg.memory_limit_bytes);
}

TEST_CASE("arena: configuration errors name the value", "[arena][errors]") {
  CacheConfig cfg = arena_config(3, 4, 10);
  cfg.memory_limit_bytes = cfg.fixed_bytes() - 1;
  const Status s = cfg.validate();
  INFO(s);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Matchers::Contains("memory_limit_bytes " + std::to_string(cfg.fixed_bytes() - 1)));
  CHECK_THAT(s.message(), Catch::Matchers::Contains(std::to_string(cfg.fixed_bytes())));
  cfg.memory_limit_bytes = -5;
  CHECK_THAT(cfg.validate().message(), Catch::Matchers::Contains("memory_limit_bytes -5 is negative"));
  cfg.memory_limit_bytes = 0;
  cfg.chunk_blocks = 0;
  CHECK_THAT(cfg.validate().message(), Catch::Matchers::Contains("chunk_blocks 0 is out of range"));
  cfg.chunk_blocks = CacheConfig::kMaxChunkBlocks + 1;
  CHECK_FALSE(cfg.validate().is_ok());
}

namespace {

ThinKvConfig thinkv_shape(int sequences) {
  ThinKvConfig c;
  c.num_sequences = sequences;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 4;
  c.head_dim = 16;
  c.group_size = 8;
  c.block_size = 16;
  c.max_tokens = 1500;
  c.segment_len = 64;
  c.token_budget = 192;
  c.chunk_blocks = 4;
  return c;
}

// ThinKV over thinkv_shape: three thought types, R4E4T2, segments shrinking to 4 tokens.
ThinKvPolicy thinkv_policy() {
  ThinKvPolicy p;
  p.retention = RetentionSchedule({32, 16, 8, 4});
  p.precision = kR4E4T2;
  p.classifier = ThoughtClassifier::three_types(0.3f, 0.6f, {0, 1}, 64, 2);
  return p;
}

template <class Cache>
Status decode_step(Cache& cache, int seq, float sharp, std::mt19937_64& rng) {
  const auto& c = cache.config();
  THINKV_RETURN_IF_ERROR(cache.begin_token(seq));
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads * c.head_dim)), out(q.size());
  for (int l = 0; l < c.num_layers; ++l) {
    std::vector<float> k, v;
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const auto kr = tt::random_row(rng, c.head_dim, 1.0), vr = tt::random_row(rng, c.head_dim, 1.0);
      k.insert(k.end(), kr.begin(), kr.end());
      v.insert(v.end(), vr.begin(), vr.end());
    }
    for (auto& x : q) x = static_cast<float>(tt::uniform01(rng) * 2.0 - 1.0) * sharp;
    THINKV_RETURN_IF_ERROR(cache.append(seq, l, k, v));
    THINKV_RETURN_IF_ERROR(cache.attend(seq, l, q, out));
  }
  return cache.end_token(seq);
}

}  // namespace

TEST_CASE("arena: a ThinKV cache allocates what its budget holds, within sequence_footprint", "[arena][thinkv]") {
  TT_SEEDED_RNG();
  const ThinKvConfig cfg = thinkv_shape(3);
  ThinKvCache<> cache(cfg, thinkv_policy());
  const SequenceFootprint f = sequence_footprint(cfg, thinkv_policy());
  CAPTURE(f.live_tokens, f.blocks, f.records, f.bytes);
  // The bound is below FullKV FP16 at this budget, and the cache allocated nothing for pages yet.
  CHECK(f.bytes < f.fullkv_fp16_bytes);
  CHECK(cache.allocated().page_bytes == 0);
  std::int64_t peak = 0;
  float sharp = 1.0f;
  for (int t = 0; t < cfg.max_tokens; ++t) {
    if (t % 64 == 0) sharp = std::vector<float>{0.0f, 1.5f, 6.0f}[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
    for (int seq = 0; seq < cfg.num_sequences; ++seq) {
      const Status s = decode_step(cache, seq, sharp, rng);
      INFO("t " << t << " seq " << seq << ": " << s);
      REQUIRE(s.is_ok());
      REQUIRE(cache.memory(seq).physical_bytes() <= f.bytes);
      REQUIRE(cache.live_tokens(seq) <= f.live_tokens);
    }
    peak = std::max(peak, cache.allocated_bytes());
  }
  // Allocation follows the budget, not max_tokens: far below what FullKV would hold, and below
  // what the pools' ranges (sized for max_tokens with no eviction) would cost.
  const std::int64_t fullkv = f.fullkv_fp16_bytes * cfg.num_sequences;
  CAPTURE(peak, fullkv);
  CHECK(peak < fullkv / 3);
  CHECK(cache.stats().tokens_evicted > 0);
  // max_sequences: that many sequences with memory_limit_bytes = the bytes never run out.
  const std::int64_t bytes = peak + f.bytes;  // some room
  const int n = max_sequences(cfg, thinkv_policy(), bytes);
  CAPTURE(n);
  CHECK(n >= 1);
  CHECK(max_sequences(cfg, thinkv_policy(), 0) == 0);
  CHECK(max_sequences(cfg, thinkv_policy(), 10 * bytes) > n);
  ThinKvConfig limited = cfg;
  limited.num_sequences = n;
  limited.memory_limit_bytes = bytes;
  ThinKvCache<> lc(limited, thinkv_policy());
  for (int t = 0; t < cfg.max_tokens; t += 1) {
    for (int seq = 0; seq < n; ++seq) {
      const Status s = decode_step(lc, seq, t % 128 < 64 ? 6.0f : 0.0f, rng);
      INFO("t " << t << " seq " << seq << ": " << s);
      REQUIRE(s.is_ok());
    }
  }
  CHECK(lc.allocated_bytes() <= bytes);
}

TEST_CASE("arena: a ThinKV token that would pass memory_limit_bytes is refused at begin_token", "[arena][thinkv]") {
  TT_SEEDED_RNG();
  ThinKvConfig cfg = thinkv_shape(2);
  cfg.memory_limit_bytes = cfg.paged_config(kR4E4T2).fixed_bytes() + 60000;
  TbqPolicy tbq;  // no eviction: memory only grows
  tbq.classifier = thinkv_policy().classifier;
  TbqCache<> cache(cfg, tbq);
  Status s;
  int t = 0;
  for (; t < cfg.max_tokens; ++t) {
    s = decode_step(cache, t % 2, 1.0f, rng);
    if (!s.is_ok()) break;
  }
  INFO(s);
  REQUIRE(s.code() == StatusCode::kPoolExhausted);
  CHECK_THAT(s.message(), Catch::Matchers::Contains("begin_token"));
  CHECK_THAT(s.message(), Catch::Matchers::Contains("memory_limit_bytes"));
  CHECK(cache.allocated_bytes() <= cfg.memory_limit_bytes);
  // Refused whole: the sequence is where it was, and ending the other one makes room.
  const int seq = t % 2;
  const std::int32_t pos = cache.position(seq);
  CHECK(decode_step(cache, seq, 1.0f, rng).code() == StatusCode::kPoolExhausted);
  CHECK(cache.position(seq) == pos);
  REQUIRE(cache.reset_sequence(1 - seq).is_ok());
  REQUIRE(decode_step(cache, seq, 1.0f, rng).is_ok());
  CHECK(cache.position(seq) == pos + 1);
}
