"""AceSpec's rules decided on one vLLM step's rows, in torch: the half of the vLLM plugin that does the math.

`apply_rules` takes the inputs vLLM's rejection sampler has (draft ids, target logits, drafter rows or none,
bonus ids) for the requests that asked for a rule, and returns their output rows: each rule's acceptance
probability for every draft row (`acespec.verify.relaxed.ROW_LAWS`, the rules' single definition), the first
rejection of each request, and the token that follows, drawn from the rule's recovered law, from the support
filter's rows where that filter stopped a block, or vLLM's bonus token where nothing was rejected.

The plugin (`acespec.cloud.vllm_plugin`) decides which requests come here and splices the rows back into
vLLM's output; this module imports nothing of vLLM, and torch only when it runs.
"""

from __future__ import annotations

import numpy as np

from acespec.cloud.vllm_guard import PLACEHOLDER
from acespec.verify import RULES, RuleSpec
from acespec.verify.relaxed import ROW_LAWS


def _uniforms(generators: dict, reqs: list[int], counts: np.ndarray, device):
    """Uniforms for the rule requests `reqs` (batch indices) with `counts` draft tokens each: one per
    draft row ([N], float64, in row order) and one per request for its recovered token ([R]). A seeded
    request draws its counts + 1 from its own generator (none when it drafted nothing, as vLLM does);
    the others share one draw from torch's global generator."""
    import torch  # heavy: the hf extra

    N, R = int(counts.sum()), len(reqs)
    u = torch.rand(N + R, dtype=torch.float64, device=device)
    row_u, next_u = u[:N], u[N:]
    at = 0
    for b, i in enumerate(reqs):
        g = generators.get(i)
        n = int(counts[b])
        if g is not None and n > 0:
            mine = torch.rand(n + 1, dtype=torch.float64, generator=g, device=device)
            row_u[at : at + n] = mine[:n]
            next_u[b] = mine[n]
        at += n
    return row_u, next_u


def _sample_rows(dist, u):
    """Inverse-CDF draw from each row of `dist` [m, V] (unnormalised, >= 0) with uniforms u [m]: int64[m]."""
    import torch  # heavy: the hf extra

    c = torch.cumsum(dist.to(torch.float64), dim=-1)  # [m, V]
    t = (u * c[:, -1]).unsqueeze(-1)  # [m, 1]
    return torch.searchsorted(c, t, right=True)[:, 0].clamp_(max=dist.shape[-1] - 1)


# On CPU the rows are processed some at a time, so that each rule's passes over them (a softmax, then
# its elementwise steps) mostly run in cache rather than each going through memory; a GPU takes them all
# at once. Smaller pieces stay in cache better, but every piece is a few more parallel torch ops, and where
# other work holds the cores each op waits for its threads: 2^22 is the compromise between the two
# (measured in docs/results/bench-plugin-cost.txt).
CPU_CHUNK = 1 << 22  # elements (rows x vocabulary) per piece on CPU: 16 MB of float32


def apply_rules(
    rules: dict[int, RuleSpec],
    reqs: list[int],
    draft_token_ids,
    num_draft_tokens,
    max_spec_len: int,
    draft_probs,
    target_logits,
    bonus_token_ids,
    sampling_metadata,
    support: dict | None = None,
    edge_q: dict | None = None,
):
    """The rows of the output [len(reqs), max_spec_len + 1] for the requests `reqs` (batch indices, each
    with a rule in `rules`), from the inputs vLLM's sampler has: draft ids [num_tokens], target logits
    [num_tokens, V] after the sampling constraints, draft probs [num_tokens, V] or None, bonus ids
    [batch, 1]. Every row at once (in pieces on CPU): each rule's acceptance probability for its
    requests' rows, the first rejection of each request, then the recovered token, drawn from the rule's
    recovered law only at the rows where a request rejected.

    `support` (batch index -> (min_p, max_rank)) puts those requests under the support filter
    (`acespec.verify.guards.verify_with_support_filter`): a draft the filter refuses stops the block
    there whatever the rule says (the rule decides the rows before it), and the token emitted in its
    place is drawn from the target's row restricted to the filter's support.

    `edge_q` (batch index -> one sparse q row per draft token) gives those requests' q when vLLM has no
    draft probs: the rows a cloud-led edge sent up with its drafts (`vllm_plugin._edge_q`). Without either, a
    token-only draft's q is one-hot on its token."""
    import torch  # heavy: the hf extra

    device = target_logits.device
    counts_all = np.asarray(num_draft_tokens, dtype=np.int64)
    starts_all = np.cumsum(counts_all) - counts_all
    counts = counts_all[reqs]  # [R]
    R, N, V = len(reqs), int(counts.sum()), target_logits.shape[-1]
    nxt = bonus_token_ids[torch.as_tensor(reqs, device=device), 0].to(
        torch.int64
    )  # [R]: vLLM drew it from the bonus row
    emitted = torch.full((R, max_spec_len + 1), PLACEHOLDER, dtype=torch.int32, device=device)
    if N == 0:
        emitted[:, 0] = nxt.to(emitted.dtype)
        return emitted
    first = np.cumsum(counts) - counts  # [R]: each request's first row among the N
    req_of_row = np.repeat(np.arange(R), counts)  # [N]
    pos = np.arange(N) - first[req_of_row]  # [N]: position in its block
    rows = torch.as_tensor(starts_all[reqs][req_of_row] + pos, device=device)  # [N]: rows of the step's flat layout
    x = draft_token_ids[rows].to(torch.int64)  # [N]
    piece = N if device.type != "cpu" else max(1, CPU_CHUNK // V)

    def law_args(spec: RuleSpec, idx):  # idx: int64[n], rows among the N -> (x [n], q [n, V] or None, p [n, V])
        at = torch.as_tensor(idx, device=device)
        r, xi = rows[at], x[at]
        p = torch.softmax(target_logits[r], dim=-1, dtype=torch.float32)
        if not RULES[spec.name].needs_q:
            return xi, None, p
        if draft_probs is not None:
            return xi, draft_probs[r].to(torch.float32), p
        q = torch.zeros_like(p)  # token-only drafts: the drafter's row is one-hot on its token
        q[torch.arange(len(idx), device=device), xi] = 1.0
        for jj, j in enumerate(idx):  # the edge's own rows, where it sent them
            sent = (edge_q or {}).get(reqs[req_of_row[j]])
            if sent is not None:
                row = sent[pos[j]]
                q[jj] = 0.0
                q[jj, torch.as_tensor([t for t, _ in row], device=device)] = torch.as_tensor(
                    [w for _, w in row], dtype=q.dtype, device=device
                )
        return xi, q, p

    def pieces(idx):
        return (idx[i : i + piece] for i in range(0, len(idx), piece))

    # the rows (indices among the N) of each rule, parameters included
    spec_of_req = [rules[i] for i in reqs]
    by_spec: dict[RuleSpec, list[int]] = {}
    for j in range(N):
        by_spec.setdefault(spec_of_req[req_of_row[j]], []).append(j)

    accept = torch.empty(N, dtype=torch.float64, device=device)  # [N]
    for spec, idx in by_spec.items():
        for part in pieces(np.asarray(idx)):
            accept[torch.as_tensor(part, device=device)] = (
                ROW_LAWS[spec.name].accept(*law_args(spec, part), **spec.kwargs()).to(torch.float64)
            )
    row_u, next_u = _uniforms(sampling_metadata.generators, reqs, counts, device)
    # accepted drafts of each request: the position of its first rejection, or its count if none
    counts_t = torch.as_tensor(counts, device=device)
    req_t = torch.as_tensor(req_of_row, device=device)
    pos_t = torch.as_tensor(pos, device=device)
    stop = row_u >= accept  # [N]: the rule rejects here
    filtered = _filtered_rows(support or {}, reqs, req_of_row, rows, x, target_logits, piece)  # [N] or None
    if filtered is not None:
        stop |= filtered  # the filter refuses the draft: the block stops here, whatever the rule said
    cand = torch.where(stop, pos_t, counts_t[req_t])  # [N]
    acc = counts_t.scatter_reduce(0, req_t, cand, "amin")  # [R]

    # the recovered token, for the requests that rejected a draft only, from their rule's recovered law
    rejected = torch.nonzero(acc < counts_t)[:, 0].cpu().numpy()  # [m] requests
    at = first[rejected] + acc.cpu().numpy()[rejected]  # [m]: their rejected rows among the N
    if filtered is not None:  # where the filter stopped a block, the token comes from the filter's support
        assert support is not None, "a filter comes from some request's support"
        cut = filtered[torch.as_tensor(at, device=device)].cpu().numpy().astype(bool)
        for b, j in zip(rejected[cut], at[cut]):
            min_p, max_rank = support[reqs[b]]
            p = torch.softmax(target_logits[rows[j : j + 1]], dim=-1, dtype=torch.float32)
            nxt[b] = _sample_rows(_support_mask(p, min_p, max_rank) * p, next_u[b : b + 1])[0]
        rejected, at = rejected[~cut], at[~cut]
    for spec in {spec_of_req[b] for b in rejected}:
        mine = np.flatnonzero([spec_of_req[b] == spec for b in rejected])
        for part in pieces(mine):
            b = torch.as_tensor(rejected[part], device=device)
            dist = ROW_LAWS[spec.name].recovered(*law_args(spec, at[part]), **spec.kwargs())  # [n, V]
            nxt[b] = _sample_rows(dist, next_u[b])

    drafts = torch.full((R, max_spec_len + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    drafts[req_t, pos_t] = x
    cols = torch.arange(max_spec_len + 1, device=device)
    emitted = torch.where(cols[None, :] < acc[:, None], drafts, PLACEHOLDER)  # [R, max_spec_len + 1]
    emitted[torch.arange(R, device=device), acc] = nxt
    return emitted.to(torch.int32)


def _support_mask(p, min_p: float, max_rank: int):
    """`acespec.verify.guards.support_mask` on torch rows p [n, V]: bool [n, V], never empty."""
    import torch  # heavy: the hf extra

    by_rank = torch.ones_like(p, dtype=torch.bool)
    if max_rank > 0:  # rank(v) <= max_rank <=> v's probability reaches the max_rank-th largest
        by_rank = p >= torch.topk(p, min(max_rank, p.shape[-1]), dim=-1).values[:, -1:]
    mask = by_rank & (p >= min_p) & (p > 0)
    empty = ~mask.any(dim=-1, keepdim=True)  # no token reaches min_p: the rank test alone
    return torch.where(empty, by_rank & (p > 0), mask)


def _filtered_rows(support: dict, reqs: list[int], req_of_row, rows, x, target_logits, piece: int):
    """bool [N]: the draft rows the support filter refuses (p(x) < min_p, or rank(x) > max_rank, rank 1 the
    argmax, ties sharing the better rank), for the requests in `support`; None if none asked for it."""
    import torch  # heavy: the hf extra

    mine = [j for j in range(len(req_of_row)) if reqs[req_of_row[j]] in support]
    if not mine:
        return None
    device = target_logits.device
    out = torch.zeros(len(req_of_row), dtype=torch.bool, device=device)
    for i in range(0, len(mine), piece):
        part = mine[i : i + piece]
        at = torch.as_tensor(part, device=device)
        p = torch.softmax(target_logits[rows[at]], dim=-1, dtype=torch.float32)
        px = p.gather(1, x[at].unsqueeze(1))  # [n, 1]
        rank = 1 + (p > px).sum(dim=-1)
        lim = torch.tensor([support[reqs[req_of_row[j]]] for j in part], dtype=torch.float64, device=device)  # [n, 2]
        out[at] = (px[:, 0] < lim[:, 0]) | ((lim[:, 1] > 0) & (rank > lim[:, 1]))
    return out
