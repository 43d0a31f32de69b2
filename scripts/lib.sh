# Shared by the set-up scripts (source it): run each set-up step so that a failure says which step,
# which package, and the command to retry, not a pip traceback alone.

# this machine's pip config lists local index folders that may not exist; pip warns once per package
_setup_filter() { grep -v "^WARNING: Location 'file://" || true; }

# step "what it does" RETRY-COMMAND -- command args...
# Runs the command, its output shown as it comes (unless STEP_QUIET=1) and kept in a log; on failure
# prints the step, the package pip names, the log's tail and the retry command, and exits with the
# command's status.
step() {
  local what="$1" retry="$2"; shift 3
  local log; log="$(mktemp "${TMPDIR:-/tmp}/acespec-setup.XXXXXX")"
  local rc
  set +e
  if [ "${STEP_QUIET:-0}" = 1 ]; then "$@" >"$log" 2>&1; else "$@" 2>&1 | tee "$log" | _setup_filter >&2; fi
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" = 0 ]; then rm -f "$log"; return 0; fi
  {
    echo
    echo "setup: FAILED: $what (exit $rc)"
    local pkg
    pkg="$(grep -oE "(Failed to build|Failed building wheel for|satisfies the requirement|No matching distribution found for|Could not build wheels for|error: subprocess-exited-with-error.*|Building wheel for) [A-Za-z0-9_.-]+" "$log" \
           | grep -v "exited-with-error" | tail -n 1 | awk '{print $NF}')" || true
    [ -n "$pkg" ] && echo "setup: the package that failed: $pkg"
    echo "setup: the last lines of its output (all of it: $log):"
    _setup_filter <"$log" | tail -n 25 | sed 's/^/    /'
    echo "setup: fix what it names, then retry with: $retry"
    echo "       (steps that already succeeded are quick the second time)"
  } >&2
  exit "$rc"
}
