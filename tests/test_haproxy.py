"""A real load balancer in front of real replicas: HAProxy (Debian's package, installed by
scripts/setup-system.sh) in TCP mode, health-checking each `acespec serve`'s /ready, TLS end to end.

The configuration is `acespec.bench.fleet.haproxy_config`, the one docs/operate/fleet.md shows."""

from __future__ import annotations

import re
import shutil
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from acespec import wire
from acespec.bench.fleet import (SERVER_NAME, Balancer, FleetConfig, ReplicaProcess, haproxy_config, make_certificates,
                                 run_fleet)
from acespec.edge.client import CloudSession, ConnectConfig
from acespec.tls import client_context

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="HAProxy is not installed: run scripts/setup-system.sh (scripts/test.sh does)")

ROOT = Path(__file__).resolve().parents[1]
TARGET = "toy:vocab=64,seed=1"
PROMPT = (1, 2, 3)


def counters(r: ReplicaProcess) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{r.http_port}/metrics", timeout=10).read().decode()
    out = {}
    for name, labels, value in re.findall(r'^(acespec:\w+)(\{[^}]*\})? ([0-9.e+]+)$', text, re.M):
        out[name + labels] = float(value)
    return out


def hello() -> wire.Hello:
    return wire.Hello(model_id="toy:vocab=64", max_tokens=50, prompt=PROMPT, auth=b"", temperature=0.0, rule="greedy",
                      seed=0, mode=wire.Mode.SPECULATIVE)


def test_the_docs_show_the_configuration_the_tests_run():
    doc = (ROOT / "docs" / "operate" / "fleet.md").read_text()
    assert haproxy_config("0.0.0.0:7070", [("10.0.0.11", 7070, 9100), ("10.0.0.12", 7070, 9100),
                                           ("10.0.0.13", 7070, 9100)]) in doc


def test_kill_9_drain_and_return_behind_haproxy_lose_and_change_no_text():
    """`acespec bench fleet` at a small size: edges through the WAN emulator (random resets) and
    HAProxy; one replica killed with SIGKILL, one drained with SIGTERM, the killed one back."""
    res = run_fleet(FleetConfig(edges=8, generations=24, max_tokens=60, rules=("greedy", "coupled")), log=lambda s: None)
    assert res["runs"] == 48
    assert res["lost"] == 0 and res["changed"] == 0, [(o["rule"], o["lost"], o["changed"], o["errors"]) for o in res["outcomes"]]
    for o in res["outcomes"]:
        assert o["killed"] and o["drained"] and o["drain_exit"] == 0, o
        assert o["failovers"] > 0, o  # edges did move off the replicas that left


@pytest.mark.parametrize("tls", [True, False])
def test_through_the_balancer_a_resume_reaches_only_the_replica_that_issued_it(tmp_path, tls):
    """Reconnecting through HAProxy lands on either replica. With TLS the edge knows its replica by
    its certificate and sends the RESUME (and the session's secret) only to it, a new session's HELLO
    to any other: no replica is ever asked to RESUME a session it does not hold. Over plain TCP the
    edge cannot tell, and that happens; the second case shows the check has teeth."""
    certs = make_certificates(tmp_path, 2) if tls else None
    # each landing on the other replica opens a new session there (the old one waits for its RESUME):
    # room for all of them, so a full replica (its /ready 503) never takes itself out of rotation
    args = ["--target", TARGET, "--auth-failures-per-min", "0", "--max-sessions", "64"]
    replicas = [ReplicaProcess(f"r{i}", args, certs[1][i] if certs else None, tmp_path).start() for i in range(2)]
    lb = None
    try:
        lb = Balancer(replicas, tmp_path)
        time.sleep(0.6)  # the first health checks
        connect = ConnectConfig(port=lb.port, tls=client_context(certs[0]) if certs else None, tls_server_name=SERVER_NAME)
        s = CloudSession(connect, hello())
        for i in range(20):
            s.link.close()
            time.sleep(0.1)  # HAProxy sees the close: both replicas have no connection, and leastconn takes turns
            if i % 2:
                # a connection that takes one turn and says nothing: without it the turns would alternate
                # in step with the failovers, and every reconnect would land on the other replica
                socket.create_connection(("127.0.0.1", lb.port), timeout=5).close()
                time.sleep(0.1)
            s.resume(list(PROMPT))
            if s.reconnects and s.recoveries:
                break
        unknown = sum(counters(r).get('acespec:errors_total{code="UNKNOWN_SESSION"}', 0.0) for r in replicas)
        s.close(linger_s=0)
        if tls:
            assert unknown == 0
            assert s.reconnects > 0 and s.failovers > 0  # it did land on both: resumed on one, reopened on the other
        else:
            assert unknown > 0
    finally:
        if lb is not None:
            lb.stop()
        for r in replicas:
            r.stop()
