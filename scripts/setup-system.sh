#!/usr/bin/env bash
# The Debian packages the tests drive, as real programs: headless Chromium and its WebDriver for the
# web pages' browser tests (tests/test_edge_page.py, tests/test_ws_page.py), and HAProxy for the load-balancer tests and
# `acespec bench fleet` (tests/test_haproxy.py). Idempotent: returns at once when all are installed.
# Needs root (or sudo) for apt.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
if command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v haproxy >/dev/null; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "setup-system: need root or sudo to install chromium and haproxy" >&2; exit 2; }
  SUDO="sudo"
fi
echo "setup-system: installing chromium, chromium-driver and haproxy (apt)" >&2
export DEBIAN_FRONTEND=noninteractive
retry="bash scripts/setup-system.sh"
export STEP_QUIET=1  # apt's progress is noise; its output is shown if it fails
step "update Debian's package lists (apt-get update)" "$retry" -- $SUDO apt-get update -qq
step "install chromium, chromium-driver and haproxy from Debian's packages" "$retry" -- \
  $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver haproxy
