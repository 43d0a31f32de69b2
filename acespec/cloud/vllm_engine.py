"""The vLLM verify engine: `acespec serve --engine vllm --target HF_DIR`.

Past one box, targets run on vLLM (tensor/pipeline parallelism, paged KV, continuous batching,
prefix caching). This engine puts AceSpec's protocol in front of an in-process `AsyncLLM`; vLLM's own
scheduler batches every session's requests, so many sessions are in flight at once and this module
only turns a draft block into one vLLM request and its answer back into a verdict:

- **verify**: one request whose prompt is the committed prefix plus the draft, `max_tokens=1`,
  `prompt_logprobs=K` for the rows after each prefix/draft token and `logprobs=K` for the bonus row.
  The rule then runs on those top-K rows (`verify/topk.py` says when that is exact and bounds the
  rest); the rules, rng and stale-block drops stay in `TargetVerifier`, as on every engine.
- **the prefix cache**: a request with `prompt_logprobs` skips the cache by default and recomputes the
  whole prefix. Reading it (`skip_reading_prefix_cache=False`) is what makes a verify cost about a
  decode step, but vLLM computes no row for a cached position: `prompt_logprobs[i]` is valid only for
  i > `num_cached_tokens`. The row this engine needs first is C (after the last committed token), so a
  request whose cache hit reached C is sent again without the cache read. Within one session that
  cannot happen (the last committed token was never in an earlier request's prompt); it can when
  another session or a rolled-back one already computed the same tokens.
- **cloud-only**: greedy sessions are one ordinary streaming request; sampled ones take one k = 0
  verify per token, so the coupled rule's shared-seed draw (not vLLM's sampler) picks each token.

Only the prompt's token ids cross into vLLM (`skip_tokenizer_init`); the tokenizer that defines the
session's fingerprint is loaded here from the same directory.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from acespec.cloud.engine import EngineRefused, EngineSession, EngineStopped, SessionSpec, VerifyEngine
from acespec.engine.verifier import Verdict
from acespec.models.base import ModelError, Tokenizer
from acespec.verify.topk import TopKRuleError, dense_logits, tail_mass_bound, topk_exactness

log = logging.getLogger("acespec.vllm")

TAIL_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # per-row tail-mass bound histogram (upper edges)


@dataclass
class VllmConfig:
    model: str  # a Hugging Face model directory (`acespec models export-hf` writes one from a registry GGUF)
    n_ctx: int = 4096  # tokens one session may hold, prompt + output (vLLM's max_model_len)
    logprobs: int = 20  # K: target tokens returned per position; far more is slow (the full vocabulary took >100 s a request)
    max_sessions: int = 64  # requests vLLM schedules at once (max_num_seqs)
    block_size: int | None = None  # KV block in tokens; None: 32 on CPU (it must be a multiple of 32 there), vLLM's own on GPU
    dtype: str = "auto"  # auto: float32 on CPU (bf16 is 5-10x slower without AVX512-BF16), the checkpoint's dtype on GPU
    cpu_kv_gib: float = 1.0  # CPU only: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)
    memory_utilization: float | None = None  # share of GPU memory (on CPU: of the NUMA node's) vLLM may take; None: 0.9 GPU, 0.3 CPU
    tensor_parallel_size: int = 1  # GPUs one replica spans
    enforce_eager: bool | None = None  # skip graph capture/compilation; None: on CPU (start-up in seconds), off on GPU


@dataclass(frozen=True)
class TargetInfo:
    """What the protocol needs to know of the target without running it: its tokenizer (the fingerprint
    every edge must match), vocabulary and context."""

    name: str
    vocab_size: int
    n_ctx: int
    tokenizer: Tokenizer


def load_target_info(model_dir: str | Path, n_ctx: int) -> TargetInfo:
    """Read config.json and the tokenizer of a Hugging Face model directory (no weights)."""
    from acespec.models.hf import _TOKENIZER_FILES, HFTokenizer, _IdTokenizer

    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{path} is not a Hugging Face model directory (no config.json); the vLLM engine needs one "
                         "(`acespec models export-hf NAME DIR` writes one from a registry model)")
    cfg = json.loads(cfg_file.read_text())
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)
    if vocab <= 0:
        raise ModelError(f"{cfg_file} names no vocab_size")
    ctx = int(cfg.get("max_position_embeddings") or n_ctx)
    if n_ctx > ctx:
        raise ModelError(f"--n-ctx {n_ctx} exceeds the model's {ctx} positions")
    has_tok = any((path / f).is_file() for f in _TOKENIZER_FILES)
    if has_tok:
        import transformers

        tok: Tokenizer = HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(path)), vocab_size=vocab)
    else:  # a bare checkpoint (the tests' random models): token i is <i>
        tok = _IdTokenizer(vocab)
    return TargetInfo(path.name, vocab, n_ctx, tok)


@dataclass(eq=False)
class _Session(EngineSession):
    spec: SessionSpec = None  # type: ignore[assignment]
    exactness: str = "exact"  # exact | bounded (see verify/topk.py)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time, in arrival order
    closed: bool = False
    tail_max: float = 0.0  # largest per-row bound on the target mass outside the rows used
    tail_sum: float = 0.0
    rows: int = 0
    stream: object = None  # cloud-only greedy: the open vLLM stream (an async generator)
    stream_at: int = -1  # committed length the stream's next token follows
    streamed: deque = field(default_factory=deque)  # tokens the stream delivered ahead of step()

    def report(self) -> dict:
        return {"exactness": self.exactness, "rows": self.rows, "tail_mass_max": self.tail_max,
                "tail_mass_mean": self.tail_sum / self.rows if self.rows else 0.0}


class VllmEngine(VerifyEngine):
    name = "vllm"

    def __init__(self, cfg: VllmConfig) -> None:
        if not 1 <= cfg.logprobs <= 20:
            raise ValueError(f"logprobs must be in 1..20 (vLLM slows sharply past that), got {cfg.logprobs}")
        self.cfg = cfg
        self.target = load_target_info(cfg.model, cfg.n_ctx)
        self._llm = None
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._live: set[_Session] = set()
        self.verdicts = 0
        self.requests = 0  # vLLM requests sent
        self.resubmits = 0  # verify requests sent again because the prefix cache covered a needed row
        self.prompt_tokens = 0  # prompt tokens sent
        self.cached_tokens = 0  # of which vLLM's prefix cache served
        self.streamed_tokens = 0  # cloud-only tokens from streaming requests
        self.tail_counts = [0] * len(TAIL_BUCKETS)
        self.tail_max = 0.0
        self.tail_sum = 0.0

    @property
    def max_context(self) -> int:
        return self.cfg.n_ctx

    # -- life cycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._llm is not None:
            return
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ModelError("the vLLM engine needs vLLM: run `scripts/setup.sh vllm` and serve from .venv-vllm") from e
        cpu = current_platform.is_cpu()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.cfg.cpu_kv_gib:g}")
        c = self.cfg
        args = AsyncEngineArgs(
            model=c.model, skip_tokenizer_init=True, max_model_len=c.n_ctx, max_logprobs=c.logprobs,
            enable_prefix_caching=True, max_num_seqs=c.max_sessions, tensor_parallel_size=c.tensor_parallel_size,
            dtype=("float32" if cpu else "auto") if c.dtype == "auto" else c.dtype,
            block_size=c.block_size or (32 if cpu else None),
            gpu_memory_utilization=c.memory_utilization or (0.3 if cpu else 0.9),
            enforce_eager=cpu if c.enforce_eager is None else c.enforce_eager,
        )
        t0 = time.perf_counter()
        self._llm = AsyncLLM.from_engine_args(args)
        await self._generate([0, 0], self._params(0, skip_cache=True))  # first request pays one-off set-up
        log.info("vLLM engine up in %.1f s (%s)", time.perf_counter() - t0, "cpu" if cpu else "gpu")

    async def stop(self) -> None:
        for s in list(self._live):
            self.close(s)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()

    # -- sessions -----------------------------------------------------------------------------------
    async def open(self, spec: SessionSpec) -> EngineSession:
        try:
            exactness = topk_exactness(spec.rule, spec.sampling, self.cfg.logprobs)
        except TopKRuleError as e:
            raise EngineRefused(str(e)) from None
        s = _Session(next(self._ids), self._make_verifier(spec), spec=spec, exactness=exactness)
        self._live.add(s)
        if len(spec.prompt) > 1:
            # put the prompt in the prefix cache while the edge drafts; all but its last token, so the
            # first verify still computes the row after it (see the module docstring)
            async with s.lock:
                await self._generate(list(spec.prompt[:-1]), self._params(0, skip_cache=False, logprobs=False))
        return s

    def close(self, s) -> None:
        s.closed = True
        self._live.discard(s)
        self._drop_stream(s)
        if s.rows:
            log.info("session %d: %s", s.id, s.report())

    def session_report(self, s) -> dict:
        """Per-session statistics: how exact its verdicts are (see verify/topk.py)."""
        return s.report()

    async def rollback(self, s, n: int) -> None:
        async with self._turn(s):
            self._drop_stream(s)
            s.verifier.rollback(n)

    async def verify(self, s, seq, base, tokens, q) -> Verdict:
        async with self._turn(s):
            v = s.verifier
            job = v.prepare(seq, base, tokens, q)
            if isinstance(job, Verdict):
                self.verdicts += 1
                return job
            t0 = time.perf_counter()
            rows = await self._rows(s, v.tokens, job.draft.tolist())
            self.verdicts += 1
            return v.finish(job, rows, time.perf_counter() - t0)

    async def step(self, s) -> Verdict:
        async with self._turn(s):
            v = s.verifier
            job = v.prepare(0, v.committed, [])
            if isinstance(job, Verdict):
                self.verdicts += 1
                return job
            t0 = time.perf_counter()
            if s.spec.sampling.greedy:
                row = np.full((1, self.target.vocab_size), -np.inf)
                row[0, await self._streamed_token(s)] = 0.0  # the stream's greedy token, as a one-hot row
            else:
                row = await self._rows(s, v.tokens, [])
            self.verdicts += 1
            return v.finish(job, row, time.perf_counter() - t0)

    # -- vLLM requests ------------------------------------------------------------------------------
    class _Turn:
        def __init__(self, s: _Session) -> None:
            self.s = s

        async def __aenter__(self):
            await self.s.lock.acquire()
            if self.s.closed:
                self.s.lock.release()
                raise EngineStopped(f"session {self.s.id} is closed")

        async def __aexit__(self, *exc) -> None:
            self.s.lock.release()

    def _turn(self, s: _Session) -> "_Turn":
        if self._llm is None:
            raise EngineStopped("the vLLM engine is not running")
        return self._Turn(s)

    def _params(self, k: int, *, skip_cache: bool, logprobs: bool = True, top: int | None = None, **kw):
        """vLLM sampling params for a request of k draft tokens; `top`: tokens per row (default K)."""
        from vllm import SamplingParams as VSP

        K = top or self.cfg.logprobs
        return VSP(max_tokens=kw.pop("max_tokens", 1), temperature=0.0, detokenize=False, ignore_eos=True,
                   logprobs=K if logprobs else None, prompt_logprobs=K if (logprobs and k) else None,
                   skip_reading_prefix_cache=skip_cache, **kw)

    async def _generate(self, ids: list[int], params):
        out = None
        async for o in self._llm.generate({"prompt_token_ids": ids}, params, request_id=f"acespec-{next(self._rids)}"):
            out = o
        self.requests += 1
        self.prompt_tokens += len(ids)
        self.cached_tokens += int(out.num_cached_tokens or 0)
        return out

    async def _rows(self, s: _Session, prefix: list[int], draft: list[int]) -> np.ndarray:
        """The target's rows [k+1, V] after prefix[-1] and after each draft token, from top-K logprobs."""
        C, k = len(prefix), len(draft)
        ids = prefix + draft
        # greedy sampling reads only the argmax of each row: one token per row is enough, and every
        # logprob vLLM returns is a Python object built per position, which costs more than the model
        # on a small target
        top = 1 if s.spec.sampling.greedy else self.cfg.logprobs
        out = await self._generate(ids, self._params(k, skip_cache=False, top=top))
        if k and (out.num_cached_tokens or 0) >= C:
            self.resubmits += 1  # the cache served the position whose row we need: compute it
            out = await self._generate(ids, self._params(k, skip_cache=True, top=top))
        entries = [out.prompt_logprobs[C + i] for i in range(k)] + [out.outputs[0].logprobs[0]]
        V, K, T = self.target.vocab_size, self.cfg.logprobs, s.spec.sampling.temperature
        rows = np.empty((k + 1, V))
        for i, e in enumerate(entries):
            lp = {int(t): float(x.logprob) for t, x in e.items()}
            rows[i] = dense_logits(lp, V)
            if s.exactness == "bounded":
                floor = min(float(x.logprob) for x in e.values() if x.rank is not None and x.rank <= K)
                b = tail_mass_bound(np.fromiter(lp.values(), float), V, T, floor=floor)
                s.tail_max, s.tail_sum, s.rows = max(s.tail_max, b), s.tail_sum + b, s.rows + 1
                self.tail_max, self.tail_sum = max(self.tail_max, b), self.tail_sum + b
                self.tail_counts[next(j for j, edge in enumerate(TAIL_BUCKETS) if b <= edge)] += 1
            else:
                s.rows += 1
        return rows

    async def _streamed_token(self, s: _Session) -> int:
        """The next token of the session's greedy streaming request, (re)opened at its committed length."""
        from vllm.sampling_params import RequestOutputKind

        v = s.verifier
        if s.stream is None or s.stream_at != v.committed:
            self._drop_stream(s)
            left = v.prompt_len + v.max_tokens - v.committed
            params = self._params(0, skip_cache=False, logprobs=False, max_tokens=left,
                                  stop_token_ids=sorted(v.stop_ids), output_kind=RequestOutputKind.DELTA)
            s.stream = self._llm.generate({"prompt_token_ids": list(v.tokens)}, params, request_id=f"acespec-{next(self._rids)}")
            s.stream_at = v.committed
            self.requests += 1
            self.prompt_tokens += v.committed
        while not s.streamed:
            try:
                o = await s.stream.__anext__()
            except StopAsyncIteration:
                raise RuntimeError(f"session {s.id}: vLLM ended the stream before the session did") from None
            s.streamed.extend(int(t) for t in o.outputs[0].token_ids)
        s.stream_at += 1
        self.streamed_tokens += 1
        return s.streamed.popleft()

    def _drop_stream(self, s: _Session) -> None:
        if s.stream is not None:
            gen, s.stream = s.stream, None
            s.streamed.clear()
            # closing the generator aborts its vLLM request
            try:
                asyncio.get_running_loop().create_task(gen.aclose())
            except RuntimeError:  # no loop (shutdown): the engine's stop() ends every request
                pass

    def metrics(self) -> dict:
        return {
            "engine": self.name, "verdicts": self.verdicts, "slots": self.cfg.max_sessions, "sessions": len(self._live),
            "requests": self.requests, "resubmits": self.resubmits, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "streamed_tokens": self.streamed_tokens, "logprobs_k": self.cfg.logprobs,
            "tail_mass_max": self.tail_max, "tail_mass_sum": self.tail_sum, "tail_buckets": list(zip(TAIL_BUCKETS, self.tail_counts)),
        }
