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
  draft, tokens proposed and accepted, steps decided with the edge's q rows), which the server reads for its statistics, and of one more row
  after the slots with the same counters over all sessions (exact even when sessions share a prompt and
  so cannot be told apart).

- **q rows, for rules that need them.** A session under a rule that needs the drafter's q (CACTUS,
  min-p, ...) uploads each draft token's sparse q row (the edge samples from its top-n, so the row is
  exact). With `q_topn` > 0 the board holds up to that many (token, prob) entries per draft token. The
  reader copies the drafts' tokens each step, but a q row only for the tokens it proposes (`QRows`),
  and keeps them only if the slot's sequence number is still the one its copy saw. The proposer hands
  them to AceSpec's rejection-sampler plugin in the same worker (`vllm_proposer.edge_q`).

Layout: one int64 row per slot, `HEADER` words then `max_drafts` drafts of `2 + 2 * draft_len` words
(base, length, tokens, parents), then, with `q_topn` > 0, `max_drafts * draft_len * q_topn` pairs of
words (token id, or -1 past a row's entries; its probability, a float64 stored in the int64 word).
parents use the wire's convention (0 = extends base, j + 1 = extends token j); a chain is written with
parents[i] = i.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from acespec.loop.board import BoardDraft

# header words of a slot
SEQ, KEY, PLEN, GEN, LIVE, K_CAP, N_DRAFTS, STEPS, DRAFT_STEPS, PROPOSED, ACCEPTED, Q_USED = range(12)
HEADER = 12

CONFIG_KEY = "acespec_board"  # vllm_config.additional_config entry: {"name", "slots", "max_drafts", "draft_len"}


def prompt_key(prompt: Sequence[int] | np.ndarray) -> int:
    """The slot key of a session: its prompt's length and tokens, as a positive int64."""
    h = hashlib.blake2b(
        np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8, person=len(prompt).to_bytes(8, "little")
    )
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
    seq: int = 0  # the slot's sequence number when copied (q rows read later are kept only if it still holds)


@dataclass(frozen=True)
class BoardShape:
    slots: int = 64  # cloud-led sessions at once (the engine's max_num_seqs)
    max_drafts: int = 8  # drafts held per session, as the embedded board
    draft_len: int = 64  # tokens kept of one draft (a longer one is cut: vLLM verifies at most K of it a step)
    q_topn: int = 0  # q entries kept per draft token (0: token-only drafts; a longer row is refused by the server)

    @property
    def head_words(self) -> int:
        return HEADER + self.max_drafts * (2 + 2 * self.draft_len)

    @property
    def words(self) -> int:
        return self.head_words + 2 * self.max_drafts * self.draft_len * self.q_topn

    def q_at(self, draft: int, token: int) -> int:
        """First word of the q row of token `token` of the slot's draft number `draft`."""
        return self.head_words + 2 * self.q_topn * (draft * self.draft_len + token)

    def as_config(self, name: str) -> dict:
        return {
            "name": name,
            "slots": self.slots,
            "max_drafts": self.max_drafts,
            "draft_len": self.draft_len,
            "q_topn": self.q_topn,
        }


class _Segment:
    def __init__(self, shm: shared_memory.SharedMemory, shape: BoardShape) -> None:
        self.shm, self.shape = shm, shape
        self.rows = np.ndarray((shape.slots + 1, shape.words), dtype=np.int64, buffer=shm.buf)  # + the totals row
        self.floats = self.rows.view(np.float64)  # the same words, for q rows' probabilities
        self.totals = self.rows[shape.slots]

    def close(self) -> None:
        self.rows = self.floats = self.totals = None  # type: ignore[assignment]  # the views must go before the mapping can
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
        drafts = list(drafts)[-sh.max_drafts :]
        for d in drafts:  # refused before a word is written: a slot left mid-write would never be read again
            if sh.q_topn and d.q is not None and any(len(row) > sh.q_topn for row in d.q):
                raise ValueError(f"a q row of more than {sh.q_topn} entries; this board keeps {sh.q_topn}")
        r[SEQ] += 1
        r[N_DRAFTS] = len(drafts)
        if k_cap is not None:
            r[K_CAP] = k_cap
        w = HEADER
        f = self.floats[i]
        for j, d in enumerate(drafts):
            n = min(len(d.tokens), sh.draft_len)
            r[w], r[w + 1] = d.base, n
            r[w + 2 : w + 2 + n] = d.tokens[:n]
            par = range(n) if d.parents is None else d.parents[:n]
            r[w + 2 + sh.draft_len : w + 2 + sh.draft_len + n] = par
            w += 2 + 2 * sh.draft_len
            if sh.q_topn and d.q is not None:
                for t, row in enumerate(d.q[:n]):
                    a, m = sh.q_at(j, t), len(row)
                    r[a : a + 2 * sh.q_topn : 2] = -1
                    if m:
                        r[a : a + 2 * m : 2] = [tok for tok, _ in row]
                        f[a + 1 : a + 2 * m : 2] = [prob for _, prob in row]
        r[SEQ] += 1

    def counters(self, i: int | None = None) -> dict:
        """Slot i's counters, or (None) those over every session."""
        r = self.totals if i is None else self.rows[i]
        return {
            "steps": int(r[STEPS]),
            "draft_steps": int(r[DRAFT_STEPS]),
            "proposed": int(r[PROPOSED]),
            "accepted": int(r[ACCEPTED]),
            "q_used": int(r[Q_USED]),
        }

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


class QRows:
    """The q rows of one draft on the board, read from shared memory when indexed (only the rows a
    proposal uses are read); check `BoardReader.still` after reading."""

    def __init__(self, reader: BoardReader, slot: int, draft: int) -> None:
        self.reader, self.slot, self.draft = reader, slot, draft

    def __getitem__(self, token: int) -> tuple[tuple[int, float], ...]:
        sh = self.reader.shape
        a = sh.q_at(self.draft, token)
        ids = self.reader.rows[self.slot, a : a + 2 * sh.q_topn : 2]
        probs = self.reader.floats[self.slot, a + 1 : a + 2 * sh.q_topn : 2]
        n = int(np.argmin(ids >= 0)) if (ids < 0).any() else len(ids)
        return tuple(zip(ids[:n].tolist(), probs[:n].tolist()))


class BoardReader(_Segment):
    """The worker's side: attaches by name, reads consistent copies of the live slots."""

    def __init__(self, cfg: dict) -> None:
        shape = BoardShape(int(cfg["slots"]), int(cfg["max_drafts"]), int(cfg["draft_len"]), int(cfg.get("q_topn", 0)))
        # vLLM spawns its workers from the server's process, so they share its resource tracker: the
        # attach registers a name already registered (a no-op), and the server's unlink ends it
        shm = shared_memory.SharedMemory(name=cfg["name"])
        super().__init__(shm, shape)

    def snapshot(self, tries: int = 8) -> list[SlotView]:
        """Every live slot, read consistently; a slot being written through all `tries` copies is left
        out of this step (the next one reads it)."""
        out: list[SlotView] = []
        L, head = self.shape.draft_len, self.shape.head_words
        for i in np.flatnonzero(self.rows[: self.shape.slots, LIVE]):
            for _ in range(tries):
                s0 = int(self.rows[i, SEQ])
                r = self.rows[i, :head].copy()
                if s0 % 2 == 0 and int(self.rows[i, SEQ]) == s0:
                    break
            else:
                continue
            if not r[LIVE]:
                continue
            drafts, w = [], HEADER
            for j in range(int(r[N_DRAFTS])):
                base, n = int(r[w]), int(r[w + 1])
                toks = tuple(int(t) for t in r[w + 2 : w + 2 + n])
                par = tuple(int(p) for p in r[w + 2 + L : w + 2 + L + n])
                q = QRows(self, int(i), j) if self.shape.q_topn else None
                # QRows reads a token's row from shared memory when indexed, which is all a board reader does with q
                drafts.append(BoardDraft(base, toks, None if par == tuple(range(n)) else par, q))  # type: ignore[arg-type]
                w += 2 + 2 * L
            out.append(SlotView(int(i), int(r[KEY]), int(r[PLEN]), int(r[GEN]), int(r[K_CAP]), drafts, s0))
        return out

    def still(self, view: SlotView) -> bool:
        """Whether slot `view.slot` is unchanged since `view` was copied (so q rows read since are its)."""
        return int(self.rows[view.slot, SEQ]) == view.seq

    def count(self, i: int, *, drafted: int = 0, accepted: int = 0) -> None:
        """One step of slot i's session: `drafted` tokens had been proposed for it, `accepted` were kept."""
        for r in (self.rows[i], self.totals):
            r[STEPS] += 1
            r[DRAFT_STEPS] += drafted > 0
            r[PROPOSED] += drafted
            r[ACCEPTED] += accepted

    def count_q(self, i: int) -> None:
        """Slot i's session had a step's draft decided with the q rows its edge sent (by the plugin)."""
        for r in (self.rows[i], self.totals):
            r[Q_USED] += 1
