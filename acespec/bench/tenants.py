"""`acespec bench tenants`: N concurrent edges against one cloud, the capacity benchmark.

    acespec bench tenants --n 1,2,4,8,16 --max-tokens 48 --json docs/results/bench-tenants.json

What a cloud does with many edges is a property of the cloud, so the edges here are replay clients,
not drafters: each replays the real drafter's blocks from an acceptance trace (`acespec bench sim
--record`), speaking the real wire protocol over loopback, and sleeps each block's recorded drafting
time before sending it, so the cores go to the cloud as they would with real devices.

How a replay edge replays a trace, and why that is exact: `bench/replay_edge.py`.

Modes: `acespec` (pipelined, 2 blocks in flight, K = 4), `sync` (stop-and-wait), `cloud-only` (the
cloud generates and streams). Engines: `batched` (the default `acespec serve`) and `serial` (the old
one-session-at-a-time server, the baseline). Per cell it reports aggregate committed tokens/s, mean
per-session tokens/s, verdict latency p50/p99 (DRAFT sent -> VERDICT in; for cloud-only the gap
between streamed tokens), target passes per token, and the KV memory the engine held.

The never-slower grid (the cloud-led bar): `--rtt 0,100,250` runs every cell at each RTT through the
WAN emulator (`net/wan.py`, the `wan` profile with that RTT), `--temperature T` makes the sessions
coupled at T (with greedy traces cloud-led and cloud-only only, whose chain is then the greedy one,
which the sampled stream leaves; with traces recorded coupled at T every mode, each chain the
drafter's coupled one), and
`--repeats R` runs each cell R times with the modes interleaved run by run. The report then ends with
cloud-led's per-session tok/s against cloud-only's in every (RTT, N) cell, the worst cell, and how many
texts differ from cloud-only's:

    acespec bench tenants --n 1,4,8 --rtt 0,100,250 --modes cloud-led,cloud-only --serial-modes '' \
        --shared-n '' --invariance 0 --temperature 1.0 --repeats 2 --max-tokens 64

Same text whatever the load: `--invariance` runs each session alone and then all of them at once,
greedy and coupled, on the batch-invariant engine and on the plain one (one unified KV cache, the
"before"), and counts the tokens that differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

from acespec.argtypes import parse_rtts, pos_int
from acespec.bench.edges import (
    DEFAULT_TRACES,
    MODES,
    _ints,
    _modes,
    bundled_traces,
    run_edges,
    wan_port,
)
from acespec.bench.replay_edge import WINDOW, K
from acespec.bench.tenants_report import _line, plot, report
from acespec.bench.vllm import cmd_tenants_vllm
from acespec.cloud.engine import make_engine
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.loop.verifier import TargetVerifier
from acespec.models.llama import LlamaCppModel
from acespec.models.registry import DEFAULT_TARGET, installed_path, resolve

ENGINES = ("batched", "serial")


def _target(engine: str, n_slots: int, n_ctx: int):
    """The default target as each engine runs it: `batched` (exact: one KV stream per session),
    `shared` (one unified KV cache, one pass for every session), `serial` (one sequence)."""
    path = installed_path(DEFAULT_TARGET) or resolve(DEFAULT_TARGET, auto_install=True).path
    if path is None:  # resolve installs a registry model or raises
        raise RuntimeError(f"{DEFAULT_TARGET} is not installed")
    if engine == "serial":
        return LlamaCppModel(path, n_ctx=n_ctx, name=DEFAULT_TARGET)
    if engine == "shared":  # one unified cache holds every session: give it room for all of them
        return LlamaCppModel(path, n_ctx=n_ctx * n_slots, n_slots=n_slots, batch_invariant=False, name=DEFAULT_TARGET)
    return LlamaCppModel(path, n_ctx=n_ctx, n_slots=n_slots, batch_invariant=True, name=DEFAULT_TARGET)


def run_cell(
    engine,
    traces,
    mode: str,
    n: int,
    *,
    cap_s: float = 120.0,
    max_tokens: int = 48,
    rtt_ms: float = 0.0,
    lead_memory=None,
    **kw,
) -> dict:
    """`run_edges` against a fresh in-process server on `engine`, plus the engine's own figures. With
    `rtt_ms` > 0 the edges reach it through the WAN emulator (the `wan` profile at that RTT: jitter,
    5 Mbit/s up, 20 down), as `bench wan` does; 0 is loopback. `lead_memory`: the cloud-led pricer's
    memory (`CloudServer.lead_memory`) to start from and add to, as a server that ran the cells before
    this one would hold it."""
    target = engine.target
    # every replay edge connects from 127.0.0.1: lift the per-address connection limit past N
    cfg = ServerConfig(
        port=0,
        max_sessions=max(n, 1),
        max_new_tokens=max_tokens,
        idle_timeout_s=cap_s + 60,
        max_connections=max(256, 2 * n),
        max_connections_per_addr=max(32, 2 * n),
    )
    with CloudServerThread(engine, cfg) as srv, contextlib.ExitStack() as stack:
        if lead_memory is not None:
            srv.server.lead_memory = lead_memory
        port = wan_port(stack, srv.port, rtt_ms)
        row = run_edges(
            port,
            traces,
            mode,
            n,
            model_id=target.tokenizer.fingerprint,
            vocab=target.vocab_size,
            cap_s=cap_s,
            max_tokens=max_tokens,
            rtt_s=rtt_ms / 1e3,
            **kw,
        )
        m = engine.metrics()
    kv_b = m.get("kv_bytes_per_token", 0)
    name = "shared" if engine.name == "batched" and not getattr(engine.target, "batch_invariant", True) else engine.name
    return {
        "engine": name,
        **row,
        "rtt_ms": rtt_ms,
        "temperature": kw.get("temperature", 0.0),
        "kv_peak_mb": m.get("kv_peak", 0) * kv_b / 2**20,
        "kv_alloc_mb": m.get("kv_tokens_allocated", 0) * kv_b / 2**20,
        "engine_metrics": m,
    }


class _RowLog:
    """Digests of every target row block the rules see, per session (keyed by prompt), while active:
    a changed row flips a verdict only at a near-tie, so rows are the sensitive witness."""

    def __init__(self) -> None:
        self.rows: dict[tuple, list[str]] = {}

    def __enter__(self) -> _RowLog:
        self._cls, self._real = TargetVerifier, TargetVerifier.finish
        real, rows = self._real, self.rows

        def finish(v, job, logits, seconds):
            rows.setdefault(tuple(v.tokens[: v.prompt_len]), []).append(
                hashlib.sha1(np.ascontiguousarray(logits, dtype=np.float32).tobytes()).hexdigest()
            )
            return real(v, job, logits, seconds)

        TargetVerifier.finish = finish  # type: ignore[method-assign]  # records every pass's rows while the cell runs
        return self

    def __exit__(self, *exc) -> None:
        self._cls.finish = self._real  # type: ignore[method-assign]  # puts the real method back


def invariance(model, traces, n: int, *, max_tokens: int, draft_s: float, cap_s: float, slots: int) -> list[dict]:
    """Each of n sessions alone, then all n at once, greedy and coupled: tokens, and target rows, that differ."""
    rows = []
    for rule, temp in (("greedy", 0.0), ("coupled", 0.8)):
        alone = {}
        with _RowLog() as solo_rows:
            for i in range(n):
                r = run_cell(
                    make_engine("batched", model, slots=slots),
                    [traces[i % len(traces)]],
                    "acespec",
                    1,
                    rule=rule,
                    temperature=temp,
                    max_tokens=max_tokens,
                    draft_s=draft_s,
                    cap_s=cap_s,
                    seed=i,
                )
                alone[traces[i % len(traces)].id] = next(iter(r["outputs"].values()))
        with _RowLog() as together_rows:
            together = run_cell(
                make_engine("batched", model, slots=slots),
                traces[:n],
                "acespec",
                n,
                rule=rule,
                temperature=temp,
                max_tokens=max_tokens,
                draft_s=draft_s,
                cap_s=cap_s,
                seed=0,
            )
        differ = total = sessions_differ = 0
        for pid, toks in together["outputs"].items():
            ref = alone[pid]
            d = sum(a != b for a, b in zip(toks, ref)) + abs(len(toks) - len(ref))
            differ += d
            total += max(len(toks), len(ref))
            sessions_differ += d > 0
        row_total = row_differ = 0
        for key, got in together_rows.rows.items():
            ref = solo_rows.rows.get(key, [])
            row_total += len(got)
            row_differ += sum(a != b for a, b in zip(got, ref)) + max(0, len(got) - len(ref))
        rows.append(
            {
                "rule": rule,
                "temperature": temp,
                "n": n,
                "tokens": total,
                "tokens_differ": differ,
                "sessions_differ": sessions_differ,
                "row_blocks": row_total,
                "row_blocks_differ": row_differ,
                "errors": together["errors"],
            }
        )
    return rows


def add_parser(sub) -> None:
    p = sub.add_parser("tenants", help="N concurrent edges against one cloud: aggregate tok/s, latency, passes, KV")
    p.add_argument("--n", default="1,2,4,8,16", help="concurrent edges per cell (default 1,2,4,8,16)")
    p.add_argument("--modes", default=",".join(MODES), help=f"batched-engine modes (default {','.join(MODES)})")
    p.add_argument(
        "--serial-modes", default="acespec", help="modes run on the old serial server too ('' = none; default acespec)"
    )
    p.add_argument("--serial-n", default="1,2,4,8", help="N for the serial server (default 1,2,4,8)")
    p.add_argument(
        "--shared-n",
        default="1,8",
        help="N for the shared-pass engine (one unified KV cache; not batch-invariant), acespec mode ('' = none)",
    )
    p.add_argument("--max-tokens", type=pos_int, default=48, help="tokens per session (default 48)")
    p.add_argument(
        "--rtt",
        default="0",
        help="round-trip times in ms, comma-separated: each cell runs at each through the WAN "
        "emulator's `wan` profile (0: loopback; default 0)",
    )
    p.add_argument(
        "--repeats",
        type=pos_int,
        default=1,
        help="runs of each (RTT, N) cell, the modes interleaved run by run (A B A B), so a drift in the "
        "machine's speed falls on every mode alike; ratios compare the modes' means (default 1)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy sessions; > 0: coupled sessions at this temperature (the same text as "
        "cloud-only), whose replayed greedy chain the sampled stream leaves wherever it samples another "
        "token: lower acceptance than greedy's",
    )
    p.add_argument("--traces", default=DEFAULT_TRACES, help=f"acceptance traces to replay (default {DEFAULT_TRACES})")
    p.add_argument("--draft-ms", type=float, help="drafting time per token (default: the trace file's measured figure)")
    p.add_argument(
        "--cap",
        type=float,
        default=120.0,
        help="seconds per cell; a capped cell counts what it committed (default 120)",
    )
    p.add_argument(
        "--tick-tokens", type=pos_int, default=256, help="batched engine's token budget per tick (default 256)"
    )
    p.add_argument(
        "--invariance",
        type=int,
        default=8,
        metavar="N",
        help="also count tokens that differ between N sessions alone and together (0 = skip; default 8)",
    )
    p.add_argument("--json", metavar="OUT", help="write every figure (and the outputs) here")
    p.add_argument("--plot", metavar="PNG", help="plot aggregate tok/s and p99 latency against N")
    p.add_argument(
        "--engine",
        choices=("llama", "vllm"),
        default="llama",
        help="llama (default): the batched, shared and serial engines on the default GGUF target; "
        "vllm: the vLLM engine (run from .venv-vllm; see bench/vllm.py)",
    )
    p.add_argument(
        "--target", help="vllm: a Hugging Face model directory (default: a tiny random Qwen2 built on the spot)"
    )
    p.add_argument("--seed", type=int, default=0, help="vllm: prompts and drawn acceptance (default 0)")
    p.add_argument(
        "--lead-k",
        type=int,
        default=8,
        help="vllm: cloud-led sessions in vLLM's own speculative decoding, up to K draft tokens a step (0: as "
        "verify requests; default 8, as serve)",
    )
    p.set_defaults(func=cmd_tenants)


def cmd_tenants(args) -> int:
    if args.engine == "vllm":
        if args.temperature:
            raise ValueError("--temperature is not yet available with --engine vllm (its replayed edges are greedy)")

        return cmd_tenants_vllm(args)
    if args.target:
        raise ValueError("--target is for --engine vllm (the llama engines run the default GGUF target)")

    ns, modes, serial_modes, serial_ns = (
        _ints(args.n),
        _modes(args.modes),
        _modes(args.serial_modes),
        _ints(args.serial_n),
    )
    shared_ns = _ints(args.shared_n)

    rtts = parse_rtts(args.rtt)
    if not args.temperature >= 0:
        raise ValueError("--temperature must be >= 0")
    rule = "greedy" if args.temperature == 0 else "coupled"
    if args.invariance < 0:
        raise ValueError("--invariance must be >= 0")
    if not args.cap > 0:
        raise ValueError("--cap must be > 0")
    path = Path(args.traces)
    ts = bundled_traces(args.traces)
    traces = ts.prompts
    if ts.rule == "coupled" and args.temperature != ts.temperature:
        raise ValueError(
            f"{args.traces} was recorded coupled at T = {ts.temperature:g}, each prompt at its own seed: "
            f"replay it with --temperature {ts.temperature:g}"
        )
    if (
        args.temperature
        and ts.rule == "greedy"
        and (set(modes) - {"cloud-led", "cloud-only"} or serial_ns and serial_modes or shared_ns or args.invariance)
    ):
        raise ValueError(
            "--temperature > 0 with greedy traces runs the cloud-led and cloud-only modes only (a replayed "
            "edge-led block is exact only for the rule its trace was recorded with): give --modes "
            "cloud-led,cloud-only --serial-modes '' --shared-n '' --invariance 0, or traces recorded with "
            "`bench sim --record --temperature T`"
        )
    if ts.rule == "coupled" and args.invariance:
        raise ValueError("--invariance draws its own seeds; run it with greedy traces (--invariance 0 here)")
    draft_s = args.draft_ms / 1e3 if args.draft_ms is not None else float(ts.timings.get("draft_s_per_token", 0.03))
    if not draft_s >= 0:
        raise ValueError("--draft-ms must be >= 0")
    n_ctx = max(len(t.prompt_tokens) for t in traces) + args.max_tokens + 2 * K + 16
    n_ctx = (n_ctx + 255) // 256 * 256

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    rows: list[dict] = []
    slots = max(ns + shared_ns + [args.invariance])
    result = {
        "command": "acespec bench tenants " + " ".join(sys.argv[3:]),
        "traces": str(path),
        "draft_s_per_token": draft_s,
        "max_tokens": args.max_tokens,
        "k": K,
        "window": WINDOW,
        "tick_tokens": args.tick_tokens,
        "rtts_ms": rtts,
        "temperature": args.temperature,
        "rule": rule,
        "trace_rule": ts.rule,
        "repeats": args.repeats,
    }
    edge_kw = dict(draft_s=draft_s, cap_s=args.cap, rule=rule, temperature=args.temperature)

    def cells(kind: str, cell_ns: list[int], cell_modes: list[str]) -> None:
        if not cell_ns or not cell_modes:
            return
        model = _target(kind, slots, n_ctx)

        def engine():
            if kind == "serial":
                # every cell starts cold on both engines: the serial engine's one sequence would otherwise
                # still hold the last cell's prompt, which the next cell replays, and skip its prefill
                # (one session at 0.38 s to its first verdict against the batched engine's 2.2 s, all of
                # the 0.53x bench-tenants once showed between them)
                model.reset()
                return make_engine("serial", model)
            return make_engine("batched", model, slots=slots, tick_tokens=args.tick_tokens)

        # one cloud-led pricer memory for the engine's cells, as one long-running server would hold: a
        # fresh one per cell would make every N = 1 session a server's first
        memory: OrderedDict = OrderedDict()
        try:
            run_cell(engine(), traces, cell_modes[0], 1, max_tokens=8, lead_memory=memory, **edge_kw)  # warm-up
            for rtt in rtts:
                for n in cell_ns:
                    for rep in range(args.repeats):
                        # odd repeats run the modes in reverse: a mode always run first (on a fresh
                        # engine, after another cell) would carry whatever that costs into every ratio
                        for mode in cell_modes if rep % 2 == 0 else cell_modes[::-1]:
                            r = run_cell(
                                engine(),
                                traces,
                                mode,
                                n,
                                max_tokens=args.max_tokens,
                                rtt_ms=rtt,
                                lead_memory=memory,
                                **edge_kw,
                            )
                            r["repeat"] = rep
                            rows.append(r)
                            say(_line(r))
            if args.invariance and kind != "serial":
                key = "after" if kind == "batched" else "before"
                result.setdefault("invariance", {})[key] = invariance(
                    model,
                    traces,
                    args.invariance,
                    max_tokens=args.max_tokens,
                    draft_s=draft_s,
                    cap_s=args.cap,
                    slots=slots,
                )
        finally:
            model.close()

    cells("batched", ns, modes)
    cells("shared", shared_ns, ["acespec"])
    cells("serial", serial_ns, serial_modes)
    result["rows"] = rows
    print(report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=float))
    if args.plot:
        plot(result, args.plot)
    return 0


def demo_capacity(
    port: int, *, model_id: str, vocab: int, auth: bytes, n: int = 4, max_tokens: int = 24, traces=None
) -> str:
    """For `acespec demo`: N replayed edges against the demo's running cloud, AceSpec then cloud-only.
    `traces` (a TraceSet) defaults to the committed traces of the default model pair."""
    ts = traces or bundled_traces()
    draft_s = float(ts.timings.get("draft_s_per_token", 0.03))
    rows = {
        mode: run_edges(
            port,
            ts.prompts,
            mode,
            n,
            model_id=model_id,
            vocab=vocab,
            auth=auth,
            max_tokens=max_tokens,
            draft_s=draft_s,
            cap_s=300.0,
        )
        for mode in ("acespec", "cloud-only")
    }
    a, c = rows["acespec"], rows["cloud-only"]
    out = [
        f"=== one cloud, {n} edges at once ({max_tokens} tokens each, drafts replayed from recorded drafter traces) ===",
        f"{'':24s}{'AceSpec':>12s}{'cloud-only':>14s}",
        f"{'aggregate tokens/s':24s}{a['agg_tok_s']:12.2f}{c['agg_tok_s']:14.2f}",
        f"{'target passes / token':24s}{a['passes_per_token']:12.3f}{c['passes_per_token']:14.3f}",
        f"{'verdict latency p99 (s)':24s}{a['lat_p99_s']:12.3f}{c['lat_p99_s']:14.3f}",
        f"{'AceSpec vs cloud-only':24s}{a['agg_tok_s'] / max(c['agg_tok_s'], 1e-9):11.2f}x",
        "note: full figures for N = 1..16 and the old serial server: `acespec bench tenants` (docs/results/bench-tenants.txt)",
    ]
    for r in (a, c):
        if r["errors"]:
            out.append(f"errors ({r['mode']}): {r['errors'][:2]}")
    return "\n".join(out)
