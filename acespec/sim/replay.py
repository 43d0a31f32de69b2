"""Models that replay a recorded trace, so the simulator can run the real drafter, cache and verifier.

A trace (`acespec.sim.trace.PromptTrace`) holds the target's greedy output y, and, at every position of
y, the drafter's top-4 probabilities and the rank of y's token among them. Two `Model`s rebuild from
that exactly the behaviour the trace recorded:

- the target: after prompt + y[:j] its distribution is (all but) one-hot on y_j, so greedy
  verification commits y, token for token;
- the drafter: after prompt + y[:j] its distribution puts the recorded top-4 probabilities on four
  tokens, with y_j at its recorded rank (an alternative token at the other ranks), so a greedy
  drafter proposes y_j exactly when the real drafter did, and the state cache ranks the same
  outcomes with the same weights.

After a context that left y (a block built on a wrong guess, an outcome that did not happen), both
put their mass on the alternative tokens: nothing drafted there matches y, as the simulator assumes
(the real drafter matches by chance now and then).

Token ids are remapped to a small vocabulary (the trace's own ids plus four alternatives), so a row
costs microseconds; `real_id` maps them back for wire sizes. A replay model has no cost of its own:
the simulator charges virtual time for each call through `on_eval`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from acespec.models.base import Model, Tokenizer

__all__ = ["TraceVocab", "ReplayModel"]

N_ALT = 4  # alternative tokens: the drafter's candidates that are not y
OFF_TRACE_Q = (0.55, 0.25, 0.12, 0.08)  # the drafter's distribution over the alternatives once a context left y
ALT_REAL_BASE = 150000  # real ids the alternatives stand for (any id with a 3-byte varint sizes frames alike)
FLOOR = -30.0  # logit of the tokens a row gives no mass to


class TraceVocab:
    """The compact vocabulary of one trace: its prompt and y in compact ids, and the map back."""

    def __init__(self, trace) -> None:
        prompt = list(trace.prompt_tokens) or [100000] * trace.prompt_len
        real = sorted(set(prompt) | set(trace.tokens))
        index = {t: i for i, t in enumerate(real)}
        self.alt = list(range(len(real), len(real) + N_ALT))
        taken = set(real)
        alt_real = [t for t in range(ALT_REAL_BASE, ALT_REAL_BASE + 2 * N_ALT + len(taken)) if t not in taken][:N_ALT]
        self.real_id = np.asarray(real + alt_real, dtype=np.int64)  # compact id -> the real id (for wire sizes)
        self.size = len(self.real_id)
        self.prompt = [index[t] for t in prompt]
        self.y = [index[t] for t in trace.tokens]
        self.full = np.asarray(self.prompt + self.y, dtype=np.int64)
        self.P = len(self.prompt)
        self.trace = trace

    def matched(self, ctx: Sequence[int]) -> int:
        """How many leading tokens of `ctx` follow prompt + y."""
        n = min(len(ctx), len(self.full))
        if n == 0:
            return 0
        diff = np.flatnonzero(np.asarray(ctx[:n], dtype=np.int64) != self.full[:n])
        return int(diff[0]) if len(diff) else n


class ReplayTokenizer(Tokenizer):
    def __init__(self, vocab: TraceVocab) -> None:
        self.eos_ids = frozenset()  # a replayed generation ends at the trace's length (max_tokens)
        self.fingerprint = f"replay:{vocab.trace.id}:{vocab.size}"
        self.vocab = vocab

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        raise NotImplementedError("a replay model has no text")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(b"<%d>" % int(self.vocab.real_id[i]) for i in ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.vocab.prompt)


class ReplayModel(Model):
    def __init__(
        self, vocab: TraceVocab, role: str, *, n_slots: int = 64, on_eval: Callable[[list[int]], None] | None = None
    ) -> None:
        super().__init__()
        if role not in ("draft", "target"):
            raise ValueError(f"role must be draft or target, got {role!r}")
        self.v = vocab
        self.role = role
        self.vocab_size = vocab.size
        self.n_ctx = 1 << 20
        self.n_slots = n_slots
        self.tokenizer = ReplayTokenizer(vocab)
        self.name = f"replay-{role}:{vocab.trace.id}"
        self.on_eval = on_eval  # called with the new tokens per sequence of every call, before it returns
        self._off = self._row_off_trace()

    # -- rows -----------------------------------------------------------------------------------
    def _row_off_trace(self) -> np.ndarray:
        row = np.full(self.vocab_size, FLOOR)
        if self.role == "target":
            row[self.v.alt[0]] = 0.0
        else:
            row[self.v.alt] = np.log(OFF_TRACE_Q)
        return row

    def row(self, ctx_len: int, on_trace: bool) -> np.ndarray:  # -> [V]
        """Logits of the token after a context of `ctx_len` tokens, on prompt + y or off it."""
        g = ctx_len - self.v.P  # the generated position this row predicts
        tr = self.v.trace
        if not on_trace or g < 0 or g >= tr.n:
            return self._off
        y = self.v.y[g]
        row = np.full(self.vocab_size, FLOOR)
        if self.role == "target":
            row[y] = 0.0
            return row
        q = [float(p) for p in tr.top_q[g]][:N_ALT]
        rest = max(1.0 - sum(q), 1e-9)
        row[:] = np.log(rest / max(1, self.vocab_size - len(q)))
        alts = iter(self.v.alt)
        for r, p in enumerate(q):
            tok = y if r == tr.rank[g] else next(alts)
            row[tok] = np.log(max(p, 1e-12)) - 1e-6 * r  # ties keep the recorded order
        return row

    def _rows(self, ctx: list[int], first: int, last: int) -> np.ndarray:
        """Rows for the contexts ctx[:L], L = first+1 .. last (inclusive)."""
        m = self.v.matched(ctx)
        rows = [self.row(L, L <= m) for L in range(first + 1, last + 1)]
        return np.stack(rows) if rows else np.zeros((0, self.vocab_size))

    # -- the Model interface ----------------------------------------------------------------------
    def _eval(self, new: list[int], want: int) -> np.ndarray:
        if self.on_eval is not None:
            self.on_eval([len(new)])
        ctx = self.tokens + new
        return self._rows(ctx, len(ctx) - want, len(ctx))

    def _eval_batch(self, items: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        if self.on_eval is not None:
            self.on_eval([len(new) for _, new, _ in items])
        out = []
        for slot, new, want in items:
            ctx = self._slots[slot] + new
            out.append(self._rows(ctx, len(ctx) - want, len(ctx)))
        return out

    def _rollback(self, n: int) -> None:
        pass  # the token list is the whole state

    def _fork(self, src: int, dst: int, n: int) -> None:
        pass
