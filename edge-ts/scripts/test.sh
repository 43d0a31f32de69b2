#!/usr/bin/env bash
# The TypeScript edge's whole check, as CI runs it: the locked dependencies (no install scripts, nothing
# fetched beyond the npm registry), the build, then every test on the compiled output. Tests that need
# the real models or a Python with acespec skip, saying why, where those are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export NODE_LLAMA_CPP_SKIP_DOWNLOAD=true
npm ci --no-audit --no-fund --ignore-scripts
npm run build
# one test file at a time: the live ones start clouds and models, and the machine may have two cores
node --test --test-concurrency=1 dist/test/*.test.js
