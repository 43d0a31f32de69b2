"""The net-win guard inside vLLM's worker, per request (used by `acespec.cloud.vllm_plugin`).

A request asks for it with `SamplingParams(extra_args={"acespec_rule": "cactus", "acespec_net_win": "math"})`:
the value is its task type. The worker keeps one `acespec.control.guards.NetWinGuard` per relaxed rule.
When the request joins the batch, that guard decides whether it runs the rule or `strict`. Each step adds
the drafts it kept. When it finishes (its max_tokens or a stop token id; one ended by a stop string is
not counted), the guard learns its length and its drafts kept per round, so a rule that makes the model
write more than it saves falls back to strict for that task type.

vLLM takes a request out of its persistent batch when it preempts it, and also when a step does not
schedule it, and puts it back later with the same SamplingParams object: such a request keeps its arm.
The guard is deterministic in the batch updates and steps it sees, and every rank sees the same ones, so
under tensor parallelism the ranks' guards choose alike.
"""

from __future__ import annotations

from acespec.control.guards import NetWinGuard
from acespec.verify import RuleSpec

NET_WIN_ARG = "acespec_net_win"  # extra_args key: the task type under which the guard decides this request's arm
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: no token at this position

GUARDS: dict[str, object] = {}  # relaxed rule (as written) -> this worker's NetWinGuard for it
GUARD_COUNTS = {"relaxed": 0, "strict": 0, "observed": 0}  # this worker's guarded requests: arms chosen, finishes told


def net_win_of(params) -> str | None:
    """The task type a request asked the guard to decide under, or None."""
    text = (getattr(params, "extra_args", None) or {}).get(NET_WIN_ARG)
    if text is None or text == "":
        return None
    text = str(text)
    if len(text) > 200:
        raise ValueError(f"extra_args[{NET_WIN_ARG!r}]: a task type of at most 200 characters")
    return text


def net_win_guard(rule: RuleSpec):
    """This worker's NetWinGuard between `rule` and strict, made on first use."""
    g = GUARDS.get(str(rule))
    if g is None:
        g = GUARDS[str(rule)] = NetWinGuard(str(rule))
    return g


class Guarded:
    """A request under the guard: its task type, its relaxed rule, and what it did so far."""

    __slots__ = ("task", "relaxed", "params", "output", "accepted", "rounds")

    def __init__(self, task: str, relaxed: RuleSpec, params, output) -> None:
        self.task, self.relaxed, self.params, self.output = task, relaxed, params, output
        self.accepted = self.rounds = 0

    def finished(self) -> bool:
        out, sp = self.output, self.params
        if out is None:
            return False
        if getattr(sp, "max_tokens", None) is not None and len(out) >= sp.max_tokens:
            return True
        stops = set(getattr(sp, "all_stop_token_ids", None) or ()) | set(getattr(sp, "stop_token_ids", None) or ())
        return bool(out) and out[-1] in stops


class GuardedRequests:
    """The batch rows whose requests are under the guard, and those out of the batch, unfinished."""

    PARKED_MAX = 4096  # requests out of the batch kept for their return; past it the oldest (aborted) go

    def __init__(self) -> None:
        self.rows: dict[int, Guarded] = {}  # batch row -> its request
        self._parked: dict[int, tuple[Guarded, RuleSpec]] = {}  # id(params) -> a request out of the batch, and its arm

    def join(self, i: int, task: str, relaxed: RuleSpec, params, output) -> RuleSpec:
        """The arm of a request joining the batch at row i: the one it had, if vLLM is putting it back;
        else the guard's choice for its task type."""
        back = self._parked.pop(id(params), None)
        if back is not None and back[0].params is params:
            g, arm = back
            g.output = output
        else:
            g = Guarded(task, relaxed, params, output)
            use = net_win_guard(relaxed).use_relaxed(task)
            arm = relaxed if use else RuleSpec.parse("strict")
            GUARD_COUNTS["relaxed" if use else "strict"] += 1
        self.rows[i] = g
        return arm

    def leave(self, i: int, arm: RuleSpec | None) -> None:
        """Row i left the batch, having run `arm`: finished, the guard learns its length and acceptance;
        else its request is kept, with its arm, for its return."""
        g = self.rows.pop(i, None)
        if g is None:
            return
        if g.finished():
            ran = "strict" if arm is None or arm.name == "strict" else str(g.relaxed)
            net_win_guard(g.relaxed).observe(g.task, ran, len(g.output), g.accepted / g.rounds if g.rounds else 0.0)
            GUARD_COUNTS["observed"] += 1
            return
        self._parked[id(g.params)] = (g, arm or RuleSpec.parse("strict"))
        while len(self._parked) > self.PARKED_MAX:
            self._parked.pop(next(iter(self._parked)))

    def step(self, out, num_draft_tokens) -> None:
        """After a step: each request's drafts kept (`out` [B, K + 1] on the CPU, PLACEHOLDER past its end)."""
        for i, g in self.rows.items():
            if i < len(num_draft_tokens) and num_draft_tokens[i] > 0:
                g.rounds += 1
                g.accepted += int((out[i] != PLACEHOLDER).sum()) - 1
