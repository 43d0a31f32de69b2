"""The edge's settings (`acespec.config`'s EdgeRole / EdgeServeRole) as the runtime's configurations:
EdgeConfig for one generation, ServeConfig for the HTTP API. Shared by `acespec edge` and `edge serve`."""

from __future__ import annotations

from acespec.config import EdgeOptions, EdgeServeRole
from acespec.config.tokens import read_token
from acespec.draft.cache import DRAFTER_SLOTS
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig
from acespec.edge.service import ServeConfig
from acespec.models.registry import resolve
from acespec.tls import client_context


def connect_config(opts: EdgeOptions) -> ConnectConfig:
    """Where the cloud is and how to reach it (reads the token file, loads the TLS files)."""
    (host, port), replicas = opts.connect_target()
    token = read_token(opts.token_file) or b""
    tls = client_context(opts.tls_ca, opts.tls_cert, opts.tls_key) if opts.wants_tls else None
    return ConnectConfig(
        host=host,
        port=port,
        token=token,
        tls=tls,
        tls_server_name=opts.tls_server_name,
        busy_retry_s=opts.busy_retry,
        replicas=tuple(replicas),
    )


def edge_config(opts: EdgeOptions, *, mode: str | None = None) -> EdgeConfig:
    """The runtime's EdgeConfig, with `--acespec` folded in (`mode`: the runtime mode instead of the options')."""
    o = opts.preset()
    return EdgeConfig(
        mode=mode or o.mode,
        k=o.k,
        policy=o.policy,
        window=o.window,
        auto_window=o.auto_window,
        pass_budget=o.pass_budget,
        cache=o.cache,
        cache_budget_mb=o.cache_budget_mb,
        branches=o.branches,
        contention_guard=o.contention_guard,
        connect=connect_config(o),
        **o.sampling.hello_fields(),
    )


def drafter_options(opts: EdgeOptions) -> dict:
    """load_model's extra options for this edge's drafter: KV sequences for the state cache's forks."""
    o = opts.preset()
    return {"n_slots": DRAFTER_SLOTS} if o.cache and not o.draft.startswith("toy") else {}


def serve_config(role: EdgeServeRole) -> ServeConfig:
    """The HTTP API's ServeConfig: each request's defaults are the options without the full system folded
    in (a request that names another mode gets it with the server's own --cache/--policy/...)."""
    return ServeConfig(
        host=role.host,
        port=role.port,
        served_model=role.served_model_name,
        max_waiting=role.max_waiting,
        defaults=edge_config(role, mode=role.request_mode),
        default_mode=role.default_mode,
        seed=role.sampling.seed,
    )


def serve_drafter_options(role: EdgeServeRole) -> dict:
    """Every request may ask for mode acespec, whose state cache forks the drafter's KV sequence."""
    return {"n_slots": DRAFTER_SLOTS} if resolve(role.draft).kind == "gguf" else {}
