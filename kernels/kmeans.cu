/// \file kmeans.cu
/// Batched K-means segment selection (TBE): one 256-thread CTA per segment, bit-identical to the
/// CPU reference thinkv::kmeans_select (thinkv/tbe/kmeans.hpp). Build without fast-math.
///
/// Exactness. Every floating-point operation of the CPU code is reproduced with an IEEE
/// round-to-nearest intrinsic (__fsub_rn, __fmul_rn, __fadd_rn, __fdiv_rn: nvcc never contracts
/// them into FMAs) and every sum runs in the CPU's order:
///  - squared distances: one thread per (point, centre) pair, eight partial sums over channels
///    j mod 8 (each in channel order) and the CPU's tree, so a distance is 8 short chains
///    (k-means++: two threads per point, four chains and one half of the tree each);
///  - k-means++ prefix sums of D(x)^2: warp 0, lane l sums points 4l .. 4l+3 in order, a
///    Hillis-Steele scan of the lane sums (shfl_up), then each point's prefix = the lanes
///    before it + its in-lane sum, as kmeanspp_prefix_sums defines it (one 128-point tile); the
///    total is the last point's prefix, and the first index with prefix > target (and not
///    chosen) is then found in parallel;
///  - centre means: one thread per (centre, channel), the centre's points in index order, then
///    sum / float(count) as the CPU divides. The member lists are integer work (match_any ranks
///    per warp, per-warp counts, a warp scan for the offsets): exact by construction.
/// Argmins reproduce the CPU's sequential "first candidate, then strictly smaller" rule, which
/// for FP32 values (NaN included) equals: the first candidate when its value is NaN, otherwise
/// the lowest-index minimum over the non-NaN values. Lloyd's assignment splits the centres of a
/// point over G thread groups (partial non-NaN argmins combined in group order, the NaN rule
/// applied with centre 0's distance); the selection step orders (value bits, index) keys, which
/// is exact because distances are +0 .. +inf or NaN (never negative, never -0). It finds each
/// centre's nearest point of all in parallel first and scans the untaken points only for a
/// centre whose nearest is already taken or whose distances hold a NaN.
///
/// Shared memory (dynamic, see Layout): the segment's points transposed (pT[j][i], point index
/// XOR-swizzled by (j & 31) so both per-point columns and per-channel rows are conflict-free),
/// the centres [layout_k, d], a scratch area (k-means++: the two halves of each point's newest
/// distance and D(x)^2; Lloyd's partial argmins; a 16-centre tile of
/// selection distances) and small index arrays.
///
/// Size classes. The layout is the launch's (layout_points, layout_k; by default max_points,
/// max_k), so a caller splitting mixed segments into launches by size (kmeans_size_class, with
/// segment_ids) runs small segments in small CTAs, many per SM. Each head_dim has three variants,
/// P = 32, 64, 128 points: P bounds the loops over a segment's points (k-means++'s running sum,
/// the selection's ballots) and sets __launch_bounds__'s minimum CTAs per SM (min_blocks), so the
/// small variants are not capped by registers. The arithmetic is the same in every variant: the
/// prefix sums see +0 past n either way (exact: no sum is ever -0), and the distance tiles (8
/// centres per thread at P = 128, 2 at 64, 1 at 32, sized for the registers of each variant's
/// occupancy) compute the same independent chains. A segment beyond the launch's layout gets the row of an invalid one.

#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "thinkv/kernels/kmeans_kernels.hpp"
#include "thinkv/tbe/kmeans.hpp"

namespace thinkv::kernels {
namespace {

constexpr int kThreads = 256;  // per CTA; >= 2 * kKmeansMaxPoints (two point groups at n = 128)
constexpr int kSelTile = 16;   // centres whose distances are materialized per selection round
constexpr unsigned kFull = 0xFFFFFFFFu;
static_assert(kThreads >= 2 * kKmeansMaxPoints, "two point groups per CTA (and the scratch holds the init's D(x)^2)");
static_assert(kKmeansMaxPoints % 32 == 0 && kKmeansMaxPoints <= 128, "selection: 4 points per lane");

/// Minimum CTAs per SM the kernel variant of head_dim D and point capacity P is compiled for
/// (__launch_bounds__): about as many as the shared memory of a P-point segment keeping P/2 lets
/// share an SM of 228 KiB (d = 128: ~105, ~53, ~27 KiB per CTA at P = 128, 64, 32; twice that at
/// d = 256), so registers do not cap the occupancy first (ptxas's counts: tile_for below).
constexpr int min_blocks(int D, int P) {
  if (P > 64) return 2;
  if (P > 32) return D > 128 ? 2 : 4;
  return D > 128 ? 4 : 8;
}
/// Centres per register tile of the distance loop (8 partial sums each): 8 at P = 128, 2 at
/// P = 64, 1 at P = 32, within the registers of min_blocks' occupancy (ptxas, sm_90a, CUDA 13.0:
/// 128 registers, no spill at P = 128; 64 at P = 64, no spill except 16 bytes of spill stores at
/// d = 32; 32 at P = 32, none at d = 256, 60 bytes of spill stores at d = 32 .. 128, 112 at d = 8).
constexpr int tile_for(int P) { return P > 64 ? 8 : P > 32 ? 2 : 1; }

/// Byte offsets of the shared-memory regions of one CTA (host and device agree).
struct Layout {
  int stride = 0;  ///< S: point index stride of pT and of the selection tile, multiple of 32
  std::size_t pt = 0, cen = 0, scratch = 0, assign = 0, members = 0, counts = 0, offsets = 0, wcount = 0, total = 0;
};

__host__ __device__ constexpr std::size_t max_sz(std::size_t a, std::size_t b) { return a > b ? a : b; }

__host__ __device__ constexpr Layout make_layout(int d, int max_points, int max_k) {
  Layout L{};
  L.stride = (max_points + 31) / 32 * 32;
  const auto S = static_cast<std::size_t>(L.stride);
  const auto K = static_cast<std::size_t>(max_k);
  const auto D = static_cast<std::size_t>(d);
  std::size_t off = 0;
  L.pt = off;  // float [D][S]
  off += D * S * sizeof(float);
  L.cen = off;  // float [K][D], 16-byte aligned rows (D % 4 == 0)
  off += K * D * sizeof(float);
  L.scratch = off;  // float: init [kKmeansMaxPoints] | Lloyd [kThreads] + int [kThreads] | selection [kSelTile][S]
  off += max_sz(2 * static_cast<std::size_t>(kThreads), kSelTile * S) * sizeof(float);
  L.assign = off;  // int [S]
  off += S * sizeof(int);
  L.members = off;  // int [S]
  off += S * sizeof(int);
  L.counts = off;  // int [K]
  off += K * sizeof(int);
  L.offsets = off;  // int [K]
  off += K * sizeof(int);
  L.wcount = off;  // int [kKmeansMaxPoints / 32][K]: Lloyd's per-warp member counts
  off += kKmeansMaxPoints / 32 * K * sizeof(int);
  L.total = (off + 15) / 16 * 16;
  return L;
}

__device__ __forceinline__ bool is_nan(float v) { return v != v; }

/// s + (a - b)^2 with the CPU's rounding: t = a - b; s += t * t (two roundings, no FMA).
__device__ __forceinline__ float add_sq(float s, float a, float b) {
  const float t = __fsub_rn(a, b);
  return __fadd_rn(s, __fmul_rn(t, t));
}

/// The tree that ends thinkv::squared_distance: ((P0 + P4) + (P2 + P6)) + ((P1 + P5) + (P3 + P7)).
__device__ __forceinline__ float combine8(const float (&q)[8]) {
  const float r0 = __fadd_rn(__fadd_rn(q[0], q[4]), __fadd_rn(q[2], q[6]));
  const float r1 = __fadd_rn(__fadd_rn(q[1], q[5]), __fadd_rn(q[3], q[7]));
  return __fadd_rn(r0, r1);
}

/// Squared distances from point i to the T centres c0 .. c0+T-1, each as thinkv::squared_distance
/// sums it (eight partial sums over channels j mod 8, 8 T independent chains, then the tree);
/// sink(c, dist) for c ascending. D % 8 == 0.
template <int D, int T, typename Sink>
__device__ __forceinline__ void distance_tile(const float* __restrict__ pT, int S, int i, const float* __restrict__ cen,
                                              int c0, Sink& sink) {
  static_assert(D % 8 == 0, "eight partial sums per distance");
  float s[T][8];
#pragma unroll
  for (int t = 0; t < T; ++t) {
#pragma unroll
    for (int u = 0; u < 8; ++u) s[t][u] = 0.0f;
  }
  const float* row = cen + c0 * D;
#pragma unroll 2
  for (int j = 0; j < D; j += 8) {
    const float* col = pT + j * S;
    const int sw = j & 31;  // j % 8 == 0, so (j + u) & 31 == sw + u for u < 8
    float x[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) x[u] = col[u * S + (i ^ (sw + u))];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float4 ca = *reinterpret_cast<const float4*>(row + t * D + j);
      const float4 cb = *reinterpret_cast<const float4*>(row + t * D + j + 4);
      s[t][0] = add_sq(s[t][0], x[0], ca.x);
      s[t][1] = add_sq(s[t][1], x[1], ca.y);
      s[t][2] = add_sq(s[t][2], x[2], ca.z);
      s[t][3] = add_sq(s[t][3], x[3], ca.w);
      s[t][4] = add_sq(s[t][4], x[4], cb.x);
      s[t][5] = add_sq(s[t][5], x[5], cb.y);
      s[t][6] = add_sq(s[t][6], x[6], cb.z);
      s[t][7] = add_sq(s[t][7], x[7], cb.w);
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) sink(c0 + t, combine8(s[t]));
}

/// Squared distances from point i to centres [cb, ce), c ascending: tiles of T centres, then one
/// tile of 4 (T = 8), 2 and 1 for the rest (a thread of a small segment may own 1 or 2 centres: no
/// chain is computed for a centre it does not own).
template <int D, int T, typename Sink>
__device__ __forceinline__ void centre_distances(const float* __restrict__ pT, int S, int i,
                                                 const float* __restrict__ cen, int cb, int ce, Sink&& sink) {
  static_assert(T == 8 || T == 4 || T == 2 || T == 1, "the tail below covers fewer than T centres");
  int c0 = cb;
  for (; c0 + T <= ce; c0 += T) distance_tile<D, T>(pT, S, i, cen, c0, sink);
  if constexpr (T > 4) {
    if (c0 + 4 <= ce) {
      distance_tile<D, 4>(pT, S, i, cen, c0, sink);
      c0 += 4;
    }
  }
  if constexpr (T > 2) {
    if (c0 + 2 <= ce) {
      distance_tile<D, 2>(pT, S, i, cen, c0, sink);
      c0 += 2;
    }
  }
  if constexpr (T > 1) {
    if (c0 < ce) distance_tile<D, 1>(pT, S, i, cen, c0, sink);
  }
}

/// D: head_dim; P: the variant's point capacity (32, 64 or 128), >= p.layout_points: the loops
/// over a segment's points run to P (p holds the resolved layout sizes, see launch_kmeans_select).
template <int D, int P>
__global__ void __launch_bounds__(kThreads, min_blocks(D, P)) kmeans_select_kernel(KmeansSelectParams p) {
  static_assert(P % 32 == 0 && P <= kKmeansMaxPoints, "P: 32, 64 or 128");
  extern __shared__ __align__(16) unsigned char smem[];
  const int seg = p.segment_ids != nullptr ? p.segment_ids[blockIdx.x] : static_cast<int>(blockIdx.x);
  if (seg < 0) return;  // no row to mark
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  int* __restrict__ out = p.kept + static_cast<std::ptrdiff_t>(seg) * p.max_k;
  const int n = p.num_points[seg];
  const int k = p.k[seg];
  // Uniform early exits (every thread reads the same n, k): no barrier has been reached yet. A
  // segment beyond the launch's layout is refused like an invalid one (its row all -1).
  if (n < 1 || n > p.max_points || k < 1 || k > p.max_k || n > p.layout_points || k > p.layout_k) {
    for (int t = tid; t < p.max_k; t += kThreads) out[t] = -1;
    return;
  }
  if (k >= n) {
    for (int t = tid; t < p.max_k; t += kThreads) out[t] = t < n ? t : -1;
    return;
  }

  const Layout L = make_layout(D, p.layout_points, p.layout_k);
  const int S = L.stride;
  float* const pT = reinterpret_cast<float*>(smem + L.pt);
  float* const cen = reinterpret_cast<float*>(smem + L.cen);
  float* const scratch = reinterpret_cast<float*>(smem + L.scratch);
  int* const assign = reinterpret_cast<int*>(smem + L.assign);
  int* const members = reinterpret_cast<int*>(smem + L.members);
  int* const counts = reinterpret_cast<int*>(smem + L.counts);
  int* const offsets = reinterpret_cast<int*>(smem + L.offsets);
  int* const wcount = reinterpret_cast<int*>(smem + L.wcount);
  // k-means++: the two halves of the tree of each point's distance to the newest centre
  // ([2][kKmeansMaxPoints]; combine8's r0 and r1), which warp 0 folds into D(x)^2 (after them).
  float* const half_sum = scratch;
  float* const dist = scratch + 2 * kKmeansMaxPoints;  // scratch holds >= 2 kThreads floats

  std::uint64_t state = p.seeds != nullptr ? p.seeds[seg] : p.seed;  // warp 0's lanes draw alike

  // ---- load the points, transposed and swizzled: pT[j * S + (i ^ (j & 31))] = x[i][j] -------
  const float* __restrict__ src = p.points + static_cast<std::ptrdiff_t>(seg) * p.max_points * D;
  if ((reinterpret_cast<std::uintptr_t>(src) & 15u) == 0) {  // 4 channels per load, 4 loads in flight
#pragma unroll 4
    for (int e = 4 * tid; e < n * D; e += 4 * kThreads) {
      const float4 x = *reinterpret_cast<const float4*>(src + e);
      const int i = e / D;
      const int j = e % D;  // j % 4 == 0: channels j + u swizzle by (j & 31) + u
      const int sw = j & 31;
      pT[j * S + (i ^ sw)] = x.x;
      pT[(j + 1) * S + (i ^ (sw + 1))] = x.y;
      pT[(j + 2) * S + (i ^ (sw + 2))] = x.z;
      pT[(j + 3) * S + (i ^ (sw + 3))] = x.w;
    }
  } else {
    for (int e = tid; e < n * D; e += kThreads) {
      const int i = e / D;
      const int j = e % D;
      pT[j * S + (i ^ (j & 31))] = src[e];
    }
  }
  for (int i = tid; i < S; i += kThreads) assign[i] = -1;
  for (int t = tid; t < P / 32 * k; t += kThreads) wcount[t] = 0;
  for (int i = tid; i < kKmeansMaxPoints; i += kThreads) {
    dist[i] = i < n ? __int_as_float(0x7F800000) : 0.0f;  // +inf; past n 0 (adds nothing below)
  }
  __syncthreads();

  // ---- 1. k-means++ initialisation ---------------------------------------------------------
  // Round c: warp 0 folds centre c - 1's distances into D(x)^2, picks centre c and copies that
  // point into cen[c]; then every point's distance to cen[c] is computed by two threads, one half
  // of its eight chains each, on all 8 warps (one thread per point left 4 warps idle; the part
  // took ~1,800 cycles per round at n = 128 on an NVIDIA H100, ~1,500 this way).
  unsigned mine_chosen = 0;  // warp 0: bit t = point 4 lane + t is a centre
  for (int c = 0; c < k; ++c) {
    if (warp == 0) {
      int pick = 0;
      if (c == 0) {
        pick = static_cast<int>(splitmix64(state) % static_cast<std::uint64_t>(n));
      } else {
        // D(x)^2 = min(D(x)^2, |x - cen[c - 1]|^2) (std::min(old, s)), s = r0 + r1 as combine8.
        const float4 ra = *reinterpret_cast<const float4*>(half_sum + 4 * lane);
        const float4 rb = *reinterpret_cast<const float4*>(half_sum + kKmeansMaxPoints + 4 * lane);
        const float4 old = *reinterpret_cast<const float4*>(dist + 4 * lane);
        const float sv[4] = {__fadd_rn(ra.x, rb.x), __fadd_rn(ra.y, rb.y), __fadd_rn(ra.z, rb.z),
                             __fadd_rn(ra.w, rb.w)};
        float dsq[4] = {old.x, old.y, old.z, old.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          if (4 * lane + t < n) dsq[t] = sv[t] < dsq[t] ? sv[t] : dsq[t];
        }
        *reinterpret_cast<float4*>(dist + 4 * lane) = make_float4(dsq[0], dsq[1], dsq[2], dsq[3]);
        // The prefix sums R_i of D(x)^2 as thinkv::kmeanspp_prefix_sums defines them (one tile:
        // P <= 128): lane l holds points 4l .. 4l+3 (0 past n, which changes no sum: every term
        // is >= +0), sums them in order, and the lanes' sums are scanned Hillis-Steele style.
        float pre[4];
        pre[0] = dsq[0];
        pre[1] = __fadd_rn(pre[0], dsq[1]);
        pre[2] = __fadd_rn(pre[1], dsq[2]);
        pre[3] = __fadd_rn(pre[2], dsq[3]);
        float x = pre[3];
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float y = __shfl_up_sync(kFull, x, off);
          if (lane >= off) x = __fadd_rn(y, x);
        }
        float e = __shfl_up_sync(kFull, x, 1);
        e = lane > 0 ? e : 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) pre[t] = __fadd_rn(e, pre[t]);
        const int last = n - 1;  // R_{n-1} is the total
        const int lt = last & 3;
        const float mine_last = lt == 0 ? pre[0] : lt == 1 ? pre[1] : lt == 2 ? pre[2] : pre[3];
        const float run = __shfl_sync(kFull, mine_last, last >> 2);
        const bool pos = run > 0.0f;
        float target = 0.0f;
        if (pos) {  // the same draw in every lane
          const float u = __fmul_rn(static_cast<float>(splitmix64(state) >> 40), 0x1p-24f);
          target = __fmul_rn(u, run);
        }
        int first_hit = INT_MAX;   // first i with run_i > target and not chosen
        int first_free = INT_MAX;  // lowest unchosen i (fallback)
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int i = 4 * lane + t;
          if (i < n && ((mine_chosen >> t) & 1u) == 0) {
            if (first_free == INT_MAX) first_free = i;
            if (pos && first_hit == INT_MAX && pre[t] > target) first_hit = i;
          }
        }
        first_hit = __reduce_min_sync(kFull, first_hit);
        first_free = __reduce_min_sync(kFull, first_free);
        pick = first_hit != INT_MAX ? first_hit : first_free;
      }
      if ((pick >> 2) == lane) mine_chosen |= 1u << (pick & 3);
      for (int j = lane; j < D; j += 32) cen[c * D + j] = pT[j * S + (pick ^ (j & 31))];
    }
    __syncthreads();
    // Thread (h, i): point i's chains u = h, h + 2, h + 4, h + 6 (channels j + u, j mod 8 == 0, in
    // channel order), then its half of combine8's tree: h = 0 r0 = (P0 + P4) + (P2 + P6), h = 1
    // r1 = (P1 + P5) + (P3 + P7). Warps 0-3 h = 0, warps 4-7 h = 1 (kThreads = 2 points' worth).
    const int h = tid / kKmeansMaxPoints;
    const int i = tid - h * kKmeansMaxPoints;
    if (c + 1 < k && h < 2 && i < n) {  // unused after the last centre
      const float* __restrict__ crow = cen + c * D + h;
      float q[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // chains h, h + 2, h + 4, h + 6
#pragma unroll(P > 32 ? 4 : 2)
      for (int j = 0; j < D; j += 8) {
        const float* col = pT + (j + h) * S;
        const int sw = (j & 31) + h;  // (j + u) & 31 == (j & 31) + u for u < 8
        q[0] = add_sq(q[0], col[i ^ sw], crow[j]);
        q[1] = add_sq(q[1], col[2 * S + (i ^ (sw + 2))], crow[j + 2]);
        q[2] = add_sq(q[2], col[4 * S + (i ^ (sw + 4))], crow[j + 4]);
        q[3] = add_sq(q[3], col[6 * S + (i ^ (sw + 6))], crow[j + 6]);
      }
      half_sum[h * kKmeansMaxPoints + i] = __fadd_rn(__fadd_rn(q[0], q[2]), __fadd_rn(q[1], q[3]));
    }
    __syncthreads();
  }

  // ---- thread roles for the distance passes: point i of group g ------------------------------
  const int group = (n + 31) / 32 * 32;  // threads per group
  const int groups = kThreads / group;   // G >= 2
  const int g = tid / group;
  const int i = tid - g * group;
  const bool active = g < groups && i < n;

  // ---- 2. Lloyd iterations -----------------------------------------------------------------
  {
    float* const part_v = scratch;                                   // [kThreads]
    int* const part_c = reinterpret_cast<int*>(scratch + kThreads);  // [kThreads]
    const int chunk = (k + groups - 1) / groups;
    const int cb = g * chunk < k ? g * chunk : k;
    const int ce = cb + chunk < k ? cb + chunk : k;
    for (int it = 0; it < p.max_iterations; ++it) {
      float pv = 0.0f;  // lowest-index minimum over the non-NaN distances of [cb, ce)
      int pc = -1;
      float d0 = 0.0f;  // distance to centre 0 (group 0)
      if (active) {
        centre_distances<D, tile_for(P)>(pT, S, i, cen, cb, ce, [&](int c, float v) {
          if (c == 0) d0 = v;
          if (!is_nan(v) && (pc < 0 || v < pv)) {
            pv = v;
            pc = c;
          }
        });
        part_v[tid] = pv;
        part_c[tid] = pc;
      }
      __syncthreads();
      int changed = 0;
      if (active && g == 0) {
        int best = pc;
        float bv = pv;
        for (int h = 1; h < groups; ++h) {
          const int ch = part_c[h * group + i];
          const float vh = part_v[h * group + i];
          if (ch >= 0 && (best < 0 || vh < bv)) {
            best = ch;
            bv = vh;
          }
        }
        if (is_nan(d0) || best < 0) best = 0;  // CPU: best = 0 first, only "dc < best_d" moves it
        if (assign[i] != best) {
          assign[i] = best;
          changed = 1;
        }
      }
      if (__syncthreads_or(changed) == 0) break;
      // New centres: mean of the members in index order (empty clusters keep their centre). The
      // member lists are built with integer counts and ranks (exact): warp w of group 0 ranks
      // each point among its lanes of the same centre (match_any) and counts them per centre
      // (wcount[w][c]); warp 0 turns the counts into offsets and per-warp bases.
      int own = -1;                           // group 0: this point's centre
      int below = 0;                          // lanes before this one in the warp with the same centre
      if (tid < group) {                      // whole warps (group is a multiple of 32)
        own = i < n ? assign[i] : -1 - lane;  // past n: a key no other lane has
        const unsigned same = __match_any_sync(kFull, own);
        below = __popc(same & ((1u << lane) - 1u));
        if (i < n && below == 0) wcount[warp * k + own] = __popc(same);
      }
      __syncthreads();
      if (warp == 0) {
        const int warps = group / 32;
        int cnt[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // centres lane and lane + 32 (k <= 64)
          const int c = lane + 32 * h;
          cnt[h] = 0;
          if (c < k) {
            for (int w = 0; w < warps; ++w) {  // wcount becomes the count of earlier warps
              const int v = wcount[w * k + c];
              wcount[w * k + c] = cnt[h];
              cnt[h] += v;
            }
            counts[c] = cnt[h];
          }
        }
        int base = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // exclusive scan over the centres
          int x = cnt[h];
#pragma unroll
          for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(kFull, x, off);
            if (lane >= off) x += y;
          }
          if (lane + 32 * h < k) offsets[lane + 32 * h] = base + x - cnt[h];
          base += __shfl_sync(kFull, x, 31);
        }
      }
      __syncthreads();
      if (tid < group && i < n) members[offsets[own] + wcount[warp * k + own] + below] = i;
      __syncthreads();
      for (int t = tid; t < P / 32 * k; t += kThreads) wcount[t] = 0;  // next iteration
      for (int e = tid; e < k * D; e += kThreads) {
        const int c = e / D;
        const int j = e % D;
        const int cnt = counts[c];
        if (cnt == 0) continue;
        const int* mem = members + offsets[c];
        const float* col = pT + j * S;
        const int sw = j & 31;
        float acc = 0.0f;
        int m = 0;
        for (; m + 4 <= cnt; m += 4) {  // four members' loads in flight, added in index order
          const float x0 = col[mem[m] ^ sw], x1 = col[mem[m + 1] ^ sw];
          const float x2 = col[mem[m + 2] ^ sw], x3 = col[mem[m + 3] ^ sw];
          acc = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(acc, x0), x1), x2), x3);
        }
        for (; m < cnt; ++m) acc = __fadd_rn(acc, col[mem[m] ^ sw]);
        cen[e] = __fdiv_rn(acc, static_cast<float>(cnt));
      }
      __syncthreads();
    }
  }

  // ---- 3. selection: for c = 0..k-1, the untaken point nearest to centre c ------------------
  float* const tile = scratch;   // [kSelTile][S] distances of the round's centres
  int* const nearest = members;  // [kSelTile] each centre's nearest point of all, -1 if one is NaN
  unsigned taken = 0;            // warp 0: bit q = point lane + 32 q is kept
  for (int c0 = 0; c0 < k; c0 += kSelTile) {
    const int tn = k - c0 < kSelTile ? k - c0 : kSelTile;
    if (active) {
      const int sc = (tn + groups - 1) / groups;
      const int sb = c0 + (g * sc < tn ? g * sc : tn);
      const int se = c0 + (g * sc + sc < tn ? g * sc + sc : tn);
      centre_distances<D, tile_for(P)>(pT, S, i, cen, sb, se, [&](int c, float v) { tile[(c - c0) * S + i] = v; });
    }
    __syncthreads();
    // Each centre's nearest point among all n, warps in parallel: the (value bits, index) minimum
    // when no distance of the centre is NaN. When that point is still untaken it is also the
    // nearest untaken one (a minimum over a subset that holds the overall minimum), so warp 0's
    // serial round below takes it without a scan; otherwise (taken, or a NaN, where the CPU's
    // first-candidate rule depends on what is taken) it scans the untaken points.
    for (int t = warp; t < tn; t += kThreads / 32) {
      unsigned long long best = ~0ull;
      bool nan = false;
#pragma unroll
      for (int q = 0; q < P / 32; ++q) {
        const int pi = lane + 32 * q;
        if (pi < n) {
          const float v = tile[t * S + pi];
          nan = nan || is_nan(v);
          const unsigned long long key =
              (static_cast<unsigned long long>(__float_as_uint(v)) << 32) | static_cast<unsigned>(pi);
          best = key < best ? key : best;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const unsigned long long o = __shfl_xor_sync(kFull, best, off);
        best = o < best ? o : best;
      }
      nan = __any_sync(kFull, nan) != 0;
      if (lane == 0) nearest[t] = nan ? -1 : static_cast<int>(best & 0xFFFFFFFFull);
    }
    __syncthreads();
    if (warp == 0) {
      for (int t = 0; t < tn; ++t) {
        const int near = nearest[t];
        if (near >= 0 && ((__shfl_sync(kFull, taken, near & 31) >> (near >> 5)) & 1u) == 0) {
          if ((near & 31) == lane) taken |= 1u << (near >> 5);
          continue;
        }
        int first = INT_MAX;  // the CPU's first candidate: lowest untaken index
#pragma unroll
        for (int q = 0; q < P / 32; ++q) {
          const int pi = lane + 32 * q;
          const unsigned bal = __ballot_sync(kFull, pi < n && ((taken >> q) & 1u) == 0);
          if (first == INT_MAX && bal != 0) first = 32 * q + __ffs(static_cast<int>(bal)) - 1;
        }
        unsigned long long best = ~0ull;
#pragma unroll
        for (int q = 0; q < P / 32; ++q) {
          const int pi = lane + 32 * q;
          if (pi < n && ((taken >> q) & 1u) == 0) {
            const float v = tile[t * S + pi];
            const unsigned hi = is_nan(v) ? (pi == first ? 0u : 0xFFFFFFFFu) : __float_as_uint(v);
            const unsigned long long key = (static_cast<unsigned long long>(hi) << 32) | static_cast<unsigned>(pi);
            best = key < best ? key : best;
          }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const unsigned long long o = __shfl_xor_sync(kFull, best, off);
          best = o < best ? o : best;
        }
        const int sel = static_cast<int>(best & 0xFFFFFFFFull);
        if ((sel & 31) == lane) taken |= 1u << (sel >> 5);
      }
    }
    __syncthreads();
  }
  if (warp == 0) {  // kept indices ascending, then -1
    int base = 0;
#pragma unroll
    for (int q = 0; q < P / 32; ++q) {
      const int pi = lane + 32 * q;
      const bool kept = pi < n && ((taken >> q) & 1u) != 0;
      const unsigned bal = __ballot_sync(kFull, kept);
      if (kept) out[base + __popc(bal & ((1u << lane) - 1u))] = pi;
      base += __popc(bal);
    }
    for (int t = base + lane; t < p.max_k; t += 32) out[t] = -1;
  }
}

template <int D, int P>
cudaError_t launch_for(const KmeansSelectParams& p, std::size_t bytes, int optin, cudaStream_t stream) {
  // The attribute is a cap, not the launch size: set it to the same value on every call (the
  // largest this instantiation can need, within the device's limit) so concurrent launches with
  // different shapes cannot undercut each other.
  const std::size_t most = make_layout(D, P, kKmeansMaxK).total;
  const int cap = most < static_cast<std::size_t>(optin) ? static_cast<int>(most) : optin;
  if (cudaError_t e =
          cudaFuncSetAttribute(kmeans_select_kernel<D, P>, cudaFuncAttributeMaxDynamicSharedMemorySize, cap);
      e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  kmeans_select_kernel<D, P><<<static_cast<unsigned>(p.num_segments), kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

/// The variant of the launch's size class (kmeans_size_class of its layout_points).
template <int D>
cudaError_t launch_class(const KmeansSelectParams& p, std::size_t bytes, int optin, cudaStream_t stream) {
  switch (kmeans_size_class(p.layout_points)) {
    case 32: return launch_for<D, 32>(p, bytes, optin, stream);
    case 64: return launch_for<D, 64>(p, bytes, optin, stream);
    default: return launch_for<D, kKmeansMaxPoints>(p, bytes, optin, stream);
  }
}

/// p with its layout sizes resolved (0: max_points, max_k), as the kernel reads them.
KmeansSelectParams resolved(const KmeansSelectParams& p) {
  KmeansSelectParams q = p;
  if (q.layout_points == 0) q.layout_points = q.max_points;
  if (q.layout_k == 0) q.layout_k = q.max_k;
  return q;
}

}  // namespace

cudaError_t check_kmeans_select(const KmeansSelectParams& p) noexcept {
  const bool d_ok = p.head_dim == 8 || p.head_dim == 32 || p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256;
  if (!d_ok || p.num_segments < 0 || p.max_points < 1 || p.max_points > kKmeansMaxPoints || p.max_k < 1 ||
      p.max_k > kKmeansMaxK || p.max_iterations < 0 || p.layout_points < 0 || p.layout_points > p.max_points ||
      p.layout_k < 0 || p.layout_k > p.max_k) {
    return cudaErrorInvalidValue;
  }
  if (p.num_segments > 0 && (p.points == nullptr || p.num_points == nullptr || p.k == nullptr || p.kept == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

std::size_t kmeans_select_shared_bytes(const KmeansSelectParams& p) noexcept {
  if (check_kmeans_select(p) != cudaSuccess) return 0;
  const KmeansSelectParams q = resolved(p);
  return make_layout(q.head_dim, q.layout_points, q.layout_k).total;
}

cudaError_t launch_kmeans_select(const KmeansSelectParams& p, cudaStream_t stream) noexcept {
  if (cudaError_t e = check_kmeans_select(p); e != cudaSuccess) return e;
  if (p.num_segments == 0) return cudaSuccess;
  const KmeansSelectParams q = resolved(p);
  const std::size_t bytes = make_layout(q.head_dim, q.layout_points, q.layout_k).total;
  int dev = 0;
  int optin = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  if (cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev); e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  if (bytes > static_cast<std::size_t>(optin)) return cudaErrorInvalidValue;
  switch (p.head_dim) {
    case 8: return launch_class<8>(q, bytes, optin, stream);
    case 32: return launch_class<32>(q, bytes, optin, stream);
    case 64: return launch_class<64>(q, bytes, optin, stream);
    case 128: return launch_class<128>(q, bytes, optin, stream);
    default: return launch_class<256>(q, bytes, optin, stream);
  }
}

}  // namespace thinkv::kernels
