#pragma once
/// \file flat_block_table.hpp
/// The block table's metadata flattened into the plain arrays a device kernel reads
/// (thinkv::kernels::PagedKvView): per-block fill and eviction-mask words, per-slot key-scale
/// record ids, each stream's block list as CSR, each stream's staged count. Host code, no CUDA:
/// a device backend uploads these arrays; tests build device views from them.
///
/// The flat arrays number blocks compactly: pool p's page i (block PoolMap::base[p] + i of the
/// table) is flat block pool_base[p] + i, the pools consecutive in precision order and each
/// `pages[p]` long (at least its allocated blocks), so a device needs arrays only as long as
/// the storage it really has, not as the pools' id ranges.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "thinkv/paged/block_table.hpp"

namespace thinkv {

struct FlatBlockTable {
  std::vector<std::uint16_t> block_fill;          ///< [N] written slots of each block (0..B)
  std::vector<std::uint64_t> evict_mask;          ///< [N, words] bit i of word i/64: slot i evicted
  std::vector<std::uint32_t> slot_record;         ///< [N, B] key-scale record of each slot (kNoRecord: none)
  std::vector<std::uint32_t> slot_segment;        ///< [N, B] thought segment of each written slot
  std::vector<std::int32_t> block_indptr;         ///< [S + 1] CSR row pointers into block_indices
  std::vector<std::uint32_t> block_indices;       ///< each stream's blocks in list order (>= 1 entry:
                                                  ///< a dummy 0 when no stream holds a block)
  std::vector<std::int32_t> staged_count;         ///< [S] staged tokens of each stream
  int evict_mask_words = 0;                       ///< words per block, (B + 63) / 64
  std::uint32_t pool_base[kNumPrecisions] = {};   ///< flat id of pool p's page 0
  std::uint32_t pool_count[kNumPrecisions] = {};  ///< pages of pool p in the numbering
  std::uint32_t total_blocks = 0;                 ///< N, the sum of pool_count

  /// The flat id of a table block id.
  [[nodiscard]] std::uint32_t flat_id(const BlockTable& table, std::uint32_t block) const {
    const PoolMap& pools = table.pools();
    const int p = static_cast<int>(pools.precision_of(block));
    return pool_base[p] + (block - pools.base[p]);
  }
};

/// The compact numbering alone: pool_base, pool_count and total_blocks of `out` for the view's
/// pools (`pages` as in flatten_attend_view).
inline void flat_numbering(const AttendView& view, FlatBlockTable& out, const std::uint32_t* pages = nullptr) {
  out.evict_mask_words = view.evict_mask_words;
  out.total_blocks = 0;
  for (int p = 0; p < kNumPrecisions; ++p) {
    out.pool_base[p] = out.total_blocks;
    out.pool_count[p] = pages != nullptr ? pages[p] : view.pools[p].blocks;
    out.total_blocks += out.pool_count[p];
  }
}

/// The streams' part of flatten_attend_view: the CSR block lists and staged counts of the view's
/// streams (the other streams' rows empty), numbered as `out`'s flat_numbering says.
inline void flatten_streams(const AttendView& view, int num_streams, FlatBlockTable& out) {
  out.block_indptr.assign(static_cast<std::size_t>(num_streams) + 1, 0);
  out.block_indices.clear();
  out.staged_count.assign(static_cast<std::size_t>(num_streams), 0);
  // Rows in stream order; a stream the view lists twice (two KV heads of one stream) once.
  std::vector<const StreamView*> by_stream(static_cast<std::size_t>(num_streams), nullptr);
  for (const StreamView& sv : view.streams) {
    if (sv.stream >= 0 && sv.stream < num_streams) by_stream[static_cast<std::size_t>(sv.stream)] = &sv;
  }
  for (int s = 0; s < num_streams; ++s) {
    if (const StreamView* sv = by_stream[static_cast<std::size_t>(s)]) {
      for (std::uint32_t b : sv->blocks) {
        const int p = view.pool_of(b);
        out.block_indices.push_back(out.pool_base[p] + (b - view.pools[p].base));
      }
      out.staged_count[static_cast<std::size_t>(s)] = sv->staged;
    }
    out.block_indptr[static_cast<std::size_t>(s) + 1] = static_cast<std::int32_t>(out.block_indices.size());
  }
  if (out.block_indices.empty()) out.block_indices.push_back(0);
}

/// Fills `out` from an attention's view (what a backend receives): the pools' metadata, and the
/// block lists and staged counts of the view's streams (the other streams' rows are empty), in
/// the same compact numbering as flatten_block_table. `num_streams` sizes the CSR (kernels index
/// it by stream id); `pages` as there (null = the view's pages with storage).
inline void flatten_attend_view(const AttendView& view, int num_streams, FlatBlockTable& out,
                                const std::uint32_t* pages = nullptr);

/// The pools' part of flatten_attend_view alone: numbering, fill, masks and slot records of every
/// page (the CSR block lists and staged counts of `out` are left as they are).
inline void flatten_pools(const AttendView& view, FlatBlockTable& out, const std::uint32_t* pages = nullptr) {
  const int bs = view.block_size;
  const int words = view.evict_mask_words;
  flat_numbering(view, out, pages);
  const std::size_t n = out.total_blocks;
  out.block_fill.assign(n, 0);
  out.evict_mask.assign(n * words, 0);
  out.slot_record.assign(n * bs, kNoRecord);
  out.slot_segment.assign(n * bs, 0);
  for (int p = 0; p < kNumPrecisions; ++p) {
    const PoolView& pv = view.pools[p];
    const std::size_t have = std::min(out.pool_count[p], pv.blocks);
    const std::size_t f = out.pool_base[p];
    std::copy_n(pv.fill.begin(), have, out.block_fill.begin() + static_cast<std::ptrdiff_t>(f));
    std::copy_n(pv.evict_mask.begin(), have * words, out.evict_mask.begin() + static_cast<std::ptrdiff_t>(f * words));
    std::copy_n(pv.slot_record.begin(), have * bs, out.slot_record.begin() + static_cast<std::ptrdiff_t>(f * bs));
    if (!pv.slot_segment.empty()) {
      std::copy_n(pv.slot_segment.begin(), have * bs, out.slot_segment.begin() + static_cast<std::ptrdiff_t>(f * bs));
    }
  }
}

inline void flatten_attend_view(const AttendView& view, int num_streams, FlatBlockTable& out,
                                const std::uint32_t* pages) {
  flatten_pools(view, out, pages);
  flatten_streams(view, num_streams, out);
}

/// The metadata of the pages changed since a mirror's sync, packed for a device scatter
/// (FlatBlockDelta): for every page of pool p that `synced[p]` has not seen (each page once), its
/// flat id, fill, mask words and slot records. False when some pool cannot be brought up to date
/// by changes (its log starts after synced[p]): the mirror must copy everything
/// (flatten_attend_view). `out` must hold the numbering (flat_numbering) the mirror uses.
struct FlatBlockDelta {
  std::vector<std::uint32_t> ids;           ///< [n] flat block ids
  std::vector<std::uint16_t> fill;          ///< [n]
  std::vector<std::uint64_t> evict_mask;    ///< [n, words]
  std::vector<std::uint32_t> slot_record;   ///< [n, B]
  std::vector<std::uint32_t> slot_segment;  ///< [n, B]
  std::vector<std::uint32_t> seen;          ///< scratch: per flat block, the pass that took it
  std::uint32_t pass = 0;
  [[nodiscard]] std::size_t size() const noexcept { return ids.size(); }
  /// Bytes of the packed metadata (what a device upload of it moves, ids included).
  [[nodiscard]] std::size_t bytes() const noexcept {
    return ids.size() * 4 + fill.size() * 2 + evict_mask.size() * 8 + slot_record.size() * 4 + slot_segment.size() * 4;
  }
};

inline bool flat_changes(const AttendView& view, const FlatBlockTable& numbering, const std::uint64_t* synced,
                         FlatBlockDelta& out) {
  const int bs = view.block_size;
  const int words = view.evict_mask_words;
  out.ids.clear();
  out.fill.clear();
  out.evict_mask.clear();
  out.slot_record.clear();
  out.slot_segment.clear();
  std::span<const std::uint32_t> pages[kNumPrecisions];
  for (int p = 0; p < kNumPrecisions; ++p) {
    if (!view.pools[p].changes_since(synced[p], pages[p])) return false;
  }
  if (out.seen.size() < numbering.total_blocks) out.seen.assign(numbering.total_blocks, 0);
  if (++out.pass == 0) {  // wrapped: start the stamps again
    std::fill(out.seen.begin(), out.seen.end(), 0);
    out.pass = 1;
  }
  for (int p = 0; p < kNumPrecisions; ++p) {
    const PoolView& pv = view.pools[p];
    for (std::uint32_t local : pages[p]) {
      if (local >= pv.blocks || local >= numbering.pool_count[p]) continue;  // lost its storage since
      const std::uint32_t flat = numbering.pool_base[p] + local;
      if (out.seen[flat] == out.pass) continue;
      out.seen[flat] = out.pass;
      out.ids.push_back(flat);
      out.fill.push_back(pv.fill[local]);
      const auto m = pv.evict_mask.subspan(static_cast<std::size_t>(local) * words, static_cast<std::size_t>(words));
      out.evict_mask.insert(out.evict_mask.end(), m.begin(), m.end());
      const auto r = pv.slot_record.subspan(static_cast<std::size_t>(local) * bs, static_cast<std::size_t>(bs));
      out.slot_record.insert(out.slot_record.end(), r.begin(), r.end());
      if (!pv.slot_segment.empty()) {
        const auto g = pv.slot_segment.subspan(static_cast<std::size_t>(local) * bs, static_cast<std::size_t>(bs));
        out.slot_segment.insert(out.slot_segment.end(), g.begin(), g.end());
      } else {
        out.slot_segment.insert(out.slot_segment.end(), static_cast<std::size_t>(bs), 0u);
      }
    }
  }
  return true;
}

/// Fills `out` from `table` (reusing its capacity): flatten_attend_view over every stream.
/// `pages[p]` gives pool p's length in the flat numbering (a device's storage; each at least
/// table.allocated_blocks(p)); null = the table's allocated blocks.
inline void flatten_block_table(const BlockTable& table, FlatBlockTable& out, const std::uint32_t* pages = nullptr) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(table.config().num_streams));
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<StreamView> views;
  flatten_attend_view(table.attend_view(ids, views), table.config().num_streams, out, pages);
}

}  // namespace thinkv
