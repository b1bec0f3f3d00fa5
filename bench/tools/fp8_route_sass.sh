#!/usr/bin/env bash
# Counts the instructions of one loop iteration of bench/tools/fp8_route_probe.cu (the FP8
# tensor-core route's own work on one 16-token NVFP4 window, per lane), in both variants: two
# E4M3 terms per B element (hi + lo, ~2^-8 of Q and P kept) and one (E4M3 alone, 2^-4). With
# cuobjdump on PATH (or in $CUDA_HOME/bin) it counts SASS; without it, PTX (one PTX instruction
# per line; ptxas fuses shifts and logic into LOP3, so PTX overcounts the placement's logic).
#   bash bench/tools/fp8_route_sass.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CUOBJDUMP=$(command -v cuobjdump || echo "$(dirname "$NVCC")/cuobjdump")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for variant in two_terms one_term; do
  flags=()
  [[ $variant == one_term ]] && flags=(-DTHINKV_FP8_PROBE_ONE_TERM)
  if [[ -x $CUOBJDUMP ]]; then
    "$NVCC" -std=c++20 -arch=sm_90a -O3 -cubin "${flags[@]}" -o "$tmp/p.cubin" bench/tools/fp8_route_probe.cu
    "$CUOBJDUMP" -sass "$tmp/p.cubin" >"$tmp/p.sass"
    # The loop body: from the target of the last backward branch (the window loop) to it.
    python3 - "$tmp/p.sass" "$variant" <<'PY'
import collections, re, sys
ins = []
for line in open(sys.argv[1]):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2)))
at = {a: i for i, (a, _) in enumerate(ins)}
body = None
for i, (a, text) in enumerate(ins):
    t = re.search(r"BRA.*?0x([0-9a-f]+)", text)
    if t and int(t.group(1), 16) < a and int(t.group(1), 16) in at:
        body = ins[at[int(t.group(1), 16)]:i + 1]
if body is None:
    sys.exit("no backward branch found in the SASS")
ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in body)
print(f"{sys.argv[2]}: {len(body)} SASS instructions per window per lane")
for op, n in ops.most_common():
    print(f"  {op:32s} {n}")
PY
  else
    "$NVCC" -std=c++20 -arch=sm_90a -O3 -ptx "${flags[@]}" -o "$tmp/p.ptx" bench/tools/fp8_route_probe.cu
    python3 - "$tmp/p.ptx" "$variant" <<'PY'
import collections, re, sys
lines = open(sys.argv[1]).read().splitlines()
# The loop: the last label that a conditional branch below it jumps back to.
labels = {l.strip().rstrip(":"): i for i, l in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:", l)}
body = None
for i, l in enumerate(lines):
    m = re.search(r"@%p\d+\s+bra\s+(\$L__BB\d+_\d+);", l)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        body = lines[labels[m.group(1)] + 1:i + 1]
if body is None:
    sys.exit("no backward branch found in the PTX")
ops = collections.Counter()
for l in body:
    t = l.strip().lstrip("{").strip()
    if not t or t.startswith("//") or t.startswith(".reg") or t in ("}",) or t.startswith("$L"):
        continue
    if t.startswith("@"):
        t = t.split(None, 1)[1]
    ops[t.split()[0].split(".")[0]] += 1
print(f"{sys.argv[2]}: {sum(ops.values())} PTX instructions per window per lane (no cuobjdump: PTX, not SASS)")
for op, n in ops.most_common():
    print(f"  {op:10s} {n}")
PY
  fi
done
