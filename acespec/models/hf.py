"""Hugging Face transformers backend (optional extra `acespec[hf]`): for HF checkpoints, GPUs in production.

The KV cache is a transformers `DynamicCache`; rolling back is `crop(n)`. Imports of torch and
transformers are deferred so the rest of AceSpec works without them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from acespec.models.base import Model, ModelError, Tokenizer, vocab_fingerprint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _require_hf():
    try:
        import torch  # heavy: the hf extra
        import transformers  # heavy: the hf extra
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ModelError("the Hugging Face backend needs torch and transformers: pip install 'acespec[hf]'") from e
    return torch, transformers


class HFTokenizer(Tokenizer):
    def __init__(self, tok: Any, vocab_size: int | None = None) -> None:
        self._tok = tok
        eos = tok.eos_token_id
        self.eos_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        # ids the model has but the tokenizer does not (Qwen pads its embedding to 151,936 rows) mean no text
        self.fingerprint = vocab_fingerprint(vocab_size or len(tok), _token_bytes(tok, vocab_size or len(tok)))

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=special))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False).encode("utf-8")

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            out = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return list(out)
        return self.encode("\n".join(m["content"] for m in messages), special=True)


class HFModel(Model):
    def __init__(self, model: Any, tokenizer: Any, name: str, device: str = "cpu") -> None:
        super().__init__()
        torch, transformers = _require_hf()
        self._torch = torch
        self._model = model.eval().to(device)
        self._device = device
        self.name = name
        self.vocab_size = int(model.config.vocab_size)
        self.n_ctx = int(getattr(model.config, "max_position_embeddings", 4096))
        self.tokenizer = (
            HFTokenizer(tokenizer, self.vocab_size) if tokenizer is not None else _IdTokenizer(self.vocab_size)
        )
        self._cache = transformers.DynamicCache()
        # transformers 5.x renamed the KV cache argument and output `past_key_values` -> `cache` (the old
        # name warns, and goes away in 5.40); use whichever this model's forward takes

        self._cache_kw = "cache" if "cache" in inspect.signature(self._model.forward).parameters else "past_key_values"

    @classmethod
    def load(cls, path_or_id: str | Path, *, device: str | None = None, dtype: str = "auto") -> HFModel:
        torch, transformers = _require_hf()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        local = Path(str(path_or_id))
        bare = local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES)
        try:
            # a bare local checkpoint (the tests' random models) has no tokenizer: token i is <i>
            tok = None if bare else transformers.AutoTokenizer.from_pretrained(str(path_or_id))
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path_or_id), dtype=dtype)
        except OSError as e:
            raise ModelError(f"cannot load Hugging Face model {path_or_id!s}: {e}") from e
        return cls(model, tok, name=str(path_or_id), device=device)

    def _eval(self, new: list[int], want: int) -> np.ndarray:
        torch = self._torch
        ids = torch.tensor([new], dtype=torch.long, device=self._device)
        with torch.no_grad():
            out = self._model(input_ids=ids, use_cache=True, **{self._cache_kw: self._cache})
        cache = getattr(out, "cache", None)
        self._cache = cache if cache is not None else out.past_key_values
        return out.logits[0, len(new) - want :].float().cpu().numpy()

    def _rollback(self, n: int) -> None:
        if n == 0:
            import transformers  # heavy: the hf extra

            self._cache = transformers.DynamicCache()
        else:
            # a negative argument removes that many tokens: transformers 4.x and 5.x agree on that form
            # (5.x rejects the positive "absolute length" form that 4.x also accepted)
            remove = self._cache.get_seq_length() - n
            if remove > 0:
                self._cache.crop(-remove)


_PAD = re.compile(r"^\[PAD\d+\]$")


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's char -> byte map (GPT-2's scheme): printable bytes stand for themselves, the
    other 68 are shifted to code points 256 and up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(rest)}}


def _token_bytes(tok: Any, n: int) -> list[bytes]:
    """Each id's bytes, as llama.cpp gives them for the same vocabulary (so the fingerprints agree):
    byte-level BPE pieces mapped back to bytes, special tokens as their text, and the `[PADi]` filler
    that GGUF conversion gives unused ids (llama.cpp: token type UNUSED, no bytes) as nothing."""
    pieces = tok.convert_ids_to_tokens(list(range(min(n, len(tok)))))
    special = {int(i) for i in getattr(tok, "added_tokens_decoder", {})}
    decoder = type(getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)).__name__
    if decoder == "ByteLevel":
        unbyte = _byte_level_decoder()

        def raw(i: int, p: str) -> bytes:
            if i in special or any(c not in unbyte for c in p):
                return p.encode()
            return bytes(unbyte[c] for c in p)
    else:  # sentencepiece and others: the decoded text is the best common ground

        def raw(i: int, p: str) -> bytes:
            return p.encode() if i in special else tok.decode([i]).encode()

    out = [
        b"" if p is None or (i not in special and _PAD.match(p) and p == f"[PAD{i}]") else raw(i, p)
        for i, p in enumerate(pieces)
    ]
    return out + [b""] * (n - len(out))


class _IdTokenizer(Tokenizer):
    """For a bare model without a tokenizer (tests): token i is `<i>`."""

    def __init__(self, vocab: int) -> None:
        self.eos_ids = frozenset()
        self.fingerprint = f"ids:{vocab}"
        self._vocab = vocab

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return [b % self._vocab for b in text.encode()]

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return "".join(f"<{int(i)}>" for i in ids).encode()

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))
