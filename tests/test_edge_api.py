"""The edge's OpenAI-compatible API, driven by the official `openai` client over loopback.

A real cloud (`CloudServerThread`, the batched engine) verifies for a real edge API (uvicorn on a
free port); the models are the exact toy models, so the reference text is known: `acespec generate`
(the CLI, once per case) and the in-process `generate()` it runs. The one real-pair test checks the
same on the default GGUF pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.api import EdgeApiThread, EdgeService
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig
from acespec.edge.service import ServeConfig
from acespec.loop import SpecConfig, generate
from acespec.models import TextStream
from acespec.models.toy import ToyModel

V = 64
TARGET = "toy:vocab=64,seed=1"
DRAFT = "toy:vocab=64,seed=1,noise=0.5,noise_seed=3"
PROMPT = "hello edge"
SEED = 7
MAX = 40
CASES = {"greedy": dict(rule="greedy", temperature=0.0), "coupled": dict(rule="coupled", temperature=0.8)}


def toy_draft() -> ToyModel:
    return ToyModel(vocab=V, seed=1, noise=0.5, noise_seed=3)


def text_of(tokens: list[int]) -> str:
    s = TextStream(toy_draft().tokenizer)
    return s.push(tokens) + s.flush()


def reference(prompt: str, rule: str, temperature: float, max_tokens: int = MAX, seed: int = SEED) -> str:
    """What `acespec generate` writes for this prompt (in process: the same function the CLI runs)."""
    target = ToyModel(vocab=V, seed=1)
    cfg = SpecConfig(rule=rule, temperature=temperature, seed=seed, max_tokens=max_tokens, k=4)
    return text_of(generate(target, target.tokenizer.encode(prompt), cfg, draft=toy_draft()).tokens)


def start_edge(cloud_port: int, *, drafters: int = 2, connect: dict | None = None, **serve) -> EdgeApiThread:
    defaults = EdgeConfig(rule="coupled", max_tokens=MAX, connect=ConnectConfig(port=cloud_port, **(connect or {})))
    cfg = ServeConfig(port=0, defaults=defaults, **serve)
    return EdgeApiThread(EdgeService([toy_draft() for _ in range(drafters)], cfg)).start()


@pytest.fixture(scope="module")
def cloud():
    with CloudServerThread(ToyModel(vocab=V, seed=1), ServerConfig(port=0, max_sessions=32)) as srv:
        yield srv


@pytest.fixture(scope="module")
def edge(cloud):
    api = start_edge(cloud.port)
    yield api
    api.stop()


@pytest.fixture(scope="module")
def client(edge):
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def cli_reference():
    """`acespec generate --json` itself, once per rule (the other cases compare with the function it runs)."""
    out = {}
    for name, case in CASES.items():
        p = subprocess.run([sys.executable, "-m", "acespec.cli", "generate", "--draft", DRAFT, "--target", TARGET,
                            "--prompt", PROMPT, "--chat", "--rule", case["rule"], "--temperature", str(case["temperature"]),
                            "--seed", str(SEED), "--max-tokens", str(MAX), "--json"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        out[name] = json.loads(p.stdout)["text"]
    return out


def chat(client, prompt=PROMPT, *, stream=False, **kw):
    """(text, finish_reason, usage) of a chat completion, streamed or not."""
    args = dict(model="acespec", messages=[{"role": "user", "content": prompt}], max_tokens=kw.pop("max_tokens", MAX),
                seed=kw.pop("seed", SEED), temperature=kw.pop("temperature"), stop=kw.pop("stop", None))
    if not stream:
        r = client.chat.completions.create(**args, extra_body=kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    pieces, finish, usage = [], None, None
    for c in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}, extra_body=kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    return "".join(pieces), finish, usage


def complete(client, prompt=PROMPT, *, stream=False, **kw):
    args = dict(model="acespec", prompt=prompt, max_tokens=kw.pop("max_tokens", MAX), seed=kw.pop("seed", SEED),
                temperature=kw.pop("temperature"), stop=kw.pop("stop", None))
    if not stream:
        r = client.completions.create(**args, extra_body=kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    pieces, finish, usage = [], None, None
    for c in client.completions.create(**args, stream=True, stream_options={"include_usage": True}, extra_body=kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    return "".join(pieces), finish, usage


def metrics(edge) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client: {name{labels}: value}."""
    body = urllib.request.urlopen(edge.url + "/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# ------------------------------------------------------------------------------------------ same text
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_chat_and_completions_return_acespec_generates_text(client, cli_reference, case, stream):
    c = CASES[case]
    assert cli_reference[case] == reference(PROMPT, **c)  # the CLI and the function agree
    # edge-led (mode acespec): it always drafts, so the usage's speculation counts are there to check;
    # the default mode (auto) never waits for a draft, and this instant toy cloud needs none
    text, finish, usage = chat(client, stream=stream, mode="acespec", **c)
    assert text == cli_reference[case]
    assert finish == "length" and usage.completion_tokens == MAX
    assert usage.prompt_tokens == len(PROMPT) and usage.total_tokens == len(PROMPT) + MAX
    assert 0 < usage.accepted_tokens <= usage.drafted_tokens and 0 < usage.target_passes < MAX
    text, finish, usage = complete(client, "def f(x):", stream=stream, **c)
    assert text == reference("def f(x):", **c) and finish == "length"


@pytest.mark.parametrize("mode", [None, "auto", "acespec", "sync", "pipelined", "cloud-only", "cloud-led"])
def test_every_mode_gives_the_same_text(client, mode):
    c = CASES["coupled"]
    text, _, usage = chat(client, stream=True, **({"mode": mode} if mode else {}), k=3, **c)
    assert text == reference(PROMPT, **c)
    if mode == "cloud-only":
        assert usage.target_passes == MAX and usage.drafted_tokens == 0
    elif mode in (None, "auto"):  # the default: the instant toy cloud may stream it all before a draft lands
        assert usage.target_passes <= MAX
    else:
        assert usage.target_passes < MAX
    if mode == "acespec":
        assert usage.cache_lookups >= usage.cache_hits >= 0


# ------------------------------------------------------------------------------------------ stop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings_end_the_text_before_them(client, stream):
    c = CASES["greedy"]
    full = reference("stop here", **c, max_tokens=60)
    stop = full[41:47]  # crosses token boundaries (every toy token is `<n>`)
    cut = full.find(stop)
    text, finish, usage = complete(client, "stop here", stream=stream, stop=[stop, "never-in-the-text"], max_tokens=60, **c)
    assert text == full[:cut] and finish == "stop"
    # the tokens up to the one that completed the stop string
    spans = [i for i, ch in enumerate(full) if ch == ">"]
    assert usage.completion_tokens == next(n for n, end in enumerate(spans, 1) if end >= cut + len(stop) - 1)
    text, finish, _ = chat(client, "stop here", stream=stream, stop="zzz", max_tokens=12, **c)
    assert text == reference("stop here", **c, max_tokens=12) and finish == "length"


# ------------------------------------------------------------------------------------------ errors
def _post(edge, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(edge.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _assert_openai_error(err: dict, *, param=None) -> dict:
    """`err`: the `error` object (the openai client's `APIStatusError.body` is that object)."""
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_errors_come_back_in_openais_shape_and_the_server_stays_up(client, edge):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=msgs)
    assert _assert_openai_error(e.value.body, param="model")["code"] == "model_not_found"
    cases = [
        (dict(n=2), "n"), (dict(extra_body={"rule": "no-such-rule"}), "rule"), (dict(logprobs=True, extra_body={"mode": "sync"}), "logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(max_tokens=5000), None),  # past the cloud's max_new_tokens: the cloud's OVER_LIMIT comes back as 400
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="acespec", messages=msgs, **kw)
        _assert_openai_error(e.value.body, param=param)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="acespec", messages=msgs, temperature=-1)
    status, body = _post(edge, "/v1/chat/completions", b"{not json")
    assert status == 422 and set(body) == {"error"} and _assert_openai_error(body["error"])["type"] == "invalid_request_error"
    status, body = _post(edge, "/v1/chat/completions", json.dumps({"model": "acespec", "messages": "hi"}).encode())
    assert status == 422 and _assert_openai_error(body["error"], param="messages")
    status, body = _post(edge, "/v1/nowhere", b"{}")
    assert status == 404 and _assert_openai_error(body["error"])["type"] == "not_found_error"
    # still serving
    assert chat(client, **CASES["greedy"], max_tokens=5)[0] == reference(PROMPT, **CASES["greedy"], max_tokens=5)
    assert client.models.list().data[0].id == "acespec"
    with urllib.request.urlopen(edge.url + "/health", timeout=5) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_input_that_once_gave_500s_gets_a_4xx_and_the_schema_is_published(client, edge):
    """Found by a mutation campaign (issue on the fleet's front door): a lone surrogate, valid JSON
    but no Unicode text, in the prompt, the model name or a message; `max_completion_tokens` of the
    wrong type on /v1/completions. Each is a 422 in OpenAI's shape; the server goes on serving."""
    bad = [
        ("/v1/completions", {"model": "acespec", "prompt": "\ud800"}),
        ("/v1/completions", {"model": "\ud800x", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "acespec", "messages": [{"role": "user", "content": "a\udc80"}]}),
        ("/v1/completions", {"model": "acespec", "prompt": "hi", "stop": ["\ud83d"]}),
        ("/v1/completions", {"model": "acespec", "prompt": "hi", "max_completion_tokens": "twelve"}),
    ]
    for path, body in bad:
        status, out = _post(edge, path, json.dumps(body).encode())  # json.dumps keeps the surrogate as an escape
        assert status == 422, (path, body, out)
        _assert_openai_error(out["error"])
    status, out = _post(edge, "/v1/completions", json.dumps({"model": "acespec", "prompt": "hi", "max_completion_tokens": 3}).encode())
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    with urllib.request.urlopen(edge.url + "/openapi.json", timeout=5) as r:
        schema = json.loads(r.read())
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    assert chat(client, **CASES["greedy"], max_tokens=5)[0] == reference(PROMPT, **CASES["greedy"], max_tokens=5)


def test_an_unreachable_cloud_is_503(cloud):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = start_edge(port, drafters=1, connect=dict(reconnect_attempts=1, connect_timeout_s=2.0))
    try:
        c = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                chat(c, stream=stream, **CASES["greedy"])
            assert e.value.status_code == 503 and "cloud" in str(e.value)
    finally:
        api.stop()


# ------------------------------------------------------------------------------------------ metrics
def test_metrics_move_by_the_requests_figures(client, edge):
    before = metrics(edge)
    assert before["acespec:drafters"] == 2
    c = CASES["coupled"]
    text, finish, usage = chat(client, stream=True, mode="acespec", **c)
    after = metrics(edge)
    assert delta(before, after, "acespec:spec_decode_num_accepted_tokens_total") == usage.accepted_tokens > 0
    assert delta(before, after, "acespec:spec_decode_num_draft_tokens_total") == usage.drafted_tokens
    assert delta(before, after, "acespec:target_passes_total") == usage.target_passes
    assert 0 < delta(before, after, "acespec:spec_decode_num_drafts_total") <= usage.target_passes
    per_pos = sum(delta(before, after, k) for k in after if k.startswith("acespec:spec_decode_num_accepted_tokens_per_pos"))
    assert per_pos == usage.accepted_tokens
    assert delta(before, after, "acespec:generation_tokens_total") == usage.completion_tokens == MAX
    assert delta(before, after, "acespec:prompt_tokens_total") == usage.prompt_tokens
    origins = {o: delta(before, after, f"acespec:tokens_by_origin_total{{origin={o}}}") for o in ("draft", "cache", "target")}
    assert origins["draft"] + origins["cache"] == usage.accepted_tokens and sum(origins.values()) == MAX
    assert delta(before, after, "acespec:state_cache_lookups_total") == usage.cache_lookups
    assert delta(before, after, "acespec:state_cache_hits_total") == usage.cache_hits
    assert delta(before, after, "acespec:request_success_total{finished_reason=length}") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(before, after, f"acespec:{h}_count") == 1, h
    assert delta(before, after, "acespec:inter_token_latency_seconds_count") == MAX - 1
    assert delta(before, after, "acespec:verdict_latency_seconds_count") == usage.target_passes
    assert delta(before, after, "acespec:draft_k_count") == usage.target_passes
    assert delta(before, after, "acespec:rtt_seconds_count") >= usage.target_passes - 1
    assert delta(before, after, "acespec:uplink_bytes_total") > 0 and delta(before, after, "acespec:downlink_bytes_total") > 0
    assert after["acespec:num_requests_running"] == after["acespec:num_requests_waiting"] == 0
    assert after["acespec:drafters_busy"] == after["acespec:cloud_sessions_live"] == 0


# ------------------------------------------------------------------------------------------ many clients
def test_eight_concurrent_streams_each_get_their_own_text(client, edge):
    jobs = [(f"client {i} asks", ("greedy", "coupled")[i % 2], ("pipelined", "acespec", "sync", "cloud-only")[i % 4])
            for i in range(8)]
    barrier = threading.Barrier(len(jobs))
    before = metrics(edge)

    def one(job):
        prompt, case, mode = job
        barrier.wait()
        return chat(client, prompt, stream=True, mode=mode, max_tokens=60, **CASES[case])[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(one, jobs))
    for (prompt, case, _), text in zip(jobs, texts):
        assert text == reference(prompt, **CASES[case], max_tokens=60), prompt
    after = metrics(edge)
    assert delta(before, after, "acespec:request_success_total{finished_reason=length}") == 8
    # 6 drafting requests on 2 drafters: some of them queued (cloud-only ones never do)
    assert delta(before, after, "acespec:request_queue_time_seconds_count") == 8
    assert delta(before, after, "acespec:request_queue_time_seconds_bucket{le=0.001}") < 6


# ------------------------------------------------------------------------------------------ disconnects
class SlowToy(ToyModel):
    """~5 ms per target pass: a generation lasts long enough to walk away from."""

    def _eval(self, new, want):
        time.sleep(0.005)
        return super()._eval(new, want)


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _long_stream_under_way(c: openai.OpenAI):
    """A 3000-token stream that has delivered its first three tokens (the caller closes it)."""
    stream = c.chat.completions.create(model="acespec", messages=[{"role": "user", "content": "long"}],
                                       max_tokens=3000, temperature=0, stream=True)
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    return stream


def test_clients_that_leave_free_their_place_and_cancel_their_cloud_session():
    # an edge-led default: those modes cannot run without a drafter, so requests queue for one
    with CloudServerThread(SlowToy(vocab=V, seed=1), ServerConfig(port=0)) as slow:
        api = start_edge(slow.port, drafters=1, max_waiting=1, default_mode="sync")
        try:
            c = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0, timeout=30)
            stream = _long_stream_under_way(c)
            assert len(slow.server.sessions) == 1
            # a second client waits in line for the only drafter, and gives up after a second
            body = json.dumps({"model": "acespec", "messages": [{"role": "user", "content": "hi"}]}).encode()
            gave_up = []

            def impatient():
                req = urllib.request.Request(api.url + "/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=1.5)
                except (TimeoutError, urllib.error.URLError) as e:
                    gave_up.append(e)

            waiter = threading.Thread(target=impatient)
            waiter.start()
            _wait(lambda: metrics(api)["acespec:num_requests_waiting"] == 1)
            # the line is full (max_waiting=1): a third gets 503, in OpenAI's shape
            with pytest.raises(openai.InternalServerError) as e:
                chat(c, **CASES["greedy"], max_tokens=5)
            assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
            waiter.join(10)
            assert gave_up
            _wait(lambda: metrics(api)["acespec:num_requests_waiting"] == 0)  # its place is free again
            assert len(slow.server.sessions) == 1  # and it never opened a cloud session
            stream.close()  # the first client goes away mid-stream
            _wait(lambda: not slow.server.sessions)
            _wait(lambda: metrics(api).get("acespec:request_success_total{finished_reason=abort}") == 2)
            m = metrics(api)
            assert m["acespec:drafters_busy"] == 0 and m["acespec:generation_tokens_total"] < 3000
            # the edge carries on
            assert chat(c, **CASES["greedy"], max_tokens=5)[0] == reference(PROMPT, **CASES["greedy"], max_tokens=5)
        finally:
            api.stop()


def test_in_auto_mode_no_request_waits_for_the_busy_drafter():
    """One drafter, held by a long auto stream; a second auto request neither queues nor waits: it
    streams at once (as cloud-only would, its drafter joining only if one frees up) and its text is exact."""
    with CloudServerThread(SlowToy(vocab=V, seed=1), ServerConfig(port=0)) as slow:
        api = start_edge(slow.port, drafters=1, max_waiting=1)
        try:
            c = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0, timeout=30)
            stream = _long_stream_under_way(c)
            _wait(lambda: metrics(api)["acespec:drafters_busy"] == 1)  # the first stream borrowed the drafter
            text, _, usage = chat(c, **CASES["greedy"], max_tokens=5)
            assert text == reference(PROMPT, **CASES["greedy"], max_tokens=5) and usage.drafted_tokens == 0
            m = metrics(api)
            assert m["acespec:num_requests_waiting"] == 0 and m["acespec:drafters_busy"] == 1
            stream.close()
            _wait(lambda: metrics(api)["acespec:drafters_busy"] == 0)  # given back when its stream ended
        finally:
            api.stop()


# ------------------------------------------------------------------------------------------ real pair
@pytest.mark.real
def test_real_pair_through_the_api_equals_generate(real_draft, real_target):
    """The real pair in auto mode through the API gives generate()'s text, and its drafts are used. A
    cloud that never waits may finish before a loaded machine's drafter has a draft ready (a CI run
    kept 0), so this cloud is given a pass budget: each step after the first waits for a draft."""
    prompt, n = "Write a Python function that adds two numbers.", 12
    ids = real_target.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
    cfg = SpecConfig(rule="greedy", temperature=0.0, max_tokens=n, k=4)
    real_draft.reset()
    real_target.reset()
    ref = generate(real_target, ids, cfg, draft=real_draft)
    s = TextStream(real_target.tokenizer)
    want = s.push(ref.tokens) + s.flush()
    real_target.reset()
    real_draft.reset()
    waits = ServerConfig(port=0, max_sessions=2, lead_pass_budget=0.5, lead_max_wait_s=120.0)
    with CloudServerThread(real_target, waits) as cloud:
        # the cloud runs in this process, on the drafter's cores: the contention guard would rest the
        # drafter (tests/test_contention.py), and this test is about the drafts' text
        defaults = EdgeConfig(rule="greedy", max_tokens=n, connect=ConnectConfig(port=cloud.port), contention_guard=False)
        api = EdgeApiThread(EdgeService([real_draft], ServeConfig(port=0, defaults=defaults))).start()
        try:
            c = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0, timeout=120)
            text, finish, usage = chat(c, prompt, stream=True, temperature=0.0, max_tokens=n)
            assert text == want and usage.completion_tokens == len(ref.tokens) and usage.accepted_tokens > 0
            assert cloud.server.lead_holds > 0  # the drafts were waited for, not merely lucky
        finally:
            api.stop()


# ------------------------------------------------------------------------------------------ the commands
def test_edge_serve_command_serves_and_stops_on_sigterm(cloud):
    import re
    import signal

    exe = [sys.executable, "-m", "acespec.cli"]
    bad = subprocess.run([*exe, "edge", "serve", "--cloud", "nowhere", "--draft", DRAFT], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("acespec: error:") and "HOST:PORT" in bad.stderr
    bad = subprocess.run([*exe, "edge", "--cloud", f"127.0.0.1:{cloud.port}", "--draft", DRAFT], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--prompt is required" in bad.stderr
    p = subprocess.Popen([*exe, "edge", "serve", "--cloud", f"127.0.0.1:{cloud.port}", "--draft", DRAFT, "--port", "0",
                          "--acespec", "--max-tokens", "12", "--seed", str(SEED)], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        # the server's defaults: mode acespec, rule coupled, 12 tokens, seed 7
        r = c.completions.create(model="acespec", prompt=PROMPT, temperature=0.8)
        assert r.choices[0].text == reference(PROMPT, "coupled", 0.8, max_tokens=12) and r.usage.completion_tokens == 12
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_bench_api_runs_both_sides_with_toy_models(tmp_path):
    out = tmp_path / "api.json"
    p = subprocess.run([sys.executable, "-m", "acespec.cli", "bench", "api", "--draft", DRAFT, "--target", TARGET,
                        "--runs", "2", "--max-tokens", "16", "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert len(r["pairs"]) == 2 and r["same_text"] == 2
    assert all(pair[s]["tokens"] == 16 for pair in r["pairs"] for s in ("edge", "api"))
    assert r["ratio"]["ttft"] > 0 and "time to first token" in p.stdout


def test_the_deepest_k_the_api_takes_fits_the_clouds_draft_limit(edge):
    """k = 64 is in the API's range, but a pipelined block carries the guessed bonus too (65 ids, over
    the wire's 64): the edge keeps the block within the cloud's WELCOME.max_draft_tokens (found by
    `acespec bench fuzz-http`, where it was a 500)."""
    code, body = _post(edge, "/v1/completions", json.dumps({"model": "acespec", "prompt": "hello", "max_tokens": 12, "k": 64, "mode": "pipelined",
                                                              "temperature": 0.0}).encode())
    assert code == 200, body
    assert body["usage"]["completion_tokens"] == 12


def test_a_prompt_over_the_wires_limit_is_a_400_not_a_500(edge):
    """The toy drafter's context is huge, but a HELLO carries at most Limits.max_prompt_tokens ids
    (found by `acespec bench fuzz-http`, where a 100,000-character prompt was a 500)."""
    code, body = _post(edge, "/v1/completions", json.dumps({"model": "acespec", "prompt": "x" * 40_000, "max_tokens": 4}).encode())
    assert code == 400 and body["error"]["code"] == "context_length_exceeded", body


def test_an_absurd_top_k_is_a_422_not_a_500(edge):
    """A top_k past what the wire's HELLO can carry was a 500 from the codec (found by `acespec bench fuzz-http`)."""
    for top_k in (2**64 + 1, 10**70):
        code, body = _post(edge, "/v1/completions", json.dumps({"model": "acespec", "prompt": "hi", "max_tokens": 4,
                                                                  "top_k": top_k}).encode())
        assert code == 422 and body["error"]["param"] == "top_k", body
    code, _ = _post(edge, "/v1/completions", json.dumps({"model": "acespec", "prompt": "hi", "max_tokens": 4, "top_k": 1 << 31}).encode())
    assert code == 200
