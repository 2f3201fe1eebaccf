"""The store client's puts: ``BatchPutStart`` (with each object's checksum; small objects
inline) -> write every replica -> ``BatchPutEnd``, or ``BatchPutRevoke`` and a retry when a
replica write fails."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from prometheus_client import Counter

from pdserve import errors, tracing
from pdserve.store.api import (
    DEFAULT_OPTIONS,
    ChunkMeta,
    ChunkNamespace,
    StoreOptions,
    byte_view,
    check_keys,
    kv_error,
)
from pdserve.store.client.checksum import checksum
from pdserve.store.client.control import MasterLink
from pdserve.store.client.routing import ReplicaRoutes
from pdserve.store.transports.base import Transport
from pdserve.telemetry import REGISTRY, Relayed
from pdserve.tracing import store_io
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)

PUT_RETRIES = Relayed(
    "store_put_retries",
    Counter(
        "pdserve_store_put_retries_total",
        "puts retried after a replica write failed",
        registry=REGISTRY,
    ),
)


def _block(m: ChunkMeta) -> kvstore_pb2.KVBlockMeta:
    return kvstore_pb2.KVBlockMeta(
        parent_key=m.parent,
        token_ids=m.packed_tokens(),
        block_size=m.block_size or len(m.tokens),
        medium=m.medium,
        engine_block_hashes=[bytes(h) for h in m.engine_hashes],
        engine_parent_block_hash=bytes(m.engine_parent),
        engine_block_size=m.engine_block_size,
    )


def _tag(request: kvstore_pb2.BatchPutStartRequest, namespace: ChunkNamespace) -> None:
    """Names each item's namespace: one ``KVNamespace`` per distinct chain root."""
    index: dict[str, int] = {}
    for item in request.items:
        root = namespace.root_of(item.key)
        at = index.get(root)
        if at is None:
            request.namespaces.add(
                root=root,
                fingerprint=namespace.fingerprint,
                labels=namespace.labels,
                tenant=namespace.tenants.get(root, ""),
            )
            at = index[root] = len(request.namespaces)
        item.namespace = at


class Writes:
    """Puts through ``master`` and the transports of ``routes``, each retried up to
    ``put_retries`` times after a failed replica write."""

    def __init__(
        self, master: MasterLink, routes: ReplicaRoutes, client_id: str, put_retries: int
    ) -> None:
        self.master = master
        self.routes = routes
        self.client_id = client_id
        self.put_retries = put_retries

    def batch_put(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        options: StoreOptions = DEFAULT_OPTIONS,
        meta: Mapping[str, ChunkMeta] | None = None,
        namespace: ChunkNamespace | None = None,
    ) -> list[bool]:
        """:meth:`pdserve.store.client.StoreClient.batch_put`."""
        keys = check_keys([k for k, _ in items])
        if len(set(keys)) != len(keys):
            raise errors.InvalidArgument("batch_put keys must be distinct")
        views = {k: byte_view(d) for k, d in items}
        blocks = {k: _block(m) for k, m in meta.items() if k in views} if meta else {}
        options.validate()
        opts = kvstore_pb2.PutOptions(
            replicas=options.replicas, soft_pin=options.soft_pin, ttl_ms=options.ttl_ms
        )
        call = self.master.call
        result: dict[str, bool] = {}
        pending = list(keys)
        failure: errors.PdserveError | None = None
        for attempt in range(self.put_retries + 1):
            if not pending:
                break
            if attempt:
                PUT_RETRIES.inc(len(pending))
                time.sleep(0.25 * attempt)
            self.master.wire_client()  # learns inline_max at first use
            request = kvstore_pb2.BatchPutStartRequest(
                client_id=self.client_id,
                items=[
                    self._put_item(k, views[k], options.checksum, blocks.get(k)) for k in pending
                ],
                options=opts,
            )
            if namespace is not None:
                _tag(request, namespace)
            resp = call("BatchPutStart", request)
            allocated = []
            for res in resp.results:
                if (res.code == kvstore_pb2.KV_OK and res.already_exists) or res.code in (
                    kvstore_pb2.KV_PUT_IN_PROGRESS,
                    kvstore_pb2.KV_QUARANTINED,  # not stored, by design: not a failure
                ):
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
                call(
                    "BatchPutRevoke",
                    kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=revoke),
                )
            if written:
                end = call(
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
        with_checksum: bool,
        block: kvstore_pb2.KVBlockMeta | None = None,
    ) -> kvstore_pb2.PutStartItem:
        """The start of a put: its checksum (when asked for); small objects travel inline, so
        the master can serve their gets without a data-plane read."""
        item = kvstore_pb2.PutStartItem(key=key, size=len(data), block=block)
        if with_checksum:
            item.checksum = checksum(data)
        if len(data) <= self.master.inline_max:
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
                t = self.routes.route(rep)
                if t is None:
                    log.warning("no allowed transport reaches node %s", rep.node_id)
                    failed.add(res.key)
                    continue
                transports[t.name] = t
                jobs.setdefault(t.name, []).append((res.key, rep))
        for name, items in jobs.items():
            t = transports[name]
            reps = [rep for _key, rep in items]
            with tracing.span("pdserve.kvstore.write", store_io(name, reps), root=False):
                errs = t.write_many([(rep, views[key]) for key, rep in items])
            for (key, rep), err in zip(items, errs, strict=True):
                if err is not None:
                    failed.add(key)
                    log.warning("write to node %s over %s failed: %s", rep.node_id, t.name, err)
        return failed
