"""Run the browser edge once, in headless Chromium, and print its result as one JSON object.

    python edge-ts/scripts/browser_edge.py --ws ws://127.0.0.1:7071/ --gguf DRAFTER.gguf \
        (--text TEXT [--chat] | --prompt 1,2,3) [--mode cloud-led|sync|pipelined|cloud-only] [--max-tokens N] \
        [--rule greedy|coupled --temperature T --seed S] [--prefill first]

A static HTTP server on loopback serves the page (edge-ts/dist-web: `npm run build:web` writes it) and
the drafter's GGUF; Chromium (Debian's, with its chromedriver, driven through selenium: the `test` profile
installs it, scripts/setup-system.sh the browser) opens the page with the run's query, and the page runs
the TypeScript edge against the cloud's WebSocket port (`acespec serve --ws-port`). What it prints is the
page's result: `text`, `tokens`, `drafted`, `accepted`, `target_passes`, `tok_s`, `ttft_s`,
`passes_per_token`, `acceptance`, `load_s`, `prefill_s` and `stats`, the fields edge-ts/src/stats.ts names.

`bench-edges.ts --browser` runs it beside the Python and Node edges; tests/test_wasm_edge_page.py drives
the page through the same `Site`, `chromium` and `page_run`.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import shutil
import sys
import threading
import urllib.parse
from pathlib import Path

WEB = Path(__file__).resolve().parents[1] / "dist-web"
BUNDLE = ("index.html", "edge.js", "wllama.wasm")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
HOST = "127.0.0.1"
PAGE_TIMEOUT_S = 600.0  # loading the GGUF into WebAssembly and generating, on a busy two-core machine


class _Static(http.server.SimpleHTTPRequestHandler):
    """The page's files from edge-ts/dist-web, and the drafter's GGUF at /drafter.gguf."""

    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".wasm": "application/wasm",
        ".js": "text/javascript",
        ".gguf": "application/octet-stream",
    }
    gguf: Path

    def translate_path(self, path: str) -> str:
        if urllib.parse.urlsplit(path).path == "/drafter.gguf":
            return str(self.gguf)
        return super().translate_path(path)

    def log_message(self, format, *args) -> None:  # noqa: A002  (the base class's name)
        pass


class Site:
    """The page and the GGUF on a loopback port, for as long as the `with` lasts; `url` is its root."""

    def __init__(self, gguf: Path, web: Path = WEB) -> None:
        missing = [name for name in BUNDLE if not (web / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"the browser edge is not built ({', '.join(missing)} missing in {web}): "
                "run `npm ci --ignore-scripts && npm run build:web` in edge-ts"
            )
        handler = type("Static", (_Static,), {"gguf": Path(gguf)})
        self._srv = http.server.ThreadingHTTPServer((HOST, 0), functools.partial(handler, directory=str(web)))
        self.url = f"http://{HOST}:{self._srv.server_address[1]}"

    def __enter__(self) -> Site:
        threading.Thread(target=self._srv.serve_forever, daemon=True, name="browser-edge-site").start()
        return self

    def __exit__(self, *exc) -> None:
        self._srv.shutdown()
        self._srv.server_close()


def chromium(window: tuple[int, int] = (1100, 700)):
    """Headless Chromium through its chromedriver, at explicit paths: selenium downloads nothing. Every
    browser test starts it here too (tests/chromium.py), so a page's screenshot has the size it asks for."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
              f"--window-size={window[0]},{window[1]}", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(30)
    return driver


def page_run(driver, site: str, **params) -> dict:
    """Open the page with `params` in its query (`run=1` starts it) and wait for its end: its state, error,
    the text it shows, its result and the resources it loaded."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{site}/index.html?{urllib.parse.urlencode({**params, 'run': '1'})}")
    state = lambda d: d.execute_script("return document.getElementById('output').dataset.state")  # noqa: E731
    WebDriverWait(driver, PAGE_TIMEOUT_S, poll_frequency=0.5).until(lambda d: state(d) in ("done", "error"))
    return driver.execute_script("""
        const out = document.getElementById('output');
        return {state: out.dataset.state, error: out.dataset.error || null, shown: out.textContent,
                result: out.dataset.result ? JSON.parse(out.dataset.result) : null,
                status: document.getElementById('status').textContent,
                resources: performance.getEntriesByType('resource').map(r => r.name)};
    """)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ws", required=True, help="the cloud's WebSocket URL (acespec serve --ws-port)")
    ap.add_argument("--gguf", required=True, help="the drafter's GGUF file")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the prompt as text, split by the drafter's tokenizer")
    src.add_argument("--prompt", help="the prompt as token ids, comma-separated")
    ap.add_argument("--chat", action="store_true", help="--text is one user turn in the target's chat template")
    ap.add_argument("--mode", default="cloud-led", choices=("cloud-led", "sync", "pipelined", "cloud-only"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rule", default="greedy", choices=("greedy", "coupled"))
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--prefill", default="beside", choices=("beside", "first"),
                    help="first: the drafter reads the prompt before the session opens (its time is prefill_s)")
    args = ap.parse_args(argv)
    params = {"ws": args.ws, "gguf": "/drafter.gguf", "mode": args.mode, "max_tokens": args.max_tokens,
              "rule": args.rule, "temperature": args.temperature, "seed": args.seed, "prefill": args.prefill}
    params.update({"text": args.text, "chat": "1" if args.chat else "0"} if args.text is not None
                  else {"prompt": args.prompt})
    try:
        with Site(Path(args.gguf)) as site:
            driver = chromium()
            try:
                page = page_run(driver, site.url, **params)
            finally:
                driver.quit()
    except (OSError, ImportError) as e:
        print(f"browser_edge: {e}", file=sys.stderr)
        return 2
    if page["state"] != "done":
        print(f"browser_edge: the page ended in {page['state']}: {page['error'] or page['status']}", file=sys.stderr)
        return 1
    print(json.dumps(page["result"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
