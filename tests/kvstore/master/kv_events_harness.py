"""A real master and node publishing KV events, for the KV event tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve import procs
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.store import open_store
from pdserve.store.api import ChunkMeta, StoreBackend


@contextlib.contextmanager
def kv_events_store(log_dir: Path, **master_flags: str) -> Iterator[tuple]:
    """(master process, store client) of a master publishing over ZMQ (topic ``kv``) and
    ``master_flags``, and one node."""
    flags = {
        "state_dir": "",
        "kv_events_endpoint": "tcp://127.0.0.1:*",
        "kv_events_topic": "kv",
        **master_flags,
    }
    with procs.local_store(log_dir, segment_size="32MiB", master_flags=flags) as (master, _node):
        client = open_store(master.info["grpc"])
        try:
            yield master, client
        finally:
            client.close()


def put_chunks(client: StoreBackend, keys: list[str], meta: dict[str, ChunkMeta] | None) -> None:
    assert all(client.batch_put([(k, b"x" * 100) for k in keys], meta=meta))


def ready_subscriber(ctx, master, client: StoreBackend, fp: ModelFingerprint, marker: int):
    """A ZMQ SUB socket on ``master``'s KV events (topic ``kv``) that receives them: a PUB drops
    what it sends before the subscription reaches it, so chunks (tokens ``marker`` x3 and a
    count) are put until one event lands; what came then is drained."""
    import zmq

    sub = ctx.socket(zmq.SUB)
    sub.connect(master.info["kv_events"])
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        probe, deadline = 0, time.monotonic() + 20
        while not sub.poll(200):
            assert time.monotonic() < deadline, "no KV event reached the ZMQ subscriber"
            probe += 1
            put_chunks(client, chunk_keys(fp, [marker, marker, marker, probe]), None)
        while sub.poll(200):
            sub.recv_multipart()
    except BaseException:
        sub.close(linger=0)
        raise
    return sub
