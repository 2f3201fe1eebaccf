"""Fixtures for the engine unit tests: the in-memory store backend with test counters, the tiny model, and a plain Hugging Face greedy loop as ground truth."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from pdserve.engines.config import EngineConfig
from pdserve.engines.torch_engine.engine import TorchEngine
from pdserve.errors import Unavailable
from pdserve.store.api import DEFAULT_OPTIONS
from pdserve.store.memory import MemoryBackend


class MemoryStore(MemoryBackend):
    """The production in-memory backend (so chunks go through the real codec: encoded on put,
    verified and decoded on read, a corrupt one a miss) with what tests need on top: the
    keys read and written in order, corrupt reads counted, and a switch that makes every
    operation fail as an unreachable store does."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.writes: list[str] = []
        self.corrupt_reads = 0
        self.down = False
        self._read = threading.local()  # what this thread's last batch_get returned

    def _check(self) -> None:
        if self.down:
            raise Unavailable("memory store is down (test)")

    def batch_put(self, items, options=DEFAULT_OPTIONS) -> list[bool]:
        self._check()
        written = super().batch_put(items, options)
        self.writes.extend(k for (k, _), new in zip(items, written, strict=True) if new)
        return written

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._check()
        self.reads.extend(keys)
        self._read.data = super().batch_get(keys)
        return self._read.data

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        return super().exists(keys)

    def batch_get_chunks(self, keys, fingerprint, *, arena=None) -> list[torch.Tensor | None]:
        out = super().batch_get_chunks(keys, fingerprint)  # reads through batch_get
        read = self._read.data
        self.corrupt_reads += sum(
            d is not None and t is None for d, t in zip(read, out, strict=True)
        )
        return out

    def corrupt(self, key: str, offset: int = -100) -> None:
        data = bytearray(self.objects[key])
        data[offset] ^= 0xFF
        self.objects[key] = bytes(data)


@pytest.fixture
def memory_store() -> MemoryStore:
    return MemoryStore()


#: Chunk size of the shared torch engine below (test modules key prompts with it).
CS = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Iterator[TorchEngine]:
    """A started torch engine on the tiny model, one per test module."""
    eng = TorchEngine(EngineConfig(model=str(tiny_model_dir), chunk_size=CS, max_model_len=256))
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
def eng(engine: TorchEngine, memory_store) -> TorchEngine:
    """The engine on a fresh in-memory store."""
    engine.attach_store(memory_store)
    return engine
