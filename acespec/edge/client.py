"""The edge's connection to the cloud verifier: a blocking TCP transport with reconnect and RESUME.

`CloudSession` is one session's link to a cloud (`edge/transports.py` plugs it into the loops). A reader
thread decodes frames into a queue, so the drafter keeps working while verdicts are in flight.
When the connection drops, a transport reports `Disconnected`; the loop then calls `resume(committed)`,
which reconnects with backoff and sends RESUME with the session's secret and the committed tokens
the edge holds (their length and digest). The cloud rolls back to that length, so both sides
continue from the same prefix and no token is lost or emitted twice.

Every handshake (connect, HELLO or RESUME, WELCOME) is retried as a whole: a link that fails anywhere
in it costs one of `reconnect_attempts`, and a cloud that answers BUSY is retried with jittered
backoff for up to `busy_retry_s`. If the cloud no longer knows the session (it restarted, or the
session expired), the edge opens a new one whose prompt is the old prompt plus everything committed
so far, with the generation budget reduced to match, and carries on: with greedy or coupled
sampling (noise keyed by absolute position and the shared seed) the text is the same as if nothing
had happened.

A fleet: `replicas` (or a `host` whose name resolves to several addresses) lists more clouds. A new
session goes to any of them, tried in turn from a random one, so a crowd of edges spreads out and a
replica that refuses (connection refused, BUSY) costs the next one only. A RESUME goes only to the
replica that issued the session, because it carries the session's secret; if that replica said
GOING_AWAY, answers UNKNOWN_SESSION or BUSY, or stays unreachable for `failover_after` attempts, the
edge opens a new session carrying its committed text on another replica instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from acespec import wire
from acespec.loop.records import Disconnected


class EdgeError(RuntimeError):
    """The cloud refused us (ERROR frame) or could not be reached."""

    def __init__(self, message: str, code: wire.ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ConnectConfig:
    host: str = "127.0.0.1"  # cloud (or WAN emulator) address
    port: int = 7070  # cloud port
    token: bytes = b""  # this tenant's auth token
    connect_timeout_s: float = 10.0  # one connection attempt
    handshake_timeout_s: float = 10.0  # longest wait for WELCOME after HELLO / RESUME
    reply_timeout_s: float = 60.0  # longest wait for any frame mid-session before we call the link dead
    reconnect_attempts: int = 8  # handshakes (connect, HELLO/RESUME, WELCOME) tried before giving up on the link
    backoff_s: float = 0.05  # first retry delay; doubles up to backoff_max_s, each wait jittered to 50-100 %
    backoff_max_s: float = 2.0  # longest retry delay
    busy_retry_s: float = 60.0  # keep retrying a cloud that answers BUSY for this long (does not use up attempts)
    recover: bool = (
        True  # if the cloud lost the session (restart, expiry), open a new one that carries the committed text
    )
    tls: ssl.SSLContext | None = None  # TLS to the cloud (see tls.py); None = plain TCP
    tls_server_name: str | None = None  # name to check the cloud's certificate against (default: host)
    limits: wire.Limits = field(default_factory=wire.Limits)  # what we accept from the cloud
    replicas: tuple[tuple[str, int], ...] = ()  # more cloud addresses (a fleet) besides host:port; see the module doc
    failover_after: int = (
        2  # in a fleet: failed RESUME attempts on the session's own replica before reopening elsewhere
    )

    def fleet(self) -> list[Replica]:
        """Every address to try: host:port and the replicas, each name expanded to every address it
        resolves to (a name that does not resolve is kept: connecting to it reports the error)."""
        out: list[Replica] = []
        for name, port in ((self.host, self.port), *self.replicas):
            try:
                infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
                addrs = list(dict.fromkeys(str(i[4][0]) for i in infos))
            except (socket.gaierror, UnicodeError):
                addrs = [name]
            for a in addrs:
                r = Replica(name, a, int(port))
                if r not in out:
                    out.append(r)
        return out


@dataclass(frozen=True)
class Replica:
    name: str  # as given (the TLS server name unless tls_server_name says otherwise)
    addr: str  # the address connected to
    port: int

    def __str__(self) -> str:
        return f"{self.name}:{self.port}" if self.name == self.addr else f"{self.name} ({self.addr}):{self.port}"


_EOF = object()


class _Link:
    """One TCP connection (plain, or TLS through memory BIOs) plus its reader thread.

    With TLS the socket is read by the reader thread and written by the caller's; the `ssl` object is
    driven through a MemoryBIO pair under one lock, because an SSL connection may not be read and
    written from two threads at once."""

    def __init__(self, cfg: ConnectConfig, replica: Replica) -> None:
        self.cfg = cfg
        self.replica = replica
        self.going_away = False  # the cloud sent CLOSE(GOING_AWAY): it is draining
        self.identity: bytes | None = None  # TLS: a digest of the replica's certificate (which replica answered)
        self.sock = socket.create_connection((replica.addr, replica.port), timeout=cfg.connect_timeout_s)
        self.frames: queue.Queue = queue.Queue()
        self.bytes_up = 0  # frame bytes sent (TLS records cost a little more on the wire)
        self.bytes_down = 0  # frame bytes received
        self.alive = True
        self._lock = threading.Lock()
        self._tls: ssl.SSLObject | None = None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cfg.tls is not None:
                self._bio_in, self._bio_out = ssl.MemoryBIO(), ssl.MemoryBIO()
                self._tls = cfg.tls.wrap_bio(
                    self._bio_in, self._bio_out, server_hostname=cfg.tls_server_name or replica.name
                )
                self._tls_handshake()
                self.identity = hashlib.sha256(self._tls.getpeercert(binary_form=True) or b"").digest()
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    # -- TLS plumbing (all under self._lock) ------------------------------------------------------
    def _tls_handshake(self) -> None:
        assert self._tls is not None, "TLS plumbing runs only on a TLS link"
        while True:
            try:
                self._tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(65536)  # bounded by connect_timeout_s
                if not data:
                    raise ConnectionError("the cloud closed the connection during the TLS handshake") from None
                self._bio_in.write(data)

    def _flush(self) -> None:
        out = self._bio_out.read()
        if out:
            self.sock.sendall(out)

    def _decrypt(self, data: bytes) -> tuple[bytes, bool]:
        """Plaintext from received TLS bytes, and whether the peer closed the TLS session."""
        with self._lock:
            self._bio_in.write(data)
            chunks, closed = [], False
            assert self._tls is not None, "TLS plumbing runs only on a TLS link"
            while True:
                try:
                    piece = self._tls.read(65536)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:
                    closed = True
                    break
                if not piece:
                    closed = True
                    break
                chunks.append(piece)
            self._flush()  # reading may owe the peer an answer (TLS 1.3 key updates)
        return b"".join(chunks), closed

    # -- the link ---------------------------------------------------------------------------------
    def _read(self) -> None:
        dec = wire.FrameDecoder(self.cfg.limits)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                closed = False
                if self._tls is not None:
                    data, closed = self._decrypt(data)
                self.bytes_down += len(data)
                for f in dec.feed(data):
                    if isinstance(f, wire.Close) and f.reason == wire.CloseReason.GOING_AWAY:
                        self.going_away = True
                    self.frames.put((time.perf_counter(), f))
                if closed:
                    break
        except (OSError, wire.WireError) as e:  # ssl.SSLError is an OSError
            self.frames.put((time.perf_counter(), e))
        self.alive = False
        self.frames.put((time.perf_counter(), _EOF))

    def send(self, frame) -> bool:
        data = wire.encode(frame)
        try:
            with self._lock:
                if self._tls is not None:
                    self._tls.write(data)
                    self._flush()
                else:
                    self.sock.sendall(data)
            self.bytes_up += len(data)
            return True
        except OSError:
            self.alive = False
            return False

    def get(self, timeout: float | None):
        """(arrival time, frame | exception | _EOF), or None on timeout."""
        try:
            return self.frames.get(timeout=timeout) if timeout != 0 else self.frames.get_nowait()
        except queue.Empty:
            return None

    def close(self, linger_s: float = 0.0) -> None:
        """Close; with `linger_s` > 0, half-close first and keep reading until the peer closes (or the
        time is up), so frames still in flight (a late verdict) do not meet a closed socket, whose
        reset would tear the path down and could discard our own CLOSE on its way to the cloud."""
        if linger_s > 0 and self.alive:
            try:
                if self._tls is not None:
                    with self._lock:
                        try:
                            self._tls.unwrap()  # close_notify
                        except ssl.SSLError:
                            pass
                        self._flush()
                self.sock.shutdown(socket.SHUT_WR)
                self._reader.join(linger_s)
            except OSError:
                pass
        self.alive = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def link_failure(item: object) -> EdgeError | Disconnected | None:
    """What an item off the link (`_Link.get`) means when it is not the frame the reader waits for, written
    once for every reader: an ERROR frame is the cloud's refusal (EdgeError, with its code); the end of the
    stream or a socket error is a lost link (Disconnected: the reader resumes); anything else (PONG, CLOSE)
    means nothing by itself (CLOSE(GOING_AWAY) is followed by the end of the stream)."""
    if isinstance(item, wire.Error):
        return EdgeError(f"cloud error {item.code.name}: {item.message}", item.code)
    if item is _EOF:
        return Disconnected("connection closed")
    if isinstance(item, Exception):
        return Disconnected(str(item))
    return None


def _expect_welcome(link: _Link, timeout: float) -> wire.Welcome:
    deadline = time.monotonic() + timeout
    while True:
        item = link.get(max(0.0, deadline - time.monotonic()))
        if item is None:
            raise EdgeError(f"no answer from the cloud within {timeout:g} s")
        _, f = item
        if isinstance(f, wire.Welcome):
            return f
        failure = link_failure(f)
        if isinstance(failure, EdgeError):
            raise EdgeError(f"the cloud refused the session: {failure}", failure.code)
        if isinstance(failure, Disconnected):
            raise EdgeError(f"the connection failed during the handshake: {failure.reason}")
        if not isinstance(f, (wire.Pong, wire.Close)):
            raise EdgeError(f"unexpected {type(f).__name__} during the handshake")


class CloudSession:
    """A session with the cloud: HELLO once, RESUME after every dropped connection, and a fresh HELLO
    carrying the committed text if the cloud lost the session."""

    def __init__(self, cfg: ConnectConfig, hello: wire.Hello) -> None:
        self.cfg = cfg
        self.hello = hello  # the original request: recovery builds its new HELLO from it
        self.bytes_up = 0
        self.bytes_down = 0
        self.reconnects = 0  # successful RESUMEs
        self.recoveries = 0  # new sessions opened because the cloud had lost ours
        self.busy_waits = 0  # BUSY answers waited out
        self.failovers = 0  # sessions reopened on another replica than the one that issued them
        self._jitter = random.Random()
        self.replicas = cfg.fleet()
        first = self._jitter.randrange(len(self.replicas))
        self.link, w = self._handshake(lambda link: hello, self.replicas[first:] + self.replicas[:first])
        self._welcomed(w)

    @property
    def home(self) -> Replica:
        """The replica that issued the session (and its secret)."""
        return self.link.replica

    def _welcomed(self, w: wire.Welcome) -> None:
        self.sid = w.session
        self.secret = w.secret
        self.committed = w.committed
        self.max_draft_tokens = w.max_draft_tokens

    def _sleep(self, delay: float) -> None:
        time.sleep(delay * self._jitter.uniform(0.5, 1.0))  # jitter: a crowd of edges does not retry in step

    def _handshake(
        self, greeting: Callable[[_Link], object], targets: Sequence[Replica], attempts: int | None = None
    ) -> tuple[_Link, wire.Welcome]:
        """Connect, send the greeting (HELLO or RESUME), wait for WELCOME; retry the whole exchange.

        Each round tries `targets` in order and takes the first WELCOME. A round in which every target
        failed (connect, TLS, a reset before WELCOME, silence) uses one of `attempts` (default
        `reconnect_attempts`); a round in which one answered BUSY is waited out with backoff for up to
        `busy_retry_s`; any other refusal is raised at once as an EdgeError with its code."""
        cfg = self.cfg
        attempts = max(1, cfg.reconnect_attempts if attempts is None else attempts)
        delay = cfg.backoff_s
        failures = 0
        busy_until: float | None = None
        while True:
            busy, last = None, None
            for target in targets:
                link = None
                try:
                    link = _Link(cfg, target)
                    if not link.send(greeting(link)):
                        raise EdgeError("connection lost while sending the handshake")
                    return link, _expect_welcome(link, cfg.handshake_timeout_s)
                except ssl.SSLCertVerificationError as e:
                    raise EdgeError(f"TLS: the cloud's certificate was refused: {e.verify_message}") from None
                except (OSError, EdgeError) as e:
                    if link is not None:
                        link.close()
                    code = getattr(e, "code", None) if isinstance(e, EdgeError) else None
                    if code == wire.ErrorCode.BUSY:
                        busy = e
                    elif code is not None:
                        raise
                    else:
                        last = e
            if busy is not None:
                now = time.monotonic()
                busy_until = busy_until or now + cfg.busy_retry_s
                if now >= busy_until:
                    raise EdgeError(
                        f"the cloud stayed busy for {cfg.busy_retry_s:g} s: {busy}", wire.ErrorCode.BUSY
                    ) from None
                self.busy_waits += 1
            else:
                failures += 1
                if failures >= attempts:
                    where = ", ".join(map(str, targets))
                    raise EdgeError(f"cannot reach the cloud at {where} after {failures} attempts: {last}") from None
            self._sleep(delay)
            delay = min(cfg.backoff_max_s, delay * 2)

    def _retire(self) -> None:
        self.bytes_up += self.link.bytes_up
        self.bytes_down += self.link.bytes_down
        self.link.close()

    def resume(self, committed: Sequence[int]) -> int:
        """Reconnect and continue from `committed` (every committed token, prompt included); returns the
        committed length the cloud agreed to. RESUME on the session's own replica first; if it no
        longer holds the session (or, in a fleet, is draining, busy or unreachable), a new session
        whose prompt is `committed` (see `recover`).

        With TLS the edge knows its replica by its certificate: a connection that a balancer routed
        to another replica gets the new session's HELLO, not the RESUME and its secret."""
        home, drained, home_id = self.home, self.link.going_away, self.link.identity
        self._retire()
        committed = [int(t) for t in committed]
        others = [r for r in self.replicas if r != home]
        if drained and others and self.cfg.recover:
            return self.recover(committed, avoid=home)
        resume = wire.Resume(
            session=self.sid,
            committed=len(committed),
            auth=self.cfg.token,
            secret=self.secret,
            digest=wire.committed_digest(committed),
        )
        fresh = self._continuation(committed) if self.cfg.recover else None

        def greeting(link: _Link):
            if home_id is None or link.identity == home_id:
                return resume
            if fresh is None:
                raise EdgeError(
                    f"reached another replica than the session's through {link.replica}; "
                    "its secret goes to no other, and recovery is off"
                )
            return fresh

        try:
            self.link, w = self._handshake(greeting, [home], self.cfg.failover_after if others else None)
        except EdgeError as e:
            gone = e.code == wire.ErrorCode.UNKNOWN_SESSION or (others and e.code in (None, wire.ErrorCode.BUSY))
            if not gone or not self.cfg.recover:
                raise
            return self.recover(committed, avoid=home if e.code != wire.ErrorCode.UNKNOWN_SESSION else None)
        if home_id is not None and self.link.identity != home_id:  # the new session's WELCOME
            return self._recovered(w, committed, moved=True)
        self.reconnects += 1
        self._welcomed(w)
        return w.committed

    def _continuation(self, committed: Sequence[int]) -> wire.Hello:
        """The HELLO of a new session that continues this one: prompt = `committed`, budget = what is left."""
        h = self.hello
        generated = len(committed) - len(h.prompt)
        if generated < 0 or list(committed[: len(h.prompt)]) != list(h.prompt):
            raise EdgeError("cannot recover: the committed tokens do not start with the prompt")
        return dataclasses.replace(h, prompt=tuple(committed), max_tokens=max(0, h.max_tokens - generated))

    def _recovered(self, w: wire.Welcome, committed: Sequence[int], moved: bool) -> int:
        if w.committed != len(committed):
            raise EdgeError(f"the new session starts at {w.committed}, the edge holds {len(committed)} tokens")
        self.recoveries += 1
        self.failovers += moved
        self._welcomed(w)
        return w.committed

    def recover(self, committed: Sequence[int], avoid: Replica | None = None) -> int:
        """Open a new session that continues the old one (see `_continuation`). Every replica is tried,
        `avoid` (one that is draining or unreachable) last."""
        prev, prev_id = self.link.replica, self.link.identity
        hello = self._continuation(committed)
        first = self._jitter.randrange(len(self.replicas))
        order = [r for r in self.replicas[first:] + self.replicas[:first] if r != avoid]
        order += [avoid] if avoid is not None else []
        self.link, _w = self._handshake(lambda link: hello, order)
        moved = self.link.replica != prev or (prev_id is not None and self.link.identity != prev_id)
        return self._recovered(_w, committed, moved)

    def total_bytes(self) -> tuple[int, int]:
        return self.bytes_up + self.link.bytes_up, self.bytes_down + self.link.bytes_down

    def close(self, linger_s: float = 2.0) -> None:
        if self.link.alive:
            self.link.send(wire.Close(reason=wire.CloseReason.NORMAL))
        self.bytes_up += self.link.bytes_up
        self.link.close(linger_s)
        self.bytes_down += self.link.bytes_down
