#pragma once
/// \file layout.hpp
/// Cache configuration, its validation, and the byte layout of pages, metadata and staging.
/// Every byte count the memory accounting reports is derived here, in one place
/// (docs/design.md, "Memory accounting", explains each term).

#include <algorithm>
#include <array>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>

#include "thinkv/policy/precision_map.hpp"
#include "thinkv/status.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

/// Bytes of a stream's fixed header (CacheLayout::kStreamHeaderBytes explains them).
inline constexpr int kStreamHeaderBytes = 40;

/// What storage needs to know: the geometry of a paged KV cache's bytes (streams, rows, groups,
/// blocks, the pools' id ranges, allocation chunks). A KV backend is set up from this alone; the
/// paged cache's settings (precision map, memory limit) are CacheConfig's; eviction (budget,
/// retention) is the ThinKV cache's policy. A *stream* is one (sequence, layer, KV head): it owns
/// a list of blocks and a staging buffer.
struct StorageConfig {
  int num_streams = 1;  ///< streams the cache holds (sequences x layers x KV heads)
  int head_dim = 128;   ///< channels per key/value row
  int group_size = 16;  ///< g: tokens per key group (per channel), channels per value group
  int block_size = 16;  ///< slots (tokens) per block
  /// Most blocks each precision's pool may hold, indexed by Precision: the range of block ids the
  /// pool owns. Nothing is allocated for it up front: pages and their metadata are allocated in
  /// chunks of `chunk_blocks` blocks as commits need them and freed when a chunk empties
  /// (docs/design.md, "Memory that follows the budget"). A pool the map uses must have >= 1.
  std::array<int, kNumPrecisions> pool_blocks{0, 0, 0, 0};
  /// Most key-scale records the shared record pool may hold; 0 = the worst case (one per slot
  /// of every quantized pool), which can never run out. Records too are allocated in chunks.
  int record_capacity = 0;
  /// Blocks per allocation chunk of a pool (the granularity of growth and release).
  int chunk_blocks = 64;

  static constexpr int kMaxHeadDim = 1024;
  static constexpr int kMaxBlockSize = 4096;
  static constexpr int kMaxStreams = 1 << 24;
  static constexpr int kMaxChunkBlocks = 1 << 16;

  /// Bytes allocated whatever the cache holds: per stream its staging buffer (g tokens of K and
  /// V in BF16) and its header (CacheLayout::kStreamHeaderBytes). Valid after the shape checks.
  [[nodiscard]] std::int64_t fixed_bytes() const noexcept {
    return std::int64_t{num_streams} * (std::int64_t{2} * group_size * head_dim * 2 + kStreamHeaderBytes);
  }

  /// Blocks per allocation chunk of pool p (chunk_blocks, at most the pool's range, at least 1).
  [[nodiscard]] std::uint32_t pool_chunk(Precision p) const noexcept {
    return static_cast<std::uint32_t>(std::max(1, std::min(chunk_blocks, pool_blocks[static_cast<int>(p)])));
  }
  /// Records per record chunk: one per group a chunk of blocks holds, at most the record range
  /// (`records`, effective_record_capacity), at least 1.
  [[nodiscard]] std::uint32_t record_chunk(std::int64_t records) const noexcept {
    const std::int64_t per_chunk = std::int64_t{chunk_blocks} * block_size / group_size;
    return static_cast<std::uint32_t>(
        std::max<std::int64_t>(1, std::min(per_chunk, std::max<std::int64_t>(records, 1))));
  }

  /// The group size alone (also checked first by configurations that divide by it).
  [[nodiscard]] static Status check_group_size(int g) {
    if (g == 8 || g == 16 || g == 32) return Status::ok();
    return {StatusCode::kInvalidArgument, "group_size " + std::to_string(g) + " is not supported; allowed: 8, 16, 32"};
  }
  /// The block size alone (also checked first by configurations that divide by it).
  [[nodiscard]] static Status check_block_size(int b) {
    if (b >= 1 && b <= kMaxBlockSize) return Status::ok();
    return {StatusCode::kInvalidArgument,
            "block_size " + std::to_string(b) + " is out of range; allowed: 1.." + std::to_string(kMaxBlockSize)};
  }

  /// Checks every field; the message names the bad value and the allowed range.
  [[nodiscard]] Status validate() const {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    if (num_streams < 1 || num_streams > kMaxStreams) {
      return bad("num_streams " + std::to_string(num_streams) + " is out of range; allowed: 1.." +
                 std::to_string(kMaxStreams));
    }
    THINKV_RETURN_IF_ERROR(check_group_size(group_size));
    if (head_dim < 1 || head_dim > kMaxHeadDim) {
      return bad("head_dim " + std::to_string(head_dim) + " is out of range; allowed: 1.." +
                 std::to_string(kMaxHeadDim) + " and a multiple of group_size");
    }
    if (head_dim % group_size != 0) {
      return bad("head_dim " + std::to_string(head_dim) + " is not a multiple of the value group size " +
                 std::to_string(group_size) + "; use a group_size (8, 16 or 32) that divides head_dim" +
                 (head_dim % 8 == 0 ? " (e.g. group_size 8)" : ""));
    }
    THINKV_RETURN_IF_ERROR(check_block_size(block_size));
    for (Precision p : kAllPrecisions) {
      const int n = pool_blocks[static_cast<int>(p)];
      const std::int64_t max_blocks = (std::int64_t{1} << 31) / block_size;
      if (n < 0 || n > max_blocks) {
        return bad("pool_blocks[" + std::string(to_string(p)) + "] " + std::to_string(n) +
                   " is out of range; allowed: 0.." + std::to_string(max_blocks));
      }
    }
    std::int64_t total_slots = 0;
    for (int n : pool_blocks) total_slots += std::int64_t{n} * block_size;
    if (total_slots >= std::int64_t{1} << 31) {
      return bad("the pools hold " + std::to_string(total_slots) +
                 " slots in all; allowed: less than 2^31 (block and record ids are 32-bit)");
    }
    if (chunk_blocks < 1 || chunk_blocks > kMaxChunkBlocks) {
      return bad("chunk_blocks " + std::to_string(chunk_blocks) + " is out of range; allowed: 1.." +
                 std::to_string(kMaxChunkBlocks));
    }
    if (record_capacity < 0) {
      return bad("record_capacity " + std::to_string(record_capacity) +
                 " is negative; allowed: 0 (worst case) or >= 1");
    }
    return Status::ok();
  }

  friend bool operator==(const StorageConfig&, const StorageConfig&) = default;
};

/// Construction-time configuration of a paged, compressed KV cache: its storage (StorageConfig,
/// what a backend is set up from) and the cache's policy settings.
struct CacheConfig : StorageConfig {
  PrecisionMap precision{};  ///< TBQ map, R4E4T2 by default
  /// Most bytes the cache may allocate in all (pages, block metadata, key-scale records, staging
  /// and stream headers: allocated_bytes()); 0 = no limit (pools grow until a pool's range or
  /// the host runs out). Every sequence, stream and precision draws on it; a commit that would
  /// pass it fails with kPoolExhausted and changes nothing.
  std::int64_t memory_limit_bytes = 0;
  /// Streams that share one staging record: streams s and t with s / n == t / n take every token
  /// together (one push of its position, thought and segment for all of them; each commits the
  /// group when it is full). ThinKvCache sets it to a sequence's layers x KV heads, so a decode
  /// step records each sequence's token once, not once per stream. 1: every stream on its own
  /// (PagedKvCache's per-stream append needs 1). Must divide num_streams.
  int stage_set_streams = 1;

  /// The storage part (what a backend's init takes).
  [[nodiscard]] const StorageConfig& storage() const noexcept { return *this; }

  /// Checks every field (storage first); the message names the bad value and the allowed range.
  [[nodiscard]] Status validate() const {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    THINKV_RETURN_IF_ERROR(StorageConfig::validate());
    for (Precision p : kAllPrecisions) {
      if (precision.uses(p) && pool_blocks[static_cast<int>(p)] == 0) {
        return bad("precision map " + precision.to_string() + " stores thoughts as " + std::string(to_string(p)) +
                   " but pool_blocks[" + std::string(to_string(p)) + "] is 0; allowed: >= 1");
      }
    }
    if (stage_set_streams < 1 || stage_set_streams > num_streams || num_streams % stage_set_streams != 0) {
      return bad("stage_set_streams " + std::to_string(stage_set_streams) + " must divide num_streams " +
                 std::to_string(num_streams) + "; allowed: 1 (each stream on its own) or a divisor");
    }
    if (memory_limit_bytes < 0) {
      return bad("memory_limit_bytes " + std::to_string(memory_limit_bytes) +
                 " is negative; allowed: 0 (no limit) or >= " + std::to_string(fixed_bytes()));
    }
    if (memory_limit_bytes > 0 && memory_limit_bytes < fixed_bytes()) {
      return bad("memory_limit_bytes " + std::to_string(memory_limit_bytes) + " is below the " +
                 std::to_string(fixed_bytes()) + " bytes the " + std::to_string(num_streams) +
                 " streams' staging buffers and headers take before any page; allowed: 0 (no limit) or >= " +
                 std::to_string(fixed_bytes()));
    }
    return Status::ok();
  }

  friend bool operator==(const CacheConfig&, const CacheConfig&) = default;
};

inline std::ostream& operator<<(std::ostream& os, const CacheConfig& c) {
  return os << "CacheConfig{streams=" << c.num_streams << ", head_dim=" << c.head_dim << ", g=" << c.group_size
            << ", block=" << c.block_size << ", map=" << c.precision << ", pools={" << c.pool_blocks[0] << ","
            << c.pool_blocks[1] << "," << c.pool_blocks[2] << "," << c.pool_blocks[3]
            << "}, records=" << c.record_capacity << ", chunk=" << c.chunk_blocks << ", limit=" << c.memory_limit_bytes
            << ", stage_set=" << c.stage_set_streams << "}";
}

/// Number of key-scale records a configuration provides: record_capacity, or when that is 0 the
/// worst case, one per slot of every quantized pool (a record stays alive while at least one of
/// its slots is live, so records in use never exceed live quantized slots).
inline std::int64_t effective_record_capacity(const StorageConfig& c) noexcept {
  if (c.record_capacity > 0) return c.record_capacity;
  std::int64_t n = 0;
  for (Precision p : kAllPrecisions) {
    if (has_group_scale(p)) n += std::int64_t{c.pool_blocks[static_cast<int>(p)]} * c.block_size;
  }
  return n;
}

/// Byte sizes derived from a validated configuration. All sizes are exact: the CPU backend
/// allocates exactly these, and a device backend must lay its buffers out the same way.
struct CacheLayout {
  int head_dim = 0;
  int group_size = 0;
  int block_size = 0;

  /// Bytes per slot of block metadata: key-scale record id (u32), segment id (u32), position (i32).
  static constexpr int kSlotMetaBytes = 12;
  /// Bytes of per-block header: thought, precision, fill, live, owner stream, padding.
  static constexpr int kBlockHeaderBytes = 16;
  /// Bytes per block-table entry (a u32 block id in the stream's block list).
  static constexpr int kBlockTableEntryBytes = 4;
  /// Bytes of a stream's fixed header: staged count, staged thought, next position, flags (8),
  /// and the FP32 second-level scales for K and V per precision (2 x 4 x 4 = 32).
  static constexpr int kStreamHeaderBytes = thinkv::kStreamHeaderBytes;
  /// Bytes of a key-scale record beyond its head_dim E4M3 scales: refcount (u32), owner (u32).
  static constexpr int kRecordHeaderBytes = 8;

  static CacheLayout from(const StorageConfig& c) { return {c.head_dim, c.group_size, c.block_size}; }

  /// Packed bytes of one token's key (or value) row at precision p.
  [[nodiscard]] constexpr int row_bytes(Precision p) const noexcept { return (head_dim * bits_of(p) + 7) / 8; }
  /// Value-scale bytes per slot: one E4M3 scale per g channels (none for BF16).
  [[nodiscard]] constexpr int value_scale_bytes(Precision p) const noexcept {
    return has_group_scale(p) ? head_dim / group_size : 0;
  }
  /// Data bytes of one slot: K row + V row + value scales.
  [[nodiscard]] constexpr int slot_data_bytes(Precision p) const noexcept {
    return 2 * row_bytes(p) + value_scale_bytes(p);
  }
  /// Bytes one commit of a staging group stores at precision p: g slots' data, plus the key-scale
  /// record's head_dim E4M3 scales when p is quantized.
  [[nodiscard]] constexpr std::int64_t commit_bytes(Precision p) const noexcept {
    return std::int64_t{group_size} * slot_data_bytes(p) + (has_group_scale(p) ? head_dim : 0);
  }
  /// Data bytes of one page (block) at precision p: what the pool allocates per block.
  [[nodiscard]] constexpr std::int64_t page_bytes(Precision p) const noexcept {
    return std::int64_t{block_size} * slot_data_bytes(p);
  }
  /// Where slot `slot`'s bytes lie in a page at precision p: its K row at k, its V row at v (each
  /// `row` bytes) and its value scales at scales (`scale_bytes` bytes). `ok` is false for an
  /// unknown precision or a slot outside the block.
  struct SlotBytes {
    std::size_t k = 0, v = 0, row = 0, scales = 0, scale_bytes = 0;
    bool ok = false;
  };
  [[nodiscard]] constexpr SlotBytes slot_bytes(Precision p, int slot) const noexcept {
    const int row = row_bytes(p), vsb = value_scale_bytes(p);
    if (row < 0 || vsb < 0 || slot < 0 || slot >= block_size) return {};
    const std::size_t r = static_cast<unsigned>(row), v = static_cast<unsigned>(vsb), i = static_cast<unsigned>(slot),
                      bs = static_cast<unsigned>(block_size);
    return {i * r, (bs + i) * r, r, 2 * bs * r + i * v, v, true};
  }
  /// Zeroes slot `slot`'s bytes (its K row, V row and value scales) in a page at precision p.
  constexpr void clear_slot(std::span<std::uint8_t> page, Precision p, int slot) const noexcept {
    const SlotBytes b = slot_bytes(p, slot);
    if (!b.ok) return;
    for (std::size_t c = 0; c < b.row; ++c) {
      page[b.k + c] = 0;
      page[b.v + c] = 0;
    }
    for (std::size_t c = 0; c < b.scale_bytes; ++c) page[b.scales + c] = 0;
  }
  /// Whether slot `slot`'s bytes (K row, V row, value scales) in a page at precision p are all zero,
  /// as clear_slot leaves them.
  [[nodiscard]] constexpr bool slot_is_clear(std::span<const std::uint8_t> page, Precision p, int slot) const noexcept {
    const SlotBytes b = slot_bytes(p, slot);
    if (!b.ok) return false;
    std::uint8_t any = 0;
    for (std::size_t c = 0; c < b.row; ++c) any |= page[b.k + c] | page[b.v + c];
    for (std::size_t c = 0; c < b.scale_bytes; ++c) any |= page[b.scales + c];
    return any == 0;
  }
  /// 64-bit words of a block's eviction mask.
  [[nodiscard]] constexpr int evict_mask_words() const noexcept { return (block_size + 63) / 64; }
  /// Metadata bytes of one block: header + eviction mask + per-slot metadata.
  [[nodiscard]] constexpr std::int64_t block_meta_bytes() const noexcept {
    return kBlockHeaderBytes + 8 * evict_mask_words() + std::int64_t{kSlotMetaBytes} * block_size;
  }
  /// Bytes of one key-scale record: head_dim E4M3 key scales + header.
  [[nodiscard]] constexpr std::int64_t record_bytes() const noexcept { return head_dim + kRecordHeaderBytes; }
  /// Bytes of one stream's staging buffer: g tokens of K and V in BF16.
  [[nodiscard]] constexpr std::int64_t staging_bytes() const noexcept {
    return std::int64_t{2} * group_size * head_dim * 2;
  }
  /// Bytes a stream always holds: its staging buffer and its header.
  [[nodiscard]] constexpr std::int64_t stream_fixed_bytes() const noexcept {
    return staging_bytes() + kStreamHeaderBytes;
  }
  /// Bytes one allocated block costs at precision p: its page, its block metadata and the
  /// block-table entry that names it when held.
  [[nodiscard]] constexpr std::int64_t block_bytes(Precision p) const noexcept {
    return page_bytes(p) + block_meta_bytes() + kBlockTableEntryBytes;
  }
  /// FullKV FP16 bytes of `tokens` tokens of one stream (K and V, 2 bytes each).
  [[nodiscard]] constexpr std::int64_t fullkv_fp16_bytes(std::int64_t tokens) const noexcept {
    return tokens * 2 * head_dim * 2;
  }
};

}  // namespace thinkv
