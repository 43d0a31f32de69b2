"""A toy target whose every pass takes time, as a real target's does (shared by the tests that need it).

A toy pass takes microseconds and almost none of it is fixed, so a cloud-led cloud could stream a whole
text before the edge's first DRAFT arrives, and its pricer would rightly find no draft worth its rows.
This one's batched call costs `pass_s` fixed (a GPU's cost shape, whatever its rows) plus `token_s` a
token evaluated (a CPU's: ticks then take long enough to overlap with new arrivals).
"""

from __future__ import annotations

import time

from acespec.models.toy import ToyModel


class PassCostToy(ToyModel):
    def __init__(self, *args, pass_s: float = 0.003, token_s: float = 0.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.pass_s = pass_s  # seconds each batched evaluation takes, whatever it holds
        self.token_s = token_s  # and seconds per token it evaluates

    def _eval_batch(self, items):
        time.sleep(self.pass_s + self.token_s * sum(len(t) for _, t, _ in items))
        return super()._eval_batch(items)
