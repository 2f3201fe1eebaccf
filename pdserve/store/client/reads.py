"""The store client's gets: ``BatchGetReplicaList`` (grants read leases) -> read each
object's best replica, all of a transport's in one batch -> fall over to the other replicas
of an object whose read or check failed -> release the leases (in the background).

A read is handed out only if it ended within its lease and matches the writer's checksum
(KV chunks: their header's checksum, fingerprint and key); anything else is a miss, never an
exception. An object that no replica holds correctly is removed, so its next writer stores
it again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Counter

from pdserve.enums import TRANSPORT
from pdserve.store.api import CORRUPT_CHUNKS
from pdserve.store.client.checksum import checksum
from pdserve.store.client.control import MasterLink
from pdserve.store.client.leases import LeaseReleaser
from pdserve.store.client.routing import ReplicaRoutes
from pdserve.store.transports.base import Transport, TransportError
from pdserve.telemetry import REGISTRY, Relayed, init_labels
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)

READ_FAILOVERS = Relayed(
    "store_read_failovers",
    Counter(
        "pdserve_store_read_failovers_total",
        "reads from a replica (one request, which may carry a batch of objects) that failed, "
        "or objects that failed verification, and moved on to other replicas",
        ["transport"],
        registry=REGISTRY,
    ),
)
init_labels(READ_FAILOVERS, TRANSPORT.choices)

#: ``decode(key, view)``: the value a read hands out, or None when the bytes are wrong.
Decode = Callable[[str, memoryview], Any]
#: ``buffer_for(index, size)``: the buffer the ``index``-th key's object is read into.
BufferFor = Callable[[int, int], memoryview]


class ReadCheck:
    """What a read must pass before it is handed out: it ended within its read lease
    (``deadline``, monotonic: past it the region may hold another object), its bytes match
    the writer's checksum (when one was recorded), and ``decode(key, view)`` accepts them
    (when given). A call returns the view (or the decoded value), or None; ``bad`` collects
    the keys whose bytes were wrong (not merely late)."""

    def __init__(self, deadline: float, decode: Decode | None = None) -> None:
        self.deadline = deadline
        self.decode = decode
        self.bad: set[str] = set()

    def __call__(self, res: kvstore_pb2.ReplicaListResult, view: memoryview) -> Any:
        if time.monotonic() > self.deadline:
            log.warning("read of %r outlived its lease: discarded", res.key)
            return None
        if res.checksum and checksum(view) != res.checksum:
            self.bad.add(res.key)
            return None
        value = view if self.decode is None else self.decode(res.key, view)
        if value is None:
            self.bad.add(res.key)
        return value


class Reads:
    """Gets through ``master``, the transports of ``routes``, and ``leases``."""

    def __init__(
        self, master: MasterLink, routes: ReplicaRoutes, leases: LeaseReleaser, client_id: str
    ) -> None:
        self.master = master
        self.routes = routes
        self.leases = leases
        self.client_id = client_id

    def read(
        self, keys: list[str], buffer_for: BufferFor, decode: Decode | None = None
    ) -> list[Any]:
        """Per key, the checked view of its object in ``buffer_for(index, size)`` (or what
        ``decode`` made of it), or None on a miss: one lookup, the reads, the releases. A
        raise from ``buffer_for`` (before anything is read) releases the leases and goes to
        the caller."""
        results, buffers, deadline = self._lookup(keys, buffer_for)
        try:
            return self._read_all(results, buffers, ReadCheck(deadline, decode))
        finally:
            self.leases.release([r.key for r in results if r.code == kvstore_pb2.KV_OK])

    def replica_lists(self, keys: list[str]) -> list[kvstore_pb2.ReplicaListResult]:
        """Where ``keys`` are, from one master lookup that grants read leases on the found
        ones (give them back with :meth:`LeaseReleaser.release`)."""
        resp = self.master.call(
            "BatchGetReplicaList",
            kvstore_pb2.BatchGetReplicaListRequest(client_id=self.client_id, keys=keys),
        )
        return list(resp.results)

    def _lookup(
        self, keys: list[str], buffer_for: BufferFor
    ) -> tuple[list[kvstore_pb2.ReplicaListResult], list[memoryview | None], float]:
        """Replica lists of ``keys`` (read leases granted), for each found object the buffer
        ``buffer_for(index, size)`` gives, and the monotonic time the leases end (counted
        from before the request). A raise here releases the leases."""
        sent = time.monotonic()
        results = self.replica_lists(keys)
        leases = [r.lease_ms for r in results if r.code == kvstore_pb2.KV_OK]
        deadline = sent + (min(leases) / 1000 if leases else 0.0)
        try:
            buffers = [
                buffer_for(i, res.replicas[0].size)
                if res.code == kvstore_pb2.KV_OK and res.replicas
                else None
                for i, res in enumerate(results)
            ]
        except BaseException:
            self.leases.release([r.key for r in results if r.code == kvstore_pb2.KV_OK])
            raise
        return results, buffers, deadline

    def _read_all(
        self,
        results: Sequence[kvstore_pb2.ReplicaListResult],
        buffers: Sequence[memoryview | None],
        check: ReadCheck,
    ) -> list[Any]:
        """:meth:`_read` of every result into its buffer (None = a miss, not read). The best
        replica of every object is read first in one :meth:`Transport.read_many` per
        transport (tcp: one request per node for the whole batch); an object whose read or
        ``check`` failed then falls over to its other replicas one by one."""
        out: list[Any] = [None] * len(results)
        first: dict[str, list[tuple[int, kvstore_pb2.Replica, memoryview]]] = {}
        transports: dict[str, Transport] = {}
        routes: dict[str, Transport | None] = {}
        for i, (res, buf) in enumerate(zip(results, buffers, strict=True)):
            if buf is None:
                continue
            if res.inline_data:  # kept by the master: no replica to read
                n = len(res.inline_data)
                buf[:n] = res.inline_data
                out[i] = check(res, buf[:n])
                if out[i] is not None:
                    continue
                log.warning("inline copy of %r failed verification; reading a replica", res.key)
            ordered = self.routes.ordered(res.replicas, routes)
            if not ordered:
                continue
            rep, t = ordered[0]
            transports[t.name] = t
            first.setdefault(t.name, []).append((i, rep, buf))
        for name, jobs in first.items():
            t = transports[name]
            errs = t.read_many([(rep, buf) for _i, rep, buf in jobs])
            # One failed request (say, to a dead node) counts once, however many objects
            # it carried.
            for err in {id(e): e for e in errs if e is not None}.values():
                READ_FAILOVERS.labels(t.name).inc()
                log.warning("read from %s failed: %s", t.name, err)
            for (i, rep, buf), err in zip(jobs, errs, strict=True):
                if err is None:
                    out[i] = _verified(check, results[i], buf[: rep.size], rep, t)
                    if out[i] is not None:
                        continue
                else:
                    self.routes.suspect(rep.node_id)
                out[i] = self._read(results[i], buf, check, skip=rep, corrupt=err is None)
        return out

    def _read(
        self,
        res: kvstore_pb2.ReplicaListResult,
        buf: memoryview,
        check: ReadCheck,
        skip: kvstore_pb2.Replica | None = None,
        corrupt: bool = False,
    ) -> Any:
        """Reads one found object from its best replica (other than ``skip``, already
        tried; ``corrupt``: it failed ``check``) into ``buf``, falling over to the others.
        Returns ``check(res, filled view)``, or None when every replica failed (or was
        rejected by the check)."""
        if res.code != kvstore_pb2.KV_OK or not res.replicas:
            return None
        for rep, t in self.routes.ordered(res.replicas):
            if rep is skip:
                continue
            try:
                t.read_into(rep, buf)
            except TransportError as exc:
                self.routes.suspect(rep.node_id)
                READ_FAILOVERS.labels(t.name).inc()
                log.warning(
                    "read of %r from node %s over %s failed: %s", res.key, rep.node_id, t.name, exc
                )
                continue
            value = _verified(check, res, buf[: rep.size], rep, t)
            if value is not None:
                return value
            corrupt = True
        if corrupt and res.key in check.bad:  # wrong bytes, not merely a late read
            CORRUPT_CHUNKS.inc()
            self.leases.discard(res.key)
        return None


def _verified(
    check: ReadCheck,
    res: kvstore_pb2.ReplicaListResult,
    view: memoryview,
    rep: kvstore_pb2.Replica,
    t: Transport,
) -> Any:
    """``check(res, view)``; None when it rejects the bytes (a failover, counted and
    logged)."""
    value = check(res, view)
    if value is None:
        READ_FAILOVERS.labels(t.name).inc()
        log.warning("replica of %r on node %s failed verification", res.key, rep.node_id)
    return value
