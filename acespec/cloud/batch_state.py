"""The batched engine's parts (`batched.py`): its configuration, a queued request, and the bookkeeping it keeps
per session (the requests it serves in order, its KV slot, the passes that built that KV).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass, field

from acespec.cloud.engine_api import EngineSession
from acespec.loop.verifier import VerifyJob


@dataclass
class BatchConfig:
    slots: int | None = None  # KV sequences: sessions resident at once (None = every sequence the model holds)
    tick_tokens: int = 256  # most tokens evaluated in one tick (ready blocks first, then prompt chunks)
    prefill_chunk: int | None = (
        None  # prompts are prefilled in chunks this long, at fixed positions (None: min(64, tick_tokens))
    )
    swap_idle_s: float = 2.0  # a session idle this long may lose its KV to a newcomer
    busy_prefill_chunks: int = (
        1  # prompt chunks a tick may take while blocks wait on it (the rest of the budget otherwise)
    )
    reuse_prefixes: bool = True  # keep a closed session's prompt KV for a newcomer with that prefix (benchmarks comparing modes on one prompt turn it off)

    def __post_init__(self) -> None:
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.tick_tokens < 2:
            raise ValueError(f"tick_tokens must be >= 2, got {self.tick_tokens}")
        if self.prefill_chunk is None:
            self.prefill_chunk = min(64, self.tick_tokens)
        if not 1 <= self.prefill_chunk <= self.tick_tokens:
            raise ValueError(f"prefill_chunk must be in 1..tick_tokens, got {self.prefill_chunk}")
        if self.busy_prefill_chunks < 1:
            raise ValueError(f"busy_prefill_chunks must be >= 1, got {self.busy_prefill_chunks}")
        if not self.swap_idle_s >= 0:
            raise ValueError(f"swap_idle_s must be >= 0, got {self.swap_idle_s}")


@dataclass(eq=False)
class _Op:
    kind: str  # "open", "verify", "step", "rollback", "close"
    fut: concurrent.futures.Future
    args: tuple = ()
    submitted: float = field(default_factory=time.perf_counter)
    mark: int = 0  # the engine's evaluated-token count when submitted (for the wait figures)
    own_mark: int = 0  # the session's own evaluated tokens then (its own prefill is no one else's delay)
    job: VerifyJob | None = None  # a prepared verify, waiting for its rows


@dataclass(eq=False)
class _State(EngineSession):
    ops: deque = field(default_factory=deque)  # this session's requests, served in order
    slot: int | None = None  # its KV sequence, None while swapped out
    last_used: float = field(default_factory=time.monotonic)
    parked: bool = False  # its edge went away: first to lose its slot
    history: dict = field(default_factory=dict)  # start position -> tokens of each pass that built its KV
    own: int = 0  # tokens evaluated for this session
    closed: bool = False


def _resolve(fut: concurrent.futures.Future, value=None) -> None:
    if not fut.done():  # a caller that gave up (cancelled) no longer hears the answer; the work stands
        fut.set_result(value)


def _fail(fut: concurrent.futures.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
