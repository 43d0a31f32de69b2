"""One small interface over every model runtime: evaluate tokens, roll the KV cache back, tokenize.

A `Model` holds the tokens that are in its KV cache (`tokens`). `eval(new)` appends `new` and returns
the logits at every new position: row i is the distribution of the token that follows `new[i]`.
`rollback(n)` keeps the first `n` tokens. Everything above this layer (drafting, verifying, the
cloud server) speaks only this interface, so llama.cpp, transformers and the toy model are
interchangeable.
"""

from __future__ import annotations

import codecs
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np


class ModelError(RuntimeError):
    """A model could not be loaded or used (bad path, incompatible pair, context overflow)."""


class VocabMismatchError(ModelError):
    """The drafter and the target do not share a tokenizer, so draft token ids mean nothing to the target."""


class ContextOverflowError(ModelError):
    """Evaluating would exceed the model's context window."""


class Tokenizer(ABC):
    eos_ids: frozenset[int]  # tokens that end a generation
    fingerprint: str  # equal fingerprints <=> token ids mean the same text on both sides

    @abstractmethod
    def encode(self, text: str, *, special: bool = False) -> list[int]: ...

    @abstractmethod
    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @abstractmethod
    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat conversation, ready for the assistant's reply."""

    def token_text(self, token: int) -> str:
        return self.decode([token])


def vocab_fingerprint(n: int, pieces) -> str:
    """`vocab:<n>:<hash>` over every token's bytes (`pieces`: n byte strings, id order), each prefixed by
    its length, so no two vocabularies that differ in any token, or only in how their bytes split into
    tokens, share one. Every backend computes it the same way from its own tokenizer, so a GGUF drafter
    and a Hugging Face target made from the same vocabulary match, and nothing else does."""
    h = hashlib.sha256()
    count = 0
    for piece in pieces:
        h.update(len(piece).to_bytes(4, "big"))
        h.update(piece)
        count += 1
    if count != n:
        raise ValueError(f"vocab_fingerprint: {count} pieces for a vocabulary of {n}")
    return f"vocab:{n}:" + h.hexdigest()[:16]


class TextStream:
    """Incremental detokenizer: token pieces can split a UTF-8 character, so decode bytes statefully."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        return self._dec.decode(self._tok.decode_bytes(ids)) if len(ids) else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class Model(ABC):
    name: str
    vocab_size: int  # rows returned by eval have this many columns
    n_ctx: int  # context window in tokens
    tokenizer: Tokenizer

    n_slots: int = 1  # KV sequences this model can hold at once (forks for the state cache)
    kv_cells: int | None = None  # KV tokens the runtime allocated for all sequences together (None: n_slots x n_ctx)

    def __init__(self) -> None:
        self.tokens: list[int] = []  # what the active KV sequence holds, in order
        self.slot = 0  # the active sequence: eval and rollback act on it
        self._slots: dict[int, list[int]] = {0: self.tokens}

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, new: Sequence[int], last: int | None = None) -> np.ndarray:
        """Append `new` to the KV cache; return logits [len(new), vocab_size], or only the `last` rows."""
        new, want = self._checked(new, last)
        if not new:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        logits = self._eval(new, want)
        self.tokens.extend(new)
        return logits

    def _checked(self, new: Sequence[int], last: int | None) -> tuple[list[int], int]:
        """`eval`'s arguments checked against the active sequence's room and the vocabulary: (the tokens as
        ints, how many logits rows to return)."""
        new = [int(t) for t in new]
        if len(self.tokens) + len(new) > self.n_ctx:
            raise ContextOverflowError(
                f"{self.name}: {len(self.tokens)} + {len(new)} tokens exceed the context window of {self.n_ctx}"
            )
        for t in new:
            if not 0 <= t < self.vocab_size:
                raise ModelError(f"{self.name}: token id {t} outside the vocabulary [0, {self.vocab_size})")
        return new, len(new) if last is None else max(0, min(int(last), len(new)))

    def eval_many(self, items: Sequence[tuple[int, Sequence[int]]]) -> list[np.ndarray]:
        """Append tokens to several sequences at once: `items` is (slot, new tokens) per sequence, each
        slot at most once; returns the last logits row [V] of each. Runtimes that can put every
        sequence in one batch (llama.cpp) read the weights once for all of them, which is what makes
        pre-drafting several outcomes together cheaper than one after another."""
        if any(not len(new) for _, new in items):
            raise ModelError(f"{self.name}: eval_many needs at least one new token per sequence")
        return [rows[-1] for rows in self.eval_batch([(slot, new, 1) for slot, new in items])]

    def eval_batch(self, items: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """The general batched call: `items` is (slot, new tokens, want) per sequence, each slot at most
        once; appends each item's tokens to its sequence and returns its last `want` logits rows
        [want, V]. The cloud's batching engine puts every session's verify block (and prompt chunks,
        with want = 0) into one call, so the weights are read once per tick for all of them."""
        work: list[tuple[int, list[int], int]] = []
        for slot, new, want in items:
            new = [int(t) for t in new]
            if slot not in self._slots:
                raise ModelError(f"{self.name}: slot {slot} holds no sequence")
            if not new:
                raise ModelError(f"{self.name}: eval_batch needs at least one new token per sequence")
            if len(self._slots[slot]) + len(new) > self.n_ctx:
                raise ContextOverflowError(
                    f"{self.name}: {len(self._slots[slot])} + {len(new)} tokens exceed the context window of {self.n_ctx}"
                )
            bad = [t for t in new if not 0 <= t < self.vocab_size]
            if bad:
                raise ModelError(f"{self.name}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
            work.append((int(slot), new, max(0, min(int(want), len(new)))))
        if len({s for s, _, _ in work}) != len(work):
            raise ModelError(f"{self.name}: eval_batch got the same slot twice")
        if not work:
            return []
        rows = self._eval_batch(work)
        for slot, new, _ in work:
            self._slots[slot].extend(new)
        return rows

    def _eval_batch(self, items: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        """One sequence after another; runtimes with a multi-sequence batch override this."""
        main = self.slot
        rows = []
        try:
            for slot, new, want in items:
                self.activate(slot)
                rows.append(self._eval(new, want))
        finally:
            self.activate(main)
        return rows

    def held(self, slot: int) -> int:
        """How many tokens sequence `slot` holds (0 for a slot that holds none)."""
        return len(self._slots.get(slot, ()))

    def open_slot(self, slot: int) -> None:
        """Make `slot` an empty sequence (dropping whatever it held): one KV sequence per cloud session."""
        if not 0 <= slot < self.n_slots:
            raise ModelError(f"{self.name}: bad slot {slot} (slots 0..{self.n_slots - 1})")
        if slot == self.slot:
            self.rollback(0)
            return
        self._free(slot)
        self._slots[slot] = []

    def rollback(self, n: int) -> None:
        """Keep the first n tokens of the KV cache."""
        if not 0 <= n <= len(self.tokens):
            raise ModelError(f"{self.name}: cannot roll back to {n}; the cache holds {len(self.tokens)} tokens")
        if n < len(self.tokens):
            self._rollback(n)
            del self.tokens[n:]

    def reset(self) -> None:
        self.rollback(0)

    def sync(self, prefix: Sequence[int]) -> int:
        """Make the cache hold a prefix of `prefix`, reusing the longest common prefix; returns its length.

        The caller then evaluates `prefix[returned:]` itself (it usually needs those logits)."""
        n = 0
        limit = min(len(prefix), len(self.tokens))
        while n < limit and self.tokens[n] == prefix[n]:
            n += 1
        self.rollback(n)
        return n

    def prefill(self, prefix: Sequence[int]) -> int:
        """Make the cache hold exactly `prefix` (reusing the longest common prefix, evaluating the rest
        without logits); returns how many tokens were evaluated. Used to get a prompt's prefill done
        while waiting on something else."""
        n = self.sync(prefix)
        self.eval(list(prefix[n:]), last=0)
        return len(prefix) - n

    # -- forks: extra KV sequences sharing a prefix with the active one ------------------------------
    def fork(self, dst: int, n: int) -> None:
        """Sequence `dst` := the first `n` tokens of the active sequence. Runtimes with a shared KV
        cache (llama.cpp's unified cache) tag the same cells, so a fork costs no compute."""
        if not 0 <= dst < self.n_slots or dst == self.slot:
            raise ModelError(f"{self.name}: bad fork slot {dst} (slots 0..{self.n_slots - 1}, active {self.slot})")
        if not 0 <= n <= len(self.tokens):
            raise ModelError(f"{self.name}: cannot fork {n} tokens from a sequence of {len(self.tokens)}")
        self._fork(self.slot, dst, n)
        self._slots[dst] = self.tokens[:n]

    def activate(self, slot: int) -> None:
        """Make `slot` the active sequence (it must have been forked into)."""
        if slot not in self._slots:
            raise ModelError(f"{self.name}: slot {slot} holds no sequence")
        self.slot = slot
        self.tokens = self._slots[slot]

    def free(self, slot: int) -> None:
        """Drop sequence `slot` (not the active one)."""
        if slot == self.slot:
            raise ModelError(f"{self.name}: cannot free the active slot {slot}")
        if self._slots.pop(slot, None) is not None:
            self._free(slot)

    def _fork(self, src: int, dst: int, n: int) -> None:
        raise ModelError(f"{self.name}: this runtime does not support forked sequences")

    def _free(self, slot: int) -> None:
        pass

    @abstractmethod
    def _eval(self, new: list[int], want: int) -> np.ndarray:
        """Evaluate `new` after `self.tokens`; return the logits of the last `want` positions [want, V]."""

    @abstractmethod
    def _rollback(self, n: int) -> None: ...

    def close(self) -> None:
        """Release runtime resources (no-op where nothing needs releasing)."""


def check_compatible(draft: Model, target: Model) -> None:
    """Refuse a pair whose tokenizers differ: every draft token id would be nonsense to the target."""
    if draft.tokenizer.fingerprint != target.tokenizer.fingerprint:
        raise VocabMismatchError(
            f"drafter {draft.name!r} and target {target.name!r} use different tokenizers "
            f"({draft.tokenizer.fingerprint} vs {target.tokenizer.fingerprint}); pick a pair from the same family"
        )
