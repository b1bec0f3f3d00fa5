#!/usr/bin/env bash
# Measures ThinKV inside a stock llama.cpp (examples/llama_cpp) against the same llama.cpp without
# it, on stories260K.gguf and on the testbed model converted to GGUF. Writes one JSON line per run
# to OUT_DIR/results.jsonl and the console summaries to OUT_DIR/log.txt.
# Usage: bench/llama_cpp/run_llama_cpp.sh BUILD_DIR STORIES_GGUF TESTBED_GGUF OUT_DIR [PROBLEMS]
#   BUILD_DIR     a build configured with -DTHINKV_LLAMA_CPP_DIR=<llama.cpp install prefix>
#   TESTBED_GGUF  models/testbed.bin converted by llama.cpp's own converter:
#                 llama-convert-llama2c-to-ggml --copy-vocab-from-model models/tok128.bin \
#                   --llama2c-model models/testbed.bin --llama2c-output-model testbed.gguf
#   PROBLEMS      eval problems of the testbed (default 20)
set -euo pipefail
build=$1 stories=$2 testbed=$3 out=$4 problems=${5:-20}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin=$build/examples/llama_cpp/thinkv_llama
mkdir -p "$out"
res=$out/results.jsonl log=$out/log.txt
: >"$res"
: >"$log"
run() {
  echo "\$ thinkv_llama $*" | tee -a "$log"
  "$bin" --json "$res" "$@" 2>&1 | tee -a "$log"
}
prompt="Once upon a time, there was a little girl named Lily. She loved to play outside"
# stories260K: teacher-forced fidelity at several budgets (every token R: no calibration exists
# for it; its sparsity is unimodal).
run --model "$stories" --prompt "$prompt" --steps 480 --budget 0
for b in 64 128 256; do
  run --model "$stories" --prompt "$prompt" --steps 480 --budget "$b" --segment 64
  run --model "$stories" --prompt "$prompt" --steps 480 --budget "$b" --segment 64 --selection first
done
# The testbed: teacher-forced on one problem's prompt, then free-running answers.
tb=(--model "$testbed" --tokenizer models/tok128.bin)
tbprompt=$(head -1 models/eval_public.jsonl | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["prompt"])')
run "${tb[@]}" --prompt "$tbprompt" --steps 1500 --budget 0
for b in 512 1024; do
  run "${tb[@]}" --prompt "$tbprompt" --steps 1500 --budget "$b"
  run "${tb[@]}" --prompt "$tbprompt" --steps 1500 --budget "$b" --calibration models/testbed-calib.json
done
ev=(--problems models/eval_public.jsonl --limit "$problems" --max-steps 1900)
run "${tb[@]}" "${ev[@]}" --budget 1024
run "${tb[@]}" "${ev[@]}" --budget 1024 --ctx 1536
run "${tb[@]}" "${ev[@]}" --budget 1024 --selection first
run "${tb[@]}" "${ev[@]}" --budget 512
run "${tb[@]}" "${ev[@]}" --budget 1024 --calibration models/testbed-calib.json
