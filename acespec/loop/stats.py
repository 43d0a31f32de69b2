"""Run statistics, named as in docs/concepts/glossary.md (same definitions as vLLM, so numbers compare)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RunStats:
    rounds: int = 0  # verifications of a draft block by the target (plain target steps included)
    dropped: int = 0  # blocks the target dropped as built on a stale prefix
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens kept
    emitted: int = 0  # tokens generated
    pos_drafted: list[int] = field(default_factory=list)  # per block position: times drafted
    pos_accepted: list[int] = field(default_factory=list)  # per block position: times accepted
    wall_s: float = 0.0  # first call to last token
    ttft_s: float = 0.0  # time to first token
    draft_s: float = 0.0  # edge time spent drafting
    draft_tokens: int = (
        0  # tokens drafted in that time, verified or not (a doomed block's, a chain's the stream passed)
    )
    verify_s: float = 0.0  # target time spent verifying (as the target reported it)
    wait_s: float = 0.0  # edge time blocked waiting for a verdict
    token_times: list[float] = field(default_factory=list)  # per emitted token: seconds since start
    bytes_up: int = 0  # uplink bytes (network modes)
    bytes_down: int = 0  # downlink bytes (network modes)
    k_chosen: list[int] = field(default_factory=list)  # draft depth chosen per block
    rejections: int = 0  # blocks whose drafts the target stopped short of (a token it judged and refused)
    passes: list[tuple[int, float]] = field(
        default_factory=list
    )  # per target pass the target reported: (draft tokens, seconds)
    cache: dict = field(default_factory=dict)  # the state cache's counts (lookups, hits, branches), when one runs
    link: dict = field(default_factory=dict)  # the link to the cloud: rtt_ms_mean, reconnects, failovers, ...
    lead: dict = field(
        default_factory=dict
    )  # a cloud-led stream's: drafts_sent, drafter_joined_at, contention_rests, ...

    def observe_block(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted < drafted:
            self.rejections += 1
        while len(self.pos_drafted) < drafted:
            self.pos_drafted.append(0)
            self.pos_accepted.append(0)
        for i in range(drafted):
            self.pos_drafted[i] += 1
            if i < accepted:
                self.pos_accepted[i] += 1

    def observe_tokens(self, n: int, now: float) -> None:
        """`n` tokens emitted at `now` (seconds since the start): the count, each token's time, and the time to
        the first token. Every loop (edge-led, cloud-led, the edge's cloud-only stream, the simulator's) counts
        its output through this one place."""
        if self.emitted == 0 and n:
            self.ttft_s = now
        self.emitted += n
        self.token_times.extend([now] * n)

    @property
    def mean_acceptance_length(self) -> float:
        """tau = 1 + accepted / rounds."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    def observe_pass(self, drafted: int, seconds: float) -> None:
        """One target pass as the target reported it (`BlockVerdict.verify_us`): what `sim.ceiling` calibrates on."""
        self.verify_s += seconds
        self.passes.append((drafted, seconds))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def target_passes_per_token(self) -> float:
        return self.rounds / self.emitted if self.emitted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.wall_s if self.wall_s > 0 else 0.0

    def steady(self) -> tuple[int, float]:
        """(tokens committed after the first commit, seconds from it to the last): a stream's steady rate,
        without the prompt's prefill before the first token, nor the tokens that came with it for free."""
        t = self.token_times
        if not t:
            return 0, 0.0
        return sum(1 for x in t if x > t[0]), t[-1] - t[0]

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]

    def inter_token_latency(self) -> tuple[float, float]:
        """(p50, p99) seconds between tokens; tokens committed together share the gap that preceded them."""
        t = np.asarray(self.token_times)
        if len(t) < 2:
            return 0.0, 0.0
        gaps = np.diff(t)
        # spread each commit event's gap over the tokens it delivered, as a streaming reader sees it
        out = []
        i = 0
        while i < len(gaps):
            j = i
            while j + 1 < len(gaps) and gaps[j + 1] == 0.0:
                j += 1
            n = j - i + 1
            out.extend([gaps[i] / n] * n)
            i = j + 1
        arr = np.asarray(out)
        return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))

    def summary(self) -> dict:
        p50, p99 = self.inter_token_latency()
        d = {
            "rounds": self.rounds,
            "dropped": self.dropped,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_passes_per_token": round(self.target_passes_per_token, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "tokens_per_s": round(self.tokens_per_s, 3),
            "wall_s": round(self.wall_s, 4),
            "ttft_s": round(self.ttft_s, 4),
            "itl_p50_s": round(p50, 5),
            "itl_p99_s": round(p99, 5),
            "draft_s": round(self.draft_s, 4),
            "draft_tokens": self.draft_tokens,
            "verify_s": round(self.verify_s, 4),
            "wait_s": round(self.wait_s, 4),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "mean_k": round(float(np.mean(self.k_chosen)), 3) if self.k_chosen else 0.0,
        }
        if self.emitted:
            d["bytes_up_per_token"] = round(self.bytes_up / self.emitted, 3)
            d["bytes_down_per_token"] = round(self.bytes_down / self.emitted, 3)
        for name in ("cache", "link", "lead"):
            if getattr(self, name):
                d[name] = dict(getattr(self, name))
        return d

    def to_dict(self) -> dict:
        return asdict(self)


def draft_timeliness(stats) -> float | None:
    """A cloud-led stream's draft timeliness: the share of its steps (the target passes the cloud
    reported) that verified a draft of the edge's, over every RunStats in `stats`; None with no pass.
    A step without one is a plain step: the draft was late, wrong about the prefix, or priced out."""
    drafted = [d for st in stats for d, _ in st.passes]
    return sum(d > 0 for d in drafted) / len(drafted) if drafted else None
