"""The verify engine: what owns the target model, its KV memory and the scheduling of every session's work.

The cloud server (`server.py`, `sessions.py`, `edge_led.py`, `streaming.py`) speaks the protocol: sessions,
auth, frames, resume. Everything that touches the target goes through one `VerifyEngine`:

    s = await engine.open(spec)                       # a new session (EngineBusy: no room, retry later)
    v = await engine.verify(s, seq, base, tokens, q)  # one draft block -> its BlockVerdict
    v = await engine.step(s)                          # cloud-only: one plain target step
    await engine.rollback(s, n)                       # RESUME: forget committed tokens past n
    engine.park(s)                                    # the edge went away: its KV may be reclaimed
    engine.close(s)                                   # the session is over: free its KV now

The rules, the rng and seed derivation and the stale-prefix drops all stay in `TargetVerifier`
(`loop/verifier.py`): an engine decides only *when* and *with whom* a session's rows are computed.
Two engines sit behind this interface here:

- `SerialEngine`: one model, one lock, sessions take turns and the KV cache is re-synced on every
  switch (a re-prefill). The old server; kept as the baseline `acespec bench tenants` measures against.
- `BatchedEngine` (`batched.py`): continuous batching, one KV sequence per session, one model pass per
  tick for every session's pending block. The default.
- `VllmEngine` (`vllm_engine.py`): a thin front end over an in-process vLLM `AsyncLLM`, whose own
  scheduler batches the sessions' requests (the scale-out engine; needs `scripts/setup.sh vllm`).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from acespec.loop.board import DraftBoard
from acespec.loop.verifier import BlockVerdict, TargetVerifier
from acespec.models.base import Model
from acespec.verify import RuleSpec, SamplingParams


class EngineBusy(Exception):
    """No room for another session right now (every KV sequence is held by an active session): retry later."""


class EngineRefused(ValueError):
    """This engine cannot serve the session as asked (e.g. a rule that needs target rows it does not have)."""


class EngineStopped(RuntimeError):
    """The engine shut down before this request was served."""


@dataclass(frozen=True)
class SessionSpec:
    prompt: tuple[int, ...]  # prompt token ids
    sampling: SamplingParams = SamplingParams()  # temperature / top-k / top-p the rule samples with
    rule: RuleSpec = field(default_factory=lambda: RuleSpec.parse("strict"))  # verification rule
    seed: int = 0  # shared seed (coupled noise, the rule's rng)
    max_tokens: int = 256  # generation budget in new tokens
    cloud_led: bool = (
        False  # the cloud decodes without waiting and the edge's drafts follow it (engines may verify them natively)
    )
    logprobs: int = 0  # 0: none; 1 + m: each committed token's log-probability and the m likeliest (HELLO.logprobs)


@dataclass(eq=False)
class EngineSession:
    """One session inside an engine. `verifier` holds its committed prefix; read it, never drive it."""

    id: int
    verifier: TargetVerifier


class VerifyEngine(ABC):
    name: str = "engine"
    target: Model  # the target model (its tokenizer fingerprint and vocabulary define what sessions may send)
    # whether `finish` sees the target's whole logit rows, so a session may ask for logprobs (HELLO.logprobs)
    serves_logprobs: bool = False

    @property
    @abstractmethod
    def max_context(self) -> int:
        """Most tokens (prompt + generation) one session may hold."""

    @abstractmethod
    async def open(self, spec: SessionSpec) -> EngineSession:
        """Admit a session (its prompt prefill starts in the background); EngineBusy if there is no room."""

    @abstractmethod
    async def verify(
        self, s: EngineSession, seq: int, base: int, tokens: Sequence[int], q: np.ndarray | None
    ) -> BlockVerdict:
        """Verify one draft block (see `TargetVerifier.verify`)."""

    def submit_verify(
        self, s: EngineSession, seq: int, base: int, tokens: Sequence[int], q: np.ndarray | None
    ) -> asyncio.Future[BlockVerdict]:
        """`verify`, started now, as a future: the server submits each block the moment it arrives (in
        arrival order) and awaits the verdicts in order elsewhere. An engine that queues work itself
        returns its own future and spares a task per block (a front end's cost at thousands of edges)."""
        return asyncio.ensure_future(self.verify(s, seq, base, tokens, q))

    @abstractmethod
    async def step(self, s: EngineSession) -> BlockVerdict:
        """One plain target step at whatever is committed (cloud-only streaming)."""

    @abstractmethod
    async def rollback(self, s: EngineSession, n: int) -> None:
        """Forget committed tokens past length n, after every request already submitted for `s`."""

    def park(self, s: EngineSession) -> None:
        """The session lost its connection: its KV may go to another session first (it is rebuilt on
        its next request)."""

    @abstractmethod
    def close(self, s: EngineSession) -> None:
        """The session is over: free its KV; requests still queued for it are cancelled."""

    # -- cloud-led sessions that the engine's own decoding loop drives (vLLM's speculative decoding) --
    def leads_natively(self, s: EngineSession) -> bool:
        """Whether this cloud-led session's steps are the engine's own (`lead_step`), with the edge's drafts
        verified inside it (`lead_publish`), instead of `step` / `verify` requests the server plans."""
        return False

    def lead_publish(self, s: EngineSession, board: DraftBoard) -> None:
        """The session's board changed (a DRAFT arrived): make its drafts visible to the engine's loop."""
        raise NotImplementedError

    async def lead_step(self, s: EngineSession, board: DraftBoard) -> BlockVerdict:
        """The tokens the engine's own loop has committed since the last call (at least one)."""
        raise NotImplementedError

    def has_room(self) -> bool:
        """Whether `open` would find KV room for one more session now (read by /ready from another thread)."""
        return True

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def metrics(self) -> dict:
        """Counters for benchmarks and logs (names say what they count)."""
        return {}

    def _make_verifier(self, spec: SessionSpec) -> TargetVerifier:
        return TargetVerifier(
            self.target,
            list(spec.prompt),
            sampling=spec.sampling,
            rule=spec.rule,
            seed=spec.seed,
            max_tokens=spec.max_tokens,
            logprobs=spec.logprobs,
        )
