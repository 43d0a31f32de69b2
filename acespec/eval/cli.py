"""`acespec eval`: the length-inflation harness (see `acespec.eval.runner` and `acespec.eval.report`).

    acespec eval --rules strict,cactus:delta=0.35 --dataset math --n 20 --max-tokens 256 --seeds 2
    acespec eval --rules strict,cactus:delta=0.35 --dataset math --think --guard budget --n 20
    acespec eval --rules strict,mentored --guard support --dataset humaneval --n 20 --max-tokens 512
    acespec eval --rules strict,cactus:delta=0.35 --ablate support,netwin --dataset sharegpt --n 30
    acespec eval --rules strict,cactus:delta=0.35 --ablate force --think --dataset math --max-tokens 192 --n 30
    acespec eval --engine vllm --target ~/qwen15-hf --draft ~/qwen05-hf --rules strict,cactus:delta=0.35 --n 20
    acespec eval --resume runs/eval-20250101-120000 [--n 40]      # continue / extend an interrupted run
    acespec eval --report-only runs/eval-20250101-120000            # rebuild the report from records

Options left out on the command line take their defaults, or on `--resume` the values saved in the run
folder's `config.json`. A resumed run may change `--n`, `--seeds`, `--ablate` and `--rules`/`--guard support|netwin`
(new jobs are added, finished ones skipped); changing anything that alters what a record means
(models, sampling, max tokens, dataset, --think, budget forcing, ...) is refused.

`--engine vllm` runs the same study through vLLM's own speculative decoding (drafter and target both
Hugging Face directories on one vLLM engine, jobs batched by its scheduler, the rules decided by
AceSpec's vLLM plugin); run it from .venv-vllm. See acespec.eval.vllm_runner for what its records
count and what they leave out.

HumanEval answers (chat) usually restate the stub before the body: give them --max-tokens 384 or more,
or a truncated function fails its tests for want of room, not of skill.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from acespec.eval.report import write_report
from acespec.eval.runner import ABLATIONS, GUARD_NAMES, IDENTITY_FIELDS, EvalConfig, build_arms, read_records, run_eval
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

# CLI option -> config field
_FIELDS = {
    "rules": "rules",
    "guard": "guards",
    "ablate": "ablate",
    "dataset": "dataset",
    "n": "n",
    "seeds": "seeds",
    "max_tokens": "max_tokens",
    "think": "think",
    "draft": "draft",
    "target": "target",
    "n_ctx": "n_ctx",
    "k": "k",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "data_seed": "data_seed",
    "min_p": "min_p",
    "max_rank": "max_rank",
    "budget_fraction": "budget_fraction",
    "netwin_min": "netwin_min",
    "parallel": "parallel",
    "batching": "batching",
    "engine": "engine",
    "concurrency": "concurrency",
    "humaneval_mode": "humaneval_mode",
    "exec_timeout": "exec_timeout",
    "min_chars": "min_chars",
    "max_chars": "max_chars",
}


def _int(text: str, lo: int = 0) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= {lo}")
    return v


def _pos_int(text: str) -> int:
    return _int(text, 1)


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v == v or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return v


def _seeds(text: str) -> list[int]:
    """`3` = seeds 0, 1, 2; `0,5,9` = those seeds."""
    text = text.strip()
    if "," in text:
        try:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: seeds are integers") from None
        if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise argparse.ArgumentTypeError(f"{text!r}: give distinct seeds >= 0")
        return seeds
    return list(range(_pos_int(text)))


def _guards(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    out: list[str] = []
    for v in values:
        for g in v.split(","):
            g = g.strip()
            if not g:
                continue
            if g not in GUARD_NAMES:
                raise ValueError(f"unknown guard {g!r}; choose from {', '.join(GUARD_NAMES)}")
            if g not in out:
                out.append(g)
    return out


def _ablations(text: str) -> list[str]:
    out = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in out if g not in ABLATIONS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(ABLATIONS)}")
    return list(dict.fromkeys(out))


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="length-inflation harness: rules x prompts x seeds; lambda, net win, accuracy, plots",
        description="Run verification rules over a data set with the single-process path and report, per rule, "
        "length ratio lambda, acceptance, the net-win verdict, accuracy and where extra tokens fall.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    S = argparse.SUPPRESS
    p.add_argument(
        "--rules",
        default=S,
        help="comma-separated rule specs, each optionally +support/+netwin "
        "(default strict,cactus:delta=0.35; strict is always added)",
    )
    p.add_argument("--dataset", choices=["math", "humaneval", "sharegpt"], default=S, help="default math")
    p.add_argument("--n", type=_pos_int, default=S, help="prompts (default 8)")
    p.add_argument("--max-tokens", type=_pos_int, default=S, help="generation budget per answer (default 256)")
    p.add_argument("--seeds", type=_seeds, default=S, help="number of seeds (0..S-1) or a list a,b,c (default 1)")
    p.add_argument(
        "--think", action="store_true", default=S, help="ask for a <think>...</think> trace before the answer"
    )
    p.add_argument(
        "--guard",
        action="append",
        default=S,
        metavar="support|netwin|budget",
        help="support: support filter on every lossy rule; netwin: net-win guard on every lossy rule; "
        "budget: budget forcing (needs --think). Repeatable or comma-separated.",
    )
    p.add_argument(
        "--ablate",
        type=_ablations,
        default=S,
        metavar="support,netwin,force",
        help="add guarded copies as rows next to each rule: X+support and X+netwin after each lossy rule, "
        "X+force (budget forcing, needs --think) after every rule; the report compares each with X",
    )
    p.add_argument("--draft", default=S, help="drafter model (default: the registry's default drafter)")
    p.add_argument("--target", default=S, help="target model (default: the registry's default target)")
    p.add_argument(
        "--n-ctx",
        type=_pos_int,
        default=S,
        help="context window (llama.cpp's n_ctx, vLLM's max_model_len; default 4096)",
    )
    p.add_argument("--k", type=_pos_int, default=S, help="draft depth (default 4)")
    p.add_argument(
        "--temperature", type=_float, default=S, help="sampling temperature (default 0.7; relaxed rules need q, so > 0)"
    )
    p.add_argument("--top-k", type=_int, default=S, help="0 = off (default)")
    p.add_argument("--top-p", type=_float, default=S, help="1.0 = off (default)")
    p.add_argument("--data-seed", type=_int, default=S, help="which math problems / ShareGPT shuffle (default 0)")
    p.add_argument("--min-p", type=_float, default=S, help="support filter: minimum target probability (default 0.10)")
    p.add_argument("--max-rank", type=_int, default=S, help="support filter: worst target rank, 0 = off (default 10)")
    p.add_argument(
        "--budget-fraction",
        type=_float,
        default=S,
        help="budget forcing point, fraction of --max-tokens (default 0.85)",
    )
    p.add_argument(
        "--netwin-min", type=_pos_int, default=S, help="net-win guard: runs of each arm before trusting it (default 8)"
    )
    p.add_argument(
        "--parallel",
        type=_pos_int,
        default=S,
        metavar="N",
        help="run N jobs at once, one batched model pass per step for all of them (llama.cpp: one unified "
        "KV cache, not batch-invariant; see acespec.eval.parallel). Default 1",
    )
    p.add_argument(
        "--batching",
        choices=["shared", "exact"],
        default=S,
        help="--parallel: shared (default; one pass for all jobs, weights read once) or exact (a pass per "
        "job: the same bits as one at a time, little speed-up on CPU)",
    )
    p.add_argument(
        "--engine",
        choices=["llama", "vllm"],
        default=S,
        help="llama (default): AceSpec's single-process path; vllm: vLLM's own speculative decoding "
        "(draft_model) with AceSpec's rules in its sampler; --target and --draft are Hugging Face directories",
    )
    p.add_argument(
        "--concurrency",
        type=_pos_int,
        default=S,
        metavar="N",
        help="--engine vllm: jobs in flight at once, batched by vLLM's scheduler (default 16)",
    )
    p.add_argument(
        "--humaneval-mode", choices=["chat", "completion"], default=S, help="HumanEval prompting (default chat)"
    )
    p.add_argument("--exec-timeout", type=_float, default=S, help="HumanEval: seconds per test program (default 10)")
    p.add_argument(
        "--min-chars", type=_int, default=S, help="ShareGPT: shortest first user turn, characters (default 32)"
    )
    p.add_argument(
        "--max-chars", type=_pos_int, default=S, help="ShareGPT: longest first user turn, characters (default 2000)"
    )
    p.add_argument("--out", default=None, help="output folder (default runs/eval-<timestamp>)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="DIR",
        help="continue an interrupted run in DIR (or in --out): finished records are skipped",
    )
    p.add_argument(
        "--report-only", default=None, metavar="DIR", help="rebuild report.md/json and plots from DIR's records"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


def resolve_config(args: argparse.Namespace) -> tuple[EvalConfig, Path, bool]:
    """Merge defaults, a resumed run's saved config and the explicit options; returns (config, out dir, resumed)."""
    given = {field: getattr(args, opt) for opt, field in _FIELDS.items() if hasattr(args, opt)}
    if "guards" in given:
        given["guards"] = _guards(given["guards"])
    if "rules" in given:
        given["rules"] = [given["rules"]]
    resume = args.resume
    if isinstance(resume, str):
        if args.out and Path(args.out) != Path(resume):
            raise ValueError("--resume DIR and --out DIR name different folders")
        out = Path(resume)
    elif resume:
        if not args.out:
            raise ValueError("--resume needs a folder: --resume DIR, or --out DIR --resume")
        out = Path(args.out)
    else:
        out = Path(args.out) if args.out else Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    saved_path = out / "config.json"
    if resume:
        if not out.is_dir():
            raise ValueError(f"nothing to resume: {out} does not exist")
        base = EvalConfig.from_dict(json.loads(saved_path.read_text())) if saved_path.exists() else EvalConfig()
        if saved_path.exists():
            saved = base.to_dict()
            trial = EvalConfig.from_dict({**base.to_dict(), **given}).to_dict()
            changed = [f for f in IDENTITY_FIELDS if trial.get(f) != saved.get(f)]
            if changed:
                raise ValueError(
                    f"{out} was run with different {', '.join(changed)} "
                    f"({', '.join(f'{f}={saved.get(f)!r}' for f in changed)}); records would not compare. "
                    "Start a new --out folder instead."
                )
    else:
        if (out / "records.jsonl").exists():
            raise ValueError(
                f"{out} already holds records.jsonl; pass --resume to continue it, or choose another --out"
            )
        base = EvalConfig()
    cfg = EvalConfig.from_dict({**base.to_dict(), **given})
    cfg.validate()
    return cfg, out, bool(resume)


def command_line(cfg: EvalConfig, out: Path) -> str:
    """A command that reproduces (and, with --resume, continues) this run."""
    d = EvalConfig()
    parts = [
        "acespec",
        "eval",
        "--rules",
        ",".join(cfg.rules),
        "--dataset",
        cfg.dataset,
        "--n",
        str(cfg.n),
        "--max-tokens",
        str(cfg.max_tokens),
        "--seeds",
        str(len(cfg.seeds)) if cfg.seeds == list(range(len(cfg.seeds))) else ",".join(map(str, cfg.seeds)),
    ]
    if cfg.think:
        parts.append("--think")
    for g in cfg.guards:
        parts += ["--guard", g]
    if cfg.ablate:
        parts += ["--ablate", ",".join(cfg.ablate)]
    for opt, field in (
        ("--draft", "draft"),
        ("--target", "target"),
        ("--k", "k"),
        ("--temperature", "temperature"),
        ("--top-k", "top_k"),
        ("--top-p", "top_p"),
        ("--data-seed", "data_seed"),
        ("--min-p", "min_p"),
        ("--max-rank", "max_rank"),
        ("--budget-fraction", "budget_fraction"),
        ("--netwin-min", "netwin_min"),
        ("--parallel", "parallel"),
        ("--batching", "batching"),
        ("--engine", "engine"),
        ("--concurrency", "concurrency"),
        ("--humaneval-mode", "humaneval_mode"),
        ("--n-ctx", "n_ctx"),
        ("--min-chars", "min_chars"),
        ("--max-chars", "max_chars"),
    ):
        v = getattr(cfg, field)
        if v != getattr(d, field):
            parts += [opt, str(v)]
    parts += ["--out", str(out)]
    return shlex.join(parts)


def settings_of(cfg: EvalConfig) -> dict:
    s = cfg.to_dict()
    s["draft"] = cfg.draft or DEFAULT_DRAFT
    s["target"] = cfg.target or DEFAULT_TARGET
    s["arms"] = [a.label for a in build_arms(cfg.rules, cfg.guards, cfg.ablate)]
    s["sampling"] = (
        f"temperature {cfg.temperature}, top-k {cfg.top_k or 'off'}, top-p {cfg.top_p if cfg.top_p < 1 else 'off'}"
    )
    s["prompting"] = (
        "completion (raw HumanEval stub)"
        if cfg.dataset == "humaneval" and cfg.humaneval_mode == "completion"
        else "chat" + (" + <think> system turn, assistant pre-filled with <think>" if cfg.think else "")
    )
    return s


def cmd_eval(args: argparse.Namespace) -> int:
    if args.report_only:
        out = Path(args.report_only)
        recs = read_records(out / "records.jsonl")
        if not recs:
            raise ValueError(f"no records in {out / 'records.jsonl'}")
        cfg_path = out / "config.json"
        cfg = EvalConfig.from_dict(json.loads(cfg_path.read_text())) if cfg_path.exists() else EvalConfig()
        arms = [a.label for a in build_arms(cfg.rules, cfg.guards, cfg.ablate)]
        write_report(recs, out, settings=settings_of(cfg), command=command_line(cfg, out), arms=arms)
        print(out / "report.md")
        return 0
    cfg, out, resumed = resolve_config(args)
    if cfg.temperature <= 0.0:
        print(
            "acespec eval: note: temperature 0 makes p and q one-hot; relaxed rules then act like greedy",
            file=sys.stderr,
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    cmd = command_line(cfg, out)
    log = (lambda m: None) if args.quiet else (lambda m: print(f"acespec eval: {m}", file=sys.stderr))
    log(("resuming " if resumed else "writing ") + str(out))
    records = run_eval(cfg, out, progress=not args.quiet, log=log)

    arms = [a.label for a in build_arms(cfg.rules, cfg.guards, cfg.ablate)]
    agg = write_report(records, out, settings=settings_of(cfg), command=cmd, arms=arms)
    for arm, a in agg.items():
        lam = "n/a" if a["lambda"] is None else f"{a['lambda']:.3f}"
        gain = "n/a" if a["gain"] is None else f"{a['gain']:.3f}"
        rnd = (a.get("ci") or {}).get("rounds_rel")
        verdict = {"baseline": "baseline", "win": "net win", "loss": "net loss"}.get(a["verdict"], "inconclusive")
        if rnd and arm != "strict":
            verdict += f" (rounds vs strict {a['rounds_rel']:.3f} [{rnd[0]:.3f}, {rnd[1]:.3f}])"
        acc = "n/a" if a["accuracy"] is None else f"{100 * a['accuracy']:.0f}%"
        L = "n/a" if a["L"] is None else f"{a['L']:.1f}"
        print(f"{arm:36} L={L:>7} lambda={lam:>6} gain={gain:>6} correct={acc:>4}  {verdict}")
    print(out / "report.md")
    return 0
