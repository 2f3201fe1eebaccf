"""KV events in the shape of vLLM's ``KVEventBatch`` (vllm/distributed/kv_events.py), so a
KV-aware router written for vLLM can follow the pooled cache, and pdserve's router can answer
longest-prefix lookups from its own index (``services/router/prefix_index.py``).

The master records a block event for every stored or removed chunk object (keys of 64 hex
characters; request tails and raw objects are not blocks) while it holds its state lock, and
the event loop turns what was recorded into numbered batches (one per flush: usually one per
master call). Each batch goes to

- the gRPC stream ``SubscribeKVEvents`` (``pb.KVEventBatch``, the same fields in proto form),
  with replay from a sequence number out of a bounded ring, or a snapshot of every current
  block first; a subscriber more than ``kv_events_queue`` batches behind is cut off (its
  stream ends; it resubscribes), the master never waits for one;
- optionally ZMQ (``kv_events_endpoint``): vLLM's wire format, byte for byte what vLLM's
  ``ZmqEventPublisher`` sends: multipart ``[topic, seq as 8-byte big-endian, msgpack
  payload]`` on a PUB socket, and a ROUTER socket (``kv_events_replay_endpoint``) that
  answers ``[b"", seq as 8 bytes]`` with the buffered batches from that sequence number on,
  then ``[b"", -1 as 8 bytes, b""]``. The payload decodes with vLLM's own
  ``msgspec.msgpack.Decoder(KVEventBatch)``.

Block hashes are the chunk keys as 32 raw bytes (vLLM's default ``ExternalBlockHash``,
sha256 bytes; ours are BLAKE3, and ``key == hash.hex()``). A stored event carries the parent's
hash and the token ids when the writer attached them to its put (``PutStartItem.block``);
consecutive blocks of one chain in one batch are one ``BlockStored``, as vLLM sends them.

Engine block hashes: an indexer built for vLLM's own events (llm-d's KV cache manager) keys
its view by vLLM's block hashes, which it computes itself from prompts, so it cannot match
chunk keys. A writer that knows them (the vLLM connector: ``request.block_hashes``, which vLLM
computes with prefix caching or a KV connector on) attaches the engine's hashes of the ``chunk_size / block_size`` engine
blocks inside each chunk, the hash of the block before them and the engine's block size
(``KVBlockMeta.engine_*``). The gRPC events carry both: the chunk keys as ever plus
``engine_block_hashes`` / ``engine_parent_block_hash`` / ``engine_block_size`` of the same
blocks (removals and snapshots too). The ZMQ payload carries one kind of hash, chosen by
``kv_events_hashes``: ``chunk`` (the default: chunk keys, block size = chunk size) or
``engine`` (the engine's hashes, parent and block size, token ids unchanged; a chunk stored
without them keeps its chunk key). vLLM's hashes depend on its hash settings:
``prefix_caching_hash_algo`` and ``PYTHONHASHSEED``, which seeds every chain's root (unset: a
fixed seed for sha256, a random one per process for xxhash). An indexer must hash prompts
exactly as the engines do, as llm-d requires, and every engine must use the same settings.

Tiers: a chunk in memory is published with ``kv_events_medium`` (default ``CPU``), or the
medium its writer named; a copy on a node's disk tier with medium ``DISK``. A copy moved
down is a stored block of ``DISK`` (the memory one stays until memory evicts it: a removed
block of the memory medium); a copy brought back up is a stored block of the memory medium.
A block is in the store while any medium holds it; its last removal names the medium that
held it last, and a snapshot names memory for a chunk in memory, ``DISK`` for one only on
disk.

Sequence numbers count from 0 at each master start; batch 0 starts with
``AllBlocksCleared``, so a consumer that follows a restarted master forgets what the previous
one held (the restarted master announces its objects again as nodes remount them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Any

from pdserve.services.kvstore.master.types import BlockMeta, is_block_key
from pdserve.v1 import kvstore_pb2 as pb

#: The medium of a block on a node's disk tier.
DISK_MEDIUM = "DISK"

log = logging.getLogger(__name__)

#: Keys per snapshot batch.
SNAPSHOT_BATCH = 1024
#: vLLM's end-of-replay marker (ZmqEventPublisher.END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_STORED, _REMOVED, _CLEARED = 1, 2, 3

#: What the ZMQ payload's block hashes are (``kv_events_hashes``): pdserve's chunk keys, or
#: the engine's own block hashes where the writer gave them.
HASH_MODES = ("chunk", "engine")


def tokens_of(packed: bytes) -> list[int]:
    """Token ids packed as uint32 little-endian, as a list."""
    a = array("I", packed)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def _engine_of(block: BlockMeta | None) -> list[bytes]:
    return list(block.engine_hashes) if block is not None else []


class _Stored:
    __slots__ = (
        "block_size",
        "engine",
        "engine_bs",
        "engine_parent",
        "hashes",
        "medium",
        "parent",
        "tokens",
    )

    def __init__(
        self,
        h: bytes,
        parent: bytes | None,
        tokens: list[int],
        bs: int,
        medium: str,
        block: BlockMeta | None = None,
    ):
        self.hashes = [h]
        self.parent = parent
        self.tokens = tokens
        self.block_size = bs
        self.medium = medium
        # the engine's own block hashes (vLLM's), when the writer gave them
        self.engine = _engine_of(block)
        self.engine_parent: bytes | None = None
        self.engine_bs = 0
        if block is not None and self.engine:
            self.engine_parent = block.engine_parent or None
            self.engine_bs = block.engine_block_size


class _Removed:
    __slots__ = ("engine", "hashes", "medium")

    def __init__(self, h: bytes, medium: str, engine: list[bytes]):
        self.hashes = [h]
        self.medium = medium
        self.engine = engine


class _Cleared:
    __slots__ = ()


Event = _Stored | _Removed | _Cleared


def group(ops: Iterable[tuple[int, str, BlockMeta | None, str]]) -> list[Event]:
    """Recorded ``(kind, key, block, medium)`` as vLLM's events: a stored block whose parent is
    the last block of the stored event before it (same size and medium, and both with engine
    hashes that continue each other's chain or both without) extends it, as do consecutive
    removals of one medium (both with engine hashes or both without)."""
    out: list[Event] = []
    for kind, key, block, medium in ops:
        last = out[-1] if out else None
        if kind == _CLEARED:
            out.append(_Cleared())
            continue
        h = bytes.fromhex(key)
        if kind == _REMOVED:
            engine = _engine_of(block)
            if (
                isinstance(last, _Removed)
                and last.medium == medium
                and bool(engine) == bool(last.engine)
            ):
                last.hashes.append(h)
                last.engine.extend(engine)
            else:
                out.append(_Removed(h, medium, engine))
            continue
        parent = bytes.fromhex(block.parent) if block is not None and block.parent else None
        tokens = tokens_of(block.tokens) if block is not None else []
        bs = block.block_size if block is not None else 0
        new = _Stored(h, parent, tokens, bs, medium, block)
        if (
            isinstance(last, _Stored)
            and parent is not None
            and parent == last.hashes[-1]
            and bs == last.block_size
            and medium == last.medium
            and bool(tokens) == bool(last.tokens)
            and bool(new.engine) == bool(last.engine)
            and (
                not new.engine
                or (new.engine_bs == last.engine_bs and new.engine_parent == last.engine[-1])
            )
        ):
            last.hashes.append(h)
            last.tokens.extend(tokens)
            last.engine.extend(new.engine)
        else:
            out.append(new)
    return out


def to_proto(seq: int, ts: float, events: list[Event], **flags: bool) -> pb.KVEventBatch:
    batch = pb.KVEventBatch(seq=seq, ts=ts, **flags)
    for e in events:
        ev = batch.events.add()
        if isinstance(e, _Stored):
            ev.stored.block_hashes.extend(e.hashes)
            ev.stored.parent_block_hash = e.parent or b""
            ev.stored.token_ids.extend(e.tokens)
            ev.stored.block_size = e.block_size
            ev.stored.medium = e.medium
            ev.stored.engine_block_hashes.extend(e.engine)
            ev.stored.engine_parent_block_hash = e.engine_parent or b""
            ev.stored.engine_block_size = e.engine_bs
        elif isinstance(e, _Removed):
            ev.removed.block_hashes.extend(e.hashes)
            ev.removed.medium = e.medium
            ev.removed.engine_block_hashes.extend(e.engine)
        else:
            ev.cleared.SetInParent()
    return batch


def to_vllm(ts: float, events: list[Event], engine: bool = False) -> list[Any]:
    """The batch as the plain values vLLM's ``KVEventBatch`` encodes to: an array ``[ts,
    events]`` (``data_parallel_rank`` None, omitted as vLLM omits defaults), each event a map
    tagged ``type`` with vLLM's class name and every field vLLM's decoder requires. With
    ``engine`` (``kv_events_hashes: engine``) the hashes, parent and block size are the
    engine's own where the writer gave them (a chunk without them keeps its chunk key)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, _Stored):
            mine = engine and bool(e.engine)
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": e.engine if mine else e.hashes,
                    "parent_block_hash": e.engine_parent if mine else e.parent,
                    "token_ids": e.tokens,
                    "block_size": e.engine_bs if mine else e.block_size,
                    "lora_id": None,
                    "medium": e.medium,
                    "lora_name": None,
                }
            )
        elif isinstance(e, _Removed):
            hashes = e.engine if engine and e.engine else e.hashes
            out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": e.medium})
        else:
            out.append({"type": "AllBlocksCleared"})
    return [ts, out]


class Subscription:
    """One gRPC subscriber's queue of batches (filled on the event loop)."""

    def __init__(self, maxlen: int) -> None:
        self._batches: collections.deque[pb.KVEventBatch] = collections.deque()
        self._maxlen = maxlen
        self._ready = asyncio.Event()
        self.closed = False

    def push(self, batch: pb.KVEventBatch) -> bool:
        """Queues ``batch``; False (and closed) when the subscriber is too far behind."""
        if len(self._batches) >= self._maxlen:
            self.close()
            return False
        self._batches.append(batch)
        self._ready.set()
        return True

    async def next(self) -> pb.KVEventBatch | None:
        """The next batch, or None once closed (the queue is dropped: a cut-off subscriber
        resubscribes, and a closing master has nothing more to say)."""
        while not self._batches:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        if self.closed:
            return None
        return self._batches.popleft()

    def close(self) -> None:
        self.closed = True
        self._ready.set()


class KVEventLog:
    """Records block events (any thread, under the master's state lock), publishes them as
    numbered batches (:meth:`flush`, on the event loop), keeps the last ``buffer`` batches for
    replay and fans them out to gRPC subscribers and the ZMQ publisher."""

    def __init__(
        self,
        *,
        medium: str = "CPU",
        buffer: int = 1000,
        queue: int = 10_000,
        encode_vllm: bool = False,
        hashes: str = "chunk",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if hashes not in HASH_MODES:
            raise ValueError(f"hashes must be one of {', '.join(HASH_MODES)}, got {hashes!r}")
        self.medium = medium
        #: The ZMQ payload names the engine's own block hashes (``kv_events_hashes``).
        self.engine_hashes = hashes == "engine"
        self.queue = queue
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[tuple[int, str, BlockMeta | None, str]] = []
        self._ring: collections.deque[tuple[int, pb.KVEventBatch, bytes]] = collections.deque(
            maxlen=buffer
        )
        # keys stored with a medium other than the default (their removal names it too)
        self._media: dict[str, str] = {}
        self._subs: set[Subscription] = set()
        self._encoder: Any = None
        if encode_vllm:
            import msgspec

            self._encoder = msgspec.msgpack.Encoder()
        #: Called (from any thread) when a first event is pending: schedules :meth:`flush`.
        self.wake: Callable[[], None] = lambda: None
        #: Called on the loop with (seq, payload) of each batch: the ZMQ publisher.
        self.sink: Callable[[int, bytes], None] | None = None
        #: Sequence number of the last batch published (-1 = none yet).
        self.seq = -1
        #: Subscribers cut off for being too far behind.
        self.cut_off = 0
        self.cleared()

    # ------------------------------------------------------------------ recording

    def _add(self, op: tuple[int, str, BlockMeta | None, str]) -> None:
        with self._lock:
            first = not self._pending
            self._pending.append(op)
        if first:
            self.wake()

    def stored(self, key: str, block: BlockMeta | None, tiers: Iterable[int] = ()) -> None:
        """A block came into the store, in ``tiers`` (its copies' pb.StorageTier; none said
        = memory): the memory medium when memory holds it, else ``DISK``."""
        if not is_block_key(key):
            return
        medium = self._memory_medium(key, block)
        if tiers and pb.STORAGE_TIER_MEMORY not in tiers:
            medium = self._media[key] = DISK_MEDIUM
        self._add((_STORED, key, block, medium))

    def removed(self, key: str, block: BlockMeta | None = None, tiers: Iterable[int] = ()) -> None:
        """A block left the store. ``block``: what the object was stored with (its engine
        hashes are published); ``tiers``: where its copies were (one removal per medium;
        none said = the medium it was last published with)."""
        if not is_block_key(key):
            return
        last = self._media.pop(key, self.medium)
        tiers = set(tiers)
        if len(tiers) < 2:
            self._add((_REMOVED, key, block, last))
            return
        for medium in (self._writer_medium(block), DISK_MEDIUM):
            self._add((_REMOVED, key, block, medium))

    def tier_added(self, key: str, block: BlockMeta | None, tier: int) -> None:
        """A copy in ``tier`` joined the block's copies in the other tier."""
        if not is_block_key(key):
            return
        if tier == pb.STORAGE_TIER_DISK:
            self._add((_STORED, key, block, DISK_MEDIUM))
            return
        if self._media.get(key) == DISK_MEDIUM:  # back in memory
            del self._media[key]
        self._add((_STORED, key, block, self._memory_medium(key, block)))

    def tier_dropped(self, key: str, block: BlockMeta | None, tier: int) -> None:
        """The copy in ``tier`` went; the other tier still holds the block."""
        if not is_block_key(key):
            return
        if tier == pb.STORAGE_TIER_DISK:
            self._add((_REMOVED, key, block, DISK_MEDIUM))
            return
        medium = self._writer_medium(block)
        self._media[key] = DISK_MEDIUM
        self._add((_REMOVED, key, block, medium))

    def _writer_medium(self, block: BlockMeta | None) -> str:
        """The medium a block in memory is published with: its writer's, else the default."""
        return block.medium if block is not None and block.medium else self.medium

    def _memory_medium(self, key: str, block: BlockMeta | None) -> str:
        """:meth:`_writer_medium`, remembered for the block's removal when not the default."""
        medium = self._writer_medium(block)
        if medium != self.medium:
            self._media[key] = medium
        return medium

    def cleared(self) -> None:
        self._add((_CLEARED, "", None, ""))

    # ------------------------------------------------------------------ publishing

    def flush(self) -> pb.KVEventBatch | None:
        """Publishes what was recorded as the next batch (None when nothing was)."""
        with self._lock:
            ops, self._pending = self._pending, []
            if not ops:
                return None
            events = group(ops)
            self.seq += 1
            ts = self._clock()
            batch = to_proto(self.seq, ts, events)
            payload = (
                self._encoder.encode(to_vllm(ts, events, self.engine_hashes))
                if self._encoder
                else b""
            )
            self._ring.append((self.seq, batch, payload))
            for sub in list(self._subs):
                if not sub.push(batch):
                    self._subs.discard(sub)
                    self.cut_off += 1
            seq = self.seq
        if self.sink is not None:
            try:
                self.sink(seq, payload)
            except Exception:  # a publisher problem never stalls the master
                log.exception("publishing KV events over ZMQ failed")
        return batch

    def replay(self, from_seq: int) -> list[tuple[int, bytes]]:
        """(seq, vLLM payload) of the buffered batches from ``from_seq`` on."""
        with self._lock:
            return [(s, p) for s, _, p in self._ring if s >= from_seq]

    # ------------------------------------------------------------------ subscribers

    def subscribe(
        self,
        *,
        snapshot: list[str] | None = None,
        from_seq: int | None = None,
        block_of: Callable[[str], BlockMeta | None] | None = None,
    ) -> tuple[Subscription, list[pb.KVEventBatch]]:
        """A new subscriber and the batches to send it first: with ``snapshot`` (every block
        key the master holds, taken under its state lock, as this is) cleared + stored
        batches numbered with the last published seq, each block with the engine hashes
        ``block_of`` gives it; else the ring from ``from_seq``; else none. Later batches are
        pushed to it."""
        sub = Subscription(self.queue)
        with self._lock:
            seq = self.seq
            ring = [b for s, b, _ in self._ring if from_seq is not None and s >= from_seq]
            self._subs.add(sub)
        if snapshot is None:
            return sub, ring
        ts = self._clock()
        first: list[pb.KVEventBatch] = []
        keys = [k for k in snapshot if is_block_key(k)]
        for i in range(0, max(len(keys), 1), SNAPSHOT_BATCH):
            part: list[Event] = [_Cleared()] if i == 0 else []
            part += [
                _Stored(
                    bytes.fromhex(k),
                    None,
                    [],
                    0,
                    self._media.get(k, self.medium),
                    block_of(k) if block_of is not None else None,
                )
                for k in keys[i : i + SNAPSHOT_BATCH]
            ]
            first.append(to_proto(seq, ts, part, snapshot=True))
        first[-1].snapshot_end = True
        return sub, first

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def close(self) -> None:
        with self._lock:
            subs, self._subs = self._subs, set()
        for sub in subs:
            sub.close()


def zmq_bind_host(endpoint: str) -> str:
    """The host part of a ``tcp://host:port`` endpoint ("" for other transports)."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://") :].rsplit(":", 1)[0]


class ZmqPublisher:
    """vLLM's ZMQ publisher protocol on the event loop (pyzmq's asyncio sockets): PUB of
    ``[topic, seq, payload]``, and a ROUTER answering replay requests from the log's ring."""

    def __init__(self, events: KVEventLog, endpoint: str, replay_endpoint: str, topic: str):
        import zmq
        import zmq.asyncio

        self.events = events
        self.topic = topic.encode()
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_sock = None
        self.replay_endpoint = ""
        self._task: asyncio.Task | None = None
        if replay_endpoint:
            self.replay_sock = self.ctx.socket(zmq.ROUTER)
            self.replay_sock.bind(replay_endpoint)
            self.replay_endpoint = self.replay_sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        events.sink = self.send

    def send(self, seq: int, payload: bytes) -> None:
        import zmq

        # PUB never blocks: beyond its high-water mark a slow subscriber loses batches
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self.replay_sock is not None
        while True:
            frames = await self.replay_sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            for seq, payload in self.events.replay(int.from_bytes(start, "big")):
                await self.replay_sock.send_multipart(
                    [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
            await self.replay_sock.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self.events.sink = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.pub.close(linger=0)
        if self.replay_sock is not None:
            self.replay_sock.close(linger=0)
        self.ctx.term()
