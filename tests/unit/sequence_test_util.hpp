#pragma once
// Shared by the sequence-operation and sequence-state tests: the small cache they run
// (every policy set through ThinKvSpec) and every stream's live positions.

#include <set>
#include <vector>

#include "../../examples/decoder/thinkv_spec.hpp"
#include "thinkv/thinkv_cache.hpp"

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

}  // namespace tt
