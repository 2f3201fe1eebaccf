"""Fixtures for the engine unit tests: an in-memory store with the StoreClient's chunk
methods, the tiny model, and a plain Hugging Face greedy loop as ground truth."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from pdserve import kvformat
from pdserve.errors import Unavailable


class MemoryStore:
    """Same methods and semantics as pdserve.store.client.StoreClient (the parts engines use):
    chunks are real kvformat bytes, verified on read; corrupt bytes are a miss. Counts reads
    and writes so tests can prove what was loaded."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.reads: list[str] = []
        self.writes: list[str] = []
        self.corrupt_reads = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise Unavailable("memory store is down (test)")

    def put(self, key: str, data: bytes, options: object = None) -> bool:
        self._check()
        with self.lock:
            if key in self.objects:
                return False
            self.objects[key] = bytes(data)
            self.writes.append(key)
            return True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        return [k in self.objects for k in keys]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        self._check()
        n = 0
        for k in keys:
            if k not in self.objects:
                break
            n += 1
        return n

    def put_chunk(
        self, key: str, kv: torch.Tensor, fingerprint: bytes, options: object = None
    ) -> bool:
        return self.put(key, kvformat.encode(kv, fingerprint, key), options)

    def batch_get_chunks(
        self, keys: Sequence[str], fingerprint: bytes
    ) -> list[torch.Tensor | None]:
        self._check()
        out: list[torch.Tensor | None] = []
        for k in keys:
            data = self.objects.get(k)
            self.reads.append(k)
            if data is None:
                out.append(None)
                continue
            try:
                out.append(kvformat.decode(bytearray(data), fingerprint, key=k)[1])
            except kvformat.ChunkFormatError:
                self.corrupt_reads += 1
                out.append(None)
        return out

    def get_chunk(self, key: str, fingerprint: bytes) -> torch.Tensor | None:
        return self.batch_get_chunks([key], fingerprint)[0]

    def corrupt(self, key: str, offset: int = -100) -> None:
        data = bytearray(self.objects[key])
        data[offset] ^= 0xFF
        self.objects[key] = bytes(data)


@pytest.fixture
def memory_store() -> MemoryStore:
    return MemoryStore()
