/// \file test_paged_cache.cpp
/// PagedKvCache over the CPU backend: staging, stored values against an independent quantization
/// model, eviction that moves no data, in-place reuse, exact memory accounting, FullKV, the
/// stories260K shape, and every error path of append/evict/read_token/reset_stream (each must
/// leave the cache exactly as it was).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <set>
#include <vector>

#include "test_util.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;
using tt::chance;
using tt::CtModel;
using tt::Diff;
using tt::uniform_int;

namespace {

constexpr ThoughtType R = ThoughtType::kReasoning;
constexpr ThoughtType E = ThoughtType::kExecution;
constexpr ThoughtType T = ThoughtType::kTransition;

CacheConfig cache_config(PrecisionMap map, int d, int g, int bs, int streams, int blocks_per_pool, int records = 0) {
  CacheConfig c;
  c.num_streams = streams;
  c.head_dim = d;
  c.group_size = g;
  c.block_size = bs;
  c.precision = map;
  for (Precision p : kAllPrecisions) c.pool_blocks[static_cast<int>(p)] = map.uses(p) ? blocks_per_pool : 0;
  c.record_capacity = records;
  return c;
}

const PrecisionMap kMaps[] = {kR4E4T2, kR8E4T2, kR8E8T4, kFullKvMap};

/// Appends `count` random tokens of one thought to a stream of cache and model; requires success.
void append_tokens(PagedKvCache<>& c, CtModel& m, std::mt19937_64& rng, int s, ThoughtType th, int count,
                   double magnitude = 0.0, std::uint32_t seg = 0) {
  Diff d;
  for (int i = 0; i < count; ++i) {
    const auto k = tt::random_row(rng, m.D, magnitude), v = tt::random_row(rng, m.D, magnitude);
    const Status st = tt::append_both(c, m, s, k, v, th, seg, d);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
  }
  TT_REQUIRE_OK_DIFF(d);
}

void evict_both(PagedKvCache<>& c, CtModel& m, int s, const std::vector<SlotRef>& slots) {
  const Status st = c.evict(s, slots);
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  m.evict(s, slots);
}

/// A cache in a non-trivial state: committed groups of every thought in several streams, holes,
/// and partial staging groups (stream 0 holds g-1 staged tokens, so its next append commits).
struct Busy {
  CacheConfig cfg;
  PagedKvCache<> cache;
  CtModel model;
  explicit Busy(std::mt19937_64& rng, PrecisionMap map = kR4E4T2, int blocks_per_pool = 8)
      : cfg(cache_config(map, 32, 8, 12, 3, blocks_per_pool)), cache(cfg), model(cfg) {
    append_tokens(cache, model, rng, 0, R, 16);
    append_tokens(cache, model, rng, 0, T, 8);
    append_tokens(cache, model, rng, 1, E, 16);
    append_tokens(cache, model, rng, 2, R, 8);
    evict_both(cache, model, 0, tt::random_live_subset(rng, model, 0, 5));
    evict_both(cache, model, 1, tt::random_live_subset(rng, model, 1, 3));
    append_tokens(cache, model, rng, 0, E, 7);
    append_tokens(cache, model, rng, 1, E, 3);
    TT_REQUIRE_OK_DIFF(tt::check_cache(cache, model));
  }
};

/// Which slot of a page a byte offset belongs to (cpu_backend.hpp's documented page layout:
/// [B x row] keys | [B x row] values | [B x D/g] value scales).
int slot_of_byte(std::size_t off, int bs, int row_bytes, int vscale_bytes) {
  const std::size_t rows = static_cast<std::size_t>(bs) * row_bytes;
  if (off < rows) return static_cast<int>(off / row_bytes);
  if (off < 2 * rows) return static_cast<int>((off - rows) / row_bytes);
  return static_cast<int>((off - 2 * rows) / vscale_bytes);
}

std::vector<std::vector<std::uint8_t>> all_pages(const PagedKvCache<>& c) {
  std::vector<std::vector<std::uint8_t>> out;
  for (std::uint32_t b = 0; b < c.table().pools().total; ++b) {
    const auto p = c.backend().page(b);
    out.emplace_back(p.begin(), p.end());
  }
  return out;
}

}  // namespace

TEST_CASE("PagedKvCache: the first g-1 tokens stay staged in BF16, the g-th commits the group", "[paged]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : kMaps) {
    const int gs[] = {8, 16, 32};
    const int g = gs[uniform_int(rng, 0, 2)];
    const int d = g * uniform_int(rng, 1, 4);
    const int bs = uniform_int(rng, 1, 40);
    CAPTURE(map, g, d, bs);
    PagedKvCache<> c(cache_config(map, d, g, bs, 2, (2 * g + bs - 1) / bs + 1));
    CtModel m(c.config());
    const ThoughtType th = kAllThoughtTypes[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
    std::vector<std::vector<float>> ks, vs;
    std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
    for (int i = 0; i < g; ++i) {
      ks.push_back(tt::random_row(rng, d));
      vs.push_back(tt::random_row(rng, d));
      Diff diff;
      REQUIRE(tt::append_both(c, m, 1, ks.back(), vs.back(), th, 9, diff).is_ok());
      TT_REQUIRE_OK_DIFF(diff);
      if (i < g - 1) {
        CHECK(c.table().staged_count(1) == i + 1);
        CHECK(c.table().live_slots(1) == 0);
        CHECK(c.table().blocks(1).empty());
        CHECK(c.memory(1).staged_tokens == i + 1);
        CHECK(c.memory(1).live_tokens == i + 1);
        // every staged row reads back as the BF16 rounding of what was appended
        for (int r = 0; r <= i; ++r) {
          REQUIRE(c.backend().read_staged(1, r, k.data(), v.data()).is_ok());
          for (int ch = 0; ch < d; ++ch) {
            REQUIRE(tt::fbits(k[ch]) == tt::fbits(tt::bf16_round(ks[r][ch])));
            REQUIRE(tt::fbits(v[ch]) == tt::fbits(tt::bf16_round(vs[r][ch])));
          }
        }
      } else {
        CHECK(c.table().staged_count(1) == 0);
        CHECK(c.table().live_slots(1) == g);
        CHECK(c.memory(1).staged_tokens == 0);
        CHECK(c.backend().stats().groups_quantized == 1);
      }
    }
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));  // includes every committed token's values
    // The stream's next g-1 tokens stage beside the committed group.
    append_tokens(c, m, rng, 1, th, g - 1);
    CHECK(c.table().staged_count(1) == g - 1);
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
  }
}

TEST_CASE("PagedKvCache: a hand-computed memory example (D 128, g 16, block 16, R4E4T2)", "[paged][memory]") {
  TT_SEEDED_RNG();
  PagedKvCache<> c(cache_config(kR4E4T2, 128, 16, 16, 2, 4));
  CtModel m(c.config());
  const MemoryUsage empty = c.memory(0);
  CHECK(empty.page_bytes == 0);
  CHECK(empty.metadata_bytes == 40);
  CHECK(empty.staging_bytes == 8192);  // 2 (K,V) x 16 tokens x 128 x 2 bytes
  CHECK(empty.physical_bytes() == 8232);
  append_tokens(c, m, rng, 0, R, 16);
  const MemoryUsage one = c.memory(0);
  CHECK(one.blocks_held == 1);
  CHECK(one.page_bytes == 2176);     // 16 x (2 x 64 + 8)
  CHECK(one.metadata_bytes == 260);  // 16 + 8 + 12 x 16 + 4, + 40
  CHECK(one.scale_record_bytes == 136);
  CHECK(one.fullkv_fp16_bytes == 8192);
  CHECK(one.physical_bytes() == 2176 + 260 + 136 + 8192);
  append_tokens(c, m, rng, 0, T, 16);  // a ternary block: 16 x (2 x 32 + 8)
  CHECK(c.memory(0).page_bytes == 2176 + 1152);
  CHECK(c.memory().staging_bytes == 2 * 8192);
  CHECK(c.memory().metadata_bytes == 260 + 220 + 40);
  TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
}

TEST_CASE("PagedKvCache: stored values match an independent quantization model", "[paged][quant]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : kMaps) {
    CAPTURE(map);
    PagedKvCache<> c(cache_config(map, 64, 16, 16, 2, 16));
    CtModel m(c.config());
    // Stream 0: a small first group fixes s2, then groups ~1000x larger saturate the E4M3 group
    // scales (clipped identically by the model), then small ones again.
    for (ThoughtType th : kAllThoughtTypes) append_tokens(c, m, rng, 0, th, 16, 0.01);
    for (ThoughtType th : kAllThoughtTypes) append_tokens(c, m, rng, 0, th, 16, 10.0);
    for (ThoughtType th : kAllThoughtTypes) append_tokens(c, m, rng, 0, th, 16, 1e-3);
    // Stream 1: random magnitudes, its own s2.
    for (int i = 0; i < 6; ++i) append_tokens(c, m, rng, 1, tt::next_thought(rng, m, 1), 16);
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
    if (map != kFullKvMap) {
      CHECK(c.backend().stats().scale_saturations > 0);
      // the stream scales are the model's (fixed by the first group of each precision)
      for (ThoughtType th : kAllThoughtTypes) {
        const Precision p = map.precision_of(th);
        CHECK(c.backend().stream_scale(0, 0, p) == m.S(0).s2k[static_cast<int>(p)]);
        CHECK(c.backend().stream_scale(0, 1, p) == m.S(0).s2v[static_cast<int>(p)]);
      }
    }
  }
}

TEST_CASE("PagedKvCache: an all-zero first group does not fix the stream scale", "[paged][quant]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : {kR4E4T2, kR8E4T2, kR8E8T4}) {
    CAPTURE(map);
    const int d = 32, g = 8;
    PagedKvCache<> c(cache_config(map, d, g, 8, 1, 8));
    CtModel m(c.config());
    const Precision p = map.precision_of(R);
    Diff diff;
    const std::vector<float> zeros(static_cast<std::size_t>(d), 0.0f);
    for (int i = 0; i < g; ++i) {  // keys all zero, values random
      const auto v = tt::random_row(rng, d);
      REQUIRE(tt::append_both(c, m, 0, zeros, v, R, 0, diff).is_ok());
    }
    TT_REQUIRE_OK_DIFF(diff);
    CHECK(c.backend().stream_scale(0, 0, p) == 0.0f);  // still unset
    CHECK(c.backend().stream_scale(0, 1, p) != 0.0f);
    // The next group, 1e5 or 1e-3 in magnitude, fixes the key scale (far from s2 = 1, which
    // needs amax in [8, 16) * Q); with s2 = 1 kept from the zero group it would saturate or
    // underflow, and the model would disagree.
    const double mag = chance(rng, 0.5) ? 1e5 : 1e-3;
    for (int i = 0; i < g; ++i) {
      const auto k = tt::random_row(rng, d, mag), v = tt::random_row(rng, d);
      REQUIRE(tt::append_both(c, m, 0, k, v, R, 0, diff).is_ok());
    }
    TT_REQUIRE_OK_DIFF(diff);
    CHECK(c.backend().stream_scale(0, 0, p) == m.S(0).s2k[static_cast<int>(p)]);
    CHECK(c.backend().stream_scale(0, 0, p) != 1.0f);
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
  }
}

TEST_CASE("PagedKvCache: random operation sequences match the model (values, placement, memory)", "[paged][random]") {
  TT_SEEDED_RNG();
  for (int round = 0; round < 12; ++round) {
    const PrecisionMap map = kMaps[round % 4];
    const int gs[] = {8, 16, 32};
    const int g = gs[uniform_int(rng, 0, 2)];
    const int d = g * uniform_int(rng, 1, 64 / g + 1);
    const int bs = uniform_int(rng, 1, 48);
    const int streams = uniform_int(rng, 1, 3);
    const int pool = uniform_int(rng, (g + bs - 1) / bs + 1, 3 * (g + bs - 1) / bs + 6);
    const int records = chance(rng, 0.25) ? uniform_int(rng, 1, 8) : 0;
    const CacheConfig cfg = cache_config(map, d, g, bs, streams, pool, records);
    CAPTURE(round, cfg);
    PagedKvCache<> c(cfg);
    CtModel m(cfg);
    Diff diff;
    tt::OpCounts n;
    tt::random_ops(c, m, rng, 300, diff, n);
    CAPTURE(n.appends, n.commits, n.exhausted, n.evictions, n.resets);
    TT_REQUIRE_OK_DIFF(diff);
    CHECK(n.commits > 3);
    CHECK(c.moved_bytes() == 0);
  }
}

TEST_CASE("PagedKvCache: eviction moves no data", "[paged][evict]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : kMaps) {
    CAPTURE(map);
    PagedKvCache<> c(cache_config(map, 32, 8, uniform_int(rng, 3, 20), 3, 64));
    CtModel m(c.config());
    for (int s = 0; s < 3; ++s)
      for (int i = 0; i < 5; ++i) append_tokens(c, m, rng, s, tt::next_thought(rng, m, s), 8);
    append_tokens(c, m, rng, 1, tt::next_thought(rng, m, 1), 5);  // staged tokens too
    for (int round = 0; round < 6; ++round) {
      const int s = uniform_int(rng, 0, 2);
      if (m.live_count(s) == 0) continue;
      const auto pages = all_pages(c);
      std::vector<std::vector<std::uint8_t>> records;
      for (int r = 0; r < c.table().record_capacity(); ++r) {
        const auto x = c.backend().record_scales(static_cast<std::uint32_t>(r));
        records.emplace_back(x.begin(), x.end());
      }
      const auto batch = tt::random_live_subset(rng, m, s, round == 5 ? 1000 : 12);  // the last frees blocks
      evict_both(c, m, s, batch);
      // Every page that still has storage, held or freed, is as it was (a chunk left empty at
      // the top of its pool is released, which moves nothing either).
      const auto after = all_pages(c);
      for (std::uint32_t b = 0; b < c.table().pools().total; ++b) {
        if (c.table().pools().local_index(b) >= c.table().allocated_blocks(c.table().block_precision(b))) continue;
        REQUIRE(after[b] == pages[b]);
      }
      for (int r = 0; r < c.table().record_capacity(); ++r) {
        const auto x = c.backend().record_scales(static_cast<std::uint32_t>(r));
        REQUIRE(std::vector<std::uint8_t>(x.begin(), x.end()) == records[static_cast<std::size_t>(r)]);
      }
      CHECK(c.moved_bytes() == 0);
      TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));  // survivors still dequantize to their values
    }
  }
}

TEST_CASE("PagedKvCache: reuse writes the new group into the holes in place", "[paged][reuse]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : kMaps) {
    const int bs = uniform_int(rng, 4, 24);
    const int g = 8, d = 32;
    CAPTURE(map, bs);
    PagedKvCache<> c(cache_config(map, d, g, bs, 2, 16));
    CtModel m(c.config());
    const ThoughtType th = kAllThoughtTypes[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
    const ThoughtType other = kAllThoughtTypes[(static_cast<std::size_t>(th) + 1) % 3];
    for (int i = 0; i < 4; ++i) append_tokens(c, m, rng, 0, th, g);
    append_tokens(c, m, rng, 0, other, g);
    append_tokens(c, m, rng, 1, th, g);
    // Evict up to g-1 slots of `th` blocks of stream 0, keeping one live slot per block.
    std::vector<SlotRef> victims;
    for (const auto& b : m.S(0).blocks) {
      if (b.thought != th) continue;
      std::vector<SlotRef> live;
      for (int i = 0; i < b.fill; ++i) live.push_back({b.real, static_cast<std::uint32_t>(i)});
      std::shuffle(live.begin(), live.end(), rng);
      for (std::size_t i = 0; i + 1 < live.size() && static_cast<int>(victims.size()) < g - 1; ++i)
        if (chance(rng, 0.3)) victims.push_back(live[i]);
    }
    if (victims.empty()) victims.push_back(m.live_slots(0)[0]);
    evict_both(c, m, 0, victims);
    // holes in attention order: block list order, then slot order
    std::vector<SlotRef> holes;
    for (std::uint32_t b : c.table().blocks(0))
      for (const SlotRef v : victims)
        if (v.block == b) holes.push_back(v);
    std::sort(holes.begin(), holes.end(), [&](SlotRef a, SlotRef b) {
      const auto bl = c.table().blocks(0);
      const auto ia = std::find(bl.begin(), bl.end(), a.block) - bl.begin();
      const auto ib = std::find(bl.begin(), bl.end(), b.block) - bl.begin();
      return ia != ib ? ia < ib : a.slot < b.slot;
    });
    const auto pages = all_pages(c);
    const std::int32_t first_pos = c.table().next_position(0);
    append_tokens(c, m, rng, 0, th, g);
    // The new group's tokens, in append order.
    std::vector<std::int32_t> pos;
    for (int i = 0; i < g; ++i) pos.push_back(first_pos + i);
    const auto placed = tt::slots_of_positions(c.table(), 0, pos);
    for (std::size_t i = 0; i < holes.size(); ++i) {
      CAPTURE(i);
      CHECK(placed[i] == holes[i]);
    }
    // Bytes changed only inside the new group's slots.
    const auto after = all_pages(c);
    int changed_outside = 0;
    for (std::uint32_t b = 0; b < after.size(); ++b) {
      const Precision p = c.table().block_precision(b);
      const int row = (d * tt::bits_of_precision(p) + 7) / 8;
      const int vsb = p == Precision::kBf16 ? 1 : d / g;
      for (std::size_t off = 0; off < after[b].size(); ++off) {
        if (after[b][off] == pages[b][off]) continue;
        const int slot = slot_of_byte(off, bs, row, vsb);
        if (std::find(placed.begin(), placed.end(), SlotRef{b, static_cast<std::uint32_t>(slot)}) == placed.end())
          ++changed_outside;
      }
    }
    CHECK(changed_outside == 0);
    CHECK(c.table().stats().slots_reused == static_cast<std::int64_t>(holes.size()));
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
  }
}

TEST_CASE("PagedKvCache: FullKV stores tokens losslessly with respect to BF16", "[paged][fullkv]") {
  TT_SEEDED_RNG();
  PagedKvCache<> c(cache_config(kFullKvMap, 64, 16, 24, 2, 8));
  CtModel m(c.config());
  std::vector<std::vector<float>> ks, vs;
  Diff d;
  for (int i = 0; i < 64; ++i) {
    ks.push_back(tt::random_row(rng, 64, std::exp2(uniform_int(rng, -20, 20))));
    vs.push_back(tt::random_row(rng, 64, std::exp2(uniform_int(rng, -20, 20))));
    REQUIRE(tt::append_both(c, m, 0, ks.back(), vs.back(), kAllThoughtTypes[(i / 16) % 3], 0, d).is_ok());
  }
  TT_REQUIRE_OK_DIFF(d);
  std::vector<float> k(64), v(64);
  for (SlotRef r : c.table().live_slot_list(0)) {
    const int p = c.table().slot_position(r);
    REQUIRE(c.read_token(r, k, v).is_ok());
    for (int ch = 0; ch < 64; ++ch) {
      REQUIRE(tt::fbits(k[ch]) == tt::fbits(tt::bf16_round(ks[p][ch])));
      REQUIRE(tt::fbits(v[ch]) == tt::fbits(tt::bf16_round(vs[p][ch])));
    }
  }
  CHECK(c.memory(0).records_held == 0);
  CHECK(c.memory(0).scale_record_bytes == 0);
  CHECK(c.memory(0).page_bytes == c.memory(0).blocks_held * 24 * (2 * 128));
  TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
}

TEST_CASE("PagedKvCache: head_dim 8 with group_size 8 works end to end (stories260K shape)", "[paged][stories]") {
  TT_SEEDED_RNG();
  // 5 layers x 4 KV heads = 20 streams, 8 query heads (GQA 2).
  for (const PrecisionMap& map : kMaps) {
    CAPTURE(map);
    PagedKvCache<> c(cache_config(map, 8, 8, 16, 20, 128));
    CtModel m(c.config());
    Diff d;
    for (int step = 0; step < 44; ++step) {
      const ThoughtType th = kAllThoughtTypes[static_cast<std::size_t>((step / 8) % 3)];
      for (int s = 0; s < 20; ++s) {
        const auto k = tt::random_row(rng, 8), v = tt::random_row(rng, 8);
        REQUIRE(tt::append_both(c, m, s, k, v, th, static_cast<std::uint32_t>(step / 8), d).is_ok());
      }
      if (step % 10 == 9)
        for (int s = 0; s < 20; ++s) {
          const auto batch = tt::random_live_subset(rng, m, s, 6);
          evict_both(c, m, s, batch);
        }
    }
    TT_REQUIRE_OK_DIFF(d);
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
    CHECK(c.table().staged_count(0) == 4);  // 44 = 5 x 8 + 4
    for (int layer = 0; layer < 5; ++layer) {
      const std::int32_t streams[4] = {4 * layer, 4 * layer + 1, 4 * layer + 2, 4 * layer + 3};
      std::vector<float> q;
      for (int h = 0; h < 8; ++h) {
        const auto x = tt::random_row(rng, 8);
        q.insert(q.end(), x.begin(), x.end());
      }
      std::vector<float> out(64, std::numeric_limits<float>::quiet_NaN());
      DecodeAttentionArgs a;
      a.num_q_heads = 8;
      a.num_kv_heads = 4;
      a.kv_streams = streams;
      a.q = q.data();
      a.out = out.data();
      REQUIRE(c.attend(a).is_ok());
      for (int h = 0; h < 8; ++h) {
        std::vector<float> k, v;
        m.attention_tokens(streams[h / 2], k, v);
        const double scale = 1.0 / std::sqrt(8.0);
        const auto want = tt::attend64(q.data() + h * 8, k, v, 8, scale);
        const double bound = tt::attention_error_bound(q.data() + h * 8, k, v, 8, scale);
        for (int ch = 0; ch < 8; ++ch) REQUIRE(std::fabs(out[h * 8 + ch] - want[ch]) <= bound);
      }
    }
  }
}

// ---- error paths ------------------------------------------------------------------------------

TEST_CASE("PagedKvCache: append with a wrong k/v size fails and changes nothing", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  const auto before = tt::snapshot_cache(b.cache);
  const int d = 32;
  for (int s : {0, 1, 2}) {  // stream 0's next token would commit its group
    for (auto [nk, nv] : {std::pair{d - 1, d}, std::pair{d + 1, d}, std::pair{0, d}, std::pair{d, d - 1},
                          std::pair{d, 2 * d}, std::pair{d, 0}, std::pair{8, 8}}) {
      CAPTURE(s, nk, nv);
      const auto k = tt::random_row(rng, std::max(nk, 1)), v = tt::random_row(rng, std::max(nv, 1));
      const Status st = b.cache.append(s, std::span<const float>(k.data(), static_cast<std::size_t>(nk)),
                                       std::span<const float>(v.data(), static_cast<std::size_t>(nv)), E);
      CHECK(st.code() == StatusCode::kShapeMismatch);
      CHECK_THAT(st.message(),
                 Contains(std::to_string(nk)) && Contains(std::to_string(nv)) && Contains("head_dim = 32"));
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
    }
  }
}

TEST_CASE("PagedKvCache: NaN and Inf in k or v are rejected naming the channel", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  const auto before = tt::snapshot_cache(b.cache);
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::signaling_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (int s : {0, 1}) {
    for (int which = 0; which < 2; ++which) {
      for (int ch : {0, uniform_int(rng, 1, 30), 31}) {
        for (float bad : bad_values) {
          auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
          (which == 0 ? k : v)[static_cast<std::size_t>(ch)] = bad;
          CAPTURE(s, which, ch, bad);
          const Status st = b.cache.append(s, k, v, E);
          CHECK(st.code() == StatusCode::kNonFinite);
          CHECK_THAT(st.message(), Contains(std::string(which == 0 ? "k[" : "v[") + std::to_string(ch) + "]"));
          TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
        }
      }
    }
  }
  // Both bad: either one may be named, nothing changes.
  auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
  k[5] = std::numeric_limits<float>::infinity();
  v[2] = std::numeric_limits<float>::quiet_NaN();
  CHECK(b.cache.append(0, k, v, E).code() == StatusCode::kNonFinite);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
}

TEST_CASE("PagedKvCache: finite values that overflow BF16 are rejected or stored finite", "[paged][errors][bug]") {
  // Values in (max BF16 = 0x1.FEp127, FLT_MAX] are finite, pass the non-finite check, and round
  // to +-Inf in the BF16 staging buffer: the cache would then hold an Inf it promised to reject.
  TT_SEEDED_RNG();
  for (float big : {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), 0x1.FFp127f}) {
    Busy b(rng);
    const auto before = tt::snapshot_cache(b.cache);
    auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
    k[3] = big;
    CAPTURE(big);
    const Status st = b.cache.append(2, k, v, E);  // stream 2 has nothing staged
    if (st.is_ok()) {
      std::vector<float> ks(32), vs(32);
      REQUIRE(b.cache.backend().read_staged(2, b.cache.table().staged_count(2) - 1, ks.data(), vs.data()).is_ok());
      CHECK(std::isfinite(ks[3]));
      continue;
    }
    CHECK(st.code() == StatusCode::kNonFinite);
    CHECK_THAT(st.message(), Contains("k[3]"));
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
  }
}

TEST_CASE("PagedKvCache: magnitudes above 2^64 are rejected, 2^64 is accepted", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  const float limit = 0x1p64f;
  const float above = std::nextafter(limit, std::numeric_limits<float>::infinity());
  for (float bad : {above, -above, 1e30f, -3e38f}) {
    for (int which = 0; which < 2; ++which) {
      const auto before = tt::snapshot_cache(b.cache);
      auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
      const int ch = uniform_int(rng, 0, 31);
      (which == 0 ? k : v)[static_cast<std::size_t>(ch)] = bad;
      CAPTURE(bad, which, ch);
      const Status st = b.cache.append(0, k, v, E);  // stream 0: this token would commit
      CHECK(st.code() == StatusCode::kNonFinite);
      CHECK_THAT(st.message(),
                 Contains(std::string(which == 0 ? "k[" : "v[") + std::to_string(ch) + "]") && Contains("2^64"));
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
    }
  }
  // Exactly 2^64 (and -2^64) is stored, and read back as the model says.
  auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
  k[7] = limit;
  v[9] = -limit;
  Diff d;
  REQUIRE(tt::append_both(b.cache, b.model, 0, k, v, E, 0, d).is_ok());
  TT_REQUIRE_OK_DIFF(d);
  TT_REQUIRE_OK_DIFF(tt::check_cache(b.cache, b.model));
}

TEST_CASE("PagedKvCache: an out-of-range stream is rejected", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  const auto before = tt::snapshot_cache(b.cache);
  const auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
  for (int s : {-1, 3, 4, 1 << 30, std::numeric_limits<int>::min()}) {
    CAPTURE(s);
    const Status st = b.cache.append(s, k, v, R);
    CHECK(st.code() == StatusCode::kOutOfRange);
    CHECK_THAT(st.message(), Contains(std::to_string(s)) && Contains("0..2"));
    CHECK(b.cache.evict(s, std::vector<SlotRef>{}).code() == StatusCode::kOutOfRange);
    CHECK(b.cache.reset_stream(s).code() == StatusCode::kOutOfRange);
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
  }
}

TEST_CASE("PagedKvCache: a thought type change inside a group is rejected", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  const auto before = tt::snapshot_cache(b.cache);
  const auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
  for (int s : {0, 1}) {  // both hold staged E tokens (stream 0: g-1 of them)
    for (ThoughtType th : {R, T}) {
      const Status st = b.cache.append(s, k, v, th);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_THAT(st.message(), Contains("type " + std::string(to_string(th))) && Contains("type E"));
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
    }
  }
  // Stream 2 has nothing staged: any type is fine.
  Diff d;
  CHECK(tt::append_both(b.cache, b.model, 2, k, v, T, 0, d).is_ok());
  TT_REQUIRE_OK_DIFF(tt::check_cache(b.cache, b.model));
}

TEST_CASE("PagedKvCache: a thought type outside the enum is rejected", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  const auto before = tt::snapshot_cache(b.cache);
  const auto k = tt::random_row(rng, 32), v = tt::random_row(rng, 32);
  const Status st = b.cache.append(2, k, v, static_cast<ThoughtType>(3));  // stream 2: nothing staged
  CHECK(st.code() == StatusCode::kInvalidArgument);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
}

TEST_CASE("PagedKvCache: a full pool fails the committing append, which succeeds after eviction", "[paged][errors]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : kMaps) {
    for (int variant = 0; variant < 2; ++variant) {
      CAPTURE(map, variant);
      const int g = 8, bs = 8;
      // 3 blocks per pool: R groups of streams 1 and 2 take all of R's pool.
      PagedKvCache<> c(cache_config(map, 16, g, bs, 3, 3));
      CtModel m(c.config());
      append_tokens(c, m, rng, 1, R, 8);
      append_tokens(c, m, rng, 2, R, 16);
      append_tokens(c, m, rng, 0, R, g - 1);
      const auto before = tt::snapshot_cache(c);
      const auto k = tt::random_row(rng, 16), v = tt::random_row(rng, 16);
      REQUIRE(m.fit(0, R) == StatusCode::kPoolExhausted);
      const Status st = c.append(0, k, v, R, 5);
      CHECK(st.code() == StatusCode::kPoolExhausted);
      const std::string pool = std::string(to_string(map.precision_of(R)));
      CHECK_THAT(st.message(), Contains(pool) && Contains("pool_blocks[" + pool + "]"));
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
      // Evicting every token of another stream gives its blocks back.
      evict_both(c, m, variant == 0 ? 1 : 2, m.live_slots(variant == 0 ? 1 : 2));
      Diff d;
      REQUIRE(tt::append_both(c, m, 0, k, v, R, 5, d).is_ok());
      TT_REQUIRE_OK_DIFF(d);
      TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
    }
  }
}

TEST_CASE("PagedKvCache: holes of the same stream make room when its pool is full", "[paged][errors]") {
  TT_SEEDED_RNG();
  PagedKvCache<> c(cache_config(kR4E4T2, 16, 8, 8, 1, 2));
  CtModel m(c.config());
  append_tokens(c, m, rng, 0, R, 16);  // both NVFP4 blocks
  append_tokens(c, m, rng, 0, R, 7);
  const auto k = tt::random_row(rng, 16), v = tt::random_row(rng, 16);
  auto before = tt::snapshot_cache(c);
  CHECK(c.append(0, k, v, R).code() == StatusCode::kPoolExhausted);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  // 7 holes (never a whole block of 8) are not enough for a group of 8 ...
  auto live = m.live_slots(0);
  std::shuffle(live.begin(), live.end(), rng);
  live.resize(7);
  evict_both(c, m, 0, live);
  before = tt::snapshot_cache(c);
  CHECK(c.append(0, k, v, R).code() == StatusCode::kPoolExhausted);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  // ... but one more hole is.
  auto more = m.live_slots(0);
  std::vector<SlotRef> one = {more[static_cast<std::size_t>(uniform_int(rng, 0, static_cast<int>(more.size()) - 1))]};
  const bool frees_block = c.table().block_live(one[0].block) == 1;
  evict_both(c, m, 0, one);
  Diff d;
  REQUIRE(tt::append_both(c, m, 0, k, v, R, 0, d).is_ok());
  TT_REQUIRE_OK_DIFF(d);
  if (!frees_block) CHECK(c.table().stats().slots_reused == 8);
  TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
}

TEST_CASE("PagedKvCache: invalid evictions fail and change nothing", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  const auto before = tt::snapshot_cache(b.cache);
  const auto live0 = b.model.live_slots(0);
  const auto live1 = b.model.live_slots(1);
  SlotRef evicted{};
  for (const auto& blk : b.model.S(0).blocks)
    for (int i = 0; i < blk.fill; ++i)
      if (blk.slots[i].evicted) evicted = {blk.real, static_cast<std::uint32_t>(i)};
  REQUIRE(evicted.block != kNoBlock);
  const std::vector<std::vector<SlotRef>> bad = {
      {live0[0], live1[0]},
      {live0[1], live0[2], live0[1]},
      {live0[0], evicted},
      {live0[0], {b.cache.table().pools().total, 0}},
      {live0[0], {live0[0].block, 12}},
      {live0[0], {live0[0].block, 0xFFFFFFFFu}},
  };
  for (const auto& batch : bad) {
    CHECK_FALSE(b.cache.evict(0, batch).is_ok());
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(b.cache));
  }
}

TEST_CASE("PagedKvCache: read_token rejects bad slots and sizes", "[paged][errors]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  std::vector<float> k(32), v(32), small(31);
  const SlotRef live = b.model.live_slots(0)[0];
  CHECK(b.cache.read_token(live, k, v).is_ok());
  CHECK(b.cache.read_token(live, small, v).code() == StatusCode::kShapeMismatch);
  CHECK(b.cache.read_token(live, k, small).code() == StatusCode::kShapeMismatch);
  SlotRef evicted{};
  for (const auto& blk : b.model.S(0).blocks)
    for (int i = 0; i < blk.fill; ++i)
      if (blk.slots[i].evicted) evicted = {blk.real, static_cast<std::uint32_t>(i)};
  CHECK_FALSE(b.cache.read_token(evicted, k, v).is_ok());
  CHECK_FALSE(b.cache.read_token({b.cache.table().pools().total, 0}, k, v).is_ok());
  CHECK_FALSE(b.cache.read_token({kNoBlock, 0}, k, v).is_ok());
  CHECK_FALSE(b.cache.read_token({live.block, 12}, k, v).is_ok());
  CHECK_FALSE(b.cache.read_token({live.block, 1000}, k, v).is_ok());
  // a free block
  for (std::uint32_t blk = 0; blk < b.cache.table().pools().total; ++blk)
    if (b.cache.table().block_owner(blk) == kNoStream) {
      CHECK_FALSE(b.cache.read_token({blk, 0}, k, v).is_ok());
      break;
    }
}

TEST_CASE("PagedKvCache: reset_stream releases everything the stream holds", "[paged]") {
  TT_SEEDED_RNG();
  Busy b(rng);
  REQUIRE(b.cache.reset_stream(0).is_ok());
  b.model.reset(0);
  TT_REQUIRE_OK_DIFF(tt::check_cache(b.cache, b.model));
  CHECK(b.cache.memory(0).blocks_held == 0);
  CHECK(b.cache.memory(0).physical_bytes() == 40 + 2 * 8 * 32 * 2);
  CHECK(b.cache.table().next_position(0) == 0);
  // s2 is chosen afresh from the stream's next first group (the model does so too).
  append_tokens(b.cache, b.model, rng, 0, R, 8, 100.0);
  TT_REQUIRE_OK_DIFF(tt::check_cache(b.cache, b.model));
}

TEST_CASE("PagedKvCache: read_token with a slot index >= 2^31 is rejected", "[paged][errors][bug]") {
  // PagedKvCache::read_token checks only the block id before BlockTable::is_live, which casts the
  // slot to int: slot 0x80000000 becomes negative, passes `slot < fill`, and is_evicted then
  // indexes the eviction mask 2^25 words past the block (out of bounds).
  TT_SEEDED_RNG();
  Busy b(rng);
  std::vector<float> k(32), v(32);
  const SlotRef live = b.model.live_slots(0)[0];
  CHECK_FALSE(b.cache.read_token({live.block, 0x80000000u}, k, v).is_ok());
}

// The backend counts the bytes it stores where it stores them; the expectation here is written
// from the formats (docs/formats.md), not from CacheLayout: per committed group of g tokens at
// precision p, K and V rows of d elements at bits(p) each, one E4M3 value scale per g channels of
// each token and the record's d E4M3 key scales (quantized formats only). Evictions and in-place
// refills in between add nothing: no byte is ever moved.
TEST_CASE("PagedKvCache: every byte the backend writes is a new token's, none is moved", "[paged][evict]") {
  TT_SEEDED_RNG();
  auto group_bytes = [](Precision p, int d, int g) -> std::int64_t {
    switch (p) {
      case Precision::kBf16: return std::int64_t{g} * 2 * d * 2;
      case Precision::kFp8E4M3: return std::int64_t{g} * (2 * d + d / g) + d;
      case Precision::kNvfp4: return std::int64_t{g} * (2 * (d / 2) + d / g) + d;
      case Precision::kTernary: return std::int64_t{g} * (2 * (d / 4) + d / g) + d;
    }
    return -1;
  };
  for (const PrecisionMap& map : kMaps) {
    CAPTURE(map);
    const int g = 8, d = 32;
    PagedKvCache<> c(cache_config(map, d, g, uniform_int(rng, 8, 24), 3, 64));
    CtModel m(c.config());
    std::int64_t expected = 0, reused_before = 0;
    for (int round = 0; round < 40; ++round) {
      const int s = uniform_int(rng, 0, 2);
      const ThoughtType th = tt::next_thought(rng, m, s);
      append_tokens(c, m, rng, s, th, g);  // staging holds whole groups only: one commit
      expected += group_bytes(map.precision_of(th), d, g);
      if (round % 3 == 2 && m.live_count(s) > g) {
        evict_both(c, m, s, tt::random_live_subset(rng, m, s, uniform_int(rng, 1, 2 * g)));
      }
    }
    INFO("slots reused " << c.table().stats().slots_reused);
    CHECK(c.table().stats().slots_reused > reused_before);  // refills in place happened
    CHECK(c.backend().stats().page_bytes_written == expected);
    CHECK(c.planned_bytes() == expected);
    CHECK(c.moved_bytes() == 0);
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
  }
}

// One plan per stream for a batch (a layer's KV heads), made once with PlanClaims and applied as
// made: the plans take distinct fresh blocks and records, the batch ends where planning each
// stream alone and appending would, and a stale or foreign plan is refused, changing nothing.
TEST_CASE("PagedKvCache: a batch of streams planned once with PlanClaims, applied as planned", "[paged]") {
  TT_SEEDED_RNG();
  const int g = 8, d = 32, streams = 4;
  PagedKvCache<> c(cache_config(kR4E4T2, d, g, 8, streams, 64));
  CtModel m(c.config());
  for (int round = 0; round < 12; ++round) {
    const ThoughtType th = round % 3 == 0 ? ThoughtType::kTransition : ThoughtType::kReasoning;
    for (int s = 0; s < streams; ++s) append_tokens(c, m, rng, s, th, g - 1);
    PlanClaims claims;
    std::vector<CommitPlan> plans(streams);
    std::set<std::uint32_t> fresh;
    std::set<std::uint32_t> records;
    for (int s = 0; s < streams; ++s) {
      REQUIRE(c.table().plan_commit(s, th, plans[static_cast<std::size_t>(s)], &claims).is_ok());
      for (std::uint32_t b : plans[static_cast<std::size_t>(s)].new_blocks) CHECK(fresh.insert(b).second);
      CHECK(records.insert(plans[static_cast<std::size_t>(s)].record).second);
    }
    CHECK(claims.records == static_cast<std::size_t>(streams));
    CHECK(claims.blocks[static_cast<int>(c.config().precision.precision_of(th))] == fresh.size());
    // A plan for another stream, or another thought, is refused and changes nothing.
    const auto before = tt::snapshot_cache(c);
    const auto k = tt::random_row(rng, d), v = tt::random_row(rng, d);
    CHECK(c.append(0, k, v, th, 0, plans[1]).code() == StatusCode::kInvalidArgument);
    const ThoughtType other = th == ThoughtType::kTransition ? ThoughtType::kReasoning : ThoughtType::kTransition;
    CommitPlan wrong = plans[0];
    wrong.thought = other;
    CHECK(c.append(0, k, v, th, 0, wrong).code() == StatusCode::kInvalidArgument);
    CHECK(tt::snapshot_cache(c) == before);
    for (int s = 0; s < streams; ++s) {
      const auto ks = tt::random_row(rng, d), vs = tt::random_row(rng, d);
      REQUIRE(c.append(s, ks, vs, th, 0, plans[static_cast<std::size_t>(s)]).is_ok());
      Diff diff;
      tt::mirror_append(c.table(), m, s, ks, vs, th, 0, diff);
      TT_REQUIRE_OK_DIFF(diff);
    }
    TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
    if (round % 4 == 3) {
      for (int s = 0; s < streams; ++s) evict_both(c, m, s, tt::random_live_subset(rng, m, s, 2 * g));
    }
  }
  // A plan given for a token that does not complete a group is refused.
  CommitPlan any;
  REQUIRE(c.table().plan_commit(0, ThoughtType::kReasoning, any).is_ok());
  const auto k = tt::random_row(rng, d), v = tt::random_row(rng, d);
  CHECK(c.append(0, k, v, ThoughtType::kReasoning, 0, any).code() == StatusCode::kInvalidArgument);
}
