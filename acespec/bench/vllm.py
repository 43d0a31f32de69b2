"""`acespec bench tenants --engine vllm`: the tenants benchmark on the vLLM engine, and what a verify costs there.

    .venv-vllm/bin/acespec bench tenants --engine vllm                   # a tiny random Qwen2 built on the spot
    .venv-vllm/bin/acespec bench tenants --engine vllm --target DIR      # any Hugging Face directory
    .venv-vllm/bin/acespec bench tenants --engine vllm --target DIR --rtt 0,100,250 --n 1,4,8 --modes cloud-led,cloud-only
                                                                         # the never-slower grid

Two parts, one vLLM engine, one run:

1. **Same text as cloud-only.** The replay edges of `bench tenants` need acceptance traces of the
   served model; for a model without recorded ones (the tiny random one) they are made here: the
   target's own greedy text `y` comes from a cloud-only run on this engine, and the acceptance lengths
   a_j are drawn from a seeded geometric law (a drafter that is right ~70% of the time). The prompts
   are random ids for the tiny model, and the bundled traces' chat prompts (`--traces`) for a real
   target, whose tokenizer must be the default pair's (an `acespec models export-hf` directory). Replaying
   them is exact (see `bench/tenants.py`), so every speculative run must give `y` token for token:
   the table counts the tokens that differ from cloud-only on the same engine.
2. **Verify against decode.** With the prefix cache read on, a verify (a 200-token prefix plus 4 draft
   tokens, top-K rows for all five positions) against a plain cache-hit decode request (the same prefix,
   one new token), side by side, interleaved; and the verify with the cache read off (what vLLM does by
   default for a request with prompt logprobs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from acespec.argtypes import parse_rtts
from acespec.bench.edges import MODES, _ints, _modes, bundled_traces, run_edges, wan_port
from acespec.bench.replay_edge import K
from acespec.bench.tenants_report import _line, never_slower
from acespec.cloud.engine import make_engine
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.models.synthetic import save_random_qwen2
from acespec.sim.trace import PromptTrace


def _traces(prompts: dict[str, list[int]], outputs: dict[str, list[int]], seed: int, p_right: float = 0.7):
    """PromptTraces with the cloud-only text `y` and drawn acceptance lengths (a_j = run of rights from j)."""
    rng = np.random.default_rng(seed)
    out = []
    for pid, prompt in prompts.items():
        y = outputs[pid]
        right = rng.random(len(y)) < p_right
        accept = [0] * len(y)
        for j in range(len(y) - 1, -1, -1):
            accept[j] = (accept[j + 1] + 1 if j + 1 < len(y) else 1) if right[j] else 0
        rank = [0 if a > 0 else 1 for a in accept]
        out.append(
            PromptTrace(
                pid, len(prompt), list(y), accept, rank, [[1.0, 0.0, 0.0, 0.0]] * len(y), prompt_tokens=list(prompt)
            )
        )
    for t in out:
        t.validate()
    return out


def verify_vs_decode(engine, loop, *, prefix: int = 200, k: int = 4, reps: int = 15, seed: int = 0) -> dict:
    """Median seconds of a plain cache-hit decode request, a verify with the cache read on, and one with
    it off, measured interleaved on `engine` (a started VllmEngine whose loop is `loop`)."""
    rng = np.random.default_rng(seed)
    V = engine.target.vocab_size

    async def timed(ids, params):
        t0 = time.perf_counter()
        out = await engine._generate(ids, params)
        return time.perf_counter() - t0, out

    async def go():
        times: dict[str, list[float]] = {"decode": [], "verify": [], "verify_greedy": [], "verify_nocache": []}
        cached = []
        for r in range(reps + 1):
            ids = [int(t) for t in rng.integers(0, V, prefix)]
            draft = [int(t) for t in rng.integers(0, V, k)]
            await timed(ids, engine._params(0, skip_cache=False, logprobs=False))  # puts the prefix in the cache
            d, _ = await timed(ids, engine._params(0, skip_cache=False, logprobs=False))  # cache hit: one new token
            v, out = await timed(ids + draft, engine._params(k, skip_cache=False))
            g, _ = await timed(ids + draft, engine._params(k, skip_cache=False, top=1))
            n, _ = await timed(ids + draft, engine._params(k, skip_cache=True))
            if r:  # the first round warms the shapes up
                times["decode"].append(d)
                times["verify"].append(v)
                times["verify_greedy"].append(g)
                times["verify_nocache"].append(n)
                cached.append(out.num_cached_tokens)
        return times, cached

    times, cached = asyncio.run_coroutine_threadsafe(go(), loop).result(600)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "prefix": prefix,
        "k": k,
        "reps": reps,
        "median_s": med,
        "verify_cached_tokens_median": statistics.median(cached),
        "verify_over_decode": med["verify"] / med["decode"],
        "greedy_over_decode": med["verify_greedy"] / med["decode"],
        "nocache_over_decode": med["verify_nocache"] / med["decode"],
    }


def cmd_tenants_vllm(args) -> int:
    ns, modes, rtts = _ints(args.n), _modes(args.modes), parse_rtts(args.rtt)

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    tmp = None
    target = args.target
    if target is None:
        tmp = tempfile.TemporaryDirectory(prefix="acespec-tiny-")
        target = str(save_random_qwen2(Path(tmp.name) / "qwen2-tiny"))
        say(f"bench tenants --engine vllm: serving a tiny random Qwen2 ({target})")
    n_prompts = max(ns)
    rng = np.random.default_rng(args.seed)
    engine = make_engine("vllm", target, n_ctx=1024, max_sessions=max(64, 2 * n_prompts), lead_k=args.lead_k)
    V = engine.target.vocab_size
    if args.target is None:  # the tiny model has no tokenizer: random prompts
        prompts = {f"p{i}": [int(t) for t in rng.integers(0, V, int(rng.integers(20, 60)))] for i in range(n_prompts)}
    else:  # a real target (the exported default one): the recorded traces' chat prompts, not random ids that end at once
        recorded = bundled_traces(args.traces).prompts
        if any(t >= V for tr in recorded for t in tr.prompt_tokens):
            raise ValueError(f"--traces {args.traces}: its prompts hold ids past this target's vocabulary ({V})")
        prompts = {
            f"{recorded[i % len(recorded)].id}#{i}": list(recorded[i % len(recorded)].prompt_tokens)
            for i in range(n_prompts)
        }
    cfg = ServerConfig(
        port=0,
        max_sessions=max(n_prompts, 1) * 2,
        max_new_tokens=args.max_tokens,
        idle_timeout_s=args.cap + 60,
        max_connections=max(256, 4 * n_prompts),
        max_connections_per_addr=max(32, 4 * n_prompts),
    )
    draft_s = (args.draft_ms if args.draft_ms is not None else 5.0) / 1e3
    result: dict = {
        "command": "acespec bench tenants " + " ".join(sys.argv[3:]),
        "engine": "vllm",
        "target": str(args.target or "tiny random Qwen2"),
        "max_tokens": args.max_tokens,
        "k": K,
        "draft_s_per_token": draft_s,
        "rtts_ms": rtts,
        "repeats": args.repeats,
        "rows": [],
    }
    try:
        srv = CloudServerThread(engine, cfg).start(timeout=900)  # vLLM loads the model at start
        try:
            common = dict(
                model_id=engine.target.tokenizer.fingerprint,
                vocab=V,
                max_tokens=args.max_tokens,
                draft_s=draft_s,
                cap_s=args.cap,
            )
            stubs = _traces(prompts, {p: [] for p in prompts}, args.seed)
            ref = run_edges(srv.port, stubs, "cloud-only", n_prompts, **common)  # y: the engine's own greedy text
            if ref["errors"]:
                raise RuntimeError(f"cloud-only reference run failed: {ref['errors'][:2]}")
            traces = _traces(prompts, ref["outputs"], args.seed)
            # RTT > 0: the edges reach the server through the WAN emulator's `wan` profile, as on the llama
            # engines; the modes of a cell interleaved run by run, so a drift falls on each alike
            for rtt in rtts:
                with contextlib.ExitStack() as stack:
                    port = wan_port(stack, srv.port, rtt)
                    for n in ns:
                        for rep in range(args.repeats):
                            for mode in (
                                modes if rep % 2 == 0 else modes[::-1]
                            ):  # as bench tenants: no mode always first
                                row = run_edges(port, traces, mode, n, rtt_s=rtt / 1e3, **common)
                                row.update(engine="vllm", rtt_ms=rtt, repeat=rep)
                                row["tokens_differ"] = sum(
                                    sum(a != b for a, b in zip(out, ref["outputs"][pid]))
                                    + abs(len(out) - len(ref["outputs"][pid]))
                                    for pid, out in row["outputs"].items()
                                )
                                result["rows"].append(row)
                                say(_line(row) + f", {row['tokens_differ']} tokens differ from cloud-only")
            result["engine_metrics"] = engine.metrics()
            say("verify vs decode, interleaved ...")
            result["cost"] = verify_vs_decode(engine, srv._loop, seed=args.seed)
        finally:
            srv.stop()
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=float))
    return 0


def report(result: dict) -> str:
    rows = result["rows"]
    out = [
        f"=== acespec bench tenants --engine vllm: target {result['target']}; {result['max_tokens']} tokens per session, "
        f"K = {K}, replayed drafting {1e3 * result['draft_s_per_token']:.1f} ms/token ===",
        f"{'mode':10s} {'N':>3s} {'RTT ms':>6s} {'agg tok/s':>10s} {'tok/s/sess':>10s} {'p50 s':>7s} {'p99 s':>7s} {'passes/tok':>10s} "
        f"{'tokens':>6s} {'differ':>6s}",
    ]
    for r in rows:
        out.append(
            f"{r['mode']:10s} {r['n']:3d} {r.get('rtt_ms', 0):6g} {r['agg_tok_s']:10.2f} {r['per_session_tok_s']:10.2f} {r['lat_p50_s']:7.3f} "
            f"{r['lat_p99_s']:7.3f} {r['passes_per_token']:10.3f} {r['tokens']:6d} {r['tokens_differ']:6d}"
        )
    total = sum(r["tokens"] for r in rows)
    differ = sum(r["tokens_differ"] for r in rows)
    out.append(
        f"same text as cloud-only on the same engine: {differ} of {total} tokens differ"
        + (f"; errors: {[e for r in rows for e in r['errors']][:2]}" if any(r["errors"] for r in rows) else "")
    )
    out += never_slower(rows)
    m = result.get("engine_metrics", {})
    if m:
        out.append(
            f"engine: {m['requests']} vLLM requests, {m['resubmits']} resubmitted past the prefix cache, "
            f"{m['cached_tokens']} of {m['prompt_tokens']} prompt tokens served by the prefix cache"
        )
        if m.get("lead_k"):
            out.append(
                f"cloud-led inside vLLM's speculative decoding (K = {m['lead_k']}): {m['lead_tokens']} tokens, "
                f"{m['lead_accepted']} of {m['lead_proposed']} proposed draft tokens kept"
            )
    c = result.get("cost")
    if c:
        med = c["median_s"]
        out.append(
            f"verify cost ({c['prefix']}-token prefix + {c['k']} drafts, top-{20} rows; medians of {c['reps']} interleaved rounds):"
        )
        out.append(f"  plain cache-hit decode request   {1e3 * med['decode']:8.1f} ms")
        out.append(
            f"  verify, cache on, top-20 rows    {1e3 * med['verify']:8.1f} ms   = {c['verify_over_decode']:.2f}x decode "
            f"(cache served {c['verify_cached_tokens_median']:.0f} tokens)"
        )
        out.append(
            f"  verify, greedy session (top-1)   {1e3 * med['verify_greedy']:8.1f} ms   = {c['greedy_over_decode']:.2f}x decode"
        )
        out.append(
            f"  verify, prefix cache read off    {1e3 * med['verify_nocache']:8.1f} ms   = {c['nocache_over_decode']:.2f}x decode"
        )
    return "\n".join(out)


__all__ = ["cmd_tenants_vllm", "verify_vs_decode", "MODES"]
