#!/usr/bin/env bash
# The main-job command: installs what is missing (as tests/run.sh does), builds the default
# configuration in build/ (CUDA when nvcc is found; only the example's target), then runs the main
# example with this script's arguments. Build output goes to stderr, the example's to stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source cmake/run_common.sh

# The main job: the `thinkv` CLI decoding the first public problem of the reasoning testbed
# (models/testbed.bin, a small Llama trained on checkable chains of thought) with its KV cache
# held by ThinKV (thinkv mode: TBQ + TBE, the committed calibration, the prompt kept), compared
# against FullKV FP16 on the same problem. Arguments given to this script are appended to
# `thinkv generate` (later flags win, e.g. --problem 4, --budget 256 or --mode h2o).
main_target=thinkv
main_binary=build/examples/thinkv/thinkv
main_args=(generate --model testbed.bin --problems models/eval_public.jsonl --problem 0 --mode thinkv
           --calibration models/testbed-calib.json --compare full)

thinkv_ensure_deps
read -r -a cuda_args <<<"$(thinkv_default_cuda_args)"
thinkv_log "configure build/" >&2
thinkv_configure build "${cuda_args[@]}" >&2
thinkv_log "build $main_target" >&2
cmake --build build --parallel "$(thinkv_jobs)" --target "$main_target" >&2
thinkv_log "run $main_binary ${main_args[*]} $*" >&2
exec "$main_binary" "${main_args[@]}" "$@"
