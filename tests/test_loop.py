"""The draft/verify loop and the target-side verifier, on the exact toy model.

Stats follow docs/concepts/glossary.md (the vLLM definitions): tau = 1 + accepted/rounds, acceptance rate =
accepted/drafted, target passes per token = rounds/emitted (1.0 for plain decoding).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from acespec.control.depth import FixedDepth, PlusTwoMinusOne, make_policy
from acespec.loop import LocalTransport, LoopConfig, SpecConfig, SpecLoop, TargetVerifier, generate
from acespec.loop.stats import RunStats
from acespec.models.base import VocabMismatchError
from acespec.models.toy import ToyModel
from acespec.verify import SamplingParams, probs_from_logits

V = 32
TARGET = ToyModel(vocab=V, seed=3)
NEAR = ToyModel(vocab=V, seed=3, noise=0.8, noise_seed=4)
FAR = ToyModel(vocab=V, seed=8, noise=2.0, noise_seed=5)
SAME = ToyModel(vocab=V, seed=3)
PROMPT = [1, 2, 3]


def _hook(store: list):
    """verifier_hook that keeps the TargetVerifier and records every BlockVerdict it returns."""

    def hook(verifier: TargetVerifier) -> None:
        store.append(verifier)
        inner = verifier.verify

        def verify(*a, **kw):
            v = inner(*a, **kw)
            store.append(v)
            return v

        verifier.verify = verify

    return hook


# -------------------------------------------------------------------------------------------- stats
@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("strict", 1.0), ("coupled", 0.8)])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft", [NEAR, FAR], ids=["near", "far"])
def test_stats_definitions(rule, temperature, k, draft):
    rec: list = []
    res = generate(
        TARGET, PROMPT, SpecConfig(rule=rule, k=k, temperature=temperature, seed=11, max_tokens=60),
        draft=draft, verifier_hook=_hook(rec),
    )
    verifier, verdicts = rec[0], rec[1:]
    s = res.stats
    assert s.emitted == len(res.tokens) == 60
    assert s.rounds == len(verdicts) == verifier.stats.rounds  # sync: nothing dropped
    assert s.dropped == 0
    assert s.drafted == sum(v.drafted for v in verdicts) == verifier.stats.drafted
    assert s.accepted == sum(v.accepted for v in verdicts) == verifier.stats.accepted
    assert s.emitted == sum(v.accepted + 1 for v in verdicts)  # a round emits accepted + 1 tokens
    assert s.mean_acceptance_length == pytest.approx(1 + s.accepted / s.rounds)
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert s.target_passes_per_token == pytest.approx(s.rounds / s.emitted)
    assert 1 / (k + 1) - 1e-12 <= s.target_passes_per_token <= 1.0
    # fixed depth: every round drafted k tokens (the last one may be cut by max_tokens, which cuts accepted)
    assert s.pos_drafted == [s.rounds] * k
    assert sum(s.pos_accepted) == s.accepted
    assert all(a <= d for a, d in zip(s.pos_accepted, s.pos_drafted))
    # acceptance can only fall along the block (a token is accepted only if all before it were)
    assert all(s.pos_accepted[i] >= s.pos_accepted[i + 1] for i in range(k - 1))
    summary = s.summary()
    assert summary["mean_acceptance_length"] == round(s.mean_acceptance_length, 4)
    assert summary["acceptance_rate"] == round(s.acceptance_rate, 4)
    assert summary["target_passes_per_token"] == round(s.target_passes_per_token, 4)
    assert summary["emitted"] == 60 and summary["mean_k"] == k
    assert len(s.token_times) == 60 and s.token_times == sorted(s.token_times)


def test_near_drafter_beats_far_drafter():
    cfg = SpecConfig(rule="strict", k=4, temperature=1.0, seed=2, max_tokens=300)
    near = generate(TARGET, PROMPT, cfg, draft=NEAR).stats
    far = generate(TARGET, PROMPT, cfg, draft=FAR).stats
    assert near.acceptance_rate > far.acceptance_rate
    assert near.target_passes_per_token < far.target_passes_per_token


@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("strict", 1.0), ("coupled", 1.0)])
def test_identical_drafter_accepts_everything(rule, temperature):
    s = generate(TARGET, PROMPT, SpecConfig(rule=rule, k=4, temperature=temperature, max_tokens=50), draft=SAME).stats
    assert s.acceptance_rate == 1.0
    assert s.mean_acceptance_length == 5.0
    assert s.target_passes_per_token == pytest.approx(10 / 50)  # 10 rounds of 5 tokens


@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("strict", 1.0), ("coupled", 0.7)])
def test_no_spec_is_one_pass_per_token(rule, temperature):
    res = generate(TARGET, PROMPT, SpecConfig(rule=rule, temperature=temperature, max_tokens=25, spec=False), draft=NEAR)
    s = res.stats
    assert s.target_passes_per_token == 1.0
    assert s.rounds == s.emitted == 25 and s.drafted == s.accepted == 0
    assert s.mean_acceptance_length == 1.0 and s.acceptance_rate == 0.0
    assert s.draft_s == 0.0
    # no drafter at all is the same
    assert generate(TARGET, PROMPT, SpecConfig(rule=rule, temperature=temperature, max_tokens=25)).stats.target_passes_per_token == 1.0


def test_toy_target_passes_are_counted():
    """Each round is one batched target evaluation (the toy model counts its eval calls)."""
    target = ToyModel(vocab=V, seed=3)
    res = generate(target, PROMPT, SpecConfig(rule="greedy", k=3, max_tokens=40), draft=NEAR)
    assert target.eval_calls == res.stats.rounds


def test_runstats_empty_and_per_position():
    s = RunStats()
    assert s.mean_acceptance_length == 0.0 and s.acceptance_rate == 0.0 and s.target_passes_per_token == 0.0
    s.observe_block(3, 1)
    s.observe_block(2, 2)
    s.observe_block(0, 0)
    assert s.rounds == 3 and s.drafted == 5 and s.accepted == 3
    assert s.pos_drafted == [2, 2, 1] and s.pos_accepted == [2, 1, 0]
    assert s.per_position_acceptance == [1.0, 0.5, 0.0]
    assert s.mean_acceptance_length == pytest.approx(2.0)


# ------------------------------------------------------------------------------------- max_tokens/EOS
@pytest.mark.parametrize("max_tokens", [0, 1, 2, 3, 5, 17, 64])
@pytest.mark.parametrize("k", [0, 1, 4, 9])
@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("strict", 1.0), ("coupled", 1.0)])
def test_max_tokens_is_exact(max_tokens, k, rule, temperature):
    for draft in (SAME, NEAR):
        res = generate(TARGET, PROMPT, SpecConfig(rule=rule, k=k, temperature=temperature, max_tokens=max_tokens), draft=draft)
        assert len(res.tokens) == max_tokens
        assert res.stats.emitted == max_tokens
        assert res.finished


def test_max_tokens_cut_keeps_verdict_shape():
    """A block fully accepted past the budget is cut there, and edge and target agree on the result."""
    rec: list = []
    res = generate(TARGET, PROMPT, SpecConfig(rule="greedy", k=8, max_tokens=6), draft=SAME, verifier_hook=_hook(rec))
    verifier, verdicts = rec[0], rec[1:]
    assert len(verdicts) == 1 and verdicts[0].finished
    assert verdicts[0].accepted == 5 and verdicts[0].drafted == 8
    assert verifier.generated == res.tokens


@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("coupled", 1.0), ("strict", 1.0)])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_eos_stops_generation(rule, temperature, k):
    """With the toy `eos` option, generation ends right after the first end-of-sequence token."""
    # pick as EOS a token that the plain run emits somewhere in the middle
    plain = generate(TARGET, PROMPT, SpecConfig(rule=rule, temperature=temperature, seed=5, max_tokens=200, spec=False)).tokens
    eos = plain[len(plain) // 3]
    target = ToyModel(vocab=V, seed=3, eos=eos)
    draft = ToyModel(vocab=V, seed=3, noise=0.8, noise_seed=4, eos=eos)
    cfg = SpecConfig(rule=rule, k=k, temperature=temperature, seed=5, max_tokens=200)
    res = generate(target, PROMPT, cfg, draft=draft)
    assert res.tokens[-1] == eos and eos not in res.tokens[:-1]
    assert res.finished and len(res.tokens) < 200
    if rule != "strict":  # greedy / coupled outputs do not depend on the drafter: cut where plain decoding is cut
        assert res.tokens == plain[: plain.index(eos) + 1]
    # explicit stop ids override the tokenizer's
    res = generate(target, PROMPT, replace(cfg, stop_ids=frozenset()), draft=draft)
    assert len(res.tokens) == 200


def test_eos_inside_an_accepted_block():
    """An EOS among accepted draft tokens ends the round there (verdict shape: accepted = its index)."""
    plain = generate(TARGET, PROMPT, SpecConfig(rule="greedy", max_tokens=40, spec=False)).tokens
    eos = plain[2]
    target = ToyModel(vocab=V, seed=3, eos=eos)
    rec: list = []
    res = generate(target, PROMPT, SpecConfig(rule="greedy", k=8, max_tokens=40), draft=SAME, verifier_hook=_hook(rec))
    assert res.tokens == plain[: plain.index(eos) + 1]
    v = rec[-1]
    assert v.finished and v.drafted == 8 and v.accepted == plain.index(eos) and v.next_token == eos


# ----------------------------------------------------------------------------------------- +2/-1 policy
def test_plus_two_minus_one_unit():
    pol = PlusTwoMinusOne(k=4, k_min=1, k_max=9)
    assert pol.next_k() == 4
    pol.update(4, 4)
    assert pol.next_k() == 6
    pol.update(6, 6)
    assert pol.next_k() == 8
    pol.update(8, 8)
    assert pol.next_k() == 9  # capped at k_max
    pol.update(9, 3)
    assert pol.next_k() == 8
    pol.update(8, 0)
    assert pol.next_k() == 7
    pol.update(0, 0)
    assert pol.next_k() == 7  # an empty block says nothing
    for _ in range(20):
        pol.update(pol.next_k(), 0)
    assert pol.next_k() == 1  # floored at k_min
    assert isinstance(make_policy("plus2minus1", 3), PlusTwoMinusOne) and make_policy("plus2minus1", 3).k == 3
    assert isinstance(make_policy("adaptive", 3), PlusTwoMinusOne)  # its old name still works
    assert isinstance(make_policy("fixed", 3), FixedDepth)
    with pytest.raises(ValueError):
        make_policy("nope", 3)
    with pytest.raises(ValueError):
        FixedDepth(-1)


@pytest.mark.parametrize("draft", [NEAR, FAR, SAME], ids=["near", "far", "same"])
@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("strict", 1.0)])
def test_plus_two_minus_one_in_the_loop(draft, rule, temperature):
    rec: list = []
    res = generate(
        TARGET, PROMPT, SpecConfig(rule=rule, k=2, policy="plus2minus1", temperature=temperature, seed=1, max_tokens=150),
        draft=draft, verifier_hook=_hook(rec),
    )
    verdicts = rec[1:]
    ks = res.stats.k_chosen
    assert len(ks) == len(verdicts) and ks[0] == 2
    for i in range(len(ks) - 1):
        v = verdicts[i]
        assert v.drafted == ks[i]
        want = min(16, ks[i] + 2) if v.accepted == v.drafted else max(1, ks[i] - 1)
        assert ks[i + 1] == want, (i, ks[i], v)
    if draft is SAME:
        assert ks[:4] == [2, 4, 6, 8]


# ---------------------------------------------------------------------------------------- the verifier
def _verifier(**kw) -> TargetVerifier:
    return TargetVerifier(ToyModel(vocab=V, seed=3), PROMPT, rule=kw.pop("rule", "greedy"), **kw)


def _greedy_next(ctx: list[int]) -> int:
    return int(np.argmax(TARGET.logits_for_context(ctx)))


def test_verifier_plain_step_and_block():
    v = _verifier()
    first = _greedy_next(PROMPT)
    vd = v.step(0)
    assert (vd.accepted, vd.next_token, vd.committed, vd.dropped, vd.drafted) == (0, first, 4, False, 0)
    ctx = PROMPT + [first]
    good = [_greedy_next(ctx), None]
    good[1] = _greedy_next(ctx + good[:1])
    vd = v.verify(1, 4, good)
    assert vd.accepted == 2 and vd.committed == 7 and vd.drafted == 2
    assert v.tokens == ctx + good + [_greedy_next(ctx + good)]
    assert v.stats.rounds == 2 and v.stats.emitted == 4 and v.stats.dropped == 0


def test_verifier_drops_stale_blocks():
    v = _verifier()
    v.step(0)
    C = v.committed  # 4
    before = list(v.tokens)
    # built on a prefix longer than what is committed (a verdict the target never gave)
    d = v.verify(1, C + 1, [5, 6])
    assert d.dropped and d.next_token == -1 and d.committed == C and d.accepted == 0
    # overlap that disagrees with the committed token at that position
    wrong = (v.tokens[C - 1] + 1) % V
    d = v.verify(2, C - 1, [wrong, 5, 6])
    assert d.dropped and d.committed == C
    # built on a prefix so old that the whole block is overlap and more (o > len(x))
    d = v.verify(3, C - 3, [v.tokens[C - 3]])
    assert d.dropped
    assert v.tokens == before and v.stats.dropped == 3 and v.stats.rounds == 1


def test_verifier_accepts_valid_overlapping_block():
    """A pipelined block whose first token guessed the last committed token: the overlap is checked,
    the rest verified, exactly as the same draft sent without overlap."""
    a, b = _verifier(), _verifier()
    a.step(0)
    b.step(0)
    C = a.committed
    ctx = list(a.tokens)
    d1 = _greedy_next(ctx)
    d2 = _greedy_next(ctx + [d1])
    va = a.verify(1, C - 1, [ctx[-1], d1, d2])  # overlap of one (the guessed bonus), two drafts
    vb = b.verify(1, C, [d1, d2])
    assert not va.dropped and va.drafted == 2 and va.accepted == 2
    assert (va.accepted, va.next_token, va.committed) == (vb.accepted, vb.next_token, vb.committed)
    assert a.tokens == b.tokens
    # an overlap-only block (everything assumed was right, nothing new drafted) is a plain step
    C = a.committed
    vo = a.verify(2, C - 1, [a.tokens[-1]])
    assert not vo.dropped and vo.drafted == 0 and vo.accepted == 0 and vo.committed == C + 1


def test_finished_verifier_drops_everything():
    v = _verifier(max_tokens=2)
    assert v.step(0).committed == 4
    last = v.step(1)
    assert last.finished and v.finished
    after = v.verify(2, v.committed, [1, 2])
    assert after.dropped and after.finished
    assert len(v.generated) == 2
    z = _verifier(max_tokens=0)
    assert z.finished and z.step(0).dropped


def test_verifier_rejects_empty_prompt():
    with pytest.raises(ValueError):
        TargetVerifier(TARGET, [], rule="greedy")


def test_verifier_last_p_and_record_accepted():
    v = _verifier(rule="strict", sampling=SamplingParams(1.0))
    v.record_accepted = True
    x = [_greedy_next(PROMPT)]
    q = probs_from_logits(TARGET.logits_for_context(PROMPT), SamplingParams(1.0))[None]
    vd = v.verify(0, 3, x, q)
    assert v.last_p.shape == (2, V)
    np.testing.assert_allclose(v.last_p[0], q[0])
    assert len(v.accepted_support) == vd.accepted
    for prob, rank in v.accepted_support:
        assert prob > 0 and rank == 1


def test_generate_refuses_incompatible_pair():
    with pytest.raises(VocabMismatchError):
        generate(TARGET, PROMPT, SpecConfig(), draft=ToyModel(vocab=V + 1, seed=3))
    # without speculation the drafter is never used, so no check
    assert len(generate(TARGET, PROMPT, SpecConfig(spec=False, max_tokens=3), draft=ToyModel(vocab=V + 1)).tokens) == 3


# ------------------------------------------------------------------------------------------- pipelined
def _sync(target, draft, cfg):
    return generate(target, PROMPT, cfg, draft=draft)


@pytest.mark.parametrize("window", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("draft", [NEAR, FAR, SAME], ids=["near", "far", "same"])
def test_pipelined_coupled_equals_sync(pipelined, window, k, draft):
    cfg = SpecConfig(rule="coupled", k=k, temperature=0.9, seed=17, max_tokens=80)
    want = _sync(ToyModel(vocab=V, seed=3), draft, cfg).tokens
    res, verifier, transport = pipelined(ToyModel(vocab=V, seed=3), PROMPT, cfg, draft=draft, window=window)
    assert res.tokens == want
    assert verifier.generated == res.tokens
    s = res.stats
    assert s.emitted == 80 and s.rounds == verifier.stats.rounds
    # every block sent was verified or dropped by the target; blocks still in flight when the loop
    # finished are dropped by the (finished) target and never seen by the loop
    assert verifier.stats.rounds + verifier.stats.dropped == transport.sent
    assert s.dropped <= verifier.stats.dropped == transport.sent - s.rounds
    if window > 1 and draft is not SAME:
        assert s.dropped > 0  # stale blocks really were sent and dropped
        assert transport.polls_refused > 0


@pytest.mark.parametrize("window", [2, 4])
def test_pipelined_greedy_equals_sync_at_a_fixed_depth_and_on_plus2minus1(pipelined, window):
    for draft in (NEAR, FAR):
        for policy in ("fixed", "plus2minus1"):
            cfg = SpecConfig(rule="greedy", k=3, policy=policy, max_tokens=70)
            want = _sync(ToyModel(vocab=V, seed=3), draft, cfg).tokens
            res, verifier, _ = pipelined(ToyModel(vocab=V, seed=3), PROMPT, cfg, draft=draft, window=window)
            assert res.tokens == want == verifier.generated


def test_pipelined_identical_drafter_never_drops(pipelined):
    """With a perfect drafter every guess is right: nothing is dropped and each block's new tokens all land."""
    cfg = SpecConfig(rule="greedy", k=4, max_tokens=100)
    res, verifier, _ = pipelined(ToyModel(vocab=V, seed=3), PROMPT, cfg, draft=SAME, window=3)
    assert res.stats.dropped == 0 and res.stats.acceptance_rate == 1.0
    assert res.tokens == _sync(TARGET, SAME, cfg).tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 33])
def test_pipelined_respects_max_tokens_and_eos(pipelined, max_tokens):
    cfg = SpecConfig(rule="strict", k=2, temperature=1.0, seed=3, max_tokens=max_tokens)
    res, verifier, _ = pipelined(ToyModel(vocab=V, seed=3), PROMPT, cfg, draft=NEAR, window=3)
    assert len(res.tokens) == max_tokens and verifier.generated == res.tokens
    plain = generate(TARGET, PROMPT, SpecConfig(rule="greedy", max_tokens=60, spec=False)).tokens
    eos = plain[20]
    cfg = SpecConfig(rule="greedy", k=3, max_tokens=60)
    res, _, _ = pipelined(ToyModel(vocab=V, seed=3, eos=eos), PROMPT, cfg, draft=ToyModel(vocab=V, seed=3, noise=0.8, noise_seed=4, eos=eos), window=3)
    assert res.tokens == plain[: plain.index(eos) + 1]


def test_loop_without_drafter_is_autoregressive():
    verifier = TargetVerifier(ToyModel(vocab=V, seed=3), PROMPT, rule="greedy", max_tokens=12)
    res = SpecLoop(LocalTransport(verifier), PROMPT, drafter=None, config=LoopConfig(max_tokens=12)).run()
    assert res.tokens == generate(TARGET, PROMPT, SpecConfig(max_tokens=12, spec=False)).tokens
    assert res.stats.k_chosen == [0] * 12


def test_loop_config_validation():
    with pytest.raises(ValueError):
        LoopConfig(mode="async")
    with pytest.raises(ValueError):
        LoopConfig(window=0)


# ------------------------------------------------------------------- regression: recovered == draft token
def _echo_reject(rule, draft, q, p, rng, **kw):
    """A legal verdict that the lossless rules give only with tiny probability (strict's residual fallback
    when p ~ q) and relaxed rules give often (e.g. a residual of q - q falls back to sampling q): the
    block is rejected at its first draft token, and the recovered token equals that very draft token."""
    if len(draft) == 0:
        return 0, int(np.argmax(p[0]))
    return 0, int(draft[0])


def _run_bounded(fn, seconds: float = 20.0):
    import threading

    out: dict = {}

    def target():
        try:
            out["res"] = fn()
        except BaseException as e:  # pragma: no cover - reported below
            out["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the loop did not terminate (it keeps sending blocks the target drops)"
    if "err" in out:
        raise out["err"]
    return out["res"]


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_rejection_recovering_the_draft_token_does_not_stall(monkeypatch, pipelined, mode):
    import acespec.loop.verifier as verifier_mod

    monkeypatch.setattr(verifier_mod, "verify_block", _echo_reject)
    cfg = SpecConfig(rule="strict", k=3, temperature=1.0, max_tokens=20)
    if mode == "sync":
        rec: list = []
        res = _run_bounded(lambda: generate(ToyModel(vocab=V, seed=3), PROMPT, cfg, draft=NEAR, verifier_hook=_hook(rec)))
        gen = rec[0].generated
    else:
        res, verifier, _ = _run_bounded(lambda: pipelined(ToyModel(vocab=V, seed=3), PROMPT, cfg, draft=NEAR, window=3))
        gen = verifier.generated
    assert len(res.tokens) == 20 and res.tokens == gen
    assert res.stats.accepted == 0 and res.stats.rounds == 20


# ------------------------------- regression: a block verified from elsewhere commits past a fresh one
def test_a_dropped_block_does_not_doom_the_next_one_that_still_extends_the_committed_text():
    """The shape that cost HumanEval/4 44 dropped blocks and 1.5x its wall time (branches, split
    cores): a doomed block A happens to match what was committed, so the target verifies it and
    commits past the fresh block F the edge sent after it; F is dropped. The block N built on F still
    extends the committed text (the target will verify it). The edge must keep N and build the next
    block on it: dooming N made the edge send a block on the committed length, which the target
    dropped once N committed past it, and so on every round."""
    from acespec.draft.chain import ChainDrafter
    from acespec.loop.records import Block
    from acespec.verify import RuleSpec

    t, ctx = [], list(PROMPT)
    for _ in range(16):
        t.append(_greedy_next(ctx))
        ctx.append(t[-1])
    n0 = len(PROMPT)
    verifier = _verifier()
    drafter = ChainDrafter(SAME, sampling=SamplingParams(0.0), rule=RuleSpec.parse("greedy"))
    loop = SpecLoop(LocalTransport(verifier), PROMPT, drafter=drafter, policy=FixedDepth(2),
                    config=LoopConfig(mode="pipelined", window=2))
    a = Block(0, n0, t[0:4], doomed=True)  # its assumption failed, but its tokens are the target's
    f = Block(1, n0, t[0:2])  # the fresh block sent on the committed length
    n = Block(2, n0 + 2, t[2:6], overlap=1)  # built on f; its first token guesses f's bonus
    for b in (a, f, n):
        loop.seq = b.seq
        loop._send(b)
    loop.spec = PROMPT + t[0:6]

    loop._apply(loop.transport.recv(0.0))  # A verified from n0: committed n0 + 5
    assert loop.committed == PROMPT + t[0:5]
    loop._apply(loop.transport.recv(0.0))  # F dropped: the target is past it
    assert verifier.stats.dropped == 1
    assert not n.doomed and loop.inflight.live() == [n]
    assert loop.spec == PROMPT + t[0:6]

    loop._send_next_block()  # built on N, not on the committed length
    nxt = loop.inflight.blocks[-1]
    assert nxt.base == n0 + 6 and nxt.overlap == 1
    while loop.inflight.blocks:
        loop._apply(loop.transport.recv(0.0))
    assert verifier.stats.dropped == 1  # N and the block after it were both verified
    assert loop.committed == PROMPT + t[: len(loop.committed) - n0]


class _TimedToy(ToyModel):
    """A toy drafter on a virtual clock: every row it evaluates costs one second."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.now = 0.0

    def _eval(self, new: list[int], want: int) -> np.ndarray:
        self.now += len(new)
        return super()._eval(new, want)


def test_a_drafter_that_sat_out_plain_steps_reports_its_catching_up_apart():
    """After K = 0 rounds the drafter reads the tokens committed meanwhile before it drafts; that
    reading is `catchup_s`, and the loop's per-token drafting cost (what the depth controller prices)
    leaves it out, so one return to drafting does not make every later draft token look dear."""
    from acespec.draft.chain import ChainDrafter
    from acespec.loop.records import InFlight
    from acespec.loop.schedule import Scheduler
    from acespec.verify import RuleSpec

    model = _TimedToy(vocab=V, seed=3)
    drafter = ChainDrafter(model, sampling=SamplingParams(0.0), rule=RuleSpec.parse("greedy"), clock=lambda: model.now)
    ctx = list(PROMPT) * 4  # 12 tokens
    d = drafter.draft(ctx, 3)  # reads 12 (the prompt), then two more rows for tokens 2 and 3
    assert d.seconds == 14 and d.catchup_s == pytest.approx(11)
    ctx = ctx + d.tokens + [5]  # all kept, plus the bonus: a drafter that kept up reads 2 tokens
    d2 = drafter.draft(ctx, 3)
    assert d2.seconds == 4 and d2.catchup_s == 0
    ctx = ctx + d2.tokens + [7] + [1, 2, 3, 4, 5, 6, 7, 8]  # then 8 plain steps
    d3 = drafter.draft(ctx, 3)
    assert d3.seconds == 12 and d3.catchup_s == pytest.approx(10 * 9 / 10)

    sched = Scheduler(LoopConfig(mode="sync"), LocalTransport(_verifier()), RunStats(), InFlight(), lambda: 0.0)
    for blk in (d, d2, d3):
        sched.drafted(len(blk.tokens), blk.seconds, blk.catchup_s)
    assert sched.stats.draft_s == 30  # the run's drafting time keeps everything
    assert sched.draft_s_per_token() == pytest.approx((30 - 11 - 9) / 9)


class _LateTransport(LocalTransport):
    """Verdicts that reach the edge `delay` seconds after their block left it, on the drafter's
    virtual clock (a `_TimedToy` row costs one second); the target itself takes no time. At each
    send it notes every verdict that had been waiting for longer than one draft row."""

    def __init__(self, verifier: TargetVerifier, model: _TimedToy, delay: float) -> None:
        super().__init__(verifier, clock=lambda: model.now)
        self.model, self.delay = model, delay
        self.arrivals: list[float] = []  # per verdict not yet taken, in order
        self.unread_at_send: list[float] = []  # how long a verdict had waited when a block was sent
        self.finished_at: float | None = None  # when the verdict that ends the text arrived

    def send(self, block) -> None:
        now = self.model.now
        self.unread_at_send += [now - a for a in self.arrivals if a <= now - 1]
        super().send(block)
        self.arrivals.append(now + self.delay)
        if self._out[-1].finished and self.finished_at is None:
            self.finished_at = now + self.delay

    def recv(self, timeout: float | None = None):
        if not self.arrivals or (timeout is not None and self.model.now < self.arrivals[0]):
            return None
        self.model.now = max(self.model.now, self.arrivals.pop(0))  # waiting for it takes the time
        return self._out.popleft()


@pytest.mark.parametrize("draft_noise", [0.0, 0.8])
def test_a_verdict_that_comes_in_while_a_block_is_drafted_is_heard_at_once(draft_noise):
    """Pipelined, deep blocks: verdicts come in while the edge drafts. Left unread until the block was
    done, each held its tokens back from the user for the rest of the block (measured: up to 0.47 s at
    the end of a 64-token text on the real pair), and after a rejection the target sat idle while the
    edge finished a block built on a token it had already lost. The loop now hears a verdict between
    two draft tokens: no block leaves while a verdict has waited a whole draft row, the text ends within
    one row of its last verdict, and the text is the target's own."""
    from acespec.draft.chain import ChainDrafter
    from acespec.verify import RuleSpec

    model = _TimedToy(vocab=V, seed=3, noise=draft_noise, noise_seed=4)
    drafter = ChainDrafter(model, sampling=SamplingParams(0.0), rule=RuleSpec.parse("greedy"), clock=lambda: model.now)
    verifier = _verifier(max_tokens=40)
    link = _LateTransport(verifier, model, delay=3.5)
    res = SpecLoop(link, PROMPT, drafter=drafter, policy=FixedDepth(8), clock=lambda: model.now,
                   config=LoopConfig(mode="pipelined", window=2, max_tokens=40)).run()
    assert res.tokens == verifier.generated and len(res.tokens) == 40
    ctx = list(PROMPT)
    for t in res.tokens:
        assert t == _greedy_next(ctx)
        ctx.append(t)
    assert link.unread_at_send == []
    assert model.now - link.finished_at <= 1.0
    if draft_noise:
        assert res.stats.accepted < res.stats.drafted  # there were rejections to hear


def test_generate_with_the_controller_is_plain_greedy_text():
    """`generate --policy controller` may take plain steps (k_min = 0) as well as blocks; the text is
    plain greedy decoding's either way."""
    ref = generate(TARGET, PROMPT, SpecConfig(rule="greedy", max_tokens=48, spec=False)).tokens
    res = generate(TARGET, PROMPT, SpecConfig(rule="greedy", max_tokens=48, policy="controller"), draft=NEAR)
    assert res.tokens == ref
