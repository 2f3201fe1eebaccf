"""The data-plane transport interface: how a client moves an object's bytes to and from a
replica on a storage node, and how a node serves them.

One file per implementation (shm.py, tcp.py, mooncake.py). Payload bytes never travel in
protobuf messages; the master only hands out :class:`~pdserve.v1.kvstore_pb2.Replica`
locations (segment id, offset, size, endpoints).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.store.segment import SegmentMemory
from pdserve.v1 import kvstore_pb2

T = TypeVar("T")
R = TypeVar("R")


class TransportError(Exception):
    """A transfer failed (node unreachable, rejected request, short transfer). The client
    treats it as "this replica is unusable" and tries the next one; it never means the
    bytes of other objects were touched."""


class Transport(ABC):
    """Client side of a transport. Implementations are thread-safe: one instance serves every
    thread of a :class:`~pdserve.store.client.StoreClient`."""

    #: "shm" | "tcp" | "mooncake"
    name: str
    #: The proto enum value this transport serves.
    kind: int

    def endpoint(self, replica: kvstore_pb2.Replica) -> kvstore_pb2.Endpoint | None:
        """The replica's endpoint for this transport, or None. Must not do I/O."""
        for ep in replica.endpoints:
            if ep.transport == self.kind:
                return ep
        return None

    def usable(self, replica: kvstore_pb2.Replica) -> bool:
        """True when this transport can reach ``replica`` from here (cheap; no transfer)."""
        return self.endpoint(replica) is not None

    @abstractmethod
    def write(self, replica: kvstore_pb2.Replica, data: memoryview) -> None:
        """Writes ``data`` (exactly ``replica.size`` bytes) at the replica's offset.

        Raises :class:`TransportError` on failure; a partial write may have happened, so the
        caller must revoke the put. Never writes outside the replica's range."""

    @abstractmethod
    def read_into(self, replica: kvstore_pb2.Replica, buf: memoryview) -> None:
        """Reads the replica's ``replica.size`` bytes into ``buf[:replica.size]`` (``buf``
        must be writable and at least that long). Raises :class:`TransportError` on failure
        (contents of ``buf`` are then undefined)."""

    def read_many(
        self, items: Sequence[tuple[kvstore_pb2.Replica, memoryview]]
    ) -> list[TransportError | None]:
        """Reads each replica into its buffer; returns each item's error (None = read).
        Transports that can batch (tcp: one request per node) override this."""
        return _each(self.read_into, items)

    def write_many(
        self, items: Sequence[tuple[kvstore_pb2.Replica, memoryview]]
    ) -> list[TransportError | None]:
        """Writes each buffer into its replica; returns each item's error (None = written).
        Transports that can batch (tcp: one request per node) override this."""
        return _each(self.write, items)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections and mappings. Idempotent."""


class TransportServer(ABC):
    """Node side of a transport: serves a node's segments to remote clients."""

    name: str

    @abstractmethod
    def start(self, segments: Sequence[SegmentMemory]) -> None:
        """Starts serving ``segments`` (called once, before the node mounts them)."""

    @abstractmethod
    def endpoint(self, segment: SegmentMemory, host_id: str) -> kvstore_pb2.Endpoint:
        """The endpoint the node advertises for ``segment`` when it mounts it."""

    def set_data_key(self, segment_id: str, key: bytes) -> None:  # noqa: B027 - optional hook
        """Called with the data key the master sent for ``segment_id`` in each mount answer
        (:mod:`pdserve.store.grants`; b"" = data tokens off: serve any in-bounds range). A
        transport that checks requests (tcp) refuses every request on a segment until the
        first call; one that cannot (shm, mooncake) ignores it."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Stops serving and releases sockets / registrations. Idempotent."""

    @property
    def bytes_read(self) -> int:
        """Payload bytes served to readers since start (0 where the transport cannot see it)."""
        return 0

    @property
    def bytes_written(self) -> int:
        """Payload bytes received from writers since start."""
        return 0


def check_range(replica: kvstore_pb2.Replica, length: int, what: str) -> None:
    """Raises TransportError when a read buffer of ``length`` bytes cannot hold the replica."""
    if length < replica.size:
        raise TransportError(f"{what}: buffer of {length} bytes for a {replica.size}-byte object")


def check_write(replica: kvstore_pb2.Replica, length: int) -> None:
    """Raises TransportError unless a write of ``length`` bytes is exactly the replica."""
    if length != replica.size:
        raise TransportError(f"write of {length} bytes into a {replica.size}-byte replica")


def balanced_groups(items: Sequence[T], sizes: Sequence[int], groups: int) -> list[list[T]]:
    """``items`` cut into at most ``groups`` consecutive groups of about equal total size
    (``sizes[i]`` is the size of ``items[i]``), for transfers split over threads."""
    total = sum(sizes)
    out: list[list[T]] = [[]]
    done = 0
    for item, size in zip(items, sizes, strict=True):
        if out[-1] and done >= total * len(out) / groups:
            out.append([])
        out[-1].append(item)
        done += size
    return out


class TransferThreads:
    """Runs the parts of one transfer at once: the first on the caller's thread, the others
    on a pool started at first use (socket I/O and numpy copies release the GIL)."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers = workers
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, jobs: Sequence[Callable[[], R]]) -> list[R]:
        """Each job's result, in order; a job's exception propagates after all finished."""
        if len(jobs) == 1:
            return [jobs[0]()]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._name)
            pool = self._pool
        others = [pool.submit(job) for job in jobs[1:]]
        try:
            first = jobs[0]()
        finally:
            rest = [f.result() for f in others]
        return [first, *rest]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None


def _each(
    op: Callable[[kvstore_pb2.Replica, memoryview], None],
    items: Sequence[tuple[kvstore_pb2.Replica, memoryview]],
) -> list[TransportError | None]:
    """``op`` on every item in turn; each item's TransportError, or None."""
    out: list[TransportError | None] = []
    for replica, buf in items:
        try:
            op(replica, buf)
            out.append(None)
        except TransportError as exc:
            out.append(exc)
    return out
