"""Edge-led (speculative) sessions: the edge drafts, the cloud answers each DRAFT with a VERDICT.

`DraftVerifier.serve` runs for the life of one speculative connection after its handshake. It reads
blocks and hands each to the verify engine the moment it arrives: a pipelined edge has several in
flight, and the engine takes a session's next block into the very next tick only if it already has it.
A writer task sends the verdicts back in the order the blocks came. PING is answered with PONG, CLOSE
ends the session.

Draining (`CloudServer.stop`): blocks already received are still verified and their verdicts sent;
then the writer sends CLOSE(GOING_AWAY) and closes the connection (`drain`). Blocks that arrive later
are not taken.

`check_draft` is what any DRAFT must be, in this mode or cloud-led (`streaming.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np

from acespec import wire
from acespec.cloud.conn import GOING_AWAY, FrameIO, ProtocolError
from acespec.cloud.engine import EngineStopped, VerifyEngine
from acespec.cloud.sessions import Session
from acespec.cloud.websocket import ConnReader, ConnWriter
from acespec.verify.sampling import dense_row

log = logging.getLogger("acespec.cloud")


def check_draft(s: Session, f: wire.Draft, V: int) -> None:
    """What any DRAFT must be, in either mode: for this connection's session, ids in the target's vocabulary."""
    if f.session != s.sid:
        raise ProtocolError(
            wire.ErrorCode.UNKNOWN_SESSION, f"DRAFT names session {f.session}, this connection holds {s.sid}"
        )
    if any(t >= V for t in f.tokens):
        raise ProtocolError(wire.ErrorCode.OVER_LIMIT, "draft token id outside the target vocabulary")
    if f.q is not None and any(t >= V for row in f.q for t, _ in row):
        raise ProtocolError(wire.ErrorCode.OVER_LIMIT, "q row token id outside the target vocabulary")


class DraftVerifier:
    """Serves speculative connections: DRAFT in, VERDICT out. `end` forgets a session (its CLOSE);
    `stopping` says whether the server has begun its drain."""

    def __init__(
        self, engine: VerifyEngine, io: FrameIO, end: Callable[[Session], None], stopping: Callable[[], bool]
    ) -> None:
        self.engine = engine
        self._io = io
        self._end = end
        self._stopping = stopping
        self._queues: dict[asyncio.Task, asyncio.Queue] = {}  # speculative connections -> their verdict queue

    def drain(self, task: asyncio.Task) -> bool:
        """The server is stopping: have this connection's verdict writer send the verdicts already owed,
        then GOING_AWAY, and close. False when `task` is no speculative connection of ours."""
        q = self._queues.get(task)
        if q is None:
            return False
        q.put_nowait(None)
        return True

    async def serve(self, s: Session, reader: ConnReader, writer: ConnWriter, decoder: wire.FrameDecoder) -> None:
        """Read blocks and hand each to the engine at once: a pipelined edge has several in flight, and
        the engine takes a session's next block into the very next tick only if it already has it.
        The verdicts go back in order from a writer task."""
        V = self.engine.target.vocab_size
        verdicts: asyncio.Queue = asyncio.Queue()
        out = asyncio.create_task(self._write_verdicts(s, verdicts, writer))
        me = asyncio.current_task()
        assert me is not None  # a connection handler runs as a task
        self._queues[me] = verdicts
        if self._stopping():
            verdicts.put_nowait(None)
        try:
            while True:
                frames = await self._io.next_frame(reader, decoder)
                if frames is None:
                    return
                for f in frames:
                    if s.owner is not me:
                        return  # a RESUME on a new connection took the session over
                    if out.done():
                        out.result()  # the writer failed: surface its error here
                        return
                    s.last_active = time.monotonic()
                    if isinstance(f, wire.Draft):
                        if self._stopping():
                            continue  # draining: the edge will be told GOING_AWAY after the verdicts it is owed
                        check_draft(s, f, V)
                        if f.parents is not None:
                            # verifying a tree as a chain would ignore its shape: refuse it until trees are verified
                            raise ProtocolError(
                                wire.ErrorCode.BAD_REQUEST,
                                "this server verifies chains only: DRAFT with HAS_TREE refused",
                            )
                        q = None
                        if f.q is not None:
                            q = (
                                np.stack([dense_row([i for i, _ in row], [p for _, p in row], V) for row in f.q])
                                if f.q
                                else None
                            )
                        elif s.verifier.rule.info.needs_q and f.tokens:
                            raise ProtocolError(
                                wire.ErrorCode.BAD_REQUEST, f"rule {s.verifier.rule} needs q rows with each DRAFT"
                            )
                        # submitted now, in arrival order (the engine sees the blocks in the order they came)
                        verdicts.put_nowait((f.seq, self.engine.submit_verify(s.handle, f.seq, f.base, f.tokens, q)))
                    elif isinstance(f, wire.Ping):
                        writer.write(wire.encode(wire.Pong(nonce=f.nonce, sent_us=f.sent_us)))
                    elif isinstance(f, wire.Close):
                        self._end(s)
                        return
                    elif isinstance(f, wire.Pong):
                        pass
                    else:
                        raise ProtocolError(
                            wire.ErrorCode.BAD_REQUEST,
                            f"unexpected {type(f).__name__.upper()} in a speculative session",
                        )
                await writer.drain()
        finally:
            self._queues.pop(me, None)
            out.cancel()
            await asyncio.gather(out, return_exceptions=True)
            # blocks still queued when the connection ends go unanswered (the session closed, or moved to
            # a new connection); their verifies run on, and one that fails (the session closed under it)
            # has no one to tell: retrieve its error so it is not reported as lost
            while not verdicts.empty():
                item = verdicts.get_nowait()
                if item is not None:
                    item[1].add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _write_verdicts(self, s: Session, verdicts: asyncio.Queue, writer: ConnWriter) -> None:
        while True:
            item = await verdicts.get()
            if item is None:  # the server is stopping: every verdict owed has gone out
                writer.write(GOING_AWAY)
                await writer.drain()
                writer.close()
                return
            seq, job = item
            try:
                v = await job
            except Exception as e:  # the engine could not verify (it is stopping, or a model error): say so
                log.warning("session %d: block %d failed: %s", s.sid, seq, e)
                code = wire.ErrorCode.BUSY if isinstance(e, EngineStopped) else wire.ErrorCode.INTERNAL
                await self._io.refuse(writer, code, f"verify failed: {type(e).__name__}")
                writer.close()
                return
            if s.writer is not writer:
                return  # the session moved to another connection: this one's verdicts are void
            writer.write(
                wire.encode(
                    wire.Verdict(
                        seq=seq,
                        accepted=v.accepted,
                        next_token=max(v.next_token, 0),
                        verify_us=v.verify_us,
                        committed=v.committed,
                        dropped=v.dropped,
                        finished=v.finished,
                    )
                )
            )
            await writer.drain()
