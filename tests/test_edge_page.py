"""The edge's web page in a real browser: headless Chromium (Debian's, installed by
scripts/setup-system.sh) driven through selenium loads `/`, sends a prompt, waits for the streamed
answer, and checks it against the API's text and its origin marks. The screenshot goes to
docs/screenshots/ (not committed; the Quickstart's, docs/edge-page.png, comes from the real pair, see `main`
below).

    python tests/test_edge_page.py http://127.0.0.1:8000 docs/edge-page.png "a prompt"   # any running edge
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from chromium import CHROMEDRIVER, CHROMIUM, start_chromium

ROOT = Path(__file__).resolve().parent.parent
SHOT = ROOT / "docs" / "screenshots" / "edge-page.png"


def browser():
    return start_chromium(window=(1280, 900))


def ask(driver, url: str, prompt: str, *, mode: str = "", max_tokens: int = 48, temperature: float = 0.0,
        seed: int = 0, timeout_s: float = 120.0, shot: Path | None = None) -> dict:
    """Load the page, send `prompt`, wait for the answer; returns what the page shows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "/")
    WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "model").text)  # /v1/models answered
    for field, value in (("max_tokens", max_tokens), ("temperature", temperature), ("seed", seed)):
        el = driver.find_element(By.ID, field)
        el.clear()
        el.send_keys(str(value))
    Select(driver.find_element(By.ID, "mode")).select_by_value(mode)
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()
    out = driver.find_element(By.ID, "output")
    WebDriverWait(driver, timeout_s).until(lambda d: out.get_attribute("data-state") in ("done", "error"))
    page = driver.execute_script("""
        const spans = [...document.querySelectorAll('#answer span')];
        const painted = (id) => {  // how many pixels the plot has drawn
          const c = document.getElementById(id), px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0; for (let i = 3; i < px.length; i += 4) n += px[i] > 0; return n;
        };
        return {
          state: document.getElementById('output').dataset.state,
          status: document.getElementById('status').textContent,
          text: document.getElementById('answer').textContent,
          tokens: spans.map(s => [s.textContent, s.dataset.origin, s.className]),
          painted: Object.fromEntries(['plot-tps', 'plot-rtt', 'plot-k', 'plot-acc'].map(id => [id, painted(id)])),
          resources: performance.getEntriesByType('resource').map(r => r.name),
        };
    """)
    if shot is not None:
        shot.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(shot))
    return page


@pytest.fixture(scope="module")
def chromium():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Chromium is not installed: run scripts/setup-system.sh (scripts/test.sh does)")
    d = browser()
    yield d
    d.quit()


def test_the_page_streams_the_apis_text_with_origin_marks(chromium):
    import openai
    from test_edge_api import start_edge

    from acespec.cloud.server import CloudServerThread, ServerConfig
    from acespec.models.toy import ToyModel

    prompt = "show me speculation"
    with CloudServerThread(ToyModel(vocab=64, seed=1), ServerConfig(port=0)) as cloud:
        api = start_edge(cloud.port, drafters=1)
        try:
            page = ask(chromium, api.url, prompt, mode="acespec", max_tokens=48, temperature=0.8, seed=3, shot=SHOT)
            c = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0)
            want = c.chat.completions.create(model="acespec", messages=[{"role": "user", "content": prompt}], max_tokens=48,
                                             temperature=0.8, seed=3, extra_body={"mode": "acespec"})
        finally:
            api.stop()
    assert page["state"] == "done", page["status"]
    assert page["text"] == want.choices[0].message.content
    assert "".join(t for t, _, _ in page["tokens"]) == page["text"]
    origins = [o for _, o, _ in page["tokens"]]
    assert set(origins) <= {"draft", "cache", "target"} and {"draft", "target"} <= set(origins)
    assert all(cls == f"tok tok-{o}" for _, o, cls in page["tokens"])
    passes = int(re.search(r"(\d+) target passes", page["status"]).group(1))  # the page's own run's usage
    assert origins.count("target") == passes  # one target token per verdict
    assert all(n > 500 for n in page["painted"].values()), page["painted"]  # every plot drew its line
    assert all(r.startswith(api.url) for r in page["resources"]), page["resources"]  # nothing from elsewhere
    assert f"{want.usage.completion_tokens} tokens" in page["status"]
    assert SHOT.stat().st_size > 10_000


def main(argv: list[str]) -> int:
    """Screenshot of a running edge: URL OUT PROMPT [MAX_TOKENS] (the Quickstart's picture)."""
    url, out, prompt = argv[:3]
    d = browser()
    try:
        page = ask(d, url.rstrip("/"), prompt, max_tokens=int(argv[3]) if len(argv) > 3 else 96, shot=Path(out), timeout_s=900)
    finally:
        d.quit()
    print(page["status"])
    return 0 if page["state"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
