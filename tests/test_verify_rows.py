"""The rules' row functions (`acespec.verify.relaxed.ROW_LAWS`, `entropy`, `jsd`, `total_variation`) are
one definition, written against the array API, that numpy runs (`verify_block`) and torch runs (AceSpec's
vLLM plugin). Here both run on the same rows, hand-built and random, for every rule at several settings:
the acceptance probability of each row's draft and the law of its recovered token must agree, exactly
(up to float64 rounding) in float64 and to float32 rounding in float32, the plugin's dtype. `jsd` is also
checked against its definition on hand-built rows (it sums over the drafter's support only where that is
sparse), as is casc_tok's eta (read from a one-hot q's token), and r_fuzzy's and casc_tok's acceptance (built on the draft's column
only) against the template's, bit for bit.
The tests that need no torch run without it."""

from __future__ import annotations

import numpy as np
import pytest

from acespec.verify import RuleSpec, relaxed
from acespec.verify.relaxed import LOSSLESS_POINTS, ROW_LAWS, entropy, jsd, total_variation, typical_threshold
from relaxed_laws import CASES, MILD, rand_dist

try:
    import torch
except ImportError:  # the numpy-only tests below still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

# a strongly relaxed setting per rule, past the registered default
STRONG = {"typical": {"eps": 0.01, "delta": 0.05}, "cactus": {"delta": 3.0}, "mentored": {"alpha": 1.0}, "fuzzy": {"T": 0.6},
          "r_fuzzy": {"alpha": 0.6}, "casc_opt": {"alpha": 2.0}, "casc_tok": {"alpha": 0.9}}


def settings(rule: str) -> list[dict]:
    out = [RuleSpec.parse(rule).kwargs()]
    for table in (MILD, STRONG, LOSSLESS_POINTS):
        if rule in table:
            out.append(dict(out[0], **table[rule]))
    return out


def row_sets() -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(name, x int[n], q [n, V], p [n, V]) batches: each hand-built case with every token as the draft,
    then random rows of many kinds, then degenerate ones."""
    sets = []
    for name, q, p in CASES:
        V = len(p)
        sets.append((name, np.arange(V), np.tile(q, (V, 1)), np.tile(p, (V, 1))))
    rng = np.random.default_rng(11)
    V = 40
    xs, qs, ps = [], [], []
    for i in range(240):
        kind = i % 6
        p = rand_dist(rng, V, sparse=kind == 1, conc=[1.0, 1.0, 0.05, 5.0, 0.3, 1.0][kind])
        q = rand_dist(rng, V, sparse=kind == 4, conc=0.3 if kind == 2 else 1.0)
        if kind == 3:
            q = 0.8 * p + 0.2 * q  # close: small JSD
        if kind == 5:
            q = p.copy()  # p == q
        x = int(rng.choice(V, p=q))
        if i % 4 == 0:
            q = np.eye(V)[x]  # a token-only draft: one-hot q
        xs.append(x)
        qs.append(q)
        ps.append(p)
    sets.append(("random", np.array(xs), np.array(qs), np.array(ps)))
    # degenerate: p(x) = 1; p(x) = 0; q(x) = 0; a one-hot (greedy) target
    e = np.eye(5)
    q = np.array([0.2, 0.6, 0.2, 0.0, 0.0])
    sets.append(("degenerate", np.array([1, 0, 3, 2, 4]), np.array([q, q, q, e[2], e[4]]),
                 np.array([e[1], e[1], [0.3, 0.3, 0.2, 0.2, 0.0], e[2], [0.25, 0.25, 0.25, 0.25, 0.0]])))
    return sets


ROWS = row_sets()


def _norm(r: np.ndarray) -> np.ndarray:
    return r / r.sum(axis=-1, keepdims=True)


@needs_torch
@pytest.mark.parametrize("rule", sorted(ROW_LAWS))
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 2e-5)])
def test_row_laws_agree_on_numpy_and_torch(rule, dtype, tol):
    law = ROW_LAWS[rule]
    seen_partial = False
    for params in settings(rule) if rule in LOSSLESS_POINTS or rule == "typical" else [{}]:
        for name, x, q, p in ROWS:
            a = law.accept(x, q, p, **params)  # numpy, float64: [n]
            res = _norm(law.recovered(x, q, p, **params))  # [n, V]
            tdt = getattr(torch, dtype)
            t = (torch.from_numpy(x), torch.from_numpy(q).to(tdt), torch.from_numpy(p).to(tdt))
            if dtype == "float32":  # the numpy side then sees the same float32-rounded rows
                q, p = t[1].double().numpy(), t[2].double().numpy()
                a, res = law.accept(x, q, p, **params), _norm(law.recovered(x, q, p, **params))
            at = law.accept(*t, **params)
            rt = law.recovered(*t, **params)
            assert isinstance(at, torch.Tensor) and at.shape == (len(x),) and rt.shape == p.shape
            np.testing.assert_allclose(at.double().numpy(), a, rtol=0, atol=tol, err_msg=f"{rule} {params} {name}: accept")
            # a residual of rounding-level mass (float32: below ~1e-4; `recovered` leaves it unnormalised) is
            # noise, in either library; such a row is rejected with that probability, so only the others must agree
            sure = slice(None) if dtype == "float64" else law.recovered(x, q, p, **params).sum(-1) > 1e-4
            np.testing.assert_allclose(_norm(rt.double().numpy())[sure], res[sure], rtol=0, atol=tol,
                                       err_msg=f"{rule} {params} {name}: recovered")
            seen_partial |= bool(((a > 0) & (a < 1)).any() or ((a == 0).any() and (a == 1).any()))
    assert seen_partial  # the rows took both branches somewhere: accepted and rejected drafts


@needs_torch
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 2e-5)])
def test_divergences_and_thresholds_agree_on_numpy_and_torch(dtype, tol):
    for _, _, q, p in ROWS:
        tq, tp = torch.from_numpy(q).to(getattr(torch, dtype)), torch.from_numpy(p).to(getattr(torch, dtype))
        q64, p64 = tq.double().numpy(), tp.double().numpy()
        for f, args, targs in ((entropy, (p64,), (tp,)), (jsd, (p64, q64), (tp, tq)), (total_variation, (p64, q64), (tp, tq))):
            np.testing.assert_allclose(f(*targs).double().numpy(), f(*args), rtol=0, atol=tol, err_msg=f.__name__)
        for prm in settings("typical"):
            np.testing.assert_allclose(typical_threshold(tp, **prm).double().numpy(), typical_threshold(p64, **prm), rtol=tol,
                                       atol=0, err_msg=f"typical_threshold {prm}")
    assert jsd(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.0, 0.0, 1.0]])).item() == pytest.approx(np.log(2))
    assert entropy(torch.tensor([0.0, 1.0])).item() == 0.0  # 0 log 0 = 0, not nan


# ------------------------------------------------------------------------------------------ jsd, by its definition


def jsd_by_definition(p: np.ndarray, q: np.ndarray) -> np.ndarray:  # float64 [n, V] -> [n]
    """sum a log(a/m) over a > 0, for a = p and a = q, m = (p+q)/2, halved: written out, no shortcuts."""
    m = (p + q) / 2

    def kl(a):
        return np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0) / np.where(a > 0, m, 1.0)), 0.0), axis=-1)

    return (kl(p) + kl(q)) / 2


def one_hot(V: int, ids) -> np.ndarray:  # int[n] -> [n, V]
    out = np.zeros((len(ids), V))
    out[np.arange(len(ids)), ids] = 1.0
    return out


def jsd_rows(V: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Hand-built (p [n, V], q [n, V]) rows: q one-hot (a token-only draft), sparse and dense; p with zeros;
    p == q (JSD 0); disjoint supports (JSD ln 2)."""
    rng = np.random.default_rng(V)
    n = 6
    p = rng.dirichlet(np.full(V, 0.3), size=n)
    pz = p * (rng.random((n, V)) < 0.5)  # p with zeros (top-k / top-p rows), at least one token kept
    pz[np.arange(n), rng.integers(0, V, n)] += 0.1
    pz /= pz.sum(-1, keepdims=True)
    onehot = one_hot(V, rng.integers(0, V, n))
    sparse = rng.random((n, V)) * (rng.random((n, V)) < min(1.0, 3 / V))  # about 3 tokens per row
    sparse[np.arange(n), rng.integers(0, V, n)] += 0.5
    sparse /= sparse.sum(-1, keepdims=True)
    dense = rng.dirichlet(np.ones(V), size=n)
    on_zero = one_hot(V, [int(np.flatnonzero(r == 0)[0]) if (r == 0).any() else 0 for r in pz])  # q's token where p is 0
    half = V // 2
    dp, dq = np.zeros((n, V)), np.zeros((n, V))  # disjoint supports: p below half, q from half on
    dp[:, :half] = rng.dirichlet(np.ones(half), size=n)
    dq[:3, half:] = one_hot(V - half, rng.integers(0, V - half, 3))  # one-hot q, and spread q
    dq[3:, half:] = rng.dirichlet(np.ones(V - half), size=n - 3)
    return {
        "one-hot q": (p, onehot), "sparse q": (p, sparse), "dense q": (p, dense),
        "p with zeros, one-hot q": (pz, onehot), "p with zeros, q on them": (pz, on_zero), "p with zeros, sparse q": (pz, sparse),
        "p with zeros, dense q": (pz, dense), "one-hot p, one-hot q": (onehot, np.roll(onehot, 1, axis=0)),
        "p == q": (p, p.copy()), "p == q, p with zeros": (pz, pz.copy()), "p == q, one-hot": (onehot, onehot.copy()),
        "disjoint": (dp, dq),
    }


BACKENDS = [("numpy", "float64", 1e-12), pytest.param("torch", "float64", 1e-12, marks=needs_torch),
            pytest.param("torch", "float32", 2e-6, marks=needs_torch)]
WAYS = {"as chosen": None, "on q's support": 0, "over whole rows": 10**18}  # relaxed.SPARSE_Q for each


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("V", [2, 5, 64, 4096, 151936])
@pytest.mark.parametrize("lib,dtype,tol", BACKENDS)
def test_jsd_is_its_definition(lib, dtype, tol, V, way, monkeypatch):
    if WAYS[way] is not None:
        monkeypatch.setattr(relaxed, "SPARSE_Q", WAYS[way])
    for name, (p, q) in jsd_rows(V).items():
        if lib == "torch":
            tp, tq = (torch.from_numpy(a).to(getattr(torch, dtype)) for a in (p, q))
            p, q = tp.double().numpy(), tq.double().numpy()  # the definition on the same (float32-rounded) rows
            got = jsd(tp, tq)
            assert isinstance(got, torch.Tensor) and got.dtype == getattr(torch, dtype)
            got = got.double().numpy()
        else:
            got = jsd(p, q)
        want = jsd_by_definition(p, q)
        assert got.shape == (len(p),)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"{name}, V = {V}")
        assert (got >= 0).all() and (got <= np.log(2) + tol).all()
        if name.startswith("p == q"):
            assert (got == 0).all(), name  # exactly: every term is p log(p/p) = 0, or 0 log 0
        if name == "disjoint":
            np.testing.assert_allclose(got, np.log(2), rtol=0, atol=tol)
        # one row alone, and rows in a [2, n/2] batch, give the same values
        if lib == "numpy":
            assert float(jsd(p[0], q[0])) == pytest.approx(float(got[0]), abs=tol)
            np.testing.assert_allclose(jsd(p.reshape(2, -1, V), q.reshape(2, -1, V)).reshape(-1), got, rtol=0, atol=tol)


def test_jsd_sums_over_qs_support_only_where_q_is_sparse(monkeypatch):
    """The way `jsd` takes: its logs on q's support only for a one-hot q, on whole rows for a dense q."""
    shapes = []
    kl_terms = relaxed._kl_terms

    def spy(a, m, tiny):
        shapes.append(a.shape)
        return kl_terms(a, m, tiny)

    monkeypatch.setattr(relaxed, "_kl_terms", spy)
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(1000), size=4)
    jsd(p, one_hot(1000, [1, 5, 7, 9]))
    assert shapes == [(4,), (4,)]
    shapes.clear()
    jsd(p, rng.dirichlet(np.ones(1000), size=4))
    assert shapes == [(4, 1000), (4, 1000)]


@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), pytest.param("torch", "float64", marks=needs_torch),
                                       pytest.param("torch", "float32", marks=needs_torch)])
@pytest.mark.parametrize("rule", ["r_fuzzy", "casc_tok"])
def test_column_accept_is_the_templates(lib, dtype, rule):
    """r_fuzzy's and casc_tok's RowLaws accept with template_accept on the draft's column of pi only: the
    same numbers as the template law built from their targets, which build pi over whole rows."""
    template, law = relaxed._template_law(getattr(relaxed, f"{rule}_targets")), ROW_LAWS[rule]
    for params in settings(rule):
        for name, x, q, p in ROWS:
            if lib == "torch":
                tdt = getattr(torch, dtype)
                x, q, p = torch.from_numpy(x), torch.from_numpy(q).to(tdt), torch.from_numpy(p).to(tdt)
            for part in ("accept", "recovered"):
                got, want = getattr(law, part)(x, q, p, **params), getattr(template, part)(x, q, p, **params)
                if lib == "torch":
                    got, want = got.double().numpy(), want.double().numpy()
                np.testing.assert_array_equal(got, want, err_msg=f"{part} {params} {name}")


@pytest.mark.parametrize("V", [5, 64, 151936])
@pytest.mark.parametrize("lib,dtype,tol", BACKENDS)
def test_casc_tok_is_its_definition_and_one_hot_rows_take_no_other_numbers(lib, dtype, tol, V, monkeypatch):
    """casc_tok's eta is 1 - (q's mass where p >= the bar), written out, on one-hot, sparse, dense and top-3
    rows; for one-hot q (read from the row's one token, with no pass over the rows) its eta, pi and
    acceptance are bit for bit those of the whole-row way."""
    rng = np.random.default_rng(V)
    n = 6
    rows = dict(jsd_rows(V))
    top3 = np.zeros((n, V))  # every row three tokens, one of them p's favourite: an edge's top-n rows
    for i, p in enumerate(rows["one-hot q"][0]):
        ids = np.concatenate([[np.argmax(p)], rng.choice(np.delete(np.arange(V), np.argmax(p)), min(2, V - 1), replace=False)])
        top3[i, ids] = rng.dirichlet(np.ones(len(ids)))
    rows["top-3 q"] = (rows["one-hot q"][0], top3)
    whole_rows = lambda q: None  # noqa: E731

    def run(p, q, x, alpha):
        top = relaxed.casc_tok_top(p, alpha=alpha)
        eta = relaxed.casc_tok_eta(q, p, top, relaxed.casc_tok_in_a(q, p, top))
        got = (eta[:, 0], relaxed.casc_tok_targets(x, q, p, alpha=alpha)[0], ROW_LAWS["casc_tok"].accept(x, q, p, alpha=alpha))
        return [g.double().numpy() for g in got] if lib == "torch" else list(got), top

    for name, (p, q) in rows.items():
        x = q.argmax(-1)
        truly = bool(((q == 1.0).sum(-1) == 1).all() and (np.count_nonzero(q, axis=-1) == 1).all())
        if lib == "torch":
            tdt = getattr(torch, dtype)
            p, q, x = torch.from_numpy(p).to(tdt), torch.from_numpy(q).to(tdt), torch.from_numpy(x)
        one_hot = relaxed.one_hot_ids(q) is not None
        assert one_hot == truly, name
        for alpha in (-1e9, 0.0, 0.3, 0.9, 1.0):
            (eta, pi, acc), top = run(p, q, x, alpha)
            p64, q64, top64 = (a.double().numpy() if lib == "torch" else a for a in (p, q, top))
            want = np.clip(1.0 - (q64 * (p64 >= top64)).sum(-1), 0.0, None)
            np.testing.assert_allclose(eta, want, rtol=0, atol=tol, err_msg=f"{name}, alpha = {alpha}")
            np.testing.assert_allclose(pi.sum(-1), 1.0, rtol=0, atol=1e3 * tol, err_msg=f"{name}, alpha = {alpha}")
            if one_hot:
                with monkeypatch.context() as m:
                    m.setattr(relaxed, "one_hot_ids", whole_rows)
                    for got, ref in zip((eta, pi, acc), run(p, q, x, alpha)[0]):
                        np.testing.assert_array_equal(got, ref, err_msg=f"{name}, alpha = {alpha}")
