"""The cloud server's settings (`ServerConfig`): where it listens, who may connect, its limits and timeouts,
its verify engine, and the pricing of cloud-led sessions. `acespec serve` fills one from its flags
(`cloud/cli.py`); tests and benchmarks build one directly. `acespec.cloud.server` exports it too."""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass, field

from acespec import wire


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # listen address
    port: int = 7070  # listen port (0 = any free port)
    token: bytes | None = (
        None  # one auth token (the tenant "default"); with no token and no tenants, anyone may connect
    )
    tenants: dict[str, bytes] | None = (
        None  # tenant name -> its auth token; a session belongs to the tenant that opened it
    )
    auth_failures_per_min: int = (
        10  # failed auths (token, session secret) one address may make per minute; then BAD_AUTH at once
    )
    max_sessions: int = 8  # live sessions at once; more get BUSY
    max_new_tokens: int = 4096  # cap on a session's max_tokens
    idle_timeout_s: float = 300.0  # a session with no traffic for this long is dropped
    resume_grace_s: float = 120.0  # a disconnected session waits this long for RESUME (its slot is held meanwhile)
    handshake_timeout_s: float = 10.0  # a connection must send HELLO/RESUME (and take its WELCOME) within this
    frame_timeout_s: float = 30.0  # after the handshake, a frame once started must be complete within this
    max_connections: int = 256  # open connections at once, all addresses; more get BUSY and are closed
    max_connections_per_addr: int = 32  # open connections at once from one peer address
    limits: wire.Limits = field(default_factory=wire.Limits)  # frame limits we accept
    tls: ssl.SSLContext | None = None  # TLS server context (acespec.tls.server_context); None = plain TCP
    ws_port: int | None = (
        None  # also take WebSocket connections on this port (websocket.py; 0 = any free port, wss with tls)
    )
    engine: str = "batched"  # verify engine for a bare target model: batched | serial (see engine.py)
    lead_k_max: int = 16  # cloud-led: most draft tokens one step verifies
    lead_pass_budget: float = (
        math.inf
    )  # cloud-led: target passes per token a session may cost (inf: never wait for a draft)
    lead_max_wait_s: float = (
        0.5  # cloud-led with a budget: longest a step waits for a draft that keeps it within budget
    )
    gc_full_s: float = (
        0.0  # see CloudServer._keep_gc: one full garbage collection this often; 0 = leave the collector be
    )
    # (`acespec serve`, whose process is the server, uses 300; a server embedded in other code leaves it alone)
