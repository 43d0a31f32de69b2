"""The loops' two links over a `CloudSession` (`edge/client.py`): `TcpTransport` for edge-led sessions
(DRAFT blocks up, VERDICT frames down) and `TcpLeadLink` for cloud-led ones (TOKENS steps down, DRAFT
chains up). They plug the network into the same `SpecLoop` and follow loop the single-process path
uses, which see only `loop.transport.Transport` and `loop.transport.LeadLink`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from acespec import wire
from acespec.edge.client import CloudSession, EdgeError, link_failure
from acespec.loop.records import Block, Disconnected, LinkSample
from acespec.loop.transport import LeadLink, StepChunk, Transport
from acespec.loop.verifier import BlockVerdict


def sparse_rows(q: np.ndarray) -> tuple[tuple[tuple[int, float], ...], ...]:  # q: [n, V]
    """Dense rows of an already-truncated q -> the wire's (id, prob) rows."""
    out = []
    for row in q:
        ids = np.flatnonzero(row)
        ids = ids[np.argsort(-row[ids], kind="stable")]
        out.append(tuple((int(i), float(np.float32(row[i]))) for i in ids))
    return tuple(out)


class TcpTransport(Transport):
    """DRAFT frames up, VERDICT frames down, over a `CloudSession`. Its link timing (see
    `acespec.loop.transport`) is stamped with time.perf_counter, the loop's default clock: the
    reader thread stamps each frame as it is decoded, so a verdict's arrival does not wait for the
    loop to poll."""

    def __init__(self, session: CloudSession, *, send_q: bool) -> None:
        self.s = session
        self.send_q = send_q
        self.sent_at: dict[
            int, tuple[float, int, int]
        ] = {}  # blocks in flight only: (sent, frame bytes, tokens); popped by their verdict, cleared on resume
        self.rtt_sum = 0.0  # over every round trip, for the mean
        self.rtt_count = 0
        self._down_seen = 0  # the link's received bytes at the previous verdict

    def send(self, block: Block) -> None:
        q = sparse_rows(block.q) if (self.send_q and block.q is not None and len(block.tokens)) else None
        frame = wire.Draft(session=self.s.sid, seq=block.seq, base=block.base, tokens=tuple(block.tokens), q=q)
        link = self.s.link
        before = link.bytes_up
        sent = time.perf_counter()
        link.send(frame)  # a failed send shows up as Disconnected on recv
        self.sent_at[block.seq] = (sent, link.bytes_up - before, len(block.tokens))

    def recv(self, timeout: float | None = None):
        while True:
            item = self.s.link.get(self.s.cfg.reply_timeout_s if timeout is None else timeout)
            if item is None:
                if timeout is None:
                    return Disconnected("no verdict within the reply timeout")
                return None
            t, f = item
            if isinstance(f, wire.Verdict):
                self._arrived(t, f)
                return BlockVerdict(
                    f.seq,
                    f.accepted,
                    f.next_token if not f.dropped else -1,
                    f.committed,
                    f.verify_us,
                    dropped=f.dropped,
                    finished=f.finished,
                )
            failure = link_failure(f)
            if isinstance(failure, EdgeError):
                raise failure
            if failure is not None:
                return failure

    def _arrived(self, t: float, f: wire.Verdict) -> None:
        sent = self.sent_at.pop(f.seq, None)
        if sent is None:  # a block sent before a resume: its timing is void
            self.last_arrival = t
            return
        sent_at, up, tokens = sent
        # the bytes received since the previous verdict: this verdict's frame (and any PONG), counted
        # without encoding the frame again
        down = self.s.link.bytes_down
        down, self._down_seen = (down - self._down_seen if down >= self._down_seen else down), down
        sample = LinkSample(sent_at, t, f.verify_us / 1e6, up, down, tokens)
        self._record(sample)
        self.rtt_sum += sample.rtt_s
        self.rtt_count += 1

    def resume(self, committed: Sequence[int]) -> int:
        self.sent_at.clear()
        return self.s.resume(committed)

    def close(self) -> None:
        self.s.close()


class TcpLeadLink(LeadLink):
    """A cloud-led session over a `CloudSession`: TOKENS steps down, DRAFT chains up (`loop.follow`).
    PINGs every `ping_every_s` measure the round trip the edge's lead depth prices."""

    def __init__(self, session: CloudSession, *, send_q: bool, ping_every_s: float = 1.0) -> None:
        self.s = session
        self.send_q = send_q
        self.ping_every_s = ping_every_s
        self._rtt: float | None = None
        self._pinged = 0.0
        self._seq = 0

    def rtt_s(self) -> float | None:
        return self._rtt

    def send_draft(
        self, base: int, tokens: Sequence[int], q: np.ndarray | None, parents: Sequence[int] | None = None
    ) -> None:
        self._seq += 1
        rows = sparse_rows(q) if (self.send_q and q is not None) else None
        self.s.link.send(
            wire.Draft(
                session=self.s.sid,
                seq=self._seq,
                base=base,
                tokens=tuple(int(t) for t in tokens),
                q=rows,
                parents=None if parents is None else tuple(parents),
            )
        )

    def recv(self, timeout: float | None):
        now = time.perf_counter()
        if now - self._pinged >= self.ping_every_s:
            self._pinged = now
            self.s.link.send(wire.Ping(nonce=self._seq, sent_us=int(now * 1e6)))
        deadline = now + (self.s.cfg.reply_timeout_s if timeout is None else timeout)
        while True:
            item = self.s.link.get(max(0.0, deadline - time.perf_counter()))
            if item is None:
                return Disconnected("no step within the reply timeout") if timeout is None else None
            t, f = item
            if isinstance(f, wire.Tokens):
                return StepChunk(
                    f.start, tuple(f.tokens), f.finished, f.drafted or 0, f.accepted, f.verify_us / 1e6, t, f.logprobs
                )
            if isinstance(f, wire.Pong):
                rtt = max(0.0, t - f.sent_us / 1e6)
                self._rtt = rtt if self._rtt is None else 0.7 * self._rtt + 0.3 * rtt
            else:
                failure = link_failure(f)
                if isinstance(failure, EdgeError):
                    raise failure
                if failure is not None:
                    return failure

    def resume(self, committed: Sequence[int]) -> int:
        return self.s.resume(committed)
