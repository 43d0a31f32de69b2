"""The browser edge in a real browser: headless Chromium (Debian's, installed by scripts/setup-system.sh)
driven through selenium loads the page the cloud's WebSocket port serves (`acespec serve --ws-port`),
which runs a session over `new WebSocket(url)` with the same binary frames as the TCP edge, and shows
the text as it streams. Checked against a live toy cloud on loopback:

- the streamed tokens equal what a cloud-only edge gets over TCP, in cloud-only and auto (cloud-led) mode,
  from token ids or from text the cloud tokenizes, and the shown text is the target's decoding of them;
- a connection the cloud drops mid-stream is RESUMEd by the page and the text is still exactly the same;
- a wrong token shows the cloud's BAD_AUTH.

    python tests/test_ws_page.py http://127.0.0.1:7071 docs/ws-edge-page.png 3,1,4   # any running cloud's page
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.parse
from pathlib import Path

import pytest
from paced_toy import PassCostToy

from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.models.toy import ToyModel

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
HOST = "127.0.0.1"
V = 64
MODEL_ID = f"toy:vocab={V}"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
TEMP, SEED = 0.8, 11
TOKEN = "page-key"


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
              "--window-size=1100,700", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)  # explicit paths: selenium downloads nothing


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
        WebDriverWait(driver, timeout_s).until(
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
    n = 80
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
