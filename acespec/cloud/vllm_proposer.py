"""Edge drafts inside vLLM's own speculative decoding: the `custom_class` proposer.

vLLM builds this class in its worker, once, with `EdgeDraftProposer(vllm_config)`, when the engine is
started with `speculative_config={"method": "custom_class", "model":
"acespec.cloud.vllm_proposer.EdgeDraftProposer", "num_speculative_tokens": K}` (the vLLM engine does
this for cloud-led sessions, `cloud/vllm_engine.py`). After every engine step it calls `propose` with
each running request's tokens; what it returns, vLLM verifies in its next step with its own rejection
sampler: full rows, batched with every other request, KV kept. Token-only drafts go through that
sampler as one-hot q (as vLLM's n-gram drafts do), so a draft x is kept with probability p(x) and
otherwise the residual is sampled: the output law is p whatever the draft was.

For each request the proposer finds its session's slot on the shared board (`cloud/vllm_board.py`) by
the prompt it starts with, walks the slot's drafts along the request's actual tokens (`DraftBoard.usable`,
the function the embedded engines use) and proposes the agreeing continuation, cut to the depth the
session's pricer chooses (`control/lead.py`): the pricer sees exactly what each proposal earned (a
request's sampled tokens after a proposal of k are its accepted ones plus one) and what a step cost.
A request with no slot (an edge-led verify, a cloud-only stream) gets no proposal, so vLLM runs it as
without speculation.

Rules that need the drafter's q rows: vLLM's `custom_class` proposals are token ids, and its sampler
gets no draft probabilities for them. So the proposer also leaves, in this worker process, the q rows
of each proposal it makes from a draft that carried them (`edge_q`, by the session's prompt key, with
the proposed tokens), and AceSpec's rejection-sampler plugin, which runs next in the same process,
takes them for a request whose drafted tokens are those (`cloud/vllm_plugin.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from acespec.cloud.vllm_board import CONFIG_KEY, BoardReader, SlotView, prompt_key
from acespec.control.lead import LeadConfig, LeadMemory, LeadPricer
from acespec.loop.board import DraftBoard

log = logging.getLogger("acespec.vllm.proposer")

# the q rows of this worker's latest proposals: (prompt key, prompt length) -> (proposed tokens, their
# sparse q rows, slot). Replaced on every propose call (a proposal is verified by the step right after
# it), read by the plugin
edge_q: dict[tuple[int, int], tuple[tuple[int, ...], list, int]] = {}
_reader: BoardReader | None = None  # this worker's board, for the plugin's q_used count


def q_used(slot: int) -> None:
    """The plugin decided a step of slot `slot`'s session with the q rows its edge sent: counted on the board."""
    if _reader is not None:
        _reader.count_q(slot)


@dataclass
class _SlotState:
    gen: int  # the session the slot held when this state began (a reused slot starts afresh)
    pricer: LeadPricer


@dataclass(frozen=True)
class _Pending:
    slot: int
    gen: int
    k: int  # tokens proposed
    call: int  # the propose call that made it


def expand_is_right() -> bool:
    """Whether vLLM's `expand_batch_to_tokens` (per-request sampling parameters spread over each
    request's draft tokens, before its rejection sampler scales the target's logits) copies floats.

    vLLM 0.32's CPU build routes it to a C++ kernel through `_ensure_int64(output)`: for the float
    temperatures that is a temporary int64 copy, so the real output stays uninitialised memory, the
    target's rows are divided by garbage, and sampled speculative decoding on CPU keeps drafts it
    should refuse (found here: a second-choice draft kept 9 times in 10 where the target gives it 0.29)."""
    import torch  # heavy: the hf extra
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens  # heavy: the vllm extra

    x = torch.tensor([0.7, 0.0, 1.5], dtype=torch.float32)
    got = expand_batch_to_tokens(x, torch.tensor([1, 3, 4], dtype=torch.int32), 4, replace_from=0, replace_to=1)
    return torch.equal(got, torch.tensor([0.7, 1.0, 1.0, 1.5], dtype=torch.float32))


def _expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's expand_kernel, in torch: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to), any dtype."""
    import torch  # heavy: the hf extra

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(ends[-1]) if len(ends) else 0
    output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)


def ensure_expand_is_right() -> bool:
    """Check vLLM's expand (see `expand_is_right`) and, if it is wrong, put `_expand_kernel` in its place
    through vLLM's own kernel-override registry; returns whether a fix was installed. Raises if vLLM is
    still wrong after it, so a worker never runs sampled speculation on corrupted rows."""
    if expand_is_right():
        return False
    from vllm.triton_utils.dispatcher import register_kernels  # heavy: the vllm extra

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel})
    if not expand_is_right():
        raise RuntimeError(
            "vLLM's expand_batch_to_tokens gives wrong values and AceSpec's fix did not take: sampled "
            "speculative decoding would not keep the target's law; serve with --lead-k 0"
        )
    log.warning(
        "vLLM's CPU expand kernel truncates float sampling parameters: replaced with a torch version, so "
        "sampled speculative decoding keeps the target's law"
    )
    return True


class EdgeDraftProposer:
    def __init__(self, vllm_config, *, check_kernels: bool = True) -> None:
        """`check_kernels`: check (and if need be fix) vLLM's kernels in this process, as a worker must;
        off only where the proposer is driven by hand with no vLLM engine (tests/test_vllm_board.py)."""
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        cfg = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        if not cfg:
            raise RuntimeError(
                f"EdgeDraftProposer needs additional_config[{CONFIG_KEY!r}] (the AceSpec server's draft board); "
                "start vLLM through `acespec serve --engine vllm`"
            )
        self.fixed_expand = (
            ensure_expand_is_right() if check_kernels else False
        )  # in the worker, before any step samples
        self.reader = BoardReader(cfg)
        global _reader
        _reader = self.reader
        self.price = bool(cfg.get("price", True))
        self.max_len = int(vllm_config.model_config.max_model_len)
        self._slots: dict[int, _SlotState] = {}
        self.memory = LeadMemory(
            LeadConfig(k_max=max(1, self.k))
        )  # what earlier sessions' proposals earned, for new ones
        # proposals waiting for the step that shows what they earned, by what the request looked like
        # then (its prompt key, length, last tokens): rows move within vLLM's batch between steps, and
        # requests with the same tokens got the same proposal, so content is the identity that matters
        self._pending: dict[tuple, list[_Pending]] = {}
        self._calls = 0
        self._keys: dict[tuple[int, int], tuple[bytes, int]] = {}  # (row, prompt length) -> (row signature, key)
        self._t = time.perf_counter()
        log.info(
            "AceSpec edge-draft proposer on board %s (K = %d, pricing %s)",
            cfg["name"],
            self.k,
            "on" if self.price else "off",
        )

    def load_model(self, *args, **kwargs) -> None:  # vLLM calls this on every drafter; there is no model
        pass

    def _key(self, row: int, tokens: np.ndarray, P: int) -> int:
        """prompt_key(tokens[:P]), remembered per row while the row's first and last prompt tokens stay."""
        sig = tokens[: min(P, 8)].tobytes() + tokens[max(0, P - 8) : P].tobytes()
        hit = self._keys.get((row, P))
        if hit is not None and hit[0] == sig:
            return hit[1]
        if len(self._keys) > 65536:
            self._keys.clear()
        key = prompt_key(tokens[:P])
        self._keys[(row, P)] = (sig, key)
        return key

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        now = time.perf_counter()
        step_s, self._t = now - self._t, now
        self._calls += 1
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        global edge_q
        edge_q = {}
        views = self.reader.snapshot()
        if not views:
            self._pending.clear()
            return out
        by_key: dict[int, list[SlotView]] = {}
        for v in views:
            by_key.setdefault(v.key, []).append(v)
        lengths = sorted({v.prompt_len for v in views})
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a prefill still in chunks: nothing was sampled, nothing to propose after
                continue
            n = int(num_tokens_no_spec[row])
            tokens = token_ids_cpu[row, :n]
            for P in lengths:
                if P > n:
                    break
                key = self._key(row, tokens, P)
                found = by_key.get(key)
                if found:
                    self._account(key, tokens, n - len(sampled), len(sampled), step_s, len(sampled_token_ids))
                    if n < self.max_len:
                        out[row] = self._propose_for(key, found, tokens)
                    break
        if self._calls % 64 == 0:  # requests that ended right after a proposal leave one behind
            self._pending = {w: [p for p in ps if self._calls - p.call < 8] for w, ps in self._pending.items()}
            self._pending = {w: ps for w, ps in self._pending.items() if ps}
        return out

    @staticmethod
    def _where(key: int, tokens: np.ndarray, n: int) -> tuple:
        return key, n, tokens[max(0, n - 8) : n].tobytes()

    def _account(self, key: int, tokens: np.ndarray, n_before: int, n_sampled: int, step_s: float, shared: int) -> None:
        """What the previous proposal for this request earned: its sampled tokens are the accepted ones plus
        one; `shared`: the requests in the step (each waited for this one's rows)."""
        waiting = self._pending.get(self._where(key, tokens, n_before))
        if not waiting:
            return
        p = waiting.pop()
        accepted = max(0, min(p.k, n_sampled - 1))
        st = self._slots.get(p.slot)
        if st is not None and st.gen == p.gen:
            st.pricer.observe(p.k, accepted, step_s, step_s, shared)
            self.reader.count(p.slot, drafted=p.k, accepted=accepted)

    def _propose_for(self, key: int, found: list[SlotView], tokens: np.ndarray) -> list[int]:
        """The proposal for one request whose prompt is that of the sessions in `found` (one, unless two
        sessions share a prompt); the first one's pricer and counters account for it."""
        own = found[0]
        st = self._slots.get(own.slot)
        if st is None or st.gen != own.gen:
            st = self._slots[own.slot] = _SlotState(own.gen, LeadPricer(LeadConfig(k_max=max(1, self.k)), self.memory))
        b = DraftBoard(max_drafts=sum(len(v.drafts) for v in found))
        for v in found:
            b.drafts.extend(v.drafts)
        cap = min(self.k, own.k_cap) if own.k_cap > 0 else self.k
        avail, q = b.usable(tokens, cap)
        k = st.pricer.choose(len(avail)) if self.price else len(avail)
        proposal = [int(t) for t in avail[:k]]
        if proposal and q is not None:
            rows = q[:k]  # read from the board just now: kept only if no write came meanwhile
            if not all(self.reader.still(v) for v in found):
                return []  # q rows torn by a write: no proposal this step rather than a rule fed the wrong q
            edge_q[(key, own.prompt_len)] = (tuple(proposal), rows, own.slot)
        self._pending.setdefault(self._where(key, tokens, len(tokens)), []).append(
            _Pending(own.slot, own.gen, k, self._calls)
        )
        return proposal
