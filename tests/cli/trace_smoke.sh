#!/usr/bin/env bash
# CLI test of `thinkv trace` on the real stories260K model: the trace file has the documented
# format (docs/calibration.md: the header lines, `prompt,step,l0..l{N-1}`, one row per prompt and
# step with steps 0..N-1, values in [0,1], no NaN/Inf) with the model's layer count, the layers
# carry a signal (not all zero), `-o -` writes the same trace to stdout; `thinkv calibrate` reads
# it and fails for lack of modes with the documented message and exit 1, writing nothing; with
# explicit thresholds it calibrates and `thinkv generate --calibration` refreshes the thought
# classifier from the decoder's sparsity; on the reasoning testbed (models/) calibration succeeds
# with two types and drives the run; bad flags exit 2, a missing model exits 1.
#   trace_smoke.sh THINKV MODELS_DIR
set -u
thinkv=$1 models=${THINKV_MODELS:-$2}
fail() { echo "FAIL: $*"; exit 1; }
if [ ! -f "$models/stories260K.bin" ] || [ ! -f "$models/tok512.bin" ]; then
  echo "SKIPPED: models not found in $models; get stories260K.bin and tok512.bin from"
  echo "karpathy/tinyllamas on the Hugging Face hub (see ../shared/models/SOURCES.md) or set THINKV_MODELS"
  exit 0
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/thinkv_trace_smoke.XXXXXX") || fail "mktemp failed"
trap 'rm -rf "$tmp"' EXIT
bin=$models/stories260K.bin
layers=5   # stories260K: dim 64, 5 layers, 8 heads (llama2.c's tinyllamas)
steps=300

# Three prompts: the fewest `thinkv calibrate` accepts by default (--min-prompts 3).
printf '%s\n' "# story openings" "Once upon a time, there was a little dog" "" \
  "Tom and his sister went to the park" "Lily wanted to bake a cake for her mom" >"$tmp/prompts.txt"
"$thinkv" trace --model "$bin" --prompts "$tmp/prompts.txt" --steps $steps -o "$tmp/trace.csv" \
  2>"$tmp/err.txt" || fail "trace exited $?: $(cat "$tmp/err.txt")"
[ -s "$tmp/trace.csv" ] || fail "trace.csv not written"
grep -q "3 prompts x $steps steps, $layers layers" "$tmp/err.txt" ||
  fail "the stderr summary does not report 3 prompts x $steps steps, $layers layers: $(cat "$tmp/err.txt")"

# The documented format, line by line (awk prints the first violation and exits 1).
awk -F, -v L=$layers -v N=$steps '
  function bad(msg) { print "line " NR ": " msg ": " $0; failed = 1; exit 1 }
  NR == 1 { if ($0 != "# thinkv-sparsity-trace v2") bad("first line is not the v2 magic"); next }
  /^# end: / { if (end) bad("a second end line"); end = $0; total = substr($0, 8) + 0; next }
  end { bad("a line after the end line") }
  /^# model: / { model = substr($0, 10); next }
  /^# num_layers: / { nl = substr($0, 15) + 0; next }
  /^#/ { next }
  !header {
    if (model != "stories260K") bad("no \"# model: stories260K\" before the column header")
    if (nl != L) bad("\"# num_layers:\" is " nl ", expected " L)
    want = "prompt,step"
    for (i = 0; i < L; ++i) want = want ",l" i
    if ($0 != want) bad("column header is not " want)
    header = 1; next
  }
  {
    if (NF != L + 2) bad("row has " NF " fields, expected " L + 2)
    if ($1 !~ /^p[012]$/) bad("prompt id " $1 " is not p0, p1 or p2")
    if ($2 !~ /^[0-9]+$/) bad("step " $2 " is not an integer >= 0")
    if ($2 + 0 != next_step[$1] + 0) bad("step " $2 " of " $1 ", expected " next_step[$1] + 0)
    next_step[$1] = $2 + 1; rows[$1]++
    for (i = 3; i <= NF; ++i) {
      if ($i !~ /^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$/) bad("value " $i " is not a number")
      if ($i + 0 < 0 || $i + 0 > 1) bad("value " $i " is outside [0,1]")
      if ($i + 0 > 0) nonzero[i - 3] = 1
    }
  }
  END {
    if (failed) exit 1
    if (!header) { print "no column header line"; exit 1 }
    if (end != "# end: " 3 * N " rows") { print "the last line is not \"# end: " 3 * N " rows\": " end; exit 1 }
    for (p = 0; p < 3; ++p) if (rows["p" p] != N) { print "prompt p" p " has " rows["p" p] + 0 " rows, expected " N; exit 1 }
    for (l = 0; l < L; ++l) if (!nonzero[l]) { print "layer " l " is 0 on every step: no sparsity recorded"; exit 1 }
  }' "$tmp/trace.csv" >"$tmp/awk.txt" || fail "trace.csv: $(cat "$tmp/awk.txt")"
if grep -qiE 'nan|inf' "$tmp/trace.csv"; then fail "trace.csv holds NaN or Inf"; fi

# -o - writes the same trace to stdout (greedy decoding is deterministic).
"$thinkv" trace --model "$bin" --prompts "$tmp/prompts.txt" --steps $steps -o - --quiet \
  >"$tmp/stdout.csv" 2>"$tmp/err.txt" || fail "trace -o - exited $?: $(cat "$tmp/err.txt")"
cmp -s "$tmp/trace.csv" "$tmp/stdout.csv" || fail "trace -o - differs from the file"

# `thinkv calibrate` reads it. stories260K's per-prompt densities are unimodal (docs/results.md):
# the documented failure (exit 1, "no layer shows 3 modes", no file written), never a success.
"$thinkv" calibrate "$tmp/trace.csv" -o "$tmp/calib.json" 2>"$tmp/cal.txt"
rc=$?
[ $rc -eq 1 ] || fail "calibrate on stories260K exited $rc, expected 1 (too few modes): $(cat "$tmp/cal.txt")"
grep -q "no layer shows 3 modes" "$tmp/cal.txt" ||
  fail "calibrate exited 1 without the documented 'no layer shows 3 modes' message: $(cat "$tmp/cal.txt")"
{ grep -q "stories260K" "$tmp/cal.txt" && grep -q "3 prompts" "$tmp/cal.txt" &&
  grep -q "$((3 * steps)) steps" "$tmp/cal.txt"; } ||
  fail "calibrate did not read the whole trace (3 prompts, $((3 * steps)) steps): $(cat "$tmp/cal.txt")"
[ ! -e "$tmp/calib.json" ] || fail "a failed calibration wrote calib.json"

# With explicit thresholds (the documented fallback) it calibrates, and generate uses the file:
# the classifier refreshes every tau steps from the decoder's per-layer sparsity.
"$thinkv" calibrate "$tmp/trace.csv" -o "$tmp/user.json" --thresholds 0.7,0.9 --tau 16 \
  2>"$tmp/cal.txt" || fail "calibrate --thresholds exited $?: $(cat "$tmp/cal.txt")"
tr -d ' \n' <"$tmp/user.json" | grep -q '"thresholds":\[0.7,0.9\]' ||
  fail "user.json lacks the given thresholds: $(cat "$tmp/user.json")"
out=$("$thinkv" generate --model "$bin" --steps 100 --calibration "$tmp/user.json" --json \
      2>"$tmp/err.txt") || fail "generate --calibration exited $?: $(cat "$tmp/err.txt")"
last=$(printf '%s\n' "$out" | tail -n 1)
case "$last" in *'"calibrated":true'*'"tau":16'* | *'"tau":16'*'"calibrated":true'*) ;;
  *) fail "generate --calibration: JSON lacks \"calibrated\":true and \"tau\":16: $last" ;; esac
refreshes=$(printf '%s\n' "$last" | sed -n 's/.*"refreshes":\([0-9]*\).*/\1/p')
# Refresh steps are the positions 16, 32, ..., 96 of 100: six.
[ "$refreshes" = 6 ] || fail "generate --calibration (tau 16, 100 steps): refreshes $refreshes, expected 6"

# The reasoning testbed (models/, committed): its layer 2 is bimodal on every prompt, so a trace
# of 4 training-distribution prompts (until EOS) calibrates two types on layer 2 (E < T), three
# types fail naming layer 2's 2 modes, and a tbq run with the two-type file stores E and T tokens
# (its refreshes reach both bands). Fails if calibration, the trace or the run-time refresh breaks.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tb=$repo/models/testbed.bin
if [ -f "$tb" ]; then
  "$thinkv" trace --model "$tb" --problems "$repo/models/testbed-calib-prompts.jsonl" --limit 4 \
    -o "$tmp/tb.csv" --quiet 2>"$tmp/err.txt" || fail "trace of the testbed exited $?: $(cat "$tmp/err.txt")"
  "$thinkv" calibrate "$tmp/tb.csv" -o "$tmp/tb3.json" 2>"$tmp/cal.txt"
  [ $? -eq 1 ] || fail "calibrate (3 types) on the testbed did not exit 1: $(cat "$tmp/cal.txt")"
  grep -q "layer 2: 2 modes on 4/4 prompts" "$tmp/cal.txt" ||
    fail "calibrate (3 types) on the testbed does not report layer 2 bimodal on 4/4: $(cat "$tmp/cal.txt")"
  "$thinkv" calibrate "$tmp/tb.csv" -o "$tmp/tb2.json" --types 2 2>"$tmp/cal.txt" ||
    fail "calibrate --types 2 on the testbed exited $?: $(cat "$tmp/cal.txt")"
  flat=$(tr -d ' \n' <"$tmp/tb2.json")
  case "$flat" in *'"layers":[2],'*'"num_types":2,"band_types":["E","T"]'*) ;;
    *) fail "testbed two-type calibration is not L*={2}, bands E,T: $flat" ;; esac
  th=$(printf '%s' "$flat" | sed -n 's/.*"thresholds":\[\([0-9.]*\)\].*/\1/p')
  awk -v t="$th" 'BEGIN { exit !(t > 0.25 && t < 0.6) }' ||
    fail "testbed two-type threshold $th is outside (0.25, 0.6), between layer 2's modes near 0.19 and 0.67"
  out=$("$thinkv" generate --model "$tb" --problems "$repo/models/eval_public.jsonl" --problem 0 \
        --mode tbq --calibration "$tmp/tb2.json" --steps 600 --json 2>"$tmp/err.txt") ||
    fail "generate --calibration (testbed) exited $?: $(cat "$tmp/err.txt")"
  last=$(printf '%s\n' "$out" | tail -n 1)
  e=$(printf '%s' "$last" | sed -n 's/.*"thought_tokens":{"R":[0-9]*,"E":\([0-9]*\),"T":[0-9]*}.*/\1/p')
  t=$(printf '%s' "$last" | sed -n 's/.*"thought_tokens":{"R":[0-9]*,"E":[0-9]*,"T":\([0-9]*\)}.*/\1/p')
  { [ -n "$e" ] && [ -n "$t" ] && [ "$e" -gt 0 ] && [ "$t" -gt 0 ]; } ||
    fail "tbq with the testbed calibration decoded E=$e T=$t tokens, expected both > 0: $last"
else
  echo "note: $tb not found: the testbed part is skipped"
fi

# Bad flags exit 2; a missing model exits 1 saying where to get it.
"$thinkv" trace --model "$bin" --steps 0 -o "$tmp/x.csv" >/dev/null 2>"$tmp/err.txt"
[ $? -eq 2 ] || fail "trace --steps 0 did not exit 2"
grep -q -- "--steps" "$tmp/err.txt" || fail "trace --steps 0: message does not name the flag"
"$thinkv" trace --model "$bin" --steps 10 >/dev/null 2>"$tmp/err.txt"
[ $? -eq 2 ] || fail "trace without -o did not exit 2"
"$thinkv" trace --model "$bin" --steps 600 -o "$tmp/x.csv" >/dev/null 2>"$tmp/err.txt"
[ $? -eq 2 ] || fail "trace beyond the 512-token context did not exit 2: $(cat "$tmp/err.txt")"
"$thinkv" trace --model does-not-exist.bin --steps 4 -o "$tmp/x.csv" >/dev/null 2>"$tmp/err.txt"
[ $? -eq 1 ] || fail "trace with a missing model did not exit 1"
grep -q "tinyllamas" "$tmp/err.txt" || fail "trace with a missing model does not say where to get it"
echo "1 passed, 0 failed"
