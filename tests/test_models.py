"""Model backends: the real default GGUF pair (llama.cpp) and the Hugging Face backend on tiny random models.

Real-model tests are marked `real` (deselect with `-m "not real"`); each GGUF model is loaded once per
session (conftest.py) and they are skipped with a reason when the models are not installed.

Numerics (measured on this machine's llama.cpp CPU build, Q4_K_M):
- re-evaluating with the *same batch shapes* after a rollback is bit-identical to a fresh evaluation;
- a *different* batch split of the same tokens (one batch vs two, one token at a time, or asking for
  fewer output rows with `last=`) changes logits by up to ~0.4 and probabilities by up to ~0.03 (the
  quantised kernels take other paths and accumulate in another order for other shapes). So cross-shape comparisons use a tolerance of 0.1 on softmax probabilities and require the same
  argmax wherever the reference's top-2 logit gap is at least 1.0.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from acespec.loop import SpecConfig, generate
from acespec.models import VocabMismatchError, check_compatible
from acespec.models.base import ContextOverflowError, ModelError
from acespec.models.toy import ToyModel
from acespec.verify import softmax

CHAT = "Write a Python function that returns the square of a number."
CONT = "def square(x):\n    return x * x\n"
PROB_TOL = 0.1  # cross-batch-shape tolerance on softmax probabilities (measured max ~0.03)
GAP = 1.0  # require equal argmax where the reference's top-2 logit gap is at least this


def _argmax_agrees(ref: np.ndarray, other: np.ndarray) -> None:  # [n, V] logits each
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= GAP
    assert (ref.argmax(-1) == other.argmax(-1))[clear].all()


# ----------------------------------------------------------------------------------- real: KV rollback
@pytest.mark.real
def test_real_rollback_then_reeval_equals_fresh(real_pair):
    _, target = real_pair
    tok = target.tokenizer
    prompt = tok.encode("# Python\nimport math\n\n")  # short: this test evaluates it several times
    cont = tok.encode(CONT)
    n = len(prompt)

    a_prompt = target.eval(prompt)
    a_cont = target.eval(cont)  # fresh: prompt, then continuation
    assert a_prompt.shape == (n, target.vocab_size) and a_cont.shape == (len(cont), target.vocab_size)

    # roll back over some junk and re-evaluate the continuation with the same batch shape: bit-identical
    target.eval(tok.encode(" and some other tokens that will be rolled back"))
    target.rollback(n)
    assert target.n_past == n and target.tokens == prompt
    b_cont = target.eval(cont)
    np.testing.assert_array_equal(b_cont, a_cont)

    # a rollback into the middle of the continuation, re-evaluating its tail
    m = n + 3
    target.rollback(m)
    tail = target.eval(cont[3:])
    # (a different batch split from a_cont's rows: compare with the cross-shape tolerance)
    assert np.abs(softmax(tail) - softmax(a_cont[3:])).max() < PROB_TOL
    _argmax_agrees(a_cont[3:], tail)

    # one batch for everything vs prompt + continuation: a different batch shape
    target.reset()
    whole = target.eval(prompt + cont)
    diff = np.abs(softmax(whole[n:]) - softmax(a_cont)).max()
    print(f"\nllama.cpp one batch vs two batches: max |dp| = {diff:.4f}, max |dlogit| = {np.abs(whole[n:] - a_cont).max():.3f}")
    assert diff < PROB_TOL
    _argmax_agrees(a_cont, whole[n:])

    # `last=` returns the trailing rows; asking llama.cpp for fewer output rows changes the shapes of the
    # last layer's kernels too (measured: logits move by up to ~0.4), so this is a cross-shape comparison
    target.rollback(n)
    last2 = target.eval(cont, last=2)
    assert last2.shape == (2, target.vocab_size)
    assert np.abs(softmax(last2) - softmax(a_cont[-2:])).max() < PROB_TOL
    _argmax_agrees(a_cont[-2:], last2)

    # the drafter's cache too: rollback + same-shape re-eval is bit-identical
    draft = real_pair[0]
    draft.eval(prompt)
    d_fresh = draft.eval(cont)
    draft.eval(tok.encode(" junk"))
    draft.rollback(n)
    np.testing.assert_array_equal(draft.eval(cont), d_fresh)


@pytest.mark.real
def test_real_model_errors(real_pair):
    _, target = real_pair
    with pytest.raises(ModelError):
        target.eval([target.vocab_size])  # out of the vocabulary
    with pytest.raises(ModelError):
        target.rollback(5)  # the cache holds nothing
    with pytest.raises(ContextOverflowError):
        target.eval([0] * (target.n_ctx + 1))
    assert target.n_past == 0


# ------------------------------------------------------------------------------ pass-shape exactness
def _rows_by_pass_shape(model, prompt: list[int], cont: list[int], n: int) -> np.ndarray:
    """Every row of `cont` after `prompt`, evaluated in passes of n tokens (each wanting all its rows)."""
    model.reset()
    model.eval(prompt, last=0)
    return np.vstack([model.eval(cont[i : i + n]) for i in range(0, len(cont), n)])


@pytest.mark.real
def test_a_position_has_the_same_logits_whatever_the_pass_shape(real_target, monkeypatch):
    """A speculative session computes generated positions in verify passes of k + 1 rows where plain
    decoding computes them one at a time; with exact passes (the default) both give the same bits, so
    speculation writes exactly plain decoding's text. A position's row depends on the KV of every
    earlier position, so this also checks that the KV built by long passes equals the one-at-a-time KV."""
    from acespec.models.llama import EXACT_PASS_ROWS, LlamaCppModel

    tok = real_target.tokenizer
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    real_target.reset()
    row = real_target.eval(prompt, last=1)[0]
    cont = []
    for _ in range(20):  # plain greedy decoding, one token a pass
        cont.append(int(np.argmax(row)))
        row = real_target.eval([cont[-1]])[0]
    alone = _rows_by_pass_shape(real_target, prompt, cont, 1)
    for n in (2, 3, EXACT_PASS_ROWS, EXACT_PASS_ROWS + 1, 15):
        np.testing.assert_array_equal(_rows_by_pass_shape(real_target, prompt, cont, n), alone, err_msg=f"passes of {n}")
    # plain decoding's first call (the prompt, wanting its last row) and a verify's first pass (the prompt
    # prefilled, then its last token with a draft) compute the prompt's last position alike
    real_target.reset()
    first_plain = real_target.eval(prompt, last=1)[0]
    real_target.reset()
    real_target.eval(prompt[:-1], last=0)
    np.testing.assert_array_equal(real_target.eval(prompt[-1:] + cont[:4])[0], first_plain)
    # the test's power: without exact passes (an operator's ACESPEC_EXACT_PASSES=0) this build's kernels
    # do give other bits from 8 rows on
    monkeypatch.setenv("ACESPEC_EXACT_PASSES", "0")
    loose = LlamaCppModel(real_target.path, n_ctx=512)
    assert not loose.exact_passes
    try:
        assert not np.array_equal(_rows_by_pass_shape(loose, prompt, cont, 10), _rows_by_pass_shape(loose, prompt, cont, 1)), \
            "llama.cpp computed 10-row passes with its one-row kernels: exact_passes may no longer be needed"
    finally:
        loose.close()


@pytest.mark.real
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the split attention kernel needs 2 threads")
def test_past_256_positions_one_token_passes_on_one_thread_keep_exact_passes_exact(real_draft):
    """From a one-token pass's 257th position on, ggml-cpu splits its attention across threads (a sum
    in an order no multi-row pass uses), so on 2 threads plain steps and verified rows part there;
    `step_threads=1` (ACESPEC_STEP_THREADS=1) computes one-token passes on one thread and they agree
    again, bit for bit, while passes of several rows keep every thread. "auto" does so from position
    256 on only, and keeps both threads for earlier steps; "pad" (the default) keeps both threads and
    gives those steps a pad row instead."""
    from acespec.models.llama import SPLIT_KV_FROM, LlamaCppModel

    prompt = [int(t) for t in np.random.default_rng(5).integers(200, 20000, 250)]
    cont = [int(t) for t in np.random.default_rng(6).integers(200, 20000, 12)]  # positions 250..261

    def rows(step_threads, n: int, threads_seen: list | None = None) -> np.ndarray:
        m = LlamaCppModel(real_draft.path, n_ctx=512, n_threads=2, step_threads=step_threads)
        if threads_seen is not None:  # the one-token passes' thread count, position by position
            decode = m._decode

            def spy(new, want, n_past):
                out = decode(new, want, n_past)
                if len(new) == 1:
                    threads_seen.append((n_past, m.step_threads))
                return out

            m._decode = spy
        try:
            return _rows_by_pass_shape(m, prompt, cont, n)
        finally:
            m.close()

    assert np.array_equal(rows(1, 1), rows(1, 4)), "one-token passes on one thread: every pass shape alike"
    seen: list = []
    assert np.array_equal(rows("auto", 1, seen), rows("auto", 4)), "auto: every pass shape alike"
    assert seen and all(t == (1 if pos >= SPLIT_KV_FROM else 2) for pos, t in seen)
    assert {t for _, t in seen} == {1, 2}  # both sides of position 256 were stepped
    # "pad": every thread on every pass, and a pad row past position 256 gives a step a verify row's bits
    seen = []
    assert np.array_equal(rows("pad", 1, seen), rows(1, 1)), "pad: a step's rows are the verify rows"
    assert seen and {t for _, t in seen} == {2}
    with pytest.raises(ModelError, match="ACESPEC_STEP_THREADS"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ACESPEC_STEP_THREADS", "two")
            LlamaCppModel(real_draft.path, n_ctx=512)
    # the default pads; a number keeps llama.cpp's own split; every setting starts on every thread
    for env, auto, pad in (("auto", True, False), ("", True, True), ("pad", True, True), ("2", False, False)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ACESPEC_STEP_THREADS", env)
            m = LlamaCppModel(real_draft.path, n_ctx=512, n_threads=2)
            assert (m.step_threads_auto, m.step_pad, m.step_threads) == (auto, pad, 2), env
            m.close()
    # the test's power: with both threads on one-token passes, the rows past position 256 part
    split, whole = rows(2, 1), rows(2, 4)
    assert np.array_equal(split[:6], whole[:6]) and not np.array_equal(split[7:], whole[7:]), \
        "llama.cpp no longer splits a one-token pass's attention at 512 cells: step_threads may not be needed"


@pytest.mark.real
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the split attention kernel needs 2 threads")
def test_auto_step_threads_keep_a_late_step_exact_among_other_sessions(real_draft):
    """The batching engine steps several sessions in one llama_decode, each a one-token pass of its
    own that takes the step's thread count: with "auto", a session past position 256 stepped beside
    an early one gets one thread (the rows it gets alone), where both threads would split its
    attention (the never-slower ShareGPT grid's differing text, 2026-12-04); with "pad" it gets a pad
    row beside its token in the same decode, and the early session's step is left as it is."""
    from acespec.models.llama import LlamaCppModel

    late = [int(t) for t in np.random.default_rng(7).integers(200, 20000, 300)]
    early = [int(t) for t in np.random.default_rng(8).integers(200, 20000, 20)]
    steps = [int(t) for t in np.random.default_rng(9).integers(200, 20000, 6)]

    def late_rows(step_threads, beside: bool) -> np.ndarray:
        m = LlamaCppModel(real_draft.path, n_ctx=512, n_slots=2, batch_invariant=True, n_threads=2,
                          step_threads=step_threads)
        try:
            for s in (0, 1):
                m.open_slot(s)
            m.eval_batch([(0, early, 0), (1, late, 0)])
            rows = []
            for t in steps:
                if beside:  # the early session steps first, alone, then both in one decode
                    m.eval_batch([(0, [t], 1)])
                    rows.append(m.eval_batch([(0, [t], 1), (1, [t], 1)])[1][0])
                else:
                    rows.append(m.eval_batch([(1, [t], 1)])[0][0])
            return np.stack(rows)
        finally:
            m.close()

    alone = late_rows(1, beside=False)
    assert np.array_equal(late_rows("auto", beside=True), alone)
    assert np.array_equal(late_rows("auto", beside=False), alone)
    assert np.array_equal(late_rows("pad", beside=True), alone)
    assert np.array_equal(late_rows("pad", beside=False), alone)
    # the power: on both threads the late session's steps take the split attention
    assert not np.array_equal(late_rows(2, beside=True), alone)


@pytest.mark.real
def test_a_batch_of_sessions_cut_into_exact_passes_gives_each_its_rows_alone(real_draft):
    """The cloud's batching engine puts several sessions' blocks in one eval_batch; a block longer than
    EXACT_PASS_ROWS is cut into rounds of passes, and each session still gets exactly the rows it gets
    one token at a time, whatever the other sessions' block lengths."""
    from acespec.models.llama import EXACT_PASS_ROWS, LlamaCppModel

    tok = real_draft.tokenizer
    prompts = [tok.encode("import os\n\ndef main():\n"), tok.encode("class Stack:\n    def __init__(self):\n")]
    conts = [tok.encode("    path = os.getcwd()\n    print(path)\n"), tok.encode("        self.items = []")]
    assert len(conts[0]) > EXACT_PASS_ROWS + 2 and len(conts[1]) <= EXACT_PASS_ROWS
    alone = [_rows_by_pass_shape(real_draft, p, c, 1) for p, c in zip(prompts, conts)]
    m = LlamaCppModel(real_draft.path, n_ctx=256, n_slots=2, batch_invariant=True)
    try:
        for s in (0, 1):
            m.open_slot(s)
        m.eval_batch([(s, p, 0) for s, p in enumerate(prompts)])
        rows = m.eval_batch([(s, c, len(c)) for s, c in enumerate(conts)])
        for s in (0, 1):
            np.testing.assert_array_equal(rows[s], alone[s], err_msg=f"slot {s}")
            assert m.held(s) == len(prompts[s]) + len(conts[s])
    finally:
        m.close()


# ----------------------------------------------------------------------------------- forks, batched
@pytest.mark.real
def test_real_eval_many_advances_forked_sequences_in_one_pass():
    """The state cache pre-drafts several outcomes in one llama.cpp batch: each sequence must get the
    logits it would get alone, and the sequence the forks came from must be left untouched."""
    from acespec.models.registry import DEFAULT_DRAFT, installed_path
    from acespec.models.llama import LlamaCppModel

    path = installed_path(DEFAULT_DRAFT)
    if path is None:
        pytest.skip(f"real model {DEFAULT_DRAFT!r} is not installed")
    m = LlamaCppModel(path, n_ctx=512, n_slots=4)
    try:
        tok = m.tokenizer
        prompt = tok.encode("# Python\nimport math\n\ndef area(r):\n")
        m.eval(prompt)
        leads = [tok.encode("    return"), tok.encode("    #"), tok.encode("    r2 =")]
        before = m.eval(leads[0], last=1)  # how the main sequence continues before any fork exists
        m.rollback(len(prompt))
        for s in (1, 2, 3):
            m.fork(s, len(prompt))
        passes = m.passes
        rows = m.eval_many([(s, lead) for s, lead in zip((1, 2, 3), leads)])
        assert m.passes == passes + 1  # one batched pass for all three
        assert m.tokens == prompt  # the main sequence did not move
        for s, lead, row in zip((1, 2, 3), leads, rows):
            assert m._slots[s] == prompt + lead
            m.activate(s)
            m.rollback(len(prompt))
            alone = m.eval(lead, last=1)  # the same sequence, evaluated by itself
            m.activate(0)
            assert np.abs(softmax(row[None]) - softmax(alone)).max() < PROB_TOL
            _argmax_agrees(alone, row[None])
        # and the main sequence still continues exactly as it did before the batched pass
        assert np.array_equal(before, m.eval(leads[0], last=1))
        with pytest.raises(ModelError):
            m.eval_many([(1, [5]), (1, [6])])  # one slot twice
        with pytest.raises(ModelError):
            m.eval_many([(3, [])])
        m.free(3)
        with pytest.raises(ModelError):
            m.eval_many([(3, [5])])  # freed
    finally:
        m.close()


def test_toy_eval_many_equals_one_sequence_at_a_time():
    a, b = ToyModel(vocab=32, seed=3), ToyModel(vocab=32, seed=3)
    for m in (a, b):
        m.eval([1, 2, 3])
        m.fork(1, 3)
        m.fork(2, 2)
    rows = a.eval_many([(1, [4, 5]), (2, [6])])
    b.activate(1)
    r1 = b.eval([4, 5], last=1)[-1]
    b.activate(2)
    r2 = b.eval([6], last=1)[-1]
    assert np.array_equal(rows[0], r1) and np.array_equal(rows[1], r2)
    assert a._slots[1] == [1, 2, 3, 4, 5] and a._slots[2] == [1, 2, 6] and a.tokens == [1, 2, 3]


# ----------------------------------------------------------------------------------- real: vocabulary
@pytest.mark.real
def test_real_vocab_compatibility(real_pair):
    draft, target = real_pair
    check_compatible(draft, target)  # same Qwen2.5 tokenizer
    assert draft.vocab_size == target.vocab_size
    assert draft.tokenizer.fingerprint == target.tokenizer.fingerprint
    toy = ToyModel(vocab=64)
    with pytest.raises(VocabMismatchError):
        check_compatible(toy, target)
    with pytest.raises(VocabMismatchError):
        check_compatible(target, toy)
    with pytest.raises(VocabMismatchError):
        generate(target, [1, 2, 3], SpecConfig(max_tokens=2), draft=toy)
    # tokenizer basics: round trip, and the chat template ends ready for the assistant
    ids = target.tokenizer.encode(CONT)
    assert target.tokenizer.decode(ids) == CONT
    chat = target.tokenizer.decode(target.tokenizer.chat_prompt([{"role": "user", "content": "hi"}]))
    assert "hi" in chat and chat.rstrip().endswith("assistant")
    assert target.tokenizer.eos_ids  # <|im_end|> / <|endoftext|>


# --------------------------------------------------------------------------- real: end-to-end greedy
@pytest.mark.real
def test_real_greedy_end_to_end(real_pair):
    draft, target = real_pair
    prompt = target.tokenizer.chat_prompt([{"role": "user", "content": CHAT}])
    checked = []

    def hook(verifier):
        inner = verifier.verify

        def verify(seq, base, x, q=None):
            v = inner(seq, base, x, q)
            if not v.dropped:
                o = len(x) - v.drafted
                emitted = list(x[o:][: v.accepted]) + [v.next_token]
                # every emitted token is the argmax of the target distribution that verified it
                best = verifier.last_p.argmax(-1)
                checked.append([int(t) == int(best[i]) for i, t in enumerate(emitted)])
            return v

        verifier.verify = verify

    n_tokens = 24
    spec = generate(target, prompt, SpecConfig(rule="greedy", k=4, max_tokens=n_tokens), draft=draft, verifier_hook=hook)
    s = spec.stats
    assert all(all(row) for row in checked) and sum(len(r) for r in checked) == len(spec.tokens)
    eos = target.tokenizer.eos_ids
    assert len(spec.tokens) == n_tokens or spec.tokens[-1] in eos
    assert s.rounds < s.emitted and s.accepted > 0  # speculation saved target passes
    assert s.target_passes_per_token < 1.0

    # independent check: evaluate the output in one call (reusing the prompt's KV); each token is the
    # target's argmax there, to the bit (exact passes: the same rows whatever the pass shape)
    target.rollback(len(prompt) - 1)
    logits = target.eval(prompt[-1:] + spec.tokens[:-1])
    chosen = logits[np.arange(len(spec.tokens)), spec.tokens]
    gap = logits.max(-1) - chosen
    assert (gap == 0).all(), gap

    # (generate() reuses the longest cached prefix: the prompt is not evaluated again)
    plain = generate(target, prompt, SpecConfig(rule="greedy", max_tokens=n_tokens, spec=False))
    common = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b), min(len(spec.tokens), len(plain.tokens)))
    text = target.tokenizer.decode(spec.tokens)
    print(
        f"\nreal greedy: {len(spec.tokens)} tokens, tau={s.mean_acceptance_length:.2f}, "
        f"acceptance={s.acceptance_rate:.2f}, passes/token={s.target_passes_per_token:.3f}; "
        f"common prefix with autoregressive greedy: {common}/{len(plain.tokens)}\n{text!r}"
    )
    # verify passes compute each position's row with the same bits as a one-token step: the same text
    assert spec.tokens == plain.tokens, (common, len(plain.tokens))


# ----------------------------------------------------------------------------- Hugging Face (tiny, no hub)
@pytest.fixture(scope="module")
def hf_pair():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from acespec.models.hf import HFModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-layer, 32-wide model gains nothing from threads on shared cores

    def tiny(seed: int, noise: float = 0.0, base=None):
        torch.manual_seed(seed)
        cfg = transformers.Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
        )
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        if base is not None:  # a drafter close to the target: its weights plus noise
            model.load_state_dict(base.state_dict())
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * noise)
        return model

    target_module = tiny(0)
    target = HFModel(target_module, tokenizer=None, name="tiny-qwen2-a")
    draft = HFModel(tiny(1, 0.02, base=target_module), tokenizer=None, name="tiny-qwen2-b")
    yield draft, target
    torch.set_num_threads(threads)


def test_hf_eval_and_rollback(hf_pair):
    _, m = hf_pair
    m.reset()
    x = [1, 2, 3, 4, 5, 6, 7, 8]
    a = m.eval(x)
    assert a.shape == (8, 64) and a.dtype == np.float32 and m.n_past == 8
    b = m.eval([9, 10, 11])
    m.rollback(8)
    assert m.n_past == 8
    b2 = m.eval([9, 10, 11])
    np.testing.assert_allclose(b2, b, atol=1e-5)
    m.rollback(5)
    c = m.eval([6, 7, 8, 12], last=2)
    m.reset()
    fresh = m.eval(x[:5] + [6, 7, 8, 12])
    np.testing.assert_allclose(c, fresh[-2:], atol=1e-5)
    np.testing.assert_allclose(fresh[:8], a, atol=1e-5)
    # one token at a time equals the batch
    m.reset()
    steps = np.stack([m.eval([t])[0] for t in x])
    np.testing.assert_allclose(steps, a, atol=1e-5)
    m.rollback(0)
    assert m.n_past == 0
    np.testing.assert_allclose(m.eval(x[:3]), a[:3], atol=1e-5)
    m.reset()


def test_hf_generate_as_target_and_drafter(hf_pair):
    draft, target = hf_pair
    check_compatible(draft, target)  # both use the id tokenizer of a 64-token vocabulary
    with pytest.raises(VocabMismatchError):
        check_compatible(ToyModel(vocab=64), target)  # a toy drafter has its own tokenizer fingerprint
    prompt = [1, 2, 3]
    plain = generate(target, prompt, SpecConfig(rule="greedy", max_tokens=20, spec=False)).tokens
    res = generate(target, prompt, SpecConfig(rule="greedy", k=3, max_tokens=20), draft=draft)
    assert len(res.tokens) == 20
    assert res.stats.accepted > 0  # the perturbed copy agrees often enough to exercise partial accepts
    # float32 batch vs single-token numerics differ by ~1e-7: no near-ties in a random model here
    assert res.tokens == plain
    coupled = SpecConfig(rule="coupled", k=2, temperature=1.0, seed=3, max_tokens=16)
    a = generate(target, prompt, coupled, draft=draft).tokens
    b = generate(target, prompt, SpecConfig(rule="coupled", temperature=1.0, seed=3, max_tokens=16, spec=False)).tokens
    assert a == b
    s = generate(target, prompt, SpecConfig(rule="strict", k=2, temperature=1.0, seed=3, max_tokens=16), draft=draft)
    assert len(s.tokens) == 16 and all(0 <= t < 64 for t in s.tokens)


def test_prefill_holds_exactly_the_prefix_and_reuses_what_is_cached():
    m = ToyModel(vocab=32, seed=1)
    assert m.prefill([3, 1, 4, 1, 5]) == 5
    assert m.tokens == [3, 1, 4, 1, 5]
    assert m.prefill([3, 1, 4, 1, 5]) == 0  # already in place: no evaluation
    assert m.prefill([3, 1, 9]) == 1  # keeps the common prefix, replaces the rest
    assert m.tokens == [3, 1, 9]
    ref = ToyModel(vocab=32, seed=1)
    assert (m.eval([2], last=1) == ref.eval([3, 1, 9, 2], last=1)).all()


def test_vocab_fingerprint_hashes_every_token():
    """Two vocabularies that differ in a single token, anywhere, must not share a fingerprint: the cloud
    takes equal fingerprints to mean the edge's token ids are its own. (The old fingerprint sampled
    every n/997-th token and missed this.)"""
    from acespec.models.base import vocab_fingerprint

    base = [f"tok{i}".encode() for i in range(5000)]
    changed = list(base)
    changed[1234] = b"other"  # 1234 is not a multiple of 5000 // 997 = 5
    split = list(base)
    split[10], split[11] = b"tok10t", b"ok11"  # same bytes overall, split differently
    fps = {vocab_fingerprint(len(v), v) for v in (base, changed, split)}
    assert len(fps) == 3
    assert vocab_fingerprint(5000, base) == vocab_fingerprint(5000, list(base))
    assert vocab_fingerprint(5000, base).startswith("vocab:5000:")
    with pytest.raises(ValueError, match="4999 pieces"):
        vocab_fingerprint(5000, base[:-1])


@pytest.mark.real
def test_tokens_longer_than_32_bytes_decode(real_draft):
    """llama-cpp-python's own detokenize drops every token over 32 bytes (runs of spaces, dashes and
    stars: code is full of them); ours must give their bytes back, or generated code loses its indentation."""
    tok = real_draft.tokenizer
    for text in (" " * 40 + "return x", "#" + "-" * 70, "/" + "*" * 72):
        ids = tok.encode(text)
        assert any(len(tok.decode_bytes([i])) > 32 for i in ids), "the test needs a token over 32 bytes"
        assert tok.decode(ids) == text
