#!/usr/bin/env python3
"""Time decode attention at forced split counts against the split plan's choice, and fit the plan.

The decode-attention launch cuts each KV head's cache into chunks (split-K); the number comes
from plan_decode_splits_for_length (include/thinkv/kernels/launch_plan.hpp), a cost model of
waves x (CTA start-up + chunk length). This tool measures how much that choice leaves on the
table and which model parameters would have chosen better.

Run (on a machine with an NVIDIA GPU, from the repository root):
  python3 bench/tools/split_sweep.py --bench build/bench/bench_paged_attention --out split-sweep \
      [--splits 1,2,3,4,6,8] [--filter REGEX]
runs bench_paged_attention once with the plan's choice (split-sweep/auto.json) and once per forced
count (THINKV_BENCH_SPLITS=N: split-sweep/splits_N.json), then reports. Report only:
  python3 bench/tools/split_sweep.py --report split-sweep [--sms 132 --ctas-per-sm 3] [--fit]
Self-check (a ctest, tools.split_sweep_model): the model with the plan's constants chooses what
the C++ plan chooses over a grid of launches:
  python3 bench/tools/split_sweep.py --check-plan build/tests/tools/plan_splits_dump

The report lists, per benchmark row (median times): the plan's split count and time, the best
measured count and time, and what the plan loses. --fit evaluates the plan's model over a grid of
its parameters on the same rows: the CTA start-up (kSplitStartupHalfPieces, in half-pieces of 128
positions), the merge kernel's cost (kSplitMergeHalfPieces) and a latency floor c0 for a partly
filled wave: an SM holding r < ctas-per-sm CTAs of the last wave finishes them in max(r, c0) /
ctas-per-sm of a full wave's time (c0 = ctas-per-sm is the plan's model, whole waves; c0 = 1 is
time proportional to the CTAs an SM holds). For each parameter set the model picks a split count
per row among the measured ones; its regret is the time lost against each row's best, summed.
--sms and --ctas-per-sm describe the device and the main pass (132 SMs and 3 CTAs per SM for the
head_dim 128 tensor-core pass on an NVIDIA H100 or H200).
"""

import argparse
import glob
import gzip
import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpp_constant(rel_path, name):
    """An integer constant of the C++ sources (the plan's own values, not copies of them)."""
    path = os.path.join(ROOT, rel_path)
    with open(path) as f:
        m = re.search(r"constexpr\s+(?:long\s+long|int)\s+" + name + r"\s*=\s*(\d+)\s*;", f.read())
    if not m:
        sys.exit(f"split_sweep: no integer constant {name} in {path}")
    return int(m.group(1))


PIECE = cpp_constant("kernels/paged_attention_common.cuh", "kTcChunkPiece")  # positions of one chunk piece
STARTUP = cpp_constant("include/thinkv/kernels/launch_plan.hpp", "kSplitStartupHalfPieces")
MERGE = cpp_constant("include/thinkv/kernels/launch_plan.hpp", "kSplitMergeHalfPieces")


def run_bench(bench, out, splits, bfilter):
    os.makedirs(out, exist_ok=True)
    runs = [("auto", None)] + [(f"splits_{s}", s) for s in splits]
    for name, s in runs:
        env = dict(os.environ)
        env.pop("THINKV_BENCH_SPLITS", None)
        if s is not None:
            env["THINKV_BENCH_SPLITS"] = str(s)
        cmd = [bench, f"--benchmark_out={os.path.join(out, name + '.json')}", "--benchmark_out_format=json"]
        if bfilter:
            cmd.append(f"--benchmark_filter={bfilter}")
        print("split_sweep:", " ".join(cmd), f"(THINKV_BENCH_SPLITS={s})" if s else "(the plan)", flush=True)
        r = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
        if r.returncode != 0:
            sys.exit(f"split_sweep: {bench} exited {r.returncode} ({name})")


def load(path):
    """{row name: (median real time in us, counters)} of one Google Benchmark JSON file (.json or .json.gz)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        data = json.load(f)
    rows = {}
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
    for b in data.get("benchmarks", []):
        if b.get("aggregate_name") != "median" or b.get("error_occurred"):
            continue
        name = re.sub(r"/iterations:\d+|/repeats:\d+|/manual_time|_median$", "", b["run_name"])
        rows[name] = (b["real_time"] * scale[b.get("time_unit", "ns")], b)
    return rows


def collect(d):
    auto_path = os.path.join(d, "auto.json")
    if not os.path.exists(auto_path) and os.path.exists(auto_path + ".gz"):
        auto_path += ".gz"
    if not os.path.exists(auto_path):
        sys.exit(f"split_sweep: no {auto_path} (run with --bench first)")
    auto = load(auto_path)
    forced = {}
    for p in glob.glob(os.path.join(d, "splits_*.json")) + glob.glob(os.path.join(d, "splits_*.json.gz")):
        m = re.search(r"splits_(\d+)\.json(\.gz)?$", p)
        if m:
            forced[int(m.group(1))] = load(p)
    if not forced:
        sys.exit(f"split_sweep: no splits_N.json in {d}")
    rows = []
    for name, (t_auto, b) in sorted(auto.items()):
        if "splits" not in b:
            continue
        times = {s: f[name][0] for s, f in forced.items() if name in f}
        plan = int(b["splits"])
        times.setdefault(plan, t_auto)
        rows.append({"name": name, "plan": plan, "t_plan": t_auto, "times": times,
                     "kv_heads": int(b.get("kv_heads", 0)), "positions": int(b.get("positions", 0))})
    return rows


def report(rows):
    print(f"{'benchmark':64s} {'plan':>4s} {'plan us':>9s} {'best':>4s} {'best us':>9s} {'lost':>6s}  times by split")
    lost_total = best_total = 0.0
    worst = None
    for r in rows:
        best = min(r["times"], key=lambda s: (r["times"][s], s))
        tb = r["times"][best]
        loss = r["t_plan"] / tb - 1.0
        lost_total += r["t_plan"] - tb
        best_total += tb
        if worst is None or loss > worst[0]:
            worst = (loss, r["name"])
        ts = " ".join(f"{s}:{r['times'][s]:.0f}" for s in sorted(r["times"]))
        print(f"{r['name']:64s} {r['plan']:4d} {r['t_plan']:9.1f} {best:4d} {tb:9.1f} {100 * loss:5.1f}%  {ts}")
    if rows:
        print(f"the plan's choices cost {100 * lost_total / best_total:.2f}% over the best measured, in total;"
              f" worst {100 * worst[0]:.1f}% ({worst[1]})")


def model_cost(s, hkv, pieces, sms, k, startup, merge, c0):
    """Cost of s chunks per KV head in half-pieces, with a latency floor c0 for a partial wave."""
    per_sm = -(-hkv * s // sms)  # CTAs on the busiest SM
    full, rest = divmod(per_sm, k)
    waves = full + (max(rest, c0) / k if rest else 0.0)
    return waves * (startup + 2 * -(-pieces // s)) + (merge if s > 1 else 0)


def model_plan(hkv, positions, sms, k, startup, merge, c0, cands):
    """The model's split count among cands for hkv KV heads of `positions` slot positions: the
    fewest chunks within 1/32 of the least cost (plan_decode_splits_for_length's rule); None when
    no candidate is <= the pieces."""
    pieces = max(1, -(-positions // PIECE))
    cands = sorted(s for s in cands if s <= pieces)
    if not cands:
        return None
    costs = {s: model_cost(s, hkv, pieces, sms, k, startup, merge, c0) for s in cands}
    best = min(costs.values())
    return next(s for s in cands if 32 * costs[s] <= 33 * best)  # near-ties go to fewer chunks


def model_choice(r, sms, k, startup, merge, c0):
    return model_plan(r["kv_heads"], r["positions"], sms, k, startup, merge, c0, r["times"])


def check_plan(exe):
    """The model with the plan's constants and whole waves (c0 = ctas per SM) against the C++
    plan over tests/tools/plan_splits_dump.cpp's grid; returns the number of disagreements."""
    r = subprocess.run([exe, str(PIECE)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"split_sweep: {exe} {PIECE} exited {r.returncode}: {r.stderr.strip()}")
    lines = r.stdout.splitlines()
    if not lines or not lines[0].startswith("constants "):
        sys.exit(f"split_sweep: {exe}: no 'constants' line first")
    startup, merge_const = (int(x) for x in lines[0].split()[1:3])
    if (startup, merge_const) != (STARTUP, MERGE):
        print(f"split_sweep: the C++ plan has start-up {startup}, merge {merge_const}; this tool read "
              f"{STARTUP}, {MERGE} from launch_plan.hpp")
        return 1
    bad = n = 0
    for line in lines[1:]:
        sms, k, smax, hkv, positions, merge, s_cpp = (int(x) for x in line.split())
        s_py = model_plan(hkv, positions, sms, k, STARTUP, merge, k, range(1, smax + 1))
        n += 1
        if s_py != s_cpp:
            bad += 1
            if bad <= 10:
                print(f"split_sweep: {sms} SMs x {k}, max {smax}, {hkv} KV heads, {positions} positions, "
                      f"merge {merge}: C++ plan {s_cpp}, model {s_py}")
    print(f"split_sweep: the model (start-up {STARTUP}, merge {MERGE}, piece {PIECE}) agrees with the C++ "
          f"plan on {n - bad} of {n} launches")
    return bad


def fit(rows, sms, k):
    rows = [r for r in rows if r["kv_heads"] > 0 and r["positions"] > 0]
    if not rows:
        print("fit: no row carries kv_heads and positions (a bench_paged_attention built before those counters)")
        return
    results = []
    for startup in range(0, max(25, 2 * STARTUP + 1)):
        for merge in range(0, max(9, 2 * MERGE + 1)):
            for c0 in range(1, k + 1):
                lost = total = 0.0
                for r in rows:
                    s = model_choice(r, sms, k, startup, merge, c0)
                    if s is None:
                        continue
                    tb = min(r["times"].values())
                    lost += r["times"][s] - tb
                    total += tb
                results.append((lost / total if total else 0.0, startup, merge, c0))
    # Equal regret: the parameter set nearest the plan's own comes first.
    results.sort(key=lambda x: (round(x[0], 6), abs(x[1] - STARTUP) + abs(x[2] - MERGE) + abs(x[3] - k)))
    cur = next(x for x in results if x[1:] == (STARTUP, MERGE, k))
    print(f"fit over {len(rows)} rows ({sms} SMs x {k} CTAs): time lost against the best measured split")
    print(f"  the plan's model (start-up {STARTUP}, merge {MERGE}, whole waves c0 = {k}): {100 * cur[0]:.2f}%")
    for lost, startup, merge, c0 in results[:8]:
        print(f"  start-up {startup:2d}  merge {merge}  c0 {c0}: {100 * lost:.2f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", help="bench_paged_attention to run (then --out is required)")
    ap.add_argument("--out", help="directory for auto.json and splits_N.json")
    ap.add_argument("--splits", default="1,2,3,4,6,8", help="forced split counts (default 1,2,3,4,6,8)")
    ap.add_argument("--filter", default="", help="--benchmark_filter for every run (default: all rows)")
    ap.add_argument("--report", help="report on an existing directory")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--ctas-per-sm", type=int, default=3)
    ap.add_argument("--fit", action="store_true", help="also fit the plan's model parameters")
    ap.add_argument("--check-plan", metavar="EXE",
                    help="only check the model against the C++ plan (tests/tools/plan_splits_dump.cpp's executable)")
    a = ap.parse_args()
    if a.check_plan:
        sys.exit(1 if check_plan(a.check_plan) else 0)
    try:
        splits = sorted({int(x) for x in a.splits.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--splits {a.splits!r}: expected comma-separated integers")
    if not splits or splits[0] < 1:
        ap.error(f"--splits {a.splits!r}: every count must be >= 1")
    if a.sms < 1 or a.ctas_per_sm < 1:
        ap.error(f"--sms {a.sms} / --ctas-per-sm {a.ctas_per_sm}: both must be >= 1")
    d = a.report
    if a.bench:
        if not a.out:
            ap.error("--bench needs --out DIR")
        run_bench(a.bench, a.out, splits, a.filter)
        d = a.out
    if not d:
        ap.error("give --bench with --out, or --report DIR")
    rows = collect(d)
    report(rows)
    if a.fit:
        fit(rows, a.sms, a.ctas_per_sm)


if __name__ == "__main__":
    main()
