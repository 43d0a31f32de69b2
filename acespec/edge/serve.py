"""`acespec edge serve`: the edge as a long-running OpenAI-compatible endpoint (see api.py).

    acespec edge serve --cloud 127.0.0.1:7070 --port 8000                 # drafter loaded once, mode auto
    acespec edge serve --cloud 127.0.0.1:7070 --acespec --drafters 2      # edge-led full system by default, 2 drafters

The edge's options (`--mode`, `--rule`, `--k`, `--temperature`, `--max-tokens`, ...) are the defaults
of every request; a request overrides them with its own fields. `--seed` is the seed of requests that
give none; without it each such request draws a fresh one, as OpenAI's API does.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys


SHUTDOWN_GRACE_S = 5.0  # on Ctrl-C / SIGTERM, requests in flight get this long to finish before they are stopped


def register(sub: argparse._SubParsersAction) -> None:
    from acespec.cli import _positive_int, add_sampling_args
    from acespec.edge.cli import add_edge_options
    from acespec.edge.service import API_MODES

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API, /metrics and the live page")
    add_edge_options(p, modes=API_MODES)
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0 = any free port, printed at start)")
    p.add_argument("--served-model-name", default="acespec", help="the model name clients use (default acespec)")
    p.add_argument("--drafters", type=_positive_int, default=1,
                   help="drafters loaded, i.e. generations that draft at once; more requests wait in line (default 1)")
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may wait for a drafter; more get 503 (default 64)")
    add_sampling_args(p, rule_default="coupled")
    p.set_defaults(func=cmd_serve, seed=None)


def build_service(args: argparse.Namespace):
    """The EdgeService the options describe, drafters loaded (shared with `bench api`)."""
    from acespec.draft.cache import DRAFTER_SLOTS
    from acespec.edge.api import EdgeService
    from acespec.edge.cli import edge_config_from_args
    from acespec.edge.service import ServeConfig
    from acespec.models import load_model
    from acespec.models.registry import resolve

    if not 0 <= args.port <= 65535:
        raise ValueError("--port must be in 0..65535")
    if args.drafters < 1:
        raise ValueError("--drafters must be >= 1")
    mode = "acespec" if args.acespec or args.mode == "acespec" else args.mode
    if args.acespec and args.mode not in ("pipelined", "acespec", "auto"):  # auto: the default, i.e. no --mode
        raise ValueError(f"--acespec is the default mode acespec; it cannot be combined with --mode {args.mode}")
    # the options without the full system folded in: a request that names another mode gets that mode
    # with the server's own --cache/--policy/..., and one that names acespec (or none, here) the full system
    args.mode, args.acespec = ("pipelined" if mode == "acespec" else mode), False
    defaults, _ = edge_config_from_args(args, controller_default=mode == "acespec", serving=True)
    # every request may ask for mode acespec, whose state cache forks the drafter's KV sequence
    slots = {"n_slots": DRAFTER_SLOTS} if resolve(args.draft).kind == "gguf" else {}
    drafters = [load_model(args.draft, n_ctx=args.n_ctx, **slots) for _ in range(args.drafters)]
    cfg = ServeConfig(host=args.host, port=args.port, served_model=args.served_model_name, max_waiting=args.max_waiting,
                      defaults=defaults, default_mode=mode, seed=args.seed)
    return EdgeService(drafters, cfg)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from acespec.edge.api import create_app

    svc = build_service(args)
    d = svc.cfg.defaults

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # stop on Ctrl-C / SIGTERM and exit 0, as `acespec serve` does (uvicorn re-raises the signal)
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # the port is known only now (--port 0)
                port = self.servers[0].sockets[0].getsockname()[1]
                fleet = ",".join(f"{h}:{p}" for h, p in [(d.connect.host, d.connect.port), *d.connect.replicas])
                print(f"acespec edge serve: http://{args.host}:{port} (model {svc.cfg.served_model}; drafter {args.draft} "
                      f"x {args.drafters}; cloud {fleet}; default mode {svc.cfg.default_mode}, "
                      f"rule {d.rule})", flush=True)

    server = Server(uvicorn.Config(create_app(svc), host=args.host, port=args.port, log_level="warning", lifespan="off",
                                   timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    server.run()
    if not server.started:
        raise OSError(f"cannot serve on {args.host}:{args.port}")
    svc.wait_idle(SHUTDOWN_GRACE_S)  # the runs stopped at the deadline close their cloud sessions
    print("acespec edge serve: stopped", file=sys.stderr)
    return 0
