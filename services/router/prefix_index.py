"""The router's copy of which chunk keys the store holds, fed by the master's KV events
(``SubscribeKVEvents``; ``services/kvstore/kv_events.py``), so a request's longest cached
prefix is a few set lookups here instead of a round trip to the master.

- The follower subscribes with a snapshot (every block the master holds, then live batches)
  and applies each batch: stored blocks are added, removed ones dropped, cleared empties it.
  A block is held while any medium holds it: the store's disk tier publishes its copies as
  blocks of medium ``DISK`` next to the memory medium's, and a block evicted from memory with
  a copy on disk is still in the store.
- The index answers only while it is in sync: from the snapshot's last batch until a gap in
  sequence numbers (batches the router missed), the stream's end (a master restart, or the
  master cut the router off for falling behind) or an error. Then lookups go to the master
  again while the follower resubscribes (backoff 0.1 s doubling to 5 s), and return to the
  index once the new snapshot is in.
- ``prefix_source`` (router config): ``master`` asks the master per request, as before;
  ``events`` follows the events and asks the master only while out of sync; ``auto`` (the
  default) is ``events`` unless the master does not offer the stream (an older master
  answering UNIMPLEMENTED), then ``master``.

The index may lag the master by the events in flight (well under a millisecond on one host):
the cached length only steers the plan and the placement, workers load what is really there.
Memory: one key string per chunk the pool holds (about 150 bytes each).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc
from prometheus_client import Counter, Gauge

from pdserve.telemetry import REGISTRY
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)

PREFIX_SOURCES = ("auto", "events", "master")

LOOKUPS = Counter(
    "pdserve_router_prefix_lookups_total",
    "Longest-prefix lookups by where they were answered (index = the KV-event index)",
    ["source"],
    registry=REGISTRY,
)
RESYNCS = Counter(
    "pdserve_router_prefix_index_resyncs_total",
    "Times the KV-event index lost sync (gap, stream end, error) and resubscribed",
    registry=REGISTRY,
)
IN_SYNC = Gauge(
    "pdserve_router_prefix_index_in_sync",
    "1 while the KV-event index answers lookups, 0 while they go to the master",
    registry=REGISTRY,
)
KEYS = Gauge(
    "pdserve_router_prefix_index_keys", "Chunk keys in the KV-event index", registry=REGISTRY
)


class PrefixIndex:
    """Chunk keys the master holds, as its KV event batches say (plain, no I/O)."""

    def __init__(self) -> None:
        #: key -> the media holding it, one bit each (see ``_bits``)
        self.keys: dict[str, int] = {}
        self._bits: dict[str, int] = {}
        self.synced = False
        #: Sequence number of the last batch applied (-1 = none).
        self.seq = -1

    def desync(self) -> None:
        self.synced = False
        IN_SYNC.set(0)

    def apply(self, batch: pb.KVEventBatch) -> bool:
        """Applies ``batch``; False when it cannot follow the batches applied so far (a gap:
        the index is then out of sync until a new snapshot)."""
        if batch.snapshot:
            self.synced = False
        elif not self.synced or batch.seq != self.seq + 1:
            self.desync()
            return False
        keys = self.keys
        for ev in batch.events:
            kind = ev.WhichOneof("event")
            if kind == "stored":
                bit = self._bit(ev.stored.medium)
                for h in ev.stored.block_hashes:
                    k = h.hex()
                    keys[k] = keys.get(k, 0) | bit
            elif kind == "removed":
                bit = self._bit(ev.removed.medium)
                for h in ev.removed.block_hashes:
                    k = h.hex()
                    left = keys.get(k, 0) & ~bit
                    if left:
                        keys[k] = left
                    else:
                        keys.pop(k, None)
            elif kind == "cleared":
                keys.clear()
        self.seq = batch.seq
        if batch.snapshot_end:
            self.synced = True
            IN_SYNC.set(1)
        KEYS.set(len(keys))
        return True

    def _bit(self, medium: str) -> int:
        bit = self._bits.get(medium)
        if bit is None:
            bit = self._bits[medium] = 1 << len(self._bits)
        return bit

    def longest_prefix(self, keys: list[str]) -> int:
        """How many leading ``keys`` the index holds."""
        held = self.keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n


class IndexedLookup:
    """The router's prefix lookup (``Orchestrator.prefix_lookup``): the index while it is in
    sync, ``master_lookup`` otherwise. The follower starts at the first lookup (or
    :meth:`start`) on the running loop."""

    def __init__(
        self,
        master_lookup: Callable[[list[str]], Awaitable[int]],
        stub: kvstore_pb2_grpc.KVMasterServiceStub,
        *,
        mode: str = "auto",
        channel: grpc.aio.Channel | None = None,
        max_backoff_s: float = 5.0,
        idle_probe_s: float = 2.0,
    ) -> None:
        if mode not in ("auto", "events"):
            raise ValueError(f"IndexedLookup mode must be auto or events, got {mode!r}")
        self.master_lookup = master_lookup
        self.stub = stub
        self.mode = mode
        self.index = PrefixIndex()
        self.max_backoff_s = max_backoff_s
        self.idle_probe_s = idle_probe_s
        self._channel = channel
        self._task: asyncio.Task | None = None
        #: Set when the master has no SubscribeKVEvents (auto mode then asks it per lookup).
        self.unsupported = False

    async def __call__(self, keys: list[str]) -> int:
        if self._task is None:
            self.start()
        if self.index.synced:
            LOOKUPS.labels("index").inc()
            return self.index.longest_prefix(keys)
        LOOKUPS.labels("master").inc()
        return await self.master_lookup(keys)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        backoff = 0.1
        while True:
            try:
                call = self.stub.SubscribeKVEvents(pb.SubscribeKVEventsRequest(snapshot=True))
                batches = aiter(call)
                while (batch := await self._next(call, batches)) is not None:
                    if not self.index.apply(batch):
                        log.info("KV event gap at seq %d: resyncing", batch.seq)
                        call.cancel()
                        break
                    if self.index.synced:
                        backoff = 0.1
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.mode == "auto":
                    log.info("the KV master has no SubscribeKVEvents: prefix lookups ask it")
                    self.unsupported = True
                    self.index.desync()
                    return
                log.warning("KV event subscription failed: %s", exc.code())
            except Exception:
                log.exception("KV event subscription failed")
            if self.index.synced or self.index.seq >= 0:
                RESYNCS.inc()
            self.index.desync()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def _next(self, call, batches) -> pb.KVEventBatch | None:
        """The stream's next batch (None at its end). A stream quiet for ``idle_probe_s``
        is checked with a Stats call: a master that does not answer it (paused, cut off; one
        of several HA masters: the channel then moves on) ends the stream, so the follower
        resubscribes where the store is served now instead of holding a stale index."""
        read = asyncio.ensure_future(anext(batches, None))
        while True:
            try:
                batch = await asyncio.wait_for(asyncio.shield(read), self.idle_probe_s)
            except TimeoutError:
                try:
                    await self.stub.Stats(pb.StatsRequest(), timeout=self.idle_probe_s)
                except grpc.RpcError as exc:
                    log.warning("KV master quiet and not answering (%s): resubscribing", exc.code())
                    read.cancel()
                    call.cancel()
                    return None
                continue
            except BaseException:
                read.cancel()
                raise
            return batch

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self.index.desync()
        if self._channel is not None:
            await self._channel.close()

    def close(self) -> None:
        """Stops following now; the channel closes in the background (on a running loop)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.index.desync()
        if self._channel is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().create_task(self._channel.close())
            self._channel = None


def indexed_lookup(master: str, mode: str, master_lookup: Callable[[list[str]], Awaitable[int]]):
    """The lookup for ``prefix_source`` ``mode``: ``master_lookup`` itself for ``master``,
    else an :class:`IndexedLookup` on its own channel to ``master``."""
    if mode == "master":
        return master_lookup
    from pdserve import grpcutil

    channel = grpcutil.channel(master, role="master")
    return IndexedLookup(
        master_lookup, kvstore_pb2_grpc.KVMasterServiceStub(channel), mode=mode, channel=channel
    )
