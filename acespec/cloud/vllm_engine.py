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
- **cloud-led, natively** (`lead_k` > 0): a cloud-led session under greedy decoding, or under `strict`
  at any temperature, is one streaming request, and vLLM's own speculative decoding verifies the
  edge's drafts inside it: the engine runs with vLLM's `custom_class` method and AceSpec's proposer
  (`cloud/vllm_proposer.py`), which reads each session's drafts from a board in shared memory
  (`cloud/vllm_board.py`) that the server writes as DRAFTs arrive. vLLM's rejection sampler works on
  full rows, so this is exact at every temperature with no top-K truncation. A relaxed rule runs there
  too, decided by AceSpec's plugin; one that needs the drafter's q gets the sparse q rows the edge sent
  with its drafts (the board keeps `lead_q_topn` entries per token, the proposer hands the proposed
  tokens' rows to the plugin in the same worker). Coupled at temperature > 0 runs as verify requests,
  as edge-led blocks do.

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
from typing import Any

import numpy as np

from acespec.cloud.engine_api import EngineRefused, EngineSession, EngineStopped, SessionSpec, VerifyEngine
from acespec.cloud.vllm_board import CONFIG_KEY, BoardShape, SharedBoard
from acespec.cloud.vllm_plugin import RULE_ARG
from acespec.loop.verifier import BlockVerdict
from acespec.models.base import ModelError, Tokenizer
from acespec.models.hf import TOKENIZER_FILES, HFTokenizer, _IdTokenizer
from acespec.verify.topk import TopKRuleError, dense_logits, tail_mass_bound, topk_exactness

log = logging.getLogger("acespec.vllm")

TAIL_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # per-row tail-mass bound histogram (upper edges)


@dataclass
class VllmConfig:
    model: str  # a Hugging Face model directory (`acespec models export-hf` writes one from a registry GGUF)
    n_ctx: int = 4096  # tokens one session may hold, prompt + output (vLLM's max_model_len)
    logprobs: int = (
        20  # K: target tokens returned per position; far more is slow (the full vocabulary took >100 s a request)
    )
    max_sessions: int = 64  # requests vLLM schedules at once (max_num_seqs)
    block_size: int | None = (
        None  # KV block in tokens; None: 32 on CPU (it must be a multiple of 32 there), vLLM's own on GPU
    )
    dtype: str = (
        "auto"  # auto: float32 on CPU (bf16 is 5-10x slower without AVX512-BF16), the checkpoint's dtype on GPU
    )
    cpu_kv_gib: float = 1.0  # CPU only: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)
    memory_utilization: float | None = (
        None  # share of GPU memory (on CPU: of the NUMA node's) vLLM may take; None: 0.9 GPU, 0.3 CPU
    )
    tensor_parallel_size: int = 1  # GPUs one replica spans
    enforce_eager: bool | None = None  # skip graph capture/compilation; None: on CPU (start-up in seconds), off on GPU
    lead_k: int = 0  # >0: cloud-led sessions run in vLLM's own speculative decoding, verifying up to this many edge-draft tokens a step
    lead_price: bool = True  # the proposer prices each session's depth from what its drafts earn (off: propose all that agrees, up to lead_k)
    lead_q_topn: int = 32  # q entries per draft token the board keeps, for cloud-led rules that need q (0: those run as verify requests)


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
    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(
            f"{path} is not a Hugging Face model directory (no config.json); the vLLM engine needs one "
            "(`acespec models export-hf NAME DIR` writes one from a registry model)"
        )
    cfg = json.loads(cfg_file.read_text())
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)
    if vocab <= 0:
        raise ModelError(f"{cfg_file} names no vocab_size")
    ctx = int(cfg.get("max_position_embeddings") or n_ctx)
    if n_ctx > ctx:
        raise ModelError(f"--n-ctx {n_ctx} exceeds the model's {ctx} positions")
    has_tok = any((path / f).is_file() for f in TOKENIZER_FILES)
    if has_tok:
        import transformers  # heavy: the hf extra

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
    native: bool = False  # cloud-led inside vLLM's speculative decoding (see the module docstring)
    slot: int | None = None  # native: its slot on the shared draft board
    counted: tuple[int, int] = (0, 0)  # native: the board's (proposed, accepted) counters at the last step
    stream: Any = None  # cloud-only greedy, native cloud-led: the open vLLM stream (an async generator)
    stream_at: int = -1  # committed length the stream's next token follows
    streamed: deque = field(default_factory=deque)  # tokens the stream delivered ahead of step()

    def report(self) -> dict:
        return {
            "exactness": self.exactness,
            "rows": self.rows,
            "tail_mass_max": self.tail_max,
            "tail_mass_mean": self.tail_sum / self.rows if self.rows else 0.0,
        }


class VllmEngine(VerifyEngine):
    name = "vllm"

    def __init__(self, cfg: VllmConfig) -> None:
        if not 1 <= cfg.logprobs <= 20:
            raise ValueError(f"logprobs must be in 1..20 (vLLM slows sharply past that), got {cfg.logprobs}")
        self.cfg = cfg
        # what the server reads of a target (tokenizer, vocabulary, fingerprint, context), not a Model that decodes
        self.target = load_target_info(cfg.model, cfg.n_ctx)  # type: ignore[assignment]
        self._llm: Any = None  # vLLM's AsyncLLM, made at start (vLLM is imported there)
        self._board: SharedBoard | None = None  # lead_k > 0: the shared draft board (created at start)
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._live: set[_Session] = set()
        self.verdicts = 0
        self.requests = 0  # vLLM requests sent
        self.resubmits = 0  # verify requests sent again because the prefix cache covered a needed row
        self.prompt_tokens = 0  # prompt tokens sent
        self.cached_tokens = 0  # of which vLLM's prefix cache served
        self.streamed_tokens = 0  # cloud-only tokens from streaming requests
        self.lead_tokens = 0  # tokens of native cloud-led sessions (what vLLM proposed and kept: _lead_totals)
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
            from vllm.engine.arg_utils import AsyncEngineArgs  # heavy: the vllm extra
            from vllm.platforms import current_platform  # heavy: the vllm extra
            from vllm.v1.engine.async_llm import AsyncLLM  # heavy: the vllm extra
        except ImportError as e:
            raise ModelError("the vLLM engine needs vLLM: run `scripts/setup.sh vllm` and serve from .venv-vllm") from e
        cpu = current_platform.is_cpu()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.cfg.cpu_kv_gib:g}")
        c = self.cfg
        lead = {}
        if c.lead_k > 0:
            board = self._board = SharedBoard(BoardShape(slots=c.max_sessions, q_topn=c.lead_q_topn))
            lead = dict(
                speculative_config={
                    "method": "custom_class",
                    "model": "acespec.cloud.vllm_proposer.EdgeDraftProposer",
                    "num_speculative_tokens": c.lead_k,
                },
                additional_config={CONFIG_KEY: {**board.shape.as_config(board.name), "price": c.lead_price}},
            )
        args = AsyncEngineArgs(
            model=c.model,
            skip_tokenizer_init=True,
            max_model_len=c.n_ctx,
            max_logprobs=c.logprobs,
            enable_prefix_caching=True,
            max_num_seqs=c.max_sessions,
            tensor_parallel_size=c.tensor_parallel_size,
            dtype=("float32" if cpu else "auto") if c.dtype == "auto" else c.dtype,
            block_size=c.block_size or (32 if cpu else None),
            gpu_memory_utilization=c.memory_utilization or (0.3 if cpu else 0.9),
            enforce_eager=cpu if c.enforce_eager is None else c.enforce_eager,
            **lead,
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
        if self._board is not None:
            self._board.destroy()
            self._board = None

    # -- sessions -----------------------------------------------------------------------------------
    def _native(self, spec: SessionSpec) -> bool:
        """Whether vLLM's rejection sampler gives this session's law: greedy decoding (any lossless
        rule is the argmax there), `strict` at any temperature, or at temperature > 0 a relaxed rule,
        which AceSpec's plugin runs inside that sampler (`cloud/vllm_plugin.py`); a rule that needs the
        drafter's q rows gets those the edge sent, through the board (`lead_q_topn` > 0)."""
        r = spec.rule
        if spec.sampling.greedy:
            ok = r.name in ("greedy", "strict", "coupled")
        else:
            ok = r.name == "strict" or (
                r.name not in ("greedy", "coupled") and (not r.info.needs_q or self.lead_q_topn > 0)
            )
        return self._board is not None and spec.cloud_led and ok

    @property
    def lead_q_topn(self) -> int:
        """Most q entries per draft token a native cloud-led session may send (the board's room)."""
        return self._board.shape.q_topn if self._board is not None else 0

    async def open(self, spec: SessionSpec) -> EngineSession:
        slot = (
            self._board.assign(spec.prompt, self.cfg.lead_k) if self._board is not None and self._native(spec) else None
        )
        if slot is not None:
            s = _Session(next(self._ids), self._make_verifier(spec), spec=spec, native=True, slot=slot)
            self._live.add(s)
            return s  # its stream's first request prefills the prompt
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
        if s.slot is not None and self._board is not None:
            self._board.release(s.slot)
            s.slot = None
        if s.rows:
            log.info("session %d: %s", s.id, s.report())

    def session_report(self, s) -> dict:
        """Per-session statistics: how exact its verdicts are (see verify/topk.py)."""
        return s.report()

    async def rollback(self, s, n: int) -> None:
        async with self._turn(s):
            self._drop_stream(s)
            s.verifier.rollback(n)

    async def verify(self, s, seq, base, tokens, q) -> BlockVerdict:
        async with self._turn(s):
            v = s.verifier
            job = v.prepare(seq, base, tokens, q)
            if isinstance(job, BlockVerdict):
                self.verdicts += 1
                return job
            t0 = time.perf_counter()
            rows = await self._rows(s, v.tokens, job.draft.tolist())
            self.verdicts += 1
            return v.finish(job, rows, time.perf_counter() - t0)

    async def step(self, s) -> BlockVerdict:
        async with self._turn(s):
            v = s.verifier
            job = v.prepare(0, v.committed, [])
            if isinstance(job, BlockVerdict):
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

    # -- native cloud-led sessions -----------------------------------------------------------------
    def leads_natively(self, s) -> bool:
        return s.native

    def lead_publish(self, s, board) -> None:
        if s.slot is not None and self._board is not None:
            self._board.publish(s.slot, board.drafts)

    async def lead_step(self, s, board) -> BlockVerdict:
        async with self._turn(s):
            v = s.verifier
            t0 = time.perf_counter()
            chunk = await self._stream_chunk(s, lead=True)
            # what vLLM's steps behind this chunk proposed and kept, from the proposer's counters (they
            # lag one step: a proposal is accounted when the next step shows what it earned)
            c = (
                self._board.counters(s.slot)
                if s.slot is not None and self._board is not None
                else {"proposed": 0, "accepted": 0}
            )
            drafted, accepted = c["proposed"] - s.counted[0], c["accepted"] - s.counted[1]
            s.counted = (c["proposed"], c["accepted"])
            self.lead_tokens += len(chunk)
            self.verdicts += 1
            verdict = v.commit_decoded(chunk, time.perf_counter() - t0, drafted=drafted, accepted=accepted)
            board.usable(v.tokens, 0)  # forget the drafts the stream has passed or contradicted
            self.lead_publish(s, board)
            return verdict

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

    def _turn(self, s: _Session) -> _Turn:
        if self._llm is None:
            raise EngineStopped("the vLLM engine is not running")
        return self._Turn(s)

    def _params(self, k: int, *, skip_cache: bool, logprobs: bool = True, top: int | None = None, **kw):
        """vLLM sampling params for a request of k draft tokens; `top`: tokens per row (default K)."""
        from vllm import SamplingParams as VSP  # heavy: the vllm extra

        K = top or self.cfg.logprobs
        return VSP(
            max_tokens=kw.pop("max_tokens", 1),
            temperature=kw.pop("temperature", 0.0),
            detokenize=False,
            ignore_eos=True,
            logprobs=K if logprobs else None,
            prompt_logprobs=K if (logprobs and k) else None,
            skip_reading_prefix_cache=skip_cache,
            **kw,
        )

    async def _generate(self, ids: list[int], params):
        out: Any = None
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
        """The next token of the session's greedy streaming request."""
        if s.stream is None or s.stream_at != s.verifier.committed or not s.streamed:
            s.streamed.extend(await self._stream_chunk(s))
        s.stream_at += 1
        self.streamed_tokens += 1
        return s.streamed.popleft()

    async def _stream_chunk(self, s: _Session, lead: bool = False) -> list[int]:
        """The tokens the session's streaming request has produced since the last call (at least one),
        the request (re)opened at the committed length. Greedy: vLLM's argmax. Sampled (native cloud-led,
        `strict`): vLLM's sampler at the session's temperature / top-k / top-p, seeded by the session's
        seed and the length the request starts at, so a reopened stream does not replay its draws."""
        from vllm.sampling_params import RequestOutputKind  # heavy: the vllm extra

        v = s.verifier
        if s.stream is None or s.stream_at != v.committed:
            self._drop_stream(s)
            left = v.prompt_len + v.max_tokens - v.committed
            sp = s.spec.sampling
            sampling: dict[str, Any] = (
                {}
                if sp.greedy
                else dict(temperature=sp.temperature, seed=(s.spec.seed * 1_000_003 + v.committed) % (1 << 63))
            )
            if not sp.greedy and s.spec.rule.name != "strict":
                sampling["extra_args"] = {RULE_ARG: str(s.spec.rule)}  # decided by AceSpec's plugin in vLLM's sampler
            if not sp.greedy and sp.top_k:
                sampling["top_k"] = sp.top_k
            if not sp.greedy and sp.top_p < 1.0:
                sampling["top_p"] = sp.top_p
            params = self._params(
                0,
                skip_cache=False,
                logprobs=False,
                max_tokens=left,
                stop_token_ids=sorted(v.stop_ids),
                output_kind=RequestOutputKind.DELTA,
                **sampling,
            )
            s.stream = self._llm.generate(
                {"prompt_token_ids": list(v.tokens)}, params, request_id=f"acespec-{next(self._rids)}"
            )
            s.stream_at = v.committed
            self.requests += 1
            self.prompt_tokens += v.committed
        out: list[int] = []
        while not out:
            try:
                o = await s.stream.__anext__()
            except StopAsyncIteration:
                raise RuntimeError(f"session {s.id}: vLLM ended the stream before the session did") from None
            out = [int(t) for t in o.outputs[0].token_ids]
        if lead:
            s.stream_at += len(out)
        return out

    def _drop_stream(self, s: _Session) -> None:
        if s.stream is not None:
            gen, s.stream = s.stream, None
            s.streamed.clear()
            # closing the generator aborts its vLLM request
            try:
                asyncio.get_running_loop().create_task(gen.aclose())
            except RuntimeError:  # no loop (shutdown): the engine's stop() ends every request
                pass

    def _lead_totals(self) -> dict:
        """Draft tokens the proposer gave vLLM and vLLM kept, and steps whose drafts a rule decided with the
        edge's q rows, over every native session (the board's totals)."""
        c = self._board.counters() if self._board is not None else {"proposed": 0, "accepted": 0, "q_used": 0}
        return {"lead_proposed": c["proposed"], "lead_accepted": c["accepted"], "lead_q_used": c["q_used"]}

    def metrics(self) -> dict:
        return {
            "engine": self.name,
            "verdicts": self.verdicts,
            "slots": self.cfg.max_sessions,
            "sessions": len(self._live),
            "requests": self.requests,
            "resubmits": self.resubmits,
            "prompt_tokens": self.prompt_tokens,
            "lead_k": self.cfg.lead_k,
            "lead_tokens": self.lead_tokens,
            **self._lead_totals(),
            "cached_tokens": self.cached_tokens,
            "streamed_tokens": self.streamed_tokens,
            "logprobs_k": self.cfg.logprobs,
            "tail_mass_max": self.tail_max,
            "tail_mass_sum": self.tail_sum,
            "tail_buckets": list(zip(TAIL_BUCKETS, self.tail_counts)),
        }
