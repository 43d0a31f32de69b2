"""The cloud verifier: an asyncio TCP server that verifies draft blocks for many edge sessions.

One connection carries one session. The first frame is HELLO (new session) or RESUME (reattach
after a dropped connection); then DRAFT -> VERDICT in speculative (edge-led) mode, or the server
streams TOKENS in cloud-only mode, or in cloud-led mode, where it decodes without waiting and
verifies, before each step, the priced part of any edge DRAFT that agrees with the stream
(`loop/board.py`, `control/lead.py`). PING is answered with PONG at any time.

This module is the connection lifecycle: `CloudServer` listens (TCP, and WebSocket with
`ServerConfig.ws_port`), limits connections per address and in total, hands each connection to the
part that serves its mode, expires idle sessions, and drains on `stop()`. The parts, each with its
own module:

- `sessions.py`: the session table, and the HELLO / RESUME handshake (auth, limits, the session
  secret; a session outlives its connection for `resume_grace_s` so an edge can RESUME);
- `edge_led.py`: speculative sessions, DRAFT -> VERDICT;
- `streaming.py`: cloud-only and cloud-led sessions, TOKENS, and the hold for a draft under a pass budget;
- `conn.py`: what they share on a connection: reading frames under the deadlines, refusing;
- `server_config.py`: `ServerConfig` (exported here too, with `ProtocolError`).

Robustness rules: any malformed frame, wrong auth token, unknown session or over-limit request is
answered with an ERROR frame (and a CLOSE) and that connection is closed; the server and every other
session carry on. Every read after the handshake has a deadline once a frame has begun; connections
are limited per address and in total; TLS with `ServerConfig.tls`.

The server owns the protocol only. Every session's target work goes through a verify engine
(`engine.py`): by default the continuous-batching engine (`batched.py`), which keeps one KV sequence
per session and verifies every session's pending block in one model pass per tick; `SerialEngine`
is the old one-session-at-a-time behaviour, kept as a baseline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import ssl
import threading
import time
from collections import OrderedDict
from typing import Any

from acespec import wire
from acespec.cloud.conn import GOING_AWAY, FrameIO, ProtocolError, peer_addr
from acespec.cloud.edge_led import DraftVerifier
from acespec.cloud.engine import EngineStopped, VerifyEngine, make_engine
from acespec.cloud.server_config import ServerConfig
from acespec.cloud.sessions import Session, SessionTable
from acespec.cloud.streaming import TokenStreamer
from acespec.cloud.websocket import ConnReader, ConnWriter, WsListener
from acespec.control.lead import LeadMemory
from acespec.models.base import Model

log = logging.getLogger("acespec.cloud")

# ServerConfig and ProtocolError live in server_config.py and conn.py; most code imports them from here
__all__ = ["CloudServer", "CloudServerThread", "ProtocolError", "ServerConfig", "Session"]


class CloudServer:
    """Listens, takes connections, and hands each to the part that serves its session's mode."""

    def __init__(self, target: Model | VerifyEngine, config: ServerConfig | None = None) -> None:
        self.cfg = config or ServerConfig()
        self.engine = target if isinstance(target, VerifyEngine) else make_engine(self.cfg.engine, target)
        self.target = self.engine.target
        self._io = FrameIO(self.cfg)  # reads frames under the deadlines, refuses, counts the ERRORs sent
        # the live sessions and the handshake that opens or resumes one (sessions.py)
        self._sessions = SessionTable(self.cfg, self.engine, lambda: self.draining)
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self._gc_task: asyncio.Task | None = None  # gc_full_s > 0: the periodic full collection (_keep_gc)
        self._conns: dict[asyncio.Task, ConnWriter] = {}  # live connections
        self._per_addr: dict[str, int] = {}  # peer address -> open connections
        self._stopping = False  # stop() is draining the connections (after draining is set)
        # edge-led sessions: DRAFT -> VERDICT (edge_led.py)
        self._edge_led = DraftVerifier(self.engine, self._io, self._sessions.end, lambda: self._stopping)
        # cloud-only and cloud-led sessions: TOKENS streaming and the pass budget's hold (streaming.py)
        self._streaming = TokenStreamer(self.cfg, self.engine, self._io, self._sessions.end)
        self.draining = False  # stop() has begun: /ready fails from this moment (cloud/metrics.py)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = self.cfg.port
        self._ws: WsListener | None = None  # cfg.ws_port: the WebSocket listener
        self.ws_port: int | None = None  # the port it bound

    # -- what tests, metrics and benchmarks read (the parts own them) ---------------------------------
    @property
    def sessions(self) -> dict[int, Session]:
        """The live sessions by id (connected, or waiting for a RESUME)."""
        return self._sessions.sessions

    @property
    def handshakes(self) -> dict[str, int]:
        """Sessions opened by HELLO and reattached by RESUME."""
        return self._sessions.handshakes

    @property
    def lead_memory(self) -> OrderedDict[tuple, LeadMemory]:
        """Cloud-led pricing learned by earlier sessions, per (tenant, rule, temperature)."""
        return self._sessions.lead_memory

    @lead_memory.setter
    def lead_memory(self, memory: OrderedDict[tuple, LeadMemory]) -> None:
        # `bench tenants` starts a cell's server from the memory its earlier cells left
        self._sessions.lead_memory = memory

    @property
    def lead_holds(self) -> int:
        """Cloud-led steps that waited for a draft (only with a pass budget)."""
        return self._streaming.holds

    @property
    def lead_held_s(self) -> float:
        """The seconds those steps waited, in all."""
        return self._streaming.held_s

    @property
    def errors_sent(self) -> dict[str, int]:
        """ERROR frames sent, by ErrorCode name (tests, logs, metrics)."""
        return self._io.errors_sent

    def _end(self, s: Session) -> None:
        """Forget a session now (what CLOSE and idle expiry do; tests call it to lose one on purpose)."""
        self._sessions.end(s)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.engine.start()
        tls: dict[str, Any] = (
            {} if self.cfg.tls is None else {"ssl": self.cfg.tls, "ssl_handshake_timeout": self.cfg.handshake_timeout_s}
        )
        self._server = await asyncio.start_server(self._on_connect, self.cfg.host, self.cfg.port, **tls)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.cfg.ws_port is not None:  # the same handler, through the WebSocket adapters
            self._ws = WsListener(self._on_connect, self.cfg.limits, self.target)
            await self._ws.start(self.cfg.host, self.cfg.ws_port, self.cfg.tls, self.cfg.handshake_timeout_s)
            self.ws_port = self._ws.port
        self._sweeper = asyncio.create_task(self._sweep())
        self._gc_task = asyncio.create_task(self._keep_gc()) if self.cfg.gc_full_s > 0 else None
        log.info("cloud verifier listening on %s:%d (target %s)", self.cfg.host, self.port, self.target.name)

    async def stop(self) -> None:
        self.draining = True
        if self._server:
            self._server.close()
            await self._server.wait_closed()
        if self._ws is not None:
            self._ws.close()
        if self._sweeper:
            self._sweeper.cancel()
        if self._gc_task is not None:
            self._gc_task.cancel()
            gc.unfreeze()  # what was frozen is the collector's again
        # Drain: blocks already received are still verified and their verdicts sent, then every edge
        # is told we are going away (CLOSE(GOING_AWAY): it reconnects, and if the cloud that answers
        # has lost the session, opens a new one carrying its text) and its connection is closed, so
        # its handler ends by itself. A speculative connection's verdict writer does this after the
        # verdicts queued before it; blocks that arrive later are not taken. Cancel only a handler
        # that does not end.
        self._stopping = True
        for task, w in list(self._conns.items()):
            if self._edge_led.drain(task):
                continue
            try:
                if not w.is_closing():
                    w.write(GOING_AWAY)
            except (ConnectionError, OSError, RuntimeError, AttributeError):
                # AttributeError: asyncio's TLS transport, written to after a failed handshake tore its
                # TLS layer down, fails inside sslproto (seen under load); the peer is gone either way
                pass
            w.close()
        if self._conns:
            _, late = await asyncio.wait(set(self._conns), timeout=10.0)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._ws is not None:
            await self._ws.wait_closed()
        await self.engine.stop()

    # -- what the HTTP port's checks read (from its own thread) -------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """Whether a new session would be taken now, and if not, why (GET /ready)."""
        if self.draining:
            return False, "draining: finishing the verdicts owed, taking no new sessions"
        if self._server is None:
            return False, "not started"
        live = len(self.sessions) + self._sessions.opening
        if live >= self.cfg.max_sessions:
            return False, f"at its session cap ({live} of {self.cfg.max_sessions})"
        if not self.engine.has_room():
            return False, "no KV room: every slot is held by an active session"
        return True, "ready"

    def loop_alive(self, timeout: float) -> bool:
        """True when the event loop runs a callback within `timeout` seconds (GET /health)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        ran = threading.Event()
        try:
            loop.call_soon_threadsafe(ran.set)
        except RuntimeError:  # closed meanwhile
            return False
        return ran.wait(timeout)

    async def serve_forever(self) -> None:
        await self.start()
        assert self._server
        async with self._server:
            await self._server.serve_forever()

    async def _keep_gc(self) -> None:
        """Keep Python's cyclic garbage collector off the event loop's critical path. Every session is
        a few hundred long-lived objects, and a full collection scans them all: at 10,000 sessions it
        stopped the loop for 0.6 s, which every edge felt as a frame delayed (`bench frontend`). So the
        objects that survived a second are frozen (moved where the collector no longer scans them), and
        once every `gc_full_s` everything is unfrozen, collected in full (the cycles of sessions that
        ended meanwhile go) and frozen again."""
        last_full = time.monotonic()
        # young collections less often: a verdict's short-lived objects die by reference count anyway
        gc.set_threshold(max(gc.get_threshold()[0], 20000), 50, 50)
        while True:
            await asyncio.sleep(1.0)
            if time.monotonic() - last_full >= self.cfg.gc_full_s:
                gc.unfreeze()
                gc.collect()
                last_full = time.monotonic()
            gc.freeze()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.cfg.idle_timeout_s / 4, self.cfg.resume_grace_s / 4))
            now = time.monotonic()
            for sid, s in list(self.sessions.items()):
                if s.in_handshake:
                    continue
                limit = self.cfg.idle_timeout_s if s.connected else self.cfg.resume_grace_s
                if now - s.last_active > limit:
                    log.info("session %d expired", sid)
                    self._sessions.end(s)
                    if s.connected and s.writer is not None:
                        # an expired session must not stay usable through its open connection
                        try:
                            s.writer.write(wire.encode(wire.Close(reason=wire.CloseReason.IDLE)))
                        except (ConnectionError, OSError):
                            pass
                        s.writer.close()

    # -- one connection ---------------------------------------------------------------------------
    async def _on_connect(self, reader: ConnReader, writer: ConnWriter) -> None:
        task = asyncio.current_task()
        addr = peer_addr(writer)
        if (
            len(self._conns) >= self.cfg.max_connections
            or self._per_addr.get(addr, 0) >= self.cfg.max_connections_per_addr
        ):
            await self._io.refuse(writer, wire.ErrorCode.BUSY, "too many open connections; retry later")
            writer.close()
            return
        if task:
            self._conns[task] = writer
        self._per_addr[addr] = self._per_addr.get(addr, 0) + 1
        session: Session | None = None
        decoder = wire.FrameDecoder(self.cfg.limits)
        try:
            first = await asyncio.wait_for(
                self._io.next_frame(reader, decoder, deadline=False), self.cfg.handshake_timeout_s
            )
            if first is None:
                return
            session = await self._sessions.handshake(first, writer)
            if session.mode in (wire.Mode.CLOUD_ONLY, wire.Mode.CLOUD_LED):
                if session.verifier.finished:
                    await self._streaming.finished_at_once(session, writer)
                await self._streaming.stream(session, reader, writer, decoder)
            else:
                await self._edge_led.serve(session, reader, writer, decoder)
        except wire.WireError as e:
            await self._io.refuse(writer, e.code, str(e))
        except ProtocolError as e:
            await self._io.refuse(writer, e.code, str(e))
        except TimeoutError:
            await self._io.refuse(writer, wire.ErrorCode.BAD_REQUEST, "no HELLO or RESUME within the handshake timeout")
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the edge went away (or broke its TLS, e.g. data after our close_notify); its session waits for RESUME
        except EngineStopped as e:
            # the replica stopped under this connection (a RESUME or a step that came in as the drain
            # ended): not a server bug. Before WELCOME, BUSY sends the edge to another replica; after
            # it, GOING_AWAY makes it reconnect and carry its text to whichever cloud answers
            if session is None:
                await self._io.refuse(writer, wire.ErrorCode.BUSY, f"this replica is stopping: {e}")
            else:
                try:
                    writer.write(GOING_AWAY)
                    await writer.drain()
                except (ConnectionError, OSError):
                    pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not take the server down
            log.exception("internal error")
            await self._io.refuse(writer, wire.ErrorCode.INTERNAL, f"internal error: {type(e).__name__}")
        finally:
            if session is not None and session.owner is task:  # not if a RESUME took the session over
                self._sessions.detach(session)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass
            if task:
                self._conns.pop(task, None)
            left = self._per_addr.get(addr, 1) - 1
            if left > 0:
                self._per_addr[addr] = left
            else:
                self._per_addr.pop(addr, None)


class CloudServerThread:
    """Runs a `CloudServer` on its own event loop in a background thread (tests, demo, benchmarks)."""

    def __init__(self, target: Model | VerifyEngine, config: ServerConfig | None = None) -> None:
        self.server = CloudServer(target, config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="acespec-cloud")

    @property
    def port(self) -> int:
        return self.server.port

    def start(self, timeout: float = 30.0) -> CloudServerThread:
        """Start and wait until it listens (an engine that loads a model at start, vLLM, needs longer)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> CloudServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
