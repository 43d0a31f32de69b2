#!/usr/bin/env bash
# The main job: set everything up, install the default model pair, run the edge-cloud demo.
# Extra arguments go to `acespec demo` (e.g. --profile transcontinental --prompt "...").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh runtime
.venv/bin/acespec models install --quiet >/dev/null
if .venv/bin/acespec demo --help >/dev/null 2>&1; then
  exec .venv/bin/acespec demo "$@"
fi
exec .venv/bin/acespec generate --chat --rule greedy --k 4 --max-tokens 96 \
  --prompt "Write a Python function that checks whether a number is prime." "$@"
