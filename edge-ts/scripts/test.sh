#!/usr/bin/env bash
# The TypeScript edge's whole check, as CI runs it: the locked dependencies (no install scripts, nothing
# fetched beyond the npm registry), the build, then every test on the compiled output. Tests that need
# the real models or a Python with acespec skip, saying why, where those are missing. Last, the browser
# edge: its bundle, and its test in headless Chromium against a live cloud (a pytest file: the Python side
# starts the cloud and drives the browser).
set -euo pipefail
cd "$(dirname "$0")/.."
export NODE_LLAMA_CPP_SKIP_DOWNLOAD=true
npm ci --no-audit --no-fund --ignore-scripts
npm run build
# one test file at a time: the live ones start clouds and models, and the machine may have two cores
node --test --test-concurrency=1 dist/test/*.test.js
npm run build:web
py="${ACESPEC_PYTHON:-$(cd .. && pwd)/.venv/bin/python}"
if (cd .. && "$py" -c "import pytest, acespec") 2>/dev/null; then
  (cd .. && "$py" -m pytest -q -s -p no:cacheprovider tests/test_wasm_edge_page.py)
else
  echo "test.sh: no Python with pytest and acespec ($py; set ACESPEC_PYTHON): the browser edge's test did not run" >&2
fi
