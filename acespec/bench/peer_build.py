"""Building the peer for `acespec bench peer` (`peer.py`): llama.cpp's `llama-speculative-simple` and
`llama-completion`, from the llama.cpp source that the installed llama-cpp-python release ships in its sdist,
so both sides of the comparison run the same kernels. The sdist comes from the package registry (`pip
download`); the tools are built with the pinned CMake and Ninja into a cache directory, once.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from acespec import env as acespec_env

TOOLS = ("llama-speculative-simple", "llama-completion")


class PeerError(RuntimeError):
    """The peer could not be fetched, built or run; the message says which step and how to retry."""


# ------------------------------------------------------------------------------------------ building


def peer_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        raise PeerError("llama-cpp-python is not installed here: run `bash scripts/setup.sh dev` first") from None


def default_build_dir() -> Path:
    return acespec_env.cache_dir() / "peer" / f"llama-cpp-python-{peer_version()}"


def _tool(name: str) -> str:
    """CMake / Ninja from this environment (requirements/build.txt pins them), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise PeerError(f"{name} is not installed: `bash scripts/setup.sh dev` installs the pinned one")
    return found


def build_steps(root: Path, version: str) -> list[tuple[str, list[str]]]:
    """(what, argv) for each step that gets the source and builds the two tools under `root`."""
    src = root / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    return [
        (
            "download llama-cpp-python's sdist from the package registry",
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                f"llama-cpp-python=={version}",
                "-d",
                str(root / "sdist"),
            ],
        ),
        (
            "configure llama.cpp (Release, shared libraries, no network code, no tests)",
            [
                _tool("cmake"),
                "-S",
                str(src),
                "-B",
                str(root / "build"),
                "-G",
                "Ninja",
                f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
            ],
        ),
        (
            "build llama-speculative-simple and llama-completion",
            [_tool("cmake"), "--build", str(root / "build"), "--target", *TOOLS, "-j", str(os.cpu_count() or 1)],
        ),
    ]


def _unpack(root: Path) -> None:
    """Unpack the downloaded sdist under root/src (only its vendored llama.cpp is built)."""
    sdists = sorted((root / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise PeerError(f"pip downloaded no llama-cpp-python sdist into {root / 'sdist'}")
    with tarfile.open(sdists[-1]) as tf:
        tf.extractall(root / "src", filter="data")


def ensure_built(root: Path, *, steps: list[tuple[str, list[str]]] | None = None, log=sys.stderr) -> dict[str, Path]:
    """The two tools' paths, building them first (`build_steps`) if `root` does not hold them yet."""
    bins = {t: root / "build" / "bin" / t for t in TOOLS}
    if all(p.is_file() for p in bins.values()):
        return bins
    version = peer_version()
    steps = build_steps(root, version) if steps is None else steps
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"peer: building llama.cpp's {' and '.join(TOOLS)} once, from llama-cpp-python {version}'s source, "
        f"into {root} (about 3 minutes on 2 cores)",
        file=log,
        flush=True,
    )
    for i, (what, argv) in enumerate(steps):
        if i > 0 and steps[i - 1][0].startswith("download"):
            _unpack(root)
        t0 = time.perf_counter()
        print(f"peer: {i + 1}/{len(steps)} {what}", file=log, flush=True)
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise PeerError(
                f"peer: step {i + 1} ({what}) failed with exit status {done.returncode}:\n{tail}\n"
                f"retry with `acespec bench peer`; delete {root} to start over"
            )
        print(f"peer:   done in {time.perf_counter() - t0:.0f} s", file=log, flush=True)
    missing = [str(p) for p in bins.values() if not p.is_file()]
    if missing:
        raise PeerError(f"the build finished but left no {', '.join(missing)}")
    return bins
