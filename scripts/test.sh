#!/usr/bin/env bash
# The test suite: set everything up (dev environment, default model pair, the vLLM profile) and run pytest.
# Extra arguments go to pytest (e.g. -k wire, -m "not real"). The main suite runs on
# ACESPEC_TEST_WORKERS pytest-xdist workers (default 2: most tests wait on sockets and subprocesses as much
# as they compute, so two workers on two cores finish in 0.64 of the serial time; 0 runs serially). The
# vLLM engine's tests run in the vLLM profile's own venv (.venv-vllm), after the rest;
# ACESPEC_SKIP_VLLM=1 leaves them out. Each part ends with its slowest tests (--durations), so a suite
# creeping past its 15 minutes says where the time went.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
scripts/setup-system.sh  # headless Chromium (tests/test_edge_page.py), HAProxy (tests/test_haproxy.py)
. scripts/lib.sh
step "install the default model pair (acespec models install)" "bash scripts/test.sh" -- .venv/bin/acespec models install --quiet
workers=${ACESPEC_TEST_WORKERS:-2}
xdist=(); [ "$workers" = 0 ] || xdist=(-n "$workers")
.venv/bin/python -m pytest -q --durations=12 "${xdist[@]}" "$@"
[ "${ACESPEC_SKIP_VLLM:-0}" = 1 ] && exit 0
scripts/setup.sh vllm
rc=0
ACESPEC_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q --durations=5 -p no:cacheprovider tests/test_vllm.py tests/test_vllm_board.py tests/test_vllm_eval.py tests/test_vllm_plugin_off.py tests/test_gpu_profile.py "$@" || rc=$?
[ "$rc" = 5 ] && rc=0  # arguments that select none of the vLLM tests (e.g. -k wire)
exit "$rc"
