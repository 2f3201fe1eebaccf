"""Which worker has seen which prompt prefix: an approximate map of the workers' own local
prefix caches (vLLM's paged-block cache), kept by the router from its own routing decisions.

The pooled store lets every worker load any stored prefix, but a prefix still in a worker's
local cache costs nothing at all; this map lets placement prefer that worker when the loads
are otherwise close. Bounded (LRU over chunk keys); stale entries cost a slightly worse
choice, never a wrong answer. Keys are the requests' chain keys, which a cache salt changes
(:func:`pdserve.hashing.chain_root`), as it changes the workers' own block hashes: a tenant's
prefix attracts only that tenant's requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixAffinity:
    def __init__(self, max_keys: int = 200_000) -> None:
        self.max_keys = max_keys
        self._owners: OrderedDict[str, set[str]] = OrderedDict()

    def record(self, worker_id: str, keys: Sequence[str]) -> None:
        """``worker_id`` now holds the prefix ``keys`` (chain keys, in prompt order)."""
        for key in keys:
            owners = self._owners.get(key)
            if owners is None:
                self._owners[key] = {worker_id}
            else:
                owners.add(worker_id)
                self._owners.move_to_end(key)
        while len(self._owners) > self.max_keys:
            self._owners.popitem(last=False)

    def longest(self, worker_id: str, keys: Sequence[str]) -> int:
        """How many leading ``keys`` ``worker_id`` is believed to hold."""
        n = 0
        for key in keys:
            owners = self._owners.get(key)
            if owners is None or worker_id not in owners:
                break
            n += 1
        return n

    def forget(self, worker_id: str) -> None:
        for owners in self._owners.values():
            owners.discard(worker_id)

    def __len__(self) -> int:
        return len(self._owners)
