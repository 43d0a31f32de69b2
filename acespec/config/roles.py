"""The settings of AceSpec's long-running roles, one frozen dataclass each.

- `SamplingConfig`: what a generation samples and how its drafts are verified; every role that
  generates shares it, and it is what a session's HELLO carries (`hello_fields`).
- `EdgeRole` (`acespec edge`) and `EdgeServeRole` (`acespec edge serve`), both `EdgeOptions`.
- `CloudRole` (`acespec serve`).
- `DemoRole` (`acespec demo`).

Each field's comment is its flag's help; `__post_init__` checks every value, so a bad one is refused
the same way from a flag, from a `--config` file and from code. The runtime's own configurations
(`EdgeConfig`, `ServeConfig`, `ServerConfig`) are built from these by the layer that owns them
(`acespec.edge.options`, `acespec.cloud.cli`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from acespec.config.schema import ConfigError, at_least, check, in_range, seconds
from acespec.control.depth import DEFAULT_PASS_BUDGET
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from acespec.net.profile import PROFILES
from acespec.verify import RuleSpec, RuleSpecError

# the runtime's names for these (edge.runtime.MODES, edge.service.API_MODES, cloud.engine.ENGINES) live
# above this layer; tests/test_config.py checks the two spellings agree
EdgeMode = Literal["auto", "sync", "pipelined", "cloud-only", "cloud-led"]
ApiMode = Literal["auto", "acespec", "pipelined", "sync", "cloud-only", "cloud-led"]
Policy = Literal["fixed", "plus2minus1", "controller"]  # plus2minus1 was "adaptive" (schema.OLD_CHOICES)
Engine = Literal["batched", "serial", "vllm", "noop"]

DEFAULT_PROMPT = "Write a Python function `is_prime(n)` that checks whether a number is prime, with a short docstring."
CORES_DEFAULT: Literal["split", "shared"] = "split" if (os.cpu_count() or 1) >= 2 else "shared"


# ------------------------------------------------------------------------------------------ sampling
@dataclass(frozen=True)
class SamplingConfig:
    """Sampling and verification: the fields a session's HELLO carries (shared by every role that generates)."""

    rule: str = "greedy"  # verification rule, e.g. greedy, strict, coupled, cactus:delta=0.35
    temperature: float = 0.0  # 0 = greedy sampling
    top_k: int = 0  # sample among the k likeliest tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much mass; 1.0 = off
    seed: int | None = 0  # drives every random choice, shared with the cloud (edge serve: unset = fresh per request)
    max_tokens: int = 128  # generation budget, in tokens

    def __post_init__(self) -> None:
        try:
            RuleSpec.parse(self.rule)
        except RuleSpecError as e:
            raise ConfigError("rule", f"{{key}}: {e}") from None
        check("temperature", 0 <= self.temperature < math.inf, self.temperature, "be a finite number >= 0")
        at_least("top_k", self.top_k, 0)
        check("top_p", 0 < self.top_p <= 1, self.top_p, "be in (0, 1]")
        at_least("seed", self.seed, 0)
        at_least("max_tokens", self.max_tokens, 1)

    @property
    def rule_spec(self) -> RuleSpec:
        return RuleSpec.parse(self.rule)

    def hello_fields(self) -> dict[str, Any]:
        """The HELLO frame's sampling fields (and EdgeConfig's, which carries them there); seed unset = 0."""
        return dict(
            rule=str(self.rule_spec),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed or 0,
            max_tokens=self.max_tokens,
        )


# ------------------------------------------------------------------------------------------ addresses
def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None
    if not 0 < p < 65536:
        raise ValueError(f"port out of range in {text!r}")
    return host.strip("[]"), p


def parse_fleet(text: str) -> list[tuple[str, int]]:
    """ "HOST:PORT[,HOST:PORT...]": one cloud, or the replicas of a fleet."""
    parts = [t.strip() for t in text.split(",")]
    if not all(parts):
        raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got {text!r}")
    out = [parse_hostport(t) for t in parts]
    if len(set(out)) != len(out):
        raise ValueError(f"--cloud lists an address twice: {text!r}")
    return out


# ------------------------------------------------------------------------------------------ edge
@dataclass(frozen=True)
class EdgeOptions:
    """How the edge drafts and reaches its cloud: shared by `acespec edge` and `acespec edge serve`."""

    draft: str = DEFAULT_DRAFT  # drafter model: a registry name, GGUF path, HF directory or toy:...
    cloud: str | None = None  # HOST:PORT of the cloud verifier (or WAN emulator); a fleet: HOST:PORT,HOST:PORT,...
    # the API's modes, a superset of the edge's: EdgeRole narrows it (a redeclared field keeps its place)
    mode: ApiMode = "auto"  # auto: the cloud streams, drafts join when ready; sync, pipelined: edge-led
    k: int = 4  # draft depth (the starting depth for the adaptive policies)
    policy: Policy = "fixed"  # draft-depth policy; controller prices K every round
    window: int = 2  # pipelined: blocks in flight
    auto_window: bool = False  # pipelined: grow the window to cover the measured round trip
    pass_budget: float = DEFAULT_PASS_BUDGET  # target passes per token the cloud grants, kept by the controller
    cache: bool = False  # pre-draft the likely verdict outcomes (the state cache)
    cache_budget_mb: float = 32.0  # state-cache memory budget, MB
    branches: bool = False  # also send pre-drafted outcomes as branch blocks (needs --cache)
    acespec: bool = False  # the full system: pipelined, --cache --branches --auto-window, --policy controller
    contention_guard: bool = True  # auto: rest the drafter while its work slows the cloud's steps (shared cores)
    token_file: str | None = None  # file holding this tenant's auth token
    tls: bool = False  # TLS with the system's trusted CAs (implied by --tls-ca)
    tls_ca: str | None = None  # TLS: check the cloud's certificate against this CA (PEM)
    tls_cert: str | None = None  # TLS: this edge's certificate (PEM), for a cloud that asks for one
    tls_key: str | None = None  # TLS: this edge's private key (PEM)
    tls_server_name: str | None = None  # TLS: the name the cloud's certificate must carry (default: the --cloud host)
    busy_retry: float = 60.0  # seconds to keep retrying a cloud that answers BUSY, with backoff
    n_ctx: int = 4096  # the drafter's context window (llama.cpp models)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    serving: ClassVar[bool] = False  # edge serve: --cache and --branches are defaults for requests that can use them
    seed_may_be_unset: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.cloud is not None:
            try:
                parse_fleet(self.cloud)
            except ValueError as e:
                raise ConfigError("cloud", f"{{key}}: {e}") from None
        at_least("k", self.k, 1)
        at_least("window", self.window, 1)
        check("pass_budget", self.pass_budget > 0, self.pass_budget, "be > 0 (inf = no limit)")
        check("cache_budget_mb", 0 < self.cache_budget_mb < math.inf, self.cache_budget_mb, "be a number > 0")
        check("busy_retry", self.busy_retry >= 0, self.busy_retry, "be >= 0")
        at_least("n_ctx", self.n_ctx, 1)
        if self.sampling.seed is None and not self.seed_may_be_unset:
            raise ConfigError("seed", "{key} must be an integer >= 0 here, not unset")
        full = self.preset()
        if self.pass_budget != DEFAULT_PASS_BUDGET and full.policy != "controller" and not self.controller_default():
            raise ConfigError(None, "--pass-budget is kept by the controller: add --policy controller (or --acespec)")
        if full.branches and not full.cache:
            raise ConfigError(None, "--branches needs --cache")
        if full.cache and full.mode in ("cloud-only", "cloud-led", "auto") and not self.serving:
            raise ConfigError(None, "--cache needs an edge-led mode (sync or pipelined)")

    def controller_default(self) -> bool:
        """Whether the default mode runs the controller, so --pass-budget has a taker without --policy."""
        return False

    def preset(self) -> EdgeOptions:
        """These options with `acespec` folded in (pipelined + cache + branches + auto window + controller)."""
        return self

    def connect_target(self) -> tuple[tuple[str, int], list[tuple[str, int]]]:
        """(the first cloud, the other replicas); --cloud is required here."""
        if not self.cloud:
            raise ConfigError(None, "--cloud HOST:PORT is required")
        first, *replicas = parse_fleet(self.cloud)
        return first, replicas

    @property
    def wants_tls(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_key)


@dataclass(frozen=True)
class EdgeRole(EdgeOptions):
    """`acespec edge`: one generation through the cloud, streamed to stdout."""

    mode: EdgeMode = "auto"  # auto: the cloud streams, drafts join when ready; sync, pipelined: edge-led
    prompt: str | None = None  # the prompt (required)
    chat: bool = False  # wrap the prompt in the model's chat template
    json: bool = False  # print one JSON object (text, stats) instead of streaming; on failure too, with the error

    def __post_init__(self) -> None:
        if self.acespec and self.mode not in ("pipelined", "auto"):  # auto: the default, i.e. no --mode given
            raise ConfigError(None, f"--acespec runs pipelined; it cannot be combined with --mode {self.mode}")
        super().__post_init__()

    def preset(self) -> EdgeRole:
        if not self.acespec:
            return self
        return dataclasses.replace(
            self, mode="pipelined", cache=True, branches=True, auto_window=True, policy="controller", acespec=False
        )


@dataclass(frozen=True)
class EdgeServeRole(EdgeOptions):
    """`acespec edge serve`: the OpenAI-compatible HTTP API. The options are each request's defaults."""

    mode: ApiMode = "auto"  # requests' default mode: auto; acespec (the full edge-led system); sync, pipelined, ...
    host: str = "127.0.0.1"  # HTTP listen address
    port: int = 8000  # HTTP port; 0 = any free port, printed at start
    served_model_name: str = "acespec"  # the model name clients use
    drafters: int = 1  # drafters loaded, i.e. generations that draft at once; more requests wait in line
    shared_drafter: bool = False  # the drafters are views of one model: drafts asked at once share one batched pass
    max_waiting: int = 64  # requests that may wait for a drafter; more get 503
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(rule="coupled", seed=None))

    serving: ClassVar[bool] = True
    seed_may_be_unset: ClassVar[bool] = True  # unset: each request that gives none draws a fresh seed

    def __post_init__(self) -> None:
        if self.acespec and self.mode not in ("pipelined", "acespec", "auto"):  # auto: the default, i.e. no --mode
            raise ConfigError(
                None, f"--acespec is the default mode acespec; it cannot be combined with --mode {self.mode}"
            )
        in_range("port", self.port, 0, 65535)
        at_least("drafters", self.drafters, 1)
        at_least("max_waiting", self.max_waiting, 0)
        super().__post_init__()

    @property
    def default_mode(self) -> str:
        """The mode of requests that name none (one of the API's modes)."""
        return "acespec" if self.acespec or self.mode == "acespec" else self.mode

    def controller_default(self) -> bool:
        return self.default_mode == "acespec"

    @property
    def request_mode(self) -> str:
        """The runtime mode of the requests' defaults, without the full system folded in: a request that names
        another mode gets that mode with the server's own --cache/--policy/..., and one that names acespec
        (or none, here) the full system."""
        return "pipelined" if self.default_mode == "acespec" else self.mode


# ------------------------------------------------------------------------------------------ cloud
@dataclass(frozen=True)
class CloudRole:
    """`acespec serve`: the cloud verifier. Sessions bring their own sampling settings in HELLO."""

    target: str = DEFAULT_TARGET  # target model: a registry name, GGUF path, HF directory or toy:...
    host: str = "127.0.0.1"  # listen address
    port: int = 7070  # listen port; 0 = any free port, printed at start
    token_file: str | None = None  # tenants' auth tokens, `name:token` per line, or one shared token; unset = no auth
    max_sessions: int = 8  # live sessions at once, resident or swapped out
    engine: Engine = "batched"  # verify engine; noop accepts every draft with no model pass (measures the front end)
    slots: int | None = None  # batched: KV sequences, i.e. sessions resident at once (unset: --max-sessions)
    n_ctx: int = 4096  # tokens one session may hold (prompt + output)
    kv_budget: int | None = None  # batched: KV tokens all slots share (unset: slots x n-ctx); n-ctx = kv-budget / slots
    batching: Literal["exact", "shared"] = "exact"  # batched llama.cpp: rows as if each session were alone, or shared
    tick_tokens: int = 256  # batched: most tokens one batch evaluates; prompt prefill is chunked to fit
    swap_idle: float = 2.0  # batched: seconds a session idles before a newcomer may take its KV
    prefix_reuse: bool = True  # batched: a newcomer keeps the prompt KV a closed session with its prefix left
    logprobs: int = 20  # vllm: target tokens returned per position, 1..20 (sampled verdicts are drawn over these)
    lead_k: int = 8  # vllm: edge-draft tokens a cloud-led step verifies in vLLM's own spec decoding; 0 = off
    lead_q_topn: int = 32  # vllm: q entries kept per draft token for rules that need q; 0 = such sessions run apart
    lead_pass_budget: float = math.inf  # cloud-led and auto: target passes per token a session may cost; inf = no wait
    lead_max_wait: float = 0.5  # with --lead-pass-budget: seconds one step may wait for an edge draft
    cpu_kv_gib: float = 1.0  # vllm on CPU: KV cache in GiB
    tensor_parallel: int = 1  # vllm: GPUs one model replica spans
    idle_timeout: float = 300.0  # seconds before an idle session is dropped
    resume_grace: float = 120.0  # seconds a session whose connection dropped waits for RESUME, holding its slot
    handshake_timeout: float = 10.0  # seconds a new connection has to send HELLO/RESUME
    frame_timeout: float = 30.0  # seconds a frame, once begun, has to be complete
    max_connections: int = 256  # open connections at once
    max_connections_per_addr: int = 32  # open connections at once from one address
    auth_failures_per_min: int = 10  # failed auths one address may make a minute before it is refused; 0 = no limit
    tls_cert: str | None = None  # TLS: the server's certificate chain (PEM); with --tls-key the server speaks TLS only
    tls_key: str | None = None  # TLS: the server's private key (PEM)
    tls_client_ca: str | None = None  # TLS: require client certificates signed by this CA (PEM)
    ws_port: int | None = None  # also take edges over WebSocket on this port (0 = any free port); wss with --tls-cert
    metrics_port: int | None = None  # serve /metrics, /health and /ready on this port (0 = any free port)
    loop: Literal["auto", "uvloop", "asyncio"] = "auto"  # event loop; auto = uvloop when it is installed
    gc_full: float = 300.0  # seconds between full garbage collections of a frozen heap; 0 = Python's own collector
    verbose: bool = False  # log at INFO

    def __post_init__(self) -> None:
        in_range("port", self.port, 0, 65535)
        at_least("max_sessions", self.max_sessions, 1)
        at_least("slots", self.slots, 1)
        at_least("n_ctx", self.n_ctx, 1)
        at_least("kv_budget", self.kv_budget, 1)
        at_least("tick_tokens", self.tick_tokens, 2)
        check("swap_idle", self.swap_idle >= 0, self.swap_idle, "be >= 0")
        in_range("logprobs", self.logprobs, 1, 20)
        at_least("lead_k", self.lead_k, 0)
        at_least("lead_q_topn", self.lead_q_topn, 0)
        check("lead_pass_budget", self.lead_pass_budget > 0, self.lead_pass_budget, "be > 0 (inf = no budget)")
        check("lead_max_wait", 0 <= self.lead_max_wait < math.inf, self.lead_max_wait, "be a number of seconds >= 0")
        check("cpu_kv_gib", 0 < self.cpu_kv_gib < math.inf, self.cpu_kv_gib, "be > 0")
        at_least("tensor_parallel", self.tensor_parallel, 1)
        for key in ("idle_timeout", "resume_grace", "handshake_timeout", "frame_timeout"):
            seconds(key, getattr(self, key))
        at_least("max_connections", self.max_connections, 1)
        at_least("max_connections_per_addr", self.max_connections_per_addr, 1)
        at_least("auth_failures_per_min", self.auth_failures_per_min, 0)
        if (self.tls_cert or self.tls_key or self.tls_client_ca) and not (self.tls_cert and self.tls_key):
            raise ConfigError(None, "TLS needs both --tls-cert and --tls-key")
        in_range("metrics_port", self.metrics_port, 0, 65535)
        in_range("ws_port", self.ws_port, 0, 65535)
        check("gc_full", 0 <= self.gc_full < math.inf, self.gc_full, "be a number of seconds >= 0")
        if self.engine in ("serial", "noop") and (self.slots or self.kv_budget):
            raise ConfigError(None, "--slots and --kv-budget are for the batched engine")
        if self.engine == "vllm" and (self.kv_budget or self.batching != "exact"):
            raise ConfigError(
                None, "--kv-budget and --batching are for the batched engine (vLLM manages its own KV blocks)"
            )
        if self.engine == "batched" and self.kv_budget and self.kv_budget // self.resident_slots < 64:
            raise ConfigError(
                None,
                f"--kv-budget {self.kv_budget} leaves {self.kv_budget // self.resident_slots} "
                f"tokens per slot for {self.resident_slots} slots; give it more",
            )

    @property
    def resident_slots(self) -> int:
        return self.slots or self.max_sessions

    @property
    def slot_context(self) -> int:
        """Tokens each batched slot holds: --kv-budget shared by the slots, else --n-ctx."""
        return self.kv_budget // self.resident_slots if self.kv_budget else self.n_ctx


# ------------------------------------------------------------------------------------------ demo
@dataclass(frozen=True)
class DemoRole:
    """`acespec demo`: cloud, WAN emulator and edge on this machine, the modes side by side."""

    profile: str = "wan"  # WAN profile: lan, wan, transcontinental, lte
    rtt: str | None = None  # override the profile's round-trip time (ms)
    prompt: str = DEFAULT_PROMPT  # the prompt every mode generates from
    draft: str = DEFAULT_DRAFT  # drafter model
    target: str = DEFAULT_TARGET  # target model
    k: int = 4  # starting draft depth
    quick: bool = False  # AceSpec only (no comparison runs)
    repeats: int = 2  # runs of AceSpec and of cloud-only, taking turns (A C .. C A); the table shows each one's fastest
    cores: Literal["split", "shared"] = CORES_DEFAULT  # split: the edge gets one core, the cloud the rest; shared: all
    json: str | None = None  # also write the table as JSON to this file
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(rule="coupled", max_tokens=96))

    omit: ClassVar[frozenset[str]] = frozenset({"top_k", "top_p"})  # the demo's runs sample with neither

    def __post_init__(self) -> None:
        check("profile", self.profile in PROFILES, self.profile, f"be one of {', '.join(sorted(PROFILES))}")
        at_least("k", self.k, 1)
        at_least("repeats", self.repeats, 1)
        if self.sampling.seed is None:
            raise ConfigError("seed", "{key} must be an integer >= 0, not unset")


ROLES: dict[str, type] = {"edge": EdgeRole, "edge-serve": EdgeServeRole, "serve": CloudRole, "demo": DemoRole}
