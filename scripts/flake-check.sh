#!/usr/bin/env bash
# The suite's flake check: clone this repository's HEAD into a fresh directory and run the README's test
# command there N times in a row (default 3), with a busy process pinned to core 0 beside it the whole
# time, as a loaded CI machine would have. Stops at the first failure; each run's log is kept.
#   bash scripts/flake-check.sh [N]        (logs: $TMPDIR/acespec-flake.*/runI.log)
set -euo pipefail
runs=${1:-3}
src=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/acespec-flake.XXXX")
git clone -q "$src" "$dir/repo"
cd "$dir/repo"
echo "flake-check: $(git rev-parse --short HEAD) in $dir/repo, $runs runs, a busy process on core 0" >&2
taskset -c 0 python3 -c "while True: pass" &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
  start=$SECONDS
  if bash scripts/test.sh > "$dir/run$i.log" 2>&1; then
    echo "flake-check: run $i passed in $((SECONDS - start)) s ($(grep -E '^[0-9]+ passed' "$dir/run$i.log" | head -1))" >&2
  else
    echo "flake-check: run $i FAILED after $((SECONDS - start)) s; see $dir/run$i.log" >&2
    tail -20 "$dir/run$i.log" >&2
    exit 1
  fi
done
echo "flake-check: $runs runs in a row passed" >&2
