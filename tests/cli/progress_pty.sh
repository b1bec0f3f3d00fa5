#!/usr/bin/env bash
# `thinkv generate --progress` under a pseudo-terminal (stdout and stderr the same terminal, as in
# an interactive shell): the status line never erases the generated text (it is drawn only where
# the text has just ended a line, and erased before the text continues), and it is drawn at most
# 10 times a second. Uses the testbed model the repository ships; needs `script` (util-linux).
#   progress_pty.sh THINKV REPO_ROOT
set -u
thinkv=$1 repo=$2
fail() { echo "FAIL: $*"; exit 1; }
if ! command -v script >/dev/null 2>&1; then
  echo "SKIPPED: no 'script' (util-linux) to run under a pseudo-terminal"
  exit 0
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/thinkv_pty.XXXXXX") || fail "mktemp failed"
trap 'rm -rf "$tmp"' EXIT
args=(generate --model "$repo/models/testbed.bin" --problems "$repo/models/eval_public.jsonl" --problem 0
      --mode thinkv --steps 600 --threads 1)
# The reference text: no terminal, no progress.
"$thinkv" "${args[@]}" >"$tmp/plain.txt" 2>/dev/null || fail "generate exited $?"
start=$(date +%s.%N)
script -qfec "stty -onlcr; $(printf '%q ' "$thinkv" "${args[@]}") --progress" /dev/null >"$tmp/pty.txt" 2>&1 ||
  fail "generate under a pty exited $?: $(tail -c 400 "$tmp/pty.txt")"
end=$(date +%s.%N)
# Every status line starts a line (never in the middle of the text).
draws=$(grep -o 'thinkv generate: step' "$tmp/pty.txt" | wc -l)
mid=$(grep -aoP '[^\n\r]\rthinkv generate: step|[^\n\r]thinkv generate: step' "$tmp/pty.txt" | wc -l)
[ "$draws" -gt 0 ] || fail "no status line was drawn with --progress"
[ "$mid" -eq 0 ] || fail "$mid status lines were drawn in the middle of a text line"
# The text survives: drop the status lines and their erasures, keep what the text wrote.
perl -0pe 's/\rthinkv generate: step[^\r\n]*//g; s/\r *\r//g; s/\r//g' "$tmp/pty.txt" | head -c "$(wc -c <"$tmp/plain.txt")" >"$tmp/text.txt"
cmp -s "$tmp/plain.txt" "$tmp/text.txt" || fail "the text under the pty differs from the plain text: $(diff <(head -c 300 "$tmp/plain.txt") <(head -c 300 "$tmp/text.txt") | head -5)"
# At most 10 draws a second (+2 for the first and a forced one).
limit=$(awk -v s="$start" -v e="$end" 'BEGIN { printf "%d", (e - s) * 10 + 3 }')
[ "$draws" -le "$limit" ] || fail "$draws status lines in $(awk -v s="$start" -v e="$end" 'BEGIN{print e-s}') s: more than 10 a second"
# stdout to a file, stderr the terminal: the line is drawn as the text goes, still at most 10
# times a second although it is erased before every token's write.
start=$(date +%s.%N)
script -qfec "stty -onlcr; $(printf '%q ' "$thinkv" "${args[@]}") --progress >$(printf '%q' "$tmp/file.txt")" /dev/null \
  >"$tmp/err_pty.txt" 2>&1 || fail "generate with stdout to a file exited $?"
end=$(date +%s.%N)
cmp -s "$tmp/plain.txt" "$tmp/file.txt" || fail "stdout to a file differs from the plain text"
draws2=$(grep -o 'thinkv generate: step' "$tmp/err_pty.txt" | wc -l)
limit2=$(awk -v s="$start" -v e="$end" 'BEGIN { printf "%d", (e - s) * 10 + 3 }')
[ "$draws2" -gt 0 ] || fail "no status line on the terminal with stdout to a file"
[ "$draws2" -le "$limit2" ] || fail "$draws2 status lines in $(awk -v s="$start" -v e="$end" 'BEGIN{print e-s}') s with stdout to a file: more than 10 a second"
echo "progress under a pty: ok ($draws draws with the text on the terminal, $draws2 with it in a file)"
