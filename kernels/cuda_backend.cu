/// \file cuda_backend.cu
/// thinkv::CudaKvBackend (include/thinkv/backend/cuda_backend.hpp): device-resident pages with the
/// CPU backend's layout, commits through launch_quantize_append, attention through
/// launch_paged_decode_attention. Host-pointer, synchronous, correctness-first (see the header).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "thinkv/backend/cpu_backend.hpp"
#include "thinkv/backend/cuda_backend.hpp"
#include "thinkv/formats.hpp"
#include "thinkv/kernels/paged_attention.hpp"
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

template <class T>
T* typed(void* p) {
  return static_cast<T*>(p);
}

/// Writes n changed blocks' metadata (FlatBlockDelta, packed) into the device mirror: one CTA
/// per block.
__global__ void scatter_block_meta(const std::uint32_t* ids, const std::uint16_t* fill, const std::uint64_t* mask,
                                   const std::uint32_t* rec, int words, int block_size, std::uint16_t* dfill,
                                   std::uint64_t* dmask, std::uint32_t* drec) {
  const std::size_t i = blockIdx.x;
  const std::size_t b = ids[i];
  if (threadIdx.x == 0) dfill[b] = fill[i];
  for (int w = threadIdx.x; w < words; w += blockDim.x) dmask[b * words + w] = mask[i * words + w];
  for (int s = threadIdx.x; s < block_size; s += blockDim.x) drec[b * block_size + s] = rec[i * block_size + s];
}

constexpr std::size_t align256(std::size_t x) { return (x + 255) & ~std::size_t{255}; }

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
  std::uint16_t* staging = nullptr;
  float* s2 = nullptr;
  // Device mirror of the block table (uploaded by attend), in the compact numbering of
  // FlatBlockTable over cap[]: fill, mask, slot_record and indices sized for meta_blocks blocks.
  std::uint16_t* fill = nullptr;
  std::uint64_t* mask = nullptr;
  std::uint32_t* slot_record = nullptr;
  std::uint32_t* indices = nullptr;
  std::size_t meta_blocks = 0;
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

  ~Impl() { release(); }

  void release() {
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
    if (attn != nullptr) (void)cudaFree(attn);
    attn = nullptr;
    attn_bytes = 0;
    ready = false;
  }

  void free_meta() {
    for (void* q : {static_cast<void*>(fill), static_cast<void*>(mask), static_cast<void*>(slot_record),
                    static_cast<void*>(indices)}) {
      if (q != nullptr) (void)cudaFree(q);
    }
    fill = nullptr;
    mask = nullptr;
    slot_record = nullptr;
    indices = nullptr;
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
    }
    if (*buf != nullptr) (void)cudaFree(*buf);
    *buf = static_cast<std::uint8_t*>(fresh);
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
  const std::uint32_t cap = Impl::next_capacity(m.cap[i], blocks, m.pools.count[i]);
  if (cap != m.cap[i]) {
    const auto page = static_cast<std::size_t>(m.layout.page_bytes(p));
    THINKV_RETURN_IF_ERROR(Impl::realloc_keep(&m.pages[i], std::min(cap, m.cap[i]) * page, cap * page, "pages"));
    m.cap[i] = cap;
    m.stats.bytes_allocated = m.fixed_bytes + m.storage_bytes();
  }
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
  const std::uint32_t cap = Impl::next_capacity(m.num_records, records, limit);
  if (cap != m.num_records) {
    const auto d = static_cast<std::size_t>(m.config.head_dim);
    THINKV_RETURN_IF_ERROR(
        Impl::realloc_keep(&m.records, std::min(cap, m.num_records) * d, cap * d, "key-scale records"));
    m.num_records = cap;
    m.stats.bytes_allocated = m.fixed_bytes + m.storage_bytes();
  }
  return Status::ok();
}

Status CudaKvBackend::stage(int stream, int row, const float* k, const float* v) {
  THINKV_BACKEND_READY();
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
  return Status::ok();
}

Status CudaKvBackend::read_staged(int stream, int row, float* k, float* v) const {
  THINKV_BACKEND_READY();
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
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  const int g = m.config.group_size;
  if (static_cast<int>(plan.slots.size()) != g) {
    return {StatusCode::kInternal, "commit plan has " + std::to_string(plan.slots.size()) +
                                       " slots, expected group_size " + std::to_string(g)};
  }
  kernels::QuantizeAppendJob job;
  job.stream = plan.stream;
  job.record = plan.record;
  job.precision = plan.precision;
  std::vector<std::uint32_t> dest(static_cast<std::size_t>(g));
  for (int i = 0; i < g; ++i) {
    const SlotRef s = plan.slots[static_cast<std::size_t>(i)];
    if (!m.has_storage(s.block)) {
      return {StatusCode::kInternal, "commit to block " + std::to_string(s.block) + ", which has no device storage"};
    }
    const int pr = static_cast<int>(m.pools.precision_of(s.block));
    const std::uint32_t flat = m.dev_base(pr) + m.pools.local_index(s.block);
    dest[static_cast<std::size_t>(i)] = flat * static_cast<std::uint32_t>(m.config.block_size) + s.slot;
  }
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
  THINKV_CUDA_TRY(
      cudaMemset(m.s2 + static_cast<std::size_t>(stream) * 2 * kNumPrecisions, 0, 2 * kNumPrecisions * sizeof(float)));
  return Status::ok();
}

Status CudaKvBackend::read_token(const TokenRef& token, float* k, float* v) const {
  THINKV_BACKEND_READY();
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
  THINKV_BACKEND_READY();
  Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(check_attention_args(args, m.config.num_streams));
  THINKV_RETURN_IF_ERROR(check_attend_view(streams, args));
  const int d = m.config.head_dim;
  if (d != 8 && d != 64 && d != 128 && d != 256) {
    return {StatusCode::kUnsupported,
            "head_dim " + std::to_string(d) + ": the CUDA attention kernel serves head_dim 8, 64, 128 and 256"};
  }
  if (args.num_q_heads / args.num_kv_heads > kernels::kMaxQueryHeadsPerKv) {
    return {StatusCode::kUnsupported, std::to_string(args.num_q_heads / args.num_kv_heads) +
                                          " query heads per KV head: the CUDA attention "
                                          "kernel serves at most " +
                                          std::to_string(kernels::kMaxQueryHeadsPerKv)};
  }
  // The device mirror of the pools' metadata, numbered over the device storage: copied whole
  // on the first call, after the storage or the mirror's buffers changed, or when a pool's
  // change log no longer reaches back to the mirror's revision; otherwise only the pages changed
  // since (PoolView's change log). The attended streams' block lists are sent every call.
  flat_numbering(streams, m.flat, m.cap);
  flatten_streams(streams, m.config.num_streams, m.flat);
  const std::size_t nb = std::max<std::size_t>(m.flat.total_blocks, 1);
  if (nb > m.meta_blocks || m.flat.block_indices.size() > m.meta_blocks + 1) {
    m.free_meta();  // also forgets the sync
    const std::size_t want = std::max(nb, m.flat.block_indices.size());
    const auto words = static_cast<std::size_t>(m.layout.evict_mask_words());
    void* p = nullptr;
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&p, want * 2, "block fill"));
    m.fill = typed<std::uint16_t>(p);
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&p, want * words * 8, "eviction masks"));
    m.mask = typed<std::uint64_t>(p);
    THINKV_RETURN_IF_ERROR(
        Impl::raw_alloc(&p, want * static_cast<std::size_t>(m.config.block_size) * 4, "slot records"));
    m.slot_record = typed<std::uint32_t>(p);
    THINKV_RETURN_IF_ERROR(Impl::raw_alloc(&p, (want + 1) * 4, "block lists"));
    m.indices = typed<std::uint32_t>(p);
    m.meta_blocks = want;
  }
  bool whole = !m.meta_synced;
  for (int p = 0; p < kNumPrecisions; ++p) whole = whole || m.meta_cap[p] != m.cap[p];
  if (!whole) whole = !flat_changes(streams, m.flat, m.meta_rev, m.delta);
  if (whole) {
    flatten_attend_view(streams, m.config.num_streams, m.flat, m.cap);
    THINKV_CUDA_TRY(cudaMemcpy(m.fill, m.flat.block_fill.data(), m.flat.block_fill.size() * 2, cudaMemcpyHostToDevice));
    THINKV_CUDA_TRY(cudaMemcpy(m.mask, m.flat.evict_mask.data(), m.flat.evict_mask.size() * 8, cudaMemcpyHostToDevice));
    THINKV_CUDA_TRY(
        cudaMemcpy(m.slot_record, m.flat.slot_record.data(), m.flat.slot_record.size() * 4, cudaMemcpyHostToDevice));
    m.stats.metadata_bytes_uploaded += static_cast<std::int64_t>(
        m.flat.block_fill.size() * 2 + m.flat.evict_mask.size() * 8 + m.flat.slot_record.size() * 4);
    ++m.stats.metadata_full_uploads;
  } else if (m.delta.size() > 0) {
    // One upload of the packed pages ([ids][fill][mask][records], 256-byte aligned parts), one
    // scatter launch.
    const std::size_t n = m.delta.size();
    const std::size_t o_fill = align256(n * 4);
    const std::size_t o_mask = o_fill + align256(n * 2);
    const std::size_t o_rec = o_mask + align256(m.delta.evict_mask.size() * 8);
    const std::size_t bytes = o_rec + m.delta.slot_record.size() * 4;
    m.delta_host.resize(bytes);
    std::memcpy(m.delta_host.data(), m.delta.ids.data(), n * 4);
    std::memcpy(m.delta_host.data() + o_fill, m.delta.fill.data(), n * 2);
    std::memcpy(m.delta_host.data() + o_mask, m.delta.evict_mask.data(), m.delta.evict_mask.size() * 8);
    std::memcpy(m.delta_host.data() + o_rec, m.delta.slot_record.data(), m.delta.slot_record.size() * 4);
    if (bytes > m.delta_dev_bytes) {
      if (m.delta_dev != nullptr) (void)cudaFree(m.delta_dev);
      m.delta_dev = nullptr;
      m.delta_dev_bytes = 0;
      THINKV_CUDA_TRY(cudaMalloc(&m.delta_dev, bytes * 2));
      m.delta_dev_bytes = bytes * 2;
    }
    THINKV_CUDA_TRY(cudaMemcpy(m.delta_dev, m.delta_host.data(), bytes, cudaMemcpyHostToDevice));
    auto* dbase = static_cast<const std::uint8_t*>(m.delta_dev);
    scatter_block_meta<<<static_cast<unsigned>(n), 64>>>(
        reinterpret_cast<const std::uint32_t*>(dbase), reinterpret_cast<const std::uint16_t*>(dbase + o_fill),
        reinterpret_cast<const std::uint64_t*>(dbase + o_mask), reinterpret_cast<const std::uint32_t*>(dbase + o_rec),
        m.layout.evict_mask_words(), m.config.block_size, m.fill, m.mask, m.slot_record);
    THINKV_CUDA_TRY(cudaGetLastError());
    m.stats.metadata_bytes_uploaded += static_cast<std::int64_t>(m.delta.bytes());
  }
  for (int p = 0; p < kNumPrecisions; ++p) {
    m.meta_rev[p] = streams.pools[p].revision;
    m.meta_cap[p] = m.cap[p];
  }
  m.meta_synced = true;
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

BackendStats CudaKvBackend::stats() const { return impl_ ? impl_->stats : BackendStats{}; }

Status CudaKvBackend::copy_page(std::uint32_t block, std::vector<std::uint8_t>& out) const {
  THINKV_BACKEND_READY();
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
  THINKV_BACKEND_READY();
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
  THINKV_BACKEND_READY();
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

}  // namespace thinkv
