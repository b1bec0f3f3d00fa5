#!/usr/bin/env python3
"""Instructions per token-head of the decode-attention main pass, per precision, from Nsight Compute.

For each precision mode of bench_paged_attention (BF16, FP8 = R8E8T8, NVFP4 = R4E4T4, ternary =
R2E2T2, R4E4T2) and each eviction share, runs one benchmark configuration under

  ncu --clock-control none -k regex:paged_decode_partial --launch-count 1 --metrics ...

(the configuration's first launch of the main pass), and reports the warp instructions it
executed, per live token-head (live tokens per stream x KV heads; a token-head is one token of one
KV head's stream, read once for the whole GQA group), per 16-token window (16 token-heads), the
issue rate (instructions per active scheduler cycle) and the kernel's duration under the profiler.
The merge kernel, when a launch has one, is not counted (a few hundred instructions per query
head, against millions in the main pass).

  python3 bench/tools/ncu_instructions.py --bench build-bench/bench/bench_paged_attention \\
      --tokens 4096 --batch 64 --json instructions.json > instructions.md

--stalls also asks for every warp-stall reason of the WarpStateStats section (the metrics
smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio: warps stalled for that reason per
cycle in which the scheduler issued) and prints them in a second table, the reasons that weigh most
over all rows first; --modes picks precision modes (0-4, default all), e.g. to set the per-block
R4E4T2 mix (4) beside NVFP4 (2) and ternary (3) at 50% evicted:

  python3 bench/tools/ncu_instructions.py --bench ... --modes 2 3 4 --evict 50 --stalls

Needs a GPU, Nsight Compute (ncu, or --ncu PATH) and the Release benchmark build. Exit status 1
when a configuration could not be profiled (its row says why).
"""
import argparse
import csv
import io
import json
import shutil
import subprocess
import sys

MODES = ["BF16", "R8E8T8 (FP8)", "R4E4T4 (NVFP4)", "R2E2T2 (ternary)", "R4E4T2"]
KV_HEADS_PER_SEQ = 8  # bench_paged_attention's shape: Llama-3-8B attention, 8 KV heads per sequence
METRICS = [
    "smsp__inst_executed.sum",
    "smsp__issue_active.avg.per_cycle_active",
    "gpu__time_duration.sum",
    "launch__grid_size",
    "launch__registers_per_thread",
]
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
STALL_METRICS = "regex:" + STALL_PREFIX + ".*" + STALL_SUFFIX.replace(".", "\\.")


def profile(ncu, bench, tokens, batch, mode, evict, timeout, stalls=False):
    flt = f"^BM_PagedDecodeAttention/tokens:{tokens}/batch:{batch}/mode:{mode}/evict:{evict}/"
    metrics = METRICS + ([STALL_METRICS] if stalls else [])
    cmd = [ncu, "--clock-control", "none", "--csv", "--metrics", ",".join(metrics), "-k",
           "regex:paged_decode_partial", "--launch-count", "1", bench, f"--benchmark_filter={flt}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith('"')]
    if r.returncode != 0 or len(rows) < 2:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return None, f"ncu exit {r.returncode}: " + " | ".join(tail)
    vals = {}
    for rec in csv.DictReader(io.StringIO("\n".join(rows))):
        name, value = rec.get("Metric Name"), rec.get("Metric Value", "")
        if name:
            vals[name] = (value.replace(",", ""), rec.get("Metric Unit", ""))
    missing = [m for m in METRICS if m not in vals]
    if missing:
        return None, "metrics missing: " + ", ".join(missing)
    return vals, ""


def print_stalls(rows, top=10):
    """The stall reasons of every profiled row, the heaviest over all rows first."""
    if not rows:
        return
    total = {}
    for r in rows:
        for k, v in r.get("stalls", {}).items():
            total[k] = total.get(k, 0.0) + v
    if not total:
        print("\nNo warp-stall metric came back (ncu matched none of " + STALL_METRICS + ").")
        return
    keys = sorted(total, key=lambda k: -total[k])[:top]
    print("\nWarps stalled per issue-active cycle, by reason (Nsight Compute WarpStateStats; the "
          f"{len(keys)} heaviest of {len(total)} reasons):\n")
    print("| precision | evicted | " + " | ".join(keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for r in rows:
        st = r.get("stalls", {})
        print(f"| {r['precision']} | {r['evict_pct']}% | " + " | ".join(f"{st.get(k, 0.0):.2f}" for k in keys) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="path of the bench_paged_attention executable")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--tokens", type=int, default=4096, help="live tokens per stream (512, 4096, 32768)")
    ap.add_argument("--batch", type=int, default=64, help="sequences (1, 8, 32, 64, 256)")
    ap.add_argument("--evict", type=int, nargs="+", default=[0, 50], help="evicted shares (0, 50)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    ap.add_argument("--modes", type=int, nargs="+", default=list(range(len(MODES))),
                    help="precision modes: 0 BF16, 1 FP8, 2 NVFP4, 3 ternary, 4 R4E4T2 per block (default all)")
    ap.add_argument("--stalls", action="store_true", help="also report the warp-stall reasons")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    bad = [m for m in a.modes if not 0 <= m < len(MODES)]
    if bad:
        ap.error(f"--modes {bad}: each must be 0..{len(MODES) - 1}")

    token_heads = a.tokens * a.batch * KV_HEADS_PER_SEQ
    print(f"Main pass, {a.tokens} live tokens x batch {a.batch} ({token_heads:,} token-heads), "
          f"Nsight Compute `--clock-control none`, first launch of each configuration:\n")
    print("| precision | evicted | warp instructions | per token-head | per 16-token window | "
          "issue rate (per active scheduler cycle) | registers | CTAs | µs under ncu |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    out, failed = [], 0
    for ev in a.evict:
        for mode in a.modes:
            name = MODES[mode]
            vals, why = profile(a.ncu, a.bench, a.tokens, a.batch, mode, ev, a.timeout, a.stalls)
            if vals is None:
                failed += 1
                print(f"| {name} | {ev}% | not profiled: {why} | | | | | | |")
                continue
            inst = float(vals["smsp__inst_executed.sum"][0])
            ipc = float(vals["smsp__issue_active.avg.per_cycle_active"][0])
            t, unit = vals["gpu__time_duration.sum"]
            us = float(t) / {"nsecond": 1e3, "usecond": 1.0, "msecond": 1e-3}.get(unit, 1e3)
            regs = int(float(vals["launch__registers_per_thread"][0]))
            grid = int(float(vals["launch__grid_size"][0]))
            row = {"precision": name, "evict_pct": ev, "tokens": a.tokens, "batch": a.batch,
                   "warp_instructions": inst, "per_token_head": inst / token_heads,
                   "per_window": 16 * inst / token_heads, "issue_per_active_cycle": ipc,
                   "registers": regs, "ctas": grid, "us_under_ncu": us}
            if a.stalls:
                row["stalls"] = {k[len(STALL_PREFIX):-len(STALL_SUFFIX)]: float(v[0])
                                 for k, v in vals.items()
                                 if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)}
            out.append(row)
            print(f"| {name} | {ev}% | {inst:,.0f} | {row['per_token_head']:.1f} | {row['per_window']:.0f} | "
                  f"{ipc:.2f} | {regs} | {grid} | {us:.1f} |", flush=True)
    if a.stalls:
        print_stalls(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
