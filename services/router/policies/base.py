"""The interface of a prefill routing policy."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.services.router.workers import Worker


@dataclass(frozen=True)
class RouteContext:
    """What a policy knows about the request being placed."""

    prompt_tokens: int
    #: Prompt tokens whose KV the store already holds (from its longest-prefix answer).
    cached_tokens: int

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
