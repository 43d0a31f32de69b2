"""`acespec bench peer`: AceSpec's local speculative decoding against llama.cpp's own, side by side.

    acespec bench peer [--ks 2,4,8] [--n-prompts 4] [--max-tokens 128] [--repeats 2] [--json OUT]

The peer is llama.cpp's `llama-speculative-simple` (a draft model proposes up to `--spec-draft-n-max`
tokens, the target verifies them in one pass, greedy acceptance) and `llama-completion` for plain
decoding. They are built once, from the llama.cpp source that the installed llama-cpp-python release
ships in its sdist (so both sides run the same kernels): the sdist comes from the package registry
(`pip download`, served by pip's cache after the first time), the two tools are built with the
CMake and Ninja that `requirements/build.txt` pins, into `--build-dir` (default
`~/.cache/acespec/peer/llama-cpp-python-<version>`), about 3 minutes on 2 cores. A second run finds
them there.

Same settings on both sides: the default pair, `--threads` threads for each model (prompt and
generation), greedy decoding, raw HumanEval code stubs as prompts (no chat template: both sides
tokenize the same text with the same vocabulary), and llama.cpp's extra weight buffers off (`-nr`,
which is what AceSpec's `LlamaCppModel` loads with: see `docs/design-notes.md` on AMX). For each
prompt and repeat, every configuration runs once, in an order that rotates, so drift on a noisy
machine falls on all of them alike.

Reported per configuration (totals over prompts and repeats): tokens/s end to end (every generated
token over prompt processing plus generation, each side by its own clock: llama.cpp's printed
timings, AceSpec's `RunStats`; model loading is left out on both), the ratio to the same side's plain
decoding, tau (tokens per target pass: n_predict / (n_predict - n_accept) for llama.cpp, whose every
pass adds one token of its own; emitted / rounds for AceSpec), the acceptance rate, and whether each
output equals that side's plain greedy text. Then the best K of each side and their ratio, and what
the 1.3x bar asks of AceSpec's speculation as a fraction of its own plain rate (1.3 x llama.cpp's best
speculative rate / AceSpec's plain rate) beside what its best K gives.

AceSpec also runs `auto`: `generate --policy controller`, which prices K every round from the passes
it measures and takes a plain target step where no block pays (on a CPU whose verify rows cost nearly
a step each, every round once it has measured that). One controller serves every `auto` run, as a
long-running process would keep it, so only the first run pays for learning the machine (a block,
and the drafter's prompt prefill). It is reported on its own line, with the share of its passes that
verified drafts, and never counts as the best K: it shows what a user of `generate` gets, not how
fast AceSpec's blocks are.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from acespec.argtypes import pos_int
from acespec.bench import write_result
from acespec.bench.peer_build import TOOLS, PeerError, build_steps, default_build_dir, ensure_built, peer_version
from acespec.eval.humaneval import load_problems
from acespec.loop import SpecConfig, generate
from acespec.loop.local import local_policy
from acespec.models import load_model
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, RegistryError, resolve

BAR = 1.3  # issue 24: AceSpec's best K at least this many times llama.cpp's best, same pair and threads


@dataclass
class Sample:
    """One generation: what it produced and what its own clock says it took."""

    side: str  # "llama.cpp" or "acespec"
    config: str  # "plain" or "k=K"
    prompt_id: str
    text: str = ""
    tokens: int = 0  # tokens generated (llama-speculative-simple may overshoot --n-predict by a block)
    seconds: float = 0.0  # prompt processing + generation
    drafted: int = 0
    accepted: int = 0
    passes: int = 0  # target verify passes (0 for plain)
    blocks: int = 0  # AceSpec: passes that verified drafts (the rest, under AUTO, were plain steps)
    equal: bool | None = None  # the text equals this side's plain greedy text (None for plain itself)


# ------------------------------------------------------------------------------------------ llama.cpp runs


def peer_argv(
    bins: dict[str, Path],
    *,
    target: Path,
    draft: Path | None,
    prompt: str,
    k: int,
    max_tokens: int,
    threads: int,
    n_ctx: int,
) -> list[str]:
    """llama.cpp's command line for one generation: plain (`draft=None`) or speculative with depth k."""
    common = [
        "-m",
        str(target),
        "-p",
        prompt,
        "-n",
        str(max_tokens),
        "--temp",
        "0",
        "-c",
        str(n_ctx),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-nr",
    ]
    if draft is None:
        return [str(bins["llama-completion"]), *common, "-no-cnv", "--no-display-prompt"]
    return [
        str(bins["llama-speculative-simple"]),
        *common,
        "-md",
        str(draft),
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        str(k),
        "-td",
        str(threads),
        "-tbd",
        str(threads),
    ]


_PERF = re.compile(
    r"common_perf_print:\s+(sampling time|prompt eval time|eval time|unaccounted time)\s+=\s+([0-9.]+) ms"
    r"(?:\s*/\s*(\d+) (?:runs|tokens))?"
)
_ENC = re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_DEC = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_COUNT = {name: re.compile(rf"\b{name}\s*=\s*(\d+)") for name in ("n_predict", "n_drafted", "n_accept")}


def parse_plain(stdout: str, stderr: str) -> tuple[str, int, float]:
    """(generated text, tokens, seconds) from llama-completion run with --no-display-prompt."""
    times: dict[str, tuple[float, int | None]] = {}
    for m in _PERF.finditer(stderr):
        times[m.group(1)] = (float(m.group(2)) / 1e3, int(m.group(3)) if m.group(3) else None)
    if "eval time" not in times or "prompt eval time" not in times:
        raise PeerError("llama-completion printed no timings (its stderr has no `common_perf_print: eval time`)")
    text = stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
    runs = times["eval time"][1] or 0
    return text, runs + 1, sum(t for t, _ in times.values())  # the first token comes from the prompt's pass


def parse_spec(stdout: str, stderr: str, prompt: str) -> tuple[str, int, float, int, int]:
    """(generated text, tokens, seconds, drafted, accepted) from llama-speculative-simple."""
    enc, dec = _ENC.search(stderr), _DEC.search(stderr)
    found = {k: rx.search(stderr) for k, rx in _COUNT.items()}
    counts = {k: m for k, m in found.items() if m is not None}
    if not enc or not dec or len(counts) < len(found):
        raise PeerError("llama-speculative-simple printed no statistics (no `decoded N tokens` / n_accept lines)")
    text = stdout.removeprefix("\n\n").removeprefix(prompt).removesuffix("\n\n").removesuffix("\n\n")
    n = int(counts["n_predict"].group(1))
    return (
        text,
        n,
        float(enc.group(2)) + float(dec.group(2)),
        int(counts["n_drafted"].group(1)),
        int(counts["n_accept"].group(1)),
    )


def run_peer(bins, cfg: PeerConfig, paths: tuple[Path, Path], prompt_id: str, prompt: str, k: int | None) -> Sample:
    draft_path, target_path = paths
    argv = peer_argv(
        bins,
        target=target_path,
        draft=None if k is None else draft_path,
        prompt=prompt,
        k=k or 0,
        max_tokens=cfg.max_tokens,
        threads=cfg.threads,
        n_ctx=cfg.n_ctx,
    )
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        raise PeerError(f"{Path(argv[0]).name} ran past {cfg.timeout_s:.0f} s on {prompt_id}") from None
    except OSError as e:
        raise PeerError(f"cannot run {argv[0]}: {e}; delete {Path(argv[0]).parent.parent.parent} to rebuild") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise PeerError(f"{Path(argv[0]).name} failed with exit status {done.returncode}:\n{tail}")
    s = Sample("llama.cpp", config_name(k), prompt_id)
    if k is None:
        s.text, s.tokens, s.seconds = parse_plain(done.stdout, done.stderr)
    else:
        s.text, s.tokens, s.seconds, s.drafted, s.accepted = parse_spec(done.stdout, done.stderr, prompt)
        s.passes = s.tokens - s.accepted  # every pass adds its own token after the accepted drafts
    return s


# ------------------------------------------------------------------------------------------ the bench


@dataclass
class PeerConfig:
    ks: tuple[int, ...] = (2, 4, 8)  # draft depths tried on both sides; each side's best counts
    n_prompts: int = 4  # HumanEval code stubs, in task order
    max_tokens: int = 128  # tokens per generation
    repeats: int = 2  # every (prompt, configuration) this many times
    threads: int = 2  # llama.cpp threads per model, both sides
    n_ctx: int = 2048  # context window, both sides
    timeout_s: float = 600.0  # one llama.cpp run longer than this is an error


AUTO = "auto"  # AceSpec's depth controller (`generate --policy controller`): K priced every round, 0 = a plain step


def configurations(ks) -> list[tuple[str, int | str | None]]:
    """(side, k) per configuration: k None is plain decoding, AUTO the controller (AceSpec only)."""
    return [(side, k) for side in ("llama.cpp", "acespec") for k in (None, *ks)] + [("acespec", AUTO)]


def config_name(k: int | str | None) -> str:
    return "plain" if k is None else (AUTO if k == AUTO else f"k={k}")


def gguf_paths(draft_spec: str, target_spec: str) -> tuple[Path, Path]:
    """The two models' GGUF files: the peer runs llama.cpp models only."""
    out = []
    for flag, spec in (("--draft", draft_spec), ("--target", target_spec)):
        r = resolve(spec)
        if r.kind != "gguf" or r.path is None:
            raise PeerError(f"bench peer runs llama.cpp models: {flag} {spec!r} is not a GGUF file or registry name")
        out.append(Path(r.path))
    return out[0], out[1]


def run_bench(cfg: PeerConfig, bins, *, draft_spec: str, target_spec: str, progress=sys.stderr) -> dict:
    paths = gguf_paths(draft_spec, target_spec)
    target = load_model(target_spec, n_ctx=cfg.n_ctx, n_threads=cfg.threads)
    draft = load_model(draft_spec, n_ctx=cfg.n_ctx, n_threads=cfg.threads)
    prompts = [(p["task_id"], p["prompt"]) for p in load_problems()[: cfg.n_prompts]]
    confs = configurations(cfg.ks)
    auto_policy = local_policy("controller", 4)  # one for every AUTO run, as a long-running process keeps it
    samples: list[Sample] = []
    total = len(prompts) * cfg.repeats * len(confs)
    t_start = time.perf_counter()
    try:
        for r in range(cfg.repeats):
            for pi, (pid, text) in enumerate(prompts):
                shift = (r * len(prompts) + pi) % len(confs)
                for side, k in confs[shift:] + confs[:shift]:
                    if side == "llama.cpp":
                        assert not isinstance(k, str), "the controller (AUTO) runs on AceSpec's side only"
                        s = run_peer(bins, cfg, paths, pid, text, k)
                    else:
                        draft.reset()
                        target.reset()
                        ids = target.tokenizer.encode(text)
                        auto = k == AUTO
                        sc = SpecConfig(
                            rule="greedy",
                            k=k if isinstance(k, int) else (4 if auto else 0),
                            max_tokens=cfg.max_tokens,
                            spec=k is not None,
                            policy="controller" if auto else "fixed",
                        )
                        res = generate(
                            target,
                            ids,
                            sc,
                            draft=draft if k is not None else None,
                            policy=auto_policy if auto else None,
                        )
                        st = res.stats
                        s = Sample(
                            "acespec",
                            config_name(k),
                            pid,
                            target.tokenizer.decode(res.tokens),
                            st.emitted,
                            st.wall_s,
                            st.drafted,
                            st.accepted,
                            st.rounds if k is not None else 0,
                            blocks=sum(1 for x in st.k_chosen if x > 0) if k is not None else 0,
                        )
                    samples.append(s)
                    if progress is not None:
                        print(
                            f"peer: {len(samples)}/{total} {s.side} {s.config} {pid}: {s.tokens / max(s.seconds, 1e-9):.2f} tok/s "
                            f"({time.perf_counter() - t_start:.0f} s)",
                            file=progress,
                            flush=True,
                        )
    finally:
        draft.close()
        target.close()
    _mark_equal(samples)
    return summarise(samples, cfg, draft_spec=draft_spec, target_spec=target_spec)


def _mark_equal(samples: list[Sample]) -> None:
    """A speculative text equals plain greedy when the plain text (max_tokens tokens) begins it: the
    peer may run a block past --n-predict, and either side may stop early at the end of text."""
    plain = {(s.side, s.prompt_id): s.text for s in samples if s.config == "plain"}
    for s in samples:
        ref = plain.get((s.side, s.prompt_id))
        if s.config != "plain" and ref is not None:
            s.equal = s.text.startswith(ref) or ref.startswith(s.text)


def summarise(samples: list[Sample], cfg: PeerConfig, *, draft_spec: str, target_spec: str) -> dict:
    rows: dict[str, dict[str, Any]] = {}  # "side config" -> its figures
    for side, k in configurations(cfg.ks):
        name = config_name(k)
        ss = [s for s in samples if s.side == side and s.config == name]
        if not ss:
            continue
        tok, sec = sum(s.tokens for s in ss), sum(s.seconds for s in ss)
        passes, accepted, drafted = sum(s.passes for s in ss), sum(s.accepted for s in ss), sum(s.drafted for s in ss)
        eq = [s.equal for s in ss if s.equal is not None]
        rows[f"{side} {name}"] = {
            "side": side,
            "config": name,
            "k": k,
            "runs": len(ss),
            "tokens": tok,
            "seconds": round(sec, 3),
            "tokens_per_s": round(tok / sec, 3) if sec > 0 else 0.0,
            "tau": round(tok / passes, 3) if passes else None,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "equal_to_plain": f"{sum(eq)}/{len(eq)}" if eq else None,
            "block_share": round(sum(s.blocks for s in ss) / passes, 3) if side == "acespec" and passes else None,
        }
    for row in rows.values():
        base = rows.get(f"{row['side']} plain")
        row["x_plain"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3) if base and base["tokens_per_s"] else None
    best = {}
    for side in ("llama.cpp", "acespec"):
        spec = [r for r in rows.values() if r["side"] == side and isinstance(r["k"], int)]  # fixed depths
        if spec:
            best[side] = max(spec, key=lambda r: r["tokens_per_s"])["config"]
    # llama.cpp's best speculative rate: what the ratio, the bar and the auto row are all measured against
    peer_rate = rows[f"llama.cpp {best['llama.cpp']}"]["tokens_per_s"] if "llama.cpp" in best else None
    ratio = None
    if len(best) == 2:
        ratio = round(rows[f"acespec {best['acespec']}"]["tokens_per_s"] / peer_rate, 3)
    # what the bar asks of AceSpec's speculation as a fraction of its own plain rate: where it is above
    # what any K gives, no K meets the bar without cheaper passes (scripts/trace_generate.py prices a
    # token of each K in plain steps; on the 2-core CPUs measured, every K costs more than a plain step)
    needs = None
    if peer_rate is not None and rows.get("acespec plain", {}).get("tokens_per_s"):
        needs = round(BAR * peer_rate / rows["acespec plain"]["tokens_per_s"], 3)
    auto = rows.get(f"acespec {AUTO}")
    auto_ratio = None
    if auto and peer_rate is not None:
        auto_ratio = round(auto["tokens_per_s"] / peer_rate, 3)
    plain_same = None
    pl = {(s.prompt_id, s.side): s.text for s in samples if s.config == "plain"}
    pids = sorted({s.prompt_id for s in samples})
    if all((p, side) in pl for p in pids for side in ("llama.cpp", "acespec")):
        plain_same = f"{sum(pl[(p, 'acespec')] == pl[(p, 'llama.cpp')] for p in pids)}/{len(pids)}"
    return {
        "config": asdict(cfg),
        "models": {"draft": draft_spec, "target": target_spec},
        "peer_version": peer_version(),
        "rows": rows,
        "best": best,
        "acespec_over_peer": ratio,
        "bar_needs_x_plain": needs,
        "auto_over_peer": auto_ratio,
        "plain_texts_equal": plain_same,
        "samples": [asdict(s) for s in samples],
    }


def format_report(res: dict) -> str:
    c = res["config"]
    out = [
        f"acespec bench peer: {res['models']['draft']} -> {res['models']['target']}, greedy, {c['n_prompts']} HumanEval "
        f"stub(s) x {c['max_tokens']} tokens x {c['repeats']} repeat(s), {c['threads']} threads per model, "
        f"llama.cpp from llama-cpp-python {res['peer_version']}, extra weight buffers off on both sides",
        f"{'side':>10} {'config':>7} {'tok/s':>8} {'x plain':>8} {'tau':>6} {'accept':>7} {'= plain greedy':>15}",
    ]
    for r in res["rows"].values():
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        out.append(
            f"{r['side']:>10} {r['config']:>7} {r['tokens_per_s']:>8.2f} {r['x_plain'] or 0:>8.2f} {tau:>6} {acc:>7} "
            f"{r['equal_to_plain'] or '(reference)':>15}"
        )
    if res["plain_texts_equal"]:
        out.append(f"plain greedy texts equal across the two sides: {res['plain_texts_equal']} prompts")
    if res["acespec_over_peer"] is not None:
        b = res["best"]
        met = "met" if res["acespec_over_peer"] >= BAR else "NOT met"
        out.append(
            f"best K: acespec {b['acespec']} over llama.cpp {b['llama.cpp']}: {res['acespec_over_peer']:.2f}x "
            f"[{met}: bar {BAR}x]"
        )
        if res.get("bar_needs_x_plain") is not None:
            best_x = res["rows"][f"acespec {b['acespec']}"]["x_plain"] or 0
            out.append(
                f"the bar asks acespec's speculation for {res['bar_needs_x_plain']:.2f}x its own plain decoding "
                f"({BAR} x llama.cpp {b['llama.cpp']} / acespec plain); its best K gives {best_x:.2f}x"
            )
    if res.get("auto_over_peer") is not None:
        r = res["rows"][f"acespec {AUTO}"]
        met = "met" if res["auto_over_peer"] >= BAR else "NOT met"
        out.append(
            f"acespec {AUTO} (the depth controller) over llama.cpp {res['best']['llama.cpp']}: {res['auto_over_peer']:.2f}x "
            f"[{met}: bar {BAR}x], {r['x_plain'] or 0:.2f}x its own plain decoding, drafts verified in "
            f"{100 * (r['block_share'] or 0):.1f}% of its target passes (the rest plain steps)"
        )
    out.append(
        "tok/s: every generated token over prompt processing + generation, by each side's own clock (model loading "
        "left out); tau: tokens per target pass; auto: `acespec generate --policy controller`, which prices K every "
        "round from the passes it measures and takes a plain step where no block pays (one controller for every auto run)"
    )
    return "\n".join(out)


def draft_depths(text: str) -> tuple[int, ...]:
    """argparse type of `--ks`: comma-separated draft depths, each 1-64 (also scripts/trace_generate.py's)."""
    try:
        ks = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ks takes comma-separated draft depths, e.g. 2,4,8; got {text!r}") from None
    if not ks or any(k < 1 or k > 64 for k in ks):
        raise argparse.ArgumentTypeError(f"--ks needs draft depths between 1 and 64, got {text!r}")
    return ks


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("peer", help="AceSpec against llama.cpp's llama-speculative-simple, side by side")
    p.add_argument("--ks", type=draft_depths, default=(2, 4, 8), help="draft depths for both sides (default 2,4,8)")
    p.add_argument("--n-prompts", type=pos_int, default=4, help="HumanEval code stubs (default 4)")
    p.add_argument("--max-tokens", type=pos_int, default=128, help="tokens per generation (default 128)")
    p.add_argument("--repeats", type=pos_int, default=2, help="runs of every (prompt, configuration) (default 2)")
    p.add_argument(
        "--threads",
        type=pos_int,
        default=os.cpu_count() or 1,
        help="threads per model, both sides (default: every core)",
    )
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"drafter GGUF or registry name (default {DEFAULT_DRAFT})")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target GGUF or registry name (default {DEFAULT_TARGET})")
    p.add_argument(
        "--build-dir", type=Path, default=None, help="where llama.cpp is built (default ~/.cache/acespec/peer/...)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the build steps and one prompt's commands; build and run nothing"
    )
    p.add_argument("--json", default=None, help="write the full result here")
    p.set_defaults(func=cmd_peer)
    return p


def cmd_peer(args: argparse.Namespace) -> int:
    cfg = PeerConfig(
        ks=args.ks, n_prompts=args.n_prompts, max_tokens=args.max_tokens, repeats=args.repeats, threads=args.threads
    )
    try:
        paths = gguf_paths(args.draft, args.target)  # before any build: a bad model is said at once
        root = args.build_dir or default_build_dir()
        if args.dry_run:
            version = peer_version()
            for what, argv in build_steps(root, version):
                print(f"# {what}\n{' '.join(argv)}")
            bins = {t: root / "build" / "bin" / t for t in TOOLS}
            for k in (None, *cfg.ks):
                argv = peer_argv(
                    bins,
                    target=paths[1],
                    draft=None if k is None else paths[0],
                    prompt="PROMPT",
                    k=k or 0,
                    max_tokens=cfg.max_tokens,
                    threads=cfg.threads,
                    n_ctx=cfg.n_ctx,
                )
                print(f"# llama.cpp {'plain' if k is None else f'k={k}'}\n{' '.join(argv)}")
            return 0
        bins = ensure_built(root)
        res = run_bench(cfg, bins, draft_spec=args.draft, target_spec=args.target)
    except (PeerError, RegistryError) as e:
        print(f"acespec: error: {e}", file=sys.stderr)
        return 2
    print(format_report(res))
    write_result(args.json, res)
    return 0


__all__ = [
    "PeerConfig",
    "PeerError",
    "Sample",
    "build_steps",
    "configurations",
    "ensure_built",
    "gguf_paths",
    "parse_plain",
    "parse_spec",
    "peer_argv",
    "run_bench",
    "summarise",
]
