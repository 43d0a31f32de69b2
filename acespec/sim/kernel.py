"""Virtual time for the simulator: an event queue, and threads that block on it instead of on the wall clock.

The simulator runs the real edge code (`SpecLoop`, the state cache, the depth policies), which is
written as ordinary blocking code: it drafts (a model call that takes time), then waits on the
transport for a verdict. To run that code on virtual time, each simulated edge runs in a `SimThread`
that holds a baton: exactly one thread (or the kernel itself) runs at any moment, so a run is
deterministic, and a thread gives the baton back whenever it would block:

- `sleep(dt)`: computing for dt seconds (a drafter call charges its cost this way);
- `Mailbox.get(timeout)`: waiting for a frame, at most `timeout` virtual seconds.

Everything else (the links, the cloud's batched passes) is an event callback on the kernel's queue.
Virtual time moves only between events, so a run takes as long as its Python work, not its wall time.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["Kernel", "SimThread", "Mailbox", "SimAbort"]


class SimAbort(BaseException):
    """Raised inside a simulated thread when the kernel shuts down before the thread finished."""


class Kernel:
    def __init__(self) -> None:
        self.t = 0.0
        self._q: list = []
        self._n = 0
        self._back = threading.Semaphore(0)  # a thread hands the baton back to the kernel here
        self._threads: list[SimThread] = []
        self.error: BaseException | None = None
        self.closed = False
        self.current: SimThread | None = None  # the thread holding the baton (None: the kernel's own callbacks)

    def now(self) -> float:
        """The virtual clock: the `clock` the loop, the cache and the transport are given."""
        return self.t

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run `fn` at virtual time `t` (not before now); equal times run in scheduling order."""
        self._n += 1
        heapq.heappush(self._q, (max(t, self.t), self._n, fn))

    def spawn(self, fn: Callable[[], None], name: str = "sim", at: float | None = None) -> SimThread:
        """Run `fn` in a simulated thread from virtual time `at` (default now)."""
        th = SimThread(self, fn, name)
        self._threads.append(th)
        self.at(self.t if at is None else at, th._resume)
        return th

    def run(self, until: float | None = None) -> None:
        """Process events until none is left (or the clock would pass `until`); re-raises the first
        error a simulated thread raised."""
        try:
            while self._q:
                if until is not None and self._q[0][0] > until:
                    break
                t, _, fn = heapq.heappop(self._q)
                self.t = t
                fn()
                if self.error is not None:
                    raise self.error
        finally:
            self.close()

    def close(self) -> None:
        """End every thread still blocked (a run that stopped early, or an error): each raises SimAbort."""
        self.closed = True
        for th in self._threads:
            if th.started and not th.done:
                th._go.release()
                self._back.acquire()


class SimThread:
    def __init__(self, kernel: Kernel, fn: Callable[[], None], name: str) -> None:
        self.k = kernel
        self.fn = fn
        self.name = name
        self._go = threading.Semaphore(0)
        self._thread: threading.Thread | None = None
        self.started = False
        self.done = False
        self._wake_id = 0  # the pending wake-up; a stale one (a timeout after a frame came) is ignored

    def _body(self) -> None:
        try:
            self.fn()
        except SimAbort:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the kernel, which re-raises it
            if self.k.error is None:
                self.k.error = e
        finally:
            self.done = True
            self.k._back.release()

    def _resume(self, wake_id: int | None = None) -> None:
        """Kernel side: let this thread run until it blocks again."""
        if self.done or (wake_id is not None and wake_id != self._wake_id):
            return
        self._wake_id += 1
        self.k.current = self
        if not self.started:
            self.started = True
            self._thread = threading.Thread(target=self._body, name=f"acespec-sim-{self.name}", daemon=True)
            self._thread.start()
        else:
            self._go.release()
        self.k._back.acquire()
        self.k.current = None

    def _block(self) -> None:
        """Thread side: hand the baton back and wait until the kernel resumes this thread."""
        self.k._back.release()
        self._go.acquire()
        if self.k.closed:
            raise SimAbort()

    def wake_at(self, t: float) -> None:
        wid = self._wake_id
        self.k.at(t, lambda: self._resume(wid))

    def sleep(self, dt: float) -> None:
        """Compute for `dt` virtual seconds."""
        if dt > 0:
            self.wake_at(self.k.t + dt)
            self._block()


class Mailbox:
    """Frames delivered to one simulated thread, in order; `get` waits for one on virtual time."""

    def __init__(self, kernel: Kernel) -> None:
        self.k = kernel
        self.items: deque = deque()
        self.waiter: SimThread | None = None

    def put(self, item) -> None:
        """Kernel side (a link delivers a frame)."""
        self.items.append(item)
        if self.waiter is not None:
            w, self.waiter = self.waiter, None
            w.wake_at(self.k.t)

    def get(self, thread: SimThread, timeout: float | None = None):
        """The next item, or None when `timeout` virtual seconds pass first (None = wait for one)."""
        if not self.items and timeout != 0.0:
            self.waiter = thread
            if timeout is not None:
                thread.wake_at(self.k.t + max(0.0, timeout))
            thread._block()
            self.waiter = None
        return self.items.popleft() if self.items else None
