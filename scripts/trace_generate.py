"""Where `acespec generate`'s time goes: every llama_decode call of a plain and a speculative run, by kind.

    .venv/bin/python scripts/trace_generate.py [--ks 1,2,4] [--n-prompts 4] [--max-tokens 128] [--threads 2]

Both runs use the default pair on raw HumanEval stubs (the prompts `acespec bench peer` uses), plain
first, then speculative at each depth K, each prompt from a fresh context. Every call to a model's
decode is timed and grouped by model and kind: the prompt's prefill, a one-token step, or a pass of n
rows (a verify block, the drafter's catch-up after a block accepted whole), split at position 256
where a one-token pass gets its pad row (`docs/design-notes.md`, exact passes). What is left over is
Python: the loop, the rules, the drafter's choice. The last lines price each K's token in plain steps
(passes only, prefills left out), which says whether that K can beat plain decoding on this machine.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from acespec.bench.peer import draft_depths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=draft_depths, default=(1, 2, 4), help="draft depths of the speculative runs (default 1,2,4)")
    ap.add_argument("--n-prompts", type=int, default=4, help="HumanEval stubs (default 4)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per generation (default 128)")
    ap.add_argument("--threads", type=int, default=None, help="threads per model (default: every core)")
    args = ap.parse_args()

    from acespec.loop.local import SpecConfig, generate
    from acespec.eval.humaneval import load_problems
    from acespec.models import load_model
    from acespec.models.llama import SPLIT_KV_FROM
    from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    opts = {"n_threads": args.threads} if args.threads else {}
    draft = load_model(DEFAULT_DRAFT, n_ctx=2048, **opts)
    target = load_model(DEFAULT_TARGET, n_ctx=2048, **opts)
    calls: list[tuple[str, str, float]] = []  # (run, kind, seconds)
    run = ["plain"]

    def traced(model, tag: str) -> None:
        decode = model._decode

        def timed(new, want, n_past):
            t0 = time.perf_counter()
            out = decode(new, want, n_past)
            n = len(new)
            kind = "prefill" if n > 16 else ("step" if n == 1 else f"{n} rows")
            if n <= 16 and n_past >= SPLIT_KV_FROM:
                kind += " (past 256)"
            calls.append((run[0], f"{tag} {kind}", time.perf_counter() - t0))
            return out

        model._decode = timed

    traced(draft, "drafter")
    traced(target, "target")
    prompts = [list(target.tokenizer.encode(p["prompt"])) for p in load_problems()[: args.n_prompts]]
    wall: dict[str, float] = {}
    tokens: dict[str, int] = {}
    runs = [("plain", SpecConfig(spec=False, max_tokens=args.max_tokens))]
    runs += [(f"k={k}", SpecConfig(k=k, max_tokens=args.max_tokens)) for k in args.ks]
    for name, cfg in runs:
        run[0] = name
        wall[name] = 0.0
        tokens[name] = 0
        for ids in prompts:
            draft.reset()
            target.reset()
            t0 = time.perf_counter()
            out = generate(target, ids, cfg, draft=draft)
            wall[name] += time.perf_counter() - t0
            tokens[name] += len(out.tokens)

    print(f"trace_generate: {DEFAULT_DRAFT} -> {DEFAULT_TARGET}, greedy, {args.n_prompts} HumanEval stub(s) "
          f"x {args.max_tokens} tokens, threads {args.threads or 'all'}")
    step = statistics.median([s for r, k, s in calls if r == "plain" and k.startswith("target step") and "256" not in k])
    for name in wall:
        rows = collections.defaultdict(list)
        for r, kind, s in calls:
            if r == name:
                rows[kind].append(s)
        print(f"\n{name}: {tokens[name]} tokens in {wall[name]:.1f} s, {tokens[name] / wall[name]:.2f} tok/s")
        print(f"{'call':>28} {'count':>6} {'median ms':>10} {'x step':>7} {'total s':>8} {'share':>6}")
        for kind in sorted(rows, key=lambda k: -sum(rows[k])):
            v = rows[kind]
            print(f"{kind:>28} {len(v):>6} {statistics.median(v) * 1e3:>10.1f} {statistics.median(v) / step:>7.2f} "
                  f"{sum(v):>8.2f} {sum(v) / wall[name]:>6.0%}")
        rest = wall[name] - sum(sum(v) for v in rows.values())
        print(f"{'python (the rest)':>28} {'':>6} {'':>10} {'':>7} {rest:>8.2f} {rest / wall[name]:>6.0%}")
    print(f"\nafter the prefills, what a token costs in passes (a plain step before position 256: {step * 1e3:.1f} ms);"
          " speculation pays where it is under 1 plain step:")
    for name in wall:
        per_token = sum(s for r, k, s in calls if r == name and "prefill" not in k) / tokens[name]
        print(f"{name:>8}: {per_token * 1e3:6.1f} ms = {per_token / step:.2f} plain steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
