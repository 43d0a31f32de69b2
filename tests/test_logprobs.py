"""Logprobs: the target's log-probabilities of the streamed tokens, sent only when a session asks.

The cloud computes them from the rows it evaluates anyway (HELLO.logprobs, TOKENS' HAS_LOGPROBS); the
tests hold every figure against the target's own log-softmax at that prefix, over real sockets, in each
streaming mode, and check that a session that does not ask pays no byte for them.
"""

from __future__ import annotations

import math
import socket

import numpy as np
import openai
import pytest

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.api import EdgeApiThread, EdgeService
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.edge.service import ServeConfig
from acespec.loop import Round, SpecConfig, generate
from acespec.models.toy import ToyModel
from acespec.verify import token_logprobs

HOST = "127.0.0.1"
V = 64
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


def toy_target() -> ToyModel:
    return ToyModel(vocab=V, seed=1)


def target_logprobs(tokens: list[int], m: int) -> list[tuple[float, tuple]]:
    """What the target says of each generated token, computed here from scratch: one fresh model, each
    prefix evaluated on its own."""
    model = toy_target()
    out = []
    for i in range(len(PROMPT), len(tokens)):
        model.reset()
        row = model.eval(tokens[:i], last=1)
        out += token_logprobs(row, np.asarray([tokens[i]]), m)
    return out


@pytest.fixture(scope="module")
def cloud():
    with CloudServerThread(toy_target(), ServerConfig(port=0, max_new_tokens=64)) as srv:
        yield srv


def _hello(**kw) -> wire.Hello:
    base = dict(model_id=f"toy:vocab={V}", max_tokens=12, prompt=PROMPT, temperature=0.0, rule="greedy")
    return wire.Hello(**(base | kw))


def _session(port: int, hello: wire.Hello) -> list:
    """Every frame the cloud sends for `hello`, through FINISHED (or its ERROR)."""
    with socket.create_connection((HOST, port), timeout=10) as s:
        wire.send_frame(s, hello)
        frames = []
        while True:
            f = wire.recv_frame(s, wire.DEFAULT_LIMITS)
            frames.append(f)
            if f is None or isinstance(f, wire.Error) or (isinstance(f, wire.Tokens) and f.finished):
                wire.send_frame(s, wire.Close(reason=wire.CloseReason.NORMAL))
                return frames


@pytest.mark.parametrize("mode", [wire.Mode.CLOUD_ONLY, wire.Mode.CLOUD_LED])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_each_streamed_token_carries_the_targets_log_probability_and_its_top_alternatives(cloud, mode, temperature):
    frames = _session(cloud.port, _hello(mode=mode, logprobs=1 + 5, temperature=temperature, rule="coupled", seed=3))
    chunks = [f for f in frames if isinstance(f, wire.Tokens)]
    tokens = list(PROMPT) + [t for c in chunks for t in c.tokens]
    got = [lp for c in chunks for lp in c.logprobs]  # every frame carries them, the empty FINISHED one too
    assert len(tokens) == len(PROMPT) + 12 and len(got) == 12
    want = target_logprobs(tokens, 5)
    for (lp, top), (wlp, wtop) in zip(got, want):
        assert lp == pytest.approx(wlp, abs=1e-5)  # f32 on the wire
        assert [t for t, _ in top] == [t for t, _ in wtop]
        assert [x for _, x in top] == pytest.approx([x for _, x in wtop], abs=1e-5)
        assert all(a >= b for (_, a), (_, b) in zip(top, top[1:]))  # likeliest first
    # probabilities: the alternatives of one position never sum past 1
    assert all(sum(math.exp(x) for _, x in top) <= 1 + 1e-5 for _, top in got)


def test_a_session_that_does_not_ask_gets_no_logprobs_and_pays_no_byte(cloud):
    frames = _session(cloud.port, _hello(mode=wire.Mode.CLOUD_ONLY))
    chunks = [f for f in frames if isinstance(f, wire.Tokens)]
    assert chunks and all(c.logprobs is None for c in chunks)
    # what asking costs, on the same stream: 4 bytes a token and 1 for the empty row (logprobs=1)
    asked = [f for f in _session(cloud.port, _hello(mode=wire.Mode.CLOUD_ONLY, logprobs=1)) if isinstance(f, wire.Tokens)]
    plain = sum(len(wire.encode(c)) for c in chunks)
    assert sum(len(wire.encode(c)) for c in asked) == plain + 5 * 12


def test_logprobs_in_an_edge_led_session_are_refused_with_a_reason(cloud):
    err = _session(cloud.port, _hello(mode=wire.Mode.SPECULATIVE, logprobs=1))[-1]
    assert isinstance(err, wire.Error) and err.code == wire.ErrorCode.BAD_REQUEST
    assert "streaming mode" in err.message


def test_logprobs_with_max_tokens_0_end_in_one_empty_finished_chunk_that_carries_them(cloud):
    frames = _session(cloud.port, _hello(mode=wire.Mode.CLOUD_ONLY, logprobs=3, max_tokens=0))
    assert frames[-1] == wire.Tokens(start=len(PROMPT), tokens=(), finished=True, logprobs=())


@pytest.mark.parametrize("mode", ["cloud-only", "cloud-led", "auto"])
def test_the_edge_runtime_hands_each_round_its_tokens_logprobs(cloud, mode):
    rounds: list[Round] = []
    drafter = ToyModel(vocab=V, seed=1, noise=0.3, noise_seed=2)
    cfg = EdgeConfig(
        mode=mode, rule="greedy", max_tokens=16, logprobs=1 + 2, connect=ConnectConfig(host=HOST, port=cloud.port)
    )
    res = run_edge(drafter, list(PROMPT), cfg, model_id=f"toy:vocab={V}", on_round=rounds.append)
    got = [lp for r in rounds for lp in r.logprobs]
    assert [t for r in rounds for t in r.tokens] == res.tokens and len(got) == len(res.tokens) == 16
    want = target_logprobs(list(PROMPT) + res.tokens, 2)
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)
    assert [[t for t, _ in top] for _, top in got] == [[t for t, _ in top] for _, top in want]


def test_an_edge_led_config_that_asks_for_logprobs_is_refused_before_it_connects():
    with pytest.raises(ValueError, match="streaming modes"):
        EdgeConfig(mode="sync", logprobs=1)
    with pytest.raises(ValueError, match="logprobs must be"):
        EdgeConfig(mode="cloud-only", logprobs=22)


# ------------------------------------------------------------------------------------------ through the API


@pytest.fixture(scope="module")
def api(cloud):
    defaults = EdgeConfig(rule="greedy", temperature=0.0, max_tokens=12, connect=ConnectConfig(port=cloud.port))
    svc = EdgeService([ToyModel(vocab=V, seed=1, noise=0.3, noise_seed=2)], ServeConfig(port=0, defaults=defaults))
    with EdgeApiThread(svc) as edge:
        yield openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=30), svc


def _greedy_reference(prompt: list[int], n: int) -> list[int]:
    return generate(toy_target(), prompt, SpecConfig(rule="greedy", temperature=0.0, max_tokens=n, spec=False)).tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["auto", "cloud-only"])
def test_chat_logprobs_through_the_api_are_the_targets_for_every_token_of_the_text(api, stream, mode):
    client, svc = api
    messages = [{"role": "user", "content": "hello logprobs"}]
    args = dict(model="acespec", messages=messages, max_tokens=12, logprobs=True, top_logprobs=3,
                extra_body={"mode": mode})
    if stream:
        text, content = "", []
        for c in client.chat.completions.create(**args, stream=True):
            for ch in c.choices:
                text += ch.delta.content or ""
                content += ch.logprobs.content if ch.logprobs else []
    else:
        r = client.chat.completions.create(**args)
        text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    prompt = svc.tokenizer.chat_prompt(messages)
    tokens = _greedy_reference(prompt, 12)
    assert b"".join(bytes(e.bytes) for e in content) == svc.tokenizer.decode_bytes(tokens)
    assert text == svc.tokenizer.decode(tokens)
    model = toy_target()
    for i, e in enumerate(content):
        model.reset()
        [(lp, top)] = token_logprobs(model.eval(prompt + tokens[:i], last=1), np.asarray([tokens[i]]), 3)
        assert e.logprob == pytest.approx(lp, abs=1e-5)
        assert [a.logprob for a in e.top_logprobs] == pytest.approx([x for _, x in top], abs=1e-5)
        assert [bytes(a.bytes) for a in e.top_logprobs] == [svc.tokenizer.decode_bytes([t]) for t, _ in top]


def test_completion_logprobs_end_with_the_token_that_completed_the_stop_string(api):
    client, svc = api
    prompt = svc.tokenizer.encode("hello")
    tokens = _greedy_reference(prompt, 12)
    whole = client.completions.create(model="acespec", prompt=prompt, max_tokens=12, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens == 12
    assert all(len(alts) == 2 for alts in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    stop = svc.tokenizer.decode(tokens[4:6])  # a stop string made of the 5th and 6th tokens' text
    cut = client.completions.create(model="acespec", prompt=prompt, max_tokens=12, logprobs=0, stop=[stop])
    n = cut.usage.completion_tokens
    assert cut.choices[0].finish_reason == "stop" and n <= 6
    assert cut.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]


def test_logprobs_in_an_edge_led_mode_get_a_400_that_names_the_streaming_modes(api):
    client, _ = api
    for mode in ("sync", "pipelined", "acespec"):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="acespec", prompt="hi", max_tokens=4, logprobs=1, extra_body={"mode": mode})
        assert e.value.body["param"] == "logprobs" and "cloud-only" in e.value.body["message"]


# ------------------------------------------------------------------------------------------ real pair
@pytest.mark.real
def test_real_target_logprobs_through_the_api_match_its_own_rows(real_draft, real_target):
    """The default pair: the API's logprobs are the 1.5B target's own log-softmax at each prefix, each
    prefix evaluated afresh here. llama.cpp's quantized kernels round differently for a whole prefix
    in one pass and for one token at a time after it (the cloud's way), so values agree to 0.05
    (alternatives: 10%), the tolerances this test holds them to. A row off by one position would list
    other alternatives, which the lookup of each listed token among the reference's five likeliest
    refuses."""
    messages, n = [{"role": "user", "content": "Name three prime numbers."}], 8
    ids = real_target.tokenizer.chat_prompt(messages)
    real_target.reset()
    with CloudServerThread(real_target, ServerConfig(port=0, max_sessions=2)) as cloud:
        defaults = EdgeConfig(rule="greedy", max_tokens=n, connect=ConnectConfig(port=cloud.port))
        with EdgeApiThread(EdgeService([real_draft], ServeConfig(port=0, defaults=defaults))) as api:
            c = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0, timeout=120)
            r = c.chat.completions.create(model="acespec", messages=messages, max_tokens=n, temperature=0.0,
                                          logprobs=True, top_logprobs=3, extra_body={"mode": "cloud-only"})
    content = r.choices[0].logprobs.content
    assert len(content) == n and b"".join(bytes(e.bytes) for e in content) == r.choices[0].message.content.encode()
    real_target.reset()
    ref = generate(real_target, ids, SpecConfig(rule="greedy", temperature=0.0, max_tokens=n, spec=False)).tokens
    for i, e in enumerate(content):
        real_target.reset()
        [(lp, top)] = token_logprobs(real_target.eval(ids + ref[:i], last=1), np.asarray([ref[i]]), 5)
        assert bytes(e.bytes) == real_target.tokenizer.decode_bytes([ref[i]]), i
        assert e.logprob == pytest.approx(lp, abs=0.05)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].bytes == e.bytes  # greedy: the token is the likeliest
        # near-ties among the alternatives may change places under other rounding: each listed one must be
        # among the reference's five likeliest, at its value
        ref_top = {real_target.tokenizer.decode_bytes([t]): x for t, x in top}
        for a in e.top_logprobs:
            assert a.logprob == pytest.approx(ref_top[bytes(a.bytes)], rel=0.1, abs=0.05), (i, a)
