"""`acespec bench apps` end to end on toy models: real child processes (cloud, edge serve), the openai
client, every mode against cloud-only, 1 and 2 chats of two turns; the figures it prints are checked
against the rows it recorded."""

from __future__ import annotations

import json
import subprocess
import sys

TOY = ["--draft", "toy:vocab=64,seed=1,noise=0.5,noise_seed=3", "--target", "toy:vocab=64,seed=1"]


def test_bench_apps_runs_every_mode_against_cloud_only_and_every_text_is_exact(tmp_path):
    out = tmp_path / "apps.json"
    p = subprocess.run([sys.executable, "-m", "acespec.cli", "bench", "apps", *TOY, "--sets", "humaneval",
                        "--n-prompts", "2", "--chats", "1,2", "--rtts", "0", "--max-tokens", "12", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "rtt 0 ms, humaneval, 2 chat(s) at once" in p.stdout
    r = json.loads(out.read_text())
    assert r["provenance"]["command"].startswith("acespec bench apps")
    # 2 prompts x 2 turns, once alone and once as one group of 2 chats, in 4 modes
    assert len(r["rows"]) == 4 * 2 * 2 * 2
    for cell in r["summary"].values():
        assert set(cell) == {"cloud-only", "auto", "acespec", "cloud-led"}
        assert cell["cloud-only"]["speed_median"] == 1.0 and cell["cloud-only"]["passes_per_token"] == 1.0
        assert all(m["same_text"] for m in cell.values())
        assert cell["acespec"]["passes_per_token"] < 1.0  # edge-led always drafts
    for row in r["rows"]:
        assert row["tokens"] == 12 and row["ttft_s"] <= row["wall_s"]


def test_bench_apps_refuses_a_bad_list_with_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "acespec.cli", "bench", "apps", *TOY, "--chats", "one"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--chats must be a comma-separated list of integers" in p.stderr


def test_with_repeats_a_requests_speed_is_the_median_of_its_runs():
    from acespec.bench.apps import summarize

    def row(mode, prompt, tok_s, rep):
        return {"rtt_ms": 0, "set": "humaneval", "chats": 1, "mode": mode, "prompt": prompt, "turn": 0,
                "repeat": rep, "tok_s": tok_s, "ttft_s": 1.0, "text": "t", "tokens": 8, "target_passes": 8}

    # cloud-only's runs of prompt a: 10, 12, 30 (one run whose prefill was fast) -> median 12
    rows = [row("cloud-only", "a", v, i) for i, v in enumerate((10.0, 12.0, 30.0))]
    rows += [row("auto", "a", v, i) for i, v in enumerate((12.0, 11.0, 13.0))]  # median 12
    m = summarize(rows, ["auto"])["0|humaneval|1"]["auto"]
    assert m["speed_median"] == m["speed_worst"] == 1.0 and m["requests"] == 3


def test_with_prefix_reuse_the_second_turn_is_compared_with_the_prompts_first_uncached_visit():
    from acespec.bench.apps import summarize

    def row(turn, ttft):
        return {"rtt_ms": 0, "set": "sharegpt", "chats": 1, "mode": "auto", "prompt": "a", "turn": turn,
                "repeat": 0, "tok_s": 5.0, "ttft_s": ttft, "text": "t", "tokens": 8, "target_passes": 8}

    rows = [row(0, 0.2), row(1, 1.0)]  # the timed first turn found its prompt cached by the visit
    assert summarize(rows, ["auto"])["0|sharegpt|1"]["auto"]["turn2_ttft_speedup"] == 0.2
    cold = [{"rtt_ms": 0, "set": "sharegpt", "chats": 1, "prompt": "a", "ttft_s": 8.0}]
    assert summarize(rows, ["auto"], cold)["0|sharegpt|1"]["auto"]["turn2_ttft_speedup"] == 8.0
