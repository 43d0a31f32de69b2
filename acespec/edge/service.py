"""The long-running edge behind `acespec edge serve`: drafters loaded once, one generation per request.

Concurrency: **no stream waits for a drafter.** A drafter holds one KV sequence (plus the state cache's
forks) and drafts one token chain at a time, so generations do not share one: `--drafters N` loads N
(llama.cpp maps the weights from the same file, so they share that memory and each adds only its KV
cache). An `auto` request (the default) starts its stream at once and borrows a drafter only when one
is free, after its first token, and only while no other stream on this edge still waits for its first
token (a drafter's prefill would compete with the cloud's for it where edge and cloud share cores):
until then it streams as cloud-only would, so a busy edge drafts less instead of slowing its streams. The edge-led modes (`sync`, `pipelined`, `acespec`) and `cloud-led`
cannot run without a drafter: they queue for one, first come first served, and beyond `max_waiting`
get 503. `cloud-only` requests need no drafter. The metrics show it: `acespec:num_requests_running`,
`acespec:num_requests_waiting`, `acespec:drafters_busy`, `acespec:request_queue_time_seconds`.

Each generation runs `run_edge` in its own thread (it is blocking network code, and llama.cpp
releases the GIL while it computes); verdicts come back to the event loop as `Round`s through an
asyncio queue. The worker thread, not the request, gives the drafter back, after its run has ended:
a client that goes away only sets the stop flag, and the drafter is never handed to the next
request while the old run still touches it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from acespec import wire
from acespec.edge.client import CloudSession, EdgeError
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop.loop import LoopResult, Round
from acespec.models.base import Model, TextStream

API_MODES = ("auto", "acespec", "pipelined", "sync", "cloud-only", "cloud-led")
MAX_STOP = 4  # stop strings per request, as OpenAI allows


class ApiError(Exception):
    """A request the edge refuses, with the HTTP status and OpenAI error type it maps to."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def edge_error_to_api(e: EdgeError) -> ApiError:
    """The cloud refused a session or could not be reached: the client's fault only for bad requests."""
    code = e.code
    if code in (wire.ErrorCode.BAD_REQUEST, wire.ErrorCode.OVER_LIMIT):
        return ApiError(
            400,
            f"the cloud refused the request: {e}",
            code="context_length_exceeded" if code == wire.ErrorCode.OVER_LIMIT else None,
        )
    return ApiError(
        503,
        f"the cloud is unavailable: {e}",
        type="service_unavailable",
        code=code.name.lower() if code is not None else "cloud_unreachable",
    )


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # HTTP listen address
    port: int = 8000  # HTTP port (0 = any free port)
    served_model: str = "acespec"  # the model name /v1/models lists and requests must name
    max_waiting: int = 64  # requests queued for a drafter; more get 503
    defaults: EdgeConfig = field(default_factory=lambda: EdgeConfig(rule="coupled"))  # what a request leaves out
    default_mode: str = "auto"  # mode for requests that name none: one of API_MODES
    seed: int | None = None  # seed for requests that give none; None = a fresh random seed per request

    def __post_init__(self) -> None:
        if self.default_mode not in API_MODES:
            raise ValueError(f"mode must be one of {', '.join(API_MODES)}, got {self.default_mode!r}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")


def edge_config_for(base: EdgeConfig, mode: str, **overrides) -> EdgeConfig:
    """The run configuration of one request: `base` holds the server's options, `mode` is one of
    API_MODES; `acespec` is the full system, as `acespec edge --acespec` runs it."""
    cfg = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if mode == "acespec":
        return dataclasses.replace(
            cfg, mode="pipelined", cache=True, branches=True, auto_window=True, policy="controller"
        )
    cache = base.cache and mode in ("sync", "pipelined")  # the server's --cache/--branches, where the mode can use them
    return dataclasses.replace(cfg, mode=mode, cache=cache, branches=base.branches and cache)


@dataclass
class GenRequest:
    """A validated request: what to generate and how."""

    prompt: list[int]  # prompt token ids
    cfg: EdgeConfig  # the run (mode, rule, K, sampling, budget, where the cloud is)
    mode: str  # as the request named it (one of API_MODES)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    marks: bool = False  # stream each token's text and origin, and the round's K/RTT (the web page)
    received: float = field(default_factory=time.perf_counter)  # when the request arrived (TTFT counts from here)


class DrafterPool:
    """Drafters handed out one generation at a time (see the module docstring): `acquire` waits in line,
    first come first served; `try_acquire`, from any thread, takes one only if it is free and nobody
    waits for it. `release` from any thread hands it to the first in line."""

    def __init__(self, drafters: list[Model], max_waiting: int) -> None:
        self.size = len(drafters)
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._free: list[Model] = list(drafters)
        self._line: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        with self._lock:
            return sum(not f.done() for _, f in self._line)

    @property
    def busy(self) -> int:
        with self._lock:
            return self.size - len(self._free)

    async def acquire(self) -> Model:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free and not self._line:
                return self._free.pop()
            if len(self._line) >= self.max_waiting:
                raise ApiError(
                    503,
                    f"{len(self._line)} requests are already waiting for a drafter; retry later",
                    type="service_unavailable",
                    code="queue_full",
                )
            fut: asyncio.Future = loop.create_future()
            self._line.append((loop, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            with self._lock:
                if (loop, fut) in self._line:
                    self._line.remove((loop, fut))
            raise

    def try_acquire(self) -> Model | None:
        with self._lock:
            return self._free.pop() if self._free and not self._line else None

    def release(self, loop: asyncio.AbstractEventLoop | None, drafter: Model) -> None:
        """From any thread (`loop` is unused: each waiter's own loop is woken)."""
        with self._lock:
            while self._line:
                wloop, fut = self._line.popleft()
                if not fut.done():
                    wloop.call_soon_threadsafe(self._hand, fut, drafter)
                    return
            self._free.append(drafter)

    def _hand(self, fut: asyncio.Future, drafter: Model) -> None:
        if fut.done():  # the waiter left between the hand-over and now: the next one gets it
            self.release(None, drafter)
        else:
            fut.set_result(drafter)


class FirstTokens:
    """The streams on this edge that still wait for their first token (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[int] = set()

    def waiting(self, owner: object) -> FirstTokens.Mark:
        with self._lock:
            self._waiting.add(id(owner))
        return FirstTokens.Mark(self, id(owner))

    def others_waiting(self, owner: object) -> bool:
        with self._lock:
            return bool(self._waiting - {id(owner)})

    class Mark:
        def __init__(self, board: FirstTokens, key: int) -> None:
            self.board, self.key = board, key

        def done(self) -> None:
            with self.board._lock:
                self.board._waiting.discard(self.key)


@dataclass
class Done:
    """The end of a generation's event stream."""

    result: LoopResult | None  # None when the run failed
    error: BaseException | None = None
    session: CloudSession | None = None


class ApiGeneration:
    """One request's run: waits for a drafter, runs `run_edge` in a thread, and yields its rounds."""

    def __init__(self, service, req: GenRequest) -> None:  # service: acespec.edge.api.EdgeService
        self.service = service
        self.req = req
        self.stop = threading.Event()  # set when the client left or a stop string matched
        self.events: asyncio.Queue = asyncio.Queue()
        self.queue_s = 0.0

    async def start(self) -> None:
        """Take a drafter (waiting in line) and start the worker; raises ApiError(503) when the line is full."""
        svc, loop = self.service, asyncio.get_running_loop()
        drafter = None
        if self.req.cfg.mode not in ("cloud-only", "auto"):  # auto borrows one later, if any is free
            t = time.perf_counter()
            drafter = await svc.pool.acquire()
            self.queue_s = time.perf_counter() - t
        svc.metrics.request_started(self.queue_s)
        worker = threading.Thread(target=self._work, args=(loop, drafter), name="acespec-edge-generation", daemon=True)
        try:
            worker.start()
        except BaseException:
            if drafter is not None:
                svc.pool.release(loop, drafter)
            raise

    def _work(self, loop: asyncio.AbstractEventLoop, drafter: Model | None) -> None:
        svc = self.service
        put = self.events.put_nowait
        closed: list[CloudSession] = []
        done = Done(None)
        tracker = svc.metrics.tracker(self.req.received)

        borrowed: list[Model] = []
        first = svc.first_tokens.waiting(self)

        def borrow() -> Model | None:  # auto: a drafter joins the stream only if one is free now
            if svc.first_tokens.others_waiting(self):
                return None
            d = svc.pool.try_acquire()
            if d is not None:
                borrowed.append(d)
            return d

        def on_round(r: Round) -> None:
            if r.tokens:
                first.done()
            tracker.round(r)
            loop.call_soon_threadsafe(put, r)

        source = borrow if self.req.cfg.mode == "auto" else None
        try:
            done.result = run_edge(
                drafter,
                self.req.prompt,
                self.req.cfg,
                model_id=svc.model_id,
                on_round=on_round,
                should_stop=self.stop.is_set,
                on_session_closed=closed.append,
                drafter_source=source,
                guard=svc.contention if self.req.cfg.contention_guard else None,
                backoff=svc.backoff,
            )
        except BaseException as e:  # handed to the request, which answers with an error
            done.error = e
        finally:
            first.done()
            for d in ([drafter] if drafter is not None else []) + borrowed:
                svc.pool.release(loop, d)
            done.session = closed[0] if closed else None
            tracker.finish(done.result, done.session)
            loop.call_soon_threadsafe(put, done)

    async def rounds(self) -> AsyncIterator[Round | Done]:
        while True:
            ev = await self.events.get()
            yield ev
            if isinstance(ev, Done):
                return


class TextAssembler:
    """Token ids -> text pieces (one per token, with its origin), cut at the first stop string.

    Text that could still turn into a stop string is held back until it cannot, so the text a stream
    delivers never has to be taken back. A stop string always starts in the held-back part: any text
    before it was released only once no stop string could start there."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self._stream = TextStream(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.sent = ""  # text released so far
        self._pending: list[list] = []  # [text, origin, token number] not released yet
        self.tokens = 0  # tokens taken in
        self.stopped_at: int | None = None  # tokens up to the one that completed a stop string

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def feed(self, tokens: list[int], origins: list[str]) -> list[tuple[str, str]]:
        """The pieces released by these tokens (nothing more once a stop string matched)."""
        if self.stopped:
            return []
        for t, o in zip(tokens, origins):
            self.tokens += 1
            self._pending.append([self._stream.push([t]), o, self.tokens])
        return self._release(final=False)

    def finish(self) -> list[tuple[str, str]]:
        """Everything still held back, once the generation has ended."""
        if self.stopped:
            return []
        tail = self._stream.flush()
        if tail:
            self._pending.append([tail, self._pending[-1][1] if self._pending else "target", self.tokens])
        return self._release(final=True)

    def _release(self, final: bool) -> list[tuple[str, str]]:
        pend = "".join(p[0] for p in self._pending)
        cut = len(pend)
        if self.stop:
            hit = min(((i, s) for s in self.stop if (i := pend.find(s)) >= 0), default=None)
            if hit is not None:
                cut = hit[0]
                self.stopped_at = self._token_at(hit[0] + len(hit[1]) - 1)
            elif not final:
                cut -= self._held(pend)
        out: list[tuple[str, str]] = []
        rest: list[list] = []
        used = 0
        for i, (text, origin, n) in enumerate(self._pending):
            if used + len(text) <= cut:
                if text:  # a piece that ends inside a UTF-8 character shows up with the next token
                    out.append((text, origin))
                used += len(text)
                continue
            if used < cut:  # the cut falls inside this piece
                out.append((text[: cut - used], origin))
                rest = [[text[cut - used :], origin, n], *self._pending[i + 1 :]]
            else:
                rest = self._pending[i:]
            break
        self._pending = [] if self.stopped else rest
        self.sent += "".join(t for t, _ in out)
        return out

    def _held(self, pend: str) -> int:
        """Length of the longest end of `pend` that a stop string starts with (a stop string cannot
        start in text already released: it would have been held back then)."""
        for n in range(min(len(pend), max(len(s) for s in self.stop) - 1), 0, -1):
            if any(s.startswith(pend[-n:]) for s in self.stop):
                return n
        return 0

    def _token_at(self, pos: int) -> int:
        used = 0
        for text, _, n in self._pending:
            used += len(text)
            if used > pos:
                return n
        return self.tokens


def new_seed() -> int:
    return secrets.randbits(32)
