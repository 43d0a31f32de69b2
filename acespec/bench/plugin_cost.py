"""`acespec bench plugin-cost`: what a rule from AceSpec's vLLM plugin adds to vLLM's rejection sampler.

Runs vLLM's `rejection_sample` (as a CPU worker sets it up, patched by `acespec/cloud/vllm_plugin.py`)
on B requests of k token-only drafts over a V-token vocabulary, with no rule (vLLM's own strict
sampler) and with AceSpec rules, interleaved, and prints each one's median time and its ratio to
strict. Run it from the vLLM profile: `.venv-vllm/bin/acespec bench plugin-cost`. This is the sampler
alone; a step adds the model's pass, which on a real target is most of it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import numpy as np

from acespec.argtypes import pos_int
from acespec.cloud import vllm_plugin
from acespec.verify import RuleSpec


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "plugin-cost", help="vLLM's rejection sampler with and without AceSpec's rules (vLLM profile)"
    )
    p.add_argument("--batch", type=pos_int, default=64, help="requests in the step (default 64)")
    p.add_argument("--k", type=pos_int, default=4, help="draft tokens per request (default 4)")
    p.add_argument("--vocab", type=pos_int, default=151936, help="vocabulary (default 151936, Qwen2.5's)")
    p.add_argument(
        "--rules", default="typical,cactus", help="AceSpec rules to time against strict (default typical,cactus)"
    )
    p.add_argument("--reps", type=pos_int, default=7, help="interleaved repetitions (default 7)")
    p.set_defaults(func=cmd_plugin_cost)
    return p


def cmd_plugin_cost(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        print(
            "bench plugin-cost needs vLLM, which this Python lacks: run `bash scripts/setup.sh vllm`, then "
            ".venv-vllm/bin/acespec bench plugin-cost",
            file=sys.stderr,
        )
        return 2
    import torch  # heavy: the hf extra

    rules = ["strict"] + [r for r in args.rules.split(",") if r.strip()]
    specs = {r: RuleSpec.parse(r) for r in rules}
    rs = vllm_plugin.cpu_sampler()
    B, k, V = args.batch, args.k, args.vocab
    rng = np.random.default_rng(0)
    logits = torch.randn(B * k, V) * 3
    draft = torch.tensor(rng.integers(0, V, B * k), dtype=torch.int32)
    bonus = torch.tensor(rng.integers(0, V, (B, 1)), dtype=torch.int64)
    cu = torch.arange(k, B * k + 1, k, dtype=torch.int32)
    times: dict[str, list[float]] = {r: [] for r in rules}
    for _ in range(args.reps):
        for r in rules:  # interleaved, so drift on a noisy machine falls on every rule alike
            meta = vllm_plugin.sampling_metadata(B, {} if r == "strict" else {i: specs[r] for i in range(B)})
            x = logits.clone()
            t0 = time.perf_counter()
            rs.rejection_sample(draft, [k] * B, k, cu, None, x, bonus, meta)
            times[r].append(time.perf_counter() - t0)
    med = {r: statistics.median(ts) for r, ts in times.items()}
    print(
        f"=== acespec bench plugin-cost: vLLM's rejection sampler, {B} requests x {k} token-only drafts, vocabulary {V}, "
        f"medians of {args.reps} interleaved runs ==="
    )
    for r in rules:
        print(f"{r:10s} {1e3 * med[r]:9.1f} ms   {med[r] / med['strict']:5.2f}x vLLM's strict")
    return 0
