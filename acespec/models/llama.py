"""llama.cpp backend (GGUF) through llama-cpp-python: the default runtime for both models.

We drive llama.cpp's batch API ourselves instead of `Llama.eval`, because speculative decoding
needs the logits of *several* positions per pass, and `Llama(logits_all=True)` would keep an
`n_ctx x vocab` float array (2.5 GB at 4k context for a 152k vocabulary) for that. Rolling back is
`llama_memory_seq_rm` from position `n` on.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from acespec import env as acespec_env
from acespec.models.base import Model, ModelError, Tokenizer, vocab_fingerprint

_EOG_PIECES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "</s>")

# llama.cpp's CPU K-quant matmul takes a tiled kernel once a pass has 8 rows (ggml-cpu tiled.cpp,
# `ggml_tiled_min_batch`) and its one-row kernel below that; the two round differently. The rows a
# pass asks for are computed in passes of at most this many, so every generated position is computed
# by the kernel that computes it one token at a time (see LlamaCppModel's `exact_passes`).
EXACT_PASS_ROWS = 7
# From this position on, a one-token pass's KV view (its cells padded to 256) reaches 512 cells, where
# ggml-cpu splits one query row's attention across threads (see LlamaCppModel's `step_threads`).
SPLIT_KV_FROM = 256


def default_threads() -> int:
    return acespec_env.threads()


def split_cpus(cores: str) -> tuple[set[int] | None, set[int] | None]:
    """(edge CPUs, cloud CPUs) for --cores, as `split_threads` gives threads: with `split`, the first CPU
    this process may run on for the edge and the others for the cloud; (None, None) for `shared`, or
    where CPU affinity cannot be set or fewer than 2 CPUs are allowed (`on_cpus(None)` changes nothing)."""
    if cores != "split" or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, set(cpus[1:])) if len(cpus) >= 2 else (None, None)


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None):
    """Run the calling thread on `cpus` inside the block (None: leave it as it is). Threads and processes
    started inside inherit it, which is how `--cores split` keeps each side's whole process or threads
    (Python, sockets and the model's own threads, not only the model's thread count) on its own core:
    with thread counts alone, a cloud-led edge that drafts all the time took the cloud's core often
    enough that its plain steps cost the cloud 93 ms, against 73 ms pinned (`acespec demo`, 2026-12-03,
    the builds before and after this function, run back to back)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def split_threads(cores: str) -> tuple[int | None, int | None]:
    """(edge threads, cloud threads) for --cores: `shared` lets both models use every core (None = the
    runtime's default); `split` gives the edge one core and the cloud the rest."""
    if cores == "shared":
        return None, None
    n = os.cpu_count() or 1
    if n < 2:
        raise ValueError("--cores split needs at least 2 CPU cores")
    return 1, n - 1


def token_piece(llm, token: int, *, special: bool) -> bytes:
    """One token's bytes. llama-cpp-python's own `detokenize` reads pieces into a 32-byte buffer and
    silently drops any longer token (Qwen has hundreds: runs of spaces, dashes and stars that code
    is full of); llama.cpp says how long a piece is when the buffer is short, so ask again at that size."""
    import llama_cpp  # heavy: loads llama.cpp's library

    vocab = llm._model.vocab
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, llama_cpp.llama_token(int(token)), buf, size, 0, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def gguf_fingerprint(llm) -> str:
    """The vocabulary fingerprint (`models.base.vocab_fingerprint`) of a llama.cpp model: every token's
    bytes (unused tokens, e.g. Qwen's padding ids, have none). Equal fingerprints are what lets the
    cloud trust that the edge's token ids mean its own tokens."""
    n = llm.n_vocab()
    return vocab_fingerprint(n, (token_piece(llm, i, special=True) for i in range(n)))


class LlamaTokenizer(Tokenizer):
    def __init__(self, llm) -> None:  # llm: llama_cpp.Llama
        self._llm = llm
        eos = {int(llm.token_eos())}
        for piece in _EOG_PIECES:
            ids = llm.tokenize(piece.encode(), add_bos=False, special=True)
            if len(ids) == 1:
                eos.add(int(ids[0]))
        self.eos_ids = frozenset(t for t in eos if t >= 0)
        self.fingerprint = gguf_fingerprint(llm)
        self._template = llm.metadata.get("tokenizer.chat_template")

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=special))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(token_piece(self._llm, i, special=False) for i in ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if not self._template:
            return self.encode("\n".join(m["content"] for m in messages) + "\n", special=True)
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # heavy: loads llama.cpp's library

        eos = self._llm.detokenize([self._llm.token_eos()], special=True).decode("utf-8", "replace")
        bos_id = self._llm.token_bos()
        bos = self._llm.detokenize([bos_id], special=True).decode("utf-8", "replace") if bos_id >= 0 else ""
        # llama_cpp types messages as its own TypedDicts; plain {"role", "content"} dicts are what they are
        text = Jinja2ChatFormatter(self._template, eos_token=eos, bos_token=bos)(messages=messages).prompt  # type: ignore[arg-type]
        return self.encode(text, special=True)


class LlamaCppModel(Model):
    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int = 4096,  # context window in tokens
        n_batch: int = 256,  # most tokens per llama_decode call
        n_threads: int | None = None,  # CPU threads; default all cores (ACESPEC_THREADS overrides)
        n_gpu_layers: int = 0,  # layers to offload when llama.cpp was built with a GPU backend
        n_slots: int = 1,  # KV sequences (forks) in one unified cache; the state cache needs > 1
        name: str | None = None,
        batch_invariant: bool = False,  # one KV stream per slot: see below
        extra_bufts: bool = False,  # llama.cpp's extra weight buffers (AMX, repacked Q4_K): see below
        exact_passes: bool | None = None,  # a row's logits the same bits whatever the pass's row count: see below
        step_threads: int
        | str
        | None = None,  # threads of a one-token pass, or "auto" / "pad"; None: ACESPEC_STEP_THREADS, else "pad"
    ) -> None:
        """`batch_invariant=True` is for the cloud's batching engine, where slots are sessions: a session's
        logits rows must be the same bits whatever else shares its llama_decode call (docs/design/architecture.md: the
        same text whatever the load). Measured on this llama.cpp build (tests/test_batched.py compares
        every row): a K-quant matmul switches to a tiled kernel once a pass has 8 or more rows, and a
        pass over several adjacent KV streams attends through one strided view of the cache; both
        change a row's bits, and a unified KV cache interleaves the sessions' cells, which changes the
        order of every attention sum. So each slot gets a KV stream of its own (`n_ctx` tokens each),
        and a batch lists its sequences in descending slot order, which llama.cpp's sequential split
        turns into one pass per sequence: a session's rows are computed exactly as if it were alone.
        The batch still saves the per-call overheads and the re-prefill a shared one-sequence cache
        pays on every switch; it does not share weight reads between sessions (that is what
        `batch_invariant=False` with several slots does: one unified cache, one pass, and rows that
        depend on the company they keep).

        `extra_bufts` is off by default: llama.cpp's extra weight buffers (AMX tiles, repacked Q4_K)
        crash this build on AMX CPUs (a segfault in ggml_backend_amx_mul_mat on any batch of 4+
        tokens), and repacked rows are computed by batch-shape-dependent kernels.

        `exact_passes=True` makes a position's logits the same bits whether it was computed alone (a
        plain decoding step) or as one row of a verify pass of k + 1 rows, so a speculative session
        writes exactly the text plain decoding writes, not only text from the same law. Two things
        in this build make rows depend on the pass's row count (measured on the default target,
        tests/test_models.py::test_a_position_has_the_same_logits_whatever_the_pass_shape): attention
        without flash attention (KQ through a batched kernel from 2 rows on) and the K-quant matmul's
        tiled kernel from 8 rows. So flash attention is on (a per-row kernel below 64 rows), and the
        rows a pass asks for are computed in passes of at most EXACT_PASS_ROWS tokens, the rows nobody
        asked for before them (a prompt) in one long, fast pass: a prompt's chunks are the same in
        every mode, and its last token, whose row is asked for, gets a small pass in every mode. The
        cost on this CPU (scripts/exact_passes_cost.py, 330 tokens of context): a one-token step 1.25x
        and a 14-row block (7 + 7) 1.52x on 2 threads, 1.08x and 1.35x on one. The matmul part holds
        for K-quant weights (the default pair); llama.cpp computes Q8_0, Q4_0 and F16 weights through
        llamafile's kernel from 2 rows on, which no option turns off. None (the default) reads
        ACESPEC_EXACT_PASSES from the environment (on unless it is 0), so an operator who would rather
        have that speed on a CPU than plain decoding's exact text can say so.

        Exact passes are exact on one thread. On more, a one-token pass whose KV view reaches 512 cells
        (from its 257th position on) has its attention split across the threads and the parts summed
        (ggml-cpu's `use_split_kv_path`: one query row, n_kv >= 512), an order no pass of several rows
        uses, so from there plain steps and verified rows differ again (bench local's HumanEval/4, 2
        threads: its 128th token). llama.cpp takes a one-token pass's thread count separately
        (`llama_set_n_threads(ctx, n_threads, n_threads_batch)`), so `step_threads=1` restores
        exactness, at the price of one-token passes on one thread. "auto" (ACESPEC_STEP_THREADS=auto,
        with exact passes on) pays that price only where the split happens: a one-token pass at position
        SPLIT_KV_FROM or later runs on one thread, an earlier one on every thread (a sequence's cells
        are contiguous from 0, since rollbacks move the cache's head back, so its KV view is its
        position padded to 256); without exact passes it keeps n_threads, as there is no exact text to
        keep. "pad", the default, keeps every thread and gives such a pass a second row instead: a pad
        token at the next position of the same sequence, whose logits nobody asks for and whose cell
        is dropped after the pass. A pass of two rows never takes the split attention, and the real
        row cannot see the pad (the causal mask hides a later position, and flash attention skips
        masked cells), so it gets the bits a verify pass gives it. Where the pad has no room (the
        context's last cell, or a llama_decode call already n_batch tokens long) that pass runs on one
        thread, as "auto" does. What each costs past position 256 (scripts/exact_passes_cost.py, 2
        threads, 2026-12-05): a step 1.27x (330 tokens of context) and 1.45x (900) with the pad row,
        1.91x and 1.92x on one thread; the pad row's cost does not grow with the thread count, one
        thread's does. A number (ACESPEC_STEP_THREADS=2) keeps llama.cpp's own split, and with it
        steps whose text can part from a verify's past position 256."""
        if exact_passes is None:
            exact_passes = acespec_env.exact_passes()
        super().__init__()
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        try:
            import llama_cpp  # heavy: loads llama.cpp's library
        except ImportError as e:  # pragma: no cover
            raise ModelError("llama-cpp-python is not installed: run the README's setup command") from e
        self._lc = llama_cpp
        threads = n_threads or default_threads()
        import llama_cpp.llama as llama_module  # heavy: loads llama.cpp's library

        default_model_params = llama_module.llama_cpp.llama_model_default_params

        def plain_weights():
            params = default_model_params()
            params.use_extra_bufts = extra_bufts
            return params

        # Llama() has no argument for this model parameter; swap the defaults it reads for the load
        llama_module.llama_cpp.llama_model_default_params = plain_weights
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=n_batch,
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=n_gpu_layers,
                flash_attn=exact_passes,
                logits_all=False,
                verbose=False,
            )
        except (ValueError, RuntimeError) as e:
            raise ModelError(f"llama.cpp could not load {path}: {e}") from e
        finally:
            llama_module.llama_cpp.llama_model_default_params = default_model_params
        self.name = name or path.stem
        self.path = path
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.vocab_size = int(self._llm.n_vocab())
        self.tokenizer = LlamaTokenizer(self._llm)
        self._ctx = self._llm._ctx
        self._batch = self._llm._batch
        self.n_slots = max(1, int(n_slots))
        self.batch_invariant = bool(batch_invariant)
        self.exact_passes = bool(exact_passes)
        if self.n_slots > 1:
            # Llama() builds a one-sequence context; rebuild it with n_seq_max sequences: in a unified
            # KV cache, where a fork tags the prefix's cells with another sequence id instead of
            # copying, or (batch-invariant) one stream of n_ctx cells per sequence
            from llama_cpp import _internals  # heavy: loads llama.cpp's library

            params = self._llm.context_params
            params.n_seq_max = self.n_slots
            params.kv_unified = not self.batch_invariant
            if self.batch_invariant:
                params.n_ctx = n_ctx * self.n_slots
            self._ctx = _internals.LlamaContext(model=self._llm._model, params=params, verbose=False)
            self._llm._ctx.close()
            self._llm._ctx = self._ctx
        # one stream of n_ctx per sequence, or one cache of n_ctx that every sequence (fork) shares
        given = acespec_env.step_threads() if step_threads is None else step_threads
        if given not in ("auto", "pad") and (not str(given).isdigit() or int(given) < 1):
            self.close()
            raise ModelError(
                f"step_threads / ACESPEC_STEP_THREADS must be a positive integer, auto or pad, not {given!r}"
            )
        self.n_threads = threads
        # "auto": one thread only for the one-token passes that would take the split attention (see
        # above); "pad": a pad row for them, and one thread only where it has no room
        self.step_threads_auto = given in ("auto", "pad") and self.exact_passes and threads > 1
        self.step_pad = given == "pad" and self.step_threads_auto
        self.step_threads = threads if given in ("auto", "pad") else int(given)  # the count llama.cpp holds now
        llama_cpp.llama_set_n_threads(self._ctx.ctx, self.step_threads, threads)
        self.kv_cells = n_ctx * self.n_slots if self.batch_invariant else n_ctx
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        self.passes = 0  # llama_decode calls that produced logits

    def _cuts(self, new: list[int], want: int) -> list[tuple[int, int, int]]:
        """The passes (start, end, rows wanted) that evaluate `new` wanting its last `want` rows: one,
        or with `exact_passes`, the rows nobody asked for (a prompt) in one long pass and the wanted rows
        in passes of at most EXACT_PASS_ROWS tokens. So a prompt's last token is computed in a small pass
        whether plain decoding asks for its row alone or a verify asks for it with the draft's."""
        if not self.exact_passes or want == 0 or len(new) <= EXACT_PASS_ROWS:
            return [(0, len(new), want)]
        first = len(new) - want
        return ([(0, first, 0)] if first else []) + [
            (a, min(a + EXACT_PASS_ROWS, len(new)), min(a + EXACT_PASS_ROWS, len(new)) - a)
            for a in range(first, len(new), EXACT_PASS_ROWS)
        ]

    def _eval(self, new: list[int], want: int) -> np.ndarray:
        cuts = self._cuts(new, want)
        if len(cuts) == 1:
            return self._decode(new, want, len(self.tokens))
        return np.vstack([self._decode(new[a:b], w, len(self.tokens) + a) for a, b, w in cuts])

    def _decode(self, new: list[int], want: int, n_past: int) -> np.ndarray:
        V = self.vocab_size
        out = np.empty((want, V), dtype=np.float32)
        first_wanted = len(new) - want
        self._ctx.kv_cache_seq_rm(self.slot, n_past, -1)
        done = 0
        row = 0
        b = self._batch.batch
        while done < len(new):
            chunk = new[done : done + self.n_batch]
            n = len(chunk)
            pad = False
            if self.step_threads_auto and n == 1:
                late = n_past + done >= SPLIT_KV_FROM
                pad = late and self.step_pad and n_past + done + 1 < self.n_ctx and self.n_batch > 1
                self._set_step_threads(1 if late and not pad else self.n_threads)
            b.n_tokens = n + pad
            n_out = 0
            for i, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = n_past + done + i
                b.seq_id[i][0] = self.slot
                b.n_seq_id[i] = 1
                flag = done + i >= first_wanted
                b.logits[i] = flag
                n_out += flag
            if pad:
                self._put_pad(b, 1, chunk[0], n_past + done + 1, self.slot)
            rc = self._lc.llama_decode(self._ctx.ctx, b)
            if pad:  # its cell goes; the next token takes it (cells stay contiguous)
                self._ctx.kv_cache_seq_rm(self.slot, n_past + done + 1, -1)
            if rc != 0:
                # llama.cpp leaves the cache in an unknown state past n_past; drop it so we stay consistent
                self._ctx.kv_cache_seq_rm(self.slot, n_past, -1)
                raise ModelError(f"{self.name}: llama_decode failed with code {rc}")
            if n_out:
                ptr = self._ctx.get_logits()
                out[row : row + n_out] = np.ctypeslib.as_array(ptr, shape=(n_out * V,)).reshape(n_out, V)
                row += n_out
                self.passes += 1
            done += n
        return out

    @staticmethod
    def _put_pad(b, bi: int, tok: int, pos: int, seq: int) -> None:
        """A row whose logits nobody asks for at batch index bi: it makes a one-token pass two rows
        long, so that it takes the multi-row attention kernel (step_threads "pad")."""
        b.token[bi] = tok
        b.pos[bi] = pos
        b.seq_id[bi][0] = seq
        b.n_seq_id[bi] = 1
        b.logits[bi] = False

    def _set_step_threads(self, n: int) -> None:
        if n != self.step_threads:
            self._lc.llama_set_n_threads(self._ctx.ctx, n, self.n_threads)
            self.step_threads = n

    def _eval_batch(self, items: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        if len(items) == 1:
            slot, new, want = items[0]
            main = self.slot
            try:
                self.activate(slot)
                return [self._eval(new, want)]
            finally:
                self.activate(main)
        if self.batch_invariant:
            # descending slot order: llama.cpp's sequential split only joins ascending adjacent
            # sequences into one pass, so each sequence gets a pass of its own, computed exactly as
            # alone (see the class docstring)
            order = sorted(range(len(items)), key=lambda i: -items[i][0])
        else:
            order = list(range(len(items)))
        # an item cut into several passes (exact_passes) goes in rounds: its n-th pass in round n
        cuts = [self._cuts(items[i][1], items[i][2]) for i in order]
        parts: list[list[np.ndarray]] = [[] for _ in order]
        for r in range(max(len(c) for c in cuts)):
            live = [j for j, c in enumerate(cuts) if r < len(c)]
            work = [
                (items[order[j]][0], items[order[j]][1][cuts[j][r][0] : cuts[j][r][1]], cuts[j][r][2]) for j in live
            ]
            rows = self._eval_sequences(work, [cuts[j][r][0] for j in live])
            for j, rr in zip(live, rows):
                parts[j].append(rr)
        out: list[np.ndarray] = [None] * len(items)  # type: ignore[list-item]
        for j, i in enumerate(order):
            out[i] = parts[j][0] if len(parts[j]) == 1 else np.vstack(parts[j])
        return out

    def _eval_sequences(self, items: list[tuple[int, list[int], int]], offsets: list[int]) -> list[np.ndarray]:
        """One llama_decode per n_batch tokens of every item; item i's tokens go at positions from
        its sequence's length + offsets[i] (a later pass of an item cut in several)."""
        V = self.vocab_size
        out = [np.empty((want, V), dtype=np.float32) for _, _, want in items]
        # every (item, token) in order, cut into llama_decode calls of at most n_batch tokens; a
        # sequence may straddle two calls, which is fine: its positions stay in order
        flat = [(i, j) for i, (_, new, _) in enumerate(items) for j in range(len(new))]
        for (slot, _, _), off in zip(items, offsets):
            self._ctx.kv_cache_seq_rm(slot, len(self._slots[slot]) + off, -1)
        b = self._batch.batch
        for start in range(0, len(flat), self.n_batch):
            chunk = flat[start : start + self.n_batch]
            padded: set[int] = set()  # items whose one token here gets a pad row right after it
            if self.step_threads_auto:
                # each sequence is a pass of its own (see _eval_batch), and llama.cpp gives every
                # one-token pass the step's thread count: one thread if any of them is past the
                # split, or with "pad" a pad row for each of them where they all have room
                n_in = collections.Counter(i for i, _ in chunk)
                late = {
                    i
                    for i, j in chunk
                    if n_in[i] == 1 and len(self._slots[items[i][0]]) + offsets[i] + j >= SPLIT_KV_FROM
                }
                if (
                    self.step_pad
                    and late
                    and len(chunk) + len(late) <= self.n_batch
                    and all(len(self._slots[items[i][0]]) + offsets[i] + len(items[i][1]) < self.n_ctx for i in late)
                ):
                    padded = late
                self._set_step_threads(1 if late and not padded else self.n_threads)
            wanted: list[tuple[int, int, int]] = []  # (batch index, item, row)
            pads: list[tuple[int, int]] = []  # (slot, position) of each pad row
            bi = 0
            for i, j in chunk:
                slot, new, want = items[i]
                pos = len(self._slots[slot]) + offsets[i] + j
                b.token[bi] = new[j]
                b.pos[bi] = pos
                b.seq_id[bi][0] = slot
                b.n_seq_id[bi] = 1
                row = j - (len(new) - want)
                b.logits[bi] = row >= 0
                if row >= 0:
                    wanted.append((bi, i, row))
                bi += 1
                if i in padded:  # beside its sequence's token, so the batch keeps its sequence order
                    self._put_pad(b, bi, new[j], pos + 1, slot)
                    pads.append((slot, pos + 1))
                    bi += 1
            b.n_tokens = bi
            rc = self._lc.llama_decode(self._ctx.ctx, b)
            for slot, pos in pads:
                self._ctx.kv_cache_seq_rm(slot, pos, -1)
            if rc != 0:
                for slot, _, _ in items:
                    self._ctx.kv_cache_seq_rm(slot, len(self._slots[slot]), -1)
                raise ModelError(f"{self.name}: llama_decode failed with code {rc}")
            if wanted:
                self.passes += 1
            for bi, i, row in wanted:
                ptr = self._lc.llama_get_logits_ith(self._ctx.ctx, bi)
                out[i][row] = np.ctypeslib.as_array(ptr, shape=(V,))
        return out

    def _rollback(self, n: int) -> None:
        self._ctx.kv_cache_seq_rm(self.slot, n, -1)

    def _fork(self, src: int, dst: int, n: int) -> None:
        self._ctx.kv_cache_seq_rm(dst, 0, -1)
        if n:
            self._ctx.kv_cache_seq_cp(src, dst, 0, n)

    def _free(self, slot: int) -> None:
        self._ctx.kv_cache_seq_rm(slot, 0, -1)

    def _kv_bytes_per_token(self) -> int:
        """K and V, every layer, f16: what one more cached token costs (for memory budgets)."""
        lc = self._lc
        m = self._llm._model.model
        try:
            n_layer = lc.llama_model_n_layer(m)
            n_embd = lc.llama_model_n_embd(m)
            n_head = lc.llama_model_n_head(m)
            n_head_kv = lc.llama_model_n_head_kv(m)
        except AttributeError:  # pragma: no cover - older bindings
            return 0
        head_dim = n_embd // max(1, n_head)
        return int(2 * n_layer * n_head_kv * head_dim * 2)

    def close(self) -> None:
        self._llm.close()
