"""`acespec bench fleet`: the cloud as replicas behind HAProxy, under the faults a fleet meets.

    acespec bench fleet [--replicas 3] [--edges 64] [--generations 200] [--rules greedy,coupled] [--json OUT]

For each rule, a fresh fleet: `--replicas` real `acespec serve` processes (toy target by default, TLS
with a certificate of its own each), HAProxy from Debian's packages in TCP mode in front of them,
health-checking each replica's `/ready`, and the WAN emulator in front of HAProxy to reset edge
connections at random. `--edges` edges at once run `--generations` generations through it all
(TLS end to end, through the balancer), while, at fixed points of the run,

- one replica is killed with SIGKILL (its edges fail over: RESUME fails, a new session carries
  the committed text to another replica);
- another is drained with SIGTERM (its /ready fails at once; it finishes the verdicts it owes and
  sends CLOSE(GOING_AWAY); its edges continue elsewhere);
- the killed one comes back on its ports (HAProxy's checks bring it back into rotation).

Every text is compared with the undisturbed text (the target alone, same prompt, rule and seed).
One line per rule, then texts lost (generations that failed), texts changed, and failed runs last.
The HAProxy configuration is `haproxy_config()`, the one `docs/operate/fleet.md` shows.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from acespec.argtypes import pos_int
from acespec.bench import write_result
from acespec.bench.children import spawn, stop_process
from acespec.bench.faults import (
    TEMPERATURE,  # the rules whose texts a campaign checks, and their temperatures
    FaultCampaign,
    FaultsConfig,
    lossless_rules,
)
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.net import WanProfile, WanProxyThread
from acespec.tls import client_context

HOST = "127.0.0.1"


class FleetError(OSError):
    """A fleet part that would not start (a replica, HAProxy, the certificates): printed as one line."""


SERVER_NAME = "acespec-cloud"  # every replica's certificate carries this name; each has its own key


def haproxy_config(bind: str, replicas: list[tuple[str, int, int]], *, check_ms: int = 250) -> str:
    """HAProxy in TCP mode (TLS passes through to the replicas), listening on `bind` ("HOST:PORT"),
    in front of replicas given as (host, cloud port, HTTP port): a new connection goes to the replica
    with the fewest, only while its /ready answers 200; a connect to a dead replica is retried on
    another."""
    servers = "\n".join(
        f"    server r{i} {host}:{port} check port {http} inter {check_ms}ms fall 2 rise 2"
        for i, (host, port, http) in enumerate(replicas)
    )
    return f"""global
    maxconn 8000

defaults
    mode tcp
    timeout connect 2s
    timeout client 10m
    timeout server 10m
    timeout check 2s
    retries 2
    option redispatch

frontend edges
    bind {bind}
    default_backend clouds

backend clouds
    balance leastconn
    option httpchk GET /ready
    http-check expect status 200
{servers}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ReplicaProcess:
    """One `acespec serve` process on fixed ports, so that it can come back where it was."""

    def __init__(self, name: str, args: list[str], tls: tuple[str, str] | None, log_dir: Path) -> None:
        self.name, self.args, self.tls = name, args, tls
        self.log_path = log_dir / f"{name}.log"  # a file, not a pipe: a pipe nobody reads fills and blocks the replica
        self.port, self.http_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> ReplicaProcess:
        exe = shutil.which("acespec", path=os.path.dirname(sys.executable)) or None
        cmd = [exe] if exe else [sys.executable, "-m", "acespec.cli"]
        tls = ["--tls-cert", self.tls[0], "--tls-key", self.tls[1]] if self.tls else []
        self.proc = spawn(
            [
                *cmd,
                "serve",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--metrics-port",
                str(self.http_port),
                *tls,
                *self.args,
            ],
            log=self.log_path,
        )
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise FleetError(f"replica {self.name} exited {self.proc.returncode}: {self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise FleetError(f"replica {self.name} not ready within {timeout:g} s")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.http_port}/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def live_sessions(self) -> int:
        """Sessions with a connection now (its /metrics), 0 if it does not answer."""
        try:
            text = urllib.request.urlopen(f"http://{HOST}:{self.http_port}/metrics", timeout=5).read().decode()
        except OSError:
            return 0
        m = re.search(r'^acespec:sessions_live\{state="connected"\} ([0-9.e+]+)$', text, re.M)
        return int(float(m.group(1))) if m else 0

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def drain(self) -> None:
        """SIGTERM: returns at once; the process finishes the verdicts it owes and exits."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        return stop_process(self.proc, timeout)


class Balancer:
    """HAProxy (the `haproxy` program) running `haproxy_config` in the foreground."""

    def __init__(self, replicas: list[ReplicaProcess], workdir: Path) -> None:
        exe = shutil.which("haproxy")
        if exe is None:
            raise FleetError("HAProxy is not installed: run scripts/setup-system.sh (Debian's haproxy package)")
        self.port = free_port()
        self.cfg_path = workdir / "haproxy.cfg"
        self.cfg_path.write_text(haproxy_config(f"{HOST}:{self.port}", [(HOST, r.port, r.http_port) for r in replicas]))
        check = subprocess.run([exe, "-c", "-f", str(self.cfg_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise FleetError(f"haproxy refused its configuration: {check.stdout}{check.stderr}")
        self.log_path = workdir / "haproxy.log"
        self.proc = spawn([exe, "-db", "-f", str(self.cfg_path)], log=self.log_path)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((HOST, self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise FleetError(
                        f"haproxy did not start: {self.log_path.read_text(errors='replace')[-2000:]}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc, 10)


def make_certificates(workdir: Path, n: int) -> tuple[str, list[tuple[str, str]]]:
    """A CA and `n` server certificates for SERVER_NAME, each with its own key; returns (CA PEM, [(cert, key)])."""
    try:
        import trustme  # heavy: the test extra
    except ImportError:
        raise FleetError("bench fleet makes its TLS certificates with trustme: run scripts/setup.sh dev") from None
    ca = trustme.CA()
    ca_path = workdir / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    out = []
    for i in range(n):
        cert = ca.issue_cert(SERVER_NAME)
        c, k = workdir / f"r{i}.pem", workdir / f"r{i}.key"
        cert.private_key_and_cert_chain_pem.write_to_path(str(c))
        cert.private_key_pem.write_to_path(str(k))
        out.append((str(c), str(k)))
    return str(ca_path), out


@dataclass
class FleetConfig:
    target: str = "toy:vocab=64,seed=1"  # the replicas' model spec
    draft: str = "toy:vocab=64,seed=1,noise=0.5,noise_seed=3"  # the edges' model spec
    rules: tuple[str, ...] = ("greedy", "coupled")  # lossless rules whose text must not change
    replicas: int = 3  # acespec serve processes behind HAProxy
    edges: int = 64  # edges running at once
    generations: int = 200  # generations per rule
    max_tokens: int = 120  # tokens per generation
    mode: str = "pipelined"  # the edges' mode
    k: int = 4  # draft depth
    kill_at: float = 0.25  # share of the generations done when one replica is killed (SIGKILL)
    drain_at: float = 0.45  # ... when another is drained (SIGTERM)
    back_at: float = 0.6  # ... when the killed one comes back
    resets: bool = True  # reset some edge connections at random throughout
    seed: int = 0  # prompts, seeds, fault times


@dataclass
class RuleOutcome:
    rule: str
    runs: int = 0
    lost: int = 0  # generations that failed: the text never arrived
    changed: int = 0  # generations whose text (or stream) differs from the undisturbed text
    resets: int = 0  # edge connections the emulator reset
    reconnects: int = 0  # RESUMEs
    recoveries: int = 0  # new sessions carrying committed text
    failovers: int = 0  # of those, on another replica than the session's
    killed: str = ""
    killed_sessions: int = 0  # sessions live on the killed replica as it died
    drained: str = ""
    drained_sessions: int = 0  # sessions live on the drained replica as SIGTERM came
    drain_exit: int | None = None  # the drained replica's exit status (0: a clean drain)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failure messages


class _Run:
    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        # the fault campaign's references (the target alone), prompts and drafters, on this config's models
        self.camp = FaultCampaign(
            FaultsConfig(target=cfg.target, draft=cfg.draft, max_tokens=cfg.max_tokens, seed=cfg.seed)
        )
        self.rng = random.Random(cfg.seed)
        self.lock = threading.Lock()

    def rule(self, rule: str, log) -> RuleOutcome:
        cfg = self.cfg
        out = RuleOutcome(rule)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="acespec-fleet-") as tmp:
            work = Path(tmp)
            ca, certs = make_certificates(work, cfg.replicas)
            n = 4 * cfg.edges
            # every edge arrives from HAProxy's address: per-address limits must hold them all
            args = [
                "--target",
                cfg.target,
                "--max-sessions",
                str(n),
                "--max-connections",
                str(4 * n),
                "--max-connections-per-addr",
                str(4 * n),
                "--auth-failures-per-min",
                "0",
                "--resume-grace",
                "60",
            ]
            replicas = [ReplicaProcess(f"r{i}", args, certs[i], work) for i in range(cfg.replicas)]
            lb = None
            try:
                threads = [threading.Thread(target=r.start, daemon=True) for r in replicas]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if not all(r.ready() for r in replicas):
                    raise FleetError("not every replica started")
                lb = Balancer(replicas, work)
                time.sleep(0.6)  # HAProxy's first checks (rise 2 x 250 ms) mark the replicas up
                tls = client_context(ca)
                with WanProxyThread(
                    HOST, 0, HOST, lb.port, WanProfile(rtt_ms=2.0, seed=self.rng.randrange(1 << 30))
                ) as wan:
                    self._campaign(rule, wan.port, tls, replicas, wan, out)
                    out.resets = wan.proxy.counters.resets
                out.drain_exit = next(
                    (r.proc.returncode for r in replicas if r.name == out.drained and r.proc is not None), None
                )
            finally:
                if lb is not None:
                    lb.stop()
                for r in replicas:
                    r.stop()
        out.wall_s = round(time.perf_counter() - t0, 1)
        log(_line(out))
        return out

    def _campaign(self, rule, port, tls, replicas, wan, out: RuleOutcome) -> None:
        cfg = self.cfg
        todo = list(range(cfg.generations))
        done = [0]
        jobs = [(self.camp.prompt(), self.rng.randrange(1 << 31)) for _ in todo]

        def edge() -> None:
            while True:
                with self.lock:
                    if not todo:
                        return
                    i = todo.pop()
                self._generate(rule, port, tls, *jobs[i], out)
                with self.lock:
                    done[0] += 1

        threads = [threading.Thread(target=edge, daemon=True) for _ in range(cfg.edges)]
        for t in threads:
            t.start()
        victim, drained = replicas[0], replicas[1 % len(replicas)]
        plan = [(cfg.kill_at, "kill"), (cfg.drain_at, "drain"), (cfg.back_at, "back")]
        rng = random.Random(self.rng.randrange(1 << 30))
        while any(t.is_alive() for t in threads):
            time.sleep(0.05)
            share = done[0] / cfg.generations
            while plan and share >= plan[0][0]:
                _, what = plan.pop(0)
                if what == "kill":
                    out.killed_sessions = victim.live_sessions()
                    victim.kill()
                    out.killed = victim.name
                elif what == "drain" and drained is not victim:
                    out.drained_sessions = drained.live_sessions()
                    drained.drain()
                    out.drained = drained.name
                elif what == "back":
                    victim.start()
            if cfg.resets and rng.random() < 0.1:  # about twice a second: a few connections reset
                wan.reset_connections(limit=max(1, cfg.edges // 16), rng=rng)
        for t in threads:
            t.join()
        if drained.proc is not None and drained is not victim:
            try:
                drained.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass

    def _generate(self, rule, port, tls, prompt, seed, out: RuleOutcome) -> None:
        cfg = self.cfg
        ref = self.camp.reference(prompt, rule, seed)
        drafter = self.camp.drafter()
        ecfg = EdgeConfig(
            mode=cfg.mode,
            rule=rule,
            k=cfg.k,
            temperature=TEMPERATURE[rule],
            seed=seed,
            max_tokens=cfg.max_tokens,
            connect=ConnectConfig(
                host=HOST,
                port=port,
                tls=tls,
                tls_server_name=SERVER_NAME,
                reply_timeout_s=20.0,
                # a loaded fleet may have no replica in rotation for some seconds (one killed,
                # one draining, checks late): 40 attempts at most 0.5 s apart outlast ~15 s of it
                backoff_max_s=0.5,
                reconnect_attempts=40,
                busy_retry_s=30.0,
            ),
        )
        streamed: list[int] = []
        try:
            res = run_edge(
                None if cfg.mode == "cloud-only" else drafter,
                prompt,
                ecfg,
                model_id=drafter.tokenizer.fingerprint,
                on_tokens=streamed.extend,
            )
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            with self.lock:
                out.runs += 1
                out.lost += 1
                if len(out.errors) < 5:
                    out.errors.append(f"{type(e).__name__}: {e}")
            return
        with self.lock:
            out.runs += 1
            c = res.stats.link
            out.reconnects += c.get("reconnects", 0)
            out.recoveries += c.get("recoveries", 0)
            out.failovers += c.get("failovers", 0)
            if res.tokens != ref or streamed != res.tokens:
                out.changed += 1


def run_fleet(cfg: FleetConfig, log=print) -> dict:
    run = _Run(cfg)
    outcomes = [run.rule(rule, log) for rule in cfg.rules]
    return {
        "config": asdict(cfg),
        "outcomes": [asdict(o) for o in outcomes],
        "runs": sum(o.runs for o in outcomes),
        "lost": sum(o.lost for o in outcomes),
        "changed": sum(o.changed for o in outcomes),
        "failed_runs": sum(o.lost for o in outcomes),
        "unclean_drains": sum(1 for o in outcomes if o.drained and o.drain_exit != 0),
    }


def _line(o: RuleOutcome) -> str:
    s = (
        f"{o.rule:>8}: {o.runs:4d} runs, {o.resets:4d} resets, {o.reconnects:4d} resumes, {o.recoveries:4d} recoveries "
        f"({o.failovers} on another replica); killed {o.killed or '-'} holding {o.killed_sessions} sessions, drained "
        f"{o.drained or '-'} holding {o.drained_sessions} (exit {o.drain_exit}); "
        f"{o.lost} lost, {o.changed} changed, {o.wall_s:.1f} s"
    )
    return s + "".join(f"\n{'':>10}{e}" for e in o.errors)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = FleetConfig()
    p = bench_subparsers.add_parser(
        "fleet", help="replicas behind HAProxy: kill -9, drain, come back, resets; texts lost or changed"
    )
    p.add_argument("--target", default=d.target)
    p.add_argument("--draft", default=d.draft)
    p.add_argument("--rules", default=",".join(d.rules), help="comma-separated lossless rules (greedy, coupled)")
    p.add_argument(
        "--replicas", type=pos_int, default=d.replicas, help="acespec serve processes (default 3; at least 2)"
    )
    p.add_argument("--edges", type=pos_int, default=d.edges, help="edges at once (default 64)")
    p.add_argument("--generations", type=pos_int, default=d.generations, help="generations per rule (default 200)")
    p.add_argument("--max-tokens", type=pos_int, default=d.max_tokens)
    p.add_argument("--mode", choices=("sync", "pipelined", "cloud-only", "cloud-led"), default=d.mode)
    p.add_argument("--no-resets", action="store_true", help="no random connection resets")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="OUT")
    p.set_defaults(func=cmd_bench_fleet)
    return p


def cmd_bench_fleet(args: argparse.Namespace) -> int:
    rules = lossless_rules(args.rules)
    if args.replicas < 2:
        raise ValueError("--replicas must be at least 2 (one is killed, another drained)")
    cfg = FleetConfig(
        target=args.target,
        draft=args.draft,
        rules=rules,
        replicas=args.replicas,
        edges=args.edges,
        generations=args.generations,
        max_tokens=args.max_tokens,
        mode=args.mode,
        resets=not args.no_resets,
        seed=args.seed,
    )
    print(
        f"bench fleet: {cfg.replicas} replicas behind HAProxy (TLS end to end), {cfg.edges} edges, {cfg.generations} "
        f"generations per rule, {cfg.mode}; kill -9 at {cfg.kill_at:.0%}, drain at {cfg.drain_at:.0%}, back at {cfg.back_at:.0%}",
        flush=True,
    )
    res = run_fleet(cfg, log=lambda s: print(s, flush=True))
    print(
        f"texts lost: {res['lost']}  texts changed: {res['changed']}  unclean drains: {res['unclean_drains']}  "
        f"runs failed: {res['failed_runs']} of {res['runs']}"
    )
    write_result(args.json, res)
    return 0 if res["lost"] == 0 and res["changed"] == 0 and res["unclean_drains"] == 0 else 1
