#!/usr/bin/env bash
# Headless Chromium and its WebDriver for the web page's browser test (tests/test_edge_page.py), from
# Debian's packages. Idempotent: returns at once when both are installed. Needs root (or sudo) for apt.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "setup-browser: need root or sudo to install chromium" >&2; exit 2; }
  SUDO="sudo"
fi
echo "setup-browser: installing chromium and chromium-driver (apt)" >&2
export DEBIAN_FRONTEND=noninteractive
retry="bash scripts/setup-browser.sh"
export STEP_QUIET=1  # apt's progress is noise; its output is shown if it fails
step "update Debian's package lists (apt-get update)" "$retry" -- $SUDO apt-get update -qq
step "install chromium and chromium-driver from Debian's packages" "$retry" -- \
  $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver
