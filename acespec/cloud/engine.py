"""The verify engines that need no GPU library, and the factory that picks one by name.

The interface every engine implements (`VerifyEngine`, `SessionSpec`, the errors) is `engine_api.py`;
its names are re-exported here, so `acespec.cloud.engine` stays the one import for callers.

- `SerialEngine`: one model, one lock, sessions take turns (the baseline `acespec bench tenants` measures).
- `NoopEngine`: instant verdicts, for measuring the front end alone.
- `make_engine(kind, ...)`: `batched` (`batched.py`), `serial`, `vllm` (`vllm_engine.py`) or `noop`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from acespec.cloud.batched import BatchConfig, BatchedEngine
from acespec.cloud.engine_api import (
    EngineBusy,
    EngineRefused,
    EngineSession,
    EngineStopped,
    SessionSpec,
    VerifyEngine,
)
from acespec.cloud.vllm_engine import VllmConfig, VllmEngine
from acespec.loop.verifier import BlockVerdict
from acespec.models.base import Model

__all__ = [
    "ENGINES",
    "EngineBusy",
    "EngineRefused",
    "EngineSession",
    "EngineStopped",
    "NoopEngine",
    "SerialEngine",
    "SessionSpec",
    "VerifyEngine",
    "make_engine",
    "run_in_thread",
]


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
    serves_logprobs = True

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
        return {
            "engine": self.name,
            "verdicts": self.verdicts,
            "slots": 1,
            "kv_tokens_allocated": self.target.n_ctx,
            "kv_bytes_per_token": int(getattr(self.target, "kv_bytes_per_token", 0)),
        }


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

    def _now(self, s: EngineSession, seq: int, base: int, tokens: Sequence[int], q) -> BlockVerdict:
        job = s.verifier.prepare(seq, base, tokens, q)
        if isinstance(job, BlockVerdict):
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
        return VllmEngine(VllmConfig(model=str(target), **batch))
    if kind == "noop":
        return NoopEngine(target)
    if kind == "serial":
        if batch:
            raise ValueError(f"the serial engine takes no batching options ({', '.join(batch)})")
        return SerialEngine(target)
    if kind == "batched":
        return BatchedEngine(target, BatchConfig(**batch))
    raise ValueError(f"unknown engine {kind!r}; use one of {', '.join(ENGINES)}")
