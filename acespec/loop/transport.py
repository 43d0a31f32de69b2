"""The loops' links to the target: for edge-led sessions blocks up, verdicts down, and what the link
measured on the way (`Transport`); for cloud-led ones steps down, drafts up (`LeadLink`, read by
`loop/follow.py`).

A `Transport` carries `Block`s to a target and brings its `BlockVerdict`s back in block order. The loop
does not care whether the target is a direct call (`LocalTransport`), a TCP connection through a WAN
(`acespec.edge.transports.TcpTransport`) or a simulated link on a virtual clock; it only needs the same
few facts about every link, so they are declared here rather than probed for:

- `rtt_samples`: recent round trips, each a verdict's arrival minus its block's send minus the
  target's verify time (queueing behind earlier blocks at the target stays in it, which is why the
  scheduler takes the minimum of the last few);
- `last_arrival`: when the latest verdict reached the edge;
- `link_samples`: the same trips with the bytes that crossed each way, for the bandwidth estimate.

All times are on the loop's clock. The defaults describe a link that measured nothing: the scheduler
then has no estimate and keeps to the configured window (a transport that never calls `_record` opts
out of timing openly, not because an attribute was missing).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from acespec.loop.records import Block, Disconnected, LinkSample
from acespec.loop.verifier import BlockVerdict, TargetVerifier

Clock = Callable[[], float]  # seconds, monotonic: time.perf_counter, or a simulator's virtual clock

RTT_SAMPLES_KEPT = 64  # recent round trips a transport keeps (the scheduler reads the last few)


class Transport(ABC):
    # Link timing (see the module docstring). Class-level defaults: a transport that measures nothing
    # still has them, and `_record` replaces them with bounded per-instance deques on first use.
    rtt_samples: Sequence[float] = ()
    last_arrival: float | None = None
    link_samples: Sequence[LinkSample] = ()

    @abstractmethod
    def send(self, block: Block) -> None: ...

    @abstractmethod
    def recv(self, timeout: float | None = None) -> BlockVerdict | Disconnected | None:
        """The next verdict, in block order; None if none arrived within `timeout` (None = wait)."""

    def resume(self, committed: Sequence[int]) -> int:
        """Re-establish the link, continuing from the `committed` tokens (prompt included); returns the
        agreed committed length."""
        raise RuntimeError("this transport cannot reconnect")

    def close(self) -> None:
        pass

    def _record(self, sample: LinkSample) -> None:
        """Keep one verdict's round trip (subclasses call this as each verdict arrives)."""
        links, rtts = self.link_samples, self.rtt_samples
        if not isinstance(links, deque) or not isinstance(rtts, deque):  # the first sample: the class's () until now
            links = self.link_samples = deque(maxlen=RTT_SAMPLES_KEPT)
            rtts = self.rtt_samples = deque(maxlen=RTT_SAMPLES_KEPT)
        links.append(sample)
        rtts.append(sample.rtt_s)
        self.last_arrival = sample.arrival


class LocalTransport(Transport):
    """Direct calls into a `TargetVerifier` in the same process: the single-process path.

    The verdict exists as soon as `send` returns, so its round trip is what the call cost beyond the
    verify itself (about zero), and that is what it reports: timing stays on, measuring a link that
    costs nothing."""

    def __init__(self, verifier: TargetVerifier, *, clock: Clock = time.perf_counter) -> None:
        self.verifier = verifier
        self.clock = clock
        self._out: deque[BlockVerdict] = deque()

    def send(self, block: Block) -> None:
        sent = self.clock()
        v = self.verifier.verify(block.seq, block.base, block.tokens, block.q)
        self._record(LinkSample(sent, self.clock(), v.verify_us / 1e6, 0, 0, len(block.tokens)))
        self._out.append(v)

    def recv(self, timeout: float | None = None) -> BlockVerdict | None:
        return self._out.popleft() if self._out else None


class StreamError(RuntimeError):
    """The cloud's stream does not fit what the edge holds (a gap, or a resume at another length)."""


@dataclass(frozen=True)
class StepChunk:
    """One cloud-led step as the edge receives it (a TOKENS frame with HAS_STEP)."""

    start: int  # position of tokens[0]
    tokens: tuple[int, ...]
    finished: bool
    drafted: int  # draft tokens the step verified (0: a plain step)
    accepted: int  # of which kept
    verify_s: float  # the step's target time
    arrived: float  # when the edge received it (the loop's clock)
    logprobs: tuple | None = None  # per token, when the session asked (TOKENS' HAS_LOGPROBS)


class LeadLink(ABC):
    """The edge's view of a cloud-led session: steps down, drafts up."""

    @abstractmethod
    def recv(self, timeout: float | None) -> StepChunk | Disconnected | None:
        """The next step (None if none within `timeout`; 0 = poll)."""

    @abstractmethod
    def send_draft(
        self, base: int, tokens: Sequence[int], q: np.ndarray | None, parents: Sequence[int] | None = None
    ) -> None:
        """Upload a chain that follows committed length `base` (a tree with `parents`, the wire's
        convention); `q`: [n, V] for rules that need it."""

    def resume(self, committed: Sequence[int]) -> int:
        """Reconnect; the cloud goes on streaming after the agreed committed length (returned)."""
        raise StreamError("this link cannot reconnect")

    def rtt_s(self) -> float | None:
        """The link's round-trip time as measured so far, if it knows it."""
        return None
