"""The router's memory of /v1/responses answers, for ``previous_response_id``: a bounded map
(at most ``max_stored`` entries, the oldest dropped first, each usable for ``ttl_s`` seconds).
A response created with ``store: false`` is never kept. The memory is the router process's
own: a restarted router, or another router replica, does not know the id (404)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.errors import NotFound


@dataclass(frozen=True)
class Stored:
    """One stored answer: the chat messages that continue it (its input turns and its own
    output turned into messages) and the Responses object itself (GET /v1/responses/{id})."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]
    at: float


class ResponseStore:
    def __init__(
        self,
        max_stored: int = 1000,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_stored < 0 or ttl_s <= 0:
            raise ValueError("responses_max_stored must be >= 0 and responses_ttl_s > 0")
        self.max_stored = max_stored
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        """Keeps ``rid``'s answer, dropping the oldest entries beyond ``max_stored``."""
        self._items[rid] = Stored(messages, response, self._clock())
        self._items.move_to_end(rid)
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str = "previous_response_id") -> Stored:
        """The stored answer ``rid``; NotFound (404 naming ``param``) when it was never stored,
        was dropped, or is older than ``ttl_s``."""
        item = self._items.get(rid)
        if item is not None and self._clock() - item.at > self.ttl_s:
            del self._items[rid]
            item = None
        if item is None:
            raise NotFound(
                f"{param}: no stored response {rid!r:.80} (unknown, created with store: false, "
                f"or past this router's retention of {self.max_stored} responses / "
                f"{self.ttl_s:g} s)",
                param=param,
            )
        return item
