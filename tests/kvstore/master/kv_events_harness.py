"""A real master and node publishing KV events, for the KV event tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from pdserve import procs
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
