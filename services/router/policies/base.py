"""The interface of a prefill routing policy."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.services.router.workers import Worker


@dataclass(frozen=True)
class RouteContext:
    """What a policy knows about the request being placed."""

    prompt_tokens: int
    #: Prompt tokens whose KV the store already holds (from its longest-prefix answer).
    cached_tokens: int
    #: The prompt and its cache salt, for the engines' own prefix caches
    #: (:class:`~pdserve.services.router.engine_events.EngineCaches`).
    token_ids: Sequence[int] = field(default=(), repr=False)
    cache_salt: str = ""

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class PrefillPolicy(abc.ABC):
    """Chooses the prefill worker for one request.

    Contract: ``choose`` gets a non-empty list of workers in rotation, returns one of them,
    never blocks and never mutates the workers (the orchestrator does the accounting).
    """

    name: str

    @abc.abstractmethod
    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker: ...


class PickOrder:
    """The tie-break of the cost policies: among equals, the worker picked longest ago (one
    never picked first). Unlike a count of picks, it does not remember how a worker fell
    behind: a worker that was busy, joined late or restarted gets its turn in the rotation,
    not every tie until its count catches up."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._clock = 0

    def rank(self, worker_id: str) -> int:
        return self._last.get(worker_id, -1)

    def record(self, worker_id: str) -> None:
        self._clock += 1
        self._last[worker_id] = self._clock
