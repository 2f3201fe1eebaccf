"""The store client's gets: the locations the client kept from its ``longest_prefix``
(:mod:`.locations`), and ``BatchGetReplicaList`` (grants read leases) for the other keys, in
one master call -> read each object's best replica, all of a transport's in one batch ->
fall over to the other replicas of an object whose read or check failed -> look up again,
once, the keys whose kept location failed -> release the leases of the lookups (in the
background; a kept location's lease stays: the cache relies on it, and it ends by itself).

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

from pdserve import errors, tracing
from pdserve.enums import TRANSPORT
from pdserve.store.api import CORRUPT_CHUNKS
from pdserve.store.client.checksum import checksum
from pdserve.store.client.control import MasterLink
from pdserve.store.client.leases import LeaseReleaser
from pdserve.store.client.locations import Location, LocationCache
from pdserve.store.client.routing import ReplicaRoutes
from pdserve.store.transports.base import Transport, TransportError
from pdserve.telemetry import REGISTRY, Relayed, init_labels
from pdserve.tracing import store_io
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

READ_LOCATIONS = Relayed(
    "store_read_locations",
    Counter(
        "pdserve_store_read_locations_total",
        "keys a get read or looked for, by where their location came from: kept from the "
        "process's longest_prefix answers (cache: no master call), a BatchGetReplicaList "
        "lookup (master), or a second lookup after the read from a kept location failed "
        "(retry: also counted as cache)",
        ["source"],
        registry=REGISTRY,
    ),
)
#: Where a read's location came from (:data:`READ_LOCATIONS`' label).
LOCATION_SOURCES = ("cache", "master", "retry")
init_labels(READ_LOCATIONS, LOCATION_SOURCES)

#: ``decode(key, view)``: the value a read hands out, or None when the bytes are wrong.
Decode = Callable[[str, memoryview], Any]
#: ``buffer_for(index, size)``: the buffer the ``index``-th key's object is read into.
BufferFor = Callable[[int, int], memoryview]


class ReadCheck:
    """What a read must pass before it is handed out: it ended within its read lease
    (``deadlines[key]``, monotonic: past it the region may hold another object), its bytes
    match the writer's checksum (when one was recorded), and ``decode(key, view)`` accepts
    them (when given). A call returns the view (or the decoded value), or None; ``bad``
    collects the keys whose bytes were wrong (not merely late). ``cached``: the keys read
    from kept locations, whose wrong bytes mean a stale location first (looked up again),
    not a corrupt object."""

    def __init__(
        self,
        deadlines: dict[str, float],
        decode: Decode | None = None,
        cached: frozenset[str] = frozenset(),
    ) -> None:
        self.deadlines = deadlines
        self.decode = decode
        self.cached = cached
        self.bad: set[str] = set()

    def __call__(self, res: kvstore_pb2.ReplicaListResult, view: memoryview) -> Any:
        if time.monotonic() > self.deadlines.get(res.key, 0.0):
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
    """Gets through ``master``, the transports of ``routes``, and ``leases``; ``locations``
    (None = none): the locations kept from lookups (:mod:`.locations`)."""

    def __init__(
        self,
        master: MasterLink,
        routes: ReplicaRoutes,
        leases: LeaseReleaser,
        client_id: str,
        locations: LocationCache | None = None,
    ) -> None:
        self.master = master
        self.routes = routes
        self.leases = leases
        self.client_id = client_id
        self.locations = locations

    def read(
        self, keys: list[str], buffer_for: BufferFor, decode: Decode | None = None
    ) -> list[Any]:
        """Per key, the checked view of its object in ``buffer_for(index, size)`` (or what
        ``decode`` made of it), or None on a miss: the kept locations and one lookup of the
        other keys, the reads (all in one batch per transport), one more lookup and read of
        the keys whose kept location failed, the releases. A raise from ``buffer_for``
        (before anything is read) releases the leases and goes to the caller."""
        kept = self.locations.take(keys) if self.locations is not None else [None] * len(keys)
        taken = [k for k, loc in zip(keys, kept, strict=True) if loc is not None]
        try:
            return self._read_kept(keys, kept, buffer_for, decode)
        finally:
            if taken:
                assert self.locations is not None
                self.locations.done(taken)

    def _read_kept(
        self,
        keys: list[str],
        kept: list[Location | None],
        buffer_for: BufferFor,
        decode: Decode | None,
    ) -> list[Any]:
        """:meth:`read`, the kept locations taken (``kept``: per key, its entry or None)."""
        rest = [i for i, loc in enumerate(kept) if loc is None]
        results: list[kvstore_pb2.ReplicaListResult] = [
            loc.result if loc is not None else _MISSING for loc in kept
        ]
        deadlines = {k: loc.lease_end for k, loc in zip(keys, kept, strict=True) if loc}
        looked_up: list[kvstore_pb2.ReplicaListResult] = []
        if rest:
            looked_up, lease_ends = self._lookup([keys[i] for i in rest])
            deadlines.update(lease_ends)
            for i, res in zip(rest, looked_up, strict=True):
                results[i] = res
        cached = frozenset(keys[i] for i, loc in enumerate(kept) if loc is not None)
        if len(rest) < len(keys):
            READ_LOCATIONS.labels("cache").inc(len(keys) - len(rest))
        if rest:
            READ_LOCATIONS.labels("master").inc(len(rest))
        try:
            buffers = _buffers(results, buffer_for)
            out = self._read_all(results, buffers, ReadCheck(deadlines, decode, cached))
        finally:
            self.leases.release([r.key for r in looked_up if r.code == kvstore_pb2.KV_OK])
        failed = [i for i, loc in enumerate(kept) if loc is not None and out[i] is None]
        if failed:
            self._retry(keys, failed, out, buffers, buffer_for, decode)
        return out

    def _retry(
        self,
        keys: list[str],
        failed: list[int],
        out: list[Any],
        buffers: list[memoryview | None],
        buffer_for: BufferFor,
        decode: Decode | None,
    ) -> None:
        """Looks the keys at ``failed`` (read from kept locations, and failed) up again and
        reads them into ``out``: their entries are dropped first (a stale location, a lease
        the master no longer holds), and what this read gets is checked as any read is."""
        assert self.locations is not None
        again = [keys[i] for i in failed]
        READ_LOCATIONS.labels("retry").inc(len(again))
        log.info("read of %d object(s) from kept locations failed; looking them up", len(again))
        self.locations.drop(again)
        results, deadlines = self._lookup(again)
        try:
            retry_buffers: list[memoryview | None] = []
            for i, res in zip(failed, results, strict=True):
                buf = None
                if res.code == kvstore_pb2.KV_OK and res.replicas:
                    size = res.replicas[0].size
                    old = buffers[i]
                    buf = (
                        old
                        if old is not None and len(old) >= size
                        else _or_none(buffer_for, i, size)
                    )
                retry_buffers.append(buf)
            got = self._read_all(results, retry_buffers, ReadCheck(deadlines, decode))
        finally:
            self.leases.release([r.key for r in results if r.code == kvstore_pb2.KV_OK])
        for i, value in zip(failed, got, strict=True):
            out[i] = value

    def replica_lists(self, keys: list[str]) -> list[kvstore_pb2.ReplicaListResult]:
        """Where ``keys`` are, from one master lookup that grants read leases on the found
        ones (give them back with :meth:`LeaseReleaser.release`)."""
        resp = self.master.call(
            "BatchGetReplicaList",
            kvstore_pb2.BatchGetReplicaListRequest(client_id=self.client_id, keys=keys),
        )
        return list(resp.results)

    def _lookup(
        self, keys: list[str]
    ) -> tuple[list[kvstore_pb2.ReplicaListResult], dict[str, float]]:
        """Replica lists of ``keys`` (read leases granted: the caller releases them), and
        per found key the monotonic time its lease ends, counted from before the request."""
        sent = time.monotonic()
        results = self.replica_lists(keys)
        ends = {r.key: sent + r.lease_ms / 1000 for r in results if r.code == kvstore_pb2.KV_OK}
        return results, ends

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
            reps = [rep for _i, rep, _buf in jobs]
            with tracing.span("pdserve.kvstore.read", store_io(name, reps), root=False):
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
        if corrupt and res.key in check.bad and res.key not in check.cached:
            # Wrong bytes from a location the master just gave (not merely a late read, nor
            # a kept location: that one is looked up again first).
            CORRUPT_CHUNKS.inc()
            self.leases.discard(res.key)
        return None


#: The result of a key not looked up yet (never read: it is replaced before the reads).
_MISSING = kvstore_pb2.ReplicaListResult(code=kvstore_pb2.KV_NOT_FOUND)


def _buffers(
    results: Sequence[kvstore_pb2.ReplicaListResult], buffer_for: BufferFor
) -> list[memoryview | None]:
    """For each found object (in key order) the buffer ``buffer_for(index, size)`` gives;
    None for a miss."""
    return [
        buffer_for(i, res.replicas[0].size)
        if res.code == kvstore_pb2.KV_OK and res.replicas
        else None
        for i, res in enumerate(results)
    ]


def _or_none(buffer_for: BufferFor, i: int, size: int) -> memoryview | None:
    """``buffer_for(i, size)``, or None (a miss) when the caller's buffer is too small: the
    object looked up again is larger than the one the kept location named."""
    try:
        return buffer_for(i, size)
    except errors.InvalidArgument as exc:
        log.warning("%s; a miss", exc)
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
