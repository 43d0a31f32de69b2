"""Every environment variable AceSpec reads, read here and nowhere else.

Settings that belong to one run are flags (or `--config` keys, see `acespec.config`); these are
the few that belong to the machine or the process and reach code no flag reaches (a model loaded by
a benchmark, a vLLM worker process). docs/operate/configuration.md has the same table for operators;
tests/test_config.py checks that it lists every variable here and that no other module reads one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what an unset (or blank) variable means, in words
    meaning: str  # one line, for the docs' table and `acespec config env`


THREADS = EnvVar(
    "ACESPEC_THREADS", "the CPU count", "threads a llama.cpp model computes on (a model's own n_threads wins)"
)
EXACT_PASSES = EnvVar(
    "ACESPEC_EXACT_PASSES",
    "1",
    "0 lets llama.cpp verify passes use its faster multi-row kernels "
    "(verified text may then part from plain decoding's)",
)
STEP_THREADS = EnvVar(
    "ACESPEC_STEP_THREADS",
    "pad",
    "one-token passes of a llama.cpp model past position 256: pad, auto or a thread count (see LlamaCppModel)",
)
MODELS_DIR = EnvVar(
    "ACESPEC_MODELS_DIR",
    "~/.cache/acespec/models",
    "where `acespec models install` puts models and where they are looked up",
)
CACHE_DIR = EnvVar("ACESPEC_CACHE", "~/.cache/acespec", "build cache of `acespec bench peer` (its llama.cpp build)")
VLLM_RULE = EnvVar(
    "ACESPEC_VLLM_RULE",
    "unset: vLLM's own sampler",
    "the verification rule the vLLM plugin applies in a vLLM process (e.g. coupled)",
)

VARIABLES: tuple[EnvVar, ...] = (THREADS, EXACT_PASSES, STEP_THREADS, MODELS_DIR, CACHE_DIR, VLLM_RULE)


def raw(var: EnvVar) -> str:
    """The variable's value, stripped; "" when it is unset."""
    return os.environ.get(var.name, "").strip()


def threads() -> int:
    """ACESPEC_THREADS as a thread count, else the CPU count."""
    text = raw(THREADS)
    if not text:
        return os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{THREADS.name} must be a positive integer, not {text!r}") from None
    if n < 1:
        raise ValueError(f"{THREADS.name} must be a positive integer, not {text!r}")
    return n


def exact_passes() -> bool:
    """ACESPEC_EXACT_PASSES: on unless it is 0."""
    return raw(EXACT_PASSES) != "0"


def step_threads() -> str:
    """ACESPEC_STEP_THREADS as given (pad, auto or a number; the model checks it), else pad."""
    return raw(STEP_THREADS) or "pad"


def models_dir() -> Path | None:
    """ACESPEC_MODELS_DIR, user-expanded; None when unset (the registry's default applies)."""
    text = raw(MODELS_DIR)
    return Path(text).expanduser() if text else None


def cache_dir() -> Path:
    """ACESPEC_CACHE, else ~/.cache/acespec."""
    text = raw(CACHE_DIR)
    return Path(text).expanduser() if text else Path.home() / ".cache" / "acespec"


def vllm_rule() -> str:
    """ACESPEC_VLLM_RULE, stripped; "" when unset."""
    return raw(VLLM_RULE)
