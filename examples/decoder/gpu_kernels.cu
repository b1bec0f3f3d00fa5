/// \file gpu_kernels.cu
/// The GPU decoder's small kernels (see gpu_kernels.hpp). Plain, memory-bound code: one CTA per
/// row for the reductions (rmsnorm, argmax), one thread per element or pair otherwise. Built
/// without fast-math: RoPE's cosf/sinf and the SiLU's expf are the accurate library functions.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>

#include "gpu_kernels.hpp"

namespace thinkv::decoder::gpu {
namespace {

constexpr int kRowThreads = 256;

__device__ __forceinline__ float load(const void* p, Elem e, std::size_t i) {
  return e == Elem::kF32 ? static_cast<const float*>(p)[i] : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
__device__ __forceinline__ void store(void* p, Elem e, std::size_t i, float v) {
  if (e == Elem::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
}

unsigned blocks_for(std::size_t n, int threads) {
  return static_cast<unsigned>((n + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads));
}

__global__ void embed_kernel(const void* table, Elem e, const int* tokens, int batch, int dim, float* x) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::size_t>(batch) * dim) return;
  const int b = static_cast<int>(i / static_cast<std::size_t>(dim));
  const int j = static_cast<int>(i % static_cast<std::size_t>(dim));
  x[i] = load(table, e, static_cast<std::size_t>(tokens[b]) * dim + j);
}

__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_kernel(const float* x, const float* w, int dim, float eps, void* out, Elem e) {
  __shared__ float part[kRowThreads / 32];
  const float* row = x + static_cast<std::size_t>(blockIdx.x) * dim;
  float ss = 0.0f;
  for (int j = static_cast<int>(threadIdx.x); j < dim; j += kRowThreads) ss = fmaf(row[j], row[j], ss);
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, off);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int wi = 0; wi < kRowThreads / 32; ++wi) total += part[wi];
  const float scale = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
  const std::size_t base = static_cast<std::size_t>(blockIdx.x) * dim;
  for (int j = static_cast<int>(threadIdx.x); j < dim; j += kRowThreads)
    store(out, e, base + j, w[j] * (scale * row[j]));
}

__global__ void rope_split_kernel(const float* qkv, const int* pos, const float* freqs, int batch, int hq, int hkv,
                                  int hd, int rope_dim, float* q, float* k, float* v) {
  const int width = (hq + 2 * hkv) * hd;  // elements per row
  const std::size_t pairs = static_cast<std::size_t>(batch) * (width / 2);
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= pairs) return;
  const int b = static_cast<int>(t / static_cast<std::size_t>(width / 2));
  const int c = 2 * static_cast<int>(t % static_cast<std::size_t>(width / 2));  // even channel of the row
  const float* src = qkv + static_cast<std::size_t>(b) * width + c;
  float v0 = src[0], v1 = src[1];
  const int head = c / hd;  // heads 0..hq-1 are q, then hkv of k, then hkv of v
  const int i = c % hd;
  if (head < hq + hkv && i < rope_dim) {
    const float val = static_cast<float>(pos[b]) * freqs[i / 2];
    const float fcr = cosf(val), fci = sinf(val);
    const float r0 = v0 * fcr - v1 * fci;
    const float r1 = v0 * fci + v1 * fcr;
    v0 = r0;
    v1 = r1;
  }
  float* dst = nullptr;
  if (head < hq) {
    dst = q + (static_cast<std::size_t>(b) * hq + head) * hd + i;
  } else if (head < hq + hkv) {
    dst = k + (static_cast<std::size_t>(b) * hkv + (head - hq)) * hd + i;
  } else {
    dst = v + (static_cast<std::size_t>(b) * hkv + (head - hq - hkv)) * hd + i;
  }
  dst[0] = v0;
  dst[1] = v1;
}

__global__ void silu_mul_kernel(const float* h, int batch, int hidden, void* out, Elem e) {
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<std::size_t>(batch) * hidden) return;
  const std::size_t b = t / static_cast<std::size_t>(hidden);
  const std::size_t i = t % static_cast<std::size_t>(hidden);
  float g = h[b * 2 * hidden + i];
  g *= 1.0f / (1.0f + expf(-g));
  store(out, e, t, g * h[b * 2 * hidden + hidden + i]);
}

__global__ void convert_kernel(const float* in, std::size_t n, void* out, Elem e) {
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) store(out, e, t, in[t]);
}

__global__ void __launch_bounds__(kRowThreads) argmax_kernel(const float* logits, int vocab, int* out) {
  __shared__ float sv[kRowThreads];
  __shared__ int si[kRowThreads];
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  const float* row = logits + static_cast<std::size_t>(blockIdx.x) * vocab;
  float best = -FLT_MAX;
  int idx = INT_MAX;
  int nonfinite = 0;
  for (int j = static_cast<int>(threadIdx.x); j < vocab; j += kRowThreads) {
    const float x = row[j];
    if (!isfinite(x)) nonfinite = 1;
    if (idx == INT_MAX || x > best) {  // strided ascending: the first maximum of this thread
      best = x;
      idx = j;
    }
  }
  if (nonfinite != 0) atomicOr(&bad, 1);
  sv[threadIdx.x] = best;
  si[threadIdx.x] = idx;
  __syncthreads();
  for (int s = kRowThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) {
      const float ov = sv[threadIdx.x + s];
      const int oi = si[threadIdx.x + s];
      if (oi != INT_MAX &&
          (si[threadIdx.x] == INT_MAX || ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x]))) {
        sv[threadIdx.x] = ov;
        si[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = bad != 0 ? -1 : si[0];
}

__device__ __forceinline__ std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform_kernel(void* out, Elem e, std::size_t n, std::uint64_t seed, float scale) {
  for (std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t r = mix64(seed + 0x9E3779B97F4A7C15ull * (t + 1));
    const float u = static_cast<float>(r >> 40) * 0x1p-24f;  // [0, 1)
    store(out, e, t, (2.0f * u - 1.0f) * scale);
  }
}

__global__ void fill_uniform_block_kernel(void* out, Elem e, std::int64_t rows, std::int64_t cols, std::uint64_t seed,
                                          float scale, std::int64_t src_cols, std::int64_t row0, std::int64_t col0) {
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  for (std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t r = t / static_cast<std::size_t>(cols), c = t % static_cast<std::size_t>(cols);
    const std::size_t g =
        (static_cast<std::size_t>(row0) + r) * static_cast<std::size_t>(src_cols) + static_cast<std::size_t>(col0) + c;
    const std::uint64_t h = mix64(seed + 0x9E3779B97F4A7C15ull * (g + 1));
    const float u = static_cast<float>(h >> 40) * 0x1p-24f;  // [0, 1), as fill_uniform_kernel
    store(out, e, t, (2.0f * u - 1.0f) * scale);
  }
}

__global__ void add_kernel(float* x, const float* y, std::size_t n) {
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) x[t] += y[t];
}

__global__ void fill_f32_kernel(float* out, std::size_t n, float value) {
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) out[t] = value;
}

}  // namespace

cudaError_t embed(const void* table, Elem e, const int* tokens, int batch, int dim, float* x, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * dim;
  if (n == 0) return cudaSuccess;
  embed_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(table, e, tokens, batch, dim, x);
  return cudaGetLastError();
}

cudaError_t rmsnorm(const float* x, const float* w, int batch, int dim, float eps, void* out, Elem e,
                    cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  rmsnorm_kernel<<<static_cast<unsigned>(batch), kRowThreads, 0, stream>>>(x, w, dim, eps, out, e);
  return cudaGetLastError();
}

cudaError_t rope_split(const float* qkv, const int* pos, const float* freqs, int batch, int hq, int hkv, int hd,
                       int rope_dim, float* q, float* k, float* v, cudaStream_t stream) {
  const std::size_t pairs = static_cast<std::size_t>(batch) * ((hq + 2 * hkv) * hd / 2);
  if (pairs == 0) return cudaSuccess;
  rope_split_kernel<<<blocks_for(pairs, 256), 256, 0, stream>>>(qkv, pos, freqs, batch, hq, hkv, hd, rope_dim, q, k, v);
  return cudaGetLastError();
}

cudaError_t silu_mul(const float* h, int batch, int hidden, void* out, Elem e, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * hidden;
  if (n == 0) return cudaSuccess;
  silu_mul_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(h, batch, hidden, out, e);
  return cudaGetLastError();
}

cudaError_t convert(const float* in, std::size_t n, void* out, Elem e, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (e == Elem::kF32) return cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
  convert_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(in, n, out, e);
  return cudaGetLastError();
}

cudaError_t argmax(const float* logits, int batch, int vocab, int* out, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  argmax_kernel<<<static_cast<unsigned>(batch), kRowThreads, 0, stream>>>(logits, vocab, out);
  return cudaGetLastError();
}

cudaError_t fill_uniform(void* out, Elem e, std::size_t n, std::uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const std::size_t blocks = std::min<std::size_t>(blocks_for(n, 256), 65536);
  fill_uniform_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(out, e, n, seed, scale);
  return cudaGetLastError();
}

cudaError_t fill_uniform_block(void* out, Elem e, std::int64_t rows, std::int64_t cols, std::uint64_t seed, float scale,
                               std::int64_t src_cols, std::int64_t row0, std::int64_t col0, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  if (n == 0) return cudaSuccess;
  const std::size_t blocks = std::min<std::size_t>(blocks_for(n, 256), 65536);
  fill_uniform_block_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(out, e, rows, cols, seed, scale,
                                                                               src_cols, row0, col0);
  return cudaGetLastError();
}

cudaError_t add(float* x, const float* y, std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  add_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t fill_f32(float* out, std::size_t n, float value, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  fill_f32_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(out, n, value);
  return cudaGetLastError();
}

namespace {
__global__ void gather_tokens_kernel(const int* last, const int* seqs, int batch, int* tokens) {
  const int b = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (b < batch && tokens[b] < 0) tokens[b] = last[seqs[b]];
}
__global__ void scatter_tokens_kernel(const int* next, const int* seqs, int batch, int* last) {
  const int b = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (b < batch) last[seqs[b]] = next[b];
}
}  // namespace

cudaError_t gather_tokens(const int* last, const int* seqs, int batch, int* tokens, cudaStream_t stream) {
  gather_tokens_kernel<<<static_cast<unsigned>((batch + 255) / 256), 256, 0, stream>>>(last, seqs, batch, tokens);
  return cudaGetLastError();
}
cudaError_t scatter_tokens(const int* next, const int* seqs, int batch, int* last, cudaStream_t stream) {
  scatter_tokens_kernel<<<static_cast<unsigned>((batch + 255) / 256), 256, 0, stream>>>(next, seqs, batch, last);
  return cudaGetLastError();
}

}  // namespace thinkv::decoder::gpu
