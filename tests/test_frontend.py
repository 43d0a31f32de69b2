"""The front end measured alone: the no-op engine (verdicts with no model pass, through the real
server and session bookkeeping) and `acespec bench frontend` at a small size."""

from __future__ import annotations

import pytest

from acespec.bench.frontend import VARIANTS, FrontendConfig, run_frontend
from acespec.cloud.engine import make_engine
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.models.toy import ToyModel

V = 48


def test_the_noop_engine_accepts_every_draft_and_keeps_the_session_budget():
    drafter = ToyModel(vocab=V, seed=1, noise=2.0, noise_seed=5)  # a drafter the real target would often refuse
    with CloudServerThread(make_engine("noop", ToyModel(vocab=V, seed=1)), ServerConfig(port=0)) as srv:
        cfg = EdgeConfig(mode="sync", rule="greedy", k=4, max_tokens=31, connect=ConnectConfig(port=srv.port))
        res = run_edge(drafter, [1, 2, 3], cfg, model_id=f"toy:vocab={V}")
        verdicts = srv.server.engine.verdicts
    st = res.stats
    assert len(res.tokens) == 31  # the budget cuts the last block, as with a real target
    assert st.drafted - st.accepted <= 4  # every draft kept but what the budget cut from the last block
    assert verdicts == st.rounds
    # each full block is the drafter's 4 tokens, then token 0
    assert res.tokens[4] == 0 and res.tokens[9] == 0


@pytest.mark.parametrize("variant", ["uvloop", "asyncio"])
def test_bench_frontend_holds_its_sessions_and_answers_every_draft(variant):
    res = run_frontend(FrontendConfig(sessions=300, rates=(300,), seconds=1.0, server_cpu=None), log=lambda s: None,
                       serve_args=VARIANTS[variant])
    assert res.opened == 300 and res.rss_open_mib > res.rss_idle_mib > 0
    [r] = res.rates
    assert r.errors == 0 and r.sent >= 250 and r.verdicts >= 0.95 * r.sent
    assert 0 < r.p50_ms <= r.p99_ms <= r.max_ms


def test_bench_frontend_says_when_other_work_shared_the_machine():
    """A front-end figure taken while something else kept a core busy is not the front end's: the run
    reports the cores others used (here a busy loop beside it), which a quiet machine shows near 0."""
    import subprocess
    import sys

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        res = run_frontend(FrontendConfig(sessions=50, rates=(100,), seconds=1.5, server_cpu=None), log=lambda s: None,
                           serve_args=VARIANTS["uvloop"])
    finally:
        burner.kill()
        burner.wait()
    [r] = res.rates
    assert r.errors == 0
    assert r.other_cpu >= 0.5  # the busy loop had a core to itself most of the time
