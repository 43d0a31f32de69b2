#!/usr/bin/env bash
# The GPU check (vLLM issue): what a verify pass costs on a CUDA GPU, for the simulator's device profile.
# Made for a lent GPU machine with no network that receives only the working tree: it needs nothing but
# the machine's own python3 with torch and transformers, builds random-weight Qwen2.5-1.5B and -7B shapes
# there, and measures t(B sessions x T new tokens) for B <= 64, T = K + 1 <= 9 (acespec/bench/gpu_profile.py).
#   bash scripts/gpu-check.sh            # writes $OUT/gpu-profile.json and $OUT/gpu-check.log (OUT defaults to .)
# Commit the JSON as docs/results/device-profiles/<gpu>.json; `acespec.sim.profiles.measured_cloud` reads it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 python3 -m acespec.bench.gpu_profile \
  --shapes "${SHAPES:-1.5b,7b}" --out "$out/gpu-profile.json" "$@" 2>&1 | tee "$out/gpu-check.log"
