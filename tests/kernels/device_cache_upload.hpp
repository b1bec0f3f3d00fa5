#pragma once
// Test-side helper: copies a CPU PagedKvCache (pages, key-scale records, second-level scales,
// block metadata, block lists, staging) into device buffers laid out as thinkv::kernels::
// PagedKvView describes, and builds the view. The buffers live as long as the DeviceCacheUpload.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "thinkv/kernels/paged_attention.hpp"
#include "thinkv/paged/flat_block_table.hpp"
#include "thinkv/paged_kv_cache.hpp"

namespace thinkv::test {

class DeviceCacheUpload {
 public:
  DeviceCacheUpload() = default;
  DeviceCacheUpload(const DeviceCacheUpload&) = delete;
  DeviceCacheUpload& operator=(const DeviceCacheUpload&) = delete;
  ~DeviceCacheUpload() {
    for (void* p : allocations_) (void)cudaFree(p);
  }

  /// Uploads `cache` and fills view(). Returns the first CUDA error (buffers so far stay owned).
  [[nodiscard]] cudaError_t upload(const PagedKvCache<CpuKvBackend>& cache) {
    const BlockTable& table = cache.table();
    const CpuKvBackend& be = cache.backend();
    const CacheConfig& cfg = cache.config();
    const PoolMap& pools = table.pools();
    const int d = cfg.head_dim;
    const int g = cfg.group_size;
    const int streams = cfg.num_streams;
    // Numbered over the pools' whole id ranges, so the view's block ids are the table's (pages
    // without storage upload as the CPU backend shows them: poison). Tests keep ranges small.
    FlatBlockTable flat;
    flatten_block_table(table, flat, pools.count);
    view_ = {};
    view_.num_streams = streams;
    view_.total_blocks = flat.total_blocks;
    for (int p = 0; p < kNumPrecisions; ++p) {
      view_.pool_base[p] = flat.pool_base[p];
      view_.pool_count[p] = flat.pool_count[p];
      std::vector<std::uint8_t> bytes;
      for (std::uint32_t i = 0; i < flat.pool_count[p]; ++i) {
        const auto page = be.page(pools.base[p] + i);
        bytes.insert(bytes.end(), page.begin(), page.end());
      }
      if (!bytes.empty()) {
        if (cudaError_t e = put(bytes, view_.pages[p]); e != cudaSuccess) return e;
      }
    }
    const auto records = static_cast<std::uint32_t>(table.record_capacity());
    std::vector<std::uint8_t> rec(static_cast<std::size_t>(records) * d);
    for (std::uint32_t r = 0; r < records; ++r) {
      const auto s = be.record_scales(r);
      std::memcpy(rec.data() + static_cast<std::size_t>(r) * d, s.data(), s.size());
    }
    std::vector<float> s2(static_cast<std::size_t>(streams) * 2 * kNumPrecisions);
    std::vector<std::uint16_t> staging(static_cast<std::size_t>(streams) * 2 * g * d);
    std::vector<float> kf(static_cast<std::size_t>(d)), vf(kf.size());
    for (int s = 0; s < streams; ++s) {
      for (int kv = 0; kv < 2; ++kv) {
        for (Precision p : kAllPrecisions) {
          s2[(static_cast<std::size_t>(s) * 2 + kv) * kNumPrecisions + static_cast<int>(p)] = be.stream_scale(s, kv, p);
        }
      }
      for (int r = 0; r < table.staged_count(s); ++r) {
        if (!be.read_staged(s, r, kf.data(), vf.data()).is_ok()) return cudaErrorInvalidValue;
        for (int c = 0; c < d; ++c) {  // BF16 -> float -> BF16 is the identity for finite values
          staging[((static_cast<std::size_t>(s) * 2 + 0) * g + r) * d + c] = encode_bf16(kf[c]);
          staging[((static_cast<std::size_t>(s) * 2 + 1) * g + r) * d + c] = encode_bf16(vf[c]);
        }
      }
    }
    cudaError_t e = cudaSuccess;
    if (e == cudaSuccess && !rec.empty()) e = put(rec, view_.key_scales);
    if (e == cudaSuccess) e = put(s2, view_.s2);
    if (e == cudaSuccess) e = put(flat.block_fill, view_.block_fill);
    if (e == cudaSuccess) e = put(flat.evict_mask, view_.evict_mask);
    if (e == cudaSuccess) e = put(flat.slot_record, view_.slot_record);
    if (e == cudaSuccess) e = put(flat.block_indptr, view_.block_indptr);
    if (e == cudaSuccess) e = put(flat.block_indices, view_.block_indices);
    if (e == cudaSuccess) e = put(staging, view_.staging);
    if (e == cudaSuccess) e = put(flat.staged_count, view_.staged_count);
    return e;
  }

  [[nodiscard]] const kernels::PagedKvView& view() const { return view_; }

 private:
  template <typename T>
  cudaError_t put(const std::vector<T>& host, const T*& dst) {
    void* p = nullptr;
    const std::size_t n = host.size() * sizeof(T);
    if (cudaError_t e = cudaMalloc(&p, n == 0 ? 1 : n); e != cudaSuccess) return e;
    allocations_.push_back(p);
    dst = static_cast<const T*>(p);
    return n == 0 ? cudaSuccess : cudaMemcpy(p, host.data(), n, cudaMemcpyHostToDevice);
  }

  kernels::PagedKvView view_{};
  std::vector<void*> allocations_;
};

}  // namespace thinkv::test
