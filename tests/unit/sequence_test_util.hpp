#pragma once
// Shared by the sequence-operation, sequence-state and position-shift tests: the small cache they
// run (every policy set through ThinKvSpec), every stream's live positions, the segments' ranges,
// and the float64 RoPE and nearest-BF16 rounding the shift tests model keys with.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "../../examples/decoder/thinkv_spec.hpp"
#include "thinkv/seq/rope.hpp"
#include "thinkv/thinkv_cache.hpp"

#include "test_util.hpp"

namespace tt {

/// 3 sequences, 2 layers x 2 KV heads (4 query heads), head_dim 16, groups of 8, blocks of 16,
/// segments of 32 shrinking along {16, 8, 4}, budget 96, R4E4T2, a three-type classifier (tau 32).
inline thinkv::decoder::ThinKvSpec sequence_spec(thinkv::decoder::CacheMode mode) {
  thinkv::decoder::ThinKvSpec c;
  c.mode = mode;
  c.num_sequences = 3;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 4;
  c.head_dim = 16;
  c.group_size = 8;
  c.block_size = 16;
  c.max_tokens = 4000;
  c.segment_len = 32;
  c.retention = thinkv::RetentionSchedule({16, 8, 4});
  c.token_budget = 96;
  c.precision = thinkv::kR4E4T2;
  c.classifier = thinkv::ThoughtClassifier::three_types(0.3f, 0.6f, {0, 1}, 32, 2);
  return c;
}

/// The live positions of every stream of a sequence (pages and staging), in stream order.
template <class Cache>
std::vector<std::set<std::int32_t>> held_positions(const Cache& cache, int seq) {
  const auto& t = cache.paged().table();
  const auto& c = cache.config();
  std::vector<std::set<std::int32_t>> out;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const int st = cache.stream_of(seq, l, h);
      std::set<std::int32_t>& s = out.emplace_back();
      for (const thinkv::SlotRef r : t.live_slot_list(st)) s.insert(t.slot_position(r));
      for (int row = 0; row < t.staged_count(st); ++row) s.insert(t.staged_position(st, row));
    }
  }
  return out;
}

/// x turned to position `pos` by the RoPE `r` describes, in float64 (written from the definition,
/// not from rope.hpp).
inline std::vector<double> rope64(const std::vector<double>& x, double pos, const thinkv::RopeSpec& r) {
  const int d = static_cast<int>(x.size());
  const int n = r.rotary_dims == 0 ? d : r.rotary_dims;
  std::vector<double> y = x;
  for (int i = 0; i < n / 2; ++i) {
    const double w = pos * r.position_scale / std::pow(r.theta, 2.0 * i / n);
    const int a = r.style == thinkv::RopeStyle::kAdjacentPairs ? 2 * i : i;
    const int b = r.style == thinkv::RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + n / 2;
    y[static_cast<std::size_t>(a)] =
        x[static_cast<std::size_t>(a)] * std::cos(w) - x[static_cast<std::size_t>(b)] * std::sin(w);
    y[static_cast<std::size_t>(b)] =
        x[static_cast<std::size_t>(a)] * std::sin(w) + x[static_cast<std::size_t>(b)] * std::cos(w);
  }
  return y;
}

/// The BF16 value nearest to x (ties to even), for normal-range x: the float rounding's BF16 and
/// its two neighbours, the nearest of them.
inline float bf16_nearest(double x) {
  const float r = bf16_round(static_cast<float>(x));
  float best = r;
  for (int step : {-1, 1}) {
    const std::uint32_t bits = fbits(r) + static_cast<std::uint32_t>(step * 0x10000);
    const float c = from_bits(bits);
    const double dc = std::fabs(static_cast<double>(c) - x), db = std::fabs(static_cast<double>(best) - x);
    if (dc < db || (dc == db && ((fbits(c) >> 16) & 1u) == 0)) best = c;
  }
  return best;
}

/// The segments of a sequence cover increasing ranges of positions: starts strictly increase,
/// the last one is below the sequence's next position, and every held token (pages of every
/// stream, staged rows) lies in its segment's range [start, next segment's start).
template <class Cache>
void check_segment_ranges(const Cache& cache, int seq) {
  const auto& segs = cache.segments(seq);
  const auto& t = cache.paged().table();
  const auto& c = cache.config();
  const std::int32_t next = cache.position(seq);
  for (std::size_t i = 0; i < segs.size(); ++i) {
    INFO("segment " << segs[i].id << " starts at " << segs[i].start << ", next position " << next);
    REQUIRE(segs[i].start >= 0);
    REQUIRE(segs[i].start < std::max(next, 1));
    if (i + 1 < segs.size()) REQUIRE(segs[i].start < segs[i + 1].start);
  }
  auto check = [&](std::int32_t pos, std::uint32_t id) {
    std::size_t i = 0;
    while (i < segs.size() && segs[i].id != id) ++i;
    INFO("a token at position " << pos << " of segment " << id);
    REQUIRE(i < segs.size());
    REQUIRE(pos >= segs[i].start);
    REQUIRE(pos < (i + 1 < segs.size() ? segs[i + 1].start : next));
  };
  for (int l = 0; l < c.num_layers; ++l) {
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const int st = cache.stream_of(seq, l, h);
      for (const thinkv::SlotRef r : t.live_slot_list(st)) check(t.slot_position(r), t.slot_segment(r));
      for (int row = 0; row < t.staged_count(st); ++row) check(t.staged_position(st, row), t.staged_segment(st, row));
    }
  }
}

}  // namespace tt
