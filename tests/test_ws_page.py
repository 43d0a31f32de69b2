"""The browser edge in a real browser: headless Chromium (Debian's, installed by scripts/setup-system.sh)
driven through selenium loads the page the cloud's WebSocket port serves (`acespec serve --ws-port`),
which runs a session over `new WebSocket(url)` with the same binary frames as the TCP edge, and shows
the text as it streams. Checked against a live toy cloud on loopback:

- the streamed tokens equal what a cloud-only edge gets over TCP, in cloud-only and auto (cloud-led) mode,
  from token ids or from text the cloud tokenizes, and the shown text is the target's decoding of them;
- a connection the cloud drops mid-stream is RESUMEd by the page, and a session the cloud lost is reopened
  carrying the text so far; either way the text is still exactly the same;
- a wrong token shows the cloud's BAD_AUTH;
- the page's codec (ws-edge.js) writes frames byte for byte as acespec.wire does and reads what it writes.

    python tests/test_ws_page.py http://127.0.0.1:7071 docs/ws-edge-page.png 3,1,4   # any running cloud's page
"""

from __future__ import annotations

import json
import os
import sys
import urllib.parse
from pathlib import Path

import pytest
from chromium import CHROMEDRIVER, CHROMIUM, start_chromium
from paced_toy import PassCostToy

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.models.toy import ToyModel

HOST = "127.0.0.1"
V = 64
MODEL_ID = f"toy:vocab={V}"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
TEMP, SEED = 0.8, 11
TOKEN = "page-key"


def browser():
    return start_chromium()


@pytest.fixture(scope="module")
def chromium():
    pytest.importorskip("selenium")
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Chromium is not installed: run scripts/setup-system.sh (scripts/test.sh does)")
    d = browser()
    yield d
    d.quit()


def page_run(driver, base: str, *, timeout_s: float = 30.0, during=None, shot: Path | None = None, **params) -> dict:
    """Open the page with `params` in its query (it starts at once), wait for the end; what it shows.
    `during(driver)`, if given, runs once the first tokens are on the page."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/?{urllib.parse.urlencode({**params, 'run': '1'})}")
    state = lambda d: d.execute_script("return document.getElementById('output').dataset.state")  # noqa: E731
    if during is not None:
        WebDriverWait(driver, timeout_s, poll_frequency=0.02).until(
            lambda d: d.execute_script("return (document.getElementById('output').dataset.tokens || '[]').length > 10"))
        during(driver)
    WebDriverWait(driver, timeout_s).until(lambda d: state(d) in ("done", "error"))
    page = driver.execute_script("""
        const out = document.getElementById('output');
        return {state: out.dataset.state, error: out.dataset.error || null, text: out.textContent,
                tokens: JSON.parse(out.dataset.tokens || '[]'), status: document.getElementById('status').textContent,
                resources: performance.getEntriesByType('resource').map(r => r.name)};
    """)
    if shot is not None:
        shot.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(shot))
    return page


def tcp_cloud_only(port: int, prompt: list[int], n: int, token: str = TOKEN) -> list[int]:
    cfg = EdgeConfig(mode="cloud-only", rule="coupled", temperature=TEMP, seed=SEED, max_tokens=n,
                     connect=ConnectConfig(host=HOST, port=port, token=token.encode(), reply_timeout_s=10.0))
    return list(run_edge(None, prompt, cfg, model_id=MODEL_ID).tokens)


def _params(n: int, **kw) -> dict:
    return dict(max_tokens=n, temperature=TEMP, seed=SEED, rule="coupled", token=TOKEN, **kw)


@pytest.fixture(scope="module")
def cloud():
    cfg = ServerConfig(port=0, ws_port=0, token=TOKEN.encode(), auth_failures_per_min=0)
    with CloudServerThread(ToyModel(vocab=V, seed=1), cfg) as srv:
        yield srv


@pytest.mark.parametrize("mode", ["cloud-only", "auto"])
def test_the_page_streams_over_websocket_the_tokens_cloud_only_gets_over_tcp(chromium, cloud, mode, tmp_path):
    n = 40
    base = f"http://{HOST}:{cloud.server.ws_port}"
    page = page_run(chromium, base, prompt_ids=",".join(map(str, PROMPT)), mode=mode, shot=tmp_path / "page.png",
                    **_params(n))
    assert page["state"] == "done", page["status"]
    want = tcp_cloud_only(cloud.port, PROMPT, n)
    assert page["tokens"] == want and len(want) == n
    assert page["text"] == cloud.server.target.tokenizer.decode(want)  # the text shown, from the cloud's tokenizer
    assert f"{n} tokens" in page["status"] and "done" in page["status"]
    assert all(r.startswith(base) for r in page["resources"]), page["resources"]  # nothing from elsewhere
    assert (tmp_path / "page.png").stat().st_size > 5_000


def test_the_page_sends_text_the_cloud_tokenizes(chromium, cloud):
    n, text = 24, "hello, browser"
    page = page_run(chromium, f"http://{HOST}:{cloud.server.ws_port}", prompt=text, mode="cloud-only", **_params(n))
    assert page["state"] == "done", page["status"]
    assert page["tokens"] == tcp_cloud_only(cloud.port, cloud.server.target.tokenizer.encode(text), n)


def test_the_page_shows_a_refused_token_as_the_clouds_bad_auth(chromium, cloud):
    page = page_run(chromium, f"http://{HOST}:{cloud.server.ws_port}", prompt_ids="1,2,3", mode="cloud-only",
                    **{**_params(8), "token": "wrong"})
    assert page["state"] == "error" and page["error"] == "BAD_AUTH", page
    assert "authentication failed" in page["status"]


def test_the_page_resumes_a_connection_the_cloud_dropped_and_streams_the_same_text(chromium):
    """Mid-stream the cloud aborts the page's connection (as a dead path would): the page reconnects,
    RESUMEs with its committed tokens' digest (computed in the browser) and gets the rest, no token lost
    or repeated."""
    n = 150  # 10 ms a step: the stream lasts long enough to be cut in the middle
    cfg = ServerConfig(port=0, ws_port=0, token=TOKEN.encode(), resume_grace_s=30.0)
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.01), cfg) as srv:
        def drop(_driver) -> None:
            def abort() -> None:
                for s in srv.server.sessions.values():
                    if s.writer is not None:
                        s.writer.transport.abort()
            srv._loop.call_soon_threadsafe(abort)

        page = page_run(chromium, f"http://{HOST}:{srv.server.ws_port}", prompt_ids=",".join(map(str, PROMPT)),
                        mode="cloud-only", during=drop, **_params(n))
        assert page["state"] == "done", page["status"]
        assert "resumed 1x" in page["status"], page["status"]
        assert srv.server.handshakes["resumed"] == 1
        assert page["tokens"] == tcp_cloud_only(srv.port, PROMPT, n)


def test_the_page_reopens_a_session_the_cloud_lost_carrying_its_text(chromium):
    """The cloud drops the connection and forgets the session (as a restarted replica would): the page's
    RESUME gets UNKNOWN_SESSION, so it opens a new session whose prompt is the text so far and whose
    budget is what is left, and the whole text is still what cloud-only decodes."""
    n = 150
    cfg = ServerConfig(port=0, ws_port=0, token=TOKEN.encode())
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.01), cfg) as srv:
        def lose(_driver) -> None:
            def forget() -> None:
                for s in list(srv.server.sessions.values()):
                    srv.server._end(s)
                    if s.writer is not None:
                        s.writer.transport.abort()
            srv._loop.call_soon_threadsafe(forget)

        page = page_run(chromium, f"http://{HOST}:{srv.server.ws_port}", prompt_ids=",".join(map(str, PROMPT)),
                        mode="auto", during=lose, **_params(n))
        assert page["state"] == "done", page["status"]
        assert "reopened 1x" in page["status"] and srv.server.handshakes == {"opened": 2, "resumed": 0}, page["status"]
        assert page["tokens"] == tcp_cloud_only(srv.port, PROMPT, n)


def test_the_pages_codec_encodes_and_decodes_frames_byte_for_byte_as_the_python_codec(chromium, cloud):
    """What the browser's module writes is what acespec.wire writes, and it reads what acespec.wire
    writes; a message that is not one frame, or a frame not for an edge, is a WireError."""
    chromium.get(f"http://{HOST}:{cloud.server.ws_port}/")
    committed = PROMPT + [1, 2]
    out = chromium.execute_async_script("""
        const [frames, committed, done] = arguments;
        import('/ws-edge.js').then(async (m) => {
          const arr = (u8) => Array.from(u8);
          const show = (f) => JSON.parse(JSON.stringify(f, (k, v) => typeof v === 'bigint' ? v.toString()
                                                                   : v instanceof Uint8Array ? Array.from(v) : v));
          const digest = await m.committedDigest(committed);
          const refused = frames.bad.map((b) => {
            try { m.decodeFrame(Uint8Array.from(b)); return null; }
            catch (e) { return e instanceof m.WireError ? e.code : String(e); }
          });
          done({
            hello: arr(m.encodeHello({auth: 'k', modelId: 'toy:vocab=64', temperature: 0.8, topK: 5, topP: 0.9,
                                      rule: 'coupled', seed: BigInt('9223372036854775813'), mode: m.Mode.CLOUD_LED,
                                      maxTokens: 40, prompt: committed.slice(0, 8)})),
            resume: arr(m.encodeResume({auth: 'k', session: 123456, secret: Uint8Array.from({length: 32}, (_, i) => i),
                                        committed: committed.length, digest})),
            ping: arr(m.encodePing(BigInt('18446744073709551615'), 12345n)),
            pong: arr(m.encodePong(7n, 8n)),
            close: arr(m.encodeClose(m.CloseReason.GOING_AWAY)),
            decoded: frames.good.map((b) => show(m.decodeFrame(Uint8Array.from(b)))),
            refused,
          });
        }).catch((e) => done({error: String(e)}));
    """, {"good": [list(wire.encode(f)) for f in _GOOD], "bad": [list(b) for b in _BAD]}, committed)
    assert "error" not in out, out
    assert bytes(out["hello"]) == wire.encode(wire.Hello(
        auth=b"k", model_id="toy:vocab=64", temperature=0.8, top_k=5, top_p=0.9, rule="coupled", seed=2**63 + 5,
        mode=wire.Mode.CLOUD_LED, max_tokens=40, prompt=tuple(PROMPT)))
    assert bytes(out["resume"]) == wire.encode(wire.Resume(
        auth=b"k", session=123456, secret=bytes(range(32)), committed=len(committed),
        digest=wire.committed_digest(committed)))  # the browser's SHA-256 too
    assert bytes(out["ping"]) == wire.encode(wire.Ping(nonce=2**64 - 1, sent_us=12345))
    assert bytes(out["pong"]) == wire.encode(wire.Pong(nonce=7, sent_us=8))
    assert bytes(out["close"]) == wire.encode(wire.Close(reason=wire.CloseReason.GOING_AWAY))
    assert out["decoded"] == [
        {"type": "WELCOME", "session": 2**20 + 3, "committed": 9, "maxDraftTokens": 64, "secret": [1] * 32},
        {"type": "TOKENS", "start": 8, "tokens": [1, 300, 70000], "finished": True, "drafted": 4, "accepted": 2,
         "verifyUs": 1234},
        {"type": "TOKENS", "start": 8, "tokens": [], "finished": False, "drafted": None, "accepted": 0, "verifyUs": 0},
        {"type": "ERROR", "code": "BAD_AUTH", "message": "authentication failed: é"},
        {"type": "CLOSE", "reason": 3},
        {"type": "PING", "nonce": "7", "sentUs": str(2**40)},
    ]
    assert out["refused"] == ["BAD_FRAME"] * len(_BAD)


_GOOD = [
    wire.Welcome(session=2**20 + 3, committed=9, max_draft_tokens=64, secret=b"\x01" * 32),
    wire.Tokens(start=8, tokens=(1, 300, 70000), finished=True, drafted=4, accepted=2, verify_us=1234),
    wire.Tokens(start=8, tokens=()),
    wire.Error(code=wire.ErrorCode.BAD_AUTH, message="authentication failed: é"),
    wire.Close(reason=wire.CloseReason.IDLE),
    wire.Ping(nonce=7, sent_us=2**40),
]
_BAD = [
    wire.encode(wire.Close()) + wire.encode(wire.Close()),  # two frames in one message
    wire.encode(wire.Close())[:-1],  # part of one
    bytes([3, wire.FrameType.TOKENS, 8, 0]),  # TOKENS cut short
    wire.encode(wire.Tokens(start=1, tokens=()))[:-1] + bytes([0x04]),  # a reserved TOKENS flag bit
    wire.encode(wire.Verdict(seq=0, accepted=0, next_token=0, verify_us=0, committed=0)),  # not for an edge
]


def main(argv: list[str]) -> int:
    """A screenshot of a running cloud's page: BASE_URL OUT PROMPT_IDS [MAX_TOKENS]."""
    base, out, ids = argv[:3]
    d = browser()
    try:
        page = page_run(d, base.rstrip("/"), prompt_ids=ids, max_tokens=int(argv[3]) if len(argv) > 3 else 64,
                        shot=Path(out), timeout_s=600)
    finally:
        d.quit()
    print(json.dumps({k: page[k] for k in ("state", "status")}))
    return 0 if page["state"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
