"""One drafter model shared by several sessions (`acespec.models.shared`, `edge serve --shared-drafter`).

Each session drafts on a view of its own; evaluations asked for at the same time run as one batched pass.
The tests hold the views to what private models would give (tokens, drafts, forks, errors) while their
passes are shared, and run four chats at once through the edge's API on one shared drafter.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.api import EdgeApiThread, EdgeService
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig
from acespec.edge.service import ServeConfig
from acespec.loop import SpecConfig, generate
from acespec.models import ModelError
from acespec.models.shared import SharedModel
from acespec.models.toy import ToyModel
from tests.paced_toy import PassCostToy

V = 64


def drafter(**kw) -> ToyModel:
    return PassCostToy(vocab=V, seed=1, noise=0.5, noise_seed=3, **kw)


def target() -> ToyModel:
    return ToyModel(vocab=V, seed=1)


PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3], [5, 7, 7, 2]]


def test_four_sessions_drafting_at_once_share_passes_and_each_gets_what_a_model_of_its_own_gives():
    cfg = SpecConfig(rule="greedy", temperature=0.0, max_tokens=40, k=4)
    alone = [generate(target(), p, cfg, draft=drafter(pass_s=0.0)) for p in PROMPTS]
    shared = SharedModel(drafter(pass_s=0.004), 4)
    go = threading.Barrier(4)

    def run(i: int):
        go.wait()
        return generate(target(), PROMPTS[i], cfg, draft=shared.views[i])

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, range(4)))
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens
        assert (b.stats.drafted, b.stats.accepted) == (a.stats.drafted, a.stats.accepted)
    # drafts asked while a pass ran waited for the next one and shared it
    assert shared.passes < 0.8 * shared.requests, (shared.passes, shared.requests)


def test_a_views_forks_and_rollbacks_touch_only_its_own_sequences():
    base = drafter(pass_s=0.0)
    shared = SharedModel(base, 2, slots_per_view=3)
    a, b = shared.views
    a.eval([1, 2, 3, 4])
    b.eval([9, 8])
    a.fork(2, 3)  # a's slot 2 := its first 3 tokens
    a.activate(2)
    row = a.eval([5], last=1)
    assert a.tokens == [1, 2, 3, 5] and base.held(2) == 4  # a's slot 2 is the base's slot 2
    assert np.array_equal(row[0], ToyModel(vocab=V, seed=1, noise=0.5, noise_seed=3).eval([1, 2, 3, 5])[-1])
    a.activate(0)
    a.rollback(1)
    a.free(2)
    assert a.tokens == [1] and b.tokens == [9, 8] and base.held(3) == 2 and base.held(2) == 0
    with pytest.raises(ModelError, match="bad slot"):
        a.fork(3, 1)  # a has slots 0..2 only
    with pytest.raises(ModelError, match="KV sequences"):
        SharedModel(drafter(n_slots=4), 2, slots_per_view=3)


class FailsOn13(PassCostToy):
    """A model whose pass fails when any sequence in it holds token 13 (as a runtime's decode can fail)."""

    def _eval_batch(self, items):
        if any(13 in new for _, new, _ in items):
            raise ModelError("decode failed")
        return super()._eval_batch(items)


def test_a_request_whose_pass_fails_fails_alone_and_the_ones_sharing_its_pass_still_get_their_rows():
    shared = SharedModel(FailsOn13(vocab=V, seed=1, pass_s=0.3), 3)
    first = threading.Event()
    out: dict = {}

    def ask(i: int, tokens: list[int]) -> None:
        if i:
            first.wait()
        try:
            out[i] = shared.views[i].eval(tokens, last=1)
        except ModelError as e:
            out[i] = e

    threads = [threading.Thread(target=ask, args=(0, [1, 2]))]
    threads[0].start()
    while shared.requests < 1:  # the first pass is under way (it takes 300 ms): the next two share one
        pass
    first.set()
    threads += [threading.Thread(target=ask, args=(1, [1, 13])), threading.Thread(target=ask, args=(2, [4, 5]))]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(10)
    assert isinstance(out[1], ModelError) and "decode failed" in str(out[1])
    assert out[0].shape == (1, V) and out[2].shape == (1, V) and shared.views[2].tokens == [4, 5]
    assert shared.views[1].tokens == []  # nothing of the failed request was kept
    assert shared.passes == 2 < shared.requests  # 1 and 2 shared the second pass (then each ran alone)
    with pytest.raises(ModelError, match="outside the vocabulary"):  # what the view can check, it checks first
        shared.views[1].eval([V + 5])


def test_four_chats_at_once_through_the_api_on_one_shared_drafter_give_cloud_only_text():
    shared = SharedModel(drafter(pass_s=0.004), 4)
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.01), ServerConfig(port=0, max_sessions=8)) as cloud:
        defaults = EdgeConfig(rule="greedy", max_tokens=24, connect=ConnectConfig(port=cloud.port),
                              contention_guard=False, pass_budget=0.5)
        with EdgeApiThread(EdgeService(list(shared.views), ServeConfig(port=0, defaults=defaults))) as api:
            c = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0, timeout=60)

            def chat(i: int, mode: str):
                r = c.completions.create(model="acespec", prompt=PROMPTS[i], max_tokens=24, temperature=0.0,
                                         extra_body={"mode": mode})
                return r.choices[0].text, r.usage

            with ThreadPoolExecutor(4) as pool:
                spec = list(pool.map(lambda i: chat(i, "sync"), range(4)))
            plain = [chat(i, "cloud-only") for i in range(4)]
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert all(u.accepted_tokens > 0 for _, u in spec)
    assert shared.passes < shared.requests
