"""The verify engine: what owns the target model, its KV memory and the scheduling of every session's work.

The cloud server (`server.py`) speaks the protocol: sessions, auth, frames, resume. Everything that
touches the target goes through one `VerifyEngine`:

    s = await engine.open(spec)                       # a new session (EngineBusy: no room, retry later)
    v = await engine.verify(s, seq, base, tokens, q)  # one draft block -> its Verdict
    v = await engine.step(s)                          # cloud-only: one plain target step
    await engine.rollback(s, n)                       # RESUME: forget committed tokens past n
    engine.park(s)                                    # the edge went away: its KV may be reclaimed
    engine.close(s)                                   # the session is over: free its KV now

The rules, the rng and seed derivation and the stale-prefix drops all stay in `TargetVerifier`
(`engine/verifier.py`): an engine decides only *when* and *with whom* a session's rows are computed.
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
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from acespec.engine.board import DraftBoard
from acespec.engine.verifier import TargetVerifier, Verdict
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
    cloud_led: bool = False  # the cloud decodes without waiting and the edge's drafts follow it (engines may verify them natively)


@dataclass(eq=False)
class EngineSession:
    """One session inside an engine. `verifier` holds its committed prefix; read it, never drive it."""

    id: int
    verifier: TargetVerifier


class VerifyEngine(ABC):
    name: str = "engine"
    target: Model  # the target model (its tokenizer fingerprint and vocabulary define what sessions may send)

    @property
    @abstractmethod
    def max_context(self) -> int:
        """Most tokens (prompt + generation) one session may hold."""

    @abstractmethod
    async def open(self, spec: SessionSpec) -> EngineSession:
        """Admit a session (its prompt prefill starts in the background); EngineBusy if there is no room."""

    @abstractmethod
    async def verify(self, s: EngineSession, seq: int, base: int, tokens: Sequence[int], q: np.ndarray | None) -> Verdict:
        """Verify one draft block (see `TargetVerifier.verify`)."""

    def submit_verify(self, s: EngineSession, seq: int, base: int, tokens: Sequence[int], q: np.ndarray | None) -> "asyncio.Future[Verdict]":
        """`verify`, started now, as a future: the server submits each block the moment it arrives (in
        arrival order) and awaits the verdicts in order elsewhere. An engine that queues work itself
        returns its own future and spares a task per block (a front end's cost at thousands of edges)."""
        return asyncio.ensure_future(self.verify(s, seq, base, tokens, q))

    @abstractmethod
    async def step(self, s: EngineSession) -> Verdict:
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

    async def lead_step(self, s: EngineSession, board: DraftBoard) -> Verdict:
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
        return TargetVerifier(self.target, list(spec.prompt), sampling=spec.sampling, rule=spec.rule, seed=spec.seed,
                              max_tokens=spec.max_tokens)


async def run_in_thread(fn, *args):
    """Run `fn` in a worker thread and return its result; if the caller is cancelled meanwhile, still
    wait for the thread to finish before the cancellation goes on, so a lock the caller holds is never
    released while the model is still running under it."""
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise


class SerialEngine(VerifyEngine):
    """One target, one FIFO lock: sessions take turns, and a switch of session re-syncs the shared KV
    cache to the other session's prefix (`Model.sync`, i.e. a re-prefill). Correct and simple; a second
    edge makes every edge slower. Kept as the baseline the batched engine is measured against."""

    name = "serial"

    def __init__(self, target: Model) -> None:
        self.target = target
        self._ids = itertools.count(1)
        self._lock: asyncio.Lock | None = None
        self._warming: set[asyncio.Task] = set()
        self.verdicts = 0

    @property
    def max_context(self) -> int:
        return self.target.n_ctx

    def _model_lock(self) -> asyncio.Lock:
        if self._lock is None:  # created on first use, inside the server's event loop
            self._lock = asyncio.Lock()
        return self._lock

    async def open(self, spec: SessionSpec) -> EngineSession:
        s = EngineSession(next(self._ids), self._make_verifier(spec))
        # prefill now rather than on the first DRAFT: the edge is prefilling its drafter meanwhile
        t = asyncio.create_task(self._warm(s))
        self._warming.add(t)
        t.add_done_callback(self._warming.discard)
        return s

    async def _warm(self, s: EngineSession) -> None:
        async with self._model_lock():
            if not s.verifier.finished:
                await run_in_thread(s.verifier.warm)

    async def verify(self, s, seq, base, tokens, q):
        async with self._model_lock():
            v = await run_in_thread(s.verifier.verify, seq, base, list(tokens), q)
        self.verdicts += 1
        return v

    async def step(self, s):
        async with self._model_lock():
            v = await run_in_thread(s.verifier.step)
        self.verdicts += 1
        return v

    async def rollback(self, s, n):
        async with self._model_lock():
            s.verifier.rollback(n)

    def close(self, s) -> None:
        pass

    async def stop(self) -> None:
        """Return once no model call runs, without prefilling sessions that are going away: queued warms
        are cancelled (a running one finishes its pass first, `run_in_thread`), then the model lock is
        taken once. Waiting for every queued warm made a stop with many sessions outlast the server
        thread's patience, and the caller then closed the model under a running prefill (a segfault,
        `bench tenants`' serial N = 8)."""
        for t in list(self._warming):
            t.cancel()
        await asyncio.gather(*self._warming, return_exceptions=True)
        async with self._model_lock():
            pass

    def metrics(self) -> dict:
        return {"engine": self.name, "verdicts": self.verdicts, "slots": 1, "kv_tokens_allocated": self.target.n_ctx,
                "kv_bytes_per_token": int(getattr(self.target, "kv_bytes_per_token", 0))}


class NoopEngine(VerifyEngine):
    """Verdicts computed instantly, for measuring the front end alone (`acespec bench frontend`): as if
    the target's rows were one-hot on whatever the edge drafted (and on token 0 after it), every block
    is accepted in full and committed through the session's real bookkeeping (stale blocks, budget,
    end of sequence), with no model pass and no rule. Not a target anyone should serve text from."""

    name = "noop"

    def __init__(self, target: Model) -> None:
        self.target = target
        self._ids = itertools.count(1)
        self.verdicts = 0

    @property
    def max_context(self) -> int:
        return self.target.n_ctx

    async def open(self, spec: SessionSpec) -> EngineSession:
        return EngineSession(next(self._ids), self._make_verifier(spec))

    def _now(self, s: EngineSession, seq: int, base: int, tokens: Sequence[int], q) -> Verdict:
        job = s.verifier.prepare(seq, base, tokens, q)
        if isinstance(job, Verdict):
            return job
        self.verdicts += 1
        # the outcome of any rule on rows one-hot on the draft (and on token 0 after it): all accepted
        return s.verifier.commit(job, job.k, 0, 0.0)

    async def verify(self, s, seq, base, tokens, q):
        return self._now(s, seq, base, tokens, q)

    def submit_verify(self, s, seq, base, tokens, q):
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(self._now(s, seq, base, tokens, q))
        except Exception as e:
            fut.set_exception(e)
        return fut

    async def step(self, s):
        return self._now(s, 0, s.verifier.committed, [], None)

    async def rollback(self, s, n):
        s.verifier.rollback(n)

    def close(self, s) -> None:
        pass

    def metrics(self) -> dict:
        return {"engine": self.name, "verdicts": self.verdicts, "slots": 1, "kv_tokens_allocated": 0}


ENGINES = ("batched", "serial", "vllm", "noop")


def make_engine(kind: str, target, **batch) -> VerifyEngine:
    """`batched` (continuous batching; `batch` goes to BatchConfig), `serial` (the old server) or `vllm`
    (`target` is a Hugging Face directory; `batch` goes to VllmConfig)."""
    if kind == "vllm":
        from acespec.cloud.vllm_engine import VllmConfig, VllmEngine

        return VllmEngine(VllmConfig(model=str(target), **batch))
    if kind == "noop":
        return NoopEngine(target)
    if kind == "serial":
        if batch:
            raise ValueError(f"the serial engine takes no batching options ({', '.join(batch)})")
        return SerialEngine(target)
    if kind == "batched":
        from acespec.cloud.batched import BatchConfig, BatchedEngine

        return BatchedEngine(target, BatchConfig(**batch))
    raise ValueError(f"unknown engine {kind!r}; use one of {', '.join(ENGINES)}")
