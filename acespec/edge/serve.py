"""`acespec edge serve`: the edge as a long-running OpenAI-compatible endpoint (see api.py).

    acespec edge serve --cloud 127.0.0.1:7070 --port 8000                 # drafter loaded once, mode auto
    acespec edge serve --cloud 127.0.0.1:7070 --acespec --drafters 2      # edge-led full system by default, 2 drafters
    acespec edge serve --config edge-serve.yaml --port 8001               # settings from a file, flags win

The edge's options (`--mode`, `--rule`, `--k`, `--temperature`, `--max-tokens`, ...) are the defaults
of every request; a request overrides them with its own fields. `--seed` is the seed of requests that
give none; without it each such request draws a fresh one, as OpenAI's API does. The flags are the
fields of `acespec.config.EdgeServeRole` (see docs/operate/configuration.md).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from acespec.config import EdgeServeRole, add_cli_args, add_config_arg, resolve
from acespec.edge.options import serve_config, serve_drafter_options
from acespec.models import Model, load_model
from acespec.models.shared import SharedModel

# whole seconds: uvicorn types its timeout_graceful_shutdown as an int
SHUTDOWN_GRACE_S = 5  # on Ctrl-C / SIGTERM, requests in flight get this long to finish before they are stopped


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API, /metrics and the live page")
    add_config_arg(p)
    add_cli_args(p, EdgeServeRole())
    p.set_defaults(func=cmd_serve)


def build_service(role: EdgeServeRole):
    """The EdgeService the settings describe, drafters loaded."""
    from acespec.edge.api import EdgeService  # heavy: FastAPI and pydantic, only for the command that serves HTTP

    return EdgeService(load_drafters(role), serve_config(role))


def load_drafters(role: EdgeServeRole) -> list[Model]:
    """`--drafters N` models, or, with `--shared-drafter`, N views of one model that holds every view's KV
    sequences (and N times the context), whose drafts asked at once run as one batched pass."""
    opts = serve_drafter_options(role)
    if not role.shared_drafter or role.drafters == 1:
        return [load_model(role.draft, n_ctx=role.n_ctx, **opts) for _ in range(role.drafters)]
    per = opts.get("n_slots", 1)  # each view's own sequences (its forks)
    if opts:  # llama.cpp: one unified KV cache for every view's sequences
        base = load_model(role.draft, n_ctx=role.n_ctx * role.drafters, n_slots=per * role.drafters)
    else:
        base = load_model(role.draft, n_ctx=role.n_ctx)
    return list(SharedModel(base, role.drafters, slots_per_view=per, n_ctx=role.n_ctx).views)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn  # heavy: uvicorn, FastAPI and pydantic load only for the one command that serves HTTP

    from acespec.edge.api import create_app

    role: EdgeServeRole = resolve(EdgeServeRole(), args).config
    svc = build_service(role)
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
                print(
                    f"acespec edge serve: http://{role.host}:{port} (model {svc.cfg.served_model}; "
                    f"drafter {role.draft} x {role.drafters}; cloud {fleet}; default mode {svc.cfg.default_mode}, "
                    f"rule {d.rule})",
                    flush=True,
                )

    server = Server(
        uvicorn.Config(
            create_app(svc),
            host=role.host,
            port=role.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
    )
    server.run()
    if not server.started:
        raise OSError(f"cannot serve on {role.host}:{role.port}")
    svc.wait_idle(SHUTDOWN_GRACE_S)  # the runs stopped at the deadline close their cloud sessions
    print("acespec edge serve: stopped", file=sys.stderr)
    return 0
