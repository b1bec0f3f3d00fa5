#!/usr/bin/env bash
# One whole GPU round on a machine with an NVIDIA GPU: configure + build the CUDA targets
# (thinkv_kernels, the GPU tests, the oracle tests) for sm_90a, run the GPU and oracle tests, then
# every GPU test executable under compute-sanitizer memcheck and racecheck. Logs go to
# $THINKV_GPU_SUITE_LOGS when set, else to build-gpu-suite/logs. Exit status: 0 when all passed,
# 1 otherwise.
#
# Catch2 (needed to configure the tests) is not installed on the H200. On a machine that has it,
#   bash bench/run_gpu_suite.sh --prepare
# copies Debian's Catch2 v2 (header + relocatable CMake package) into .gpu-deps/ (ignored through
# .git/info/exclude); copy the checkout with .gpu-deps/ to the GPU machine. There, from the repo root:
#   bash bench/run_gpu_suite.sh
# Environment: THINKV_CUDA_ARCHITECTURES (default 90a), THINKV_GPU_BUILD_DIR (build-gpu-suite),
# THINKV_TEST_SEED (pins the random tests' seed), THINKV_GPU_SANITIZE (a regex: only the GPU tests
# it matches run under compute-sanitizer), THINKV_COMMIT (the commit to print when the copy
# has no or stale git metadata, as a copied work tree may: pass $(git rev-parse --short HEAD)),
# THINKV_GPU_TAR=1 (pack every log and JSON into one $LOGS/gpu-suite.tgz at the end, for
# copying the results back in one file).
#
# The full round ends with the GPU benchmarks (every bench/bench_*.cu, Google Benchmark; JSON in
# $LOGS/<name>.json), the decode-attention main pass's instructions per token-head for each
# precision (bench/tools/ncu_instructions.py, when ncu is installed) and PyTorch SDPA's numbers on
# the same BF16 decode shapes (bench/torch_sdpa_decode.py); THINKV_GPU_SKIP_BENCH=1 leaves them out.
#   bash bench/run_gpu_suite.sh --bench
# runs only the benchmarks (their own build dir, $THINKV_GPU_BUILD_DIR-bench); extra arguments
# after --bench go to every benchmark (e.g. --benchmark_filter=...).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
DEPS=$ROOT/.gpu-deps

prepare() {
  local src_h=/usr/include/catch2/catch.hpp src_c=/usr/lib/cmake/Catch2
  if [[ ! -f $src_h || ! -d $src_c ]]; then
    echo "prepare: Catch2 v2 not found ($src_h, $src_c); apt-get install catch2" >&2
    return 1
  fi
  mkdir -p "$DEPS/include/catch2" "$DEPS/lib/cmake"
  cp "$src_h" "$DEPS/include/catch2/catch.hpp"
  # A minimal package: the header-only target Catch2::Catch2 (all thinkv uses) and the
  # catch_discover_tests scripts; Debian's own config also imports a prebuilt library.
  rm -rf "$DEPS/lib/cmake/Catch2"
  mkdir -p "$DEPS/lib/cmake/Catch2"
  cp "$src_c/Catch.cmake" "$src_c/CatchAddTests.cmake" "$src_c/Catch2ConfigVersion.cmake" \
    "$DEPS/lib/cmake/Catch2/"
  cat >"$DEPS/lib/cmake/Catch2/Catch2Config.cmake" <<'CMAKE'
# Minimal relocatable Catch2 v2 package written by bench/run_gpu_suite.sh --prepare.
if(NOT TARGET Catch2::Catch2)
  list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
  get_filename_component(_catch2_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
  add_library(Catch2::Catch2 INTERFACE IMPORTED)
  set_target_properties(Catch2::Catch2 PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_catch2_prefix}/include")
  unset(_catch2_prefix)
endif()
set(Catch2_FOUND TRUE)
CMAKE
  # The real model for the CLI's --backend cuda smoke test (the GPU machine has no ../shared).
  local models=${THINKV_MODELS:-$ROOT/../shared/models}
  if [[ -f $models/stories260K.bin && -f $models/tok512.bin ]]; then
    mkdir -p "$DEPS/models"
    cp "$models/stories260K.bin" "$models/tok512.bin" "$DEPS/models/"
  else
    echo "prepare: no stories260K.bin + tok512.bin in $models: the CLI smoke test will be skipped" >&2
  fi
  local excl
  excl=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
  mkdir -p "$(dirname "$excl")"
  grep -qxF '/.gpu-deps/' "$excl" 2>/dev/null || echo '/.gpu-deps/' >>"$excl"
  echo "prepare: Catch2 copied into $DEPS"
}

if [[ ${1:-} == --prepare ]]; then
  prepare
  exit $?
fi
BENCH_ONLY=0
BENCH_ARGS=()
if [[ ${1:-} == --bench ]]; then
  BENCH_ONLY=1
  shift
  BENCH_ARGS=("$@")
fi

LOGS=${THINKV_GPU_SUITE_LOGS:-$ROOT/build-gpu-suite/logs}
BUILD=${THINKV_GPU_BUILD_DIR:-$ROOT/build-gpu-suite}
ARCH=${THINKV_CUDA_ARCHITECTURES:-90a}
mkdir -p "$LOGS"
SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"
status=0
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME CMD...: runs CMD, log in $LOGS/NAME.log, records pass/fail
  local name=$1
  shift
  local t0=$SECONDS
  "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  if [[ $rc -eq 0 ]]; then
    note "PASS $name ($((SECONDS - t0)) s)"
  else
    note "FAIL $name (exit $rc, $((SECONDS - t0)) s): see $name.log"
    tail -n 40 "$LOGS/$name.log"
    status=1
  fi
  return $rc
}

[[ -d $DEPS/lib/cmake/Catch2 ]] || prepare || true
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
COMMIT=${THINKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no git metadata in this copy)")}
note "gpu suite: $(date -u +%FT%TZ) commit $COMMIT (+ working tree changes), arch $ARCH"
command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$SUMMARY"

# The GPU benchmarks (every bench/bench_*.cu): Release build with THINKV_BUILD_BENCH=ON (tests
# off), JSON out, then PyTorch's scaled_dot_product_attention on the same BF16 decode shapes
# (bench/torch_sdpa_decode.py) when python3 can import torch.
run_bench() {
  local bbuild=$BUILD-bench
  local benches=()
  for f in bench/bench_*.cu; do benches+=("$(basename "$f" .cu)"); done
  step bench_configure cmake -S . -B "$bbuild" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DTHINKV_CUDA_ARCHITECTURES="$ARCH" -DTHINKV_WERROR=ON \
    -DTHINKV_BUILD_TESTS=OFF -DTHINKV_BUILD_BENCH=ON -DTHINKV_BUILD_EXAMPLES=OFF || return 1
  step bench_build cmake --build "$bbuild" --target "${benches[@]}" || return 1
  for b in "${benches[@]}"; do
    step "$b" "$bbuild/bench/$b" --benchmark_out="$LOGS/$b.json" --benchmark_out_format=json \
      --benchmark_counters_tabular=true "${BENCH_ARGS[@]}"
    # The median rows, short, for the end of the output.
    grep -E '_median' "$LOGS/$b.log" | sed -E 's/^BM_//' | tee "$LOGS/${b}_median.txt"
  done
  # Instructions per token-head of each precision's main pass (Nsight Compute, when installed).
  local ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  if [[ -x $ncu ]]; then
    step ncu_instructions python3 bench/tools/ncu_instructions.py --ncu "$ncu" \
      --bench "$bbuild/bench/bench_paged_attention" --tokens 4096 --batch 64 --json "$LOGS/ncu_instructions.json"
    cat "$LOGS/ncu_instructions.log"
  else
    note "SKIP ncu_instructions (no Nsight Compute: $ncu)"
  fi
  if python3 -c 'import torch' >/dev/null 2>&1; then
    step torch_sdpa_decode python3 bench/torch_sdpa_decode.py --out "$LOGS/torch_sdpa_decode.json"
    tail -n 40 "$LOGS/torch_sdpa_decode.log"
  else
    note "SKIP torch_sdpa_decode (python3 cannot import torch here)"
  fi
}
pack_logs() {  # THINKV_GPU_TAR=1: everything under $LOGS into one tarball
  [[ ${THINKV_GPU_TAR:-0} == 1 ]] || return 0
  local tgz=gpu-suite.tgz
  [[ $BENCH_ONLY -eq 1 ]] && tgz=gpu-bench.tgz
  (cd "$LOGS" && tar czf "../$tgz.tmp" --exclude='gpu-*.tgz' . && find . -mindepth 1 -maxdepth 1 ! -name 'gpu-*.tgz' -exec rm -rf {} + &&
    mv "../$tgz.tmp" "$tgz") && echo "logs packed into $LOGS/$tgz"
}
if [[ $BENCH_ONLY -eq 1 ]]; then
  run_bench
  note "gpu bench: $([[ $status -eq 0 ]] && echo PASSED || echo FAILED) in $SECONDS s"
  pack_logs
  exit $status
fi

step configure cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DTHINKV_CUDA_ARCHITECTURES="$ARCH" -DTHINKV_WERROR=ON \
  -DTHINKV_BUILD_TESTS=ON -DTHINKV_BUILD_BENCH=OFF -DTHINKV_BUILD_EXAMPLES=ON \
  -DCMAKE_PREFIX_PATH="$DEPS" || { cat "$SUMMARY"; exit 1; }

# Only the CUDA-related targets: the kernels, the GPU tests and the oracle tests.
mapfile -t TARGETS < <(ninja -C "$BUILD" -t targets all 2>/dev/null |
  grep -oE '^(gpu|oracle)_test_[A-Za-z0-9_]+:' | tr -d ':' | sort -u)
note "targets: thinkv_kernels thinkv ${TARGETS[*]}"
step build cmake --build "$BUILD" --target thinkv_kernels thinkv "${TARGETS[@]}" || { cat "$SUMMARY"; exit 1; }

# -V: the GPU tests print their measured errors per case; keep them in the log.
step ctest env THINKV_MODELS="${THINKV_MODELS:-$DEPS/models}" ctest --test-dir "$BUILD" -L 'gpu|oracle' -V --timeout 300

# The CLI on the real model with --backend cuda: same text as the CPU backend
# (tests/cli/generate_smoke.sh; models from --prepare's copy or $THINKV_MODELS).
MODELS=${THINKV_MODELS:-$DEPS/models}
if [[ -f $MODELS/stories260K.bin ]]; then
  step cli_generate_smoke env THINKV_MODELS="$MODELS" bash tests/cli/generate_smoke.sh \
    "$BUILD/examples/thinkv/thinkv" "$MODELS"
  grep -E 'note:|FAIL' "$LOGS/cli_generate_smoke.log"
else
  note "SKIP cli_generate_smoke (no stories260K.bin in $MODELS: run --prepare where ../shared/models exists)"
fi

# Every GPU test executable under compute-sanitizer (smaller inputs: THINKV_TEST_SMALL), or those
# whose name matches the extended regex $THINKV_GPU_SANITIZE (e.g. 'kmeans|batched'; 'none' for
# none). racecheck is the slow one: test_cuda_batched takes about 7 minutes under it on an NVIDIA
# H100, so it gets 15 minutes, memcheck 4.
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for exe in "$BUILD"/tests/kernels/test_*; do
  [[ -x $exe && -f $exe ]] || continue
  name=$(basename "$exe")
  [[ -z ${THINKV_GPU_SANITIZE:-} || $name =~ ${THINKV_GPU_SANITIZE} ]] || continue
  for tool in memcheck racecheck; do
    extra=()
    limit=240
    [[ $tool == memcheck ]] && extra=(--leak-check full)
    [[ $tool == racecheck ]] && limit=900
    step "${name}_${tool}" env THINKV_TEST_SMALL=1 THINKV_UNDER_SANITIZER=1 timeout $limit "$SAN" --tool "$tool" \
      --error-exitcode 3 "${extra[@]}" "$exe"
  done
done

[[ ${THINKV_GPU_SKIP_BENCH:-0} == 1 ]] || run_bench

note "gpu suite: $([[ $status -eq 0 ]] && echo PASSED || echo FAILED) in $SECONDS s"
pack_logs
exit $status
