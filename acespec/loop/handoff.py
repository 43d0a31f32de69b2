"""Who may use the edge's drafter: the follow loop, or a job running beside it.

A cloud-led edge (`loop/follow.py`) hands the user each streamed token from its loop, so the
drafter's long calls run beside the loop as a `DrafterJob`: the prompt's prefill (started while the
handshake is in flight), a late drafter's prefill on everything streamed so far, and a catch-up on
what the stream committed while the drafter rested. While a job runs, the loop leaves the drafter
alone; the first time it finds the job done it waits on it (which re-raises what the job raised) and
takes the drafter back. A run that ends while a prefill job computes stops it at its next piece
(`ChainDrafter.prefill`'s `stop`, asked every PREFILL_PIECE tokens): the user's response ends with the stream, not once the drafter has
read a long prompt that no draft will follow (2.8-3.7 s after the last token, on a 2,000-token ShareGPT
prompt with the drafter on one core). `DrafterHandoff` holds that state: the drafter (once one is bound), the job,
how to start one (`spawn`), and where a late drafter comes from (`source`).

A job is a thread on the live edge (`ThreadJob`: llama.cpp releases the GIL while it computes) and a
simulated thread in the simulator (`sim/edge.py`'s `SimJob`).
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from acespec.draft.chain import ChainDrafter


class DrafterJob(ABC):
    """Drafter work running beside the follow loop (the prompt's prefill, a catch-up)."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def wait(self) -> None:
        """Block until it is done; re-raise what it raised."""


class ThreadJob(DrafterJob):
    """A job on a thread of its own: llama.cpp releases the GIL while it computes."""

    def __init__(self, fn: Callable[[], None], name: str = "acespec-drafter-job") -> None:
        self._error: BaseException | None = None

        def body() -> None:
            try:
                fn()
            except BaseException as e:  # re-raised by wait(), in the loop's thread
                self._error = e

        self._thread = threading.Thread(target=body, name=name, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


Spawn = Callable[[Callable[[], None]], DrafterJob]  # how to run drafter work beside the loop


class DrafterHandoff:
    """The follow loop's drafter and the job that may hold it. Only the loop's thread touches this
    object; the job's thread touches only the drafter, and only while `job` is set."""

    def __init__(
        self,
        drafter: ChainDrafter | None,
        job: DrafterJob | None,
        spawn: Spawn | None,
        source: Callable[[], ChainDrafter | None] | None,
        after_first: bool,
    ) -> None:
        self.drafter = drafter  # the bound drafter; None until one joins (or for the whole run, with no source)
        self.needs_q = False  # the bound drafter's rule needs q rows with each draft
        self.job = job  # drafter work running beside the loop: while set, the loop leaves the drafter alone
        self.spawn = spawn  # how to start such work (None: catch up inside the next draft call instead)
        self.source = source  # asked, without blocking, for a late drafter (None once one joined, or if none will)
        self.after_first = after_first  # ask `source` only once the stream's first token is here
        self.joined_at: int | None = None  # tokens streamed when a late drafter joined
        self.catch_ups = 0  # catch-ups run as jobs beside the loop (stats)
        self.ending = threading.Event()  # set by settle(): a prefill job stops at its next piece

    def bind(self, drafter: ChainDrafter) -> None:
        """Take `drafter` for the rest of the run."""
        self.drafter = drafter
        self.needs_q = drafter.rule.info.needs_q

    def bound(self) -> ChainDrafter:
        """The drafter: the loop drafts only once one is bound."""
        assert self.drafter is not None, "the loop drafts only with a bound drafter"
        return self.drafter

    def late(self, emitted: int) -> ChainDrafter | None:
        """A late drafter, if `source` has one now (`emitted`: tokens streamed so far); asked no more after."""
        if self.source is None or (self.after_first and emitted == 0):
            return None
        drafter = self.source()
        if drafter is None:
            return None
        self.source = None
        return drafter

    def prefill_late(
        self, committed: Sequence[int], emitted: int, on_read: Callable[[int, float], None] | None = None
    ) -> None:
        """Start the bound late drafter's prefill on `committed` beside the loop (inside its first draft
        call, with no `spawn`). `on_read(tokens, seconds)`: told how fast it read (wall time)."""
        self.joined_at = emitted
        drafter, ctx = self.bound(), list(committed)
        if self.spawn is None:
            return

        def job() -> None:
            before, t = drafter.missing(ctx), time.perf_counter()
            drafter.prefill(ctx, stop=self.ending.is_set)
            if on_read is not None:
                on_read(before - drafter.missing(ctx), time.perf_counter() - t)

        self.job = self.spawn(job)

    def should_catch_up(self, committed: Sequence[int], lag: int) -> bool:
        """Whether the drafter lags `committed` by more than `lag` tokens and a job can catch it up."""
        return self.spawn is not None and self.bound().missing(committed) > lag

    def catch_up(self, committed: Sequence[int]) -> None:
        """Evaluate what the drafter lacks of `committed` beside the loop."""
        assert self.spawn is not None, "a catch-up job needs spawn"
        drafter, ctx = self.bound(), list(committed)
        self.job = self.spawn(functools.partial(drafter.prefill, ctx, stop=self.ending.is_set))  # its own context
        self.catch_ups += 1

    def waiting(self, emitted: int, joining: bool = True) -> bool:
        """Whether something beside the loop may soon want the loop's attention: a running job, or a
        late drafter the source may offer (once the first token is here; `joining`: one is wanted now)."""
        return self.job is not None or (joining and self.source is not None and emitted > 0)

    def running(self) -> bool:
        """Whether a job is computing on the drafter now (a finished one not yet waited on is not)."""
        return self.job is not None and not self.job.done()

    def idle(self) -> bool:
        """Whether no job holds the drafter (a finished one not yet waited on still holds it)."""
        return self.job is None

    def free(self) -> bool:
        """Whether the loop may use the drafter: no job is running (a finished one's error surfaces here)."""
        if self.job is None:
            return True
        if not self.job.done():
            return False
        job, self.job = self.job, None
        job.wait()
        return True

    def settle(self) -> None:
        """Stop a running job at its next piece and wait for it: the drafter must be idle before its
        owner uses it again."""
        self.ending.set()
        if self.job is not None:
            job, self.job = self.job, None
            job.wait()
