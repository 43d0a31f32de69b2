"""An exact toy language model for tests and quick runs: `toy:vocab=64,seed=1`.

The logits at a position are a seeded table lookup keyed by the last `order` tokens, so the
distributions are known exactly, deterministic, and identical whether tokens are evaluated one at
a time or in a batch (batch-invariant, unlike real runtimes). A drafter that approximates a target
is the same table plus seeded noise: `toy:vocab=64,seed=1,noise=0.5,noise_seed=9`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from acespec.models.base import Model, ModelError, Tokenizer


class ToyTokenizer(Tokenizer):
    """Token i is the text `<i>`; text is encoded one byte per token (modulo the vocabulary)."""

    def __init__(self, vocab: int, eos: int | None) -> None:
        self.vocab = vocab
        self.eos_ids = frozenset() if eos is None else frozenset([eos])
        self.fingerprint = f"toy:vocab={vocab}"

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return [b % self.vocab for b in text.encode("utf-8")]

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return "".join(f"<{int(i)}>" for i in ids).encode()

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


class ToyModel(Model):
    def __init__(
        self,
        vocab: int = 64,  # vocabulary size
        seed: int = 1,  # which table
        order: int = 2,  # how many previous tokens the distribution depends on
        scale: float = 2.0,  # logit spread: larger means peakier distributions
        noise: float = 0.0,  # std of extra logit noise (a drafter that is close to, not equal to, the target)
        noise_seed: int = 0,  # which noise table
        eos: int = -1,  # end-of-sequence token id, -1 for none
        n_ctx: int = 1 << 20,  # context window
        n_slots: int = 64,  # forked sequences it can hold (they cost nothing here)
    ) -> None:
        super().__init__()
        if vocab < 2:
            raise ModelError(f"toy model needs vocab >= 2, got {vocab}")
        if order < 0:
            raise ModelError(f"toy model needs order >= 0, got {order}")
        self.vocab_size = int(vocab)
        self.seed, self.order, self.scale = int(seed), int(order), float(scale)
        self.noise, self.noise_seed = float(noise), int(noise_seed)
        self.n_ctx = int(n_ctx)
        self.n_slots = int(n_slots)
        self.tokenizer = ToyTokenizer(self.vocab_size, None if eos < 0 else int(eos))
        self.name = f"toy:vocab={vocab},seed={seed}" + (f",noise={noise:g}" if noise else "")
        self._table: dict[tuple[int, ...], np.ndarray] = {}
        self.eval_calls = 0  # how many batched evaluations ran (a "target pass")

    def _key_seed(self, ctx: tuple[int, ...]) -> int:
        h = hashlib.blake2b(np.asarray(ctx, dtype=np.int64).tobytes(), digest_size=8).digest()
        return int.from_bytes(h, "little")

    def logits_for_context(self, ctx: Sequence[int]) -> np.ndarray:  # -> [V]
        """The exact logits after the context `ctx` (only its last `order` tokens matter)."""
        key = tuple(int(t) for t in ctx[len(ctx) - self.order :]) if self.order else ()
        row = self._table.get(key)
        if row is None:
            h = self._key_seed(key)
            row = np.random.default_rng([self.seed, h]).standard_normal(self.vocab_size) * self.scale
            if self.noise:
                row = row + np.random.default_rng([self.noise_seed, h, 1]).standard_normal(self.vocab_size) * self.noise
            self._table[key] = row
        return row

    def _eval(self, new: list[int], want: int) -> np.ndarray:
        self.eval_calls += 1
        ctx = self.tokens + new
        base = len(self.tokens)
        rows = [self.logits_for_context(ctx[: base + i + 1]) for i in range(len(new) - want, len(new))]
        return np.stack(rows) if rows else np.zeros((0, self.vocab_size))

    def _rollback(self, n: int) -> None:
        pass  # the "KV cache" is just self.tokens

    def _fork(self, src: int, dst: int, n: int) -> None:
        pass  # likewise: the slot's token list is its whole state
