"""The router's KV-event prefix index against a real master and node: it answers the same
longest prefix as the master, falls back to the master when its subscription breaks (a gap
in sequence numbers, the stream ending) and resyncs."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pdserve import grpcutil, procs
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.services.router.prefix_index import IndexedLookup, PrefixIndex
from pdserve.services.router.server import prefix_lookup
from pdserve.store import open_store
from pdserve.store.api import StoreBackend
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

FP = ModelFingerprint("prefix-index-test", chunk_size=4)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    with procs.local_store(
        tmp_path_factory.mktemp("prefix-index"),
        segment_size="32MiB",
        master_flags={"state_dir": ""},
    ) as (master, _node):
        client = open_store(master.info["grpc"])
        try:
            yield master.info["grpc"], client
        finally:
            client.close()


def prompts(rng: random.Random, n: int) -> list[list[str]]:
    """Chains of ``n`` prompts, many sharing prefixes (a few system prompts)."""
    systems = [[rng.randrange(50_000) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    out = []
    for _ in range(n):
        tokens = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(40))]
        out.append(chunk_keys(FP, tokens))
    return out


def put(client: StoreBackend, keys: list[str]) -> None:
    if keys:
        client.batch_put([(k, b"v" * 64) for k in keys])


async def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def caught_up(client: StoreBackend, index: PrefixIndex) -> None:
    """Puts a fresh sentinel chunk and waits until the index holds it: events are in order,
    so everything stored or removed before it is applied too."""
    (sentinel,) = chunk_keys(FP, [random.randrange(2**31) for _ in range(4)])
    await asyncio.to_thread(put, client, [sentinel])
    await wait_for(lambda: index.synced and sentinel in index.keys, "the sentinel")


class CountingMaster:
    def __init__(self, address: str) -> None:
        self.lookup = prefix_lookup(address)
        self.calls = 0

    async def __call__(self, keys: list[str]) -> int:
        self.calls += 1
        return await self.lookup(keys)


@pytest.mark.slow
def test_index_answers_what_the_master_answers(store) -> None:
    address, client = store
    rng = random.Random(7)

    async def main() -> None:
        master = CountingMaster(address)
        channel = grpcutil.channel(address)
        lookup = IndexedLookup(master, kvstore_pb2_grpc.KVMasterServiceStub(channel))
        lookup.start()
        chains = prompts(rng, 60)
        # random subsets (holes too), some stored before the subscription's snapshot
        every = sorted({k for c in chains for k in c})
        await asyncio.to_thread(put, client, rng.sample(every, len(every) // 3))
        await wait_for(lambda: lookup.index.synced, "the snapshot")
        for _ in range(3):
            await asyncio.to_thread(put, client, rng.sample(every, len(every) // 4))
            await asyncio.to_thread(client.remove, rng.sample(every, len(every) // 6))
            await caught_up(client, lookup.index)
            before = master.calls
            for keys in chains:
                want = await master(keys)
                assert await lookup(keys) == want, keys
            assert master.calls - before == len(chains)  # the index answered, not the master
        assert sum(lookup.index.longest_prefix(c) for c in chains) > 0  # not all misses
        await lookup.aclose()

    asyncio.run(main())


class BreakingStub:
    """Forwards SubscribeKVEvents; the first stream breaks as ``how`` says after its first live
    batch (``gap``: the next batch is skipped; ``end``: the stream just ends). The second
    subscription waits for ``release``, so the test sees the fallback before the resync."""

    def __init__(self, stub, how: str) -> None:
        self.stub = stub
        self.how = how
        self.subscriptions = 0
        self.release = asyncio.Event()

    def SubscribeKVEvents(self, request):
        self.subscriptions += 1
        return _Stream(self, self.stub, request, self.subscriptions)

    def Stats(self, request, **kw):  # the follower's check of a quiet stream
        return self.stub.Stats(request, **kw)


class _Stream:
    def __init__(self, owner: BreakingStub, stub, request, n: int) -> None:
        self.owner, self.stub, self.request, self.n = owner, stub, request, n
        self.call = None

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    async def __aiter__(self):
        if self.n > 1:
            await self.owner.release.wait()
        self.call = self.stub.SubscribeKVEvents(self.request)
        live = 0
        async for batch in self.call:
            if self.n == 1 and not batch.snapshot:
                live += 1
                if live == 2:
                    if self.owner.how == "end":
                        self.call.cancel()
                        return
                    continue  # "gap": this batch never reaches the index
            yield batch


@pytest.mark.slow
@pytest.mark.parametrize("how", ["gap", "end"])
def test_a_broken_subscription_falls_back_to_the_master_then_resyncs(store, how) -> None:
    address, client = store
    rng = random.Random(f"prefix-index-{how}")  # str seeds are stable; hash() is not

    async def main() -> None:
        master = CountingMaster(address)
        channel = grpcutil.channel(address)
        stub = BreakingStub(kvstore_pb2_grpc.KVMasterServiceStub(channel), how)
        lookup = IndexedLookup(master, stub, max_backoff_s=0.05)  # type: ignore[arg-type]
        lookup.start()
        chains = prompts(rng, 20)
        await wait_for(lambda: lookup.index.synced, "the snapshot")
        await caught_up(client, lookup.index)  # the first live batch
        # the second live batch breaks the stream: stored, but the index never sees it
        await asyncio.to_thread(put, client, chains[0])
        if how == "gap":  # a gap shows at a batch after the missing one: fresh chunks, one
            # put at a time until the index notices (the master may flush two quick puts as
            # one batch, and then the skipped batch held the first fresh chunk too)
            deadline = time.monotonic() + 20.0
            while lookup.index.synced:
                assert time.monotonic() < deadline, "timed out waiting for the index to notice"
                (fresh,) = chunk_keys(FP, [random.randrange(2**31) for _ in range(4)])
                await asyncio.to_thread(put, client, [fresh])
                await asyncio.sleep(0.05)
        await wait_for(lambda: not lookup.index.synced, "the index to notice")
        before = master.calls
        assert await lookup(chains[0]) == len(chains[0])  # from the master, and right
        assert master.calls == before + 1
        stub.release.set()
        await caught_up(client, lookup.index)
        assert stub.subscriptions >= 2
        before = master.calls
        for keys in chains:
            assert await lookup(keys) == await master(keys)
        assert master.calls - before == len(chains)  # answered by the index again
        await lookup.aclose()

    asyncio.run(main())


def test_index_applies_batches_in_order_only() -> None:
    index = PrefixIndex()
    keys = chunk_keys(FP, list(range(12)))
    hashes = [bytes.fromhex(k) for k in keys]
    snap = pb.KVEventBatch(seq=4, snapshot=True, snapshot_end=True)
    snap.events.add().cleared.SetInParent()
    snap.events.add().stored.block_hashes.extend(hashes[:2])
    assert index.apply(snap) and index.synced
    live = pb.KVEventBatch(seq=5)
    live.events.add().stored.block_hashes.extend(hashes[2:])
    assert index.apply(live) and index.longest_prefix(keys) == 3
    removed = pb.KVEventBatch(seq=6)
    removed.events.add().removed.block_hashes.append(hashes[1])
    assert index.apply(removed) and index.longest_prefix(keys) == 1
    assert not index.apply(pb.KVEventBatch(seq=8)) and not index.synced  # 7 is missing
    assert not index.apply(pb.KVEventBatch(seq=9))  # stays out until a snapshot


def test_a_block_is_held_while_any_medium_holds_it() -> None:
    """The store's disk tier publishes copies as blocks of medium DISK: memory evicting a
    block that has a disk copy leaves it in the store."""
    index = PrefixIndex()
    (key,) = chunk_keys(FP, list(range(4)))
    h = bytes.fromhex(key)

    def batch(seq: int, *events: tuple[str, str]) -> pb.KVEventBatch:
        b = pb.KVEventBatch(seq=seq, snapshot=seq == 0, snapshot_end=seq == 0)
        for kind, medium in events:
            ev = getattr(b.events.add(), kind)
            ev.block_hashes.append(h)
            ev.medium = medium
        return b

    assert index.apply(batch(0, ("stored", "CPU"), ("stored", "DISK")))
    assert index.apply(batch(1, ("removed", "CPU"))) and index.longest_prefix([key]) == 1
    assert index.apply(batch(2, ("stored", "CPU"), ("removed", "DISK")))
    assert index.longest_prefix([key]) == 1
    assert index.apply(batch(3, ("removed", "CPU"))) and index.longest_prefix([key]) == 0


def test_a_quiet_stream_from_a_master_that_stopped_answering_is_left() -> None:
    """A paused master (SIGSTOP) keeps its event stream open and silent: the follower checks
    a quiet stream with Stats and, when that is not answered, subscribes again (to the master
    that serves now, with several HA masters) instead of holding a stale index."""

    class HangingStub:
        def __init__(self) -> None:
            self.subscriptions = 0
            self.cancelled = 0
            self.answering = True

        def SubscribeKVEvents(self, request):
            self.subscriptions += 1
            owner = self

            class Call:
                def cancel(self) -> None:
                    owner.cancelled += 1

                async def __aiter__(self):
                    yield pb.KVEventBatch(seq=0, snapshot=True, snapshot_end=True)
                    await asyncio.Event().wait()  # then silence, forever

            return Call()

        async def Stats(self, request, timeout=None):
            if not self.answering:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
                )
            return pb.StatsResponse()

    async def main() -> None:
        stub = HangingStub()

        async def master(keys: list[str]) -> int:
            return 0

        lookup = IndexedLookup(master, stub, max_backoff_s=0.05, idle_probe_s=0.05)  # type: ignore[arg-type]
        lookup.start()
        await wait_for(lambda: lookup.index.synced, "the snapshot")
        await asyncio.sleep(0.3)  # quiet, but the master answers: the stream is kept
        assert stub.subscriptions == 1
        stub.answering = False
        await wait_for(lambda: stub.subscriptions >= 2, "a new subscription")
        assert stub.cancelled >= 1
        await lookup.aclose()

    asyncio.run(main())
