"""`acespec bench wan`: cloud-only vs sync vs pipelined speculative decoding over an emulated WAN.

    acespec bench wan [--rtt 0,50,100,200] [--n-prompts 2] [--max-tokens 64] [--k 4] [--profile wan] [--json OUT]

One process, one run, side by side (docs/design/architecture.md, "Measuring": compare ratios measured together, never
numbers from different runs):

- the drafter and the target are loaded once each;
- the cloud verifier (`CloudServerThread`) serves the target from a background thread;
- a `WanProxyThread` sits between edge and cloud with the profile's jitter, bandwidth and loss, and
  the RTT under test (`set_profile` between RTTs; every generation opens a fresh connection);
- the edge runs here, in greedy mode, on HumanEval prompts wrapped in the chat template the same way
  as the eval harness (`acespec.eval.humaneval.chat_message`).

For every RTT, every prompt runs in every mode (the mode order rotates with the prompt so no mode is
always first). Both models' KV caches are emptied before each generation, so every run pays its own
prefill, as a new session would. One short untimed warm-up per mode comes first.

Reported per RTT and mode: tokens/s (total emitted / total wall time), time to first token, the
inter-token latency p50/p99 (`RunStats.inter_token_latency` per generation, averaged over prompts),
target passes per token, uplink and downlink bytes per emitted token, acceptance, and the ratio of
tokens/s to cloud-only's at the same RTT; and per mode the RTT sensitivity, tokens/s at the highest
RTT over tokens/s at the lowest (RTT 0 when measured).

Caveat printed with every result: here the drafter and the target share the same CPU cores, so edge
and cloud compete for compute; a real edge device and a cloud GPU do not.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from acespec.argtypes import parse_rtts
from acespec.argtypes import pos_int as _pos_int
from acespec.bench import write_result
from acespec.cloud.engine import make_engine
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig, EdgeError
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.eval.datasets import load_items
from acespec.models import load_model
from acespec.models.base import check_compatible
from acespec.models.llama import on_cpus, split_cpus, split_threads
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, resolve
from acespec.net import PROFILES, WanProxyThread, profile_from_args
from acespec.sim.ceiling import against_ceiling, calibrate

MODES = ("cloud-only", "sync", "pipelined")
DEFAULT_RTTS = "0,50,100,200"

CAVEAT = (
    "caveat: the drafter (edge) and the target (cloud) run on the same CPU cores of this machine, so they compete "
    "for compute: drafting slows verification and vice versa, which a real edge device + cloud GPU would not do. "
    "Compare modes with each other at the same RTT (ratios), not with other machines."
)
SPLIT_CAVEAT = (
    "caveat: cores split: the drafter (edge) runs on {edge} llama.cpp thread(s) and the target (cloud) on {cloud}, "
    "each side's threads pinned to its own CPUs, like two devices: neither can take or borrow the other's core (so "
    "every mode, the baselines included, runs each model on fewer threads than with --cores shared; in one process "
    "they still share Python's interpreter lock, and `acespec demo` runs the cloud in a process of its own). "
    "Compare modes with each other "
    "at the same RTT (ratios), not with other machines."
)


def caveat(cores: str) -> str:
    if cores == "shared":
        return CAVEAT
    edge, cloud = split_threads(cores)
    return SPLIT_CAVEAT.format(edge=edge, cloud=cloud)


def load_pair(draft_spec: str, target_spec: str, *, n_ctx: int, cores: str = "shared", draft_slots: int = 1):
    """(drafter, target) for a benchmark, with threads per --cores (llama.cpp models only)."""
    edge, cloud = split_threads(cores)

    def opts(spec: str, threads: int | None, slots: int) -> dict:
        if resolve(spec).kind != "gguf":
            return {}
        return {**({"n_threads": threads} if threads else {}), **({"n_slots": slots} if slots > 1 else {})}

    target = load_model(target_spec, n_ctx=n_ctx, **opts(target_spec, cloud, 1))
    try:
        draft = load_model(draft_spec, n_ctx=n_ctx, **opts(draft_spec, edge, draft_slots))
    except BaseException:
        target.close()
        raise
    return draft, target


# ------------------------------------------------------------------------------------------ inputs


def parse_modes(text: str, known: Sequence[str] = MODES) -> list[str]:
    modes = [m.strip() for m in str(text).split(",") if m.strip()]
    for m in modes:
        if m not in known:
            raise ValueError(f"--modes: unknown mode {m!r}; choose from {', '.join(known)}")
    if not modes:
        raise ValueError("--modes: give at least one mode")
    return list(dict.fromkeys(modes))


def humaneval_prompts(tokenizer, n: int) -> list[tuple[str, list[int]]]:
    """The first `n` HumanEval problems as (task id, chat prompt ids), as the eval harness builds them."""
    out = []
    for item in load_items("humaneval", n):
        ids = list(tokenizer.chat_prompt([{"role": "user", "content": item.text}]))
        out.append((item.id, ids))
    return out


# ------------------------------------------------------------------------------------------ the run


@dataclass
class RunRecord:
    rtt_ms: float
    mode: str
    prompt_id: str
    prompt_tokens: int
    emitted: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0
    itl_p50_s: float = 0.0
    itl_p99_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    dropped: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    reconnects: int = 0
    draft_s: float = 0.0  # edge: drafting on the critical path (pre-drafting for the cache is in cache.predraft_s)
    wait_s: float = 0.0  # edge: blocked on a verdict with nothing to draft
    verify_s: float = 0.0  # cloud: verify time the verdicts reported
    k_chosen: list[int] = field(default_factory=list, repr=False)
    steps: int = 0  # target passes the cloud reported
    draft_steps: int = 0  # of them, passes that verified a draft of the edge's
    cache: dict = field(default_factory=dict)
    error: str = ""
    tokens: list[int] = field(default_factory=list, repr=False)


@dataclass
class BenchConfig:
    rtts: list[float]
    modes: list[str] = field(default_factory=lambda: list(MODES))
    profile: str | None = "wan"  # a name from acespec.net.PROFILES (jitter, bandwidth, loss), or None
    k: int = 4
    window: int = 2
    max_tokens: int = 64
    warmup_tokens: int = 4  # one untimed generation per mode first; 0 = none
    reply_timeout_s: float = 300.0
    variants: dict = field(default_factory=dict)  # name -> EdgeConfig overrides; a mode name needs none
    cores: str = "shared"  # split: the cloud's threads on their own CPUs, the edge's and the emulator's on another
    temperature: float = 0.0  # 0: greedy; above 0: coupled, the i-th prompt at seed i in every mode


def run_wan_bench(
    draft,
    target,
    prompts: Sequence[tuple[str, list[int]]],
    cfg: BenchConfig,
    *,
    progress: bool = True,
    reset_models: bool = True,
) -> dict:
    """Run every (RTT, prompt, mode) once, side by side; returns {"config", "runs", "summary", "sensitivity"}.

    `draft`, `target`: loaded models sharing a tokenizer. The cloud server and the WAN emulator live for
    the whole call. Works with toy models too (tests)."""
    from tqdm import tqdm  # heavy: optional here

    check_compatible(draft, target)
    if not prompts:
        raise ValueError("no prompts to run")
    model_id = draft.tokenizer.fingerprint
    longest = max(len(ids) for _, ids in prompts)
    server_cfg = ServerConfig(port=0, max_sessions=4, max_new_tokens=max(cfg.max_tokens, cfg.warmup_tokens, 1))
    if longest + cfg.max_tokens > target.n_ctx:
        raise ValueError(
            f"a prompt of {longest} tokens + {cfg.max_tokens} new tokens exceeds the target's "
            f"context of {target.n_ctx}; use a larger --n-ctx or fewer --max-tokens"
        )

    def profile_for(rtt: float):
        return profile_from_args(cfg.profile, rtt=rtt)

    def one(port: int, name: str, ids: list[int], max_tokens: int, seed: int = 0):
        if reset_models:  # every run pays its own prefill, as a new session would
            _reset_cloud_model(cloud)
            draft.reset()
        opts: dict[str, Any] = {"mode": name, "k": cfg.k, "window": cfg.window}  # EdgeConfig fields
        opts.update(cfg.variants.get(name, {}))
        # coupled is lossless to the token (the noise is the seed's and the position's), so every mode
        # of a prompt at one seed writes one text, as greedy does
        ecfg = EdgeConfig(
            rule="coupled" if cfg.temperature > 0 else "greedy",
            temperature=cfg.temperature,
            seed=seed,
            max_tokens=max_tokens,
            connect=ConnectConfig(host="127.0.0.1", port=port, reply_timeout_s=cfg.reply_timeout_s),
            **opts,
        )
        return run_edge(None if ecfg.mode == "cloud-only" else draft, ids, ecfg, model_id=model_id)

    records: list[RunRecord] = []
    stats: dict[int, object] = {}  # id(record) -> its RunStats, for the ceilings
    total = len(cfg.rtts) * len(prompts) * len(cfg.modes)
    # split cores: the cloud's threads (its event loop, and the engine's, which runs the target) start
    # on the cloud's CPUs and inherit them; this thread, the edge's, and the emulator's stay on the edge's
    edge_cpus, cloud_cpus = split_cpus(cfg.cores)
    with on_cpus(cloud_cpus):
        # every run pays its own prompt prefill (see _reset_cloud_model): with prefix reuse, the modes
        # after a prompt's first would start from its KV while each edge-led run's drafter starts cold
        engine = make_engine("batched", target, reuse_prefixes=False)
        cloud = CloudServerThread(engine, server_cfg).start()
    with contextlib.ExitStack() as stack:
        stack.callback(cloud.stop)
        stack.enter_context(on_cpus(edge_cpus))
        wan = stack.enter_context(WanProxyThread("127.0.0.1", 0, "127.0.0.1", cloud.port, profile_for(cfg.rtts[0])))
        if cfg.warmup_tokens > 0:
            for mode in cfg.modes:
                one(wan.port, mode, prompts[0][1], cfg.warmup_tokens)
        with tqdm(total=total, desc="bench wan", unit="run", file=sys.stderr, disable=not progress) as bar:
            for rtt in cfg.rtts:
                wan.set_profile(profile_for(rtt))
                for i, (pid, ids) in enumerate(prompts):
                    order = list(cfg.modes[i % len(cfg.modes) :]) + list(cfg.modes[: i % len(cfg.modes)])
                    for mode in order:
                        bar.set_postfix_str(f"rtt={rtt:g}ms {mode} {pid}")
                        rec = RunRecord(rtt_ms=rtt, mode=mode, prompt_id=pid, prompt_tokens=len(ids))
                        try:
                            res = one(wan.port, mode, ids, cfg.max_tokens, seed=i)
                        except (EdgeError, OSError) as e:
                            rec.error = f"{type(e).__name__}: {e}"
                        else:
                            s = res.stats
                            p50, p99 = s.inter_token_latency()
                            rec.emitted, rec.wall_s, rec.ttft_s = s.emitted, s.wall_s, s.ttft_s
                            rec.itl_p50_s, rec.itl_p99_s = p50, p99
                            rec.rounds, rec.drafted, rec.accepted, rec.dropped = (
                                s.rounds,
                                s.drafted,
                                s.accepted,
                                s.dropped,
                            )
                            rec.bytes_up, rec.bytes_down = s.bytes_up, s.bytes_down
                            rec.reconnects = int(s.link.get("reconnects", 0))
                            rec.draft_s, rec.wait_s, rec.verify_s = s.draft_s, s.wait_s, s.verify_s
                            rec.tokens = list(res.tokens)
                            rec.k_chosen = list(s.k_chosen)
                            rec.steps, rec.draft_steps = len(s.passes), sum(d > 0 for d, _ in s.passes)
                            rec.cache = {k: v for k, v in s.cache.items() if k != "reconnects"}
                            stats[id(rec)] = s
                        records.append(rec)
                        bar.update(1)
    summary = summarize(records, cfg.rtts, cfg.modes)
    _ceilings(summary["by_rtt"], records, stats, cfg)
    # greedy and coupled are lossless: every mode should emit the same tokens for a prompt (with
    # llama.cpp's exact passes, the default, to the bit; docs/design-notes.md says when a model's rows
    # can still differ)
    groups: dict[tuple, set] = {}
    for r in records:
        if not r.error:
            groups.setdefault((r.rtt_ms, r.prompt_id), set()).add(tuple(r.tokens))
    agree = sum(1 for v in groups.values() if len(v) == 1)
    return {
        "outputs_agree": f"{agree}/{len(groups)}",
        "config": asdict(cfg),
        "prompts": [pid for pid, _ in prompts],
        "models": {"draft": getattr(draft, "name", "?"), "target": getattr(target, "name", "?")},
        "caveat": CAVEAT,
        "summary": summary["by_rtt"],
        "sensitivity": summary["sensitivity"],
        "runs": [asdict(r) for r in records],
    }


def _reset_cloud_model(cloud, timeout: float = 30.0) -> None:
    """Wait until the last session has closed: the batching engine (prefix reuse off) frees a closed
    session's KV sequence and clears it before the next session uses it, so every run starts from a
    cold cache (docs/design-notes.md: what reuse did to these comparisons)."""
    deadline = time.monotonic() + timeout
    while cloud.server.sessions and time.monotonic() < deadline:
        time.sleep(0.002)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _share(seconds: float, wall: float) -> float:
    return round(seconds / wall, 4) if wall > 0 else 0.0


def _decode_rate(runs: Sequence[RunRecord]) -> float:
    tokens = sum(max(0, r.emitted - 1) for r in runs)
    wall = sum(max(0.0, r.wall_s - r.ttft_s) for r in runs)
    return round(tokens / wall, 3) if wall > 0 else 0.0


def _ceilings(by_rtt: dict, records: Sequence[RunRecord], stats: dict, cfg: BenchConfig) -> None:
    """Each (RTT, mode)'s ceiling and its steady rate's share of it (sim/ceiling.py), calibrated on
    every run at that RTT: their passes pooled, each run held to its own acceptance and round trip. The
    share is of the steady rate (after the first commit): the ceiling is a stream's steady rate, and the
    prompt's prefill is the same cloud work in every mode."""
    for rtt in cfg.rtts:
        runs = [r for r in records if r.rtt_ms == rtt and id(r) in stats]
        cal = calibrate(stats[id(r)] for r in runs)
        for name, m in by_rtt[f"{rtt:g}"].items():
            mine = [stats[id(r)] for r in runs if r.mode == name]
            mode = cfg.variants.get(name, {}).get("mode", name)
            top, share, _ = against_ceiling(mine, mode, cal) if cal and mine else (0.0, 0.0, 0)
            m["ceiling_tokens_per_s"] = round(top, 3) if top else None
            m["of_ceiling"] = round(share, 3) if share else None


def summarize(records: Sequence[RunRecord], rtts: Sequence[float], modes: Sequence[str]) -> dict:
    """Aggregate the runs per (RTT, mode); ratios against cloud-only at the same RTT; RTT sensitivity."""
    by_rtt: dict[str, dict[str, dict]] = {}
    for rtt in rtts:
        row: dict[str, dict] = {}
        for mode in modes:
            runs = [r for r in records if r.rtt_ms == rtt and r.mode == mode and not r.error]
            emitted = sum(r.emitted for r in runs)
            wall = sum(r.wall_s for r in runs)
            drafted = sum(r.drafted for r in runs)
            row[mode] = {
                "runs": len(runs),
                "failed": sum(1 for r in records if r.rtt_ms == rtt and r.mode == mode and r.error),
                "emitted": emitted,
                "wall_s": round(wall, 4),
                "tokens_per_s": round(emitted / wall, 3) if wall > 0 else 0.0,
                # after the first token: the prompt's prefill is the same cloud work in every mode (see ttft_s)
                "decode_tokens_per_s": _decode_rate(runs),
                "ttft_s": round(_mean([r.ttft_s for r in runs]), 4),
                "itl_p50_ms": round(1e3 * _mean([r.itl_p50_s for r in runs]), 2),
                "itl_p99_ms": round(1e3 * _mean([r.itl_p99_s for r in runs]), 2),
                "target_passes_per_token": round(sum(r.rounds for r in runs) / emitted, 4) if emitted else 0.0,
                "bytes_up_per_token": round(sum(r.bytes_up for r in runs) / emitted, 2) if emitted else 0.0,
                "bytes_down_per_token": round(sum(r.bytes_down for r in runs) / emitted, 2) if emitted else 0.0,
                "acceptance_rate": round(sum(r.accepted for r in runs) / drafted, 4) if drafted else None,
                "reconnects": sum(r.reconnects for r in runs),
                "mean_k": round(_mean([k for r in runs for k in r.k_chosen]), 3)
                if any(r.k_chosen for r in runs)
                else None,
                # cloud-led: the share of the stream's steps that had a usable draft (the others step plainly)
                "timeliness": (
                    round(sum(r.draft_steps for r in runs) / sum(r.steps for r in runs), 4)
                    if mode == "cloud-led" and sum(r.steps for r in runs) > 0
                    else None
                ),
                # where the time goes, as fractions of the wall time (edge: one thread; cloud: its busy share)
                "time": {
                    "draft": _share(sum(r.draft_s for r in runs), wall),
                    "predraft": _share(sum(r.cache.get("predraft_s", 0.0) for r in runs), wall),
                    "wait": _share(sum(r.wait_s for r in runs), wall),
                    "verify": _share(sum(r.verify_s for r in runs), wall),
                },
            }
            caches = [r.cache for r in runs if r.cache.get("lookups")]
            if caches:
                lr = sum(c.get("lookups_rejected", 0) for c in caches)
                hr = sum(round(c.get("hit_rate_rejected", 0) * c.get("lookups_rejected", 0)) for c in caches)
                cr = sum(round(c.get("coverage_rejected", 0) * c.get("lookups_rejected", 0)) for c in caches)
                row[mode]["cache"] = {
                    "lookups": sum(c["lookups"] for c in caches),
                    "lookups_rejected": lr,
                    "coverage_rejected": round(cr / lr, 4) if lr else None,
                    "hit_rate": round(sum(c["hits"] for c in caches) / sum(c["lookups"] for c in caches), 4),
                    "hit_rate_rejected": round(hr / lr, 4) if lr else None,
                    "lookup_us_mean": round(_mean([c["lookup_us_mean"] for c in caches]), 2),
                    "peak_bytes": max(c["peak_bytes"] for c in caches),
                    "time_saved_s": round(sum(c["time_saved_s"] for c in caches), 3),
                    "branches_sent": sum(c.get("branches_sent", 0) for c in caches),
                    "branch_hits": sum(c.get("branch_hits", 0) for c in caches),
                }
        base = row.get("cloud-only", {}).get("tokens_per_s", 0.0)
        for mode in modes:
            row[mode]["vs_cloud_only"] = round(row[mode]["tokens_per_s"] / base, 3) if base else None
        by_rtt[f"{rtt:g}"] = row
    lo, hi = f"{min(rtts):g}", f"{max(rtts):g}"
    sensitivity = {}
    for mode in modes:
        a, b = by_rtt[lo][mode]["tokens_per_s"], by_rtt[hi][mode]["tokens_per_s"]
        sensitivity[mode] = {"rtt_lo_ms": float(lo), "rtt_hi_ms": float(hi), "ratio": round(b / a, 3) if a else None}
    return {"by_rtt": by_rtt, "sensitivity": sensitivity}


# ------------------------------------------------------------------------------------------ report


def format_table(result: dict) -> str:
    cols = [
        ("rtt_ms", 7),
        ("mode", 11),
        ("tok/s", 8),
        ("x cloud", 8),
        ("dec tok/s", 9),
        ("ttft_s", 7),
        ("itl p50 ms", 10),
        ("itl p99 ms", 10),
        ("passes/tok", 10),
        ("up B/tok", 9),
        ("down B/tok", 10),
        ("accept", 7),
        ("ceil tok/s", 10),
        ("steady/ceil", 11),
    ]
    lines = ["  ".join(f"{name:>{w}}" for name, w in cols)]
    for rtt, row in result["summary"].items():
        for mode, m in row.items():
            vals = [
                rtt,
                mode,
                f"{m['tokens_per_s']:.2f}",
                "-" if m["vs_cloud_only"] is None else f"{m['vs_cloud_only']:.2f}",
                f"{m.get('decode_tokens_per_s', 0.0):.2f}",
                f"{m['ttft_s']:.3f}",
                f"{m['itl_p50_ms']:.1f}",
                f"{m['itl_p99_ms']:.1f}",
                f"{m['target_passes_per_token']:.3f}",
                f"{m['bytes_up_per_token']:.1f}",
                f"{m['bytes_down_per_token']:.1f}",
                "-" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.2f}",
                "-" if m.get("ceiling_tokens_per_s") is None else f"{m['ceiling_tokens_per_s']:.2f}",
                "-" if m.get("of_ceiling") is None else f"{m['of_ceiling']:.2f}",
            ]
            if m["failed"]:
                vals[1] += "!"
            lines.append("  ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols)))
    sens = result["sensitivity"]
    if sens and len(result["summary"]) > 1:
        any_mode = next(iter(sens.values()))
        lines.append("")
        lines.append(
            f"RTT sensitivity (tok/s at {any_mode['rtt_hi_ms']:g} ms / tok/s at {any_mode['rtt_lo_ms']:g} ms):"
        )
        for mode, s in sens.items():
            lines.append(f"  {mode:>11}: {'-' if s['ratio'] is None else format(s['ratio'], '.3f')}")
    timely = [
        (rtt, m["timeliness"])
        for rtt, row in result["summary"].items()
        for mode, m in row.items()
        if m.get("timeliness") is not None
    ]
    if timely:
        lines.append(
            "cloud-led draft timeliness (share of the stream's steps that verified a draft of the edge's): "
            + ", ".join(f"{t:.2f} at {rtt} ms" for rtt, t in timely)
        )
    if "outputs_agree" in result:
        t = result.get("config", {}).get("temperature") or 0.0
        how = f"coupled, T = {t:g}, one seed per prompt" if t > 0 else "greedy"
        lines.append(f"identical output in every mode ({how}) for {result['outputs_agree']} (RTT, prompt) pairs")
    failed = [r for r in result["runs"] if r["error"]]
    if failed:
        lines.append("")
        lines.append(f"{len(failed)} run(s) failed (marked '!'):")
        for r in failed:
            lines.append(f"  rtt={r['rtt_ms']:g}ms {r['mode']} {r['prompt_id']}: {r['error']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `wan` to the `acespec bench` subcommands."""
    p = bench_subparsers.add_parser(
        "wan",
        help="cloud-only vs sync vs pipelined over an emulated WAN, side by side",
        description="Cloud-only, sync and pipelined speculative decoding (greedy) on HumanEval prompts through the "
        "WAN emulator, at several RTTs, in one process. " + CAVEAT,
    )
    p.add_argument(
        "--rtt", default=DEFAULT_RTTS, help=f"comma-separated round-trip times in ms (default {DEFAULT_RTTS})"
    )
    p.add_argument("--n-prompts", type=_pos_int, default=2, help="HumanEval problems to run (default 2)")
    p.add_argument("--max-tokens", type=_pos_int, default=64, help="tokens per generation (default 64)")
    p.add_argument("--k", type=_pos_int, default=4, help="draft depth (default 4)")
    p.add_argument("--window", type=_pos_int, default=2, help="pipelined: blocks in flight (default 2)")
    p.add_argument(
        "--profile",
        default="wan",
        choices=sorted(PROFILES) + ["none"],
        help="network profile for jitter, bandwidth and loss; its RTT is replaced by --rtt (default wan)",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"drafter model (default {DEFAULT_DRAFT})")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--n-ctx", type=_pos_int, default=2048, help="context window for llama.cpp models (default 2048)")
    add_cores_arg(p)
    p.add_argument("--warmup-tokens", type=int, default=4, help="untimed warm-up generation per mode (0 = none)")
    p.add_argument("--json", metavar="OUT", help="also write the full result (config, per-run records, summary) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench_wan)
    return p


def add_cores_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cores",
        default="shared",
        choices=("shared", "split"),
        help="shared (default): both models use every core; split: the edge gets one core and the cloud "
        "the rest, emulating two devices",
    )


def cmd_bench_wan(args: argparse.Namespace) -> int:
    cfg = BenchConfig(
        rtts=parse_rtts(args.rtt),
        modes=parse_modes(args.modes),
        profile=None if args.profile == "none" else args.profile,
        k=args.k,
        window=args.window,
        max_tokens=args.max_tokens,
        warmup_tokens=max(0, args.warmup_tokens),
        cores=args.cores,
    )
    print(caveat(args.cores), file=sys.stderr)
    t0 = time.perf_counter()
    draft, target = load_pair(args.draft, args.target, n_ctx=args.n_ctx, cores=args.cores)
    try:
        prompts = humaneval_prompts(target.tokenizer, args.n_prompts)
        result = run_wan_bench(draft, target, prompts, cfg, progress=not args.no_progress)
    finally:
        draft.close()
        target.close()
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    result["cores"], result["caveat"] = args.cores, caveat(args.cores)

    prof = profile_from_args(cfg.profile, rtt=0)
    print(
        f"acespec bench wan: {args.draft} -> {args.target}, greedy, k={cfg.k}, window={cfg.window}, "
        f"{len(prompts)} HumanEval prompt(s) x {cfg.max_tokens} tokens; link: {prof.describe().replace('rtt=0ms ', '')}"
    )
    print(format_table(result))
    print()
    print(caveat(args.cores))
    write_result(args.json, result)
    return 1 if any(r["error"] for r in result["runs"]) else 0
