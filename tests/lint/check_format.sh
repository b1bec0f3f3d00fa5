#!/usr/bin/env bash
# lint.clang_format: every C++/CUDA source the repository tracks is formatted as .clang-format
# says (clang-format 14, Debian 12's; another version formats differently, so the test skips).
# Prints the files that differ and how to fix them.
#   check_format.sh REPO_ROOT
set -u
root=$1
cf=$(command -v clang-format-14 || command -v clang-format || true)
if [[ -z $cf ]]; then
  echo "SKIPPED: clang-format not found (Debian: apt-get install clang-format)"
  exit 0
fi
if ! "$cf" --version | grep -q "version 14\."; then
  echo "SKIPPED: $("$cf" --version) is not clang-format 14, which .clang-format is checked with"
  exit 0
fi
cd "$root" || exit 1
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh' '*.h')
else
  mapfile -t files < <(find include kernels examples tests bench -type f \
    \( -name '*.hpp' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) | sort)
fi
bad=()
for f in "${files[@]}"; do
  "$cf" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "FAIL: ${#bad[@]} of ${#files[@]} files are not formatted as .clang-format says:"
  printf '  %s\n' "${bad[@]}"
  echo "fix: $cf -i ${bad[*]}"
  exit 1
fi
echo "${#files[@]} files formatted as .clang-format says"
