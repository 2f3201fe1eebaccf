"""KV events in vLLM's KVEventBatch shape: the event log alone, then a real master and node
with chunks put through the real store client, read over ZMQ with vLLM's own decoder and over
the gRPC SubscribeKVEvents stream."""

from __future__ import annotations

import itertools

import blake3
import grpc
import pytest
from kv_events_harness import kv_events_store, put_chunks, ready_subscriber

from pdserve.config import ConfigError
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.kv_events import KVEventLog, tokens_of
from pdserve.services.kvstore.master.types import BlockMeta
from pdserve.store.api import ChunkMeta
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

CS = 4
FP = ModelFingerprint("kv-events-test", chunk_size=CS)


def packed(tokens: list[int]) -> bytes:
    return ChunkMeta("", tokens).packed_tokens()


def chain(tokens: list[int], salt: str = "") -> tuple[list[str], dict[str, ChunkMeta]]:
    keys = chunk_keys(FP, tokens, salt)
    meta = {
        k: ChunkMeta(keys[i - 1] if i else "", tokens[i * CS : (i + 1) * CS])
        for i, k in enumerate(keys)
    }
    return keys, meta


def vllm_classes():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    return kv_events


# ---------------------------------------------------------------------------- the log alone


def test_log_groups_a_chain_and_skips_objects_that_are_not_blocks() -> None:
    log = KVEventLog(clock=lambda: 12.5)
    first = log.flush()
    assert first is not None and first.seq == 0
    assert [e.WhichOneof("event") for e in first.events] == ["cleared"]
    keys, meta = chain(list(range(12)))
    for k in keys:
        m = meta[k]
        log.stored(k, BlockMeta(m.parent, m.packed_tokens(), CS, ""))
    log.stored("tail-" + "0" * 60, None)  # a request tail: not a block
    log.removed(keys[2])
    batch = log.flush()
    assert batch is not None and batch.seq == 1 and batch.ts == 12.5
    stored, removed = batch.events
    assert [h.hex() for h in stored.stored.block_hashes] == keys
    assert stored.stored.parent_block_hash == b""  # the chain's first block
    assert list(stored.stored.token_ids) == list(range(12))
    assert stored.stored.block_size == CS and stored.stored.medium == "CPU"
    assert [h.hex() for h in removed.removed.block_hashes] == [keys[2]]
    assert log.flush() is None  # nothing new: no batch, no sequence number


def test_blocks_of_other_chains_start_a_new_stored_event() -> None:
    log = KVEventLog()
    log.flush()
    a, ma = chain([1, 2, 3, 4, 5, 6, 7, 8])
    b, mb = chain([9, 9, 9, 9])
    for k, m in [(a[1], ma[a[1]]), (b[0], mb[b[0]])]:
        log.stored(k, BlockMeta(m.parent, m.packed_tokens(), CS, "GPU" if k == b[0] else ""))
    batch = log.flush()
    assert batch is not None
    first, second = (e.stored for e in batch.events)
    assert first.parent_block_hash.hex() == a[0] and list(first.token_ids) == [5, 6, 7, 8]
    assert second.medium == "GPU" and list(second.token_ids) == [9, 9, 9, 9]
    log.removed(b[0])  # removed where it was stored
    (ev,) = log.flush().events  # type: ignore[union-attr]
    assert ev.removed.medium == "GPU"


def test_tier_moves_are_blocks_of_the_disk_medium_and_the_snapshot_names_where_it_is() -> None:
    log = KVEventLog()
    log.flush()
    (k,), meta = chain([1, 2, 3, 4])
    block = BlockMeta("", meta[k].packed_tokens(), CS, "")

    def media() -> list[tuple[str | None, str]]:
        batch = log.flush()
        assert batch is not None
        return [
            (e.WhichOneof("event"), getattr(e, e.WhichOneof("event")).medium) for e in batch.events
        ]

    log.stored(k, block, [pb.STORAGE_TIER_MEMORY])
    log.tier_added(k, block, pb.STORAGE_TIER_DISK)  # moved down: memory keeps its copy
    log.tier_dropped(k, block, pb.STORAGE_TIER_MEMORY)  # memory evicted its copy
    assert media() == [("stored", "CPU"), ("stored", "DISK"), ("removed", "CPU")]
    _sub, snap = log.subscribe(snapshot=[k], block_of=lambda _k: block)
    assert [e.stored.medium for e in snap[0].events if e.WhichOneof("event") == "stored"] == [
        "DISK"
    ]
    log.tier_added(k, block, pb.STORAGE_TIER_MEMORY)  # read: back up
    log.removed(k, block, [pb.STORAGE_TIER_MEMORY, pb.STORAGE_TIER_DISK])  # gone from both
    assert media() == [("stored", "CPU"), ("removed", "CPU"), ("removed", "DISK")]
    log.stored(k, block, [pb.STORAGE_TIER_DISK])  # a disk-only copy restored on a remount
    log.removed(k, block, [pb.STORAGE_TIER_DISK])
    assert media() == [("stored", "DISK"), ("removed", "DISK")]


@pytest.mark.slow  # importing vLLM runs `file` on the interpreter (a process)
def test_vllm_decodes_the_payload_with_its_own_classes() -> None:
    kv = vllm_classes()
    import msgspec

    log = KVEventLog(encode_vllm=True, clock=lambda: 3.25)
    sent: list[tuple[int, bytes]] = []
    log.sink = lambda seq, payload: sent.append((seq, payload))
    keys, meta = chain(list(range(100, 108)))
    for k in keys:
        m = meta[k]
        log.stored(k, BlockMeta(m.parent, m.packed_tokens(), CS, ""))
    log.flush()
    log.removed(keys[1])
    log.flush()
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    batches = [decoder.decode(p) for _, p in sent]
    assert [s for s, _ in sent] == [0, 1]
    cleared, stored = batches[0].events
    assert isinstance(cleared, kv.AllBlocksCleared)
    assert isinstance(stored, kv.BlockStored)
    assert stored.block_hashes == [bytes.fromhex(k) for k in keys]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(100, 108))
    assert stored.block_size == CS and stored.medium == kv.MEDIUM_CPU
    assert batches[0].ts == 3.25 and batches[0].data_parallel_rank is None
    (removed,) = batches[1].events
    assert isinstance(removed, kv.BlockRemoved)
    assert removed.block_hashes == [bytes.fromhex(keys[1])]


def test_snapshot_and_replay_and_a_slow_subscriber_is_cut_off() -> None:
    log = KVEventLog(buffer=3, queue=2)
    log.flush()
    keys, _ = chain(list(range(40)))
    for k in keys[:5]:
        log.stored(k, None)
        log.flush()  # batches 1..5; the ring keeps 3..5
    sub, first = log.subscribe(from_seq=0)
    assert [b.seq for b in first] == [3, 4, 5]  # 0..2 are gone: the gap says so
    snap_sub, snap = log.subscribe(snapshot=[*keys[:5], "not-a-block"])
    assert [b.seq for b in snap] == [5] and snap[0].snapshot and snap[0].snapshot_end
    got = [h.hex() for e in snap[0].events[1:] for h in e.stored.block_hashes]
    assert snap[0].events[0].HasField("cleared") and got == keys[:5]
    for k in keys[5:8]:
        log.stored(k, None)
        log.flush()
    assert sub.closed and snap_sub.closed and log.cut_off == 2  # 3 batches > queue of 2
    assert log.subscribers == 0


def test_zmq_endpoints_are_loopback_unless_insecure() -> None:
    MasterConfig(kv_events_endpoint="tcp://127.0.0.1:5557").validate()
    with pytest.raises(ConfigError, match="no authentication"):
        MasterConfig(kv_events_endpoint="tcp://*:5557").validate()
    MasterConfig(kv_events_endpoint="tcp://*:5557", insecure=True).validate()
    with pytest.raises(ConfigError, match="needs kv_events_endpoint"):
        MasterConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558").validate()


# ---------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    with kv_events_store(
        tmp_path_factory.mktemp("kv-events"), kv_events_replay_endpoint="tcp://127.0.0.1:*"
    ) as started:
        yield started


def _check_chain(stored, keys: list[str], tokens: list[int]) -> None:
    """The event is the chain: each hash is BLAKE3(parent || tokens as uint32 LE)."""
    hashes = list(stored.block_hashes)
    assert [h.hex() for h in hashes] == keys
    assert list(stored.token_ids) == tokens and stored.block_size == CS
    parent = stored.parent_block_hash or None
    for i, h in enumerate(hashes):
        if parent is not None:  # the first block's parent is the (unpublished) chain root
            assert blake3.blake3(parent + packed(tokens[i * CS : (i + 1) * CS])).digest() == h
        parent = h


@pytest.mark.slow
def test_zmq_subscriber_decodes_stored_removed_and_replays(store) -> None:
    kv = vllm_classes()
    import msgspec
    import zmq

    master, client = store
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    ctx = zmq.Context()
    sub = ready_subscriber(ctx, master, client, FP, 7)
    try:
        tokens = list(range(1000, 1012))
        keys, meta = chain(tokens)
        put_chunks(client, keys, meta)
        assert client.remove([keys[2]]) == 1
        ours = {bytes.fromhex(k) for k in keys}
        seen: list[tuple[int, object]] = []

        def our_events() -> list:
            # a probe's batch can still be on its way (a loaded machine): only ours count
            return [
                e
                for _, b in seen
                for e in b.events  # type: ignore[attr-defined]
                if ours & set(e.block_hashes)
            ]

        def ours_of(kind: type) -> list:
            return [e for e in our_events() if isinstance(e, kind)]

        # the master publishes what committed since its last batch: a chain's put can land in
        # more than one batch, each run of it one BlockStored (as vLLM splits them too)
        while sum(len(e.block_hashes) for e in ours_of(kv.BlockStored)) < len(keys) or not ours_of(
            kv.BlockRemoved
        ):
            assert sub.poll(10_000), "timed out waiting for KV events"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            seen.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        runs, (removed,) = ours_of(kv.BlockStored), ours_of(kv.BlockRemoved)
        assert runs[0].parent_block_hash is None  # the chain's first chunk
        for before, run in itertools.pairwise(runs):  # each run continues the last
            assert run.parent_block_hash == before.block_hashes[-1]
        assert all(run.medium == "CPU" for run in runs)
        assert [t for run in runs for t in run.token_ids] == tokens
        hashes = [h for run in runs for h in run.block_hashes]
        assert hashes == [bytes.fromhex(k) for k in keys]
        for i in (1, 2):
            parent, h = hashes[i - 1], hashes[i]
            assert blake3.blake3(parent + packed(tokens[i * CS : (i + 1) * CS])).digest() == h
        assert removed.block_hashes == [bytes.fromhex(keys[2])]
        seqs = [s for s, _ in seen]
        assert seqs == sorted(seqs)

        # replay from the stored batch's number: the same bytes again, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(master.info["kv_events_replay"])
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(10_000), "timed out waiting for the replay"
            _, topic, seq_b, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == -1:
                assert topic == b"" and payload == b""
                break
            replayed.append((seq, decoder.decode(payload)))
        assert [s for s, _ in replayed] == list(range(seqs[0], seqs[0] + len(replayed)))
        assert [s for s, _ in replayed][: len(seqs)] == seqs
        assert replayed[0][1].events == seen[0][1].events  # type: ignore[attr-defined]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_grpc_subscription_sees_the_same_and_replays(store) -> None:
    master, client = store
    channel = grpc.insecure_channel(master.info["grpc"])
    stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
    try:
        pre_keys, pre_meta = chain(list(range(500, 508)))
        put_chunks(client, pre_keys, pre_meta)
        snap = stub.SubscribeKVEvents(pb.SubscribeKVEventsRequest(snapshot=True), timeout=30)
        held: set[str] = set()
        while True:
            b = next(snap)
            assert b.snapshot
            for e in b.events:
                if e.HasField("cleared"):
                    held.clear()
                held.update(h.hex() for h in e.stored.block_hashes)
            if b.snapshot_end:
                break
        snap_seq = b.seq
        assert set(pre_keys) <= held and not any(k.startswith("tail") for k in held)

        tokens = list(range(2000, 2008))
        keys, meta = chain(tokens)
        put_chunks(client, keys, meta)
        put_chunks(client, ["tail-" + "1" * 59], None)  # not a block: not published
        assert client.remove(keys[:1]) == 1
        # the put's events may come in more than one batch (one per flush): read up to the
        # removal, which comes after every stored event
        live = [next(snap)]
        while not any(e.HasField("removed") for e in live[-1].events):
            live.append(next(snap))
        assert [b.seq for b in live] == list(range(snap_seq + 1, snap_seq + 1 + len(live)))
        events = [e for b in live for e in b.events]
        stored = [e.stored for e in events if e.HasField("stored")]
        chain_event = pb.KVBlockStored()
        chain_event.CopyFrom(stored[0])
        for more in stored[1:]:  # a later event of the run continues the chain
            assert more.parent_block_hash == chain_event.block_hashes[-1]
            chain_event.block_hashes.extend(more.block_hashes)
            chain_event.token_ids.extend(more.token_ids)
        _check_chain(chain_event, keys, tokens)
        assert [h.hex() for h in events[-1].removed.block_hashes] == keys[:1]
        snap.cancel()

        # replay from the first live batch: the same batches, by number
        replay = stub.SubscribeKVEvents(
            pb.SubscribeKVEventsRequest(from_seq=live[0].seq), timeout=30
        )
        again = [next(replay) for _ in live]
        assert again == live
        replay.cancel()
    finally:
        channel.close()


@pytest.mark.slow
def test_put_rejects_bad_block_metadata(store) -> None:
    master, _ = store
    channel = grpc.insecure_channel(master.info["grpc"])
    stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
    try:
        (key,) = chunk_keys(FP, [1, 2, 3, 9])
        resp = stub.BatchPutStart(
            pb.BatchPutStartRequest(
                client_id="t",
                items=[
                    pb.PutStartItem(
                        key=key, size=10, block=pb.KVBlockMeta(token_ids=b"abc", block_size=4)
                    ),
                    pb.PutStartItem(
                        key=key[::-1], size=10, block=pb.KVBlockMeta(parent_key="nope")
                    ),
                ],
            )
        )
        assert [r.code for r in resp.results] == [pb.KV_INVALID, pb.KV_INVALID]
        assert "multiple of 4" in resp.results[0].message
        assert "parent_key" in resp.results[1].message
    finally:
        channel.close()


def test_tokens_round_trip() -> None:
    assert tokens_of(packed([0, 1, 2**32 - 1])) == [0, 1, 2**32 - 1]


@pytest.mark.slow
def test_torch_engine_saves_chunks_with_their_chain(store, tiny_model_dir) -> None:
    """The torch engine's saves carry parent keys and token ids through ChunkIO and the store
    client to the master's stored events."""
    import asyncio

    from pdserve.engines import create_engine
    from pdserve.engines.config import EngineConfig
    from pdserve.requests import Sampling

    master, _ = store
    cs = 32
    prompt = list(range(300, 300 + 3 * cs + 5))
    channel = grpc.insecure_channel(master.info["grpc"])
    stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
    live = stub.SubscribeKVEvents(pb.SubscribeKVEventsRequest(), timeout=120)

    async def run() -> None:
        engine = create_engine(
            EngineConfig(
                engine="torch",
                model="tiny",
                chunk_size=cs,
                kv_dtype="float32",
                max_model_len=512,
                store_master=master.info["grpc"],
            )
        )
        await engine.start()
        try:
            await engine.prefill("kv-events", prompt, Sampling(max_tokens=1, temperature=0.0))
        finally:
            await engine.close()

    try:
        asyncio.run(run())
        stored = []
        while sum(len(s.block_hashes) for s in stored) < 3:
            b = next(live)
            stored += [e.stored for e in b.events if e.HasField("stored")]
        tokens = [t for s in stored for t in s.token_ids]
        assert tokens == prompt[: 3 * cs]  # the three full chunks; the tail is not a block
        assert stored[0].parent_block_hash == b"" and stored[0].block_size == cs
        hashes = [h for s in stored for h in s.block_hashes]
        for i in (1, 2):
            chunk = packed(prompt[i * cs : (i + 1) * cs])
            assert blake3.blake3(hashes[i - 1] + chunk).digest() == hashes[i]
    finally:
        live.cancel()
        channel.close()


@pytest.mark.slow  # imports vLLM, which runs `file` on the interpreter (a process)
def test_vllm_connector_saves_carry_the_chain() -> None:
    """The connector's scheduler side puts each full chunk's parent key and tokens in its
    save, and its worker side hands them to ChunkIO.save (tails carry none)."""
    pytest.importorskip("vllm")
    import torch

    from pdserve.engines.connector_data import ConnectorSettings, PdserveConnectorMetadata
    from pdserve.engines.connector_scheduler import ConnectorScheduler, _SaveTracker
    from pdserve.engines.connector_worker import ConnectorWorker

    cs, bs = 8, 4
    fp = ModelFingerprint("kv-events-vllm", chunk_size=cs)
    prompt = list(range(10, 10 + 2 * cs + 3))
    keys = chunk_keys(fp, prompt)
    settings = ConnectorSettings(master_address="", fingerprint=fp, tail_ttl_ms=5000)
    sched = ConnectorScheduler(settings, bs, io=None)  # the save tracking alone: no lookups
    sched._trackers = {"r": _SaveTracker(keys, len(prompt), prompt, "tail-x", list(range(6)))}
    meta = PdserveConnectorMetadata()
    sched._advance("r", len(prompt), meta)
    assert [(s.key, s.parent, s.tokens) for s in meta.saves] == [
        (keys[0], "", prompt[:cs]),
        (keys[1], keys[0], prompt[cs : 2 * cs]),
        ("tail-x", "", []),
    ]

    saved: list[tuple[int, dict]] = []

    class IO:
        def available(self) -> bool:
            return True

        def save(self, items, *, ttl_ms=0, meta=None, roots=None, tenants=None):
            saved.append((ttl_ms, {k: meta[k] for k, _ in items if meta and k in meta}))
            return len(items)

    worker = ConnectorWorker(None, fp, fp, bs, IO())  # TP rank 0: it publishes the chain
    worker._gather_all = lambda saves: [torch.zeros(1) for _ in saves]
    worker.wait_for_save(meta)
    chunks = dict(saved)[0]
    assert {k: (m.parent, list(m.tokens)) for k, m in chunks.items()} == {
        keys[0]: ("", prompt[:cs]),
        keys[1]: (keys[0], prompt[cs : 2 * cs]),
    }
    assert dict(saved)[5000] == {}  # the tail: no chain metadata
