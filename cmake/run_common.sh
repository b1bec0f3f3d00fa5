# Shell helpers shared by tests/run.sh and examples/run.sh (sourced, not executed).
# Callers run from the repository root with `set -euo pipefail`.

# Debian packages the build needs (Debian 12 versions: CMake 3.25, g++ 12, Catch2 2.13, benchmark 1.7,
# nlohmann-json 3.11, CLI11 2.1).
# clang and libclang-rt-14-dev (libFuzzer, sanitizer runtimes) build the fuzz targets;
# clang-format-14 checks the formatting (tests/lint/). ccache lets build-cpu/ reuse build/'s objects
# (the CPU sources compile with the same flags in both), which saves about a quarter of a clean run.
# python3 runs bench/tools/split_sweep.py's check against the C++ split plan (tests/tools/).
THINKV_APT_PACKAGES=(cmake ninja-build ccache g++ catch2 libbenchmark-dev nlohmann-json3-dev libcli11-dev clang libclang-rt-14-dev
                     clang-format-14 python3)

thinkv_log() { printf '\n==== %s\n' "$*" >&2; }

# Installs the missing packages with apt-get when root; otherwise prints the command and exits 1.
thinkv_ensure_deps() {
  local missing=() pkg
  if command -v dpkg-query >/dev/null 2>&1; then
    for pkg in "${THINKV_APT_PACKAGES[@]}"; do
      if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$pkg")
      fi
    done
  else
    # Not Debian: check the tools only; CMake reports a missing Catch2/benchmark package itself.
    command -v cmake >/dev/null 2>&1 || missing+=(cmake)
    command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
    if ((${#missing[@]})); then
      echo "error: missing tools: ${missing[*]} (install them with your package manager)" >&2
      exit 1
    fi
    return 0
  fi
  ((${#missing[@]})) || return 0
  local cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
  if [[ $(id -u) -ne 0 ]]; then
    echo "error: missing packages: ${missing[*]}" >&2
    echo "run as root:  sudo sh -c '$cmd'" >&2
    exit 1
  fi
  thinkv_log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update >&2
  apt-get install -y --no-install-recommends "${missing[@]}" >&2
}

# Prints the nvcc to use ($CUDACXX, nvcc on PATH, /usr/local/cuda/bin/nvcc), or nothing.
thinkv_find_nvcc() {
  if [[ -n "${CUDACXX:-}" && -x "${CUDACXX}" ]]; then
    echo "$CUDACXX"
  elif command -v nvcc >/dev/null 2>&1; then
    command -v nvcc
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    echo /usr/local/cuda/bin/nvcc
  fi
}

thinkv_jobs() { nproc 2>/dev/null || echo 2; }

# thinkv_configure <build-dir> [cmake args...]: the CI settings (Ninja, Release with asserts kept,
# warnings as errors, ccache when present). Keeps the generator of an existing build directory.
thinkv_configure() {
  local dir=$1
  shift
  local args=(-S . -B "$dir"
    -DCMAKE_BUILD_TYPE=Release
    # Release optimisation, but assert() stays on: these builds exist to run the tests.
    -DCMAKE_CXX_FLAGS_RELEASE=-O2 -DCMAKE_CUDA_FLAGS_RELEASE=-O2
    -DTHINKV_WERROR=ON)
  [[ -f "$dir/CMakeCache.txt" ]] || args+=(-G Ninja)
  if command -v ccache >/dev/null 2>&1; then
    # build/ and build-cpu/ compile the same sources with the same flags: ccache shares them.
    args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  cmake "${args[@]}" "$@"
}

# The CMake arguments of the default configuration: CUDA when an nvcc is found.
thinkv_default_cuda_args() {
  local nvcc
  nvcc=$(thinkv_find_nvcc)
  if [[ -n "$nvcc" ]]; then
    echo "-DCMAKE_CUDA_COMPILER=$nvcc"
  fi
}
