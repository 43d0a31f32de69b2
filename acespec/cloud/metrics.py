"""The cloud's HTTP port (`acespec serve --metrics-port P`): Prometheus metrics and load-balancer checks.

    GET /metrics   Prometheus text format
    GET /health    200 while the process is up and its event loop answers; 503 when the loop is stuck
    GET /ready     200 while it takes new sessions; 503 with the reason when it does not: draining
                   (SIGTERM: at once, while the verdicts owed still go out), at its session cap, or
                   no KV room left (every slot held by an active session)

Both checks answer a small JSON body, so a person reading it learns the reason too. Any other path
is 404, any other method 405; nothing a client sends gets a 5xx other than 503.

Read at scrape time from the server and its verify engine (no bookkeeping on the hot path). Names
follow vLLM's where the meaning is the same (`vllm:kv_cache_usage_perc` -> `acespec:kv_cache_usage_perc`),
with the prefix `acespec:`; counters end in `_total` as Prometheus expects.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
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
        c = CounterMetricFamily(
            "acespec:sessions_started", "Sessions opened (HELLO) and reattached (RESUME)", labels=["how"]
        )
        for how, n in srv.handshakes.items():
            c.add_metric([how], n)
        yield c
        c = CounterMetricFamily("acespec:errors", "ERROR frames sent, by code", labels=["code"])
        for code, n in sorted(srv.errors_sent.items()):
            c.add_metric([code], n)
        yield c
        yield CounterMetricFamily(
            "acespec:verdicts", "Verdicts the engine produced (dropped blocks included)", value=m.get("verdicts", 0)
        )
        if "ticks" in m:  # the batching engine
            yield CounterMetricFamily("acespec:engine_ticks", "Batched model passes (ticks) run", value=m["ticks"])
            yield CounterMetricFamily(
                "acespec:engine_evaluated_tokens", "Tokens the target evaluated", value=m["evaluated"]
            )
            yield CounterMetricFamily(
                "acespec:engine_swaps", "Sessions whose KV was dropped to make room", value=m["swaps"]
            )
            yield CounterMetricFamily(
                "acespec:engine_busy_refusals", "Opens refused for want of a KV slot", value=m["refused"]
            )
            yield GaugeMetricFamily("acespec:kv_cache_tokens", "KV tokens resident now", value=m["kv_tokens"])
            alloc = m.get("kv_tokens_allocated") or 0
            yield GaugeMetricFamily(
                "acespec:kv_cache_usage_perc",
                "Fraction of the allocated KV cells in use",
                value=(m["kv_tokens"] / alloc) if alloc else 0.0,
            )

        if "requests" in m:  # the vLLM engine
            yield CounterMetricFamily("acespec:engine_requests", "Requests sent to vLLM", value=m["requests"])
            yield CounterMetricFamily(
                "acespec:engine_cache_resubmits",
                "Verify requests sent again because the prefix cache covered a row they need",
                value=m["resubmits"],
            )
            yield CounterMetricFamily(
                "acespec:prefix_cache_queries", "Prompt tokens sent to vLLM", value=m["prompt_tokens"]
            )
            yield CounterMetricFamily(
                "acespec:prefix_cache_hits", "Prompt tokens vLLM's prefix cache served", value=m["cached_tokens"]
            )
            # cloud-led sessions inside vLLM's own speculative decoding (serve --lead-k)
            yield CounterMetricFamily(
                "acespec:lead_native_tokens",
                "Tokens of cloud-led sessions decoded by vLLM's speculative decoding",
                value=m.get("lead_tokens", 0),
            )
            yield CounterMetricFamily(
                "acespec:lead_native_proposed",
                "Edge-draft tokens the proposer gave vLLM to verify",
                value=m.get("lead_proposed", 0),
            )
            yield CounterMetricFamily(
                "acespec:lead_native_accepted",
                "Of those, tokens vLLM's rejection sampler kept",
                value=m.get("lead_accepted", 0),
            )
            yield CounterMetricFamily(
                "acespec:lead_native_q_used",
                "Steps whose drafts a rule decided with the q rows the edge sent",
                value=m.get("lead_q_used", 0),
            )
            # sampled coupled sessions: per target row, the bound on the tempered mass outside the top-K
            # tokens the rule drew over (0 for exact sessions, which are not counted)
            edges = [e for e, _ in m["tail_buckets"]]
            counts = [n for _, n in m["tail_buckets"]]
            cum = [sum(counts[: i + 1]) for i in range(len(counts))]
            h = HistogramMetricFamily(
                "acespec:topk_tail_mass", "Bound on the target mass outside the top-K rows, per verified row"
            )
            h.add_metric(
                [],
                [(f"{e:g}", c) for e, c in zip(edges[:-1], cum[:-1])] + [("+Inf", cum[-1])],
                sum_value=m["tail_mass_sum"],
            )
            yield h
            yield GaugeMetricFamily(
                "acespec:topk_tail_mass_max",
                "Largest bound on the target mass outside the top-K rows",
                value=m["tail_mass_max"],
            )


HEALTH_LOOP_TIMEOUT_S = 5.0  # /health fails when the event loop has not run a callback for this long


class _Handler(BaseHTTPRequestHandler):
    server_version = "acespec"
    protocol_version = "HTTP/1.1"
    cloud: Any = None  # the CloudServer (set on the subclass start_metrics_server makes)
    registry: CollectorRegistry

    def log_message(self, fmt, *args) -> None:  # health checks every second would flood stderr
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj: dict) -> None:
        self._send(code, json.dumps(obj).encode() + b"\n", "application/json")

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/metrics":
            self._send(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == "/health":
            alive = self.cloud.loop_alive(HEALTH_LOOP_TIMEOUT_S)
            self._json(200 if alive else 503, {"status": "ok" if alive else "event loop not answering"})
        elif path == "/ready":
            ready, reason = self.cloud.readiness()
            self._json(200 if ready else 503, {"ready": ready, "reason": reason})
        else:
            self._json(404, {"error": "no such path; try /metrics, /health or /ready"})

    do_HEAD = do_GET

    def _not_allowed(self) -> None:
        self.close_connection = True
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def __getattr__(self, name: str):
        # any other method word a client sends (http.server would answer 501): 405
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def send_error(self, code, message=None, explain=None) -> None:
        # http.server's own refusals: 505 for an HTTP version it does not speak is the client's error too,
        # and every answer carries a status line (http.server leaves it out for what it takes as HTTP/0.9)
        self.request_version = "HTTP/1.0" if self.request_version == "HTTP/0.9" else self.request_version
        super().send_error(400 if code >= 500 else code, message, explain)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # a health checker that hangs up after the status line (HAProxy does) is not an error

        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def start_metrics_server(server, port: int, host: str = "127.0.0.1"):
    """Serve /metrics, /health and /ready for `server` (a CloudServer) from a daemon thread; returns
    (httpd, thread). Stop it with httpd.shutdown()."""
    registry = CollectorRegistry()
    registry.register(CloudCollector(server))
    handler = type("CloudHTTPHandler", (_Handler,), {"cloud": server, "registry": registry})
    httpd = _HTTPServer((host, port), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True, name="acespec-metrics")
    t.start()
    return httpd, t
