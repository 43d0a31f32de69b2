"""The session table: who may open a session, the handshake that opens or resumes one, and the end of one.

A connection's first frame is HELLO (a new session) or RESUME (reattach after a dropped connection);
`SessionTable.handshake` answers it with WELCOME and hands the connection handler (`server.py`) its
`Session`. A session outlives its connection (`detach`) for `resume_grace_s`, so an edge can RESUME;
`end` forgets it (CLOSE, idle expiry) and the engine frees its KV.

Trust (docs/design-notes.md, "Trust model"): a HELLO's token names its tenant; WELCOME gives the
session a random id and a 32-byte secret, and only a RESUME with that secret, the same tenant's token
and a digest of the same committed tokens reattaches it (anything else is UNKNOWN_SESSION; a wrong
secret for a live session counts as a failed auth against the peer address).

Cloud-led sessions get a `LeadState` whose pricing starts from what earlier sessions of the same
tenant, rule and temperature learned (`lead_memory`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from acespec import wire
from acespec.cloud.auth import Gatekeeper
from acespec.cloud.conn import ProtocolError, peer_addr
from acespec.cloud.engine import EngineBusy, EngineRefused, EngineSession, EngineStopped, SessionSpec, VerifyEngine
from acespec.cloud.server_config import ServerConfig
from acespec.cloud.websocket import ConnWriter
from acespec.control.lead import LeadConfig, LeadMemory
from acespec.loop.lead import LeadState
from acespec.loop.verifier import TargetVerifier
from acespec.verify import RuleSpec, RuleSpecError, SamplingParams

log = logging.getLogger("acespec.cloud")


@dataclass
class Session:
    """One edge's session: its state in the verify engine, and who holds it now."""

    sid: int
    handle: EngineSession  # the session inside the verify engine
    mode: wire.Mode
    last_active: float
    tenant: str = ""  # who opened it: only that tenant may RESUME it
    secret: bytes = field(default=b"", repr=False)  # sent in WELCOME; RESUME must present it
    connected: bool = False  # a connection holds it now (set once its WELCOME has gone out)
    in_handshake: bool = False  # its HELLO or a RESUME is being answered: another RESUME is refused, the sweeper waits
    bytes_in: int = 0
    bytes_out: int = 0
    owner: asyncio.Task | None = None  # the connection handler serving this session now
    writer: ConnWriter | None = None  # that connection's writer (idle expiry closes it)
    lead: LeadState | None = None  # cloud-led: the edge's drafts and the pricing of each step
    draft_in: asyncio.Event = field(default_factory=asyncio.Event)  # cloud-led: set when a DRAFT arrives

    @property
    def verifier(self) -> TargetVerifier:
        return self.handle.verifier


class SessionTable:
    """The live sessions, by id, and the handshake that adds one. `draining` says whether the server has
    begun to stop (it then opens and resumes nothing: BUSY sends the edge to another replica)."""

    def __init__(self, cfg: ServerConfig, engine: VerifyEngine, draining: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.engine = engine
        self.target = engine.target
        self._draining = draining
        self.sessions: dict[int, Session] = {}
        self._gate = Gatekeeper(cfg.tenants, cfg.token, cfg.auth_failures_per_min)
        self.opening = 0  # sessions admitted by the engine whose WELCOME has not gone out yet
        self.handshakes = {"opened": 0, "resumed": 0}  # sessions opened by HELLO, reattached by RESUME
        # cloud-led pricing learned by earlier sessions, per (tenant, rule, temperature): what a
        # tenant's greedy code sessions accept says nothing about another's chat at T = 1
        self.lead_memory: OrderedDict[tuple, LeadMemory] = OrderedDict()

    async def handshake(self, frames: list, writer: ConnWriter) -> Session:
        """Open or resume the session, send WELCOME, and only then count the session as held by this
        connection: a connection that dies before its WELCOME is out leaves no session behind (a new
        one is closed at once; a resumed one goes back to waiting for its RESUME). A new session is
        listed before its WELCOME is written, so a RESUME that follows the WELCOME at once finds it."""
        first = frames[0]
        if len(frames) > 1:
            raise ProtocolError(wire.ErrorCode.BAD_REQUEST, "frames sent before WELCOME")
        addr = peer_addr(writer)
        if isinstance(first, (wire.Hello, wire.Resume)) and self._gate.blocked(addr):
            raise ProtocolError(
                wire.ErrorCode.BAD_AUTH, "too many failed authentications from this address; retry later"
            )
        if isinstance(first, wire.Hello):
            tenant = self._check_auth(first.auth, addr)
            self.opening += 1
            try:
                session = await self._open(first, tenant)
                session.in_handshake = True
                self.sessions[session.sid] = session
            finally:
                self.opening -= 1
            try:
                await self._welcome(session, writer)
            except BaseException:
                self.end(session)
                raise
            finally:
                session.in_handshake = False
        elif isinstance(first, wire.Resume):
            tenant = self._check_auth(first.auth, addr)
            session = await self._resume(first, tenant, addr)
            try:
                await self._welcome(session, writer)
            except BaseException:
                session.last_active = time.monotonic()
                raise
            finally:
                session.in_handshake = False
        else:
            raise ProtocolError(
                wire.ErrorCode.BAD_REQUEST, f"expected HELLO or RESUME, got {type(first).__name__.upper()}"
            )
        session.owner, session.writer = asyncio.current_task(), writer
        session.connected = True
        session.last_active = time.monotonic()
        log.info(
            "session %d %s", session.sid, "opened" if isinstance(first, wire.Hello) else f"resumed at {first.committed}"
        )
        self.handshakes["opened" if isinstance(first, wire.Hello) else "resumed"] += 1
        return session

    async def _welcome(self, session: Session, writer: ConnWriter) -> None:
        writer.write(
            wire.encode(
                wire.Welcome(
                    session=session.sid,
                    committed=session.verifier.committed,
                    max_draft_tokens=self.cfg.limits.max_draft_tokens,
                    secret=session.secret,
                )
            )
        )
        await asyncio.wait_for(writer.drain(), self.cfg.handshake_timeout_s)

    def _check_auth(self, auth: bytes, addr: str) -> str:
        """The tenant whose token `auth` is ("" when the server has no tokens); BAD_AUTH otherwise."""
        tenant = self._gate.tenant_of(auth, addr)
        if tenant is None:
            raise ProtocolError(wire.ErrorCode.BAD_AUTH, "authentication failed")
        return tenant

    async def _open(self, h: wire.Hello, tenant: str) -> Session:
        if h.model_id != self.target.tokenizer.fingerprint:
            raise ProtocolError(
                wire.ErrorCode.MODEL_MISMATCH,
                f"tokenizer fingerprint {h.model_id!r} does not match the target's {self.target.tokenizer.fingerprint!r}",
            )
        try:
            rule = RuleSpec.parse(h.rule)
            sp = SamplingParams(float(h.temperature), int(h.top_k), float(h.top_p))
        except (RuleSpecError, ValueError) as e:
            raise ProtocolError(wire.ErrorCode.BAD_REQUEST, str(e)) from None
        if not h.prompt:
            raise ProtocolError(wire.ErrorCode.BAD_REQUEST, "empty prompt")
        ctx = self.engine.max_context
        if h.max_tokens > self.cfg.max_new_tokens or len(h.prompt) + h.max_tokens > ctx:
            raise ProtocolError(
                wire.ErrorCode.OVER_LIMIT,
                f"prompt {len(h.prompt)} + max_tokens {h.max_tokens} exceeds the server's limits "
                f"(max_tokens <= {self.cfg.max_new_tokens}, context {ctx})",
            )
        if any(t >= self.target.vocab_size for t in h.prompt):
            raise ProtocolError(wire.ErrorCode.OVER_LIMIT, "prompt token id outside the target vocabulary")
        if h.logprobs and h.mode == wire.Mode.SPECULATIVE:
            raise ProtocolError(
                wire.ErrorCode.BAD_REQUEST,
                "logprobs ride on TOKENS frames: ask for them in a streaming mode (cloud-only or cloud-led)",
            )
        if h.logprobs and not self.engine.serves_logprobs:
            raise ProtocolError(wire.ErrorCode.BAD_REQUEST, f"the {self.engine.name} engine does not compute logprobs")
        if self._draining():  # a HELLO that was already on its way when stop() began: send it elsewhere
            raise ProtocolError(wire.ErrorCode.BUSY, "this replica is draining; open the session on another")
        if len(self.sessions) + self.opening > self.cfg.max_sessions:  # opening counts this one
            raise ProtocolError(wire.ErrorCode.BUSY, f"the server holds {self.cfg.max_sessions} sessions; retry later")
        spec = SessionSpec(
            tuple(h.prompt),
            sampling=sp,
            rule=rule,
            seed=h.seed,
            max_tokens=h.max_tokens,
            cloud_led=h.mode == wire.Mode.CLOUD_LED,
            logprobs=h.logprobs,
        )
        try:
            handle = await self.engine.open(spec)
        except (
            EngineBusy,
            EngineStopped,
        ) as e:  # stopped: the replica is going away, and BUSY sends the edge to another
            raise ProtocolError(wire.ErrorCode.BUSY, str(e)) from None
        except EngineRefused as e:
            raise ProtocolError(wire.ErrorCode.BAD_REQUEST, str(e)) from None
        sid = self._new_sid()
        log.info("session %d: rule %s, %d prompt tokens, mode %s", sid, rule, len(h.prompt), wire.Mode(h.mode).name)
        s = Session(sid, handle, wire.Mode(h.mode), time.monotonic(), tenant=tenant, secret=secrets.token_bytes(32))
        if s.mode == wire.Mode.CLOUD_LED:
            cfg = LeadConfig(k_max=min(self.cfg.lead_k_max, self.cfg.limits.max_draft_tokens))
            s.lead = LeadState(cfg, memory=self._memory_for((tenant, str(rule), round(sp.temperature, 2)), cfg))
        return s

    def _memory_for(self, key: tuple, cfg: LeadConfig) -> LeadMemory:
        mem = self.lead_memory.pop(key, None) or LeadMemory(cfg)
        self.lead_memory[key] = mem
        while len(self.lead_memory) > 256:  # tenants x rules x temperatures an attacker could spread
            self.lead_memory.popitem(last=False)
        return mem

    def _new_sid(self) -> int:
        """A random id below 2**21 (3 varint bytes on every DRAFT) that no live session holds: ids say
        nothing about how many sessions came before, and the secret, not the id, guards a session."""
        while True:
            sid = 1 + secrets.randbelow((1 << 21) - 1)
            if sid not in self.sessions:
                return sid

    async def _resume(self, r: wire.Resume, tenant: str, addr: str) -> Session:
        s = self.sessions.get(r.session)
        # an unknown id, another tenant's session and a wrong secret get the same answer, so RESUME
        # tells a client nothing about sessions it does not hold. Only a wrong secret for a live
        # session counts as a failed auth: an unknown id is what an honest edge sends after this
        # replica restarted, or through a balancer to a replica it never used, and with every edge
        # behind one balancer address, counting those would lock them all out
        if s is None or s.tenant != tenant or not hmac.compare_digest(r.secret, s.secret):
            if s is not None:
                self._gate.failed(addr)
            raise ProtocolError(
                wire.ErrorCode.UNKNOWN_SESSION,
                f"no session {r.session} for these credentials (expired, never opened, or not yours)",
            )
        if self._draining():
            # the session dies with this replica: resuming it here would only meet GOING_AWAY (or a
            # stopped engine). BUSY sends the edge to another replica, where it opens a session
            # carrying its committed text
            raise ProtocolError(wire.ErrorCode.BUSY, "this replica is draining; continue the session on another")
        if s.in_handshake:
            # two RESUMEs at once: the first one wins; this one must not also be told a committed
            # length the winner may roll back
            raise ProtocolError(wire.ErrorCode.BUSY, f"session {r.session} is being resumed on another connection")
        s.in_handshake = True
        s.last_active = time.monotonic()  # the sweeper must not expire it under the RESUME
        try:
            if s.connected:
                # The edge reconnected before this server noticed its old connection die (a reset or a
                # dead path while the old handler waited on the model). The edge is the one that knows:
                # close the old connection and wait for its handler to finish, so no verify of the old
                # connection can land after the rollback below.
                old = s.owner
                if old is not None and not old.done():
                    if s.writer is not None:
                        s.writer.transport.abort()
                    await asyncio.wait({old}, timeout=30.0)
                    if not old.done():
                        raise ProtocolError(
                            wire.ErrorCode.BUSY, f"session {r.session} is still busy on its old connection"
                        )
                s.connected = False
            v = s.verifier
            if not v.prompt_len <= r.committed <= v.committed:
                raise ProtocolError(
                    wire.ErrorCode.BAD_REQUEST,
                    f"RESUME at {r.committed}, but the session has committed {v.committed} (prompt {v.prompt_len})",
                )
            if not hmac.compare_digest(r.digest, wire.committed_digest(v.tokens[: r.committed])):
                raise ProtocolError(
                    wire.ErrorCode.BAD_REQUEST,
                    f"RESUME at {r.committed}: the edge's committed tokens differ from the session's",
                )
            # continue from the shorter agreed prefix: verdicts the edge never saw are undone, so no
            # token is lost or emitted twice (in coupled mode they are regenerated identically)
            await self.engine.rollback(s.handle, r.committed)
        except BaseException:
            s.in_handshake = False
            raise
        s.last_active = time.monotonic()
        return s

    def detach(self, session: Session) -> None:
        """The session's connection is gone: it waits `resume_grace_s` for a RESUME."""
        session.connected = False
        session.owner = session.writer = None
        session.last_active = time.monotonic()
        if self.sessions.get(session.sid) is session:
            self.engine.park(session.handle)  # its KV may go to another session meanwhile

    def end(self, s: Session) -> None:
        """Forget a session (CLOSE, expiry): the engine frees its KV."""
        if self.sessions.get(s.sid) is s:
            del self.sessions[s.sid]
            self.engine.close(s.handle)
