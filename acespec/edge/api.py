"""The edge's OpenAI-compatible HTTP API (FastAPI on uvicorn): `acespec edge serve`.

    POST /v1/chat/completions, /v1/completions   (streaming with "stream": true: server-sent events)
    GET  /v1/models, /health, /metrics (Prometheus), /  (the live web page)

Requests speak OpenAI's schema (`edge/schema.py`: `model`, `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`,
`seed`, `stop`, `n` = 1, `stream`, `stream_options.include_usage`, and `logprobs` / `top_logprobs` in the
streaming modes, see `edge/logprobs.py`); AceSpec's own choices ride in extra body fields, as vLLM's do:
`rule` (e.g. coupled, strict, cactus:delta=0.35), `k`, `top_k`, `mode` (auto, the default; acespec,
pipelined, sync, cloud-only, cloud-led) and `marks` (stream every token's text and origin and the round's
K, RTT and acceptance under `acespec` in each chunk; the web page asks for it). What a request
leaves out takes the value the server was started with. `usage` adds `accepted_tokens`,
`drafted_tokens`, `target_passes`, `cache_hits` and `cache_lookups` to OpenAI's token counts.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 422 for a body that
does not fit the schema (or is not JSON), 400 for values the edge cannot serve (n > 1, a bad rule,
a prompt past the context, `logprobs` in an edge-led mode, `tools`, a `response_format` other than text), 404 for an unknown model or path, 503 when the drafter queue is full or
the cloud cannot be reached. A streaming request's errors before its first token come back the same
way (the response starts only with the first token); a failure later ends the stream with an `error`
event. A client that goes away stops its generation and closes its cloud session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from acespec import wire
from acespec.draft.prediction import prediction_usage
from acespec.edge.client import EdgeError
from acespec.edge.logprobs import LogprobLog
from acespec.edge.metrics import EdgeMetrics
from acespec.edge.runtime import STREAMING_MODES
from acespec.edge.schema import UNSUPPORTED, ChatBody, CompletionBody, RequestBody
from acespec.edge.service import (
    MAX_STOP,
    ApiError,
    ApiGeneration,
    Done,
    DrafterPool,
    FirstTokens,
    GenRequest,
    ServeConfig,
    TextAssembler,
    edge_config_for,
    edge_error_to_api,
    new_seed,
)
from acespec.loop.backoff import BackoffMemory
from acespec.loop.contention import ContentionGuard
from acespec.loop.loop import Round
from acespec.models.base import Model, ModelError
from acespec.verify import RuleSpec, RuleSpecError

DISCONNECT_POLL_S = 0.25  # how often a request that is not streaming yet checks that its client is still there


# ------------------------------------------------------------------------------------------ service
class EdgeService:
    """What the routes share: the drafters (as a queue), the defaults, the metrics."""

    def __init__(self, drafters: list[Model], cfg: ServeConfig) -> None:
        if not drafters:
            raise ValueError("the edge needs at least one drafter")
        self.cfg = cfg
        self.tokenizer = drafters[0].tokenizer
        self.model_id = self.tokenizer.fingerprint
        self.n_ctx = drafters[0].n_ctx
        self.vocab_size = drafters[0].vocab_size
        self.slots = min(d.n_slots for d in drafters)
        self.pool = DrafterPool(drafters, cfg.max_waiting)
        self.first_tokens = FirstTokens()  # auto streams lend no drafter while another waits for its first token
        # whether drafting slows the cloud (shared cores), learned once for every auto request
        self.contention = ContentionGuard.watching_cores(getattr(drafters[0], "n_threads", 1))
        self.backoff = BackoffMemory()  # whether the cloud verifies our drafts, and the drafter's prefill speed
        self.metrics = EdgeMetrics(len(drafters), self.pool)
        self.started = int(time.time())

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (from any thread but the event loop's) until no generation runs; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.metrics.running:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def request(self, body: RequestBody, prompt: list[int]) -> GenRequest:
        """Check a request against what this edge can serve; ApiError says why not."""
        if body.model != self.cfg.served_model:
            raise ApiError(
                404,
                f"The model `{body.model}` does not exist; this edge serves `{self.cfg.served_model}`.",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise ApiError(400, "only n = 1 is supported", param="n")
        for name, neutral in UNSUPPORTED.items():
            if (body.model_extra or {}).get(name) not in neutral:
                raise ApiError(400, f"`{name}` is not supported by this edge", param=name)
        fmt = (body.model_extra or {}).get("response_format")
        if fmt not in (None, {"type": "text"}):
            # a constrained format is lossless only if the drafter and the target are constrained by one
            # grammar; the wire carries none yet, and an unconstrained answer would pass for a constrained one
            raise ApiError(
                400,
                '`response_format` other than {"type": "text"} is not supported: this edge cannot '
                "constrain the cloud's target and its own drafter to one grammar, and will not return "
                "unconstrained text in its place",
                param="response_format",
            )
        if not prompt:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{self.vocab_size - 1}", param="prompt")
        d = self.cfg.defaults
        max_tokens = body.max_tokens or body.max_completion_tokens or d.max_tokens
        # the wire bounds a session too: its HELLO carries the prompt, and a session reopened after a
        # failover carries the prompt and everything generated
        n_ctx = min(self.n_ctx, wire.Limits().max_prompt_tokens)
        if len(prompt) + max_tokens > n_ctx:
            raise ApiError(
                400,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds this edge's context "
                f"of {n_ctx} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP:
            raise ApiError(400, f"at most {MAX_STOP} stop strings", param="stop")
        mode = body.mode or self.cfg.default_mode
        logprobs = body.logprobs_asked()
        if logprobs and mode not in STREAMING_MODES:
            raise ApiError(
                400,
                f"logprobs come from the cloud's token stream: ask in a streaming mode ({', '.join(STREAMING_MODES)}),"
                f" not {mode}",
                param="logprobs",
            )
        seed = body.seed if body.seed is not None else self.cfg.seed if self.cfg.seed is not None else new_seed()
        try:
            rule = str(RuleSpec.parse(body.rule)) if body.rule is not None else None
            cfg = edge_config_for(
                d,
                mode,
                rule=rule,
                k=body.k,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=seed,
                max_tokens=max_tokens,
                logprobs=logprobs,
            )
        except (RuleSpecError, ValueError) as e:
            raise ApiError(400, str(e), param="rule" if isinstance(e, RuleSpecError) else None) from None
        if body.prediction is not None:
            content = body.prediction.content
            if isinstance(content, list):  # content parts: text only, as in messages
                if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, "only text content parts are supported", param="prediction.content")
                content = "".join(p["text"] for p in content)
            pred = self.tokenizer.encode(content)
            if len(pred) > self.n_ctx:
                raise ApiError(
                    400, f"the prediction ({len(pred)} tokens) is longer than this edge's context", param="prediction"
                )
            cfg = dataclasses.replace(cfg, prediction=tuple(pred))
        if cfg.cache and self.slots < 2:
            raise ApiError(
                400, f"mode {mode} uses the state cache, which needs a drafter with forks (n_slots > 1)", param="mode"
            )
        return GenRequest(prompt=prompt, cfg=cfg, mode=mode, stop=stop, marks=body.marks)

    def chat_prompt(self, body: ChatBody) -> list[int]:
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content or ""
            if isinstance(content, list):  # content parts: text only
                if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, "only text content parts are supported", param=f"messages.{i}.content")
                content = "".join(p["text"] for p in content)
            messages.append({"role": m.role, "content": content})
        try:
            return self.tokenizer.chat_prompt(messages)
        except (ModelError, ValueError, KeyError) as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None

    def completion_prompt(self, body: CompletionBody) -> list[int]:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "one prompt per request (n = 1)", param="prompt")
            p = p[0]
        return self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]  # token ids


# ------------------------------------------------------------------------------------------ responses
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Answer:
    """Turns a generation's rounds into OpenAI's chat or completion objects."""

    def __init__(self, svc: EdgeService, req: GenRequest, chat: bool) -> None:
        self.svc, self.req, self.chat = svc, req, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.text = TextAssembler(svc.tokenizer, req.stop)
        self.lp = LogprobLog(svc.tokenizer, chat=chat) if req.cfg.logprobs else None
        self.done: Done | None = None

    def feed(self, r: Round) -> list[tuple[str, str]]:
        """A round's text pieces (its logprobs wait for `logprobs`)."""
        if self.lp is not None and not self.text.stopped:
            self.lp.take(r.tokens, r.logprobs)
        return self.text.feed(r.tokens, r.origins)

    def logprobs(self) -> dict | None:
        """The logprobs not sent yet, up to the token that completed a stop string."""
        return None if self.lp is None else self.lp.pop(self.text.stopped_at)

    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        res = self.done.result if self.done is not None else None
        return "length" if res is not None and len(res.tokens) >= self.req.cfg.max_tokens else "stop"

    def usage(self) -> dict:
        res = self.done.result if self.done is not None else None
        s = res.stats if res is not None else None
        completion = (
            self.text.stopped_at
            if self.text.stopped_at is not None
            else (len(res.tokens) if res is not None else self.text.tokens)
        )
        return {
            "prompt_tokens": len(self.req.prompt),
            "completion_tokens": completion,
            "total_tokens": len(self.req.prompt) + completion,
            "accepted_tokens": s.accepted if s else 0,
            "drafted_tokens": s.drafted if s else 0,
            "target_passes": s.rounds if s else 0,
            "cache_hits": s.cache.get("hits", 0) if s else 0,
            "cache_lookups": s.cache.get("lookups", 0) if s else 0,
        } | self._prediction_usage(res)

    def _prediction_usage(self, res) -> dict:
        pred = self.req.cfg.prediction
        if not pred:
            return {}
        accepted, rejected = prediction_usage(pred, res.tokens if res is not None else [])
        return {
            "completion_tokens_details": {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": rejected,
            }
        }

    def _choice(
        self, text: str | None, finish: str | None, *, delta: bool, first: bool = False, logprobs: dict | None = None
    ) -> dict:
        c: dict = {"index": 0}
        if not self.chat:
            c["text"] = text or ""
        elif delta:
            c["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
        else:
            c["message"] = {"role": "assistant", "content": text}
        c["logprobs"] = logprobs
        c["finish_reason"] = finish
        return c

    def _obj(self, choices: list, *, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.svc.cfg.served_model,
            "choices": choices,
        }

    def chunk(self, pieces: list[tuple[str, str]], r: Round | None, *, first: bool = False, logprobs=None) -> dict:
        text = "".join(t for t, _ in pieces)
        obj = self._obj([self._choice(text, None, delta=True, first=first, logprobs=logprobs)], chunk=True)
        if self.req.marks and r is not None:
            obj["acespec"] = {
                "tokens": [[t, o] for t, o in pieces],
                "n": len(r.tokens),
                "k": r.drafted,
                "accepted": r.accepted,
                "rtt_ms": None if r.rtt_s is None else round(r.rtt_s * 1e3, 3),
                "latency_ms": None if r.latency_s is None else round(r.latency_s * 1e3, 3),
            }
        return obj

    def last_chunks(self, tail: list[tuple[str, str]], include_usage: bool) -> list[dict]:
        lps = self.logprobs()
        out = [self.chunk(tail, None, logprobs=lps)] if tail or lps else []
        out.append(self._obj([self._choice(None if self.chat else "", self.finish_reason(), delta=True)], chunk=True))
        if include_usage:
            out.append(self._obj([], chunk=True) | {"usage": self.usage()})
        return out

    def whole(self, text: str) -> dict:
        choice = self._choice(text, self.finish_reason(), delta=False, logprobs=self.logprobs())
        return self._obj([choice], chunk=False) | {"usage": self.usage()}


def _failure(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EdgeError):
        return edge_error_to_api(e)
    if isinstance(e, (ModelError, ValueError)):
        return ApiError(400, str(e))
    return ApiError(500, f"the edge failed: {type(e).__name__}: {e}", type="internal_error")


class _ClientGone(Exception):
    pass


async def _unless_gone(request: Request, aw):
    """Await `aw`, giving up (and cancelling it) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone
    finally:
        task.cancel()


# ------------------------------------------------------------------------------------------ the app
def create_app(svc: EdgeService) -> FastAPI:
    app = FastAPI(title="AceSpec edge", docs_url=None, redoc_url=None)  # the schema at /openapi.json, as vLLM's server
    app.state.svc = svc
    m: EdgeMetrics = svc.metrics

    def error(e: ApiError) -> JSONResponse:
        m.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(
            f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
            for err in e.errors()[:5]
        )
        return error(ApiError(422, msg or "invalid request", param=".".join(loc) or None, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.get("/health")
    async def health():
        return {"status": "ok", "drafters": svc.pool.size, "drafters_busy": svc.pool.busy, "waiting": svc.pool.waiting}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": svc.cfg.served_model,
                    "object": "model",
                    "created": svc.started,
                    "owned_by": "acespec",
                    "max_model_len": svc.n_ctx,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(_static("index.html"))

    @app.get("/static/{name}")
    async def static(name: str):
        types = {".js": "text/javascript", ".css": "text/css"}
        kind = next((t for ext, t in types.items() if name.endswith(ext)), None)
        if kind is None or "/" in name or name.startswith("."):
            raise StarletteHTTPException(404, "no such file")
        try:
            return Response(_static(name), media_type=kind)
        except FileNotFoundError:
            raise StarletteHTTPException(404, "no such file") from None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        return await _serve(request, body, svc.request(body, svc.chat_prompt(body)), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await _serve(request, body, svc.request(body, svc.completion_prompt(body)), chat=False)

    async def _serve(request: Request, body: RequestBody, req: GenRequest, *, chat: bool):
        gen = ApiGeneration(svc, req)
        ans = _Answer(svc, req, chat)
        try:
            await _unless_gone(request, gen.start())  # a full queue raises 503 here
            first = await _unless_gone(request, gen.events.get())  # errors before the first token keep their status
        except _ClientGone:
            gen.stop.set()
            m.request_ended("abort", len(req.prompt))
            return Response(status_code=499)
        if isinstance(first, Done) and first.error is not None:
            return error(_failure(first.error))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(gen, ans, first, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        pieces: list[tuple[str, str]] = []
        ev = first
        try:
            while True:
                if isinstance(ev, Done):
                    ans.done = ev
                    break
                pieces += ans.feed(ev)
                if ans.text.stopped:
                    gen.stop.set()
                ev = await _unless_gone(request, gen.events.get())
        except _ClientGone:
            gen.stop.set()
            m.request_ended("abort", len(req.prompt))
            return Response(status_code=499)
        if ans.done.error is not None:
            return error(_failure(ans.done.error))
        pieces += ans.text.finish()
        m.request_ended(ans.finish_reason(), len(req.prompt))
        return JSONResponse(ans.whole("".join(t for t, _ in pieces)))

    async def _stream(gen: ApiGeneration, ans: _Answer, first, include_usage: bool):
        ended = False
        try:
            if ans.chat:
                yield _sse(ans.chunk([], None, first=True))
            ev = first
            while not isinstance(ev, Done):
                pieces = ans.feed(ev)
                if ans.text.stopped:
                    gen.stop.set()
                lps = ans.logprobs()
                if pieces or ans.req.marks or lps:
                    yield _sse(ans.chunk(pieces, ev, logprobs=lps))
                ev = await gen.events.get()
            ans.done = ev
            if ev.error is not None:
                failure = _failure(ev.error)
                m.errors.labels(str(failure.status)).inc()
                yield _sse(failure.body())
            else:
                for c in ans.last_chunks(ans.text.finish(), include_usage):
                    yield _sse(c)
                m.request_ended(ans.finish_reason(), len(ans.req.prompt))
            ended = True
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away mid-stream: stop the run, which closes its cloud session
                gen.stop.set()
                m.request_ended("abort", len(ans.req.prompt))

    return app


def _static(name: str) -> str:
    return resources.files("acespec.edge").joinpath("static", name).read_text("utf-8")


# ------------------------------------------------------------------------------------------ running it
class EdgeApiThread:
    """uvicorn serving the app on its own thread (tests, benchmarks); `port` is known once started."""

    def __init__(self, svc: EdgeService) -> None:
        import uvicorn  # heavy: the HTTP server only

        self.svc = svc
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(svc), host=svc.cfg.host, port=svc.cfg.port, log_level="warning", lifespan="off")
        )
        self._thread = threading.Thread(target=self.server.run, daemon=True, name="acespec-edge-api")

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.svc.cfg.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> EdgeApiThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the edge API did not start")
            time.sleep(0.01)
        self._port = self.server.servers[0].sockets[0].getsockname()[1]  # known once bound (port 0 = any)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)

    def __enter__(self) -> EdgeApiThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
