"""`acespec bench faults`: a standing fault campaign over the WAN emulator, for greedy and coupled.

    acespec bench faults [--rules greedy,coupled] [--resets 100] [--max-tokens 200] [--concurrent 64] [--json OUT]

AceSpec's promise is that speculation never changes the text or loses it, whatever the link does.
Every scenario runs real edges (`run_edge`) against a real cloud (`CloudServerThread`) through a
`WanProxyThread`, and compares each generation with the undisturbed text (the target alone,
`generate(spec=False)`, same prompt, rule and seed) and the streamed tokens with the result:

- `resets`: connection resets at random points of each generation, until `--resets` were made;
- `stalls`: the path stalls (blackhole, bytes held) for 0.2-0.5 s, three times per generation;
- `loss`: 5 % segment loss (retransmission stalls);
- `handshake`: the path drops everything and resets as the edge sends its first HELLO;
- `restart`: the cloud stops (CLOSE(GOING_AWAY)) mid-generation and a new one starts on its port,
  knowing nothing of the session: the edge opens a new session carrying its committed text;
- `concurrent`: `--concurrent` edges at once while every connection is reset at random moments.

One line per scenario and rule (runs, resets made, reconnects, recoveries, failures, mismatches),
then the mismatch count last. Toy models by default (exact, fast); `--target/--draft` take any model
spec (the restart scenario loads the target again for the new cloud).
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from dataclasses import asdict, dataclass, field

from acespec.argtypes import pos_int
from acespec.bench import write_result
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop import SpecConfig, generate
from acespec.models import load_model
from acespec.net import WanProfile, WanProxyThread

SCENARIOS = ("resets", "stalls", "loss", "handshake", "restart", "concurrent")
TEMPERATURE = {"greedy": 0.0, "coupled": 0.8}
HOST = "127.0.0.1"


@dataclass
class FaultOutcome:
    """One scenario under one rule: its generations and what went wrong in them."""

    scenario: str
    rule: str
    runs: int = 0
    failures: int = 0  # generations that raised
    mismatches: int = 0  # generations whose text (or stream) differs from the undisturbed text
    resets: int = 0  # connections the emulator reset
    reconnects: int = 0  # RESUMEs the edges made
    recoveries: int = 0  # new sessions opened after the cloud lost one
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failure messages


@dataclass
class FaultsConfig:
    target: str = "toy:vocab=64,seed=1"  # cloud model spec
    draft: str = "toy:vocab=64,seed=1,noise=0.5,noise_seed=3"  # edge model spec
    rules: tuple[str, ...] = ("greedy", "coupled")  # lossless rules whose text must not change
    scenarios: tuple[str, ...] = SCENARIOS  # which scenarios to run
    max_tokens: int = 200  # tokens per generation
    resets: int = 100  # resets per rule in the `resets` scenario
    resets_per_gen: int = 10  # resets spread over one generation
    generations: int = 4  # generations per rule in stalls / loss / handshake; restart runs this many too
    concurrent: int = 64  # edges at once in the `concurrent` scenario
    rtt_ms: float = 20.0  # the emulated path's round trip
    mode: str = "pipelined"  # edge mode
    k: int = 4  # draft depth
    seed: int = 0  # seeds prompts and fault timing


class FaultCampaign:
    """What every scenario needs: the models, the prompts, the undisturbed reference texts, and one
    checked edge generation (`generate`); `run` plays one scenario. The fleet bench reuses its pieces."""

    def __init__(self, cfg: FaultsConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.target = load_model(cfg.target)  # the cloud's (a restarted cloud loads its own)
        self._ref_target = load_model(cfg.target)  # the undisturbed runs': never shared with a cloud
        self.vocab = self.target.vocab_size
        self._refs: dict[tuple, list[int]] = {}
        self._lock = threading.Lock()  # edges run in threads: references, model loads and counters go one at a time

    # -- pieces -------------------------------------------------------------------------------------
    def server_config(self, port: int = 0):
        n = max(64, 2 * self.cfg.concurrent)
        # every edge comes through the emulator, i.e. from one address: the per-address limit must fit them all
        return ServerConfig(
            host=HOST,
            port=port,
            max_sessions=n,
            max_connections=4 * n,
            max_connections_per_addr=4 * n,
            max_new_tokens=max(4096, self.cfg.max_tokens),
            resume_grace_s=60.0,
        )

    def drafter(self):
        with self._lock:
            return load_model(self.cfg.draft)

    def prompt(self) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(8)]

    def reference(self, prompt: list[int], rule: str, seed: int) -> list[int]:
        key = (tuple(prompt), rule, seed)
        with self._lock:
            if key not in self._refs:
                cfg = SpecConfig(
                    rule=rule, temperature=TEMPERATURE[rule], seed=seed, max_tokens=self.cfg.max_tokens, spec=False
                )
                self._refs[key] = list(generate(self._ref_target, prompt, cfg).tokens)
            return self._refs[key]

    def generate(
        self, port: int, prompt: list[int], rule: str, seed: int, out: FaultOutcome, on_tokens=None, arm=None
    ) -> None:
        """One edge generation; its result checked against the undisturbed text and counted in `out`.
        `arm`: called just before the edge connects (a fault timed to its first frames)."""
        ref = self.reference(prompt, rule, seed)
        drafter = self.drafter()
        cfg = EdgeConfig(
            mode=self.cfg.mode,
            rule=rule,
            k=self.cfg.k,
            temperature=TEMPERATURE[rule],
            seed=seed,
            max_tokens=self.cfg.max_tokens,
            connect=ConnectConfig(host=HOST, port=port, reply_timeout_s=15.0, backoff_max_s=0.5, reconnect_attempts=12),
        )
        streamed: list[int] = []

        def push(toks):
            streamed.extend(toks)
            if on_tokens is not None:
                on_tokens(len(streamed))

        if arm is not None:
            arm()
        try:
            res = run_edge(drafter, prompt, cfg, model_id=drafter.tokenizer.fingerprint, on_tokens=push)
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            with self._lock:
                out.runs += 1
                out.failures += 1
                if len(out.errors) < 5:
                    out.errors.append(f"{type(e).__name__}: {e}")
            return
        with self._lock:
            out.runs += 1
            out.reconnects += res.stats.link.get("reconnects", 0)
            out.recoveries += res.stats.link.get("recoveries", 0)
            if res.tokens != ref or streamed != res.tokens:
                out.mismatches += 1

    # -- scenarios ----------------------------------------------------------------------------------
    def run(self, scenario: str, rule: str) -> FaultOutcome:
        out = FaultOutcome(scenario, rule)
        t0 = time.perf_counter()
        cloud = CloudServerThread(
            self.target if scenario != "restart" else self._fresh_target(), self.server_config()
        ).start()
        port = cloud.port
        clouds = [cloud]
        profile = WanProfile(rtt_ms=self.cfg.rtt_ms, seed=self.rng.randrange(1 << 30))
        try:
            with WanProxyThread(HOST, 0, HOST, port, profile) as proxy:
                getattr(self, f"_{scenario}")(proxy, rule, out, port, clouds)
                out.resets += proxy.counters.resets
        finally:
            for c in clouds:
                c.stop()
        out.wall_s = round(time.perf_counter() - t0, 2)
        return out

    def _fresh_target(self):
        return load_model(self.cfg.target)

    def _seed(self) -> int:
        return self.rng.randrange(1 << 31)

    def _resets(self, proxy, rule, out, port, clouds) -> None:
        n = self.cfg.max_tokens
        per = max(1, min(self.cfg.resets_per_gen, n - 1))
        cap = 10 * (self.cfg.resets // per + 1)  # generations, should resets keep missing a live connection
        made = 0
        runs = 0
        while made < self.cfg.resets and runs < cap:
            runs += 1
            marks = sorted(self.rng.sample(range(1, n), per))
            done = [0]

            def on_tokens(count, marks=marks, done=done):
                while marks and count >= marks[0]:
                    marks.pop(0)
                    done[0] += proxy.reset_connections()

            self.generate(proxy.port, self.prompt(), rule, self._seed(), out, on_tokens)
            made += done[0]

    def _stalls(self, proxy, rule, out, port, clouds) -> None:
        for _ in range(self.cfg.generations):
            marks = sorted(self.rng.sample(range(1, self.cfg.max_tokens), 3))

            def on_tokens(count, marks=marks):
                while marks and count >= marks[0]:
                    marks.pop(0)
                    proxy.blackhole(self.rng.uniform(0.2, 0.5))

            self.generate(proxy.port, self.prompt(), rule, self._seed(), out, on_tokens)

    def _loss(self, proxy, rule, out, port, clouds) -> None:
        proxy.set_profile(WanProfile(rtt_ms=self.cfg.rtt_ms, loss_pct=5.0, seed=self.rng.randrange(1 << 30)))
        for _ in range(self.cfg.generations):
            self.generate(proxy.port, self.prompt(), rule, self._seed(), out)

    def _handshake(self, proxy, rule, out, port, clouds) -> None:
        for _ in range(self.cfg.generations):
            # the first HELLO is lost and its connection reset. Armed once the reference text is computed,
            # not before: on a loaded machine computing it outlasted the 0.3 s, and no HELLO met the fault
            self.generate(
                proxy.port, self.prompt(), rule, self._seed(), out, arm=lambda: proxy.blackhole(0.3, drop=True)
            )

    def _restart(self, proxy, rule, out, port, clouds) -> None:
        for _ in range(self.cfg.generations):
            mark = [self.rng.randrange(1, self.cfg.max_tokens // 2)]
            worker: list[threading.Thread] = []

            def restart() -> None:
                clouds[-1].stop()
                clouds.append(CloudServerThread(self._fresh_target(), self.server_config(port)).start())

            def on_tokens(count, mark=mark, worker=worker) -> None:
                if mark and count >= mark[0]:
                    mark.pop()
                    t = threading.Thread(target=restart, daemon=True)
                    t.start()
                    worker.append(t)

            self.generate(proxy.port, self.prompt(), rule, self._seed(), out, on_tokens)
            for t in worker:
                t.join(60)

    def _concurrent(self, proxy, rule, out, port, clouds) -> None:
        threads = [
            threading.Thread(
                target=self.generate, args=(proxy.port, self.prompt(), rule, self._seed(), out), daemon=True
            )
            for _ in range(self.cfg.concurrent)
        ]
        for t in threads:
            t.start()
        rng = random.Random(self.rng.randrange(1 << 30))
        while any(t.is_alive() for t in threads):
            time.sleep(rng.uniform(0.05, 0.3))
            proxy.reset_connections()
        for t in threads:
            t.join()


def run_faults(cfg: FaultsConfig, log=None) -> dict:
    """Run every scenario for every rule; returns {"outcomes": [...], "runs", "failures", "mismatches"}."""
    campaign = FaultCampaign(cfg)
    outcomes = []
    for scenario in cfg.scenarios:
        for rule in cfg.rules:
            o = campaign.run(scenario, rule)
            outcomes.append(o)
            if log:
                log(_line(o))
    return {
        "config": asdict(cfg),
        "outcomes": [asdict(o) for o in outcomes],
        "runs": sum(o.runs for o in outcomes),
        "failures": sum(o.failures for o in outcomes),
        "mismatches": sum(o.mismatches for o in outcomes),
    }


def _line(o: FaultOutcome) -> str:
    s = (
        f"{o.scenario:>10} {o.rule:>8}: {o.runs:4d} runs, {o.resets:4d} resets, {o.reconnects:4d} reconnects, "
        f"{o.recoveries:3d} recoveries, {o.failures:3d} failed, {o.mismatches:3d} mismatched, {o.wall_s:7.1f} s"
    )
    return s + "".join(f"\n{'':>20}{e}" for e in o.errors)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "faults", help="fault campaign: resets, stalls, loss, handshake resets, restarts, crowds"
    )
    d = FaultsConfig()
    p.add_argument("--target", default=d.target)
    p.add_argument("--draft", default=d.draft)
    p.add_argument("--rules", default=",".join(d.rules), help="comma-separated lossless rules (greedy, coupled)")
    p.add_argument("--scenarios", default=",".join(d.scenarios), help=f"comma-separated, from {', '.join(SCENARIOS)}")
    p.add_argument("--max-tokens", type=pos_int, default=d.max_tokens)
    p.add_argument(
        "--resets", type=pos_int, default=d.resets, help="resets per rule in the resets scenario (default 100)"
    )
    p.add_argument("--resets-per-gen", type=pos_int, default=d.resets_per_gen)
    p.add_argument(
        "--generations", type=pos_int, default=d.generations, help="generations per rule in the other scenarios"
    )
    p.add_argument("--concurrent", type=pos_int, default=d.concurrent)
    p.add_argument("--rtt", type=float, default=d.rtt_ms, help="emulated round trip in ms (default 20)")
    p.add_argument("--mode", choices=("sync", "pipelined", "cloud-only"), default=d.mode)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="OUT")
    p.set_defaults(func=cmd_bench_faults)
    return p


def lossless_rules(text: str) -> tuple[str, ...]:
    """`--rules` of a campaign that checks exact texts: a comma-separated subset of TEMPERATURE's rules."""
    rules = tuple(r.strip() for r in text.split(",") if r.strip())
    if not rules or any(r not in TEMPERATURE for r in rules):
        raise ValueError(f"--rules: the campaign checks exact texts, so only {', '.join(TEMPERATURE)}")
    return rules


def cmd_bench_faults(args: argparse.Namespace) -> int:
    rules = lossless_rules(args.rules)
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    if not scenarios or any(s not in SCENARIOS for s in scenarios):
        raise ValueError(f"--scenarios: choose from {', '.join(SCENARIOS)}")
    if not 0 <= args.rtt < float("inf"):
        raise ValueError("--rtt must be >= 0")
    cfg = FaultsConfig(
        target=args.target,
        draft=args.draft,
        rules=rules,
        scenarios=scenarios,
        max_tokens=args.max_tokens,
        resets=args.resets,
        resets_per_gen=args.resets_per_gen,
        generations=args.generations,
        concurrent=args.concurrent,
        rtt_ms=args.rtt,
        mode=args.mode,
        seed=args.seed,
    )
    result = run_faults(cfg, log=lambda line: print(line, flush=True))
    write_result(args.json, result)
    print(f"runs: {result['runs']}, failed: {result['failures']}")
    print(f"mismatches: {result['mismatches']}")
    return 0 if result["mismatches"] == 0 and result["failures"] == 0 else 1
