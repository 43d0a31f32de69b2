"""The rules' row functions (`acespec.verify.relaxed.ROW_LAWS`, `entropy`, `jsd`, `total_variation`) are
one definition, written against the array API, that numpy runs (`verify_block`) and torch runs (AceSpec's
vLLM plugin). Here both run on the same rows, hand-built and random, for every rule at several settings:
the acceptance probability of each row's draft and the law of its recovered token must agree, exactly
(up to float64 rounding) in float64 and to float32 rounding in float32, the plugin's dtype."""

from __future__ import annotations

import numpy as np
import pytest

from acespec.verify import RuleSpec
from acespec.verify.relaxed import LOSSLESS_POINTS, ROW_LAWS, entropy, jsd, total_variation, typical_threshold
from relaxed_laws import CASES, MILD, rand_dist

torch = pytest.importorskip("torch")

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
