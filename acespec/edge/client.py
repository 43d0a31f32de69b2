"""The edge's connection to the cloud verifier: a blocking TCP transport with reconnect and RESUME.

`TcpTransport` plugs the network into the same `SpecLoop` the single-process engine uses. A reader
thread decodes frames into a queue, so the drafter keeps working while verdicts are in flight.
When the connection drops, `recv` reports `Disconnected`; the loop then calls `resume(committed)`,
which reconnects with backoff and sends RESUME with the last committed length the edge saw. The
cloud rolls back to that length, so both sides continue from the same prefix and no token is lost
or emitted twice.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from acespec import wire
from acespec.engine.loop import Block, Disconnected, Transport
from acespec.engine.verifier import Verdict


class EdgeError(RuntimeError):
    """The cloud refused us (ERROR frame) or could not be reached."""

    def __init__(self, message: str, code: wire.ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ConnectConfig:
    host: str = "127.0.0.1"  # cloud (or WAN emulator) address
    port: int = 7070  # cloud port
    token: bytes = b""  # auth token shared with the cloud
    connect_timeout_s: float = 10.0  # one connection attempt
    reply_timeout_s: float = 60.0  # longest wait for WELCOME / any frame before we call the link dead
    reconnect_attempts: int = 8  # tries before giving up on a dropped connection
    backoff_s: float = 0.05  # first retry delay; doubles up to backoff_max_s
    backoff_max_s: float = 2.0  # longest retry delay
    limits: wire.Limits = field(default_factory=wire.Limits)  # what we accept from the cloud


_EOF = object()


class _Link:
    """One TCP connection plus its reader thread."""

    def __init__(self, cfg: ConnectConfig) -> None:
        self.cfg = cfg
        self.sock = socket.create_connection((cfg.host, cfg.port), timeout=cfg.connect_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self.frames: queue.Queue = queue.Queue()
        self.bytes_up = 0
        self.bytes_down = 0
        self.alive = True
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        dec = wire.FrameDecoder(self.cfg.limits)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                self.bytes_down += len(data)
                for f in dec.feed(data):
                    self.frames.put((time.perf_counter(), f))
        except (OSError, wire.WireError) as e:
            self.frames.put((time.perf_counter(), e))
        self.alive = False
        self.frames.put((time.perf_counter(), _EOF))

    def send(self, frame) -> bool:
        data = wire.encode(frame)
        try:
            with self._lock:
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


def _expect_welcome(link: _Link, timeout: float) -> wire.Welcome:
    item = link.get(timeout)
    if item is None:
        raise EdgeError(f"no answer from the cloud within {timeout:.0f} s")
    _, f = item
    if isinstance(f, wire.Welcome):
        return f
    if isinstance(f, wire.Error):
        raise EdgeError(f"cloud refused the session: {f.code.name}: {f.message}", f.code)
    if isinstance(f, Exception):
        raise EdgeError(f"connection failed during the handshake: {f}")
    raise EdgeError(f"unexpected {type(f).__name__} during the handshake")


class CloudSession:
    """A session with the cloud: HELLO once, RESUME after every dropped connection."""

    def __init__(self, cfg: ConnectConfig, hello: wire.Hello) -> None:
        self.cfg = cfg
        self.hello = hello
        self.bytes_up = 0
        self.bytes_down = 0
        self.reconnects = 0
        self.link = self._connect_with_retry(lambda link: link.send(hello))
        w = _expect_welcome(self.link, cfg.reply_timeout_s)
        self.sid = w.session
        self.committed = w.committed

    def _connect_with_retry(self, greet) -> _Link:
        delay = self.cfg.backoff_s
        last: Exception | None = None
        for _ in range(max(1, self.cfg.reconnect_attempts)):
            try:
                link = _Link(self.cfg)
                greet(link)
                return link
            except OSError as e:
                last = e
                time.sleep(delay)
                delay = min(self.cfg.backoff_max_s, delay * 2)
        raise EdgeError(f"cannot reach the cloud at {self.cfg.host}:{self.cfg.port}: {last}")

    def _retire(self) -> None:
        self.bytes_up += self.link.bytes_up
        self.bytes_down += self.link.bytes_down
        self.link.close()

    def resume(self, committed: int) -> int:
        """Reconnect and RESUME at `committed`; returns the committed length the cloud agreed to."""
        self._retire()
        delay = self.cfg.backoff_s
        for attempt in range(max(1, self.cfg.reconnect_attempts)):
            self.link = self._connect_with_retry(
                lambda link: link.send(wire.Resume(session=self.sid, committed=committed, auth=self.cfg.token))
            )
            try:
                w = _expect_welcome(self.link, self.cfg.reply_timeout_s)
            except EdgeError as e:
                if e.code is not None:  # a refusal, not a flaky link: retrying will not help
                    raise
                self.link.close()
                time.sleep(delay)
                delay = min(self.cfg.backoff_max_s, delay * 2)
                continue
            self.reconnects += 1
            self.committed = w.committed
            return w.committed
        raise EdgeError(f"could not resume session {self.sid} after {self.cfg.reconnect_attempts} attempts")

    def total_bytes(self) -> tuple[int, int]:
        return self.bytes_up + self.link.bytes_up, self.bytes_down + self.link.bytes_down

    def close(self, linger_s: float = 2.0) -> None:
        if self.link.alive:
            self.link.send(wire.Close(reason=wire.CloseReason.NORMAL))
        self.bytes_up += self.link.bytes_up
        self.link.close(linger_s)
        self.bytes_down += self.link.bytes_down


def sparse_rows(q: np.ndarray) -> tuple[tuple[tuple[int, float], ...], ...]:  # q: [n, V]
    """Dense rows of an already-truncated q -> the wire's (id, prob) rows."""
    out = []
    for row in q:
        ids = np.flatnonzero(row)
        ids = ids[np.argsort(-row[ids], kind="stable")]
        out.append(tuple((int(i), float(np.float32(row[i]))) for i in ids))
    return tuple(out)


class TcpTransport(Transport):
    """DRAFT frames up, VERDICT frames down, over a `CloudSession`."""

    def __init__(self, session: CloudSession, *, send_q: bool) -> None:
        self.s = session
        self.send_q = send_q
        self.sent_at: dict[int, float] = {}
        self.rtt_samples: list[float] = []  # verdict arrival - block send - cloud verify time
        self.last_arrival: float | None = None  # perf_counter when the latest verdict reached the edge

    def send(self, block: Block) -> None:
        q = sparse_rows(block.q) if (self.send_q and block.q is not None and len(block.tokens)) else None
        frame = wire.Draft(session=self.s.sid, seq=block.seq, base=block.base, tokens=tuple(block.tokens), q=q)
        self.sent_at[block.seq] = time.perf_counter()
        self.s.link.send(frame)  # a failed send shows up as Disconnected on recv

    def recv(self, timeout: float | None = None):
        while True:
            item = self.s.link.get(self.s.cfg.reply_timeout_s if timeout is None else timeout)
            if item is None:
                if timeout is None:
                    return Disconnected("no verdict within the reply timeout")
                return None
            t, f = item
            if isinstance(f, wire.Verdict):
                self.last_arrival = t
                sent = self.sent_at.pop(f.seq, None)
                if sent is not None:
                    self.rtt_samples.append(max(0.0, t - sent - f.verify_us / 1e6))
                return Verdict(
                    f.seq, f.accepted, f.next_token if not f.dropped else -1, f.committed, f.verify_us,
                    dropped=f.dropped, finished=f.finished,
                )
            if isinstance(f, wire.Error):
                raise EdgeError(f"cloud error {f.code.name}: {f.message}", f.code)
            if f is _EOF or isinstance(f, Exception):
                return Disconnected(str(f) if f is not _EOF else "connection closed")
            # PONG / CLOSE: nothing to do here

    def resume(self, committed: int) -> int:
        self.sent_at.clear()
        return self.s.resume(committed)

    def close(self) -> None:
        self.s.close()
