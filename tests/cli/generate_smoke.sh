#!/usr/bin/env bash
# CLI test of `thinkv generate` on the real stories260K model: --json gives one JSON object as the
# last stdout line with the documented fields and sane values; bad flags exit 2, a missing model
# exits 1 with a message saying where to get it; truncated and corrupt copies of the real model
# files (header, mid-tensor, tokenizer, flipped magic) and a missing tokenizer exit 1 with a
# message naming the file, never a crash; the summary says "first divergence: none" when there
# is none; the --compare full phase shows a status line in a terminal.
#   generate_smoke.sh THINKV MODELS_DIR
set -u
thinkv=$1 models=${THINKV_MODELS:-$2}
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/thinkv_generate_smoke.XXXXXX") || fail "mktemp failed"
trap 'rm -rf "$tmp"' EXIT
if [ ! -f "$models/stories260K.bin" ]; then
  echo "SKIPPED: models not found in $models; get stories260K.bin and tok512.bin from"
  echo "karpathy/tinyllamas on the Hugging Face hub (see ../shared/models/SOURCES.md) or set THINKV_MODELS"
  exit 0
fi
out=$("$thinkv" generate --model "$models/stories260K.bin" --steps 64 --mode thinkv --budget 32 \
      --compare full --json 2>err.txt) || fail "generate exited $?: $(cat err.txt)"
last=$(printf '%s\n' "$out" | tail -n 1)
for f in '"mode":"thinkv"' '"kv_bytes":' '"fullkv_fp16_bytes":' '"gather_bytes":0' \
         '"eviction_calls_per_step":' '"token_agreement":' '"mean_kl":' '"first_divergence":'; do
  case "$last" in *"$f"*) ;; *) fail "JSON line lacks $f: $last" ;; esac
done
case "$out" in "Once upon a time"*) ;; *) fail "text does not start as llama2.c's: $out" ;; esac

"$thinkv" generate --model "$models/stories260K.bin" --steps 0 >/dev/null 2>err.txt
[ $? -eq 2 ] || fail "--steps 0 did not exit 2"
grep -q -- "--steps" err.txt || fail "--steps 0: message does not name the flag"
"$thinkv" generate --model "$models/stories260K.bin" --steps 4 --mode fast >/dev/null 2>err.txt
[ $? -eq 2 ] || fail "--mode fast did not exit 2"
"$thinkv" generate --model does-not-exist.bin --steps 4 >/dev/null 2>err.txt
[ $? -eq 1 ] || fail "a missing model did not exit 1"
grep -q "tinyllamas" err.txt || fail "a missing model does not say where to get it"
"$thinkv" generate --model "$models/stories260K.bin" --steps 4 --backend tpu >/dev/null 2>err.txt
[ $? -eq 2 ] || fail "--backend tpu did not exit 2"

# --backend cuda: the same text as the CPU backend on a GPU machine; elsewhere exit 1 with a
# message saying why (a CPU-only build, or no usable CUDA device).
cpu_text=$(printf '%s\n' "$out" | sed '$d')
"$thinkv" generate --model "$models/stories260K.bin" --steps 64 --mode thinkv --budget 32 \
    --backend cuda --json >cuda_out.txt 2>err.txt
rc=$?
if [ $rc -eq 0 ]; then
  [ "$(sed '$d' cuda_out.txt)" = "$cpu_text" ] || fail "--backend cuda decoded other text than cpu"
  grep -q '"backend":"cuda"' cuda_out.txt || fail "--backend cuda: JSON lacks \"backend\":\"cuda\""
else
  [ $rc -eq 1 ] || fail "--backend cuda exited $rc (expected 0, or 1 without a GPU)"
  grep -qE "built without CUDA kernels|no usable CUDA device" err.txt ||
    fail "--backend cuda failed without saying why: $(cat err.txt)"
  echo "note: --backend cuda not run here: $(grep -oE 'built without CUDA kernels|no usable CUDA device' err.txt | head -1)"
fi

# ---- bad model files: truncated or corrupt copies of the real models ---------------------------
# expect_refused WHAT MODEL BAD [generate args...]: `generate --model MODEL` exits 1 (not a
# crash: no signal, no abort), writes nothing to stdout, and its message names the bad file BAD
# by path (as the command line or the tokenizer lookup gave it).
expect_refused() {
  local what=$1 file=$2 bad=$3
  shift 3
  "$thinkv" generate --model "$file" --steps 4 "$@" >"$tmp/out.txt" 2>"$tmp/err.txt"
  local rc=$?
  [ $rc -lt 128 ] || fail "$what: thinkv crashed (exit $rc): $(cat "$tmp/err.txt")"
  [ $rc -eq 1 ] || fail "$what: exit $rc, expected 1: $(cat "$tmp/err.txt")"
  grep -qF -- "$bad" "$tmp/err.txt" || fail "$what: the message does not name $bad: $(cat "$tmp/err.txt")"
  [ ! -s "$tmp/out.txt" ] || fail "$what: wrote to stdout: $(cat "$tmp/out.txt")"
}
# cut_to SRC BYTES DST: the first BYTES bytes of SRC.
cut_to() { head -c "$2" "$1" >"$3" || fail "could not write $3"; }
# flip_byte FILE OFFSET CHAR: overwrites one byte in place.
flip_byte() { printf '%s' "$3" | dd of="$1" bs=1 seek="$2" conv=notrunc 2>/dev/null || fail "dd $1"; }
size_of() { wc -c <"$1" | tr -d ' '; }

bin=$models/stories260K.bin
n=$(size_of "$bin")
cut_to "$bin" 16 "$tmp/hdr_cut.bin"             # inside the 28-byte header
expect_refused "stories260K.bin cut in the header" "$tmp/hdr_cut.bin" "$tmp/hdr_cut.bin"
cut_to "$bin" $((n / 2)) "$tmp/mid_cut.bin"      # inside the weights
expect_refused "stories260K.bin cut mid-tensor" "$tmp/mid_cut.bin" "$tmp/mid_cut.bin"
grep -q "truncated" "$tmp/err.txt" || fail "a mid-tensor cut does not say 'truncated': $(cat "$tmp/err.txt")"
cut_to "$bin" $((n - 1)) "$tmp/last_cut.bin"     # one byte short
expect_refused "stories260K.bin one byte short" "$tmp/last_cut.bin" "$tmp/last_cut.bin"

# The tokenizer: tok512.bin is found next to the model; a truncated one is refused naming it,
# a missing one says where to get it.
if [ -f "$models/tok512.bin" ]; then
  t=$(size_of "$models/tok512.bin")
  for c in 2 $((t / 2)) $((t - 1)); do
    mkdir -p "$tmp/tok_$c" && cp "$bin" "$tmp/tok_$c/" && cut_to "$models/tok512.bin" "$c" "$tmp/tok_$c/tok512.bin"
    expect_refused "tok512.bin cut at $c" "$tmp/tok_$c/stories260K.bin" "$tmp/tok_$c/tok512.bin"
  done
  cut_to "$models/tok512.bin" $((t / 2)) "$tmp/half_tok.bin"
  expect_refused "--tokenizer cut in half" "$bin" "$tmp/half_tok.bin" --tokenizer "$tmp/half_tok.bin"
else
  echo "note: $models/tok512.bin absent: truncated-tokenizer checks not run"
fi
mkdir -p "$tmp/notok" && cp "$bin" "$tmp/notok/"
expect_refused "stories260K.bin without a tokenizer" "$tmp/notok/stories260K.bin" "$tmp/notok/stories260K.bin"
for f in tok512.bin tinyllamas SOURCES.md --tokenizer; do
  grep -qF -- "$f" "$tmp/err.txt" || fail "a missing tokenizer: the message lacks '$f': $(cat "$tmp/err.txt")"
done

if [ -f "$models/stories260K_q80.bin" ]; then
  q=$models/stories260K_q80.bin
  n=$(size_of "$q")
  cut_to "$q" 30 "$tmp/hdr_cut_q80.bin"          # inside the 256-byte v2 header
  expect_refused "stories260K_q80.bin cut in the header" "$tmp/hdr_cut_q80.bin" "$tmp/hdr_cut_q80.bin"
  cut_to "$q" $((n / 2)) "$tmp/mid_cut_q80.bin"
  expect_refused "stories260K_q80.bin cut mid-tensor" "$tmp/mid_cut_q80.bin" "$tmp/mid_cut_q80.bin"
  cp "$q" "$tmp/magic_q80.bin" && chmod u+w "$tmp/magic_q80.bin"
  flip_byte "$tmp/magic_q80.bin" 0 X               # "ak42" -> "Xk42"
  expect_refused "stories260K_q80.bin with a flipped magic" "$tmp/magic_q80.bin" "$tmp/magic_q80.bin"
else
  echo "note: $models/stories260K_q80.bin absent: its corruption checks not run"
fi

if [ -f "$models/stories260K.gguf" ]; then
  g=$models/stories260K.gguf
  n=$(size_of "$g")
  cut_to "$g" 20 "$tmp/hdr_cut.gguf"             # inside the 24-byte GGUF header
  expect_refused "stories260K.gguf cut in the header" "$tmp/hdr_cut.gguf" "$tmp/hdr_cut.gguf"
  cut_to "$g" $((n / 2)) "$tmp/mid_cut.gguf"     # inside the tensor data
  expect_refused "stories260K.gguf cut mid-tensor" "$tmp/mid_cut.gguf" "$tmp/mid_cut.gguf"
  # Inside the embedded tokenizer (metadata): its token strings and its scores.
  koff=$(grep -boa "tokenizer.ggml.tokens" "$g" | head -n 1 | cut -d: -f1)
  soff=$(grep -boa "tokenizer.ggml.scores" "$g" | head -n 1 | cut -d: -f1)
  [ -n "$koff" ] && [ -n "$soff" ] || fail "stories260K.gguf has no tokenizer.ggml.tokens/scores keys"
  for c in $((koff + 200)) $(((koff + soff) / 2)) $((soff + 100)); do
    cut_to "$g" "$c" "$tmp/tok_cut_$c.gguf"
    expect_refused "stories260K.gguf cut in the tokenizer at $c" "$tmp/tok_cut_$c.gguf" "$tmp/tok_cut_$c.gguf"
  done
  # A corrupt (not truncated) tokenizer: the token array's element count (after the key, its
  # value type and element type) set to 2^64-1.
  cp "$g" "$tmp/count.gguf" && chmod u+w "$tmp/count.gguf"
  printf '\377\377\377\377\377\377\377\377' |
    dd of="$tmp/count.gguf" bs=1 seek=$((koff + 21 + 8)) conv=notrunc 2>/dev/null || fail "dd count.gguf"
  expect_refused "stories260K.gguf with a corrupt token count" "$tmp/count.gguf" "$tmp/count.gguf"
  grep -q "tokenizer.ggml.tokens" "$tmp/err.txt" ||
    fail "a corrupt token count: the message does not name the key: $(cat "$tmp/err.txt")"
  cp "$g" "$tmp/magic.gguf" && chmod u+w "$tmp/magic.gguf"
  flip_byte "$tmp/magic.gguf" 3 X                  # "GGUF" -> "GGUX"
  expect_refused "stories260K.gguf with a flipped magic" "$tmp/magic.gguf" "$tmp/magic.gguf"
  grep -q "GGUX" "$tmp/err.txt" || fail "a flipped GGUF magic: the message does not show it: $(cat "$tmp/err.txt")"
else
  echo "note: $models/stories260K.gguf absent: its corruption checks not run"
fi

# ---- the fidelity line when nothing diverges: "none", and -1 in the JSON -------------------------
out=$("$thinkv" generate --model "$bin" --steps 32 --mode full --compare full --json 2>"$tmp/err.txt") ||
  fail "full vs full exited $?: $(cat "$tmp/err.txt")"
grep -q "first divergence: none" "$tmp/err.txt" || fail "full vs full: summary lacks 'first divergence: none': $(cat "$tmp/err.txt")"
if grep -q "step -1" "$tmp/err.txt"; then fail "full vs full: the summary prints step -1"; fi
case "$(printf '%s\n' "$out" | tail -n 1)" in *'"first_divergence":-1'*) ;; *) fail "full vs full: JSON first_divergence is not -1: $out" ;; esac

# ---- progress: stdout is only the text; the --compare phase shows a status line in a terminal ----
# Not a terminal, no --progress: stderr has no status line (a log stays clean).
"$thinkv" generate --model "$bin" --steps 32 --compare full >"$tmp/plain.txt" 2>"$tmp/err.txt" ||
  fail "generate exited $?"
if grep -q "comparing with FullKV" "$tmp/err.txt"; then fail "a status line without a terminal or --progress"; fi
# --progress forces it, on stderr only: stdout is byte for byte the text of the run without it.
"$thinkv" generate --model "$bin" --steps 32 --compare full --progress >"$tmp/out.txt" 2>"$tmp/err.txt" ||
  fail "generate --progress exited $?"
grep -q "comparing with FullKV" "$tmp/err.txt" || fail "--progress: no status line for the --compare phase"
cmp -s "$tmp/plain.txt" "$tmp/out.txt" || fail "--progress changed stdout: $(cat -A "$tmp/out.txt")"
# stdout and stderr on one terminal (an interactive run): the compare phase still shows its line.
if command -v script >/dev/null 2>&1 &&
   script -qec "true" /dev/null >/dev/null 2>&1; then
  script -qec "'$thinkv' generate --model '$bin' --steps 32 --compare full" /dev/null >"$tmp/tty.txt" 2>&1 ||
    fail "generate in a terminal exited $?: $(cat "$tmp/tty.txt")"
  grep -q "comparing with FullKV" "$tmp/tty.txt" ||
    fail "in a terminal the --compare full phase shows no status line: $(cat "$tmp/tty.txt")"
else
  echo "note: util-linux 'script' not usable here: the terminal check of the --compare status line not run"
fi
echo "1 passed, 0 failed"
