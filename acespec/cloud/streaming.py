"""Streaming sessions (cloud-only, and cloud-led, the wire mode of the edge's `auto` too): the cloud
decodes and sends each step's tokens in a TOKENS frame, without waiting for the edge.

`TokenStreamer.stream` runs for the life of one such connection after its handshake. A read side
answers PING, ends the session on CLOSE and, in cloud-led mode, puts each DRAFT on the session's board
(`loop/board.py`); the step loop then verifies, before each step, the priced part of the longest
draft that agrees with the stream (`control/lead.py`), or takes a plain step when none does. On an
engine whose own decoding loop verifies the drafts (vLLM's speculative decoding), a step is whatever
that loop committed since the last one.

The loop never waits for a draft, unless the server has a pass budget (`ServerConfig.lead_pass_budget`):
then a step whose board holds too short a draft waits for the edge's next DRAFT, at most
`lead_max_wait_s` (`hold_for_draft`; `holds` and `held_s` count those waits).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from acespec import wire
from acespec.cloud.conn import FrameIO, ProtocolError
from acespec.cloud.edge_led import check_draft
from acespec.cloud.engine import VerifyEngine
from acespec.cloud.server_config import ServerConfig
from acespec.cloud.sessions import Session
from acespec.cloud.websocket import ConnReader, ConnWriter
from acespec.loop.verifier import TargetVerifier

log = logging.getLogger("acespec.cloud")


class TokenStreamer:
    """Serves streaming connections: TOKENS out, DRAFTs in (cloud-led). `end` forgets a session (its CLOSE)."""

    def __init__(self, cfg: ServerConfig, engine: VerifyEngine, io: FrameIO, end: Callable[[Session], None]) -> None:
        self.cfg = cfg
        self.engine = engine
        self._io = io
        self._end = end
        self.holds = 0  # cloud-led steps that waited for a draft (a pass budget; never without one)
        self.held_s = 0.0  # and the seconds they waited in all

    async def stream(self, s: Session, reader: ConnReader, writer: ConnWriter, decoder: wire.FrameDecoder) -> None:
        """Generate and stream each step's tokens; still answer PING / CLOSE meanwhile. A cloud-led
        session also takes DRAFTs at any time, and each step verifies the priced part of the longest
        one that agrees with the stream (a plain step when none does): the loop never waits for one."""
        closed = asyncio.Event()
        lead = s.lead

        async def read_side() -> None:
            while True:
                frames = await self._io.next_frame(reader, decoder)
                if frames is None:
                    closed.set()
                    return
                for f in frames:
                    if isinstance(f, wire.Ping):
                        writer.write(wire.encode(wire.Pong(nonce=f.nonce, sent_us=f.sent_us)))
                    elif isinstance(f, wire.Close):
                        self._end(s)
                        closed.set()
                        return
                    elif lead and isinstance(f, wire.Draft):
                        self.take_draft(s, f)
                    elif not isinstance(f, wire.Pong):
                        raise ProtocolError(
                            wire.ErrorCode.BAD_REQUEST,
                            f"unexpected {type(f).__name__.upper()} in a {s.mode.name.lower().replace('_', '-')} session",
                        )

        # on an engine whose own decoding loop verifies the drafts (vLLM's speculative decoding), a
        # step is whatever that loop committed since the last one, and the pricing happens there
        native = lead is not None and self.engine.leads_natively(s.handle)
        reading = asyncio.create_task(read_side())
        try:
            v = s.verifier
            while not v.finished and not closed.is_set() and s.owner is asyncio.current_task():
                if reading.done():
                    reading.result()  # re-raise a protocol error from the read side
                start = v.committed
                short = await self.hold_for_draft(s, closed) if lead and not native else 0
                t0 = time.perf_counter()
                draft, q = lead.plan(v, at_least=short) if lead and not native else ([], None)
                if native:
                    assert lead is not None  # native implies a cloud-led session
                    verdict = await self.engine.lead_step(s.handle, lead.board)
                elif draft:
                    assert lead is not None  # only a cloud-led session plans drafts
                    verdict = await self.engine.verify(s.handle, lead.steps, start, draft, q)
                else:
                    verdict = await self.engine.step(s.handle)
                s.last_active = time.monotonic()
                step = {}
                if lead:
                    if not native:
                        lead.observe(verdict, time.perf_counter() - t0)
                    step = {"drafted": verdict.drafted, "accepted": verdict.accepted, "verify_us": verdict.verify_us}
                writer.write(
                    wire.encode(
                        wire.Tokens(
                            start=start,
                            tokens=tuple(v.tokens[start : verdict.committed]),
                            finished=verdict.finished,
                            logprobs=_logprobs(v, start, verdict.committed),
                            **step,
                        )
                    )
                )
                await writer.drain()
            if lead and v.finished:
                b = lead.board.stats
                log.info(
                    "session %d: cloud-led: %d steps, %d with a usable draft, %d drafts received; pricer %s",
                    s.sid,
                    b.steps,
                    b.usable_steps,
                    b.received,
                    lead.pricer.describe(),
                )
            if s.owner is asyncio.current_task() and not closed.is_set():
                # generation is over: keep the connection until the edge's CLOSE (which ends the
                # session) or EOF, so a finished session does not linger and hold a slot
                await reading
            if reading.done() and not reading.cancelled():
                reading.result()
        finally:
            reading.cancel()

    def take_draft(self, s: Session, f: wire.Draft) -> None:
        """Put a cloud-led DRAFT on the session's board, after the checks a DRAFT gets in edge-led mode."""
        check_draft(s, f, self.engine.target.vocab_size)
        rule = s.verifier.rule
        if f.q is None and rule.info.needs_q and rule.name != "strict":
            raise ProtocolError(wire.ErrorCode.BAD_REQUEST, f"rule {rule} needs q rows with each DRAFT")
        room = getattr(self.engine, "lead_q_topn", 0) if f.q is not None and self.engine.leads_natively(s.handle) else 0
        if room and f.q is not None and any(len(row) > room for row in f.q):  # room is 0 without q rows
            raise ProtocolError(
                wire.ErrorCode.OVER_LIMIT,
                f"a q row of more than {room} entries: this vLLM server keeps "
                f"{room} per draft token (send the drafter's top {room})",
            )
        assert s.lead is not None  # DRAFTs are taken here in cloud-led sessions only
        if s.lead.take(f.base, f.tokens, f.parents, f.q, s.verifier.committed) and self.engine.leads_natively(s.handle):
            self.engine.lead_publish(s.handle, s.lead.board)
        s.draft_in.set()

    async def hold_for_draft(self, s: Session, closed: asyncio.Event) -> int:
        """With a pass budget (`lead_pass_budget`), the draft tokens this step must verify to keep the
        session within it; if the board holds fewer, wait for the edge's next DRAFT, at most
        `lead_max_wait_s` in all (an edge with no drafter, or drafts that keep missing, still gets its
        stream, a plain step after each wait). With no budget (the default) the cloud never waits, and
        the first step never does: the edge's drafter starts on the prompt only after the first token."""
        budget = self.cfg.lead_pass_budget
        v, lead = s.verifier, s.lead
        assert lead is not None  # only cloud-led sessions hold for drafts
        if not math.isfinite(budget) or lead.steps == 0:  # the first step, the prompt's, waits for nobody
            return 0
        left = v.prompt_len + v.max_tokens - v.committed
        short = min(lead.tokens_short(v, budget), max(0, left - 1))  # never more than the session has left
        t0 = time.monotonic()
        deadline = t0 + self.cfg.lead_max_wait_s
        if short and lead.board.reach(v.tokens, lead.pricer.cfg.k_max) < short:
            self.holds += 1
            while lead.board.reach(v.tokens, lead.pricer.cfg.k_max) < short and not closed.is_set():
                wait = deadline - time.monotonic()
                if wait <= 0:
                    break
                s.draft_in.clear()
                try:
                    await asyncio.wait_for(s.draft_in.wait(), wait)
                except TimeoutError:
                    break
            self.held_s += time.monotonic() - t0
        return short

    async def finished_at_once(self, s: Session, writer: ConnWriter) -> None:
        """A stream with nothing left to generate (HELLO with max_tokens 0, or a RESUME at the end of the
        generation) still ends in a FINISHED TOKENS frame, here an empty one, right after WELCOME: the
        step loop would send none, and the edge would wait for it until its own timeout
        (docs/reference/wire.md, section 9.3)."""
        step = {"drafted": 0} if s.mode == wire.Mode.CLOUD_LED else {}
        v = s.verifier
        lps = _logprobs(v, v.committed, v.committed)
        writer.write(wire.encode(wire.Tokens(start=v.committed, tokens=(), finished=True, logprobs=lps, **step)))
        await writer.drain()


def _logprobs(v: TargetVerifier, start: int, end: int) -> tuple | None:
    """HAS_LOGPROBS for the tokens at positions start..end, when the session asked (HELLO.logprobs)."""
    if not v.logprobs:
        return None
    return tuple(v.token_logprobs[start - v.prompt_len : end - v.prompt_len])
