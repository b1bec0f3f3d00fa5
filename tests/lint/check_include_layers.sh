#!/usr/bin/env bash
# The folders of include/thinkv form layers: no include cycle between them (a header of folder A
# including folder B while a header of B includes A). Each subfolder is one node, each top-level
# header its own node; an edge A -> B is an `#include "thinkv/..."` from A's headers into B.
# tsort finds the cycles. Also: storage (backend/) sees only plain views, never the block table.
# Usage: check_include_layers.sh <project root>
set -euo pipefail
root=${1:-.}
cd "$root/include"
node_of() {  # thinkv/paged/layout.hpp -> paged ; thinkv/status.hpp -> status.hpp
  local rel=${1#thinkv/}
  if [[ $rel == */* ]]; then echo "${rel%%/*}"; else echo "$rel"; fi
}
edges=$(mktemp)
trap 'rm -f "$edges"' EXIT
while IFS= read -r file; do
  from=$(node_of "$file")
  echo "$from $from" >>"$edges"
  while IFS= read -r inc; do
    to=$(node_of "$inc")
    [[ $to != "$from" ]] && echo "$from $to" >>"$edges"
  done < <(sed -n 's/^#include "\(thinkv\/[^"]*\)".*/\1/p' "$file")
done < <(find thinkv -name '*.hpp' | sort)
status=0
if ! tsort "$edges" >/dev/null 2>"$edges.err"; then
  echo "FAIL: include cycle between folders of include/thinkv:"
  sed 's/^tsort: /  /' "$edges.err"
  echo "  edges (from -> to):"
  sort -u "$edges" | awk '$1 != $2 { print "    " $1 " -> " $2 }'
  status=1
fi
rm -f "$edges.err"
for f in thinkv/backend/*.hpp; do  # code lines only (comments may say what storage does not see)
  if sed 's://.*$::' "$f" | grep -n 'block_table\.hpp\|BlockTable' >/dev/null; then
    echo "FAIL: $f names the BlockTable; storage sees paged/storage_view.hpp only"
    status=1
  fi
done
[[ $status == 0 ]] && echo "include layers: no cycle between folders; backends see plain views only"
exit $status
