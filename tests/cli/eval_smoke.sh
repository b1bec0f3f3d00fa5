#!/usr/bin/env bash
# CLI test of `thinkv eval`, `thinkv trace --problems` and `thinkv thoughts` on the reasoning
# testbed model the repository ships (models/): a small sweep writes its console table, JSON,
# Markdown, SVG and generations with the documented fields; bad input gets a clear error naming
# the file and line, exit 1 (data) or 2 (usage), and writes nothing; trace + thoughts read each
# other's files.
#   eval_smoke.sh THINKV REPO_ROOT
set -u
thinkv=$1 repo=$2
models=$repo/models
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/thinkv_eval_smoke.XXXXXX") || fail "mktemp failed"
trap 'rm -rf "$tmp"' EXIT
model=$models/testbed.bin
problems=$models/eval_public.jsonl

# ---- a small sweep: 2 problems, FullKV + thinkv + h2o at one budget, capped length -------------
"$thinkv" eval --model "$model" --problems "$problems" --limit 2 --methods full,thinkv,h2o,kivi2 --budgets 128 \
  --max-steps 300 --calibration "$models/testbed-calib.json" --labels "$models/testbed-labels.txt" --kl --jobs 2 \
  --json "$tmp/e.json" --md "$tmp/e.md" --svg "$tmp/e.svg" --generations "$tmp/g.jsonl" --no-progress \
  >"$tmp/out.txt" 2>"$tmp/err.txt" || fail "eval exited $?: $(cat "$tmp/err.txt")"
for f in e.json e.md e.svg g.jsonl; do [ -s "$tmp/$f" ] || fail "$f not written"; done
for m in full thinkv h2o kivi2; do grep -q "^$m " "$tmp/out.txt" || fail "console table lacks $m: $(cat "$tmp/out.txt")"; done
for k in '"configs"' '"accuracy"' '"held_ratio"' '"allocated_ratio"' '"peak_held_ratio"' '"generated_tokens_mean"' \
         '"eviction_calls_per_step"' '"token_agreement"' '"first_divergence_median"' '"mean_kl"' '"tokens_per_second"' \
         '"thought_tokens"' '"confusion_label_by_type"' '"runs"'; do
  grep -q "$k" "$tmp/e.json" || fail "eval JSON lacks $k"
done
grep -q '^| method | budget | accuracy' "$tmp/e.md" || fail "Markdown table header missing: $(head -3 "$tmp/e.md")"
grep -q '<svg' "$tmp/e.svg" || fail "the plot is not an SVG"
[ "$(wc -l <"$tmp/g.jsonl")" -eq 8 ] || fail "generations: expected 2 problems x 4 configurations = 8 lines"
grep -q 'thought types of thinkv/128' "$tmp/out.txt" || fail "no confusion matrix for thinkv with --labels"

# ---- bad input: a clear message naming the file and line; exit 1; nothing written --------------
expect_data_error() {  # WHAT PATTERN eval-args...
  local what=$1 pattern=$2
  shift 2
  rm -f "$tmp/bad.json"
  "$thinkv" eval --model "$model" --methods full --max-steps 20 --json "$tmp/bad.json" --no-progress "$@" \
    >"$tmp/o.txt" 2>"$tmp/e.txt"
  local rc=$?
  [ $rc -eq 1 ] || fail "$what: exit $rc, expected 1: $(cat "$tmp/e.txt")"
  grep -q -- "$pattern" "$tmp/e.txt" || fail "$what: message lacks '$pattern': $(cat "$tmp/e.txt")"
  [ ! -e "$tmp/bad.json" ] || fail "$what: the JSON was written anyway"
  if grep -q "Segmentation\|Aborted\|terminate" "$tmp/e.txt"; then fail "$what: crashed: $(cat "$tmp/e.txt")"; fi
}
head -n 2 "$problems" >"$tmp/two.jsonl"
{ head -n 1 "$problems"; echo '{"prompt": "Values: a=1.\n", "id": "no-answer"}'; } >"$tmp/missing.jsonl"
expect_data_error "missing answer" "missing.jsonl:2: field 'answer' is missing" --problems "$tmp/missing.jsonl"
{ head -n 1 "$problems"; echo '{"answer": "12"}'; } >"$tmp/noprompt.jsonl"
expect_data_error "missing prompt" "noprompt.jsonl:2: field 'prompt' is missing" --problems "$tmp/noprompt.jsonl"
{ head -n 1 "$problems"; echo '{"prompt": "x", "answer": '; } >"$tmp/badline.jsonl"
expect_data_error "a bad line" "badline.jsonl:2: not a JSON object" --problems "$tmp/badline.jsonl"
echo '[1, 2]' >"$tmp/array.jsonl"
expect_data_error "not an object" "array.jsonl:1: not a JSON object" --problems "$tmp/array.jsonl"
: >"$tmp/empty.jsonl"
expect_data_error "an empty file" "empty.jsonl: no problems" --problems "$tmp/empty.jsonl"
expect_data_error "a missing file" "nope.jsonl: cannot open" --problems "$tmp/nope.jsonl"
# The reference completions hold the answer, so a pattern that cannot find it is caught first.
expect_data_error "a pattern that never matches" "finds no answer in this problem's reference completion" \
  --problems "$tmp/two.jsonl" --answer-pattern 'Result=([0-9]+)'
# Without completions: the pattern must match some FullKV output.
printf '{"prompt": %s, "answer": "73"}\n' "$(head -n 1 "$problems" | sed 's/.*"prompt": \("[^"]*"\).*/\1/')" >"$tmp/nocomp.jsonl"
expect_data_error "a pattern that matches no output" "matched none of the 1 FullKV outputs that ended" \
  --problems "$tmp/nocomp.jsonl" --answer-pattern 'Result=([0-9]+)' --max-steps 1200
# A model/tokenizer mismatch: stories260K's tokenizer (512 tokens) for the testbed (128) is
# refused when loading; a tokenizer of the right size that cannot encode the prompt is caught.
printf '{"prompt": "caf\\u00e9\\t!", "answer": "1"}\n' >"$tmp/unicode.jsonl"
expect_data_error "a prompt the tokenizer cannot encode" "unicode.jsonl:1: the tokenizer of testbed" \
  --problems "$tmp/unicode.jsonl"
"$thinkv" eval --model "$model" --problems "$tmp/two.jsonl" --answer-pattern '(' >/dev/null 2>"$tmp/e.txt"
[ $? -eq 2 ] || fail "an invalid regex did not exit 2"
grep -q "not a valid regular expression" "$tmp/e.txt" || fail "invalid regex message: $(cat "$tmp/e.txt")"
"$thinkv" eval --model "$model" --problems "$tmp/two.jsonl" --methods full,warp >/dev/null 2>"$tmp/e.txt"
[ $? -eq 2 ] || fail "an unknown method did not exit 2"
grep -q "'warp' is not a method" "$tmp/e.txt" || fail "unknown method message: $(cat "$tmp/e.txt")"
printf 'R .*\nX ^Wait\n' >"$tmp/badrules.txt"
expect_data_error "a bad labels rule" "badrules.txt:2: expected 'R <regex>'" --problems "$tmp/two.jsonl" \
  --labels "$tmp/badrules.txt"
# An unwritable output: the run fails and says so.
"$thinkv" eval --model "$model" --problems "$tmp/two.jsonl" --limit 1 --methods full --max-steps 10 \
  --json "$tmp/no/such/dir/e.json" --no-progress >/dev/null 2>"$tmp/e.txt"
[ $? -eq 1 ] || fail "an unwritable --json did not exit 1"
grep -q "cannot write" "$tmp/e.txt" || fail "unwritable output message: $(cat "$tmp/e.txt")"

# ---- trace --problems --texts, then thoughts on them ---------------------------------------------
"$thinkv" trace --model "$model" --problems "$problems" --limit 3 --steps 500 -o "$tmp/t.csv" --texts "$tmp/t.jsonl" \
  2>"$tmp/err.txt" || fail "trace --problems exited $?: $(cat "$tmp/err.txt")"
grep -q "^1001-000,0," "$tmp/t.csv" || fail "trace rows are not named by the problems' ids"
[ "$(wc -l <"$tmp/t.jsonl")" -eq 3 ] || fail "trace --texts: expected 3 lines"
"$thinkv" thoughts "$tmp/t.csv" --texts "$tmp/t.jsonl" --labels "$models/testbed-labels.txt" \
  --calibration "$models/testbed-calib.json" --json "$tmp/th.json" >"$tmp/th.txt" 2>"$tmp/err.txt" ||
  fail "thoughts exited $?: $(cat "$tmp/err.txt")"
for k in 'labelled decode steps' '| layer |' 'agreement with the labels' 'label-informed classifier'; do
  grep -q "$k" "$tmp/th.txt" || fail "thoughts report lacks '$k': $(cat "$tmp/th.txt")"
done
"$thinkv" trace --model "$model" --problems "$problems" --limit 3 --steps 500 --mode thinkv --budget 128 \
  --calibration "$models/testbed-calib.json" -o "$tmp/t2.csv" --texts "$tmp/t2.jsonl" 2>"$tmp/err.txt" ||
  fail "trace --mode thinkv exited $?: $(cat "$tmp/err.txt")"
"$thinkv" thoughts "$tmp/t.csv" --texts "$tmp/t.jsonl" --labels "$models/testbed-labels.txt" \
  --calibration "$models/testbed-calib.json" --compare "$tmp/t2.csv" --compare-texts "$tmp/t2.jsonl" \
  >"$tmp/th2.txt" 2>"$tmp/err.txt" || fail "thoughts --compare exited $?: $(cat "$tmp/err.txt")"
grep -q "mean |difference| per layer" "$tmp/th2.txt" || fail "thoughts --compare: no difference report"

# ---- generate --problems: the answer line -------------------------------------------------------
"$thinkv" generate --model "$model" --problems "$problems" --problem 1001-000 --mode full --steps 1200 \
  >"$tmp/gen.txt" 2>"$tmp/err.txt" || fail "generate --problems exited $?: $(cat "$tmp/err.txt")"
grep -q "answer: 73, expected 73 (right)" "$tmp/err.txt" || fail "generate --problems: no answer line: $(cat "$tmp/err.txt")"
"$thinkv" generate --model "$model" --problems "$problems" --problem 999 >/dev/null 2>"$tmp/err.txt"
[ $? -eq 1 ] || fail "generate --problem 999 did not exit 1"
grep -q "no problem with index 999" "$tmp/err.txt" || fail "bad --problem message: $(cat "$tmp/err.txt")"
# ---- a model with a NaN weight: refused as a corrupt model before any token is printed ----------
cp "$model" "$tmp/nan.bin"
# testbed.bin: 28-byte header, the 128 x 192 token embedding, then layer 0's attention RMSNorm.
printf '\x00\x00\xc0\x7f' | dd of="$tmp/nan.bin" bs=1 seek=$((28 + 4 * 128 * 192 + 12)) conv=notrunc 2>/dev/null
"$thinkv" generate --model "$tmp/nan.bin" --tokenizer "$models/tok128.bin" -n 20 -p "Values: a=1." \
  >"$tmp/nan_out.txt" 2>"$tmp/nan_err.txt"
rc=$?
[ $rc -eq 1 ] || fail "a NaN weight: exit $rc, expected 1: $(cat "$tmp/nan_err.txt")"
grep -q "NaN or Inf weights" "$tmp/nan_err.txt" || fail "a NaN weight: the message does not blame the model: $(cat "$tmp/nan_err.txt")"
[ ! -s "$tmp/nan_out.txt" ] || fail "a NaN weight: tokens were printed before the error: $(head -c 100 "$tmp/nan_out.txt")"
# ---- short flags, --version, a directory as --model ---------------------------------------------
"$thinkv" --version | grep -q '^thinkv [0-9]' || fail "--version does not print the version"
"$thinkv" generate -m "$model" -p "Values: a=12, b=7." -n 8 -t 1 -s 3 -c 64 >/dev/null 2>"$tmp/err.txt" ||
  fail "short flags: exit $?: $(cat "$tmp/err.txt")"
"$thinkv" generate -m "$models" -n 4 >/dev/null 2>"$tmp/err.txt"
[ $? -eq 1 ] || fail "a directory as --model did not exit 1"
grep -q "is a directory" "$tmp/err.txt" || fail "a directory as --model: $(cat "$tmp/err.txt")"
echo "eval smoke: ok"
