"""`acespec serve`: run the cloud verifier.

    acespec serve --target qwen2.5-coder-1.5b --port 7070 --token-file token.txt
    acespec serve --slots 16 --kv-budget 32768 --tick-tokens 256     # 16 sessions of 2,048 tokens each
    acespec serve --token-file tenants.txt --tls-cert cloud.pem --tls-key cloud.key   # tenants, TLS
    acespec serve --ws-port 7071     # also WebSocket edges (browsers): docs/operate/websocket.md

A token file holds one token per tenant, `name:token` on each line (blank lines and `#` comments are
skipped); a session belongs to the tenant that opened it, and no other tenant can RESUME it. A file
of one line with no `:` is a single shared token (the tenant `default`).

The default engine batches every session's blocks into one model pass per tick, with one KV sequence
per resident session (`--slots`); `--kv-budget` is the KV memory they share, in tokens, so each
session may hold `kv-budget / slots` tokens. `--engine serial` is the old one-session-at-a-time server.
`--engine vllm --target HF_DIR` serves the target on vLLM (install it with `scripts/setup.sh vllm` and run
`.venv-vllm/bin/acespec serve ...`; `acespec models export-hf qwen2.5-coder-1.5b DIR` makes the directory).

Stops cleanly on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from pathlib import Path

from acespec.cloud.engine import ENGINES
from acespec.models.registry import DEFAULT_TARGET


def read_token(path: str | None) -> bytes | None:
    if not path:
        return None
    p = Path(path)
    try:
        tok = p.read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the token file {path}: {e.strerror}") from None
    if not tok:
        raise ValueError(f"the token file {path} is empty")
    return tok


def read_tenants(path: str | None) -> dict[str, bytes] | None:
    """`name:token` lines -> {name: token}; a one-line file without `:` -> {"default": token}."""
    if not path:
        return None
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the token file {path}: {e.strerror}") from None
    lines = [ln.strip() for ln in raw.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(b"#")]
    if not lines:
        raise ValueError(f"the token file {path} is empty")
    if len(lines) == 1 and b":" not in lines[0]:
        return {"default": lines[0]}
    tenants: dict[str, bytes] = {}
    for i, ln in enumerate(lines, 1):
        name, sep, tok = ln.partition(b":")
        name, tok = name.strip(), tok.strip()
        if not sep or not name or not tok:
            raise ValueError(f"the token file {path}: entry {i} must look like name:token")
        try:
            key = name.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"the token file {path}: entry {i} has a tenant name that is not UTF-8") from None
        if key in tenants:
            raise ValueError(f"the token file {path}: tenant {key!r} is listed twice")
        if tok in tenants.values():
            raise ValueError(f"the token file {path}: tenant {key!r} shares its token with another tenant")
        tenants[key] = tok
    return tenants


def register(sub: argparse._SubParsersAction) -> None:
    from acespec.argtypes import nonneg_float, pos_float_or_inf
    from acespec.argtypes import nonneg_int as _nonnegative_int
    from acespec.cli import _positive_int

    p = sub.add_parser("serve", help="run the cloud verifier (TCP)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_positive_int, default=7070, help="0 = any free port (printed at start)")
    p.add_argument("--token-file", help="tenants' auth tokens, `name:token` per line, or one shared token (default: no auth)")
    p.add_argument("--max-sessions", type=_positive_int, default=8, help="live sessions at once, resident or swapped out")
    p.add_argument("--engine", choices=ENGINES, default="batched", help="verify engine (default batched; noop accepts every draft with no model pass, for measuring the front end)")
    p.add_argument("--slots", type=_positive_int, help="batched: KV sequences, i.e. sessions resident at once (default --max-sessions)")
    p.add_argument("--n-ctx", type=_positive_int, default=4096, help="tokens one session may hold (prompt + output; default 4096)")
    p.add_argument("--kv-budget", type=_positive_int,
                   help="batched: total KV tokens for all slots (default slots x n-ctx); sets n-ctx to kv-budget / slots")
    p.add_argument("--batching", choices=("exact", "shared"), default="exact",
                   help="batched, llama.cpp: exact (default) computes each session's rows as if it were alone; "
                        "shared puts every session in one pass over one unified KV cache (reads the weights once, "
                        "but a session's text can depend on who shares its batches)")
    p.add_argument("--tick-tokens", type=_positive_int, default=256,
                   help="batched: most tokens one batch evaluates; prompt prefill is chunked to fit (default 256)")
    p.add_argument("--swap-idle", type=float, default=2.0, metavar="S",
                   help="batched: a session idle this long may lose its KV to a newcomer (default 2 s)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="batched: every session prefills its whole prompt (by default a newcomer keeps the prompt KV "
                        "a closed session with the same prefix left; `acespec demo` turns it off so every mode pays its own prefill)")
    p.add_argument("--logprobs", type=_positive_int, default=20,
                   help="vllm: target tokens returned per position, K (1..20; default 20): sampled coupled verdicts are "
                        "drawn over these, within the target mass outside them of the exact law (see docs)")
    p.add_argument("--lead-k", type=_nonnegative_int, default=8, metavar="K",
                   help="vllm: cloud-led sessions (greedy, or strict and the relaxed rules at any temperature) run in "
                        "vLLM's own speculative decoding, verifying up to K edge-draft tokens a step with its rejection "
                        "sampler; 0 runs them as verify requests (default 8)")
    p.add_argument("--lead-q-topn", type=_nonnegative_int, default=32, metavar="N",
                   help="vllm: cloud-led sessions under rules that need the drafter's q rows: q entries kept per draft "
                        "token (an edge's row with more is refused; 0: such sessions run as verify requests; default 32, "
                        "the edge's --q-topn default)")
    p.add_argument("--lead-pass-budget", type=pos_float_or_inf, default=math.inf, metavar="P",
                   help="cloud-led and auto sessions: target passes per token one session may cost; a step that would "
                        "go over waits (at most --lead-max-wait) for an edge draft long enough to stay within it. "
                        "Default inf: the cloud never waits, so no user is slower than cloud-only; lower trades "
                        "user speed for cloud passes (edge-led modes reach about 0.2 on good drafts)")
    p.add_argument("--lead-max-wait", type=nonneg_float, default=0.5, metavar="S",
                   help="with --lead-pass-budget: longest one step waits for a draft (default 0.5 s)")
    p.add_argument("--cpu-kv-gib", type=float, default=1.0, help="vllm on CPU: KV cache in GiB (default 1)")
    p.add_argument("--tensor-parallel", type=_positive_int, default=1, help="vllm: GPUs one model replica spans (default 1)")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds before an idle session is dropped")
    p.add_argument("--resume-grace", type=float, default=120.0, metavar="S",
                   help="a session whose connection dropped waits this long for RESUME, holding its slot (default 120)")
    p.add_argument("--handshake-timeout", type=float, default=10.0, metavar="S",
                   help="a new connection must send HELLO/RESUME within this (default 10)")
    p.add_argument("--frame-timeout", type=float, default=30.0, metavar="S",
                   help="a frame once begun must be complete within this (default 30)")
    p.add_argument("--max-connections", type=_positive_int, default=256, help="open connections at once (default 256)")
    p.add_argument("--max-connections-per-addr", type=_positive_int, default=32,
                   help="open connections at once from one address (default 32)")
    p.add_argument("--auth-failures-per-min", type=int, default=10,
                   help="failed auths one address may make per minute before it is refused unheard (0 = no limit; default 10)")
    p.add_argument("--tls-cert", help="TLS: the server's certificate chain (PEM); with --tls-key, the server speaks TLS only")
    p.add_argument("--tls-key", help="TLS: the server's private key (PEM)")
    p.add_argument("--tls-client-ca", help="TLS: require client certificates signed by this CA (PEM)")
    p.add_argument("--ws-port", type=int, metavar="P",
                   help="also take edges over WebSocket on this port (0 = any free port, printed at start): the same "
                        "frames, one per binary message, wss with --tls-cert; GET / there is a browser edge page")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics, and /health and /ready for load balancers "
                        "(0 = any free port, printed at start)")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="event loop: uvloop (about twice the frames per second of one core; `bench frontend`) or "
                        "asyncio's own; auto = uvloop when installed (default)")
    p.add_argument("--gc-full", type=float, default=300.0, metavar="S",
                   help="freeze long-lived objects out of the garbage collector's scans and collect in full every S "
                        "seconds (default 300; 0 = Python's collector as it is, which pauses the loop 0.6 s at 10,000 sessions)")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=cmd_serve)


def engine_from_args(args: argparse.Namespace, target_spec: str):
    """Load the target as the engine needs it and build the engine (shared with `bench tenants`)."""
    from acespec.cloud.engine import make_engine
    from acespec.models import load_model

    if args.engine == "vllm":
        return _vllm_engine(args, target_spec)
    if args.engine == "noop":  # the front end alone (bench frontend): verdicts accept every draft, no model pass
        if args.slots or args.kv_budget:
            raise ValueError("--slots and --kv-budget are for the batched engine")
        return make_engine("noop", load_model(target_spec, n_ctx=args.n_ctx))
    if args.engine == "serial":
        if args.slots or args.kv_budget:
            raise ValueError("--slots and --kv-budget are for the batched engine")
        return make_engine("serial", load_model(target_spec, n_ctx=args.n_ctx))
    slots = args.slots or args.max_sessions
    n_ctx = args.n_ctx
    if args.kv_budget:
        n_ctx = args.kv_budget // slots
        if n_ctx < 64:
            raise ValueError(f"--kv-budget {args.kv_budget} leaves {n_ctx} tokens per slot for {slots} slots; give it more")
    if not args.tick_tokens >= 2:
        raise ValueError("--tick-tokens must be >= 2")
    if not args.swap_idle >= 0:
        raise ValueError("--swap-idle must be >= 0")
    from acespec.models.registry import resolve

    # llama.cpp: one KV stream per slot, batch-invariant (see LlamaCppModel); toy models hold 64
    # sequences already; other runtimes hold one, so they need --slots 1 (or --engine serial)
    kind = resolve(target_spec).kind
    extra = {"n_slots": slots, "batch_invariant": args.batching == "exact"} if kind == "gguf" else {}
    target = load_model(target_spec, n_ctx=n_ctx, **extra)
    if kind == "toy":  # a toy's context and sequences are plain attributes: give it the budget asked for
        target.n_ctx = n_ctx
        target.n_slots = max(target.n_slots, slots)
    return make_engine("batched", target, slots=slots, tick_tokens=args.tick_tokens, swap_idle_s=args.swap_idle,
                       reuse_prefixes=not args.no_prefix_reuse)


def _vllm_engine(args: argparse.Namespace, target_spec: str):
    from acespec.cloud.engine import make_engine
    from acespec.models.registry import resolve

    r = resolve(target_spec)
    if r.kind != "hf" or r.path is None:
        hint = (f"; export it first: acespec models export-hf {target_spec} DIR, then --target DIR" if r.kind == "gguf" else "")
        raise ValueError(f"--engine vllm serves a Hugging Face model directory, not {target_spec!r}{hint}")
    if args.kv_budget or args.batching != "exact":
        raise ValueError("--kv-budget and --batching are for the batched engine (vLLM manages its own KV blocks)")
    if not 1 <= args.logprobs <= 20:
        raise ValueError("--logprobs must be in 1..20")
    if not args.cpu_kv_gib > 0:
        raise ValueError("--cpu-kv-gib must be > 0")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--engine vllm needs vLLM, which this Python lacks: run `bash scripts/setup.sh vllm`, "
                         "then serve with .venv-vllm/bin/acespec")
    return make_engine("vllm", str(r.path), n_ctx=args.n_ctx, logprobs=args.logprobs, max_sessions=args.slots or args.max_sessions,
                       cpu_kv_gib=args.cpu_kv_gib, tensor_parallel_size=args.tensor_parallel, lead_k=args.lead_k,
                       lead_q_topn=args.lead_q_topn)


def run_loop(coro, loop: str = "auto"):
    """asyncio.run on uvloop (`loop` uvloop, or auto when it is installed) or on asyncio's own loop."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    from acespec.cloud.server import CloudServer, ServerConfig

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack to stderr: a hung replica says where
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError("--metrics-port must be in 0..65535")
    if args.ws_port is not None and not 0 <= args.ws_port <= 65535:
        raise ValueError("--ws-port must be in 0..65535")
    if args.max_sessions < 1:
        raise ValueError("--max-sessions must be >= 1")
    for name in ("idle_timeout", "resume_grace", "handshake_timeout", "frame_timeout"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):  # also refuses nan
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    if not 0 <= args.gc_full < float("inf"):
        raise ValueError("--gc-full must be a number of seconds >= 0")
    if args.auth_failures_per_min < 0:
        raise ValueError("--auth-failures-per-min must be >= 0")
    tls = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        from acespec.tls import server_context

        tls = server_context(args.tls_cert, args.tls_key, args.tls_client_ca)
    tenants = read_tenants(args.token_file)
    engine = engine_from_args(args, args.target)
    target = engine.target
    cfg = ServerConfig(
        host=args.host, port=args.port, tenants=tenants, max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout,
        resume_grace_s=args.resume_grace, handshake_timeout_s=args.handshake_timeout, frame_timeout_s=args.frame_timeout,
        max_connections=args.max_connections, max_connections_per_addr=args.max_connections_per_addr,
        auth_failures_per_min=args.auth_failures_per_min, tls=tls, gc_full_s=args.gc_full, ws_port=args.ws_port,
        lead_pass_budget=args.lead_pass_budget, lead_max_wait_s=args.lead_max_wait,
    )
    server = CloudServer(engine, cfg)

    async def main() -> None:
        await server.start()
        m = engine.metrics()
        _say(f"acespec serve: listening on {cfg.host}:{server.port}{' (TLS)' if tls else ''} (target {target.name}, {engine.name} engine, "
             f"{m.get('slots', 1)} KV slot(s) of {engine.max_context} tokens)")
        if server.ws_port is not None:
            ws, http = ("wss", "https") if tls else ("ws", "http")
            where = f"{cfg.host}:{server.ws_port}"
            _say(f"acespec serve: WebSocket listening on {where} ({ws}://{where}/; browser edge at {http}://{where}/)")
        if args.metrics_port is not None:
            from acespec.cloud.metrics import start_metrics_server

            httpd, _ = start_metrics_server(server, args.metrics_port, cfg.host)
            _say(f"acespec serve: metrics at http://{cfg.host}:{httpd.server_port}/metrics (load-balancer checks: "
                 f"/health, /ready)")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            server.draining = True  # /ready fails from here, before the loop gets round to stop()
            stop.set()
            _say(f"acespec serve: {sig.name}: draining (the verdicts owed go out, no new sessions)")

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        await stop.wait()
        await server.stop()

    run_loop(main(), args.loop)
    print("acespec serve: stopped", file=sys.stderr)
    return 0


def _say(line: str) -> None:
    """A line on stdout that may go nowhere. A supervisor or a pipe that stopped reading (`| head`, a
    parent that read the first line and closed its end) must not stop the server: a BrokenPipeError in
    the SIGTERM handler left `acespec serve` running, undrained, until it was killed. Once the pipe is
    gone, stdout goes to /dev/null, so the exit's flush does not fail either."""
    try:
        print(line, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: stdout closed
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
