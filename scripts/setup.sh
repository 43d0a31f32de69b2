#!/usr/bin/env bash
# Create .venv and install AceSpec with pinned dependencies. Idempotent: a second run whose
# requirement files did not change returns at once. Usage: scripts/setup.sh runtime|dev|vllm
# (vllm: a second venv, .venv-vllm, with vLLM; see scripts/setup-vllm.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:-runtime}"
req="requirements/${profile}.txt"
[ -f "$req" ] || [ "$profile" = vllm ] || { echo "setup: no such profile: $profile (use runtime, dev or vllm)" >&2; exit 2; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 or newer is required" >&2; exit 2; }
if [ "$profile" = vllm ]; then PYTHON="$PY" exec bash scripts/setup-vllm.sh; fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.acespec-${profile}"
want="$(cat requirements/runtime.txt requirements/dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

echo "setup: installing the ${profile} environment into .venv (llama-cpp-python compiles once, ~8 min on 2 cores)" >&2
# this machine's pip config lists local index folders that may not exist; pip warns once per package
quiet() {
  local rc=0
  "$@" > >(grep -v "^WARNING: Location 'file://" >&2 || true) 2>&1 || rc=$?
  return "$rc"
}
quiet .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade "pip==25.3"
quiet .venv/bin/python -m pip install -q --disable-pip-version-check -r "$req"
quiet .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
