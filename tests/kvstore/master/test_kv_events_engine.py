"""KV events that carry the engine's own block hashes (vLLM's ``request.block_hashes``) next to
pdserve's chunk keys: the event log alone (proto form, vLLM's decoder in ``engine`` mode,
snapshots), the master's checks and its removal path, the vLLM connector's scheduler with a
real vLLM ``Request``, and a real master and node with chunks put through the real store
client, read back over gRPC (SubscribeKVEvents, live and snapshot) and ZMQ."""

from __future__ import annotations

import argparse
import hashlib
import itertools

import grpc
import pytest
from kv_events_harness import kv_events_store, put_chunks, ready_subscriber

from pdserve import config, errors
from pdserve.config import ConfigError
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.kv_events import KVEventLog
from pdserve.services.kvstore.master.objects import _block_problem
from pdserve.services.kvstore.master.state import MasterState
from pdserve.services.kvstore.master.types import BlockMeta
from pdserve.store.api import ChunkMeta
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

CS, EBS = 4, 2  # chunk size; engine block size: two engine blocks per chunk
FP = ModelFingerprint("kv-events-engine-test", chunk_size=CS)


def fake_engine_hashes(tokens: list[int], tag: bytes = b"") -> list[bytes]:
    """A chain of stand-in engine block hashes (sha256 of parent and tokens), one per EBS
    tokens: the master treats them as opaque bytes."""
    out: list[bytes] = []
    parent = b"root" + tag
    for i in range(0, len(tokens) - len(tokens) % EBS, EBS):
        parent = hashlib.sha256(parent + repr(tokens[i : i + EBS]).encode()).digest()
        out.append(parent)
    return out


def chain(
    tokens: list[int], *, engine: bool = True, tag: bytes = b""
) -> tuple[list[str], dict[str, ChunkMeta], list[bytes]]:
    """Chunk keys, ChunkMeta per key (with engine hashes when ``engine``), engine hashes."""
    keys = chunk_keys(FP, tokens)
    eh = fake_engine_hashes(tokens, tag)
    bpc = CS // EBS
    meta = {}
    for i, k in enumerate(keys):
        extra = {}
        if engine:
            extra = dict(
                engine_hashes=eh[i * bpc : (i + 1) * bpc],
                engine_parent=eh[i * bpc - 1] if i else b"",
                engine_block_size=EBS,
            )
        meta[k] = ChunkMeta(keys[i - 1] if i else "", tokens[i * CS : (i + 1) * CS], **extra)
    return keys, meta, eh


def block_of(m: ChunkMeta) -> BlockMeta:
    return BlockMeta(
        m.parent,
        m.packed_tokens(),
        CS,
        m.medium,
        tuple(m.engine_hashes),
        m.engine_parent,
        m.engine_block_size,
    )


# ---------------------------------------------------------------------------- the log alone


def test_stored_and_removed_events_carry_the_engine_hashes() -> None:
    log = KVEventLog()
    log.flush()
    keys, meta, eh = chain(list(range(12)))
    for k in keys:
        log.stored(k, block_of(meta[k]))
    log.removed(keys[0], block_of(meta[keys[0]]))
    log.removed(keys[1], block_of(meta[keys[1]]))
    stored, removed = log.flush().events  # type: ignore[union-attr]
    s = stored.stored
    assert [h.hex() for h in s.block_hashes] == keys  # the chunk keys as ever
    assert list(s.engine_block_hashes) == eh  # plus the engine's, concatenated in order
    assert s.engine_parent_block_hash == b"" and s.engine_block_size == EBS
    assert list(s.token_ids) == list(range(12)) and s.block_size == CS
    r = removed.removed
    assert [h.hex() for h in r.block_hashes] == keys[:2]
    assert list(r.engine_block_hashes) == eh[:4]


def test_grouping_needs_both_or_neither_with_engine_hashes_that_continue() -> None:
    log = KVEventLog(encode_vllm=True)
    log.flush()
    tokens = list(range(50, 66))  # four chunks
    keys, meta, eh = chain(tokens)
    _, bare, _ = chain(tokens, engine=False)
    _, other, other_eh = chain(tokens, tag=b"other seed")
    # chunk 0, 1 engine; chunk 2 without; chunk 3 with hashes of another engine's settings
    log.stored(keys[0], block_of(meta[keys[0]]))
    log.stored(keys[1], block_of(meta[keys[1]]))
    log.stored(keys[2], block_of(bare[keys[2]]))
    log.stored(keys[3], block_of(other[keys[3]]))
    log.removed(keys[1], block_of(meta[keys[1]]))
    log.removed(keys[2], None)  # no block known: its own removal event
    events = [e for e in log.flush().events]  # type: ignore[union-attr]
    stored = [e.stored for e in events if e.HasField("stored")]
    assert [[h.hex() for h in s.block_hashes] for s in stored] == [keys[:2], keys[2:3], keys[3:]]
    assert [list(s.engine_block_hashes) for s in stored] == [eh[:4], [], other_eh[6:8]]
    assert stored[1].engine_block_size == 0 and stored[1].parent_block_hash.hex() == keys[1]
    # chunk 3's engine parent is the other engine's hash: not eh[5], so not grouped with 2
    assert stored[2].engine_parent_block_hash == other_eh[5]
    removed = [e.removed for e in events if e.HasField("removed")]
    assert [list(r.engine_block_hashes) for r in removed] == [eh[2:4], []]


def test_snapshot_carries_the_engine_hashes() -> None:
    log = KVEventLog()
    log.flush()
    keys, meta, eh = chain(list(range(8)))
    blocks = {k: block_of(meta[k]) for k in keys}
    _, snap = log.subscribe(snapshot=[*keys, "f" * 64], block_of=blocks.get)
    stored = [e.stored for b in snap for e in b.events if e.HasField("stored")]
    assert [s.block_hashes[0].hex() for s in stored] == [*keys, "f" * 64]
    assert [list(s.engine_block_hashes) for s in stored] == [eh[:2], eh[2:], []]
    assert [s.engine_parent_block_hash for s in stored] == [b"", eh[1], b""]
    assert [s.engine_block_size for s in stored] == [EBS, EBS, 0]


@pytest.mark.slow  # importing vLLM runs `file` on the interpreter (a process)
def test_vllm_decodes_engine_hashes_in_engine_mode() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    tokens = list(range(100, 112))
    keys, meta, eh = chain(tokens)
    _, bare, _ = chain(list(range(7, 11)), engine=False)
    (bare_key,) = bare
    payloads: dict[str, list[bytes]] = {}
    for mode in ("chunk", "engine"):
        log = KVEventLog(encode_vllm=True, hashes=mode)
        sent: list[bytes] = []
        log.sink = lambda _seq, p, sent=sent: sent.append(p)
        log.flush()
        for k in keys[1:]:  # from the second chunk: a parent to publish
            log.stored(k, block_of(meta[k]))
        log.stored(bare_key, block_of(bare[bare_key]))
        log.flush()
        log.removed(keys[2], block_of(meta[keys[2]]))
        log.removed(bare_key, block_of(bare[bare_key]))
        log.flush()
        payloads[mode] = sent
    engine = [decoder.decode(p) for p in payloads["engine"]]
    run, fallback = engine[1].events
    assert isinstance(run, kv.BlockStored) and isinstance(fallback, kv.BlockStored)
    assert run.block_hashes == eh[2:]  # vLLM's decoder reads the engine's hashes back
    assert run.parent_block_hash == eh[1] and run.block_size == EBS
    assert run.token_ids == tokens[CS:]  # token ids unchanged
    # a chunk stored without engine hashes keeps its chunk key and the chunk size
    assert fallback.block_hashes == [bytes.fromhex(bare_key)] and fallback.block_size == CS
    gone, gone_bare = engine[2].events
    assert isinstance(gone, kv.BlockRemoved) and gone.block_hashes == eh[4:6]
    assert gone_bare.block_hashes == [bytes.fromhex(bare_key)]
    chunk = [decoder.decode(p) for p in payloads["chunk"]]
    assert chunk[1].events[0].block_hashes == [bytes.fromhex(k) for k in keys[1:]]
    assert chunk[1].events[0].block_size == CS
    assert chunk[2].events[0].block_hashes == [bytes.fromhex(keys[2])]


def test_kv_events_hashes_option_is_validated_and_a_flag() -> None:
    MasterConfig(kv_events_hashes="engine").validate()
    with pytest.raises(ConfigError, match="kv_events_hashes must be 'chunk' or 'engine'"):
        MasterConfig(kv_events_hashes="vllm").validate()
    with pytest.raises(ValueError, match="hashes must be one of chunk, engine"):
        KVEventLog(hashes="vllm")
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, MasterConfig)
    args = parser.parse_args(["--kv-events-hashes", "engine"])
    assert config.from_args(MasterConfig, "kvstore_master", args).kv_events_hashes == "engine"


# ---------------------------------------------------------------------------- master checks


def test_master_checks_engine_fields() -> None:
    keys, meta, _ = chain(list(range(8)))
    good = block_of(meta[keys[1]])
    assert _block_problem(good) == ""
    assert _block_problem(BlockMeta("", b"", 0, "", (b"x" * 32,) * 3, b"", EBS)) == ""

    def bad(**changes) -> str:
        import dataclasses

        return _block_problem(dataclasses.replace(good, **changes))

    assert "at most 64" in bad(engine_hashes=(b"h",) * 65, engine_block_size=1)
    assert "engine_block_hashes[1] has 65 bytes" in bad(engine_hashes=(b"h", b"h" * 65))
    assert "engine_block_hashes[0] has 0 bytes" in bad(engine_hashes=(b"", b"h"))
    assert "engine_parent_block_hash has 65 bytes" in bad(engine_parent=b"p" * 65)
    assert "token_ids has 4" in bad(engine_block_size=3)  # 3 x 2 hashes != 4 tokens
    assert "must be > 0" in bad(engine_block_size=0)
    assert "need engine_block_hashes" in bad(engine_hashes=(), engine_block_size=0)


def test_a_removed_object_still_tells_its_engine_hashes() -> None:
    seen: list[tuple[int, str, BlockMeta | None]] = []
    holder: list[MasterState] = []

    def on_event(type_: int, key: str, size: int, reason: int) -> None:
        seen.append((type_, key, holder[0].block_of(key)))

    cfg = MasterConfig(state_dir="")
    state = MasterState(cfg, on_event=on_event, placement_seed=1)
    holder.append(state)
    state.mount("s1", "n1", 1 << 20, [], address="n1:7000")
    keys, meta, eh = chain(list(range(8)))
    blocks = [block_of(meta[k]) for k in keys]
    outs = state.put_start("c", [(k, 100) for k in keys], blocks=blocks)
    assert all(o.code == pb.KV_OK for o in outs)
    state.put_end("c", keys)
    state.remove(keys[1:])
    assert state.block_of(keys[1]) is None  # gone once the event is recorded
    removed = [(k, b) for t, k, b in seen if t == pb.KV_EVENT_REMOVED]
    assert removed == [(keys[1], blocks[1])] and removed[0][1].engine_hashes == tuple(eh[2:])


# ---------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    with kv_events_store(
        tmp_path_factory.mktemp("kv-events-engine"), kv_events_hashes="engine"
    ) as started:
        yield started


def _subscribed(stub):
    """A live SubscribeKVEvents stream, returned once the master has it: the snapshot asked
    for first ends after the subscription is registered (a plain subscription may still be on
    its way when the test's puts are published, and then they never reach it)."""
    stream = stub.SubscribeKVEvents(pb.SubscribeKVEventsRequest(snapshot=True), timeout=60)
    while not next(stream).snapshot_end:
        pass
    return stream


def _read_until(stream, done) -> list[pb.KVCacheEvent]:
    events: list[pb.KVCacheEvent] = []
    while not done(events):
        events += list(next(stream).events)
    return events


def _stored_of(events, keys: list[str]) -> list[pb.KVBlockStored]:
    ours = {bytes.fromhex(k) for k in keys}
    return [e.stored for e in events if e.HasField("stored") and ours & set(e.stored.block_hashes)]


@pytest.mark.slow
def test_store_client_round_trip_over_grpc_and_zmq(store) -> None:
    """ChunkMeta's engine fields go through the real store client and master, and come back
    from SubscribeKVEvents (live, removal, snapshot) and ZMQ (engine mode, vLLM's decoder)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec
    import zmq

    master, client = store
    channel = grpc.insecure_channel(master.info["grpc"])
    stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
    live = _subscribed(stub)
    ctx = zmq.Context()
    sub = ready_subscriber(ctx, master, client, FP, 9)
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    try:
        tokens = list(range(3000, 3012))
        keys, meta, eh = chain(tokens)
        put_chunks(client, keys, meta)
        assert client.remove([keys[2]]) == 1

        events = _read_until(live, lambda ev: any(e.HasField("removed") for e in ev))
        stored = _stored_of(events, keys)
        assert [h.hex() for s in stored for h in s.block_hashes] == keys
        assert [h for s in stored for h in s.engine_block_hashes] == eh
        assert stored[0].engine_parent_block_hash == b""
        assert all(s.engine_block_size == EBS for s in stored)
        for before, after in itertools.pairwise(stored):  # a split run continues
            assert after.engine_parent_block_hash == before.engine_block_hashes[-1]
        (removed,) = [e.removed for e in events if e.HasField("removed")]
        assert [h.hex() for h in removed.block_hashes] == keys[2:]
        assert list(removed.engine_block_hashes) == eh[4:6]

        snap = stub.SubscribeKVEvents(pb.SubscribeKVEventsRequest(snapshot=True), timeout=60)
        batches = [next(snap)]
        while not batches[-1].snapshot_end:
            batches.append(next(snap))
        snap.cancel()
        held = {
            e.stored.block_hashes[0].hex(): list(e.stored.engine_block_hashes)
            for b in batches
            for e in b.events
            if e.HasField("stored")
        }
        assert held[keys[0]] == eh[:2] and held[keys[1]] == eh[2:4] and keys[2] not in held

        # ZMQ in engine mode: vLLM's decoder reads the engine's hashes and block size
        got: list = []
        ours = set(eh)
        while not any(isinstance(e, kv.BlockRemoved) for e in got):
            assert sub.poll(10_000), "timed out waiting for ZMQ KV events"
            _, _, payload = sub.recv_multipart()
            got += [e for e in decoder.decode(payload).events if ours & set(e.block_hashes)]
        runs = [e for e in got if isinstance(e, kv.BlockStored)]
        assert [h for r in runs for h in r.block_hashes] == eh
        assert runs[0].parent_block_hash is None and all(r.block_size == EBS for r in runs)
        assert [t for r in runs for t in r.token_ids] == tokens
        assert got[-1].block_hashes == eh[4:6]
    finally:
        live.cancel()
        channel.close()
        sub.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_put_rejects_bad_engine_fields(store) -> None:
    master, client = store
    (key,) = chunk_keys(FP, [4, 3, 2, 1])
    bad = ChunkMeta("", [4, 3, 2, 1], engine_hashes=[b"a"], engine_block_size=2)
    with pytest.raises(errors.InvalidArgument, match="engine_block_size 2 x 1"):
        client.batch_put([(key, b"x" * 100)], meta={key: bad})
    assert not client.exists([key])[0]
    channel = grpc.insecure_channel(master.info["grpc"])
    stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
    try:
        key_a, key_b = chunk_keys(FP, [1, 2, 3, 4, 5, 6, 7, 8])
        tokens = ChunkMeta("", [1, 2, 3, 4]).packed_tokens()
        resp = stub.BatchPutStart(
            pb.BatchPutStartRequest(
                client_id="t",
                items=[
                    pb.PutStartItem(  # 3 hashes of 2 tokens for a 4-token chunk
                        key=key_a,
                        size=10,
                        block=pb.KVBlockMeta(
                            token_ids=tokens,
                            block_size=4,
                            engine_block_hashes=[b"a", b"b", b"c"],
                            engine_block_size=2,
                        ),
                    ),
                    pb.PutStartItem(  # a hash longer than 64 bytes
                        key=key_b,
                        size=10,
                        block=pb.KVBlockMeta(engine_block_hashes=[b"h" * 65], engine_block_size=4),
                    ),
                ],
            )
        )
        assert [r.code for r in resp.results] == [pb.KV_INVALID, pb.KV_INVALID]
        assert "engine_block_size 2 x 3" in resp.results[0].message
        assert "engine_block_hashes[0] has 65 bytes" in resp.results[1].message
    finally:
        channel.close()


@pytest.mark.slow  # imports vLLM
def test_vllm_connector_publishes_the_requests_block_hashes(store) -> None:
    """A real vLLM ``Request`` hashed by vLLM's own block hasher: the connector's scheduler
    attaches its ``block_hashes`` per full chunk, its worker hands them to the store, and the
    master's events carry exactly vLLM's hashes (checked against vLLM's hash function)."""
    pytest.importorskip("vllm")
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        hash_block_tokens,
        init_none_hash,
    )
    from vllm.v1.request import Request

    from pdserve.engines.connector_data import ConnectorSettings, PdserveConnectorMetadata
    from pdserve.engines.connector_scheduler import ConnectorScheduler
    from pdserve.engines.connector_worker import ConnectorWorker

    master, client = store
    cs, bs = 8, 4
    fp = ModelFingerprint("kv-events-engine-vllm", chunk_size=cs)
    prompt = list(range(4000, 4000 + 2 * cs + 3))  # two chunks (four vLLM blocks) + 3
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hashed = Request(
        "hashed", prompt, SamplingParams(max_tokens=1), None,
        block_hasher=get_request_block_hasher(bs, hash_fn),
    )  # fmt: skip
    bare = Request("bare", prompt[::-1], SamplingParams(max_tokens=1), None)  # no hasher
    expected: list[bytes] = []
    for i in range(len(prompt) // bs):  # vLLM's chain, computed here from its hash function
        parent = expected[-1] if expected else None
        expected.append(hash_block_tokens(hash_fn, parent, prompt[i * bs : (i + 1) * bs]))
    assert hashed.block_hashes == expected and len(expected) == 4 and not bare.block_hashes

    settings = ConnectorSettings(master_address="", fingerprint=fp)
    sched = ConnectorScheduler(settings, bs, io=None)  # the save tracking alone: no lookups
    meta = PdserveConnectorMetadata()
    for req in (hashed, bare):
        sched.on_new_request(req)
        sched._track(req.request_id, list(req.prompt_token_ids), list(range(5)), 0)
        sched._advance(req.request_id, len(prompt), meta)
    keys, bare_keys = chunk_keys(fp, prompt), chunk_keys(fp, prompt[::-1])
    assert [(s.key, s.engine_hashes, s.engine_parent, s.engine_block_size) for s in meta.saves] == [
        (keys[0], expected[:2], b"", bs),
        (keys[1], expected[2:], expected[1], bs),
        (bare_keys[0], [], b"", 0),  # no block hashes: nothing attached
        (bare_keys[1], [], b"", 0),
    ]

    class IO:  # ChunkIO's save, straight into the real store
        def available(self) -> bool:
            return True

        def save(self, items, *, ttl_ms=0, meta=None, roots=None, tenants=None):
            put_chunks(client, [k for k, _ in items], meta)
            return len(items)

    channel = grpc.insecure_channel(master.info["grpc"])
    stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
    live = _subscribed(stub)
    try:
        worker = ConnectorWorker(None, fp, fp, bs, IO())  # TP rank 0: it publishes the chain
        worker._gather_all = lambda saves: [torch.zeros(1) for _ in saves]
        worker.wait_for_save(meta)
        everything = keys + bare_keys
        events = _read_until(
            live, lambda ev: sum(len(s.block_hashes) for s in _stored_of(ev, everything)) >= 4
        )
        ours, theirs = _stored_of(events, keys), _stored_of(events, bare_keys)
        assert [h for s in ours for h in s.engine_block_hashes] == hashed.block_hashes
        assert ours[0].engine_parent_block_hash == b"" and ours[0].engine_block_size == bs
        assert [t for s in ours for t in s.token_ids] == prompt[: 2 * cs]
        assert all(not s.engine_block_hashes and not s.engine_block_size for s in theirs)
    finally:
        live.cancel()
        channel.close()
