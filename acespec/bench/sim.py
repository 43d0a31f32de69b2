"""`acespec bench sim`: replay recorded acceptance traces under device and network profiles.

    acespec bench sim --record [--n-prompts 4] [--max-tokens 96] [--out runs/traces/X.json]
    acespec bench sim [--traces PATH] [--profile edge-npu+h200] [--rtt 0,50,100,200] [--modes ...] [--json OUT]
    acespec bench sim --validate [--live wan.json] [--traces PATH]

`--record` runs the real model pair on HumanEval prompts (greedy, K = 4), stores per-position acceptance
and this machine's timings (see `acespec.sim.trace`). The default replays the newest trace file under
runs/traces/. `--validate` replays the `cpu-here` profile (this machine's measured timings, drafter and
target sharing the cores) and prints it next to live figures from `acespec bench wan --json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from acespec.argtypes import nonneg_float as _nonneg
from acespec.argtypes import parse_rtts
from acespec.argtypes import pos_int as _pos_int

DEFAULT_DIR = Path("runs/traces")
DEFAULT_RTTS = "0,50,100,200"


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `sim` to the `acespec bench` subcommands."""
    from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
    from acespec.sim.model import MODES_DEFAULT
    from acespec.sim.profiles import DEVICE_PROFILES

    profiles = ["cpu-here", *DEVICE_PROFILES]
    p = bench_subparsers.add_parser(
        "sim", help="trace-driven simulation of edge-cloud runs under device and network profiles",
        description="Record real per-position acceptance once (--record), then replay it under device profiles "
                    "(edge NPU / CPU drafter, cloud GPU verifier) and network profiles. --validate compares the "
                    "cpu-here profile with live `acespec bench wan --json` figures.",
    )
    act = p.add_mutually_exclusive_group()
    act.add_argument("--record", action="store_true", help="record traces from HumanEval prompts with the real models")
    act.add_argument("--validate", action="store_true", help="simulate cpu-here next to live figures (--live)")
    act.add_argument("--remeasure", action="store_true",
                     help="measure this machine's timings again into the trace file (--traces), keeping its acceptance")
    p.add_argument("--traces", help=f"trace file to replay (default: the newest {DEFAULT_DIR}/*.json)")
    p.add_argument("--profile", default="edge-npu+h200",
                   help=f"device profile(s), comma-separated, or 'all': {', '.join(profiles)} (default edge-npu+h200)")
    p.add_argument("--rtt", default=DEFAULT_RTTS, help=f"round-trip times in ms (default {DEFAULT_RTTS})")
    p.add_argument("--modes", default=",".join(MODES_DEFAULT),
                   help="comma-separated modes: cloud-only, sync, pipelined, each with optional +cache, +branches, "
                        f"+ideal, +adaptive, +ctrl (default {','.join(MODES_DEFAULT)})")
    p.add_argument("--k", type=_pos_int, default=4, help="draft depth (start depth for adaptive policies; default 4)")
    p.add_argument("--window", type=_pos_int, default=2, help="pipelined: blocks in flight (default 2)")
    p.add_argument("--net", default="wan", help="network profile for jitter/bandwidth/loss, RTT replaced by --rtt: "
                   "none (ideal link), lan, wan, transcontinental, lte (default wan: jitter 20 ms, up 5, down 20 Mbit/s, "
                   "as `bench wan`)")
    p.add_argument("--jitter-ms", type=_nonneg, help="override the round-trip jitter (ms)")
    p.add_argument("--up", help="override the uplink rate, e.g. 5mbit (0 = unlimited)")
    p.add_argument("--down", help="override the downlink rate, e.g. 20mbit (0 = unlimited)")
    p.add_argument("--seed", type=int, default=0, help="jitter / loss seed (default 0)")
    p.add_argument("--no-handshake", action="store_true", help="send the first DRAFT with HELLO (no WELCOME round trip)")
    p.add_argument("--json", metavar="OUT", help="also write the result (rows, sensitivity, assumptions) here")
    p.add_argument("--live", metavar="FILE", help="--validate: live figures from `acespec bench wan --json`")
    rec = p.add_argument_group("recording (--record)")
    rec.add_argument("--n-prompts", type=_pos_int, default=4, help="HumanEval problems (default 4)")
    rec.add_argument("--max-tokens", type=_pos_int, default=96, help="tokens per generation (default 96)")
    rec.add_argument("--out", help=f"trace file to write (default {DEFAULT_DIR}/humaneval-nN-tT-STAMP.json)")
    rec.add_argument("--prompt-style", choices=["sim", "eval"], default="sim",
                     help="sim: 'Complete this Python function: ...' (default); eval: the eval harness / bench wan "
                          "template (use it to validate against `bench wan`)")
    rec.add_argument("--draft", default=DEFAULT_DRAFT, help=f"drafter model (default {DEFAULT_DRAFT})")
    rec.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    rec.add_argument("--n-ctx", type=_pos_int, default=2048, help="context window for llama.cpp models (default 2048)")
    rec.add_argument("--no-timings", action="store_true", help="skip measuring this machine's timings")
    p.set_defaults(func=cmd_bench_sim)
    return p


# ------------------------------------------------------------------------------------------ helpers
def newest_trace(directory: Path = DEFAULT_DIR) -> Path:
    files = sorted(directory.glob("*.json"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise ValueError(f"no trace files in {directory}/; record some with `acespec bench sim --record`")
    return files[-1]


def _net(args, rtt: float = 0.0):
    from acespec.net.profile import PROFILES, WanProfile, parse_rate

    if args.net == "none":
        base = WanProfile()
    elif args.net in PROFILES:
        base = PROFILES[args.net]
    else:
        raise ValueError(f"--net: unknown network profile {args.net!r}; choose none, {', '.join(PROFILES)}")
    kw = {"rtt_ms": rtt, "jitter_ms": base.jitter_ms, "up_bps": base.up_bps, "down_bps": base.down_bps,
          "loss_pct": base.loss_pct, "seed": args.seed}
    if args.jitter_ms is not None:
        kw["jitter_ms"] = args.jitter_ms
    if args.up is not None:
        kw["up_bps"] = parse_rate(args.up)
    if args.down is not None:
        kw["down_bps"] = parse_rate(args.down)
    return WanProfile(**kw)


def _devices(spec: str, timings: dict):
    from acespec.sim.profiles import DEVICE_PROFILES, device_profile

    names = ["cpu-here", *DEVICE_PROFILES] if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    if spec.strip() == "all" and not timings:
        names.remove("cpu-here")
    return [device_profile(n, timings) for n in names]


def _modes(text: str) -> list[str]:
    from acespec.sim.model import parse_mode

    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        parse_mode(m)  # validate
    if not modes:
        raise ValueError("--modes: give at least one mode")
    return list(dict.fromkeys(modes))


# ------------------------------------------------------------------------------------------ commands
def cmd_bench_sim(args: argparse.Namespace) -> int:
    if args.record:
        return _record(args)
    if args.validate:
        return _validate(args)
    if args.remeasure:
        return _remeasure(args)
    return _simulate(args)


def _record(args) -> int:
    from acespec.models import load_model
    from acespec.sim.trace import humaneval_prompts, record_traces

    out = Path(args.out) if args.out else DEFAULT_DIR / f"humaneval-n{args.n_prompts}-t{args.max_tokens}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    t0 = time.perf_counter()
    target = load_model(args.target, n_ctx=args.n_ctx)
    draft = load_model(args.draft, n_ctx=args.n_ctx)
    try:
        if args.prompt_style == "eval":
            from acespec.bench.wan import humaneval_prompts as eval_prompts

            prompts = eval_prompts(target.tokenizer, args.n_prompts)
        else:
            prompts = [(pid, list(target.tokenizer.chat_prompt([{"role": "user", "content": text}])))
                       for pid, text in humaneval_prompts(args.n_prompts)]
        ts = record_traces(target, draft, prompts, max_tokens=args.max_tokens, k=4, timings=not args.no_timings,
                           progress=lambda s: print(s, file=sys.stderr))
    finally:
        draft.close()
        target.close()
    ts.meta["prompt_style"] = args.prompt_style
    ts.meta["elapsed_s"] = round(time.perf_counter() - t0, 2)
    ts.save(out)
    print(f"wrote {out} ({len(ts.prompts)} prompts, {sum(p.n for p in ts.prompts)} tokens, "
          f"engine agreement {ts.meta['engine_agreement']}, {ts.meta['elapsed_s']} s)")
    return 0


def _remeasure(args) -> int:
    from acespec.models import load_model
    from acespec.sim.trace import measure_timings, system_load

    path, ts = _load(args)
    if not ts.prompts:
        raise ValueError(f"{path} holds no prompts")
    first = ts.prompts[0]
    target = load_model(args.target, n_ctx=args.n_ctx)
    draft = load_model(args.draft, n_ctx=args.n_ctx)
    try:
        load0 = system_load()
        t0 = time.perf_counter()
        tim = measure_timings(target, draft, list(first.prompt_tokens) + list(first.tokens))
        tim["measure_s"] = round(time.perf_counter() - t0, 2)
    finally:
        draft.close()
        target.close()
    tim["load_avg_before"], tim["load_avg_after"] = load0, system_load()
    ts.timings = tim
    ts.save(path)
    print(f"updated timings in {path}: draft {1e3 * tim['draft_s_per_token']:.1f} ms/token, verify K=0..8 "
          + ", ".join(f"{1e3 * v:.0f}" for v in tim["verify_s"]) + f" ms, contention draft x{tim.get('contention_draft', 1):.2f} "
          f"verify x{tim.get('contention_verify', 1):.2f}; load average {tim['load_avg_before']} -> {tim['load_avg_after']}")
    return 0


def _load(args):
    from acespec.sim.trace import TraceSet

    path = Path(args.traces) if args.traces else newest_trace()
    return path, TraceSet.load(path)


def _simulate(args) -> int:
    from acespec.sim.report import format_assumptions, format_table, run_grid

    path, ts = _load(args)
    devices = _devices(args.profile, ts.timings)
    rtts = parse_rtts(args.rtt)
    modes = _modes(args.modes)
    net = _net(args)
    result = run_grid(ts.prompts, devices, rtts, modes, k=args.k, window=args.window, net=net,
                      handshake=not args.no_handshake)
    print(f"acespec bench sim: {path} ({len(ts.prompts)} prompts, {sum(p.n for p in ts.prompts)} tokens; "
          f"{ts.drafter} -> {ts.target}, greedy)")
    print(format_assumptions(devices, net, args.k, args.window))
    print()
    print(format_table(result))
    if args.json:
        doc = {"traces": str(path), "assumptions": format_assumptions(devices, net, args.k, args.window).splitlines(),
               "config": {"k": args.k, "window": args.window, "rtts": rtts, "modes": modes, "net": net.describe(),
                          "handshake": not args.no_handshake}, **result}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


def _validate(args) -> int:
    from acespec.net.profile import profile_from_args
    from acespec.sim.profiles import device_profile
    from acespec.sim.report import format_validation, parse_live, run_grid, validation_rows

    path, ts = _load(args)
    dev = device_profile("cpu-here", ts.timings)
    live_rows, live_cfg = [], {}
    if args.live:
        live_rows, live_cfg = parse_live(json.loads(Path(args.live).read_text()))
    rtts = sorted({r["rtt_ms"] for r in live_rows}) if live_rows else parse_rtts(args.rtt)
    modes = list(dict.fromkeys(r["mode"] for r in live_rows)) if live_rows else ["cloud-only", "sync", "pipelined"]
    k = int(live_cfg.get("k", args.k))
    window = int(live_cfg.get("window", args.window))
    net = _net(args)
    if "profile" in live_cfg:  # replay the network the live run used
        net = profile_from_args(live_cfg["profile"], rtt=0, seed=args.seed)  # None = the ideal link
    result = run_grid(ts.prompts, [dev], rtts, modes, k=k, window=window, net=net, handshake=not args.no_handshake)
    print(f"acespec bench sim --validate: {path}; {dev.describe()}")
    print(f"network {net.describe()}; K = {k}, window = {window}")
    if live_rows:
        lp = live_cfg.get("max_tokens")
        if lp and lp != ts.meta.get("max_tokens"):
            print(f"note: live max_tokens {lp} vs trace {ts.meta.get('max_tokens')}: compare with care")
        rows = validation_rows(result["rows"], live_rows)
        print(format_validation(rows))
    else:
        rows = validation_rows(result["rows"], [])
        print("(no --live file: simulated figures only)")
        print(format_validation(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"traces": str(path), "device": dev.describe(), "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


