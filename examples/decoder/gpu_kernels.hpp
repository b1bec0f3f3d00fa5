#pragma once
/// \file gpu_kernels.hpp
/// The GPU decoder's own small kernels (gpu_kernels.cu): everything of a Llama layer that is
/// neither a GEMM (cuBLAS) nor attention (ThinKV's cache). Each works on a batch of rows, one
/// row per sequence of the step, and is enqueued on `stream` without waiting. Activations are
/// FP32; the inputs of the GEMMs are written in the weights' element type (FP32 or BF16).
/// Every function returns the launch's error (cudaSuccess, or what cudaGetLastError says).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace thinkv::decoder::gpu {

/// Element type of the weights and of the GEMM inputs.
enum class Elem : std::uint8_t { kF32, kBF16 };

inline constexpr std::size_t elem_bytes(Elem e) noexcept { return e == Elem::kF32 ? 4 : 2; }

/// x[b] = table[tokens[b]] (table [vocab, dim] in `e`), as FP32.
cudaError_t embed(const void* table, Elem e, const int* tokens, int batch, int dim, float* x, cudaStream_t stream);

/// out[b] = w * (x[b] / sqrt(mean(x[b]^2) + eps)), written in `e` (llama2.c's rmsnorm).
cudaError_t rmsnorm(const float* x, const float* w, int batch, int dim, float eps, void* out, Elem e,
                    cudaStream_t stream);

/// Splits qkv ([batch, (hq + 2 hkv) * hd], the fused projection's output) into q [batch, hq, hd],
/// k and v [batch, hkv, hd], rotating q and k by llama2.c's RoPE (adjacent pairs of the first
/// rope_dim channels of each head, angle pos[b] * freqs[i / 2]).
cudaError_t rope_split(const float* qkv, const int* pos, const float* freqs, int batch, int hq, int hkv, int hd,
                       int rope_dim, float* q, float* k, float* v, cudaStream_t stream);

/// out[b][i] = silu(h[b][i]) * h[b][hidden + i] for h [batch, 2 * hidden] (gate, then up), in `e`.
cudaError_t silu_mul(const float* h, int batch, int hidden, void* out, Elem e, cudaStream_t stream);

/// out = in converted to `e` (n elements; a copy when e is FP32).
cudaError_t convert(const float* in, std::size_t n, void* out, Elem e, cudaStream_t stream);

/// out[b] = the index of the largest logit of row b (the first on ties), or -1 when the row holds
/// a value that is not finite.
cudaError_t argmax(const float* logits, int batch, int vocab, int* out, cudaStream_t stream);
/// Pipelined steps: tokens[b] < 0 becomes last[seqs[b]] (the sequence's previous greedy token,
/// kept on the device), and after the step last[seqs[b]] = next[b].
cudaError_t gather_tokens(const int* last, const int* seqs, int batch, int* tokens, cudaStream_t stream);
cudaError_t scatter_tokens(const int* next, const int* seqs, int batch, int* last, cudaStream_t stream);

/// n values uniform in [-scale, scale) from a counter-based hash of (seed, index), in `e`
/// (reproducible whatever the launch shape; for weights whose values do not matter).
cudaError_t fill_uniform(void* out, Elem e, std::size_t n, std::uint64_t seed, float scale, cudaStream_t stream);

/// A block of a matrix fill_uniform would draw: `rows` x `cols` values (row-major, in `e`) whose
/// element (r, c) is fill_uniform's element (row0 + r) * src_cols + col0 + c of the same seed
/// (the whole matrix has src_cols columns). With row0 = col0 = 0 and src_cols = cols, exactly
/// fill_uniform: a tensor-parallel rank draws its slice of the matrix one GPU draws.
cudaError_t fill_uniform_block(void* out, Elem e, std::int64_t rows, std::int64_t cols, std::uint64_t seed, float scale,
                               std::int64_t src_cols, std::int64_t row0, std::int64_t col0, cudaStream_t stream);

/// x[i] += y[i] for n values (FP32).
cudaError_t add(float* x, const float* y, std::size_t n, cudaStream_t stream);

/// n copies of `value` (FP32).
cudaError_t fill_f32(float* out, std::size_t n, float value, cudaStream_t stream);

}  // namespace thinkv::decoder::gpu
