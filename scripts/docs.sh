#!/usr/bin/env bash
# Build the documentation site (MkDocs + Material) into site/, with --strict: a broken link, a page
# missing from the nav or a nav entry with no page fails the build. Usage: scripts/docs.sh [mkdocs args]
#   bash scripts/docs.sh                 # build site/ (the first run creates .venv-docs: about a minute)
#   bash scripts/docs.sh serve           # preview at http://127.0.0.1:8000 (instead of build)
# The docs profile lives in its own venv, .venv-docs, so it needs neither the runtime's compiled
# llama-cpp-python nor .venv: pyproject's `docs` extra (MkDocs, the theme), pinned by requirements/docs.txt,
# and the runtime dependencies the reference pages import (AceSpec's CLI parser, its HTTP app's OpenAPI
# schema, its Prometheus registries), pinned by requirements/runtime.txt. AceSpec itself is read from this
# checkout (docs/hooks/reference.py puts it on sys.path), so the pages always describe the code beside them.
set -euo pipefail
export NO_MKDOCS_2_WARNING=1  # the theme's banner about its successor, at every build
cd "$(dirname "$0")/.."
. scripts/lib.sh

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "docs: Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)" >&2; exit 2; }

venv=.venv-docs
retry="bash scripts/docs.sh"
stamp="$venv/.acespec-docs"
want="$(cat requirements/runtime.txt requirements/docs.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/mkdocs" ]; }; then
  echo "docs: installing the docs profile into $venv" >&2
  [ -x "$venv/bin/python" ] || step "create the virtual environment $venv with $PY" "$retry" -- "$PY" -m venv "$venv"
  # what to install: pyproject's docs extra and its runtime dependencies, less the one that compiles
  mapfile -t reqs < <("$venv/bin/python" - <<'EOF'
import tomllib
from pathlib import Path
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
for r in project["optional-dependencies"]["docs"] + project["dependencies"]:
    if not r.lower().replace("_", "-").startswith("llama-cpp-python"):
        print(r)
EOF
)
  step "install the docs profile (pyproject's docs extra, runtime dependencies; pins: requirements/docs.txt, runtime.txt)" \
    "$retry" -- "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -c requirements/runtime.txt -c requirements/docs.txt "${reqs[@]}"
  echo "$want" > "$stamp"
fi

if [ "${1:-}" = serve ]; then shift; exec "$venv/bin/mkdocs" serve "$@"; fi
exec "$venv/bin/mkdocs" build --strict "$@"
