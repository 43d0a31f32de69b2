"""Model runtimes behind one interface (`Model`), and `load_model(spec)` for every way to name a model:

- a registry name (`qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`; see `acespec models list`),
- a path to a GGUF file (llama.cpp) or to a Hugging Face model directory (transformers),
- `hf:ORG/NAME` for a hub id where a hub is reachable,
- `toy:vocab=64,seed=1,...` for the exact toy model.
"""

from __future__ import annotations

from acespec.models.base import (
    ContextOverflowError,
    Model,
    ModelError,
    TextStream,
    Tokenizer,
    VocabMismatchError,
    check_compatible,
)
from acespec.models.hf import HFModel
from acespec.models.llama import LlamaCppModel
from acespec.models.registry import resolve
from acespec.models.toy import ToyModel


def load_model(spec: str, *, n_ctx: int = 4096, auto_install: bool = False, **kwargs) -> Model:
    """Load a model from any spec above. Raises ModelError / RegistryError with a clear message."""
    r = resolve(spec, auto_install=auto_install)
    if r.kind == "toy":
        try:
            return ToyModel(**r.options)
        except TypeError as e:
            raise ModelError(f"bad toy model spec {spec!r}: {e}") from None
    if r.kind == "gguf" and r.path is not None:  # a GGUF spec always resolves to a file
        return LlamaCppModel(r.path, n_ctx=n_ctx, name=r.name, **kwargs)
    if r.kind == "hf":
        return HFModel.load(r.path if r.path is not None else r.name, **kwargs)
    raise ModelError(f"unsupported model kind {r.kind!r} for {spec!r}")


__all__ = [
    "ContextOverflowError",
    "Model",
    "ModelError",
    "TextStream",
    "Tokenizer",
    "VocabMismatchError",
    "check_compatible",
    "load_model",
]
