#pragma once
/// \file storage_view.hpp
/// The plain values a KV backend (storage) receives from the cache: where a slot is (SlotRef,
/// PoolMap), where a staged group goes (CommitPlan), which token a slot holds (TokenRef), and
/// what an attention reads (AttendView: each attended stream's block list and staged count, and
/// each pool's per-block metadata as spans). No BlockTable, no policy setting: a backend that
/// keeps the bytes in its own memory reads only these. BlockTable produces them
/// (token_ref, pool_view, stream_view).

#include <cstdint>
#include <span>
#include <vector>

#include "thinkv/paged/layout.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

inline constexpr std::uint32_t kNoRecord = 0xFFFFFFFFu;  ///< slot has no key-scale record (BF16)
inline constexpr std::uint32_t kNoBlock = 0xFFFFFFFFu;
inline constexpr std::int32_t kNoStream = -1;

/// One slot of one block. Block ids are global across pools (see PoolMap).
struct SlotRef {
  std::uint32_t block = kNoBlock;
  std::uint32_t slot = 0;
  friend constexpr bool operator==(const SlotRef&, const SlotRef&) = default;
  friend constexpr auto operator<=>(const SlotRef&, const SlotRef&) = default;
};

/// Global block ids: pool p owns ids [base[p], base[p] + count[p]).
struct PoolMap {
  std::uint32_t base[kNumPrecisions] = {};
  std::uint32_t count[kNumPrecisions] = {};
  std::uint32_t total = 0;

  static PoolMap from(const StorageConfig& c) {
    PoolMap m;
    for (int p = 0; p < kNumPrecisions; ++p) {
      m.base[p] = m.total;
      m.count[p] = static_cast<std::uint32_t>(c.pool_blocks[p]);
      m.total += m.count[p];
    }
    return m;
  }
  [[nodiscard]] constexpr Precision precision_of(std::uint32_t block) const noexcept {
    for (int p = kNumPrecisions - 1; p > 0; --p) {
      if (block >= base[p]) return static_cast<Precision>(p);
    }
    return Precision::kBf16;
  }
  /// Index of the block inside its pool.
  [[nodiscard]] constexpr std::uint32_t local_index(std::uint32_t block) const noexcept {
    return block - base[static_cast<int>(precision_of(block))];
  }
};

/// Where one staged group goes. Produced by BlockTable::plan_commit (pure), consumed by the
/// backend (writes the data) and by BlockTable::apply_commit (records it).
struct CommitPlan {
  std::int32_t stream = kNoStream;
  ThoughtType thought = ThoughtType::kReasoning;
  Precision precision = Precision::kBf16;
  std::vector<SlotRef> slots;             ///< [group_size] destination of staged token i
  std::vector<std::uint32_t> new_blocks;  ///< blocks taken fresh from the pool, in order
  std::uint32_t record = kNoRecord;       ///< key-scale record of this group (kNoRecord: BF16)
  int reused_slots = 0;                   ///< how many of `slots` are evicted slots reused
  /// Where the stream's next search for holes of `thought` may start once this plan is applied:
  /// the block-list index of the last block the plan took holes from (every earlier block of the
  /// type is then hole-free); 0 when it took none. The table's own bookkeeping.
  std::uint32_t hole_search_from = 0;
};

/// The token a live slot holds, as storage needs it to decode the slot: the stream that owns its
/// block (whose second-level scales apply) and its key-scale record (kNoRecord for BF16).
struct TokenRef {
  SlotRef slot;
  std::int32_t stream = kNoStream;
  std::uint32_t record = kNoRecord;
};

/// One precision pool's block metadata, by page index i (block id base + i), for the pages with
/// storage (0 .. blocks - 1). Spans into the cache's metadata, valid until its next change.
///
/// The change log lets a backend that mirrors the metadata (a device) send only what changed:
/// every change of a page's fill, eviction mask, slot records (and segments) or owner raises `revision` by one
/// and appends the page index to `changed`, so changed[i] is the page of revision
/// log_first + i + 1. A mirror synced at revision r with log_first <= r <= revision is brought
/// up to date by copying pages changed[r - log_first ..] (a page may repeat; a page at or past
/// `blocks` has lost its storage since and is skipped). Pages that get storage are logged as
/// changed. One synced before log_first (the log was trimmed when it outgrew twice the pool)
/// copies the whole pool.
struct PoolView {
  std::uint32_t base = 0;                       ///< global id of page 0
  std::uint32_t blocks = 0;                     ///< pages with storage
  std::span<const std::uint16_t> fill;          ///< [blocks] written slots (0..block_size)
  std::span<const std::uint64_t> evict_mask;    ///< [blocks * evict_mask_words] bit s: slot s evicted
  std::span<const std::uint32_t> slot_record;   ///< [blocks * block_size] key-scale record per slot
  std::span<const std::int32_t> owner;          ///< [blocks] owning stream (kNoStream: free)
  std::uint64_t revision = 0;                   ///< changes so far
  std::uint64_t log_first = 0;                  ///< revision before changed[0]
  std::span<const std::uint32_t> changed;       ///< pages changed after log_first, in order
  std::span<const std::uint32_t> slot_segment;  ///< [blocks * block_size] thought segment of each written slot

  /// The pages a mirror synced at `synced` must copy, or false when it must copy every page.
  [[nodiscard]] bool changes_since(std::uint64_t synced, std::span<const std::uint32_t>& pages) const noexcept {
    if (synced < log_first || synced > revision) return false;
    pages = changed.subspan(static_cast<std::size_t>(synced - log_first));
    return true;
  }
};

/// One stream as an attention reads it: its blocks in list order (slot order within a block is
/// attention order), then its staged tokens.
struct StreamView {
  std::int32_t stream = kNoStream;
  std::span<const std::uint32_t> blocks;  ///< global block ids
  std::int32_t staged = 0;                ///< staged tokens (rows 0 .. staged - 1)
  std::int64_t live = 0;                  ///< live slots in its blocks (not counting staged)
  /// Changes whenever `blocks` changes (a value no other list of the table has had): a mirror
  /// that holds a stream's list at this version need not copy it again. 0: never listed a block.
  std::uint64_t list_version = 0;
};

/// What one attention call reads: streams[h] is args.kv_streams[h]'s view; pools[p] every pool's
/// metadata (a block of a stream lies in the pool whose [base, base + blocks) holds it).
struct AttendView {
  int block_size = 0;
  int evict_mask_words = 0;
  PoolView pools[kNumPrecisions];
  std::span<const StreamView> streams;

  /// The pool holding global block b (a block some stream lists), or -1.
  [[nodiscard]] int pool_of(std::uint32_t b) const noexcept {
    for (int p = 0; p < kNumPrecisions; ++p) {
      if (b >= pools[p].base && b - pools[p].base < pools[p].blocks) return p;
    }
    return -1;
  }
  /// Slot s of block b (in pool p) is written and not evicted.
  [[nodiscard]] bool live(int p, std::uint32_t b, int s) const noexcept {
    const PoolView& v = pools[p];
    const std::size_t i = b - v.base;
    if (s >= v.fill[i]) return false;
    const std::uint64_t w =
        v.evict_mask[i * static_cast<std::size_t>(evict_mask_words) + static_cast<std::size_t>(s / 64)];
    return ((w >> (s % 64)) & 1u) == 0;
  }
  /// The token in slot s of block b (in pool p).
  [[nodiscard]] TokenRef token(int p, std::uint32_t b, int s) const noexcept {
    const PoolView& v = pools[p];
    const std::size_t i = b - v.base;
    return {
        {b, static_cast<std::uint32_t>(s)}, v.owner[i], v.slot_record[i * static_cast<std::size_t>(block_size) + s]};
  }
};

/// Read access to the block table's current state as plain views, for a backend that reads
/// streams beyond the ones an attention names (a batched step's attention on the host) or keeps a
/// mirror of the block lists (a device): any stream's and any pool's view, fetched when needed
/// (each valid until the table's next change), and the log of block-list changes. Every change
/// of a stream's block list raises `list_revision` by one and appends the stream to
/// `list_changed`, so list_changed[i] is the stream of revision list_log_first + i + 1. A mirror
/// synced at revision r with list_log_first <= r <= list_revision copies the lists of
/// list_changed[r - list_log_first ..] (a stream may repeat); one synced before list_log_first
/// copies every list.
struct TableView {
  const void* ctx = nullptr;
  StreamView (*stream_fn)(const void*, int) = nullptr;
  PoolView (*pool_fn)(const void*, int) = nullptr;
  int num_streams = 0;
  int block_size = 0;
  int evict_mask_words = 0;
  std::uint64_t list_revision = 0;
  std::uint64_t list_log_first = 0;
  std::span<const std::int32_t> list_changed;

  [[nodiscard]] StreamView stream(int s) const { return stream_fn(ctx, s); }
  [[nodiscard]] PoolView pool(int p) const { return pool_fn(ctx, p); }
  /// The streams whose lists a mirror synced at `synced` must copy, or false: copy every list.
  [[nodiscard]] bool list_changes_since(std::uint64_t synced, std::span<const std::int32_t>& streams) const noexcept {
    if (synced < list_log_first || synced > list_revision) return false;
    streams = list_changed.subspan(static_cast<std::size_t>(synced - list_log_first));
    return true;
  }
  /// The live slots of `stream` holding thought segment `segment`, in attention order (the
  /// stream's blocks in list order, then slot order: what BlockTable::live_segment_slots lists),
  /// as the tokens they hold, into `out` (cleared).
  void segment_tokens(int stream, std::uint32_t segment, std::vector<TokenRef>& out) const {
    out.clear();
    PoolView pv[kNumPrecisions];
    for (int p = 0; p < kNumPrecisions; ++p) pv[p] = pool(p);
    const StreamView sv = this->stream(stream);
    const auto bs = static_cast<std::size_t>(block_size);
    for (std::uint32_t b : sv.blocks) {
      for (int p = 0; p < kNumPrecisions; ++p) {
        if (b < pv[p].base || b - pv[p].base >= pv[p].blocks) continue;
        const std::size_t i = b - pv[p].base;
        const int n = pv[p].fill[i];
        for (int sl = 0; sl < n; ++sl) {
          const std::uint64_t w =
              pv[p].evict_mask[i * static_cast<std::size_t>(evict_mask_words) + static_cast<std::size_t>(sl / 64)];
          if (pv[p].slot_segment[i * bs + static_cast<std::size_t>(sl)] != segment || ((w >> (sl % 64)) & 1u) != 0) {
            continue;
          }
          out.push_back({{b, static_cast<std::uint32_t>(sl)}, pv[p].owner[i], pv[p].slot_record[i * bs + sl]});
        }
      }
    }
  }
  /// An AttendView of `streams` (their views into `out`, reused) and every pool, as now.
  [[nodiscard]] AttendView attend_view(std::span<const std::int32_t> streams, std::vector<StreamView>& out) const {
    out.clear();
    for (std::int32_t s : streams) out.push_back(stream(s));
    AttendView v;
    v.block_size = block_size;
    v.evict_mask_words = evict_mask_words;
    for (int p = 0; p < kNumPrecisions; ++p) v.pools[p] = pool(p);
    v.streams = out;
    return v;
  }
};

}  // namespace thinkv
