"""The rule registry, rule specs (`cactus:delta=0.35`) and the general accept/residual/bonus template.

Every rule is a pure function

    rule(draft, q, p, rng, **params) -> (accepted, next_token)

    draft: int[k]            the drafted token ids
    q:     float[k, V]|None  drafter distribution at each draft position (None for rules that need none)
    p:     float[k+1, V]     target distribution at each draft position, plus the bonus position
    rng:   numpy Generator   the only source of randomness

`accepted` is how many draft tokens are kept (0..k); `next_token` is the recovered token after a
rejection or the bonus token after a full accept. A round therefore emits `accepted + 1` tokens.

The template's arithmetic (`template_accept`, `residual`) and the rules' row functions in `relaxed`
are written once against the array API (`array_api_compat.array_namespace`) and batched over rows
`[n, V]`: the same definition runs on numpy here (float64, one block at a time) and on torch in
AceSpec's vLLM plugin (`acespec/cloud/vllm_rules.py`, every request of a step at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from array_api_compat import array_namespace, device

from acespec.verify.sampling import sample


def namespace(*arrays):
    """The array namespace of the arrays given (numpy's or torch's); lists and tuples count as numpy.
    None entries (an unused q) are skipped."""
    return array_namespace(*(np.asarray(a) if isinstance(a, (list, tuple)) else a for a in arrays if a is not None))


def as_float(a):
    """numpy input (arrays, lists) as float64, as the numpy rules have always computed; torch as it is."""
    return np.asarray(a, dtype=np.float64) if isinstance(a, (list, tuple, np.ndarray, float, int)) else a


def rows_of(xp, a):  # a: [n, ...] -> int[n]: 0..n-1 on a's device, for gathers like p[r, x]
    return xp.arange(a.shape[0], device=device(a))


class RuleFn(Protocol):
    def __call__(
        self, draft: np.ndarray, q: np.ndarray | None, p: np.ndarray, rng: np.random.Generator, **params: float
    ) -> tuple[int, int]: ...


@dataclass(frozen=True)
class RuleInfo:
    name: str
    fn: RuleFn
    needs_q: bool  # whether the rule reads the drafter distribution (and so the wire must carry it)
    defaults: dict[str, float] = field(default_factory=dict)  # parameter defaults (a relaxed setting)
    lossless: bool = False  # lossless at every parameter value
    doc: str = ""
    bounds: dict[str, tuple[float, float]] = field(
        default_factory=dict
    )  # parameter -> (low, high), inclusive; unlisted: any finite value


RULES: dict[str, RuleInfo] = {}


def register(
    name: str,
    *,
    needs_q: bool,
    defaults: dict[str, float] | None = None,
    lossless: bool = False,
    bounds: dict[str, tuple[float, float]] | None = None,
):
    def deco(fn: RuleFn) -> RuleFn:
        if name in RULES:
            raise ValueError(f"rule {name!r} registered twice")
        RULES[name] = RuleInfo(
            name, fn, needs_q, dict(defaults or {}), lossless, (fn.__doc__ or "").strip(), dict(bounds or {})
        )
        return fn

    return deco


class RuleSpecError(ValueError):
    """A rule spec string (e.g. `cactus:delta=0.35`) could not be parsed or names an unknown rule/parameter."""


@dataclass(frozen=True)
class RuleSpec:
    """A rule and its parameters, written the same way everywhere: `name` or `name:a=1,b=2`."""

    name: str
    params: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, text: str) -> RuleSpec:
        text = text.strip()
        name, _, rest = text.partition(":")
        name = name.strip()
        if name not in RULES:
            raise RuleSpecError(f"unknown rule {name!r}; known rules: {', '.join(sorted(RULES))}")
        info = RULES[name]
        params: dict[str, float] = {}
        if rest.strip():
            for item in rest.split(","):
                key, eq, val = item.partition("=")
                key = key.strip()
                if not eq:
                    raise RuleSpecError(f"rule parameter {item!r} in {text!r} must look like name=value")
                if key not in info.defaults:
                    known = ", ".join(sorted(info.defaults)) or "none"
                    raise RuleSpecError(f"rule {name!r} has no parameter {key!r} (parameters: {known})")
                try:
                    value = float(val)
                except ValueError:
                    raise RuleSpecError(f"rule parameter {key!r} in {text!r}: {val!r} is not a number") from None
                # a spec often comes from the wire (HELLO.rule): nan, inf or a value outside the rule's
                # range would make the rule accept anything, or nothing, without saying so
                if not math.isfinite(value):
                    raise RuleSpecError(
                        f"rule parameter {key!r} in {text!r} must be a finite number, got {val.strip()!r}"
                    )
                low, high = info.bounds.get(key, (-math.inf, math.inf))
                if not low <= value <= high:
                    raise RuleSpecError(
                        f"rule parameter {key!r} in {text!r} must be in [{low:g}, {high:g}], got {value:g}"
                    )
                params[key] = value
        return cls(name, tuple(sorted(params.items())))

    @property
    def info(self) -> RuleInfo:
        return RULES[self.name]

    def kwargs(self) -> dict[str, float]:
        out = dict(self.info.defaults)
        out.update(dict(self.params))
        return out

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v:g}" for k, v in self.params)


def template_accept(x, q, pi_rej):  # x: int[n]; q, pi_rej: [n, V] -> [n]
    """Probability of accepting draft x at each row: min(1, pi_rej(x)/q(x)), 0 where pi_rej(x) = 0.

    q(x) = 0 cannot happen for a token the drafter sampled; it counts as "always accept if pi_rej(x) > 0".
    """
    xp = namespace(q, pi_rej)
    r = rows_of(xp, pi_rej)
    px, qx = pi_rej[r, x], q[r, x]  # [n], [n]
    ratio = xp.where(qx > 0, xp.clip(px / xp.where(qx > 0, qx, 1.0), max=1.0), 1.0)
    return xp.where(px > 0, ratio, 0.0)


RESIDUAL_FLOOR = 1e-12  # a residual with less mass than this is rounding noise (float64; float32: 256 ulps of 1)


def residual(pi_res, q):  # pi_res, q: [n, V] -> [n, V], unnormalised
    """The law of the token emitted after a rejection: norm(max(0, pi_res - q)), left unnormalised.

    Where pi_res == q up to rounding (mass <= RESIDUAL_FLOOR, or 256 ulps of 1 in float32) a rejection
    has probability ~0 and the residual is rounding noise: the row is then pi_res itself, its limit.
    """
    xp = namespace(pi_res, q)
    r = xp.clip(pi_res - q, min=0.0)
    mass = xp.sum(r, axis=-1, keepdims=True)  # [n, 1]
    live = mass > max(RESIDUAL_FLOOR, 256 * float(xp.finfo(r.dtype).eps))  # [n, 1]
    if bool(xp.all(live)):  # the usual case: r itself, without a pass over the rows to pick it
        return r
    return xp.where(live, r, pi_res)


def template_verify(
    draft: np.ndarray,  # int[k]
    q: np.ndarray,  # [k, V]
    pi_rej: np.ndarray,  # [k, V] acceptance target: accept x with prob min(1, pi_rej(x)/q(x))
    pi_res: np.ndarray,  # [k, V] residual base: on rejection sample from norm(max(0, pi_res - q))
    pi_bonus: np.ndarray,  # [V] bonus distribution after a full accept
    rng: np.random.Generator,
) -> tuple[int, int]:
    """The general template (Xia et al. 2026; docs/research/rules.md) that strict and the relaxed rules share:
    one u per position, accept iff u < `template_accept`, else emit a sample of `residual`."""
    k = len(draft)
    accept = template_accept(np.asarray(draft, dtype=np.int64), q, pi_rej) if k else np.empty(0)  # [k]
    for i in range(k):
        u = rng.random()
        if u < accept[i]:
            continue
        return i, residual_sample(pi_res[i], q[i], rng)
    return k, sample(pi_bonus, rng)


def residual_sample(pi: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> int:  # pi, q: [V]
    r = residual(pi[None, :], q[None, :])[0]  # [V]
    return sample(r / r.sum(), rng)


def verify_block(
    rule: str | RuleSpec,
    draft: np.ndarray,  # int[k]
    q: np.ndarray | None,  # [k, V] or None
    p: np.ndarray,  # [k+1, V]
    rng: np.random.Generator,
    **params: float,
) -> tuple[int, int]:
    """Verify one draft block with a rule; returns (accepted, next_token). See the module docstring."""
    spec = rule if isinstance(rule, RuleSpec) else RuleSpec.parse(rule)
    info = spec.info
    draft = np.asarray(draft, dtype=np.int64)
    p = np.asarray(p, dtype=np.float64)
    k = len(draft)
    if p.ndim != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must have shape [k+1, V] = [{k + 1}, V], got {p.shape}")
    if info.needs_q:
        if q is None:
            raise ValueError(f"rule {spec.name!r} needs the drafter distribution q")
        q = np.asarray(q, dtype=np.float64)
        if q.shape != (k, p.shape[1]):
            raise ValueError(f"q must have shape [k, V] = [{k}, {p.shape[1]}], got {q.shape}")
    kwargs = spec.kwargs()
    kwargs.update(params)
    return info.fn(draft, q, p, rng, **kwargs)


RuleCallable = Callable[..., tuple[int, int]]
