"""Cloud-led drafts from the AceSpec server to vLLM's worker: a draft board in shared memory.

On vLLM a cloud-led session is one streaming vLLM request, and vLLM's own speculative decoding
verifies the edge's drafts (`speculative_config={"method": "custom_class", ...}`, the proposer in
`cloud/vllm_proposer.py`). The proposer runs in vLLM's worker process, not in the server's, so the
drafts cross a process boundary here:

- **One slot per cloud-led session** in a `multiprocessing.shared_memory` segment the server creates;
  its name reaches the worker through `vllm_config.additional_config["acespec_board"]`.
- **Found by content.** vLLM hands the proposer token ids, not request ids, so a slot is keyed by
  `prompt_key(prompt)`: the prompt's length and a hash of its tokens. Two sessions with one prompt
  share a key; the proposer then walks every draft of both along the row's own tokens (the board's
  `usable`, the same function the embedded engines use), and strict rejection sampling keeps any
  draft, right or wrong, exact. A collision costs acceptance, never a token.
- **Seqlock.** The server is the only writer of a slot's drafts: it makes the slot's sequence number
  odd, writes, then makes it even again; a reader copies the slot and keeps the copy only if the number
  was even and unchanged across the copy, so it never sees half a draft. (Plain stores and loads keep
  their order on x86-64, the platform vLLM's CPU and CUDA builds run on.)
- **Counters back.** The proposer is the only writer of a slot's counters (steps seen, steps given a
  draft, tokens proposed and accepted), which the server reads for its statistics, and of one more row
  after the slots with the same counters over all sessions (exact even when sessions share a prompt and
  so cannot be told apart).

Layout: one int64 row per slot, `HEADER` words then `max_drafts` drafts of `2 + 2 * draft_len` words
(base, length, tokens, parents). parents use the wire's convention (0 = extends base, j + 1 = extends
token j); a chain is written with parents[i] = i.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Sequence

import numpy as np

from acespec.engine.board import BoardDraft

# header words of a slot
SEQ, KEY, PLEN, GEN, LIVE, K_CAP, N_DRAFTS, STEPS, DRAFT_STEPS, PROPOSED, ACCEPTED = range(11)
HEADER = 11

CONFIG_KEY = "acespec_board"  # vllm_config.additional_config entry: {"name", "slots", "max_drafts", "draft_len"}


def prompt_key(prompt: Sequence[int]) -> int:
    """The slot key of a session: its prompt's length and tokens, as a positive int64."""
    h = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8,
                        person=len(prompt).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF or 1


@dataclass(frozen=True)
class SlotView:
    """One live slot as a reader copied it."""

    slot: int
    key: int
    prompt_len: int
    gen: int  # which session of the slot (assign counts them)
    k_cap: int  # most draft tokens a step of this session should verify (the server's ceiling)
    drafts: list[BoardDraft]


@dataclass(frozen=True)
class BoardShape:
    slots: int = 64  # cloud-led sessions at once (the engine's max_num_seqs)
    max_drafts: int = 8  # drafts held per session, as the embedded board
    draft_len: int = 64  # tokens kept of one draft (a longer one is cut: vLLM verifies at most K of it a step)

    @property
    def words(self) -> int:
        return HEADER + self.max_drafts * (2 + 2 * self.draft_len)

    def as_config(self, name: str) -> dict:
        return {"name": name, "slots": self.slots, "max_drafts": self.max_drafts, "draft_len": self.draft_len}


class _Segment:
    def __init__(self, shm: shared_memory.SharedMemory, shape: BoardShape) -> None:
        self.shm, self.shape = shm, shape
        self.rows = np.ndarray((shape.slots + 1, shape.words), dtype=np.int64, buffer=shm.buf)  # + the totals row
        self.totals = self.rows[shape.slots]

    def close(self) -> None:
        self.rows = self.totals = None  # type: ignore[assignment]  # the views must go before the mapping can
        self.shm.close()


class SharedBoard(_Segment):
    """The server's side: owns the segment, gives each cloud-led session a slot, writes its drafts."""

    def __init__(self, shape: BoardShape = BoardShape()) -> None:
        shm = shared_memory.SharedMemory(create=True, size=(shape.slots + 1) * shape.words * 8)
        super().__init__(shm, shape)
        self.rows[:] = 0
        self._free = list(range(shape.slots - 1, -1, -1))

    @property
    def name(self) -> str:
        return self.shm.name

    def assign(self, prompt: Sequence[int], k_cap: int) -> int | None:
        """A slot for a new session (None when every slot is taken: the session then runs unaided)."""
        if not self._free:
            return None
        i = self._free.pop()
        r = self.rows[i]
        r[SEQ] += 1
        gen = r[GEN] + 1  # a new session in the slot: the proposer starts its state afresh
        r[KEY + 1 :] = 0
        r[KEY], r[PLEN], r[GEN], r[K_CAP], r[LIVE] = prompt_key(prompt), len(prompt), gen, k_cap, 1
        r[SEQ] += 1
        return i

    def publish(self, i: int, drafts: Sequence[BoardDraft], k_cap: int | None = None) -> None:
        """Write the session's held drafts (newest last, as the board keeps them)."""
        sh = self.shape
        r = self.rows[i]
        r[SEQ] += 1
        drafts = list(drafts)[-sh.max_drafts :]
        r[N_DRAFTS] = len(drafts)
        if k_cap is not None:
            r[K_CAP] = k_cap
        w = HEADER
        for d in drafts:
            n = min(len(d.tokens), sh.draft_len)
            r[w], r[w + 1] = d.base, n
            r[w + 2 : w + 2 + n] = d.tokens[:n]
            par = range(n) if d.parents is None else d.parents[:n]
            r[w + 2 + sh.draft_len : w + 2 + sh.draft_len + n] = par
            w += 2 + 2 * sh.draft_len
        r[SEQ] += 1

    def counters(self, i: int | None = None) -> dict:
        """Slot i's counters, or (None) those over every session."""
        r = self.totals if i is None else self.rows[i]
        return {"steps": int(r[STEPS]), "draft_steps": int(r[DRAFT_STEPS]), "proposed": int(r[PROPOSED]),
                "accepted": int(r[ACCEPTED])}

    def release(self, i: int) -> None:
        r = self.rows[i]
        r[SEQ] += 1
        r[LIVE], r[N_DRAFTS] = 0, 0
        r[SEQ] += 1
        self._free.append(i)

    def destroy(self) -> None:
        self.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class BoardReader(_Segment):
    """The worker's side: attaches by name, reads consistent copies of the live slots."""

    def __init__(self, cfg: dict) -> None:
        shape = BoardShape(int(cfg["slots"]), int(cfg["max_drafts"]), int(cfg["draft_len"]))
        # vLLM spawns its workers from the server's process, so they share its resource tracker: the
        # attach registers a name already registered (a no-op), and the server's unlink ends it
        shm = shared_memory.SharedMemory(name=cfg["name"])
        super().__init__(shm, shape)

    def snapshot(self, tries: int = 8) -> list[SlotView]:
        """Every live slot, read consistently; a slot being written through all `tries` copies is left
        out of this step (the next one reads it)."""
        out: list[SlotView] = []
        L = self.shape.draft_len
        for i in np.flatnonzero(self.rows[: self.shape.slots, LIVE]):
            for _ in range(tries):
                s0 = int(self.rows[i, SEQ])
                r = self.rows[i].copy()
                if s0 % 2 == 0 and int(self.rows[i, SEQ]) == s0:
                    break
            else:
                continue
            if not r[LIVE]:
                continue
            drafts, w = [], HEADER
            for _ in range(int(r[N_DRAFTS])):
                base, n = int(r[w]), int(r[w + 1])
                toks = tuple(int(t) for t in r[w + 2 : w + 2 + n])
                par = tuple(int(p) for p in r[w + 2 + L : w + 2 + L + n])
                drafts.append(BoardDraft(base, toks, None if par == tuple(range(n)) else par))
                w += 2 + 2 * L
            out.append(SlotView(int(i), int(r[KEY]), int(r[PLEN]), int(r[GEN]), int(r[K_CAP]), drafts))
        return out

    def count(self, i: int, *, drafted: int = 0, accepted: int = 0) -> None:
        """One step of slot i's session: `drafted` tokens had been proposed for it, `accepted` were kept."""
        for r in (self.rows[i], self.totals):
            r[STEPS] += 1
            r[DRAFT_STEPS] += drafted > 0
            r[PROPOSED] += drafted
            r[ACCEPTED] += accepted
