"""Least load by the power of two choices: sample two workers, take the less loaded one."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdserve.services.router.policies.base import PrefillPolicy, RouteContext
from pdserve.services.router.workers import Worker


class LeastLoad(PrefillPolicy):
    name = "least_load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if (a.load, a.inflight_tokens) <= (b.load, b.inflight_tokens) else b
