"""The capacity simulation (acespec.sim.capacity, `acespec bench capacity`): many simulated edges, each
running the live edge loop, on one batched cloud GPU. Synthetic traces; fast."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from acespec.sim.capacity import GpuCost, run_capacity, users_served
from acespec.sim.profiles import DEVICE_PROFILES
from acespec.sim.trace import TraceSet

from test_sim import random_trace

NPU = DEVICE_PROFILES["edge-npu+h200"]
FLAT = GpuCost("flat", step_s=0.02, token_s=0.0, session_s=0.0, prefill_token_s=0.0)  # a pass costs the same at any batch


def traces(n=3, length=60):
    return [random_trace(length, 0.8, seed=s) for s in range(n)]


def test_batching_shares_the_gpu_among_edges():
    """With a pass that costs the same at any batch, N cloud-only edges share each step: GPU time per token
    falls about N-fold while each user keeps about one token per step."""
    one = run_capacity(traces(1), 1, "cloud-only", FLAT, NPU)
    many = run_capacity(traces(), 12, "cloud-only", FLAT, NPU)
    assert many["sessions_per_pass"] > 6
    assert many["gpu_s_per_1k_tokens"] < one["gpu_s_per_1k_tokens"] / 4
    assert many["user_tok_s_p50"] == pytest.approx(one["user_tok_s_p50"], rel=0.25)
    assert many["tokens"] == sum(t.n for t in traces()) * 4


def test_speculation_uses_fewer_gpu_seconds_per_token_on_a_costly_pass():
    """When every token in a pass costs (a compute-bound GPU), verifying accepted drafts costs fewer
    passes per token than one step per token, and the GPU time follows."""
    gpu = GpuCost("per-token", step_s=0.004, token_s=0.002, session_s=0.0, prefill_token_s=0.0)
    co = run_capacity(traces(), 6, "cloud-only", gpu, NPU)
    sp = run_capacity(traces(), 6, "sync", gpu, NPU)
    assert sp["passes"] < co["passes"]
    assert sp["gpu_busy"] < co["gpu_busy"]


def test_runs_are_seeded():
    a = run_capacity(traces(), 5, "acespec", FLAT, NPU, seed=1)
    b = run_capacity(traces(), 5, "acespec", FLAT, NPU, seed=1)
    c = run_capacity(traces(), 5, "acespec", FLAT, NPU, seed=2)
    assert a == b and a != c


def test_users_served_is_the_largest_n_whose_10th_percentile_keeps_up():
    rows = [{"mode": "m", "n_edges": n, "user_tok_s_p10": p} for n, p in ((1, 40), (4, 25), (16, 21), (64, 12))]
    assert users_served(rows, "m") == 16
    assert users_served([{"mode": "m", "n_edges": 1, "user_tok_s_p10": 5}], "m") == 0
    assert users_served(rows, "other") == 0


def test_bench_capacity_command(tmp_path, capsys):
    from acespec.bench.capacity import add_parser

    path = TraceSet(traces(2, 40), "d", "t").save(tmp_path / "tr.json")
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="bench"))
    args = ap.parse_args(["capacity", "--traces", str(path), "--n", "1,3", "--modes", "cloud-only,acespec",
                          "--out", str(tmp_path / "cap")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "users served per GPU at >= 20 tokens/s" in out
    doc = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert [(r["n_edges"], r["mode"]) for r in doc["rows"]] == [(1, "cloud-only"), (1, "acespec"), (3, "cloud-only"),
                                                                (3, "acespec")]
    assert (tmp_path / "cap" / "capacity.png").stat().st_size > 1000
    for bad in (["--n", "0,4"], ["--n", "x"], ["--modes", "warp"], ["--traces", str(tmp_path / "missing.json")]):
        args = ap.parse_args(["capacity", "--traces", str(path), *bad])
        with pytest.raises(ValueError):
            args.func(args)
