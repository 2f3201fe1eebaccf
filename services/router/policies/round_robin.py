"""Round robin over the workers in rotation."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.services.router.policies.base import PrefillPolicy, RouteContext
from pdserve.services.router.workers import Worker


class RoundRobin(PrefillPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        ordered = sorted(workers, key=lambda w: w.id)
        w = ordered[self._next % len(ordered)]
        self._next += 1
        return w
