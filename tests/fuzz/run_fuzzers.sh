#!/usr/bin/env bash
# Runs every fuzz target of tests/fuzz/: first each regression input once (an input that once
# crashed or hit undefined behaviour must now be handled), then fuzzing from the committed seed
# corpus for SECONDS seconds. New corpus entries go to a scratch directory, never into the repo.
# A crash, a leak, a sanitizer report or an invariant failure fails the run, and libFuzzer keeps
# the input as crash-*/leak-*/timeout-* in ARTIFACTS (default: the scratch directory).
#   run_fuzzers.sh BUILD_DIR [SECONDS] [ARTIFACTS]
set -u
build=$1 seconds=${2:-15}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/thinkv_fuzz.XXXXXX")
artifacts=${3:-$scratch/artifacts}
mkdir -p "$artifacts"
targets=(gguf llama2c tokenizer trace calibration cache_args sequence_state)
failed=()
summary=()
for t in "${targets[@]}"; do
  bin=$build/tests/fuzz/fuzz_$t
  if [[ ! -x $bin ]]; then
    echo "run_fuzzers: $bin not built" >&2
    failed+=("$t (not built)")
    continue
  fi
  # Regressions: each file once (libFuzzer runs the inputs it is given and exits).
  regs=()
  [[ -d $here/regressions/$t ]] && mapfile -t regs < <(find "$here/regressions/$t" -type f | sort)
  if ((${#regs[@]})); then
    if ! "$bin" -close_fd_mask=2 "${regs[@]}" >"$scratch/$t.reg.log" 2>&1; then
      echo "run_fuzzers: $t: a regression input fails:" >&2
      tail -30 "$scratch/$t.reg.log" >&2
      failed+=("$t (regression)")
      continue
    fi
  fi
  # Fuzzing from a copy of the seed corpus.
  mkdir -p "$scratch/corpus/$t"
  cp "$here/corpus/$t/"* "$scratch/corpus/$t/" 2>/dev/null || true
  if ! "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -close_fd_mask=2 \
       -artifact_prefix="$artifacts/$t-" "$scratch/corpus/$t" >"$scratch/$t.log" 2>&1; then
    echo "run_fuzzers: $t: a finding (input kept under $artifacts):" >&2
    tail -40 "$scratch/$t.log" >&2
    failed+=("$t")
    continue
  fi
  runs=$(grep -Eo 'Done [0-9]+ runs' "$scratch/$t.log" | grep -Eo '[0-9]+' | tail -1)
  cov=$(grep -Eo 'cov: [0-9]+' "$scratch/$t.log" | tail -1 | grep -Eo '[0-9]+')
  summary+=("$(printf '%-12s %3d regression inputs, %9s executions in %ss, coverage %s edges, corpus %d' \
    "$t" "${#regs[@]}" "${runs:-?}" "$seconds" "${cov:-?}" "$(ls "$scratch/corpus/$t" | wc -l)")")
done
printf 'fuzz: %s\n' "${summary[@]}" >&2
if ((${#failed[@]})); then
  echo "run_fuzzers: FAILED: ${failed[*]} (logs in $scratch)" >&2
  exit 1
fi
rm -rf "$scratch"
echo "run_fuzzers: ${#targets[@]} targets clean" >&2
