"""One model, several sessions: `SharedModel.view()` hands each session a `Model` of its own (its own KV
sequences), and the evaluations that sessions ask for at the same time run as one batched pass.

An edge that drafts for several chats at once would otherwise run one drafter per chat, each reading
the whole of the weights for every token it drafts. llama.cpp puts several sequences in one batch
(`Model.eval_batch`), and a pass over four sequences' next tokens costs far less than four passes,
because decoding a token on a CPU is mostly reading the weights. The views keep the sessions' code
unchanged: a `ChainDrafter` or a cloud-led `FollowLoop` drafts on a view as it would on a model of its
own, forks included (each view owns `slots_per_view` of the model's sequences).

How the calls meet: an evaluation queues its request; if no pass is being led, it leads one: it takes
the model's lock and evaluates every request queued so far in one `eval_batch`, and hands each its rows
(the others wait for theirs without touching the lock). Sessions that
draft at the same pace would otherwise take turns (each queues its next token just after the other's
pass began), so the lock holder first waits a moment for the other views that are drafting (those that
asked within the last few passes) to queue theirs: at most a fifth of a pass, and never for a view that
is idle. So a session alone waits for nobody, and sessions drafting together share their passes.
Everything else that touches the KV cache (rollback, fork, free) takes the same lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from acespec.models.base import ContextOverflowError, Model, ModelError

GATHER_PASSES = 4  # a view that asked within this many passes' time counts as drafting
GATHER_SHARE = 0.2  # the longest wait for drafting views to queue, as a share of a pass
GATHER_MAX_S = 0.01  # ... and in seconds


@dataclass(eq=False)
class _Request:
    view: int  # the asking view's first slot
    items: list[tuple[int, list[int], int]]  # (base slot, new tokens, want) per sequence
    rows: list[np.ndarray] | None = None
    error: BaseException | None = None
    done: bool = False


class SharedModel:
    """Splits `base` (a model loaded with `n_views * slots_per_view` KV sequences) into `n_views` views."""

    def __init__(self, base: Model, n_views: int, *, slots_per_view: int = 1, n_ctx: int | None = None) -> None:
        if n_views < 1 or slots_per_view < 1:
            raise ValueError("a shared model needs at least one view of at least one slot")
        if base.n_slots < n_views * slots_per_view:
            raise ModelError(
                f"{base.name}: {n_views} views x {slots_per_view} slots need {n_views * slots_per_view} KV sequences, "
                f"the model holds {base.n_slots}"
            )
        self.base = base
        self.n_ctx = n_ctx or base.n_ctx  # each view's context (the KV cells of all views together may be more)
        self._lock = threading.Lock()  # the model: one pass or KV edit at a time
        self._queued = threading.Condition()  # guards the queue and `_asked`
        self._queue: list[_Request] = []
        self._asked: dict[int, float] = {}  # view -> when it last asked
        self._pass_s = 0.0  # how long the last pass took
        self.passes = 0  # batched passes run
        self.requests = 0  # evaluations asked for (passes < requests when sessions shared passes)
        for slot in range(1, n_views * slots_per_view):  # every view's first slot holds a sequence
            if slot % slots_per_view == 0 and slot not in base._slots:
                base.open_slot(slot)
        self.views = [SlotView(self, v * slots_per_view, slots_per_view) for v in range(n_views)]

    def evaluate(self, view: int, items: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        """Rows for `items` (base slots), evaluated in the next pass, together with whatever else is queued."""
        req = _Request(view, items)
        with self._queued:
            self._queue.append(req)
            self.requests += 1
            self._asked[view] = time.perf_counter()
            self._queued.notify_all()
        while not req.done:
            # lead the next pass if nobody does; else wait to be served (or for the leader to leave), without
            # touching the model's lock: a served session must not queue behind the next leader's gathering
            if self._lock.acquire(blocking=False):
                try:
                    if not req.done:
                        batch = self._gather()
                        t0 = time.perf_counter()
                        self._run(batch)
                        self._pass_s = time.perf_counter() - t0
                finally:
                    self._lock.release()
                    with self._queued:
                        self._queued.notify_all()
            else:
                with self._queued:
                    self._queued.wait_for(lambda: req.done or not self._lock.locked(), timeout=1.0)
        if req.error is not None:
            raise req.error
        assert req.rows is not None
        return req.rows

    def _gather(self) -> list[_Request]:
        """The queue, once every view that is drafting has queued (or the short wait is over)."""
        with self._queued:
            now = time.perf_counter()
            recent = now - GATHER_PASSES * self._pass_s
            drafting = {v for v, t in self._asked.items() if t >= recent}
            deadline = now + min(GATHER_SHARE * self._pass_s, GATHER_MAX_S)
            while {r.view for r in self._queue} < drafting and (left := deadline - time.perf_counter()) > 0:
                self._queued.wait(left)
            batch, self._queue = self._queue, []
        return batch

    def _run(self, batch: list[_Request]) -> None:
        self.passes += 1
        try:
            rows = self.base.eval_batch([it for r in batch for it in r.items])
        except BaseException as e:  # noqa: BLE001 - handed to every request of the pass
            if len(batch) == 1:
                batch[0].error = e
            else:  # one bad request must not fail the others: run each alone
                for r in batch:
                    try:
                        r.rows = self.base.eval_batch(r.items)
                    except BaseException as e1:  # noqa: BLE001
                        r.error = e1
            self._finish(batch)
            return
        i = 0
        for r in batch:
            r.rows, i = rows[i : i + len(r.items)], i + len(r.items)
        self._finish(batch)

    def _finish(self, batch: list[_Request]) -> None:
        with self._queued:
            for r in batch:
                r.done = True
            self._queued.notify_all()

    def on_slot(self, slot: int, fn, *args):
        """Run `fn(*args)` on the base model with `slot` active (a KV edit), then restore the active slot."""
        with self._lock:
            main = self.base.slot
            self.base.activate(slot)
            try:
                return fn(*args)
            finally:
                self.base.activate(main)


class SlotView(Model):
    """A session's model inside a `SharedModel`: its slots 0..k-1 are the base's `first`..`first + k - 1`."""

    def __init__(self, shared: SharedModel, first: int, n_slots: int) -> None:
        super().__init__()
        base = shared.base
        self.shared, self.first = shared, first
        self.name = f"{base.name}[{first // n_slots}]"
        self.vocab_size, self.n_ctx, self.tokenizer = base.vocab_size, shared.n_ctx, base.tokenizer
        self.n_slots = n_slots
        self.kv_bytes_per_token = getattr(base, "kv_bytes_per_token", 0)
        self.n_threads = getattr(base, "n_threads", 1)
        self._slots = {0: base._slots[first]}  # the very lists the base keeps, so both see every token
        self.tokens = self._slots[0]

    def _base(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise ModelError(f"{self.name}: bad slot {slot} (slots 0..{self.n_slots - 1})")
        return self.first + slot

    def eval(self, new: Sequence[int], last: int | None = None) -> np.ndarray:
        # the base model appends the tokens to this view's sequence (the same list) in the shared pass
        new, want = self._checked(new, last)
        if not new:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        return self.shared.evaluate(self.first, [(self._base(self.slot), new, want)])[0]

    def eval_batch(self, items: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        work = [(self._base(slot), [int(t) for t in new], int(want)) for slot, new, want in items]
        for slot, new, _ in items:
            if len(self._slots.get(slot, ())) + len(new) > self.n_ctx:
                raise ContextOverflowError(f"{self.name}: slot {slot} would pass the context window of {self.n_ctx}")
        return self.shared.evaluate(self.first, work) if work else []

    def _eval(self, new: list[int], want: int) -> np.ndarray:  # eval is overridden; kept for the interface
        return self.eval(new, want)

    def _rollback(self, n: int) -> None:
        self.shared.on_slot(self._base(self.slot), self.shared.base._rollback, n)

    def fork(self, dst: int, n: int) -> None:
        if dst == self.slot or not 0 <= n <= len(self.tokens):
            raise ModelError(f"{self.name}: bad fork of {n} tokens to slot {dst}")
        base = self.shared.base
        self.shared.on_slot(self._base(self.slot), base.fork, self._base(dst), n)
        self._slots[dst] = base._slots[self._base(dst)]

    def free(self, slot: int) -> None:
        if slot == self.slot:
            raise ModelError(f"{self.name}: cannot free the active slot {slot}")
        if self._slots.pop(slot, None) is not None:
            base, b = self.shared.base, self._base(slot)
            self.shared.on_slot(self._base(self.slot), base.free, b)

    def open_slot(self, slot: int) -> None:
        raise ModelError(f"{self.name}: a shared model's view opens no sequences (its forks are its own)")
