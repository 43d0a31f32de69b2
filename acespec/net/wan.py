"""WAN emulator: an asyncio TCP proxy that puts a slow, jittery, asymmetric, lossy path between edge and cloud.

    edge  --->  WanProxy (listen)  --- "up" (edge -> cloud) --->  cloud (upstream)
          <---                     <-- "down" (cloud -> edge) ---

Every connection accepted on the listening port is paired with a fresh connection to the upstream
address. Each direction runs a reader (takes bytes off one socket, stamps each chunk with a delivery
time from `link.StreamClock`) and a writer (hands chunks to the other socket, in order, when their time
comes). Bytes are never dropped or reordered while the path is alive: that is TCP's contract, and the
edge-cloud protocol must be tested against TCP's failure modes (delay, stalls, resets), not IP's.

Faults, for tests and for live runs:

* `reset_connections()`: abort every proxied connection with an RST on both sides (peers see
  ConnectionResetError or EOF). The listener stays up; new connections work at once.
* `blackhole(seconds)`: the path stalls. Bytes in both directions, and new connections' upstream
  connects, are held and then released when the stall ends, in order.
* `blackhole(seconds, drop=True)`: the path dies. Bytes in flight and bytes sent meanwhile are
  discarded, and when the period ends every connection is reset (the endpoints' TCP would eventually
  give up on a dead path; the reset models that, without waiting minutes for it).
* `set_profile(profile)`: swap the profile live; it applies to chunks read from then on.

A varying profile (`WanProfile.switch_s > 0`, e.g. the `varying` profile) switches phase on the
proxy's own clock: its first phase starts when the proxy starts, and again at every `set_profile`, so
a benchmark that sets the profile before each run gives every run the same sequence of phases.

Running `acespec wan` (`cli.run_wan`) also maps signals to faults, so they can be injected into a
running process from a shell:

    kill -USR1 <pid>   # reset_connections()
    kill -USR2 <pid>   # blackhole(2.0): a 2-second stall, then the held bytes are delivered
    kill -INT / -TERM  # stop, print the counters

Limits of the model: chunk timing uses what one `read()` returned (at most READ_SIZE bytes), not real
segments; IP/TCP header overhead and congestion control are not modelled; bytes released after a
`blackhole` stall arrive in one burst rather than at the link rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from acespec.net.link import LinkQueue, StreamClock
from acespec.net.profile import WanProfile

__all__ = ["WanCounters", "WanProxy", "WanProxyThread", "SIGNAL_BLACKHOLE_S"]

UP, DOWN = "up", "down"

# Largest chunk read from a socket at once. It is also the timing granularity: a chunk is delivered
# whole, so at 1 Mbit/s a 16 KiB chunk appears 131 ms after its first byte would have.
READ_SIZE = 16 * 1024
# Bytes read from one side but not yet delivered, per connection and direction, before the proxy stops
# reading. Like a socket buffer: without it a fast sender would see an infinitely deep link.
MAX_PENDING = 1 << 20
# Give up on an upstream that does not accept within this time (the client then sees a reset).
CONNECT_TIMEOUT_S = 10.0
# Length of the blackhole SIGUSR2 injects into a running `acespec wan`.
SIGNAL_BLACKHOLE_S = 2.0


@dataclass
class WanCounters:
    """What the proxy has done so far. `up` is edge -> cloud, `down` is cloud -> edge."""

    up_bytes: int = 0  # bytes delivered to the upstream (cloud)
    up_chunks: int = 0  # writes delivered to the upstream
    down_bytes: int = 0  # bytes delivered to the client (edge)
    down_chunks: int = 0  # writes delivered to the client
    up_stalls: int = 0  # up chunks that drew a loss and waited an extra RTO
    down_stalls: int = 0  # down chunks that drew a loss and waited an extra RTO
    dropped_bytes: int = 0  # bytes discarded by a drop-mode blackhole (both directions)
    connections: int = 0  # connections accepted since start
    active: int = 0  # connections open now
    resets: int = 0  # connections aborted by fault injection (reset_connections, drop blackhole)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.as_dict().items())


def _abort_with_rst(transport: asyncio.WriteTransport | None) -> None:
    """Close a TCP transport so the peer sees a reset, not an orderly FIN.

    SO_LINGER with a zero timeout makes close() send RST and discard unsent data, which is what a path
    failure looks like from an endpoint; a plain abort() would usually send a FIN and look like a clean
    close.
    """
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and not transport.is_closing():
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed underneath us: abort() below is still right
    transport.abort()


class _Connection:
    """One proxied connection: the client side, the upstream side (once connected), and its handler task."""

    def __init__(self, cid: int, client: asyncio.StreamWriter, task: asyncio.Task) -> None:
        self.cid = cid
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task = task
        self.aborted = False

    def abort(self) -> None:
        """Reset both sides and stop the pumps. Safe to call more than once, from any task on the loop."""
        if self.aborted:
            return
        self.aborted = True
        _abort_with_rst(self.client.transport)
        if self.upstream is not None:
            _abort_with_rst(self.upstream.transport)
        if self.task is not asyncio.current_task():
            self.task.cancel()  # cancels the pumps too: the handler awaits them


class _Pipe:
    """One direction of one connection: a reader that stamps chunks with delivery times, a writer that
    delivers them in order when due. The two halves talk through a FIFO, so order is preserved by
    construction; `StreamClock` makes the delivery times non-decreasing so FIFO order costs nothing."""

    def __init__(
        self, proxy: WanProxy, conn: _Connection, direction: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.conn = conn
        self.direction = direction
        self.src = src
        self.dst = dst
        # Seeded per (profile seed, connection number, direction): a run with the same traffic pattern
        # draws the same jitter and losses, whatever other connections do meanwhile.
        rng = random.Random(f"acespec-wan:{proxy.profile.seed}:{conn.cid}:{direction}")
        self.clock = StreamClock(proxy._links[direction], rng)
        self.queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        self.pending = 0  # bytes queued, not yet delivered
        self.space = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(self._read_loop(), self._write_loop())

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await self.src.read(READ_SIZE)
            except (ConnectionError, OSError):
                self.conn.abort()  # the sender's side reset: pass the reset on (TCP discards in-flight data too)
                return
            now = loop.time()
            if self.proxy._path_dead(now):
                # Sent into a dead path: lost. An EOF is lost too; the connection is reset when the
                # blackhole ends, so nothing waits for it.
                self.proxy._counters.dropped_bytes += len(data)
                if not data:
                    return
                continue
            deliver_at, stalled = self.clock.schedule(self.proxy.profile_at(now), self.direction, now, len(data))
            if not data:
                self.queue.put_nowait((deliver_at, None))  # EOF travels in order, after the last byte
                return
            if stalled:
                if self.direction == UP:
                    self.proxy._counters.up_stalls += 1
                else:
                    self.proxy._counters.down_stalls += 1
            self.pending += len(data)
            self.queue.put_nowait((deliver_at, data))
            while self.pending > MAX_PENDING:  # backpressure: stop reading until the link drains
                self.space.clear()
                await self.space.wait()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            deliver_at, data = await self.queue.get()
            await self.proxy._wait_until(deliver_at)
            if data is not None:
                self.pending -= len(data)
                if self.pending <= MAX_PENDING:
                    self.space.set()
            if self.proxy._path_dead(loop.time()):
                if data is None:
                    return
                self.proxy._counters.dropped_bytes += len(data)
                continue
            try:
                if data is None:
                    # Forward the half-close; the other direction may still carry data.
                    if self.dst.can_write_eof():
                        self.dst.write_eof()
                    return
                self.dst.write(data)
                c = self.proxy._counters
                if self.direction == UP:
                    c.up_bytes += len(data)
                    c.up_chunks += 1
                else:
                    c.down_bytes += len(data)
                    c.down_chunks += 1
                await self.dst.drain()
            except (ConnectionError, OSError):
                self.conn.abort()  # the receiver went away: tear down both sides, as a failed TCP path does
                return


class WanProxy:
    """Asyncio TCP proxy applying a `WanProfile` between clients (edge) and one upstream (cloud).

    Use from a running event loop: `await start()`, then `port`, `counters`, the fault methods
    (`reset_connections`, `blackhole`, `set_profile`, all plain calls on the loop's thread), and
    `await stop()`. From synchronous code use `WanProxyThread`.
    """

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        upstream_host: str,
        upstream_port: int,
        profile: WanProfile | None = None,
    ) -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self._profile = self._check_profile(profile if profile is not None else WanProfile())
        self._links = {UP: LinkQueue(), DOWN: LinkQueue()}
        self._counters = WanCounters()
        self._conns: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        # Fault state, in loop.time(): until when the path is stalled (hold) or dead (drop).
        self._hold_until = -math.inf
        self._drop_until = -math.inf
        self._drop_timer: asyncio.TimerHandle | None = None
        self._epoch = 0.0  # loop.time() when the profile's first phase began (a varying profile's clock)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting. Returns once listening; `port` is then the bound port."""
        if self._server is not None:
            raise RuntimeError("WanProxy already started")
        self._loop = asyncio.get_running_loop()
        self._epoch = self._loop.time()
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)

    async def stop(self) -> None:
        """Stop listening, reset every proxied connection, and wait for their handlers to finish."""
        if self._server is None or self._stopped is None or self._stopped.is_set():
            return
        self._server.close()
        if self._drop_timer is not None:
            self._drop_timer.cancel()
        tasks = [conn.task for conn in self._conns.values()]
        for conn in list(self._conns.values()):
            conn.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await self._server.wait_closed()
        self._stopped.set()

    async def serve_forever(self) -> None:
        """Start if needed, then run until `stop()` is called (or this coroutine is cancelled)."""
        if self._server is None:
            await self.start()
        assert self._stopped is not None
        await self._stopped.wait()

    async def __aenter__(self) -> WanProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- state ---------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port actually bound (useful with listen_port=0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("WanProxy is not listening; call start() first")
        return self._server.sockets[0].getsockname()[1]

    @property
    def profile(self) -> WanProfile:
        return self._profile

    def profile_at(self, now: float) -> WanProfile:
        """The fixed profile in force at loop time `now` (a varying profile's current phase)."""
        return self._profile.at(now - self._epoch)

    @property
    def counters(self) -> WanCounters:
        """A snapshot of the counters (a copy: later traffic does not change it)."""
        snap = dataclasses.replace(self._counters)
        snap.active = len(self._conns)
        return snap

    @property
    def blackhole_remaining_s(self) -> float:
        """Seconds left of the current blackhole (stall or drop), 0.0 when the path is up."""
        if self._loop is None:
            return 0.0
        return max(0.0, max(self._hold_until, self._drop_until) - self._loop.time())

    # -- faults --------------------------------------------------------------------------------------

    def set_profile(self, profile: WanProfile) -> None:
        """Use `profile` for every chunk read from now on (chunks already scheduled keep their times).

        The RNG seed of existing connections is kept; new connections use the new profile's seed. A
        varying profile starts in its first phase.
        """
        self._profile = self._check_profile(profile)
        if self._loop is not None:
            self._epoch = self._loop.time()

    def reset_connections(self, limit: int | None = None, rng: random.Random | None = None) -> int:
        """Abort every proxied connection (or `limit` of them, picked with `rng`) with RST on both
        sides. Returns how many were reset. The listener keeps accepting, so a reconnect works
        immediately."""
        conns = list(self._conns.values())
        if limit is not None and limit < len(conns):
            conns = (rng or random).sample(conns, limit)
        for conn in conns:
            conn.abort()
        self._counters.resets += len(conns)
        return len(conns)

    def blackhole(self, seconds: float, drop: bool = False) -> None:
        """Stall (drop=False) or kill (drop=True) the path for `seconds`, starting now.

        Stall: bytes in both directions, and upstream connects of new connections, are held and then
        delivered in order when the period ends. Kill: bytes in flight or sent meanwhile are discarded,
        and every connection is reset when the period ends. Overlapping calls extend the period.
        """
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise ValueError(f"blackhole seconds must be a finite number >= 0, got {seconds!r}")
        loop = self._require_loop()
        until = loop.time() + seconds
        if not drop:
            self._hold_until = max(self._hold_until, until)
            return
        self._drop_until = max(self._drop_until, until)
        if self._drop_timer is not None:
            self._drop_timer.cancel()
        self._drop_timer = loop.call_at(self._drop_until, self._end_drop)

    # -- internals -----------------------------------------------------------------------------------

    @staticmethod
    def _check_profile(profile: WanProfile) -> WanProfile:
        if not isinstance(profile, WanProfile):
            raise ValueError(f"expected a WanProfile, got {type(profile).__name__}")
        return profile

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("WanProxy is not running; call start() first")
        return self._loop

    def _path_dead(self, now: float) -> bool:
        return now < self._drop_until

    def _end_drop(self) -> None:
        self._drop_timer = None
        assert self._loop is not None
        if self._loop.time() < self._drop_until:  # woke a hair early: come back at the exact end
            self._drop_timer = self._loop.call_at(self._drop_until, self._end_drop)
            return
        self.reset_connections()

    async def _wait_until(self, when: float) -> None:
        """Sleep until `when`, and past the end of any stall (which may be extended while we sleep)."""
        loop = asyncio.get_running_loop()
        while True:
            target = max(when, self._hold_until)
            delay = target - loop.time()
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = _Connection(next(self._ids), client_writer, task)
        self._conns[conn.cid] = conn
        self._counters.connections += 1
        pumps: list[asyncio.Task] = []
        clean = False
        try:
            # A stalled or dead path delays the upstream handshake as well as data.
            await self._wait_until(max(self._hold_until, self._drop_until))
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.upstream_host, self.upstream_port), CONNECT_TIMEOUT_S
                )
            except (TimeoutError, OSError):
                return  # upstream unreachable: the client sees a reset (below), as with a refused connect
            conn.upstream = up_writer
            pumps = [
                asyncio.create_task(_Pipe(self, conn, UP, client_reader, up_writer).run()),
                asyncio.create_task(_Pipe(self, conn, DOWN, up_reader, client_writer).run()),
            ]
            await asyncio.gather(*pumps)
            # Both directions reached EOF and delivered it: an orderly close on both sides.
            for w in (client_writer, up_writer):
                w.close()
            clean = True
        except asyncio.CancelledError:
            pass  # aborted (reset_connections, drop blackhole, stop): the sockets are already reset
        finally:
            for t in pumps:
                t.cancel()
            if not clean:
                conn.abort()  # no-op when already aborted; otherwise never leave a half-dead pair behind
            self._conns.pop(conn.cid, None)


class WanProxyThread:
    """`WanProxy` on its own event loop in a daemon thread, for synchronous callers.

        with WanProxyThread("127.0.0.1", 0, "127.0.0.1", cloud_port, PROFILES["wan"]) as wan:
            connect_to(("127.0.0.1", wan.port)); wan.blackhole(1.0); ...

    Every method is thread-safe: calls are marshalled onto the proxy's loop and wait for it.
    """

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        upstream_host: str,
        upstream_port: int,
        profile: WanProfile | None = None,
    ) -> None:
        self.proxy = WanProxy(listen_host, listen_port, upstream_host, upstream_port, profile)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> WanProxyThread:
        """Start the loop thread and the proxy; returns once it is listening."""
        if self._thread is not None:
            raise RuntimeError("WanProxyThread already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._run_loop, args=(loop,), name="acespec-wan", daemon=True)
        self._loop, self._thread = loop, thread
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.start(), loop).result(timeout)
        except BaseException:
            self._shutdown_loop(timeout)
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the proxy (resetting its connections) and the loop thread. Idempotent."""
        if self._loop is None or self._thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(timeout)
        finally:
            self._shutdown_loop(timeout)

    def __enter__(self) -> WanProxyThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._call(lambda: self.proxy.port)

    @property
    def profile(self) -> WanProfile:
        return self.proxy.profile

    @property
    def counters(self) -> WanCounters:
        return self._call(lambda: self.proxy.counters)

    @property
    def blackhole_remaining_s(self) -> float:
        return self._call(lambda: self.proxy.blackhole_remaining_s)

    def reset_connections(self, limit: int | None = None, rng: random.Random | None = None) -> int:
        return self._call(lambda: self.proxy.reset_connections(limit, rng))

    def blackhole(self, seconds: float, drop: bool = False) -> None:
        self._call(lambda: self.proxy.blackhole(seconds, drop=drop))

    def set_profile(self, profile: WanProfile) -> None:
        self._call(lambda: self.proxy.set_profile(profile))

    # -- internals -----------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], object], timeout: float = 10.0):
        """Run `fn()` on the proxy's loop and return its result (or raise its exception) here."""
        if self._loop is None or not self._loop.is_running():
            raise RuntimeError("WanProxyThread is not running; call start() first")

        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            # Let cancelled handlers unwind before the loop closes, so nothing is left "pending".
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _shutdown_loop(self, timeout: float) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout)
