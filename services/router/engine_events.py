"""What each stock ``vllm serve`` engine holds in its own prefix cache, from vLLM's KV events
(``vllm serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``), so the router's placement
knows which engine already holds a prompt's prefix instead of guessing from its own picks.

vLLM's block hashes cannot be recomputed outside the engine without its hashing settings (a
``PYTHONHASHSEED``-seeded root, ``prefix_caching_hash_algo``), so the view does not use them
as keys: a ``BlockStored`` carries each block's token ids and its parent's hash, so the view
chains its own BLAKE3 hash over the tokens (:func:`pdserve.hashing.chain_hashes` at the
engine's block size, under a root of its own) and keeps, per vLLM hash, the chain hash it
stands for. A prompt's leading blocks are then looked up by hashing the prompt the same way.
What the view cannot place it leaves out, so it only ever under-counts:

- a block whose parent it never saw (it subscribed late and the engine offers no replay);
- blocks of a LoRA adapter, of multimodal inputs or of another KV group (hybrid models);
- a block whose extra keys are anything but the first block's cache salt (a salted prompt
  chains under its salt's root, as vLLM's own hashes do: only the tenant's requests match).

The engine's publisher must bind its endpoint (vLLM binds a ``tcp://*:PORT`` or ``ipc://``
endpoint, its default ``tcp://*:5557``; a ``tcp://HOST:PORT`` one makes vLLM connect out to a
collector instead), and the router connects to it. Each engine's publisher numbers its batches; the follower asks the replay endpoint (when
given) for everything from 0 at start and for the missed ones after a gap, and forgets the
engine's blocks when its numbering restarts (a restarted engine starts empty). The view steers
placement only: a wrong count costs a slower first token, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import blake3
from prometheus_client import Counter as MetricCounter
from prometheus_client import Gauge

from pdserve.hashing import chain_hashes
from pdserve.telemetry import REGISTRY

if TYPE_CHECKING:
    from pdserve.services.router.policies.base import RouteContext
    from pdserve.services.router.workers import Worker

log = logging.getLogger(__name__)

BLOCKS = Gauge(
    "pdserve_router_engine_cached_blocks",
    "Blocks a stock engine's KV events say its prefix cache holds (those the view can place)",
    ["engine"],
    registry=REGISTRY,
)
BATCHES = MetricCounter(
    "pdserve_router_engine_kv_event_batches_total",
    "KV event batches applied from stock engines (replayed ones too)",
    ["engine"],
    registry=REGISTRY,
)
GAPS = MetricCounter(
    "pdserve_router_engine_kv_event_gaps_total",
    "Batches a stock engine's publisher numbered that the router never got (none replayed)",
    ["engine"],
    registry=REGISTRY,
)
#: vLLM's end-of-replay sequence number (ZmqEventPublisher.END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _root(cache_salt: str) -> bytes:
    return blake3.blake3(b"pdserve-engine-view\x00" + cache_salt.encode()).digest()


def parse_engine_events(specs: Sequence[str]) -> dict[str, tuple[str, str]]:
    """``URL=ENDPOINT[+REPLAY]`` per engine -> {URL: (endpoint, replay endpoint or "")}.
    Raises ValueError naming what is wrong."""
    out: dict[str, tuple[str, str]] = {}
    for spec in specs:
        url, sep, rest = spec.partition("=")
        endpoints = rest.split("+") if sep else []
        if not url.startswith(("http://", "https://")) or not 1 <= len(endpoints) <= 2:
            raise ValueError(
                f"engine_kv_events {spec!r}: expected URL=ENDPOINT[+REPLAY_ENDPOINT], e.g. "
                "http://10.0.0.5:8000=tcp://10.0.0.5:5557+tcp://10.0.0.5:5558 (the engine's "
                "--kv-events-config endpoint and replay_endpoint, with its host for '*')"
            )
        for e in endpoints:
            if not e.startswith(("tcp://", "ipc://")):
                raise ValueError(f"engine_kv_events {spec!r}: {e!r} is not a tcp:// or ipc:// URL")
        if url in out:
            raise ValueError(f"engine_kv_events: {url} is given twice")
        out[url] = (endpoints[0], endpoints[1] if len(endpoints) > 1 else "")
    return out


class EngineCache:
    """One engine's prefix cache as its KV events say (plain state, no I/O)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.block_size = 0
        #: Sequence number of the last batch applied (-1 = none).
        self.seq = -1
        #: vLLM block hash -> the view's chain hash of the prefix ending with that block.
        self._blocks: dict[Any, bytes] = {}
        self._held: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self._held.clear()

    def apply_batch(self, seq: int, batch: Any) -> int:
        """Applies a decoded ``KVEventBatch`` (``[ts, events, dp_rank]``) numbered ``seq``;
        returns how many batches before it were missed (0 in order; a restart clears)."""
        missed = 0
        if seq <= self.seq:  # the publisher's numbering restarted: a fresh engine
            self.clear()
        elif self.seq >= 0:
            missed = seq - self.seq - 1
        self.seq = seq
        self.apply(batch[1] if isinstance(batch, list | tuple) and len(batch) > 1 else [])
        BLOCKS.labels(self.name).set(len(self._blocks))
        return missed

    def apply(self, events: Iterable[Any]) -> None:
        for ev in events:
            if not isinstance(ev, dict):
                continue
            kind = ev.get("type")
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                if ev.get("medium") in (None, "GPU") and not ev.get("group_idx"):
                    for h in ev.get("block_hashes") or ():
                        self._drop(h)
            elif kind == "AllBlocksCleared":
                self.clear()

    def _stored(self, ev: dict[str, Any]) -> None:
        if ev.get("medium") not in (None, "GPU") or ev.get("group_idx"):
            return
        if ev.get("lora_id") is not None or ev.get("lora_name") is not None:
            return
        bs = int(ev.get("block_size") or 0)
        hashes = list(ev.get("block_hashes") or ())
        tokens = list(ev.get("token_ids") or ())
        if bs <= 0 or len(tokens) != bs * len(hashes):
            return
        if bs != self.block_size:
            self.clear()
            self.block_size = bs
        extra = list(ev.get("extra_keys") or [])[: len(hashes)]
        extra += [None] * (len(hashes) - len(extra))
        parent = ev.get("parent_block_hash")
        if parent is None:
            salt = extra[0][0] if extra[0] and len(extra[0]) == 1 else ""
            if extra[0] and not (len(extra[0]) == 1 and isinstance(salt, str)):
                return  # extra keys other than a salt (multimodal, embeddings)
            prev = _root(salt)
            extra = [None, *extra[1:]]
        else:
            prev = self._blocks.get(parent)
            if prev is None:
                return  # its prefix was never seen
        for i, h in enumerate(hashes):
            if extra[i]:
                return
            (prev,) = chain_hashes(prev, tokens[i * bs : (i + 1) * bs], bs)
            old = self._blocks.get(h)
            if old != prev:
                if old is not None:
                    self._drop(h)
                self._blocks[h] = prev
                self._held[prev] += 1

    def _drop(self, h: Any) -> None:
        ours = self._blocks.pop(h, None)
        if ours is not None:
            self._held[ours] -= 1
            if self._held[ours] <= 0:
                del self._held[ours]

    def cached_tokens(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Leading prompt tokens the engine holds (whole blocks)."""
        bs = self.block_size
        if not bs or not self._held:
            return 0
        n = 0
        for h in chain_hashes(_root(cache_salt), tokens, bs):
            if h not in self._held:
                break
            n += 1
        return n * bs


class EngineCaches:
    """The views of every engine that publishes events, by its URL (the worker's address)."""

    def __init__(self, specs: dict[str, tuple[str, str]] | None = None) -> None:
        self.specs = specs or {}
        self.caches = {url: EngineCache(url) for url in self.specs}
        self._tasks: list[asyncio.Task] = []

    def cached_tokens(self, worker: Worker, ctx: RouteContext) -> int | None:
        """Leading prompt tokens ``worker``'s engine holds; None when it publishes no events
        (or none has arrived yet) or the prompt is not known."""
        cache = self.caches.get(worker.address)
        if cache is None or cache.seq < 0 or not ctx.token_ids:
            return None
        return cache.cached_tokens(ctx.token_ids, ctx.cache_salt)

    def start(self) -> None:
        for url, (endpoint, replay) in self.specs.items():
            follower = EngineEventFollower(self.caches[url], endpoint, replay)
            task = asyncio.ensure_future(follower.run())
            task.add_done_callback(_log_end)
            self._tasks.append(task)

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()


def _log_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a KV event follower stopped", exc_info=task.exception())


class EngineEventFollower:
    """Subscribes to one engine's ZMQ publisher (SUB) and replays from its ROUTER socket."""

    def __init__(self, cache: EngineCache, endpoint: str, replay: str = "") -> None:
        self.cache = cache
        self.endpoint = endpoint
        self.replay_endpoint = replay

    async def run(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        decode = msgspec.msgpack.Decoder().decode
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        log.info("following KV events of %s at %s", self.cache.name, self.endpoint)
        try:
            replayed = await self._replay(ctx, decode, 0)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if replayed is not None:
                    if replayed[0] <= seq <= replayed[1]:
                        continue  # queued here while the replay applied it
                    replayed = None
                if 0 <= self.cache.seq < seq - 1:
                    replayed = await self._replay(ctx, decode, self.cache.seq + 1)
                    if seq <= self.cache.seq:
                        continue
                self._apply(seq, frames[2], decode)
        finally:
            sub.close(0)

    def _apply(self, seq: int, payload: bytes, decode) -> None:
        try:
            batch = decode(payload)
        except Exception:
            log.warning("undecodable KV event batch %d from %s", seq, self.cache.name)
            return
        missed = self.cache.apply_batch(seq, batch)
        BATCHES.labels(self.cache.name).inc()
        if missed > 0:
            GAPS.labels(self.cache.name).inc(missed)
            log.warning("missed %d KV event batches of %s", missed, self.cache.name)

    async def _replay(
        self, ctx, decode, start: int, timeout_s: float = 2.0
    ) -> tuple[int, int] | None:
        """Applies the publisher's buffered batches from ``start`` on; the range of sequence
        numbers applied, or None (no replay endpoint, nothing buffered, or no answer within
        ``timeout_s``)."""
        if not self.replay_endpoint:
            return None
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        first = last = -1
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), timeout_s)
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq > self.cache.seq:
                    self._apply(seq, frames[3], decode)
                    first = seq if first < 0 else first
                    last = seq
        except TimeoutError:
            log.info("no KV event replay from %s within %.0f s", self.replay_endpoint, timeout_s)
        finally:
            dealer.close(0)
        return (first, last) if first >= 0 else None
