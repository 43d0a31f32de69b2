"""`acespec bench capacity`: how many edges one cloud GPU serves, simulated (see `acespec.sim.capacity`).

    acespec bench capacity [--n 1,4,16,64,256,1024] [--modes cloud-only,sync,acespec] [--gpu-profile FILE]
                           [--traces PATH] [--out DIR]

Every edge runs the live edge's loop on virtual time, replaying recorded acceptance traces; the cloud
batches every session's next block into one pass priced by a batched GPU cost curve (an assumed H200
curve, or the one `scripts/gpu-check.sh` measured). Prints, per mode and N, per-user tokens/s, cloud
GPU-seconds per 1,000 tokens and how busy the GPU is; then users served per GPU at >= 20 tokens/s each.
`--out DIR` writes capacity.json, capacity.txt and capacity.png there.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

from acespec.argtypes import pos_int
from acespec.bench.sim import _modes
from acespec.sim.capacity import H200_1P5B, RTT_MIX, TARGET_TOK_S, GpuCost, sweep, users_served
from acespec.sim.profiles import DEVICE_PROFILES
from acespec.sim.trace import TraceSet

DEFAULT_TRACES = "humaneval-n4-t256.json"  # bundled with the package (acespec/sim/traces/)
DEFAULT_NS = "1,4,16,64,256,1024"


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "capacity",
        help="simulated: N edges on one cloud GPU, per-user speed and GPU cost",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--n", default=DEFAULT_NS, help=f"edge counts, comma-separated (default {DEFAULT_NS})")
    p.add_argument(
        "--modes",
        default="cloud-only,sync,acespec",
        help="simulator modes (`bench sim --modes`), default cloud-only,sync,acespec",
    )
    p.add_argument("--traces", default=DEFAULT_TRACES, help=f"trace file the edges replay (default {DEFAULT_TRACES})")
    p.add_argument(
        "--edge",
        default="edge-npu+h200",
        choices=sorted(DEVICE_PROFILES),
        help="device profile whose edge timings every edge uses (default edge-npu+h200)",
    )
    p.add_argument(
        "--gpu-profile",
        metavar="FILE",
        help="a measured device profile (scripts/gpu-check.sh) instead of the assumed H200 curve",
    )
    p.add_argument("--shape", default="1.5b", help="--gpu-profile: which model shape's passes to fit (default 1.5b)")
    p.add_argument("--seed", type=int, default=0, help="RTT draws, arrivals, jitter (default 0)")
    p.add_argument("--out", metavar="DIR", help="write capacity.json, capacity.txt and capacity.png here")
    p.set_defaults(func=cmd_bench_capacity)
    return p


def _ns(text: str) -> list[int]:
    try:
        ns = sorted({pos_int(x) for x in text.split(",") if x.strip()})
    except (argparse.ArgumentTypeError, ValueError):
        raise ValueError(f"--n: {text!r} is not a comma-separated list of positive integers") from None
    if not ns:
        raise ValueError("--n: give at least one edge count")
    return ns


def cmd_bench_capacity(args: argparse.Namespace) -> int:
    ns, modes = _ns(args.n), _modes(args.modes)
    gpu = GpuCost.from_profile(args.gpu_profile, args.shape) if args.gpu_profile else H200_1P5B
    edge = DEVICE_PROFILES[args.edge]
    ts = TraceSet.load(args.traces)
    t0 = time.perf_counter()

    def progress(row: dict) -> None:
        print(
            f"  N = {row['n_edges']:>5} {row['mode']:<12} p10 {row['user_tok_s_p10']:7.2f} tok/s  "
            f"({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )

    rows = sweep(ts.prompts, ns, modes, gpu, edge, seed=args.seed, progress=progress)
    served = {m: users_served(rows, m) for m in modes}
    buf = io.StringIO()
    with redirect_stdout(buf):
        print(
            f"acespec bench capacity: {len(ts.prompts)} traces from {args.traces}, modes {', '.join(modes)}, "
            f"N = {', '.join(map(str, ns))}"
        )
        print(f"edge: {edge.describe()}")
        print(f"cloud: {gpu.describe()}")
        for note in gpu.notes:
            print(f"  - {note}")
        print(
            "RTTs: "
            + ", ".join(f"{share:.0%} {lo:g}-{hi:g} ms" for share, (lo, hi) in RTT_MIX)
            + "; jitter 10 ms, up 5 Mbit/s, down 20 Mbit/s; arrivals over the first second"
        )
        print()
        print(
            f"{'N':>5}  {'mode':<12} {'tok/s mean':>10} {'p10':>7} {'p50':>7} {'GPU s/1k tok':>12} {'GPU busy':>8} "
            f"{'sess/pass':>9} {'>= 20 tok/s':>11}"
        )
        for r in rows:
            print(
                f"{r['n_edges']:>5}  {r['mode']:<12} {r['user_tok_s_mean']:>10.2f} {r['user_tok_s_p10']:>7.2f} "
                f"{r['user_tok_s_p50']:>7.2f} {r['gpu_s_per_1k_tokens']:>12.3f} {r['gpu_busy']:>8.2f} "
                f"{r['sessions_per_pass']:>9.2f} {r['served']:>5}/{r['n_edges']:<5}"
            )
        print()
        # a mode that still serves the largest N simulated may serve more: say so rather than cap it
        print(
            f"users served per GPU at >= {TARGET_TOK_S:g} tokens/s each (10th percentile user, largest N simulated): "
            + ", ".join(f"{m} {'>= ' if served[m] == max(ns) else ''}{served[m]}" for m in modes)
        )
    text = buf.getvalue()
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "traces": args.traces,
            "edge": edge.describe(),
            "gpu": gpu.describe(),
            "gpu_notes": list(gpu.notes),
            "rtt_mix": [[s, list(b)] for s, b in RTT_MIX],
            "rows": rows,
            "users_served": served,
            "target_tok_s": TARGET_TOK_S,
            "command": "acespec bench capacity " + " ".join(sys.argv[3:]),
        }
        (out / "capacity.json").write_text(json.dumps(doc, indent=2))
        (out / "capacity.txt").write_text(text)
        _plot(rows, modes, out / "capacity.png", gpu.name)
        print(f"wrote {out}/capacity.json, capacity.txt, capacity.png")
    return 0


def _plot(rows: list[dict], modes: list[str], path: Path, gpu_name: str) -> None:
    import matplotlib  # heavy: the eval extra (plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: the eval extra (plots)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        ns = [r["n_edges"] for r in rs]
        a.plot(ns, [r["user_tok_s_p10"] for r in rs], marker="o", label=m)
        b.plot(ns, [r["gpu_s_per_1k_tokens"] for r in rs], marker="o", label=m)
    a.axhline(TARGET_TOK_S, color="grey", ls="--", lw=1)
    for ax, title, ylabel in (
        (a, "10th-percentile user", "tokens/s per user"),
        (b, "cloud cost", "GPU-seconds per 1,000 tokens"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("edges on one GPU")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    b.set_yscale("log")
    fig.suptitle(f"simulated capacity: {gpu_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
