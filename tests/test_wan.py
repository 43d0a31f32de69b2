"""Tests for the WAN emulator (acespec.net): parsers, the timing model, and the proxy on real sockets.

Socket tests use 127.0.0.1 only, run every coroutine under a hard timeout, and close their servers.
Timing bounds are generous on purpose: they check the emulator's model (delay, rate, stalls), not how
fast this machine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import random
import signal
import socket
import socketserver
import statistics
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acespec.net import (
    MSS, PROFILES, LinkQueue, StreamClock, WanProfile, WanProxy, WanProxyThread, parse_hostport, parse_rate,
    profile_from_args, run_wan,
)
from acespec.net.wan import SIGNAL_BLACKHOLE_S

HOST = "127.0.0.1"


# --------------------------------------------------------------------------------------------------
# helpers


def arun(coro, timeout: float = 15.0):
    """Run a coroutine on a fresh loop with a hard time limit, so no test can hang."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class EchoServer:
    """Asyncio echo server; remembers how each server-side connection ended ("eof" or "reset")."""

    def __init__(self) -> None:
        self.server: asyncio.base_events.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.endings: list[str] = []
        self.arrivals: list[float] = []  # loop.time() of every chunk received, for one-way delay tests

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(65536):
                self.arrivals.append(loop.time())
                writer.write(data)
                await writer.drain()
            self.endings.append("eof")
        except (ConnectionError, OSError):
            self.endings.append("reset")
        finally:
            writer.close()

    async def __aenter__(self) -> EchoServer:
        self.server = await asyncio.start_server(self._handle, HOST, 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.transport.abort()
        await self.server.wait_closed()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def echo_behind(profile: WanProfile):
    """An echo server with a WanProxy in front of it; yields (proxy, server)."""
    async with EchoServer() as server:
        proxy = WanProxy(HOST, 0, HOST, server.port, profile)
        await proxy.start()
        try:
            yield proxy, server
        finally:
            await proxy.stop()


async def connect(proxy: WanProxy):
    return await asyncio.open_connection(HOST, proxy.port)


async def round_trip(reader, writer, payload: bytes) -> float:
    """Send `payload`, wait for its echo, return the elapsed seconds."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    writer.write(payload)
    await writer.drain()
    echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    assert echoed == payload
    return loop.time() - t0


async def read_until_closed(reader, timeout: float = 5.0) -> tuple[bytes, str]:
    """Read until the stream ends; return (bytes read, "eof" | "reset")."""
    got = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                got += chunk
        return bytes(got), "eof"
    except (ConnectionResetError, BrokenPipeError):
        return bytes(got), "reset"


def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


# --------------------------------------------------------------------------------------------------
# parsers and profiles


@pytest.mark.parametrize("text, bps", [
    ("20mbit", 20e6), ("5Mbit/s", 5e6), ("500kbit", 500e3), ("1gbit", 1e9), ("1GBIT/S", 1e9),
    ("2.5m", 2.5e6), ("750k", 750e3), ("1000000", 1e6), ("1e6", 1e6), (" 20 Mbit/s ", 20e6),
    ("64bit", 64.0), ("0", 0.0), ("unlimited", 0.0), (1_000_000, 1e6), (2.5e6, 2.5e6), (0, 0.0),
])
def test_parse_rate_accepts(text, bps):
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", [
    "", "fast", "mbit", "20 mbps", "5MB/s", "10 bytes", "-5mbit", "20tbit", "1.2.3mbit", "nan", "inf",
    -1, float("nan"), float("inf"), True, None, [5],
])
def test_parse_rate_rejects(bad):
    with pytest.raises(ValueError):
        parse_rate(bad)


def test_parse_rate_error_explains_byte_units():
    with pytest.raises(ValueError, match="ambiguous"):
        parse_rate("20mbps")


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from([("k", 1e3), ("m", 1e6), ("g", 1e9), ("", 1)]),
       st.sampled_from(["", "bit", "bit/s", "/s"]))
@settings(max_examples=200, deadline=None)
def test_parse_rate_property(n, prefix, suffix):
    letter, scale = prefix
    if not letter and suffix == "/s":
        suffix = "bit/s"  # "5/s" alone is not a rate we promise to read
    assert parse_rate(f"{n}{letter.upper() if n % 2 else letter}{suffix}") == pytest.approx(n * scale)


def test_named_profiles():
    assert set(PROFILES) == {"lan", "wan", "transcontinental", "lte", "varying"}
    lan, wan, tc, lte = (PROFILES[k] for k in ("lan", "wan", "transcontinental", "lte"))
    assert (lan.rtt_ms, lan.jitter_ms, lan.up_bps, lan.down_bps) == (1, 0, 1e9, 1e9)
    assert (wan.rtt_ms, wan.jitter_ms, wan.up_bps, wan.down_bps) == (100, 20, 5e6, 20e6)
    assert (tc.rtt_ms, tc.jitter_ms, tc.up_bps, tc.down_bps) == (250, 25, 5e6, 20e6)
    assert (lte.rtt_ms, lte.jitter_ms, lte.up_bps, lte.down_bps) == (60, 30, 2e6, 10e6)
    assert WanProfile().is_passthrough and not wan.is_passthrough
    assert wan.rto_ms == 200 and tc.rto_ms == 500
    assert "rtt=100ms" in wan.describe() and "up=5Mbit/s" in wan.describe()


def test_profile_from_args_overrides():
    p = profile_from_args("wan", rtt=80, jitter="5ms", up="1mbit", down="2Mbit/s", loss="1.5%", seed=7)
    assert p == WanProfile(rtt_ms=80, jitter_ms=5, up_bps=1e6, down_bps=2e6, loss_pct=1.5, seed=7)
    assert profile_from_args("lte") == PROFILES["lte"]
    assert profile_from_args("LAN", rtt="0.25s").rtt_ms == 250
    assert profile_from_args("wan", down=None).down_bps == 20e6  # None means "keep the profile's value"
    assert profile_from_args(None) == WanProfile()
    assert PROFILES["wan"].rtt_ms == 100  # overrides never mutate the shared named profiles


@pytest.mark.parametrize("kwargs", [
    {"name": "moon"}, {"name": "wan", "rtt": -1}, {"name": "wan", "rtt": "fast"}, {"name": "wan", "jitter": "x"},
    {"name": "wan", "up": "5MB/s"}, {"name": "wan", "down": "-1"}, {"name": "wan", "loss": 101},
    {"name": "wan", "loss": "lots"}, {"name": "wan", "rtt": float("nan")}, {"name": "wan", "seed": "abc"},
])
def test_profile_from_args_rejects(kwargs):
    with pytest.raises(ValueError):
        profile_from_args(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"rtt_ms": -1}, {"jitter_ms": float("inf")}, {"up_bps": -5}, {"loss_pct": 100.5}, {"seed": 1.5},
    {"rtt_ms": "100"}, {"down_bps": True},
])
def test_profile_validation(kwargs):
    with pytest.raises(ValueError):
        WanProfile(**kwargs)


def test_profile_is_frozen():
    with pytest.raises(Exception):
        PROFILES["wan"].rtt_ms = 1  # type: ignore[misc]


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9000", ("127.0.0.1", 9000)), ("localhost:0", ("localhost", 0)), (":8080", ("127.0.0.1", 8080)),
    ("[::1]:443", ("::1", 443)), ("0.0.0.0:65535", ("0.0.0.0", 65535)),
])
def test_parse_hostport(text, expected):
    assert parse_hostport(text) == expected


@pytest.mark.parametrize("bad", ["9000", "host:", "host:port", "host:70000", "host:-1", "::1:80", "[::1]80", "", 80])
def test_parse_hostport_rejects(bad):
    with pytest.raises(ValueError):
        parse_hostport(bad)


# --------------------------------------------------------------------------------------------------
# timing model (no sockets)


def test_link_queue_serialises():
    link = LinkQueue()
    # 200 kB at 1 Mbit/s, all arriving at t=0 in 16 KiB chunks: the last bit leaves at 1.6 s.
    end = 0.0
    sent = 0
    while sent < 200_000:
        n = min(16384, 200_000 - sent)
        end = link.transmit(0.0, n, 1e6)
        sent += n
    assert end == pytest.approx(1.6)
    # A chunk arriving after the queue drained starts at once; unlimited rate costs nothing.
    assert link.transmit(10.0, 1250, 1e6) == pytest.approx(10.01)
    assert LinkQueue().transmit(3.0, 10**9, 0) == 3.0


def test_passthrough_profile_adds_nothing():
    clock = StreamClock(LinkQueue(), random.Random(0))
    for t in (0.0, 0.5, 0.5, 2.0):
        assert clock.schedule(WanProfile(), "up", t, 1000) == (t, False)


@given(
    rtt=st.floats(0, 500), jitter=st.floats(0, 200), rate=st.sampled_from([0, 1e5, 1e6, 1e8]),
    loss=st.floats(0, 30), seed=st.integers(0, 2**31),
    events=st.lists(st.tuples(st.floats(0, 0.2), st.integers(0, 100_000)), min_size=1, max_size=60),
)
@settings(max_examples=150, deadline=None)
def test_schedule_is_ordered_and_never_early(rtt, jitter, rate, loss, seed, events):
    profile = WanProfile(rtt_ms=rtt, jitter_ms=jitter, up_bps=rate, down_bps=rate, loss_pct=loss, seed=seed)
    clock = StreamClock(LinkQueue(), random.Random(seed))
    t, last = 0.0, -math.inf
    min_delay = max(0.0, rtt - jitter) / 2 / 1000
    for gap, n in events:
        t += gap
        deliver, stalled = clock.schedule(profile, "down", t, n)
        assert deliver >= last  # jitter and stalls never reorder
        ser = n * 8 / rate if rate else 0.0
        assert deliver >= t + ser + min_delay - 1e-9
        if stalled:
            assert deliver >= t + profile.rto_ms / 1000 - 1e-9
        if loss == 0:
            assert not stalled
        last = deliver


def test_schedule_is_reproducible_from_the_seed():
    profile = WanProfile(rtt_ms=100, jitter_ms=40, loss_pct=5)

    def run(seed):
        clock = StreamClock(LinkQueue(), random.Random(seed))
        return [clock.schedule(profile, "up", i * 0.3, 3000) for i in range(200)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    stalls = sum(s for _, s in run(3))
    # P(stall) per 3000-byte chunk = 1 - 0.95**3 ~ 14%: 200 chunks give ~29 stalls.
    assert 10 <= stalls <= 55
    with pytest.raises(ValueError):
        StreamClock(LinkQueue(), random.Random(0)).schedule(profile, "sideways", 0.0, 1)


def test_loss_is_per_segment():
    profile = WanProfile(loss_pct=10)
    clock = StreamClock(LinkQueue(), random.Random(0))
    small = sum(clock.schedule(profile, "up", i * 10.0, 100)[1] for i in range(2000))
    big = sum(clock.schedule(profile, "up", 1e5 + i * 10.0, 10 * MSS)[1] for i in range(2000))
    assert 100 < small < 320  # ~10%
    assert 1100 < big < 1500  # 1 - 0.9**10 ~ 65%


# --------------------------------------------------------------------------------------------------
# the proxy on real sockets


def test_passthrough_is_fast():
    async def main():
        async with echo_behind(WanProfile()) as (proxy, _):
            reader, writer = await connect(proxy)
            times = [await round_trip(reader, writer, b"x" * 64) for _ in range(100)]
            close_writer(writer)
            return times

    times = arun(main())
    assert statistics.median(times) < 0.02, times


def test_bytes_intact_and_in_order_under_jitter_and_loss():
    profile = WanProfile(rtt_ms=10, jitter_ms=30, up_bps=80e6, down_bps=80e6, loss_pct=2, seed=11)
    n_conns = 3

    async def one_connection(proxy, seed):
        rng = random.Random(seed)
        payload = bytes(rng.getrandbits(8) for _ in range(300_000))
        reader, writer = await connect(proxy)
        received = asyncio.create_task(read_until_closed(reader, timeout=15))
        pos = 0
        while pos < len(payload):  # many writes of random sizes, with pauses, so chunks interleave with jitter
            n = rng.randint(1, 6000)
            writer.write(payload[pos:pos + n])
            pos += n
            if rng.random() < 0.1:
                await asyncio.sleep(0.002)
        await writer.drain()
        writer.write_eof()  # half-close: the proxy must forward it after the data, and the echo then ends
        got, how = await received
        writer.close()
        return payload, got, how

    async def main():
        async with echo_behind(profile) as (proxy, server):
            results = await asyncio.gather(*(one_connection(proxy, s) for s in range(n_conns)))
            return results, proxy.counters, server.endings

    results, counters, endings = arun(main(), timeout=25)
    for payload, got, how in results:
        assert how == "eof"
        assert len(got) == len(payload)
        assert got == payload
    total = sum(len(p) for p, _, _ in results)
    assert counters.up_bytes == total and counters.down_bytes == total
    assert counters.up_stalls + counters.down_stalls > 0  # loss was exercised, and still no byte was lost
    assert counters.connections == n_conns
    assert endings == ["eof"] * n_conns


def test_round_trip_and_one_way_delay():
    async def main():
        async with echo_behind(WanProfile(rtt_ms=200)) as (proxy, server):
            reader, writer = await connect(proxy)
            loop = asyncio.get_running_loop()
            rtts, one_way = [], []
            for i in range(4):
                sent = loop.time()
                rtts.append(await round_trip(reader, writer, b"ping%d" % i))
                one_way.append(server.arrivals[-1] - sent)
            close_writer(writer)
            return rtts, one_way

    rtts, one_way = arun(main())
    assert all(0.19 <= r <= 0.4 for r in rtts), rtts
    assert all(0.095 <= w <= 0.2 for w in one_way), one_way


def test_jitter_varies_delay_within_bounds():
    async def main():
        async with echo_behind(WanProfile(rtt_ms=100, jitter_ms=60, seed=3)) as (proxy, _):
            reader, writer = await connect(proxy)
            rtts = [await round_trip(reader, writer, b"j") for _ in range(10)]
            close_writer(writer)
            return rtts

    rtts = arun(main())
    # each way 50 +- 15 ms, so a round trip is within 100 +- 30 ms (plus scheduling slack)
    assert all(0.065 <= r <= 0.25 for r in rtts), rtts
    assert max(rtts) - min(rtts) > 0.005, rtts


def test_uplink_bandwidth_limit():
    async def main():
        async with echo_behind(WanProfile(up_bps=parse_rate("1mbit"))) as (proxy, _):
            reader, writer = await connect(proxy)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            elapsed = await round_trip(reader, writer, os.urandom(200_000))
            assert loop.time() - t0 >= elapsed
            close_writer(writer)
            return elapsed, proxy.counters

    elapsed, counters = arun(main())
    assert 1.5 <= elapsed <= 6.0, elapsed  # 200 kB * 8 / 1 Mbit/s = 1.6 s
    assert counters.up_bytes == 200_000 and counters.up_chunks >= 200_000 // 16384


def test_downlink_bandwidth_limit_is_separate():
    async def main():
        # the uplink is unlimited and the downlink slow: the echo of 100 kB takes ~0.8 s
        async with echo_behind(WanProfile(down_bps=1e6)) as (proxy, _):
            reader, writer = await connect(proxy)
            elapsed = await round_trip(reader, writer, os.urandom(100_000))
            close_writer(writer)
            return elapsed

    elapsed = arun(main())
    assert 0.75 <= elapsed <= 4.0, elapsed


def test_set_profile_live():
    async def main():
        async with echo_behind(WanProfile()) as (proxy, _):
            reader, writer = await connect(proxy)
            fast = await round_trip(reader, writer, b"a")
            proxy.set_profile(WanProfile(rtt_ms=200))
            slow = await round_trip(reader, writer, b"b")
            proxy.set_profile(WanProfile())
            fast_again = await round_trip(reader, writer, b"c")
            with pytest.raises(ValueError):
                proxy.set_profile("wan")  # type: ignore[arg-type]
            close_writer(writer)
            return fast, slow, fast_again

    fast, slow, fast_again = arun(main())
    assert fast < 0.1 and fast_again < 0.1
    assert 0.19 <= slow <= 0.4


def test_reset_connections():
    async def main():
        async with echo_behind(WanProfile(rtt_ms=2)) as (proxy, server):
            reader, writer = await connect(proxy)
            await round_trip(reader, writer, b"before")
            assert proxy.reset_connections() == 1
            got, how = await read_until_closed(reader, timeout=3)
            assert got == b"" and how in ("eof", "reset")
            for _ in range(100):  # the server side sees the reset too
                if server.endings:
                    break
                await asyncio.sleep(0.01)
            assert server.endings and server.endings[0] in ("eof", "reset")
            writer.transport.abort()
            reader2, writer2 = await connect(proxy)  # the listener survives
            await round_trip(reader2, writer2, b"after")
            counters = proxy.counters
            close_writer(writer2)
            return counters

    counters = arun(main())
    assert counters.resets == 1 and counters.connections == 2 and counters.active == 1


def test_blackhole_holds_then_delivers():
    async def main():
        async with echo_behind(WanProfile()) as (proxy, _):
            reader, writer = await connect(proxy)
            await round_trip(reader, writer, b"warm")
            proxy.blackhole(0.5)
            assert 0.4 < proxy.blackhole_remaining_s <= 0.5
            held = await round_trip(reader, writer, b"held" * 1000)
            # a connection opened during the stall waits for the path, then works
            proxy.blackhole(0.3)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            reader2, writer2 = await connect(proxy)
            await round_trip(reader2, writer2, b"new")
            new_conn = loop.time() - t0
            after = await round_trip(reader, writer, b"after")
            counters = proxy.counters
            close_writer(writer)
            close_writer(writer2)
            return held, new_conn, after, counters

    held, new_conn, after, counters = arun(main())
    assert 0.45 <= held <= 1.5, held
    assert 0.25 <= new_conn <= 1.5, new_conn
    assert after < 0.1
    assert counters.dropped_bytes == 0 and counters.resets == 0


def test_blackhole_drop_discards_and_resets():
    async def main():
        async with echo_behind(WanProfile(rtt_ms=2)) as (proxy, _):
            reader, writer = await connect(proxy)
            await round_trip(reader, writer, b"warm")
            loop = asyncio.get_running_loop()
            proxy.blackhole(0.3, drop=True)
            t0 = loop.time()
            writer.write(b"into the void")
            await writer.drain()
            got, how = await read_until_closed(reader, timeout=3)
            closed_after = loop.time() - t0
            reader2, writer2 = await connect(proxy)  # the path is back
            await round_trip(reader2, writer2, b"alive")
            counters = proxy.counters
            close_writer(writer)
            close_writer(writer2)
            return got, how, closed_after, counters

    got, how, closed_after, counters = arun(main())
    assert got == b"" and how in ("eof", "reset")
    assert 0.25 <= closed_after <= 2.0, closed_after
    assert counters.dropped_bytes == len(b"into the void")
    assert counters.resets == 1


def test_blackhole_rejects_bad_durations():
    async def main():
        async with echo_behind(WanProfile()) as (proxy, _):
            for bad in (-1, float("nan"), float("inf"), "2"):
                with pytest.raises(ValueError):
                    proxy.blackhole(bad)  # type: ignore[arg-type]

    arun(main())
    with pytest.raises(RuntimeError):
        WanProxy(HOST, 0, HOST, 1).blackhole(1.0)


def test_unreachable_upstream_resets_client():
    async def main():
        with socket.socket() as s:  # a port with nothing listening on it
            s.bind((HOST, 0))
            dead_port = s.getsockname()[1]
        proxy = WanProxy(HOST, 0, HOST, dead_port, WanProfile())
        await proxy.start()
        try:
            reader, writer = await connect(proxy)
            writer.write(b"hello?")
            got, how = await read_until_closed(reader, timeout=3)
            writer.transport.abort()
            return got, proxy.counters
        finally:
            await proxy.stop()

    got, counters = arun(main())
    assert got == b"" and counters.active == 0


# --------------------------------------------------------------------------------------------------
# synchronous wrapper and CLI entry point


class _SyncEcho(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            try:
                while data := self.request.recv(65536):
                    self.request.sendall(data)
            except OSError:
                pass


@pytest.fixture
def sync_echo():
    server = _SyncEcho((HOST, 0), _SyncEcho.Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _sync_round_trip(sock: socket.socket, payload: bytes) -> float:
    t0 = time.monotonic()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "connection closed early"
        got += chunk
    assert got == payload
    return time.monotonic() - t0


def test_thread_wrapper(sync_echo):
    with WanProxyThread(HOST, 0, HOST, sync_echo, WanProfile(rtt_ms=100)) as wan:
        port = wan.port
        with socket.create_connection((HOST, port), timeout=5) as sock:
            # every trip pays the 100 ms; a loaded machine only adds to a trip, so the upper bounds are on
            # the quickest of a few (one trip alone read 0.6 s beside a busy process)
            trips = [_sync_round_trip(sock, b"hello") for _ in range(3)]
            assert 0.095 <= min(trips) <= 0.4
            wan.set_profile(WanProfile())
            assert min(_sync_round_trip(sock, b"fast") for _ in range(5)) < 0.095  # the delay is gone
            wan.blackhole(0.3)
            assert 0.25 <= _sync_round_trip(sock, b"held") <= 1.5
            assert wan.reset_connections() == 1
            try:
                assert sock.recv(10) == b""
            except ConnectionResetError:
                pass
        with socket.create_connection((HOST, port), timeout=5) as sock:
            _sync_round_trip(sock, b"again")
        counters = wan.counters
        assert counters.resets == 1 and counters.connections == 2
        assert counters.up_bytes == counters.down_bytes == len(b"hello" * 3 + b"fast" * 5 + b"heldagain")
    # stopped: nothing listens any more, and the fault methods refuse politely
    with pytest.raises(OSError):
        socket.create_connection((HOST, port), timeout=2).close()
    with pytest.raises(RuntimeError):
        wan.reset_connections()
    wan.stop()  # idempotent


def test_run_wan_signals_and_output():
    out = io.StringIO()

    async def main():
        async with EchoServer() as server:
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(
                run_wan(f"{HOST}:0", f"{HOST}:{server.port}", PROFILES["lan"], on_ready=ready.set_result, out=out))
            proxy = await asyncio.wait_for(ready, 5)
            reader, writer = await connect(proxy)
            await round_trip(reader, writer, b"hi")
            os.kill(os.getpid(), signal.SIGUSR1)  # -> reset_connections
            got, how = await read_until_closed(reader, timeout=3)
            assert got == b""
            writer.transport.abort()
            os.kill(os.getpid(), signal.SIGUSR2)  # -> 2 s blackhole
            for _ in range(100):
                if proxy.blackhole_remaining_s > 0:
                    break
                await asyncio.sleep(0.01)
            assert SIGNAL_BLACKHOLE_S - 0.5 < proxy.blackhole_remaining_s <= SIGNAL_BLACKHOLE_S
            os.kill(os.getpid(), signal.SIGTERM)  # -> clean stop
            counters = await asyncio.wait_for(task, 5)
            return counters

    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    counters = arun(main())
    assert {s: signal.getsignal(s) for s in previous} == previous  # handlers restored
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("acespec wan: listening on 127.0.0.1:") and "rtt=1ms" in lines[0]
    assert any("SIGUSR1: reset 1 connection" in l for l in lines)
    assert any("SIGUSR2: blackhole" in l for l in lines)
    assert lines[-1].startswith("acespec wan: stopped") and "resets=1" in lines[-1]
    assert counters.resets == 1 and counters.up_bytes == 2


def test_run_wan_cancel_and_bad_addresses():
    out = io.StringIO()

    async def main():
        async with EchoServer() as server:
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(
                run_wan(f"{HOST}:0", f"{HOST}:{server.port}", WanProfile(), on_ready=ready.set_result, out=out))
            await asyncio.wait_for(ready, 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        with pytest.raises(ValueError):
            await run_wan("nonsense", f"{HOST}:1", WanProfile(), out=out)
        with pytest.raises(ValueError):
            await run_wan(f"{HOST}:0", f"{HOST}:99999", WanProfile(), out=out)

    arun(main())
    assert "stopped" in out.getvalue().splitlines()[-1]


def test_cli_process_signals(sync_echo):
    """`acespec wan` as a real process: status line, SIGUSR1 resets, SIGTERM stops with counters."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, PYTHONUNBUFFERED="1")
    bad = subprocess.run([sys.executable, "-m", "acespec.cli", "wan", "--listen", f"{HOST}:0", "--upstream",
                          f"{HOST}:{sync_echo}", "--up", "5MB/s"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=20)
    assert bad.returncode == 2 and "invalid rate" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "acespec.cli", "wan", "--listen", f"{HOST}:0", "--upstream",
                             f"{HOST}:{sync_echo}", "--profile", "lan", "--rtt", "20"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import select

        ready, _, _ = select.select([proc.stdout], [], [], 20)  # bounded wait for the status line
        assert ready, "acespec wan printed nothing within 20 s"
        status = proc.stdout.readline()
        assert status.startswith("acespec wan: listening on 127.0.0.1:"), (status, proc.stderr.read())
        port = int(status.split("listening on 127.0.0.1:")[1].split()[0])
        with socket.create_connection((HOST, port), timeout=5) as sock:
            assert 0.019 <= min(_sync_round_trip(sock, b"hi") for _ in range(3)) <= 0.5  # the quickest: as above
            proc.send_signal(signal.SIGUSR1)
            try:
                assert sock.recv(10) == b""
            except ConnectionResetError:
                pass
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "SIGUSR1: reset 1 connection" in out
        assert out.splitlines()[-1].startswith("acespec wan: stopped") and "up_bytes=6" in out  # "hi", three times
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=5)


# -------------------------------------------------------------------------------------------------- varying link


def test_varying_profile_alternates_its_phases():
    v = PROFILES["varying"]
    assert v.varies and v.switch_s == 10 and not v.is_passthrough
    good, bad = v.at(0.0), v.at(10.0)
    assert (good.rtt_ms, good.up_bps) == (80, 5e6) and not good.varies
    assert (bad.rtt_ms, bad.up_bps) == (250, 64e3)
    assert v.at(9.99) == good and v.at(19.99) == bad and v.at(20.0) == good and v.at(35.0) == bad
    assert PROFILES["wan"].at(12.0) is PROFILES["wan"]  # a fixed profile never changes
    assert "switching every 10s with rtt=250ms" in v.describe()
    short = profile_from_args("varying", switch="500ms", rtt=60)
    assert short.switch_s == 0.5 and short.at(0).rtt_ms == 60 and short.at(0.5).rtt_ms == 250
    assert profile_from_args("varying", switch=2).switch_s == 2.0
    assert profile_from_args("varying", switch="2.5").switch_s == 2.5
    with pytest.raises(ValueError):
        profile_from_args("wan", switch=1)  # only a varying profile switches
    with pytest.raises(ValueError):
        profile_from_args("varying", switch=0)
    with pytest.raises(ValueError):
        WanProfile(switch_s=1.0)  # no alternate
    with pytest.raises(ValueError):
        WanProfile(switch_s=1.0, alternate=v)  # one level of switching


def test_emulator_switches_between_the_phases():
    """Pings through a 0.4 s varying link: their round trips follow the phase they were sent in."""
    profile = WanProfile(rtt_ms=20, switch_s=0.4, alternate=WanProfile(rtt_ms=150))

    async def main():
        async with echo_behind(WanProfile()) as (proxy, _):
            reader, writer = await connect(proxy)
            loop = asyncio.get_running_loop()
            proxy.set_profile(profile)  # the first phase starts now
            start = loop.time()
            seen = []
            while loop.time() - start < 1.6:
                t = loop.time() - start
                seen.append((t, await round_trip(reader, writer, b"p")))
            close_writer(writer)
            return seen

    seen = arun(main())
    # a ping's round trip is decided by the phase when each half was read; keep those well inside one
    inside = [(t, r) for t, r in seen if 0.03 < t % 0.4 < 0.2]
    good = [r for t, r in inside if int(t // 0.4) % 2 == 0]
    bad = [r for t, r in inside if int(t // 0.4) % 2 == 1]
    assert good and bad, seen
    assert max(good) < 0.1 and min(bad) >= 0.14, (good, bad)
