"""The `acespec` command, run for real in a subprocess (the installed entry point when there is one,
else `python -m acespec.cli`): JSON output, the baseline mode, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).with_name("acespec")
CMD = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "acespec.cli"]
TOY = ["--draft", "toy:vocab=64,seed=1,noise=0.5", "--target", "toy:vocab=64,seed=1"]


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def assert_usage_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("acespec: error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_generate_toy_json():
    p = run("generate", *TOY, "--prompt", "hi", "--json", "--max-tokens", "40", "--k", "3")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"text", "tokens", "stats"}
    s = out["stats"]
    assert len(out["tokens"]) == s["emitted"] == 40
    assert all(0 <= t < 64 for t in out["tokens"])
    assert out["text"] == "".join(f"<{t}>" for t in out["tokens"])  # the toy tokenizer's text
    assert s["mode"] == "speculative" and s["rule"] == "greedy" and s["k"] == 3
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["accepted"] / s["rounds"], abs=1e-3)
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], abs=1e-3)
    assert s["target_passes_per_token"] == pytest.approx(s["rounds"] / s["emitted"], abs=1e-3)
    assert s["target_passes_per_token"] < 1.0
    # deterministic: the same command gives the same tokens; and greedy equals the baseline
    again = json.loads(run("generate", *TOY, "--prompt", "hi", "--json", "--max-tokens", "40", "--k", "3").stdout)
    assert again["tokens"] == out["tokens"]
    base = json.loads(run("generate", *TOY, "--prompt", "hi", "--json", "--max-tokens", "40", "--no-spec").stdout)
    assert base["tokens"] == out["tokens"]


def test_generate_no_spec_is_one_pass_per_token():
    p = run("generate", *TOY, "--prompt", "hi", "--json", "--no-spec", "--max-tokens", "12")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)["stats"]
    assert s["target_passes_per_token"] == 1.0
    assert s["mode"] == "autoregressive" and s["drafted"] == 0 and s["emitted"] == s["rounds"] == 12


def test_generate_sampling_options_and_stream():
    p = run("generate", *TOY, "--prompt", "hello", "--rule", "coupled", "--temperature", "0.8", "--top-k", "10",
            "--top-p", "0.9", "--seed", "7", "--policy", "plus2minus1", "--max-tokens", "30", "--json")
    assert p.returncode == 0, p.stderr
    coupled = json.loads(p.stdout)
    plain = json.loads(run("generate", *TOY, "--prompt", "hello", "--rule", "coupled", "--temperature", "0.8",
                           "--top-k", "10", "--top-p", "0.9", "--seed", "7", "--max-tokens", "30", "--no-spec", "--json").stdout)
    assert coupled["tokens"] == plain["tokens"]  # coupled output does not depend on the drafter
    # without --json: the text streams to stdout, the stats go to stderr
    p = run("generate", *TOY, "--prompt", "hi", "--max-tokens", "5", "--rule", "strict", "--temperature", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("<") == 5 and "--- stats ---" in p.stderr and "target passes/token" in p.stderr


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--rule", "nope"], ["unknown rule 'nope'"]),
        (["--rule", "cactus:zeta=1"], ["no parameter 'zeta'"]),
        (["--rule", "cactus:delta=abc"], ["not a number"]),
        (["--rule", "strict:delta"], ["name=value"]),
        (["--target", "/nonexistent/dir/model.gguf"], ["does not exist"]),
        (["--draft", "./missing.gguf"], ["does not exist"]),
        (["--target", "no-such-model"], ["unknown model 'no-such-model'"]),
        (["--target", "toy:vocab=x"], ["not a number"]),
        (["--target", "toy:bogus=1"], ["bad toy model spec"]),
        (["--top-p", "1.5"], ["--top-p", "(0, 1]"]),
        (["--top-p", "0"], ["--top-p"]),
        (["--k", "-1"], ["--k", ">= 0"]),
        (["--temperature", "-0.5"], ["--temperature"]),
        (["--max-tokens", "ten"], ["--max-tokens", "not an integer"]),
        (["--policy", "sometimes"], ["--policy"]),
        (["--bogus-flag"], ["unrecognized arguments"]),
    ],
)
def test_bad_inputs_are_one_line_errors(args, needles):
    assert_usage_error(run("generate", *TOY, "--prompt", "hi", *args), *needles)


def test_bad_top_level_usage():
    assert_usage_error(run(), "required")
    assert_usage_error(run("frobnicate"), "invalid choice")
    assert_usage_error(run("generate", *TOY), "--prompt")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    assert_usage_error(run("generate", "--target", str(bad), "--draft", str(bad), "--prompt", "hi"), "not a GGUF file")
    d = tmp_path / "emptydir"
    d.mkdir()
    assert_usage_error(run("generate", "--target", str(d), "--prompt", "hi", "--no-spec"), "no config.json")


def test_vocab_mismatch_is_an_error():
    p = run("generate", "--draft", "toy:vocab=32", "--target", "toy:vocab=64", "--prompt", "hi")
    assert_usage_error(p, "different tokenizers")


def test_models_list():
    p = run("models", "list")
    assert p.returncode == 0, p.stderr
    assert "qwen2.5-coder-0.5b" in p.stdout and "qwen2.5-coder-1.5b" in p.stdout
    rows = json.loads(run("models", "list", "--json").stdout)
    assert {r["name"] for r in rows} >= {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert {r["role"] for r in rows} == {"drafter", "target"}
    for r in rows:
        assert r["status"] in ("installed", "partial", "missing") and r["size"] > 0


def test_models_path_errors(tmp_path):
    # an empty models directory: the registry models are not installed there
    p = run("models", "path", "qwen2.5-coder-0.5b", env={"ACESPEC_MODELS_DIR": str(tmp_path)})
    assert_usage_error(p, "not installed", "acespec models install qwen2.5-coder-0.5b")
    assert_usage_error(run("models", "path", "no-such-model"), "unknown model")
    # and the default pair needs installing before a generate can use it
    p = run("generate", "--prompt", "hi", env={"ACESPEC_MODELS_DIR": str(tmp_path)})
    assert_usage_error(p, "not installed")
    rows = json.loads(run("models", "list", "--json", env={"ACESPEC_MODELS_DIR": str(tmp_path)}).stdout)
    assert all(r["status"] == "missing" for r in rows)


def test_bench_is_a_subcommand_group():
    p = run("bench", "-h")
    assert p.returncode == 0, p.stderr
    assert "local" in p.stdout
    p = run("bench", "local", "-h")
    assert p.returncode == 0 and "--n-prompts" in p.stdout and "--json" in p.stdout
    assert_usage_error(run("bench"), "required")
    assert_usage_error(run("bench", "local", "--n-prompts", "0"), "--n-prompts")


def test_bench_local_toy(tmp_path):
    """The benchmark's whole path on toy models (the real run is the lead's, not the test suite's)."""
    out = tmp_path / "bench.json"
    p = run("bench", "local", "--draft", "toy:vocab=64,seed=1,noise=0.5", "--target", "toy:vocab=64,seed=1",
            "--n-prompts", "2", "--max-tokens", "12", "--json", str(out), "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "target passes/token" in p.stdout and "no wall-clock speed-up" in p.stdout
    data = json.loads(out.read_text())
    names = [c["name"] for c in data["configs"]]
    assert names == ["autoregressive", "greedy k=4", "coupled T=0.7 k=4", "plus2minus1", "controller"]
    for c in data["configs"]:
        s = c["summary"]
        assert s["emitted"] == 24  # 2 prompts x 12 tokens (toy: no end-of-sequence token)
        assert s["target_passes_per_token"] == pytest.approx(s["rounds"] / s["emitted"], abs=1e-3)
    assert data["configs"][0]["summary"]["target_passes_per_token"] == 1.0
    assert data["configs"][0]["summary"]["speedup"] == 1.0


def test_bench_cost_toy(tmp_path):
    """`bench cost` times both models per call size and fits a line; bad sizes are a usage error."""
    out = tmp_path / "cost.json"
    p = run("bench", "cost", "--draft", "toy:vocab=64,seed=1,noise=0.5", "--target", "toy:vocab=64,seed=1",
            "--sizes", "3,1,3", "--repeats", "2", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "t(n) =" in p.stdout
    data = json.loads(out.read_text())
    assert data["sizes"] == [1, 3]
    for role in ("drafter", "target"):
        m = data["models"][role]
        assert len(m["seconds"]) == 2 and all(s > 0 for s in m["seconds"])
        assert m["c0_s"] + 3 * m["c1_s"] == pytest.approx(m["seconds"][1])  # two points: the line goes through both
        assert data["prefill"][f"{role}_s_per_token"] > 0
    # the serving engine's passes (K = n - 1 drafts) and the per-row Python cost, for the simulator's profile
    assert data["engine"]["ks"] == [0, 2] and all(t > 0 for t in data["engine"]["verify_s"])
    assert data["rows"]["draft_choose_s"] > 0 and data["rows"]["verify_row_s"] > 0
    assert "through the serving engine" in p.stdout
    for bad in ("0", "1,x", ""):
        assert_usage_error(run("bench", "cost", "--sizes", bad), "--sizes")


@pytest.mark.real
def test_real_generate_cli():
    from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, installed_path

    for name in (DEFAULT_DRAFT, DEFAULT_TARGET):
        if installed_path(name) is None:
            pytest.skip(f"real model {name!r} is not installed; run `acespec models install {name}`")
    p = run("generate", "--prompt", "Write a Python function that adds two numbers.", "--chat",
            "--max-tokens", "16", "--k", "4", "--n-ctx", "1024", "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    s = out["stats"]
    assert 1 <= s["emitted"] == len(out["tokens"]) <= 16
    assert out["text"].strip()
    assert 0 < s["target_passes_per_token"] <= 1.0 and s["rounds"] >= 1
    print(f"\nreal CLI: {s['emitted']} tokens, passes/token {s['target_passes_per_token']}: {out['text']!r}")


def test_edge_cli_runs_the_full_acespec_system_losslessly():
    """`acespec edge --acespec` (pipelined + cache + branches + controller) against a real server on
    loopback emits what `--mode cloud-only` emits for the same seed (coupled sampling)."""
    from acespec.cloud.server import CloudServerThread, ServerConfig
    from acespec.models.toy import ToyModel

    common = ["--draft", "toy:vocab=64,seed=1,noise=0.5,noise_seed=3", "--prompt", "hi", "--max-tokens", "40",
              "--rule", "coupled", "--temperature", "0.8", "--seed", "3", "--json"]
    with CloudServerThread(ToyModel(vocab=64, seed=1), ServerConfig(port=0)) as cloud:
        where = ["--cloud", f"127.0.0.1:{cloud.port}"]
        ref = run("edge", *where, *common, "--mode", "cloud-only")
        full = run("edge", *where, *common, "--acespec")
        unbounded = run("edge", *where, *common, "--acespec", "--pass-budget", "inf")
        assert ref.returncode == 0 and full.returncode == 0 and unbounded.returncode == 0, \
            ref.stderr + full.stderr + unbounded.stderr
        a, b = json.loads(ref.stdout), json.loads(full.stdout)
        assert b["tokens"] == a["tokens"] and len(a["tokens"]) == 40
        assert json.loads(unbounded.stdout)["tokens"] == a["tokens"]
        assert b["stats"]["cache"]["lookups"] > 0  # the state cache ran (it records every verdict it consults)
    assert_usage_error(run("edge", *where, *common, "--acespec", "--mode", "sync"), "--acespec")
    assert_usage_error(run("edge", *where, *common, "--branches"), "--branches needs --cache")
    assert_usage_error(run("edge", *where, *common, "--cache", "--cache-budget-mb", "0"), "--cache-budget-mb")
    for bad in ("0", "-1", "nan", "x"):
        assert_usage_error(run("edge", *where, *common, "--acespec", "--pass-budget", bad), "--pass-budget")
    # only the controller keeps a pass budget: asking a fixed depth for one is an error, not a no-op
    assert_usage_error(run("edge", *where, *common, "--pass-budget", "0.5"), "--policy controller")


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--engine", "warp"], ["--engine"]),
        (["--engine", "serial", "--slots", "2"], ["--slots and --kv-budget are for the batched engine"]),
        (["--slots", "4", "--kv-budget", "100"], ["--kv-budget 100 leaves 25 tokens per slot"]),
        (["--batching", "loose"], ["--batching"]),
        (["--swap-idle", "-1"], ["--swap-idle must be >= 0"]),
        (["--tick-tokens", "0"], ["--tick-tokens"]),
    ],
)
def test_serve_refuses_bad_engine_options(args, needles):
    assert_usage_error(run("serve", "--target", "toy:vocab=64,seed=1", "--port", "0", *args), *needles)


def test_serve_batched_engine_serves_an_edge_over_the_cli():
    """`acespec serve` (batched engine, 2 slots of a small KV budget) answers a real `acespec edge`."""
    srv = subprocess.Popen([*CMD, "serve", "--target", "toy:vocab=64,seed=1", "--port", "0", "--slots", "2",
                            "--kv-budget", "1024", "--tick-tokens", "32", "--metrics-port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        assert "batched engine, 2 KV slot(s) of 512 tokens" in line, line
        port = line.split("listening on ")[1].split()[0].split(":")[1]
        metrics_url = srv.stdout.readline().split("metrics at ")[1].split()[0]
        outs = []
        for mode in ("pipelined", "cloud-only"):
            p = run("edge", "--cloud", f"127.0.0.1:{port}", "--draft", "toy:vocab=64,seed=1,noise=0.5", "--mode", mode,
                    "--prompt", "hello", "--max-tokens", "20", "--rule", "coupled", "--temperature", "0.8", "--json")
            assert p.returncode == 0, p.stderr
            outs.append(json.loads(p.stdout)["tokens"])
        assert outs[0] == outs[1] and len(outs[0]) == 20
        import urllib.request

        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert 'acespec:sessions_started_total{how="opened"} 2.0' in text, text
    finally:
        srv.terminate()
        srv.wait(30)


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--resume-grace", "0"], ["--resume-grace must be a positive number"]),
        (["--frame-timeout", "nan"], ["--frame-timeout must be a positive number"]),
        (["--tls-cert", "x.pem"], ["TLS needs both --tls-cert and --tls-key"]),
        (["--auth-failures-per-min", "-1"], ["--auth-failures-per-min"]),
        (["--gc-full", "-1"], ["--gc-full must be"]),
    ],
)
def test_serve_refuses_bad_trust_options(args, needles):
    assert_usage_error(run("serve", "--target", "toy:vocab=64,seed=1", "--port", "0", *args), *needles)


def test_serve_with_tenants_and_tls_serves_an_edge_and_drains_on_sigterm(tmp_path):
    """`acespec serve --token-file (two tenants) --tls-cert/--tls-key` answers `acespec edge --token-file
    --tls-ca`; a wrong token is refused; SIGTERM sends CLOSE(GOING_AWAY) to a connected session and
    the server exits 0."""
    import signal
    import socket
    import ssl

    trustme = pytest.importorskip("trustme")
    from acespec import wire

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    (tmp_path / "tenants.txt").write_text("# who may connect\nalice:alice-key\nbob:bob-key\n")
    (tmp_path / "alice.txt").write_text("alice-key\n")
    (tmp_path / "mallory.txt").write_text("guess\n")
    srv = subprocess.Popen([*CMD, "serve", "--target", "toy:vocab=64,seed=1", "--port", "0", "--token-file",
                            str(tmp_path / "tenants.txt"), "--tls-cert", str(tmp_path / "cert.pem"), "--tls-key",
                            str(tmp_path / "key.pem"), "--resume-grace", "5"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        assert "(TLS)" in line, line
        port = int(line.split("listening on ")[1].split()[0].split(":")[1])
        edge = ["edge", "--cloud", f"127.0.0.1:{port}", "--draft", "toy:vocab=64,seed=1,noise=0.5", "--prompt", "hello",
                "--max-tokens", "12", "--rule", "coupled", "--temperature", "0.8", "--json", "--tls-ca", str(tmp_path / "ca.pem")]
        ok = run(*edge, "--token-file", str(tmp_path / "alice.txt"))
        assert ok.returncode == 0, ok.stderr
        assert len(json.loads(ok.stdout)["tokens"]) == 12
        bad = run(*edge, "--token-file", str(tmp_path / "mallory.txt"))
        assert bad.returncode == 2 and "BAD_AUTH" in bad.stderr
        assert json.loads(bad.stdout)["error"]["code"] == "BAD_AUTH"
        # a session held open over TLS is told GOING_AWAY when the server is stopped
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        s.sendall(wire.encode(wire.Hello(model_id="toy:vocab=64", max_tokens=5, prompt=(1, 2, 3), auth=b"bob-key")))
        assert isinstance(wire.recv_frame(s), wire.Welcome)
        srv.send_signal(signal.SIGTERM)
        assert wire.recv_frame(s) == wire.Close(reason=wire.CloseReason.GOING_AWAY)
        s.close()
        assert srv.wait(30) == 0
    finally:
        if srv.poll() is None:
            srv.terminate()
            srv.wait(30)
