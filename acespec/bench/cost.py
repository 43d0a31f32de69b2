"""`acespec bench cost`: what one model call costs, as a function of the tokens it evaluates.

    acespec bench cost [--cores shared|split] [--sizes 1,2,3,5,8,14] [--repeats 3] [--json OUT]

The cost models of the controller and of the pipeline rest on two numbers per machine: how a target
pass grows with the tokens it verifies (t_v(n) = c0 + c1 n) and what a drafted token costs. On a GPU
a pass over a few tokens costs about one step (c1 ~ 0); on a CPU thread it can grow with every token,
and then deep blocks buy fewer passes, not speed. This measures both models side by side after the
first HumanEval prompt: for each n, the fastest of `--repeats` evaluations of n tokens appended to the
prompt (rolled back in between), and the least-squares line through them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from acespec.argtypes import pos_int
from acespec.bench import write_result
from acespec.bench.wan import add_cores_arg, caveat, humaneval_prompts, load_pair
from acespec.cloud.engine import SessionSpec, make_engine
from acespec.draft.cache import CacheConfig
from acespec.draft.chain import ChainDrafter
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from acespec.verify import RuleSpec, SamplingParams, probs_from_logits, verify_block


def time_eval(model, prefix: list[int], sizes: list[int], repeats: int, stat: str = "min") -> list[float]:
    """Seconds to evaluate n tokens after `prefix`, for each n in `sizes`: the fastest of `repeats`
    (`stat="min"`, what one call can cost), or their median (`"median"`, what a call typically costs on a
    machine whose speed drifts: the simulator's calibration). The sizes are interleaved round by round, so
    a drift in the machine's speed shifts every size alike instead of bending the curve."""
    model.prefill(prefix)
    base = len(model.tokens)
    filler = (prefix * (max(sizes) // max(1, len(prefix)) + 1))[: max(sizes)]  # real token ids, any will do
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for i, n in enumerate(sizes):
            model.rollback(base)
            t0 = time.perf_counter()
            model.eval(filler[:n], last=n)  # every row, as a verify pass needs
            times[i].append(time.perf_counter() - t0)
    model.rollback(base)
    return [float(np.median(t)) if stat == "median" else min(t) for t in times]


def time_prefill(model, prompt: list[int], repeats: int = 1) -> float:
    """Seconds per token to prefill `prompt` into an empty cache (the fastest of `repeats`)."""
    best = float("inf")
    for _ in range(repeats):
        model.reset()
        t0 = time.perf_counter()
        model.prefill(prompt)
        best = min(best, time.perf_counter() - t0)
    model.reset()
    return best / max(1, len(prompt))


def time_rows(draft, target, reps: int = 20) -> dict:
    """What the Python around the model calls costs per vocabulary-sized row: the drafter choosing a token
    and ranking its candidates for the state cache (`ChainDrafter._choose`), and the verifier turning a
    target row into probabilities and judging it (`probs_from_logits` + the greedy rule). On a 150k-token
    vocabulary these are milliseconds, which a model-call table alone would leave out."""
    rng = np.random.default_rng(0)
    sp, rule = SamplingParams(), RuleSpec.parse("greedy")
    d = ChainDrafter(draft, sampling=sp, rule=rule)
    row = rng.standard_normal(draft.vocab_size).astype(np.float32)
    choose = _best(lambda: d._choose(row, 100, CacheConfig().alternatives + 1), reps)
    rows = rng.standard_normal((5, target.vocab_size)).astype(np.float32)
    draft4 = np.argmax(rows[:4], axis=-1)
    judge = _best(lambda: verify_block(rule, draft4, None, probs_from_logits(rows, sp), rng), reps) / len(rows)
    return {"draft_choose_s": choose, "verify_row_s": judge}


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_engine(target, prompt: list[int], ks: list[int], repeats: int) -> tuple[list[float], float]:
    """Median seconds from a block of K drafts being submitted to its verdict, through the cloud's
    serving engine (the default batched one, in process, one session), for each K in `ks` (0: a plain
    step): what a verify pass costs as the server runs it, with the verifier's rollback and rule and
    the engine's thread hops, none of which a bare model call pays. The drafts are tokens the target
    rejects at once (each block commits one token), so every pass also rolls the KV back.

    Also returns the seconds from opening the session to its first token: the prompt's prefill as
    the engine runs it (in fixed chunks, one per tick), which a bare prefill of the whole prompt in
    one call underprices (on one thread here, by about a third)."""

    async def run() -> tuple[list[float], float]:
        engine = make_engine("batched", target)
        await engine.start()
        try:
            t_open = time.perf_counter()
            s = await engine.open(
                SessionSpec(prompt=tuple(prompt), rule=RuleSpec.parse("greedy"), max_tokens=len(ks) * repeats + 8)
            )
            await engine.step(s)  # the prompt's prefill and the first token
            first = time.perf_counter() - t_open
            times: list[list[float]] = [[] for _ in ks]
            seq = 1
            for _ in range(repeats):
                for i, k in enumerate(ks):
                    base = s.verifier.committed
                    nxt = s.verifier.tokens[-1]
                    drafts = [(nxt + 1 + j) % target.vocab_size for j in range(k)]  # not what the target says next
                    t0 = time.perf_counter()
                    await engine.verify(s, seq, base, drafts, None)
                    times[i].append(time.perf_counter() - t0)
                    seq += 1
            engine.close(s)
            return [float(np.median(t)) for t in times], first
        finally:
            await engine.stop()

    target.reset()
    try:
        return asyncio.run(run())
    finally:
        target.reset()


def calibrate(draft, target, prompt: list[int], sizes: list[int], repeats: int, stat: str = "min") -> dict:
    """Both models' call costs after `prompt`, their prompt-prefill rates and the per-row Python cost:
    what `bench cost` prints, and what `acespec.sim.profiles.DeviceProfile.from_cost` builds this
    machine's profile from."""
    result: dict = {"prompt_tokens": len(prompt), "sizes": list(sizes), "stat": stat, "models": {}, "prefill": {}}
    for role, model in (("drafter", draft), ("target", target)):
        secs = time_eval(model, prompt, sizes, repeats, stat)
        c0, c1 = fit_line(sizes, secs)
        result["models"][role] = {"name": getattr(model, "name", "?"), "seconds": secs, "c0_s": c0, "c1_s": c1}
        result["prefill"][f"{role}_s_per_token"] = time_prefill(model, prompt)
    result["rows"] = time_rows(draft, target)
    ks = [n - 1 for n in sizes]  # K drafts make a pass of K + 1 tokens
    verify_s, first = time_engine(target, prompt, ks, repeats)
    result["engine"] = {"ks": ks, "verify_s": verify_s, "first_token_s": first}
    return result


def fit_line(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(c0, c1) of the least-squares line seconds = c0 + c1 n (c1 = 0 with a single size)."""
    if len(set(sizes)) < 2:
        return float(np.mean(seconds)), 0.0
    c1, c0 = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return float(c0), float(c1)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("cost", help="what a model call costs per token evaluated (drafter and target)")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument(
        "--sizes",
        default="1,2,3,5,8,14",
        type=_sizes,
        help="token counts per call, comma-separated, ranges allowed (1-12: what `bench sim` profiles need)",
    )
    p.add_argument("--repeats", type=pos_int, default=3, help="evaluations per size; the fastest counts")
    p.add_argument("--n-ctx", type=pos_int, default=2048)
    add_cores_arg(p)
    p.add_argument("--json", metavar="OUT")
    p.set_defaults(func=cmd_bench_cost)
    return p


def _sizes(text: str) -> list[int]:
    try:
        sizes = []
        for part in (x.strip() for x in text.split(",")):
            lo, sep, hi = part.partition("-")
            if part:
                sizes += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts >= 1")
    return sorted(set(sizes))


def cmd_bench_cost(args: argparse.Namespace) -> int:
    print(caveat(args.cores), file=sys.stderr)
    draft, target = load_pair(args.draft, args.target, n_ctx=args.n_ctx, cores=args.cores)
    try:
        ((pid, prompt),) = humaneval_prompts(target.tokenizer, 1)
        if len(prompt) + max(args.sizes) > min(draft.n_ctx, target.n_ctx):
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) + {max(args.sizes)} exceeds the context; use a larger --n-ctx"
            )
        result = {"prompt": pid, "cores": args.cores, **calibrate(draft, target, prompt, args.sizes, args.repeats)}
    finally:
        draft.close()
        target.close()
    print(
        f"acespec bench cost: {args.draft} -> {args.target}, after {pid} ({len(prompt)} tokens), cores {args.cores}, "
        f"fastest of {args.repeats}"
    )
    print(f"{'tokens':>6}  {'drafter ms':>10}  {'ms/token':>8}  {'target ms':>10}  {'ms/token':>8}")
    d, t = result["models"]["drafter"]["seconds"], result["models"]["target"]["seconds"]
    for n, a, b in zip(args.sizes, d, t):
        print(f"{n:>6}  {1e3 * a:>10.1f}  {1e3 * a / n:>8.1f}  {1e3 * b:>10.1f}  {1e3 * b / n:>8.1f}")
    for role, m in result["models"].items():
        print(
            f"{role}: t(n) = {1e3 * m['c0_s']:.1f} ms + {1e3 * m['c1_s']:.1f} ms x n; prompt prefill "
            f"{1e3 * result['prefill'][role + '_s_per_token']:.2f} ms/token"
        )
    eng = result["engine"]
    print(
        "through the serving engine, block submitted -> verdict: "
        + ", ".join(f"K={k} {1e3 * t:.1f} ms" for k, t in zip(eng["ks"], eng["verify_s"]))
    )
    print(
        f"through the serving engine, session opened -> first token (the {len(prompt)}-token prompt's prefill): "
        f"{1e3 * eng['first_token_s']:.0f} ms"
    )
    rows = result["rows"]
    print(
        f"per vocabulary row: drafter picks a token in {1e3 * rows['draft_choose_s']:.2f} ms, the verifier judges a row "
        f"in {1e3 * rows['verify_row_s']:.2f} ms"
    )
    print()
    print(caveat(args.cores))
    write_result(args.json, result)
    return 0
