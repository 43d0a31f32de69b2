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
                 "--prefix", "16", "--out", str(out)]) == 0
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
