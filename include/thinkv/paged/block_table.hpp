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
#include <set>
#include <span>
#include <string>
#include <vector>

#include "thinkv/paged/layout.hpp"
#include "thinkv/status.hpp"
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

  static PoolMap from(const CacheConfig& c) {
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
};

/// Counters of the block table (never reset).
/// Fresh blocks (per precision) and key-scale records that earlier plans of one batch will take.
/// plan_commit given claims plans as if those plans were already applied, so the plans of a
/// batch of streams (one layer's KV heads) get distinct blocks and records and can be applied one
/// after the other, in the order they were made, without planning again.
struct PlanClaims {
  std::size_t blocks[kNumPrecisions] = {};
  std::size_t records = 0;
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
};

/// Host metadata of the CT cache. Single-threaded; not copyable by accident (use copy()).
class BlockTable {
 public:
  /// `config` must be valid (CacheConfig::validate()); throws ConfigError otherwise.
  explicit BlockTable(const CacheConfig& config)
      : config_(config), layout_(CacheLayout::from(config)), pools_(PoolMap::from(config)) {
    if (Status s = config.validate(); !s.is_ok()) throw ConfigError(s);
    const std::size_t nb = pools_.total;
    const std::size_t ns = static_cast<std::size_t>(config.block_size) * nb;
    block_thought_.assign(nb, ThoughtType::kReasoning);
    block_fill_.assign(nb, 0);
    block_live_.assign(nb, 0);
    block_owner_.assign(nb, kNoStream);
    evict_mask_.assign(nb * static_cast<std::size_t>(layout_.evict_mask_words()), 0);
    slot_record_.assign(ns, kNoRecord);
    slot_segment_.assign(ns, 0);
    slot_position_.assign(ns, -1);
    for (int p = 0; p < kNumPrecisions; ++p) {
      // Ordered, so allocation takes the lowest free id: deterministic, and freed blocks at the
      // low end are reused first (pages stay dense at the front of the pool).
      for (std::uint32_t i = 0; i < pools_.count[p]; ++i) {
        free_blocks_[p].insert(free_blocks_[p].end(), pools_.base[p] + i);
      }
    }
    const std::int64_t rec_cap = effective_record_capacity(config);
    record_refs_.assign(static_cast<std::size_t>(rec_cap), 0);
    record_owner_.assign(static_cast<std::size_t>(rec_cap), kNoStream);
    free_records_.reserve(static_cast<std::size_t>(rec_cap));
    for (std::int64_t r = rec_cap; r-- > 0;) free_records_.push_back(static_cast<std::uint32_t>(r));
    streams_.resize(static_cast<std::size_t>(config.num_streams));
    for (auto& s : streams_) {
      s.staged_segment.assign(static_cast<std::size_t>(config.group_size), 0);
      s.staged_position.assign(static_cast<std::size_t>(config.group_size), -1);
    }
  }

  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] const CacheLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] const PoolMap& pools() const noexcept { return pools_; }
  [[nodiscard]] const BlockTableStats& stats() const noexcept { return stats_; }
  [[nodiscard]] int num_streams() const noexcept { return config_.num_streams; }
  [[nodiscard]] int record_capacity() const noexcept { return static_cast<int>(record_refs_.size()); }

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
  /// Tokens held in staging (not yet quantized) and their thought type.
  [[nodiscard]] int staged_count(int stream) const { return stream_(stream).staged; }
  [[nodiscard]] ThoughtType staged_thought(int stream) const { return stream_(stream).staged_thought; }
  [[nodiscard]] std::uint32_t staged_segment(int stream, int row) const {
    return stream_(stream).staged_segment[static_cast<std::size_t>(row)];
  }
  [[nodiscard]] std::int32_t staged_position(int stream, int row) const {
    return stream_(stream).staged_position[static_cast<std::size_t>(row)];
  }
  /// Position the next appended token of the stream gets (tokens appended so far).
  [[nodiscard]] std::int32_t next_position(int stream) const { return stream_(stream).next_position; }
  /// Live (non-evicted) tokens in pages, excluding staging.
  [[nodiscard]] std::int64_t live_slots(int stream) const { return stream_(stream).live; }
  /// Evicted slots still held in the stream's blocks (holes awaiting reuse).
  [[nodiscard]] std::int64_t hole_slots(int stream) const { return stream_(stream).holes; }
  /// Key-scale records owned by the stream.
  [[nodiscard]] std::int64_t records_held(int stream) const { return stream_(stream).records; }

  // ---- per-block / per-slot queries ----------------------------------------------------------

  [[nodiscard]] ThoughtType block_thought(std::uint32_t b) const { return block_thought_[b]; }
  [[nodiscard]] Precision block_precision(std::uint32_t b) const { return pools_.precision_of(b); }
  [[nodiscard]] int block_fill(std::uint32_t b) const { return block_fill_[b]; }
  [[nodiscard]] int block_live(std::uint32_t b) const { return block_live_[b]; }
  [[nodiscard]] std::int32_t block_owner(std::uint32_t b) const { return block_owner_[b]; }
  /// True when the slot exists (block id within the pools, slot index within the block).
  [[nodiscard]] bool contains(SlotRef s) const noexcept {
    return s.block < pools_.total && s.slot < static_cast<std::uint32_t>(config_.block_size);
  }
  /// Evicted and not reused yet (false for a slot that does not exist).
  [[nodiscard]] bool is_evicted(SlotRef s) const {
    if (!contains(s)) return false;
    const std::uint64_t w = evict_mask_[mask_index(s)];
    return (w >> (s.slot % 64)) & 1u;
  }
  /// Written and not evicted (false for a slot that does not exist).
  [[nodiscard]] bool is_live(SlotRef s) const { return contains(s) && s.slot < block_fill_[s.block] && !is_evicted(s); }
  [[nodiscard]] std::uint32_t slot_record(SlotRef s) const { return slot_record_[slot_index(s)]; }
  [[nodiscard]] std::uint32_t slot_segment(SlotRef s) const { return slot_segment_[slot_index(s)]; }
  [[nodiscard]] std::int32_t slot_position(SlotRef s) const { return slot_position_[slot_index(s)]; }
  [[nodiscard]] int record_refs(std::uint32_t r) const { return record_refs_[r]; }
  [[nodiscard]] std::int32_t record_owner(std::uint32_t r) const { return record_owner_[r]; }
  /// Raw eviction-mask words of a block (bit i of word i/64 = slot i evicted).
  [[nodiscard]] std::span<const std::uint64_t> evict_mask(std::uint32_t b) const {
    return {evict_mask_.data() + static_cast<std::size_t>(b) * layout_.evict_mask_words(),
            static_cast<std::size_t>(layout_.evict_mask_words())};
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
    for (int i = 0; i < block_fill_[b]; ++i) {
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
  [[nodiscard]] std::size_t free_blocks(Precision p) const { return free_blocks_[static_cast<int>(p)].size(); }
  [[nodiscard]] std::size_t free_records() const { return free_records_.size(); }

  /// Live slots of a stream in attention order (block list order, then slot order).
  [[nodiscard]] std::vector<SlotRef> live_slot_list(int stream) const {
    std::vector<SlotRef> out;
    out.reserve(static_cast<std::size_t>(stream_(stream).live));
    for (std::uint32_t b : blocks(stream)) {
      for (int i = 0; i < block_fill_[b]; ++i) {
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
    const StreamState& s = stream_(stream);
    if (s.staged > 0 && s.staged_thought != t) {
      return {StatusCode::kInvalidArgument,
              "thought type " + std::string(to_string(t)) + " appended to stream " + std::to_string(stream) +
                  " while its staging group holds " + std::to_string(s.staged) + " token(s) of type " +
                  std::string(to_string(s.staged_thought)) +
                  ": a quantization group never mixes thought types; change the type only when "
                  "the position is a multiple of group_size (" +
                  std::to_string(config_.group_size) + ")"};
    }
    return Status::ok();
  }
  /// Records a staged token's metadata (the backend holds its data). Call after check_stage and,
  /// if this token fills the group, after a successful plan_commit. Returns the staging row.
  int push_staged(int stream, ThoughtType t, std::uint32_t segment) {
    StreamState& s = stream_(stream);
    const int row = s.staged;
    s.staged_thought = t;
    s.staged_segment[static_cast<std::size_t>(row)] = segment;
    s.staged_position[static_cast<std::size_t>(row)] = s.next_position++;
    ++s.staged;
    return row;
  }
  /// Undoes the last push_staged (used when a backend fails after the table was updated).
  void pop_staged(int stream) {
    StreamState& s = stream_(stream);
    --s.staged;
    --s.next_position;
  }

  /// Gives the stream's whole staging group a new thought type (nothing is committed yet, so no
  /// data moves). Thought refreshes use it: see ThoughtTracker. No-op when nothing is staged.
  void relabel_staged(int stream, ThoughtType t) {
    StreamState& s = stream_(stream);
    if (s.staged > 0) s.staged_thought = t;
  }

  // ---- commit: plan (pure), then apply -----------------------------------------------------

  /// Plans where a full staging group of `thought` goes: evicted slots of the stream's blocks of
  /// the same thought type first (oldest block first, lowest slot first), then unwritten slots of
  /// those blocks, then fresh blocks from the precision's pool. Fails with kPoolExhausted (and
  /// changes nothing) when the pool or the record pool cannot supply enough. With `claims`, the
  /// fresh blocks and records earlier plans of the batch claimed are skipped, and on success this
  /// plan's are added to them.
  [[nodiscard]] Status plan_commit(int stream, ThoughtType thought, CommitPlan& plan,
                                   PlanClaims* claims = nullptr) const {
    THINKV_RETURN_IF_ERROR(check_stream(stream));
    const int g = config_.group_size;
    const int bs = config_.block_size;
    const Precision p = config_.precision.precision_of(thought);
    plan = CommitPlan{};
    plan.stream = stream;
    plan.thought = thought;
    plan.precision = p;
    plan.slots.reserve(static_cast<std::size_t>(g));
    const StreamState& s = stream_(stream);
    // 1. holes of the same thought type (in place reuse)
    if (s.holes_by_thought[static_cast<int>(thought)] > 0) {
      for (std::uint32_t b : s.blocks) {
        if (block_thought_[b] != thought) continue;
        for (int w = 0; w < layout_.evict_mask_words() && plan_full(plan, g) == false; ++w) {
          std::uint64_t bits = evict_mask_[static_cast<std::size_t>(b) * layout_.evict_mask_words() + w];
          while (bits != 0 && !plan_full(plan, g)) {
            const int i = __builtin_ctzll(bits);
            bits &= bits - 1;
            plan.slots.push_back({b, static_cast<std::uint32_t>(w * 64 + i)});
            ++plan.reused_slots;
          }
        }
        if (plan_full(plan, g)) break;
      }
    }
    // 2. unwritten slots of open blocks of the same thought type
    for (std::uint32_t b : s.blocks) {
      if (plan_full(plan, g)) break;
      if (block_thought_[b] != thought) continue;
      for (int i = block_fill_[b]; i < bs && !plan_full(plan, g); ++i) {
        plan.slots.push_back({b, static_cast<std::uint32_t>(i)});
      }
    }
    // 3. fresh blocks
    const auto& fl = free_blocks_[static_cast<int>(p)];
    const std::size_t skip = claims != nullptr ? claims->blocks[static_cast<int>(p)] : 0;
    auto next_free = skip < fl.size() ? std::next(fl.begin(), static_cast<std::ptrdiff_t>(skip)) : fl.end();
    while (!plan_full(plan, g)) {
      if (next_free == fl.end()) {
        return {StatusCode::kPoolExhausted, "the " + std::string(to_string(p)) + " pool has no free block for stream " +
                                                std::to_string(stream) + " (" +
                                                std::to_string(pools_.count[static_cast<int>(p)]) +
                                                " blocks, all held); raise pool_blocks[" + std::string(to_string(p)) +
                                                "], lower the token budget, or evict"};
      }
      const std::uint32_t b = *next_free++;
      plan.new_blocks.push_back(b);
      for (int i = 0; i < bs && !plan_full(plan, g); ++i) { plan.slots.push_back({b, static_cast<std::uint32_t>(i)}); }
    }
    if (has_group_scale(p)) {
      const std::size_t taken = claims != nullptr ? claims->records : 0;
      if (free_records_.size() <= taken) {
        return {StatusCode::kPoolExhausted,
                "the key-scale record pool is exhausted (" + std::to_string(record_capacity()) +
                    " records, all held); raise record_capacity or set it to 0 (worst case)"};
      }
      plan.record = free_records_[free_records_.size() - 1 - taken];
    }
    if (claims != nullptr) {
      claims->blocks[static_cast<int>(p)] += plan.new_blocks.size();
      if (plan.record != kNoRecord) ++claims->records;
    }
    return Status::ok();
  }

  /// Records a planned commit: takes the planned blocks and record, fills the slots, clears the
  /// reused slots' eviction bits and the staging group. The plan must come from plan_commit on
  /// the current state (no other mutation in between).
  void apply_commit(const CommitPlan& plan) {
    StreamState& s = stream_(plan.stream);
    const int p = static_cast<int>(plan.precision);
    for (std::uint32_t b : plan.new_blocks) {
      free_blocks_[p].erase(b);
      block_owner_[b] = plan.stream;
      block_thought_[b] = plan.thought;
      block_fill_[b] = 0;
      block_live_[b] = 0;
      s.blocks.push_back(b);
      ++stats_.blocks_allocated;
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
    for (std::size_t i = 0; i < plan.slots.size(); ++i) {
      const SlotRef r = plan.slots[i];
      const std::size_t si = slot_index(r);
      if (is_evicted(r)) {
        evict_mask_[mask_index(r)] &= ~(std::uint64_t{1} << (r.slot % 64));
        --s.holes;
        --s.holes_by_thought[static_cast<int>(plan.thought)];
      } else {
        block_fill_[r.block] = std::max<int>(block_fill_[r.block], static_cast<int>(r.slot) + 1);
      }
      slot_record_[si] = plan.record;
      slot_segment_[si] = s.staged_segment[i];
      slot_position_[si] = s.staged_position[i];
      ++block_live_[r.block];
      ++s.live;
    }
    stats_.slots_written += static_cast<std::int64_t>(plan.slots.size());
    stats_.slots_reused += plan.reused_slots;
    ++stats_.commits;
    s.staged = 0;
  }

  // ---- eviction ----------------------------------------------------------------------------

  /// Marks live slots of a stream evicted. Moves no data. Releases key-scale records whose last
  /// live slot went, and returns blocks with no live slot to their pool. All-or-nothing: a slot
  /// that is not a live slot of this stream, or a duplicate, fails the call with nothing changed.
  [[nodiscard]] Status evict(int stream, std::span<const SlotRef> slots) {
    THINKV_RETURN_IF_ERROR(check_stream(stream));
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const SlotRef r = slots[i];
      if (!contains(r)) {
        return {StatusCode::kOutOfRange,
                "slot {block " + std::to_string(r.block) + ", slot " + std::to_string(r.slot) + "} does not exist"};
      }
      if (block_owner_[r.block] != stream || !is_live(r)) {
        return {StatusCode::kInvalidArgument, "slot {block " + std::to_string(r.block) + ", slot " +
                                                  std::to_string(r.slot) + "} is not a live slot of stream " +
                                                  std::to_string(stream)};
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (slots[j] == r) {
          return {StatusCode::kInvalidArgument,
                  "slot {block " + std::to_string(r.block) + ", slot " + std::to_string(r.slot) + "} is listed twice"};
        }
      }
    }
    StreamState& s = stream_(stream);
    for (const SlotRef r : slots) {
      evict_mask_[mask_index(r)] |= std::uint64_t{1} << (r.slot % 64);
      --block_live_[r.block];
      --s.live;
      ++s.holes;
      ++s.holes_by_thought[static_cast<int>(block_thought_[r.block])];
      ++stats_.slots_evicted;
      const std::uint32_t rec = slot_record_[slot_index(r)];
      if (rec != kNoRecord && --record_refs_[rec] == 0) {
        record_owner_[rec] = kNoStream;
        free_records_.push_back(rec);
        --s.records;
        ++stats_.records_freed;
      }
    }
    // Return blocks with no live slot to their pools (their holes go with them).
    for (std::size_t k = 0; k < s.blocks.size();) {
      const std::uint32_t b = s.blocks[k];
      if (block_live_[b] == 0) {
        const int holes = count_holes(b);
        s.holes -= holes;
        s.holes_by_thought[static_cast<int>(block_thought_[b])] -= holes;
        release_block(b);
        s.blocks.erase(s.blocks.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        ++k;
      }
    }
    return Status::ok();
  }

  /// Releases everything a stream holds (end of sequence): blocks, records, staging.
  void reset_stream(int stream) {
    StreamState& s = stream_(stream);
    for (std::uint32_t b : s.blocks) {
      for (int i = 0; i < block_fill_[b]; ++i) {
        const SlotRef r{b, static_cast<std::uint32_t>(i)};
        if (is_evicted(r)) continue;
        const std::uint32_t rec = slot_record_[slot_index(r)];
        if (rec != kNoRecord && --record_refs_[rec] == 0) {
          record_owner_[rec] = kNoStream;
          free_records_.push_back(rec);
          ++stats_.records_freed;
        }
      }
      release_block(b);
    }
    StreamState fresh;
    fresh.staged_segment.assign(static_cast<std::size_t>(config_.group_size), 0);
    fresh.staged_position.assign(static_cast<std::size_t>(config_.group_size), -1);
    s = std::move(fresh);
  }

  // ---- accounting --------------------------------------------------------------------------

  /// Bytes a held block costs: its page, its metadata, and its block-table entry.
  [[nodiscard]] std::int64_t held_block_bytes(Precision p) const noexcept {
    return layout_.page_bytes(p) + layout_.block_meta_bytes() + CacheLayout::kBlockTableEntryBytes;
  }

 private:
  struct StreamState {
    std::vector<std::uint32_t> blocks;
    std::int64_t live = 0;
    std::int64_t holes = 0;
    std::int64_t holes_by_thought[kNumThoughtTypes] = {};
    std::int64_t records = 0;
    int staged = 0;
    ThoughtType staged_thought = ThoughtType::kReasoning;
    std::vector<std::uint32_t> staged_segment;
    std::vector<std::int32_t> staged_position;
    std::int32_t next_position = 0;
  };

  static bool plan_full(const CommitPlan& p, int g) { return static_cast<int>(p.slots.size()) >= g; }
  [[nodiscard]] const StreamState& stream_(int s) const { return streams_[static_cast<std::size_t>(s)]; }
  StreamState& stream_(int s) { return streams_[static_cast<std::size_t>(s)]; }
  [[nodiscard]] std::size_t slot_index(SlotRef s) const {
    return static_cast<std::size_t>(s.block) * static_cast<std::size_t>(config_.block_size) + s.slot;
  }
  [[nodiscard]] std::size_t mask_index(SlotRef s) const {
    return static_cast<std::size_t>(s.block) * static_cast<std::size_t>(layout_.evict_mask_words()) + s.slot / 64;
  }
  [[nodiscard]] int count_holes(std::uint32_t b) const {
    int n = 0;
    for (std::uint64_t w : evict_mask(b)) n += __builtin_popcountll(w);
    return n;
  }
  void release_block(std::uint32_t b) {
    for (int w = 0; w < layout_.evict_mask_words(); ++w) {
      evict_mask_[static_cast<std::size_t>(b) * layout_.evict_mask_words() + w] = 0;
    }
    const std::size_t first = static_cast<std::size_t>(b) * config_.block_size;
    std::fill_n(slot_record_.begin() + static_cast<std::ptrdiff_t>(first), config_.block_size, kNoRecord);
    std::fill_n(slot_position_.begin() + static_cast<std::ptrdiff_t>(first), config_.block_size, -1);
    block_fill_[b] = 0;
    block_live_[b] = 0;
    block_owner_[b] = kNoStream;
    free_blocks_[static_cast<int>(pools_.precision_of(b))].insert(b);
    ++stats_.blocks_freed;
  }

  CacheConfig config_;
  CacheLayout layout_;
  PoolMap pools_;
  BlockTableStats stats_;
  // per block, indexed by global block id
  std::vector<ThoughtType> block_thought_;
  std::vector<std::uint16_t> block_fill_;
  std::vector<std::uint16_t> block_live_;
  std::vector<std::int32_t> block_owner_;
  std::vector<std::uint64_t> evict_mask_;  // [blocks, evict_mask_words]
  // per slot, indexed by block * block_size + slot
  std::vector<std::uint32_t> slot_record_;
  std::vector<std::uint32_t> slot_segment_;
  std::vector<std::int32_t> slot_position_;
  std::set<std::uint32_t> free_blocks_[kNumPrecisions];
  // key-scale records
  std::vector<int> record_refs_;
  std::vector<std::int32_t> record_owner_;
  std::vector<std::uint32_t> free_records_;
  std::vector<StreamState> streams_;
};

}  // namespace thinkv
