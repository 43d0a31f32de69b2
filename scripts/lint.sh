#!/usr/bin/env bash
# The static checks, as CI and the pre-commit hooks run them: ruff's lint rules, ruff's formatting (checked,
# never rewritten here) and mypy, each on the acespec package, with the pinned tools of the dev profile's
# .venv (scripts/setup.sh dev). Their settings are pyproject.toml's [tool.ruff] and [tool.mypy].
# Runs all three and exits non-zero if any failed, so one run shows every problem.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
if [ ! -x "$bin/ruff" ] || [ ! -x "$bin/mypy" ]; then
  echo "lint: $bin/ruff or $bin/mypy is missing: run scripts/setup.sh dev (it installs the pinned tools)" >&2
  exit 2
fi
rc=0
echo "lint: ruff check acespec" >&2
"$bin/ruff" check acespec || rc=1
echo "lint: ruff format --check acespec" >&2
"$bin/ruff" format --check acespec || rc=1
echo "lint: mypy acespec" >&2
"$bin/mypy" acespec || rc=1
[ "$rc" = 0 ] && echo "lint: all passed" >&2
exit "$rc"
