"""Shared fixtures.

- `real_draft` / `real_target` / `real_pair`: the default GGUF pair, each loaded once per session (llama.cpp),
  skipped with a clear reason when `acespec models install` has not been run. Tests that use them are
  marked `@pytest.mark.real` (deselect with `-m "not real"`).
- `held_transport`: a real in-process, queue-based `Transport` with a verifier thread that holds every
  verdict back until the loop blocks on `recv(None)`, so a pipelined `SpecLoop` keeps its whole window
  in flight (the worst case for stale blocks). Used by the engine and the lossless tests.
"""

from __future__ import annotations

import queue
import threading

import pytest

from acespec.loop.loop import Block, Transport
from acespec.loop.verifier import BlockVerdict, TargetVerifier

# Small context windows keep the KV caches (and load time) small; every real test fits easily.
REAL_N_CTX = 1024


def _load_real(name: str):
    from acespec.models.llama import LlamaCppModel
    from acespec.models.registry import installed_path

    path = installed_path(name)
    if path is None:
        pytest.skip(f"real model {name!r} is not installed; run `acespec models install {name}` to run this test")
    return LlamaCppModel(path, n_ctx=REAL_N_CTX, name=name)


@pytest.fixture(scope="session")
def real_draft():
    from acespec.models.registry import DEFAULT_DRAFT

    m = _load_real(DEFAULT_DRAFT)
    yield m
    m.close()


@pytest.fixture(scope="session")
def real_target():
    from acespec.models.registry import DEFAULT_TARGET

    m = _load_real(DEFAULT_TARGET)
    yield m
    m.close()


@pytest.fixture
def real_pair(real_draft, real_target):
    """(drafter, target) with empty KV caches."""
    real_draft.reset()
    real_target.reset()
    return real_draft, real_target


class HeldVerdictTransport(Transport):
    """Blocks go up a queue to a verifier thread; its verdicts come down another queue, but `recv` with a
    timeout (the loop polling without blocking) never returns one: a verdict is released only when the
    loop blocks (`recv(None)`), i.e. when its window is full. So the target always verifies with the
    maximum number of blocks in flight, and the edge learns outcomes as late as possible."""

    def __init__(self, verifier: TargetVerifier, *, timeout: float = 30.0) -> None:
        self.verifier = verifier
        self.timeout = timeout
        self._up: queue.Queue[Block | None] = queue.Queue()
        self._down: queue.Queue[BlockVerdict | BaseException] = queue.Queue()
        self.sent = 0
        self.polls_refused = 0  # non-blocking recv calls answered with None
        self._thread = threading.Thread(target=self._serve, name="held-verifier", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            block = self._up.get()
            if block is None:
                return
            try:
                self._down.put(self.verifier.verify(block.seq, block.base, list(block.tokens), block.q))
            except BaseException as e:  # surface verifier errors in the test thread
                self._down.put(e)

    def send(self, block: Block) -> None:
        self.sent += 1
        self._up.put(block)

    def recv(self, timeout: float | None = None) -> BlockVerdict | None:
        if timeout is not None:
            self.polls_refused += 1
            return None
        try:
            v = self._down.get(timeout=self.timeout)
        except queue.Empty:
            raise AssertionError(f"no verdict within {self.timeout}s: the verifier thread is stuck") from None
        if isinstance(v, BaseException):
            raise v
        return v

    def close(self) -> None:
        self._up.put(None)
        self._thread.join(timeout=self.timeout)


@pytest.fixture
def held_transport():
    """The `HeldVerdictTransport` class (construct it with a `TargetVerifier`; close it when done)."""
    return HeldVerdictTransport


def run_pipelined(target, prompt, cfg, *, draft=None, window: int = 2, transport_cls=HeldVerdictTransport):
    """Run one generation through a pipelined `SpecLoop` over a `HeldVerdictTransport` (the same pieces
    `generate()` wires up for sync mode). Returns (LoopResult, TargetVerifier, transport)."""
    from acespec.control.depth import make_policy
    from acespec.draft.chain import ChainDrafter
    from acespec.loop.loop import LoopConfig, SpecLoop
    from acespec.models.base import check_compatible

    rule, sp = cfg.rule_spec, cfg.sampling
    verifier = TargetVerifier(
        target, prompt, sampling=sp, rule=rule, seed=cfg.seed, max_tokens=cfg.max_tokens, stop_ids=cfg.stop_ids
    )
    drafter = None
    if cfg.spec and draft is not None:
        check_compatible(draft, target)
        drafter = ChainDrafter(draft, sampling=sp, rule=rule, seed=cfg.seed)
    policy = make_policy(cfg.policy, cfg.k if drafter else 0)
    transport = transport_cls(verifier)
    loop = SpecLoop(
        transport,
        prompt,
        drafter=drafter,
        policy=policy,
        config=LoopConfig(mode="pipelined", window=window, max_tokens=cfg.max_tokens, min_conf=cfg.min_conf),
    )
    try:
        res = loop.run()
    finally:
        transport.close()
    return res, verifier, transport


@pytest.fixture
def pipelined():
    """`run_pipelined(target, prompt, cfg, draft=..., window=...)`: see above."""
    return run_pipelined
