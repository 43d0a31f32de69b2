"""Predicted Outputs: a client's expected output drafted from where the generation lines up with it.

Alignment and OpenAI's usage counts on hand-built token lists; then over real sockets, a poor drafter
with a perfect prediction: the text is still exactly cloud-only's (the rule decides, the prediction
only proposes), and nearly every prediction token is accepted, in every speculative mode; and the
edge's API takes the field and reports `completion_tokens_details` as OpenAI defines it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.draft.prediction import Prediction, prediction_usage
from acespec.edge.api import EdgeApiThread, EdgeService
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.edge.service import ServeConfig
from acespec.models.toy import ToyModel

from paced_toy import PassCostToy

V = 64
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


def test_the_prediction_is_the_first_draft_and_realigns_after_an_edit():
    p = Prediction([10, 11, 12, 13, 14, 15, 16], start=2)
    assert p.continuation([0, 0], 3) == [10, 11, 12]
    assert p.continuation([0, 0, 10, 11], 3) == [12, 13, 14]
    # the model wrote 99 where the prediction had 12, then went back to the prediction's 13
    assert p.continuation([0, 0, 10, 11, 99, 13], 2) == [14, 15]
    assert p.continuation([0, 0, 10, 11, 99], 2) == []  # nothing lines up: the model drafts
    assert p.continuation([0, 0, 10, 11, 16], 4) == []  # the prediction's end


def test_a_repeated_snippet_lines_up_with_its_nearest_occurrence_ahead():
    p = Prediction([1, 2, 7, 1, 2, 8], start=0)
    assert p.continuation([1, 2], 1) == [7]
    assert p.continuation([1, 2, 7, 1, 2], 1) == [8]


def test_usage_counts_prediction_tokens_that_appear_in_the_completion():
    assert prediction_usage([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]) == (4, 1)
    assert prediction_usage([], [1, 2]) == (0, 0)
    assert prediction_usage([7, 8], []) == (0, 2)


@pytest.fixture(scope="module")
def cloud():
    # a pass that takes time, as a real target's: a toy cloud-led cloud could otherwise stream the whole
    # text before the edge's first DRAFT, and what the prediction carried would depend on the machine
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.004), ServerConfig(port=0, max_sessions=8)) as srv:
        yield srv


def _run(port: int, mode: str, prediction=(), rule: str = "coupled", temperature: float = 0.8, n: int = 40):
    poor = ToyModel(vocab=V, seed=9, noise=3.0, noise_seed=2)  # another table: it rarely agrees with the target
    cfg = EdgeConfig(mode=mode, rule=rule, temperature=temperature, seed=4, max_tokens=n, connect=ConnectConfig(port=port),
                     prediction=tuple(prediction))
    return run_edge(poor if mode != "cloud-only" else None, PROMPT, cfg, model_id=poor.tokenizer.fingerprint)


@pytest.mark.parametrize("mode", ["sync", "pipelined", "cloud-led"])
def test_a_perfect_prediction_drafts_a_poor_drafters_way_to_cloud_only_text(cloud, mode):
    ref = _run(cloud.port, "cloud-only").tokens
    plain = _run(cloud.port, mode)
    led = _run(cloud.port, mode, prediction=ref)
    assert plain.tokens == ref and led.tokens == ref
    # cloud-led: the cloud never waits, so its first token goes out before the edge's first DRAFT
    # arrives; after that the prediction carries it
    assert led.stats.accepted >= (0.6 if mode == "cloud-led" else 0.8) * len(ref) > plain.stats.accepted
    assert led.stats.rounds < plain.stats.rounds


def test_a_wrong_prediction_costs_nothing_but_its_drafts(cloud):
    ref = _run(cloud.port, "cloud-only").tokens
    wrong = [(t + 1) % V for t in ref]
    assert _run(cloud.port, "cloud-led", prediction=wrong).tokens == ref


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_api_takes_a_prediction_and_reports_its_tokens_as_openai_does(cloud):
    draft = ToyModel(vocab=V, seed=1, noise=0.5, noise_seed=3)
    defaults = EdgeConfig(rule="coupled", max_tokens=24, connect=ConnectConfig(port=cloud.port))
    api = EdgeApiThread(EdgeService([draft], ServeConfig(port=0, defaults=defaults))).start()
    try:
        content = "hello edge, again"
        for mode in ("cloud-led", "pipelined", "cloud-only"):
            code, r = _post(api.url, {"model": "acespec", "prompt": "hello edge", "max_tokens": 24, "mode": mode,
                                      "prediction": {"type": "content", "content": content}})
            assert code == 200, r
            d = r["usage"]["completion_tokens_details"]
            assert d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] == len(draft.tokenizer.encode(content))
        code, r = _post(api.url, {"model": "acespec", "prompt": "x", "prediction": {"type": "file", "content": "y"}})
        assert code == 422 and r["error"]["type"]
        code, r = _post(api.url, {"model": "acespec", "prompt": "x",
                                  "prediction": {"type": "content", "content": [{"type": "image_url", "image_url": "z"}]}})
        assert code == 400 and r["error"]["param"] == "prediction.content"
        code, r = _post(api.url, {"model": "acespec", "prompt": "hello", "max_tokens": 4})
        assert code == 200 and "completion_tokens_details" not in r["usage"]
    finally:
        api.stop()
