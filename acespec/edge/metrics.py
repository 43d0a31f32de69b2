"""Prometheus metrics of the edge API, served at /metrics by `acespec edge serve`.

Names follow vLLM's where the meaning is the same, with the prefix `acespec:` instead of `vllm:`
(`vllm:spec_decode_num_accepted_tokens` -> `acespec:spec_decode_num_accepted_tokens_total`, as
prometheus_client appends `_total` to counters, like vLLM's exporter). AceSpec's own figures (state
cache, round trip, K, link bytes, cloud sessions) carry their own names. Every metric lives in the
service's own registry, so several edges in one process (the tests) never mix their figures.

Counting rules, so the figures add up: a round is one verdict the edge applied; a *draft* is a round
whose block held draft tokens (vLLM counts one draft per request per step the same way);
`num_draft_tokens` is the K of the verified blocks, `num_accepted_tokens` the tokens the target kept,
so `num_accepted_tokens_total` moves by exactly a request's `usage.accepted_tokens`. The inter-token
latency spreads each verdict's gap over the tokens it committed, as a streaming reader sees them (and
as `RunStats.inter_token_latency` does): a request of n tokens adds n - 1 observations.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from acespec.loop.loop import Round

# buckets: seconds for latencies on a WAN (1 ms .. 60 s), tokens for K
_LATENCY = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    60.0,
)
_REQUEST = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_K = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
MAX_POSITIONS = 32  # per-position acceptance is kept for the first this-many block positions


class EdgeMetrics:
    def __init__(self, pool_size: int, pool=None) -> None:
        disable_created_metrics()  # process-wide: the `_created` series would double the exposition for nothing a dashboard reads
        self.registry = r = CollectorRegistry()
        self._lock = threading.Lock()
        self.running = 0
        # requests (vLLM names)
        g = Gauge("acespec:num_requests_running", "Requests generating now", registry=r)
        g.set_function(lambda: self.running)
        g = Gauge("acespec:num_requests_waiting", "Requests queued for a drafter", registry=r)
        g.set_function(lambda: pool.waiting if pool is not None else 0)
        Gauge("acespec:drafters", "Drafters loaded (generations that can draft at once)", registry=r).set(pool_size)
        g = Gauge("acespec:drafters_busy", "Drafters running a generation now", registry=r)
        g.set_function(lambda: pool.busy if pool is not None else 0)
        self.success = Counter(
            "acespec:request_success", "Requests ended, by why (stop, length, abort)", ["finished_reason"], registry=r
        )
        self.errors = Counter(
            "acespec:request_errors", "Requests answered with an error, by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter("acespec:prompt_tokens", "Prompt tokens of the requests run", registry=r)
        self.generation_tokens = Counter("acespec:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "acespec:time_to_first_token_seconds", "Request arrival to its first token", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "acespec:inter_token_latency_seconds",
            "Time between tokens, as a streaming reader sees it",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "acespec:e2e_request_latency_seconds", "Request arrival to its last token", buckets=_REQUEST, registry=r
        )
        self.queue = Histogram(
            "acespec:request_queue_time_seconds", "Time a request waited for a drafter", buckets=_LATENCY, registry=r
        )
        # speculative decoding (vLLM names)
        self.drafts = Counter("acespec:spec_decode_num_drafts", "Verified blocks that held draft tokens", registry=r)
        self.draft_tokens = Counter("acespec:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter(
            "acespec:spec_decode_num_accepted_tokens", "Draft tokens the target accepted", registry=r
        )
        self.accepted_pos = Counter(
            "acespec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their position in the block",
            ["position"],
            registry=r,
        )
        # AceSpec's own
        self.passes = Counter(
            "acespec:target_passes", "Target verify passes (rounds; a cloud-only token is one)", registry=r
        )
        self.origins = Counter(
            "acespec:tokens_by_origin", "Tokens generated, by origin (draft, cache, target)", ["origin"], registry=r
        )
        self.k = Histogram("acespec:draft_k", "Draft depth K of each verified block", buckets=_K, registry=r)
        self.rtt = Histogram(
            "acespec:rtt_seconds", "The path's round-trip estimate at each verdict", buckets=_LATENCY, registry=r
        )
        self.verdict = Histogram(
            "acespec:verdict_latency_seconds",
            "Block sent to its verdict applied (round trip, queueing and verify time)",
            buckets=_LATENCY,
            registry=r,
        )
        self.cache_lookups = Counter(
            "acespec:state_cache_lookups", "Verdicts that consulted the state cache", registry=r
        )
        self.cache_hits = Counter(
            "acespec:state_cache_hits", "State-cache lookups that found the outcome pre-drafted", registry=r
        )
        self.bytes_up = Counter("acespec:uplink_bytes", "Frame bytes sent to the cloud", registry=r)
        self.bytes_down = Counter("acespec:downlink_bytes", "Frame bytes received from the cloud", registry=r)
        self.sessions_live = 0
        g = Gauge("acespec:cloud_sessions_live", "Generations holding (or opening) a cloud session", registry=r)
        g.set_function(lambda: self.sessions_live)
        self.sessions_resumed = Counter(
            "acespec:cloud_sessions_resumed",
            "Cloud sessions continued after a dropped link (resume) or a lost session (recover; "
            "failover: of those, reopened on another replica of the fleet)",
            ["how"],
            registry=r,
        )
        self.busy = Counter("acespec:cloud_busy", "BUSY answers from the cloud, retried with backoff", registry=r)

    def request_started(self, queue_s: float) -> None:
        with self._lock:
            self.running += 1
            self.sessions_live += 1
        self.queue.observe(queue_s)

    def request_ended(self, reason: str, prompt_tokens: int) -> None:
        """Called by the request once it has answered (reason: stop, length or abort)."""
        self.success.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)

    def tracker(self, received: float) -> RequestTracker:
        return RequestTracker(self, received)


class RequestTracker:
    """One generation's figures, moved into the metrics as its rounds arrive (from its worker thread)."""

    def __init__(self, m: EdgeMetrics, received: float) -> None:
        self.m = m
        self.received = received
        self.last: float | None = None  # when the previous round arrived

    def round(self, r: Round) -> None:
        m, now = self.m, time.perf_counter()
        n = len(r.tokens)
        if self.last is None:  # the first token; the others it came with arrived with it (gap 0)
            m.ttft.observe(now - self.received)
            gaps = [0.0] * (n - 1)
        else:
            gaps = [(now - self.last) / max(1, n)] * n
        for gap in gaps:
            m.itl.observe(gap)
        self.last = now
        m.generation_tokens.inc(n)
        m.passes.inc()
        for origin in set(r.origins):
            m.origins.labels(origin).inc(r.origins.count(origin))
        if r.latency_s is None:  # cloud-only streaming: no blocks, no verdicts
            return
        m.k.observe(r.drafted)
        m.verdict.observe(r.latency_s)
        if r.rtt_s is not None:
            m.rtt.observe(r.rtt_s)
        if r.drafted:
            m.drafts.inc()
            m.draft_tokens.inc(r.drafted)
            m.accepted.inc(r.accepted)
            for i in range(min(r.accepted, MAX_POSITIONS)):
                m.accepted_pos.labels(str(i)).inc()

    def finish(self, result, session) -> None:
        """The run ended (result None if it failed); `session` is its closed cloud session, if it had one."""
        m = self.m
        with m._lock:
            m.running -= 1
            m.sessions_live -= 1
        m.e2e.observe(time.perf_counter() - self.received)
        if result is not None and result.stats.cache:
            c = result.stats.cache
            m.cache_lookups.inc(c.get("lookups", 0))
            m.cache_hits.inc(c.get("hits", 0))
        if session is not None:
            m.bytes_up.inc(session.bytes_up)  # a closed session has folded its last link's bytes in
            m.bytes_down.inc(session.bytes_down)
            m.sessions_resumed.labels("resume").inc(session.reconnects)
            m.sessions_resumed.labels("recover").inc(session.recoveries)
            m.sessions_resumed.labels("failover").inc(session.failovers)
            m.busy.inc(session.busy_waits)
