/// \file kmeans.cu
/// Batched K-means segment selection (TBE): one 256-thread CTA per segment, bit-identical to the
/// CPU reference thinkv::kmeans_select (thinkv/tbe/kmeans.hpp). Build without fast-math.
///
/// Exactness. Every floating-point operation of the CPU code is reproduced with an IEEE
/// round-to-nearest intrinsic (__fsub_rn, __fmul_rn, __fadd_rn, __fdiv_rn: nvcc never contracts
/// them into FMAs) and every sum runs in the CPU's order:
///  - squared distances: one thread per (point, centre) pair, channels 0..d-1 in order;
///  - k-means++ D(x)^2 total and running sum: one thread (lane 0 of warp 0), index order; the CPU's
///    total and its running sum are the same chain of partial sums, so one pass gives both and the
///    first index with run > target (and not chosen) is then found in parallel (min index);
///  - centre means: one thread per (centre, channel), the centre's points in index order, then
///    sum / float(count) as the CPU divides.
/// Argmins reproduce the CPU's sequential "first candidate, then strictly smaller" rule, which
/// for FP32 values (NaN included) equals: the first candidate when its value is NaN, otherwise
/// the lowest-index minimum over the non-NaN values. Lloyd's assignment splits the centres of a
/// point over G thread groups (partial non-NaN argmins combined in group order, the NaN rule
/// applied with centre 0's distance); the selection step orders (value bits, index) keys, which
/// is exact because distances are +0 .. +inf or NaN (never negative, never -0).
///
/// Shared memory (dynamic, see Layout): the segment's points transposed (pT[j][i], point index
/// XOR-swizzled by (j & 31) so both per-point columns and per-channel rows are conflict-free),
/// the centres [max_k, d], a scratch area (k-means++ D(x)^2 and running sums; Lloyd's partial
/// argmins; a 16-centre tile of selection distances) and small index arrays.

#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "thinkv/kernels/kmeans_kernels.hpp"
#include "thinkv/tbe/kmeans.hpp"

namespace thinkv::kernels {
namespace {

constexpr int kThreads = 256;  // per CTA; >= 2 * kKmeansMaxPoints (two point groups at n = 128)
constexpr int kTile = 8;       // centres per register tile of the distance loop
constexpr int kSelTile = 16;   // centres whose distances are materialized per selection round
constexpr unsigned kFull = 0xFFFFFFFFu;
static_assert(kThreads >= 2 * kKmeansMaxPoints, "two point groups per CTA");
static_assert(kKmeansMaxPoints % 32 == 0 && kKmeansMaxPoints <= 128, "selection: 4 points per lane");

/// Byte offsets of the shared-memory regions of one CTA (host and device agree).
struct Layout {
  int stride = 0;  ///< S: point index stride of pT and of the selection tile, multiple of 32
  std::size_t pt = 0, cen = 0, scratch = 0, assign = 0, members = 0, counts = 0, offsets = 0, picks = 0, flags = 0,
              total = 0;
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
  L.scratch = off;  // float: init [2][S] | Lloyd [kThreads] + int [kThreads] | selection [kSelTile][S]
  off += max_sz(max_sz(2 * S, 2 * static_cast<std::size_t>(kThreads)), kSelTile * S) * sizeof(float);
  L.assign = off;  // int [S]
  off += S * sizeof(int);
  L.members = off;  // int [S]
  off += S * sizeof(int);
  L.counts = off;  // int [K]
  off += K * sizeof(int);
  L.offsets = off;  // int [K]
  off += K * sizeof(int);
  L.picks = off;  // int [K]
  off += K * sizeof(int);
  L.flags = off;  // unsigned char [S]
  off += S;
  L.total = (off + 15) / 16 * 16;
  return L;
}

__device__ __forceinline__ bool is_nan(float v) { return v != v; }

/// s + (a - b)^2 with the CPU's rounding: t = a - b; s += t * t (two roundings, no FMA).
__device__ __forceinline__ float add_sq(float s, float a, float b) {
  const float t = __fsub_rn(a, b);
  return __fadd_rn(s, __fmul_rn(t, t));
}

/// Squared distances from point i to centres [cb, ce), each summed over channels 0..D-1 in
/// order; sink(c, dist) is called for c ascending. kTile independent chains at a time.
template <int D, typename Sink>
__device__ __forceinline__ void centre_distances(const float* __restrict__ pT, int S, int i,
                                                 const float* __restrict__ cen, int cb, int ce, Sink&& sink) {
  for (int c0 = cb; c0 < ce; c0 += kTile) {
    float s[kTile];
    const float* row[kTile];
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      s[t] = 0.0f;
      const int c = c0 + t < ce ? c0 + t : ce - 1;  // clamp: tail results are discarded
      row[t] = cen + c * D;
    }
#pragma unroll 4
    for (int j = 0; j < D; j += 4) {
      const float* col = pT + j * S;
      const int sw = j & 31;  // j % 4 == 0, so (j + u) & 31 == sw + u for u < 4
      const float x0 = col[i ^ sw];
      const float x1 = col[S + (i ^ (sw + 1))];
      const float x2 = col[2 * S + (i ^ (sw + 2))];
      const float x3 = col[3 * S + (i ^ (sw + 3))];
#pragma unroll
      for (int t = 0; t < kTile; ++t) {
        const float4 cv = *reinterpret_cast<const float4*>(row[t] + j);
        float a = s[t];
        a = add_sq(a, x0, cv.x);
        a = add_sq(a, x1, cv.y);
        a = add_sq(a, x2, cv.z);
        a = add_sq(a, x3, cv.w);
        s[t] = a;
      }
    }
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (c0 + t < ce) sink(c0 + t, s[t]);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) kmeans_select_kernel(KmeansSelectParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int seg = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  int* __restrict__ out = p.kept + static_cast<std::ptrdiff_t>(seg) * p.max_k;
  const int n = p.num_points[seg];
  const int k = p.k[seg];
  // Uniform early exits (every thread reads the same n, k): no barrier has been reached yet.
  if (n < 1 || n > p.max_points || k < 1 || k > p.max_k) {
    for (int t = tid; t < p.max_k; t += kThreads) out[t] = -1;
    return;
  }
  if (k >= n) {
    for (int t = tid; t < p.max_k; t += kThreads) out[t] = t < n ? t : -1;
    return;
  }

  const Layout L = make_layout(D, p.max_points, p.max_k);
  const int S = L.stride;
  float* const pT = reinterpret_cast<float*>(smem + L.pt);
  float* const cen = reinterpret_cast<float*>(smem + L.cen);
  float* const scratch = reinterpret_cast<float*>(smem + L.scratch);
  int* const assign = reinterpret_cast<int*>(smem + L.assign);
  int* const members = reinterpret_cast<int*>(smem + L.members);
  int* const counts = reinterpret_cast<int*>(smem + L.counts);
  int* const offsets = reinterpret_cast<int*>(smem + L.offsets);
  int* const picks = reinterpret_cast<int*>(smem + L.picks);
  unsigned char* const chosen = smem + L.flags;
  float* const dist = scratch;        // k-means++: D(x)^2 [S]
  float* const prefix = scratch + S;  // k-means++: running sums [S]

  std::uint64_t state = p.seeds != nullptr ? p.seeds[seg] : p.seed;  // used by thread 0 only

  // ---- load the points, transposed and swizzled: pT[j * S + (i ^ (j & 31))] = x[i][j] -------
  const float* __restrict__ src = p.points + static_cast<std::ptrdiff_t>(seg) * p.max_points * D;
  for (int e = tid; e < n * D; e += kThreads) {
    const int i = e / D;
    const int j = e % D;
    pT[j * S + (i ^ (j & 31))] = src[e];
  }
  for (int i = tid; i < n; i += kThreads) {
    dist[i] = __int_as_float(0x7F800000);  // +inf
    chosen[i] = 0;
    assign[i] = -1;
  }
  if (tid == 0) picks[0] = static_cast<int>(splitmix64(state) % static_cast<std::uint64_t>(n));
  __syncthreads();

  // ---- 1. k-means++ initialisation ---------------------------------------------------------
  for (int c = 0; c < k; ++c) {
    if (c > 0) {
      if (warp == 0) {
        float target = 0.0f;
        int pos = 0;
        if (lane == 0) {
          // total = sum of D(x)^2 in index order; the CPU's running sum is the same chain.
          float run = 0.0f;
          for (int i = 0; i < n; ++i) {
            run = __fadd_rn(run, dist[i]);
            prefix[i] = run;
          }
          pos = run > 0.0f;
          if (pos) {
            const float u = __fmul_rn(static_cast<float>(splitmix64(state) >> 40), 0x1p-24f);
            target = __fmul_rn(u, run);
          }
        }
        __syncwarp();
        pos = __shfl_sync(kFull, pos, 0);
        target = __shfl_sync(kFull, target, 0);
        int first_hit = INT_MAX;   // first i with run_i > target and not chosen
        int first_free = INT_MAX;  // lowest unchosen i (fallback)
#pragma unroll
        for (int q = 0; q < kKmeansMaxPoints / 32; ++q) {
          const int i = lane + 32 * q;
          if (i < n && chosen[i] == 0) {
            if (first_free == INT_MAX) first_free = i;
            if (pos != 0 && first_hit == INT_MAX && prefix[i] > target) first_hit = i;
          }
        }
        first_hit = __reduce_min_sync(kFull, first_hit);
        first_free = __reduce_min_sync(kFull, first_free);
        if (lane == 0) picks[c] = first_hit != INT_MAX ? first_hit : first_free;
      }
      __syncthreads();
    }
    const int pick = picks[c];
    if (tid == 0) chosen[pick] = 1;
    if (c + 1 < k && tid < n) {  // D(x)^2 = min(D(x)^2, |x - x_pick|^2); unused after the last
      const int i = tid;
      float s = 0.0f;
#pragma unroll 8
      for (int j = 0; j < D; ++j) {
        const float* col = pT + j * S;
        const int sw = j & 31;
        s = add_sq(s, col[i ^ sw], col[pick ^ sw]);
      }
      const float old = dist[i];
      dist[i] = s < old ? s : old;  // std::min(old, s)
    }
    __syncthreads();
  }
  for (int e = tid; e < k * D; e += kThreads) {  // centre c = point picks[c]
    const int c = e / D;
    const int j = e % D;
    cen[e] = pT[j * S + (picks[c] ^ (j & 31))];
  }
  __syncthreads();

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
        centre_distances<D>(pT, S, i, cen, cb, ce, [&](int c, float v) {
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
      // New centres: mean of the members in index order (empty clusters keep their centre).
      if (tid < k) {
        int cnt = 0;
        for (int x = 0; x < n; ++x) cnt += assign[x] == tid ? 1 : 0;
        counts[tid] = cnt;
      }
      __syncthreads();
      if (tid < k) {
        int off = 0;
        for (int c = 0; c < tid; ++c) off += counts[c];
        offsets[tid] = off;
        for (int x = 0; x < n; ++x) {
          if (assign[x] == tid) members[off++] = x;
        }
      }
      __syncthreads();
      for (int e = tid; e < k * D; e += kThreads) {
        const int c = e / D;
        const int j = e % D;
        const int cnt = counts[c];
        if (cnt == 0) continue;
        const int* mem = members + offsets[c];
        const float* col = pT + j * S;
        const int sw = j & 31;
        float acc = 0.0f;
        for (int m = 0; m < cnt; ++m) acc = __fadd_rn(acc, col[mem[m] ^ sw]);
        cen[e] = __fdiv_rn(acc, static_cast<float>(cnt));
      }
      __syncthreads();
    }
  }

  // ---- 3. selection: for c = 0..k-1, the untaken point nearest to centre c ------------------
  float* const tile = scratch;  // [kSelTile][S] distances of the round's centres
  unsigned taken = 0;           // warp 0: bit q = point lane + 32 q is kept
  for (int c0 = 0; c0 < k; c0 += kSelTile) {
    const int tn = k - c0 < kSelTile ? k - c0 : kSelTile;
    if (active) {
      const int sc = (tn + groups - 1) / groups;
      const int sb = c0 + (g * sc < tn ? g * sc : tn);
      const int se = c0 + (g * sc + sc < tn ? g * sc + sc : tn);
      centre_distances<D>(pT, S, i, cen, sb, se, [&](int c, float v) { tile[(c - c0) * S + i] = v; });
    }
    __syncthreads();
    if (warp == 0) {
      for (int t = 0; t < tn; ++t) {
        int first = INT_MAX;  // the CPU's first candidate: lowest untaken index
#pragma unroll
        for (int q = 0; q < kKmeansMaxPoints / 32; ++q) {
          const int pi = lane + 32 * q;
          const unsigned bal = __ballot_sync(kFull, pi < n && ((taken >> q) & 1u) == 0);
          if (first == INT_MAX && bal != 0) first = 32 * q + __ffs(static_cast<int>(bal)) - 1;
        }
        unsigned long long best = ~0ull;
#pragma unroll
        for (int q = 0; q < kKmeansMaxPoints / 32; ++q) {
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
    for (int q = 0; q < kKmeansMaxPoints / 32; ++q) {
      const int pi = lane + 32 * q;
      const bool kept = pi < n && ((taken >> q) & 1u) != 0;
      const unsigned bal = __ballot_sync(kFull, kept);
      if (kept) out[base + __popc(bal & ((1u << lane) - 1u))] = pi;
      base += __popc(bal);
    }
    for (int t = base + lane; t < p.max_k; t += 32) out[t] = -1;
  }
}

template <int D>
cudaError_t launch_for(const KmeansSelectParams& p, std::size_t bytes, int optin, cudaStream_t stream) {
  // The attribute is a cap, not the launch size: set it to the same value on every call (the
  // largest this instantiation can need, within the device's limit) so concurrent launches with
  // different shapes cannot undercut each other.
  const std::size_t most = make_layout(D, kKmeansMaxPoints, kKmeansMaxK).total;
  const int cap = most < static_cast<std::size_t>(optin) ? static_cast<int>(most) : optin;
  if (cudaError_t e = cudaFuncSetAttribute(kmeans_select_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, cap);
      e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  kmeans_select_kernel<D><<<static_cast<unsigned>(p.num_segments), kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t check_kmeans_select(const KmeansSelectParams& p) noexcept {
  const bool d_ok = p.head_dim == 8 || p.head_dim == 32 || p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256;
  if (!d_ok || p.num_segments < 0 || p.max_points < 1 || p.max_points > kKmeansMaxPoints || p.max_k < 1 ||
      p.max_k > kKmeansMaxK || p.max_iterations < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_segments > 0 && (p.points == nullptr || p.num_points == nullptr || p.k == nullptr || p.kept == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

std::size_t kmeans_select_shared_bytes(const KmeansSelectParams& p) noexcept {
  if (check_kmeans_select(p) != cudaSuccess) return 0;
  return make_layout(p.head_dim, p.max_points, p.max_k).total;
}

cudaError_t launch_kmeans_select(const KmeansSelectParams& p, cudaStream_t stream) noexcept {
  if (cudaError_t e = check_kmeans_select(p); e != cudaSuccess) return e;
  if (p.num_segments == 0) return cudaSuccess;
  const std::size_t bytes = make_layout(p.head_dim, p.max_points, p.max_k).total;
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
    case 8: return launch_for<8>(p, bytes, optin, stream);
    case 32: return launch_for<32>(p, bytes, optin, stream);
    case 64: return launch_for<64>(p, bytes, optin, stream);
    case 128: return launch_for<128>(p, bytes, optin, stream);
    default: return launch_for<256>(p, bytes, optin, stream);
  }
}

}  // namespace thinkv::kernels
