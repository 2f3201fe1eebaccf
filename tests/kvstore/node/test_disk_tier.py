"""A storage node's disk tier through real processes: objects three times the node's memory
all stay readable (memory evicts only what has a disk copy), every byte read back is the
byte written, a disk-only object read comes back to memory, and a node SIGKILLed and
restarted with its memory gone serves its disk-tier objects again, none wrong."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from pdserve import procs
from pdserve.store import open_store
from pdserve.v1 import kvstore_pb2 as pb

MiB = 1 << 20
SIZE = 512 * 1024


def _blob(i: int) -> bytes:
    return os.urandom(16) + i.to_bytes(4, "little") * ((SIZE - 16) // 4)


def _wait(pred, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_working_set_three_times_memory_lives_on_disk_and_survives_a_node_kill(
    cluster_factory, tmp_path
) -> None:
    c = cluster_factory(demote_watermark=0.25, inline_max_bytes=0)
    node_id = f"disk{uuid.uuid4().hex[:6]}"
    disk = tmp_path / "disk"
    flags = dict(
        node_id=node_id, segment_sizes="4MiB", transports="tcp", disk_path=disk, disk_size="32MiB"
    )
    node = c.add_node(**flags)
    client = open_store(c.address, transport="tcp")
    blobs = {f"obj-{i}": _blob(i) for i in range(24)}  # 12 MiB: 3x the memory segment
    keys = list(blobs)
    for n, key in enumerate(keys, 1):
        assert client.put(key, blobs[key])
        if n % 2 == 0:  # let the mover copy the coldest down before memory fills
            _wait(lambda n=n: client.stats().demotions >= n - 3, "demotions")
    stats = client.stats()
    assert stats.memory_evictions > 0 and stats.evictions == 0
    assert stats.disk_capacity_bytes == 32 * MiB and stats.disk_used_bytes >= 12 * MiB
    tiers = {s.segment_id: s.tier for s in stats.segments}
    assert sorted(tiers.values()) == [pb.STORAGE_TIER_MEMORY, pb.STORAGE_TIER_DISK]
    got = client.batch_get(keys)
    assert [g == blobs[k] for g, k in zip(got, keys, strict=True)] == [True] * len(keys)
    # the first objects were read from disk only: they come back up to memory
    _wait(lambda: client.stats().promotions > 0, "a promotion")
    assert client.get(keys[0]) == blobs[keys[0]]

    # SIGKILL, the node's memory lost with it (as after a reboot), restart on the same disk
    node.kill()
    procs.remove_shm(node)
    again = c.add_node(**flags)
    assert again.info["node_id"] == node_id
    got = client.batch_get(keys)
    wrong = [k for g, k in zip(got, keys, strict=True) if g is not None and g != blobs[k]]
    served = [k for g, k in zip(got, keys, strict=True) if g is not None]
    assert wrong == []
    assert len(served) == len(keys)  # every object had its disk copy
    client.close()
