#!/usr/bin/env python3
"""Summarize an Nsight Compute SASS source-counter export (CSV, optionally gzipped).

The CSV comes from
  ncu -k regex:KERNEL --launch-count 1 --section SourceCounters --section WarpStateStats \
      --page source --print-source sass --csv BENCHMARK ... > out.csv
(see docs/perf.md). Prints the warp instructions executed, the stall reasons' shares of the
samples, and the instructions grouped by execution count: SASS lines that run the same number of
times belong to the same loop level (once per window, once per tile, once per warp, ...), which
is how docs/perf.md splits a kernel's instruction budget. --opcodes COUNT lists the opcode mix of
the lines executed COUNT times.

  python3 bench/tools/sass_profile.py docs/perf-data/profiles/paged_attention_nvfp4_32k_b32_8ab7c89.csv.gz \
      --units 8388608 --opcodes 524288
"""
import argparse
import collections
import csv
import gzip
import sys


def read_rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        sys.exit(f"{path}: no SASS table (a line starting with \"Address\") found")
    return list(csv.DictReader(lines[start:]))


def num(text):
    text = (text or "").replace(",", "")
    return int(text) if text else 0


def opcode(source):
    parts = source.split()
    if not parts:
        return "?"
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --csv --page source --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--units", type=float, default=0.0,
                    help="divide the instruction total by this (e.g. token-heads) and print it")
    ap.add_argument("--top", type=int, default=12, help="execution-count classes to print")
    ap.add_argument("--opcodes", type=int, default=None, metavar="COUNT",
                    help="print the opcode mix of the SASS lines executed COUNT times")
    args = ap.parse_args()

    rows = read_rows(args.csv)
    executed = [num(r.get("Instructions Executed")) for r in rows]
    total = sum(executed)
    print(f"SASS lines {len(rows)}, warp instructions executed {total:,}")
    if args.units > 0:
        print(f"per unit: {total / args.units:.2f}")

    stall_keys = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    stalls = collections.Counter()
    for r in rows:
        for k in stall_keys:
            stalls[k] += num(r.get(k))
    samples = sum(stalls.values())
    if samples:
        print("stall samples: " + ", ".join(f"{k[6:]} {100 * v / samples:.1f}%" for k, v in stalls.most_common(8)))

    by_count = collections.Counter()
    lines_at = collections.Counter()
    samples_at = collections.Counter()
    for r, e in zip(rows, executed):
        by_count[e] += e
        lines_at[e] += 1
        samples_at[e] += num(r.get("Warp Stall Sampling (All Samples)"))
    all_samples = sum(samples_at.values()) or 1
    print(f"{'executed':>10} {'lines':>6} {'instructions':>14} {'share':>6} {'samples':>8}")
    for count, instr in sorted(by_count.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{count:>10} {lines_at[count]:>6} {instr:>14,} {100 * instr / max(total, 1):>5.1f}% "
              f"{100 * samples_at[count] / all_samples:>7.1f}%")

    if args.opcodes is not None:
        mix = collections.Counter()
        mix_samples = collections.Counter()
        for r, e in zip(rows, executed):
            if e == args.opcodes:
                op = opcode(r.get("Source", ""))
                mix[op] += 1
                mix_samples[op] += num(r.get("Warp Stall Sampling (All Samples)"))
        print(f"opcodes of the {sum(mix.values())} lines executed {args.opcodes} times:")
        for op, n in mix.most_common():
            print(f"  {op:28s} {n:5d}  samples {mix_samples[op]}")


if __name__ == "__main__":
    main()
