/// \file bench/gather_compaction/gather_compaction.cu (the gather baseline, not in thinkv::kernels)
/// Gather-compaction of the paged cache (thinkv/kernels/gather_compaction.hpp): the copy a
/// token-level eviction method must make to keep a stream's live tokens contiguous. ThinKV itself
/// never runs it; the benchmark measures what Continuous Thinking avoids.
///
/// Design. Grid (listed stream i, split c), kThreads threads per CTA, no workspace.
///  1. Count: every CTA of stream i walks the stream's whole source block list (block id, fill,
///     eviction-mask words: ~14 bytes per block, L2 hits after the first CTA) and reduces the
///     live count of the blocks before its chunk (its first output position) and of all blocks
///     (L, which sizes the destination). It also checks the block ids (in range, all in the pool
///     of the first source block, destination blocks too); a bad stream is skipped as a whole
///     (uniform decision through __syncthreads_or), with live_counts[i] = -1.
///  2. Destination metadata: CTA c writes block_fill / zero mask / ~0u records past the fill of
///     destination blocks c, c + splits, ... (each destination block by exactly one CTA).
///  3. Copy: CTA c's chunk is the source blocks [nb c / splits, nb (c + 1) / splits). It walks
///     the chunk's slots in tiles of kTile (kItems consecutive slots per thread), flags the live
///     ones, a block-wide exclusive scan gives each live slot its output position, and the
///     (source, destination) slot pairs of the tile go to shared memory (the key-scale record id
///     is copied right there). Then all threads copy the tile's tokens as one flat list of work
///     items, per token: K row units, V row units, value-scale units; consecutive threads take
///     consecutive units (coalesced), kUnroll loads in flight per thread before the stores. A
///     row unit is the widest of 16/8/4/2/1 bytes dividing the row size, the page size and both
///     pool base addresses (value scales likewise): 16 bytes for rows and 8 for value scales at
///     Llama-3-8B shapes. Measured on an H200 (bench_gather_compaction, 50% evicted, 32 layers
///     in one launch): ~80% of 4.3 TB/s for BF16 (256-byte rows), ~50-55% for NVFP4 (64-byte
///     rows at random live slots; the extra CTAs/unroll variants tried did not move it).
/// Barriers: every __syncthreads / __syncthreads_or is reached by all threads of the CTA (loop
/// bounds and early exits depend only on values uniform across the CTA).

#include <cuda_runtime.h>

#include <cstdint>

#include "gather_compaction.hpp"
#include "thinkv/paged/layout.hpp"

namespace thinkv::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 4;                 // consecutive slots per thread per tile
constexpr int kTile = kThreads * kItems;  // slots per tile
constexpr int kUnroll = 2;                // loads in flight per thread in the copy loop
// Resident CTAs per SM: 8 x 256 threads needs <= 32 registers per thread (ptxas: 32, no spills
// for sm_90a). On an H200, 8 x 2 x 16 bytes in flight per thread beat 4 x 4 or 4 x 8 with larger
// tiles by 5-10% on NVFP4 rows and matched them on BF16.
constexpr int kCtasPerSm = 8;
constexpr std::uint32_t kNoRecordId = 0xFFFFFFFFu;

struct Args {
  const std::uint8_t* src_pages[kNumPrecisions];
  std::uint8_t* dst_pages[kNumPrecisions];
  unsigned long long page_bytes[kNumPrecisions];
  std::uint32_t pool_base[kNumPrecisions];
  int row_bytes[kNumPrecisions];
  int vs_bytes[kNumPrecisions];
  int row_w[kNumPrecisions];  // copy width (bytes) of K/V rows
  int vs_w[kNumPrecisions];   // copy width (bytes) of value scales
  std::uint32_t total_blocks;
  int num_src_streams;
  int block_size;
  int mask_words;
  const std::uint16_t* src_fill;
  const std::uint64_t* src_mask;
  const std::uint32_t* src_record;
  const std::int32_t* src_indptr;
  const std::uint32_t* src_indices;
  const std::int32_t* streams;
  const std::int32_t* dst_indptr;
  const std::uint32_t* dst_indices;
  std::uint16_t* dst_fill;
  std::uint64_t* dst_mask;
  std::uint32_t* dst_record;
  std::int32_t* live_counts;
};

/// arr[p] with constant indices only (a dynamic index into a kernel parameter array would force
/// the parameter block into local memory).
template <class T>
__device__ __forceinline__ T pick(const T (&arr)[kNumPrecisions], int p) {
  return p == 0 ? arr[0] : p == 1 ? arr[1] : p == 2 ? arr[2] : arr[3];
}

/// PoolMap::precision_of.
__device__ __forceinline__ int pool_of(const Args& a, std::uint32_t b) {
#pragma unroll
  for (int p = kNumPrecisions - 1; p > 0; --p) {
    if (b >= a.pool_base[p]) return p;
  }
  return 0;
}

/// Live slots of block b: slots < fill whose eviction bit is clear.
__device__ __forceinline__ int block_live(const Args& a, std::uint32_t b) {
  int fill = a.src_fill[b];
  if (fill > a.block_size) fill = a.block_size;
  int evicted = 0;
  const std::uint64_t* m = a.src_mask + static_cast<std::size_t>(b) * a.mask_words;
  for (int w = 0; w * 64 < fill; ++w) {
    const int n = fill - w * 64;  // slots of this word below the fill
    const std::uint64_t below = n >= 64 ? ~0ull : ((1ull << n) - 1ull);
    evicted += __popcll(m[w] & below);
  }
  return fill - evicted;
}

/// Block-wide sum of two ints; every thread gets the result. `red` holds kWarps entries.
__device__ __forceinline__ int2 block_sum2(int2 v, int2* red) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xFFFFFFFFu, v.x, o);
    v.y += __shfl_xor_sync(0xFFFFFFFFu, v.y, o);
  }
  if (lane == 0) red[warp] = v;
  __syncthreads();
  int2 r = make_int2(0, 0);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    r.x += red[w].x;
    r.y += red[w].y;
  }
  __syncthreads();  // red may be reused
  return r;
}

/// Block-wide exclusive prefix sum of v; `total` gets the sum over the CTA. `sums`: kWarps ints.
__device__ __forceinline__ int block_exclusive_scan(int v, int* sums, int& total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xFFFFFFFFu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sums[warp] = x;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int s = sums[w];
    before += w < warp ? s : 0;
    total += s;
  }
  __syncthreads();  // sums may be reused
  return before + x - v;
}

/// The slot pairs of one tile (pool-local block indices, slots).
struct TileList {
  std::uint32_t src_block[kTile];
  std::uint32_t dst_block[kTile];
  std::uint16_t src_slot[kTile];
  std::uint16_t dst_slot[kTile];
};

/// Loads w bytes (16, 8, 4, 2 or 1; p aligned to w) into the low bytes of a uint4.
__device__ __forceinline__ uint4 load_w(const std::uint8_t* p, int w) {
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  switch (w) {
    case 16: r = *reinterpret_cast<const uint4*>(p); break;
    case 8: {
      const uint2 x = *reinterpret_cast<const uint2*>(p);
      r.x = x.x;
      r.y = x.y;
      break;
    }
    case 4: r.x = *reinterpret_cast<const std::uint32_t*>(p); break;
    case 2: r.x = *reinterpret_cast<const std::uint16_t*>(p); break;
    default: r.x = *p; break;
  }
  return r;
}

/// Stores the low w bytes of v (p aligned to w).
__device__ __forceinline__ void store_w(std::uint8_t* p, int w, uint4 v) {
  switch (w) {
    case 16: *reinterpret_cast<uint4*>(p) = v; break;
    case 8: *reinterpret_cast<uint2*>(p) = make_uint2(v.x, v.y); break;
    case 4: *reinterpret_cast<std::uint32_t*>(p) = v.x; break;
    case 2: *reinterpret_cast<std::uint16_t*>(p) = static_cast<std::uint16_t>(v.x); break;
    default: *p = static_cast<std::uint8_t>(v.x); break;
  }
}

/// How one token's bytes are cut into work items: nr units of wr bytes per K row and per V row
/// (a row of slot s at (kv * B + s) * rb in the page), then nv units of wv bytes of value scales
/// (at vs_base + s * vs). Units are consecutive in memory within a segment.
struct TokenPlan {
  unsigned long long page_bytes;
  int block_size, rb, vs, wr, wv, nr, nv;
  unsigned vs_base;
};

/// Copies the first n tokens of the tile list: all their work items as one flat list, kUnroll
/// loads in flight per thread before the stores; consecutive threads take consecutive units.
__device__ __forceinline__ void copy_tile(const TileList& t, int n, const std::uint8_t* src, std::uint8_t* dst,
                                          const TokenPlan& tp) {
  const int per_tok = 2 * tp.nr + tp.nv;
  const int items = n * per_tok;
  for (int base = static_cast<int>(threadIdx.x); base < items; base += kUnroll * kThreads) {
    uint4 v[kUnroll];
    std::uint8_t* d[kUnroll];
    int w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int it = base + u * kThreads;
      d[u] = nullptr;
      w[u] = 1;
      v[u] = make_uint4(0u, 0u, 0u, 0u);
      if (it < items) {
        const int tok = it / per_tok;
        const int r = it - tok * per_tok;
        const unsigned ss = t.src_slot[tok];
        const unsigned ds = t.dst_slot[tok];
        unsigned so, dof;
        if (r < 2 * tp.nr) {
          const int seg = r >= tp.nr ? 1 : 0;
          const unsigned in_row = static_cast<unsigned>((r - seg * tp.nr) * tp.wr);
          const unsigned seg_base = static_cast<unsigned>(seg * tp.block_size);
          so = (seg_base + ss) * static_cast<unsigned>(tp.rb) + in_row;
          dof = (seg_base + ds) * static_cast<unsigned>(tp.rb) + in_row;
          w[u] = tp.wr;
        } else {
          const unsigned in_vs = static_cast<unsigned>((r - 2 * tp.nr) * tp.wv);
          so = tp.vs_base + ss * static_cast<unsigned>(tp.vs) + in_vs;
          dof = tp.vs_base + ds * static_cast<unsigned>(tp.vs) + in_vs;
          w[u] = tp.wv;
        }
        v[u] = load_w(src + t.src_block[tok] * tp.page_bytes + so, w[u]);
        d[u] = dst + t.dst_block[tok] * tp.page_bytes + dof;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (d[u] != nullptr) store_w(d[u], w[u], v[u]);
    }
  }
}

__global__ void __launch_bounds__(kThreads, kCtasPerSm) gather_compaction_kernel(const Args a) {
  __shared__ TileList list;
  __shared__ int2 red[kWarps];
  __shared__ int scan_sums[kWarps];

  const int i = static_cast<int>(blockIdx.x);  // position in the stream list
  const int split = static_cast<int>(blockIdx.y);
  const int splits = static_cast<int>(gridDim.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int B = a.block_size;

  // ---- the stream, its lists and its pool (all uniform across the CTA) ----
  const int s = a.streams[i];
  bool bad = s < 0 || s >= a.num_src_streams;
  int sb = 0, nb = 0;
  if (!bad) {
    sb = a.src_indptr[s];
    nb = a.src_indptr[s + 1] - sb;
    bad = sb < 0 || nb < 0;
  }
  const int db = a.dst_indptr[i];
  const int nd = a.dst_indptr[i + 1] - db;
  bad = bad || db < 0 || nd < 0;
  if (bad) nb = 0;
  int pool = -1;  // pool of the stream's first source block; -1 when it has none
  if (nb > 0) {
    const std::uint32_t b0 = a.src_indices[sb];
    if (b0 < a.total_blocks) pool = pool_of(a, b0);
  }
  // Chunk [cb, ce) of the source list. Slot counts fit in int: the pools hold < 2^31 slots.
  const int cb = static_cast<int>(static_cast<long long>(nb) * split / splits);
  const int ce = static_cast<int>(static_cast<long long>(nb) * (split + 1) / splits);

  // ---- 1. count live slots (before the chunk, and in all) and check block ids ----
  int2 cnt = make_int2(0, 0);  // x: live slots in blocks < cb, y: all live slots
  bool my_bad = bad;
  for (int j = tid; j < nb; j += kThreads) {
    const std::uint32_t b = a.src_indices[sb + j];
    if (b >= a.total_blocks || pool_of(a, b) != pool) {
      my_bad = true;
      continue;
    }
    const int live = block_live(a, b);
    cnt.y += live;
    if (j < cb) cnt.x += live;
  }
  if (!bad) {
    for (int j = tid; j < nd; j += kThreads) {
      const std::uint32_t d = a.dst_indices[db + j];
      if (d >= a.total_blocks || (pool >= 0 && pool_of(a, d) != pool)) my_bad = true;
    }
  }
  if (__syncthreads_or(my_bad ? 1 : 0) != 0) {
    if (split == 0 && tid == 0 && a.live_counts != nullptr) a.live_counts[i] = -1;
    return;  // uniform: every thread of the CTA leaves here
  }
  cnt = block_sum2(cnt, red);
  const int live_total = cnt.y;
  const long long cap = static_cast<long long>(nd) * B;
  const int n_out = live_total < cap ? live_total : static_cast<int>(cap);
  if (split == 0 && tid == 0 && a.live_counts != nullptr) a.live_counts[i] = live_total;

  // ---- 2. destination metadata of blocks split, split + splits, ... ----
  for (int j = split; j < nd; j += splits) {
    const std::uint32_t d = a.dst_indices[db + j];
    const long long rest = static_cast<long long>(n_out) - static_cast<long long>(j) * B;
    const int fill = rest <= 0 ? 0 : (rest >= B ? B : static_cast<int>(rest));
    if (tid == 0) a.dst_fill[d] = static_cast<std::uint16_t>(fill);
    for (int w = tid; w < a.mask_words; w += kThreads) {
      a.dst_mask[static_cast<std::size_t>(d) * a.mask_words + w] = 0;
    }
    for (int sl = fill + tid; sl < B; sl += kThreads) {
      a.dst_record[static_cast<std::size_t>(d) * B + sl] = kNoRecordId;
    }
  }
  if (pool < 0) return;  // no source block: nothing to copy (uniform)

  // ---- 3. copy the chunk's live slots, tile by tile ----
  const std::uint8_t* src_pool = pick(a.src_pages, pool);
  std::uint8_t* dst_pool = pick(a.dst_pages, pool);
  const std::uint32_t base = pick(a.pool_base, pool);
  TokenPlan tp;
  tp.page_bytes = pick(a.page_bytes, pool);
  tp.block_size = B;
  tp.rb = pick(a.row_bytes, pool);
  tp.vs = pick(a.vs_bytes, pool);
  tp.wr = pick(a.row_w, pool);
  tp.wv = pick(a.vs_w, pool);
  tp.nr = tp.rb / tp.wr;
  tp.nv = tp.vs / tp.wv;  // 0 for BF16
  tp.vs_base = 2u * static_cast<unsigned>(B) * static_cast<unsigned>(tp.rb);
  const int n_slots = (ce - cb) * B;
  int running = cnt.x;  // output position of the tile's first live slot
  for (int tile0 = 0; tile0 < n_slots && running < n_out; tile0 += kTile) {
    // kItems consecutive slots of the chunk per thread: block cb + q / B, slot q % B.
    const unsigned q0 = static_cast<unsigned>(tile0) + static_cast<unsigned>(tid) * kItems;
    unsigned j = q0 / static_cast<unsigned>(B);
    int sl = static_cast<int>(q0 - j * static_cast<unsigned>(B));
    j += static_cast<unsigned>(cb);
    const unsigned q_end = static_cast<unsigned>(n_slots);
    std::uint32_t blk[kItems];
    int slot[kItems];
    unsigned live_bits = 0;
    std::uint32_t b = 0;
    int fill = 0;
    unsigned cached_j = 0xFFFFFFFFu;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      blk[k] = 0;
      slot[k] = sl;
      if (q0 + static_cast<unsigned>(k) < q_end) {
        if (j != cached_j) {  // a new block: its id and fill
          b = a.src_indices[sb + static_cast<int>(j)];
          fill = a.src_fill[b];
          cached_j = j;
        }
        blk[k] = b;
        const std::uint64_t w = a.src_mask[static_cast<std::size_t>(b) * a.mask_words + (sl >> 6)];
        if (sl < fill && ((w >> (sl & 63)) & 1ull) == 0) live_bits |= 1u << k;
      }
      if (++sl == B) {
        sl = 0;
        ++j;
      }
    }
    int tile_live = 0;
    int e = block_exclusive_scan(__popc(live_bits), scan_sums, tile_live);  // my first entry
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      if (((live_bits >> k) & 1u) == 0) continue;
      const int pos = running + e;  // output position
      if (pos < n_out) {
        const std::uint32_t d = a.dst_indices[db + pos / B];
        const int dslot = pos % B;
        list.src_block[e] = blk[k] - base;
        list.src_slot[e] = static_cast<std::uint16_t>(slot[k]);
        list.dst_block[e] = d - base;
        list.dst_slot[e] = static_cast<std::uint16_t>(dslot);
        a.dst_record[static_cast<std::size_t>(d) * B + dslot] =
            a.src_record[static_cast<std::size_t>(blk[k]) * B + slot[k]];
      }
      ++e;
    }
    __syncthreads();  // the tile list is complete
    const int room = n_out - running;
    copy_tile(list, tile_live < room ? tile_live : room, src_pool, dst_pool, tp);
    running += tile_live;
    __syncthreads();  // the list may be overwritten by the next tile
  }
}

bool pool_map_ok(const PagedKvView& v) noexcept {
  std::uint64_t total = 0;
  for (int p = 0; p < kNumPrecisions; ++p) {
    if (v.pool_base[p] != total) return false;
    total += v.pool_count[p];
  }
  return total == v.total_blocks;
}

/// Widest copy unit (16, 8, 4, 2, 1 bytes) dividing every offset and address of a segment.
int copy_width_for(std::uint64_t seg_bytes, std::uint64_t page_bytes, std::uint64_t seg_base, const void* src,
                   const void* dst) noexcept {
  const std::uint64_t bits = seg_bytes | page_bytes | seg_base |
                             static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(src)) |
                             static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(dst));
  for (int w = 16; w > 1; w >>= 1) {
    if ((bits & static_cast<std::uint64_t>(w - 1)) == 0) return w;
  }
  return 1;
}

}  // namespace

int gather_compaction_splits(const GatherCompactionParams& p) noexcept {
  if (p.num_splits > 0) return p.num_splits < kMaxGatherSplits ? p.num_splits : kMaxGatherSplits;
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) {
    (void)cudaGetLastError();
    sms = 132;
  }
  const long long n = p.num_streams > 0 ? p.num_streams : 1;
  long long splits = (static_cast<long long>(kCtasPerSm) * sms + n - 1) / n;  // about one wave
  if (splits < 1) splits = 1;
  if (splits > kMaxGatherSplits) splits = kMaxGatherSplits;
  return static_cast<int>(splits);
}

cudaError_t check_gather_compaction(const GatherCompactionParams& p) noexcept {
  const PagedKvView& v = p.src;
  const bool group_ok = p.group_size == 8 || p.group_size == 16 || p.group_size == 32;
  if (!group_ok || p.head_dim < 1 || p.head_dim > 1024 || p.head_dim % p.group_size != 0 || p.block_size < 1 ||
      p.block_size > 4096) {
    return cudaErrorInvalidValue;
  }
  if (p.num_streams < 1 || p.num_splits < 0 || p.num_splits > kMaxGatherSplits) return cudaErrorInvalidValue;
  if (p.streams == nullptr || p.dst_indptr == nullptr || p.dst_indices == nullptr || p.dst_block_fill == nullptr ||
      p.dst_evict_mask == nullptr || p.dst_slot_record == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (v.num_streams < 1 || v.block_fill == nullptr || v.evict_mask == nullptr || v.slot_record == nullptr ||
      v.block_indptr == nullptr || v.block_indices == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (!pool_map_ok(v)) return cudaErrorInvalidValue;
  // Slot and record ids are 32-bit and positions int: fewer than 2^31 slots in all.
  if (static_cast<std::uint64_t>(v.total_blocks) * static_cast<std::uint64_t>(p.block_size) >=
      (std::uint64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  for (int i = 0; i < kNumPrecisions; ++i) {
    if (v.pool_count[i] > 0 && (v.pages[i] == nullptr || p.dst_pages[i] == nullptr)) { return cudaErrorInvalidValue; }
  }
  return cudaSuccess;
}

cudaError_t launch_gather_compaction(const GatherCompactionParams& p, cudaStream_t stream) noexcept {
  if (cudaError_t e = check_gather_compaction(p); e != cudaSuccess) return e;
  const PagedKvView& v = p.src;
  Args a{};
  const int B = p.block_size;
  const CacheLayout L{p.head_dim, p.group_size, B};
  for (int i = 0; i < kNumPrecisions; ++i) {
    const auto prec = static_cast<Precision>(i);
    const int rb = L.row_bytes(prec);
    const int vs = L.value_scale_bytes(prec);
    const std::uint64_t page = static_cast<std::uint64_t>(L.page_bytes(prec));
    a.src_pages[i] = v.pages[i];
    a.dst_pages[i] = p.dst_pages[i];
    a.page_bytes[i] = page;
    a.pool_base[i] = v.pool_base[i];
    a.row_bytes[i] = rb;
    a.vs_bytes[i] = vs;
    a.row_w[i] = copy_width_for(static_cast<std::uint64_t>(rb), page, 0, v.pages[i], p.dst_pages[i]);
    a.vs_w[i] = vs > 0 ? copy_width_for(static_cast<std::uint64_t>(vs), page,
                                        2ull * static_cast<std::uint64_t>(B) * static_cast<std::uint64_t>(rb),
                                        v.pages[i], p.dst_pages[i])
                       : 1;
  }
  a.total_blocks = v.total_blocks;
  a.num_src_streams = v.num_streams;
  a.block_size = B;
  a.mask_words = (B + 63) / 64;
  a.src_fill = v.block_fill;
  a.src_mask = v.evict_mask;
  a.src_record = v.slot_record;
  a.src_indptr = v.block_indptr;
  a.src_indices = v.block_indices;
  a.streams = p.streams;
  a.dst_indptr = p.dst_indptr;
  a.dst_indices = p.dst_indices;
  a.dst_fill = p.dst_block_fill;
  a.dst_mask = p.dst_evict_mask;
  a.dst_record = p.dst_slot_record;
  a.live_counts = p.live_counts;
  const dim3 grid(static_cast<unsigned>(p.num_streams), static_cast<unsigned>(gather_compaction_splits(p)));
  gather_compaction_kernel<<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace thinkv::bench
