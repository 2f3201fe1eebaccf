"""The client of pdserve's own KV store, used by the engines (contract:
:class:`pdserve.store.api.StoreBackend`).

:class:`StoreClient` is synchronous and thread-safe (asyncio code calls it through
``asyncio.to_thread``). Control goes to the master over its control wire
(:mod:`pdserve.store.wire`, the same messages without HTTP/2), or gRPC when the wire is off
or unreachable (``control="grpc"`` forces gRPC); payload bytes move over a data-plane
transport chosen per replica: shm when the node is on this host, else tcp, else mooncake
(``transport=`` forces one).

Put: ``BatchPutStart`` (with the object's checksum) -> write every replica -> ``BatchPutEnd``
(``BatchPutRevoke`` when a write fails). Get: ``BatchGetReplicaList`` (grants a read lease)
-> read the best replica, falling over to the next on failure -> ``BatchReleaseLease``. A
read is handed out only if it ended within its lease and matches the writer's checksum (KV
chunks: their header's checksum, fingerprint and key). Read failures (dead replica, corrupt
or misplaced bytes) are misses, never exceptions.

Every replica the master hands out carries its data-plane grant (``Replica.token``: a read
grant from the lookup, a write grant from ``BatchPutStart``; :mod:`pdserve.store.grants`),
which the tcp transport sends with each range; a node that refuses a range (no valid grant,
an expired one) fails that replica like any other transfer error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import blake3
import grpc
from prometheus_client import Counter

from pdserve import errors, grpcutil
from pdserve.store.api import (
    CORRUPT_CHUNKS,
    DEFAULT_OPTIONS,
    ChunkMeta,
    StoreBackend,
    StoreOptions,
    byte_view,
    check_keys,
    decode_chunk,
    kv_error,
)
from pdserve.store.segment import host_id as local_host_id
from pdserve.store.transports import PREFERENCE
from pdserve.store.transports.base import Transport, TransportError
from pdserve.store.wire import VERSION as WIRE_VERSION
from pdserve.store.wire import WireClient, WireUnreachable
from pdserve.telemetry import REGISTRY, Relayed
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

if TYPE_CHECKING:
    import torch

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
PUT_RETRIES = Relayed(
    "store_put_retries",
    Counter(
        "pdserve_store_put_retries_total",
        "puts retried after a replica write failed",
        registry=REGISTRY,
    ),
)

#: How long lease releases wait to be sent together (seconds).
RELEASE_DELAY_S = 0.01

TRANSPORT_NAMES = {
    kvstore_pb2.TRANSPORT_SHM: "shm",
    kvstore_pb2.TRANSPORT_TCP: "tcp",
    kvstore_pb2.TRANSPORT_MOONCAKE: "mooncake",
}


#: How long a client uses gRPC before it looks for the master's control wire again after the
#: wire was off or unreachable (seconds).
WIRE_RETRY_S = 1.0

_UNROUTED: Any = object()

#: How long a node that failed a read is tried after the other replicas (seconds).
SUSPECT_S = 5.0


#: Objects from this size on are hashed on every core (BLAKE3's tree mode: same digest).
PARALLEL_HASH_BYTES = 4 << 20


def _block(m: ChunkMeta) -> kvstore_pb2.KVBlockMeta:
    return kvstore_pb2.KVBlockMeta(
        parent_key=m.parent,
        token_ids=m.packed_tokens(),
        block_size=m.block_size or len(m.tokens),
        medium=m.medium,
    )


def _checksum(data: memoryview) -> bytes:
    """An object's checksum: BLAKE3, first 16 bytes (the GIL is released while it runs)."""
    threads = blake3.blake3.AUTO if len(data) >= PARALLEL_HASH_BYTES else 1
    return blake3.blake3(data, max_threads=threads).digest(length=16)


class _Check:
    """What a read must pass before it is handed out: it ended within its read lease
    (``deadline``, monotonic: past it the region may hold another object), its bytes match
    the writer's checksum (when one was recorded), and ``decode(key, view)`` accepts them
    (when given). A call returns the view (or the decoded value), or None; ``bad`` collects
    the keys whose bytes were wrong (not merely late)."""

    def __init__(
        self, deadline: float, decode: Callable[[str, memoryview], Any] | None = None
    ) -> None:
        self.deadline = deadline
        self.decode = decode
        self.bad: set[str] = set()

    def __call__(self, res: kvstore_pb2.ReplicaListResult, view: memoryview) -> Any:
        if time.monotonic() > self.deadline:
            log.warning("read of %r outlived its lease: discarded", res.key)
            return None
        if res.checksum and _checksum(view) != res.checksum:
            self.bad.add(res.key)
            return None
        value = view if self.decode is None else self.decode(res.key, view)
        if value is None:
            self.bad.add(res.key)
        return value


class StoreClient(StoreBackend):
    """Synchronous, thread-safe client of a pdserve KV store."""

    def __init__(
        self,
        master_address: str,
        *,
        client_id: str | None = None,
        transport: str = "auto",
        timeout_s: float = 5.0,
        put_retries: int = 2,
        control: str = "auto",
    ) -> None:
        if transport not in ("auto", *PREFERENCE):
            raise errors.InvalidArgument(
                f"transport must be auto, shm, tcp or mooncake, got {transport!r}"
            )
        if control not in ("auto", "grpc"):
            raise errors.InvalidArgument(f"control must be auto or grpc, got {control!r}")
        self.master_address = master_address
        self.client_id = client_id or f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.transport = transport
        self.timeout_s = timeout_s
        self.put_retries = put_retries
        self.control = control
        self.host_id = local_host_id()
        self._channel = grpcutil.sync_channel(master_address)
        self._stub = kvstore_pb2_grpc.KVMasterServiceStub(self._channel)
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()
        self._wire: WireClient | None = None
        self._wire_checked = -WIRE_RETRY_S
        self._inline_max = 0  # from GetControlWire
        # node id -> monotonic time until which reads try its replicas last (it just failed)
        self._suspect_until: dict[str, float] = {}
        self._release_cv = threading.Condition()
        self._flush_lock = threading.Lock()
        self._pending_release: list[str] = []
        self._pending_remove: set[str] = set()
        self._releaser: threading.Thread | None = None
        self._closing = False

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, method: str, request: Any) -> Any:
        wire = self._wire_client()
        if wire is not None:
            try:
                return wire.call(method, request)
            except WireUnreachable as exc:
                # The master restarted (a new wire port) or its wire is cut off: gRPC says
                # which, and the wire is looked up again after WIRE_RETRY_S.
                log.info("%s; using gRPC", exc)
                with self._lock:
                    if self._wire is wire:
                        self._wire, self._wire_checked = None, time.monotonic()
                wire.close()
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            detail = exc.details()  # type: ignore[attr-defined]
            raise errors.from_status(
                code, f"kvstore master {self.master_address} {method}: {code.name}: {detail}"
            ) from exc

    @property
    def control_path(self) -> str:
        """``"wire"`` when calls go to the master's control wire, else ``"grpc"``."""
        return "wire" if self._wire_client() is not None else "grpc"

    def _wire_client(self) -> WireClient | None:
        """The master's control wire, looked up with ``GetControlWire`` at first use and
        again WIRE_RETRY_S after it was off or unreachable; None means gRPC. The same answer
        says how large an object may travel inline with its put."""
        with self._lock:
            if self._wire is not None or time.monotonic() - self._wire_checked < WIRE_RETRY_S:
                return self._wire
            self._wire_checked = time.monotonic()
        try:
            info = self._stub.GetControlWire(
                kvstore_pb2.ControlWireRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            log.debug("GetControlWire failed: %s", exc)
            return None
        self._inline_max = info.inline_max_bytes
        if self.control != "auto":
            self._wire_checked = float("inf")  # gRPC by choice: no need to ask again
            return None
        if not info.port or info.version != WIRE_VERSION:
            return None
        host = self.master_address.rpartition(":")[0]
        wire = WireClient(host, info.port, self.timeout_s)
        with self._lock:
            if self._wire is None:
                self._wire = wire
                return wire
        wire.close()
        return self._wire

    def _get_transport(self, name: str) -> Transport:
        with self._lock:
            t = self._transports.get(name)
            if t is None:
                if name == "shm":
                    from pdserve.store.transports.shm import ShmTransport

                    t = ShmTransport(self.host_id)
                elif name == "tcp":
                    from pdserve.store.transports.tcp import TcpTransport

                    t = TcpTransport(self.timeout_s)
                else:
                    from pdserve.store.transports.mooncake import MooncakeTransport

                    t = MooncakeTransport()
                self._transports[name] = t
            return t

    def _route(self, replica: kvstore_pb2.Replica) -> Transport | None:
        """The best transport that reaches ``replica``, or None."""
        offered = {TRANSPORT_NAMES.get(ep.transport) for ep in replica.endpoints}
        names = PREFERENCE if self.transport == "auto" else (self.transport,)
        for name in names:
            if name not in offered:
                continue
            if name == "shm" and not any(
                ep.transport == kvstore_pb2.TRANSPORT_SHM and ep.host_id == self.host_id
                for ep in replica.endpoints
            ):
                continue
            return self._get_transport(name)
        return None

    def _ordered(
        self,
        replicas: Sequence[kvstore_pb2.Replica],
        routes: dict[str, Transport | None] | None = None,
    ) -> list[tuple[kvstore_pb2.Replica, Transport]]:
        """Replicas that some allowed transport reaches, best transport first. ``routes``
        memoizes the route per segment within one batch (its endpoints cannot change there)."""
        routed = []
        for r in replicas:
            if routes is None:
                t = self._route(r)
            else:
                t = routes.get(r.segment_id, _UNROUTED)  # type: ignore[arg-type]
                if t is _UNROUTED:
                    t = routes[r.segment_id] = self._route(r)
            if t is not None:
                routed.append((r, t))
        if len(routed) > 1:
            now = time.monotonic()
            # A node that just failed a transfer goes last until SUSPECT_S passes, so a dead
            # or cut-off node costs one timeout, not one per object, before the master
            # notices it.
            routed.sort(
                key=lambda rt: (
                    self._suspect_until.get(rt[0].node_id, 0.0) > now,
                    PREFERENCE.index(rt[1].name),
                )
            )
        return routed

    # -- puts -------------------------------------------------------------------------------

    carries_chunk_meta = True

    def batch_put(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        options: StoreOptions = DEFAULT_OPTIONS,
        *,
        meta: Mapping[str, ChunkMeta] | None = None,
    ) -> list[bool]:
        """Puts several objects with one master round trip per phase. Items that succeed are
        committed even when another item fails; the first hard failure is then raised.
        ``meta``: per key, the chunk's place in its chain (``PutStartItem.block``), which the
        master publishes with the stored event."""
        keys = check_keys([k for k, _ in items])
        if len(set(keys)) != len(keys):
            raise errors.InvalidArgument("batch_put keys must be distinct")
        views = {k: byte_view(d) for k, d in items}
        blocks = {k: _block(m) for k, m in meta.items() if k in views} if meta else {}
        options.validate()
        opts = kvstore_pb2.PutOptions(
            replicas=options.replicas, soft_pin=options.soft_pin, ttl_ms=options.ttl_ms
        )
        result: dict[str, bool] = {}
        pending = list(keys)
        failure: errors.PdserveError | None = None
        for attempt in range(self.put_retries + 1):
            if not pending:
                break
            if attempt:
                PUT_RETRIES.inc(len(pending))
                time.sleep(0.25 * attempt)
            self._wire_client()  # learns inline_max_bytes at first use
            resp = self._call(
                "BatchPutStart",
                kvstore_pb2.BatchPutStartRequest(
                    client_id=self.client_id,
                    items=[
                        self._put_item(k, views[k], options.checksum, blocks.get(k))
                        for k in pending
                    ],
                    options=opts,
                ),
            )
            allocated = []
            for res in resp.results:
                if (
                    res.code == kvstore_pb2.KV_OK and res.already_exists
                ) or res.code == kvstore_pb2.KV_PUT_IN_PROGRESS:
                    result[res.key] = False
                elif res.code != kvstore_pb2.KV_OK:
                    failure = failure or kv_error(res.code, f"put of {res.key!r}", res.message)
                    result[res.key] = False
                else:
                    allocated.append(res)
            failed = self._write_all(allocated, views)
            written = [r.key for r in allocated if r.key not in failed]
            revoke = [r.key for r in allocated if r.key in failed]  # and retry them
            if revoke:
                self._call(
                    "BatchPutRevoke",
                    kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=revoke),
                )
            if written:
                end = self._call(
                    "BatchPutEnd",
                    kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=written),
                )
                for r in end.results:
                    result[r.key] = r.code == kvstore_pb2.KV_OK
                    if r.code != kvstore_pb2.KV_OK:  # not "already existed": the put failed
                        failure = failure or kv_error(r.code, f"put of {r.key!r}", r.message)
            pending = revoke
        for k in pending:
            result[k] = False
            failure = failure or errors.Unavailable(
                f"put of {k!r}: writing a replica failed {self.put_retries + 1} times"
            )
        if failure is not None:
            raise failure
        return [result.get(k, False) for k in keys]

    def _put_item(
        self,
        key: str,
        data: memoryview,
        checksum: bool,
        block: kvstore_pb2.KVBlockMeta | None = None,
    ) -> kvstore_pb2.PutStartItem:
        """The start of a put: its checksum (when asked for); small objects travel inline, so
        the master can serve their gets without a data-plane read."""
        item = kvstore_pb2.PutStartItem(key=key, size=len(data), block=block)
        if checksum:
            item.checksum = _checksum(data)
        if len(data) <= self._inline_max:
            item.inline_data = bytes(data)
        return item

    def _write_all(
        self, allocated: Sequence[kvstore_pb2.PutStartResult], views: dict[str, memoryview]
    ) -> set[str]:
        """Writes every replica of every allocated put, one :meth:`Transport.write_many`
        per transport (tcp: one request per node for the whole batch); returns the keys of
        which some replica could not be written."""
        failed: set[str] = set()
        jobs: dict[str, list[tuple[str, kvstore_pb2.Replica]]] = {}
        transports: dict[str, Transport] = {}
        for res in allocated:
            if not res.replicas:
                failed.add(res.key)
            for rep in res.replicas:
                t = self._route(rep)
                if t is None:
                    log.warning("no allowed transport reaches node %s", rep.node_id)
                    failed.add(res.key)
                    continue
                transports[t.name] = t
                jobs.setdefault(t.name, []).append((res.key, rep))
        for name, items in jobs.items():
            t = transports[name]
            errs = t.write_many([(rep, views[key]) for key, rep in items])
            for (key, rep), err in zip(items, errs, strict=True):
                if err is not None:
                    failed.add(key)
                    log.warning("write to node %s over %s failed: %s", rep.node_id, t.name, err)
        return failed

    # -- gets -------------------------------------------------------------------------------

    def _replica_lists(self, keys: list[str]) -> list[kvstore_pb2.ReplicaListResult]:
        resp = self._call(
            "BatchGetReplicaList",
            kvstore_pb2.BatchGetReplicaListRequest(client_id=self.client_id, keys=keys),
        )
        return list(resp.results)

    def _release(self, keys: list[str]) -> None:
        """Queues read leases for release. A background thread sends them in batches (one
        ``BatchReleaseLease`` per ~``RELEASE_DELAY_S``), so a get costs one master round trip
        on its own path; a lost release only means the lease runs out on its own."""
        if not keys:
            return
        with self._release_cv:
            self._pending_release.extend(keys)
            if self._releaser is None:
                self._releaser = threading.Thread(
                    target=self._release_loop, name="store-lease-release", daemon=True
                )
                self._releaser.start()
            self._release_cv.notify()

    def _release_loop(self) -> None:
        while True:
            with self._release_cv:
                while not self._pending_release and not self._closing:
                    self._release_cv.wait()
                if self._closing and not self._pending_release:
                    return
            time.sleep(RELEASE_DELAY_S)  # let more releases coalesce
            self._flush_releases()

    def _flush_releases(self) -> None:
        """Sends the queued releases now; returns once no release is in flight."""
        with self._flush_lock:
            with self._release_cv:
                keys, self._pending_release = self._pending_release, []
                bad, self._pending_remove = self._pending_remove, set()
            if not keys:
                return
            try:
                self._call(
                    "BatchReleaseLease",
                    kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=keys),
                )
                if bad:
                    resp = self._call("BatchRemove", kvstore_pb2.BatchKeysRequest(keys=sorted(bad)))
                    gone = sum(r.code == kvstore_pb2.KV_OK for r in resp.results)
                    log.warning(
                        "removed %d of %d objects that failed verification on every replica, "
                        "so their next writer stores them again",
                        gone,
                        len(bad),
                    )
            except errors.PdserveError as exc:
                log.debug("lease release of %d key(s) failed: %s", len(keys), exc)

    def _read(
        self,
        res: kvstore_pb2.ReplicaListResult,
        buf: memoryview,
        check: _Check,
        skip: kvstore_pb2.Replica | None = None,
        corrupt: bool = False,
    ) -> Any:
        """Reads one found object from its best replica (other than ``skip``, already
        tried; ``corrupt``: it failed ``check``) into ``buf``, falling over to the others.
        Returns ``check(res, filled view)``, or None when every replica failed (or was
        rejected by the check)."""
        if res.code != kvstore_pb2.KV_OK or not res.replicas:
            return None
        for rep, t in self._ordered(res.replicas):
            if rep is skip:
                continue
            try:
                t.read_into(rep, buf)
            except TransportError as exc:
                self._suspect_until[rep.node_id] = time.monotonic() + SUSPECT_S
                READ_FAILOVERS.labels(t.name).inc()
                log.warning(
                    "read of %r from node %s over %s failed: %s", res.key, rep.node_id, t.name, exc
                )
                continue
            value = self._verified(check, res, buf[: rep.size], rep, t)
            if value is not None:
                return value
            corrupt = True
        if corrupt and res.key in check.bad:  # wrong bytes, not merely a late read
            CORRUPT_CHUNKS.inc()
            self._discard(res.key)
        return None

    def _discard(self, key: str) -> None:
        """Queues the removal of an object none of whose replicas holds what was written
        (torn, overwritten): readers would miss on it until it is evicted, and its writers
        would skip it as already stored. Sent after the lease releases."""
        with self._release_cv:
            self._pending_remove.add(key)

    @staticmethod
    def _verified(
        check: _Check,
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

    def _read_all(
        self,
        results: Sequence[kvstore_pb2.ReplicaListResult],
        buffers: Sequence[memoryview | None],
        check: _Check,
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
            ordered = self._ordered(res.replicas, routes)
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
                    out[i] = self._verified(check, results[i], buf[: rep.size], rep, t)
                    if out[i] is not None:
                        continue
                else:
                    self._suspect_until[rep.node_id] = time.monotonic() + SUSPECT_S
                out[i] = self._read(results[i], buf, check, skip=rep, corrupt=err is None)
        return out

    def _lookup(
        self, keys: Sequence[str], buffer_for: Callable[[int, int], memoryview]
    ) -> tuple[list[kvstore_pb2.ReplicaListResult], list[memoryview | None], float]:
        """Replica lists of ``keys`` (read leases granted), for each found object the buffer
        ``buffer_for(index, size)`` gives, and the monotonic time the leases end (counted
        from before the request). A raise here releases the leases."""
        sent = time.monotonic()
        results = self._replica_lists(list(keys))
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
            self._release([r.key for r in results if r.code == kvstore_pb2.KV_OK])
            raise
        return results, buffers, deadline

    def _finish(self, results: Sequence[kvstore_pb2.ReplicaListResult]) -> None:
        self._release([r.key for r in results if r.code == kvstore_pb2.KV_OK])

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = check_keys(keys)
        results, buffers, deadline = self._lookup(keys, lambda _i, n: memoryview(bytearray(n)))
        try:
            views = self._read_all(results, buffers, _Check(deadline))
        finally:
            self._finish(results)
        return [None if v is None else bytes(v) for v in views]

    def get_into(self, key: str, buf: memoryview) -> int | None:
        """Copies the object into ``buf`` (zero-copy where the transport allows it); returns
        the number of bytes written, or None on a miss. Raises InvalidArgument when ``buf`` is
        read-only or smaller than the object."""
        return self.batch_get_into([key], [buf])[0]

    def batch_get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        """Reads each object into its buffer with one master lookup for all of them (and
        one lease release, sent in the background); returns the bytes written per key, or
        None for a miss. Raises InvalidArgument, before anything is read, when a buffer is
        read-only or smaller than its object."""
        keys = check_keys(keys)
        if len(buffers) != len(keys):
            raise errors.InvalidArgument(
                f"batch_get_into: {len(keys)} keys but {len(buffers)} buffers"
            )
        views = [byte_view(b, writable=True, allow_empty=True) for b in buffers]

        def buffer_for(i: int, size: int) -> memoryview:
            if size > len(views[i]):
                raise errors.InvalidArgument(
                    f"buffer of {len(views[i])} bytes is smaller than object {keys[i]!r} "
                    f"({size} bytes)"
                )
            return views[i]

        results, bufs, deadline = self._lookup(keys, buffer_for)
        try:
            read = self._read_all(results, bufs, _Check(deadline))
        finally:
            self._finish(results)
        return [None if v is None else len(v) for v in read]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        resp = self._call(
            "BatchExists", kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=keys)
        )
        return list(resp.exists)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are committed in the store."""
        keys = check_keys(keys)
        if not keys:
            return 0
        return self._call("LongestPrefix", kvstore_pb2.LongestPrefixRequest(keys=keys)).length

    def remove(self, keys: Sequence[str]) -> int:
        """Removes objects; returns how many were removed (leased or absent ones are not)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        self._flush_releases()  # our own read leases must not block our removal
        resp = self._call(
            "BatchRemove", kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=keys)
        )
        return sum(1 for r in resp.results if r.code == kvstore_pb2.KV_OK)

    def stats(self) -> kvstore_pb2.StatsResponse:
        return self._call("Stats", kvstore_pb2.StatsRequest())

    # -- KV chunks --------------------------------------------------------------------------

    def batch_get_chunks(
        self, keys: Sequence[str], fingerprint: bytes, *, arena: memoryview | None = None
    ) -> list[torch.Tensor | None]:
        """Chunks verified against their checksum and ``fingerprint``; a corrupt replica is
        skipped for the next one, and a chunk with no good replica is a miss.

        ``arena``: a writable byte buffer the caller reuses across calls (e.g. a KV connector
        loading a prompt's chunks every step). The chunks are read into consecutive slices of
        it instead of fresh buffers (no allocation, no page faults: fresh buffers cost about as
        much as the read itself), and the returned tensors are views of it, valid until the
        caller reuses the arena. Chunks that do not fit get fresh buffers."""
        keys = check_keys(keys)
        used = 0

        def buffer_for(_i: int, n: int) -> memoryview:
            nonlocal used
            if arena is not None and used + n <= len(arena):
                used += n
                return arena[used - n : used]
            return memoryview(bytearray(n))

        results, buffers, deadline = self._lookup(keys, buffer_for)
        try:
            check = _Check(deadline, lambda key, v: decode_chunk(v, fingerprint, key))
            return self._read_all(results, buffers, check)
        finally:
            self._finish(results)

    def close(self) -> None:
        with self._release_cv:
            self._closing = True
            self._release_cv.notify()
        self._flush_releases()
        if self._releaser is not None:
            self._releaser.join(timeout=self.timeout_s)
        with self._lock:
            transports = list(self._transports.values())
            self._transports.clear()
        for t in transports:
            t.close()
        if self._wire is not None:
            self._wire.close()
        self._channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
