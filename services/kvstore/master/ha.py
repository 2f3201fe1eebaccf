"""Master high availability on etcd: several masters, one leader, the objects in etcd.

With ``ha_etcd`` (etcd endpoints) a master starts as a standby: it binds no port and serves
nothing. It campaigns for ``<ha_prefix>leader`` (a put-if-absent bound to an etcd lease of
``ha_lease_s`` seconds); the one that gets it loads every committed object from
``<ha_prefix>objects/`` and serves. Clients name every master (``host:port,host:port``:
:func:`pdserve.grpcutil.channel` dials the list, and a standby, which does not listen, is
skipped), so nodes, workers and routers follow the leader without asking anyone who it is.

Why replicate through etcd rather than rebuild from the nodes: a node holds bytes, not
records; only the master knows which puts finished (a half-written put looks like a finished
one to its node), soft pins and TTLs. So the leader writes each call's changes, as the SQLite
journal does on one host (:class:`EtcdMetadataStore`, the same rows as JSON), to etcd before
it answers, and a new leader reads them back: nothing committed is lost with the leader's
host. Each write is a transaction that succeeds only while ``leader`` still carries this
master's lease (fencing): a leader paused past its lease (SIGSTOP, a long GC, a partition)
cannot write after its successor took over, and it exits as soon as it notices (its lease
keep-alive fails or a guarded write fails); ``pdserve up`` restarts it as a standby.

After a failover the nodes' heartbeats reach the new leader, which does not know them: they
remount their segments (bytes kept), and the loaded objects' replicas revive there, as after
a master restart. Read leases, unfinished puts and the inline copies are not replicated: a
put in flight is refused (the writer's chunk is not stored), a read in flight retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from pdserve.errors import Unavailable
from pdserve.etcdaccess import EtcdAccess
from pdserve.services.kvstore.master.persistence import (
    NamespaceChanges,
    StoredNamespace,
    StoredObject,
    StoredPin,
    StoredQuarantine,
    StoredReplica,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Deadline of one etcd call (seconds).
CALL_TIMEOUT_S = 5.0
#: etcd's default --max-txn-ops: the most operations one transaction may hold.
MAX_TXN_OPS = 128
#: How often a standby looks whether the leader key is free (seconds).
POLL_S = 0.1
#: Exit status of a leader that lost its lease (``up`` restarts it as a standby).
LOST_EXIT = 75


class EtcdLink:
    """An etcd3aio client on a thread and event loop of its own: the master's state calls
    (worker threads holding the state lock) write through it synchronously, and the master's
    own loop never waits on etcd."""

    def __init__(self, access: EtcdAccess) -> None:
        """``access``: etcd's endpoints, TLS and user (:mod:`pdserve.etcdaccess`)."""
        self.access = access
        self.endpoints = list(access.endpoints)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="etcd", daemon=True)
        self._thread.start()
        self._token = contextlib.AsyncExitStack()
        self.client = access.client()
        self.call("connect", self._connect())

    async def _connect(self) -> None:
        await self.client.connect()
        await self.access.authenticate(self.client, self._token, CALL_TIMEOUT_S)
        await self.client.ping(write_check=False, timeout=CALL_TIMEOUT_S)

    def call(self, what: str, coro: Awaitable[T], timeout: float = CALL_TIMEOUT_S) -> T:
        """Runs ``coro`` on the etcd loop and waits for it (from any other thread)."""
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        try:
            return future.result()
        except Exception as exc:
            raise Unavailable(f"etcd at {self.access.describe()}: {what} failed: {exc}") from exc

    async def acall(self, what: str, coro: Awaitable[T], timeout: float = CALL_TIMEOUT_S) -> T:
        """:meth:`call` for a coroutine of another event loop."""
        return await asyncio.to_thread(self.call, what, coro, timeout)

    @property
    def kv(self) -> Any:
        return self.client.kv

    def close(self) -> None:
        with contextlib.suppress(Unavailable):
            self.call("stop the token refresher", self._token.aclose())
        with contextlib.suppress(Unavailable):
            self.call("close", self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class Leadership:
    """This master's campaign for ``<prefix>leader`` and, once it leads, the lease that keeps
    it there. ``on_lost`` runs (on the etcd thread) when the lease cannot be kept; by default
    the process exits at once with :data:`LOST_EXIT`."""

    def __init__(
        self,
        link: EtcdLink,
        prefix: str,
        address: str,
        ttl_s: int,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.link = link
        self.key = prefix + "leader"
        self.address = address
        self.ttl_s = ttl_s
        self.lease = 0
        self.on_lost = on_lost or _exit
        self._last_ok = 0.0
        self._keeper: asyncio.Future | None = None

    async def campaign(self, progress: Callable[[str], None] = log.info) -> None:
        """Returns once this master holds the leader key (standby until then). An etcd call
        that fails (etcd slow or briefly out of reach) is tried again after :data:`POLL_S`:
        a standby that exited on one instead was out of the election until ``up`` had
        restarted it, seconds after the leader's lease had ended."""
        said, failing = "", False
        while True:
            try:
                leader = await self._claim(progress)
            except Unavailable as exc:
                if not failing:
                    log.warning("standby: %s; campaigning on", exc)
                failing = True
                await asyncio.sleep(POLL_S)
                continue
            failing = False
            if leader is None:
                return
            if leader != said:
                progress(f"standby: the kvstore master leader is {leader}")
                said = leader
            await asyncio.sleep(POLL_S)

    async def _claim(self, progress: Callable[[str], None] = log.info) -> str | None:
        """One round of the campaign: None once this master holds the leader key, else the
        leader's address ("" when the key was free but another master took it first)."""
        kv = self.link.kv
        got = await self.link.acall("read the leader", kv.get(self.key))
        if got.kvs:
            return str(got.kvs[0].value.decode())
        grant = await self.link.acall("grant a lease", self.link.client.lease.grant(self.ttl_s))
        free = kv.txn_compare_create_revision(self.key, 0)
        claim = kv.txn_op_put(self.key, self.address, lease=grant.ID)
        won = await self.link.acall("campaign", kv.txn([free], [claim]))
        if won.succeeded:
            self.lease, self._last_ok = grant.ID, time.monotonic()
            self._keeper = asyncio.run_coroutine_threadsafe(self._keep(), self.link.loop)
            progress(f"leading (lease {grant.ID:x}, {grant.TTL} s)")
            return None
        await self.link.acall("revoke the lease", self.link.client.lease.revoke(grant.ID))
        return ""

    async def _keep(self) -> None:
        """Renews the lease every third of its TTL; gives up (``on_lost``) when a renewal says
        it expired, or when none succeeded for a whole TTL (the process was paused, or etcd
        is out of reach: another master may lead by now)."""
        lease = self.link.client.lease
        while True:
            if time.monotonic() - self._last_ok >= self.ttl_s:
                self.on_lost(f"no lease renewal for {self.ttl_s} s")
                return
            try:
                stream = lease.keep_alive(self.lease)
                try:
                    async for resp in stream:
                        if resp.TTL <= 0:
                            self.on_lost("the leader lease expired")
                            return
                        self._last_ok = time.monotonic()
                        break
                finally:
                    stream.cancel()
            except Exception as exc:  # etcd unreachable: retry until the TTL runs out
                log.warning("leader lease renewal failed: %s", exc)
            await asyncio.sleep(max(self.ttl_s / 3.0, 0.2))

    def guard(self) -> Any:
        """The compare a leader's write carries: the leader key still has this lease."""
        from etcd3aio._protobuf import Compare

        return Compare(
            result=Compare.EQUAL, target=Compare.LEASE, key=self.key.encode(), lease=self.lease
        )

    def resign(self) -> None:
        """Gives the leader key up now (a clean stop: a standby takes over at once)."""
        if self._keeper is not None:
            self._keeper.cancel()
        if self.lease:
            try:
                self.link.call("resign", self.link.client.lease.revoke(self.lease))
            except Unavailable as exc:
                log.warning("resign: %s", exc)
            self.lease = 0


def _exit(why: str) -> None:
    log.critical("kvstore master lost its leadership (%s): exiting to restart as a standby", why)
    logging.shutdown()
    os._exit(LOST_EXIT)


def _encode(obj: StoredObject) -> str:
    return json.dumps(
        {
            "size": obj.size,
            "pin": obj.soft_pin,
            "ttl": obj.ttl_deadline_ms,
            "replicas": [[r.segment_id, r.node_id, r.offset] for r in obj.replicas],
            "checksum": obj.checksum.hex(),
            "root": obj.root,
        },
        separators=(",", ":"),
    )


def _decode(key: str, value: bytes) -> StoredObject:
    row = json.loads(value)
    replicas = tuple(StoredReplica(str(s), str(n), int(o)) for s, n, o in row["replicas"])
    return StoredObject(
        key,
        int(row["size"]),
        bool(row["pin"]),
        int(row["ttl"]),
        replicas,
        bytes.fromhex(row.get("checksum", "")),
        str(row.get("root", "")),
    )


class EtcdMetadataStore:
    """The committed objects under ``<prefix>objects/``, the namespaces under
    ``<prefix>namespaces/`` (by chain root) and the quarantines under ``<prefix>quarantines/``
    (by fingerprint digest): the interface of :class:`~.persistence.MetadataStore`, each write
    guarded by the leader's lease."""

    def __init__(self, link: EtcdLink, leadership: Leadership, prefix: str) -> None:
        self.link = link
        self.leadership = leadership
        self.prefix = prefix + "objects/"
        self.ns_prefix = prefix + "namespaces/"
        self.q_prefix = prefix + "quarantines/"
        self.pin_prefix = prefix + "pins/"
        #: Where the rows are, for log lines (as MetadataStore.path).
        self.path = f"etcd {','.join(link.endpoints)} {self.prefix}"

    def _range(self, what: str, prefix: str) -> list[tuple[str, bytes]]:
        """(key without ``prefix``, value) of every key under ``prefix``."""
        from etcd3aio import prefix_range_end

        got = self.link.call(
            what, self.link.kv.get(prefix, range_end=prefix_range_end(prefix)), timeout=60.0
        )
        return [(kv.key.decode()[len(prefix) :], kv.value) for kv in got.kvs]

    def load(self) -> list[StoredObject]:
        return [_decode(k, v) for k, v in self._range("load the objects", self.prefix)]

    def load_namespaces(self) -> tuple[list[StoredNamespace], list[StoredQuarantine]]:
        spaces = []
        for root, value in self._range("load the namespaces", self.ns_prefix):
            row = json.loads(value)
            spaces.append(
                StoredNamespace(
                    root, str(row["fingerprint"]), dict(row["labels"]), str(row.get("tenant", ""))
                )
            )
        quarantines = []
        for digest, value in self._range("load the quarantines", self.q_prefix):
            row = json.loads(value)
            quarantines.append(
                StoredQuarantine(digest, str(row["reason"]), str(row["by"]), int(row["since_ms"]))
            )
        return spaces, quarantines

    def load_pins(self) -> list[StoredPin]:
        """The pins under ``<prefix>pins/`` (by tenant and the name's hex)."""
        out = []
        for _, value in self._range("load the pins", self.pin_prefix):
            row = json.loads(value)
            pin = StoredPin(row["tenant"], row["name"], tuple(row["keys"]), int(row["created_ms"]))
            out.append(pin)
        return sorted(out, key=lambda p: (p.tenant, p.name))

    def _pin_key(self, tenant: str, name: str) -> str:
        return f"{self.pin_prefix}{tenant}/{name.encode().hex()}"

    def apply(
        self,
        upserts: Iterable[StoredObject],
        deletes: Iterable[str],
        changes: NamespaceChanges | None = None,
    ) -> None:
        """Writes one call's changes before the call answers (in transactions of at most
        :data:`MAX_TXN_OPS`, each guarded by the leader's lease)."""
        kv = self.link.kv
        ops = [kv.txn_op_delete(self.prefix + key) for key in deletes]
        ops += [kv.txn_op_put(self.prefix + o.key, _encode(o)) for o in upserts]
        if changes:
            ops += self._namespace_ops(changes)
        for i in range(0, len(ops), MAX_TXN_OPS):
            batch = ops[i : i + MAX_TXN_OPS]
            done = self.link.call("write objects", kv.txn([self.leadership.guard()], batch))
            if not done.succeeded:
                self.leadership.on_lost("a write found another master leading")
                raise Unavailable("this kvstore master no longer leads")

    def _namespace_ops(self, changes: NamespaceChanges) -> list[Any]:
        kv = self.link.kv
        ops = [kv.txn_op_delete(self.ns_prefix + root) for root in changes.dropped]
        ops += [
            kv.txn_op_put(
                self.ns_prefix + n.root,
                json.dumps(
                    {"fingerprint": n.fingerprint, "labels": n.labels, "tenant": n.tenant},
                    sort_keys=True,
                ),
            )
            for n in changes.namespaces.values()
        ]
        for (tenant, name), pin in changes.pins.items():
            key = self._pin_key(tenant, name)
            if pin is None:
                ops.append(kv.txn_op_delete(key))
            else:
                row = {"tenant": tenant, "name": name, "keys": list(pin.keys)}
                ops.append(kv.txn_op_put(key, json.dumps({**row, "created_ms": pin.created_ms})))
        for digest, q in changes.quarantines.items():
            if q is None:
                ops.append(kv.txn_op_delete(self.q_prefix + digest))
            else:
                row = {"reason": q.reason, "by": q.by, "since_ms": q.since_ms}
                ops.append(kv.txn_op_put(self.q_prefix + digest, json.dumps(row)))
        return ops

    def close(self) -> None:
        pass
