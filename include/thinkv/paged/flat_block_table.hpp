#pragma once
/// \file flat_block_table.hpp
/// The block table's metadata flattened into the plain arrays a device kernel reads
/// (thinkv::kernels::PagedKvView): per-block fill and eviction-mask words, per-slot key-scale
/// record ids, each stream's block list as CSR, each stream's staged count. Host code, no CUDA:
/// a device backend uploads these arrays; tests build device views from them.

#include <cstdint>
#include <vector>

#include "thinkv/paged/block_table.hpp"

namespace thinkv {

struct FlatBlockTable {
  std::vector<std::uint16_t> block_fill;     ///< [N] written slots of each block (0..B)
  std::vector<std::uint64_t> evict_mask;     ///< [N, words] bit i of word i/64: slot i evicted
  std::vector<std::uint32_t> slot_record;    ///< [N, B] key-scale record of each slot (kNoRecord: none)
  std::vector<std::int32_t> block_indptr;    ///< [S + 1] CSR row pointers into block_indices
  std::vector<std::uint32_t> block_indices;  ///< each stream's blocks in list order (>= 1 entry:
                                             ///< a dummy 0 when no stream holds a block)
  std::vector<std::int32_t> staged_count;    ///< [S] staged tokens of each stream
  int evict_mask_words = 0;                  ///< words per block, (B + 63) / 64
};

/// Fills `out` from `table` (reusing its capacity).
inline void flatten_block_table(const BlockTable& table, FlatBlockTable& out) {
  const PoolMap& pools = table.pools();
  const int bs = table.config().block_size;
  const int streams = table.config().num_streams;
  const int words = table.layout().evict_mask_words();
  out.evict_mask_words = words;
  out.block_fill.resize(pools.total);
  out.evict_mask.resize(static_cast<std::size_t>(pools.total) * words);
  out.slot_record.resize(static_cast<std::size_t>(pools.total) * bs);
  for (std::uint32_t b = 0; b < pools.total; ++b) {
    out.block_fill[b] = static_cast<std::uint16_t>(table.block_fill(b));
    const auto m = table.evict_mask(b);
    for (int w = 0; w < words; ++w) {
      out.evict_mask[static_cast<std::size_t>(b) * words + w] = m[static_cast<std::size_t>(w)];
    }
    for (int i = 0; i < bs; ++i) {
      out.slot_record[static_cast<std::size_t>(b) * bs + i] = table.slot_record({b, static_cast<std::uint32_t>(i)});
    }
  }
  out.block_indptr.assign(static_cast<std::size_t>(streams) + 1, 0);
  out.block_indices.clear();
  out.staged_count.resize(static_cast<std::size_t>(streams));
  for (int s = 0; s < streams; ++s) {
    for (std::uint32_t b : table.blocks(s)) out.block_indices.push_back(b);
    out.block_indptr[static_cast<std::size_t>(s) + 1] = static_cast<std::int32_t>(out.block_indices.size());
    out.staged_count[static_cast<std::size_t>(s)] = table.staged_count(s);
  }
  if (out.block_indices.empty()) out.block_indices.push_back(0);
}

}  // namespace thinkv
