"""Prometheus metrics for the cloud: `acespec serve --metrics-port P` serves them at /metrics.

Read at scrape time from the server and its verify engine (no bookkeeping on the hot path). Names
follow vLLM's where the meaning is the same (`vllm:kv_cache_usage_perc` -> `acespec:kv_cache_usage_perc`),
with the prefix `acespec:`; counters end in `_total` as Prometheus expects.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class CloudCollector(Collector):
    def __init__(self, server) -> None:  # server: acespec.cloud.server.CloudServer
        self.server = server

    def collect(self):
        srv = self.server
        m = srv.engine.metrics()
        live = list(srv.sessions.values())
        g = GaugeMetricFamily("acespec:sessions_live", "Live sessions by state", labels=["state"])
        g.add_metric(["connected"], sum(1 for s in live if s.connected))
        g.add_metric(["waiting_resume"], sum(1 for s in live if not s.connected))
        g.add_metric(["resident"], m.get("resident", len(live)))
        yield g
        c = CounterMetricFamily("acespec:sessions_started", "Sessions opened (HELLO) and reattached (RESUME)", labels=["how"])
        for how, n in srv.handshakes.items():
            c.add_metric([how], n)
        yield c
        c = CounterMetricFamily("acespec:errors", "ERROR frames sent, by code", labels=["code"])
        for code, n in sorted(srv.errors_sent.items()):
            c.add_metric([code], n)
        yield c
        yield CounterMetricFamily("acespec:verdicts", "Verdicts the engine produced (dropped blocks included)",
                                  value=m.get("verdicts", 0))
        if "ticks" in m:  # the batching engine
            yield CounterMetricFamily("acespec:engine_ticks", "Batched model passes (ticks) run", value=m["ticks"])
            yield CounterMetricFamily("acespec:engine_evaluated_tokens", "Tokens the target evaluated", value=m["evaluated"])
            yield CounterMetricFamily("acespec:engine_swaps", "Sessions whose KV was dropped to make room", value=m["swaps"])
            yield CounterMetricFamily("acespec:engine_busy_refusals", "Opens refused for want of a KV slot", value=m["refused"])
            yield GaugeMetricFamily("acespec:kv_cache_tokens", "KV tokens resident now", value=m["kv_tokens"])
            alloc = m.get("kv_tokens_allocated") or 0
            yield GaugeMetricFamily("acespec:kv_cache_usage_perc", "Fraction of the allocated KV cells in use",
                                    value=(m["kv_tokens"] / alloc) if alloc else 0.0)

        if "requests" in m:  # the vLLM engine
            yield CounterMetricFamily("acespec:engine_requests", "Requests sent to vLLM", value=m["requests"])
            yield CounterMetricFamily("acespec:engine_cache_resubmits",
                                      "Verify requests sent again because the prefix cache covered a row they need",
                                      value=m["resubmits"])
            yield CounterMetricFamily("acespec:prefix_cache_queries", "Prompt tokens sent to vLLM", value=m["prompt_tokens"])
            yield CounterMetricFamily("acespec:prefix_cache_hits", "Prompt tokens vLLM's prefix cache served", value=m["cached_tokens"])
            # sampled coupled sessions: per target row, the bound on the tempered mass outside the top-K
            # tokens the rule drew over (0 for exact sessions, which are not counted)
            edges = [e for e, _ in m["tail_buckets"]]
            counts = [n for _, n in m["tail_buckets"]]
            cum = [sum(counts[: i + 1]) for i in range(len(counts))]
            h = HistogramMetricFamily("acespec:topk_tail_mass", "Bound on the target mass outside the top-K rows, per verified row")
            h.add_metric([], [(f"{e:g}", c) for e, c in zip(edges[:-1], cum[:-1])] + [("+Inf", cum[-1])], sum_value=m["tail_mass_sum"])
            yield h
            yield GaugeMetricFamily("acespec:topk_tail_mass_max", "Largest bound on the target mass outside the top-K rows",
                                    value=m["tail_mass_max"])


def start_metrics_server(server, port: int, host: str = "127.0.0.1"):
    """Serve the server's metrics on http://host:port/metrics from a daemon thread; returns (httpd, thread)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(CloudCollector(server))
    return start_http_server(port, addr=host, registry=registry)
