#pragma once
/// \file block_table.hpp
/// The Continuous-Thinking (CT) block table: host metadata of a paged, compressed KV cache.
///
/// Per stream (sequence, layer, KV head) a list of fixed-size blocks; per block its thought type,
/// fill count, live count and eviction mask; per slot its key-scale record, segment id and token
/// position. Blocks of one precision come from one pool; key-scale records from one shared pool.
/// This class moves no K/V data: it decides *where* data goes (plan_commit) and records that it
/// went there (apply). Eviction only sets mask bits. docs/design.md explains the invariants.
///
/// Worked example (block_size 4, g = 2, one stream, all tokens of type R):
///   append t0 t1 -> group full -> plan: fresh block b0, slots {0,1}, record r0 -> apply
///   append t2 t3 -> slots {2,3} of b0, record r1;  b0: fill 4, live 4, mask 0000
///   evict slot 1 -> mask 0100 (bit i = slot i), live 3; r0 refcount 2 -> 1; no data moves
///   append t4 t5 -> plan: reuse hole b0:1 first, then fresh block b1 slot 0, record r2
///                   (t4's key scales come from r2, not from r0: a reused slot names its record)

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "thinkv/paged/id_bitset.hpp"
#include "thinkv/paged/layout.hpp"
#include "thinkv/paged/storage_view.hpp"
#include "thinkv/status.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

/// Counters of the block table (never reset).
/// Fresh blocks (per precision) and key-scale records that earlier plans of one batch will take.
/// plan_commit given claims plans as if those plans were already applied, so the plans of a
/// batch of streams (one layer's KV heads) get distinct blocks and records and can be applied one
/// after the other, in the order they were made, without planning again.
struct PlanClaims {
  std::size_t blocks[kNumPrecisions] = {};
  std::size_t records = 0;

  PlanClaims& operator+=(const PlanClaims& o) noexcept {
    for (int p = 0; p < kNumPrecisions; ++p) blocks[p] += o.blocks[p];
    records += o.records;
    return *this;
  }
  friend PlanClaims operator+(PlanClaims a, const PlanClaims& b) noexcept { return a += b; }
  /// a - b, each term clamped at 0.
  friend PlanClaims operator-(PlanClaims a, const PlanClaims& b) noexcept {
    for (int p = 0; p < kNumPrecisions; ++p) a.blocks[p] = a.blocks[p] > b.blocks[p] ? a.blocks[p] - b.blocks[p] : 0;
    a.records = a.records > b.records ? a.records - b.records : 0;
    return a;
  }
};

/// One held block of a stream as saved and restored (BlockTable::export_stream / import_stream):
/// its metadata without its id. Slots past `fill` are unwritten; a set mask bit is a hole.
struct BlockImage {
  ThoughtType thought = ThoughtType::kReasoning;
  std::uint16_t fill = 0;
  std::uint32_t seg_lo = 0xFFFFFFFFu, seg_hi = 0;  ///< segment ids written into the block, min / max
  std::vector<std::uint64_t> mask;                 ///< [evict_mask_words] eviction bits
  /// [block_size] the live slot's key-scale record as an index into the stream's saved records
  /// (numbered in order of first use), kNoRecord for a hole, an unwritten slot or a BF16 block
  std::vector<std::uint32_t> slot_record;
  std::vector<std::uint32_t> slot_segment;  ///< [block_size]
  std::vector<std::int32_t> slot_position;  ///< [block_size]
  friend bool operator==(const BlockImage&, const BlockImage&) = default;
};
/// A stream's pages as BlockTable holds them: its blocks in allocation order and how many
/// key-scale records their live slots use. The staging set is not part of it.
struct StreamImage {
  std::vector<BlockImage> blocks;
  std::uint32_t records = 0;
  friend bool operator==(const StreamImage&, const StreamImage&) = default;
};

struct BlockTableStats {
  std::int64_t commits = 0;        ///< staged groups written into pages
  std::int64_t slots_written = 0;  ///< slots written by commits (fresh + reused)
  std::int64_t slots_reused = 0;   ///< of which were evicted slots reused in place
  std::int64_t slots_evicted = 0;  ///< slots marked evicted
  std::int64_t blocks_allocated = 0;
  std::int64_t blocks_freed = 0;
  std::int64_t records_allocated = 0;
  std::int64_t records_freed = 0;
  std::int64_t chunks_grown = 0;            ///< block chunks given storage (all pools)
  std::int64_t chunks_released = 0;         ///< block chunks whose storage was released
  std::int64_t blocks_shared = 0;           ///< blocks given to another stream by share_prefix (each time)
  std::int64_t blocks_copied_on_write = 0;  ///< shared blocks copied for a holder (apply_unshare)
};

/// Host metadata of the CT cache. Single-threaded; not copyable by accident (use copy()).
///
/// Memory follows what is held: a pool's block ids are a range (PoolMap) of which only the low
/// chunks have storage (pages in the backend, metadata here). A commit that needs a block past
/// them grows its pool by whole chunks; a chunk at the top of a pool whose blocks are all free is
/// released at once (eviction, end of a sequence), so its bytes serve any pool. Fresh blocks are
/// the lowest free id of their pool, which keeps held blocks at the low end. Key-scale records
/// grow the same way (and are not released). allocated_bytes() is what all this costs, and
/// CacheConfig::memory_limit_bytes bounds it.
class BlockTable {
 public:
  /// `config` must be valid (CacheConfig::validate()); throws ConfigError otherwise.
  explicit BlockTable(const CacheConfig& config)
      : config_(config), layout_(CacheLayout::from(config)), pools_(PoolMap::from(config)) {
    if (Status s = config.validate(); !s.is_ok()) throw ConfigError(s);
    for (Precision p : kAllPrecisions) chunk_[static_cast<int>(p)] = config.pool_chunk(p);
    record_cap_ = static_cast<std::uint32_t>(effective_record_capacity(config));
    record_chunk_ = config.record_chunk(record_cap_);
    streams_.resize(static_cast<std::size_t>(config.num_streams));
    sets_.resize(static_cast<std::size_t>(config.num_streams / config.stage_set_streams));
    for (auto& t : sets_) {
      t.segment.assign(static_cast<std::size_t>(config.group_size), 0);
      t.position.assign(static_cast<std::size_t>(config.group_size), -1);
    }
  }

  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] const CacheLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] const PoolMap& pools() const noexcept { return pools_; }
  [[nodiscard]] const BlockTableStats& stats() const noexcept { return stats_; }
  [[nodiscard]] int num_streams() const noexcept { return config_.num_streams; }
  /// Most key-scale records the record pool may hold (its id range).
  [[nodiscard]] int record_capacity() const noexcept { return static_cast<int>(record_cap_); }
  /// Reserves the host metadata of every pool's whole range and of every key-scale record now,
  /// so that growing the pools never reallocates (and copies) it, and releasing chunks no longer
  /// shrinks it. For a runtime that sizes its batch to memory once: without it a pool's
  /// per-slot arrays double when they fill, a copy of all of them inside one step (at 15 M BF16
  /// blocks, 3 GB in one begin_step). Returns the host bytes the reserved arrays hold (their
  /// capacities): about 24 + 8 x evict_mask_words + 12 x block_size per block (change log
  /// included) and 8 per record.
  std::int64_t reserve_host_metadata() {
    host_reserved_ = true;
    std::int64_t bytes = 0;
    auto held = [&bytes](const auto&... v) {
      ((bytes += static_cast<std::int64_t>(v.capacity() * sizeof(v[0]))), ...);
    };
    for (int p = 0; p < kNumPrecisions; ++p) {
      PoolState& ps = pool_[p];
      const std::size_t nb = pools_.count[p];
      const std::size_t ns = nb * static_cast<std::size_t>(config_.block_size);
      const std::size_t nm = nb * static_cast<std::size_t>(layout_.evict_mask_words());
      ps.thought.reserve(nb);
      ps.fill.reserve(nb);
      ps.live.reserve(nb);
      ps.owner.reserve(nb);
      ps.mask.reserve(nm);
      ps.slot_record.reserve(ns);
      ps.slot_segment.reserve(ns);
      ps.seg_lo.reserve(nb);
      ps.seg_hi.reserve(nb);
      ps.slot_position.reserve(ns);
      ps.chunk_held.reserve((nb + chunk_[p] - 1) / chunk_[p]);
      ps.changed.reserve(std::max<std::size_t>(1024, 2 * nb) + 1);  // touch() trims it at that size
      bytes += ps.free.reserve(static_cast<std::uint32_t>(nb));
      held(ps.thought, ps.fill, ps.live, ps.owner, ps.mask, ps.slot_record, ps.slot_segment, ps.seg_lo, ps.seg_hi,
           ps.slot_position, ps.chunk_held, ps.changed);
    }
    record_refs_.reserve(record_cap_);
    record_owner_.reserve(record_cap_);
    held(record_refs_, record_owner_);
    return bytes;
  }
  [[nodiscard]] bool host_metadata_reserved() const noexcept { return host_reserved_; }

  // ---- storage: what is allocated ------------------------------------------------------------

  /// Blocks of pool p that have storage (ids pools().base[p] .. + allocated_blocks(p) - 1).
  [[nodiscard]] std::uint32_t allocated_blocks(Precision p) const noexcept { return pool_[static_cast<int>(p)].grown; }
  /// Key-scale records that have storage (ids 0 .. allocated_records() - 1).
  [[nodiscard]] std::uint32_t allocated_records() const noexcept { return records_grown_; }
  /// Blocks per allocation chunk of pool p, and records per record chunk.
  [[nodiscard]] std::uint32_t chunk_blocks(Precision p) const noexcept { return chunk_[static_cast<int>(p)]; }
  [[nodiscard]] std::uint32_t chunk_records() const noexcept { return record_chunk_; }
  /// Bytes the cache allocates in all for its current storage, by the formats of CacheLayout:
  /// allocated pages and their block metadata, allocated key-scale records, every stream's
  /// staging buffer and header. The CPU backend's allocator sees exactly the page, record-scale,
  /// staging and second-level-scale part of it (tests check this).
  [[nodiscard]] std::int64_t allocated_bytes() const noexcept {
    std::int64_t n = std::int64_t{config_.num_streams} * layout_.stream_fixed_bytes();
    for (Precision p : kAllPrecisions) n += std::int64_t{allocated_blocks(p)} * layout_.block_bytes(p);
    return n + std::int64_t{records_grown_} * layout_.record_bytes();
  }
  /// Bytes allocating `claims` (fresh blocks and records beyond those free now, as plans with
  /// PlanClaims count them) would add to allocated_bytes(): whole chunks.
  [[nodiscard]] std::int64_t growth_bytes(const PlanClaims& claims) const noexcept {
    std::int64_t n = 0;
    for (Precision p : kAllPrecisions) {
      const int i = static_cast<int>(p);
      n += std::int64_t{grown_for_blocks(p, claims.blocks[i]) - pool_[i].grown} * layout_.block_bytes(p);
    }
    return n + std::int64_t{grown_for_records(claims.records) - records_grown_} * layout_.record_bytes();
  }
  /// Checks that `claims` (fresh blocks per pool and records, e.g. a batch's plans) fit together
  /// with `reserved` (what other open tokens reserved): each pool's range, the record range, and
  /// memory_limit_bytes. `who` starts the message ("append layer 3", ...); kPoolExhausted names
  /// what ran out and by how much.
  [[nodiscard]] Status check_claims(const PlanClaims& claims, const PlanClaims& reserved,
                                    const std::string& who) const {
    const PlanClaims total = claims + reserved;
    for (Precision p : kAllPrecisions) {
      const int i = static_cast<int>(p);
      if (total.blocks[i] > free_blocks(p)) {
        const std::size_t left = free_blocks(p) > reserved.blocks[i] ? free_blocks(p) - reserved.blocks[i] : 0;
        return {StatusCode::kPoolExhausted,
                who + ": the " + std::string(to_string(p)) + " pool has " + std::to_string(left) +
                    " free blocks after other open tokens' reservations (" + std::to_string(free_blocks(p)) +
                    " free of " + std::to_string(pools_.count[i]) + ", " + std::to_string(reserved.blocks[i]) +
                    " reserved); the commits need " + std::to_string(claims.blocks[i]) +
                    "; raise pool_blocks, lower the token budget, or end other sequences"};
      }
    }
    if (total.records > free_records()) {
      const std::size_t left = free_records() > reserved.records ? free_records() - reserved.records : 0;
      return {StatusCode::kPoolExhausted,
              who + ": the key-scale record pool has " + std::to_string(left) +
                  " free records after other open tokens' reservations (" + std::to_string(free_records()) +
                  " free of " + std::to_string(record_capacity()) + "); the commits need " +
                  std::to_string(claims.records) + "; raise record_capacity or set it to 0 (worst case)"};
    }
    return check_limit(total, who);
  }

  // ---- per-stream queries ------------------------------------------------------------------

  [[nodiscard]] Status check_stream(int stream) const {
    if (stream < 0 || stream >= config_.num_streams) {
      return {StatusCode::kOutOfRange, "stream " + std::to_string(stream) + " is out of range; allowed: 0.." +
                                           std::to_string(config_.num_streams - 1)};
    }
    return Status::ok();
  }
  /// Blocks of a stream in allocation order (its block-table row).
  [[nodiscard]] std::span<const std::uint32_t> blocks(int stream) const {
    return streams_[static_cast<std::size_t>(stream)].blocks;
  }
  /// Staging sets: the streams s with the same s / stage_set_streams() share one staging record
  /// (CacheConfig::stage_set_streams): every token is pushed once for all of them, and each of
  /// them commits the group when it is full. 1 (the default): every stream its own.
  [[nodiscard]] int stage_set_streams() const noexcept { return config_.stage_set_streams; }
  [[nodiscard]] int stage_set(int stream) const noexcept { return stream / config_.stage_set_streams; }
  /// Tokens held in staging (not yet quantized): the tokens of the set's current group, or 0
  /// once this stream has committed a full group. In a set of several streams, between the push
  /// of a group's last token and a stream's commit, that stream reads group_size.
  [[nodiscard]] int staged_count(int stream) const {
    const StageSet& t = set_of(stream);
    return t.staged == config_.group_size && stream_(stream).committed == t.epoch ? 0 : t.staged;
  }
  /// Thought type of the staged group (meaningful while staged_count() > 0).
  [[nodiscard]] ThoughtType staged_thought(int stream) const { return set_of(stream).thought; }
  [[nodiscard]] std::uint32_t staged_segment(int stream, int row) const {
    return set_of(stream).segment[static_cast<std::size_t>(row)];
  }
  [[nodiscard]] std::int32_t staged_position(int stream, int row) const {
    return set_of(stream).position[static_cast<std::size_t>(row)];
  }
  /// The longest block list any stream of the stream's staging set has held since the set was
  /// last reset (an upper bound on each one's list now: a planning hint for attention launches).
  [[nodiscard]] std::uint32_t set_max_blocks(int stream) const { return set_of(stream).max_blocks; }
  /// Position the next appended token of the stream gets (tokens appended so far).
  [[nodiscard]] std::int32_t next_position(int stream) const { return set_of(stream).next_position; }
  /// Live (non-evicted) tokens in pages, excluding staging.
  [[nodiscard]] std::int64_t live_slots(int stream) const { return stream_(stream).live; }
  /// Evicted slots still held in the stream's blocks (holes awaiting reuse).
  [[nodiscard]] std::int64_t hole_slots(int stream) const { return stream_(stream).holes; }
  /// Key-scale records owned by the stream.
  [[nodiscard]] std::int64_t records_held(int stream) const { return stream_(stream).records; }

  // ---- per-block / per-slot queries ----------------------------------------------------------
  // A block without storage (past its pool's allocated chunks) reads as a free, empty block.

  [[nodiscard]] ThoughtType block_thought(std::uint32_t b) const {
    const Loc l = loc(b);
    return l.ok ? l.pool->thought[l.local] : ThoughtType::kReasoning;
  }
  [[nodiscard]] Precision block_precision(std::uint32_t b) const { return pools_.precision_of(b); }
  [[nodiscard]] int block_fill(std::uint32_t b) const {
    const Loc l = loc(b);
    return l.ok ? l.pool->fill[l.local] : 0;
  }
  [[nodiscard]] int block_live(std::uint32_t b) const {
    const Loc l = loc(b);
    return l.ok ? l.pool->live[l.local] : 0;
  }
  [[nodiscard]] std::int32_t block_owner(std::uint32_t b) const {
    const Loc l = loc(b);
    return l.ok ? l.pool->owner[l.local] : kNoStream;
  }
  /// True when the slot exists (block id within the pools, slot index within the block).
  [[nodiscard]] bool contains(SlotRef s) const noexcept {
    return s.block < pools_.total && s.slot < static_cast<std::uint32_t>(config_.block_size);
  }
  /// Evicted and not reused yet (false for a slot that does not exist).
  [[nodiscard]] bool is_evicted(SlotRef s) const {
    if (!contains(s)) return false;
    const Loc l = loc(s.block);
    if (!l.ok) return false;
    const std::uint64_t w = l.pool->mask[mask_index(l, s.slot)];
    return (w >> (s.slot % 64)) & 1u;
  }
  /// Written and not evicted (false for a slot that does not exist).
  [[nodiscard]] bool is_live(SlotRef s) const {
    return contains(s) && static_cast<int>(s.slot) < block_fill(s.block) && !is_evicted(s);
  }
  [[nodiscard]] std::uint32_t slot_record(SlotRef s) const {
    const Loc l = loc(s.block);
    return l.ok ? l.pool->slot_record[slot_index(l, s.slot)] : kNoRecord;
  }
  [[nodiscard]] std::uint32_t slot_segment(SlotRef s) const {
    const Loc l = loc(s.block);
    return l.ok ? l.pool->slot_segment[slot_index(l, s.slot)] : 0;
  }
  [[nodiscard]] std::int32_t slot_position(SlotRef s) const {
    const Loc l = loc(s.block);
    return l.ok ? l.pool->slot_position[slot_index(l, s.slot)] : -1;
  }
  // ---- what storage sees (storage_view.hpp) ----------------------------------------------

  /// The token in a live slot: its block's owner and its key-scale record.
  [[nodiscard]] TokenRef token_ref(SlotRef s) const { return {s, block_owner(s.block), slot_record(s)}; }
  /// Pool p's block metadata for the pages with storage (spans valid until the next change).
  [[nodiscard]] PoolView pool_view(Precision p) const noexcept {
    const PoolState& ps = pool_[static_cast<int>(p)];
    return {pools_.base[static_cast<int>(p)],
            ps.grown,
            ps.fill,
            ps.mask,
            ps.slot_record,
            ps.owner,
            ps.revision,
            ps.log_first,
            ps.changed,
            ps.slot_segment};
  }
  /// A stream's block list, staged count and live slots.
  [[nodiscard]] StreamView stream_view(int stream) const {
    const StreamState& s = stream_(stream);
    return {stream, s.blocks, staged_count(stream), s.live, s.list_version};
  }
  /// An attention's view of the streams `streams` (each one's StreamView into `out`, reused).
  [[nodiscard]] AttendView attend_view(std::span<const std::int32_t> streams, std::vector<StreamView>& out) const {
    out.clear();
    for (std::int32_t s : streams) out.push_back(stream_view(s));
    AttendView v;
    v.block_size = config_.block_size;
    v.evict_mask_words = layout_.evict_mask_words();
    for (Precision p : kAllPrecisions) v.pools[static_cast<int>(p)] = pool_view(p);
    v.streams = out;
    return v;
  }

  /// Plain read access to the table's current streams and pools, and the block-list change log
  /// (storage_view.hpp's TableView), for a backend that reads any stream or mirrors the lists.
  [[nodiscard]] TableView table_view() const noexcept {
    TableView v;
    v.ctx = this;
    v.stream_fn = [](const void* t, int s) { return static_cast<const BlockTable*>(t)->stream_view(s); };
    v.pool_fn = [](const void* t, int p) {
      return static_cast<const BlockTable*>(t)->pool_view(static_cast<Precision>(p));
    };
    v.num_streams = config_.num_streams;
    v.block_size = config_.block_size;
    v.evict_mask_words = layout_.evict_mask_words();
    v.list_revision = list_clock_;
    v.list_log_first = list_log_first_;
    v.list_changed = list_log_;
    return v;
  }

  [[nodiscard]] int record_refs(std::uint32_t r) const { return r < records_grown_ ? record_refs_[r] : 0; }
  [[nodiscard]] std::int32_t record_owner(std::uint32_t r) const {
    return r < records_grown_ ? record_owner_[r] : kNoStream;
  }
  /// Raw eviction-mask words of a block (bit i of word i/64 = slot i evicted).
  [[nodiscard]] std::span<const std::uint64_t> evict_mask(std::uint32_t b) const {
    const auto words = static_cast<std::size_t>(layout_.evict_mask_words());
    const Loc l = loc(b);
    if (!l.ok) return {kZeroMask, words};
    return {l.pool->mask.data() + static_cast<std::size_t>(l.local) * words, words};
  }
  /// The thought segments a block's live slots belong to: per segment its id, its start index in
  /// the block (the lowest live slot naming it) and its segment mask (bit i = live slot i belongs
  /// to it), in order of start index. Derived from the per-slot segment ids: with in-place reuse
  /// a block holds tokens of several segments in any slot order (docs/design.md, "Block table").
  struct BlockSegment {
    std::uint32_t segment = 0;
    int start = 0;                    ///< first live slot of the segment in this block
    std::vector<std::uint64_t> mask;  ///< evict_mask layout: bit i of word i/64 = slot i
    friend bool operator==(const BlockSegment&, const BlockSegment&) = default;
  };
  [[nodiscard]] std::vector<BlockSegment> block_segments(std::uint32_t b) const {
    std::vector<BlockSegment> out;
    for (int i = 0; i < block_fill(b); ++i) {
      const SlotRef r{b, static_cast<std::uint32_t>(i)};
      if (is_evicted(r)) continue;
      const std::uint32_t id = slot_segment(r);
      auto it = std::find_if(out.begin(), out.end(), [&](const BlockSegment& x) { return x.segment == id; });
      if (it == out.end()) {
        out.push_back({id, i, std::vector<std::uint64_t>(static_cast<std::size_t>(layout_.evict_mask_words()), 0)});
        it = out.end() - 1;
      }
      it->mask[static_cast<std::size_t>(i / 64)] |= std::uint64_t{1} << (i % 64);
    }
    return out;
  }
  /// Blocks pool p can still supply (its range minus the held ones), allocated or not.
  [[nodiscard]] std::size_t free_blocks(Precision p) const {
    const int i = static_cast<int>(p);
    return pool_[i].free.size() + (pools_.count[i] - pool_[i].grown);
  }
  /// Records the record pool can still supply, allocated or not.
  [[nodiscard]] std::size_t free_records() const { return free_records_.size() + (record_cap_ - records_grown_); }

  /// Live slots of a stream in attention order (block list order, then slot order).
  /// The live slots of a stream that hold tokens of thought segment `segment`, in
  /// live_slot_list's order, into `out` (cleared). Visits only the blocks whose range of segment
  /// ids written so far holds `segment` (a block's tokens come from its first segment and from the
  /// later segments that reused its holes), not every live slot.
  void live_segment_slots(int stream, std::uint32_t segment, std::vector<SlotRef>& out) const {
    out.clear();
    const StreamState& s = stream_(stream);
    const int words = layout_.evict_mask_words();
    for (std::size_t k = 0; k < s.blocks.size(); ++k) {
      const std::uint32_t b = s.blocks[k];
      const int p = static_cast<int>(config_.precision.precision_of(s.thoughts[k]));
      const PoolState& ps = pool_[p];
      const std::uint32_t local = b - pools_.base[p];
      if (segment < ps.seg_lo[local] || segment > ps.seg_hi[local]) continue;
      const int n = ps.fill[local];
      const std::uint32_t* seg = ps.slot_segment.data() + slot_index(local, 0);
      const std::uint64_t* mask = ps.mask.data() + static_cast<std::size_t>(local) * words;
      for (int i = 0; i < n; ++i) {
        if (seg[i] == segment && ((mask[i / 64] >> (i % 64)) & 1u) == 0)
          out.push_back({b, static_cast<std::uint32_t>(i)});
      }
    }
  }

  [[nodiscard]] std::vector<SlotRef> live_slot_list(int stream) const {
    std::vector<SlotRef> out;
    out.reserve(static_cast<std::size_t>(stream_(stream).live));
    for (std::uint32_t b : blocks(stream)) {
      for (int i = 0; i < block_fill(b); ++i) {
        SlotRef s{b, static_cast<std::uint32_t>(i)};
        if (!is_evicted(s)) out.push_back(s);
      }
    }
    return out;
  }

  // ---- staging -----------------------------------------------------------------------------

  /// Checks that a token of type `t` may join the stream's staging group. A quantization group
  /// never mixes thought types: the thought classifier refreshes on group boundaries.
  [[nodiscard]] Status check_stage(int stream, ThoughtType t) const {
    THINKV_RETURN_IF_ERROR(check_stream(stream));
    if (static_cast<int>(t) >= kNumThoughtTypes) {
      return {StatusCode::kInvalidArgument,
              "thought type " + std::to_string(static_cast<int>(t)) + " is not one of R (0), E (1), T (2)"};
    }
    const StageSet& s = set_of(stream);
    if (s.staged > 0 && s.staged < config_.group_size && s.thought != t) {
      return {StatusCode::kInvalidArgument,
              "thought type " + std::string(to_string(t)) + " appended to stream " + std::to_string(stream) +
                  " while its staging group holds " + std::to_string(s.staged) + " token(s) of type " +
                  std::string(to_string(s.thought)) +
                  ": a quantization group never mixes thought types; change the type only when "
                  "the position is a multiple of group_size (" +
                  std::to_string(config_.group_size) + ")"};
    }
    return Status::ok();
  }
  /// Records a staged token's metadata for the stream's staging set (the backend holds its data):
  /// the set's next position, thought `t`, segment `segment`. Call after check_stage and, if this
  /// token fills the group, after a successful plan_commit. A full group (every stream of the set
  /// committed it) is left for a new one. Returns the staging row.
  int push_staged(int stream, ThoughtType t, std::uint32_t segment) {
    StageSet& s = set_of(stream);
    if (s.staged == config_.group_size) {
      s.staged = 0;
      ++s.epoch;
    }
    const int row = s.staged;
    s.thought = t;
    s.segment[static_cast<std::size_t>(row)] = segment;
    s.position[static_cast<std::size_t>(row)] = s.next_position++;
    ++s.staged;
    return row;
  }
  /// Undoes the last push_staged (used when a backend fails after the table was updated).
  void pop_staged(int stream) {
    StageSet& s = set_of(stream);
    --s.staged;
    --s.next_position;
  }
  /// Sets a staging set's group directly: `count` tokens (0 .. group_size - 1) of thought `t`
  /// with these segments, at positions next - count .. next - 1, the set's next position being
  /// `next`. A prompt uses it for the tokens past its last full group (the full groups are
  /// committed with apply_commit's explicit metadata). Nothing else changes.
  void set_staged(int stream, ThoughtType t, std::span<const std::uint32_t> segments, std::int32_t next) {
    StageSet& s = set_of(stream);
    s.staged = static_cast<int>(segments.size());
    ++s.epoch;
    s.thought = t;
    for (std::size_t i = 0; i < segments.size(); ++i) {
      s.segment[i] = segments[i];
      s.position[i] = next - static_cast<std::int32_t>(segments.size() - i);
    }
    s.next_position = next;
  }

  /// Moves the positions of the stream's written slots (live or evicted) in [lo, hi) by `delta`
  /// (a position shift: llama.cpp's seq_add). Only the metadata changes; the caller keeps the
  /// positions in order and the staging set's rows (set_staged). No data moves.
  void shift_positions(int stream, std::int32_t lo, std::int32_t hi, std::int32_t delta) {
    for (const std::uint32_t b : stream_(stream).blocks) {
      std::uint32_t local = 0;
      PoolState& ps = pool_of(b, local);
      std::int32_t* pos = ps.slot_position.data() + slot_index(local, 0);
      for (int i = 0; i < ps.fill[local]; ++i) {
        if (pos[i] >= lo && pos[i] < hi) pos[i] += delta;
      }
    }
  }

  /// Gives the stream's whole staging group a new thought type (nothing is committed yet, so no
  /// data moves). Thought refreshes use it: see ThoughtTracker. No-op when no group is open.
  void relabel_staged(int stream, ThoughtType t) {
    StageSet& s = set_of(stream);
    if (s.staged > 0 && s.staged < config_.group_size) s.thought = t;
  }

  // ---- commit: plan (pure), then apply -----------------------------------------------------

  /// Slots the stream's commits of `thought` fill before plan_commit takes a fresh block: the
  /// holes of that thought type and the unwritten slots of the type's newest block (its first
  /// two cases). A run of n groups then takes ceil(max(0, n * group_size - this) / block_size)
  /// fresh blocks.
  [[nodiscard]] std::int64_t slots_before_fresh_block(int stream, ThoughtType thought) const {
    const StreamState& s = stream_(stream);
    std::int64_t n = s.holes_by_thought[static_cast<int>(thought)];
    const int pi = static_cast<int>(config_.precision.precision_of(thought));
    if (const std::size_t k = newest_block_of(s, thought); k != kNoIndex) {
      n += config_.block_size - pool_[pi].fill[s.blocks[k] - pools_.base[pi]];
    }
    return n;
  }

  /// Plans where a full staging group of `thought` goes: evicted slots of the stream's blocks of
  /// the same thought type first (oldest block first, lowest slot first), then unwritten slots of
  /// those blocks, then fresh blocks from the precision's pool (lowest free id first, past the
  /// allocated chunks when none of them is free). Fails with kPoolExhausted (and changes nothing)
  /// when the pool's range, the record range or memory_limit_bytes cannot supply enough. With
  /// `claims`, the fresh blocks and records earlier plans of the batch claimed are skipped (and
  /// their growth counted against the limit), and on success this plan's are added to them.
  [[nodiscard]] Status plan_commit(int stream, ThoughtType thought, CommitPlan& plan,
                                   PlanClaims* claims = nullptr) const {
    THINKV_RETURN_IF_ERROR(check_stream(stream));
    const int g = config_.group_size;
    const int bs = config_.block_size;
    const Precision p = config_.precision.precision_of(thought);
    const int pi = static_cast<int>(p);
    plan.slots.clear();  // kept allocated: a batch's plans reuse their vectors
    plan.new_blocks.clear();
    plan.stream = stream;
    plan.thought = thought;
    plan.precision = p;
    plan.record = kNoRecord;
    plan.reused_slots = 0;
    plan.hole_search_from = 0;
    plan.slots.reserve(static_cast<std::size_t>(g));
    const StreamState& s = stream_(stream);
    const int words = layout_.evict_mask_words();
    // Every block of `thought` lies in pool p (the map sends a thought type to one precision).
    const PoolState& ps = pool_[pi];
    const std::uint32_t base = pools_.base[pi];
    // 1. holes of the same thought type (in place reuse), oldest block first; the blocks below
    //    the stream's hole_free_below of the type hold none (its invariant), so the search
    //    starts there instead of reading every older block's mask
    const int ti = static_cast<int>(thought);
    if (s.holes_by_thought[ti] > 0) {
      for (std::size_t k = s.hole_free_below[ti]; k < s.blocks.size() && !plan_full(plan, g); ++k) {
        if (s.thoughts[k] != thought) continue;
        const std::uint32_t b = s.blocks[k];
        const std::uint64_t* mask = ps.mask.data() + static_cast<std::size_t>(b - base) * words;
        for (int w = 0; w < words && !plan_full(plan, g); ++w) {
          std::uint64_t bits = mask[w];
          if (bits != 0) plan.hole_search_from = static_cast<std::uint32_t>(k);
          while (bits != 0 && !plan_full(plan, g)) {
            const int i = __builtin_ctzll(bits);
            bits &= bits - 1;
            plan.slots.push_back({b, static_cast<std::uint32_t>(w * 64 + i)});
            ++plan.reused_slots;
          }
        }
      }
    }
    // 2. unwritten slots of the type's blocks: only its newest block can have any (a fresh block
    //    is taken only when every slot of the type's blocks is written and live)
    if (const std::size_t k = newest_block_of(s, thought); k != kNoIndex && !plan_full(plan, g)) {
      const std::uint32_t b = s.blocks[k];
      for (int i = ps.fill[b - base]; i < bs && !plan_full(plan, g); ++i) {
        plan.slots.push_back({b, static_cast<std::uint32_t>(i)});
      }
    }
    // 3. fresh blocks
    std::size_t next = claims != nullptr ? claims->blocks[pi] : 0;
    const std::size_t first_fresh = next;
    while (!plan_full(plan, g)) {
      const std::uint32_t b = nth_free_block(p, next++);
      if (b == kNoBlock) {
        return {StatusCode::kPoolExhausted, "the " + std::string(to_string(p)) + " pool has no free block for stream " +
                                                std::to_string(stream) + " (" + std::to_string(pools_.count[pi]) +
                                                " blocks, all held); raise pool_blocks[" + std::string(to_string(p)) +
                                                "], lower the token budget, or evict"};
      }
      plan.new_blocks.push_back(b);
      for (int i = 0; i < bs && !plan_full(plan, g); ++i) { plan.slots.push_back({b, static_cast<std::uint32_t>(i)}); }
    }
    const std::size_t taken = claims != nullptr ? claims->records : 0;
    if (has_group_scale(p)) {
      plan.record = nth_free_record(taken);
      if (plan.record == kNoRecord) {
        return {StatusCode::kPoolExhausted,
                "the key-scale record pool is exhausted (" + std::to_string(record_capacity()) +
                    " records, all held); raise record_capacity or set it to 0 (worst case)"};
      }
    }
    PlanClaims after = claims != nullptr ? *claims : PlanClaims{};
    after.blocks[pi] = first_fresh + plan.new_blocks.size();
    after.records = taken + (plan.record != kNoRecord ? 1 : 0);
    THINKV_RETURN_IF_ERROR(check_limit(after, "stream " + std::to_string(stream)));
    if (claims != nullptr) *claims = after;
    return Status::ok();
  }

  /// Blocks pool `plan.precision` must have storage for before the plan's data is written (the
  /// current allocation when it already covers the plan's fresh blocks), in whole chunks.
  [[nodiscard]] std::uint32_t blocks_needed(const CommitPlan& plan) const noexcept {
    const int pi = static_cast<int>(plan.precision);
    std::uint32_t need = pool_[pi].grown;
    for (std::uint32_t b : plan.new_blocks) {
      const std::uint32_t local = b - pools_.base[pi];
      if (local >= need) need = round_blocks(plan.precision, local + 1);
    }
    return need;
  }
  /// Records that must have storage before the plan's key scales are written.
  [[nodiscard]] std::uint32_t records_needed(const CommitPlan& plan) const noexcept {
    if (plan.record == kNoRecord || plan.record < records_grown_) return records_grown_;
    return round_records(plan.record + 1);
  }

  /// Records a planned commit: gives storage to the planned blocks and record when they have
  /// none yet (blocks_needed, records_needed), takes them, fills the slots, clears the reused
  /// slots' eviction bits and the staging group. The plan must come from plan_commit on the
  /// current state (no other mutation in between), or from a batch planned with PlanClaims and
  /// applied in order.
  void apply_commit(const CommitPlan& plan) {
    const StageSet& t = set_of(plan.stream);
    apply_commit(plan, t.segment, t.position);
    stream_(plan.stream).committed = t.epoch;  // this stream is done with the set's group
  }
  /// apply_commit with the group's token metadata given (segments[i] and positions[i] of the
  /// token going to plan.slots[i]) instead of the staging set's: a prompt's full groups (the
  /// staging set's own group is not committed by it).
  void apply_commit(const CommitPlan& plan, std::span<const std::uint32_t> segments,
                    std::span<const std::int32_t> positions) {
    ++op_;
    StreamState& s = stream_(plan.stream);
    const int p = static_cast<int>(plan.precision);
    // The plan took every hole of its type's blocks before this index (plan_commit's search).
    std::uint32_t& from = s.hole_free_below[static_cast<int>(plan.thought)];
    from = std::max(from, plan.hole_search_from);
    grow_pool(plan.precision, blocks_needed(plan));
    grow_records(records_needed(plan));
    PoolState& ps = pool_[p];
    for (std::uint32_t b : plan.new_blocks) {
      const std::uint32_t local = b - pools_.base[p];
      take_block(ps, p, local, plan.stream);
      ps.thought[local] = plan.thought;
      ps.fill[local] = 0;
      ps.live[local] = 0;
      ps.seg_lo[local] = 0xFFFFFFFFu;
      ps.seg_hi[local] = 0;
      touch(ps, local);
      s.blocks.push_back(b);
      s.thoughts.push_back(plan.thought);
    }
    if (!plan.new_blocks.empty()) {
      s.list_version = list_changed(plan.stream);
      StageSet& t = set_of(plan.stream);
      t.max_blocks = std::max(t.max_blocks, static_cast<std::uint32_t>(s.blocks.size()));
    }
    if (plan.record != kNoRecord) {
      if (free_records_.back() == plan.record) {
        free_records_.pop_back();
      } else {  // a batch's plans applied out of order
        free_records_.erase(std::find(free_records_.begin(), free_records_.end(), plan.record));
      }
      record_refs_[plan.record] = static_cast<int>(plan.slots.size());
      record_owner_[plan.record] = plan.stream;
      ++s.records;
      ++stats_.records_allocated;
    }
    // Every slot of the plan lies in pool p (its thought's precision).
    PoolState& q = ps;
    const std::uint32_t base = pools_.base[p];
    std::uint32_t logged = kNoBlock;  // the page touch() logged last (a plan's slots run by block)
    for (std::size_t i = 0; i < plan.slots.size(); ++i) {
      const SlotRef r = plan.slots[i];
      const std::uint32_t local = r.block - base;
      if (local != logged) {
        touch(q, local);
        logged = local;
      }
      const std::size_t si = slot_index(local, r.slot);
      std::uint64_t& word = q.mask[mask_index(local, r.slot)];
      const std::uint64_t bit = std::uint64_t{1} << (r.slot % 64);
      if ((word & bit) != 0) {  // a hole reused
        word &= ~bit;
        --s.holes;
        --s.holes_by_thought[static_cast<int>(plan.thought)];
      } else {
        q.fill[local] = static_cast<std::uint16_t>(std::max<int>(q.fill[local], static_cast<int>(r.slot) + 1));
      }
      q.slot_record[si] = plan.record;
      q.slot_segment[si] = segments[i];
      q.seg_lo[local] = std::min(q.seg_lo[local], segments[i]);
      q.seg_hi[local] = std::max(q.seg_hi[local], segments[i]);
      q.slot_position[si] = positions[i];
      ++q.live[local];
      ++s.live;
    }
    stats_.slots_written += static_cast<std::int64_t>(plan.slots.size());
    stats_.slots_reused += plan.reused_slots;
    ++stats_.commits;
  }

  // ---- eviction ----------------------------------------------------------------------------

  /// Marks live slots of a stream evicted. Moves no data. Releases key-scale records whose last
  /// live slot went, returns blocks with no live slot to their pool, and releases the storage of
  /// chunks at the top of a pool left with no held block. All-or-nothing: a slot that is not a
  /// live slot of this stream, or a duplicate, fails the call with nothing changed.
  [[nodiscard]] Status evict(int stream, std::span<const SlotRef> slots) {
    THINKV_RETURN_IF_ERROR(check_stream(stream));
    for (const SlotRef r : slots) {
      if (!contains(r)) {
        return {StatusCode::kOutOfRange,
                "slot {block " + std::to_string(r.block) + ", slot " + std::to_string(r.slot) + "} does not exist"};
      }
      if (is_shared(r.block)) {
        return {StatusCode::kInvalidArgument, "slot {block " + std::to_string(r.block) + ", slot " +
                                                  std::to_string(r.slot) +
                                                  "} lies in a block several streams share: copy it first "
                                                  "(plan_unshare / apply_unshare)"};
      }
      const Loc l = loc(r.block);
      const bool live = l.ok && l.pool->owner[l.local] == stream && static_cast<int>(r.slot) < l.pool->fill[l.local] &&
                        ((l.pool->mask[mask_index(l, r.slot)] >> (r.slot % 64)) & 1u) == 0;
      if (!live) {
        return {StatusCode::kInvalidArgument, "slot {block " + std::to_string(r.block) + ", slot " +
                                                  std::to_string(r.slot) + "} is not a live slot of stream " +
                                                  std::to_string(stream)};
      }
    }
    // Duplicates: sorted, a slot listed twice is adjacent (the runs of one block serve below).
    sorted_.assign(slots.begin(), slots.end());
    std::sort(sorted_.begin(), sorted_.end());
    if (const auto it = std::adjacent_find(sorted_.begin(), sorted_.end()); it != sorted_.end()) {
      return {StatusCode::kInvalidArgument,
              "slot {block " + std::to_string(it->block) + ", slot " + std::to_string(it->slot) + "} is listed twice"};
    }
    ++op_;
    StreamState& s = stream_(stream);
    emptied_.clear();
    holed_.clear();
    for (std::size_t i = 0; i < sorted_.size();) {
      // One block's victims at a time: its mask words, live count and change log once.
      const std::uint32_t b = sorted_[i].block;
      holed_.push_back(b);  // ascending: sorted_ is
      std::uint32_t local = 0;
      PoolState& q = pool_of(b, local);
      const int t = static_cast<int>(q.thought[local]);
      int n = 0;
      for (; i < sorted_.size() && sorted_[i].block == b; ++i, ++n) {
        const std::uint32_t slot = sorted_[i].slot;
        q.mask[mask_index(local, slot)] |= std::uint64_t{1} << (slot % 64);
        const std::uint32_t rec = q.slot_record[slot_index(local, slot)];
        if (rec != kNoRecord && --record_refs_[rec] == 0) {
          record_owner_[rec] = kNoStream;
          free_records_.push_back(rec);
          --s.records;
          ++stats_.records_freed;
        }
      }
      touch(q, local);
      q.live[local] = static_cast<std::uint16_t>(q.live[local] - n);
      s.live -= n;
      s.holes += n;
      s.holes_by_thought[t] += n;
      stats_.slots_evicted += n;
      if (q.live[local] == 0) emptied_.push_back(b);
    }
    // plan_commit's search for holes must reach the blocks that got some: each type's
    // hole_free_below drops to the first of them (only the indices below it need a look).
    std::uint32_t below = 0;
    for (const std::uint32_t v : s.hole_free_below) below = std::max(below, v);
    below = std::min(below, static_cast<std::uint32_t>(s.blocks.size()));
    for (std::uint32_t k = 0; k < below; ++k) {
      std::uint32_t& from = s.hole_free_below[static_cast<int>(s.thoughts[k])];
      if (k < from && std::binary_search(holed_.begin(), holed_.end(), s.blocks[k])) from = k;
    }
    // Return blocks with no live slot to their pools (their holes go with them): those this call
    // emptied (ascending), found in the stream's list without reading every block's live count.
    std::size_t released = 0;
    for (std::size_t k = 0; released < emptied_.size() && k < s.blocks.size();) {
      const std::uint32_t b = s.blocks[k];
      if (std::binary_search(emptied_.begin(), emptied_.end(), b)) {
        ++released;
        const int holes = count_holes(b);
        s.holes -= holes;
        s.holes_by_thought[static_cast<int>(block_thought(b))] -= holes;
        release_block(b);
        s.blocks.erase(s.blocks.begin() + static_cast<std::ptrdiff_t>(k));
        s.thoughts.erase(s.thoughts.begin() + static_cast<std::ptrdiff_t>(k));
        // The blocks after it move down one index.
        for (std::uint32_t& from : s.hole_free_below) from -= from > k ? 1 : 0;
        s.list_version = list_changed(stream);
      } else {
        ++k;
      }
    }
    if (!emptied_.empty()) release_empty_chunks();
    return Status::ok();
  }

  /// Releases everything a stream holds (end of sequence): blocks, records, staging, and the
  /// storage of chunks left with no held block at the top of their pool.
  void reset_stream(int stream) {
    ++op_;
    StreamState& s = stream_(stream);
    for (std::uint32_t b : s.blocks) {
      if (is_shared(b)) {  // the block stays with its other holders
        drop_holder(b, stream);
        continue;
      }
      for (int i = 0; i < block_fill(b); ++i) {
        const SlotRef r{b, static_cast<std::uint32_t>(i)};
        if (is_evicted(r)) continue;
        const std::uint32_t rec = slot_record(r);
        if (rec != kNoRecord && --record_refs_[rec] == 0) {
          record_owner_[rec] = kNoStream;
          free_records_.push_back(rec);
          ++stats_.records_freed;
        }
      }
      release_block(b);
    }
    StreamState fresh;
    fresh.list_version = s.blocks.empty() ? s.list_version : list_changed(stream);
    s = std::move(fresh);
    // The stream's staging set starts over (in a set of several streams the sequence is reset
    // stream by stream: idempotent).
    StageSet& t = set_of(stream);
    t.staged = 0;
    ++t.epoch;
    t.next_position = 0;
    t.max_blocks = 0;
    release_empty_chunks();
  }

  // ---- saving and restoring a stream (sequence state) -----------------------------------------

  /// A stream's blocks as an image, and the ids they have here: `block_ids[i]` is the block of
  /// image.blocks[i], `record_ids[j]` the record the image numbers j.
  /// With `first_block`, the stream's blocks from that index on (copy_sequence shares the ones
  /// before it): the records are those of the exported blocks only.
  void export_stream(int stream, StreamImage& image, std::vector<std::uint32_t>& block_ids,
                     std::vector<std::uint32_t>& record_ids, std::size_t first_block = 0) const {
    const StreamState& s = stream_(stream);
    const int bs = config_.block_size;
    first_block = std::min(first_block, s.blocks.size());
    image.blocks.assign(s.blocks.size() - first_block, BlockImage{});
    block_ids.assign(s.blocks.begin() + static_cast<std::ptrdiff_t>(first_block), s.blocks.end());
    record_ids.clear();
    std::vector<std::pair<std::uint32_t, std::uint32_t>> seen;  // (record, index), sorted
    for (std::size_t k = 0; k < block_ids.size(); ++k) {
      const std::uint32_t b = block_ids[k];
      const Loc l = loc(b);
      BlockImage& bi = image.blocks[k];
      bi.thought = l.pool->thought[l.local];
      bi.fill = l.pool->fill[l.local];
      bi.seg_lo = l.pool->seg_lo[l.local];
      bi.seg_hi = l.pool->seg_hi[l.local];
      const auto words = evict_mask(b);
      bi.mask.assign(words.begin(), words.end());
      const std::size_t first = slot_index(l, 0);
      bi.slot_segment.assign(l.pool->slot_segment.begin() + static_cast<std::ptrdiff_t>(first),
                             l.pool->slot_segment.begin() + static_cast<std::ptrdiff_t>(first + bs));
      bi.slot_position.assign(l.pool->slot_position.begin() + static_cast<std::ptrdiff_t>(first),
                              l.pool->slot_position.begin() + static_cast<std::ptrdiff_t>(first + bs));
      // Unwritten slots say nothing (their metadata may be a previous owner's): segment 0, position -1.
      std::fill(bi.slot_segment.begin() + bi.fill, bi.slot_segment.end(), 0u);
      std::fill(bi.slot_position.begin() + bi.fill, bi.slot_position.end(), -1);
      bi.slot_record.assign(static_cast<std::size_t>(bs), kNoRecord);
      for (int i = 0; i < bi.fill; ++i) {
        const SlotRef r{b, static_cast<std::uint32_t>(i)};
        const std::uint32_t rec = l.pool->slot_record[first + static_cast<std::size_t>(i)];
        if (rec == kNoRecord || is_evicted(r)) continue;  // a hole's record may belong to another stream now
        auto it = std::lower_bound(seen.begin(), seen.end(), std::make_pair(rec, std::uint32_t{0}));
        if (it == seen.end() || it->first != rec) {
          it = seen.insert(it, {rec, static_cast<std::uint32_t>(record_ids.size())});
          record_ids.push_back(rec);
        }
        bi.slot_record[static_cast<std::size_t>(i)] = it->second;
      }
    }
    image.records = static_cast<std::uint32_t>(record_ids.size());
  }

  /// Checks that an image (from a saved state: any bytes) describes blocks this table could hold:
  /// sizes, thought types, fills, masks (no hole past fill, a live slot in every block), records
  /// (a live quantized slot names one, each is named, a group's g slots share one at most), the
  /// fill order plan_commit relies on (only a thought type's last block is partly written), a
  /// segment range that holds every written slot's segment, and what a save writes canonically
  /// (unwritten slots at segment 0, position -1; no mask bit past block_size; records numbered in
  /// the order live slots first name them), so a state that loads saves back to the same bytes.
  /// kCorruptData names what is wrong.
  [[nodiscard]] Status check_image(const StreamImage& image) const {
    const int bs = config_.block_size;
    const auto words = static_cast<std::size_t>(layout_.evict_mask_words());
    std::vector<int> uses(image.records, 0);
    std::uint32_t next_record = 0;  // records are numbered in the order live slots first name them
    bool partial[kNumThoughtTypes] = {};
    for (std::size_t k = 0; k < image.blocks.size(); ++k) {
      const BlockImage& bi = image.blocks[k];
      auto bad = [k](const std::string& what) {
        return Status{StatusCode::kCorruptData, "block " + std::to_string(k) + " of the stream: " + what};
      };
      if (static_cast<int>(bi.thought) >= kNumThoughtTypes) return bad("thought type out of range");
      if (bi.mask.size() != words || bi.slot_record.size() != static_cast<std::size_t>(bs) ||
          bi.slot_segment.size() != static_cast<std::size_t>(bs) ||
          bi.slot_position.size() != static_cast<std::size_t>(bs)) {
        return bad("metadata sizes do not match block_size " + std::to_string(bs));
      }
      if (bi.fill == 0 || bi.fill > bs)
        return bad("fill " + std::to_string(bi.fill) + " outside 1.." + std::to_string(bs));
      const int t = static_cast<int>(bi.thought);
      if (partial[t])
        return bad("a block of type " + std::string(to_string(bi.thought)) + " follows a partly written one");
      partial[t] = bi.fill < bs;
      const Precision p = config_.precision.precision_of(bi.thought);
      int live = 0;
      if (bs % 64 != 0 && (bi.mask[words - 1] >> (bs % 64)) != 0) return bad("eviction mask bits past block_size");
      for (int i = 0; i < bs; ++i) {
        const bool hole = ((bi.mask[static_cast<std::size_t>(i / 64)] >> (i % 64)) & 1u) != 0;
        if (hole && i >= bi.fill) return bad("hole at unwritten slot " + std::to_string(i));
        if (i >= bi.fill && (bi.slot_segment[static_cast<std::size_t>(i)] != 0 ||
                             bi.slot_position[static_cast<std::size_t>(i)] != -1)) {
          // A save writes segment 0, position -1 there (export_stream): anything else would
          // load and save back other bytes.
          return bad("unwritten slot " + std::to_string(i) + " carries segment " +
                     std::to_string(bi.slot_segment[static_cast<std::size_t>(i)]) + ", position " +
                     std::to_string(bi.slot_position[static_cast<std::size_t>(i)]) + " (a save writes 0, -1)");
        }
        const bool is_live = i < bi.fill && !hole;
        live += is_live ? 1 : 0;
        const std::uint32_t rec = bi.slot_record[static_cast<std::size_t>(i)];
        if (!is_live || !has_group_scale(p)) {
          if (rec != kNoRecord) return bad("slot " + std::to_string(i) + " names a record it cannot have");
          continue;
        }
        if (rec >= image.records)
          return bad("slot " + std::to_string(i) + " names record " + std::to_string(rec) + " of " +
                     std::to_string(image.records));
        if (uses[rec] == 0) {
          // export_stream numbers records by first use: another numbering would load and save
          // back renumbered.
          if (rec != next_record) {
            return bad("slot " + std::to_string(i) + " names record " + std::to_string(rec) +
                       " first, where a save names " + std::to_string(next_record));
          }
          ++next_record;
        }
        if (++uses[rec] > config_.group_size) {
          return bad("record " + std::to_string(rec) + " serves more than group_size slots");
        }
      }
      if (live == 0) return bad("no live slot (a held block has one)");
      if (bi.seg_lo > bi.seg_hi)
        return bad("segment range " + std::to_string(bi.seg_lo) + ".." + std::to_string(bi.seg_hi));
      // The range holds every segment written into the block (live_segment_slots skips a block
      // whose range misses the segment it looks for).
      const auto written = std::span<const std::uint32_t>(bi.slot_segment).first(bi.fill);
      const auto [lo, hi] = std::minmax_element(written.begin(), written.end());
      if (*lo < bi.seg_lo || *hi > bi.seg_hi) {
        return bad("segment range " + std::to_string(bi.seg_lo) + ".." + std::to_string(bi.seg_hi) +
                   " misses the written slots' segments " + std::to_string(*lo) + ".." + std::to_string(*hi));
      }
    }
    for (std::uint32_t r = 0; r < image.records; ++r) {
      if (uses[r] == 0) return {StatusCode::kCorruptData, "record " + std::to_string(r) + " of the stream is unused"};
    }
    return Status::ok();
  }

  /// Where images of streams (checked) go: their blocks' ids, their records' ids, in stream order,
  /// taken from the free ones as commits take them. kPoolExhausted (nothing changes) when a
  /// pool's range, the record range or memory_limit_bytes cannot hold them; `claims` says what
  /// the pools give.
  [[nodiscard]] Status plan_import(std::span<const StreamImage* const> images, PlanClaims& claims,
                                   std::vector<std::vector<std::uint32_t>>& block_ids,
                                   std::vector<std::vector<std::uint32_t>>& record_ids) const {
    claims = PlanClaims{};
    block_ids.assign(images.size(), {});
    record_ids.assign(images.size(), {});
    for (std::size_t k = 0; k < images.size(); ++k) {
      for (const BlockImage& bi : images[k]->blocks) {
        const Precision p = config_.precision.precision_of(bi.thought);
        const std::uint32_t b = nth_free_block(p, claims.blocks[static_cast<int>(p)]++);
        if (b == kNoBlock) {
          return {StatusCode::kPoolExhausted, "the " + std::string(to_string(p)) + " pool has " +
                                                  std::to_string(pools_.count[static_cast<int>(p)]) +
                                                  " blocks and cannot hold the saved state's; raise pool_blocks[" +
                                                  std::string(to_string(p)) + "] or end sequences"};
        }
        block_ids[k].push_back(b);
      }
      for (std::uint32_t r = 0; r < images[k]->records; ++r) {
        const std::uint32_t id = nth_free_record(claims.records++);
        if (id == kNoRecord) {
          return {StatusCode::kPoolExhausted, "the key-scale record pool (" + std::to_string(record_capacity()) +
                                                  " records) cannot hold the saved state's; raise record_capacity"};
        }
        record_ids[k].push_back(id);
      }
    }
    return check_limit(claims, "loading a saved state");
  }
  /// Blocks pool p and records must have storage for before import_stream writes `ids`.
  [[nodiscard]] std::uint32_t blocks_needed(Precision p, std::span<const std::vector<std::uint32_t>> ids) const {
    const int pi = static_cast<int>(p);
    std::uint32_t need = pool_[pi].grown;
    for (const auto& list : ids) {
      for (std::uint32_t b : list) {
        if (pools_.precision_of(b) != p) continue;
        const std::uint32_t local = b - pools_.base[pi];
        if (local >= need) need = round_blocks(p, local + 1);
      }
    }
    return need;
  }
  [[nodiscard]] std::uint32_t records_needed(std::span<const std::vector<std::uint32_t>> ids) const {
    std::uint32_t need = records_grown_;
    for (const auto& list : ids) {
      for (std::uint32_t r : list) {
        if (r >= need) need = round_records(r + 1);
      }
    }
    return need;
  }
  /// Gives an empty stream (no block, no record) the image's blocks at `block_ids` and records
  /// at `record_ids` (plan_import's, applied in the order planned). The staging set is left as
  /// it is (set_staged restores it).
  void import_stream(int stream, const StreamImage& image, std::span<const std::uint32_t> block_ids,
                     std::span<const std::uint32_t> record_ids) {
    ++op_;
    StreamState& s = stream_(stream);
    const int bs = config_.block_size;
    const auto words = static_cast<std::size_t>(layout_.evict_mask_words());
    for (std::size_t k = 0; k < image.blocks.size(); ++k) {
      const BlockImage& bi = image.blocks[k];
      const std::uint32_t b = block_ids[k];
      const Precision p = pools_.precision_of(b);
      const int pi = static_cast<int>(p);
      grow_pool(p, round_blocks(p, b - pools_.base[pi] + 1));
      PoolState& ps = pool_[pi];
      const std::uint32_t local = b - pools_.base[pi];
      take_block(ps, pi, local, stream);
      ps.thought[local] = bi.thought;
      ps.fill[local] = bi.fill;
      ps.seg_lo[local] = bi.seg_lo;
      ps.seg_hi[local] = bi.seg_hi;
      std::copy_n(bi.mask.begin(), words, ps.mask.begin() + static_cast<std::ptrdiff_t>(local * words));
      const std::size_t first = slot_index(local, 0);
      int holes = 0;
      for (int i = 0; i < bs; ++i) {
        const std::size_t si = first + static_cast<std::size_t>(i);
        const std::uint32_t rec = bi.slot_record[static_cast<std::size_t>(i)];
        ps.slot_record[si] = rec == kNoRecord ? kNoRecord : record_ids[rec];
        ps.slot_segment[si] = bi.slot_segment[static_cast<std::size_t>(i)];
        ps.slot_position[si] = bi.slot_position[static_cast<std::size_t>(i)];
        holes += static_cast<int>((bi.mask[static_cast<std::size_t>(i / 64)] >> (i % 64)) & 1u);
      }
      ps.live[local] = static_cast<std::uint16_t>(bi.fill - holes);
      touch(ps, local);
      s.blocks.push_back(b);
      s.thoughts.push_back(bi.thought);
      s.live += bi.fill - holes;
      s.holes += holes;
      s.holes_by_thought[static_cast<int>(bi.thought)] += holes;
    }
    for (std::uint32_t r : record_ids) {
      if (r >= records_grown_) grow_records(round_records(r + 1));
    }
    if (!record_ids.empty()) {  // out of the free list in one pass (a find per record was quadratic)
      std::vector<char> taken(records_grown_, 0);
      for (std::uint32_t r : record_ids) taken[r] = 1;
      std::erase_if(free_records_, [&](std::uint32_t r) { return taken[r] != 0; });
    }
    for (std::uint32_t r : record_ids) {
      record_refs_[r] = 0;
      record_owner_[r] = stream;
      ++s.records;
      ++stats_.records_allocated;
    }
    for (std::size_t k = 0; k < image.blocks.size(); ++k) {
      for (std::uint32_t rec : image.blocks[k].slot_record) {
        if (rec != kNoRecord) ++record_refs_[record_ids[rec]];
      }
    }
    if (!image.blocks.empty()) {
      s.list_version = list_changed(stream);
      StageSet& t = set_of(stream);
      t.max_blocks = std::max(t.max_blocks, static_cast<std::uint32_t>(s.blocks.size()));
    }
  }

  // ---- shared blocks (copy_sequence's prefix sharing) ------------------------------------------
  //
  // A block may be held by several streams: copy_sequence gives the destination the source's
  // leading blocks of the pinned prompt instead of copies. Only full blocks without holes whose
  // every token is pinned are shared, so nothing writes into them: commits never reuse them (no
  // hole, no unwritten slot), TBE never evicts pinned tokens, a shift never moves them. The one
  // write left, remove() of a shared token, copies the block first (plan_unshare, apply_unshare:
  // copy on write); evict() refuses a shared block. The block keeps one owner among its holders
  // (its key-scale records' owner too, and the stream whose second-level scales its codes use:
  // every holder has the same ones, copied with the state); when the owner lets go, the next
  // holder owns it. A shared block counts once in allocated_bytes().

  /// True when more than one stream holds block b.
  [[nodiscard]] bool is_shared(std::uint32_t b) const { return !holders_.empty() && holders_.contains(b); }
  /// The streams that hold block b when it is shared (in the order they took it), else empty.
  [[nodiscard]] std::span<const std::int32_t> holders(std::uint32_t b) const {
    const auto it = holders_.find(b);
    return it == holders_.end() ? std::span<const std::int32_t>{} : std::span<const std::int32_t>(it->second);
  }
  /// Shared blocks in the table (each once).
  [[nodiscard]] std::size_t shared_blocks() const noexcept { return holders_.size(); }
  /// How many of the stream's leading blocks could be shared: full, without a hole, every slot's
  /// position below `below` (the pinned prefix's end), and no key-scale record of theirs named by
  /// a slot outside the block (a group that refilled holes of two blocks: sharing one of them
  /// would split the group's record when it is copied on write).
  [[nodiscard]] std::size_t shareable_prefix(int stream, std::int32_t below) const {
    const StreamState& s = stream_(stream);
    const int bs = config_.block_size;
    std::vector<std::pair<std::uint32_t, int>> uses;  // a block's records and their slots in it
    std::size_t n = 0;
    for (; n < s.blocks.size(); ++n) {
      const Loc l = loc(s.blocks[n]);
      if (!l.ok || l.pool->fill[l.local] != bs || l.pool->live[l.local] != bs) break;
      const std::int32_t* pos = l.pool->slot_position.data() + slot_index(l, 0);
      if (!std::all_of(pos, pos + bs, [&](std::int32_t x) { return x < below; })) break;
      uses.clear();
      const std::uint32_t* rec = l.pool->slot_record.data() + slot_index(l, 0);
      for (int i = 0; i < bs; ++i) {
        if (rec[i] == kNoRecord) continue;
        const auto it = std::find_if(uses.begin(), uses.end(), [&](const auto& u) { return u.first == rec[i]; });
        if (it == uses.end()) {
          uses.emplace_back(rec[i], 1);
        } else {
          ++it->second;
        }
      }
      if (!std::all_of(uses.begin(), uses.end(), [&](const auto& u) { return record_refs_[u.first] == u.second; }))
        break;
    }
    return n;
  }
  /// Puts the first `n` blocks of stream `src` at the front of stream `dst`'s list, shared (no
  /// data moves; dst's later blocks stay after them). kInvalidArgument (nothing changes) when one
  /// of them is not full or has a hole, or dst already holds it.
  [[nodiscard]] Status share_prefix(int src, int dst, std::size_t n) {
    THINKV_RETURN_IF_ERROR(check_stream(src));
    THINKV_RETURN_IF_ERROR(check_stream(dst));
    const StreamState& a = stream_(src);
    StreamState& d = stream_(dst);
    if (src == dst || n > a.blocks.size()) {
      return {StatusCode::kInvalidArgument, "share_prefix(" + std::to_string(src) + ", " + std::to_string(dst) + ", " +
                                                std::to_string(n) + "): needs two streams and at most the source's " +
                                                std::to_string(a.blocks.size()) + " blocks"};
    }
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint32_t b = a.blocks[k];
      if (block_fill(b) != config_.block_size || block_live(b) != config_.block_size ||
          std::find(d.blocks.begin(), d.blocks.end(), b) != d.blocks.end()) {
        return {StatusCode::kInvalidArgument, "share_prefix: block " + std::to_string(b) + " of stream " +
                                                  std::to_string(src) + " is not full and hole-free, or stream " +
                                                  std::to_string(dst) + " holds it"};
      }
    }
    if (n == 0) return Status::ok();
    ++op_;
    d.blocks.insert(d.blocks.begin(), a.blocks.begin(), a.blocks.begin() + static_cast<std::ptrdiff_t>(n));
    d.thoughts.insert(d.thoughts.begin(), a.thoughts.begin(), a.thoughts.begin() + static_cast<std::ptrdiff_t>(n));
    d.live += static_cast<std::int64_t>(n) * config_.block_size;
    stats_.blocks_shared += static_cast<std::int64_t>(n);
    for (std::size_t k = 0; k < n; ++k) {
      std::vector<std::int32_t>& h = holders_[a.blocks[k]];
      if (h.empty()) h.push_back(src);
      h.push_back(dst);
    }
    d.list_version = list_changed(dst);
    StageSet& t = set_of(dst);
    t.max_blocks = std::max(t.max_blocks, static_cast<std::uint32_t>(d.blocks.size()));
    return Status::ok();
  }

  /// A shared block's copy for one of its holders (copy on write): the fresh block that takes its
  /// place in the stream's list and fresh key-scale records for the distinct records its slots
  /// name (`records_from[i]` copied to `records_to[i]`).
  struct UnsharePlan {
    int stream = 0;
    std::uint32_t from = kNoBlock, to = kNoBlock;
    std::vector<std::uint32_t> records_from, records_to;
  };
  /// Plans the copy of shared block `b` for `stream` (a holder), after what `claims` took (and
  /// adds its own). kInvalidArgument when the stream does not hold b or b is not shared;
  /// kPoolExhausted (nothing changes) when the pool, the record range or memory_limit_bytes
  /// cannot supply the copy.
  [[nodiscard]] Status plan_unshare(int stream, std::uint32_t b, UnsharePlan& plan, PlanClaims& claims) const {
    THINKV_RETURN_IF_ERROR(check_stream(stream));
    const auto h = holders(b);
    if (std::find(h.begin(), h.end(), stream) == h.end()) {
      return {StatusCode::kInvalidArgument,
              "block " + std::to_string(b) + " is not a block stream " + std::to_string(stream) + " shares"};
    }
    const Precision p = pools_.precision_of(b);
    const int pi = static_cast<int>(p);
    PlanClaims after = claims;
    plan.stream = stream;
    plan.from = b;
    plan.to = nth_free_block(p, after.blocks[pi]++);
    if (plan.to == kNoBlock) {
      return {StatusCode::kPoolExhausted, "the " + std::string(to_string(p)) +
                                              " pool has no free block to copy shared block " + std::to_string(b) +
                                              " for stream " + std::to_string(stream) + "; raise pool_blocks[" +
                                              std::string(to_string(p)) + "] or end sequences"};
    }
    plan.records_from.clear();
    plan.records_to.clear();
    for (int i = 0; i < block_fill(b); ++i) {
      const SlotRef r{b, static_cast<std::uint32_t>(i)};
      const std::uint32_t rec = is_evicted(r) ? kNoRecord : slot_record(r);
      if (rec == kNoRecord ||
          std::find(plan.records_from.begin(), plan.records_from.end(), rec) != plan.records_from.end())
        continue;
      const std::uint32_t to = nth_free_record(after.records++);
      if (to == kNoRecord) {
        return {StatusCode::kPoolExhausted, "the key-scale record pool (" + std::to_string(record_capacity()) +
                                                " records) cannot hold a shared block's copy; raise record_capacity"};
      }
      plan.records_from.push_back(rec);
      plan.records_to.push_back(to);
    }
    THINKV_RETURN_IF_ERROR(check_limit(after, "copying shared block " + std::to_string(b)));
    claims = after;
    return Status::ok();
  }
  /// Applies plans of plan_unshare made together (their claims in order): each stream's list
  /// names the copy where it named the shared block, the copy's slots name the fresh records,
  /// and the stream lets go of the shared block (its next holder owns it when it was the owner).
  void apply_unshare(std::span<const UnsharePlan> plans) {
    ++op_;
    const int bs = config_.block_size;
    const auto words = static_cast<std::size_t>(layout_.evict_mask_words());
    for (const UnsharePlan& u : plans) {
      const Precision p = pools_.precision_of(u.to);
      const int pi = static_cast<int>(p);
      grow_pool(p, round_blocks(p, u.to - pools_.base[pi] + 1));
      for (std::uint32_t r : u.records_to) {
        if (r >= records_grown_) grow_records(round_records(r + 1));
      }
      std::uint32_t lf = 0, lt = 0;
      PoolState& ps = pool_of(u.to, lt);
      (void)pool_of(u.from, lf);
      take_block(ps, pi, lt, u.stream);
      ps.thought[lt] = ps.thought[lf];
      ps.fill[lt] = ps.fill[lf];
      ps.live[lt] = ps.live[lf];
      ps.seg_lo[lt] = ps.seg_lo[lf];
      ps.seg_hi[lt] = ps.seg_hi[lf];
      std::copy_n(ps.mask.begin() + static_cast<std::ptrdiff_t>(lf * words), words,
                  ps.mask.begin() + static_cast<std::ptrdiff_t>(lt * words));
      StreamState& s = stream_(u.stream);
      for (std::size_t j = 0; j < u.records_to.size(); ++j) {
        const std::uint32_t r = u.records_to[j];
        std::erase(free_records_, r);
        record_refs_[r] = 0;
        record_owner_[r] = u.stream;
        ++s.records;
        ++stats_.records_allocated;
      }
      for (int i = 0; i < bs; ++i) {
        const std::size_t f = slot_index(lf, static_cast<std::uint32_t>(i)),
                          t = slot_index(lt, static_cast<std::uint32_t>(i));
        ps.slot_segment[t] = ps.slot_segment[f];
        ps.slot_position[t] = ps.slot_position[f];
        const std::uint32_t rec = ps.slot_record[f];
        const bool live =
            i < ps.fill[lf] && ((ps.mask[mask_index(lf, static_cast<std::uint32_t>(i))] >> (i % 64)) & 1u) == 0;
        std::uint32_t to = kNoRecord;
        if (live && rec != kNoRecord) {
          const auto at = std::find(u.records_from.begin(), u.records_from.end(), rec) - u.records_from.begin();
          to = u.records_to[static_cast<std::size_t>(at)];
          ++record_refs_[to];
        }
        ps.slot_record[t] = to;
      }
      touch(ps, lt);
      ++stats_.blocks_copied_on_write;
      *std::find(s.blocks.begin(), s.blocks.end(), u.from) = u.to;
      s.list_version = list_changed(u.stream);
      drop_holder(u.from, u.stream);
    }
  }

  // ---- accounting --------------------------------------------------------------------------

  /// Bytes a held block costs: its page, its metadata, and its block-table entry.
  [[nodiscard]] std::int64_t held_block_bytes(Precision p) const noexcept {
    return layout_.page_bytes(p) + layout_.block_meta_bytes() + CacheLayout::kBlockTableEntryBytes;
  }

 private:
  struct StreamState {
    std::vector<std::uint32_t> blocks;
    std::vector<ThoughtType> thoughts;  // the thought type of each block of `blocks`
    std::int64_t live = 0;
    std::int64_t holes = 0;
    std::int64_t holes_by_thought[kNumThoughtTypes] = {};
    std::int64_t records = 0;
    // Per thought type: no block of the type at a `blocks` index below this holds a hole (a lower
    // bound, where plan_commit's search for holes starts). apply_commit raises it past the blocks
    // a plan emptied of holes; evict lowers it to the first block it makes holes in or removes.
    std::uint32_t hole_free_below[kNumThoughtTypes] = {};
    std::uint32_t committed = 0;     // the StageSet::epoch whose full group this stream committed
    std::uint64_t list_version = 0;  // StreamView::list_version
  };
  /// The staging record of a set of streams (CacheConfig::stage_set_streams).
  struct StageSet {
    int staged = 0;  // tokens of the current group pushed (group_size: full)
    ThoughtType thought = ThoughtType::kReasoning;
    std::vector<std::uint32_t> segment;  // [group_size]
    std::vector<std::int32_t> position;  // [group_size]
    std::int32_t next_position = 0;
    std::uint32_t epoch = 1;       // the current group's number; a stream that committed it holds it
    std::uint32_t max_blocks = 0;  // the longest block list any stream of the set has had since reset
  };
  /// One precision's pool: the allocated part of its id range and its blocks' metadata.
  struct PoolState {
    std::uint32_t grown = 0;                // blocks with storage: local ids [0, grown)
    IdBitset free;                          // free blocks among them, by local id
    std::uint64_t free_version = 0;         // changes of `free` (nth_free_block's cursor)
    std::vector<std::uint32_t> chunk_held;  // held blocks per chunk
    std::vector<ThoughtType> thought;       // per block, by local id
    std::vector<std::uint16_t> fill;
    std::vector<std::uint16_t> live;
    std::vector<std::int32_t> owner;
    std::vector<std::uint64_t> mask;            // [grown, evict_mask_words]
    std::vector<std::uint32_t> slot_record;     // [grown, block_size]
    std::vector<std::uint32_t> slot_segment;    // [grown, block_size]
    std::vector<std::uint32_t> seg_lo, seg_hi;  // [grown] segment ids written into the block, min / max
    std::vector<std::int32_t> slot_position;    // [grown, block_size]
    // change log (PoolView): pages whose fill, mask, slot records or owner changed
    std::uint64_t revision = 0;
    std::uint64_t log_first = 0;
    std::vector<std::uint32_t> changed;
    std::uint64_t last_op = 0;  // the call that logged changed.back()
  };
  /// Logs a change of page `local` of pool `ps`. Within one mutating call (no mirror can sync in
  /// the middle of one) consecutive changes of a page log once. The log drops its older half when
  /// it outgrows twice the pool (a mirror that far behind copies the whole pool).
  void touch(PoolState& ps, std::uint32_t local) {
    if (ps.last_op == op_ && !ps.changed.empty() && ps.changed.back() == local) return;
    ps.last_op = op_;
    if (ps.changed.size() >= std::max<std::size_t>(1024, 2 * static_cast<std::size_t>(ps.grown))) {
      // Drop the older half: a mirror that syncs often never falls behind the log (it would copy
      // every page), one that does is told to copy everything.
      const std::size_t drop = ps.changed.size() / 2;
      ps.changed.erase(ps.changed.begin(), ps.changed.begin() + static_cast<std::ptrdiff_t>(drop));
      ps.log_first += drop;
    }
    ps.changed.push_back(local);
    ++ps.revision;
  }
  /// A stream's block list changed: a new list version, logged for TableView (trimmed, like the
  /// pools' logs, when it outgrows twice the streams: a mirror that far behind copies every list).
  std::uint64_t list_changed(int stream) {
    if (list_log_.size() >= std::max<std::size_t>(1024, 2 * streams_.size())) {
      const std::size_t drop = list_log_.size() / 2;  // the older half, as the pools' logs
      list_log_.erase(list_log_.begin(), list_log_.begin() + static_cast<std::ptrdiff_t>(drop));
      list_log_first_ += drop;
    }
    list_log_.push_back(stream);
    return ++list_clock_;
  }
  struct FreeCursor {
    std::uint64_t version = ~std::uint64_t{0};
    const IdBitset* set = nullptr;  // the set walked (a copied table has its own)
    std::size_t k = 0;
    std::uint32_t local = 0;  // its k-th id
  };
  /// Where a global block id lives: its pool and local id; ok = false without storage.
  struct Loc {
    const PoolState* pool = nullptr;
    std::uint32_t local = 0;
    bool ok = false;
  };
  static constexpr std::uint64_t kZeroMask[64] = {};  // words of a block without storage (B <= 4096)

  [[nodiscard]] Loc loc(std::uint32_t b) const noexcept {
    if (b >= pools_.total) return {};
    const int p = static_cast<int>(pools_.precision_of(b));
    const std::uint32_t local = b - pools_.base[p];
    return {&pool_[p], local, local < pool_[p].grown};
  }
  /// The pool and local id of a block that has storage, for writing (callers checked it).
  PoolState& pool_of(std::uint32_t b, std::uint32_t& local) noexcept {
    const int p = static_cast<int>(pools_.precision_of(b));
    local = b - pools_.base[p];
    return pool_[p];
  }
  [[nodiscard]] std::size_t slot_index(std::uint32_t local, std::uint32_t slot) const noexcept {
    return static_cast<std::size_t>(local) * static_cast<std::size_t>(config_.block_size) + slot;
  }
  [[nodiscard]] std::size_t mask_index(std::uint32_t local, std::uint32_t slot) const noexcept {
    return static_cast<std::size_t>(local) * static_cast<std::size_t>(layout_.evict_mask_words()) + slot / 64;
  }
  [[nodiscard]] std::size_t slot_index(const Loc& l, std::uint32_t slot) const noexcept {
    return slot_index(l.local, slot);
  }
  [[nodiscard]] std::size_t mask_index(const Loc& l, std::uint32_t slot) const noexcept {
    return mask_index(l.local, slot);
  }
  [[nodiscard]] std::uint32_t round_blocks(Precision p, std::uint32_t n) const noexcept {
    const std::uint64_t c = chunk_[static_cast<int>(p)];
    const std::uint64_t r = (n + c - 1) / c * c;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(r, pools_.count[static_cast<int>(p)]));
  }
  [[nodiscard]] std::uint32_t round_records(std::uint32_t n) const noexcept {
    const std::uint64_t c = record_chunk_;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>((n + c - 1) / c * c, record_cap_));
  }
  /// Allocated blocks pool p needs for `fresh` fresh blocks (those free now go first).
  [[nodiscard]] std::uint32_t grown_for_blocks(Precision p, std::size_t fresh) const noexcept {
    const PoolState& ps = pool_[static_cast<int>(p)];
    if (fresh <= ps.free.size()) return ps.grown;
    const std::size_t beyond =
        std::min<std::size_t>(fresh - ps.free.size(), pools_.count[static_cast<int>(p)] - ps.grown);
    return round_blocks(p, ps.grown + static_cast<std::uint32_t>(beyond));
  }
  [[nodiscard]] std::uint32_t grown_for_records(std::size_t fresh) const noexcept {
    if (fresh <= free_records_.size()) return records_grown_;
    const std::size_t beyond = std::min<std::size_t>(fresh - free_records_.size(), record_cap_ - records_grown_);
    return round_records(records_grown_ + static_cast<std::uint32_t>(beyond));
  }
  /// The k-th free block of pool p in allocation order (the free allocated ids, lowest first,
  /// then the ids past the allocated chunks), or kNoBlock.
  [[nodiscard]] std::uint32_t nth_free_block(Precision p, std::size_t k) const {
    const int i = static_cast<int>(p);
    const PoolState& ps = pool_[i];
    if (k < ps.free.size()) {
      // Plans made with PlanClaims ask for k, k + 1, ... in turn: walk on from the last answer
      // while the free set is unchanged.
      FreeCursor& c = cursor_[i];
      if (c.version != ps.free_version || c.set != &ps.free || k < c.k) {
        c.version = ps.free_version;
        c.set = &ps.free;
        c.k = 0;
        c.local = ps.free.next(0);
      }
      for (; c.k < k; ++c.k) c.local = ps.free.next(c.local + 1);
      return pools_.base[i] + c.local;
    }
    const std::size_t j = ps.grown + (k - ps.free.size());
    return j < pools_.count[i] ? pools_.base[i] + static_cast<std::uint32_t>(j) : kNoBlock;
  }
  /// The k-th free record in allocation order (the freed ones, last freed first, then the ids
  /// past the allocated chunks), or kNoRecord.
  [[nodiscard]] std::uint32_t nth_free_record(std::size_t k) const {
    if (k < free_records_.size()) return free_records_[free_records_.size() - 1 - k];
    const std::size_t j = records_grown_ + (k - free_records_.size());
    return j < record_cap_ ? static_cast<std::uint32_t>(j) : kNoRecord;
  }
  [[nodiscard]] Status check_limit(const PlanClaims& claims, const std::string& who) const {
    const std::int64_t limit = config_.memory_limit_bytes;
    if (limit <= 0) return Status::ok();
    const std::int64_t now = allocated_bytes();
    const std::int64_t more = growth_bytes(claims);
    if (more == 0 || now + more <= limit) return Status::ok();
    std::string what;
    for (Precision p : kAllPrecisions) {
      const int i = static_cast<int>(p);
      const std::uint32_t n = grown_for_blocks(p, claims.blocks[i]) - pool_[i].grown;
      if (n > 0) {
        what += (what.empty() ? "" : ", ") + std::to_string(n) + " " + std::string(to_string(p)) + " blocks of " +
                std::to_string(layout_.block_bytes(p)) + " bytes";
      }
    }
    const std::uint32_t nr = grown_for_records(claims.records) - records_grown_;
    if (nr > 0) {
      what += (what.empty() ? "" : ", ") + std::to_string(nr) + " key-scale records of " +
              std::to_string(layout_.record_bytes()) + " bytes";
    }
    return {StatusCode::kPoolExhausted, who + ": memory_limit_bytes " + std::to_string(limit) +
                                            " reached: the cache has allocated " + std::to_string(now) +
                                            " bytes and needs " + std::to_string(more) + " more (" + what +
                                            "); end sequences, lower the token budget, or raise memory_limit_bytes"};
  }
  /// Gives pool p storage for `blocks` blocks (no-op when it already has as many).
  void grow_pool(Precision p, std::uint32_t blocks) {
    PoolState& ps = pool_[static_cast<int>(p)];
    if (blocks <= ps.grown) return;
    const std::uint32_t old = ps.grown;
    resize_pool(static_cast<int>(p), blocks);
    for (std::uint32_t i = old; i < blocks; ++i) ps.free.insert(i);
    ++ps.free_version;
    stats_.chunks_grown += (blocks - old + chunk_[static_cast<int>(p)] - 1) / chunk_[static_cast<int>(p)];
  }
  void grow_records(std::uint32_t records) {
    if (records <= records_grown_) return;
    record_refs_.resize(records, 0);
    record_owner_.resize(records, kNoStream);
    // New ids go below the freed ones, lowest taken first once those are used (nth_free_record).
    std::vector<std::uint32_t> ids;
    ids.reserve(records - records_grown_ + free_records_.size());
    for (std::uint32_t r = records; r-- > records_grown_;) ids.push_back(r);
    ids.insert(ids.end(), free_records_.begin(), free_records_.end());
    free_records_ = std::move(ids);
    records_grown_ = records;
  }
  void resize_pool(int p, std::uint32_t blocks) {
    PoolState& ps = pool_[p];
    const std::size_t nb = blocks;
    const std::size_t ns = nb * static_cast<std::size_t>(config_.block_size);
    ps.thought.resize(nb, ThoughtType::kReasoning);
    ps.fill.resize(nb, 0);
    ps.live.resize(nb, 0);
    ps.owner.resize(nb, kNoStream);
    ps.mask.resize(nb * static_cast<std::size_t>(layout_.evict_mask_words()), 0);
    ps.slot_record.resize(ns, kNoRecord);
    ps.slot_segment.resize(ns, 0);
    ps.seg_lo.resize(nb, 0xFFFFFFFFu);
    ps.seg_hi.resize(nb, 0);
    ps.slot_position.resize(ns, -1);
    ps.chunk_held.resize((nb + chunk_[p] - 1) / chunk_[p], 0);
    ps.free.resize(blocks);  // ids past `blocks` leave the free set with their storage
    // New pages are logged as changed (a mirror learns their initial metadata); pages that go
    // need nothing (no stream lists them; their log entries are skipped, and a page that comes
    // back is logged again). A mirror follows growth and release by changes, not whole copies.
    const std::uint32_t before = ps.grown;
    ps.grown = blocks;
    for (std::uint32_t local = before; local < blocks; ++local) touch(ps, local);
  }
  /// Releases the storage of the chunks at the top of each pool that hold no block.
  void release_empty_chunks() {
    for (int p = 0; p < kNumPrecisions; ++p) {
      PoolState& ps = pool_[p];
      std::size_t chunks = ps.chunk_held.size();
      while (chunks > 0 && ps.chunk_held[chunks - 1] == 0) --chunks;
      if (chunks == ps.chunk_held.size()) continue;
      const auto keep = static_cast<std::uint32_t>(std::min<std::size_t>(chunks * chunk_[p], ps.grown));
      ++ps.free_version;
      stats_.chunks_released += static_cast<std::int64_t>(ps.chunk_held.size() - chunks);
      resize_pool(p, keep);
      if (host_reserved_) continue;  // reserve_host_metadata: the arrays keep their capacity
      // Shrink the metadata's own allocations too: memory follows what is held.
      ps.thought.shrink_to_fit();
      ps.fill.shrink_to_fit();
      ps.live.shrink_to_fit();
      ps.owner.shrink_to_fit();
      ps.mask.shrink_to_fit();
      ps.slot_record.shrink_to_fit();
      ps.slot_segment.shrink_to_fit();
      ps.seg_lo.shrink_to_fit();
      ps.seg_hi.shrink_to_fit();
      ps.slot_position.shrink_to_fit();
    }
  }

  static bool plan_full(const CommitPlan& p, int g) { return static_cast<int>(p.slots.size()) >= g; }
  [[nodiscard]] const StreamState& stream_(int s) const { return streams_[static_cast<std::size_t>(s)]; }
  StreamState& stream_(int s) { return streams_[static_cast<std::size_t>(s)]; }
  [[nodiscard]] const StageSet& set_of(int stream) const {
    return sets_[static_cast<std::size_t>(stream / config_.stage_set_streams)];
  }
  StageSet& set_of(int stream) { return sets_[static_cast<std::size_t>(stream / config_.stage_set_streams)]; }
  static constexpr std::size_t kNoIndex = static_cast<std::size_t>(-1);
  /// Index in s.blocks of the stream's newest block of `thought`, or kNoIndex.
  [[nodiscard]] static std::size_t newest_block_of(const StreamState& s, ThoughtType thought) noexcept {
    for (std::size_t k = s.blocks.size(); k-- > 0;) {
      if (s.thoughts[k] == thought) return k;
    }
    return kNoIndex;
  }
  [[nodiscard]] int count_holes(std::uint32_t b) const {
    int n = 0;
    for (std::uint64_t w : evict_mask(b)) n += __builtin_popcountll(w);
    return n;
  }
  /// `stream` lets go of shared block b: when it owned b, the next holder owns it and the key-scale
  /// records of b's slots the stream owned; a block left with one holder is no longer shared.
  void drop_holder(std::uint32_t b, int stream) {
    const auto it = holders_.find(b);
    std::vector<std::int32_t>& h = it->second;
    std::erase(h, stream);
    std::uint32_t local = 0;
    PoolState& ps = pool_of(b, local);
    if (ps.owner[local] == stream) {
      const std::int32_t next = h.front();
      ps.owner[local] = next;
      touch(ps, local);
      for (int i = 0; i < ps.fill[local]; ++i) {
        const std::uint32_t rec = ps.slot_record[slot_index(local, static_cast<std::uint32_t>(i))];
        if (rec == kNoRecord || record_owner_[rec] != stream) continue;
        record_owner_[rec] = next;
        --stream_(stream).records;
        ++stream_(next).records;
      }
    }
    if (h.size() == 1) holders_.erase(it);
  }
  /// Takes the free block of local id `local` of pool `pi` for `stream`: out of the free set, owned,
  /// counted in its chunk. The caller fills its metadata and puts it in the stream's list.
  void take_block(PoolState& ps, int pi, std::uint32_t local, int stream) {
    ps.free.erase(local);
    ++ps.free_version;
    ps.owner[local] = stream;
    ++ps.chunk_held[local / chunk_[pi]];
    ++stats_.blocks_allocated;
  }
  void release_block(std::uint32_t b) {
    std::uint32_t local = 0;
    PoolState& ps = pool_of(b, local);
    const auto words = static_cast<std::size_t>(layout_.evict_mask_words());
    std::fill_n(ps.mask.begin() + static_cast<std::ptrdiff_t>(local * words), words, 0);
    const std::size_t first = static_cast<std::size_t>(local) * config_.block_size;
    std::fill_n(ps.slot_record.begin() + static_cast<std::ptrdiff_t>(first), config_.block_size, kNoRecord);
    std::fill_n(ps.slot_position.begin() + static_cast<std::ptrdiff_t>(first), config_.block_size, -1);
    ps.fill[local] = 0;
    ps.live[local] = 0;
    ps.owner[local] = kNoStream;
    touch(ps, local);
    --ps.chunk_held[local / chunk_[static_cast<int>(pools_.precision_of(b))]];
    ps.free.insert(local);
    ++ps.free_version;
    ++stats_.blocks_freed;
  }

  CacheConfig config_;
  std::uint64_t op_ = 0;          // mutating calls so far (touch)
  std::uint64_t list_clock_ = 0;  // StreamView::list_version of the last list change
  // Block-list change log (TableView): streams whose list changed after list_log_first_.
  std::uint64_t list_log_first_ = 0;
  std::vector<std::int32_t> list_log_;
  CacheLayout layout_;
  PoolMap pools_;
  BlockTableStats stats_;
  PoolState pool_[kNumPrecisions];
  mutable FreeCursor cursor_[kNumPrecisions];  // nth_free_block's last answer per pool
  std::uint32_t chunk_[kNumPrecisions] = {1, 1, 1, 1};
  // key-scale records: ids [0, records_grown_) have storage
  std::uint32_t record_cap_ = 0;
  bool host_reserved_ = false;  // reserve_host_metadata: capacities kept, never shrunk
  std::uint32_t record_chunk_ = 1;
  std::uint32_t records_grown_ = 0;
  std::vector<int> record_refs_;
  std::vector<std::int32_t> record_owner_;
  std::vector<std::uint32_t> free_records_;  // freed ids below records_grown_; the back goes first
  std::vector<StreamState> streams_;
  std::vector<StageSet> sets_;
  std::vector<SlotRef> sorted_;                                 // evict's scratch
  std::vector<std::uint32_t> holed_;                            // evict's scratch: blocks given holes
  std::vector<std::uint32_t> emptied_;                          // evict's scratch: blocks left with no live slot
  std::map<std::uint32_t, std::vector<std::int32_t>> holders_;  // shared blocks: their holders
};

}  // namespace thinkv
