/// \file quantize_append.cu
/// Quantize-append: flushes full staging groups of many streams into their planned page slots,
/// bit-identical to CpuKvBackend::commit.
///
/// Design. One CTA per (job, K or V), min(256, D rounded up to 32) threads, no dynamic shared
/// memory. Every warp first checks the job (stream, precision, record, and that every destination
/// slot lies in the precision's pool: a warp vote, the same in every warp, so a bad job writes
/// nothing) and computes the byte offsets of the g destination rows (and value-scale areas), lane
/// i holding row i's, which the loops below fetch by shuffles: no barrier. For a quantized
/// precision it reads s2 of (stream, K/V, precision); when it is unset (0) the CTA reduces the
/// amax of the g x D staged values (warp shuffles + one shared array) and, when that is nonzero,
/// sets s2 = choose_stream_scale(P, amax), as the CPU does. Then:
///  - K: one thread per channel: it quantizes the channel's group (the g tokens of the channel)
///    and writes the channel's E4M3 scale into the record; the e = 8 / bits channels of a row byte
///    are adjacent lanes, which combine their codes by shuffles, and the first writes that byte of
///    each of the g destination rows;
///  - V: one thread per (token, value group): quantizes the g channels, writes the E4M3 scale into
///    the slot's value-scale area and the g*bits/8 packed bytes into the token's V row;
///  - BF16: the rows are copied as little-endian BF16.
/// Every value goes through the THINKV_HD functions the CPU backend's quantize_group is made of
/// (decode_bf16, group_amax, group_scale_saturates, fp_group_scale_code, fp_element_code,
/// ternary_scale_of_sorted, ternary_element_code, choose_stream_scale), on identical inputs in
/// identical order, so results are bit-identical by construction (no fast-math: the element codes
/// divide with IEEE division); the ternary scale's descending sort is a network in registers
/// (sort_descending_network, the same sequence of values as the CPU's insertion sort; unit-tested
/// against quantize_group). The offset helpers below are __host__ __device__. Occupancy: launch
/// bounds of 6 x 256 threads (40 registers) for g = 8 and 16, so 12 CTAs of D = 128 threads share
/// an SM (measured on the H200: see kMinBlocks and docs/perf-history.md, 2026-11-30 08:22 UTC).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "thinkv/formats/bf16.hpp"
#include "thinkv/formats/group_quant.hpp"
#include "thinkv/kernels/quantize_append.hpp"
#include "thinkv/paged/layout.hpp"

namespace thinkv::kernels {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kBf16 = static_cast<int>(Precision::kBf16);

/// The job's own fields are usable: stream in range, a precision with a non-empty pool, and a
/// record in range for quantized precisions.
THINKV_HD inline bool job_ok(const QuantizeAppendView& v, const QuantizeAppendJob& job) noexcept {
  const int p = static_cast<int>(job.precision);
  if (job.stream < 0 || job.stream >= v.num_streams) return false;
  if (p < 0 || p >= kNumPrecisions || v.pool_count[p] == 0) return false;
  return p == kBf16 || job.record < v.num_records;
}

/// Global slot id `id` lies in a block of pool p (p valid).
THINKV_HD inline bool dest_ok(const QuantizeAppendView& v, int p, std::uint32_t id) noexcept {
  const std::uint32_t block = id / static_cast<std::uint32_t>(v.block_size);
  return block - v.pool_base[p] < v.pool_count[p];  // unsigned: also false for block < base
}

/// Byte offsets, from pages[p], of slot `id`'s K (kv = 0) or V (kv = 1) row and of its value
/// scales (CpuKvBackend::row_ptr / value_scales_ptr).
struct SlotOffsets {
  std::size_t row;
  std::size_t value_scales;
};
THINKV_HD inline SlotOffsets slot_offsets(const QuantizeAppendView& v, int p, std::uint32_t id, int kv) noexcept {
  const auto bs = static_cast<std::uint32_t>(v.block_size);
  const std::uint32_t block = id / bs;
  const std::uint32_t slot = id % bs;
  const CacheLayout L{v.head_dim, v.group_size, v.block_size};  // row and page sizes
  const auto prec = static_cast<Precision>(p);
  const std::size_t page =
      static_cast<std::size_t>(block - v.pool_base[p]) * static_cast<std::size_t>(L.page_bytes(prec));
  const auto rb = static_cast<std::size_t>(L.row_bytes(prec));
  SlotOffsets o;
  o.row = page + (static_cast<std::size_t>(kv) * bs + slot) * rb;
  o.value_scales = page + 2 * static_cast<std::size_t>(bs) * rb +
                   static_cast<std::size_t>(slot) * static_cast<std::size_t>(v.head_dim / v.group_size);
  return o;
}

/// Max |x| over stg[k], k = start, start + stride, ... < n (the CPU's group_amax over the whole
/// staged K or V group, split over threads; max is order-independent for finite values).
THINKV_HD inline float staged_amax_partial(const std::uint16_t* stg, int n, int start, int stride) noexcept {
  float m = 0.0f;
  for (int k = start; k < n; k += stride) {
    const float a = abs_float(decode_bf16(stg[k]));
    if (a > m) m = a;
  }
  return m;
}

#ifndef THINKV_QA_ELEMENT_UNROLL
#define THINKV_QA_ELEMENT_UNROLL 1
#endif
/// Unroll factor of the per-element loops (code, pack, store; THINKV_QA_ELEMENT_UNROLL overrides
/// it for experiments). They are not unrolled: the kernel's paths (three quantized precisions and
/// BF16, K or V) run side by side on an SM, and with every loop fully unrolled the G = 16 kernel
/// was 177 KB of code whose warps waited on instruction fetch for 62% of their stall samples.
/// H200, batch 64 (16,384 jobs, R4E4T2): fully unrolled 552 us, unroll 4 296 us, 2 or 1 265 us
/// (docs/perf-history.md, 2026-11-30 08:22 UTC).
constexpr int kElementUnroll = THINKV_QA_ELEMENT_UNROLL;
#ifndef THINKV_QA_MIN_BLOCKS
#define THINKV_QA_MIN_BLOCKS 6
#endif
/// Launch bounds for g = 8 and 16: CTAs of kMaxThreads per SM (THINKV_QA_MIN_BLOCKS overrides it
/// for experiments). 6 caps the kernel at 40 registers (g = 16 spills 16 bytes), so 12 CTAs of
/// D = 128 threads share an SM. H200, batch 64 (16,384 jobs, R4E4T2): 4 (54 registers) 181 us,
/// 6 173 us, 8 177 us.
constexpr int kMinBlocks = THINKV_QA_MIN_BLOCKS;

/// The scale of one group of G staged values x (loaded into registers by the caller; x is
/// clobbered for ternary), as quantize_group computes it: returns the E4M3 scale code and sets
/// `use` to what the element codes need (FP8 / NVFP4: the group scale decode_e4m3(code) * s2, or
/// 0 for an all-zero group, whose codes are all 0; ternary: a = decode_e4m3(code) * s2) and
/// `saturated` to the CPU backend's saturation test.
template <int P, int G>
__device__ __forceinline__ std::uint8_t group_scale(float (&x)[G], float s2, float& use, bool& saturated) {
  constexpr Precision kP = static_cast<Precision>(P);
  const float amax = group_amax(x, 1, G);
  saturated = group_scale_saturates(kP, amax, s2);
  std::uint8_t scale = 0;
  if constexpr (kP == Precision::kTernary) {
#pragma unroll
    for (int i = 0; i < G; ++i) x[i] = abs_float(x[i]);
    sort_descending_network(x);
    scale = encode_e4m3(ternary_scale_of_sorted(x, G) / s2);
    use = decode_e4m3(scale) * s2;
  } else {
    if (amax != 0.0f) scale = fp_group_scale_code(kP, amax, s2);
    use = amax != 0.0f ? decode_e4m3(scale) * s2 : 0.0f;
  }
  return scale;
}

/// The code of staged element x of a group whose scale gave `use` (group_scale). Branch-free: an
/// all-zero FP8 / NVFP4 group (use == 0) divides by 1 and discards the code.
template <int P>
__device__ __forceinline__ std::uint32_t element_code(float x, float use) {
  constexpr Precision kP = static_cast<Precision>(P);
  if constexpr (kP == Precision::kTernary) {
    return ternary_element_code(x, use);
  } else {
    const std::uint32_t code = fp_element_code(kP, x, use != 0.0f ? use : 1.0f);
    return use != 0.0f ? code : 0u;
  }
}

/// Byte offset, from the pool's pages, of destination row i (0 <= i < G): lane i of every warp
/// holds it (`mine`); every lane of the warp must call this.
__device__ __forceinline__ std::size_t lane_offset(std::size_t mine, int i) {
  return static_cast<std::size_t>(__shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine), i));
}

/// K, channel c, one thread per channel (c < d when `active`; every lane of the warp calls it):
/// quantizes the channel's group (the G staged tokens of the channel, token order) and writes its
/// scale to record[c]; the E = 8 / bits channels of one row byte sit on E adjacent lanes, which OR
/// their codes together (element c of a row sits in byte c / E at bit (c % E) * bits, as
/// store_code places it) and the first of them writes byte c / E of each of the G destination K
/// rows. The element codes re-read the staged values (L1 hits) so the loop need not be unrolled;
/// an inactive lane reads channel 0 and codes it with use = 0 (code 0), so only the store is
/// predicated. `row` is this lane's destination row offset (lane_offset). Returns the number of
/// saturated groups (0 or 1).
template <int P, int G>
__device__ inline int key_channel(const std::uint16_t* stg, int d, float s2, std::uint8_t* pool, std::size_t row,
                                  std::uint8_t* record, int c, bool active) {
  constexpr int kBits = bits_of(static_cast<Precision>(P));
  constexpr int kPerByte = 8 / kBits;
  const std::uint16_t* src = stg + (active ? c : 0);
  bool saturated = false;
  float use = 0.0f;
  if (active) {
    float x[G];
#pragma unroll
    for (int i = 0; i < G; ++i) x[i] = decode_bf16(src[static_cast<std::size_t>(i) * d]);
    record[c] = group_scale<P, G>(x, s2, use, saturated);
  }
  const unsigned shift = static_cast<unsigned>((c % kPerByte) * kBits);
  const bool writer = active && shift == 0u;
  std::uint8_t* dst = pool + c / kPerByte;
#pragma unroll kElementUnroll
  for (int i = 0; i < G; ++i, src += d) {
    std::uint32_t byte = element_code<P>(decode_bf16(*src), use) << shift;
#pragma unroll
    for (int off = 1; off < kPerByte; off <<= 1) byte |= __shfl_xor_sync(0xFFFFFFFFu, byte, off);
    const std::size_t o = lane_offset(row, i);
    if (writer) dst[o] = static_cast<std::uint8_t>(byte);
  }
  return saturated ? 1 : 0;
}

/// V, item = (token i, value group j), j < d / G (when `active`; every lane of the warp calls it):
/// quantizes channels j*G .. j*G+G-1 of token i, writes the scale to the slot's value scale j and
/// the G * bits / 8 packed bytes into its V row (one byte at a time, its elements re-read from the
/// staging row). `row` and `vs` are this lane's destination row and value-scale offsets
/// (lane_offset). Returns the number of saturated groups (0 or 1).
template <int P, int G>
__device__ inline int value_group(const std::uint16_t* stg, int d, float s2, std::uint8_t* pool, std::size_t row,
                                  std::size_t vs, int item, bool active) {
  constexpr int kBits = bits_of(static_cast<Precision>(P));
  constexpr int kPerByte = 8 / kBits;
  constexpr int kBytes = G * kBits / 8;  // the group starts on a byte boundary (G * bits % 8 == 0)
  const int groups = d / G;
  const int i = active ? item / groups : 0;
  const int j = item - i * groups;
  const std::size_t row_i = lane_offset(row, i);
  const std::size_t vs_i = lane_offset(vs, i);
  if (!active) return 0;
  const std::uint16_t* src = stg + static_cast<std::size_t>(i) * d + static_cast<std::size_t>(j) * G;
  float x[G];
#pragma unroll
  for (int e = 0; e < G; ++e) x[e] = decode_bf16(src[e]);
  bool saturated = false;
  float use = 0.0f;
  pool[vs_i + static_cast<std::size_t>(j)] = group_scale<P, G>(x, s2, use, saturated);
  std::uint8_t* dst = pool + row_i + static_cast<std::size_t>(j) * kBytes;
#pragma unroll kElementUnroll
  for (int b = 0; b < kBytes; ++b, src += kPerByte) {
    std::uint32_t byte = 0u;
#pragma unroll
    for (int e = 0; e < kPerByte; ++e) byte |= element_code<P>(decode_bf16(src[e]), use) << (e * kBits);
    dst[b] = static_cast<std::uint8_t>(byte);
  }
  return saturated ? 1 : 0;
}

/// Max over the CTA of each thread's m (m >= 0). Must be reached by every thread of the CTA.
__device__ float block_max(float m, float* warp_max) {
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xFFFFFFFFu, m, off);
    if (o > m) m = o;
  }
  if ((threadIdx.x & 31u) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  float r = 0.0f;
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int w = 0; w < warps; ++w) {
    if (warp_max[w] > r) r = warp_max[w];
  }
  return r;
}

/// The K or V half of one (validated) job at precision P. Called by every thread of the CTA; lane
/// i < G of every warp holds destination row i's offsets (row, vs).
template <int P, int G>
__device__ void quantize_half(const QuantizeAppendParams& prm, const QuantizeAppendJob& job, int kv, std::size_t row,
                              std::size_t vs, float* warp_max) {
  const QuantizeAppendView& v = prm.cache;
  const int d = v.head_dim;
  const int tid = static_cast<int>(threadIdx.x);
  const int nt = static_cast<int>(blockDim.x);
  const std::uint16_t* stg = v.staging + (static_cast<std::size_t>(job.stream) * 2 + static_cast<std::size_t>(kv)) * G *
                                             static_cast<std::size_t>(d);
  std::uint8_t* pool = v.pages[P];
  // Loops over items with a uniform trip count (whole warps shuffle the row offsets).
  if constexpr (P == kBf16) {
    for (int base = 0; base < G * d; base += nt) {  // element idx of the G x d group
      const int idx = base + tid;
      const bool active = idx < G * d;
      const int i = active ? idx / d : 0;
      const std::size_t o = lane_offset(row, i) + 2 * static_cast<std::size_t>(idx - i * d);
      if (active) {  // little-endian copy (CpuKvBackend::commit)
        const std::uint16_t x = stg[idx];
        pool[o] = static_cast<std::uint8_t>(x & 0xFF);
        pool[o + 1] = static_cast<std::uint8_t>(x >> 8);
      }
    }
  } else {
    constexpr Precision kP = static_cast<Precision>(P);
    float* s2p = v.s2 + (static_cast<std::size_t>(job.stream) * 2 + static_cast<std::size_t>(kv)) * kNumPrecisions + P;
    // Every thread reads s2 before any thread can write it (the write follows block_max's
    // barrier; no other CTA writes this (stream, K/V, precision)), so the branch is uniform.
    float s2 = *s2p;
    if (s2 == 0.0f) {
      // First group of this (stream, K/V, precision) with a nonzero value fixes s2.
      const float amax = block_max(staged_amax_partial(stg, G * d, tid, nt), warp_max);
      if (amax > 0.0f) {
        s2 = choose_stream_scale(kP, amax);
        if (tid == 0) *s2p = s2;
      }
    }
    const float s2_use = s2 > 0.0f ? s2 : 1.0f;
    int saturations = 0;
    if (kv == 0) {
      std::uint8_t* record = v.key_scales + static_cast<std::size_t>(job.record) * d;
      for (int base = 0; base < d; base += nt) {
        saturations += key_channel<P, G>(stg, d, s2_use, pool, row, record, base + tid, base + tid < d);
      }
    } else {
      for (int base = 0; base < d; base += nt) {  // G tokens x d / G groups = d items
        saturations += value_group<P, G>(stg, d, s2_use, pool, row, vs, base + tid, base + tid < d);
      }
    }
    if (saturations > 0 && prm.scale_saturations != nullptr) {
      atomicAdd(prm.scale_saturations, static_cast<unsigned long long>(saturations));
    }
  }
}

/// Grid: 2 * num_jobs CTAs, CTA b = (job b / 2, K if b is even else V). blockDim.x: a multiple of
/// 32, 32..kMaxThreads (>= G). g = 32 keeps the default register budget (its 32-element arrays
/// would spill at 64 registers). Every warp checks the job and computes the G destination
/// offsets itself (lane i: row i), so no barrier is needed unless s2 is unset.
template <int G>
__global__ void __launch_bounds__(kMaxThreads, G == 32 ? 1 : kMinBlocks)
    quantize_append_kernel(const QuantizeAppendParams prm) {
  __shared__ float warp_max[kMaxThreads / 32];
  int job_index = static_cast<int>(blockIdx.x >> 1);
  if (prm.job_range != nullptr) {
    job_index += static_cast<int>(prm.job_range[0]);
    if (job_index >= static_cast<int>(prm.job_range[1])) return;  // the whole CTA: no barrier reached
  }
  const int kv = static_cast<int>(blockIdx.x & 1u);
  const int lane = static_cast<int>(threadIdx.x & 31u);
  // Both loads go out at once (the slot's address does not depend on the job's fields).
  const QuantizeAppendJob job = prm.jobs[job_index];
  const std::uint32_t id =
      prm.dest_slots[static_cast<std::size_t>(job_index) * G + static_cast<std::size_t>(lane < G ? lane : 0)];
  const int p = static_cast<int>(job.precision);
  bool bad = !job_ok(prm.cache, job);  // uniform
  std::size_t row = 0;
  std::size_t vs = 0;
  if (!bad && lane < G) {
    bad = !dest_ok(prm.cache, p, id);
    if (!bad) {
      const SlotOffsets o = slot_offsets(prm.cache, p, id, kv);
      row = o.row;
      vs = o.value_scales;
    }
  }
  // The same verdict in every warp (the same job and slots): a bad job writes nothing.
  if (__any_sync(0xFFFFFFFFu, bad)) {
    if (threadIdx.x == 0 && kv == 0 && prm.rejected_jobs != nullptr) atomicAdd(prm.rejected_jobs, 1u);
    return;
  }
  switch (p) {  // uniform over the CTA
    case 0: quantize_half<0, G>(prm, job, kv, row, vs, warp_max); break;
    case 1: quantize_half<1, G>(prm, job, kv, row, vs, warp_max); break;
    case 2: quantize_half<2, G>(prm, job, kv, row, vs, warp_max); break;
    default: quantize_half<3, G>(prm, job, kv, row, vs, warp_max); break;
  }
}

}  // namespace

cudaError_t check_quantize_append(const QuantizeAppendParams& p) noexcept {
  const QuantizeAppendView& v = p.cache;
  if (v.num_streams < 1 || v.num_streams > kQuantizeAppendMaxStreams) return cudaErrorInvalidValue;
  if (v.group_size != 8 && v.group_size != 16 && v.group_size != 32) return cudaErrorInvalidValue;
  if (v.head_dim < 1 || v.head_dim > kQuantizeAppendMaxHeadDim || v.head_dim % v.group_size != 0) {
    return cudaErrorInvalidValue;
  }
  if (v.block_size < 1 || v.block_size > kQuantizeAppendMaxBlockSize) return cudaErrorInvalidValue;
  std::uint64_t total = 0;
  bool quantized = false;
  for (int i = 0; i < kNumPrecisions; ++i) {
    if (v.pool_base[i] != total) return cudaErrorInvalidValue;  // consecutive pools (PoolMap)
    if (v.pool_count[i] > 0 && v.pages[i] == nullptr) return cudaErrorInvalidValue;
    total += v.pool_count[i];
    quantized = quantized || (i != kBf16 && v.pool_count[i] > 0);
  }
  if (total != v.total_blocks) return cudaErrorInvalidValue;
  if (total * static_cast<std::uint64_t>(v.block_size) >= (std::uint64_t{1} << 31)) { return cudaErrorInvalidValue; }
  if (v.staging == nullptr) return cudaErrorInvalidValue;
  if (quantized && (v.s2 == nullptr || v.key_scales == nullptr || v.num_records == 0)) { return cudaErrorInvalidValue; }
  if (p.num_jobs < 0 || p.num_jobs > v.num_streams) return cudaErrorInvalidValue;
  if (p.num_jobs > 0 && (p.jobs == nullptr || p.dest_slots == nullptr)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t check_quantize_append_jobs(const QuantizeAppendParams& p, const QuantizeAppendJob* host_jobs,
                                       const std::uint32_t* host_dest_slots) noexcept {
  if (cudaError_t e = check_quantize_append(p); e != cudaSuccess) return e;
  if (p.num_jobs == 0) return cudaSuccess;
  if (host_jobs == nullptr || host_dest_slots == nullptr) return cudaErrorInvalidValue;
  const QuantizeAppendView& v = p.cache;
  const auto g = static_cast<std::size_t>(v.group_size);
  const auto n = static_cast<std::size_t>(p.num_jobs);
  try {
    std::vector<std::int32_t> streams;
    std::vector<std::uint32_t> records, slots;
    streams.reserve(n);
    slots.reserve(n * g);
    for (std::size_t k = 0; k < n; ++k) {
      const QuantizeAppendJob& job = host_jobs[k];
      if (!job_ok(v, job)) return cudaErrorInvalidValue;
      const int prec = static_cast<int>(job.precision);
      for (std::size_t i = 0; i < g; ++i) {
        const std::uint32_t id = host_dest_slots[k * g + i];
        if (!dest_ok(v, prec, id)) return cudaErrorInvalidValue;
        slots.push_back(id);
      }
      streams.push_back(job.stream);
      if (prec != kBf16) records.push_back(job.record);
    }
    auto has_duplicate = [](auto& x) {
      std::sort(x.begin(), x.end());
      return std::adjacent_find(x.begin(), x.end()) != x.end();
    };
    if (has_duplicate(streams) || has_duplicate(records) || has_duplicate(slots)) { return cudaErrorInvalidValue; }
  } catch (const std::bad_alloc&) { return cudaErrorMemoryAllocation; }
  return cudaSuccess;
}

cudaError_t launch_quantize_append(const QuantizeAppendParams& p, cudaStream_t stream) noexcept {
  if (cudaError_t e = check_quantize_append(p); e != cudaSuccess) return e;
  if (p.num_jobs == 0) return cudaSuccess;
  const int threads = std::min(kMaxThreads, (p.cache.head_dim + 31) / 32 * 32);
  const unsigned grid = 2u * static_cast<unsigned>(p.num_jobs);
  switch (p.cache.group_size) {
    case 8: quantize_append_kernel<8><<<grid, threads, 0, stream>>>(p); break;
    case 16: quantize_append_kernel<16><<<grid, threads, 0, stream>>>(p); break;
    default: quantize_append_kernel<32><<<grid, threads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace thinkv::kernels
