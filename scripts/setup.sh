#!/usr/bin/env bash
# Create .venv and install AceSpec with pinned dependencies. Idempotent: a second run whose requirement
# files did not change returns at once. Usage: scripts/setup.sh runtime|dev|vllm
#   runtime  what `scripts/demo.sh` needs: AceSpec itself (pyproject's dependencies)
#   dev      runtime + the hf, eval and test extras: what `scripts/test.sh` needs
#   vllm     a second venv, .venv-vllm, with vLLM (scripts/setup-vllm.sh)
# What each profile installs is pyproject.toml's list (its dependencies and extras); the files in
# requirements/ only pin their versions (pip constraints), so the two cannot drift apart
# (tests/test_packaging.py checks every entry has a pin that satisfies it).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
profile="${1:-runtime}"
case "$profile" in
  runtime) extras="" ;;
  dev) extras="[dev]" ;;
  vllm) ;;
  *) echo "setup: no such profile: $profile (use runtime, dev or vllm)" >&2; exit 2 ;;
esac

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)" >&2; exit 2; }
if [ "$profile" = vllm ]; then PYTHON="$PY" exec bash scripts/setup-vllm.sh; fi

retry="bash scripts/setup.sh $profile"
venv=.venv
stamp="$venv/.acespec-${profile}"
want="$(cat requirements/build.txt requirements/runtime.txt requirements/dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/acespec" ]; then exit 0; fi

pins=(-c requirements/runtime.txt)
[ "$profile" = dev ] && pins+=(-c requirements/dev.txt)
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

echo "setup: installing the ${profile} environment into $venv (llama-cpp-python compiles once, ~8 min on 2 cores)" >&2
[ -x "$venv/bin/python" ] || step "create the virtual environment $venv with $PY" "$retry" -- "$PY" -m venv "$venv"
step "install the pinned build tools (requirements/build.txt: pip, setuptools, wheel)" "$retry" -- \
  "${pip[@]}" -r requirements/build.txt
step "install AceSpec and its pinned dependencies (pyproject.toml${extras:+ extras $extras}, pins in ${pins[*]})" "$retry" -- \
  "${pip[@]}" --no-build-isolation "${pins[@]}" -e ".${extras}"
step "check that AceSpec imports in $venv" "$retry" -- "$venv/bin/python" -c "import acespec.cli, acespec.edge.api"
echo "$want" > "$stamp"
