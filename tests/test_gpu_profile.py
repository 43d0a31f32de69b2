"""The GPU check's profile (scripts/gpu-check.sh -> acespec/bench/gpu_profile.py), dry-run on the CPU with the
tiny shape: it writes a file the simulator's device profiles read."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_gpu_profile_dry_run_feeds_the_simulator(tmp_path):
    from acespec.bench.gpu_profile import main
    from acespec.sim.profiles import DEVICE_PROFILES, measured_cloud

    out = tmp_path / "profile.json"
    assert main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,2", "--reps", "1",
                 "--prefix", "16", "--rules", "", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    m = d["models"]["tiny"]
    assert {(r["batch"], r["new_tokens"]) for r in m["passes"]} == {(b, t) for b in (1, 2) for t in (1, 2, 3, 5, 9)}
    assert all(r["seconds"] > 0 and r["total_tokens"] == r["batch"] * r["new_tokens"] for r in m["passes"])
    assert set(m["decode_step_s"]) == {"1", "2"}
    prof = measured_cloud(DEVICE_PROFILES["edge-npu+h200"], str(out), "tiny")
    table = prof.verify_table_s
    assert len(table) == 9 and all(a <= b for a, b in zip(table, table[1:]))  # K = 0..8, never falling
    assert prof.draft_s_per_token == DEVICE_PROFILES["edge-npu+h200"].draft_s_per_token  # the edge side is kept
    with pytest.raises(ValueError, match="no measurements for shape '7b'"):
        measured_cloud(DEVICE_PROFILES["edge-npu+h200"], str(out), "7b")
    # and the capacity simulation fits its batched cost curve to the same file's passes
    from acespec.sim.capacity import GpuCost

    gpu = GpuCost.from_profile(str(out), "tiny")
    assert gpu.step_s >= 0 and gpu.token_s >= 0 and gpu.session_s >= 0
    assert gpu.pass_s([8, 8]) >= gpu.pass_s([0])  # more work never costs less
    with pytest.raises(ValueError, match="no batched passes"):
        GpuCost.from_profile(str(out), "7b")
    assert "study_cell" not in m  # --rules "": no study cell


def test_gpu_check_times_a_study_cell_of_each_rule_against_the_reference_strict(tmp_path, capsys):
    """The study cell, dry-run: a speculative step of 3 sessions x 2 drafts under strict and cactus, each the
    pass plus the plugin's sampling of that pass's rows, next to the reference strict sampler (vLLM's own where
    vLLM is installed, as in the vLLM profile; else the plugin's strict), and bad arguments refused."""
    import importlib.util

    from acespec.bench.gpu_profile import main

    out = tmp_path / "profile.json"
    assert main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1", "--reps", "2",
                 "--prefix", "16", "--rules", "strict,cactus", "--cell-batch", "3", "--cell-k", "2", "--out", str(out)]) == 0
    cell = json.loads(out.read_text())["models"]["tiny"]["study_cell"]
    assert (cell["batch"], cell["k"]) == (3, 2)
    assert set(cell["sampler_s"]) == set(cell["step_s"]) == {"reference", "strict", "cactus"}
    assert cell["pass_s"] > 0 and all(s > 0 for s in cell["sampler_s"].values())
    for n, s in cell["step_s"].items():
        assert s == pytest.approx(cell["pass_s"] + cell["sampler_s"][n])
        assert cell["step_vs_reference"][n] == pytest.approx(s / cell["step_s"]["reference"])
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert cell["reference"].startswith("vLLM's") == has_vllm, cell["reference"]
    assert "study cell, B=3 K=2: cactus" in capsys.readouterr().out
    for bad in (["--rules", "nosuchrule"], ["--cell-k", "0"]):
        assert main(["--shapes", "tiny", "--device", "cpu", "--out", str(out), *bad]) == 2
    assert "--rules 'nosuchrule'" in capsys.readouterr().err
