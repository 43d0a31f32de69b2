"""One configuration for the long-running roles (acespec/config): `--config FILE` (YAML, TOML) for
`serve`, `edge`, `edge serve` and `demo`, flags over the file, one-line errors with exit status 2,
`acespec config show`, the runtime configurations built from the tree, and the environment table.
The commands run for real in subprocesses, against real servers on loopback."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

from acespec import env
from acespec.cloud.engine import ENGINES
from acespec.config import ROLES, CloudRole, ConfigError, EdgeRole, EdgeServeRole, SamplingConfig
from acespec.config.roles import ApiMode, EdgeMode, Engine
from acespec.config.schema import leaves
from acespec.edge.options import edge_config, serve_config
from acespec.edge.runtime import MODES
from acespec.edge.service import API_MODES

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).with_name("acespec")
CMD = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "acespec.cli"]
TARGET = "toy:vocab=64,seed=1"
DRAFT = "toy:vocab=64,seed=1,noise=0.5,noise_seed=3"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=timeout)


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CMD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def assert_usage_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("acespec: error: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def cloud_port(srv: subprocess.Popen) -> tuple[int, str]:
    line = srv.stdout.readline()
    m = re.search(r"listening on [\d.]+:(\d+)", line)
    assert m, (line, srv.stderr.read() if srv.poll() is not None else "")
    return int(m.group(1)), line


@pytest.fixture
def cloud(tmp_path):
    """A real `acespec serve` on a free port, started from a YAML file."""
    cfg = tmp_path / "cloud.yaml"
    cfg.write_text(f"target: '{TARGET}'\nport: 0\n")
    srv = start("serve", "--config", str(cfg))
    try:
        port, _ = cloud_port(srv)
        yield port
    finally:
        stop(srv)


# ------------------------------------------------------------------------------------------ serve
def test_serve_starts_with_the_settings_of_a_yaml_file_and_a_flag_overrides_one(tmp_path):
    cfg = tmp_path / "cloud.yaml"
    cfg.write_text(f"# the cloud\ntarget: '{TARGET}'\nport: 0\nslots: 2\nkv-budget: 1024\ntick_tokens: 32\n")
    srv = start("serve", "--config", str(cfg))
    try:
        port, line = cloud_port(srv)
        assert "batched engine, 2 KV slot(s) of 512 tokens" in line, line
        edge = run("edge", "--cloud", f"127.0.0.1:{port}", "--draft", DRAFT, "--prompt", "hi", "--max-tokens", "9",
                   "--json")
        assert edge.returncode == 0, edge.stderr
        assert len(json.loads(edge.stdout)["tokens"]) == 9
    finally:
        stop(srv)
    srv = start("serve", "--config", str(cfg), "--slots", "4")  # the flag wins: 1024 tokens over 4 slots
    try:
        _, line = cloud_port(srv)
        assert "batched engine, 4 KV slot(s) of 256 tokens" in line, line
    finally:
        stop(srv)


# ------------------------------------------------------------------------------------------ edge
def test_edge_runs_with_the_settings_of_a_toml_file_and_flags_override_them(tmp_path, cloud):
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'cloud = "127.0.0.1:{cloud}"\ndraft = "{DRAFT}"\nprompt = "hello"\nmax_tokens = 11\n'
                   'rule = "coupled"\ntemperature = 0.8\nseed = 3\nmode = "cloud-only"\njson = true\n')
    a = run("edge", "--config", str(cfg))
    assert a.returncode == 0, a.stderr
    out = json.loads(a.stdout)
    assert len(out["tokens"]) == 11 and out["stats"]["mode"] == "cloud-only" and out["stats"]["rule"] == "coupled"
    # flags over the file: another mode gives the same text (coupled sampling), more tokens as asked
    b = run("edge", "--config", str(cfg), "--mode", "pipelined", "--acespec", "--max-tokens", "15")
    assert b.returncode == 0, b.stderr
    full = json.loads(b.stdout)
    assert full["stats"]["mode"] == "pipelined" and len(full["tokens"]) == 15
    assert full["tokens"][:11] == out["tokens"]


def test_edge_serve_runs_with_the_settings_of_a_toml_file_and_a_flag_overrides_one(tmp_path, cloud):
    cfg = tmp_path / "edge-serve.toml"
    cfg.write_text(f'cloud = "127.0.0.1:{cloud}"\ndraft = "{DRAFT}"\nport = 0\nserved-model-name = "tiny"\n'
                   'mode = "cloud-only"\nrule = "greedy"\nmax-tokens = 7\n')
    api = start("edge", "serve", "--config", str(cfg), "--served-model-name", "small")
    try:
        line = api.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+) \(model small; drafter (\S+) x 1; cloud (\S+); default mode (\S+), "
                      r"rule (\S+)\)", line)
        assert m, (line, api.stderr.read() if api.poll() is not None else "")
        assert m.group(2, 3, 4, 5) == (DRAFT, f"127.0.0.1:{cloud}", "cloud-only", "greedy")
        body = json.dumps({"model": "small", "prompt": "hello"}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{m.group(1)}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            usage = json.loads(r.read())["usage"]
        assert usage["completion_tokens"] == 7  # the file's max-tokens is the requests' default
    finally:
        stop(api)


# ------------------------------------------------------------------------------------------ config show
def test_config_show_prints_each_value_with_its_source_as_toml_that_reads_back(tmp_path):
    cfg = tmp_path / "cloud.yaml"
    cfg.write_text(f"target: '{TARGET}'\nmax-sessions: 3\nlead_pass_budget: 1.5\n")
    p = run("config", "show", "serve", "--config", str(cfg), "--max-sessions", "5", "--no-prefix-reuse")
    assert p.returncode == 0, p.stderr
    lines = {ln.split("=")[0].strip(): ln for ln in p.stdout.splitlines() if "=" in ln and not ln.startswith("# ")}
    assert lines["target"].endswith(f"# file {cfg}") and lines["lead-pass-budget"].endswith(f"# file {cfg}")
    assert lines["max-sessions"].endswith("# flag") and lines["prefix-reuse"].endswith("# flag")
    assert lines["port"].endswith("# default")
    shown = tomllib.loads(p.stdout)
    assert (shown["target"], shown["max-sessions"], shown["lead-pass-budget"], shown["prefix-reuse"], shown["port"]) \
        == (TARGET, 5, 1.5, False, 7070)
    assert "slots" not in shown and "# slots = (unset)" in p.stdout
    again = tmp_path / "shown.toml"
    again.write_text(p.stdout)
    q = run("config", "show", "serve", "--config", str(again))
    assert q.returncode == 0, q.stderr
    assert tomllib.loads(q.stdout) == shown


def test_config_show_knows_every_role_and_folds_nothing_away():
    p = run("config", "show", "edge-serve", "--acespec", "--pass-budget", "0.3")
    assert p.returncode == 0, p.stderr
    shown = tomllib.loads(p.stdout)
    assert shown["acespec"] is True and shown["pass-budget"] == 0.3 and shown["rule"] == "coupled"
    assert "seed" not in shown  # edge serve: unset, each request without one draws a fresh seed
    demo = tomllib.loads(run("config", "show", "demo").stdout)
    assert demo["max-tokens"] == 96 and "top-k" not in demo  # the demo's runs sample with no top-k
    assert tomllib.loads(run("config", "show", "edge").stdout)["mode"] == "auto"


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "name,text,needles",
    [
        ("c.yaml", "bogus: 1\n", ["unknown key 'bogus' in", "c.yaml"]),
        ("c.yaml", "max-sesions: 1\n", ["unknown key 'max-sesions'", "did you mean 'max-sessions'"]),
        ("c.yaml", "port: seven\n", ["port in", "must be an integer, not 'seven'"]),
        ("c.toml", "verbose = 1\n", ["verbose in", "must be true or false"]),
        ("c.toml", 'engine = "warp"\n', ["engine in", "must be one of batched, serial, vllm, noop"]),
        ("c.toml", "swap-idle = -1\n", ["swap-idle in", "must be >= 0"]),
        ("c.toml", "resume_grace = 0\n", ["resume-grace in", "must be a positive number of seconds"]),
        ("c.toml", "port = [\n", ["is not valid TOML"]),
        ("c.yaml", "- a\n- b\n", ["must hold a table of settings"]),
        ("c.json", "{}", ["must end in .toml, .yaml or .yml"]),
        ("c.toml", 'tls-cert = "x.pem"\n', ["TLS needs both --tls-cert and --tls-key", "c.toml"]),
    ],
)
def test_bad_config_files_are_one_line_errors_naming_the_key(tmp_path, name, text, needles):
    (tmp_path / name).write_text(text)
    assert_usage_error(run("serve", "--config", str(tmp_path / name)), *needles)


def test_a_missing_config_file_is_a_one_line_error():
    assert_usage_error(run("edge", "serve", "--config", "/nonexistent/edge.yaml"), "cannot read the config file")


@pytest.mark.parametrize("command", [["edge", "--cloud", "127.0.0.1:1", "--prompt", "hi"],
                                     ["edge", "serve", "--cloud", "127.0.0.1:1"], ["config", "show", "edge"]])
def test_a_window_of_zero_is_refused_by_every_edge_command_with_one_message(command):
    assert_usage_error(run(*command, "--window", "0"), "--window must be >= 1, got 0")


@pytest.mark.parametrize(
    "args,needles",
    [
        (["serve", "--max-connections", "0"], ["--max-connections must be >= 1"]),
        (["serve", "--port", "70000"], ["--port must be in 0..65535"]),
        (["edge", "--k", "0"], ["--k must be >= 1"]),
        (["edge", "--max-tokens", "0"], ["--max-tokens must be >= 1"]),
        (["edge", "--cloud", "nowhere"], ["--cloud", "HOST:PORT"]),
        (["edge", "--rule", "nope"], ["--rule", "unknown rule 'nope'"]),
        (["edge", "serve", "--drafters", "0"], ["--drafters must be >= 1"]),
        (["demo", "--profile", "moon"], ["--profile must be one of"]),
    ],
)
def test_values_that_used_to_slip_through_are_refused(args, needles):
    assert_usage_error(run(*args), *needles)


# ------------------------------------------------------------------------------------------ the tree
def test_every_setting_has_a_help_comment_and_a_unique_flag():
    for name, role in ROLES.items():
        settings = leaves(role())
        assert all(s.doc for s in settings), (name, [s.name for s in settings if not s.doc])
        assert len({s.flag for s in settings}) == len(settings)


def test_the_config_spells_the_runtime_choices_as_the_runtime_does():
    from typing import get_args

    assert set(get_args(EdgeMode)) == set(MODES)
    assert set(get_args(ApiMode)) == set(API_MODES)
    assert set(get_args(Engine)) == set(ENGINES)


def test_the_runtime_configurations_are_built_from_the_tree():
    full = edge_config(EdgeRole(cloud="127.0.0.1:7070,10.0.0.2:7071", acespec=True,
                                sampling=SamplingConfig(rule="coupled", temperature=0.8, seed=5)))
    assert (full.mode, full.cache, full.branches, full.auto_window, full.policy) == \
        ("pipelined", True, True, True, "controller")
    assert (full.rule, full.temperature, full.seed, full.connect.port, full.connect.replicas) == \
        ("coupled", 0.8, 5, 7070, (("10.0.0.2", 7071),))
    api = serve_config(EdgeServeRole(cloud="127.0.0.1:7070", acespec=True, pass_budget=0.3))
    # requests get the full system by default; their defaults are the options without it folded in
    assert api.default_mode == "acespec" and api.defaults.mode == "pipelined" and not api.defaults.cache
    assert api.seed is None and api.defaults.rule == "coupled" and api.defaults.pass_budget == 0.3


def test_checks_run_when_code_builds_a_role_too():
    with pytest.raises(ConfigError, match="--window must be >= 1"):
        EdgeRole(window=0)
    with pytest.raises(ConfigError, match="--branches needs --cache"):
        EdgeRole(branches=True)
    with pytest.raises(ConfigError, match="--tick-tokens must be >= 2"):
        CloudRole(tick_tokens=1)
    with pytest.raises(ConfigError, match="--seed must be an integer"):
        EdgeRole(sampling=SamplingConfig(seed=None))
    EdgeServeRole(sampling=SamplingConfig(seed=None))  # edge serve: unset = a fresh seed per request


# ------------------------------------------------------------------------------------------ environment
def test_no_module_but_acespec_env_reads_the_environment():
    readers = []
    for path in (ROOT / "acespec").rglob("*.py"):
        if path == ROOT / "acespec" / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                if (owner == "os.environ" and node.func.attr in ("get", "pop")) \
                        or ast.unparse(node.func) == "os.getenv":
                    readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" \
                    and isinstance(node.ctx, ast.Load):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []


def test_the_docs_table_lists_every_environment_variable():
    doc = (ROOT / "docs" / "operate" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(ACESPEC_\w+)` \|", doc, flags=re.M))
    assert rows == {v.name for v in env.VARIABLES}


def test_env_reads_each_variable_with_its_default(monkeypatch):
    monkeypatch.setenv("ACESPEC_THREADS", " 3 ")
    monkeypatch.setenv("ACESPEC_EXACT_PASSES", "0")
    monkeypatch.delenv("ACESPEC_STEP_THREADS", raising=False)
    assert (env.threads(), env.exact_passes(), env.step_threads()) == (3, False, "pad")
    monkeypatch.setenv("ACESPEC_THREADS", "zero")
    with pytest.raises(ValueError, match="ACESPEC_THREADS must be a positive integer"):
        env.threads()
    p = run("config", "env")
    assert p.returncode == 0 and all(v.name in p.stdout for v in env.VARIABLES)


def test_the_docs_examples_are_config_files_their_roles_take(tmp_path):
    import argparse

    from acespec.config import resolve

    doc = (ROOT / "docs" / "operate" / "configuration.md").read_text()
    examples = re.findall(r"```(yaml|toml)\n# \S+: acespec ([a-z ]+?) --config.*?\n(.*?)```", doc, flags=re.S)
    roles = {"serve": "serve", "edge": "edge", "edge serve": "edge-serve", "demo": "demo"}
    assert sorted(cmd for _, cmd, _ in examples) == sorted(roles)
    for kind, cmd, body in examples:
        path = tmp_path / f"{roles[cmd]}.{kind}"
        path.write_text(body)
        resolved = resolve(ROLES[roles[cmd]](), argparse.Namespace(config=str(path)))
        assert any(src.startswith("file ") for src in resolved.sources.values())


def test_a_config_file_or_flag_given_before_edge_serve_is_kept():
    from acespec.cli import build_parser

    args = build_parser().parse_args(["edge", "--config", "edge.toml", "--draft", DRAFT, "serve", "--port", "0"])
    assert (args.config, args.draft, args.port) == ("edge.toml", DRAFT, 0)
    assert not hasattr(build_parser().parse_args(["edge", "serve"]), "max_tokens")  # defaults come from the role


def test_the_sampling_settings_are_fields_of_hello_edge_config_and_spec_config():
    from dataclasses import fields

    from acespec import wire
    from acespec.edge.runtime import EdgeConfig
    from acespec.loop.local import SpecConfig

    names = {f.name for f in fields(SamplingConfig)}
    for cls in (wire.Hello, EdgeConfig, SpecConfig):
        assert names <= {f.name for f in fields(cls)}, cls
    assert set(SamplingConfig().hello_fields()) == names


def test_demo_runs_with_the_settings_of_a_yaml_file_and_a_flag_overrides_one(tmp_path):
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(f"draft: '{DRAFT}'\ntarget: '{TARGET}'\nprofile: lan\nquick: true\nmax-tokens: 12\n"
                   "temperature: 0.8\nseed: 5\n")
    p = run("demo", "--config", str(cfg), "--seed", "6", timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "rule coupled, temperature 0.8, seed 6 ===" in p.stdout, p.stdout
    assert "cloud-only" not in p.stdout  # quick: AceSpec alone


def test_the_old_name_of_a_renamed_policy_is_read_as_its_new_name_from_a_flag_and_a_file(tmp_path):
    """`--policy adaptive` was the +2/-1 schedule's name, beside a cost-model `AdaptiveController` that was
    `--policy controller`; the schedule is now `plus2minus1`, and the old spelling still works."""
    cfg = tmp_path / "edge.toml"
    cfg.write_text('policy = "adaptive"\n')
    for args in (("--policy", "adaptive"), ("--config", str(cfg))):
        p = run("config", "show", "edge", *args)
        assert p.returncode == 0, p.stderr
        assert tomllib.loads(p.stdout)["policy"] == "plus2minus1", p.stdout
    p = run("config", "show", "edge", "--policy", "+2/-1")
    assert_usage_error(p, "--policy", "plus2minus1")
    assert "adaptive" not in run("edge", "--help").stdout.split("--policy")[1].split("\n  --")[0]
