"""Device profiles for the trace-driven simulator: how fast the edge drafts and the cloud verifies.

A profile is a set of timings; the network is a separate `acespec.net.profile.WanProfile` (RTT, jitter,
up/down rate, loss), so any device profile can be replayed under any network.

Built-in profiles (the numbers are assumptions, each with its rationale next to it):

- `edge-npu+h200`: a phone-class NPU runs the 0.5B drafter; an H200-class GPU serves the 1.5B target.
- `edge-cpu+gpu`: a laptop CPU runs the drafter (llama.cpp); a commodity inference GPU (L4 / A10 class)
  serves the target.
- `cpu-here`: this development machine, from the timings a trace file recorded (`from_timings`).
- `cpu-split` (`from_cost`): this machine as `acespec bench cost --cores split` measured it, drafter and
  target each on its own core like two devices; `bench sim --validate` calibrates with it.

A drafter call that evaluates n tokens at once (a prompt, a catch-up after a verdict, a batched
pre-draft step over n cache outcomes) costs `draft_call_s`: the measured table where it has n, else
one decode step plus the prefill rate per further token. A cloud pass costs `pass_s`: t_v over the
tokens it verifies, plus the prompt tokens it prefills.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DeviceProfile", "DEVICE_PROFILES", "device_profile", "measured_cloud"]


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    draft_s_per_token: float  # edge: one drafter decode step (one token), seconds
    draft_prefill_s_per_token: float  # edge: drafter prompt processing, seconds per prompt token
    verify_c0_s: float  # cloud: a verify pass with no draft tokens (= one plain decode step), seconds
    verify_c1_s: float  # cloud: extra verify time per draft token in the pass, seconds
    target_prefill_s_per_token: float  # cloud: target prompt processing (first pass only), seconds per token
    verify_table_s: tuple[float, ...] = ()  # measured t_v(K) for K = 0, 1, ...; overrides c0 + c1 K where given
    cloud_overhead_s: float = 0.0  # cloud: per-pass work besides the model (framing, scheduling), seconds
    edge_overhead_s: float = 0.0005  # edge: per-verdict bookkeeping (decode, apply, controller), seconds
    draft_table_s: tuple[
        float, ...
    ] = ()  # measured drafter call evaluating n = 1, 2, ... tokens at once (overrides the rates)
    draft_choose_s: float = 0.0  # edge: picking a token (and ranking candidates) from one vocabulary-sized row
    verify_row_s: float = 0.0  # cloud: turning one target row into probabilities and judging it
    notes: tuple[str, ...] = field(default=(), compare=False)  # assumptions, one line each

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not (v >= 0.0):
                raise ValueError(f"DeviceProfile.{f.name} must be >= 0, got {v}")

    def verify_s(self, k: int) -> float:
        """t_v(K): one cloud pass verifying K draft tokens (K = 0: a plain decode step)."""
        t = self.verify_table_s
        if k < len(t):
            base = t[k]
        elif len(t) >= 2:  # extend the measured table linearly with its last slope
            base = t[-1] + (k - len(t) + 1) * max(0.0, t[-1] - t[-2])
        elif t:
            base = t[0] + k * self.verify_c1_s
        else:
            base = self.verify_c0_s + self.verify_c1_s * k
        return base + self.cloud_overhead_s

    def pass_s(self, ks, prefill: int = 0) -> float:
        """One accelerator pass: verifying ks[i] draft tokens for each session in it (t_v over all the
        tokens of the pass, one row per session beyond its drafts) and prefilling `prefill` prompt tokens."""
        rows = sum(k + 1 for k in ks)
        t = self.verify_s(rows - 1) + rows * self.verify_row_s if len(ks) else 0.0
        if prefill:
            t += prefill * self.target_prefill_s_per_token + (0.0 if len(ks) else self.cloud_overhead_s)
        return t

    def draft_call_s(self, sizes) -> float:
        """One drafter call evaluating sizes[i] new tokens for each sequence in it (one batch)."""
        n = int(sum(sizes))
        if n <= 0:
            return 0.0
        t = self.draft_table_s
        pick = (
            len(sizes) * self.draft_choose_s
        )  # a token chosen per sequence (a prompt prefill chooses none: a few ms off)
        if n <= len(t):
            return t[n - 1] + pick
        if t:
            return t[-1] + (n - len(t)) * self.draft_prefill_s_per_token + pick
        return self.draft_s_per_token + (n - 1) * self.draft_prefill_s_per_token + pick

    @property
    def cloud_step_s(self) -> float:
        """Cloud-only decoding: one target step per token."""
        return self.verify_s(0)

    def replace(self, **kw) -> DeviceProfile:
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        tv = ", ".join(f"{1e3 * self.verify_s(k):.1f}" for k in (0, 1, 4, 8))
        s = (
            f"{self.name}: draft {1e3 * self.draft_s_per_token:.1f} ms/token (prefill {1e3 * self.draft_prefill_s_per_token:.2f} ms/token), "
            f"verify t_v(0,1,4,8) = {tv} ms, target prefill {1e3 * self.target_prefill_s_per_token:.3f} ms/token"
        )
        return s

    @classmethod
    def from_timings(cls, timings: dict, name: str = "cpu-here") -> DeviceProfile:
        """The `cpu-here` profile from the timings a trace file recorded on this machine."""
        if not timings:
            raise ValueError("the trace file has no measured timings; record it with `acespec bench sim --record`")
        # t_v(K) cannot fall as K grows: smooth the noisy measured table with isotonic regression
        table = tuple(_isotonic([float(x) for x in timings["verify_s"]]))
        return cls(
            name=name,
            draft_s_per_token=float(timings["draft_s_per_token"]),
            draft_prefill_s_per_token=float(timings.get("draft_prefill_s_per_token", 0.0)),
            verify_c0_s=table[0],
            verify_c1_s=max(0.0, (table[-1] - table[0]) / max(1, len(table) - 1)),
            target_prefill_s_per_token=float(timings.get("target_prefill_s_per_token", 0.0)),
            verify_table_s=table,
            cloud_overhead_s=float(timings.get("cloud_overhead_s", 0.0005)),  # asyncio + framing in the server
            edge_overhead_s=float(timings.get("edge_overhead_s", 0.0005)),
            notes=(
                "measured on this machine when the trace was recorded (TargetVerifier.verify and ChainDrafter.draft code paths)",
            ),
        )

    @classmethod
    def from_cost(cls, cost: dict, name: str = "cpu-split") -> DeviceProfile:
        """This machine as `acespec bench cost` measured it (its JSON): the drafter's call table, t_v(K) =
        the target evaluating K + 1 tokens, and both prompt-prefill rates."""
        d, t = cost["models"]["drafter"], cost["models"]["target"]
        sizes = [int(n) for n in cost["sizes"]]
        if sizes != list(range(1, len(sizes) + 1)):
            raise ValueError(
                f"the cost file must measure every size from 1 (it has {sizes}); run `acespec bench cost --sizes 1-N`"
            )
        draft_tab = tuple(_isotonic([float(x) for x in d["seconds"]]))
        verify_tab = tuple(_isotonic([float(x) for x in t["seconds"]]))
        pre = cost.get("prefill", {})
        rows = dict(cost.get("rows", {}))
        overhead = float(cost.get("cloud_overhead_s", 0.0005))
        eng = cost.get("engine")
        if eng and list(eng["ks"]) == list(range(len(eng["ks"]))):
            # passes timed through the serving engine already hold the rule, the rollback and the
            # engine's own hops: take them as t_v(K), with nothing added on top
            verify_tab = tuple(_isotonic([float(x) for x in eng["verify_s"]]))
            rows["verify_row_s"], overhead = 0.0, 0.0
        target_prefill = float(pre.get("target_s_per_token", t["c1_s"]))
        first, n_prompt = (eng or {}).get("first_token_s"), int(cost.get("prompt_tokens", 0))
        if first is not None and n_prompt > 1:
            # the prefill as the serving engine runs it (chunks, one a tick), the way the simulated
            # cloud charges it: the prompt but its last token, then a step for the first token
            target_prefill = max(0.0, (float(first) - verify_tab[0]) / (n_prompt - 1))
        return cls(
            name=name,
            draft_s_per_token=draft_tab[0],
            draft_prefill_s_per_token=float(pre.get("drafter_s_per_token", d["c1_s"])),
            verify_c0_s=verify_tab[0],
            verify_c1_s=max(0.0, float(t["c1_s"])),
            target_prefill_s_per_token=target_prefill,
            verify_table_s=verify_tab,
            cloud_overhead_s=overhead,  # asyncio + framing in the server
            edge_overhead_s=float(cost.get("edge_overhead_s", 0.0005)),  # frame decode + the loop's bookkeeping
            draft_table_s=draft_tab,
            draft_choose_s=float(rows.get("draft_choose_s", 0.0)),
            verify_row_s=float(rows.get("verify_row_s", 0.0)),
            notes=(
                f"measured on this machine by `acespec bench cost --cores {cost.get('cores', '?')}`: drafter and "
                "target calls of n tokens, prompt prefill rates",
            ),
        )


def _isotonic(y: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in y:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    out: list[float] = []
    for m, w in blocks:
        out.extend([m] * int(w))
    return out


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    "edge-npu+h200": DeviceProfile(
        name="edge-npu+h200",
        draft_s_per_token=0.012,  # 0.5B Q4 drafter on a phone NPU: ~80 tok/s decode incl. the app's sampling loop
        draft_prefill_s_per_token=0.001,  # NPUs are built for batched matmuls: ~1000 tok/s prompt processing for 0.5B
        verify_c0_s=0.018,  # 1.5B target step on an H200-class GPU at batch 1 through a serving stack (launch/latency bound)
        verify_c1_s=0.0004,  # each extra token in the pass is nearly free: the step is memory-bound, weights are read once
        target_prefill_s_per_token=0.00005,  # prompt prefill of a 1.5B model on an H200: ~20k tok/s
        cloud_overhead_s=0.0,  # already inside the 18 ms step
        edge_overhead_s=0.0005,  # verdict decode + loop bookkeeping on a phone CPU
        notes=(
            "drafter 12 ms/token: 0.5B Q4 on a phone NPU (~80 tok/s decode incl. sampling)",
            "drafter prefill 1 ms/token: NPU prompt processing is batched matmul, ~1000 tok/s for 0.5B",
            "t_v(K) = 18 ms + 0.4 ms*K: batch-1 decode of 1.5B on an H200 is latency/memory bound; extra tokens ride along",
            "cloud-only step = t_v(0) = 18 ms",
            "target prefill 0.05 ms/token: compute-bound prefill of 1.5B on an H200",
        ),
    ),
    "edge-cpu+gpu": DeviceProfile(
        name="edge-cpu+gpu",
        draft_s_per_token=0.035,  # 0.5B Q4_K_M with llama.cpp on a 4-8 core laptop CPU: ~30 tok/s
        draft_prefill_s_per_token=0.005,  # llama.cpp CPU prompt processing for 0.5B: ~200 tok/s
        verify_c0_s=0.020,  # 1.5B target step on an L4/A10-class GPU at batch 1 through a serving stack
        verify_c1_s=0.001,  # less compute headroom than an H200: ~1 ms per extra verified token
        target_prefill_s_per_token=0.0002,  # ~5k tok/s prefill for 1.5B on an L4-class GPU
        cloud_overhead_s=0.0,
        edge_overhead_s=0.0005,
        notes=(
            "drafter 35 ms/token: 0.5B Q4_K_M, llama.cpp, laptop CPU (~30 tok/s)",
            "drafter prefill 5 ms/token: llama.cpp CPU prompt processing (~200 tok/s)",
            "t_v(K) = 20 ms + 1 ms*K: 1.5B at batch 1 on an L4/A10-class GPU",
            "target prefill 0.2 ms/token (~5k tok/s)",
        ),
    ),
}


def device_profile(name: str, timings: dict | None = None) -> DeviceProfile:
    """A built-in profile by name; `cpu-here` needs the timings recorded in a trace file."""
    if name == "cpu-here":
        return DeviceProfile.from_timings(timings or {})
    try:
        return DEVICE_PROFILES[name]
    except KeyError:
        known = ", ".join(["cpu-here", *DEVICE_PROFILES])
        raise ValueError(f"unknown device profile {name!r}; choose one of {known}") from None


def measured_cloud(base: DeviceProfile, path: str, shape: str, *, name: str | None = None) -> DeviceProfile:
    """`base` with its cloud timings replaced by a measured device profile file (`scripts/gpu-check.sh`,
    `acespec/bench/gpu_profile.py`): t_v(K) of one session from the file, interpolated between the K it
    measured and made non-decreasing. The file's batched table, t(B sessions x T new tokens), stays in
    the file for the capacity simulation."""
    with open(path) as f:
        d = json.load(f)
    if d.get("format") != "acespec-device-profile":
        raise ValueError(f"{path} is not an AceSpec device profile file")
    try:
        m = d["models"][shape]
    except KeyError:
        raise ValueError(f"{path} has no measurements for shape {shape!r} (it has {', '.join(d['models'])})") from None
    ks = sorted(int(k) for k in m["verify_s"])
    vs = [float(m["verify_s"][str(k)]) for k in ks]
    table = _isotonic([float(np.interp(k, ks, vs)) for k in range(ks[-1] + 1)])
    note = f"cloud: measured on {d.get('device', '?')} with {d.get('engine', '?')}, {shape} shape, {d.get('when', '')}"
    return base.replace(
        name=name or f"{base.name}@{d.get('device', 'measured')}",
        verify_c0_s=table[0],
        verify_c1_s=max(0.0, (table[-1] - table[0]) / max(1, len(table) - 1)),
        verify_table_s=tuple(table),
        cloud_overhead_s=0.0,
        notes=base.notes + (note,),
    )
