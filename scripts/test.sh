#!/usr/bin/env bash
# The test suite: set everything up (dev environment, default model pair) and run pytest.
# Extra arguments go to pytest (e.g. -k wire, -m "not real").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
scripts/setup-browser.sh  # headless Chromium for tests/test_edge_page.py
.venv/bin/acespec models install --quiet >/dev/null
exec .venv/bin/python -m pytest -q "$@"
