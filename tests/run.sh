#!/usr/bin/env bash
# The test command (CI's .ci/run calls exactly this). On Debian 12, as root, it first installs what
# is missing (cmake/run_common.sh lists the packages). Then it configures, builds and tests, with
# warnings as errors:
#   build/       default: CUDA kernels and GPU tests when nvcc is found (GPU tests skip without a GPU)
#   build-cpu/   CPU-only: -DTHINKV_ENABLE_CUDA=OFF, even when nvcc exists
#   build-asan/  CPU-only unit and CLI tests under ASan + UBSan (THINKV_SKIP_SANITIZERS=1 skips)
#   build-fuzz/  the fuzz targets (clang libFuzzer): regression inputs, then THINKV_FUZZ_SECONDS
#                (default 15) per target (0 skips)
# Exits non-zero if either fails. Extra arguments are passed to ctest (e.g. -L unit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source cmake/run_common.sh

thinkv_ensure_deps
jobs=$(thinkv_jobs)
failed=()
summary=()

# run_config <name> <build-dir> [cmake args...]; the ctest arguments are ctest_args plus
# config_ctest_args (set by the caller for one configuration).
config_ctest_args=()
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
           "${config_ctest_args[@]}" "${ctest_args[@]}"; then
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

# The CPU-only unit and CLI tests again under AddressSanitizer + UndefinedBehaviorSanitizer
# (any report fails the test). THINKV_SKIP_SANITIZERS=1 skips this configuration.
# -Wno-maybe-uninitialized: GCC 12 reports false positives inside libstdc++ (std::regex,
# std::function) once ASan instruments it; every other warning stays an error.
if [[ ${THINKV_SKIP_SANITIZERS:-0} != 1 ]]; then
  export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  config_ctest_args=(-L "unit|cli")
  run_config "sanitizers (CPU-only, ASan + UBSan: unit and CLI tests)" build-asan -DTHINKV_ENABLE_CUDA=OFF \
    -DTHINKV_BUILD_BENCH=OFF -DTHINKV_INSTALL=OFF \
    "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -Wno-maybe-uninitialized"
  config_ctest_args=()
fi

# Fuzzing: every parser of untrusted input (tests/fuzz/), clang libFuzzer with ASan + UBSan:
# the regression inputs once, then THINKV_FUZZ_SECONDS (default 15) seconds per target from the
# committed seed corpus. THINKV_FUZZ_SECONDS=0 skips it.
fuzz_seconds=${THINKV_FUZZ_SECONDS:-15}
if [[ $fuzz_seconds != 0 ]]; then
  start=$SECONDS
  thinkv_log "configuration 'fuzz (clang libFuzzer, ASan + UBSan)' in build-fuzz/: configure, build, run"
  if CXX=clang++ thinkv_configure build-fuzz -DTHINKV_ENABLE_CUDA=OFF -DTHINKV_BUILD_FUZZERS=ON \
       -DTHINKV_BUILD_TESTS=OFF -DTHINKV_BUILD_EXAMPLES=OFF -DTHINKV_BUILD_BENCH=OFF -DTHINKV_INSTALL=OFF &&
     cmake --build build-fuzz --parallel "$jobs" &&
     bash tests/fuzz/run_fuzzers.sh build-fuzz "$fuzz_seconds"; then
    summary+=("PASS  fuzz (build-fuzz/, $((SECONDS - start)) s)")
  else
    summary+=("FAIL  fuzz (build-fuzz/, $((SECONDS - start)) s)")
    failed+=("fuzz")
  fi
fi

thinkv_log "summary ($((SECONDS - total_start)) s)"
printf '%s\n' "${summary[@]}" >&2
if ((${#failed[@]})); then
  echo "tests/run.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "tests/run.sh: all configurations passed" >&2
