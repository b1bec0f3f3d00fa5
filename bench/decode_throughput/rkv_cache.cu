/// \file rkv_cache.cu
/// The R-KV-style baseline cache (rkv_cache.hpp): storage, append, attention through the
/// library's paged decode-attention kernel, and the compression kernels (scores, selection,
/// gather-compaction).

#include "rkv_cache.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "decoder/gpu_kernels.hpp"
#include "thinkv/kernels/paged_attention.hpp"

namespace thinkv::bench {

namespace {

constexpr int kBlock = 16;     // tokens per page
constexpr int kMaxCap = 2048;  // budget + buffer, the selection sorts this many in shared memory
constexpr int kMaxRows = 64;   // query heads per KV head x window, scored together

Status cuda_error(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return {StatusCode::kCudaError, std::string("R-KV cache: ") + what + ": " + cudaGetErrorString(e)};
}
#define RKV_CUDA(expr, what)                                            \
  do {                                                                  \
    if (Status s_ = cuda_error((expr), (what)); !s_.is_ok()) return s_; \
  } while (0)

Status blas_error(cublasStatus_t e, const char* what) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return {StatusCode::kCudaError,
          std::string("R-KV cache: ") + what + ": cuBLAS status " + std::to_string(static_cast<int>(e))};
}

__device__ __forceinline__ float bf(std::uint16_t x) { return __uint_as_float(static_cast<unsigned>(x) << 16); }
__device__ __forceinline__ std::uint16_t to_bf(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

// ---- decode ------------------------------------------------------------------------------

/// Streams of every layer for the step's batch: streams[l][b * H + h] = (seq_b * L + l) * H + h.
__global__ void step_streams(const std::int32_t* seqs, int B, int L, int H, std::int32_t* streams) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= L * B * H) return;
  const int l = i / (B * H), bh = i % (B * H), b = bh / H, h = bh % H;
  streams[i] = (seqs[b] * L + l) * H + h;
}

/// One token's K and V per (b, h) into slot len[b] of the stream's pages; the page's fill and
/// the stream's block count follow.
__global__ void append_rows(const float* k, const float* v, const std::int32_t* seqs, const std::int32_t* len, int l,
                            int L, int H, int D, int nb, std::uint8_t* pages, std::uint16_t* fill,
                            std::int32_t* count) {
  const int b = blockIdx.x / H, h = blockIdx.x % H;
  const int s = (seqs[b] * L + l) * H + h;
  const int n = len[b];
  const std::size_t blk = static_cast<std::size_t>(s) * nb + n / kBlock;
  const int slot = n % kBlock;
  const std::size_t row = static_cast<std::size_t>(D) * 2;
  auto* kd = reinterpret_cast<std::uint16_t*>(pages + blk * kBlock * 2 * row + slot * row);
  auto* vd = reinterpret_cast<std::uint16_t*>(pages + blk * kBlock * 2 * row + (kBlock + slot) * row);
  const std::size_t src = (static_cast<std::size_t>(b) * H + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    kd[d] = to_bf(k[src + d]);
    vd[d] = to_bf(v[src + d]);
  }
  if (threadIdx.x == 0) {
    fill[blk] = static_cast<std::uint16_t>(slot + 1);
    count[s] = n / kBlock + 1;
  }
}

/// The step's queries of layer l into each sequence's window ring (slot len % W).
__global__ void keep_queries(const float* q, const std::int32_t* seqs, const std::int32_t* len, int l, int L, int W,
                             int qd, float* ring) {
  const int b = blockIdx.x;
  float* dst = ring + ((static_cast<std::size_t>(seqs[b]) * L + l) * W + len[b] % W) * qd;
  const float* src = q + static_cast<std::size_t>(b) * qd;
  for (int i = threadIdx.x; i < qd; i += blockDim.x) dst[i] = src[i];
}

// ---- compression -----------------------------------------------------------------------

struct Chunk {
  int s0 = 0;  // first stream (of one sequence, one layer range)
  int streams = 0;
  int n = 0;  // tokens each stream holds (budget + buffer)
};

__device__ __forceinline__ const std::uint16_t* key_row(const std::uint8_t* pages, int nb, int D, int s, int j) {
  const std::size_t blk = static_cast<std::size_t>(s) * nb + j / kBlock;
  return reinterpret_cast<const std::uint16_t*>(pages + blk * kBlock * 2 * D * 2 + (j % kBlock) * D * 2);
}

/// kn[c][j] = k_j / (|k_j| + 1e-8) in BF16 (a warp per key).
__global__ void normalise_keys(const std::uint8_t* pages, Chunk ch, int nb, int D, std::uint16_t* kn) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= ch.streams * ch.n) return;
  const int c = warp / ch.n, j = warp % ch.n;
  const std::uint16_t* k = key_row(pages, nb, D, ch.s0 + c, j);
  float ss = 0;
  for (int d = lane; d < D; d += 32) ss += bf(k[d]) * bf(k[d]);
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
  const float inv = 1.0f / (sqrtf(ss) + 1e-8f);
  std::uint16_t* out = kn + (static_cast<std::size_t>(c) * ch.n + j) * D;
  for (int d = lane; d < D; d += 32) out[d] = to_bf(bf(k[d]) * inv);
}

/// logits[c][r][j] of the window rows r = g * W + w (query head g of the KV head's group, ring
/// slot w) against key j, scaled by 1/sqrt(D); -inf past the row's causal limit. Thread per key.
__global__ void window_logits(const std::uint8_t* pages, const float* ring, Chunk ch, int L, int H, int G, int W,
                              int nb, int D, float scale, float* logits) {
  extern __shared__ float qs[];  // [G * W, D]
  const int c = blockIdx.y, s = ch.s0 + c;
  const int seq = s / (L * H), l = (s / H) % L, h = s % H;
  const int rows = G * W;
  const int qd = H * G * D;
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int r = i / D, d = i % D, g = r / W, w = r % W;
    qs[i] = ring[((static_cast<std::size_t>(seq) * L + l) * W + w) * qd + (h * G + g) * D + d];
  }
  __syncthreads();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= ch.n) return;
  const std::uint16_t* k = key_row(pages, nb, D, s, j);
  float acc[kMaxRows];
  for (int r = 0; r < rows; ++r) acc[r] = 0;
  for (int d = 0; d < D; ++d) {
    const float kv = bf(k[d]);
    for (int r = 0; r < rows; ++r) acc[r] += qs[r * D + d] * kv;
  }
  for (int r = 0; r < rows; ++r) {
    // Ring slot w holds the query of cache index i with i % W == w, i in [n - W, n).
    const int w = r % W;
    const int idx = ch.n - W + ((w - (ch.n - W)) % W + W) % W;
    logits[(static_cast<std::size_t>(c) * rows + r) * ch.n + j] = j <= idx ? acc[r] * scale : -INFINITY;
  }
}

/// Per row: max and sum of exp (a warp per row).
__global__ void row_softmax_stats(const float* logits, int rows_total, int n, float* m, float* z) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= rows_total) return;
  const float* x = logits + static_cast<std::size_t>(row) * n;
  float mx = -INFINITY;
  for (int j = lane; j < n; j += 32) mx = fmaxf(mx, x[j]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
  float sum = 0;
  for (int j = lane; j < n; j += 32) sum += x[j] == -INFINITY ? 0.0f : expf(x[j] - mx);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
  if (lane == 0) {
    m[row] = mx;
    z[row] = sum;
  }
}

/// imp[c][j] = mean over the rows of the probability of key j (j < n - W).
__global__ void importance(const float* logits, const float* m, const float* z, Chunk ch, int rows, int W, float* imp) {
  const int c = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= ch.n - W) return;
  float a = 0;
  for (int r = 0; r < rows; ++r) {
    const std::size_t row = static_cast<std::size_t>(c) * rows + r;
    const float x = logits[row * ch.n + j];
    if (x != -INFINITY) a += expf(x - m[row]) / z[row];
  }
  imp[static_cast<std::size_t>(c) * ch.n + j] = a / static_cast<float>(rows);
}

/// red[c][i]: the mean over j of cos(k_i, k_j), the diagonal and the largest j with a
/// similarity above the threshold left out (a warp per row of the Gram matrix).
__global__ void redundancy_rows(const float* gram, Chunk ch, float threshold, float* red) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= ch.streams * ch.n) return;
  const int c = warp / ch.n, i = warp % ch.n;
  const float* row = gram + (static_cast<std::size_t>(c) * ch.n + i) * ch.n;
  float sum = 0;
  int last = -1;
  for (int j = lane; j < ch.n; j += 32) {
    if (j == i) continue;
    const float x = row[j];
    sum += x;
    if (x > threshold) last = j;  // j grows: the lane's largest
  }
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
    last = max(last, __shfl_xor_sync(0xFFFFFFFFu, last, o));
  }
  if (lane == 0) red[static_cast<std::size_t>(c) * ch.n + i] = (sum - (last >= 0 ? row[last] : 0.0f)) / ch.n;
}

__device__ float block_reduce(float v, bool is_max, float* sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = is_max ? fmaxf(v, y) : v + y;
  }
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float r = sh[0];
  for (int w = 1; w < warps; ++w) r = is_max ? fmaxf(r, sh[w]) : r + sh[w];
  __syncthreads();
  return r;
}

/// One CTA per stream: scores, the top budget - W of the first n - W tokens plus the last W,
/// then the gather-compaction of their K and V rows (through `scratch`) to slots 0..budget-1.
__global__ void select_gather(Chunk ch, int W, int kernel, float lambda, int budget, int nb, int D, const float* imp,
                              const float* red, std::uint8_t* pages, std::uint16_t* fill, std::int32_t* count,
                              std::uint8_t* scratch, std::int32_t* kept_out) {
  __shared__ float key[kMaxCap];
  __shared__ int idx[kMaxCap];
  __shared__ int pos[kMaxCap];
  __shared__ float sh[32];
  const int c = blockIdx.x, s = ch.s0 + c, n = ch.n, m = n - W;
  const float* rc = red + static_cast<std::size_t>(c) * n;
  const float* ic = imp + static_cast<std::size_t>(c) * n;
  // Softmax of the redundancy over all n tokens.
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, rc[i]);
  mx = block_reduce(mx, true, sh);
  float sum = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) sum += expf(rc[i] - mx);
  sum = block_reduce(sum, false, sh);
  // Scores of the first m tokens (max-pooled importance); the padding sorts last.
  int sz = 1;
  while (sz < m) sz <<= 1;
  const int half = kernel / 2;
  for (int j = threadIdx.x; j < sz; j += blockDim.x) {
    if (j < m) {
      float a = -INFINITY;
      for (int t = max(0, j - half); t <= min(m - 1, j + half); ++t) a = fmaxf(a, ic[t]);
      key[j] = lambda * a - (1.0f - lambda) * expf(rc[j] - mx) / sum;
    } else {
      key[j] = -INFINITY;
    }
    idx[j] = j;
  }
  __syncthreads();
  // Bitonic sort: score descending, index ascending on ties.
  for (int k = 2; k <= sz; k <<= 1) {
    for (int jj = k >> 1; jj > 0; jj >>= 1) {
      for (int i = threadIdx.x; i < sz; i += blockDim.x) {
        const int p = i ^ jj;
        if (p > i) {
          const bool before = key[i] > key[p] || (key[i] == key[p] && idx[i] < idx[p]);  // i ranks first
          const bool up = (i & k) == 0;
          if (up ? !before : before) {
            const float tk = key[i];
            key[i] = key[p];
            key[p] = tk;
            const int ti = idx[i];
            idx[i] = idx[p];
            idx[p] = ti;
          }
        }
      }
      __syncthreads();
    }
  }
  // Keep flags in pos[] (1 = kept), then their ranks by an inclusive scan.
  const int top = budget - W;
  for (int j = threadIdx.x; j < n; j += blockDim.x) pos[j] = j >= m ? 1 : 0;
  __syncthreads();
  for (int r = threadIdx.x; r < top; r += blockDim.x) pos[idx[r]] = 1;
  __syncthreads();
  for (int off = 1; off < n; off <<= 1) {
    int add[4] = {0, 0, 0, 0};
    int q = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x, ++q) add[q] = j >= off ? pos[j - off] : 0;
    __syncthreads();
    q = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x, ++q) pos[j] += add[q];
    __syncthreads();
  }
  // idx[dest] = source token, dest = rank - 1 of a kept token.
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int before = j > 0 ? pos[j - 1] : 0;
    if (pos[j] != before) idx[pos[j] - 1] = j;
  }
  __syncthreads();
  if (kept_out != nullptr) {
    for (int t = threadIdx.x; t < budget; t += blockDim.x) kept_out[static_cast<std::size_t>(s) * budget + t] = idx[t];
  }
  // Gather: kept rows to scratch, then back to the front of the pages (16-byte moves).
  const int vec = D * 2 / 16;  // uint4 per row
  const std::size_t rowb = static_cast<std::size_t>(D) * 2;
  auto* scr = reinterpret_cast<uint4*>(scratch + static_cast<std::size_t>(c) * budget * 2 * rowb);
  const std::size_t page = kBlock * 2 * rowb;
  std::uint8_t* base = pages + static_cast<std::size_t>(s) * nb * page;
  for (int e = threadIdx.x; e < budget * 2 * vec; e += blockDim.x) {
    const int t = e / (2 * vec), kv = (e / vec) % 2, u = e % vec;
    const int j = idx[t];
    const auto* src = reinterpret_cast<const uint4*>(base + (j / kBlock) * page + (kv * kBlock + j % kBlock) * rowb);
    scr[e] = src[u];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < budget * 2 * vec; e += blockDim.x) {
    const int t = e / (2 * vec), kv = (e / vec) % 2, u = e % vec;
    auto* dst = reinterpret_cast<uint4*>(base + (t / kBlock) * page + (kv * kBlock + t % kBlock) * rowb);
    dst[u] = scr[e];
  }
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    fill[static_cast<std::size_t>(s) * nb + b] = static_cast<std::uint16_t>(b < budget / kBlock ? kBlock : 0);
  }
  if (threadIdx.x == 0) count[s] = budget / kBlock;
}

__global__ void fill_u32(std::uint32_t* p, std::size_t n, std::uint32_t v) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = v;
}
__global__ void iota_u32(std::uint32_t* p, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<std::uint32_t>(i);
}
__global__ void stride_i32(std::int32_t* p, int n, int stride) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = i * stride;
}

}  // namespace

struct RkvCache::Impl {
  ThinKvConfig shape;
  RkvOptions o;
  int S = 0, L = 0, H = 0, Hq = 0, G = 0, D = 0, nb = 0, cap = 0;
  std::size_t N = 0;  // blocks
  cudaStream_t stream = nullptr, side = nullptr;
  cublasHandle_t blas = nullptr;
  // storage
  std::uint8_t* pages = nullptr;
  std::uint16_t* fill = nullptr;
  std::uint64_t* mask = nullptr;
  std::uint32_t* records = nullptr;
  std::int32_t* indptr = nullptr;
  std::uint32_t* indices = nullptr;
  std::int32_t* count = nullptr;
  float* s2 = nullptr;
  std::uint16_t* staging = nullptr;
  std::int32_t* staged = nullptr;
  float* ring = nullptr;
  std::int32_t* kept = nullptr;
  // step
  std::int32_t* d_step = nullptr;  // [2 * max_batch]: seqs, len
  std::int32_t* h_step = nullptr;  // pinned
  std::int32_t* d_streams = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  int batch = 0;
  // compression scratch
  std::uint16_t* kn = nullptr;
  float *gram = nullptr, *logits = nullptr, *rm = nullptr, *rz = nullptr, *imp = nullptr, *red = nullptr;
  std::uint8_t* gather = nullptr;
  std::int64_t bytes = 0;
  // host state
  std::vector<int> len, pos;
  std::vector<cudaEvent_t> done;  // overlapped compression per sequence
  std::vector<char> pending;
  cudaEvent_t step_done = nullptr;
  bool timing = false;
  std::vector<cudaEvent_t> ev;  // compression timing
  RkvTimes times;
  ThinKvStats stats;

  Status alloc(void** p, std::size_t n, const char* what) {
    if (cudaError_t e = cudaMalloc(p, std::max<std::size_t>(n, 16)); e != cudaSuccess) {
      (void)cudaGetLastError();
      return {StatusCode::kCudaError, std::string("R-KV cache: cudaMalloc of ") + std::to_string(n) + " bytes (" +
                                          what + "): " + cudaGetErrorString(e)};
    }
    bytes += static_cast<std::int64_t>(n);
    return Status::ok();
  }
  template <class T>
  Status alloc_t(T** p, std::size_t n, const char* what) {
    return alloc(reinterpret_cast<void**>(p), n * sizeof(T), what);
  }

  kernels::PagedKvView view() const {
    kernels::PagedKvView v;
    v.num_streams = S;
    v.pages[0] = pages;
    // One BF16 pool holds every block; the other pools are empty and follow it (PoolMap order).
    for (int i = 0; i < kNumPrecisions; ++i) v.pool_base[i] = i == 0 ? 0 : static_cast<std::uint32_t>(N);
    v.pool_count[0] = static_cast<std::uint32_t>(N);
    v.total_blocks = static_cast<std::uint32_t>(N);
    v.s2 = s2;
    v.block_fill = fill;
    v.evict_mask = mask;
    v.slot_record = records;
    v.block_indptr = indptr;
    v.block_indices = indices;
    v.block_count = count;
    v.staging = staging;
    v.staged_count = staged;
    return v;
  }
  kernels::DecodeAttentionParams attn_params(int B) const {
    kernels::DecodeAttentionParams p;
    p.num_q_heads = B * Hq;
    p.num_kv_heads = B * H;
    p.head_dim = D;
    p.group_size = 16;
    p.block_size = kBlock;
    p.max_positions = cap;
    return p;
  }

  Status compress(int seq, cudaStream_t st) {
    const int per_seq = L * H;
    const int chunk = std::max(1, std::min(o.chunk_streams, per_seq));
    const int chunks = (per_seq + chunk - 1) / chunk;
    // Timed (sequential mode only: timing waits for the compression): score and gather parts.
    const bool timed = timing && !o.overlap;
    if (timed && static_cast<int>(ev.size()) < 2 * chunks + 1) {
      for (int i = static_cast<int>(ev.size()); i < 2 * chunks + 1; ++i) {
        cudaEvent_t e = nullptr;
        RKV_CUDA(cudaEventCreate(&e), "cudaEventCreate");
        ev.push_back(e);
      }
    }
    const int rows = G * o.window;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    for (int k = 0; k < chunks; ++k) {
      const int first = k * chunk;
      Chunk ch;
      ch.s0 = seq * per_seq + first;
      ch.streams = std::min(chunk, per_seq - first);
      ch.n = cap;
      if (timed) RKV_CUDA(cudaEventRecord(ev[static_cast<std::size_t>(2 * k)], st), "cudaEventRecord");
      const int warps = ch.streams * ch.n;
      normalise_keys<<<(warps + 7) / 8, 256, 0, st>>>(pages, ch, nb, D, kn);
      // gram[c] = kn[c] kn[c]^T: column-major A = kn[c] as D x n (lda D), C = A^T A (n x n).
      const float one = 1.0f, zero = 0.0f;
      THINKV_RETURN_IF_ERROR(blas_error(
          cublasGemmStridedBatchedEx(
              blas, CUBLAS_OP_T, CUBLAS_OP_N, ch.n, ch.n, D, &one, kn, CUDA_R_16BF, D, static_cast<long long>(ch.n) * D,
              kn, CUDA_R_16BF, D, static_cast<long long>(ch.n) * D, &zero, gram, CUDA_R_32F, ch.n,
              static_cast<long long>(ch.n) * ch.n, ch.streams, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx (key similarities)"));
      redundancy_rows<<<(warps + 7) / 8, 256, 0, st>>>(gram, ch, o.threshold, red);
      window_logits<<<dim3((ch.n + 127) / 128, ch.streams), 128, static_cast<std::size_t>(rows) * D * 4, st>>>(
          pages, ring, ch, L, H, G, o.window, nb, D, scale, logits);
      const int rt = ch.streams * rows;
      row_softmax_stats<<<(rt + 7) / 8, 256, 0, st>>>(logits, rt, ch.n, rm, rz);
      importance<<<dim3((ch.n + 127) / 128, ch.streams), 128, 0, st>>>(logits, rm, rz, ch, rows, o.window, imp);
      if (timed) RKV_CUDA(cudaEventRecord(ev[static_cast<std::size_t>(2 * k + 1)], st), "cudaEventRecord");
      select_gather<<<ch.streams, 512, 0, st>>>(ch, o.window, o.kernel, o.lambda, o.budget, nb, D, imp, red, pages,
                                                fill, count, gather, kept);
      RKV_CUDA(cudaGetLastError(), "compression launches");
    }
    if (timed) {
      RKV_CUDA(cudaEventRecord(ev[static_cast<std::size_t>(2 * chunks)], st), "cudaEventRecord");
      RKV_CUDA(cudaEventSynchronize(ev[static_cast<std::size_t>(2 * chunks)]), "cudaEventSynchronize");
      for (int k = 0; k < chunks; ++k) {
        float a = 0, b = 0;
        (void)cudaEventElapsedTime(&a, ev[static_cast<std::size_t>(2 * k)], ev[static_cast<std::size_t>(2 * k + 1)]);
        (void)cudaEventElapsedTime(&b, ev[static_cast<std::size_t>(2 * k + 1)],
                                   ev[static_cast<std::size_t>(2 * k + 2)]);
        times.score_ms += a;
        times.gather_ms += b;
      }
    }
    times.compressions += 1;
    stats.eviction_calls += 1;
    stats.selections += per_seq;
    stats.tokens_evicted += static_cast<std::int64_t>(cap - o.budget) * per_seq;
    return Status::ok();
  }
};

RkvCache::RkvCache() : impl_(std::make_unique<Impl>()) {}

RkvCache::~RkvCache() {
  Impl& m = *impl_;
  if (m.stream != nullptr) (void)cudaStreamSynchronize(m.stream);
  if (m.side != nullptr) {
    (void)cudaStreamSynchronize(m.side);
    (void)cudaStreamDestroy(m.side);
  }
  if (m.blas != nullptr) cublasDestroy(m.blas);
  for (cudaEvent_t e : m.done) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : m.ev) (void)cudaEventDestroy(e);
  if (m.step_done != nullptr) (void)cudaEventDestroy(m.step_done);
  for (void* p : {static_cast<void*>(m.pages),   static_cast<void*>(m.fill),      static_cast<void*>(m.mask),
                  static_cast<void*>(m.records), static_cast<void*>(m.indptr),    static_cast<void*>(m.indices),
                  static_cast<void*>(m.count),   static_cast<void*>(m.s2),        static_cast<void*>(m.staging),
                  static_cast<void*>(m.staged),  static_cast<void*>(m.ring),      static_cast<void*>(m.kept),
                  static_cast<void*>(m.d_step),  static_cast<void*>(m.d_streams), m.workspace,
                  static_cast<void*>(m.kn),      static_cast<void*>(m.gram),      static_cast<void*>(m.logits),
                  static_cast<void*>(m.rm),      static_cast<void*>(m.rz),        static_cast<void*>(m.imp),
                  static_cast<void*>(m.red),     static_cast<void*>(m.gather)}) {
    if (p != nullptr) (void)cudaFree(p);
  }
  if (m.h_step != nullptr) (void)cudaFreeHost(m.h_step);
}

std::int64_t RkvCache::bytes_per_sequence(const ThinKvConfig& c, const RkvOptions& o) {
  const std::int64_t streams = std::int64_t{c.num_layers} * c.num_kv_heads;
  const std::int64_t nb = (o.budget + o.buffer) / kBlock;
  const std::int64_t per_block = std::int64_t{kBlock} * 2 * c.head_dim * 2 + 2 + 8 + 4 * kBlock + 4;
  const std::int64_t per_stream = nb * per_block + 4 * 3 + 4 * 2 * 4 + 4 * std::int64_t{o.budget};
  const std::int64_t ring = std::int64_t{c.num_layers} * o.window * c.num_q_heads * c.head_dim * 4;
  return streams * per_stream + ring;
}

std::int64_t RkvCache::fixed_bytes(const ThinKvConfig& c, const RkvOptions& o) {
  const std::int64_t ch = std::min<std::int64_t>(o.chunk_streams, std::int64_t{c.num_layers} * c.num_kv_heads);
  const std::int64_t n = o.budget + o.buffer;
  const std::int64_t rows = std::int64_t{c.num_q_heads / c.num_kv_heads} * o.window;
  return ch * (n * c.head_dim * 2 + n * n * 4 + rows * n * 4 + 2 * rows * 4 + 2 * n * 4 +
               std::int64_t{o.budget} * 2 * c.head_dim * 2) +
         (std::int64_t{64} << 20);  // attention workspace, step arrays
}

Status RkvCache::create(const ThinKvConfig& c, const RkvOptions& o, std::unique_ptr<RkvCache>& out) {
  auto bad = [](const std::string& m) { return Status(StatusCode::kInvalidArgument, "R-KV cache: " + m); };
  if (c.num_sequences < 1 || c.num_layers < 1 || c.num_kv_heads < 1 || c.num_q_heads % c.num_kv_heads != 0) {
    return bad("a shape with sequences, layers and heads (q heads a multiple of KV heads) is needed");
  }
  if (c.head_dim != 64 && c.head_dim != 128) return bad("head_dim " + std::to_string(c.head_dim) + ": 64 or 128");
  if (o.window < 1 || o.budget <= o.window || o.budget % kBlock != 0 || o.buffer < kBlock || o.buffer % kBlock != 0 ||
      o.buffer % o.window != 0 || o.budget + o.buffer > kMaxCap) {
    return bad("budget " + std::to_string(o.budget) + ", buffer " + std::to_string(o.buffer) + ", window " +
               std::to_string(o.window) +
               ": budget and buffer multiples of 16, buffer a multiple of the window, "
               "budget > window, budget + buffer <= " +
               std::to_string(kMaxCap));
  }
  if ((c.num_q_heads / c.num_kv_heads) * o.window > kMaxRows) {
    return bad("query heads per KV head x window must be <= " + std::to_string(kMaxRows));
  }
  if (o.kernel < 1 || o.kernel % 2 == 0) return bad("kernel " + std::to_string(o.kernel) + " must be odd");
  if (!(o.lambda >= 0.0f && o.lambda <= 1.0f)) return bad("lambda must lie in [0, 1]");
  if (o.chunk_streams < 1) return bad("chunk_streams must be >= 1");
  std::unique_ptr<RkvCache> r(new RkvCache());
  Impl& m = *r->impl_;
  m.shape = c;
  m.o = o;
  m.L = c.num_layers;
  m.H = c.num_kv_heads;
  m.Hq = c.num_q_heads;
  m.G = m.Hq / m.H;
  m.D = c.head_dim;
  m.S = c.num_sequences * m.L * m.H;
  m.cap = o.budget + o.buffer;
  m.nb = m.cap / kBlock;
  m.N = static_cast<std::size_t>(m.S) * m.nb;
  const std::size_t S = static_cast<std::size_t>(m.S);
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.pages, m.N * kBlock * 2 * m.D * 2, "pages"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.fill, m.N, "block fill"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.mask, m.N, "eviction masks"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.records, m.N * kBlock, "slot records"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.indptr, S, "block list rows"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.indices, m.N, "block lists"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.count, S, "block counts"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.s2, S * 2 * kNumPrecisions, "second-level scales"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.staging, 2 * 16 * static_cast<std::size_t>(m.D), "staging (never read)"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.staged, S, "staged counts"));
  THINKV_RETURN_IF_ERROR(
      m.alloc_t(&m.ring, static_cast<std::size_t>(c.num_sequences) * m.L * o.window * m.Hq * m.D, "window queries"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.kept, S * o.budget, "kept indices"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.d_step, 2 * static_cast<std::size_t>(c.num_sequences), "step arrays"));
  THINKV_RETURN_IF_ERROR(
      m.alloc_t(&m.d_streams, static_cast<std::size_t>(m.L) * c.num_sequences * m.H, "step streams"));
  const std::size_t ch = static_cast<std::size_t>(std::min(o.chunk_streams, m.L * m.H));
  const std::size_t n = static_cast<std::size_t>(m.cap), rows = static_cast<std::size_t>(m.G * o.window);
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.kn, ch * n * m.D, "normalised keys"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.gram, ch * n * n, "key similarities"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.logits, ch * rows * n, "window logits"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.rm, ch * rows, "row max"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.rz, ch * rows, "row sums"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.imp, ch * n, "importance"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.red, ch * n, "redundancy"));
  THINKV_RETURN_IF_ERROR(m.alloc_t(&m.gather, ch * o.budget * 2 * m.D * 2, "gather scratch"));
  RKV_CUDA(cudaMallocHost(reinterpret_cast<void**>(&m.h_step), 2 * sizeof(std::int32_t) * c.num_sequences),
           "cudaMallocHost");
  // Metadata: empty streams, identity block lists, no eviction, no key-scale record.
  RKV_CUDA(cudaMemset(m.fill, 0, m.N * 2), "cudaMemset");
  RKV_CUDA(cudaMemset(m.mask, 0, m.N * 8), "cudaMemset");
  RKV_CUDA(cudaMemset(m.count, 0, S * 4), "cudaMemset");
  RKV_CUDA(cudaMemset(m.staged, 0, S * 4), "cudaMemset");
  RKV_CUDA(cudaMemset(m.staging, 0, 2 * 16 * static_cast<std::size_t>(m.D) * 2), "cudaMemset");
  RKV_CUDA(cudaMemset(m.ring, 0, static_cast<std::size_t>(c.num_sequences) * m.L * o.window * m.Hq * m.D * 4),
           "cudaMemset");
  fill_u32<<<1024, 256>>>(m.records, m.N * kBlock, ~0u);
  iota_u32<<<1024, 256>>>(m.indices, m.N);
  RKV_CUDA(decoder::gpu::fill_f32(m.s2, S * 2 * kNumPrecisions, 1.0f, nullptr), "fill_f32");
  stride_i32<<<static_cast<unsigned>((S + 255) / 256), 256>>>(m.indptr, m.S, m.nb);
  RKV_CUDA(cudaGetLastError(), "initialisation kernels");
  RKV_CUDA(cudaDeviceSynchronize(), "initialisation");
  m.len.assign(static_cast<std::size_t>(c.num_sequences), 0);
  m.pos.assign(static_cast<std::size_t>(c.num_sequences), 0);
  m.pending.assign(static_cast<std::size_t>(c.num_sequences), 0);
  m.done.resize(static_cast<std::size_t>(c.num_sequences), nullptr);
  for (cudaEvent_t& e : m.done) RKV_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  RKV_CUDA(cudaEventCreateWithFlags(&m.step_done, cudaEventDisableTiming), "cudaEventCreate");
  THINKV_RETURN_IF_ERROR(blas_error(cublasCreate(&m.blas), "cublasCreate"));
  RKV_CUDA(cudaStreamCreateWithFlags(&m.side, cudaStreamNonBlocking), "cudaStreamCreate");
  {
    // The attention's own parameter check (host only), once, for the largest batch.
    kernels::DecodeAttentionParams p = m.attn_params(c.num_sequences);
    p.streams = m.d_streams;
    p.q = m.s2;
    p.out = m.s2;
    p.workspace = m.d_step;
    RKV_CUDA(kernels::check_paged_decode_attention(m.view(), p), "the attention's view of the pages");
  }
  out = std::move(r);
  return Status::ok();
}

const RkvOptions& RkvCache::options() const noexcept { return impl_->o; }
bool RkvCache::busy(int seq) const {
  const Impl& m = *impl_;
  if (seq < 0 || seq >= static_cast<int>(m.pending.size()) || !m.pending[static_cast<std::size_t>(seq)]) return false;
  return cudaEventQuery(m.done[static_cast<std::size_t>(seq)]) == cudaErrorNotReady;
}
void RkvCache::set_timing(bool on) {
  impl_->timing = on;
  impl_->times = {};
}
RkvTimes RkvCache::times() const { return impl_->times; }
int RkvCache::stored(int seq) const { return impl_->len.at(static_cast<std::size_t>(seq)); }

Status RkvCache::kept_indices(int seq, int layer, int kv_head, std::vector<std::int32_t>& out) const {
  const Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(const_cast<RkvCache*>(this)->settle());
  const std::size_t s = (static_cast<std::size_t>(seq) * m.L + layer) * m.H + kv_head;
  out.resize(static_cast<std::size_t>(m.o.budget));
  RKV_CUDA(cudaMemcpy(out.data(), m.kept + s * m.o.budget, out.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return Status::ok();
}

Status RkvCache::read_stream(int seq, int layer, int kv_head, std::vector<std::uint16_t>& k,
                             std::vector<std::uint16_t>& v) const {
  const Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(const_cast<RkvCache*>(this)->settle());
  const std::size_t s = (static_cast<std::size_t>(seq) * m.L + layer) * m.H + kv_head;
  const int n = m.len[static_cast<std::size_t>(seq)];
  std::vector<std::uint16_t> pages(static_cast<std::size_t>(m.nb) * kBlock * 2 * m.D);
  RKV_CUDA(
      cudaMemcpy(pages.data(), m.pages + s * m.nb * kBlock * 2 * m.D * 2, pages.size() * 2, cudaMemcpyDeviceToHost),
      "cudaMemcpy");
  k.resize(static_cast<std::size_t>(n) * m.D);
  v.resize(static_cast<std::size_t>(n) * m.D);
  for (int j = 0; j < n; ++j) {
    const std::size_t pg = static_cast<std::size_t>(j / kBlock) * kBlock * 2 * m.D;
    std::memcpy(&k[static_cast<std::size_t>(j) * m.D], &pages[pg + static_cast<std::size_t>(j % kBlock) * m.D],
                static_cast<std::size_t>(m.D) * 2);
    std::memcpy(&v[static_cast<std::size_t>(j) * m.D], &pages[pg + static_cast<std::size_t>(kBlock + j % kBlock) * m.D],
                static_cast<std::size_t>(m.D) * 2);
  }
  return Status::ok();
}

Status RkvCache::read_window(int seq, int layer, std::vector<float>& q) const {
  const Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(const_cast<RkvCache*>(this)->settle());
  const std::size_t per = static_cast<std::size_t>(m.o.window) * m.Hq * m.D;
  q.resize(per);
  RKV_CUDA(cudaMemcpy(q.data(), m.ring + (static_cast<std::size_t>(seq) * m.L + layer) * per, per * 4,
                      cudaMemcpyDeviceToHost),
           "cudaMemcpy");
  return Status::ok();
}

const ThinKvConfig& RkvCache::config() const { return impl_->shape; }

Status RkvCache::set_stream(CUstream_st* stream) {
  impl_->stream = stream;
  return blas_error(cublasSetStream(impl_->blas, impl_->o.overlap ? impl_->side : stream), "cublasSetStream");
}
Status RkvCache::reserve_storage() { return Status::ok(); }  // allocated whole at create

Status RkvCache::begin_step(std::span<const int> seqs, std::span<const TokenHint>) {
  Impl& m = *impl_;
  const int B = static_cast<int>(seqs.size());
  if (B < 1 || B > m.shape.num_sequences) {
    return {StatusCode::kInvalidArgument, "R-KV cache: a step of " + std::to_string(B) + " sequences; allowed 1.." +
                                              std::to_string(m.shape.num_sequences)};
  }
  std::vector<char> seen(static_cast<std::size_t>(m.shape.num_sequences), 0);
  for (int s : seqs) {
    if (s < 0 || s >= m.shape.num_sequences || seen[static_cast<std::size_t>(s)]) {
      return {StatusCode::kInvalidArgument,
              "R-KV cache: sequence " + std::to_string(s) + " is out of range or listed twice"};
    }
    seen[static_cast<std::size_t>(s)] = 1;
  }
  // The pinned step arrays of the previous step must have left.
  RKV_CUDA(cudaEventSynchronize(m.step_done), "cudaEventSynchronize");
  for (int b = 0; b < B; ++b) {
    const auto s = static_cast<std::size_t>(seqs[static_cast<std::size_t>(b)]);
    m.h_step[b] = static_cast<std::int32_t>(s);
    m.h_step[m.shape.num_sequences + b] = m.len[s];
    if (m.pending[s]) {  // an overlapped compression: this step waits for it on the device
      RKV_CUDA(cudaStreamWaitEvent(m.stream, m.done[s], 0), "cudaStreamWaitEvent");
      m.pending[s] = 0;
    }
  }
  RKV_CUDA(cudaMemcpyAsync(m.d_step, m.h_step, static_cast<std::size_t>(B) * 4, cudaMemcpyHostToDevice, m.stream),
           "cudaMemcpyAsync");
  RKV_CUDA(cudaMemcpyAsync(m.d_step + m.shape.num_sequences, m.h_step + m.shape.num_sequences,
                           static_cast<std::size_t>(B) * 4, cudaMemcpyHostToDevice, m.stream),
           "cudaMemcpyAsync");
  RKV_CUDA(cudaEventRecord(m.step_done, m.stream), "cudaEventRecord");
  const int total = m.L * B * m.H;
  step_streams<<<(total + 255) / 256, 256, 0, m.stream>>>(m.d_step, B, m.L, m.H, m.d_streams);
  RKV_CUDA(cudaGetLastError(), "step_streams");
  m.batch = B;
  const kernels::DecodeAttentionParams p = m.attn_params(B);
  const std::size_t need = kernels::paged_decode_attention_workspace_size(p);
  if (need > m.workspace_bytes) {
    RKV_CUDA(cudaStreamSynchronize(m.stream), "cudaStreamSynchronize");
    if (m.workspace != nullptr) {
      (void)cudaFree(m.workspace);
      m.bytes -= static_cast<std::int64_t>(m.workspace_bytes);
    }
    m.workspace = nullptr;
    m.workspace_bytes = 0;
    THINKV_RETURN_IF_ERROR(m.alloc(&m.workspace, need, "attention workspace"));
    m.workspace_bytes = need;
  }
  return Status::ok();
}

Status RkvCache::append_batch(int l, std::span<const int> seqs, TensorRef k, TensorRef v) {
  Impl& m = *impl_;
  if (static_cast<int>(seqs.size()) != m.batch || k.type != ElementType::kF32 || v.type != ElementType::kF32) {
    return {StatusCode::kInvalidArgument, "R-KV cache: append_batch takes the step's batch, FP32 K and V"};
  }
  append_rows<<<m.batch * m.H, 128, 0, m.stream>>>(static_cast<const float*>(k.data), static_cast<const float*>(v.data),
                                                   m.d_step, m.d_step + m.shape.num_sequences, l, m.L, m.H, m.D, m.nb,
                                                   m.pages, m.fill, m.count);
  RKV_CUDA(cudaGetLastError(), "append_rows");
  return Status::ok();
}

Status RkvCache::attend_batch(int l, std::span<const int> seqs, TensorRef q, MutableTensorRef out) {
  Impl& m = *impl_;
  if (static_cast<int>(seqs.size()) != m.batch || q.type != ElementType::kF32 || out.type != ElementType::kF32) {
    return {StatusCode::kInvalidArgument, "R-KV cache: attend_batch takes the step's batch, FP32 q and out"};
  }
  keep_queries<<<m.batch, 256, 0, m.stream>>>(static_cast<const float*>(q.data), m.d_step,
                                              m.d_step + m.shape.num_sequences, l, m.L, m.o.window, m.Hq * m.D, m.ring);
  kernels::DecodeAttentionParams p = m.attn_params(m.batch);
  p.streams = m.d_streams + static_cast<std::size_t>(l) * m.batch * m.H;
  p.q = static_cast<const float*>(q.data);
  p.out = static_cast<float*>(out.data);
  p.workspace = m.workspace;
  RKV_CUDA(kernels::launch_paged_decode_attention(m.view(), p, m.stream), "launch_paged_decode_attention");
  return Status::ok();
}

Status RkvCache::end_step(std::span<const int> seqs) {
  Impl& m = *impl_;
  for (int s : seqs) {
    const auto i = static_cast<std::size_t>(s);
    ++m.len[i];
    ++m.pos[i];
    m.stats.steps += 1;
    if (m.len[i] < m.cap) continue;
    if (m.o.overlap) {
      // After this step's work, on the side stream; the next step that lists s waits for it.
      cudaEvent_t ready = m.done[i];
      RKV_CUDA(cudaEventRecord(ready, m.stream), "cudaEventRecord");
      RKV_CUDA(cudaStreamWaitEvent(m.side, ready, 0), "cudaStreamWaitEvent");
      THINKV_RETURN_IF_ERROR(m.compress(s, m.side));
      RKV_CUDA(cudaEventRecord(m.done[i], m.side), "cudaEventRecord");
      m.pending[i] = 1;
    } else {
      THINKV_RETURN_IF_ERROR(m.compress(s, m.stream));
    }
    m.len[i] = m.o.budget;
  }
  return Status::ok();
}

Status RkvCache::begin_prompt(int, int) {
  return {StatusCode::kUnsupported, "R-KV cache: the baseline decodes from an empty cache (no prompt)"};
}
Status RkvCache::prefill(int, int, TensorRef, TensorRef, TensorRef, MutableTensorRef) {
  return {StatusCode::kUnsupported, "R-KV cache: the baseline decodes from an empty cache (no prompt)"};
}
Status RkvCache::end_prompt(int) {
  return {StatusCode::kUnsupported, "R-KV cache: the baseline decodes from an empty cache (no prompt)"};
}
Status RkvCache::poll_faults(bool) { return Status::ok(); }
bool RkvCache::faulted(int) const { return false; }
Status RkvCache::reset_sequence(int seq) {
  Impl& m = *impl_;
  if (seq < 0 || seq >= m.shape.num_sequences) {
    return {StatusCode::kOutOfRange, "R-KV cache: sequence " + std::to_string(seq) + " is out of range"};
  }
  THINKV_RETURN_IF_ERROR(settle());
  const std::size_t per = static_cast<std::size_t>(m.L) * m.H;
  RKV_CUDA(cudaMemsetAsync(m.count + static_cast<std::size_t>(seq) * per, 0, per * 4, m.stream), "cudaMemsetAsync");
  m.len[static_cast<std::size_t>(seq)] = 0;
  m.pos[static_cast<std::size_t>(seq)] = 0;
  return Status::ok();
}
Status RkvCache::settle() {
  RKV_CUDA(cudaStreamSynchronize(impl_->side), "cudaStreamSynchronize");
  if (impl_->stream != nullptr) RKV_CUDA(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize");
  for (char& p : impl_->pending) p = 0;
  return Status::ok();
}
std::int32_t RkvCache::position(int seq) const { return impl_->pos.at(static_cast<std::size_t>(seq)); }
std::int64_t RkvCache::live_tokens(int seq) const {
  return std::int64_t{impl_->len.at(static_cast<std::size_t>(seq))} * impl_->L * impl_->H;
}
MemoryUsage RkvCache::memory(int seq) const {
  const Impl& m = *impl_;
  MemoryUsage u;
  u.live_tokens = live_tokens(seq);
  const std::int64_t per = bytes_per_sequence(m.shape, m.o);
  u.page_bytes = std::int64_t{m.L} * m.H * m.nb * kBlock * 2 * m.D * 2;
  u.metadata_bytes = per - u.page_bytes;
  u.fullkv_fp16_bytes = u.live_tokens * 2 * m.D * 2;
  return u;
}
MemoryUsage RkvCache::memory() const {
  MemoryUsage u;
  for (int s = 0; s < impl_->shape.num_sequences; ++s) u += memory(s);
  return u;
}
const ThinKvStats& RkvCache::stats() const { return impl_->stats; }
std::int64_t RkvCache::device_bytes() const { return impl_->bytes; }
std::string RkvCache::method_name() const { return impl_->o.overlap ? "rkv-overlapped" : "rkv-sequential"; }
CacheReport RkvCache::report(int) const { return {}; }
BlockTableStats RkvCache::table_stats() const { return {}; }
ThoughtStats RkvCache::thought_stats(int) const { return {}; }
std::vector<SegmentState> RkvCache::segments(int) const { return {}; }
std::span<const float> RkvCache::layer_sparsity(int) const { return {}; }

}  // namespace thinkv::bench
