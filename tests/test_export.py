"""`acespec models export-hf`: the registry's GGUF target as a Hugging Face directory for vLLM, with a
tokenizer whose fingerprint equals the GGUF drafter's (or no edge could pair with a cloud serving it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.mark.real
def test_exported_target_tokenizer_pairs_with_the_gguf_drafter(real_draft, tmp_path):
    from acespec.models.export import export_hf, hf_tokenizer_fingerprint
    from acespec.models.hf import HFTokenizer
    from acespec.models.registry import DEFAULT_TARGET

    out = tmp_path / "target-hf"
    fp = export_hf(DEFAULT_TARGET, out, weights=False, say=lambda s: None)
    assert fp == real_draft.tokenizer.fingerprint
    assert hf_tokenizer_fingerprint(out) == fp  # and it survives the save/load round trip
    # the exported tokenizer encodes and decodes text as the GGUF one does
    import transformers

    tok = HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(out)), 151936)
    text = "def f(x):\n" + " " * 36 + "return x  # ok ✓"
    assert tok.encode(text) == real_draft.tokenizer.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_export_hf_refuses_bad_arguments(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "acespec.cli", "models", "export-hf", *args],
                              capture_output=True, text=True, timeout=120)

    r = run("qwen2.5-coder-1.5b")
    assert r.returncode != 0 and "NAME DIR" in r.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    r = run("qwen2.5-coder-1.5b", str(full))
    assert r.returncode != 0 and "not empty" in r.stderr
    assert (full / "x").read_text() == "keep me"
    r = run("toy:vocab=8", str(tmp_path / "t"))
    assert r.returncode != 0 and "not a GGUF model" in r.stderr


def test_export_hf_without_accelerate_says_which_profile_has_it(tmp_path, monkeypatch):
    """Where accelerate is missing (the vLLM profile), export-hf stops before reading anything, naming what is
    missing and the profile to export from, and writes no directory."""
    from acespec.models.base import ModelError
    from acespec.models.export import export_hf
    from acespec.models.registry import DEFAULT_TARGET, resolve

    path = resolve(DEFAULT_TARGET).path
    if not path or not os.path.exists(path):
        pytest.skip("the default target is not installed here")
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    said = []
    with pytest.raises(ModelError, match=r"accelerate is missing here.*scripts/setup.sh dev"):
        export_hf(DEFAULT_TARGET, tmp_path / "out", say=said.append)
    assert said == [] and not (tmp_path / "out").exists()
