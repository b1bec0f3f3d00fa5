/// \file fp8_route_probe.cu
/// The FP8 tensor-core route for quantized decode attention, costed in instructions before it is
/// built: one loop iteration is the route-specific work of one warp on one 16-token window of
/// NVFP4 pages (head_dim 128, a GQA group of 4 query heads, g = 16), written as the kernel would
/// do it on sm_90a:
///   - codes: the window's 2 x 16 x 128 E2M1 codes (128 per lane, 16 words) placed into E4M3
///     bytes (sign -> bit 7, exponent and mantissa -> bits 4..2: the code's value x 2^-6, exact)
///     for the A fragments of mma.m16n8k32 e4m3;
///   - key side B: Q x the key scales of the window's group (32 per lane: the lane's 8 channels
///     of each of the 4 k32 steps), split into two E4M3 terms (hi, lo) as two columns per head,
///     so that the product keeps ~2^-8 of Q instead of E4M3's 2^-4;
///   - value side B: P x the value scales (one value group per 16-channel m-tile), the same split
///     (32 per lane: 8 tokens x 8 groups over a 32-token k step, half of it per 16 tokens);
///   - the 8 mma.sync.m16n8k32 e4m3 (4 for the scores, 4 for the values) instead of the FP16
///     route's 16 mma.m16n8k16.
/// Softmax, the tile walk, row addresses and loads are the same in both routes and left out.
/// It is never run: bench/tools/fp8_route_sass.sh compiles it and counts the SASS of the loop
/// body, which docs/perf.md compares with the FP16 route's measured per-window counts.

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace {

/// Even nibbles of w (E2M1 codes 0, 2, 4, 6) -> 4 E4M3 bytes of value x 2^-6.
__device__ __forceinline__ std::uint32_t e2m1_even_to_e4m3(std::uint32_t w) {
  return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
}
/// Odd nibbles of w (codes 1, 3, 5, 7) -> 4 E4M3 bytes of value x 2^-6.
__device__ __forceinline__ std::uint32_t e2m1_odd_to_e4m3(std::uint32_t w) {
  return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

/// Two elements x2 (FP16) -> their E4M3 term: hi for a lane with neg_term = 0, lo (x - hi) for
/// a lane with neg_term = -1. 16 bits: the two E4M3 bytes.
/// Built with -DTHINKV_FP8_PROBE_ONE_TERM: one E4M3 term per element (no lo column), the cheap
/// and coarse variant.
__device__ __forceinline__ std::uint32_t split_term(__half2 x2, __half2 neg_term) {
#ifdef THINKV_FP8_PROBE_ONE_TERM
  (void)neg_term;
  return __nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(x2), __NV_SATFINITE, __NV_E4M3);
#endif
  const __nv_fp8x2_storage_t hi = __nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(x2), __NV_SATFINITE, __NV_E4M3);
  const __half2 back = static_cast<__half2>(__nv_cvt_fp8x2_to_halfraw2(hi, __NV_E4M3));
  const __half2 r = __hfma2(back, neg_term, x2);
  return __nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(r), __NV_SATFINITE, __NV_E4M3);
}

/// 4 E4M3 scale bytes (w) times 4 FP16 values (a, b) -> 4 split terms, packed.
__device__ __forceinline__ std::uint32_t scaled_terms(std::uint32_t w, __half2 a, __half2 b, __half2 neg_term) {
  const __half2 s01 = static_cast<__half2>(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3));
  const __half2 s23 =
      static_cast<__half2>(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3));
  return split_term(__hmul2(a, s01), neg_term) | (split_term(__hmul2(b, s23), neg_term) << 16);
}

__device__ __forceinline__ void mma_e4m3(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace

/// codes: 16 words per lane per window; kscale: 8 words (32 scale bytes) per lane per window;
/// vscale: 8 words per lane per window; p: 16 FP16 pairs per lane per window (the lane's P values,
/// already in the B layout); q: the lane's 32 Q values (16 pairs), loaded once.
extern "C" __global__ void fp8_route_window(const uint4* __restrict__ codes, const uint4* __restrict__ kscale,
                                            const uint4* __restrict__ vscale, const uint4* __restrict__ p,
                                            const __half2* __restrict__ q, float* __restrict__ out, int windows) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const __half2 neg_term = ((lane >> 2) & 1) != 0 ? __float2half2_rn(-1.0f) : __float2half2_rn(0.0f);
  __half2 qr[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) qr[i] = q[lane * 16 + i];
  float sk[4] = {0, 0, 0, 0}, ov[4][4] = {};
  for (int w = 0; w < windows; ++w) {
    const std::size_t at = (static_cast<std::size_t>(w) * 32 + lane) * 4;
    // Codes -> E4M3 A fragments (16 words -> 32 registers).
    std::uint32_t a[8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 c = codes[at + i];
      a[2 * i][0] = e2m1_even_to_e4m3(c.x);
      a[2 * i][2] = e2m1_odd_to_e4m3(c.x);
      a[2 * i][1] = e2m1_even_to_e4m3(c.y);
      a[2 * i][3] = e2m1_odd_to_e4m3(c.y);
      a[2 * i + 1][0] = e2m1_even_to_e4m3(c.z);
      a[2 * i + 1][2] = e2m1_odd_to_e4m3(c.z);
      a[2 * i + 1][1] = e2m1_even_to_e4m3(c.w);
      a[2 * i + 1][3] = e2m1_odd_to_e4m3(c.w);
    }
    // Key side: B = split(Q x key scale), 8 words of B for the 4 k32 steps; 4 mma.
    std::uint32_t bk[8];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 s = kscale[static_cast<std::size_t>(w) * 64 + lane * 2 + i];
      bk[4 * i + 0] = scaled_terms(s.x, qr[8 * i + 0], qr[8 * i + 1], neg_term);
      bk[4 * i + 1] = scaled_terms(s.y, qr[8 * i + 2], qr[8 * i + 3], neg_term);
      bk[4 * i + 2] = scaled_terms(s.z, qr[8 * i + 4], qr[8 * i + 5], neg_term);
      bk[4 * i + 3] = scaled_terms(s.w, qr[8 * i + 6], qr[8 * i + 7], neg_term);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) mma_e4m3(sk, a[k], bk[2 * k], bk[2 * k + 1]);
    // Value side: B = split(P x value scale) per value group; 4 mma (half of a 32-token k step).
    std::uint32_t bv[8];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 s = vscale[static_cast<std::size_t>(w) * 64 + lane * 2 + i];
      const uint4 pp = p[static_cast<std::size_t>(w) * 64 + lane * 2 + i];
      const __half2* ph = reinterpret_cast<const __half2*>(&pp);
      bv[4 * i + 0] = scaled_terms(s.x, ph[0], ph[1], neg_term);
      bv[4 * i + 1] = scaled_terms(s.y, ph[2], ph[3], neg_term);
      bv[4 * i + 2] = scaled_terms(s.z, ph[0], ph[1], neg_term);
      bv[4 * i + 3] = scaled_terms(s.w, ph[2], ph[3], neg_term);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) mma_e4m3(ov[k], a[4 + k], bv[2 * k], bv[2 * k + 1]);
    sk[0] += ov[0][0];  // a use of the scores, as the softmax would make
  }
  float sum = sk[0] + sk[1] + sk[2] + sk[3];
#pragma unroll
  for (int k = 0; k < 4; ++k) sum += ov[k][0] + ov[k][1] + ov[k][2] + ov[k][3];
  out[blockIdx.x * 32 + lane] = sum;
}
