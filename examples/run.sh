#!/usr/bin/env bash
# The main-job command: installs what is missing (as tests/run.sh does), builds the example's
# target only (CPU-only in build-cpu/; the CUDA configuration in build/ with --backend cuda), then
# runs the main example with this script's arguments. Build output goes to stderr, the example's
# to stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source cmake/run_common.sh

# The main job: the `thinkv` CLI decoding the first public problem of the reasoning testbed
# (models/testbed.bin, a small Llama trained on checkable chains of thought) with its KV cache
# held by ThinKV (thinkv mode: TBQ + TBE, the committed calibration, the prompt kept), compared
# against FullKV FP16 on the same problem. Arguments given to this script are appended to
# `thinkv generate` (later flags win, e.g. --problem 4, --budget 256 or --mode h2o).
main_target=thinkv
main_args=(generate --model testbed.bin --problems models/eval_public.jsonl --problem 0 --mode thinkv
           --calibration models/testbed-calib.json --compare full)

# The main job decodes on the CPU, so it builds the CPU-only configuration in build-cpu/ (no CUDA
# compiled first); with `--backend cuda` among the arguments it builds the default configuration
# in build/ (CUDA kernels when nvcc is found) instead.
build_dir=build-cpu
build_args=(-DTHINKV_ENABLE_CUDA=OFF)
for a in "$@"; do
  if [[ $a == cuda || $a == --backend=cuda ]]; then
    build_dir=build
    read -r -a build_args <<<"$(thinkv_default_cuda_args)"
  fi
done
main_binary=$build_dir/examples/thinkv/thinkv

thinkv_ensure_deps
thinkv_log "configure $build_dir/" >&2
thinkv_configure "$build_dir" "${build_args[@]}" >&2
thinkv_log "build $main_target" >&2
cmake --build "$build_dir" --parallel "$(thinkv_jobs)" --target "$main_target" >&2
thinkv_log "run $main_binary ${main_args[*]} $*" >&2
exec "$main_binary" "${main_args[@]}" "$@"
