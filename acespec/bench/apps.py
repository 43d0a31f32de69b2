"""`acespec bench apps`: speculation as apps see it, through `acespec edge serve`'s API, against plain streaming.

    acespec bench apps [--modes auto,acespec,cloud-led] [--sets humaneval,sharegpt] [--chats 1,4]
                       [--rtts 0,100,250] [--cores split] [--n-prompts 4] [--turns 2] [--max-tokens 64]

For each RTT a fresh cloud (`acespec serve`, child process), the WAN emulator in front of it (RTT > 0)
and an edge (`acespec edge serve`, child process, one drafter: an edge device's) are started. The
official `openai` client then streams chat completions through the edge, as an app would:

- every prompt of each set runs in every mode, cloud-only included, the modes taking turns going first
  (prompt i starts with mode i mod m), so drift in the machine's load hits each mode alike;
- with `--chats N`, N conversations run at once, each on its own prompt (a prompt group);
- each conversation has `--turns` turns: the next turn sends the whole conversation, the model's own
  answer included, and one more user message;
- with `--repeats R`, each prompt runs R times in every mode (who goes first rotating each time), and a
  request's speed is the median of its runs: on a machine whose prefill time varies by a third from run
  to run, one run compares the runs more than the modes;
- the cloud keeps no closed session's prompt KV for the next (`--no-prefix-reuse`), as in the demo, or
  the first mode to run a prompt would pay its prefill and the others not; `--prefix-reuse` measures
  conversations as a cloud serves them, each prompt first run once, untimed, for every mode alike.

Per mode it prints, against cloud-only in the same run: per-request speed (completion tokens over the
request's wall time, first token included) as the median and the worst ratio over the same request
(prompt, turn) run in cloud-only; time to first token (p50, p99) and its p50's ratio; the second
turn's first token against the first's (with `--prefix-reuse`, against each prompt's first, uncached
visit: the timed first turns find their prompt cached); target passes per token (the API's `usage.target_passes`);
and whether every text equals cloud-only's (greedy and coupled are exact, so they must).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

from acespec.argtypes import pos_float_or_inf, pos_int
from acespec.bench import write_result
from acespec.bench.children import ChildProcesses
from acespec.bench.stack import start_stack
from acespec.eval.datasets import load_items
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from acespec.verify import RuleSpec

FOLLOW_UP = "Thank you. Now say the same thing again in two sentences."


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "apps",
        help="speculation as apps see it: the edge's API, every mode against "
        "cloud-only, 1 and N chats, two turns, several RTTs",
    )
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument(
        "--modes", default="auto,acespec,cloud-led", help="modes against cloud-only (default auto,acespec,cloud-led)"
    )
    p.add_argument("--sets", default="humaneval,sharegpt", help="prompt sets (default humaneval,sharegpt)")
    p.add_argument("--n-prompts", type=pos_int, default=4, help="prompts per set (default 4)")
    p.add_argument(
        "--min-chars",
        type=pos_int,
        default=32,
        help="ShareGPT: only prompts at least this long (default 32); e.g. 1500 for long conversations",
    )
    p.add_argument("--chats", default="1,4", help="conversations at once, a list (default 1,4)")
    p.add_argument("--turns", type=pos_int, default=2, help="turns per conversation (default 2)")
    p.add_argument(
        "--repeats",
        type=pos_int,
        default=1,
        help="runs of each prompt in each mode (default 1); a prompt's speed is its runs' median, so a "
        "machine whose prefill varies from run to run compares modes, not runs",
    )
    p.add_argument("--rtts", default="0,100,250", help="round-trip times in ms, a list (default 0,100,250)")
    p.add_argument("--max-tokens", type=pos_int, default=64)
    p.add_argument("--rule", default="greedy", help="verification rule (default greedy)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--cores",
        choices=("split", "shared"),
        default="split",
        help="split (default): the cloud gets one core and the edge the rest, like two devices; shared: "
        "both use every core, as on a developer's laptop",
    )
    p.add_argument("--drafters", type=pos_int, default=1, help="drafters the edge loads (default 1)")
    p.add_argument(
        "--shared-drafter",
        action="store_true",
        help="the edge's drafters are views of one model (edge serve --shared-drafter): concurrent drafts share a pass",
    )
    p.add_argument(
        "--lead-pass-budget",
        type=pos_float_or_inf,
        default=math.inf,
        metavar="P",
        help="the cloud's `acespec serve --lead-pass-budget` (default inf: no budget)",
    )
    p.add_argument(
        "--prefix-reuse",
        action="store_true",
        help="let the cloud keep a closed session's prompt KV for the next session with that prefix (a "
        "chat's next turn). Off by default, as in the demo: the first mode to run a prompt would "
        "pay its prefill and every later mode would not. On, each prompt is first run once, "
        "untimed, so that every mode starts from the same cache",
    )
    p.add_argument("--n-ctx", type=pos_int, default=4096)
    p.add_argument("--json", metavar="OUT")
    p.set_defaults(func=cmd_bench_apps)
    return p


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be a comma-separated list of integers, got {text!r}") from None
    if not out or any(v < 0 for v in out):
        raise ValueError(f"--{what} must list at least one integer >= 0, got {text!r}")
    return out


# ------------------------------------------------------------------------------------------ one request
def chat_once(client, messages: list[dict], mode: str, args: argparse.Namespace) -> dict:
    """One streaming chat completion through the openai client; times from the request to each chunk."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="acespec",
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mode": mode, "rule": args.rule},
    )
    first, pieces, usage = None, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                first = first or time.perf_counter()
                pieces.append(c.delta.content)
    end = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    extra = usage.model_extra or {} if usage else {}
    return {
        "ttft_s": (first or end) - t0,
        "wall_s": end - t0,
        "tokens": n,
        "text": "".join(pieces),
        "target_passes": extra.get("target_passes", n),
        "tok_s": n / (end - t0) if end > t0 else 0.0,
    }


def conversation(client, prompt: str, mode: str, args: argparse.Namespace) -> list[dict]:
    messages = [{"role": "user", "content": prompt}]
    out = []
    for turn in range(args.turns):
        r = chat_once(client, messages, mode, args)
        r["turn"] = turn
        out.append(r)
        messages += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": FOLLOW_UP}]
    return out


def run_group(client, prompts: list[tuple[str, str]], mode: str, args: argparse.Namespace) -> list[dict]:
    """The group's conversations at once, one thread each (the openai client is thread-safe)."""
    results: list[list[dict] | BaseException] = [[] for _ in prompts]

    def one(i: int, text: str) -> None:
        try:
            results[i] = conversation(client, text, mode, args)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the bench's thread
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, t)) for i, (_, t) in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = []
    for (pid, _), res in zip(prompts, results):
        if isinstance(res, BaseException):
            raise RuntimeError(f"mode {mode}, prompt {pid}: {res}") from res
        rows += [r | {"prompt": pid, "mode": mode} for r in res]
    return rows


# ------------------------------------------------------------------------------------------ the bench
def _prompts(sets: list[str], n: int, min_chars: int = 32) -> dict[str, list[tuple[str, str]]]:
    return {
        s: [(it.id, it.text) for it in load_items(s, n, **({"min_chars": min_chars} if s == "sharegpt" else {}))]
        for s in sets
    }


def _start_stack(args: argparse.Namespace, rtt: int, kids: ChildProcesses) -> int:
    """Cloud, emulator and edge as child processes; the edge's HTTP port."""
    serve = ["--max-sessions", "16", "--lead-pass-budget", str(args.lead_pass_budget)]
    return start_stack(
        kids,
        cores=args.cores,
        target=args.target,
        draft=args.draft,
        n_ctx=args.n_ctx,
        rtt_ms=rtt,
        serve=serve + ([] if args.prefix_reuse else ["--no-prefix-reuse"]),
        edge_serve=["--drafters", str(args.drafters)] + (["--shared-drafter"] if args.shared_drafter else []),
    ).api_port


def cmd_bench_apps(args: argparse.Namespace) -> int:
    import openai  # heavy: the benchmark's client (the test extra)

    RuleSpec.parse(args.rule)
    modes = [m for m in args.modes.split(",") if m and m != "cloud-only"]
    sets = [s for s in args.sets.split(",") if s]
    chats, rtts = _ints(args.chats, "chats"), _ints(args.rtts, "rtts")
    if not modes or not sets or 0 in chats:
        raise ValueError("--modes and --sets must name at least one each, and --chats must be >= 1")
    prompts = _prompts(sets, args.n_prompts, args.min_chars)
    all_modes = ["cloud-only", *modes]
    rows: list[dict] = []
    cold: list[dict] = []  # with --prefix-reuse: each prompt's first, untimed visit (nothing cached): its TTFT
    started = time.time()
    for rtt in rtts:
        kids = ChildProcesses()
        try:
            port = _start_stack(args, rtt, kids)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
            warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
            chat_once(
                client, [{"role": "user", "content": "Hi"}], "auto", warm
            )  # both models' first evaluation is slow
            for s in sets:
                for n in chats:
                    groups = [prompts[s][i : i + n] for i in range(0, len(prompts[s]), n)]
                    for g, group in enumerate(groups):
                        if args.prefix_reuse:  # every mode then finds each prompt's KV cached, not only the later ones
                            for pid, text in group:
                                visit = chat_once(client, [{"role": "user", "content": text}], "cloud-only", warm)
                                cold.append(
                                    {"rtt_ms": rtt, "set": s, "chats": n, "prompt": pid, "ttft_s": visit["ttft_s"]}
                                )
                        for rep in range(args.repeats):
                            first = g + rep  # who goes first rotates over groups and over repeats
                            order = all_modes[first % len(all_modes) :] + all_modes[: first % len(all_modes)]
                            for mode in order:
                                got = run_group(client, group, mode, args)
                                rows += [r | {"rtt_ms": rtt, "set": s, "chats": n, "repeat": rep} for r in got]
                                print(
                                    f"  rtt {rtt} ms, {s}, {n} chat(s), group {g}, run {rep + 1}, {mode}: "
                                    + ", ".join(f"{r['tok_s']:.1f} tok/s" for r in got),
                                    file=sys.stderr,
                                    flush=True,
                                )
        finally:
            kids.stop_all()
    result = {
        "provenance": provenance(args, started),
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "rows": rows,
        "cold_ttft": cold,
        "summary": summarize(rows, modes, cold),
    }
    print(format_table(result))
    write_result(args.json, result)
    return 0


def provenance(args: argparse.Namespace, started: float) -> dict:
    try:
        build = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(__file__),
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        build = "unknown"
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "command": "acespec " + " ".join(sys.argv[1:]),
        "build": build,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }


# ------------------------------------------------------------------------------------------ the figures
def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def _speeds(rows: list[dict]) -> dict[tuple, float]:
    """Each request's (prompt, turn) speed in tokens/s: the median of its runs (`--repeats`)."""
    runs: dict[tuple, list[float]] = {}
    for r in rows:
        runs.setdefault((r["prompt"], r["turn"]), []).append(r["tok_s"])
    return {k: statistics.median(v) for k, v in runs.items()}


def summarize(rows: list[dict], modes: list[str], cold: list[dict] | None = None) -> dict:
    """Per (rtt, set, chats) cell and mode: the figures the module docstring lists. `cold`: with
    `--prefix-reuse`, each prompt's first visit; a conversation's first turn then is that one (a new
    conversation finds nothing cached), not the timed first turns, which the visit warmed."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["rtt_ms"], r["set"], r["chats"]), {}).setdefault(r["mode"], []).append(r)
    out = {}
    for (rtt, s, n), by in sorted(cells.items()):
        base = {(r["prompt"], r["turn"]): r for r in by.get("cloud-only", [])}
        base_speed = _speeds(by.get("cloud-only", []))
        cell = {}
        for mode in ["cloud-only", *modes]:
            rs = by.get(mode, [])
            if not rs:
                continue
            ratios = [v / base_speed[k] for k, v in _speeds(rs).items() if base_speed.get(k, 0) > 0]
            ttft = [r["ttft_s"] for r in rs]
            t1 = [c["ttft_s"] for c in cold or () if (c["rtt_ms"], c["set"], c["chats"]) == (rtt, s, n)]
            t1 = t1 or [r["ttft_s"] for r in rs if r["turn"] == 0]
            t2 = [r["ttft_s"] for r in rs if r["turn"] == 1]
            same = all(base.get((r["prompt"], r["turn"]), {}).get("text") == r["text"] for r in rs)
            cell[mode] = {
                "speed_median": statistics.median(ratios) if ratios else None,
                "speed_worst": min(ratios) if ratios else None,
                "ttft_p50_s": _pct(ttft, 0.5),
                "ttft_p99_s": _pct(ttft, 0.99),
                "turn2_ttft_speedup": statistics.median(t1) / statistics.median(t2) if t1 and t2 else None,
                "passes_per_token": sum(r["target_passes"] for r in rs) / max(1, sum(r["tokens"] for r in rs)),
                "same_text": same,
                "requests": len(rs),
            }
        b50 = cell.get("cloud-only", {}).get("ttft_p50_s")
        for m in cell.values():
            m["ttft_p50_ratio"] = m["ttft_p50_s"] / b50 if b50 else None
        out[f"{rtt}|{s}|{n}"] = cell
    return out


def format_table(result: dict) -> str:
    cfg = result["config"]
    budget = "" if math.isinf(cfg["lead_pass_budget"]) else f", cloud pass budget {cfg['lead_pass_budget']:g}"
    lines = [
        f"=== acespec bench apps: cores {cfg['cores']}, rule {cfg['rule']}, T {cfg['temperature']:g}, "
        f"{cfg['max_tokens']} tokens, {cfg['turns']} turn(s), {cfg.get('repeats', 1)} run(s) each{budget}; "
        "against cloud-only in the same run ==="
    ]
    head = (
        f"{'mode':<11}{'speed p50':>10}{'worst':>8}{'TTFT p50':>10}{'p99':>8}{'TTFT/c-o':>10}"
        f"{'turn2 TTFT':>11}{'passes/tok':>11}{'same text':>10}"
    )
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for key, cell in result["summary"].items():
        rtt, s, n = key.split("|")
        lines += ["", f"rtt {rtt} ms, {s}, {n} chat(s) at once", head]
        for mode, m in cell.items():
            lines.append(
                f"{mode:<11}{fmt(m['speed_median'], '.2f') + 'x':>10}{fmt(m['speed_worst'], '.2f') + 'x':>8}"
                f"{m['ttft_p50_s']:>9.3f}s{m['ttft_p99_s']:>7.3f}s{fmt(m['ttft_p50_ratio'], '.2f') + 'x':>10}"
                f"{fmt(m['turn2_ttft_speedup'], '.2f') + 'x':>11}{m['passes_per_token']:>11.3f}"
                f"{'yes' if m['same_text'] else 'NO':>10}"
            )
    lines.append(
        "\nspeed: completion tokens / request wall time (a request's median over its runs), as a ratio to "
        "the same request in cloud-only (median, worst over requests); turn2 TTFT: the first turn's median TTFT "
        "over the second's (with --prefix-reuse, the first turn's is each prompt's first, uncached visit)"
    )
    return "\n".join(lines)
