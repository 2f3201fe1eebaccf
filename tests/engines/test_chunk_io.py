"""The engine-store seam (pdserve.engines.chunk_io) over the real in-memory backend: the
production chunk codec, one batched put with no exists, and the failure policy."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve import errors, hashing, kvformat
from pdserve.engines.chunk_io import ChunkIO
from pdserve.store.api import kv_error
from pdserve.store.memory import MemoryBackend
from pdserve.telemetry import REGISTRY
from pdserve.v1 import kvstore_pb2

FP = hashing.ModelFingerprint(model_id="m", kv_dtype="float32", chunk_size=4)


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 3, 4, 8, generator=torch.Generator().manual_seed(seed))


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Flaky(MemoryBackend):
    """The memory backend that raises ``error`` from every call while it is set, counts the
    calls that reached it, and refuses ``exists`` (ChunkIO must never ask before a put)."""

    def __init__(self) -> None:
        super().__init__()
        self.error: Exception | None = None
        self.calls = 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error

    def batch_put(self, items, options=None):
        self._maybe_fail()
        return super().batch_put(items, options) if options else super().batch_put(items)

    def batch_get(self, keys):
        self._maybe_fail()
        return super().batch_get(keys)

    def longest_prefix(self, keys):
        self._maybe_fail()
        return super().longest_prefix(keys)

    def exists(self, keys):
        raise AssertionError("ChunkIO asked exists()")


def test_chunks_round_trip_through_the_codec_and_saves_skip_what_is_stored() -> None:
    store = Flaky()
    io = ChunkIO(store, FP)
    keys = [f"k{i}" for i in range(3)]
    written = metric("pdserve_kv_chunks_written_total", kind="chunk")
    assert io.save([(keys[0], chunk(0)), (keys[1], chunk(1))]) == 2
    assert io.save([(keys[1], chunk(1)), (keys[2], chunk(2))]) == 1  # k1 skipped by the store
    assert metric("pdserve_kv_chunks_written_total", kind="chunk") - written == 3
    # bytes in the store are the production chunk format under this fingerprint and key
    _, kv = kvformat.decode(store.objects["k2"], FP.digest(), key="k2")
    assert torch.equal(kv, chunk(2))
    assert io.lookup(keys) == 3 and io.lookup(["k0", "nope", "k2"]) == 1
    assert all(torch.equal(a, chunk(i)) for i, a in enumerate(io.load_prefix(keys)))
    # a corrupt chunk is a miss that ends the prefix
    data = bytearray(store.objects["k1"])
    data[-3] ^= 0xFF
    store.objects["k1"] = bytes(data)
    assert [t is None for t in io.get(keys)] == [False, True, False]
    assert len(io.load_prefix(keys)) == 1
    # another fingerprint's reader never decodes these bytes
    other = ChunkIO(
        store, hashing.ModelFingerprint(model_id="m2", kv_dtype="float32", chunk_size=4)
    )
    assert other.get(["k0"]) == [None]


def test_a_tail_is_saved_with_its_ttl_and_expires() -> None:
    store = MemoryBackend()
    io = ChunkIO(store, FP)
    assert io.save([("tail", chunk(3)[:, :, :, :2])], ttl_ms=50) == 1
    assert io.has("tail")
    time.sleep(0.08)
    assert not io.has("tail") and "tail" not in store.objects


def test_compressed_chunks_are_stored_in_the_fingerprints_encoding() -> None:
    fp8 = hashing.ModelFingerprint(
        model_id="m", kv_dtype="float32", chunk_size=64, kv_compression="fp8"
    )
    kv = torch.randn(2, 2, 3, 64, 8, generator=torch.Generator().manual_seed(5))
    store = MemoryBackend()
    io = ChunkIO(store, fp8)
    io.save([("k", kv)])
    assert len(store.objects["k"]) < kvformat.encoded_size(tuple(kv.shape), torch.float32) / 3
    (back,) = io.get(["k"])
    assert back is not None and back.dtype == torch.float32
    assert (back - kv).abs().max() < 0.1 * kv.abs().max()


def test_an_unreachable_store_is_paused_with_doubling_backoff_then_resumed() -> None:
    store, clock = Flaky(), Clock()
    io = ChunkIO(store, FP, backoff_s=2.0, max_backoff_s=5.0, clock=clock)
    io.save([("k0", chunk(0))])
    errors_before = metric("pdserve_kv_store_errors_total", op="lookup")
    store.error = errors.Unavailable("master down (test)")
    assert io.lookup(["k0"]) == 0  # the error is a miss
    assert metric("pdserve_kv_store_errors_total", op="lookup") - errors_before == 1
    calls = store.calls
    # paused: nothing reaches the store, every answer is a miss
    assert io.lookup(["k0"]) == 0 and io.get(["k0"]) == [None]
    assert io.save([("k1", chunk(1))]) == 0 and not io.available()
    assert store.calls == calls
    clock.now += 2.0
    assert io.lookup(["k0"]) == 0  # still down: the pause doubles (4 s)
    clock.now += 3.9
    assert not io.available()
    clock.now += 0.2
    store.error = None
    assert io.lookup(["k0"]) == 1  # back: a success resets the pause
    store.error = errors.Unavailable("down again (test)")
    io.lookup(["k0"])
    clock.now += 2.0
    assert io.available()


@pytest.mark.parametrize(
    "error",
    [
        errors.ResourceExhausted("no space (test)"),
        errors.InvalidArgument("bad (test)"),
        # a master that has just taken over, its nodes not remounted yet: it answers
        kv_error(kvstore_pb2.KV_NOT_ENOUGH_NODES, "put of 'k0'", "0 nodes alive (test)"),
    ],
)
def test_errors_that_are_not_the_store_being_down_do_not_pause_it(error) -> None:
    store = Flaky()
    io = ChunkIO(store, FP, clock=Clock())
    store.error = error
    assert io.save([("k0", chunk(0))]) == 0
    assert io.available()
    store.error = None
    assert io.save([("k0", chunk(0))]) == 1


def test_write_mode_wait_loads_chunks_as_they_land_and_stops_on_an_error() -> None:
    store = Flaky()
    io = ChunkIO(store, FP)
    keys = ["a", "b", "c"]
    io.save([("a", chunk(0))])
    got: list[torch.Tensor | None] = []

    def load(start: int, end: int) -> int:
        batch = io.get(keys[start:end])
        got.extend(batch)
        if len(got) == 1:  # "b" lands while "a" is being loaded
            io.save([("b", chunk(1))])
        return sum(t is not None for t in batch)

    assert io.load_as_landed(keys, 100, load) == 2  # "c" never lands: given up after 100 ms
    assert [torch.equal(t, chunk(i)) for i, t in enumerate(got)] == [True, True]
    store.error = errors.Unavailable("down (test)")
    assert io.load_as_landed(keys, 100, load) == 0 and not io.available()
