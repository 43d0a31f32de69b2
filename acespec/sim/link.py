"""The simulated network: one direction of a WAN path, and the byte size of every frame on it.

A frame of B bytes is serialised at the link's rate, FIFO behind the frames before it
(8 (B + 52 per 1448-byte segment) / rate: TCP/IP headers cost time, not wire bytes), then travels
RTT/2 + U(-jitter/2, +jitter/2) (clamped >= 0, never reordering); a frame that loses a segment arrives
max(200 ms, 2 RTT) later, a retransmission. A varying profile (`WanProfile.switch_s`) applies the
phase in force when the frame is sent. Sizes are those of `acespec.wire.encode`, with the trace's real
token ids, so bytes per token match the live wire.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from acespec import wire as wf
from acespec.net.profile import MIN_RTO_MS, WanProfile
from acespec.sim.kernel import Kernel

__all__ = ["FrameSizer", "SimLink", "SEGMENT", "PACKET_OVERHEAD"]

SEGMENT = 1448  # TCP payload per segment
PACKET_OVERHEAD = 52  # TCP/IP header bytes per segment (counted in serialisation time, not in wire bytes)
SIM_SESSION_ID = 1 << 20  # session ids are random below 2**21 (protocol v2): most take 3 varint bytes


class FrameSizer:
    """Bytes of each frame as `acespec.wire.encode` writes it. `q_topn` > 0: every drafted token also
    carries a q row of that many (id, prob) entries, as rules that read q send them (`EdgeConfig.q_topn`);
    the traces are greedy, so this prices the wire of such a rule, not its acceptance."""

    def __init__(self, q_topn: int = 0) -> None:
        if q_topn < 0:
            raise ValueError(f"q_topn must be >= 0, got {q_topn}")
        self.wf = wf
        self.q_topn = q_topn
        # large ids and distinct probabilities: the varints and floats a real row costs
        self._q_row = tuple((150_000 - 37 * j, 0.5 / (j + 1)) for j in range(q_topn))

    def _enc(self, frame) -> int:
        return len(self.wf.encode(frame))

    def hello(self, prompt: Iterable[int], max_tokens: int, cloud_only: bool) -> int:
        wf = self.wf
        return self._enc(
            wf.Hello(
                model_id="vocab:151936:0123456789abcdef",
                max_tokens=max_tokens,
                prompt=tuple(prompt),
                temperature=0.0,
                rule="greedy",
                mode=wf.Mode.CLOUD_ONLY if cloud_only else wf.Mode.SPECULATIVE,
            )
        )

    def welcome(self, committed: int) -> int:
        return self._enc(
            self.wf.Welcome(session=SIM_SESSION_ID, committed=committed, max_draft_tokens=64, secret=bytes(32))
        )

    def draft(self, seq: int, base: int, tokens: tuple[int, ...], parents: tuple[int, ...] | None = None) -> int:
        q = (self._q_row,) * len(tokens) if self.q_topn else None
        return self._enc(self.wf.Draft(session=SIM_SESSION_ID, seq=seq, base=base, tokens=tokens, q=q, parents=parents))

    def verdict(
        self, seq: int, accepted: int, next_token: int, verify_us: int, committed: int, dropped: bool, finished: bool
    ) -> int:
        return self._enc(
            self.wf.Verdict(
                seq=seq,
                accepted=accepted,
                next_token=max(0, next_token),
                verify_us=verify_us,
                committed=committed,
                dropped=dropped,
                finished=finished,
            )
        )

    def tokens(
        self, start: int, toks: tuple[int, ...], finished: bool, step: tuple[int, int, int] | None = None
    ) -> int:
        """A TOKENS frame; `step` = (drafted, accepted, verify_us) for a cloud-led step."""
        drafted, accepted, verify_us = (None, 0, 0) if step is None else step
        return self._enc(
            self.wf.Tokens(
                start=start, tokens=toks, finished=finished, drafted=drafted, accepted=accepted, verify_us=verify_us
            )
        )


class SimLink:
    """One direction of one edge's path."""

    def __init__(self, kernel: Kernel, net: WanProfile, up: bool, rng: np.random.Generator) -> None:
        self.k, self.net, self.up, self.rng = kernel, net, up, rng
        self.free = 0.0  # when the serialiser is next idle
        self.last_arrival = 0.0
        self.bytes = 0
        self.frames = 0

    def send(self, nbytes: int, deliver: Callable[[float], None]) -> float:
        """Put a frame of `nbytes` on the link; `deliver(arrival)` runs when it arrives. Returns the arrival."""
        now = self.k.t
        net = self.net.at(now)
        bps = net.up_bps if self.up else net.down_bps
        self.bytes += nbytes
        self.frames += 1
        segs = max(1, math.ceil(nbytes / SEGMENT))
        start = max(now, self.free)
        self.free = start + (8.0 * (nbytes + PACKET_OVERHEAD * segs) / bps if bps > 0 else 0.0)
        delay = net.rtt_ms / 2e3
        if net.jitter_ms > 0:
            delay = max(0.0, delay + self.rng.uniform(-net.jitter_ms / 2e3, net.jitter_ms / 2e3))
        if net.loss_pct > 0 and self.rng.random() < 1.0 - (1.0 - net.loss_pct / 100.0) ** segs:
            delay += max(MIN_RTO_MS, 2.0 * net.rtt_ms) / 1e3
        arrival = max(self.free + delay, self.last_arrival)
        self.last_arrival = arrival
        self.k.at(arrival, lambda: deliver(arrival))
        return arrival
