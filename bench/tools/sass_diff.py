#!/usr/bin/env python3
"""Compare two Nsight Compute SASS source-counter exports of the same kernel binary, line by line.

Both CSVs (optionally gzipped) come from the same executable and kernel instance run on two
configurations, e.g. the decode-attention main pass on NVFP4 pages and on the per-block R4E4T2 mix:

  ncu --clock-control none -k regex:paged_decode_partial --launch-count 1 --section SourceCounters \
      -o a bench_paged_attention --benchmark_filter='^BM_PagedDecodeAttention/tokens:4096/batch:64/mode:2/evict:50/'
  ncu --import a.ncu-rep --page source --csv --print-source sass > a.csv

Prints each side's warp instructions executed and splits the difference by what the lines do in
the two runs: lines only B runs (e.g. another precision's window code), lines B runs less often
(code A runs more), lines B runs more often, and lines both run equally often (prologue,
epilogue). --marker OPCODE (default HMMA) counts the executions of the lines with that opcode per
execution-count class: for the main pass, whose window runs each of its 16 HMMA lines once, that
is the number of windows each precision ran. --runs N lists the N contiguous stretches of lines
that B runs more often, largest difference first (where the extra work sits).

  python3 bench/tools/sass_diff.py docs/perf-data/2026-12-07-split-fit/h100-933f10b/sass_nvfp4_evict50.csv.gz \
      docs/perf-data/2026-12-07-split-fit/h100-933f10b/sass_r4e4t2_block_evict50.csv.gz
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_profile import num, opcode, read_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="first export (.csv or .csv.gz)")
    ap.add_argument("b", help="second export, same binary and kernel")
    ap.add_argument("--marker", default="HMMA", help="opcode whose executions are counted per class (default HMMA)")
    ap.add_argument("--runs", type=int, default=5, help="stretches of lines B runs more often to list (default 5)")
    args = ap.parse_args()
    ra, rb = read_rows(args.a), read_rows(args.b)
    if len(ra) != len(rb):
        sys.exit(f"sass_diff: {len(ra)} vs {len(rb)} SASS lines: not the same kernel binary")
    ops_a = [opcode(r.get("Source", "")) for r in ra]
    ops_b = [opcode(r.get("Source", "")) for r in rb]
    if ops_a != ops_b:
        first = next(i for i in range(len(ops_a)) if ops_a[i] != ops_b[i])
        sys.exit(f"sass_diff: the opcodes differ from line {first} on: not the same kernel binary")
    xa = [num(r.get("Instructions Executed")) for r in ra]
    xb = [num(r.get("Instructions Executed")) for r in rb]
    ta, tb = sum(xa), sum(xb)
    print(f"warp instructions executed: A {ta:,}, B {tb:,} ({100 * (tb / ta - 1) if ta else 0:+.1f}%)")
    classes = collections.OrderedDict(
        (k, [0, 0, 0]) for k in ("only B runs", "B runs less often", "B runs more often", "equal", "only A runs"))
    marker = collections.Counter()
    for i in range(len(xa)):
        a, b = xa[i], xb[i]
        if a == 0 and b == 0:
            continue
        k = ("only B runs" if a == 0 else "only A runs" if b == 0 else "B runs less often" if b < a
             else "B runs more often" if b > a else "equal")
        c = classes[k]
        c[0] += a
        c[1] += b
        c[2] += 1
        if ops_a[i].split(".")[0] == args.marker:
            marker[(a, b)] += 1
    print(f"{'lines':>20s} {'count':>6s} {'A':>14s} {'B':>14s} {'B - A':>14s}")
    for k, (a, b, n) in classes.items():
        if n:
            print(f"{k:>20s} {n:6d} {a:14,} {b:14,} {b - a:+14,}")
    if marker:
        print(f"{args.marker} lines by executions (A, B): " +
              ", ".join(f"{n} lines x ({a:,}, {b:,})" for (a, b), n in sorted(marker.items())))
    runs, cur = [], None
    for i in range(len(xa)):
        if xa[i] > 0 and xb[i] > xa[i]:
            if cur is None:
                cur = [i, i, 0, 0, 0]
            cur[1] = i
            cur[2] += xb[i] - xa[i]
            cur[3] += xa[i]
            cur[4] += xb[i]
        elif cur is not None and i - cur[1] > 8:
            runs.append(cur)
            cur = None
    if cur is not None:
        runs.append(cur)
    runs.sort(key=lambda r: -r[2])
    for first, last, d, a, b in runs[:args.runs]:
        print(f"lines {first}-{last} (addresses {ra[first].get('Address', '?')}-{ra[last].get('Address', '?')}): "
              f"B - A {d:+,} (A {a:,}, B {b:,}, x{b / a:.2f})")


if __name__ == "__main__":
    main()
