"""The cloud as a fleet: what the HTTP port tells a load balancer (/health, /ready), and an edge that
knows several replicas and finishes its text on another one when its own drains, dies or is full.

Replicas are real `CloudServer`s (toy target, so a generation takes milliseconds) on loopback, or
real `acespec serve` processes where a test needs SIGTERM or kill -9."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from acespec import wire
from acespec.cloud.engine import make_engine
from acespec.cloud.metrics import start_metrics_server
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.cli import parse_fleet
from acespec.edge.client import CloudSession, ConnectConfig, EdgeError, Replica
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop.verifier import TargetVerifier
from acespec.models.toy import ToyModel
from acespec.verify import SamplingParams

V = 48
HOST = "127.0.0.1"
MODEL_ID = f"toy:vocab={V}"
PROMPT = [1, 2, 3, 4]
BIN = Path(sys.executable).with_name("acespec")
CMD = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "acespec.cli"]


def target() -> ToyModel:
    return ToyModel(vocab=V, seed=1)


def solo(rule: str, temperature: float, seed: int, n: int) -> list[int]:
    v = TargetVerifier(target(), PROMPT, sampling=SamplingParams(temperature), rule=rule, seed=seed, max_tokens=n)
    while not v.finished:
        v.step()
    return v.generated


def hello(max_tokens: int = 20) -> wire.Hello:
    return wire.Hello(model_id=MODEL_ID, max_tokens=max_tokens, prompt=tuple(PROMPT), auth=b"", temperature=0.0,
                      rule="greedy", seed=0, mode=wire.Mode.SPECULATIVE)


def get(url: str, method: str = "GET") -> tuple[int, dict | str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            code, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        code, body = e.code, e.read().decode()
    try:
        return code, json.loads(body)
    except ValueError:
        return code, body


def raw_http(port: int, request: bytes) -> int:
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(request)
        return int(s.recv(4096).split(b" ", 2)[1])


# ---------------------------------------------------------------------------------- /health and /ready


def test_ready_says_why_it_refuses_and_health_stays_up_while_draining():
    """/ready is 200 with room, 503 with the reason when the session cap or the KV slots are used
    up, and 503 from the moment a drain begins, while /health stays 200 as long as the loop runs."""
    engine = make_engine("batched", target(), slots=1, swap_idle_s=1000.0)  # an active session keeps its slot
    srv = CloudServerThread(engine, ServerConfig(port=0, max_sessions=2)).start()
    httpd, _ = start_metrics_server(srv.server, 0, HOST)
    base = f"http://{HOST}:{httpd.server_port}"
    try:
        assert get(base + "/health") == (200, {"status": "ok"})
        assert get(base + "/ready") == (200, {"ready": True, "reason": "ready"})
        a = CloudSession(ConnectConfig(port=srv.port), hello())
        code, body = get(base + "/ready")
        assert code == 503 and "no KV room" in body["reason"], body
        a.close(linger_s=0.5)
        deadline = time.monotonic() + 5
        while get(base + "/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(base + "/ready")[0] == 200
        assert get(base + "/metrics")[0] == 200
        # the rest of the port: a 4xx for whatever else a client sends, never a 5xx
        assert get(base + "/nope")[0] == 404
        assert get(base + "/ready", method="POST")[0] == 405
        assert raw_http(httpd.server_port, b"BREW /ready HTTP/1.1\r\nHost: x\r\n\r\n") == 405
        assert raw_http(httpd.server_port, b"GET /ready HTTP/2.0\r\n\r\n") == 400
        assert raw_http(httpd.server_port, b"\x16\x03\x01\x00\xa5garbage\r\n\r\n") == 400
        b = CloudSession(ConnectConfig(port=srv.port), hello())  # the drain below must still serve it
        import asyncio

        stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(), srv._loop)
        deadline = time.monotonic() + 10
        while not srv.server.draining and time.monotonic() < deadline:  # stop() has begun on the server's loop
            time.sleep(0.01)
        code, body = get(base + "/ready")
        assert code == 503 and body["reason"].startswith("draining"), body
        assert get(base + "/health")[0] == 200  # draining is not dead: the balancer must not kill it
        stopping.result(30)
        b.close(linger_s=0)
    finally:
        httpd.shutdown()
        srv.stop()


def test_ready_is_refused_at_the_session_cap():
    engine = make_engine("batched", target(), slots=4)
    with CloudServerThread(engine, ServerConfig(port=0, max_sessions=1)) as srv:
        httpd, _ = start_metrics_server(srv.server, 0, HOST)
        try:
            a = CloudSession(ConnectConfig(port=srv.port), hello())
            code, body = get(f"http://{HOST}:{httpd.server_port}/ready")
            assert code == 503 and body["reason"] == "at its session cap (1 of 1)", body
            a.close(linger_s=0.5)
        finally:
            httpd.shutdown()


def _serve(*extra: str) -> tuple[subprocess.Popen, int, int]:
    """`acespec serve` on a toy target; returns (process, cloud port, HTTP port)."""
    p = subprocess.Popen([*CMD, "serve", "--target", f"toy:vocab={V},seed=1", "--port", "0", "--metrics-port", "0", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert "listening on" in line, (line, p.stderr.read() if p.poll() is not None else "")
    port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    http_port = int(p.stdout.readline().split("metrics at ")[1].split()[0].split(":")[2].split("/")[0])
    return p, port, http_port


def test_sigterm_fails_ready_and_the_process_exits_cleanly():
    """A real `acespec serve`: /health and /ready answer 200. After SIGTERM, from the moment the
    process says it is draining, no /ready answer is 200 again, and it exits 0 having told its edge
    GOING_AWAY. (Between the kill and the process running its handler, a /ready answered by the HTTP
    thread can still be 200: no process can act on a signal before it has received it.)"""
    p, port, http_port = _serve()
    try:
        assert get(f"http://{HOST}:{http_port}/health")[0] == 200
        assert get(f"http://{HOST}:{http_port}/ready")[0] == 200
        s = CloudSession(ConnectConfig(port=port), hello())
        p.send_signal(signal.SIGTERM)
        line = p.stdout.readline()
        assert "SIGTERM: draining" in line, line
        answers = []
        while p.poll() is None:
            try:
                answers.append(get(f"http://{HOST}:{http_port}/ready")[0])
            except (OSError, http.client.HTTPException):  # the port closes with the process
                break
        assert 200 not in answers, answers
        assert p.wait(30) == 0
        deadline = time.monotonic() + 10
        while not s.link.going_away and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.link.going_away
    finally:
        p.kill()
        p.wait(30)


def test_sigterm_drains_and_exits_when_nobody_reads_the_servers_stdout():
    """A supervisor that read the first line and closed its end of the pipe (or `acespec serve | head`):
    SIGTERM still drains the server and it exits 0, telling its edge GOING_AWAY. Its "draining" line
    then met a broken pipe inside the signal handler, and the process ran on until it was killed."""
    p, port, _ = _serve()
    try:
        s = CloudSession(ConnectConfig(port=port), hello())
        p.stdout.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        deadline = time.monotonic() + 10
        while not s.link.going_away and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.link.going_away
        assert "BrokenPipeError" not in p.stderr.read()
    finally:
        p.kill()
        p.wait(30)


# ------------------------------------------------------------------------------------- the edge's fleet


def test_cloud_option_takes_a_fleet():
    assert parse_fleet("10.0.0.1:7070,cloud-b:7071") == [("10.0.0.1", 7070), ("cloud-b", 7071)]
    assert parse_fleet("[::1]:7070") == [("::1", 7070)]
    for bad in ("a:1,,b:2", "a:1,a:1", "a:1,b"):
        with pytest.raises(ValueError):
            parse_fleet(bad)
    # a name is expanded to every address it resolves to; one that does not resolve is kept as given
    fleet = ConnectConfig(host="127.0.0.1", port=1, replicas=(("127.0.0.1", 2), ("no-such-host.invalid", 3))).fleet()
    assert fleet == [Replica("127.0.0.1", "127.0.0.1", 1), Replica("127.0.0.1", "127.0.0.1", 2),
                     Replica("no-such-host.invalid", "no-such-host.invalid", 3)]


class Fleet:
    """Replicas on loopback, each a CloudServerThread, and the edge's ConnectConfig for all of them."""

    def __init__(self, n: int, **cfg) -> None:
        self.servers = [CloudServerThread(target(), ServerConfig(port=0, **cfg)).start() for _ in range(n)]

    def connect(self, **kw) -> ConnectConfig:
        (first, *rest) = [(HOST, s.port) for s in self.servers]
        return ConnectConfig(host=first[0], port=first[1], replicas=tuple(rest), reply_timeout_s=20.0, **kw)

    def holding(self) -> CloudServerThread:
        """The replica that holds a live session now."""
        [srv] = [s for s in self.servers if any(x.connected for x in s.server.sessions.values())]
        return srv

    def close(self) -> None:
        for s in self.servers:
            s.stop()


def edge_run(connect: ConnectConfig, rule: str, temperature: float, n: int, mode: str, at: int, act):
    """One generation through the fleet; `act()` runs once, from the edge's own thread, when `at`
    tokens are out (mid-generation, with the session live)."""
    done = []

    def on_tokens(toks):
        done.extend(toks)
        if len(done) >= at and not fired:
            fired.append(True)
            act()

    fired: list = []
    cfg = EdgeConfig(mode=mode, rule=rule, temperature=temperature, seed=5, max_tokens=n, k=3, connect=connect)
    drafter = None if mode == "cloud-only" else ToyModel(vocab=V, seed=1, noise=0.6, noise_seed=2)
    res = run_edge(drafter, PROMPT, cfg, model_id=MODEL_ID, on_tokens=on_tokens)
    assert fired, "the generation ended before the fault"
    return res


@pytest.mark.parametrize("mode", ["pipelined", "cloud-led"])
@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("coupled", 0.8)])
def test_a_draining_replica_hands_its_edge_to_another_with_the_same_text(rule, temperature, mode):
    """The replica holding the session drains mid-generation (CLOSE(GOING_AWAY)): the edge reopens on
    the other replica at once, without a RESUME to the one that is leaving, and the text is the
    text of an undisturbed run."""
    fleet = Fleet(2)
    try:
        box = {}

        def drain():
            box["home"] = srv = fleet.holding()
            threading.Thread(target=srv.stop, daemon=True).start()
            deadline = time.monotonic() + 10
            while not srv.server.draining and time.monotonic() < deadline:
                time.sleep(0.005)

        res = edge_run(fleet.connect(), rule, temperature, 300, mode, at=5, act=drain)
        assert res.tokens == solo(rule, temperature, 5, 300)
        assert res.stats.link["failovers"] == 1
        assert box["home"].server.handshakes["resumed"] == 0  # no RESUME went to the replica leaving
        [other] = [s for s in fleet.servers if s is not box["home"]]
        assert other.server.handshakes == {"opened": 1, "resumed": 0}
    finally:
        fleet.close()


def test_a_dropped_link_resumes_on_its_own_replica_and_no_other_sees_the_secret():
    """A reset with the replica alive: RESUME (which carries the secret) goes to the replica that
    issued the session and to no other, and the session continues there."""
    fleet = Fleet(3)
    try:
        def reset():
            srv = fleet.holding()
            [s] = [x for x in srv.server.sessions.values() if x.connected]
            srv._loop.call_soon_threadsafe(s.writer.transport.abort)

        res = edge_run(fleet.connect(), "coupled", 0.8, 50, "pipelined", at=10, act=reset)
        assert res.tokens == solo("coupled", 0.8, 5, 50)
        assert res.stats.link["reconnects"] == 1 and res.stats.link["failovers"] == 0
        hs = sorted((s.server.handshakes["opened"], s.server.handshakes["resumed"]) for s in fleet.servers)
        assert hs == [(0, 0), (0, 0), (1, 1)], hs
        assert all("UNKNOWN_SESSION" not in s.server.errors_sent for s in fleet.servers)
    finally:
        fleet.close()


def test_a_full_replica_sends_a_new_session_to_the_next_without_waiting():
    fleet = Fleet(2, max_sessions=1)
    try:
        full = fleet.servers[0]
        hog = CloudSession(ConnectConfig(port=full.port), hello())  # replica 0 is at its cap
        for _ in range(4):  # whichever replica it tries first
            s = CloudSession(fleet.connect(busy_retry_s=0.0), hello())
            assert s.home.port == fleet.servers[1].port and s.busy_waits == 0
            s.close(linger_s=0.5)
        hog.close(linger_s=0)
        # with every replica full, BUSY is waited out (here: not at all) and then raised with its code
        hog2 = CloudSession(ConnectConfig(port=fleet.servers[1].port), hello())
        hog3 = CloudSession(ConnectConfig(port=full.port), hello())
        with pytest.raises(EdgeError) as e:
            CloudSession(fleet.connect(busy_retry_s=0.0), hello())
        assert e.value.code == wire.ErrorCode.BUSY
        hog2.close(linger_s=0)
        hog3.close(linger_s=0)
    finally:
        fleet.close()


@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("coupled", 0.8)])
def test_kill_9_of_the_replica_mid_generation_loses_no_text(rule, temperature):
    """Two `acespec serve` processes; the one holding the session is killed with SIGKILL mid-generation.
    The edge fails over after `failover_after` refused RESUMEs and ends with an undisturbed run's text."""
    procs = [_serve() for _ in range(2)]
    try:
        ports = [p[1] for p in procs]

        def kill_home():
            for p, port, http_port in procs:
                # the one whose /ready counts a session (max_sessions is 8: it is still ready; read /metrics)
                text = get(f"http://{HOST}:{http_port}/metrics")[1]
                if 'acespec:sessions_live{state="connected"} 1.0' in text:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(10)
                    return
            raise AssertionError("no replica holds the session")

        connect = ConnectConfig(host=HOST, port=ports[0], replicas=((HOST, ports[1]),), reply_timeout_s=20.0)
        res = edge_run(connect, rule, temperature, 80, "pipelined", at=20, act=kill_home)
        assert res.tokens == solo(rule, temperature, 5, 80)
        assert res.stats.link["failovers"] == 1
    finally:
        for p, _, _ in procs:
            p.kill()
            p.wait(30)
