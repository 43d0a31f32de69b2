"""Cloud capacity at internet scale: N edges on one cloud GPU, simulated.

Each edge is a `SimEdge` (the live edge's loop on virtual time, replaying a recorded trace) on an edge
NPU profile, behind its own WAN path; RTTs differ per edge (`RTT_MIX`). All of them share one
`SimCloud` whose passes batch every session's next block, priced by a batched cost curve (`GpuCost`):
a pass over B sessions carrying T new tokens in all costs

    t(B, T) = step_s + token_s * T + session_s * B   (+ prefill_token_s per prompt token prefilled)

The default curve (`H200_1P5B`) is an assumption with its rationale beside each number; a measured one
replaces it (`GpuCost.from_profile`) once `scripts/gpu-check.sh` has run on a GPU (a least-squares fit
of its table of passes). Reported per mode and N: per-user tokens/s (mean and 10th percentile), cloud
GPU-seconds per 1,000 tokens, and users served per GPU at >= 20 tokens/s each (the largest N whose 10th
percentile user still gets 20 tokens/s).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from acespec.net.profile import WanProfile
from acespec.sim.cloud import SimCloud
from acespec.sim.edge import SimEdge, parse_mode
from acespec.sim.kernel import Kernel
from acespec.sim.link import FrameSizer
from acespec.sim.profiles import DeviceProfile
from acespec.sim.trace import PromptTrace

__all__ = ["GpuCost", "H200_1P5B", "RTT_MIX", "run_capacity", "users_served", "TARGET_TOK_S"]

TARGET_TOK_S = 20.0  # a user is served when they get at least this many tokens/s
# Where edges sit: (share of edges, RTT range in ms): same region, same continent, far away or on mobile
RTT_MIX = ((0.3, (20.0, 50.0)), (0.4, (50.0, 120.0)), (0.3, (120.0, 250.0)))


@dataclass(frozen=True)
class GpuCost:
    name: str
    step_s: float  # a pass's fixed cost: kernel launches, scheduling, sampling (what batch 1 pays)
    token_s: float  # each new token in the pass, once the batch is compute-bound
    session_s: float  # each session in the pass: reading its KV cache
    prefill_token_s: float  # each prompt token prefilled
    notes: tuple[str, ...] = field(default=(), compare=False)

    def pass_s(self, ks: Sequence[int], prefill: int = 0) -> float:
        """A pass verifying ks[i] draft tokens for session i (T = sum(k + 1)) and prefilling `prefill` tokens."""
        t = self.step_s + self.token_s * sum(k + 1 for k in ks) + self.session_s * len(ks)
        return t + self.prefill_token_s * prefill

    def describe(self) -> str:
        return (
            f"{self.name}: t(B, T) = {1e3 * self.step_s:.1f} ms + {1e6 * self.token_s:.1f} us x T + "
            f"{1e6 * self.session_s:.1f} us x B; prefill {1e6 * self.prefill_token_s:.1f} us/token"
        )

    @classmethod
    def from_profile(cls, path: str, shape: str = "1.5b") -> GpuCost:
        """The measured curve: a least-squares fit of t = a + b T + c B to the passes in a device profile
        file written by `scripts/gpu-check.sh` (`acespec.bench.gpu_profile`)."""
        with open(path) as f:
            d = json.load(f)
        if d.get("format") != "acespec-device-profile":
            raise ValueError(f"{path} is not an AceSpec device profile file")
        try:
            rows = d["models"][shape]["passes"]
        except KeyError:
            raise ValueError(f"{path} has no batched passes for shape {shape!r}") from None
        X = np.array([[1.0, r["total_tokens"], r["batch"]] for r in rows])
        y = np.array([r["seconds"] for r in rows])
        (a, b, c), *_ = np.linalg.lstsq(X, y, rcond=None)
        return cls(
            f"{d.get('device', 'measured')} {shape}",
            max(0.0, float(a)),
            max(0.0, float(b)),
            max(0.0, float(c)),
            max(0.0, float(b)),
            notes=(
                f"fitted to {len(rows)} passes measured on {d.get('device', '?')} with "
                f"{d.get('engine', '?')} ({d.get('when', '')})",
            ),
        )


H200_1P5B = GpuCost(
    name="h200 1.5b (assumed)",
    step_s=0.018,  # batch-1 step through a serving stack, as the edge-npu+h200 profile assumes for one session
    token_s=6.3e-6,  # 2 x 1.5e9 FLOP per token at ~50% of the H200's 989 TFLOP/s (bf16 dense)
    session_s=5e-6,  # KV of ~600 context tokens x 28 KB/token (Qwen2.5-1.5B, bf16) read at ~70% of 4.8 TB/s
    prefill_token_s=6.3e-6,  # prompt tokens: compute-bound like the verified ones
    notes=(
        "step 18 ms: batch-1 latency of a 1.5B model through a serving stack (same as edge-npu+h200)",
        "6.3 us per token in the pass: 3 GFLOP/token at ~50% of 989 TFLOP/s",
        "5 us per session in the pass: ~17 MB of KV read per pass at ~3.4 TB/s",
    ),
)


def _rtts(n: int, rng: np.random.Generator) -> list[float]:
    shares = np.array([s for s, _ in RTT_MIX])
    bands = rng.choice(len(RTT_MIX), size=n, p=shares / shares.sum())
    return [float(rng.uniform(*RTT_MIX[b][1])) for b in bands]


def run_capacity(
    traces: Sequence[PromptTrace],
    n_edges: int,
    mode: str,
    gpu: GpuCost,
    edge: DeviceProfile,
    *,
    net: WanProfile | None = None,
    seed: int = 0,
    arrivals_s: float = 1.0,
) -> dict:
    """`n_edges` edges, each replaying a trace (in turn) from a start drawn uniformly over `arrivals_s`,
    on one GPU. `net`: each edge's path (jitter, rates, loss), its RTT drawn from RTT_MIX."""
    if not traces:
        raise ValueError("no traces to replay")
    net = net or WanProfile(jitter_ms=10.0, up_bps=5e6, down_bps=20e6)
    rng = np.random.default_rng([seed, n_edges])
    kernel = Kernel()
    cloud = SimCloud(kernel, gpu, FrameSizer())
    cfg = parse_mode(mode)
    rtts = _rtts(n_edges, rng)
    starts = rng.uniform(0.0, arrivals_s, size=n_edges)
    edges = [
        SimEdge(
            kernel,
            cloud,
            traces[i % len(traces)],
            edge,
            WanProfile(
                rtt_ms=rtts[i],
                jitter_ms=net.jitter_ms,
                up_bps=net.up_bps,
                down_bps=net.down_bps,
                loss_pct=net.loss_pct,
                seed=int(seed) * 100003 + i,
            ),
            cfg,
            cloud.sizer,
            seed=i,
            start=float(starts[i]),
            name=f"edge{i}",
        )
        for i in range(n_edges)
    ]
    kernel.run()
    stalled = [i for i, e in enumerate(edges) if e.result is None]
    if stalled:
        raise RuntimeError(f"{len(stalled)} simulated edge(s) stalled ({mode}, N = {n_edges})")
    results = [e.result for e in edges if e.result is not None]  # all of them: none stalled
    rates = np.array([r.tokens_per_s for r in results])
    tokens = sum(r.n for r in results)
    return {
        "mode": mode,
        "n_edges": n_edges,
        "tokens": tokens,
        "user_tok_s_mean": round(float(rates.mean()), 3),
        "user_tok_s_p10": round(float(np.percentile(rates, 10)), 3),
        "user_tok_s_p50": round(float(np.percentile(rates, 50)), 3),
        "gpu_s_per_1k_tokens": round(1e3 * cloud.busy_s / tokens, 4),
        "passes": cloud.passes,
        "sessions_per_pass": round(float(np.mean(cloud.pass_sizes)), 2) if cloud.pass_sizes else 0.0,
        "gpu_busy": round(cloud.busy_s / kernel.t, 4) if kernel.t > 0 else 0.0,
        "sim_s": round(kernel.t, 3),
        "served": int((rates >= TARGET_TOK_S).sum()),
    }


def users_served(rows: Sequence[dict], mode: str) -> int:
    """The largest N simulated for `mode` whose 10th-percentile user gets >= TARGET_TOK_S (0 if none)."""
    ok = [r["n_edges"] for r in rows if r["mode"] == mode and r["user_tok_s_p10"] >= TARGET_TOK_S]
    return max(ok, default=0)


def sweep(
    traces: Sequence[PromptTrace],
    ns: Sequence[int],
    modes: Sequence[str],
    gpu: GpuCost,
    edge: DeviceProfile,
    *,
    seed: int = 0,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    rows = []
    for n in ns:
        for mode in modes:
            row = run_capacity(traces, n, mode, gpu, edge, seed=seed)
            rows.append(row)
            if progress:
                progress(row)
    return rows
