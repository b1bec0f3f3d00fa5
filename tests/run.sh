#!/usr/bin/env bash
# The test command (CI's .ci/run calls exactly this). On Debian 12, as root, it first installs what
# is missing (cmake ninja-build g++ catch2 libbenchmark-dev). Then it configures, builds and runs
# ctest for two configurations, with warnings as errors:
#   build/      default: CUDA kernels and GPU tests when nvcc is found (GPU tests skip without a GPU)
#   build-cpu/  CPU-only: -DTHINKV_ENABLE_CUDA=OFF, even when nvcc exists
# Exits non-zero if either fails. Extra arguments are passed to ctest (e.g. -L unit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source cmake/run_common.sh

thinkv_ensure_deps
jobs=$(thinkv_jobs)
failed=()
summary=()

# run_config <name> <build-dir> [cmake args...]
run_config() {
  local name=$1 dir=$2
  shift 2
  local start=$SECONDS
  thinkv_log "configuration '$name' in $dir/: configure"
  if thinkv_configure "$dir" "$@" &&
     thinkv_log "configuration '$name' in $dir/: build (-j$jobs)" &&
     cmake --build "$dir" --parallel "$jobs" &&
     thinkv_log "configuration '$name' in $dir/: ctest" &&
     ctest --test-dir "$dir" --output-on-failure --parallel "$jobs" --timeout 900 \
           "${ctest_args[@]}"; then
    summary+=("PASS  $name ($dir/, $((SECONDS - start)) s)")
  else
    summary+=("FAIL  $name ($dir/, $((SECONDS - start)) s)")
    failed+=("$name")
  fi
}

ctest_args=("$@")
total_start=$SECONDS
read -r -a cuda_args <<<"$(thinkv_default_cuda_args)"
if ((${#cuda_args[@]})); then
  default_name="default (CUDA: ${cuda_args[0]#-DCMAKE_CUDA_COMPILER=})"
else
  default_name="default (no nvcc found: CPU-only)"
fi
run_config "$default_name" build "${cuda_args[@]}"
run_config "CPU-only (THINKV_ENABLE_CUDA=OFF)" build-cpu -DTHINKV_ENABLE_CUDA=OFF

thinkv_log "summary ($((SECONDS - total_start)) s)"
printf '%s\n' "${summary[@]}" >&2
if ((${#failed[@]})); then
  echo "tests/run.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "tests/run.sh: all configurations passed" >&2
