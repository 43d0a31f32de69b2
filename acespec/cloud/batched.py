"""The embedded verify engine: continuous batching of every session's work on one target model.

One model context holds one KV sequence ("slot") per resident session. A worker thread runs ticks:

1. Closes and rollbacks, then admissions (a free slot, or the slot of a parked or idle session).
2. Each session with a pending block is prepared (`TargetVerifier.prepare`: stale blocks are
   answered at once, with no model work), and its slot is trimmed to the committed prefix.
3. One batch is filled under a token budget (`tick_tokens`): every ready block first, oldest request
   first, one per session (its next block's fate hangs on this verdict), as the committed token its
   slot lacks plus the draft, asking for the k + 1 rows its rule needs; then chunks of prompts still
   being prefilled, at most `busy_prefill_chunks` of them while blocks are waiting, so a long prompt
   never holds another session's verdict back by more than that.
4. One `Model.eval_batch` call evaluates it all; each session's rows go through its own rule
   (`TargetVerifier.finish`) and its verdict goes back to the server's event loop.

KV memory is explicit: `slots` sequences of `max_context` tokens (the model's context per sequence).
A newcomer gets a free slot, else the slot of a parked session (its edge went away) or of the least
recently used one idle for `swap_idle_s`; with none, `open` raises EngineBusy (the server answers
BUSY, retryable). A swapped-out session gets a slot back on its next request.

Prefix reuse across sessions. A closed session's slot is kept, KV and all, as a "retained" slot (the
first to go when a slot is needed, before any live session's). A newcomer whose prompt shares whole
prefill chunks with a retained slot's prompt takes that slot and keeps those chunks' KV: the KV at a
position is the same bits only if the same pass built it, so the engine keeps the chunks
[j*c, (j+1)*c) the closed session prefilled itself (its `history`) that the newcomer's own prefill
would have run with the very same tokens, and prefills the rest as usual (`prefix_reused_tokens`).

Same text whatever the load. A session's rows are the same bits alone or in any company, as long as
the runtime computes each sequence of a batch on its own (llama.cpp: `LlamaCppModel(batch_invariant=
True)`; the toy model always does) and the engine never changes the shapes a session's KV is built
with: prompts are prefilled in chunks at fixed positions (multiples of `prefill_chunk`) whatever the
budget leaves, and a swapped-out session's KV is rebuilt by replaying the very passes that first
built it (`history`), not by a prefill in other chunk sizes. docs/design-notes.md has the measurements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque

from acespec.cloud.batch_state import BatchConfig, _fail, _Op, _resolve, _State
from acespec.cloud.engine_api import EngineBusy, EngineSession, EngineStopped, SessionSpec, VerifyEngine
from acespec.loop.verifier import BlockVerdict
from acespec.models.base import Model

log = logging.getLogger("acespec.cloud.batched")


class BatchedEngine(VerifyEngine):
    name = "batched"
    serves_logprobs = True

    def __init__(self, target: Model, config: BatchConfig | None = None) -> None:
        self.target = target
        cfg = config or BatchConfig()
        if cfg.slots is None:
            cfg = dataclasses.replace(cfg, slots=target.n_slots)
        # the config's Optional fields, resolved (by the line above and BatchConfig.__post_init__)
        self.slots: int = cfg.slots or target.n_slots
        self.chunk: int = cfg.prefill_chunk or min(64, cfg.tick_tokens)
        if target.n_slots < self.slots:
            raise ValueError(f"the target holds {target.n_slots} KV sequences; the engine wants {self.slots}")
        self.cfg = cfg
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._sessions: dict[int, _State] = {}  # live sessions (resident or swapped out)
        self._admin: deque[tuple[_State, _Op]] = deque()  # opens, in arrival order
        self._holder: dict[int, _State] = {}  # slot -> resident session
        self._stopping = False
        self._thread: threading.Thread | None = None
        # figures for benchmarks and tests
        self.ticks = 0
        self.evaluated = 0  # tokens evaluated by the model, all ticks
        self.verdicts = 0
        self.swaps = 0  # sessions whose KV was dropped to make room
        self.refused = 0  # opens answered EngineBusy
        self.max_batch_sessions = 0  # most sessions in one tick
        self.max_wait_tokens = 0  # most tokens evaluated for other sessions between a block's arrival and its verdict
        self.kv_peak = 0  # most KV tokens resident at once
        self.tick_s = 0.0
        # closed sessions' slots, oldest first: slot -> (the passes that built its KV, its prompt's length)
        self._retained: dict[int, tuple[dict, int]] = {}
        self.prefix_reuses = 0  # newcomers that took a retained slot's prefill chunks
        self.prefix_reused_tokens = 0  # prompt tokens those newcomers did not evaluate

    # -- public interface (event loop side) -------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self.target.n_ctx

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="acespec-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    async def open(self, spec: SessionSpec) -> EngineSession:
        s = _State(next(self._ids), self._make_verifier(spec))
        op = self._submit(s, "open", admin=True)
        try:
            await asyncio.wrap_future(op.fut)
        except asyncio.CancelledError:
            self.close(s)  # admitted meanwhile or not, nobody will use it: free its slot
            raise
        return s

    async def verify(self, s, seq, base, tokens, q):
        return await self.submit_verify(s, seq, base, tokens, q)

    def submit_verify(self, s, seq, base, tokens, q):
        return asyncio.wrap_future(self._submit(s, "verify", (seq, base, list(tokens), q)).fut)

    async def step(self, s):
        return await asyncio.wrap_future(self._submit(s, "step").fut)

    async def rollback(self, s, n):
        await asyncio.wrap_future(self._submit(s, "rollback", (n,)).fut)

    def park(self, s) -> None:
        with self._cv:
            s.parked = True

    def close(self, s) -> None:
        with self._cv:
            if not s.closed:
                s.ops.append(_Op("close", concurrent.futures.Future()))
                self._cv.notify_all()

    def metrics(self) -> dict:
        with self._cv:
            resident = [st for st in self._holder.values()]
            retained = list(self._retained)
            kv = sum(self.target.held(st.slot) for st in resident if st.slot is not None)  # resident: a slot each
            return {
                "engine": self.name,
                "slots": self.slots,
                "tick_tokens": self.cfg.tick_tokens,
                "sessions": len(self._sessions),
                "resident": len(resident),
                "kv_tokens": kv,
                "kv_peak": self.kv_peak,
                "kv_tokens_allocated": self.target.kv_cells or self.slots * self.target.n_ctx,
                "kv_bytes_per_token": int(getattr(self.target, "kv_bytes_per_token", 0)),
                "ticks": self.ticks,
                "evaluated": self.evaluated,
                "verdicts": self.verdicts,
                "swaps": self.swaps,
                "refused": self.refused,
                "max_batch_sessions": self.max_batch_sessions,
                "max_wait_tokens": self.max_wait_tokens,
                "tick_s": round(self.tick_s, 3),
                "retained": len(retained),
                "retained_kv_tokens": sum(self.target.held(sl) for sl in retained),
                "prefix_reuses": self.prefix_reuses,
                "prefix_reused_tokens": self.prefix_reused_tokens,
            }

    def _submit(self, s: _State, kind: str, args: tuple = (), *, admin: bool = False) -> _Op:
        op = _Op(kind, concurrent.futures.Future(), args)
        with self._cv:
            if self._stopping:
                raise EngineStopped("the verify engine is shutting down")
            if s.closed and not admin:
                raise EngineStopped(f"session {s.id} is closed")
            op.mark, op.own_mark = self.evaluated, s.own
            s.parked = False  # it is back
            (self._admin.append((s, op)) if admin else s.ops.append(op))
            self._cv.notify_all()
        return op

    # -- the worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self._has_work():
                        self._cv.wait()
                    if self._stopping:
                        break
                try:
                    self._tick()
                except Exception:  # a bug must not leave every session hanging: fail this tick's requests
                    log.exception("engine tick failed")
                    self._fail_in_flight()
        finally:
            self._cancel_everything()

    def _has_work(self) -> bool:
        if self._admin:
            return True
        for s in self._sessions.values():
            if s.ops or self._needs_prefill(s):
                return True
        return False

    def _needs_prefill(self, s: _State) -> bool:
        # a resident session whose slot lacks committed tokens is prefilled ahead of its first block
        return s.slot is not None and not s.verifier.finished and self.target.held(s.slot) < s.verifier.committed - 1

    def _tick(self) -> None:
        self._run_cheap_ops()  # closes first: a slot freed by a CLOSE is there for the newcomers below
        with self._cv:
            admin = list(self._admin)
            self._admin.clear()
        for s, op in admin:
            self._admit(s, op)
        batch, prefill = self._plan()
        if not batch and not prefill:
            return
        t0 = time.perf_counter()
        items = [(s.slot, toks, want) for s, toks, want, _ in batch] + [(s.slot, toks, 0) for s, toks in prefill]
        try:
            rows = self.target.eval_batch(items)
        except Exception as e:
            # the model refused (context overflow, a runtime error): fail those blocks, keep the engine up;
            # the slots are rebuilt from the committed prefix on the next request
            log.error("batched eval failed: %s", e)
            # every session in the tick hears it (a prompt chunk fails the request waiting on it), so
            # a model that keeps refusing cannot spin the engine; their KV is rebuilt on a retry
            for s in {x[0] for x in batch} | {x[0] for x in prefill}:
                if s.ops and s.ops[0].job is not None:
                    _fail(s.ops.popleft().fut, e)
                s.history.clear()
                self._evict(s)
            return
        done = time.perf_counter()
        self.ticks += 1
        self.tick_s += done - t0
        self.max_batch_sessions = max(self.max_batch_sessions, len(items))
        answers = []
        for (s, _, _, op), r in zip(batch, rows):
            s.ops.popleft()
            self.max_wait_tokens = max(self.max_wait_tokens, self.evaluated - op.mark - (s.own - op.own_mark))
            # the pass's own time, as `BlockVerdict.verify_us` means: the edge's link timing subtracts it from
            # the round trip, and its scheduler expects queued blocks' verdicts one verify apart, so a
            # time that also held this block's wait behind the blocks before it (submitted -> done)
            # counted that wait twice and put every verdict later than it came
            answers.append(
                (
                    op,
                    dataclasses.replace(
                        s.verifier.finish(op.job, r, done - t0),
                        shared=len(items),
                        prefill_rows=sum(len(t) for _, t in prefill),
                    ),
                )
            )
            s.last_used = time.monotonic()
        for s, toks, _, _ in batch:
            s.own += len(toks)
        for s, toks in prefill:
            s.own += len(toks)
        with self._cv:  # counted before anyone hears back, so a follow-up block is measured from here
            self.evaluated += sum(len(t) for _, t, _ in items)
            self.kv_peak = max(self.kv_peak, sum(self.target.held(sl) for sl in self._holder))
            self.verdicts += len(answers)
        for op, v in answers:
            _resolve(op.fut, v)

    def _admit(self, s: _State, op: _Op) -> None:
        if not op.fut.set_running_or_notify_cancel():
            return  # the newcomer gave up waiting: admit nobody
        slot, keep = self._best_retained(s.verifier.tokens)
        if slot is None:
            slot = self._free_slot(exclude=None)
        if slot is None:
            self.refused += 1
            _fail(op.fut, EngineBusy(f"all {self.slots} KV sequences are held by active sessions; retry later"))
            return
        with self._cv:
            self._sessions[s.id] = s
        self._give_slot(s, slot, keep)
        s.last_used = time.monotonic()
        _resolve(op.fut, None)

    def _pick_slot(self, exclude: _State | None, waiting: bool) -> tuple[int | None, _State | None]:
        """(a free slot, None), else (the oldest retained slot, None), else (the slot of the parked or least
        recently used idle session, that session), else (None, None). Picks only: `_free_slot` takes it."""
        holders = dict(self._holder)  # /ready reads this from another thread
        retained = list(self._retained)
        for slot in range(self.slots):
            if slot not in holders and slot not in retained:
                return slot, None
        if retained:  # a closed session's KV goes before any live session's (oldest first)
            return retained[0], None
        now = time.monotonic()
        idle = [h for h in holders.values() if h is not exclude and not h.ops]
        parked = [h for h in idle if h.parked]
        if parked:
            victim = min(parked, key=lambda h: h.last_used)
        else:
            # a returning session may take any idle slot; a newcomer only one idle for swap_idle_s
            old = [h for h in idle if waiting or now - h.last_used >= self.cfg.swap_idle_s]
            if not old:
                return None, None
            victim = min(old, key=lambda h: h.last_used)
        return victim.slot, victim

    def has_room(self) -> bool:
        return self._pick_slot(None, waiting=False)[0] is not None

    def _free_slot(self, exclude: _State | None, *, waiting: bool = False) -> int | None:
        """A slot for a newcomer (or a swapped-out session coming back): a free one, else a closed session's
        retained one, else the slot of the parked or least recently used idle session, whose KV is dropped."""
        slot, victim = self._pick_slot(exclude, waiting)
        if victim is None:
            return slot
        self._evict(victim)
        self.swaps += 1
        log.info("session %d swapped out of slot %d", victim.id, slot)
        return slot

    def _give_slot(self, s: _State, slot: int, keep: int = 0) -> None:
        """Make `slot` the session's, empty, or (a retained slot) keeping its first `keep` tokens, the prompt
        chunks `_reusable` vouched for: they count as the session's own passes from then on."""
        old = self._retained.pop(slot, None)
        self._holder[slot] = s
        s.slot = slot
        if old is None or keep <= 0:
            self.target.open_slot(slot)
            return
        self._trim(slot, keep)
        s.history = {k: list(v) for k, v in old[0].items() if k < keep}
        log.debug("session %d keeps %d prompt tokens of slot %d", s.id, keep, slot)
        self.prefix_reuses += 1
        self.prefix_reused_tokens += keep

    def _reusable(self, slot: int, tokens: list[int], n_prompt: int) -> int:
        """How many leading tokens of retained `slot` a newcomer may keep, whose tokens are `tokens` and
        whose prompt is its first `n_prompt`: the KV of the closed session's prompt chunks, each kept only
        where it is the very pass the newcomer's own prefill would run (same start, a multiple of c, and
        the same tokens: `tokens[j*c : min(n_prompt - 1, (j+1)*c)]`, so a prompt's partial last chunk only
        when both prompts end there), every one before it kept too, and no later pass of the closed
        session started inside it. Then each kept position is the bits the newcomer would have computed:
        the same tokens, by the same pass, over the same KV before it."""
        history, prompt_len = self._retained[slot]
        held = self._held_tokens(slot)
        c = self.chunk
        starts = sorted(history)
        keep, i = 0, 0
        while i < len(starts) and starts[i] == keep:
            chunk = history[keep]
            end = keep + len(chunk)
            nxt = starts[i + 1] if i + 1 < len(starts) else None
            # below the closed session's last prompt token every pass was a prompt chunk (verifies and
            # rollbacks start from it on); past it, passes are verifies, never a newcomer's prefill
            if not chunk or end > min(prompt_len - 1, len(held)) or (nxt is not None and nxt < end):
                break
            if chunk != tokens[keep : min(n_prompt - 1, keep + c)] or held[keep:end] != chunk:
                break
            keep, i = end, i + 1
            if len(chunk) < c:
                break  # a prompt's last chunk: nothing after it is a prompt chunk
        return keep

    def _best_retained(self, tokens: list[int]) -> tuple[int | None, int]:
        """The retained slot that saves a newcomer (whose tokens are its prompt) the most prefill, and how
        many tokens it keeps; (None, 0) when none shares a chunk."""
        best, keep = None, 0
        for slot in self._retained:
            n = self._reusable(slot, tokens, len(tokens))
            if n > keep:
                best, keep = slot, n
        return best, keep

    def _retain(self, s: _State) -> None:
        """A closing session's slot stays, for a newcomer with the same prompt prefix; only its prompt
        chunks can be reused, so it is trimmed to them (nothing left: freed)."""
        slot = s.slot
        if slot is None or self._holder.get(slot) is not s:
            s.slot = None
            return
        del self._holder[slot]
        s.slot = None
        if not self.cfg.reuse_prefixes:
            self.target.open_slot(slot)
            return
        self._retained[slot] = (s.history, s.verifier.prompt_len)
        keep = self._reusable(slot, self._held_tokens(slot), s.verifier.prompt_len)
        if keep <= 0:
            del self._retained[slot]
            self.target.open_slot(slot)
            return
        self._trim(slot, keep)

    def _trim(self, slot: int, keep: int) -> None:
        """Keep the first `keep` tokens of `slot`'s KV, leaving the model's active slot as it was."""
        m, prev = self.target, self.target.slot
        try:
            m.activate(slot)
            m.rollback(keep)
        finally:
            m.activate(prev)

    def _held_tokens(self, slot: int) -> list[int]:
        m = self.target
        if not m.held(slot):
            return []
        prev = m.slot
        try:
            m.activate(slot)
            return list(m.tokens)
        finally:
            m.activate(prev)

    def _drop_retained(self) -> None:
        for slot in list(self._retained):
            del self._retained[slot]
            self.target.open_slot(slot)

    def _evict(self, s: _State) -> None:
        if s.slot is not None and self._holder.get(s.slot) is s:
            del self._holder[s.slot]
            self.target.open_slot(s.slot)
        s.slot = None

    def _run_cheap_ops(self) -> None:
        """Closes, rollbacks and stale blocks need no model pass: answer them now, in each session's order."""
        for s in list(self._sessions.values()):
            while s.ops:
                op = s.ops[0]
                if op.kind == "close":
                    self._close(s)
                    break
                if op.kind == "rollback":
                    s.ops.popleft()
                    try:
                        s.verifier.rollback(*op.args)
                        _resolve(op.fut, None)
                    except Exception as e:
                        _fail(op.fut, e)
                    continue
                if op.job is None:
                    args: tuple = (0, s.verifier.committed, []) if op.kind == "step" else op.args
                    try:
                        job = s.verifier.prepare(args[0], args[1], args[2], args[3] if len(args) > 3 else None)
                    except Exception as e:
                        s.ops.popleft()
                        _fail(op.fut, e)
                        continue
                    if isinstance(job, BlockVerdict):  # stale, or the session has finished
                        s.ops.popleft()
                        self.verdicts += 1
                        _resolve(op.fut, job)
                        continue
                    op.job = job
                break

    def _close(self, s: _State) -> None:
        with self._cv:
            s.closed = True
            self._sessions.pop(s.id, None)
            ops = list(s.ops)
            s.ops.clear()
        self._retain(s)
        for op in ops:
            if op.kind == "close":
                _resolve(op.fut, None)
            else:
                op.fut.cancel()

    def _plan(self) -> tuple[list, list]:
        """This tick's work: ready blocks (oldest request first), then catch-up chunks, under the token budget."""
        budget = self.cfg.tick_tokens
        batch: list[tuple[_State, list[int], int, _Op]] = []
        waiting = sorted(
            (s for s in self._sessions.values() if s.ops and s.ops[0].job is not None), key=lambda s: s.ops[0].submitted
        )
        catch_up: list[_State] = []
        for s in waiting:
            if s.slot is None:
                slot = self._free_slot(exclude=s, waiting=True)
                if slot is None:
                    continue  # every slot is busy: wait for one to go idle
                self._give_slot(s, slot)
            op = s.ops[0]
            have = self._sync(s)
            if have < s.verifier.committed - 1:
                catch_up.append(s)  # its KV lacks committed tokens: rebuild first
                continue
            need = s.verifier.tokens[have:] + op.job.draft.tolist()
            if len(need) > budget and batch:
                continue  # next tick: it is the oldest request then, and the oldest block always goes
            batch.append((s, need, op.job.k + 1, op))
            self._record(s, have, need)
            budget -= len(need)
        prefill: list[tuple[_State, list[int]]] = []
        others = [
            s
            for s in self._sessions.values()
            if s not in catch_up and not any(b[0] is s for b in batch) and self._needs_prefill(s)
        ]
        for s in catch_up + sorted(others, key=lambda s: s.id):
            if batch and len(prefill) >= self.cfg.busy_prefill_chunks:
                break  # sessions are waiting on verdicts: their tick stays short
            have = self._sync(s)
            chunk, replay = self._next_chunk(s, have)
            if not chunk or (len(chunk) > budget and (batch or prefill)):
                continue
            prefill.append((s, chunk))
            if not replay:
                self._record(s, have, chunk)
            budget -= len(chunk)
        return batch, prefill

    def _next_chunk(self, s: _State, have: int) -> tuple[list[int], bool]:
        """What to evaluate next for a session whose KV holds `have` < committed - 1 tokens: the pass
        that first built position `have` again, with the very same tokens (a swapped-out session, so its
        KV comes back bit for bit), else the next canonical prompt chunk (chunks start at multiples of
        prefill_chunk, whatever the load, so a prompt's KV is the same alone or among others)."""
        again = s.history.get(have)
        if again is not None:
            return list(again), True
        c = self.chunk
        return s.verifier.tokens[have : min(s.verifier.committed - 1, (have // c + 1) * c)], False

    @staticmethod
    def _record(s: _State, start: int, tokens: list[int]) -> None:
        """Remember each pass that built the session's KV (from position `start`); later passes are void."""
        for k in [k for k in s.history if k >= start]:
            del s.history[k]
        s.history[start] = list(tokens)

    def _sync(self, s: _State) -> int:
        """Trim the session's slot to what it shares with the committed prefix (minus the last token,
        which every verify evaluates); returns how many tokens it keeps."""
        m = self.target
        prev = m.slot
        assert s.slot is not None, "only a resident session is synced"
        try:
            m.activate(s.slot)
            return m.sync(s.verifier.tokens[:-1])
        finally:
            m.activate(prev)

    def _fail_in_flight(self) -> None:
        err = RuntimeError("the verify engine failed on this tick; see the server log")
        for s in list(self._sessions.values()):
            if s.ops and s.ops[0].job is not None:
                op = s.ops.popleft()
                if not op.fut.done():
                    _fail(op.fut, err)
            self._evict(s)
        self._drop_retained()  # a bug may have left any slot's KV in doubt

    def _cancel_everything(self) -> None:
        with self._cv:
            pending = [op for _, op in self._admin] + [op for s in self._sessions.values() for op in s.ops]
            self._admin.clear()
            for s in self._sessions.values():
                s.ops.clear()
        for op in pending:
            if not op.fut.done():
                _fail(op.fut, EngineStopped("the verify engine stopped"))
