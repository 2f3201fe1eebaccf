"""The store client API against real processes, for both backends: pdserve's own store
(master + two nodes) and a Mooncake Store cluster (mooncake_master + a storage process)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdserve import errors
from pdserve.store import open_store
from pdserve.store.api import StoreBackend, StoreOptions

FP = bytes(range(32))


def _blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(params=["pdserve", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store(request) -> Iterator[StoreBackend]:
    if request.param == "pdserve":
        cluster = request.getfixturevalue("cluster")
        s = open_store(cluster.address, backend="pdserve")
    else:
        mc = request.getfixturevalue("mooncake_cluster")
        s = open_store(mc.address, backend="mooncake")
    yield s
    s.close()


def _key(name: str) -> str:
    return f"{name}-{os.getpid()}-{np.random.default_rng().integers(1 << 40)}"


@pytest.mark.slow
def test_client_put_get_roundtrip(store: StoreBackend) -> None:
    k = _key("rt")
    data = _blob(300_001, 1)
    assert store.get(k) is None
    assert store.put(k, data) is True
    assert store.put(k, _blob(10, 2)) is False  # immutable: the second put is a no-op
    assert store.get(k) == data
    assert store.exists([k, _key("absent")]) == [True, False]
    # Our own read leases do not block our removal.
    assert store.remove([k]) == 1
    assert store.get(k) is None


@pytest.mark.slow
def test_client_get_into(store: StoreBackend) -> None:
    k = _key("into")
    data = _blob(4 * 1024 * 1024 + 3, 3)
    store.put(k, memoryview(data))
    buf = bytearray(len(data) + 100)
    assert store.get_into(k, memoryview(buf)) == len(data)
    assert bytes(buf[: len(data)]) == data
    with pytest.raises(errors.InvalidArgument, match="smaller"):
        store.get_into(k, memoryview(bytearray(10)))
    with pytest.raises(errors.InvalidArgument, match="writable"):
        store.get_into(k, memoryview(b"x" * len(data)))
    assert store.get_into(_key("absent"), memoryview(buf)) is None


@pytest.mark.slow
def test_client_batched_ops(store: StoreBackend) -> None:
    items = [(_key(f"b{i}"), _blob(1 + i * 40_000, 10 + i)) for i in range(6)]
    assert store.batch_put(items) == [True] * 6
    assert store.batch_put([*items[:2], (_key("new"), b"n")]) == [False, False, True]
    missing = _key("absent")
    got = store.batch_get([items[3][0], missing, items[0][0], items[5][0]])
    assert got == [items[3][1], None, items[0][1], items[5][1]]
    assert store.remove([items[1][0], missing]) == 1
    assert store.exists([k for k, _ in items[:3]]) == [True, False, True]


@pytest.mark.slow
def test_client_batch_get_into(store: StoreBackend) -> None:
    items = [(_key(f"bi{i}"), _blob(1 + i * 300_000, 20 + i)) for i in range(4)]
    store.batch_put(items)
    missing = _key("absent")
    keys = [items[2][0], missing, items[0][0], items[3][0]]
    bufs = [bytearray(1_000_000) for _ in keys]
    got = store.batch_get_into(keys, [memoryview(b) for b in bufs])
    assert got == [len(items[2][1]), None, 1, len(items[3][1])]
    assert bytes(bufs[0][: got[0]]) == items[2][1]
    assert bytes(bufs[3][: got[3]]) == items[3][1]
    with pytest.raises(errors.InvalidArgument, match="2 keys but 1 buffers"):
        store.batch_get_into(keys[:2], [memoryview(bufs[0])])
    # A buffer too small for its object refuses the whole call before reading, and leaves
    # no lease behind that would block removal.
    small = [memoryview(bytearray(1_000_000)), memoryview(bytearray(10))]
    with pytest.raises(errors.InvalidArgument, match="smaller"):
        store.batch_get_into([items[0][0], items[3][0]], small)
    assert store.remove([items[3][0]]) == 1


@pytest.mark.slow
def test_client_longest_prefix(store: StoreBackend) -> None:
    keys = [_key(f"chain{i}") for i in range(64)]
    assert store.longest_prefix(keys) == 0
    store.batch_put([(k, b"c" * 64) for k in keys[:40]])
    assert store.longest_prefix(keys) == 40
    store.put(keys[50], b"c")  # a later key alone does not extend the prefix
    assert store.longest_prefix(keys) == 40
    assert store.remove([keys[10]]) == 1
    assert store.longest_prefix(keys) == 10
    assert store.longest_prefix([]) == 0


@pytest.mark.slow
def test_client_chunks(store: StoreBackend) -> None:
    kv = torch.randn(2, 2, 3, 16, 8)
    k = _key("chunk")
    assert store.put_chunk(k, kv, FP)
    back = store.get_chunk(k, FP)
    assert back is not None and torch.equal(back, kv)
    assert store.get_chunk(k, bytes(32)) is None  # another model's fingerprint: a miss
    raw = _key("notachunk")
    store.put(raw, b"definitely not a chunk" * 10)
    assert store.batch_get_chunks([raw, k, _key("absent")], FP)[1] is not None
    assert store.batch_get_chunks([raw], FP) == [None]


@pytest.mark.slow
def test_client_rejects_bad_input(store: StoreBackend) -> None:
    with pytest.raises(errors.InvalidArgument):
        store.put("", b"x")
    with pytest.raises(errors.InvalidArgument):
        store.put(_key("empty"), b"")
    with pytest.raises(errors.InvalidArgument):
        store.put(_key("bad"), 12345)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        store.exists("not-a-list")
    with pytest.raises(errors.InvalidArgument):
        store.put(_key("r"), b"x", StoreOptions(replicas=0))
