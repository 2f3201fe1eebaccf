"""``pdserve kvstore drop`` through real processes: a master and a node with a disk tier hold
the chunks of two model fingerprints in memory and on disk; dropping one leaves none of its
chunks (the master's stats and listing, BatchExists, the disk tier's use), the other's all,
byte for byte, and a restart of the node brings none of the dropped ones back; ``--salt``
drops one tenant's chunks of a model and none of the model's others."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from pdserve import hashing
from pdserve.engines.chunk_io import ChunkIO
from pdserve.store.client import StoreClient

CHUNK = 16
CHUNKS = 10  # per fingerprint; 128 KiB each
A = hashing.ModelFingerprint(model_id="org/model-a", revision="r1", chunk_size=CHUNK)
B = hashing.ModelFingerprint(model_id="org/model-b", revision="r1", chunk_size=CHUNK)


def _wait(pred, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _chunks(fp: hashing.ModelFingerprint, seed: int) -> tuple[list[str], list[torch.Tensor]]:
    """A prompt's chunk keys under ``fp`` and a KV tensor per chunk."""
    tokens = list(range(seed, seed + CHUNK * CHUNKS))
    keys = hashing.chunk_keys(fp, tokens, "")
    g = torch.Generator().manual_seed(seed)
    return keys, [torch.randn(4, 2, 4, CHUNK, 64, generator=g) for _ in keys]


def _pdserve(*args: str) -> str:
    """Runs the ``pdserve`` CLI; its stdout (a failure fails the test with its stderr)."""
    exe = Path(sys.executable).with_name("pdserve")
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_drop_removes_one_models_chunks_from_memory_and_disk_for_good(
    cluster_factory, tmp_path
) -> None:
    c = cluster_factory(demote_watermark=0.0, inline_max_bytes=0)
    flags = dict(
        node_id=f"drop{uuid.uuid4().hex[:6]}",
        segment_sizes="8MiB",
        transports="tcp",
        disk_path=tmp_path / "disk",
        disk_size="32MiB",
    )
    node = c.add_node(**flags)
    client = StoreClient(c.address, transport="tcp")
    keys_a, kv_a = _chunks(A, 1)
    keys_b, kv_b = _chunks(B, 1)  # the same tokens: only the fingerprint differs
    assert ChunkIO(client, A).save(list(zip(keys_a, kv_a, strict=True))) == CHUNKS
    assert ChunkIO(client, B).save(list(zip(keys_b, kv_b, strict=True))) == CHUNKS
    # every chunk gets a disk copy (demote_watermark 0) and keeps its memory one
    _wait(lambda: client.stats().demotions == 2 * CHUNKS, "every chunk copied to disk")
    before = client.stats()
    assert before.objects == 2 * CHUNKS and before.disk_used_bytes > 0
    listed = {f.labels.get("model_id"): f for f in client.list_namespaces()}
    assert listed["org/model-a"].objects == CHUNKS and listed["org/model-b"].objects == CHUNKS

    dry = _pdserve(
        "kvstore",
        "drop",
        "--model",
        "org/model-a",
        "--dry-run",
        "--master",
        c.address,
        "--run-dir",
        str(tmp_path / "no-up"),
    )
    assert f"would drop {CHUNKS} objects" in dry and A.digest().hex() in dry
    assert client.exists(keys_a) == [True] * CHUNKS
    out = _pdserve(
        "kvstore",
        "drop",
        "--model",
        "org/model-a",
        "--master",
        c.address,
        "--run-dir",
        str(tmp_path / "no-up"),
    )
    assert f"dropped {CHUNKS} objects" in out and "org/model-a r1" in out

    def only_b_left() -> None:
        stats = client.stats()
        assert stats.objects == CHUNKS and stats.dropped_objects == CHUNKS
        # every chunk is the same size: the disk tier holds exactly B's half
        assert stats.disk_used_bytes * 2 == before.disk_used_bytes
        used = {s.tier: s.used for s in stats.segments}
        assert used[0] * 2 == {s.tier: s.used for s in before.segments}[0]
        assert client.exists(keys_a) == [False] * CHUNKS
        assert client.exists(keys_b) == [True] * CHUNKS
        assert [f.labels.get("model_id") for f in client.list_namespaces()] == ["org/model-b"]
        got = client.batch_get_chunks(keys_b, B.digest())
        assert all(g is not None and torch.equal(g, t) for g, t in zip(got, kv_b, strict=True))
        assert client.batch_get_chunks(keys_a, A.digest()) == [None] * CHUNKS

    only_b_left()

    # the node restarts (its disk segment's file kept, its memory new): B's disk copies come
    # back, none of A's
    node.stop()
    again = c.add_node(**flags)
    assert again.info["node_id"] == flags["node_id"]
    _wait(lambda: client.stats().objects == CHUNKS, "B's chunks back from disk")
    stats = client.stats()
    assert stats.objects == CHUNKS and stats.disk_used_bytes * 2 == before.disk_used_bytes
    assert client.exists(keys_a) == [False] * CHUNKS
    got = client.batch_get_chunks(keys_b, B.digest())
    assert all(g is not None and torch.equal(g, t) for g, t in zip(got, kv_b, strict=True))

    # a tenant's chunks of B (its cache salt's chain): --salt drops them alone, the salt
    # computed into chain roots by the CLI, never sent
    salt = "tenant-secret-7"
    tokens = list(range(1, 1 + CHUNK * CHUNKS))
    keys_s = hashing.chunk_keys(B, tokens, salt)
    root = hashing.chain_root(B, salt).hex()
    saved = ChunkIO(client, B).save(
        list(zip(keys_s, kv_b, strict=True)), roots=dict.fromkeys(keys_s, root)
    )
    assert saved == CHUNKS and client.stats().objects == 2 * CHUNKS
    out = _pdserve(
        "kvstore",
        "drop",
        "--model",
        "org/model-b",
        "--salt",
        salt,
        "--master",
        c.address,
        "--run-dir",
        str(tmp_path / "no-up"),
    )
    assert f"dropped {CHUNKS} objects" in out and salt not in out
    assert client.exists(keys_s) == [False] * CHUNKS
    assert client.exists(keys_b) == [True] * CHUNKS
    client.close()
