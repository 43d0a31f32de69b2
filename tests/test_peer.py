"""`acespec bench peer`: the commands it gives llama.cpp carry AceSpec's settings, it reads llama.cpp's
own reports right, it judges equality and picks each side's best K as the report says, and bad input
or a failed build is one clear error. (Building and timing llama.cpp takes minutes: that is the
benchmark's job, `docs/results/bench-peer.txt`, not the suite's.)"""

from __future__ import annotations

import sys

import pytest

from acespec.bench import peer
from tests.test_cli import assert_usage_error, run


@pytest.fixture
def ggufs(tmp_path):
    """Two files that resolve as GGUF models (the magic is all `resolve` reads)."""
    out = []
    for name in ("draft.gguf", "target.gguf"):
        p = tmp_path / name
        p.write_bytes(b"GGUF" + b"\0" * 60)
        out.append(p)
    return out


def test_dry_run_gives_llama_cpp_acespecs_weight_buffers_threads_and_greedy(ggufs, tmp_path):
    draft, target = ggufs
    p = run("bench", "peer", "--dry-run", "--draft", str(draft), "--target", str(target), "--ks", "3,6",
            "--threads", "2", "--max-tokens", "40", "--build-dir", str(tmp_path / "peer"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    build = [x for x in lines if not x.startswith("#")][:3]
    assert "pip download" in build[0].replace(" -m pip", " pip") and "--no-binary :all:" in build[0]
    assert "vendor/llama.cpp" in build[1] and "-DCMAKE_BUILD_TYPE=Release" in build[1]
    assert "llama-speculative-simple" in build[2] and "llama-completion" in build[2]
    runs = [x for x in lines if not x.startswith("#")][3:]
    assert len(runs) == 3  # plain, k=3, k=6
    for argv in runs:
        a = argv.split()
        assert "-nr" in a  # the extra weight buffers off, as LlamaCppModel loads
        assert a[a.index("--temp") + 1] == "0" and a[a.index("-n") + 1] == "40"
        assert a[a.index("-t") + 1] == "2" and a[a.index("-m") + 1] == str(target)
    assert "llama-completion" in runs[0] and "-md" not in runs[0]
    for argv, k in zip(runs[1:], ("3", "6")):
        a = argv.split()
        assert a[a.index("--spec-draft-n-max") + 1] == k and a[a.index("-md") + 1] == str(draft)
        assert a[a.index("-td") + 1] == "2"  # the drafter gets the same threads as the target


@pytest.mark.parametrize("args, needle", [
    (["--ks", "0"], "between 1 and 64"),
    (["--ks", "2,x"], "comma-separated"),
    (["--draft", "/nowhere/d.gguf"], "does not exist"),
    (["--draft", "toy:vocab=8"], "is not a GGUF file"),
])
def test_bad_arguments_are_one_line_errors_before_anything_is_built(args, needle, tmp_path):
    p = run("bench", "peer", "--build-dir", str(tmp_path / "peer"), *args)
    assert_usage_error(p, needle)
    assert not (tmp_path / "peer").exists()


def test_a_failed_build_step_names_the_step_and_the_retry(tmp_path):
    steps = [("configure llama.cpp", [sys.executable, "-c", "import sys; print('no compiler here'); sys.exit(3)"])]
    with pytest.raises(peer.PeerError) as e:
        peer.ensure_built(tmp_path / "peer", steps=steps)
    msg = str(e.value)
    assert "configure llama.cpp" in msg and "exit status 3" in msg and "no compiler here" in msg
    assert "acespec bench peer" in msg


def test_built_tools_are_found_without_building(tmp_path):
    for t in peer.TOOLS:
        (tmp_path / "build" / "bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / "build" / "bin" / t).write_text("")
    steps = [("must not run", [sys.executable, "-c", "raise SystemExit(1)"])]
    bins = peer.ensure_built(tmp_path, steps=steps)
    assert set(bins) == set(peer.TOOLS) and all(p.is_file() for p in bins.values())


# llama.cpp's reports, in the shape its tools print them (examples/speculative-simple, common_perf_print)
SPEC_ERR = """0.01.2 I encoded   13 tokens in    0.299 seconds, speed:   43.498 t/s
0.09.1 I decoded   67 tokens in    6.627 seconds, speed:   10.110 t/s
0.09.1 I
0.09.1 I n_draft   = 4
0.09.1 I n_predict = 67
0.09.1 I n_drafted = 64
0.09.1 I n_accept  = 51
0.09.1 I accept    = 79.688%
"""
PLAIN_ERR = """0.05.8 I common_perf_print:    sampling time =      24.89 ms
0.05.8 I common_perf_print: prompt eval time =     236.10 ms /    13 tokens (   18.16 ms per token,    55.06 tokens per second)
0.05.8 I common_perf_print:        eval time =    5029.98 ms /    63 runs   (   79.84 ms per token,    12.52 tokens per second)
0.05.8 I common_perf_print: unaccounted time =       6.59 ms /   0.1 %      (total - sampling - prompt eval - eval) / (total)
"""


def test_reads_llama_cpps_own_reports():
    prompt = "def f(x):\n"
    text, n, sec, drafted, accepted = peer.parse_spec("\n\n" + prompt + "    return x\n" + "\n\n" * 2, SPEC_ERR, prompt)
    assert text == "    return x\n" and n == 67 and drafted == 64 and accepted == 51
    assert sec == pytest.approx(0.299 + 6.627)
    text, n, sec = peer.parse_plain("    return x\n\n\n", PLAIN_ERR)
    assert text == "    return x\n" and n == 64  # 63 decode runs after the token the prompt's pass gave
    assert sec == pytest.approx((24.89 + 236.10 + 5029.98 + 6.59) / 1e3)
    text, _, _ = peer.parse_plain("    return x [end of text]\n\n\n", PLAIN_ERR)
    assert text == "    return x"
    with pytest.raises(peer.PeerError, match="no statistics"):
        peer.parse_spec("", "killed\n", prompt)
    with pytest.raises(peer.PeerError, match="no timings"):
        peer.parse_plain("", "")


def _sample(side, config, pid, text, tokens, seconds, passes=0, drafted=0, accepted=0):
    return peer.Sample(side, config, pid, text, tokens, seconds, drafted, accepted, passes)


def test_summary_judges_equality_and_each_sides_best_k():
    cfg = peer.PeerConfig(ks=(2, 4), n_prompts=1, repeats=1)
    plain = "abcdef"
    ss = [
        _sample("llama.cpp", "plain", "p", plain, 100, 10.0),
        _sample("llama.cpp", "k=2", "p", plain + "gh", 102, 12.0, passes=40, drafted=80, accepted=62),
        _sample("llama.cpp", "k=4", "p", "abcXef", 100, 11.0, passes=25, drafted=100, accepted=75),
        _sample("acespec", "plain", "p", plain, 100, 10.0),
        _sample("acespec", "k=2", "p", plain, 100, 8.0, passes=40, drafted=80, accepted=60),
        _sample("acespec", "k=4", "p", plain, 100, 9.0, passes=25, drafted=100, accepted=75),
    ]
    peer._mark_equal(ss)
    res = peer.summarise(ss, cfg, draft_spec="d", target_spec="t")
    rows = res["rows"]
    assert rows["llama.cpp k=2"]["equal_to_plain"] == "1/1"  # a block past --n-predict still equals plain
    assert rows["llama.cpp k=4"]["equal_to_plain"] == "0/1"  # a changed token does not
    assert rows["acespec k=2"]["tau"] == pytest.approx(100 / 40)
    assert rows["acespec k=2"]["x_plain"] == pytest.approx((100 / 8) / (100 / 10), abs=1e-3)
    assert res["best"] == {"llama.cpp": "k=4", "acespec": "k=2"}  # fastest, not deepest
    assert res["acespec_over_peer"] == pytest.approx((100 / 8) / (100 / 11), abs=1e-3)
    assert res["plain_texts_equal"] == "1/1"
    # the bar at 1.3 x llama.cpp's 100/11 tok/s is 1.18x acespec's plain 100/10: more than plain's own speed
    assert res["bar_needs_x_plain"] == pytest.approx(1.3 * (100 / 11) / (100 / 10), abs=1e-3)
    report = peer.format_report(res)
    assert "NOT met" not in report and "[met: bar 1.3x]" in report
    assert "the bar asks acespec's speculation for 1.18x its own plain decoding (1.3 x llama.cpp k=4 / acespec plain); " \
        "its best K gives 1.25x" in report


def test_the_controller_row_is_reported_apart_from_the_best_fixed_k():
    """`auto` (the depth controller, which may take plain steps) never counts as a side's best K: it
    gets its own ratio and says how many of its passes verified drafts."""
    cfg = peer.PeerConfig(ks=(3,), n_prompts=1, repeats=1)
    plain = "abcdef"
    auto = _sample("acespec", "auto", "p", plain, 100, 6.5, passes=96, drafted=8, accepted=4)
    auto.blocks = 4
    ss = [
        _sample("llama.cpp", "plain", "p", plain, 100, 6.0),
        _sample("llama.cpp", "k=3", "p", plain, 100, 9.0, passes=27, drafted=81, accepted=73),
        _sample("acespec", "plain", "p", plain, 100, 6.2),
        _sample("acespec", "k=3", "p", plain, 100, 9.1, passes=27, drafted=81, accepted=73),
        auto,
    ]
    peer._mark_equal(ss)
    res = peer.summarise(ss, cfg, draft_spec="d", target_spec="t")
    assert res["best"] == {"llama.cpp": "k=3", "acespec": "k=3"}  # auto is faster, but not a fixed K
    assert res["acespec_over_peer"] == pytest.approx(9.0 / 9.1, abs=1e-3)
    assert res["auto_over_peer"] == pytest.approx(9.0 / 6.5, abs=1e-3)
    assert res["rows"]["acespec auto"]["block_share"] == pytest.approx(4 / 96, abs=1e-3)
    assert res["rows"]["acespec auto"]["equal_to_plain"] == "1/1"
    report = peer.format_report(res)
    assert "best K: acespec k=3 over llama.cpp k=3: 0.99x [NOT met: bar 1.3x]" in report
    assert "for 0.90x its own plain decoding (1.3 x llama.cpp k=3 / acespec plain); its best K gives 0.68x" in report
    assert "acespec auto (the depth controller) over llama.cpp k=3: 1.39x [met: bar 1.3x]," in report
    assert "drafts verified in 4.2% of its target passes" in report
