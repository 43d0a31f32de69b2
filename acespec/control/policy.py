"""The interface of a draft-depth policy (see `depth.py` for the baselines and the factory, `controller.py` for
the controller): `next_k() -> int` before drafting, `update(drafted, accepted, **obs)` after each verdict,
`observe(**obs)` for measurements that come without one.
"""

from __future__ import annotations


class DepthPolicy:
    name = "policy"

    def next_k(self) -> int:
        raise NotImplementedError

    def update(self, drafted: int, accepted: int, **obs: float) -> None:
        pass

    def observe(self, **obs: float) -> None:
        pass
