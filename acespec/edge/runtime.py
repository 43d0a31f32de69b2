"""The edge runtime: drafts locally, has the cloud verify, streams the committed text.

Modes:
- `sync`: stop-and-wait, one block in flight.
- `pipelined`: keep drafting past a sent block and send the next one without waiting (window of
  blocks in flight); a rejection rolls the drafter back to the committed prefix.
- `cloud-only`: no drafting; the cloud generates and streams tokens down the same link (the baseline
  a user would pick instead of speculative decoding).
- `cloud-led`: the cloud decodes and streams as in cloud-only, never waiting for the edge; the edge
  follows the stream, drafts ahead of it and uploads its drafts, which the cloud verifies when they
  agree with what it has committed and are worth their cost (`loop/follow.py`). A user is never
  slower than cloud-only; the cloud pays for more target passes than in the edge-led modes.
- `auto` (the default): cloud-led on the wire, arranged so that nothing on the edge can delay the
  stream either. The drafter joins once the first token is here (its prefill never competes with the
  cloud's for the first token, as it does when edge and cloud share a box's cores), and a drafter
  may be handed over late or never (`drafter_source`: an edge serving several apps lends its
  drafters to whichever stream gets one first; the others stream as cloud-only until one is free).
  Nor can the drafter slow the cloud: where the two share cores, its work would slow the cloud's
  steps, and a `ContentionGuard` rests it while it does (`loop/contention.py`).
  What the cloud spends on the edge's drafts is the cloud operator's to bound
  (`acespec serve --lead-pass-budget`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from acespec import env as acespec_env
from acespec import wire
from acespec.control.depth import DEFAULT_PASS_BUDGET, DepthPolicy, make_policy
from acespec.draft.cache import CacheConfig, StateCache
from acespec.draft.chain import ChainDrafter
from acespec.draft.prediction import PredictedDrafter, Prediction
from acespec.edge.client import CloudSession, ConnectConfig, EdgeError, link_failure
from acespec.edge.transports import TcpLeadLink, TcpTransport
from acespec.loop.backoff import BackoffMemory
from acespec.loop.contention import ContentionGuard
from acespec.loop.follow import FollowConfig, FollowLoop
from acespec.loop.handoff import ThreadJob
from acespec.loop.loop import ORIGIN_TARGET, LoopConfig, LoopResult, Round, SpecLoop
from acespec.loop.stats import RunStats
from acespec.loop.transport import Clock, StreamError, Transport
from acespec.models.base import Model
from acespec.verify import RuleSpec, SamplingParams

MODES = ("auto", "sync", "pipelined", "cloud-only", "cloud-led")
CLOUD_LED_MODES = ("auto", "cloud-led")  # the modes whose HELLO asks the cloud to lead
STREAMING_MODES = (*CLOUD_LED_MODES, "cloud-only")  # the cloud streams TOKENS (and logprobs, when asked)


@dataclass
class EdgeConfig:
    mode: str = "auto"  # auto | sync | pipelined | cloud-only | cloud-led
    rule: str = "greedy"  # verification rule spec
    k: int = 4  # draft depth (starting depth for adaptive policies)
    policy: str = "fixed"  # fixed | adaptive | controller
    window: int = 2  # pipelined: blocks in flight (the least, with auto_window)
    auto_window: bool = False  # pipelined: grow the window to cover the measured round trip
    pass_budget: float = DEFAULT_PASS_BUDGET  # controller: target verify passes per token the cloud grants (inf = none)
    temperature: float = 0.0  # 0 = greedy sampling
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0  # shared with the cloud (coupled sampling)
    max_tokens: int = 128  # generation budget
    q_topn: int = 32  # rules that need q: the drafter samples from, and sends, the top-n of q
    min_conf: float = 0.0  # stop a block early when q(x) < this
    cache: bool = False  # pre-draft likely verdict outcomes (the drafter model needs n_slots > 1)
    cache_budget_mb: float = 32.0  # state-cache memory budget per session
    branches: bool = False  # also send cached outcomes as branch blocks (needs cache; q-free rules)
    connect: ConnectConfig = field(default_factory=ConnectConfig)  # where the cloud is
    prediction: tuple[int, ...] = ()  # predicted output tokens (OpenAI's Predicted Outputs): drafts where they line up
    contention_guard: bool = True  # auto: rest the drafter while its work slows the cloud's steps (shared cores)
    logprobs: int = 0  # 0 = none; 1 + m: the cloud streams each token's logprob and the m likeliest (streaming modes)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 <= self.logprobs <= 1 + wire.MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be 0 .. {1 + wire.MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.logprobs and self.mode not in STREAMING_MODES:
            raise ValueError(f"logprobs come with the streaming modes ({', '.join(STREAMING_MODES)}), not {self.mode}")
        if not self.pass_budget > 0:  # also refuses nan
            raise ValueError(f"pass_budget must be > 0 (inf = no limit), got {self.pass_budget}")


def run_edge(
    drafter_model: Model | None,
    prompt: Sequence[int],
    cfg: EdgeConfig,
    *,
    model_id: str,
    on_tokens: Callable[[list[int]], None] | None = None,
    policy: DepthPolicy | None = None,
    on_round: Callable[[Round], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_session_closed: Callable[[CloudSession], None] | None = None,
    drafter_source: Callable[[], Model | None] | None = None,
    guard: ContentionGuard | None = None,
    backoff: BackoffMemory | None = None,
) -> LoopResult:
    """One generation through the cloud. `model_id` is the drafter's tokenizer fingerprint.

    `auto` mode takes its drafter from `drafter_model` or, late, from `drafter_source` (polled without
    blocking; the caller gives back what it handed out once this returns); with neither it streams.

    `on_round` sees every applied verdict (tokens, their origins, K, latencies); `should_stop`, polled
    between verdicts, ends the run early and closes the cloud session (the result has finished=False);
    `on_session_closed` gets the session once it is closed, however the run ended, for its byte and
    reconnect counts. `guard`: in auto, what earlier sessions learned of whether drafting slows this
    cloud (`loop/contention.py`; a server keeps one for all its requests); None starts a fresh one
    (with `cfg.contention_guard`). `backoff`: in auto, what earlier sessions learned of whether the
    cloud verifies this edge's drafts (`loop/backoff.py`; a server keeps one too); None: nothing."""
    rule = RuleSpec.parse(cfg.rule)
    sp = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    hello = wire.Hello(
        model_id=model_id,
        max_tokens=cfg.max_tokens,
        prompt=tuple(int(t) for t in prompt),
        auth=cfg.connect.token,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        rule=str(rule),
        seed=cfg.seed,
        logprobs=cfg.logprobs,
        mode=(
            wire.Mode.CLOUD_ONLY
            if cfg.mode == "cloud-only"
            else wire.Mode.CLOUD_LED
            if cfg.mode in CLOUD_LED_MODES
            else wire.Mode.SPECULATIVE
        ),
    )
    t0 = time.perf_counter()
    kw: dict[str, Any] = dict(sampling=sp, rule=rule, seed=cfg.seed, q_topn=cfg.q_topn)

    def make_drafter(model: Model) -> ChainDrafter:
        return (
            PredictedDrafter(model, Prediction(cfg.prediction, len(prompt)), **kw)
            if cfg.prediction
            else ChainDrafter(model, **kw)
        )

    if cfg.mode == "auto":
        if guard is None and cfg.contention_guard:
            guard = ContentionGuard.watching_cores(acespec_env.threads())
        return _auto(
            drafter_model,
            drafter_source,
            make_drafter,
            prompt,
            cfg,
            hello,
            rule,
            t0,
            on_tokens,
            on_round,
            should_stop,
            on_session_closed,
            guard,
            backoff,
        )
    drafter = None
    if cfg.mode != "cloud-only":
        if drafter_model is None:
            raise EdgeError("speculative modes need a drafter model")
        drafter = make_drafter(drafter_model)
    # cloud-led: the stream starts as soon as the cloud has the prompt, so the drafter's prefill goes on
    # beside the follow loop rather than holding the stream's first tokens until it is done
    session, prefill = _open_while_prefilling(cfg.connect, hello, drafter, prompt, keep_going=cfg.mode == "cloud-led")
    try:
        if drafter is None:
            return _cloud_only(session, prompt, cfg, on_tokens, t0, on_round, should_stop)
        if cfg.mode == "cloud-led":
            return _follow(
                session,
                prompt,
                cfg,
                rule,
                t0,
                "cloud-led",
                drafter=drafter,
                job=prefill,
                on_tokens=on_tokens,
                on_round=on_round,
                should_stop=should_stop,
            )
        if cfg.k + 1 > session.max_draft_tokens:
            # a block is K tokens and (pipelined) the guessed bonus before them: keep it within what the
            # cloud said it takes (WELCOME.max_draft_tokens), or the DRAFT would be refused as over limit
            cfg = dataclasses.replace(cfg, k=max(1, session.max_draft_tokens - 1))
        transport = TcpTransport(session, send_q=rule.info.needs_q)
        loop = build_loop(
            transport,
            drafter,
            prompt,
            cfg,
            policy=policy,
            on_tokens=on_tokens,
            on_round=on_round,
            should_stop=should_stop,
        )
        res = loop.run(t0)
        res.stats.wall_s = time.perf_counter() - t0
        res.stats.bytes_up, res.stats.bytes_down = session.total_bytes()
        _link_stats(res.stats, session)
        res.stats.link["rtt_ms_mean"] = round(1e3 * transport.rtt_sum / max(1, transport.rtt_count), 3)
        return res
    finally:
        if prefill is not None and not prefill.done():  # a run that failed before its follow loop took the job
            try:
                prefill.wait()
            except BaseException:  # noqa: BLE001 - the run's own error is the one on its way out
                pass
        session.close()
        if on_session_closed is not None:
            on_session_closed(session)


def _auto(
    drafter_model: Model | None,
    source: Callable[[], Model | None] | None,
    make_drafter,
    prompt,
    cfg: EdgeConfig,
    hello: wire.Hello,
    rule: RuleSpec,
    t0: float,
    on_tokens,
    on_round,
    should_stop,
    on_session_closed,
    guard: ContentionGuard | None,
    backoff: BackoffMemory | None = None,
) -> LoopResult:
    """`auto`: a cloud-led session whose drafter joins after the first token (see the module docstring).
    Where the contention guard will rest the drafter through the whole session (the edge shares busy
    cores with the cloud), or the backoff's memory says the cloud passes our drafts over and this
    session is not its probe (`loop/backoff.py`), the session is a cloud-only one: nothing of the
    cloud-led path runs for drafts that will not come. A request with a prediction drafts from it
    whatever the memory says, and teaches the memory nothing: its drafts are not the drafter's."""
    if cfg.prediction:
        backoff = None
    rests = guard is not None and guard.resting >= cfg.max_tokens
    if rests or (backoff is not None and not backoff.drafts()):
        plain = dataclasses.replace(hello, mode=wire.Mode.CLOUD_ONLY)
        with _closing(CloudSession(cfg.connect, plain), on_session_closed) as session:
            res = _cloud_only(session, prompt, cfg, on_tokens, t0, on_round, should_stop)
        if guard is not None:  # the drafter rested through these steps, whichever said so
            guard.skip(len(res.tokens))
        why = "contention" if rests else "backoff"
        res.stats.lead.update(drafter_joined_at=None, contention_rests=0, streamed_plain=True, plain_because=why)
        return res
    if drafter_model is not None:
        given: list[Model] = [drafter_model]
        source = lambda: given.pop() if given else None  # noqa: E731 - hands the one drafter over once
    late = (
        (lambda: make_drafter(m) if (m := source()) is not None else None)  # noqa: E731
        if source is not None
        else None
    )
    with _closing(CloudSession(cfg.connect, hello), on_session_closed) as session:
        return _follow(
            session,
            prompt,
            cfg,
            rule,
            t0,
            "auto",
            drafter=None,
            source=late,
            after_first=True,
            guard=guard,
            backoff=backoff,
            on_tokens=on_tokens,
            on_round=on_round,
            should_stop=should_stop,
        )


@contextlib.contextmanager
def _closing(session: CloudSession, on_session_closed: Callable[[CloudSession], None] | None):
    """The session, closed and handed to `on_session_closed` however the run with it ends."""
    try:
        yield session
    finally:
        session.close()
        if on_session_closed is not None:
            on_session_closed(session)


def _follow(
    session: CloudSession, prompt, cfg: EdgeConfig, rule: RuleSpec, t0: float, mode: str, **loop_kw
) -> LoopResult:
    """A streaming session's follow loop (cloud-led and auto), and the link's figures in its stats."""
    link = TcpLeadLink(session, send_q=rule.info.needs_q)
    follow = FollowConfig(max_tokens=cfg.max_tokens, max_lead=min(FollowConfig.max_lead, session.max_draft_tokens))
    try:
        res = FollowLoop(link, prompt, config=follow, spawn=ThreadJob, **loop_kw).run(t0)
    except StreamError as e:
        raise EdgeError(f"{mode} stream: {e}") from None
    res.stats.bytes_up, res.stats.bytes_down = session.total_bytes()
    _link_stats(res.stats, session)
    rtt = link.rtt_s()
    res.stats.link["rtt_ms_mean"] = None if rtt is None else round(1e3 * rtt, 3)
    return res


def build_loop(
    transport: Transport,
    drafter: ChainDrafter,
    prompt: Sequence[int],
    cfg: EdgeConfig,
    *,
    policy: DepthPolicy | None = None,
    clock: Clock = time.perf_counter,
    on_tokens: Callable[[list[int]], None] | None = None,
    on_round: Callable[[Round], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SpecLoop:
    """The edge's loop for `cfg` over any transport: the state cache, the depth policy and the loop's
    configuration, built one way for the live edge and for the simulator (which passes its virtual
    `clock` and a simulated link), so the two cannot drift apart."""
    cache = None
    if cfg.cache:
        if drafter.model.n_slots < 2:
            raise EdgeError("the state cache needs a drafter loaded with n_slots > 1")
        cache = StateCache(
            drafter,
            CacheConfig(budget_bytes=int(cfg.cache_budget_mb * (1 << 20))),
            coupled=drafter.rule.name == "coupled",
            clock=clock,
        )
    loop_cfg = LoopConfig(
        mode=cfg.mode,
        window=cfg.window,
        max_tokens=cfg.max_tokens,
        min_conf=cfg.min_conf,
        branches=cfg.branches,
        auto_window=cfg.auto_window,
    )
    policy = policy or make_policy(
        cfg.policy,
        cfg.k,
        pipelined=cfg.mode == "pipelined",
        auto_window=cfg.auto_window,
        pass_budget=cfg.pass_budget,
        max_window=loop_cfg.max_window,
    )
    return SpecLoop(
        transport,
        prompt,
        drafter=drafter,
        policy=policy,
        config=loop_cfg,
        on_tokens=on_tokens,
        cache=cache,
        on_round=on_round,
        should_stop=should_stop,
        clock=clock,
    )


def _open_while_prefilling(
    connect: ConnectConfig, hello: wire.Hello, drafter: ChainDrafter | None, prompt, *, keep_going: bool = False
) -> tuple[CloudSession, ThreadJob | None]:
    """Open the session while the drafter prefills the prompt in a second thread: the handshake is a
    round trip of waiting, and llama.cpp releases the GIL while it computes. `keep_going`: return with
    the prefill still running (the job is the caller's to wait on) instead of after it."""
    if drafter is None:
        return CloudSession(connect, hello), None
    job = ThreadJob(lambda: drafter.prefill(prompt), name="acespec-drafter-prefill")
    try:
        session = CloudSession(connect, hello)
    except BaseException:
        job.wait()  # the drafter must be idle before anything else touches it
        raise
    if keep_going:
        return session, job
    try:
        job.wait()
    except BaseException:
        session.close()
        raise
    return session, None


def _cloud_only(
    session: CloudSession, prompt, cfg: EdgeConfig, on_tokens, t0: float, on_round=None, should_stop=None
) -> LoopResult:
    stats = RunStats()
    committed = len(prompt)
    out: list[int] = []
    finished = False
    while not finished and not (should_stop is not None and should_stop()):
        item = session.link.get(cfg.connect.reply_timeout_s)
        f = None if item is None else item[1]
        if isinstance(f, wire.Tokens):
            new = list(f.tokens[committed - f.start :]) if f.start <= committed else []
            if f.start > committed:
                raise EdgeError(f"cloud streamed from {f.start}, the edge holds {committed}")
            lps = None if f.logprobs is None else f.logprobs[committed - f.start :]
            now = time.perf_counter() - t0
            if new:
                out.extend(new)
                committed += len(new)
                stats.rounds += len(new)
                stats.observe_tokens(len(new), now)
                if on_tokens:
                    on_tokens(new)
                if on_round:
                    on_round(
                        Round(
                            tokens=list(new),
                            origins=[ORIGIN_TARGET] * len(new),
                            drafted=0,
                            accepted=0,
                            latency_s=None,
                            verify_s=0.0,
                            rtt_s=None,
                            logprobs=lps,
                        )
                    )
            finished = f.finished
        elif isinstance(failure := link_failure(f), EdgeError):
            raise failure
        elif item is None or failure is not None or not isinstance(f, (wire.Pong, wire.Close)):
            session.resume(list(prompt) + out)  # the cloud continues streaming from what we have
    stats.wall_s = time.perf_counter() - t0
    stats.bytes_up, stats.bytes_down = session.total_bytes()
    _link_stats(stats, session)
    return LoopResult(out, stats, finished)


def _link_stats(stats: RunStats, session: CloudSession) -> None:
    stats.link.update(
        reconnects=session.reconnects,
        recoveries=session.recoveries,
        failovers=session.failovers,
        busy_waits=session.busy_waits,
    )
