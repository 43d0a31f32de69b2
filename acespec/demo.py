"""`acespec demo`: the whole edge–cloud system on this machine, in one command.

It starts the cloud verifier (`acespec serve`, default target) and the WAN emulator (`acespec wan`)
as child processes, runs the edge (default drafter) in this process through the emulated link, and
generates the same prompt four ways with the same seed: AceSpec (the default mode, `auto`: the
cloud streams without ever waiting and the edge's drafts join when ready), `edge-led` (pipelined +
state cache + branches + adaptive depth and window: the edge drafts and the cloud verifies),
`sync` (stop-and-wait) and `cloud-only` (the cloud streams tokens). It streams
AceSpec's text, then prints a side-by-side table and a losslessness check. Every child process is
stopped on exit, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from acespec.bench.children import ChildProcesses, wait_for_line
from acespec.config import DemoRole, add_cli_args, add_config_arg, resolve
from acespec.config.roles import DEFAULT_PROMPT  # noqa: F401  (its old home: importable from here)
from acespec.config.schema import flat
from acespec.models.registry import resolve as resolve_model
from acespec.sim.ceiling import against_ceiling, calibrate, describe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run cloud verifier + WAN emulator + edge on this machine and compare modes")
    add_config_arg(p)
    add_cli_args(p, DemoRole())
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    role: DemoRole = resolve(DemoRole(), args).config
    resolve_model(role.draft), resolve_model(role.target)  # clear errors before starting anything
    args = argparse.Namespace(**flat(role))  # what _run reads: every setting by its flag's name
    children = ChildProcesses()
    interrupted = threading.Event()

    def interrupt(*_):
        interrupted.set()
        raise KeyboardInterrupt()

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(args, children)
    except Exception as e:
        # unwinding from Ctrl-C can fail on its own (a half-closed session, a child already gone): the
        # user asked to stop, so report the interrupt, not what broke while stopping
        if interrupted.is_set():
            raise KeyboardInterrupt() from e
        raise
    finally:
        children.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace, children: ChildProcesses) -> int:
    from acespec.draft.cache import DRAFTER_SLOTS
    from acespec.edge.client import ConnectConfig
    from acespec.edge.runtime import EdgeConfig, run_edge
    from acespec.loop.backoff import BackoffMemory
    from acespec.models import TextStream, load_model
    from acespec.models.llama import on_cpus, split_cpus, split_threads

    py = [sys.executable, "-m", "acespec.cli"]
    with tempfile.TemporaryDirectory(prefix="acespec-demo-") as tmp, contextlib.ExitStack() as stack:
        token = secrets.token_hex(16).encode()
        token_file = Path(tmp) / "token"
        token_file.write_bytes(token)
        env = dict(os.environ)
        edge_threads, cloud_threads = split_threads(args.cores)
        if cloud_threads:
            env["ACESPEC_THREADS"] = str(cloud_threads)
        # split cores: the cloud's whole process on its cores, the rest of the demo (the edge, the WAN
        # emulator, the edge's Python) on the edge's, as two devices would be
        edge_cpus, cloud_cpus = split_cpus(args.cores)
        print(f"[demo] starting the cloud verifier ({args.target}) ...", file=sys.stderr, flush=True)
        with on_cpus(cloud_cpus):
            serve = children.start(
                py
                + [
                    "serve",
                    "--target",
                    args.target,
                    "--port",
                    "0",
                    "--token-file",
                    str(token_file),
                    "--no-prefix-reuse",
                ],
                env,
            )
        stack.enter_context(on_cpus(edge_cpus))
        m = wait_for_line(serve, r"listening on ([\d.]+):(\d+)", 300, "the cloud verifier")
        cloud_port = int(m.group(2))
        wan_args = [
            "wan",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"127.0.0.1:{cloud_port}",
            "--profile",
            args.profile,
        ]
        if args.rtt:
            wan_args += ["--rtt", args.rtt]
        wan = children.start(py + wan_args, env)
        m = wait_for_line(wan, r"listening on [\d.]+:(\d+) -> \S+ \| (.*?) \|", 60, "the WAN emulator")
        wan_port, link = int(m.group(1)), m.group(2)
        print(f"[demo] WAN emulator: {link}", file=sys.stderr)
        print(f"[demo] loading the drafter ({args.draft}) on the edge ...", file=sys.stderr, flush=True)
        if args.draft.startswith("toy"):
            drafter = load_model(args.draft)
        else:
            threads: dict[str, Any] = {"n_threads": edge_threads} if edge_threads else {}
            drafter = load_model(args.draft, n_slots=DRAFTER_SLOTS, **threads)
        tok = drafter.tokenizer
        prompt = tok.chat_prompt([{"role": "user", "content": args.prompt}])
        connect = ConnectConfig(port=wan_port, token=token)
        common = dict(
            rule=args.rule, temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens, connect=connect
        )
        auto = ("AceSpec", EdgeConfig(mode="auto", **common), True)
        runs = [auto]
        if not args.quick:
            runs += [
                (
                    "edge-led",
                    EdgeConfig(
                        mode="pipelined",
                        k=args.k,
                        policy="controller",
                        cache=True,
                        branches=True,
                        auto_window=True,
                        **common,
                    ),
                    False,
                ),
                ("sync", EdgeConfig(mode="sync", k=args.k, **common), False),
            ]
            # AceSpec and cloud-only, the headline's two sides, run `repeats` times each in mirrored order
            # (A C edge-led sync C A ...), and each keeps its fastest run: the same prompt's prefill
            # alone varies by up to a third from run to run on a shared CPU, more than the modes differ
            plain = ("cloud-only", EdgeConfig(mode="cloud-only", **common), False)
            runs.insert(1, plain)
            for i in range(1, args.repeats):
                runs += [plain, (auto[0], auto[1], False)] if i % 2 else [(auto[0], auto[1], False), plain]
        # one short untimed run first: llama.cpp's first evaluation of a model is slow (weights are
        # repacked, threads spun up), and that cold start belongs to no mode
        print("[demo] warming up both models ...", file=sys.stderr, flush=True)
        run_edge(
            drafter, prompt, EdgeConfig(mode="sync", k=args.k, **{**common, "max_tokens": 4}), model_id=tok.fingerprint
        )
        results: dict[str, Any] = {}
        every: dict[str, list] = {}  # each mode's runs, for the losslessness check
        # one edge across its runs, as `edge serve` is across its requests: an auto run after one that
        # found the cloud passing its drafts over streams as cloud-only, but for a probe (`loop/backoff.py`)
        memory = BackoffMemory()
        for name, cfg, show in runs:
            stream = TextStream(tok)
            if show:
                print(
                    f"\n[demo] {name} (mode auto: the cloud streams, the edge's drafts join when ready) over the emulated link:\n",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                print(f"\n[demo] running {name} for comparison ...", file=sys.stderr, flush=True)

            def on_tokens(toks, stream=stream, show=show):
                text = stream.push(toks)
                if show:
                    sys.stdout.write(text)
                    sys.stdout.flush()

            res = run_edge(
                drafter if cfg.mode != "cloud-only" else None,
                prompt,
                cfg,
                model_id=tok.fingerprint,
                on_tokens=on_tokens,
                backoff=memory,
            )
            if show:
                sys.stdout.write(stream.flush() + "\n")
            every.setdefault(name, []).append(res)
            if name not in results or res.stats.tokens_per_s > results[name].stats.tokens_per_s:
                results[name] = res
        results = {name: results[name] for name in ("AceSpec", "edge-led", "sync", "cloud-only") if name in results}
        print_table(results, args, link, modes={name: cfg.mode for name, cfg, _ in runs}, every=every)
        if not args.quick:
            from acespec.bench.tenants import demo_capacity

            print(
                "\n[demo] the cloud's side: several edges at once (a short live run of `acespec bench tenants`) ...",
                file=sys.stderr,
                flush=True,
            )
            traces = None
            if args.target.startswith("toy"):  # the committed traces are the default pair's: record toy ones
                from acespec.sim.trace import TraceSet, record_prompt

                target = load_model(args.target)
                traces = TraceSet(
                    [
                        record_prompt(target, drafter, prompt, max_tokens=args.max_tokens, pid=f"toy/{i}")[0]
                        for i in range(4)
                    ]
                )
            print(
                "\n"
                + demo_capacity(
                    cloud_port, model_id=tok.fingerprint, vocab=drafter.vocab_size, auth=token, traces=traces
                )
            )
        if args.json:
            import json

            Path(args.json).write_text(
                json.dumps({k: v.stats.summary() | {"tokens": v.tokens} for k, v in results.items()}, indent=2)
            )
    return 0


def agreement(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(1, max(len(a), len(b)))


def print_table(
    results: dict,
    args: argparse.Namespace,
    link: str,
    modes: dict[str, str] | None = None,
    every: dict[str, list] | None = None,
) -> None:
    """`results`: the run shown per mode; `modes`: each one's edge mode (its ceiling's mode; without it
    no ceiling is printed); `every`: all of a mode's runs where it ran more than once (each one's text
    is checked, and the table says how many runs it kept the fastest of)."""
    every = every or {}
    names = list(results)
    rows = [
        ("tokens/s", lambda s, st: f"{s['tokens_per_s']:.2f}"),
        ("time to first token (s)", lambda s, st: f"{s['ttft_s']:.3f}"),
        ("inter-token p50 (ms)", lambda s, st: f"{1e3 * s['itl_p50_s']:.1f}"),
        ("inter-token p99 (ms)", lambda s, st: f"{1e3 * s['itl_p99_s']:.1f}"),
        ("target passes / token", lambda s, st: f"{s['target_passes_per_token']:.3f}"),
        ("uplink bytes / token", lambda s, st: f"{s.get('bytes_up_per_token', 0):.1f}"),
        ("downlink bytes / token", lambda s, st: f"{s.get('bytes_down_per_token', 0):.1f}"),
        ("cache hit rate", lambda s, st: f"{s['cache']['hit_rate']:.2f}" if "hit_rate" in s.get("cache", {}) else "-"),
        ("mean K chosen", lambda s, st: f"{s['mean_k']:.2f}" if s["drafted"] else "-"),
        ("mean acceptance length", lambda s, st: f"{s['mean_acceptance_length']:.2f}" if s["drafted"] else "-"),
        ("tokens", lambda s, st: str(s["emitted"])),
    ]
    sums = {n: results[n].stats.summary() for n in names}
    # what the hardware allows each mode, from this run's own passes, drafting, link and acceptance

    cal = calibrate(results[n].stats for n in names)
    modes = modes or {}
    tops = {n: against_ceiling([results[n].stats], modes[n], cal) for n in names if cal is not None and n in modes}
    w = 26
    out = sys.stdout
    out.write(f"\n=== AceSpec demo: {link}; rule {args.rule}, temperature {args.temperature:g}, seed {args.seed} ===\n")
    out.write(f"{'':{w}}" + "".join(f"{n:>14}" for n in names) + "\n")
    for label, fn in rows:
        out.write(f"{label:{w}}" + "".join(f"{fn(sums[n], results[n].stats):>14}" for n in names) + "\n")
    if tops:
        out.write(
            f"{'ceiling tokens/s (K)':{w}}"
            + "".join(f"{f'{tops[n][0]:.2f} ({tops[n][2]})' if n in tops else '-':>14}" for n in names)
            + "\n"
        )
        out.write(
            f"{'steady rate / ceiling':{w}}"
            + "".join(f"{tops[n][1]:>14.2f}" if n in tops else f"{'-':>14}" for n in names)
            + "\n"
        )
    if "cloud-only" in results:
        base = sums["cloud-only"]["tokens_per_s"] or 1e-9
        out.write(
            f"{'speed vs cloud-only':{w}}" + "".join(f"{sums[n]['tokens_per_s'] / base:>13.2f}x" for n in names) + "\n"
        )
        ref = results["cloud-only"].tokens
        for n in names:
            runs = every.get(n, [results[n]])
            if n == "cloud-only":
                if any(r.tokens != ref for r in runs):
                    out.write("losslessness: cloud-only's runs gave different texts (a cloud without exact passes)\n")
                continue
            differs = [r for r in runs if r.tokens != ref]
            a = agreement((differs or runs)[0].tokens, ref)
            same = not differs
            out.write(
                f"losslessness: {n} text {'==' if same else '!='} cloud-only text"
                + (
                    ""
                    if same
                    else f" (agreement {a:.0%} of tokens before the first difference; expected equal: a"
                    " model without exact passes, docs/design-notes.md, computes verify rows with other rounding)"
                )
                + "\n"
            )
    repeated = [n for n in names if len(every.get(n, ())) > 1]
    if repeated:
        plain = sum(1 for r in every.get("AceSpec", ()) if r.stats.lead.get("plain_because") == "backoff")
        why = f" ({plain} of the AceSpec runs streamed as cloud-only: the cloud had passed its drafts over)"
        out.write(
            f"runs: {' and '.join(repeated)} ran {len(every[repeated[0]])} times each, taking turns; each column "
            "shows its fastest run (the same prompt's prefill varies by up to a third between runs here); "
            "the edge keeps what each auto run learned of the cloud's use of its drafts for the next, as "
            f"`edge serve` does{why if plain else ''}\n"
        )
    if tops:
        out.write(
            describe(cal)
            + "\n      the ceiling: the best tokens/s any schedule of the mode could reach on those figures\n"
            "      (acespec/sim/ceiling.py); steady rate / ceiling: what the serving engine, the wire and Python cost\n"
        )
    if getattr(args, "cores", "shared") == "split":
        out.write(
            "note: the edge and the cloud each have their own CPU core(s) here (--cores split), like two devices;\n"
            "      a cloud GPU would verify a block in about the time of one step (see `acespec bench sim`).\n"
        )
    else:
        out.write(
            "note: edge and cloud share this machine's CPU cores here, so drafting and verifying compete for compute;\n"
            "      on a real edge NPU + cloud GPU they run in parallel (see `acespec bench acespec`).\n"
        )
    out.flush()
