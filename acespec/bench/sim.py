"""`acespec bench sim`: replay recorded acceptance traces under device and network profiles.

    acespec bench sim --record [--n-prompts 4] [--max-tokens 96] [--out runs/traces/X.json]
    acespec bench sim [--traces PATH] [--profile edge-npu+h200] [--rtt 0,50,100,200] [--modes ...] [--json OUT]
    acespec bench sim --validate [--n-prompts 2] [--max-tokens 64] [--rtt 0,200] [--live F] [--cost F] [--traces F]

`--record` runs the real model pair on HumanEval prompts (greedy, K = 4) and stores per-position
acceptance (see `acespec.sim.trace`). The default replays the newest trace file under runs/traces/
through the live edge's own loop on virtual time (`acespec.sim.edge`).

`--validate` checks the simulator against the live system on this machine, like with like: with the
pair loaded on split cores (drafter and target one core each, as two devices), it calibrates this
machine's profile (`bench cost`), records traces of the very prompts and lengths the live side runs,
runs `bench acespec --cores split` live, simulates the same variants and RTTs, and prints both side by
side; its last line is the largest tokens/s error over modes and RTTs. Any of the three inputs can be
given instead (`--cost`, `--traces`, `--live`); what it measured is kept under runs/validate-STAMP/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from acespec.argtypes import nonneg_float as _nonneg
from acespec.argtypes import parse_rtts
from acespec.argtypes import pos_int as _pos_int
from acespec.bench.acespec_bench import POLICY_VARIANTS, VARIANTS
from acespec.bench.cost import calibrate, fit_line
from acespec.bench.wan import BenchConfig, caveat, humaneval_prompts, load_pair, run_wan_bench
from acespec.bench.wan import humaneval_prompts as eval_prompts
from acespec.draft.cache import DRAFTER_SLOTS
from acespec.models import load_model
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from acespec.net.profile import PROFILES, WanProfile, parse_rate, profile_from_args
from acespec.sim.edge import MODES_DEFAULT, parse_mode, simulate
from acespec.sim.profiles import DEVICE_PROFILES, DeviceProfile, device_profile
from acespec.sim.report import (
    format_assumptions,
    format_table,
    format_validation,
    max_error,
    parse_live,
    run_grid,
    validation_rows,
)
from acespec.sim.trace import TraceSet, dataset_prompts, record_traces

DEFAULT_DIR = Path("runs/traces")
DEFAULT_RTTS = "0,50,100,200"
VALIDATE_RTTS = "0,200"
CALIBRATION_SIZES = list(
    range(1, 13)
)  # drafter and target calls of 1..12 tokens: blocks up to K = 11, batches up to 12


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `sim` to the `acespec bench` subcommands."""
    profiles = ["cpu-here", *DEVICE_PROFILES]
    p = bench_subparsers.add_parser(
        "sim",
        help="trace-driven simulation of edge-cloud runs under device and network profiles",
        description="Record real per-position acceptance once (--record), then replay it under device profiles "
        "(edge NPU / CPU drafter, cloud GPU verifier) and network profiles. --validate compares the "
        "cpu-here profile with live `acespec bench wan --json` figures.",
    )
    act = p.add_mutually_exclusive_group()
    act.add_argument(
        "--record",
        action="store_true",
        help="record traces from HumanEval (or --dataset sharegpt) prompts with the real models",
    )
    act.add_argument(
        "--validate",
        action="store_true",
        help="calibrate, record, run live on split cores and simulate the same runs; print the errors",
    )
    p.add_argument("--traces", help=f"trace file to replay (default: the newest {DEFAULT_DIR}/*.json)")
    p.add_argument(
        "--profile",
        default="edge-npu+h200",
        help=f"device profile(s), comma-separated, or 'all': {', '.join(profiles)} (default edge-npu+h200)",
    )
    p.add_argument("--rtt", help=f"round-trip times in ms (default {DEFAULT_RTTS}; --validate: {VALIDATE_RTTS})")
    p.add_argument(
        "--modes",
        default=",".join(MODES_DEFAULT),
        help="comma-separated modes: cloud-only, sync, pipelined, each with optional +cache, +branches, "
        "+plus2minus1, +ctrl, +autowin and :k=N, or `bench acespec`'s variant names "
        f"(default {','.join(MODES_DEFAULT)})",
    )
    p.add_argument(
        "--k", type=_pos_int, default=4, help="draft depth (start depth for plus2minus1 and the controller; default 4)"
    )
    p.add_argument("--window", type=_pos_int, default=2, help="pipelined: blocks in flight (default 2)")
    p.add_argument(
        "--net",
        default="wan",
        help="network profile for jitter/bandwidth/loss, RTT replaced by --rtt: "
        "none (ideal link), lan, wan, transcontinental, lte (default wan: jitter 20 ms, up 5, down 20 Mbit/s, "
        "as `bench wan`); varying: replayed as it is, switching between its two links every 10 s",
    )
    p.add_argument("--jitter-ms", type=_nonneg, help="override the round-trip jitter (ms)")
    p.add_argument("--up", help="override the uplink rate, e.g. 5mbit (0 = unlimited)")
    p.add_argument("--down", help="override the downlink rate, e.g. 20mbit (0 = unlimited)")
    p.add_argument("--seed", type=int, default=0, help="jitter / loss seed (default 0)")
    p.add_argument("--json", metavar="OUT", help="also write the result (rows, sensitivity, assumptions) here")
    val = p.add_argument_group("validation (--validate)")
    val.add_argument(
        "--live", metavar="FILE", help="live figures from `acespec bench acespec --json` instead of running them"
    )
    val.add_argument(
        "--cost",
        metavar="FILE",
        help="this machine's calibration from `acespec bench cost --sizes 1-12 --json` instead of measuring it",
    )
    rec = p.add_argument_group("recording (--record, --validate)")
    rec.add_argument("--n-prompts", type=_pos_int, help="prompts (default 4; --validate: 2)")
    rec.add_argument(
        "--dataset",
        choices=["humaneval", "sharegpt"],
        default="humaneval",
        help="--record: HumanEval problems (default; code, high acceptance) or ShareGPT first user turns "
        "(chat, low acceptance; the bundled dataset package, seeded shuffle)",
    )
    rec.add_argument("--max-tokens", type=_pos_int, help="tokens per generation (default 96; --validate: 64)")
    rec.add_argument(
        "--temperature",
        type=_nonneg,
        default=0.0,
        help="--record: 0 (default) records greedy traces; > 0 records coupled ones at this temperature, "
        "prompt i at session seed i (the seed `bench tenants` gives its i-th edge), so replayed edges "
        "draft what a coupled drafter would",
    )
    rec.add_argument("--out", help=f"trace file to write (default {DEFAULT_DIR}/DATASET-nN-tT-STAMP.json)")
    rec.add_argument(
        "--prompt-style",
        choices=["sim", "eval"],
        default="sim",
        help="sim: 'Complete this Python function: ...' (default); eval: the eval harness / bench wan "
        "template (use it to validate against `bench wan`)",
    )
    rec.add_argument("--draft", default=DEFAULT_DRAFT, help=f"drafter model (default {DEFAULT_DRAFT})")
    rec.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    rec.add_argument("--n-ctx", type=_pos_int, default=2048, help="context window for llama.cpp models (default 2048)")
    rec.add_argument("--no-timings", action="store_true", help="skip measuring this machine's timings")
    rec.add_argument(
        "--cores",
        choices=["shared", "split"],
        default=None,
        help="--validate: how the pair shares this machine's cores (default split: one core each, as two devices)",
    )
    p.set_defaults(func=cmd_bench_sim)
    return p


# ------------------------------------------------------------------------------------------ helpers
def newest_trace(directory: Path = DEFAULT_DIR) -> Path:
    files = sorted(directory.glob("*.json"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise ValueError(f"no trace files in {directory}/; record some with `acespec bench sim --record`")
    return files[-1]


def _net(args, rtt: float = 0.0):
    if args.net == "none":
        base = WanProfile()
    elif args.net in PROFILES:
        base = PROFILES[args.net]
    else:
        raise ValueError(f"--net: unknown network profile {args.net!r}; choose none, {', '.join(PROFILES)}")
    if base.varies:  # a varying link is replayed as it is: its phases carry their own RTTs and rates
        if args.jitter_ms is not None or args.up is not None or args.down is not None:
            raise ValueError("--jitter-ms, --up and --down do not apply to a varying --net profile")
        return dataclasses.replace(base, seed=args.seed)
    kw = {
        "rtt_ms": rtt,
        "jitter_ms": base.jitter_ms,
        "up_bps": base.up_bps,
        "down_bps": base.down_bps,
        "loss_pct": base.loss_pct,
        "seed": args.seed,
    }
    if args.jitter_ms is not None:
        kw["jitter_ms"] = args.jitter_ms
    if args.up is not None:
        kw["up_bps"] = parse_rate(args.up)
    if args.down is not None:
        kw["down_bps"] = parse_rate(args.down)
    return WanProfile(**kw)


def _devices(spec: str, timings: dict):
    names = (
        ["cpu-here", *DEVICE_PROFILES] if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    )
    if spec.strip() == "all" and not timings:
        names.remove("cpu-here")
    return [device_profile(n, timings) for n in names]


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        parse_mode(m)  # validate
    if not modes:
        raise ValueError("--modes: give at least one mode")
    return list(dict.fromkeys(modes))


# ------------------------------------------------------------------------------------------ commands
def cmd_bench_sim(args: argparse.Namespace) -> int:
    if args.temperature and not args.record:
        raise ValueError("--temperature applies to --record (a replay takes the temperature its trace was recorded at)")
    if args.record:
        return _record(args)
    if args.validate:
        return _validate(args)
    return _simulate(args)


def _record(args) -> int:
    args.n_prompts = args.n_prompts or 4
    args.max_tokens = args.max_tokens or 96

    if args.dataset == "sharegpt" and args.prompt_style == "eval":
        raise ValueError("--prompt-style eval is HumanEval's template; ShareGPT prompts are chat turns already")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    temp = f"-T{args.temperature:g}" if args.temperature else ""
    out = (
        Path(args.out)
        if args.out
        else DEFAULT_DIR / f"{args.dataset}-n{args.n_prompts}-t{args.max_tokens}{temp}-{stamp}.json"
    )
    texts = dataset_prompts(args.dataset, args.n_prompts)
    t0 = time.perf_counter()
    target = load_model(args.target, n_ctx=args.n_ctx)
    draft = load_model(args.draft, n_ctx=args.n_ctx)
    try:
        if args.prompt_style == "eval":
            prompts = eval_prompts(target.tokenizer, args.n_prompts)
        else:
            prompts = [
                (pid, list(target.tokenizer.chat_prompt([{"role": "user", "content": text}]))) for pid, text in texts
            ]
        ts = record_traces(
            target,
            draft,
            prompts,
            max_tokens=args.max_tokens,
            k=4,
            timings=not args.no_timings,
            progress=lambda s: print(s, file=sys.stderr),
            temperature=args.temperature,
        )
    finally:
        draft.close()
        target.close()
    ts.meta["prompt_style"] = args.prompt_style
    ts.meta["dataset"] = args.dataset
    ts.meta["elapsed_s"] = round(time.perf_counter() - t0, 2)
    ts.save(out)
    print(
        f"wrote {out} ({len(ts.prompts)} prompts, {sum(p.n for p in ts.prompts)} tokens, "
        f"engine agreement {ts.meta['engine_agreement']}, {ts.meta['elapsed_s']} s)"
    )
    return 0


def _load(args):
    path = Path(args.traces) if args.traces else newest_trace()
    return path, TraceSet.load(path)


def _simulate(args) -> int:
    path, ts = _load(args)
    devices = _devices(args.profile, ts.timings)
    rtts = parse_rtts(args.rtt or DEFAULT_RTTS)
    modes = _modes(args.modes)
    net = _net(args)
    if net.varies:
        if args.rtt:
            raise ValueError("--rtt does not apply to a varying --net profile (its phases have their own)")
        rtts = [net.rtt_ms]
    result = run_grid(ts.prompts, devices, rtts, modes, k=args.k, window=args.window, net=net)
    print(
        f"acespec bench sim: {path} ({len(ts.prompts)} prompts, {sum(p.n for p in ts.prompts)} tokens; "
        f"{ts.drafter} -> {ts.target}, greedy)"
    )
    print(format_assumptions(devices, net, args.k, args.window))
    print()
    print(format_table(result))
    if args.json:
        doc = {
            "traces": str(path),
            "assumptions": format_assumptions(devices, net, args.k, args.window).splitlines(),
            "config": {
                "k": args.k,
                "window": args.window,
                "rtts": rtts,
                "modes": modes,
                "net": net.describe(),
            },
            **result,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


def _validate(args) -> int:
    if args.dataset != "humaneval":
        raise ValueError("--validate runs `bench wan`'s HumanEval prompts live; --dataset applies to --record")
    n_prompts, max_tokens = args.n_prompts or 2, args.max_tokens or 64
    rtts = parse_rtts(args.rtt or VALIDATE_RTTS)
    variants = _modes(args.modes)
    out_dir = Path("runs") / f"validate-{time.strftime('%Y%m%d-%H%M%S')}"
    cost = json.loads(Path(args.cost).read_text()) if args.cost else None
    ts = TraceSet.load(args.traces) if args.traces else None
    live = json.loads(Path(args.live).read_text()) if args.live else None
    if cost is None or ts is None or live is None:
        cost, ts, live = _measure(args, cost, ts, live, n_prompts, max_tokens, rtts, variants, out_dir)
    live_rows, live_cfg = parse_live(live)
    dev = DeviceProfile.from_cost(cost)
    if live_cfg.get("rtts"):
        rtts = sorted(float(r) for r in live_cfg["rtts"])
    live_modes = [m for m in variants if any(r["mode"] == m for r in live_rows)]
    if not live_modes:
        raise ValueError(f"the live figures hold none of the modes {', '.join(variants)}")
    net = _live_net(live_cfg.get("profile", "wan"), args.seed)
    k, window = int(live_cfg.get("k", args.k)), int(live_cfg.get("window", args.window))
    result = run_grid(ts.prompts, [dev], rtts, live_modes, k=k, window=window, net=net)
    rows = validation_rows(result["rows"], live_rows)
    print(
        f"acespec bench sim --validate: {len(ts.prompts)} prompt(s) x {max(p.n for p in ts.prompts)} tokens, "
        f"K = {k}, window = {window}, network {net.describe()} with RTT {', '.join(f'{r:g}' for r in rtts)} ms"
    )
    print(dev.describe())
    print(format_validation(rows))
    err = max_error(rows)
    hit = [abs(r["hit_rate_points"]) for r in rows if r.get("hit_rate_points") is not None]
    if hit:
        print(f"largest cache hit-rate difference: {max(hit):.1f} points")
    # which part of the error is the calibration and which the model of the protocol: the same
    # simulation with the costs the live runs themselves measured
    retimed, scales = _retime(dev, live, ts.prompts, net, k, window)
    rows2, err2 = [], None
    if retimed is not None:
        rows2 = validation_rows(
            run_grid(ts.prompts, [retimed], rtts, live_modes, k=k, window=window, net=net)["rows"], live_rows
        )
        err2 = max_error(rows2)
        print(
            f"\nthe same, with the costs the live runs measured (target step x{scales['verify']:.2f}, drafting "
            f"x{scales['draft']:.2f}, prompt prefill {scales['prefill_s']:+.2f} s against the calibration):"
        )
        print(format_validation(rows2))
        print("max |sim/live - 1| with live costs = " + ("-" if err2 is None else f"{100 * err2:.1f}%"))
    if args.json:
        write = {
            "device": dev.describe(),
            "cost": cost,
            "rtts": rtts,
            "modes": live_modes,
            "rows": rows,
            "max_tok_s_error": err,
            "traces": [p.id for p in ts.prompts],
            "live_costs": {"scales": scales, "rows": rows2, "max_tok_s_error": err2},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(write, indent=2))
        print(f"wrote {args.json}")
    print("max |sim/live - 1| = " + ("-" if err is None else f"{100 * err:.1f}%"))
    return 0


def _retime(dev, live: dict, traces, net, k: int, window: int):
    """`dev` with its costs scaled to what the live runs measured: a target step from the cloud-only
    runs' median inter-token time (the verdicts' own verify times include queueing in the engine, behind
    the prompt's prefill among others, so they overstate a pass), the drafter's critical-path drafting
    time of the live sync runs against the same runs simulated, and the cloud-only time to first token
    (the prompt's prefill). Returns (profile, the scales), or (None, None) without per-run records."""
    runs = [r for r in live.get("runs", []) if not r.get("error")]
    if not runs:
        return None, None  # a summary without its runs: nothing to take the costs from
    lo = min(r["rtt_ms"] for r in runs)
    by_id = {t.id: t for t in traces}
    at_lo = dataclasses.replace(net, rtt_ms=lo)
    scales = {"verify": 1.0, "draft": 1.0, "prefill_s": 0.0}
    co = [r for r in runs if r["mode"] == "cloud-only" and r["rtt_ms"] == lo and r["prompt_id"] in by_id]
    if co:
        sim = [simulate(by_id[r["prompt_id"]], dev, at_lo, parse_mode("cloud-only")).stats for r in co]
        scales["verify"] = statistics.median(r["itl_p50_s"] for r in co) / statistics.median(
            s.inter_token_latency()[0] for s in sim
        )
        scales["prefill_s"] = sum(r["ttft_s"] - s.ttft_s for r, s in zip(co, sim)) / len(co)
    sync = [r for r in runs if r["mode"] == "sync" and r["rtt_ms"] == lo and r["prompt_id"] in by_id]
    if sync:
        sim = [simulate(by_id[r["prompt_id"]], dev, at_lo, parse_mode("sync", k=k, window=window)).stats for r in sync]
        scales["draft"] = sum(r["draft_s"] for r in sync) / max(1e-9, sum(s.draft_s for s in sim))
    f_v, f_d = scales["verify"], scales["draft"]
    prompt = sum(t.prompt_len for t in traces) / len(traces)
    out = dev.replace(
        name=f"{dev.name}, live costs",
        verify_c0_s=dev.verify_c0_s * f_v,
        verify_c1_s=dev.verify_c1_s * f_v,
        verify_table_s=tuple(x * f_v for x in dev.verify_table_s),
        verify_row_s=dev.verify_row_s * f_v,
        draft_s_per_token=dev.draft_s_per_token * f_d,
        draft_table_s=tuple(x * f_d for x in dev.draft_table_s),
        draft_choose_s=dev.draft_choose_s * f_d,
        target_prefill_s_per_token=max(
            0.0, dev.target_prefill_s_per_token + scales["prefill_s"] / max(1.0, prompt - 1)
        ),
    )
    return out, scales


def _mean_cost(a: dict, b: dict) -> dict:
    """Two calibrations of the same sizes, averaged number by number (the line fits refitted)."""
    out = {**a, "calibrations": [a, b]}
    out["models"] = {}
    for role in a["models"]:
        secs = [(x + y) / 2 for x, y in zip(a["models"][role]["seconds"], b["models"][role]["seconds"])]
        c0, c1 = fit_line(a["sizes"], secs)
        out["models"][role] = {**a["models"][role], "seconds": secs, "c0_s": c0, "c1_s": c1}
    out["prefill"] = {k: (a["prefill"][k] + b["prefill"][k]) / 2 for k in a["prefill"]}
    out["rows"] = {k: (a["rows"][k] + b["rows"][k]) / 2 for k in a["rows"]}
    if "engine" in a and "engine" in b:
        out["engine"] = {
            "ks": a["engine"]["ks"],
            "verify_s": [(x + y) / 2 for x, y in zip(a["engine"]["verify_s"], b["engine"]["verify_s"])],
        }
        if "first_token_s" in a["engine"] and "first_token_s" in b["engine"]:
            out["engine"]["first_token_s"] = (a["engine"]["first_token_s"] + b["engine"]["first_token_s"]) / 2
    return out


def _live_net(profile: str | None, seed: int):
    """The network the live run went through (its RTT replaced per row); None or `none`: an ideal link."""
    return (profile_from_args(profile, rtt=0, seed=seed) if profile else None) or WanProfile()


def _measure(
    args, cost, ts, live, n_prompts: int, max_tokens: int, rtts: list[float], variants: list[str], out_dir: Path
):
    """Whatever the validation was not given, measured here with the pair loaded on split cores; each
    input is saved under `out_dir` so the comparison can be rerun from files."""
    cores = args.cores or "split"
    print(caveat(cores), file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft, target = load_pair(args.draft, args.target, n_ctx=args.n_ctx, cores=cores, draft_slots=DRAFTER_SLOTS)
    try:
        prompts = humaneval_prompts(target.tokenizer, n_prompts)  # the live bench's prompts and template
        calibrating = cost is None
        if calibrating:
            print("calibrating this machine (bench cost) ...", file=sys.stderr)
            cost = {
                "prompt": prompts[0][0],
                "cores": cores,
                **calibrate(draft, target, prompts[0][1], CALIBRATION_SIZES, 5, "median"),
            }
            (out_dir / "cost-before.json").write_text(json.dumps(cost, indent=2))
        if ts is None:
            print("recording traces of the same prompts and lengths ...", file=sys.stderr)
            ts = record_traces(
                target,
                draft,
                prompts,
                max_tokens=max_tokens,
                k=4,
                timings=False,
                progress=lambda s: print(s, file=sys.stderr),
            )
            ts.meta["prompt_style"] = "eval"
            ts.save(out_dir / "traces.json")
        if live is None:
            known = {**VARIANTS, **POLICY_VARIANTS}
            unknown = [v for v in variants if v not in known and v not in ("cloud-only", "sync", "pipelined")]
            if unknown:
                raise ValueError(
                    f"--validate runs `bench acespec` variants live; {', '.join(unknown)} is not one "
                    f"(choose from {', '.join(known)})"
                )
            cfg = BenchConfig(
                rtts=rtts,
                modes=variants,
                profile="wan",
                k=args.k,
                window=args.window,
                max_tokens=max_tokens,
                variants=known,
                cores=cores,
            )
            live = run_wan_bench(draft, target, prompts, cfg)
            live["cores"] = cores
            (out_dir / "live.json").write_text(json.dumps(live, indent=2))
        if calibrating:
            # this machine's speed drifts by 15% and more within minutes: calibrate again after the live
            # runs and take the mean of the two, so the profile describes the time the runs took place
            print("calibrating again after the live runs ...", file=sys.stderr)
            cost = _mean_cost(cost, calibrate(draft, target, prompts[0][1], CALIBRATION_SIZES, 5, "median"))
            (out_dir / "cost.json").write_text(json.dumps(cost, indent=2))
    finally:
        draft.close()
        target.close()
    print(f"kept the calibration, traces and live figures under {out_dir}/", file=sys.stderr)
    return cost, ts, live
