"""`acespec bench api`: what the HTTP API costs, against `acespec edge`, side by side in one run.

    acespec bench api [--runs 5] [--max-tokens 32] [--mode acespec] [--rtt MS] [--json OUT]

One cloud (`acespec serve`, child process; behind `acespec wan` with `--rtt`), and the same prompts
generated two ways, alternating A B A B so that drift in the machine's load hits both alike:

    edge   what `acespec edge` runs: `run_edge` in this process, the drafter loaded once; times are
           taken where its tokens are handed out (the callback that prints them)
    api    `acespec edge serve` (child process, its own drafter) streaming the same request as
           server-sent events to a plain HTTP client in this process; times are taken when each
           chunk has been read and parsed

Time to first token counts from the request (for `edge`: from tokenizing the prompt) to its first
token; inter-token latency is (last token - first token) / (tokens - 1) of each run. The figures are
medians over the runs; the ratios api / edge and the differences api - edge are medians over the
pairs (each api run against the edge run next to it), so slow drift in the machine's load cancels.
The difference is the API's own cost in seconds; with toy models (`--draft toy:... --target toy:...`)
it is measured against a generation of a few milliseconds, so it shows up clearly. The texts of
each pair must be equal (same rule and seed).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import sys
import time
from typing import Any

from acespec.bench import write_result
from acespec.bench.children import ChildProcesses
from acespec.bench.stack import start_stack

PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the vowels in a string.",
)
BAR = 1.05  # the bar: the API adds at most 5 % to time to first token and to inter-token latency


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from acespec.argtypes import nonneg_float, pos_int
    from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    p = bench_subparsers.add_parser(
        "api", help="the HTTP API's cost on time to first token and inter-token latency, against acespec edge"
    )
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--runs", type=pos_int, default=5, help="measured runs per side, after one warm-up each (default 5)")
    p.add_argument("--max-tokens", type=pos_int, default=32)
    p.add_argument("--mode", choices=("acespec", "pipelined", "sync", "cloud-only"), default="acespec")
    p.add_argument("--rule", default="coupled")
    p.add_argument(
        "--rtt",
        type=nonneg_float,
        default=0.0,
        help="put `acespec wan` with this round trip (ms) in between (0 = none)",
    )
    p.add_argument("--n-ctx", type=pos_int, default=2048)
    p.add_argument(
        "--cores",
        choices=("split", "shared"),
        default="split",
        help="split (default): the cloud gets one core, the edges (the API and acespec edge, which never run "
        "at once) the other, like two devices; shared: every process uses every core, and llama.cpp "
        "threads of two processes computing at once slow each other several-fold",
    )
    p.add_argument("--json", metavar="OUT")
    p.set_defaults(func=cmd_bench_api)
    return p


# ------------------------------------------------------------------------------------------ one run each
def run_edge_once(drafter, cfg, prompt: str) -> dict:
    """`acespec edge`'s path: tokenize, run_edge, tokens handed to a callback as they commit."""
    from acespec.edge.runtime import run_edge
    from acespec.models import TextStream

    stream = TextStream(drafter.tokenizer)
    times: list[float] = []
    pieces: list[str] = []

    def push(toks: list[int]) -> None:
        now = time.perf_counter()
        times.extend([now] * len(toks))
        pieces.append(stream.push(toks))

    t0 = time.perf_counter()
    ids = drafter.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
    res = run_edge(
        drafter if cfg.mode != "cloud-only" else None, ids, cfg, model_id=drafter.tokenizer.fingerprint, on_tokens=push
    )
    pieces.append(stream.flush())
    return _figures(t0, times[0], times[-1], len(res.tokens), "".join(pieces))


def run_api_once(host: str, port: int, body: dict) -> dict:
    """One streaming chat completion, read as a plain client reads server-sent events."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the API answered {resp.status}: {resp.read()[:300]!r}")
    buf, pieces, first, last, usage = b"", [], None, None, None
    while True:
        data = resp.read1(65536)
        if not data:
            break
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            payload = event.removeprefix(b"data: ")
            if payload == b"[DONE]":
                continue
            msg = json.loads(payload)
            if "error" in msg:
                raise RuntimeError(f"the API failed mid-stream: {msg['error']['message']}")
            usage = msg.get("usage") or usage
            text = "".join(c["delta"].get("content") or "" for c in msg["choices"])
            if text:
                last = time.perf_counter()
                first = first or last
                pieces.append(text)
    conn.close()
    if first is None or last is None or usage is None:
        raise RuntimeError("the API's stream ended without text or without usage")
    return _figures(t0, first, last, usage["completion_tokens"], "".join(pieces))


def _figures(t0: float, first: float, last: float, n: int, text: str) -> dict:
    return {"ttft_s": first - t0, "itl_s": (last - first) / (n - 1) if n > 1 else 0.0, "tokens": n, "text": text}


# ------------------------------------------------------------------------------------------ the bench
def cmd_bench_api(args: argparse.Namespace) -> int:

    from acespec.draft.cache import DRAFTER_SLOTS
    from acespec.edge.client import ConnectConfig
    from acespec.edge.runtime import EdgeConfig
    from acespec.edge.service import edge_config_for
    from acespec.models import load_model
    from acespec.models.llama import on_cpus
    from acespec.models.registry import resolve

    kids = ChildProcesses()
    stack = contextlib.ExitStack()
    try:
        up = start_stack(
            kids,
            cores=args.cores,
            target=args.target,
            draft=args.draft,
            n_ctx=args.n_ctx,
            rtt_ms=args.rtt,
            edge_serve=["--rule", args.rule, "--mode", args.mode],
        )
        stack.enter_context(on_cpus(up.edge_cpus))  # this process's own edges run on the edge's CPUs too
        cloud_port, api_port, edge_threads = up.cloud_port, up.api_port, up.edge_threads
        # as `edge serve` loads it
        slots: dict[str, Any] = {"n_slots": DRAFTER_SLOTS} if resolve(args.draft).kind == "gguf" else {}
        if edge_threads and resolve(args.draft).kind == "gguf":
            slots["n_threads"] = edge_threads
        drafter = load_model(args.draft, n_ctx=args.n_ctx, **slots)
        base = EdgeConfig(
            rule=args.rule, temperature=0.0, seed=0, max_tokens=args.max_tokens, connect=ConnectConfig(port=cloud_port)
        )
        cfg = edge_config_for(base, args.mode)
        body = {
            "model": "acespec",
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "seed": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "mode": args.mode,
            "rule": args.rule,
        }
        pairs = []
        for i in range(args.runs + 1):  # the first pair warms both up and is not counted
            prompt = PROMPTS[i % len(PROMPTS)]
            first_api = i % 2 == 1  # A B, then B A: neither side always runs on the heels of the other
            sides = {}
            for side in ("api", "edge") if first_api else ("edge", "api"):
                if side == "edge":
                    sides[side] = run_edge_once(drafter, cfg, prompt)
                else:
                    sides[side] = run_api_once(
                        "127.0.0.1", api_port, body | {"messages": [{"role": "user", "content": prompt}]}
                    )
            print(
                f"  pair {i}{' (warm-up)' if i == 0 else ''}: ttft edge {sides['edge']['ttft_s']:.3f} s, api "
                f"{sides['api']['ttft_s']:.3f} s; itl edge {1e3 * sides['edge']['itl_s']:.1f} ms, api "
                f"{1e3 * sides['api']['itl_s']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
            if i:
                pairs.append(sides)
    finally:
        stack.close()
        kids.stop_all()
    result = summarize(pairs, vars(args))
    print(format_table(result))
    write_result(args.json, result)
    return 0


def summarize(pairs: list[dict], config: dict) -> dict:
    med = statistics.median
    out = {"config": {k: v for k, v in config.items() if k != "func"}, "pairs": pairs}
    for side in ("edge", "api"):
        out[side] = {"ttft_s": med(p[side]["ttft_s"] for p in pairs), "itl_s": med(p[side]["itl_s"] for p in pairs)}
    out["ratio"] = {
        "ttft": med(p["api"]["ttft_s"] / p["edge"]["ttft_s"] for p in pairs),
        "itl": med(p["api"]["itl_s"] / p["edge"]["itl_s"] for p in pairs if p["edge"]["itl_s"] > 0),
    }
    out["diff_s"] = {  # api - edge, per pair: the API's own cost, in seconds
        "ttft": med(p["api"]["ttft_s"] - p["edge"]["ttft_s"] for p in pairs),
        "itl": med(p["api"]["itl_s"] - p["edge"]["itl_s"] for p in pairs),
    }
    out["same_text"] = sum(p["api"]["text"] == p["edge"]["text"] for p in pairs)
    return out


def format_table(r: dict) -> str:
    c = r["config"]
    lines = [
        f"=== bench api: {c['draft']} -> {c['target']}, mode {c['mode']}, rule {c['rule']}, {c['max_tokens']} tokens, "
        f"rtt {c['rtt']:g} ms, cores {c.get('cores', 'shared')}, {len(r['pairs'])} pairs (A B / B A) ===",
        f"{'':28}{'acespec edge':>14}{'edge serve API':>16}{'api / edge':>12}{'api - edge':>14}",
        f"{'time to first token (s)':28}{r['edge']['ttft_s']:>14.3f}{r['api']['ttft_s']:>16.3f}{r['ratio']['ttft']:>11.3f}x"
        f"{1e3 * r['diff_s']['ttft']:>+11.1f} ms",
        f"{'inter-token latency (ms)':28}{1e3 * r['edge']['itl_s']:>14.1f}{1e3 * r['api']['itl_s']:>16.1f}"
        f"{r['ratio']['itl']:>11.3f}x{1e3 * r['diff_s']['itl']:>+11.2f} ms",
        f"same text: {r['same_text']}/{len(r['pairs'])} pairs",
    ]
    for name in ("ttft", "itl"):
        ok = r["ratio"][name] <= BAR
        lines.append(f"bar: the API adds at most 5% to {name}: {r['ratio'][name]:.3f}x -> {'met' if ok else 'NOT met'}")
    lines.append(
        "ratios and differences: medians over pairs of api / edge and api - edge (each api run against the "
        "edge run beside it)"
    )
    return "\n".join(lines)
