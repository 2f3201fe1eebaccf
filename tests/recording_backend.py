"""A memory store backend that records the namespace each chunk put names (for the tests of
what the connector and the store client tag their puts with)."""

from __future__ import annotations

from pdserve.store.api import ChunkNamespace
from pdserve.store.memory import MemoryBackend


class Recording(MemoryBackend):
    """The memory backend that keeps the namespace each chunk put named."""

    carries_chunk_meta = True

    def __init__(self) -> None:
        super().__init__()
        self.namespaces: list[ChunkNamespace | None] = []

    def batch_put(self, items, options=None, *, meta=None, namespace=None):
        self.namespaces.append(namespace)
        return super().batch_put(items, options)
