"""`acespec serve`: run the cloud verifier.

    acespec serve --target qwen2.5-coder-1.5b --port 7070 --token-file token.txt

Stops cleanly on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

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


def register(sub: argparse._SubParsersAction) -> None:
    from acespec.cli import _positive_int

    p = sub.add_parser("serve", help="run the cloud verifier (TCP)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_positive_int, default=7070, help="0 = any free port (printed at start)")
    p.add_argument("--token-file", help="file holding the shared auth token (default: no auth)")
    p.add_argument("--max-sessions", type=_positive_int, default=8)
    p.add_argument("--n-ctx", type=_positive_int, default=4096)
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds before an idle session is dropped")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from acespec.cloud.server import CloudServer, ServerConfig
    from acespec.models import load_model

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.max_sessions < 1:
        raise ValueError("--max-sessions must be >= 1")
    token = read_token(args.token_file)
    target = load_model(args.target, n_ctx=args.n_ctx)
    cfg = ServerConfig(host=args.host, port=args.port, token=token, max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout)
    server = CloudServer(target, cfg)

    async def main() -> None:
        await server.start()
        print(f"acespec serve: listening on {cfg.host}:{server.port} (target {target.name})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    print("acespec serve: stopped", file=sys.stderr)
    return 0
