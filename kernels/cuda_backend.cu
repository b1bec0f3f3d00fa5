/// \file cuda_backend.cu
/// thinkv::CudaKvBackend (include/thinkv/backend/cuda_backend.hpp): device-resident pages with the
/// CPU backend's layout, commits through launch_quantize_append, attention through
/// launch_paged_decode_attention. Host-pointer, synchronous, correctness-first (see the header).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <deque>
#include <cstring>
#include <string>
#include <vector>

#include "thinkv/backend/cpu_backend.hpp"
#include "thinkv/backend/cuda_backend.hpp"
#include "thinkv/formats.hpp"
#include "thinkv/kernels/kmeans_kernels.hpp"
#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/kernels/prefill_attention.hpp"
#include "thinkv/kernels/quantize_append.hpp"
#include "thinkv/paged/flat_block_table.hpp"

namespace thinkv {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  (void)cudaGetLastError();  // clear a sticky-free error so later calls are not blamed
  return {StatusCode::kCudaError,
          std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"};
}

#define THINKV_CUDA_TRY(call) THINKV_RETURN_IF_ERROR(cuda_status((call), #call))

// Inside CudaKvBackend members: refuse calls before init() (or on a moved-from backend).
#define THINKV_BACKEND_READY()                                                                    \
  do {                                                                                            \
    if (!impl_ || !impl_->ready) {                                                                \
      return Status{StatusCode::kInvalidArgument,                                                 \
                    "CudaKvBackend used before a successful init() (or after being moved from)"}; \
    }                                                                                             \
  } while (0)

// The one-token calls run on the legacy default stream, synchronously: they first wait for the
// batched work enqueued on the backend's stream (a no-op when it is idle or the default stream).
#define THINKV_ONE_TOKEN_CALL()                                                          \
  do {                                                                                   \
    THINKV_BACKEND_READY();                                                              \
    if (impl_->stream != nullptr) THINKV_CUDA_TRY(cudaStreamSynchronize(impl_->stream)); \
  } while (0)

template <class T>
T* typed(void* p) {
  return static_cast<T*>(p);
}

/// Writes n changed blocks' metadata (FlatBlockDelta, packed) into the device mirror: one CTA
/// per block.
__global__ void scatter_block_meta(const std::uint32_t* ids, const std::uint16_t* fill, const std::uint64_t* mask,
                                   const std::uint32_t* rec, const std::uint32_t* seg, int words, int block_size,
                                   std::uint16_t* dfill, std::uint64_t* dmask, std::uint32_t* drec,
                                   std::uint32_t* dseg) {
  const std::size_t i = blockIdx.x;
  const std::size_t b = ids[i];
  if (threadIdx.x == 0) dfill[b] = fill[i];
  for (int w = threadIdx.x; w < words; w += blockDim.x) dmask[b * words + w] = mask[i * words + w];
  for (int s = threadIdx.x; s < block_size; s += blockDim.x) {
    drec[b * block_size + s] = rec[i * block_size + s];
    dseg[b * block_size + s] = seg[i * block_size + s];
  }
}

constexpr std::size_t align256(std::size_t x) { return (x + 255) & ~std::size_t{255}; }

__device__ inline float load_elem(const void* p, ElementType t, std::size_t i) {
  switch (t) {
    case ElementType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    case ElementType::kBf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

/// One staged row, by one CTA: converts the row's K and V to BF16 (round to nearest even, as
/// encode_bf16), or stages zeros and raises the row's fault when a value is not finite or exceeds
/// 2^64; `last` (the stream's last row of the call) writes the device staged count (0 once the
/// row completes a group: its commit follows in stream order).
__device__ void stage_row(const StageRow r, bool last, const void* k, const void* v, ElementType kt, ElementType vt,
                          int d, int g, std::uint16_t* staging, std::int32_t* staged, unsigned int* fault_word,
                          unsigned int* fault_block, int fault_cap) {
  bool bad = false;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    const std::size_t i = static_cast<std::size_t>(r.src) * d + c;
    const float kx = load_elem(k, kt, i), vx = load_elem(v, vt, i);
    bad = bad || !(fabsf(kx) <= 0x1p64f) || !(fabsf(vx) <= 0x1p64f);
  }
  bad = __syncthreads_or(bad) != 0;
  std::uint16_t* sk = staging + ((static_cast<std::size_t>(r.stream) * 2 + 0) * g + r.row) * d;
  std::uint16_t* sv = staging + ((static_cast<std::size_t>(r.stream) * 2 + 1) * g + r.row) * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    const std::size_t i = static_cast<std::size_t>(r.src) * d + c;
    const float kx = bad ? 0.0f : load_elem(k, kt, i), vx = bad ? 0.0f : load_elem(v, vt, i);
    sk[c] = __bfloat16_as_ushort(__float2bfloat16_rn(kx));
    sv[c] = __bfloat16_as_ushort(__float2bfloat16_rn(vx));
  }
  if (threadIdx.x == 0) {
    if (last) staged[r.stream] = r.row + 1 == g ? 0 : r.row + 1;
    if (bad && atomicOr(&fault_word[r.fault], 1u) == 0u) {
      const unsigned pos = atomicAdd(&fault_block[0], 1u);
      if (pos < static_cast<unsigned>(fault_cap)) {
        fault_block[1 + 2 * pos] = static_cast<unsigned>(r.fault);
        fault_block[2 + 2 * pos] = static_cast<unsigned>(r.tag);
      }
      fault_word[r.fault] = 1u | (static_cast<unsigned>(r.tag) << 1);  // the tag, for an overflowing list
    }
  }
}

/// Batched stage (prompts): one CTA per row. A stream's rows are adjacent and in row order: its
/// last row writes the count.
__global__ void stage_rows_kernel(const StageRow* rows, const void* k, const void* v, ElementType kt, ElementType vt,
                                  int d, int g, std::uint16_t* staging, std::int32_t* staged, unsigned int* fault_word,
                                  unsigned int* fault_block, int fault_cap) {
  const StageRow r = rows[blockIdx.x];
  const bool last = blockIdx.x + 1 == gridDim.x || rows[blockIdx.x + 1].stream != r.stream;
  stage_row(r, last, k, v, kt, vt, d, g, staging, staged, fault_word, fault_block, fault_cap);
}

/// A decode step's layer: one CTA per (sequence b, KV head h) = blockIdx.x = b * hkv + h, input
/// row blockIdx.x, into the sequence's staging row of stream first_stream + layer * hkv + h.
__global__ void stage_step_kernel(const StepSequence* seqs, int layer, int hkv, const void* k, const void* v,
                                  ElementType kt, ElementType vt, int d, int g, std::uint16_t* staging,
                                  std::int32_t* staged, unsigned int* fault_word, unsigned int* fault_block,
                                  int fault_cap) {
  const int b = static_cast<int>(blockIdx.x) / hkv, h = static_cast<int>(blockIdx.x) % hkv;
  const StepSequence q = seqs[b];
  const StageRow r{q.first_stream + layer * hkv + h, q.row, static_cast<std::int32_t>(blockIdx.x), q.first_stream,
                   q.tag};
  stage_row(r, true, k, v, kt, vt, d, g, staging, staged, fault_word, fault_block, fault_cap);
}

/// A decode step's attention streams ([layers, cap_n * hkv]: sequence b's KV head h of layer l) and
/// sparsity flags ([n * hkv]) from its sequences.
__global__ void expand_step_kernel(const StepSequence* seqs, int n, int hkv, int layers, int cap_n,
                                   std::int32_t* streams, std::uint8_t* flags) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t per_layer = static_cast<std::size_t>(n) * hkv;
  if (i >= per_layer * static_cast<std::size_t>(layers)) return;
  const int l = static_cast<int>(i / per_layer);
  const int j = static_cast<int>(i % per_layer);
  const StepSequence q = seqs[j / hkv];
  streams[static_cast<std::size_t>(l) * cap_n * hkv + j] = q.first_stream + l * hkv + j % hkv;
  if (l == 0) flags[j] = q.sparsity != 0 ? 1 : 0;
}

/// Writes changed block lists into their fixed-capacity rows: one CTA per changed stream.
/// head[i] = {stream, count, offset into blocks}.
__global__ void scatter_block_lists(const std::int32_t* head, const std::uint32_t* blocks, int stride,
                                    std::uint32_t* indices, std::int32_t* counts) {
  const int s = head[3 * blockIdx.x], n = head[3 * blockIdx.x + 1], off = head[3 * blockIdx.x + 2];
  for (int i = threadIdx.x; i < n; i += blockDim.x) indices[static_cast<std::size_t>(s) * stride + i] = blocks[off + i];
  if (threadIdx.x == 0) counts[s] = n;
}

__global__ void fill_row_starts(std::int32_t* ptr, int n, int stride) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) ptr[i] = i * stride;
}

__global__ void convert_to_f32(const void* in, ElementType t, float* out, std::size_t n) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = load_elem(in, t, i);
}
__global__ void convert_from_f32(const float* in, void* out, ElementType t, std::size_t n) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (t == ElementType::kF16) {
    static_cast<__half*>(out)[i] = __float2half_rn(in[i]);
  } else {
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(in[i]);
  }
}

/// TBE's selections on the device (select_segments): what the kernels read.
struct SelectView {
  const std::uint8_t* pages[kNumPrecisions];
  unsigned long long page_bytes[kNumPrecisions];
  int row_bytes[kNumPrecisions];
  std::uint32_t dev_base[kNumPrecisions];  // the flat numbering: pool p's page i is block dev_base[p] + i
  std::uint32_t dev_count[kNumPrecisions];
  const std::uint8_t* records;
  const float* s2;
  const std::uint16_t* fill;
  std::uint64_t* mask;
  const std::uint32_t* slot_record;
  const std::uint32_t* slot_segment;
  const std::uint32_t* lidx;
  const std::int32_t* lcount;
  int lstride;
  int d;
  int block_size;
  int words;
};
/// One selection job as the device reads it.
struct SelectJob {
  std::int32_t stream;
  std::uint32_t segment;
  std::int32_t keep;
  std::int32_t count;
  std::uint64_t seed;
  std::uint32_t victims;  // where its count - keep victims go in the compact victims list
  std::uint32_t pad;
};

/// Finds job blockIdx.x's tokens (the live slots of its stream holding its segment, in attention
/// order: blocks in list order, slots in order) and dequantizes their keys exactly as
/// CpuKvBackend::dequantize_token does (element * (E4M3 key scale * s2_k), or the BF16 value) into
/// points[job, i, :]; refs[job, i] = flat slot id (block * B + slot); found[job] = the number of
/// tokens (points beyond max_points are counted, not written); np, kk, seeds: the K-means inputs.
/// blockDim.x = kGatherThreads. The walk over the stream's slots (flat index f = list position *
/// B + slot) is split into one contiguous range per warp, walked twice: first counting the hits
/// (32 slots per ballot), then, from the warp's offset (the counts of the warps before it),
/// writing them. Each warp's chain of dependent loads is a quarter of the list, not all of it.
constexpr int kGatherThreads = 128;
__global__ void __launch_bounds__(kGatherThreads)
    gather_segment_kernel(SelectView v, const SelectJob* jobs, int max_points, float* points, std::uint32_t* refs,
                          int* found, int* np, int* kk, std::uint64_t* seeds) {
  constexpr int kWarps = kGatherThreads / 32;
  __shared__ int warp_hits[kWarps];
  __shared__ int shared_n;
  const int j = static_cast<int>(blockIdx.x);
  const SelectJob job = jobs[j];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, w = tid >> 5;
  std::uint32_t* jrefs = refs + static_cast<std::size_t>(j) * max_points;
  const std::uint32_t* row = v.lidx + static_cast<std::size_t>(job.stream) * v.lstride;
  const long long total = static_cast<long long>(v.lcount[job.stream]) * v.block_size;
  const long long per_warp = (total + kWarps - 1) / kWarps;
  const long long lo = per_warp * w, hi = lo + per_warp < total ? lo + per_warp : total;
  // Whether flat slot f holds a live token of the job's segment, and its slot id.
  auto probe = [&](long long f, std::uint32_t& id) {
    if (f >= hi) return false;
    const std::uint32_t fb = row[f / v.block_size];
    const int sl = static_cast<int>(f % v.block_size);
    if (sl >= v.fill[fb]) return false;
    const std::size_t si = static_cast<std::size_t>(fb) * v.block_size + sl;
    const std::uint64_t word = v.mask[static_cast<std::size_t>(fb) * v.words + sl / 64];
    id = fb * static_cast<std::uint32_t>(v.block_size) + static_cast<std::uint32_t>(sl);
    return v.slot_segment[si] == job.segment && ((word >> (sl % 64)) & 1u) == 0;
  };
  int hits = 0;
  for (long long base = lo; base < hi; base += 32) {
    std::uint32_t id = 0;
    hits += __popc(__ballot_sync(0xFFFFFFFFu, probe(base + lane, id)));
  }
  if (lane == 0) warp_hits[w] = hits;
  __syncthreads();
  int at = 0;
  for (int x = 0; x < w; ++x) at += warp_hits[x];
  for (long long base = lo; base < hi && at < max_points; base += 32) {
    std::uint32_t id = 0;
    const bool hit = probe(base + lane, id);
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, hit);
    if (hit) {
      const int idx = at + __popc(ballot & ((1u << lane) - 1u));
      if (idx < max_points) jrefs[idx] = id;
    }
    at += __popc(ballot);
  }
  if (tid == 0) {
    int all = 0;
    for (int x = 0; x < kWarps; ++x) all += warp_hits[x];
    shared_n = all;
    found[j] = all;
    np[j] = all < max_points ? all : max_points;
    kk[j] = job.keep;
    seeds[j] = job.seed;
  }
  __syncthreads();
  const int n = shared_n < max_points ? shared_n : max_points;
  float* out = points + static_cast<std::size_t>(j) * max_points * v.d;
  for (int e = tid; e < n * v.d; e += static_cast<int>(blockDim.x)) {
    const int i = e / v.d, c = e % v.d;
    const std::uint32_t id = jrefs[i];
    const std::uint32_t fb = id / static_cast<std::uint32_t>(v.block_size);
    const std::uint32_t sl = id % static_cast<std::uint32_t>(v.block_size);
    int p = 0;
    for (int q = 0; q < kNumPrecisions; ++q) {
      if (fb >= v.dev_base[q] && fb - v.dev_base[q] < v.dev_count[q]) p = q;
    }
    const std::uint8_t* kr = v.pages[p] + static_cast<std::size_t>(fb - v.dev_base[p]) * v.page_bytes[p] +
                             static_cast<std::size_t>(sl) * v.row_bytes[p];
    const auto prec = static_cast<Precision>(p);
    float x;
    if (prec == Precision::kBf16) {
      x = decode_bf16(static_cast<std::uint16_t>(kr[2 * c] | (kr[2 * c + 1] << 8)));
    } else {
      const std::uint8_t code = load_code(prec, kr, c);
      const std::uint32_t rec = v.slot_record[id];
      const float s2k = v.s2[(static_cast<std::size_t>(job.stream) * 2) * kNumPrecisions + p];
      const float scale = __fmul_rn(decode_e4m3(v.records[static_cast<std::size_t>(rec) * v.d + c]), s2k);
      x = __fmul_rn(decode_element(prec, code), scale);
    }
    out[static_cast<std::size_t>(i) * v.d + c] = x;
  }
}

/// One stored token a continued prompt chunk attends to (attend_chunk), with every device
/// address resolved on the host: a live page slot (k / v rows, value scales and key-scale record
/// for the quantized pools, the owning stream's second-level scales) or a staged row (BF16, like
/// a BF16 page's rows); dst = its row in the chunk's FP32 scratch (KV head h's rows start at h *
/// rows).
struct ChunkToken {
  const std::uint8_t* k;
  const std::uint8_t* v;
  const std::uint8_t* value_scales;  // quantized only
  const std::uint8_t* key_scales;    // quantized only
  const float* s2;                   // [2 * kNumPrecisions] of the owning stream; quantized only
  std::uint32_t dst;
  std::int32_t precision;
};

/// Dequantizes token blockIdx.x's key and value into row dst of kout / vout exactly as
/// CpuKvBackend::dequantize_token does (element * (E4M3 scale * s2), two IEEE roundings).
__global__ void chunk_gather_kernel(const ChunkToken* tokens, int d, int g, float* kout, float* vout) {
  const ChunkToken t = tokens[blockIdx.x];
  const auto prec = static_cast<Precision>(t.precision);
  float* ko = kout + static_cast<std::size_t>(t.dst) * d;
  float* vo = vout + static_cast<std::size_t>(t.dst) * d;
  for (int c = static_cast<int>(threadIdx.x); c < d; c += static_cast<int>(blockDim.x)) {
    if (prec == Precision::kBf16) {
      ko[c] = decode_bf16(static_cast<std::uint16_t>(t.k[2 * c] | (t.k[2 * c + 1] << 8)));
      vo[c] = decode_bf16(static_cast<std::uint16_t>(t.v[2 * c] | (t.v[2 * c + 1] << 8)));
      continue;
    }
    const float ks = __fmul_rn(decode_e4m3(t.key_scales[c]), t.s2[t.precision]);
    const float vs = __fmul_rn(decode_e4m3(t.value_scales[c / g]), t.s2[kNumPrecisions + t.precision]);
    ko[c] = __fmul_rn(decode_element(prec, load_code(prec, t.k, c)), ks);
    vo[c] = __fmul_rn(decode_element(prec, load_code(prec, t.v, c)), vs);
  }
}

/// The chunk's own K/V ([tokens, hkv, d] of their element types) into rows prefix[h] + t of KV
/// head h (grid: tokens x hkv).
__global__ void chunk_place_kernel(const void* k, const void* v, ElementType kt, ElementType vt, int hkv, int d,
                                   const int* prefix, std::size_t rows, float* kout, float* vout) {
  const int t = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const std::size_t src = (static_cast<std::size_t>(t) * hkv + h) * d;
  const std::size_t dst = (static_cast<std::size_t>(h) * rows + static_cast<std::size_t>(prefix[h] + t)) * d;
  for (int c = static_cast<int>(threadIdx.x); c < d; c += static_cast<int>(blockDim.x)) {
    kout[dst + c] = load_elem(k, kt, src + c);
    vout[dst + c] = load_elem(v, vt, src + c);
  }
}

/// A selection's victims in a launch-time numbering, marked again in the current one.
struct RenumberView {
  std::uint32_t old_base[kNumPrecisions], old_count[kNumPrecisions], new_base[kNumPrecisions];
};
__global__ void remark_victims_kernel(const std::uint32_t* victims, std::size_t n, RenumberView rv, std::uint64_t* mask,
                                      int words, int block_size) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const std::uint32_t id = victims[i];
  if (id == 0xFFFFFFFFu) return;  // a job that found another count marked nothing
  const std::uint32_t fb = id / static_cast<std::uint32_t>(block_size),
                      sl = id % static_cast<std::uint32_t>(block_size);
  for (int p = 0; p < kNumPrecisions; ++p) {
    if (fb >= rv.old_base[p] && fb - rv.old_base[p] < rv.old_count[p]) {
      const std::size_t nb = rv.new_base[p] + (fb - rv.old_base[p]);
      atomicOr(reinterpret_cast<unsigned long long*>(&mask[nb * words + sl / 64]), 1ull << (sl % 64));
      return;
    }
  }
}

/// One warp per job: the tokens K-means did not keep, in order, into victims[job.victims ..] (their
/// flat slot ids: count - keep of them) with their count in vcount[job], each marked evicted in
/// the device's masks. A job whose segment held another number of tokens than the host expected
/// marks and writes nothing: vcount -1.
__global__ void mark_victims_kernel(SelectView v, const SelectJob* jobs, const int* found, const std::uint32_t* refs,
                                    const int* kept, int max_points, int max_k, std::uint32_t* victims, int* vcount) {
  const int j = static_cast<int>(blockIdx.x);
  const int lane = static_cast<int>(threadIdx.x);
  const SelectJob job = jobs[j];
  const int n = found[j];
  if (n != job.count || n > max_points || job.keep > n) {
    for (int i = lane; i < job.count - job.keep; i += 32) victims[job.victims + static_cast<std::uint32_t>(i)] = ~0u;
    if (lane == 0) vcount[j] = -1;
    return;
  }
  const int* krow = kept + static_cast<std::size_t>(j) * max_k;
  int v_n = 0;
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    bool victim = false;
    if (i < n) {
      victim = true;
      for (int t = 0; t < max_k; ++t) {
        const int x = krow[t];
        if (x < 0) break;
        if (x == i) {
          victim = false;
          break;
        }
      }
    }
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, victim);
    if (victim) {
      const std::uint32_t id = refs[static_cast<std::size_t>(j) * max_points + i];
      const int at = v_n + __popc(ballot & ((1u << lane) - 1u));
      if (at < job.count - job.keep) victims[job.victims + static_cast<std::uint32_t>(at)] = id;
      const std::uint32_t fb = id / static_cast<std::uint32_t>(v.block_size);
      const std::uint32_t sl = id % static_cast<std::uint32_t>(v.block_size);
      atomicOr(reinterpret_cast<unsigned long long*>(&v.mask[static_cast<std::size_t>(fb) * v.words + sl / 64]),
               1ull << (sl % 64));
    }
    v_n += __popc(ballot);
  }
  if (lane == 0) vcount[j] = v_n;
}

constexpr int kFaultCap = 255;  // faults one copy reports; more between two polls: a full scan

/// Pinned host bytes and device bytes of one upload, reused round robin (its event says when the
/// copy of its previous use is done).
struct UploadSlot {
  void* host = nullptr;
  void* dev = nullptr;
  std::size_t cap = 0;
  cudaEvent_t done = nullptr;
};

}  // namespace

struct CudaKvBackend::Impl {
  bool ready = false;
  StorageConfig config{};
  CacheLayout layout{};
  PoolMap pools{};
  BackendStats stats{};
  std::int64_t fixed_bytes = 0;  // staging and second-level scales
  std::vector<void*> allocations;
  // Storage that grows with the cache (resize_pool / resize_records): per pool a device buffer
  // of cap[p] pages (at least the pages the cache asked for, grown by doubling, shrunk when the
  // cache needs half or less), the records likewise. Owned here, not in `allocations`.
  std::uint8_t* pages[kNumPrecisions] = {};
  std::uint32_t cap[kNumPrecisions] = {};
  std::uint8_t* records = nullptr;
  std::uint32_t num_records = 0;  // records' buffer capacity
  bool reserved = false;          // reserve_storage(): every range allocated whole, never shrunk
  std::uint16_t* staging = nullptr;
  float* s2 = nullptr;
  // Device mirror of the block table (uploaded by attend), in the compact numbering of
  // FlatBlockTable over cap[]: fill, mask, slot_record and indices sized for meta_blocks blocks.
  std::uint16_t* fill = nullptr;
  std::uint64_t* mask = nullptr;
  std::uint32_t* slot_record = nullptr;
  std::uint32_t* slot_segment = nullptr;  // TBE's selections find a segment's tokens on the device
  std::size_t meta_blocks = 0;
  std::uint32_t* indices = nullptr;  // the one-token attend's CSR block lists
  std::size_t indices_cap = 0;
  std::int32_t* indptr = nullptr;
  std::int32_t* staged = nullptr;
  // What the mirror has seen: each pool's revision (PoolView's change log) on the device storage
  // of meta_cap[] pages. attend copies everything when meta_synced is false, else the changes.
  bool meta_synced = false;
  std::uint64_t meta_rev[kNumPrecisions] = {};
  std::uint32_t meta_cap[kNumPrecisions] = {};
  FlatBlockDelta delta;
  std::vector<std::uint8_t> delta_host;
  void* delta_dev = nullptr;
  std::size_t delta_dev_bytes = 0;
  // Commit scratch: one job.
  kernels::QuantizeAppendJob* job = nullptr;
  std::uint32_t* dest = nullptr;
  unsigned long long* saturations = nullptr;
  unsigned int* rejected = nullptr;
  // Attention scratch, grown on demand.
  void* attn = nullptr;
  std::size_t attn_bytes = 0;
  FlatBlockTable flat;
  // ---- batched calls -------------------------------------------------------------------------
  cudaStream_t stream = nullptr;
  std::vector<UploadSlot> ring;  // pinned uploads, round robin
  std::size_t ring_next = 0;
  std::vector<std::uint8_t> pack;   // host packing scratch
  std::int32_t* bstaged = nullptr;  // [S] staged counts, kept on the device
  // Block lists: stream s's row is lidx[s * lstride ..], lcount[s] blocks; lptr[s] = s * lstride;
  // in the numbering of lcap[] pages (sync_lists).
  std::uint32_t* lidx = nullptr;
  std::int32_t* lcount = nullptr;
  std::int32_t* lptr = nullptr;
  int lstride = 0;
  std::uint32_t lcap[kNumPrecisions] = {};
  // Faults: fault_word[S] (bit 0 raised, the tag above it); fault_block = [count, (fault, tag) x
  // kFaultCap], copied back by poll_faults into pinned copies (FIFO, each with its event).
  unsigned int* fault_word = nullptr;
  unsigned int* fault_block = nullptr;
  struct FaultCopy {
    unsigned int* host = nullptr;
    cudaEvent_t done = nullptr;
  };
  std::vector<FaultCopy> fault_free;
  std::deque<FaultCopy> fault_busy;
  // Batched commits' counters (read by stats() / synchronize()).
  unsigned long long* bsat = nullptr;
  unsigned int* brej = nullptr;
  // Host results of batched attends: pinned bytes copied to `dst` by synchronize().
  struct HostResult {
    const void* pinned;
    void* dst;
    std::size_t bytes;
  };
  std::vector<HostResult> results;
  std::vector<std::pair<void*, std::size_t>> result_chunks;  // pinned, reused after synchronize
  std::size_t result_chunk = 0, result_used = 0;
  // Batched attention scratch (q / out conversions, sparsity, streams, workspace).
  void* battn = nullptr;
  std::size_t battn_bytes = 0;
  // K-means scratch (points, kept).
  void* sel = nullptr;
  std::size_t sel_bytes = 0;
  // A continued prompt chunk's scratch (attend_chunk): FP32 K and V of the stored tokens and the
  // chunk, [hkv, rows, d] each.
  void* chunk = nullptr;
  std::size_t chunk_bytes = 0;
  int kmeans_split_jobs = CudaKvBackend::kDefaultKmeansSplitJobs;  // launch_selection's class split
  std::vector<ChunkToken> chunk_tokens;                            // host packing scratch
  // TBE's selections launched and not yet collected (launch_selection / collect_selection).
  struct Selection {
    std::uint64_t id = 0;
    bool live = false;
    std::vector<SelectJob> jobs;
    std::size_t total = 0;                                                // victims, compact
    std::uint32_t base[kNumPrecisions] = {}, count[kNumPrecisions] = {};  // the flat numbering at launch
    void* dev = nullptr;                                                  // [victims][counts]
    std::size_t dev_bytes = 0;
    void* pinned = nullptr;  // [counts][victims]
    std::size_t pinned_bytes = 0;
    cudaEvent_t done = nullptr;
  };
  std::deque<Selection> selections;  // stable addresses
  std::uint64_t selection_clock = 0;
  // ---- the open decode step (prepare_step) ---------------------------------------------------
  // One device area, laid out by capacity (so a captured graph's launches find everything where
  // they found it), rewritten by each step's upload (stream-ordered after the previous step's
  // kernels): [sequences][layer job ranges][jobs][dest slots] uploaded, [streams][sparsity flags]
  // expanded on the device, [sparsity] written by the attentions.
  std::uint8_t* step_dev = nullptr;
  std::size_t step_dev_bytes = 0;
  std::size_t cap_n = 0, cap_jobs = 0, cap_layers = 0;
  std::size_t o_ranges = 0, o_jobs = 0, o_dest = 0, o_streams = 0, o_flags = 0, o_sparsity = 0;
  int step_n = 0, step_layers = 0, step_hkv = 0, step_hq = 0;
  float step_scale = 0.0f;
  long long step_max_positions = 0;
  bool step_capturable = false;
  int fixed_splits = 0;  // capturable steps: the attention's split count, fixed per epoch and batch size
  int fixed_splits_n = 0;
  std::uint64_t fixed_splits_epoch = 0;
  std::vector<std::uint32_t> step_layer_commits;
  std::vector<std::int64_t> step_layer_bytes;  // page bytes each layer's commits store
  std::vector<std::int8_t> step_slot;
  float* step_sparsity = nullptr;  // the cache's host results
  int step_slots = 0;
  bool step_ready = false;
  float* sp_pinned = nullptr;  // the sparsity copied back, then into step_sparsity by wait_sparsity
  std::size_t sp_pinned_floats = 0;
  cudaEvent_t sp_done = nullptr;
  bool sp_pending = false;
  // Changes whenever a device pointer or launch shape a step's per-layer launches use changes
  // (storage, mirror, lists, step area, scratch): a captured graph is stale from then on.
  std::uint64_t epoch = 1;
  // Device timing (set_device_timing): event pairs per part, summed by device_times().
  bool timing = false;
  struct Timed {
    int part;
    cudaEvent_t start, stop;
  };
  std::vector<Timed> timed;
  std::vector<cudaEvent_t> spare_events;
  CudaKvBackend::DeviceTimes times;
  cudaEvent_t timing_event() {
    cudaEvent_t e = nullptr;
    if (!spare_events.empty()) {
      e = spare_events.back();
      spare_events.pop_back();
    } else if (cudaEventCreate(&e) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return e;
  }
  /// Starts timing a part on the stream (returns its index, or -1 when timing is off).
  int time_start(int part) {
    if (!timing) return -1;
    cudaEvent_t a = timing_event(), b = timing_event();
    if (a == nullptr || b == nullptr) return -1;
    (void)cudaEventRecord(a, stream);
    timed.push_back({part, a, b});
    return static_cast<int>(timed.size()) - 1;
  }
  void time_stop(int i) {
    if (i >= 0) (void)cudaEventRecord(timed[static_cast<std::size_t>(i)].stop, stream);
  }
  // The block-list mirror's sync by the table's list change log.
  bool lists_synced = false;
  std::uint64_t list_rev = 0;
  std::vector<std::uint32_t> lseen;  // per stream: the sync pass that sent it
  std::uint32_t lpass = 0;

  ~Impl() { release(); }

  void release_batched() {
    for (UploadSlot& u : ring) {
      if (u.done != nullptr) (void)cudaEventSynchronize(u.done);
      if (u.host != nullptr) (void)cudaFreeHost(u.host);
      if (u.dev != nullptr) (void)cudaFree(u.dev);
      if (u.done != nullptr) (void)cudaEventDestroy(u.done);
    }
    ring.clear();
    for (FaultCopy& f : fault_busy) fault_free.push_back(f);
    fault_busy.clear();
    for (FaultCopy& f : fault_free) {
      if (f.done != nullptr) {
        (void)cudaEventSynchronize(f.done);
        (void)cudaEventDestroy(f.done);
      }
      if (f.host != nullptr) (void)cudaFreeHost(f.host);
    }
    fault_free.clear();
    for (auto& c : result_chunks) (void)cudaFreeHost(c.first);
    result_chunks.clear();
    results.clear();
    result_chunk = result_used = 0;
    for (void* q : {static_cast<void*>(lidx), static_cast<void*>(lcount), static_cast<void*>(lptr), battn, sel, chunk,
                    static_cast<void*>(step_dev)}) {
      if (q != nullptr) (void)cudaFree(q);
    }
    step_dev = nullptr;
    step_dev_bytes = 0;
    step_ready = false;
    if (sp_pinned != nullptr) (void)cudaFreeHost(sp_pinned);
    sp_pinned = nullptr;
    sp_pinned_floats = 0;
    if (sp_done != nullptr) (void)cudaEventDestroy(sp_done);
    sp_done = nullptr;
    sp_pending = false;
    lists_synced = false;
    lseen.clear();
    for (Selection& x : selections) {
      if (x.done != nullptr) {
        (void)cudaEventSynchronize(x.done);
        (void)cudaEventDestroy(x.done);
      }
      if (x.dev != nullptr) (void)cudaFree(x.dev);
      if (x.pinned != nullptr) (void)cudaFreeHost(x.pinned);
    }
    selections.clear();
    for (Timed& t : timed) {
      spare_events.push_back(t.start);
      spare_events.push_back(t.stop);
    }
    timed.clear();
    for (cudaEvent_t e : spare_events) (void)cudaEventDestroy(e);
    spare_events.clear();
    lidx = nullptr;
    lcount = nullptr;
    lptr = nullptr;
    lstride = 0;
    battn = nullptr;
    battn_bytes = 0;
    sel = nullptr;
    sel_bytes = 0;
    chunk = nullptr;
    chunk_bytes = 0;
  }

  /// Copies `bytes` of host data into device memory on `stream` through the next pinned slot;
  /// returns the device copy (valid for the kernels enqueued after it).
  Status upload(const void* src, std::size_t bytes, void** dev) {
    Staged st;
    THINKV_RETURN_IF_ERROR(stage(src, bytes, st));
    return issue(st, nullptr, dev);
  }

  /// An upload split in two: stage() copies the bytes into the next pinned slot (host work),
  /// issue() enqueues the copy to the device (to `dst`, or the slot's own device part) and marks
  /// the slot busy until it is done. A caller stages everything first, then issues back to back.
  struct Staged {
    UploadSlot* slot = nullptr;
    std::size_t bytes = 0;
  };
  Status stage(const void* src, std::size_t bytes, Staged& out) {
    out = {};
    if (bytes == 0) return Status::ok();
    if (ring.empty()) ring.resize(64);
    UploadSlot& u = ring[ring_next++ % ring.size()];
    if (u.done == nullptr) THINKV_CUDA_TRY(cudaEventCreateWithFlags(&u.done, cudaEventDisableTiming));
    THINKV_CUDA_TRY(cudaEventSynchronize(u.done));
    if (u.cap < bytes) {
      const std::size_t cap = std::max<std::size_t>(4096, 2 * bytes);
      if (u.host != nullptr) (void)cudaFreeHost(u.host);
      if (u.dev != nullptr) (void)cudaFree(u.dev);
      u.host = nullptr;
      u.dev = nullptr;
      u.cap = 0;
      THINKV_CUDA_TRY(cudaMallocHost(&u.host, cap));
      THINKV_RETURN_IF_ERROR(raw_alloc(&u.dev, cap, "upload buffers"));
      u.cap = cap;
    }
    std::memcpy(u.host, src, bytes);
    out = {&u, bytes};
    return Status::ok();
  }
  /// Enqueues a staged upload; returns the device copy (`dst` when given).
  Status issue(const Staged& st, void* dst, void** dev) {
    if (dev != nullptr) *dev = nullptr;
    if (st.slot == nullptr) return Status::ok();
    void* to = dst != nullptr ? dst : st.slot->dev;
    stats.host_to_device_bytes += static_cast<std::int64_t>(st.bytes);
    THINKV_CUDA_TRY(cudaMemcpyAsync(to, st.slot->host, st.bytes, cudaMemcpyHostToDevice, stream));
    THINKV_CUDA_TRY(cudaEventRecord(st.slot->done, stream));
    if (dev != nullptr) *dev = to;
    return Status::ok();
  }

  /// Copies `bytes` of host data into the device buffer `dst` on `stream` through the next pinned
  /// slot (its host part only).
  Status upload_to(void* dst, const void* src, std::size_t bytes) {
    Staged st;
    THINKV_RETURN_IF_ERROR(stage(src, bytes, st));
    return issue(st, dst, nullptr);
  }

  /// The metadata updates of a sync whose upload is deferred: where their parts lie in `dpack`.
  struct Deferred {
    std::size_t pages = 0, o_ids = 0, o_fill = 0, o_mask = 0, o_rec = 0, o_seg = 0;
    std::size_t lists = 0, o_head = 0, o_blocks = 0;
  };
  std::vector<std::uint8_t> dpack;  // deferred updates, packed
  void scatter_pages(const std::uint8_t* d, std::size_t n, std::size_t o_ids, std::size_t o_fill, std::size_t o_mask,
                     std::size_t o_rec, std::size_t o_seg) {
    scatter_block_meta<<<static_cast<unsigned>(n), 64, 0, stream>>>(
        reinterpret_cast<const std::uint32_t*>(d + o_ids), reinterpret_cast<const std::uint16_t*>(d + o_fill),
        reinterpret_cast<const std::uint64_t*>(d + o_mask), reinterpret_cast<const std::uint32_t*>(d + o_rec),
        reinterpret_cast<const std::uint32_t*>(d + o_seg), layout.evict_mask_words(), config.block_size, fill, mask,
        slot_record, slot_segment);
  }
  void scatter_lists(const std::uint8_t* d, std::size_t n, std::size_t o_head, std::size_t o_blocks) {
    scatter_block_lists<<<static_cast<unsigned>(n), 128, 0, stream>>>(
        reinterpret_cast<const std::int32_t*>(d + o_head), reinterpret_cast<const std::uint32_t*>(d + o_blocks),
        lstride, lidx, lcount);
  }
  /// Issues the staged `dpack` (one copy; staged with stage_deferred) and launches the scatters
  /// `d` recorded.
  Status stage_deferred(const Deferred& d, Staged& st) {
    st = {};
    if (d.pages == 0 && d.lists == 0) return Status::ok();
    return stage(dpack.data(), dpack.size(), st);
  }
  Status launch_deferred(const Deferred& d, const Staged& st) {
    if (d.pages == 0 && d.lists == 0) return Status::ok();
    void* dev = nullptr;
    THINKV_RETURN_IF_ERROR(issue(st, nullptr, &dev));
    const auto* base = static_cast<const std::uint8_t*>(dev);
    if (d.pages > 0) scatter_pages(base, d.pages, d.o_ids, d.o_fill, d.o_mask, d.o_rec, d.o_seg);
    if (d.lists > 0) scatter_lists(base, d.lists, d.o_head, d.o_blocks);
    THINKV_CUDA_TRY(cudaGetLastError());
    return Status::ok();
  }

  /// Brings the device mirror of the pools' metadata (fill, masks, slot records, in the compact
  /// numbering over cap[]) up to date on `stream`: the pages changed since the last sync (one
  /// upload, one scatter launch), or everything on the first sync, after the storage changed, or
  /// when a pool's change log no longer reaches back.
  /// With `deferred`, the changed pages are appended to `dpack` (and the scatter recorded) for
  /// launch_deferred to send with the rest of a step's upload.
  Status sync_pools(const AttendView& view, Deferred* deferred = nullptr) {
    flat_numbering(view, flat, cap);
    const std::size_t nb = std::max<std::size_t>(flat.total_blocks, 1);
    if (nb > meta_blocks) {
      THINKV_CUDA_TRY(cudaStreamSynchronize(stream));
      free_meta();
      const auto words = static_cast<std::size_t>(layout.evict_mask_words());
      void* p = nullptr;
      THINKV_RETURN_IF_ERROR(raw_alloc(&p, nb * 2, "block fill"));
      fill = typed<std::uint16_t>(p);
      THINKV_RETURN_IF_ERROR(raw_alloc(&p, nb * words * 8, "eviction masks"));
      mask = typed<std::uint64_t>(p);
      THINKV_RETURN_IF_ERROR(raw_alloc(&p, nb * static_cast<std::size_t>(config.block_size) * 4, "slot records"));
      slot_record = typed<std::uint32_t>(p);
      THINKV_RETURN_IF_ERROR(raw_alloc(&p, nb * static_cast<std::size_t>(config.block_size) * 4, "slot segments"));
      slot_segment = typed<std::uint32_t>(p);
      meta_blocks = nb;
      ++epoch;
    }
    bool whole = !meta_synced;
    for (int p = 0; p < kNumPrecisions; ++p) whole = whole || meta_cap[p] != cap[p];
    if (!whole) whole = !flat_changes(view, flat, meta_rev, delta);
    if (whole) {
      flatten_pools(view, flat, cap);
      THINKV_CUDA_TRY(
          cudaMemcpyAsync(fill, flat.block_fill.data(), flat.block_fill.size() * 2, cudaMemcpyHostToDevice, stream));
      THINKV_CUDA_TRY(
          cudaMemcpyAsync(mask, flat.evict_mask.data(), flat.evict_mask.size() * 8, cudaMemcpyHostToDevice, stream));
      THINKV_CUDA_TRY(cudaMemcpyAsync(slot_record, flat.slot_record.data(), flat.slot_record.size() * 4,
                                      cudaMemcpyHostToDevice, stream));
      THINKV_CUDA_TRY(cudaMemcpyAsync(slot_segment, flat.slot_segment.data(), flat.slot_segment.size() * 4,
                                      cudaMemcpyHostToDevice, stream));
      // Victims the device marked for selections the cache has not collected yet are not in the
      // host's masks: mark them again in the copy (their flat ids renumbered).
      for (const Selection& x : selections) {
        if (!x.live || x.total == 0) continue;
        RenumberView rv{};
        for (int p = 0; p < kNumPrecisions; ++p) {
          rv.old_base[p] = x.base[p];
          rv.old_count[p] = x.count[p];
          rv.new_base[p] = dev_base(p);
        }
        remark_victims_kernel<<<static_cast<unsigned>((x.total + 255) / 256), 256, 0, stream>>>(
            static_cast<const std::uint32_t*>(x.dev), x.total, rv, mask, layout.evict_mask_words(), config.block_size);
        THINKV_CUDA_TRY(cudaGetLastError());
      }
      THINKV_CUDA_TRY(cudaStreamSynchronize(stream));  // pageable sources: wait before the host reuses them
      const auto bytes = static_cast<std::int64_t>(flat.block_fill.size() * 2 + flat.evict_mask.size() * 8 +
                                                   flat.slot_record.size() * 4 + flat.slot_segment.size() * 4);
      stats.metadata_bytes_uploaded += bytes;
      stats.host_to_device_bytes += bytes;
      ++stats.metadata_full_uploads;
    } else if (delta.size() > 0) {
      // One upload of the packed pages ([ids][fill][mask][records], 256-byte aligned parts), one
      // scatter launch.
      const std::size_t n = delta.size();
      std::vector<std::uint8_t>& out = deferred != nullptr ? dpack : pack;
      const std::size_t o_ids = deferred != nullptr ? align256(out.size()) : 0;
      const std::size_t o_fill = o_ids + align256(n * 4);
      const std::size_t o_mask = o_fill + align256(n * 2);
      const std::size_t o_rec = o_mask + align256(delta.evict_mask.size() * 8);
      const std::size_t o_seg = o_rec + align256(delta.slot_record.size() * 4);
      const std::size_t bytes = o_seg + delta.slot_segment.size() * 4;
      out.resize(bytes);
      std::memcpy(out.data() + o_ids, delta.ids.data(), n * 4);
      std::memcpy(out.data() + o_fill, delta.fill.data(), n * 2);
      std::memcpy(out.data() + o_mask, delta.evict_mask.data(), delta.evict_mask.size() * 8);
      std::memcpy(out.data() + o_rec, delta.slot_record.data(), delta.slot_record.size() * 4);
      std::memcpy(out.data() + o_seg, delta.slot_segment.data(), delta.slot_segment.size() * 4);
      stats.metadata_bytes_uploaded += static_cast<std::int64_t>(delta.bytes());
      if (deferred != nullptr) {
        deferred->pages = n;
        deferred->o_ids = o_ids;
        deferred->o_fill = o_fill;
        deferred->o_mask = o_mask;
        deferred->o_rec = o_rec;
        deferred->o_seg = o_seg;
      } else {
        void* dev = nullptr;
        THINKV_RETURN_IF_ERROR(upload(pack.data(), bytes, &dev));
        scatter_pages(static_cast<const std::uint8_t*>(dev), n, o_ids, o_fill, o_mask, o_rec, o_seg);
        THINKV_CUDA_TRY(cudaGetLastError());
      }
    }
    for (int p = 0; p < kNumPrecisions; ++p) {
      meta_rev[p] = view.pools[p].revision;
      meta_cap[p] = cap[p];
    }
    meta_synced = true;
    return Status::ok();
  }

  /// Brings the device's block-list rows (lidx / lcount, one fixed-capacity row per stream) up to
  /// date on `stream`: the lists the table's change log names since the last sync (one upload,
  /// one scatter launch), or every list on the first sync, after the numbering changed (storage
  /// grew or shrank), when a row must grow, or when the log no longer reaches back.
  Status sync_lists(const TableView& t, Deferred* deferred = nullptr) {
    const auto S = static_cast<std::size_t>(config.num_streams);
    bool all = !lists_synced || lptr == nullptr;
    for (int p = 0; p < kNumPrecisions; ++p) all = all || lcap[p] != cap[p];
    std::span<const std::int32_t> changed;
    if (!all) all = !t.list_changes_since(list_rev, changed);
    if (lseen.size() != S) lseen.assign(S, 0);
    auto next_pass = [&] {
      if (++lpass == 0) {
        std::fill(lseen.begin(), lseen.end(), 0);
        lpass = 1;
      }
    };
    // The lists to send (each stream once) and the longest of them.
    std::vector<std::int32_t>& todo = flat.block_indptr;  // scratch reuse
    std::size_t longest = 0;
    auto collect = [&] {
      todo.clear();
      next_pass();
      longest = 0;
      auto take = [&](std::int32_t st) {
        if (st < 0 || static_cast<std::size_t>(st) >= S || lseen[static_cast<std::size_t>(st)] == lpass) return;
        lseen[static_cast<std::size_t>(st)] = lpass;
        const StreamView sv = t.stream(st);
        if (all && sv.blocks.empty()) return;  // every count is cleared first
        todo.push_back(st);
        longest = std::max(longest, sv.blocks.size());
      };
      if (all) {
        for (std::size_t st = 0; st < S; ++st) take(static_cast<std::int32_t>(st));
      } else {
        for (std::int32_t st : changed) take(st);
      }
    };
    collect();
    if (lptr == nullptr || longest > static_cast<std::size_t>(lstride)) {
      THINKV_CUDA_TRY(cudaStreamSynchronize(stream));
      std::size_t stride = std::max<std::size_t>(16, static_cast<std::size_t>(lstride) * 2);
      while (stride < longest) stride *= 2;
      if (lidx != nullptr) (void)cudaFree(lidx);
      lidx = nullptr;
      void* p = nullptr;
      THINKV_RETURN_IF_ERROR(raw_alloc(&p, S * stride * 4, "block lists"));
      lidx = typed<std::uint32_t>(p);
      if (lptr == nullptr) {
        THINKV_RETURN_IF_ERROR(raw_alloc(&p, (S + 1) * 4, "block list rows"));
        lptr = typed<std::int32_t>(p);
        THINKV_RETURN_IF_ERROR(raw_alloc(&p, S * 4, "block list counts"));
        lcount = typed<std::int32_t>(p);
      }
      lstride = static_cast<int>(stride);
      ++epoch;
      fill_row_starts<<<static_cast<unsigned>((S + 256) / 256), 256, 0, stream>>>(lptr, static_cast<int>(S), lstride);
      THINKV_CUDA_TRY(cudaGetLastError());
      if (!all) {
        all = true;
        collect();
      }
    }
    if (all) THINKV_CUDA_TRY(cudaMemsetAsync(lcount, 0, S * 4, stream));
    // Pack: [head: (stream, count, offset) per list][blocks in the flat numbering].
    std::vector<std::int32_t> head;
    std::vector<std::uint32_t>& blocks = flat.block_indices;  // scratch reuse
    head.reserve(todo.size() * 3);
    blocks.clear();
    const std::uint32_t* base_of = nullptr;
    std::uint32_t bases[kNumPrecisions];
    for (int p = 0; p < kNumPrecisions; ++p) bases[p] = dev_base(p);
    base_of = bases;
    for (std::int32_t st : todo) {
      const StreamView sv = t.stream(st);
      head.push_back(st);
      head.push_back(static_cast<std::int32_t>(sv.blocks.size()));
      head.push_back(static_cast<std::int32_t>(blocks.size()));
      for (std::uint32_t b : sv.blocks) {
        const int p = static_cast<int>(pools.precision_of(b));
        blocks.push_back(base_of[p] + (b - pools.base[p]));
      }
    }
    if (!head.empty()) {
      std::vector<std::uint8_t>& out = deferred != nullptr ? dpack : pack;
      const std::size_t o_head = deferred != nullptr ? align256(out.size()) : 0;
      const std::size_t o_blocks = o_head + align256(head.size() * 4);
      out.resize(o_blocks + blocks.size() * 4);
      std::memcpy(out.data() + o_head, head.data(), head.size() * 4);
      std::memcpy(out.data() + o_blocks, blocks.data(), blocks.size() * 4);
      stats.metadata_bytes_uploaded += static_cast<std::int64_t>(head.size() * 4 + blocks.size() * 4);
      if (deferred != nullptr) {
        deferred->lists = head.size() / 3;
        deferred->o_head = o_head;
        deferred->o_blocks = o_blocks;
      } else {
        void* dev = nullptr;
        THINKV_RETURN_IF_ERROR(upload(pack.data(), pack.size(), &dev));
        scatter_lists(static_cast<const std::uint8_t*>(dev), head.size() / 3, o_head, o_blocks);
        THINKV_CUDA_TRY(cudaGetLastError());
      }
    }
    list_rev = t.list_revision;
    lists_synced = true;
    for (int p = 0; p < kNumPrecisions; ++p) lcap[p] = cap[p];
    return Status::ok();
  }

  /// A commit plan as a quantize-append job and its group_size destination slots (flat ids in
  /// the device's numbering).
  Status pack_job(const CommitPlan& plan, kernels::QuantizeAppendJob& job, std::uint32_t* dest) const {
    const int g = config.group_size;
    if (static_cast<int>(plan.slots.size()) != g) {
      return {StatusCode::kInternal, "commit plan has " + std::to_string(plan.slots.size()) +
                                         " slots, expected group_size " + std::to_string(g)};
    }
    job = kernels::QuantizeAppendJob{};
    job.stream = plan.stream;
    job.record = plan.record;
    job.precision = plan.precision;
    for (int i = 0; i < g; ++i) {
      const SlotRef sl = plan.slots[static_cast<std::size_t>(i)];
      if (!has_storage(sl.block)) {
        return {StatusCode::kInternal, "commit to block " + std::to_string(sl.block) + ", which has no device storage"};
      }
      const int pr = static_cast<int>(pools.precision_of(sl.block));
      const std::uint32_t flat = dev_base(pr) + pools.local_index(sl.block);
      dest[i] = flat * static_cast<std::uint32_t>(config.block_size) + sl.slot;
    }
    return Status::ok();
  }

  /// What TBE's selection kernels read, in the current numbering.
  [[nodiscard]] SelectView select_view() const {
    SelectView v{};
    for (int p = 0; p < kNumPrecisions; ++p) {
      v.pages[p] = pages[p];
      v.page_bytes[p] = static_cast<unsigned long long>(layout.page_bytes(static_cast<Precision>(p)));
      v.row_bytes[p] = layout.row_bytes(static_cast<Precision>(p));
      v.dev_base[p] = dev_base(p);
      v.dev_count[p] = cap[p];
    }
    v.records = records;
    v.s2 = s2;
    v.fill = fill;
    v.mask = mask;
    v.slot_record = slot_record;
    v.slot_segment = slot_segment;
    v.lidx = lidx;
    v.lcount = lcount;
    v.lstride = lstride;
    v.d = config.head_dim;
    v.block_size = config.block_size;
    v.words = layout.evict_mask_words();
    return v;
  }

  /// The attention parameters of the open step (streams, q, out and workspace set by the caller).
  [[nodiscard]] kernels::DecodeAttentionParams step_attention_params(float* sparsity) const {
    kernels::DecodeAttentionParams prm;
    prm.num_q_heads = step_n * step_hq;
    prm.num_kv_heads = step_n * step_hkv;
    prm.head_dim = config.head_dim;
    prm.group_size = config.group_size;
    prm.block_size = config.block_size;
    prm.softmax_scale = step_scale;
    prm.max_positions = step_max_positions;
    prm.sparsity = sparsity;
    prm.sparsity_heads = step_dev + o_flags;
    return prm;
  }

  /// Pinned host bytes for a result copied back by synchronize().
  Status result_bytes(std::size_t bytes, void** host) {
    bytes = align256(bytes);
    while (result_chunk < result_chunks.size() && result_used + bytes > result_chunks[result_chunk].second) {
      ++result_chunk;
      result_used = 0;
    }
    if (result_chunk == result_chunks.size()) {
      const std::size_t cap = std::max<std::size_t>(1 << 16, bytes);
      void* p = nullptr;
      THINKV_CUDA_TRY(cudaMallocHost(&p, cap));
      result_chunks.emplace_back(p, cap);
      result_used = 0;
    }
    *host = static_cast<std::uint8_t*>(result_chunks[result_chunk].first) + result_used;
    result_used += bytes;
    return Status::ok();
  }

  void release() {
    release_batched();
    for (void* p : allocations) (void)cudaFree(p);
    allocations.clear();
    for (int p = 0; p < kNumPrecisions; ++p) {
      if (pages[p] != nullptr) (void)cudaFree(pages[p]);
      pages[p] = nullptr;
      cap[p] = 0;
    }
    if (records != nullptr) (void)cudaFree(records);
    records = nullptr;
    num_records = 0;
    free_meta();
    if (indices != nullptr) (void)cudaFree(indices);
    indices = nullptr;
    indices_cap = 0;
    if (attn != nullptr) (void)cudaFree(attn);
    attn = nullptr;
    attn_bytes = 0;
    ready = false;
  }

  void free_meta() {
    for (void* q : {static_cast<void*>(fill), static_cast<void*>(mask), static_cast<void*>(slot_record),
                    static_cast<void*>(slot_segment)}) {
      if (q != nullptr) (void)cudaFree(q);
    }
    fill = nullptr;
    mask = nullptr;
    slot_record = nullptr;
    slot_segment = nullptr;
    meta_blocks = 0;
    meta_synced = false;
    if (delta_dev != nullptr) (void)cudaFree(delta_dev);
    delta_dev = nullptr;
    delta_dev_bytes = 0;
  }

  /// Device allocation owned by the caller (pages, records, metadata mirror).
  static Status raw_alloc(void** p, std::size_t bytes, const char* what) {
    *p = nullptr;
    const cudaError_t e = cudaMalloc(p, bytes == 0 ? 1 : bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return {StatusCode::kPoolExhausted, std::string("cudaMalloc of ") + std::to_string(bytes) + " bytes for " + what +
                                              " failed: out of device memory (lower memory_limit_bytes, the token "
                                              "budget or the number of sequences)"};
    }
    return cuda_status(e, "cudaMalloc");
  }

  /// Replaces *buf (old_bytes) by a buffer of new_bytes keeping its first keep bytes, the rest
  /// poisoned with 0xA5. Nothing changes on an error.
  static Status realloc_keep(std::uint8_t** buf, std::size_t keep, std::size_t new_bytes, const char* what) {
    void* fresh = nullptr;
    if (new_bytes > 0) {
      THINKV_RETURN_IF_ERROR(raw_alloc(&fresh, new_bytes, what));
      if (keep > 0) {
        if (cudaError_t e = cudaMemcpy(fresh, *buf, keep, cudaMemcpyDeviceToDevice); e != cudaSuccess) {
          (void)cudaFree(fresh);
          return cuda_status(e, "cudaMemcpy (growing device storage)");
        }
      }
      if (new_bytes > keep) {
        if (cudaError_t e = cudaMemset(static_cast<std::uint8_t*>(fresh) + keep, 0xA5, new_bytes - keep);
            e != cudaSuccess) {
          (void)cudaFree(fresh);
          return cuda_status(e, "cudaMemset");
        }
      }
      // The copy and the poison ran on the legacy default stream: finish them before any kernel
      // on a non-blocking stream of the caller's touches the new buffer.
      if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        (void)cudaFree(fresh);
        return cuda_status(e, "cudaDeviceSynchronize (growing device storage)");
      }
    }
    if (*buf != nullptr) (void)cudaFree(*buf);
    *buf = static_cast<std::uint8_t*>(fresh);
    return Status::ok();
  }

  /// realloc_keep for the storage (a pool's pages, the key-scale records): moving it changes the
  /// device numbering (epoch) and counts in BackendStats::storage_reallocations.
  Status move_storage(std::uint8_t** buf, std::size_t keep, std::size_t new_bytes, const char* what) {
    THINKV_RETURN_IF_ERROR(realloc_keep(buf, keep, new_bytes, what));
    ++epoch;
    ++stats.storage_reallocations;
    return Status::ok();
  }

  /// New capacity for `want` items when `cap` are held: at least want, doubling on growth (up to
  /// `limit`), down to want when want is half of cap or less.
  static std::uint32_t next_capacity(std::uint32_t cap, std::uint32_t want, std::uint32_t limit) {
    if (want > cap)
      return std::min<std::uint32_t>(limit, std::max<std::uint32_t>(want, cap > limit / 2 ? limit : 2 * cap));
    if (want * 2 <= cap) return want;
    return cap;
  }

  [[nodiscard]] std::int64_t storage_bytes() const {
    std::int64_t n = static_cast<std::int64_t>(num_records) * config.head_dim;
    for (Precision p : kAllPrecisions) n += std::int64_t{cap[static_cast<int>(p)]} * layout.page_bytes(p);
    return n;
  }
  /// The compact numbering (FlatBlockTable): pool p's page i is block base(p) + i.
  [[nodiscard]] std::uint32_t dev_base(int p) const {
    std::uint32_t b = 0;
    for (int q = 0; q < p; ++q) b += cap[q];
    return b;
  }
  [[nodiscard]] std::uint32_t dev_total() const { return dev_base(kNumPrecisions); }

  /// Device allocation owned by `allocations` (staging, scales, commit scratch).
  Status alloc(void** p, std::size_t bytes, const char* what) {
    THINKV_RETURN_IF_ERROR(raw_alloc(p, bytes, what));
    allocations.push_back(*p);
    return Status::ok();
  }

  [[nodiscard]] std::size_t staging_offset(int stream, int row, int kv) const {
    return ((static_cast<std::size_t>(stream) * 2 + kv) * config.group_size + row) * config.head_dim;
  }
  [[nodiscard]] std::size_t page_offset(std::uint32_t block) const {
    return pools.local_index(block) * static_cast<std::size_t>(layout.page_bytes(pools.precision_of(block)));
  }
  [[nodiscard]] bool has_storage(std::uint32_t block) const {
    return block < pools.total && pools.local_index(block) < cap[static_cast<int>(pools.precision_of(block))];
  }

  /// The pool fields both kernel views share.
  template <class View>
  void fill_pools(View& v) const {
    for (int p = 0; p < kNumPrecisions; ++p) {
      v.pages[p] = pages[p];
      v.pool_base[p] = dev_base(p);
      v.pool_count[p] = cap[p];
    }
    v.total_blocks = dev_total();
    v.key_scales = records;
    v.s2 = s2;
    v.staging = staging;
  }

  [[nodiscard]] kernels::QuantizeAppendView append_view() const {
    kernels::QuantizeAppendView v;
    v.num_streams = config.num_streams;
    v.head_dim = config.head_dim;
    v.group_size = config.group_size;
    v.block_size = config.block_size;
    fill_pools(v);
    v.num_records = num_records;
    return v;
  }

  [[nodiscard]] kernels::PagedKvView attention_view() const {
    kernels::PagedKvView v;
    v.num_streams = config.num_streams;
    fill_pools(v);
    v.block_fill = fill;
    v.evict_mask = mask;
    v.slot_record = slot_record;
    v.block_indptr = indptr;
    v.block_indices = indices;
    v.staged_count = staged;
    return v;
  }
};

CudaKvBackend::CudaKvBackend() : impl_(std::make_unique<Impl>()) {}
CudaKvBackend::~CudaKvBackend() = default;
CudaKvBackend::CudaKvBackend(CudaKvBackend&&) noexcept = default;
CudaKvBackend& CudaKvBackend::operator=(CudaKvBackend&&) noexcept = default;

Status CudaKvBackend::init(const StorageConfig& config) {
  THINKV_RETURN_IF_ERROR(config.validate());
  if (!impl_) impl_ = std::make_unique<Impl>();
  Impl& m = *impl_;
  m.release();
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return {StatusCode::kCudaError,
            std::string("CudaKvBackend: no usable CUDA device (") +
                (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") +
                "); use the CPU backend on this machine (CpuKvBackend; `thinkv generate --backend cpu`)"};
  }
  m.config = config;
  m.layout = CacheLayout::from(config);
  m.pools = PoolMap::from(config);
  m.stats = {};
  const int d = config.head_dim;
  const int g = config.group_size;
  const auto streams = static_cast<std::size_t>(config.num_streams);
  std::int64_t bytes = 0;
  void* p = nullptr;
  const std::size_t staging_elems = streams * 2 * g * d;
  THINKV_RETURN_IF_ERROR(m.alloc(&p, staging_elems * 2, "staging"));
  m.staging = typed<std::uint16_t>(p);
  THINKV_CUDA_TRY(cudaMemset(p, 0, staging_elems * 2));
  const std::size_t s2_elems = streams * 2 * kNumPrecisions;
  THINKV_RETURN_IF_ERROR(m.alloc(&p, s2_elems * sizeof(float), "second-level scales"));
  m.s2 = typed<float>(p);
  THINKV_CUDA_TRY(cudaMemset(p, 0, s2_elems * sizeof(float)));
  bytes += static_cast<std::int64_t>(staging_elems * 2 + s2_elems * 4);
  // Block-table mirror and commit scratch (not counted in bytes_allocated, like the host table;
  // the per-block arrays are sized by attend, for the storage there is then).
  THINKV_RETURN_IF_ERROR(m.alloc(&p, (streams + 1) * 4, "block list pointers"));
  m.indptr = typed<std::int32_t>(p);
  THINKV_RETURN_IF_ERROR(m.alloc(&p, streams * 4, "staged counts"));
  m.staged = typed<std::int32_t>(p);
  THINKV_RETURN_IF_ERROR(m.alloc(&p, sizeof(kernels::QuantizeAppendJob), "commit job"));
  m.job = typed<kernels::QuantizeAppendJob>(p);
  THINKV_RETURN_IF_ERROR(m.alloc(&p, static_cast<std::size_t>(g) * 4, "commit slots"));
  m.dest = typed<std::uint32_t>(p);
  THINKV_RETURN_IF_ERROR(m.alloc(&p, sizeof(unsigned long long), "commit counters"));
  m.saturations = typed<unsigned long long>(p);
  THINKV_RETURN_IF_ERROR(m.alloc(&p, sizeof(unsigned int), "commit counters"));
  m.rejected = typed<unsigned int>(p);
  // Batched calls: device staged counts, fault words and list, commit counters.
  THINKV_RETURN_IF_ERROR(m.alloc(&p, streams * 4, "staged counts"));
  m.bstaged = typed<std::int32_t>(p);
  THINKV_CUDA_TRY(cudaMemset(p, 0, streams * 4));
  THINKV_RETURN_IF_ERROR(m.alloc(&p, streams * 4, "fault words"));
  m.fault_word = typed<unsigned int>(p);
  THINKV_CUDA_TRY(cudaMemset(p, 0, streams * 4));
  THINKV_RETURN_IF_ERROR(m.alloc(&p, (1 + 2 * kFaultCap) * 4, "fault list"));
  m.fault_block = typed<unsigned int>(p);
  THINKV_CUDA_TRY(cudaMemset(p, 0, (1 + 2 * kFaultCap) * 4));
  THINKV_RETURN_IF_ERROR(m.alloc(&p, sizeof(unsigned long long) + sizeof(unsigned int), "commit counters"));
  THINKV_CUDA_TRY(cudaMemset(p, 0, sizeof(unsigned long long) + sizeof(unsigned int)));
  m.bsat = typed<unsigned long long>(p);
  m.brej = reinterpret_cast<unsigned int*>(typed<unsigned long long>(p) + 1);
  THINKV_CUDA_TRY(cudaDeviceSynchronize());
  m.stats.bytes_allocated = bytes;
  m.fixed_bytes = bytes;
  m.ready = true;
  return Status::ok();
}

Status CudaKvBackend::resize_pool(Precision p, std::uint32_t blocks) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  const int i = static_cast<int>(p);
  if (blocks > m.pools.count[i]) {
    return {StatusCode::kOutOfRange, "resize_pool(" + std::string(to_string(p)) + ", " + std::to_string(blocks) +
                                         "): the pool's range holds " + std::to_string(m.pools.count[i]) + " blocks"};
  }
  const std::uint32_t cap = m.reserved ? m.cap[i] : Impl::next_capacity(m.cap[i], blocks, m.pools.count[i]);
  if (cap != m.cap[i]) {
    THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));  // batched work still reading or writing pages
    const auto page = static_cast<std::size_t>(m.layout.page_bytes(p));
    THINKV_RETURN_IF_ERROR(m.move_storage(&m.pages[i], std::min(cap, m.cap[i]) * page, cap * page, "pages"));
    m.cap[i] = cap;
    m.stats.bytes_allocated = m.fixed_bytes + m.storage_bytes();
  }
  return Status::ok();
}

Status CudaKvBackend::reserve_storage() {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));
  for (Precision p : kAllPrecisions) {
    const int i = static_cast<int>(p);
    const std::uint32_t cap = m.pools.count[i];
    if (cap == m.cap[i]) continue;
    const auto page = static_cast<std::size_t>(m.layout.page_bytes(p));
    THINKV_RETURN_IF_ERROR(m.move_storage(&m.pages[i], std::min(cap, m.cap[i]) * page, cap * page, "pages"));
    m.cap[i] = cap;
  }
  const auto limit = static_cast<std::uint32_t>(effective_record_capacity(m.config));
  if (limit != m.num_records) {
    const auto d = static_cast<std::size_t>(m.config.head_dim);
    THINKV_RETURN_IF_ERROR(
        m.move_storage(&m.records, std::min(limit, m.num_records) * d, limit * d, "key-scale records"));
    m.num_records = limit;
  }
  m.reserved = true;
  m.stats.bytes_allocated = m.fixed_bytes + m.storage_bytes();
  return Status::ok();
}

Status CudaKvBackend::resize_records(std::uint32_t records) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  const auto limit = static_cast<std::uint32_t>(effective_record_capacity(m.config));
  if (records > limit) {
    return {StatusCode::kOutOfRange,
            "resize_records(" + std::to_string(records) + "): the record range holds " + std::to_string(limit)};
  }
  const std::uint32_t cap = m.reserved ? m.num_records : Impl::next_capacity(m.num_records, records, limit);
  if (cap != m.num_records) {
    THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));
    const auto d = static_cast<std::size_t>(m.config.head_dim);
    THINKV_RETURN_IF_ERROR(m.move_storage(&m.records, std::min(cap, m.num_records) * d, cap * d, "key-scale records"));
    m.num_records = cap;
    m.stats.bytes_allocated = m.fixed_bytes + m.storage_bytes();
  }
  return Status::ok();
}

Status CudaKvBackend::stage(int stream, int row, const float* k, const float* v) {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  const int d = m.config.head_dim;
  std::vector<std::uint16_t> kb(static_cast<std::size_t>(d)), vb(kb.size());
  for (int c = 0; c < d; ++c) {
    kb[static_cast<std::size_t>(c)] = encode_bf16(k[c]);
    vb[static_cast<std::size_t>(c)] = encode_bf16(v[c]);
  }
  THINKV_CUDA_TRY(
      cudaMemcpy(m.staging + m.staging_offset(stream, row, 0), kb.data(), kb.size() * 2, cudaMemcpyHostToDevice));
  THINKV_CUDA_TRY(
      cudaMemcpy(m.staging + m.staging_offset(stream, row, 1), vb.data(), vb.size() * 2, cudaMemcpyHostToDevice));
  const std::int32_t count = row + 1 == m.config.group_size ? 0 : row + 1;  // as stage_rows_kernel keeps it
  THINKV_CUDA_TRY(cudaMemcpy(m.bstaged + stream, &count, 4, cudaMemcpyHostToDevice));
  return Status::ok();
}

Status CudaKvBackend::read_staged(int stream, int row, float* k, float* v) const {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  const int d = m.config.head_dim;
  std::vector<std::uint16_t> kb(static_cast<std::size_t>(d)), vb(kb.size());
  THINKV_CUDA_TRY(
      cudaMemcpy(kb.data(), m.staging + m.staging_offset(stream, row, 0), kb.size() * 2, cudaMemcpyDeviceToHost));
  THINKV_CUDA_TRY(
      cudaMemcpy(vb.data(), m.staging + m.staging_offset(stream, row, 1), vb.size() * 2, cudaMemcpyDeviceToHost));
  for (int c = 0; c < d; ++c) {
    k[c] = decode_bf16(kb[static_cast<std::size_t>(c)]);
    v[c] = decode_bf16(vb[static_cast<std::size_t>(c)]);
  }
  return Status::ok();
}

Status CudaKvBackend::commit(const CommitPlan& plan) {
  THINKV_ONE_TOKEN_CALL();
  Impl& m = *impl_;
  kernels::QuantizeAppendJob job;
  std::vector<std::uint32_t> dest(static_cast<std::size_t>(m.config.group_size));
  THINKV_RETURN_IF_ERROR(m.pack_job(plan, job, dest.data()));
  THINKV_CUDA_TRY(cudaMemcpy(m.job, &job, sizeof(job), cudaMemcpyHostToDevice));
  THINKV_CUDA_TRY(cudaMemcpy(m.dest, dest.data(), dest.size() * 4, cudaMemcpyHostToDevice));
  THINKV_CUDA_TRY(cudaMemset(m.saturations, 0, sizeof(unsigned long long)));
  THINKV_CUDA_TRY(cudaMemset(m.rejected, 0, sizeof(unsigned int)));
  kernels::QuantizeAppendParams prm;
  prm.cache = m.append_view();
  prm.num_jobs = 1;
  prm.jobs = m.job;
  prm.dest_slots = m.dest;
  prm.scale_saturations = m.saturations;
  prm.rejected_jobs = m.rejected;
  THINKV_CUDA_TRY(kernels::launch_quantize_append(prm, nullptr));
  THINKV_CUDA_TRY(cudaDeviceSynchronize());
  unsigned long long sat = 0;
  unsigned int rejected = 0;
  THINKV_CUDA_TRY(cudaMemcpy(&sat, m.saturations, sizeof(sat), cudaMemcpyDeviceToHost));
  THINKV_CUDA_TRY(cudaMemcpy(&rejected, m.rejected, sizeof(rejected), cudaMemcpyDeviceToHost));
  if (rejected != 0) {
    return {StatusCode::kInternal, "quantize-append refused the commit of stream " + std::to_string(plan.stream) +
                                       " (record " + std::to_string(plan.record) + ", precision " +
                                       std::string(to_string(plan.precision)) + ")"};
  }
  m.stats.scale_saturations += static_cast<std::int64_t>(sat);
  ++m.stats.groups_quantized;
  // What the quantize-append kernel stores for this job: g slots (K row, V row, value scales) and,
  // quantized, the record's head_dim key scales.
  m.stats.page_bytes_written += m.layout.commit_bytes(plan.precision);
  return Status::ok();
}

Status CudaKvBackend::reset_stream(int stream) {
  THINKV_BACKEND_READY();
  const Impl& m = *impl_;
  if (stream < 0 || stream >= m.config.num_streams) {
    return {StatusCode::kOutOfRange, "reset_stream(" + std::to_string(stream) + "): no such stream"};
  }
  THINKV_CUDA_TRY(cudaMemsetAsync(m.s2 + static_cast<std::size_t>(stream) * 2 * kNumPrecisions, 0,
                                  2 * kNumPrecisions * sizeof(float), m.stream));
  THINKV_CUDA_TRY(cudaMemsetAsync(m.bstaged + stream, 0, 4, m.stream));
  THINKV_CUDA_TRY(cudaMemsetAsync(m.fault_word + stream, 0, 4, m.stream));
  return Status::ok();
}

Status CudaKvBackend::read_token(const TokenRef& token, float* k, float* v) const {
  THINKV_ONE_TOKEN_CALL();
  const SlotRef slot = token.slot;
  const Impl& m = *impl_;
  if (slot.block >= m.pools.total || slot.slot >= static_cast<std::uint32_t>(m.config.block_size)) {
    return {StatusCode::kOutOfRange,
            "slot {block " + std::to_string(slot.block) + ", slot " + std::to_string(slot.slot) + "} does not exist"};
  }
  if (!m.has_storage(slot.block)) {
    return {StatusCode::kInvalidArgument,
            "slot {block " + std::to_string(slot.block) + ", slot " + std::to_string(slot.slot) + "} has no storage"};
  }
  const int d = m.config.head_dim;
  const int g = m.config.group_size;
  const int bs = m.config.block_size;
  const Precision p = m.pools.precision_of(slot.block);
  const auto rb = static_cast<std::size_t>(m.layout.row_bytes(p));
  const std::uint8_t* page = m.pages[static_cast<int>(p)] + m.page_offset(slot.block);
  std::vector<std::uint8_t> kr(rb), vr(rb);
  THINKV_CUDA_TRY(cudaMemcpy(kr.data(), page + slot.slot * rb, rb, cudaMemcpyDeviceToHost));
  THINKV_CUDA_TRY(
      cudaMemcpy(vr.data(), page + (static_cast<std::size_t>(bs) + slot.slot) * rb, rb, cudaMemcpyDeviceToHost));
  if (p == Precision::kBf16) {
    CpuKvBackend::dequantize_token(p, kr.data(), vr.data(), nullptr, nullptr, 0.0f, 0.0f, d, g, k, v);
    return Status::ok();
  }
  const std::int32_t owner = token.stream;
  const std::uint32_t r = token.record;
  if (owner < 0 || owner >= m.config.num_streams || r == kNoRecord || r >= m.num_records) {
    return {StatusCode::kInvalidArgument,
            "slot {block " + std::to_string(slot.block) + ", slot " + std::to_string(slot.slot) + "} holds no token"};
  }
  std::vector<std::uint8_t> rec(static_cast<std::size_t>(d)), vs(static_cast<std::size_t>(d / g));
  float s2[2 * kNumPrecisions];
  THINKV_CUDA_TRY(
      cudaMemcpy(rec.data(), m.records + static_cast<std::size_t>(r) * d, rec.size(), cudaMemcpyDeviceToHost));
  THINKV_CUDA_TRY(cudaMemcpy(vs.data(),
                             page + 2 * static_cast<std::size_t>(bs) * rb +
                                 static_cast<std::size_t>(slot.slot) * m.layout.value_scale_bytes(p),
                             vs.size(), cudaMemcpyDeviceToHost));
  THINKV_CUDA_TRY(
      cudaMemcpy(s2, m.s2 + static_cast<std::size_t>(owner) * 2 * kNumPrecisions, sizeof(s2), cudaMemcpyDeviceToHost));
  CpuKvBackend::dequantize_token(p, kr.data(), vr.data(), vs.data(), rec.data(), s2[static_cast<int>(p)],
                                 s2[kNumPrecisions + static_cast<int>(p)], d, g, k, v);
  return Status::ok();
}

Status CudaKvBackend::attend(const AttendView& streams, const DecodeAttentionArgs& args) const {
  THINKV_ONE_TOKEN_CALL();
  Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(check_attention_args(args, m.config.num_streams));
  THINKV_RETURN_IF_ERROR(check_attend_view(streams, args));
  const int d = m.config.head_dim;
  if (d != 8 && d != 32 && d != 64 && d != 128 && d != 256) {
    return {StatusCode::kUnsupported,
            "head_dim " + std::to_string(d) + ": the CUDA attention kernel serves head_dim 8, 32, 64, 128 and 256"};
  }
  if (args.num_q_heads / args.num_kv_heads > kernels::kMaxQueryHeadsPerKv) {
    return {StatusCode::kUnsupported, std::to_string(args.num_q_heads / args.num_kv_heads) +
                                          " query heads per KV head: the CUDA attention "
                                          "kernel serves at most " +
                                          std::to_string(kernels::kMaxQueryHeadsPerKv)};
  }
  // The device mirror of the pools' metadata (sync_pools, on the backend's stream, which
  // THINKV_ONE_TOKEN_CALL drained: waited for below), and the attended streams' block lists as a
  // CSR sent every call.
  THINKV_RETURN_IF_ERROR(m.sync_pools(streams));
  THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));
  flatten_streams(streams, m.config.num_streams, m.flat);
  if (m.flat.block_indices.size() > m.indices_cap) {
    if (m.indices != nullptr) (void)cudaFree(m.indices);
    m.indices = nullptr;
    m.indices_cap = 0;
    void* p = nullptr;
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&p, m.flat.block_indices.size() * 2 * 4, "block lists"));
    m.indices = typed<std::uint32_t>(p);
    m.indices_cap = m.flat.block_indices.size() * 2;
  }
  THINKV_CUDA_TRY(
      cudaMemcpy(m.indptr, m.flat.block_indptr.data(), m.flat.block_indptr.size() * 4, cudaMemcpyHostToDevice));
  THINKV_CUDA_TRY(
      cudaMemcpy(m.indices, m.flat.block_indices.data(), m.flat.block_indices.size() * 4, cudaMemcpyHostToDevice));
  THINKV_CUDA_TRY(
      cudaMemcpy(m.staged, m.flat.staged_count.data(), m.flat.staged_count.size() * 4, cudaMemcpyHostToDevice));
  m.stats.metadata_bytes_uploaded += static_cast<std::int64_t>(
      m.flat.block_indptr.size() * 4 + m.flat.block_indices.size() * 4 + m.flat.staged_count.size() * 4);
  // Scratch: q, out, sparsity, streams, workspace (16-byte aligned pieces of one buffer).
  kernels::DecodeAttentionParams prm;
  prm.num_q_heads = args.num_q_heads;
  prm.num_kv_heads = args.num_kv_heads;
  prm.head_dim = d;
  prm.group_size = m.config.group_size;
  prm.block_size = m.config.block_size;
  prm.softmax_scale = args.softmax_scale;
  // The split plan's hint: the longest stream of this launch, in slot positions.
  for (int h = 0; h < args.num_kv_heads; ++h) {
    const auto st = static_cast<std::size_t>(args.kv_streams[h]);
    const long long pos =
        static_cast<long long>(m.flat.block_indptr[st + 1] - m.flat.block_indptr[st]) * m.config.block_size +
        m.flat.staged_count[st];
    if (pos > prm.max_positions) prm.max_positions = pos;
  }
  const auto align = [](std::size_t x) { return (x + 255) & ~std::size_t{255}; };
  const std::size_t q_bytes = align(static_cast<std::size_t>(args.num_q_heads) * d * 4);
  const std::size_t sp_bytes = align(static_cast<std::size_t>(args.num_q_heads) * 4);
  const std::size_t st_bytes = align(static_cast<std::size_t>(args.num_kv_heads) * 4);
  // The workspace is sized for the plan with sparsity (prm.sparsity is set below); without it the
  // plan never takes more chunks. Only the pointer's nullness is read here.
  kernels::DecodeAttentionParams sizing = prm;
  float sparsity_marker = 0.0f;
  sizing.sparsity = &sparsity_marker;
  const std::size_t ws_bytes = align(kernels::paged_decode_attention_workspace_size(sizing));
  const std::size_t need = 2 * q_bytes + sp_bytes + st_bytes + ws_bytes;
  if (need > m.attn_bytes) {
    if (m.attn != nullptr) (void)cudaFree(m.attn);
    m.attn = nullptr;
    m.attn_bytes = 0;
    THINKV_CUDA_TRY(cudaMalloc(&m.attn, need));
    m.attn_bytes = need;
  }
  char* base = static_cast<char*>(m.attn);
  float* dq = reinterpret_cast<float*>(base);
  float* dout = reinterpret_cast<float*>(base + q_bytes);
  float* dsp = reinterpret_cast<float*>(base + 2 * q_bytes);
  auto* dstreams = reinterpret_cast<std::int32_t*>(base + 2 * q_bytes + sp_bytes);
  void* dws = base + 2 * q_bytes + sp_bytes + st_bytes;
  THINKV_CUDA_TRY(cudaMemcpy(dq, args.q, static_cast<std::size_t>(args.num_q_heads) * d * 4, cudaMemcpyHostToDevice));
  THINKV_CUDA_TRY(
      cudaMemcpy(dstreams, args.kv_streams, static_cast<std::size_t>(args.num_kv_heads) * 4, cudaMemcpyHostToDevice));
  prm.streams = dstreams;
  prm.q = dq;
  prm.out = dout;
  prm.sparsity = args.sparsity != nullptr ? dsp : nullptr;
  prm.workspace = dws;
  const kernels::PagedKvView view = m.attention_view();
  if (cudaError_t e = kernels::check_paged_decode_attention(view, prm); e != cudaSuccess) {
    return {StatusCode::kUnsupported, "the CUDA attention kernel refuses this cache (head_dim " + std::to_string(d) +
                                          ", group_size " + std::to_string(prm.group_size) + ", block_size " +
                                          std::to_string(prm.block_size) + "): " + cudaGetErrorString(e)};
  }
  THINKV_CUDA_TRY(kernels::launch_paged_decode_attention(view, prm, nullptr));
  THINKV_CUDA_TRY(cudaDeviceSynchronize());
  THINKV_CUDA_TRY(
      cudaMemcpy(args.out, dout, static_cast<std::size_t>(args.num_q_heads) * d * 4, cudaMemcpyDeviceToHost));
  if (args.sparsity != nullptr) {
    THINKV_CUDA_TRY(
        cudaMemcpy(args.sparsity, dsp, static_cast<std::size_t>(args.num_q_heads) * 4, cudaMemcpyDeviceToHost));
  }
  return Status::ok();
}

BackendStats CudaKvBackend::stats() const {
  if (!impl_ || !impl_->ready) return impl_ ? impl_->stats : BackendStats{};
  BackendStats s = impl_->stats;
  unsigned long long sat = 0;
  if (cudaStreamSynchronize(impl_->stream) == cudaSuccess &&
      cudaMemcpy(&sat, impl_->bsat, sizeof(sat), cudaMemcpyDeviceToHost) == cudaSuccess) {
    s.scale_saturations += static_cast<std::int64_t>(sat);
  } else {
    (void)cudaGetLastError();
  }
  return s;
}

// ---- batched calls --------------------------------------------------------------------------

Status CudaKvBackend::set_stream(CUstream_st* stream) {
  THINKV_BACKEND_READY();
  if (stream == impl_->stream) return Status::ok();
  THINKV_CUDA_TRY(cudaStreamSynchronize(impl_->stream));
  impl_->stream = stream;
  return Status::ok();
}

CUstream_st* CudaKvBackend::stream() const noexcept { return impl_ ? impl_->stream : nullptr; }

Status CudaKvBackend::stage_batch(std::span<const StageRow> rows, TensorRef k, TensorRef v) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  if (rows.empty()) return Status::ok();
  if (k.data == nullptr || v.data == nullptr) return {StatusCode::kInvalidArgument, "stage_batch: null k or v"};
  for (const StageRow& r : rows) {
    if (r.stream < 0 || r.stream >= m.config.num_streams || r.row < 0 || r.row >= m.config.group_size || r.fault < 0 ||
        r.fault >= m.config.num_streams || r.src < 0) {
      return {StatusCode::kInternal, "stage_batch: row for stream " + std::to_string(r.stream) + ", staging row " +
                                         std::to_string(r.row) + " is out of range"};
    }
  }
  void* dev = nullptr;
  THINKV_RETURN_IF_ERROR(m.upload(rows.data(), rows.size_bytes(), &dev));
  const int d = m.config.head_dim;
  const int threads = std::min(256, (d + 31) / 32 * 32);
  stage_rows_kernel<<<static_cast<unsigned>(rows.size()), threads, 0, m.stream>>>(
      static_cast<const StageRow*>(dev), k.data, v.data, k.type, v.type, d, m.config.group_size, m.staging, m.bstaged,
      m.fault_word, m.fault_block, kFaultCap);
  THINKV_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

Status CudaKvBackend::commit_batch(std::span<const CommitPlan> plans) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  if (plans.empty()) return Status::ok();
  const int g = m.config.group_size;
  const std::size_t n = plans.size();
  const std::size_t o_dest = align256(n * sizeof(kernels::QuantizeAppendJob));
  m.pack.resize(o_dest + n * g * 4);
  auto* jobs = reinterpret_cast<kernels::QuantizeAppendJob*>(m.pack.data());
  auto* dest = reinterpret_cast<std::uint32_t*>(m.pack.data() + o_dest);
  for (std::size_t j = 0; j < n; ++j) {
    THINKV_RETURN_IF_ERROR(m.pack_job(plans[j], jobs[j], dest + j * static_cast<std::size_t>(g)));
  }
  void* dev = nullptr;
  THINKV_RETURN_IF_ERROR(m.upload(m.pack.data(), m.pack.size(), &dev));
  kernels::QuantizeAppendParams prm;
  prm.cache = m.append_view();
  prm.num_jobs = static_cast<int>(n);
  prm.jobs = static_cast<const kernels::QuantizeAppendJob*>(dev);
  prm.dest_slots = reinterpret_cast<const std::uint32_t*>(static_cast<const std::uint8_t*>(dev) + o_dest);
  prm.scale_saturations = m.bsat;
  prm.rejected_jobs = m.brej;
  THINKV_CUDA_TRY(kernels::launch_quantize_append(prm, m.stream));
  m.stats.groups_quantized += static_cast<std::int64_t>(n);
  for (const CommitPlan& plan : plans) m.stats.page_bytes_written += m.layout.commit_bytes(plan.precision);
  return Status::ok();
}

namespace {
/// What both prompt attentions refuse before launching: a shape the prefill kernel does not serve
/// (kUnsupported naming the call).
Status check_prefill_shape(const char* call, int head_dim, int num_q_heads) {
  if (head_dim > kernels::kPrefillMaxHeadDim || (num_q_heads + 3) / 4 > 65535) {
    return {StatusCode::kUnsupported,
            std::string(call) + ": head_dim " + std::to_string(head_dim) + " with " + std::to_string(num_q_heads) +
                " query heads: the prefill kernel serves head_dim <= " + std::to_string(kernels::kPrefillMaxHeadDim) +
                " and up to 262,140 heads"};
  }
  return Status::ok();
}
/// The prefill kernel's parameters for a prompt attention, its K and V as given.
kernels::PrefillAttentionParams prefill_params(const PromptAttendArgs& a) {
  kernels::PrefillAttentionParams p;
  p.tokens = a.tokens;
  p.num_q_heads = a.num_q_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.head_dim = a.head_dim;
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.out = a.out.data;
  p.q_type = a.q.type;
  p.k_type = a.k.type;
  p.v_type = a.v.type;
  p.out_type = a.out.type;
  p.softmax_scale = a.softmax_scale;
  return p;
}
}  // namespace

Status CudaKvBackend::attend_prompt(const PromptAttendArgs& a) const {
  THINKV_BACKEND_READY();
  THINKV_RETURN_IF_ERROR(check_prompt_attend(a));
  THINKV_RETURN_IF_ERROR(check_prefill_shape("attend_prompt", a.head_dim, a.num_q_heads));
  THINKV_CUDA_TRY(kernels::launch_prefill_attention(prefill_params(a), impl_->stream));
  return Status::ok();
}

Status CudaKvBackend::attend_chunk(const AttendView& view, const PromptAttendArgs& a) const {
  THINKV_BACKEND_READY();
  THINKV_RETURN_IF_ERROR(check_prompt_attend(a));
  Impl& m = *impl_;
  const int d = m.config.head_dim, g = m.config.group_size, bs = m.config.block_size, hkv = a.num_kv_heads;
  if (a.head_dim != d || view.streams.size() != static_cast<std::size_t>(hkv)) {
    return {StatusCode::kShapeMismatch, "attend_chunk: head_dim " + std::to_string(a.head_dim) + " and " +
                                            std::to_string(view.streams.size()) + " view streams for " +
                                            std::to_string(hkv) + " KV heads (the cache's head_dim is " +
                                            std::to_string(d) + ")"};
  }
  THINKV_RETURN_IF_ERROR(check_prefill_shape("attend_chunk", d, a.num_q_heads));
  // Every stored token in attention order (live slots of the blocks in list order, then the
  // staged rows), its device addresses resolved here from the host's table.
  std::vector<ChunkToken>& toks = m.chunk_tokens;
  toks.clear();
  std::vector<int> prefix(static_cast<std::size_t>(hkv));
  std::size_t longest = 0;
  for (int h = 0; h < hkv; ++h) {
    const StreamView& sv = view.streams[static_cast<std::size_t>(h)];
    if (sv.stream < 0 || sv.stream >= m.config.num_streams) {
      return {StatusCode::kInvalidArgument, "attend_chunk: view stream " + std::to_string(sv.stream) +
                                                " is out of range for KV head " + std::to_string(h)};
    }
    prefix[static_cast<std::size_t>(h)] = static_cast<int>(sv.live) + sv.staged;
    longest = std::max(longest, static_cast<std::size_t>(sv.live) + static_cast<std::size_t>(sv.staged));
  }
  const std::size_t rows = longest + static_cast<std::size_t>(a.tokens);
  for (int h = 0; h < hkv; ++h) {
    const StreamView& sv = view.streams[static_cast<std::size_t>(h)];
    auto dst = static_cast<std::uint32_t>(static_cast<std::size_t>(h) * rows);
    const std::uint32_t first = dst;
    for (std::uint32_t b : sv.blocks) {
      const int p = view.pool_of(b);
      if (p < 0 || !m.has_storage(b)) {
        return {StatusCode::kInvalidArgument, "attend_chunk: stream " + std::to_string(sv.stream) + " lists block " +
                                                  std::to_string(b) + ", which has no storage"};
      }
      const auto prec = static_cast<Precision>(p);
      const auto rb = static_cast<std::size_t>(m.layout.row_bytes(prec));
      const std::uint8_t* page = m.pages[p] + m.page_offset(b);
      for (int s = 0; s < bs; ++s) {
        if (!view.live(p, b, s)) continue;
        if (dst - first >= static_cast<std::uint32_t>(sv.live)) {
          return {StatusCode::kInvalidArgument, "attend_chunk: stream " + std::to_string(sv.stream) +
                                                    " has more live slots than the " + std::to_string(sv.live) +
                                                    " its view lists"};
        }
        ChunkToken t{};
        t.k = page + static_cast<std::size_t>(s) * rb;
        t.v = page + (static_cast<std::size_t>(bs) + s) * rb;
        t.precision = p;
        t.dst = dst++;
        if (prec != Precision::kBf16) {
          const TokenRef ref = view.token(p, b, s);
          if (ref.stream < 0 || ref.stream >= m.config.num_streams || ref.record == kNoRecord ||
              ref.record >= m.num_records) {
            return {StatusCode::kInvalidArgument, "attend_chunk: slot {block " + std::to_string(b) + ", slot " +
                                                      std::to_string(s) + "} holds no token"};
          }
          t.value_scales = page + 2 * static_cast<std::size_t>(bs) * rb +
                           static_cast<std::size_t>(s) * m.layout.value_scale_bytes(prec);
          t.key_scales = m.records + static_cast<std::size_t>(ref.record) * d;
          t.s2 = m.s2 + static_cast<std::size_t>(ref.stream) * 2 * kNumPrecisions;
        }
        toks.push_back(t);
      }
    }
    if (dst - first != static_cast<std::uint32_t>(sv.live)) {
      return {StatusCode::kInvalidArgument, "attend_chunk: stream " + std::to_string(sv.stream) + " lists " +
                                                std::to_string(sv.live) + " live slots but its blocks hold " +
                                                std::to_string(dst - first)};
    }
    for (int r = 0; r < sv.staged; ++r) {
      ChunkToken t{};
      t.k = reinterpret_cast<const std::uint8_t*>(m.staging + m.staging_offset(sv.stream, r, 0));
      t.v = reinterpret_cast<const std::uint8_t*>(m.staging + m.staging_offset(sv.stream, r, 1));
      t.precision = static_cast<int>(Precision::kBf16);
      t.dst = dst++;
      toks.push_back(t);
    }
  }
  // Scratch: K and V in FP32 ([hkv, rows, d] each), then one upload of [tokens][prefix].
  const auto align = [](std::size_t x) { return (x + 255) & ~std::size_t{255}; };
  const std::size_t kv_bytes = align(static_cast<std::size_t>(hkv) * rows * d * 4);
  if (2 * kv_bytes > m.chunk_bytes) {
    if (m.chunk != nullptr) (void)cudaFree(m.chunk);
    m.chunk = nullptr;
    m.chunk_bytes = 0;
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&m.chunk, 2 * kv_bytes, "prompt chunk scratch"));
    m.chunk_bytes = 2 * kv_bytes;
  }
  auto* kbuf = static_cast<float*>(m.chunk);
  auto* vbuf = reinterpret_cast<float*>(static_cast<std::uint8_t*>(m.chunk) + kv_bytes);
  const std::size_t o_prefix = align(toks.size() * sizeof(ChunkToken));
  m.pack.assign(o_prefix + prefix.size() * 4, 0);
  std::memcpy(m.pack.data(), toks.data(), toks.size() * sizeof(ChunkToken));
  std::memcpy(m.pack.data() + o_prefix, prefix.data(), prefix.size() * 4);
  void* dev = nullptr;
  THINKV_RETURN_IF_ERROR(m.upload(m.pack.data(), m.pack.size(), &dev));
  const auto* dtoks = static_cast<const ChunkToken*>(dev);
  const auto* dprefix = reinterpret_cast<const int*>(static_cast<const std::uint8_t*>(dev) + o_prefix);
  const int threads = std::min(256, (d + 31) / 32 * 32);
  if (!toks.empty()) {
    chunk_gather_kernel<<<static_cast<unsigned>(toks.size()), threads, 0, m.stream>>>(dtoks, d, g, kbuf, vbuf);
    THINKV_CUDA_TRY(cudaGetLastError());
  }
  chunk_place_kernel<<<dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>(hkv)), threads, 0, m.stream>>>(
      a.k.data, a.v.data, a.k.type, a.v.type, hkv, d, dprefix, rows, kbuf, vbuf);
  THINKV_CUDA_TRY(cudaGetLastError());
  kernels::PrefillAttentionParams p = prefill_params(a);  // head_dim == d, num_kv_heads == hkv (checked above)
  p.k = kbuf;
  p.v = vbuf;
  p.k_type = p.v_type = ElementType::kF32;
  p.prefix = dprefix;
  p.kv_row_stride = d;
  p.kv_head_stride = static_cast<long long>(rows) * d;
  THINKV_CUDA_TRY(kernels::launch_prefill_attention(p, m.stream));
  return Status::ok();
}

Status CudaKvBackend::prepare_step(const StepView& step) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  const int d = m.config.head_dim, g = m.config.group_size;
  const std::size_t n = step.seqs.size();
  const auto L = static_cast<std::size_t>(step.num_layers);
  const auto hkv = static_cast<std::size_t>(step.num_kv_heads);
  const auto hq = static_cast<std::size_t>(step.num_q_heads);
  if (n == 0 || L == 0 || hkv == 0 || hq == 0 || hq % hkv != 0 || step.layer_commits.size() != L + 1 ||
      step.sparsity_slot.size() != L || step.layer_commits[L] != step.commits.size() ||
      n * hkv > static_cast<std::size_t>(m.config.num_streams)) {
    return {StatusCode::kInvalidArgument, "prepare_step: the step's tables do not match its shape"};
  }
  if (d != 8 && d != 32 && d != 64 && d != 128 && d != 256) {
    return {StatusCode::kUnsupported,
            "head_dim " + std::to_string(d) + ": the CUDA attention kernel serves head_dim 8, 32, 64, 128 and 256"};
  }
  if (hq / hkv > static_cast<std::size_t>(kernels::kMaxQueryHeadsPerKv)) {
    return {StatusCode::kUnsupported, std::to_string(hq / hkv) +
                                          " query heads per KV head: the CUDA attention kernel serves at most " +
                                          std::to_string(kernels::kMaxQueryHeadsPerKv)};
  }
  m.step_ready = false;
  // 1. The metadata mirror's and the block lists' changes, packed (sent below with the step).
  AttendView pools_view;
  pools_view.block_size = step.table.block_size;
  pools_view.evict_mask_words = step.table.evict_mask_words;
  for (int p = 0; p < kNumPrecisions; ++p) pools_view.pools[p] = step.table.pool(p);
  Impl::Deferred updates;
  m.dpack.clear();
  THINKV_RETURN_IF_ERROR(m.sync_pools(pools_view, &updates));
  THINKV_RETURN_IF_ERROR(m.sync_lists(step.table, &updates));
  // 2. The step area, laid out by capacity (grown by doubling; growing it changes the epoch).
  int slots = 0;
  for (std::int8_t x : step.sparsity_slot) slots = std::max(slots, x + 1);
  const std::size_t jobs = step.commits.size();
  if (n > m.cap_n || jobs > m.cap_jobs || L != m.cap_layers || m.step_dev == nullptr) {
    m.cap_n = std::max(n, 2 * m.cap_n);
    m.cap_jobs = std::max<std::size_t>(std::max(jobs, 2 * m.cap_jobs), 64);
    m.cap_layers = L;
    m.o_ranges = align256(m.cap_n * sizeof(StepSequence));
    m.o_jobs = m.o_ranges + align256((L + 1) * 4);
    m.o_dest = m.o_jobs + align256(m.cap_jobs * sizeof(kernels::QuantizeAppendJob));
    m.o_streams = m.o_dest + align256(m.cap_jobs * static_cast<std::size_t>(g) * 4);
    m.o_flags = m.o_streams + align256(L * m.cap_n * hkv * 4);
    m.o_sparsity = m.o_flags + align256(m.cap_n * hkv);
    const std::size_t need = m.o_sparsity + L * m.cap_n * hq * 4;
    THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));  // the previous step's kernels read the area
    if (m.step_dev != nullptr) (void)cudaFree(m.step_dev);
    m.step_dev = nullptr;
    m.step_dev_bytes = 0;
    void* p = nullptr;
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&p, need, "the decode step's tables"));
    m.step_dev = static_cast<std::uint8_t*>(p);
    m.step_dev_bytes = need;
    if (m.sp_done != nullptr) THINKV_CUDA_TRY(cudaEventSynchronize(m.sp_done));
    if (m.sp_pinned != nullptr) (void)cudaFreeHost(m.sp_pinned);
    m.sp_pinned = nullptr;
    m.sp_pinned_floats = 0;
    THINKV_CUDA_TRY(cudaMallocHost(&p, L * m.cap_n * hq * 4));
    m.sp_pinned = static_cast<float*>(p);
    m.sp_pinned_floats = L * m.cap_n * hq;
    ++m.epoch;
  }
  if (m.sp_done == nullptr) THINKV_CUDA_TRY(cudaEventCreateWithFlags(&m.sp_done, cudaEventDisableTiming));
  // The upload: [sequences][ranges][jobs][dest], the gaps left as they are.
  const std::size_t up = m.o_dest + jobs * static_cast<std::size_t>(g) * 4;
  m.pack.resize(up);
  std::memcpy(m.pack.data(), step.seqs.data(), n * sizeof(StepSequence));
  std::memcpy(m.pack.data() + m.o_ranges, step.layer_commits.data(), (L + 1) * 4);
  auto* jp = reinterpret_cast<kernels::QuantizeAppendJob*>(m.pack.data() + m.o_jobs);
  auto* dp = reinterpret_cast<std::uint32_t*>(m.pack.data() + m.o_dest);
  m.step_layer_bytes.assign(L, 0);
  for (std::size_t l = 0; l < L; ++l) {
    for (std::uint32_t j = step.layer_commits[l]; j < step.layer_commits[l + 1]; ++j) {
      const CommitPlan& plan = step.commits[j];
      THINKV_RETURN_IF_ERROR(m.pack_job(plan, jp[j], dp + static_cast<std::size_t>(j) * static_cast<std::size_t>(g)));
      m.step_layer_bytes[l] += m.layout.commit_bytes(plan.precision);
    }
  }
  // The device's work, back to back once the host has staged it: the updates' copy and
  // scatters, the step's tables, their expansion.
  Impl::Staged st_updates, st_tables;
  THINKV_RETURN_IF_ERROR(m.stage_deferred(updates, st_updates));
  THINKV_RETURN_IF_ERROR(m.stage(m.pack.data(), up, st_tables));
  const int timer = m.time_start(0);
  THINKV_RETURN_IF_ERROR(m.launch_deferred(updates, st_updates));
  THINKV_RETURN_IF_ERROR(m.issue(st_tables, m.step_dev, nullptr));
  const std::size_t cells = L * n * hkv;
  expand_step_kernel<<<static_cast<unsigned>((cells + 255) / 256), 256, 0, m.stream>>>(
      reinterpret_cast<const StepSequence*>(m.step_dev), static_cast<int>(n), static_cast<int>(hkv),
      static_cast<int>(L), static_cast<int>(m.cap_n), reinterpret_cast<std::int32_t*>(m.step_dev + m.o_streams),
      m.step_dev + m.o_flags);
  THINKV_CUDA_TRY(cudaGetLastError());
  m.time_stop(timer);
  // 3. The attention's launch: the split count (fixed per epoch and batch size when capturable)
  // and its scratch, sized here so that no launch of the step allocates.
  m.step_n = static_cast<int>(n);
  m.step_layers = static_cast<int>(L);
  m.step_hkv = static_cast<int>(hkv);
  m.step_hq = static_cast<int>(hq);
  m.step_scale = step.softmax_scale;
  m.step_max_positions = step.max_positions;
  m.step_capturable = step.capturable;
  m.step_layer_commits.assign(step.layer_commits.begin(), step.layer_commits.end());
  m.step_slot.assign(step.sparsity_slot.begin(), step.sparsity_slot.end());
  m.step_sparsity = step.sparsity;
  m.step_slots = slots;
  kernels::DecodeAttentionParams sizing = m.step_attention_params(static_cast<float*>(nullptr));
  float marker = 0.0f;
  sizing.sparsity = &marker;
  if (step.capturable && (m.fixed_splits == 0 || m.fixed_splits_n != m.step_n || m.fixed_splits_epoch != m.epoch)) {
    sizing.num_splits = 0;
    m.fixed_splits = kernels::paged_decode_attention_splits(sizing);
    m.fixed_splits_n = m.step_n;
    m.fixed_splits_epoch = m.epoch;
  }
  if (step.capturable) sizing.num_splits = m.fixed_splits;
  const std::size_t qn = n * hq * static_cast<std::size_t>(d);
  const std::size_t need = 2 * align256(qn * 4) + align256(kernels::paged_decode_attention_workspace_size(sizing));
  if (need > m.battn_bytes) {
    THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));
    if (m.battn != nullptr) (void)cudaFree(m.battn);
    m.battn = nullptr;
    m.battn_bytes = 0;
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&m.battn, need, "attention scratch"));
    m.battn_bytes = need;
    ++m.epoch;
    if (step.capturable) m.fixed_splits_epoch = m.epoch;  // the split count was sized into it
  }
  // Counters for every layer of the step (a replayed graph makes no host call per layer).
  m.stats.groups_quantized += static_cast<std::int64_t>(jobs);
  for (std::int64_t b : m.step_layer_bytes) m.stats.page_bytes_written += b;
  m.sp_pending = false;
  m.step_ready = true;
  return Status::ok();
}

Status CudaKvBackend::append_step(int layer, TensorRef k, TensorRef v) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  if (!m.step_ready || layer < 0 || layer >= m.step_layers) {
    return {StatusCode::kInvalidArgument, "append_step: layer " + std::to_string(layer) + " of no prepared step"};
  }
  if (k.data == nullptr || v.data == nullptr) return {StatusCode::kInvalidArgument, "append_step: null k or v"};
  const int d = m.config.head_dim;
  const int threads = std::min(256, (d + 31) / 32 * 32);
  const int timer = m.time_start(1);
  stage_step_kernel<<<static_cast<unsigned>(m.step_n * m.step_hkv), threads, 0, m.stream>>>(
      reinterpret_cast<const StepSequence*>(m.step_dev), layer, m.step_hkv, k.data, v.data, k.type, v.type, d,
      m.config.group_size, m.staging, m.bstaged, m.fault_word, m.fault_block, kFaultCap);
  THINKV_CUDA_TRY(cudaGetLastError());
  const auto l = static_cast<std::size_t>(layer);
  // The layer's commits: a capturable step launches for the most the layer can have and reads its
  // range from the device; otherwise exactly the layer's, or nothing.
  const std::uint32_t count = m.step_layer_commits[l + 1] - m.step_layer_commits[l];
  if (count == 0 && !m.step_capturable) {
    m.time_stop(timer);
    return Status::ok();
  }
  kernels::QuantizeAppendParams prm;
  prm.cache = m.append_view();
  prm.jobs = reinterpret_cast<const kernels::QuantizeAppendJob*>(m.step_dev + m.o_jobs);
  prm.dest_slots = reinterpret_cast<const std::uint32_t*>(m.step_dev + m.o_dest);
  prm.job_range = reinterpret_cast<const std::uint32_t*>(m.step_dev + m.o_ranges) + l;
  prm.num_jobs = m.step_capturable ? m.step_n * m.step_hkv : static_cast<int>(count);
  prm.scale_saturations = m.bsat;
  prm.rejected_jobs = m.brej;
  THINKV_CUDA_TRY(kernels::launch_quantize_append(prm, m.stream));
  m.time_stop(timer);
  return Status::ok();
}

Status CudaKvBackend::attend_step(int layer, TensorRef q, MutableTensorRef out) const {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  if (!m.step_ready || layer < 0 || layer >= m.step_layers) {
    return {StatusCode::kInvalidArgument, "attend_step: layer " + std::to_string(layer) + " of no prepared step"};
  }
  if (q.data == nullptr || out.data == nullptr) return {StatusCode::kInvalidArgument, "attend_step: null q or out"};
  const int d = m.config.head_dim;
  const int slot = m.step_slot[static_cast<std::size_t>(layer)];
  float* dsp = slot >= 0 ? reinterpret_cast<float*>(m.step_dev + m.o_sparsity) +
                               static_cast<std::size_t>(slot) * m.cap_n * static_cast<std::size_t>(m.step_hq)
                         : nullptr;
  kernels::DecodeAttentionParams prm = m.step_attention_params(dsp);
  prm.streams = reinterpret_cast<const std::int32_t*>(m.step_dev + m.o_streams) +
                static_cast<std::size_t>(layer) * m.cap_n * static_cast<std::size_t>(m.step_hkv);
  if (m.step_capturable) prm.num_splits = m.fixed_splits;
  const std::size_t qn = static_cast<std::size_t>(prm.num_q_heads) * d;
  const bool q32 = q.type == ElementType::kF32, o32 = out.type == ElementType::kF32;
  char* base = static_cast<char*>(m.battn);
  float* dq = q32 ? static_cast<float*>(const_cast<void*>(q.data)) : reinterpret_cast<float*>(base);
  float* dout = o32 ? static_cast<float*>(out.data) : reinterpret_cast<float*>(base + align256(qn * 4));
  if (!q32) {
    convert_to_f32<<<static_cast<unsigned>((qn + 255) / 256), 256, 0, m.stream>>>(q.data, q.type, dq, qn);
    THINKV_CUDA_TRY(cudaGetLastError());
  }
  prm.q = dq;
  prm.out = dout;
  prm.workspace = base + 2 * align256(qn * 4);
  kernels::PagedKvView kv = m.attention_view();
  kv.block_indptr = m.lptr;
  kv.block_indices = m.lidx;
  kv.block_count = m.lcount;
  kv.staged_count = m.bstaged;
  if (cudaError_t e = kernels::check_paged_decode_attention(kv, prm); e != cudaSuccess) {
    return {StatusCode::kUnsupported, "the CUDA attention kernel refuses this batch (head_dim " + std::to_string(d) +
                                          ", group_size " + std::to_string(prm.group_size) + ", block_size " +
                                          std::to_string(prm.block_size) + ", " + std::to_string(prm.num_kv_heads) +
                                          " KV heads): " + cudaGetErrorString(e)};
  }
  const int timer = m.time_start(2);
  THINKV_CUDA_TRY(kernels::launch_paged_decode_attention(kv, prm, m.stream));
  m.time_stop(timer);
  if (!o32) {
    convert_from_f32<<<static_cast<unsigned>((qn + 255) / 256), 256, 0, m.stream>>>(dout, out.data, out.type, qn);
    THINKV_CUDA_TRY(cudaGetLastError());
  }
  if (dsp != nullptr) {
    // Back to the host (pinned) as soon as the layer is done; wait_sparsity waits for the last.
    const std::size_t floats = static_cast<std::size_t>(m.step_n) * static_cast<std::size_t>(m.step_hq);
    THINKV_CUDA_TRY(cudaMemcpyAsync(m.sp_pinned + static_cast<std::size_t>(slot) * floats, dsp, floats * 4,
                                    cudaMemcpyDeviceToHost, m.stream));
    // Captured, an external record: a node of the graph the host can wait on after a replay.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    THINKV_CUDA_TRY(cudaStreamIsCapturing(m.stream, &capture));
    if (capture == cudaStreamCaptureStatusActive) {
      THINKV_CUDA_TRY(cudaEventRecordWithFlags(m.sp_done, m.stream, cudaEventRecordExternal));
    } else {
      THINKV_CUDA_TRY(cudaEventRecord(m.sp_done, m.stream));
    }
    m.sp_pending = true;
  }
  return Status::ok();
}

Status CudaKvBackend::wait_sparsity() {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  if (m.step_sparsity == nullptr || m.step_slots == 0) return Status::ok();
  // The last sparsity layer's copy, not the rest of the step. A capturable step has sparsity
  // layers on every step, recorded in its graph when it was replayed (no host call then).
  if (!m.sp_pending && !m.step_capturable) return Status::ok();
  THINKV_CUDA_TRY(cudaEventSynchronize(m.sp_done));
  const std::size_t floats =
      static_cast<std::size_t>(m.step_slots) * static_cast<std::size_t>(m.step_n) * static_cast<std::size_t>(m.step_hq);
  std::memcpy(m.step_sparsity, m.sp_pinned, floats * 4);
  m.stats.device_to_host_bytes += static_cast<std::int64_t>(floats * 4);
  m.sp_pending = false;
  return Status::ok();
}

std::uint64_t CudaKvBackend::graph_epoch() const noexcept { return impl_ ? impl_->epoch : 0; }

void CudaKvBackend::set_device_timing(bool on) {
  if (impl_) impl_->timing = on;
}

void CudaKvBackend::set_kmeans_split_jobs(int jobs) noexcept {
  if (impl_) impl_->kmeans_split_jobs = std::max(jobs, 1);
}

Status CudaKvBackend::device_times(DeviceTimes& out) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));
  for (Impl::Timed& t : m.timed) {
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, t.start, t.stop) == cudaSuccess) {
      double* part[] = {&m.times.prepare_ms, &m.times.append_ms, &m.times.attend_ms, &m.times.select_ms};
      *part[t.part] += ms;
    } else {
      (void)cudaGetLastError();  // a pair whose stop was never recorded (an error path)
    }
    m.spare_events.push_back(t.start);
    m.spare_events.push_back(t.stop);
  }
  m.timed.clear();
  out = m.times;
  return Status::ok();
}

Status CudaKvBackend::poll_faults(std::vector<BackendFault>& out, bool wait) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  constexpr std::size_t kBytes = (1 + 2 * kFaultCap) * 4;
  auto take = [&](Impl::FaultCopy& f) -> Status {
    const unsigned count = f.host[0];
    const unsigned n = std::min<unsigned>(count, kFaultCap);
    for (unsigned i = 0; i < n; ++i) {
      out.push_back({static_cast<std::int32_t>(f.host[1 + 2 * i]), static_cast<std::int32_t>(f.host[2 + 2 * i])});
    }
    if (count > static_cast<unsigned>(kFaultCap)) {  // the list overflowed: every raised word
      std::vector<unsigned> words(static_cast<std::size_t>(m.config.num_streams));
      THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));
      THINKV_CUDA_TRY(cudaMemcpy(words.data(), m.fault_word, words.size() * 4, cudaMemcpyDeviceToHost));
      for (std::size_t s = 0; s < words.size(); ++s) {
        if ((words[s] & 1u) != 0)
          out.push_back({static_cast<std::int32_t>(s), static_cast<std::int32_t>(words[s] >> 1)});
      }
    }
    return Status::ok();
  };
  auto drain = [&](bool block) -> Status {
    while (!m.fault_busy.empty()) {
      Impl::FaultCopy f = m.fault_busy.front();
      if (block) {
        THINKV_CUDA_TRY(cudaEventSynchronize(f.done));
      } else {
        const cudaError_t q = cudaEventQuery(f.done);
        if (q == cudaErrorNotReady) break;
        THINKV_CUDA_TRY(q);
      }
      m.fault_busy.pop_front();
      m.fault_free.push_back(f);
      THINKV_RETURN_IF_ERROR(take(f));
    }
    return Status::ok();
  };
  THINKV_RETURN_IF_ERROR(drain(false));
  // Enqueue the next copy (at most 4 in flight), then clear the device list.
  if (m.fault_free.empty() && m.fault_busy.size() < 4) {
    Impl::FaultCopy f;
    THINKV_CUDA_TRY(cudaMallocHost(&f.host, kBytes));
    THINKV_CUDA_TRY(cudaEventCreateWithFlags(&f.done, cudaEventDisableTiming));
    m.fault_free.push_back(f);
  }
  if (!m.fault_free.empty()) {
    Impl::FaultCopy f = m.fault_free.back();
    m.fault_free.pop_back();
    THINKV_CUDA_TRY(cudaMemcpyAsync(f.host, m.fault_block, kBytes, cudaMemcpyDeviceToHost, m.stream));
    m.stats.device_to_host_bytes += static_cast<std::int64_t>(kBytes);
    THINKV_CUDA_TRY(cudaMemsetAsync(m.fault_block, 0, 4, m.stream));
    THINKV_CUDA_TRY(cudaEventRecord(f.done, m.stream));
    m.fault_busy.push_back(f);
  }
  if (wait) THINKV_RETURN_IF_ERROR(drain(true));
  return Status::ok();
}

Status CudaKvBackend::select_segments(const TableView& table, std::span<const SegmentSelect> jobs, int max_iterations,
                                      std::vector<SlotRef>& victims, std::vector<std::uint32_t>& offsets) {
  std::uint64_t ticket = 0;
  THINKV_RETURN_IF_ERROR(launch_selection(table, jobs, max_iterations, ticket));
  bool ready = false;
  return collect_selection(ticket, true, ready, victims, offsets);
}

namespace {
/// One K-means launch of a selection: ids[begin, end) of its jobs, its layout's points and keep.
struct KmeansClass {
  int begin = 0, end = 0, points = 0, keep = 0;
};
/// Orders the jobs by count, largest first (stable counting sort into ids[0, jobs.size()): the
/// longest selections start first), and cuts them at the kernel's size classes
/// (kernels::kmeans_size_class: counts 65..128, 33..64, 1..32), each launched with a shared-memory
/// layout for its largest count and keep, so small segments run in small CTAs, many per SM.
/// Returns the number of classes in `out` (counts and keeps validated: 1..128, 1..64).
/// Below `split_jobs` jobs (CudaKvBackend::set_kmeans_split_jobs) the sorted jobs go in ONE
/// launch sized for the largest: the class launches run one after another on the stream, each as
/// long as its slowest segment, which costs more than the occupancy gains while the jobs fit in a
/// few waves. Measured on an NVIDIA H200 (bench_kmeans BM_KmeansMixed, head_dim 128, a decode
/// step's mix of levels): 650 jobs take 450 us unsorted in one launch, 357 us sorted in one
/// launch, 516 us as three class launches; 10,400 jobs (a whole-batch transition's scale) 4,449 /
/// 4,251 / 3,794 us.
int kmeans_classes(std::span<const SegmentSelect> jobs, int split_jobs, int* ids, KmeansClass (&out)[3]) {
  constexpr int kMaxN = kernels::kKmeansMaxPoints;
  int at[kMaxN + 1] = {};  // at[kMaxN - count]: where the jobs of that count start in ids
  for (const SegmentSelect& j : jobs) ++at[kMaxN - j.count];
  for (int b = 0, sum = 0; b <= kMaxN; ++b) {
    const int c = at[b];
    at[b] = sum;
    sum += c;
  }
  for (std::size_t i = 0; i < jobs.size(); ++i) ids[at[kMaxN - jobs[i].count]++] = static_cast<int>(i);
  if (jobs.size() < static_cast<std::size_t>(std::max(split_jobs, 1))) {
    out[0] = {0, static_cast<int>(jobs.size()), jobs.empty() ? 1 : jobs[static_cast<std::size_t>(ids[0])].count, 1};
    for (const SegmentSelect& j : jobs) out[0].keep = std::max(out[0].keep, j.keep);
    return jobs.empty() ? 0 : 1;
  }
  int classes = 0;
  for (int r = 0; r < static_cast<int>(jobs.size()); ++r) {
    const SegmentSelect& j = jobs[static_cast<std::size_t>(ids[r])];
    if (classes == 0 || kernels::kmeans_size_class(j.count) != kernels::kmeans_size_class(out[classes - 1].points)) {
      out[classes++] = {r, r, j.count, 0};  // the class's first job has its largest count
    }
    KmeansClass& c = out[classes - 1];
    c.end = r + 1;
    c.keep = std::max(c.keep, j.keep);
  }
  return classes;
}
}  // namespace

Status CudaKvBackend::launch_selection(const TableView& table, std::span<const SegmentSelect> jobs, int max_iterations,
                                       std::uint64_t& ticket) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  ticket = 0;
  const int d = m.config.head_dim;
  if (d != 8 && d != 32 && d != 64 && d != 128 && d != 256) {
    return {StatusCode::kUnsupported, "select_segments: head_dim " + std::to_string(d)};
  }
  int max_points = 1, max_k = 1;
  for (const SegmentSelect& j : jobs) {
    if (j.count < 1 || j.count > kernels::kKmeansMaxPoints || j.keep < 1 || j.keep > kernels::kKmeansMaxK ||
        j.stream < 0 || j.stream >= m.config.num_streams) {
      return {StatusCode::kUnsupported, "select_segments: a segment of " + std::to_string(j.count) +
                                            " tokens keeping " + std::to_string(j.keep) +
                                            " is beyond the K-means kernel (128, 64)"};
    }
    max_points = std::max(max_points, j.count);
    max_k = std::max(max_k, j.keep);
  }
  // A selection's state lives until it is collected: its victims (on the device, for marking
  // them again after a whole copy of the metadata) and their copy back.
  Impl::Selection* sel = nullptr;
  for (Impl::Selection& x : m.selections) {
    if (!x.live) sel = &x;
  }
  if (sel == nullptr) sel = &m.selections.emplace_back();
  sel->id = ++m.selection_clock;
  sel->jobs.clear();
  sel->total = 0;
  sel->live = true;
  ticket = sel->id;
  if (jobs.empty()) return Status::ok();
  // The device's copy of the metadata and lists must be the table's (a prompt or a one-token
  // call may have changed them since the step began).
  AttendView pools_view;
  pools_view.block_size = table.block_size;
  pools_view.evict_mask_words = table.evict_mask_words;
  for (int p = 0; p < kNumPrecisions; ++p) pools_view.pools[p] = table.pool(p);
  Impl::Deferred updates;
  m.dpack.clear();
  if (Status e = m.sync_pools(pools_view, &updates); !e.is_ok()) {
    sel->live = false;
    return e;
  }
  if (Status e = m.sync_lists(table, &updates); !e.is_ok()) {
    sel->live = false;
    return e;
  }
  const std::size_t nj = jobs.size();
  sel->jobs.resize(nj);
  std::size_t total = 0;  // victims of every job, compact (each job's count is count - keep)
  for (std::size_t i = 0; i < nj; ++i) {
    sel->jobs[i] = SelectJob{jobs[i].stream,
                             jobs[i].segment,
                             jobs[i].keep,
                             jobs[i].count,
                             jobs[i].seed,
                             static_cast<std::uint32_t>(total),
                             0};
    total += static_cast<std::size_t>(std::max(0, jobs[i].count - jobs[i].keep));
  }
  sel->total = total;
  for (int p = 0; p < kNumPrecisions; ++p) {
    sel->base[p] = m.dev_base(p);
    sel->count[p] = m.cap[p];
  }
  // The selection's own buffers: victims and counts on the device, their copy back pinned.
  const std::size_t own = align256(std::max<std::size_t>(total, 1) * 4) + nj * 4;  // [victims][counts]
  const std::size_t back = align256(nj * 4) + total * 4;                           // [counts][victims]
  if (own > sel->dev_bytes) {
    if (sel->dev != nullptr) (void)cudaFree(sel->dev);
    sel->dev = nullptr;
    sel->dev_bytes = 0;
    if (Status e = Impl::raw_alloc(&sel->dev, 2 * own, "TBE's selection results"); !e.is_ok()) {
      sel->live = false;
      return e;
    }
    sel->dev_bytes = 2 * own;
  }
  if (back > sel->pinned_bytes) {
    if (sel->pinned != nullptr) (void)cudaFreeHost(sel->pinned);
    sel->pinned = nullptr;
    sel->pinned_bytes = 0;
    if (cudaError_t e = cudaMallocHost(&sel->pinned, 2 * back); e != cudaSuccess) {
      sel->live = false;
      return cuda_status(e, "cudaMallocHost (selection results)");
    }
    sel->pinned_bytes = 2 * back;
  }
  if (sel->done == nullptr) THINKV_CUDA_TRY(cudaEventCreateWithFlags(&sel->done, cudaEventDisableTiming));
  auto* vict = static_cast<std::uint32_t*>(sel->dev);
  auto* vcount =
      reinterpret_cast<int*>(static_cast<std::uint8_t*>(sel->dev) + align256(std::max<std::size_t>(total, 1) * 4));
  Impl::Staged st_updates, st_jobs;
  THINKV_RETURN_IF_ERROR(m.stage_deferred(updates, st_updates));
  // The jobs, then the K-means launches' job ids (kmeans_classes), in one upload.
  const std::size_t o_ids = nj * sizeof(SelectJob);
  m.pack.resize(o_ids + nj * sizeof(int));
  std::memcpy(m.pack.data(), sel->jobs.data(), o_ids);
  KmeansClass classes[3];
  const int num_classes =
      kmeans_classes(jobs, m.kmeans_split_jobs, reinterpret_cast<int*>(m.pack.data() + o_ids), classes);
  THINKV_RETURN_IF_ERROR(m.stage(m.pack.data(), m.pack.size(), st_jobs));
  const int timer = m.time_start(3);
  THINKV_RETURN_IF_ERROR(m.launch_deferred(updates, st_updates));
  void* dev = nullptr;
  THINKV_RETURN_IF_ERROR(m.issue(st_jobs, nullptr, &dev));
  const auto* djobs = static_cast<const SelectJob*>(dev);
  const auto* dids = reinterpret_cast<const int*>(static_cast<const std::uint8_t*>(dev) + o_ids);
  // Scratch (used in stream order by one selection at a time): points, refs, found, np, kk,
  // seeds, kept.
  const std::size_t mp = static_cast<std::size_t>(max_points);
  const std::size_t o_refs = align256(nj * mp * static_cast<std::size_t>(d) * 4);
  const std::size_t o_found = o_refs + align256(nj * mp * 4);
  const std::size_t o_np = o_found + align256(nj * 4);
  const std::size_t o_kk = o_np + align256(nj * 4);
  const std::size_t o_seeds = o_kk + align256(nj * 4);
  const std::size_t o_kept = o_seeds + align256(nj * 8);
  const std::size_t need = o_kept + nj * static_cast<std::size_t>(max_k) * 4;
  if (need > m.sel_bytes) {
    if (m.sel != nullptr) (void)cudaFree(m.sel);
    m.sel = nullptr;
    m.sel_bytes = 0;
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&m.sel, 2 * need, "K-means scratch"));
    m.sel_bytes = 2 * need;
  }
  auto* base = static_cast<std::uint8_t*>(m.sel);
  const SelectView v = m.select_view();
  auto* points = reinterpret_cast<float*>(base);
  auto* refs = reinterpret_cast<std::uint32_t*>(base + o_refs);
  auto* found = reinterpret_cast<int*>(base + o_found);
  auto* np = reinterpret_cast<int*>(base + o_np);
  auto* kk = reinterpret_cast<int*>(base + o_kk);
  auto* seeds = reinterpret_cast<std::uint64_t*>(base + o_seeds);
  auto* kept = reinterpret_cast<int*>(base + o_kept);
  gather_segment_kernel<<<static_cast<unsigned>(nj), kGatherThreads, 0, m.stream>>>(v, djobs, max_points, points, refs,
                                                                                    found, np, kk, seeds);
  THINKV_CUDA_TRY(cudaGetLastError());
  // One K-means launch per size class (the arrays are the gather's, indexed by job; a job whose
  // segment holds more tokens than its count gets an all -1 row, and mark_victims skips it).
  kernels::KmeansSelectParams kp;
  kp.max_points = max_points;
  kp.head_dim = d;
  kp.max_k = max_k;
  kp.max_iterations = max_iterations;
  kp.points = points;
  kp.num_points = np;
  kp.k = kk;
  kp.seeds = seeds;
  kp.kept = kept;
  for (int c = 0; c < num_classes; ++c) {
    kp.num_segments = classes[c].end - classes[c].begin;
    kp.segment_ids = dids + classes[c].begin;
    kp.layout_points = classes[c].points;
    kp.layout_k = classes[c].keep;
    if (cudaError_t e = kernels::launch_kmeans_select(kp, m.stream); e != cudaSuccess) {
      (void)cudaGetLastError();
      sel->live = false;
      if (e == cudaErrorInvalidValue) {
        return {StatusCode::kUnsupported,
                std::string("select_segments: the K-means kernel refuses the launch: ") + cudaGetErrorString(e)};
      }
      return cuda_status(e, "launch_kmeans_select");
    }
  }
  mark_victims_kernel<<<static_cast<unsigned>(nj), 32, 0, m.stream>>>(v, djobs, found, refs, kept, max_points, max_k,
                                                                      vict, vcount);
  THINKV_CUDA_TRY(cudaGetLastError());
  m.time_stop(timer);
  // Back, asynchronously: the counts, then the victims (compact), into pinned memory.
  auto* hcounts = static_cast<int*>(sel->pinned);
  auto* hids = reinterpret_cast<std::uint32_t*>(static_cast<std::uint8_t*>(sel->pinned) + align256(nj * 4));
  THINKV_CUDA_TRY(cudaMemcpyAsync(hcounts, vcount, nj * 4, cudaMemcpyDeviceToHost, m.stream));
  if (total > 0) THINKV_CUDA_TRY(cudaMemcpyAsync(hids, vict, total * 4, cudaMemcpyDeviceToHost, m.stream));
  THINKV_CUDA_TRY(cudaEventRecord(sel->done, m.stream));
  m.stats.device_to_host_bytes += static_cast<std::int64_t>(nj * 4 + total * 4);
  return Status::ok();
}

Status CudaKvBackend::collect_selection(std::uint64_t ticket, bool wait, bool& ready, std::vector<SlotRef>& victims,
                                        std::vector<std::uint32_t>& offsets) {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  ready = false;
  victims.clear();
  offsets.assign(1, 0);
  Impl::Selection* sel = nullptr;
  for (Impl::Selection& x : m.selections) {
    if (x.live && x.id == ticket) sel = &x;
  }
  if (sel == nullptr) {
    return {StatusCode::kInvalidArgument, "collect_selection: no selection " + std::to_string(ticket) + " is pending"};
  }
  const std::size_t nj = sel->jobs.size();
  if (nj > 0) {
    if (wait) {
      THINKV_CUDA_TRY(cudaEventSynchronize(sel->done));
    } else {
      const cudaError_t q = cudaEventQuery(sel->done);
      if (q == cudaErrorNotReady) return Status::ok();
      THINKV_CUDA_TRY(q);
    }
  }
  ready = true;
  sel->live = false;
  const auto* hcounts = static_cast<const int*>(sel->pinned);
  const auto* hids =
      reinterpret_cast<const std::uint32_t*>(static_cast<const std::uint8_t*>(sel->pinned) + align256(nj * 4));
  const int bs = m.config.block_size;
  victims.reserve(sel->total);
  for (std::size_t j = 0; j < nj; ++j) {
    const SelectJob& job = sel->jobs[j];
    if (hcounts[j] != std::max(0, job.count - job.keep)) {
      return {StatusCode::kInternal, "select_segments: segment " + std::to_string(job.segment) + " of stream " +
                                         std::to_string(job.stream) + " does not hold the " +
                                         std::to_string(job.count) + " live tokens the cache expected"};
    }
    for (int i = 0; i < hcounts[j]; ++i) {
      // Flat ids in the numbering of the launch (the pages keep their index in their pool).
      const std::uint32_t id = hids[job.victims + static_cast<std::size_t>(i)];
      const std::uint32_t fb = id / static_cast<std::uint32_t>(bs);
      int p = 0;
      for (int q = 0; q < kNumPrecisions; ++q) {
        if (fb >= sel->base[q] && fb - sel->base[q] < sel->count[q]) p = q;
      }
      victims.push_back({m.pools.base[p] + (fb - sel->base[p]), id % static_cast<std::uint32_t>(bs)});
    }
    offsets.push_back(static_cast<std::uint32_t>(victims.size()));
  }
  return Status::ok();
}

Status CudaKvBackend::synchronize() {
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  THINKV_CUDA_TRY(cudaStreamSynchronize(m.stream));
  for (const Impl::HostResult& r : m.results) std::memcpy(r.dst, r.pinned, r.bytes);
  m.results.clear();
  m.result_chunk = 0;
  m.result_used = 0;
  unsigned rejected = 0;
  THINKV_CUDA_TRY(cudaMemcpy(&rejected, m.brej, sizeof(rejected), cudaMemcpyDeviceToHost));
  if (rejected != 0) {
    THINKV_CUDA_TRY(cudaMemset(m.brej, 0, sizeof(rejected)));
    return {StatusCode::kInternal, "quantize-append refused " + std::to_string(rejected) +
                                       " batched commit job(s): the cache's plans and the device storage disagree"};
  }
  return Status::ok();
}

Status CudaKvBackend::copy_page(std::uint32_t block, std::vector<std::uint8_t>& out) const {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  if (block >= m.pools.total) {
    return {StatusCode::kOutOfRange, "block " + std::to_string(block) + " does not exist"};
  }
  if (!m.has_storage(block)) {
    return {StatusCode::kInvalidArgument, "block " + std::to_string(block) + " has no device storage"};
  }
  const Precision p = m.pools.precision_of(block);
  out.resize(static_cast<std::size_t>(m.layout.page_bytes(p)));
  THINKV_CUDA_TRY(
      cudaMemcpy(out.data(), m.pages[static_cast<int>(p)] + m.page_offset(block), out.size(), cudaMemcpyDeviceToHost));
  return Status::ok();
}

Status CudaKvBackend::copy_record(std::uint32_t record, std::vector<std::uint8_t>& out) const {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  if (record >= m.num_records) {
    return {StatusCode::kOutOfRange, "record " + std::to_string(record) + " does not exist"};
  }
  out.resize(static_cast<std::size_t>(m.config.head_dim));
  THINKV_CUDA_TRY(cudaMemcpy(out.data(), m.records + static_cast<std::size_t>(record) * m.config.head_dim, out.size(),
                             cudaMemcpyDeviceToHost));
  return Status::ok();
}

Status CudaKvBackend::stream_scale(int stream, int kv, Precision p, float& out) const {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  if (stream < 0 || stream >= m.config.num_streams || kv < 0 || kv > 1) {
    return {StatusCode::kOutOfRange,
            "stream scale (" + std::to_string(stream) + ", " + std::to_string(kv) + ") does not exist"};
  }
  THINKV_CUDA_TRY(cudaMemcpy(&out,
                             m.s2 + (static_cast<std::size_t>(stream) * 2 + kv) * kNumPrecisions + static_cast<int>(p),
                             sizeof(float), cudaMemcpyDeviceToHost));
  return Status::ok();
}

namespace {
Status check_state_page(std::uint32_t page, std::uint32_t pages, Precision p, const char* call) {
  if (page < pages) return Status::ok();
  return {StatusCode::kOutOfRange, std::string(call) + ": page " + std::to_string(page) + " of the " +
                                       std::string(to_string(p)) + " pool has no device storage (" +
                                       std::to_string(pages) + " pages have)"};
}
}  // namespace

Status CudaKvBackend::read_page(Precision p, std::uint32_t page, std::span<std::uint8_t> out) const {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(check_state_page(page, m.cap[static_cast<int>(p)], p, "read_page"));
  THINKV_RETURN_IF_ERROR(
      check_state_io_size(out.size(), static_cast<std::size_t>(m.layout.page_bytes(p)), "read_page"));
  const std::uint32_t block = m.pools.base[static_cast<int>(p)] + page;
  THINKV_CUDA_TRY(
      cudaMemcpy(out.data(), m.pages[static_cast<int>(p)] + m.page_offset(block), out.size(), cudaMemcpyDeviceToHost));
  return Status::ok();
}

Status CudaKvBackend::write_page(Precision p, std::uint32_t page, std::span<const std::uint8_t> in) {
  THINKV_ONE_TOKEN_CALL();
  Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(check_state_page(page, m.cap[static_cast<int>(p)], p, "write_page"));
  THINKV_RETURN_IF_ERROR(
      check_state_io_size(in.size(), static_cast<std::size_t>(m.layout.page_bytes(p)), "write_page"));
  const std::uint32_t block = m.pools.base[static_cast<int>(p)] + page;
  THINKV_CUDA_TRY(
      cudaMemcpy(m.pages[static_cast<int>(p)] + m.page_offset(block), in.data(), in.size(), cudaMemcpyHostToDevice));
  m.stats.host_to_device_bytes += static_cast<std::int64_t>(in.size());
  return Status::ok();
}

Status CudaKvBackend::read_record(std::uint32_t record, std::span<std::uint8_t> out) const {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  if (record >= m.num_records) {
    return {StatusCode::kOutOfRange, "read_record: record " + std::to_string(record) + " has no device storage"};
  }
  THINKV_RETURN_IF_ERROR(check_state_io_size(out.size(), static_cast<std::size_t>(m.config.head_dim), "read_record"));
  THINKV_CUDA_TRY(cudaMemcpy(out.data(), m.records + static_cast<std::size_t>(record) * m.config.head_dim, out.size(),
                             cudaMemcpyDeviceToHost));
  return Status::ok();
}

Status CudaKvBackend::write_record(std::uint32_t record, std::span<const std::uint8_t> in) {
  THINKV_ONE_TOKEN_CALL();
  Impl& m = *impl_;
  if (record >= m.num_records) {
    return {StatusCode::kOutOfRange, "write_record: record " + std::to_string(record) + " has no device storage"};
  }
  THINKV_RETURN_IF_ERROR(check_state_io_size(in.size(), static_cast<std::size_t>(m.config.head_dim), "write_record"));
  THINKV_CUDA_TRY(cudaMemcpy(m.records + static_cast<std::size_t>(record) * m.config.head_dim, in.data(), in.size(),
                             cudaMemcpyHostToDevice));
  m.stats.host_to_device_bytes += static_cast<std::int64_t>(in.size());
  return Status::ok();
}

Status CudaKvBackend::read_stream_scales(int stream, std::span<float> out) const {
  THINKV_ONE_TOKEN_CALL();
  const Impl& m = *impl_;
  if (stream < 0 || stream >= m.config.num_streams) {
    return {StatusCode::kOutOfRange, "read_stream_scales: stream " + std::to_string(stream) + " does not exist"};
  }
  THINKV_RETURN_IF_ERROR(check_state_io_size(out.size(), 2 * std::size_t{kNumPrecisions}, "read_stream_scales"));
  THINKV_CUDA_TRY(cudaMemcpy(out.data(), m.s2 + static_cast<std::size_t>(stream) * 2 * kNumPrecisions,
                             out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return Status::ok();
}

Status CudaKvBackend::write_stream_scales(int stream, std::span<const float> in) {
  THINKV_ONE_TOKEN_CALL();
  Impl& m = *impl_;
  if (stream < 0 || stream >= m.config.num_streams) {
    return {StatusCode::kOutOfRange, "write_stream_scales: stream " + std::to_string(stream) + " does not exist"};
  }
  THINKV_RETURN_IF_ERROR(check_state_io_size(in.size(), 2 * std::size_t{kNumPrecisions}, "write_stream_scales"));
  THINKV_CUDA_TRY(cudaMemcpy(m.s2 + static_cast<std::size_t>(stream) * 2 * kNumPrecisions, in.data(),
                             in.size() * sizeof(float), cudaMemcpyHostToDevice));
  m.stats.host_to_device_bytes += static_cast<std::int64_t>(in.size() * sizeof(float));
  return Status::ok();
}

}  // namespace thinkv
