"""What exact passes cost on this machine: the target's pass times with and without them, side by side.

For each setting, in a process of its own (llama.cpp reads its kernel switches once per process), the
default target is loaded and timed on one context: a prompt prefill, a one-token step, and verify
passes of 5 and 14 rows (every row asked for), medians of a few interleaved repetitions.

    .venv/bin/python scripts/exact_passes_cost.py [--threads 2] [--context 330] [--reps 3]

Settings: `exact` (LlamaCppModel's default: flash attention, asked-for rows in passes of at most 7),
`exact-auto-steps` (the same with ACESPEC_STEP_THREADS=auto: one-token passes from position 256 on on
one thread, exact on several threads too; what that costs), `exact-pad-steps` (ACESPEC_STEP_THREADS=pad:
such passes keep every thread and get a pad row instead),
`loose` (ACESPEC_EXACT_PASSES=0: llama.cpp's own kernels and pass shapes), and the two llama.cpp
switches that would also give exact rows, for comparison: `tiled-off` (GGML_CPU_TILED_MM=0, exact
passes on) and `tiled-forced` (GGML_CPU_TILED_MM_FORCE=1, loose: every matmul through the tiled
kernel). docs/design-notes.md quotes its output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {
    "exact": {},
    "exact-auto-steps": {"ACESPEC_STEP_THREADS": "auto"},
    "exact-pad-steps": {"ACESPEC_STEP_THREADS": "pad"},
    "loose": {"ACESPEC_EXACT_PASSES": "0"},
    "tiled-off": {"GGML_CPU_TILED_MM": "0"},
    "tiled-forced": {"ACESPEC_EXACT_PASSES": "0", "GGML_CPU_TILED_MM_FORCE": "1"},
}


def measure(threads: int, context: int, reps: int) -> dict:
    """One setting (this process's environment): median seconds of each kind of pass."""
    import statistics
    import time

    import numpy as np

    from acespec.models.llama import LlamaCppModel
    from acespec.models.registry import DEFAULT_TARGET, model_path

    m = LlamaCppModel(model_path(DEFAULT_TARGET), n_ctx=max(1024, 2 * context), n_threads=threads)
    toks = [int(t) for t in np.random.default_rng(0).integers(100, 20000, context + 16)]
    times: dict[str, list[float]] = {"prefill": [], "step": [], "5 rows": [], "14 rows": []}

    def timed(key, fn):
        t0 = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t0)

    try:
        for _ in range(reps):
            m.reset()
            timed("prefill", lambda: m.eval(toks[:context], last=0))
            for key, n in (("step", 1), ("5 rows", 5), ("14 rows", 14)):
                m.rollback(context)
                timed(key, lambda n=n: m.eval(toks[context : context + n]))
    finally:
        m.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument("--context", type=int, default=330, help="tokens of context before the timed passes (default 330)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per setting (default 3)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"which (default {','.join(SETTINGS)})")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one setting in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.threads, args.context, args.reps)))
        return 0
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad:
        ap.error(f"unknown setting {bad[0]!r} (choose from {', '.join(SETTINGS)})")
    res = {}
    for name in names:
        env = {**os.environ, **SETTINGS[name]}
        out = subprocess.run([sys.executable, __file__, "--one", name, "--threads", str(args.threads), "--context",
                              str(args.context), "--reps", str(args.reps)], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"the default target, {args.threads} thread(s), {args.context} tokens of context, medians of {args.reps}:")
    print(f"{'setting':>16} " + " ".join(f"{k:>10}" for k in res[names[0]]))
    for name, r in res.items():
        print(f"{name:>16} " + " ".join(f"{1e3 * v:8.1f}ms" for v in r.values()))
    for a, b in (("exact", "loose"), ("exact-auto-steps", "exact"), ("exact-pad-steps", "exact")):
        if a in res and b in res:
            print(f"{a} / {b}: " + ", ".join(f"{k} {res[a][k] / res[b][k]:.2f}x" for k in res[a]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
