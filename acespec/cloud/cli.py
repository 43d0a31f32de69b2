"""`acespec serve`: run the cloud verifier.

    acespec serve --target qwen2.5-coder-1.5b --port 7070 --token-file token.txt
    acespec serve --slots 16 --kv-budget 32768 --tick-tokens 256     # 16 sessions of 2,048 tokens each
    acespec serve --token-file tenants.txt --tls-cert cloud.pem --tls-key cloud.key   # tenants, TLS

A token file holds one token per tenant, `name:token` on each line (blank lines and `#` comments are
skipped); a session belongs to the tenant that opened it, and no other tenant can RESUME it. A file
of one line with no `:` is a single shared token (the tenant `default`). The flags are the fields of
`acespec.config.CloudRole`; `--config FILE` reads them from YAML or TOML (docs/operate/configuration.md).

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
import faulthandler
import importlib.util
import logging
import os
import signal
import ssl
import sys
from typing import Any

from acespec.cloud.engine import make_engine
from acespec.cloud.metrics import start_metrics_server
from acespec.cloud.server import CloudServer, ServerConfig
from acespec.config import CloudRole, add_cli_args, add_config_arg, resolve
from acespec.config.tokens import read_tenants, read_token  # noqa: F401  (their old home: importable from here)
from acespec.models import load_model
from acespec.models.registry import resolve as resolve_model
from acespec.tls import server_context


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the cloud verifier (TCP)")
    add_config_arg(p)
    add_cli_args(p, CloudRole())
    p.set_defaults(func=cmd_serve)


def engine_from_role(role: CloudRole):
    """Load the target as the engine needs it and build the engine."""
    if role.engine == "vllm":
        return _vllm_engine(role)
    if role.engine in ("noop", "serial"):  # noop: the front end alone (bench frontend), every draft accepted
        return make_engine(role.engine, load_model(role.target, n_ctx=role.n_ctx))
    slots, n_ctx = role.resident_slots, role.slot_context
    # llama.cpp: one KV stream per slot, batch-invariant (see LlamaCppModel); toy models hold 64
    # sequences already; other runtimes hold one, so they need --slots 1 (or --engine serial)
    kind = resolve_model(role.target).kind
    extra: dict[str, Any] = {"n_slots": slots, "batch_invariant": role.batching == "exact"} if kind == "gguf" else {}
    target = load_model(role.target, n_ctx=n_ctx, **extra)
    if kind == "toy":  # a toy's context and sequences are plain attributes: give it the budget asked for
        target.n_ctx = n_ctx
        target.n_slots = max(target.n_slots, slots)
    return make_engine(
        "batched",
        target,
        slots=slots,
        tick_tokens=role.tick_tokens,
        swap_idle_s=role.swap_idle,
        reuse_prefixes=role.prefix_reuse,
    )


def _vllm_engine(role: CloudRole):
    r = resolve_model(role.target)
    if r.kind != "hf" or r.path is None:
        hint = (
            f"; export it first: acespec models export-hf {role.target} DIR, then --target DIR"
            if r.kind == "gguf"
            else ""
        )
        raise ValueError(f"--engine vllm serves a Hugging Face model directory, not {role.target!r}{hint}")
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--engine vllm needs vLLM, which this Python lacks: run `bash scripts/setup.sh vllm`, "
            "then serve with .venv-vllm/bin/acespec"
        )
    return make_engine(
        "vllm",
        str(r.path),
        n_ctx=role.n_ctx,
        logprobs=role.logprobs,
        max_sessions=role.resident_slots,
        cpu_kv_gib=role.cpu_kv_gib,
        tensor_parallel_size=role.tensor_parallel,
        lead_k=role.lead_k,
        lead_q_topn=role.lead_q_topn,
    )


def server_config(role: CloudRole, *, tenants: dict[str, bytes] | None, tls: ssl.SSLContext | None) -> ServerConfig:
    """The server's ServerConfig from the role's settings (tenants and TLS context already read)."""
    return ServerConfig(
        host=role.host,
        port=role.port,
        tenants=tenants,
        max_sessions=role.max_sessions,
        idle_timeout_s=role.idle_timeout,
        resume_grace_s=role.resume_grace,
        handshake_timeout_s=role.handshake_timeout,
        frame_timeout_s=role.frame_timeout,
        max_connections=role.max_connections,
        max_connections_per_addr=role.max_connections_per_addr,
        auth_failures_per_min=role.auth_failures_per_min,
        tls=tls,
        gc_full_s=role.gc_full,
        ws_port=role.ws_port,
        lead_pass_budget=role.lead_pass_budget,
        lead_max_wait_s=role.lead_max_wait,
    )


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
    role: CloudRole = resolve(CloudRole(), args).config
    logging.basicConfig(
        level=logging.INFO if role.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s"
    )
    # `kill -USR1 PID` prints every thread's stack to stderr: a hung replica says where
    faulthandler.register(signal.SIGUSR1)
    tls = server_context(role.tls_cert, role.tls_key, role.tls_client_ca) if role.tls_cert and role.tls_key else None
    tenants = read_tenants(role.token_file)
    engine = engine_from_role(role)
    target = engine.target
    cfg = server_config(role, tenants=tenants, tls=tls)
    server = CloudServer(engine, cfg)

    async def main() -> None:
        await server.start()
        m = engine.metrics()
        _say(
            f"acespec serve: listening on {cfg.host}:{server.port}{' (TLS)' if tls else ''} "
            f"(target {target.name}, {engine.name} engine, "
            f"{m.get('slots', 1)} KV slot(s) of {engine.max_context} tokens)"
        )
        if server.ws_port is not None:
            ws, http = ("wss", "https") if tls else ("ws", "http")
            where = f"{cfg.host}:{server.ws_port}"
            _say(f"acespec serve: WebSocket listening on {where} ({ws}://{where}/; browser edge at {http}://{where}/)")
        if role.metrics_port is not None:
            httpd, _ = start_metrics_server(server, role.metrics_port, cfg.host)
            _say(
                f"acespec serve: metrics at http://{cfg.host}:{httpd.server_port}/metrics (load-balancer checks: "
                f"/health, /ready)"
            )
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

    run_loop(main(), role.loop)
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
