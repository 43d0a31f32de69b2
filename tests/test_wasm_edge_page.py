"""The browser edge with a WebAssembly drafter, in a real browser: headless Chromium (Debian's, installed
by scripts/setup-system.sh) driven through selenium loads edge-ts's page (edge-ts/web/index.html and the
bundle `npm run build:web` writes to edge-ts/dist-web/), which runs the TypeScript edge's session logic
and drafts with the default drafter's GGUF in llama.cpp compiled to WebAssembly (wllama). A small static
HTTP server on loopback serves the page, the bundle, wllama.wasm and the GGUF; the page talks to a live
`acespec serve` with the default target over its WebSocket port.

With the default pair, greedy, the page's tokens (and the text it shows) equal what a cloud-only edge
gets over TCP for the same prompt, and the drafter drafted: in sync and pipelined mode, and in cloud-led
mode against a cloud with a lead pass budget (which holds a step for the edge's draft), drafts were
verified and some accepted; in cloud-led mode against `acespec serve`'s defaults (a cloud that never
waits) drafts were sent, and whether any is accepted depends on the drafter outrunning the cloud's steps,
so it is printed, not asserted. With `coupled` at temperature 0.7 the page's text is the Python edge's
cloud-only sample for the same seed, and `?chat=1` gives the target's chat-template ids. Each run prints the browser's tok/s, time to first token, target passes per token,
acceptance, and the drafter's load, prefill and drafting times; the cloud-only reference prints its own.

The page is driven through edge-ts/scripts/browser_edge.py (its static server, Chromium, `page_run`), the
harness `bench-edges.ts --browser` runs too. edge-ts/scripts/test.sh builds the bundle and runs this file
(CI runs it after the Python suite, with the models installed); without the bundle, the models or
Chromium it skips, saying why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from chromium import browser_edge

from acespec.cli_output import prompt_tokens
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge

ROOT = Path(__file__).resolve().parents[1]
# the harness that drives the page: the same one `bench-edges.ts --browser` runs
page_run = browser_edge.page_run
HOST = browser_edge.HOST
PROMPT = "Write a Python function that returns the n-th Fibonacci number."
N = 24  # tokens: a short run, as the target takes most of the time on two cores


def _models() -> tuple[Path, Path]:
    from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, installed_path

    draft, target = installed_path(DEFAULT_DRAFT), installed_path(DEFAULT_TARGET)
    if draft is None or target is None:
        pytest.skip("the default model pair is not installed: run `acespec models install`")
    return Path(draft), Path(target)


@pytest.fixture(scope="module")
def chromium():
    pytest.importorskip("selenium")
    if not (os.path.exists(browser_edge.CHROMIUM) and os.path.exists(browser_edge.CHROMEDRIVER)):
        pytest.skip("Chromium is not installed: run scripts/setup-system.sh (scripts/test.sh does)")
    missing = [name for name in browser_edge.BUNDLE if not (browser_edge.WEB / name).is_file()]
    if missing:
        pytest.skip(
            f"the browser edge is not built ({', '.join(missing)} missing in {browser_edge.WEB}): "
            "run `npm ci --ignore-scripts && npm run build:web` in edge-ts (edge-ts/scripts/test.sh does)"
        )
    d = browser_edge.chromium()
    yield d
    d.quit()


@pytest.fixture(scope="module")
def site():
    draft, _ = _models()
    with browser_edge.Site(draft) as s:
        yield s.url


def _serve(config: ServerConfig):
    from acespec.models.llama import LlamaCppModel
    from acespec.models.registry import DEFAULT_TARGET

    _, target_path = _models()
    # one thread for the target: the page's drafter computes on the other core
    target = LlamaCppModel(target_path, n_ctx=1024, n_threads=1, name=DEFAULT_TARGET)
    try:
        with CloudServerThread(target, config) as srv:
            yield srv
    finally:
        target.close()


@pytest.fixture(scope="module")
def cloud():
    """`acespec serve`'s defaults: a cloud-led step never waits for a draft."""
    yield from _serve(ServerConfig(port=0, ws_port=0))


@pytest.fixture(scope="module")
def budget_cloud():
    """A cloud with a lead pass budget (`--lead-pass-budget 0.5 --lead-max-wait 2`): a cloud-led step that
    would take the session past half a target pass per token waits up to 2 s for the edge's draft. That
    is how a cloud serves edges whose drafter is slower than its own steps, as a WebAssembly drafter on
    a busy machine is."""
    yield from _serve(ServerConfig(port=0, ws_port=0, lead_pass_budget=0.5, lead_max_wait_s=2.0))


@pytest.fixture(scope="module")
def reference(cloud):
    """The prompt's ids, and what a cloud-only edge gets over TCP for them, greedy, `n` tokens."""
    tok = cloud.server.target.tokenizer
    prompt = prompt_tokens(tok, PROMPT, True)
    runs: dict[int, list[int]] = {}

    def get(n: int) -> tuple[list[int], list[int]]:
        if n not in runs:
            cfg = EdgeConfig(
                mode="cloud-only",
                rule="greedy",
                temperature=0.0,
                max_tokens=n,
                connect=ConnectConfig(host=HOST, port=cloud.port, reply_timeout_s=120.0),
            )
            res = run_edge(None, prompt, cfg, model_id=tok.fingerprint)
            runs[n] = list(res.tokens)
            assert len(runs[n]) == n
            print(
                f"\ncloud-only over TCP (the Python edge, the same cloud, {n} tokens): "
                f"{res.stats.tokens_per_s:.3f} tok/s, TTFT {res.stats.ttft_s:.3f} s"
            )
        return prompt, runs[n]

    return get


def _check(page: dict, site: str, cloud, mode: str, n: int, want: list[int]) -> dict:
    """The page ended well, wrote cloud-only's tokens and text, and drafted; prints its figures."""
    assert page["state"] == "done", page["status"]
    r = page["result"]
    print(
        f"\nbrowser edge ({mode}, WebAssembly drafter, {n} tokens): {r['tok_s']} tok/s, "
        f"TTFT {r['ttft_s']} s, {r['passes_per_token']} target passes/token, acceptance {r['acceptance']} "
        f"({r['accepted']} of {r['drafted']} drafted), drafter load {r['load_s']} s, prefill {r['prefill_s']} s, "
        f"{r['stats']['draft_tokens']} tokens drafted in {r['stats']['draft_s']} s"
    )
    assert r["model_id"] == cloud.server.target.tokenizer.fingerprint  # computed in the browser from the GGUF
    assert r["tokens"] == want, (r["tokens"], want)
    text = cloud.server.target.tokenizer.decode(want)
    assert r["text"] == text and page["shown"] == text  # the text shown, as the cloud's tokenizer writes it
    assert r["stats"]["draft_tokens"] > 0, r["stats"]  # the WebAssembly drafter drafted
    assert all(x.startswith(site) for x in page["resources"]), page["resources"]  # nothing from elsewhere
    return r


def _accepted(r: dict, n: int) -> None:
    assert r["drafted"] > 0 and r["accepted"] > 0, json.dumps({k: v for k, v in r.items() if k != "tokens"})
    assert r["target_passes"] < n, r  # accepted drafts saved target passes


def _run(chromium, site: str, cloud, mode: str, prompt: list[int], n: int) -> dict:
    # prefill=first: the drafter reads the prompt before the session opens (a WebAssembly drafter's
    # prefill on a shared two-core machine can take longer than a short answer streams, so beside the
    # stream it would join after the end); the figures give its cost apart from the session's
    return page_run(
        chromium,
        site,
        ws=f"ws://{HOST}:{cloud.server.ws_port}/",
        gguf="/drafter.gguf",
        prompt=",".join(map(str, prompt)),
        mode=mode,
        max_tokens=n,
        prefill="first",
    )


def test_sync_in_the_browser_writes_cloud_onlys_text_with_drafts_accepted(chromium, site, cloud, reference):
    prompt, want = reference(N)
    r = _check(_run(chromium, site, cloud, "sync", prompt, N), site, cloud, "sync, greedy", N, want)
    _accepted(r, N)


def test_pipelined_in_the_browser_writes_cloud_onlys_text_with_drafts_accepted(chromium, site, cloud, reference):
    prompt, want = reference(N)
    r = _check(_run(chromium, site, cloud, "pipelined", prompt, N), site, cloud, "pipelined, greedy", N, want)
    _accepted(r, N)


def test_cloud_led_in_the_browser_writes_cloud_onlys_text_with_drafts_accepted(
    chromium, site, cloud, budget_cloud, reference
):
    """Against a cloud with a lead pass budget, which holds a step for the page's draft."""
    prompt, want = reference(N)
    r = _check(_run(chromium, site, budget_cloud, "cloud-led", prompt, N), site, budget_cloud, "cloud-led, greedy", N, want)
    assert r["stats"]["drafts_sent"] > 0, r["stats"]
    _accepted(r, N)


def test_cloud_led_in_the_browser_against_a_cloud_that_never_waits(chromium, site, cloud, reference):
    """`acespec serve`'s defaults: the cloud streams without waiting, and the page's drafts count only
    where the drafter gets ahead of the stream, so acceptance depends on the drafter's speed against
    the cloud's; the text is cloud-only's whatever it is, and the figures are printed."""
    prompt, want = reference(N)
    page = _run(chromium, site, cloud, "cloud-led", prompt, N)
    r = _check(page, site, cloud, "cloud-led, greedy, no lead budget", N, want)
    assert r["stats"]["drafts_sent"] > 0, r["stats"]


def test_coupled_sampling_in_the_browser_writes_the_text_the_cloud_samples_for_the_seed(chromium, site, cloud, reference):
    """rule=coupled at temperature 0.7, seed 7: the page's drafter picks with the cloud's noise (its q from
    wllama's whole softmax row), and the text is the one the Python edge's cloud-only run samples."""
    prompt, _ = reference(N)
    cfg = EdgeConfig(
        mode="cloud-only",
        rule="coupled",
        temperature=0.7,
        seed=7,
        max_tokens=N,
        connect=ConnectConfig(host=HOST, port=cloud.port, reply_timeout_s=120.0),
    )
    want = list(run_edge(None, prompt, cfg, model_id=cloud.server.target.tokenizer.fingerprint).tokens)
    page = page_run(
        chromium,
        site,
        ws=f"ws://{HOST}:{cloud.server.ws_port}/",
        gguf="/drafter.gguf",
        prompt=",".join(map(str, prompt)),
        mode="sync",
        max_tokens=N,
        prefill="first",
        rule="coupled",
        temperature="0.7",
        seed="7",
    )
    r = _check(page, site, cloud, "sync, coupled T=0.7", N, want)
    assert r["rule"] == "coupled", r
    _accepted(r, N)


def test_the_pages_tokenizer_splits_text_as_the_clouds_does_and_chat_1_takes_the_targets_template(
    chromium, site, cloud
):
    """?text= is split by wllama's tokenizer on the drafter's GGUF: the same ids as the cloud's tokenizer
    (the Python edge's), for plain, spaced, accented, CJK and emoji text and a special token's name. With
    ?chat=1 the text is one user turn in the target's chat template, as the edge's API renders a chat."""
    tok = cloud.server.target.tokenizer
    for text in (PROMPT, "  two  spaces\tand a tab\n", "héllo wörld ✓ 你好 🙂", "<|im_end|> is text here"):
        page = page_run(
            chromium,
            site,
            ws=f"ws://{HOST}:{cloud.server.ws_port}/",
            gguf="/drafter.gguf",
            text=text,
            mode="cloud-only",
            max_tokens=2,
        )
        assert page["state"] == "done", page["status"]
        assert page["result"]["prompt"] == tok.encode(text), text
    page = page_run(
        chromium,
        site,
        ws=f"ws://{HOST}:{cloud.server.ws_port}/",
        gguf="/drafter.gguf",
        text=PROMPT,
        chat="1",
        mode="cloud-only",
        max_tokens=2,
    )
    assert page["state"] == "done", page["status"]
    chat = tok.chat_prompt([{"role": "user", "content": PROMPT}])
    assert page["result"]["prompt"] == chat and chat != tok.encode(PROMPT)
