#!/usr/bin/env bash
# The GPU check (vLLM issue): what a verify pass costs on a CUDA GPU, for the simulator's device profile,
# and one study cell: a speculative step under each rule of SAMPLERS' list (default strict,cactus), i.e. that
# pass plus the rejection sampling AceSpec's vLLM plugin runs for the rule, next to the reference strict.
# Made for a lent GPU machine with no network that receives only the working tree: it needs nothing but
# the machine's own python3 with torch and transformers (plus array_api_compat, which the rules use: where
# the machine lacks it, carry .venv/lib/python3.11/site-packages/array_api_compat and it is found there),
# builds random-weight Qwen2.5-1.5B and -7B shapes there, and measures t(B sessions x T new tokens) for
# B <= 64, T = K + 1 <= 9 (acespec/bench/gpu_profile.py).
#   bash scripts/gpu-check.sh            # writes $OUT/gpu-profile.json and $OUT/gpu-check.log (OUT defaults to .)
# Commit the JSON as docs/results/device-profiles/<gpu>.json; `acespec.sim.profiles.measured_cloud` reads it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
extra=""
if ! python3 -c "import array_api_compat" 2>/dev/null; then
  for d in .venv/lib/python3*/site-packages; do
    if [ -d "$d/array_api_compat" ]; then  # only that package from the carried folder, not the venv's others
      extra="$(mktemp -d)"
      ln -s "$PWD/$d/array_api_compat" "$extra/array_api_compat"
      break
    fi
  done
fi
PYTHONPATH="$PWD${extra:+:$extra}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 python3 -m acespec.bench.gpu_profile \
  --shapes "${SHAPES:-1.5b,7b}" --rules "${SAMPLERS:-strict,cactus}" --out "$out/gpu-profile.json" "$@" 2>&1 | tee "$out/gpu-check.log"
