"""The client of pdserve's own KV store, used by the engines (contract:
:class:`pdserve.store.api.StoreBackend`; open one with :func:`pdserve.store.open_store`).

:class:`StoreClient` is synchronous and thread-safe (asyncio code calls it through
``asyncio.to_thread``), and made of small parts, each with its state in plain view:

* :mod:`.control` (:class:`~.control.MasterLink`): calls to the master over its control wire
  (:mod:`pdserve.store.wire`, the same messages without HTTP/2), or gRPC when the wire is off
  or unreachable (``control="grpc"`` forces gRPC);
* :mod:`.routing` (:class:`~.routing.ReplicaRoutes`): the data-plane transport per replica:
  shm when the node is on this host, else tcp, else mooncake (``transport=`` forces one);
* :mod:`.writes`: ``BatchPutStart`` (with the object's checksum) -> write every replica ->
  ``BatchPutEnd`` (``BatchPutRevoke`` and a retry when a write fails);
* :mod:`.locations` (:class:`~.locations.LocationCache`): the replica lists that
  :meth:`StoreClient.longest_prefix` got with its answer (``LongestPrefix`` with
  ``with_replicas``: leased and granted as ``BatchGetReplicaList`` gives them), kept until
  shortly before their lease ends, shared by every client of the same master in the process;
* :mod:`.reads`: the kept locations, and ``BatchGetReplicaList`` (grants a read lease) for
  the other keys -> read the best replica, falling over to the next on failure, verify ->
  release the lookup's leases (a kept location's lease stays with the cache); a read from a
  kept location that failed is looked up and read again, once;
* :mod:`.leases` (:class:`~.leases.LeaseReleaser`): the thread that releases read leases in
  batches.

So the connector's read of a prompt (``longest_prefix`` of its chunk keys, then
``batch_get_chunks`` of the found ones) costs one master round trip, the lookup, and then
only its bytes.

Every replica the master hands out carries its data-plane grant (``Replica.token``: a read
grant from the lookup, a write grant from ``BatchPutStart``; :mod:`pdserve.store.grants`),
which the tcp transport sends with each range; a node that refuses a range (no valid grant,
an expired one) fails that replica like any other transfer error.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pdserve import errors
from pdserve.store.api import (
    DEFAULT_OPTIONS,
    ChunkMeta,
    ChunkNamespace,
    StoreBackend,
    StoreOptions,
    byte_view,
    check_keys,
    decode_chunk,
)
from pdserve.store.client import locations, namespaces
from pdserve.store.client.control import MasterLink
from pdserve.store.client.leases import LeaseReleaser
from pdserve.store.client.reads import Reads
from pdserve.store.client.routing import ReplicaRoutes
from pdserve.store.client.writes import Writes
from pdserve.store.segment import host_id as local_host_id
from pdserve.store.transports import PREFERENCE
from pdserve.v1 import kvstore_pb2

if TYPE_CHECKING:
    import torch


class StoreClient(StoreBackend):
    """Synchronous, thread-safe client of a pdserve KV store. ``transport``: "auto" or the
    one data-plane transport to use (shm, tcp, mooncake); ``control``: "auto" (the master's
    control wire when it has one) or "grpc"; ``put_retries``: retries of a put after a
    failed replica write; ``timeout_s``: of one master call or transfer."""

    carries_chunk_meta = True

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
        # The parts, in plain view: the control path to the master, the data-plane route to
        # each replica, the lease releaser, the put and read paths. Tools that inject faults
        # or inspect placement (bench chaos, the store tests) drive one of them directly.
        self.master = MasterLink(master_address, timeout_s, control)
        self.routes = ReplicaRoutes(transport, self.host_id, timeout_s)
        self.leases = LeaseReleaser(self.master.call, self.client_id, timeout_s)
        self.writes = Writes(self.master, self.routes, self.client_id, put_retries)
        # Where longest_prefix found objects, shared with the process's other clients of this
        # master; its leases are the cache's (its holder's), released early only when an
        # entry is dropped.
        self.locations = locations.shared(master_address, timeout_s, control)
        self.locations.open()
        self._closed = False
        self.reads = Reads(self.master, self.routes, self.leases, self.client_id, self.locations)
        #: Whether longest_prefix asks for the replicas (off after the master refused it to
        #: this identity: a role that may not read).
        self.prefix_replicas = True

    @property
    def control_path(self) -> str:
        """``"wire"`` when calls go to the master's control wire, else ``"grpc"``."""
        return self.master.path

    # -- puts -------------------------------------------------------------------------------

    def batch_put(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        options: StoreOptions = DEFAULT_OPTIONS,
        *,
        meta: Mapping[str, ChunkMeta] | None = None,
        namespace: ChunkNamespace | None = None,
    ) -> list[bool]:
        """Puts several objects with one master round trip per phase. Items that succeed are
        committed even when another item fails; the first hard failure is then raised.
        ``meta``: per key, the chunk's place in its chain (``PutStartItem.block``), which the
        master publishes with the stored event; ``namespace``: whose KV the objects are
        (``PutStartItem.namespace``). An item of a quarantined fingerprint is not stored
        (False), and not a failure. Kept locations of the keys are dropped (and their leases
        released in the background)."""
        self.locations.drop([k for k, _v in items])
        return self.writes.batch_put(items, options, meta, namespace)

    # -- gets -------------------------------------------------------------------------------

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = check_keys(keys)
        views = self.reads.read(keys, lambda _i, n: memoryview(bytearray(n)))
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

        return [None if v is None else len(v) for v in self.reads.read(keys, buffer_for)]

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

        return self.reads.read(keys, buffer_for, lambda k, v: decode_chunk(v, fingerprint, k))

    # -- metadata ---------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        resp = self.master.call(
            "BatchExists", kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=keys)
        )
        return list(resp.exists)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are committed in the store. The master answers where
        the found ones are too (read-leased to this process's location cache), and the gets
        of the next seconds read them with no master call of their own (:mod:`.locations`)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        if not self.prefix_replicas:
            request = kvstore_pb2.LongestPrefixRequest(keys=keys)
            return self.master.call("LongestPrefix", request).length
        request = kvstore_pb2.LongestPrefixRequest(
            keys=keys, client_id=self.locations.holder, with_replicas=True
        )
        self.locations.begin_lookup(keys)
        found: list[kvstore_pb2.ReplicaListResult] = []
        sent = time.monotonic()  # the leases count from before the request
        try:
            resp = self.master.call("LongestPrefix", request)
            n = resp.length
            found = [r for r, k in zip(resp.results, keys[:n], strict=False) if r.key == k]
        except errors.PermissionDenied:
            # An identity that may not read (not a worker or router): the length alone.
            self.prefix_replicas = False
            return self.longest_prefix(keys)
        finally:
            self.locations.end_lookup(keys, found, sent)
        return n

    def remove(self, keys: Sequence[str]) -> int:
        """Removes objects; returns how many were removed (leased or absent ones are not)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        # Our own read leases must not block our removal: the kept locations' (the cache's,
        # unless a read or lookup uses them now) and those queued for release.
        self.locations.drop(keys)
        self.release_leases()
        resp = self.master.call(
            "BatchRemove", kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=keys)
        )
        return sum(1 for r in resp.results if r.code == kvstore_pb2.KV_OK)

    def stats(self) -> kvstore_pb2.StatsResponse:
        return self.master.call("Stats", kvstore_pb2.StatsRequest())

    # -- namespaces (:mod:`.namespaces`) -----------------------------------------------------

    def list_namespaces(self) -> list[kvstore_pb2.FingerprintUsage]:
        """Every model fingerprint the store holds chunks of (admin only)."""
        return namespaces.list_namespaces(self.master)

    def drop_namespaces(
        self, fingerprints: Sequence[str] = (), roots: Sequence[str] = (), *, dry_run: bool = False
    ) -> kvstore_pb2.DropNamespacesResponse:
        """Removes the fingerprints' (every root) and the roots' chunks (admin only). The
        read leases this process's location cache holds go back first: they would only
        defer the removal of what they lease."""
        if not dry_run:
            self.locations.clear()
            self.release_leases()
        return namespaces.drop_namespaces(self.master, fingerprints, roots, dry_run=dry_run)

    def set_quarantine(self, fingerprint_hex: str, reason: str) -> bool:
        """Quarantines a fingerprint: the store answers its chunks as not found and refuses
        its puts until an admin clears it (the router's identity or admin). Returns whether
        it was quarantined already."""
        return namespaces.set_quarantine(self.master, fingerprint_hex, reason).was_quarantined

    def clear_quarantine(self, fingerprint_hex: str, reason: str = "") -> bool:
        """Clears a fingerprint's quarantine (admin only); returns whether it had one."""
        resp = namespaces.set_quarantine(self.master, fingerprint_hex, reason, quarantined=False)
        return resp.was_quarantined

    def release_leases(self) -> None:
        """Sends the read leases queued for release now, instead of with the next call (so
        a tool or test that reads then removes sees the master's state settle)."""
        self.leases.flush()
        self.locations.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.locations.close()  # the last client of the process releases its leases
        self.leases.close()
        self.routes.close()
        self.master.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
