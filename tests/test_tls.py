"""TLS on the edge-cloud link, over real sockets on 127.0.0.1, with certificates made here (trustme).

- an edge that trusts the cloud's CA runs a generation over TLS and gets the reference text, through
  the WAN emulator too (it relays TLS records as bytes) and across a forced reconnect;
- with TLS on, the server speaks nothing else: a plaintext HELLO gets no WELCOME;
- an edge that does not trust the cloud's certificate fails at once with a typed error;
- with a client CA, an edge without a client certificate is refused and one with it is served.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

trustme = pytest.importorskip("trustme")

from acespec import wire  # noqa: E402
from acespec.cloud.server import CloudServerThread, ServerConfig  # noqa: E402
from acespec.edge.client import ConnectConfig, EdgeError  # noqa: E402
from acespec.edge.runtime import EdgeConfig, run_edge  # noqa: E402
from acespec.loop import SpecConfig, generate  # noqa: E402
from acespec.models.toy import ToyModel  # noqa: E402
from acespec.net import WanProfile, WanProxyThread  # noqa: E402
from acespec.tls import client_context, server_context  # noqa: E402

HOST = "127.0.0.1"
V = 64
MODEL_ID = f"toy:vocab={V}"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
SEED = 5
TEMP = 0.8
N = 30


def reference(n: int = N) -> list[int]:
    cfg = SpecConfig(rule="coupled", temperature=TEMP, seed=SEED, max_tokens=n, spec=False)
    return generate(ToyModel(vocab=V, seed=1), PROMPT, cfg).tokens


def edge_cfg(port: int, tls: ssl.SSLContext | None, **kw) -> EdgeConfig:
    connect = dict(host=HOST, port=port, tls=tls, reconnect_attempts=2, backoff_s=0.01, reply_timeout_s=10.0)
    connect.update(kw)
    return EdgeConfig(mode="pipelined", rule="coupled", k=3, temperature=TEMP, seed=SEED, max_tokens=N,
                      connect=ConnectConfig(**connect))


def drafter() -> ToyModel:
    return ToyModel(vocab=V, seed=1, noise=0.7, noise_seed=3)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("edge-1@example.org")
    other_ca = trustme.CA()
    paths = {}
    for name, blob in [("ca", ca.cert_pem), ("other_ca", other_ca.cert_pem), ("server_key", server.private_key_pem),
                       ("client_key", client.private_key_pem)]:
        paths[name] = str(d / f"{name}.pem")
        blob.write_to_path(paths[name])
    for name, cert in [("server_cert", server), ("client_cert", client)]:
        paths[name] = str(d / f"{name}.pem")
        with open(paths[name], "wb") as f:
            for blob in cert.cert_chain_pems:
                f.write(blob.bytes())
    return paths


@pytest.fixture(scope="module")
def tls_cloud(pki):
    ctx = server_context(pki["server_cert"], pki["server_key"])
    with CloudServerThread(ToyModel(vocab=V, seed=1), ServerConfig(port=0, tls=ctx, handshake_timeout_s=2.0)) as srv:
        yield srv


def test_an_edge_that_trusts_the_cloud_runs_over_tls(tls_cloud, pki):
    res = run_edge(drafter(), PROMPT, edge_cfg(tls_cloud.port, client_context(pki["ca"])), model_id=MODEL_ID)
    assert res.tokens == reference()
    assert res.stats.link["reconnects"] == 0


def test_tls_through_the_wan_emulator_with_forced_resets(tls_cloud, pki):
    """The emulator relays TLS records as bytes; resets mid-run reconnect (a new TLS handshake, then
    RESUME with the session's secret) and change nothing."""
    with WanProxyThread(HOST, 0, HOST, tls_cloud.port, WanProfile(rtt_ms=20, seed=3)) as proxy:
        cfg = edge_cfg(proxy.port, client_context(pki["ca"]), tls_server_name="127.0.0.1", reconnect_attempts=8)
        cfg.max_tokens = 60
        streamed: list[int] = []
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("res", run_edge(drafter(), PROMPT, cfg, model_id=MODEL_ID,
                                                                           on_tokens=streamed.extend)), daemon=True)
        t.start()
        resets = 0
        deadline = time.monotonic() + 30
        while t.is_alive() and resets < 2 and time.monotonic() < deadline:
            if len(streamed) >= 10 * (resets + 1):
                resets += proxy.reset_connections() > 0
            time.sleep(0.005)
        t.join(30)
        assert not t.is_alive()
    res = out["res"]
    assert res.tokens == reference(60) and streamed == res.tokens
    assert res.stats.link["reconnects"] >= 1


def test_the_tls_server_refuses_plaintext(tls_cloud):
    s = socket.create_connection((HOST, tls_cloud.port), timeout=5)
    s.sendall(wire.encode(wire.Hello(model_id=MODEL_ID, max_tokens=5, prompt=PROMPT)))
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    s.close()
    frames = []
    try:
        frames = wire.FrameDecoder().feed(data)
    except wire.WireError:
        pass
    assert not any(isinstance(f, wire.Welcome) for f in frames), frames
    assert not tls_cloud.server.sessions


def test_an_edge_that_does_not_trust_the_certificate_fails_at_once(tls_cloud, pki):
    with pytest.raises(EdgeError) as e:
        run_edge(drafter(), PROMPT, edge_cfg(tls_cloud.port, client_context(pki["other_ca"]), reconnect_attempts=8),
                 model_id=MODEL_ID)
    assert "certificate" in str(e.value)
    # a plaintext edge gets nowhere either
    with pytest.raises(EdgeError):
        run_edge(drafter(), PROMPT, edge_cfg(tls_cloud.port, None), model_id=MODEL_ID)


def test_client_certificates_when_the_cloud_asks_for_them(pki):
    ctx = server_context(pki["server_cert"], pki["server_key"], client_ca=pki["ca"])
    with CloudServerThread(ToyModel(vocab=V, seed=1), ServerConfig(port=0, tls=ctx, handshake_timeout_s=2.0)) as srv:
        with pytest.raises(EdgeError):
            run_edge(drafter(), PROMPT, edge_cfg(srv.port, client_context(pki["ca"])), model_id=MODEL_ID)
        assert not srv.server.sessions
        with_cert = client_context(pki["ca"], pki["client_cert"], pki["client_key"])
        res = run_edge(drafter(), PROMPT, edge_cfg(srv.port, with_cert), model_id=MODEL_ID)
        assert res.tokens == reference()
