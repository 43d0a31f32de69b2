"""`acespec serve --engine vllm` refuses what it cannot serve with a clear error, before loading anything
(these run in the main venv, without vLLM)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _serve(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "acespec.cli", "serve", "--engine", "vllm", "--port", "0", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_gguf_target_is_refused_with_the_export_command():
    r = _serve("--target", "qwen2.5-coder-1.5b")
    assert r.returncode == 2
    assert "Hugging Face model directory" in r.stderr and "acespec models export-hf qwen2.5-coder-1.5b DIR" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--target", "toy:vocab=8"], "Hugging Face model directory"),
    (["--kv-budget", "4096"], "--kv-budget and --batching are for the batched engine"),
    (["--logprobs", "50"], "--logprobs must be in 1..20"),
])
def test_bad_arguments(tmp_path, args, message):
    pytest.importorskip("transformers")
    from acespec.models.synthetic import save_random_qwen2

    d = save_random_qwen2(tmp_path / "m")
    full = args if args[0] == "--target" else ["--target", str(d), *args]
    r = _serve(*full)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_without_vllm_installed_it_says_how_to_get_it(tmp_path):
    pytest.importorskip("transformers")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed in this venv")
    except ImportError:
        pass
    from acespec.models.synthetic import save_random_qwen2

    r = _serve("--target", str(save_random_qwen2(tmp_path / "m")), "--n-ctx", "512")
    assert r.returncode == 2 and "scripts/setup.sh vllm" in r.stderr, r.stderr


def test_bench_plugin_cost_without_vllm_says_where_to_run_it():
    pytest.importorskip("torch")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    r = subprocess.run([sys.executable, "-m", "acespec.cli", "bench", "plugin-cost"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "scripts/setup.sh vllm" in r.stderr and "Traceback" not in r.stderr
