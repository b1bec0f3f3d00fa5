#!/usr/bin/env python3
"""Instrument a copy of kernels/kmeans.cu with per-phase clocks (an experiment, never built into
the library).

Thread 0 of every CTA reads clock64() at the kernel's phase boundaries and adds the cycles to
device counters per segment size (n > 64, > 32, > 16, > 8, <= 8 points): loading the points,
k-means++, Lloyd, the selection, and the Lloyd assignment passes run. For the n > 64 segments it
also splits each phase: k-means++'s serial part (warp 0's prefix sums, draw and centre copy, up to
the barrier) and its distance part; Lloyd's assignment passes and centre updates; the selection's
distance tiles and its picks. Every 10,000 CTAs the device prints the running means (cycles per
CTA: divide by the SM clock for time; thread 0 waits at the CTA's barriers, so a phase's cycles
are the CTA's, not one warp's). Use it on a benchmark whose launches are all alike, e.g.

  python3 bench/tools/kmeans_phase_clocks.py kernels/kmeans.cu /tmp/kmprof/kernels/kmeans.cu
  # with /tmp/kmprof a copy of CMakeLists.txt cmake include kernels bench examples README.md
  cmake -S /tmp/kmprof -B build-kmprof -G Ninja -DCMAKE_BUILD_TYPE=Release \\
      -DTHINKV_BUILD_TESTS=OFF -DTHINKV_BUILD_EXAMPLES=OFF && cmake --build build-kmprof --target bench_kmeans
  build-kmprof/bench/bench_kmeans --benchmark_filter='BM_KmeansMixed/segments:650/mix:0/mode:1' | grep -E 'PHASES|FINE'

The anchors are lines of the kernel's source; when the kernel changes, the script stops and names
the anchor it could not find.
"""
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: kmeans_phase_clocks.py KMEANS_CU OUT_CU")
    s = open(sys.argv[1], encoding="utf-8").read()

    def rep(old, new):
        nonlocal s
        if s.count(old) != 1:
            sys.exit("kmeans_phase_clocks.py: anchor not found once in the kernel: " + repr(old[:100]))
        s = s.replace(old, new, 1)

    # Counters and printf, ahead of the kernel (outside the library's namespaces for <cstdio>).
    rep("template <int D, int P>\n__global__",
        "}  // namespace\n}  // namespace thinkv::kernels\n#include <cstdio>\nnamespace thinkv::kernels {\nnamespace {\n"
        "__device__ unsigned long long g_ph[5][6];\n__device__ unsigned long long g_fine[7];\n"
        "__device__ unsigned int g_ph_done;\n"
        "template <int D, int P>\n__global__")
    rep("  const Layout L = make_layout(D, p.layout_points, p.layout_k);\n",
        "  const Layout L = make_layout(D, p.layout_points, p.layout_k);\n  const long long ph0 = clock64();\n")
    rep("  // ---- 1. k-means++ initialisation",
        "  const long long ph1 = clock64();\n"
        "  long long fk_ser = 0, fk_dist = 0, fl_dist = 0, fl_upd = 0, fs_dist = 0, fs_pick = 0;\n"
        "  // ---- 1. k-means++ initialisation")
    rep("  for (int c = 0; c < k; ++c) {\n    if (warp == 0) {\n",
        "  for (int c = 0; c < k; ++c) {\n    const long long f0 = clock64();\n    if (warp == 0) {\n")
    rep("    __syncthreads();\n    // Thread (h, i): point i's chains",
        "    __syncthreads();\n    const long long f1 = clock64();\n    fk_ser += f1 - f0;\n"
        "    // Thread (h, i): point i's chains")
    rep("      half_sum[h * kKmeansMaxPoints + i] = __fadd_rn(__fadd_rn(q[0], q[2]), __fadd_rn(q[1], q[3]));\n"
        "    }\n    __syncthreads();\n",
        "      half_sum[h * kKmeansMaxPoints + i] = __fadd_rn(__fadd_rn(q[0], q[2]), __fadd_rn(q[1], q[3]));\n"
        "    }\n    __syncthreads();\n    fk_dist += clock64() - f1;\n")
    rep("  // ---- thread roles for the distance passes",
        "  const long long ph2 = clock64();\n  int ph_it = 0;\n  // ---- thread roles for the distance passes")
    rep("    for (int it = 0; it < p.max_iterations; ++it) {\n",
        "    for (int it = 0; it < p.max_iterations; ++it) {\n      const long long l0 = clock64();\n")
    rep("      if (__syncthreads_or(changed) == 0) break;\n",
        "      ph_it = it + 1;\n      const int any_changed = __syncthreads_or(changed);\n"
        "      fl_dist += clock64() - l0;\n      if (any_changed == 0) break;\n      const long long l1 = clock64();\n")
    rep("        cen[e] = __fdiv_rn(acc, static_cast<float>(cnt));\n      }\n      __syncthreads();\n    }\n",
        "        cen[e] = __fdiv_rn(acc, static_cast<float>(cnt));\n      }\n      __syncthreads();\n"
        "      fl_upd += clock64() - l1;\n    }\n")
    rep("  // ---- 3. selection", "  const long long ph3 = clock64();\n  // ---- 3. selection")
    rep("  for (int c0 = 0; c0 < k; c0 += kSelTile) {\n",
        "  for (int c0 = 0; c0 < k; c0 += kSelTile) {\n    const long long s0 = clock64();\n")
    rep("    __syncthreads();\n    // Each centre's nearest point among all n",
        "    __syncthreads();\n    const long long s1 = clock64();\n    fs_dist += s1 - s0;\n"
        "    // Each centre's nearest point among all n")
    rep("        if ((sel & 31) == lane) taken |= 1u << (sel >> 5);\n      }\n    }\n    __syncthreads();\n",
        "        if ((sel & 31) == lane) taken |= 1u << (sel >> 5);\n      }\n    }\n    __syncthreads();\n"
        "    fs_pick += clock64() - s1;\n")
    rep("    for (int t = base + lane; t < p.max_k; t += 32) out[t] = -1;\n  }\n",
        "    for (int t = base + lane; t < p.max_k; t += 32) out[t] = -1;\n  }\n" + RECORD)
    open(sys.argv[2], "w", encoding="utf-8").write(s)


RECORD = r"""  if (tid == 0) {
    const long long ph4 = clock64();
    const int bk = n > 64 ? 0 : n > 32 ? 1 : n > 16 ? 2 : n > 8 ? 3 : 4;
    const long long part[6] = {1, ph1 - ph0, ph2 - ph1, ph3 - ph2, ph4 - ph3, ph_it};
    for (int x = 0; x < 6; ++x) atomicAdd(&g_ph[bk][x], static_cast<unsigned long long>(part[x]));
    if (bk == 0) {
      const long long fine[7] = {1, fk_ser, fk_dist, fl_dist, fl_upd, fs_dist, fs_pick};
      for (int x = 0; x < 7; ++x) atomicAdd(&g_fine[x], static_cast<unsigned long long>(fine[x]));
    }
    const unsigned done = atomicAdd(&g_ph_done, 1u) + 1u;
    if (done % 10000u == 0u) {
      for (int b = 0; b < 5; ++b) {
        const double c = static_cast<double>(g_ph[b][0]);
        if (c > 0) {
          printf("PHASES done %u n<=%d count %.0f load %.0f kpp %.0f lloyd %.0f select %.0f cycles, "
                 "assignment passes %.2f\n", done, 128 >> b, c, g_ph[b][1] / c, g_ph[b][2] / c, g_ph[b][3] / c,
                 g_ph[b][4] / c, g_ph[b][5] / c);
        }
      }
      const double f = static_cast<double>(g_fine[0]);
      if (f > 0) {
        printf("FINE n>64 count %.0f kpp serial %.0f kpp dist %.0f lloyd assign %.0f lloyd update %.0f "
               "sel dist %.0f sel pick %.0f cycles\n", f, g_fine[1] / f, g_fine[2] / f, g_fine[3] / f,
               g_fine[4] / f, g_fine[5] / f, g_fine[6] / f);
      }
    }
  }
"""

if __name__ == "__main__":
    main()
