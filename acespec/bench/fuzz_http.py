"""`acespec bench fuzz-http`: a mutation campaign through the HTTP front doors.

    acespec bench fuzz-http [--requests 100000] [--threads 8] [--seed 0] [--json OUT]

Two real processes on loopback: `acespec serve` (toy target, with its HTTP port for /metrics,
/health and /ready) and `acespec edge serve` (the OpenAI-compatible API) in front of it. The
requests are built from the edge API's own OpenAPI schema (`/openapi.json`):

- **schema-generated** bodies for every POST path: each property of the request schema given a
  value of a type the schema declares (small budgets, so a generation takes milliseconds);
- **mutated** bodies: a property given a value of another type, a huge or negative number, a lone
  surrogate, a long or NUL-filled string; a required property dropped; unknown properties added;
- **malformed** requests: random bytes, truncated or deeply nested JSON, JSON that is not an
  object, a wrong content type, unknown paths and methods, on both the edge API and the cloud's port.

A response of 500 or more other than 503 is a failure (with the first few bodies kept), a request
unanswered within `--timeout` is a hang, and at the end a valid request must still be served by
both processes. Exit status 0 only then.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from acespec.argtypes import pos_float, pos_int
from acespec.bench import write_result
from acespec.bench.children import ChildProcesses, wait_for_line
from acespec.bench.fleet import free_port

HOST = "127.0.0.1"
NASTY_STRINGS = ["", "\ud800", "a\x00b", "x" * 100_000, "🙂" * 1000, "null", "-1", "1e400", " ", "\n" * 50]
NASTY_NUMBERS = [-1, 0, 2**31, 2**63, 2**64 + 1, 10**400, -(10**18), 1e308, -1e308, 0.5, 1e-300]


@dataclass
class FuzzHttpResult:
    requests: int = 0
    by_status: dict[str, int] = field(default_factory=dict)  # status (or "dropped": closed without an answer) -> count
    by_kind: dict[str, int] = field(default_factory=dict)  # how the request was made -> count
    failures: int = 0  # responses >= 500 other than 503
    hangs: int = 0  # no answer within the timeout
    examples: list[str] = field(default_factory=list)  # the first failures and hangs
    valid_after: bool = False  # a valid request to each process was served at the end
    wall_s: float = 0.0


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        node = schema["components"]["schemas"][name]
    return node


def _types(schema: dict, prop: dict) -> list[dict]:
    prop = _resolve(schema, prop)
    if "anyOf" in prop or "oneOf" in prop:
        return [t for p in prop.get("anyOf", prop.get("oneOf", [])) for t in _types(schema, p)]
    return [prop]


def _value(schema: dict, prop: dict, rng: random.Random, depth: int = 0, served: tuple[str, ...] = ()):
    """A value of one of the types `prop` declares."""
    t = rng.choice(_types(schema, prop))
    if "enum" in t:
        return rng.choice(t["enum"])
    kind = t.get("type")
    if kind == "integer":
        lo, hi = t.get("minimum", 0), t.get("maximum", 64)
        return rng.randint(int(lo), int(min(hi, lo + 64)))
    if kind == "number":
        lo, hi = t.get("minimum", 0.0), t.get("maximum", 2.0)
        return rng.uniform(lo, min(hi, lo + 2.0))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return rng.choice(["hello", "def f(x):", "acespec", "x" * rng.randint(1, 40)])
    if kind == "null":
        return None
    if kind == "array":
        items = t.get("items", {})
        return [_value(schema, items, rng, depth + 1, served) for _ in range(rng.randint(0, 3))] if depth < 4 else []
    if kind == "object" or "properties" in t:
        return _object(schema, t, rng, depth + 1, served) if depth < 4 else {}
    return rng.choice(["x", 1, None, [], {}])


def _object(schema: dict, node: dict, rng: random.Random, depth: int = 0, served: tuple[str, ...] = ()) -> dict:
    """A body built from the schema's node; `served`: the edge API's model ids (/v1/models), so most
    bodies that have a model field name one."""
    node = _resolve(schema, node)
    props = node.get("properties", {})
    required = set(node.get("required", []))
    out = {}
    for name, prop in props.items():
        if name in required or rng.random() < 0.5:
            out[name] = _value(schema, prop, rng, depth, served)
    if "model" in out and served and rng.random() < 0.8:
        out["model"] = rng.choice(served)
    for name in ("max_tokens", "max_completion_tokens", "n"):  # keep generations short: milliseconds each
        if isinstance(out.get(name), int):
            out[name] = min(out[name], 24)
    return out


def _wrong(rng: random.Random):
    return rng.choice(
        [
            rng.choice(NASTY_STRINGS),
            rng.choice(NASTY_NUMBERS),
            None,
            True,
            [],
            {},
            [1, "a", None],
            {"a": {"b": [1]}},
            [[[]]],
            float("inf") if rng.random() < 0.1 else "inf",
        ]
    )


class _Campaign:
    def __init__(
        self, api_port: int, cloud_http_port: int, schema: dict, seed: int, timeout: float, served: tuple[str, ...] = ()
    ) -> None:
        self.api_port, self.cloud_http_port, self.schema, self.timeout = api_port, cloud_http_port, schema, timeout
        self.served = served  # the edge API's model ids
        self.rng = random.Random(seed)
        self.posts = [(path, ops["post"]) for path, ops in schema.get("paths", {}).items() if "post" in ops]
        self.gets = [path for path, ops in schema.get("paths", {}).items() if "get" in ops and "{" not in path]
        self.lock = threading.Lock()
        self.res = FuzzHttpResult()

    def _body_schema(self, op: dict) -> dict:
        content = op.get("requestBody", {}).get("content", {})
        return content.get("application/json", {}).get("schema", {})

    def make(self, rng: random.Random) -> tuple[str, int, str, str, bytes, dict]:
        """(kind, port, method, path, body, headers) of one request."""
        json_h = {"Content-Type": "application/json"}
        roll = rng.random()
        if roll < 0.1:  # the cloud's HTTP port: its three paths, and anything else
            path = rng.choice(["/metrics", "/health", "/ready", "/", "/ready?x=1", "/%ff", "/" + "a" * 3000])
            method = rng.choice(["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "BREW"])
            return (
                "cloud-port",
                self.cloud_http_port,
                method,
                path,
                rng.randbytes(rng.randint(0, 64)) if method != "GET" else b"",
                {},
            )
        if roll < 0.15:  # the edge API's GET paths, and unknown ones, with any method
            path = rng.choice(self.gets + ["/v1/nothing", "/static/../../etc/passwd", "/static/%00", "/v1/models/x"])
            return "api-get", self.api_port, rng.choice(["GET", "HEAD", "DELETE", "PATCH"]), path, b"", {}
        path, op = rng.choice(self.posts)
        body = _object(self.schema, self._body_schema(op), rng, served=self.served)
        if roll < 0.35:
            return "schema", self.api_port, "POST", path, json.dumps(body).encode(), json_h
        if roll < 0.75:  # one to three properties mutated, dropped or added
            props = list(_resolve(self.schema, self._body_schema(op)).get("properties", {}))
            for _ in range(rng.randint(1, 3)):
                what = rng.random()
                name = rng.choice(props)
                if what < 0.6:
                    body[name] = _wrong(rng)
                elif what < 0.8:
                    body.pop(name, None)
                else:
                    body[rng.choice(["extra", "\ud800", "x" * 200, "max_tokens ", "__proto__"])] = _wrong(rng)
            try:
                data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
            except (ValueError, OverflowError):
                data = b"{}"
            return "mutated", self.api_port, "POST", path, data, json_h
        kind = rng.choice(["bytes", "truncated", "nested", "not-object", "content-type", "empty"])
        if kind == "bytes":
            data = rng.randbytes(rng.randint(1, 2048))
        elif kind == "truncated":
            full = json.dumps(body).encode()
            data = full[: rng.randint(0, max(0, len(full) - 1))]
        elif kind == "nested":
            n = rng.choice([100, 1000, 100_000])
            data = b"[" * n + b"]" * n if rng.random() < 0.5 else b'{"a":' * n + b"1" + b"}" * n
        elif kind == "not-object":
            data = rng.choice([b"[]", b"1", b'"x"', b"null", b"true", b"[{}]"])
        elif kind == "content-type":
            data = json.dumps(body).encode()
            return (
                kind,
                self.api_port,
                "POST",
                path,
                data,
                {
                    "Content-Type": rng.choice(
                        [
                            "text/plain",
                            "application/x-www-form-urlencoded",
                            "multipart/form-data; boundary=x",
                            "application/json; charset=latin-1",
                        ]
                    )
                },
            )
        else:
            data = b""
        return kind, self.api_port, "POST", path, data, json_h

    def send(self, conns: dict, kind, port, method, path, body, headers) -> str:
        """The status as text, "dropped" if the connection closed unanswered, "hang" on timeout."""
        for attempt in range(2):
            c = conns.get(port)
            if c is None:
                c = conns[port] = http.client.HTTPConnection(HOST, port, timeout=self.timeout)
            try:
                c.request(method, path, body=body or None, headers=headers)
                r = c.getresponse()
                text = r.read()
                if r.getheader("connection", "").lower() == "close":
                    c.close()
                    conns.pop(port, None)
                status = str(r.status)
                if r.status >= 500 and r.status != 503:
                    self._example(f"{r.status} {kind} {method} {path[:60]} {body[:200]!r} -> {text[:300]!r}")
                return status
            except TimeoutError:
                c.close()
                conns.pop(port, None)
                self._example(f"hang {kind} {method} {path[:60]} {body[:200]!r}")
                return "hang"
            except (http.client.HTTPException, ConnectionError, OSError):
                c.close()
                conns.pop(port, None)
                if attempt:  # a fresh connection closed too: the server refused this request's bytes
                    return "dropped"
        return "dropped"

    def _example(self, text: str) -> None:
        with self.lock:
            if len(self.res.examples) < 10:
                self.res.examples.append(text)

    def run(self, n: int, threads: int, log) -> FuzzHttpResult:
        res = self.res
        counter = iter(range(n))
        t0 = time.perf_counter()

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            conns: dict = {}
            while True:
                with self.lock:
                    i = next(counter, None)
                if i is None:
                    break
                kind, port, method, path, body, headers = self.make(rng)
                status = self.send(conns, kind, port, method, path, body, headers)
                with self.lock:
                    res.requests += 1
                    res.by_status[status] = res.by_status.get(status, 0) + 1
                    res.by_kind[kind] = res.by_kind.get(kind, 0) + 1
                    if status == "hang":
                        res.hangs += 1
                    elif status.isdigit() and int(status) >= 500 and status != "503":
                        res.failures += 1
                    if res.requests % 10000 == 0:
                        log(
                            f"  {res.requests} requests, {res.failures} failures, {res.hangs} hangs, "
                            f"{res.requests / (time.perf_counter() - t0):.0f}/s"
                        )
            for c in conns.values():
                c.close()

        ts = [threading.Thread(target=worker, args=(self.rng.randrange(1 << 30),), daemon=True) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res.wall_s = round(time.perf_counter() - t0, 1)
        return res


def _valid(api_port: int, cloud_http_port: int, served: tuple[str, ...]) -> bool:
    body = json.dumps(
        {"model": served[0] if served else "acespec", "prompt": "hello", "max_tokens": 8, "temperature": 0.0}
    ).encode()
    req = urllib.request.Request(
        f"http://{HOST}:{api_port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            ok = r.status == 200 and len(json.loads(r.read())["choices"][0]["text"]) > 0
        with urllib.request.urlopen(f"http://{HOST}:{cloud_http_port}/ready", timeout=10) as r:
            return ok and r.status == 200
    except (OSError, ValueError, KeyError):
        return False


def run_fuzz_http(
    n: int,
    threads: int = 8,
    seed: int = 0,
    timeout: float = 30.0,
    log=print,
    target: str = "toy:vocab=64,seed=1",
    draft: str = "toy:vocab=64,seed=1,noise=0.5",
) -> FuzzHttpResult:
    exe = [sys.executable, "-m", "acespec.cli"]
    kids = ChildProcesses()
    try:
        cloud_port = free_port()
        cloud = kids.start(
            [
                *exe,
                "serve",
                "--target",
                target,
                "--port",
                str(cloud_port),
                "--metrics-port",
                "0",
                "--max-sessions",
                "64",
            ]
        )
        cloud_http = int(wait_for_line(cloud, r"metrics at http://[\d.]+:(\d+)/metrics", 120, "the cloud").group(1))
        api = kids.start([*exe, "edge", "serve", "--cloud", f"127.0.0.1:{cloud_port}", "--draft", draft, "--port", "0"])
        api_port = int(wait_for_line(api, r"http://[\d.]+:(\d+)", 120, "the edge API").group(1))
        with urllib.request.urlopen(f"http://{HOST}:{api_port}/openapi.json", timeout=30) as r:
            schema = json.loads(r.read())
        with urllib.request.urlopen(f"http://{HOST}:{api_port}/v1/models", timeout=30) as r:
            served = tuple(m["id"] for m in json.loads(r.read())["data"])
        camp = _Campaign(api_port, cloud_http, schema, seed, timeout, served)
        res = camp.run(n, threads, log)
        res.valid_after = _valid(api_port, cloud_http, served) and cloud.poll() is None and api.poll() is None
        return res
    finally:
        kids.stop_all()


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "fuzz-http", help="schema-generated and mutated requests to the edge API and the cloud's HTTP port"
    )
    p.add_argument("--requests", type=pos_int, default=100_000, help="requests to send (default 100000)")
    p.add_argument("--threads", type=pos_int, default=8, help="clients at once (default 8)")
    p.add_argument(
        "--timeout", type=pos_float, default=30.0, help="seconds before an unanswered request is a hang (default 30)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT")
    p.set_defaults(func=cmd_bench_fuzz_http)
    return p


def cmd_bench_fuzz_http(args: argparse.Namespace) -> int:
    print(
        f"bench fuzz-http: {args.requests} requests from {args.threads} clients to acespec edge serve's API (built from "
        f"its /openapi.json) and acespec serve's HTTP port; toy pair",
        flush=True,
    )
    res = run_fuzz_http(args.requests, args.threads, args.seed, args.timeout, log=lambda s: print(s, flush=True))
    print(f"  by kind: {', '.join(f'{k} {v}' for k, v in sorted(res.by_kind.items()))}")
    print(f"  by status: {', '.join(f'{k} {v}' for k, v in sorted(res.by_status.items()))}")
    for e in res.examples:
        print(f"  example: {e}")
    print(
        f"{res.requests} requests in {res.wall_s:.0f} s; a valid request served after: {'yes' if res.valid_after else 'NO'}; "
        f"failures (>= 500, not 503): {res.failures}  hangs: {res.hangs}"
    )
    write_result(args.json, asdict(res))
    return 0 if res.failures == 0 and res.hangs == 0 and res.valid_after else 1
