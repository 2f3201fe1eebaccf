"""Asynchronous loads in the vLLM connector without a vLLM engine. Write mode: the scheduler
side turns a handle whose chunks are not stored yet into one asynchronous load (and waits at
most once per request), the worker side scatters each chunk as it lands, reports what never
landed as failed blocks before it reports the request, and stops waiting when the request is
aborted. ``load_async``: a stored prefix loads the same way, off the step, tail included."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from pdserve import hashing
from pdserve.engines import kv_layout
from pdserve.engines.chunk_io import ChunkIO
from pdserve.engines.connector_data import (
    PARAMS_KEY,
    ChunkSave,
    ConnectorSettings,
    PdserveConnectorMetadata,
    RequestLoad,
)
from pdserve.engines.connector_scheduler import ConnectorScheduler
from pdserve.engines.connector_worker import ConnectorWorker

L, H, D, BS, CHUNK = 2, 2, 8, 4, 8
FP = hashing.ModelFingerprint(model_id="m", revision="r", kv_dtype="bfloat16", chunk_size=CHUNK)
TOKENS = list(range(10, 10 + 3 * CHUNK + 5))  # 3 full chunks + 5: the handle names all 3
KEYS = hashing.chunk_keys(FP, TOKENS)


class _Connector:
    """Both halves of the connector over one store, as vLLM's two roles hold them (no engine
    behind them: the worker half's caches are plain tensors in the content layout)."""

    def __init__(self, store, off_reason: str = "", load_async: bool = False) -> None:
        io = ChunkIO(store, FP)
        settings = ConnectorSettings(
            master_address="", fingerprint=FP, tail_ttl_ms=1000, load_async=load_async
        )
        self.scheduler = ConnectorScheduler(settings, BS, io, off_reason)
        self.worker = ConnectorWorker(None, FP, FP, BS, io)
        self.worker._caches = [
            torch.zeros(32, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)
        ]
        self.worker._layout = kv_layout.content_layout(BS, D)
        if off_reason:
            self.worker.turn_off(off_reason)


def _connector(store, off_reason: str = "", load_async: bool = False) -> _Connector:
    return _Connector(store, off_reason, load_async)


def _request(wait_ms: int = 1000) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        prompt_token_ids=TOKENS,
        cache_salt=None,
        kv_transfer_params={PARAMS_KEY: {"await_chunks": 3, "chunk_wait_ms": wait_ms}},
    )


def _chunk(i: int) -> torch.Tensor:
    torch.manual_seed(i)
    return torch.randn(L, 2, H, CHUNK, D).to(torch.bfloat16)


def _publish(store, i: int) -> None:
    store.put_chunk(KEYS[i], _chunk(i), FP.digest())


def _empty_output() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    return SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=[],
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
    )


def test_missing_chunks_become_one_async_load_and_a_request_waits_once(memory_store) -> None:
    conn = _connector(memory_store)
    _publish(memory_store, 0)
    req = _request()
    assert conn.scheduler.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
    blocks = list(range(7, 7 + 3 * CHUNK // BS))
    conn.scheduler.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: [blocks]), 3 * CHUNK
    )
    (load,) = conn.scheduler.build_connector_meta(_empty_output()).loads
    assert (load.req_id, load.block_ids, load.wait_ms) == ("r", blocks, 1000)
    assert [c.key for c in load.chunks] == KEYS
    assert not conn.scheduler.build_connector_meta(_empty_output()).loads  # emitted once
    # rescheduled after a failed wait: no second wait, a synchronous load of what is stored
    assert conn.scheduler.get_num_new_matched_tokens(req, 0) == (CHUNK, False)
    # every chunk stored already: no wait at all
    fresh = _connector(memory_store)
    for i in (1, 2):
        _publish(memory_store, i)
    assert fresh.scheduler.get_num_new_matched_tokens(_request(), 0) == (3 * CHUNK, False)


def test_chunks_the_store_holds_are_not_saved_again_after_a_local_cache_hit(memory_store):
    """A prompt whose first chunks vLLM's own prefix cache holds (so nothing is loaded) and
    the store holds too saves only the chunks after them: it used to gather and encode the
    whole prefix again, inside its step, for the master to skip it as stored."""
    conn = _connector(memory_store)
    for i in (0, 1):
        _publish(memory_store, i)
    req = SimpleNamespace(
        request_id="r", prompt_token_ids=TOKENS, cache_salt=None, kv_transfer_params=None
    )
    conn.scheduler.on_new_request(req)
    local = 2 * CHUNK  # vLLM's local hit: the two stored chunks
    assert conn.scheduler.get_num_new_matched_tokens(req, local) == (0, False)
    out = _empty_output()
    blocks = list(range(len(TOKENS) // BS + 1))
    out.scheduled_new_reqs = [
        SimpleNamespace(
            req_id="r", block_ids=[blocks], prompt_token_ids=TOKENS, num_computed_tokens=local
        )
    ]
    out.num_scheduled_tokens = {"r": len(TOKENS) - local}
    saves = conn.scheduler.build_connector_meta(out).saves
    assert [s.key for s in saves] == [KEYS[2]]
    # a store that held nothing at the lookup: every chunk the step completes is saved
    other = _connector(memory_store)
    other.scheduler.on_new_request(req)
    memory_store.remove(KEYS[:2])
    assert other.scheduler.get_num_new_matched_tokens(req, local) == (0, False)
    assert [s.key for s in other.scheduler.build_connector_meta(out).saves] == KEYS


def test_a_steps_chunks_are_gathered_together_as_one_at_a_time(memory_store) -> None:
    """_gather_all (one indexed copy per layer for all of a step's full chunks) gives each
    save the bytes _gather gives it alone, and both the tokens the cache's K and V views hold
    at the save's blocks, in order; a partial tail goes its own way."""
    conn = _connector(memory_store)
    torch.manual_seed(5)
    conn.worker._caches = [torch.randn(32, H, BS, 2 * D).to(torch.bfloat16) for _ in range(L)]
    saves = [
        ChunkSave("a", 0, CHUNK, [9, 3]),
        ChunkSave("b", CHUNK, CHUNK, [17, 30, 4]),  # more block ids than the chunk needs
        ChunkSave("t", 2 * CHUNK, 5, [21, 22], ttl_ms=10),
        ChunkSave("c", 3 * CHUNK, CHUNK, [0, 31]),
    ]
    together = conn.worker._gather_all(saves)
    alone = [conn.worker._gather(s) for s in saves]
    assert [t.shape for t in together] == [a.shape for a in alone]
    assert all(torch.equal(t, a) for t, a in zip(together, alone, strict=True))
    assert together[0].is_contiguous()

    def reference(save: ChunkSave) -> torch.Tensor:  # token by token, from the views
        def tokens(view: torch.Tensor) -> torch.Tensor:
            rows = [view[save.block_ids[t // BS], :, t % BS] for t in range(save.num_tokens)]
            return torch.stack(rows, dim=1)  # [H, tokens, D]

        return torch.stack(
            [torch.stack([tokens(c[..., :D]), tokens(c[..., D:])]) for c in conn.worker._caches]
        )

    assert all(torch.equal(t, reference(s)) for t, s in zip(together, saves, strict=True))


class _Landing:
    """The store as decode sees it while prefill publishes: each prefix lookup lands one
    more chunk, up to ``up_to``."""

    def __init__(self, store, up_to: int) -> None:
        self.store = store
        self.up_to = up_to
        self.landed = 0

    def longest_prefix(self, keys):
        if self.landed < self.up_to:
            _publish(self.store, self.landed)
            self.landed += 1
        return self.store.longest_prefix(keys)

    def batch_get_chunks(self, keys, fingerprint):
        return self.store.batch_get_chunks(keys, fingerprint)

    def close(self) -> None:
        pass


def _wait_load(conn: _Connector, wait_ms: int) -> RequestLoad:
    req = _request(wait_ms)
    conn.scheduler.get_num_new_matched_tokens(req, 0)
    blocks = list(range(3, 3 + 3 * CHUNK // BS))
    conn.scheduler.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: [blocks]), 3 * CHUNK
    )
    (load,) = conn.scheduler.build_connector_meta(_empty_output()).loads
    conn.worker._start_wait(load)
    return load


def _finished(conn: _Connector, aborted: set[str] | None = None) -> set[str]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, done = conn.worker.get_finished(aborted or set())
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("the wait never ended")


def _scattered(conn: _Connector, load: RequestLoad, i: int) -> torch.Tensor:
    blocks = load.block_ids[i * CHUNK // BS : (i + 1) * CHUNK // BS]
    return conn.worker._gather(SimpleNamespace(num_tokens=CHUNK, block_ids=blocks))


def test_chunks_are_scattered_as_they_land(memory_store) -> None:
    conn = _connector(_Landing(memory_store, up_to=3))
    load = _wait_load(conn, wait_ms=60_000)
    assert _finished(conn) == {"r"}
    assert conn.worker.get_block_ids_with_load_errors() == set()
    for i in range(3):
        assert torch.equal(_scattered(conn, load, i), _chunk(i))


def test_chunks_that_never_land_are_failed_blocks_reported_first(memory_store) -> None:
    conn = _connector(_Landing(memory_store, up_to=1))
    load = _wait_load(conn, wait_ms=50)
    # failed blocks are set before the request is reported (the order vLLM reads them in)
    assert _finished(conn) == {"r"}
    assert conn.worker.get_block_ids_with_load_errors() == set(load.block_ids[CHUNK // BS :])
    assert torch.equal(_scattered(conn, load, 0), _chunk(0))


def test_an_aborted_wait_stops_and_is_reported_without_failures(memory_store) -> None:
    conn = _connector(_Landing(memory_store, up_to=0))
    _wait_load(conn, wait_ms=600_000)
    assert _finished(conn, aborted={"r"}) == {"r"}
    assert conn.worker.get_block_ids_with_load_errors() == set()
    conn.worker.shutdown()


def test_a_layout_it_cannot_convert_turns_the_store_off_not_the_engine(memory_store) -> None:
    """Never down because of a layout: the scheduler side plans no load and no save; a
    worker side that cannot convert what a scheduler planned reports the blocks as failed
    (vLLM recomputes them) and the wait as over, and writes nothing into the cache."""
    for i in range(3):
        _publish(memory_store, i)
    planner = _connector(memory_store)
    planned = _request(wait_ms=0)
    assert planner.scheduler.get_num_new_matched_tokens(planned, 0) == (3 * CHUNK, False)
    blocks = list(range(3, 3 + 3 * CHUNK // BS))
    planner.scheduler.update_state_after_alloc(
        planned, SimpleNamespace(get_block_ids=lambda: [blocks]), 3 * CHUNK
    )
    out = _empty_output()
    out.scheduled_new_reqs = [
        SimpleNamespace(req_id="r", block_ids=[blocks], prompt_token_ids=TOKENS,
                        num_computed_tokens=0)
    ]  # fmt: skip
    out.num_scheduled_tokens = {"r": len(TOKENS)}
    meta = planner.scheduler.build_connector_meta(out)
    assert meta.loads

    off = _connector(memory_store, off_reason="test: a layout no strided view reproduces")
    assert off.scheduler.get_num_new_matched_tokens(_request(), 0) == (0, False)
    assert off.scheduler.build_connector_meta(out) == PdserveConnectorMetadata()  # nothing
    off.worker.start_load_kv(meta)  # the worker side, handed another scheduler's plan
    assert off.worker.get_block_ids_with_load_errors() == set(blocks)
    assert all(not c.any() for c in off.worker._caches)
    meta.saves = [ChunkSave("never-saved", 0, CHUNK, blocks[: CHUNK // BS])]
    off.worker.wait_for_save(meta)
    assert memory_store.exists(["never-saved"]) == [False]
    planner.worker.wait_for_save(meta)  # (the same save, where the store is on, is written)
    assert planner.worker.drain_saves(30)  # no reader awaits it: written off the step
    assert memory_store.exists(["never-saved"]) == [True]


def _plain(params: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        prompt_token_ids=TOKENS,
        cache_salt=None,
        kv_transfer_params={PARAMS_KEY: params} if params else None,
    )


def _async_load(conn: _Connector, req: SimpleNamespace, tokens: int) -> RequestLoad:
    """The lookup answers ``tokens`` asynchronously; the blocks are allocated; the next step's
    metadata carries the load, which the worker side starts."""
    assert conn.scheduler.get_num_new_matched_tokens(req, 0) == (tokens, True)
    blocks = list(range(3, 3 + (tokens + BS - 1) // BS))
    conn.scheduler.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: [blocks]), tokens
    )
    meta = conn.scheduler.build_connector_meta(_empty_output())
    (load,) = meta.loads
    assert (load.asynchronous, load.wait_ms, load.block_ids) == (True, 0, blocks)
    conn.worker.start_load_kv(meta)
    return load


def test_load_async_loads_a_stored_prefix_off_the_step_once(memory_store) -> None:
    for i in range(3):
        _publish(memory_store, i)
    conn = _connector(memory_store, load_async=True)
    req = _plain()
    load = _async_load(conn, req, 3 * CHUNK)
    assert _finished(conn) == {"r"}
    assert conn.worker.get_block_ids_with_load_errors() == set()
    for i in range(3):
        assert torch.equal(_scattered(conn, load, i), _chunk(i))
    # vLLM schedules it with the loaded tokens computed: nothing loaded is saved again
    out = _empty_output()
    out.scheduled_new_reqs = [
        SimpleNamespace(req_id="r", block_ids=[[*load.block_ids, 20, 21]],
                        prompt_token_ids=TOKENS, num_computed_tokens=3 * CHUNK)
    ]  # fmt: skip
    out.num_scheduled_tokens = {"r": len(TOKENS) - 3 * CHUNK}
    meta = conn.scheduler.build_connector_meta(out)
    assert (meta.loads, meta.saves) == ([], [])
    # a request looked up again (its load failed, vLLM reschedules it) loads in the step
    assert conn.scheduler.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    _, params = conn.scheduler.request_finished(req)
    assert params[PARAMS_KEY] == {"loaded_tokens": 3 * CHUNK, "failed_tokens": 0}
    # without load_async the same lookup loads in the step
    assert _connector(memory_store).scheduler.get_num_new_matched_tokens(_plain(), 0) == (
        3 * CHUNK,
        False,
    )


def test_load_async_loads_the_tail_with_the_chunks(memory_store) -> None:
    """A P/D decode's handed tail (the prompt's last partial chunk) is part of the one
    asynchronous load: every prompt token but the last comes from the store."""
    for i in range(3):
        _publish(memory_store, i)
    torch.manual_seed(9)
    tail = torch.randn(L, 2, H, 5, D).to(torch.bfloat16)
    memory_store.put_chunk("tail-key", tail, FP.digest())
    conn = _connector(memory_store, load_async=True)
    req = _plain({"load_tail_key": "tail-key", "load_tail_tokens": len(TOKENS)})
    load = _async_load(conn, req, len(TOKENS) - 1)
    assert [c.key for c in load.chunks] == [*KEYS, "tail-key"]
    assert _finished(conn) == {"r"}
    assert conn.worker.get_block_ids_with_load_errors() == set()
    blocks = load.block_ids[3 * CHUNK // BS :]
    got = conn.worker._gather(SimpleNamespace(num_tokens=4, block_ids=blocks))
    assert torch.equal(got, tail[:, :, :, :4])  # up to the last prompt token


def test_load_async_reports_a_chunk_gone_before_its_load_as_failed_blocks(memory_store):
    for i in range(3):
        _publish(memory_store, i)
    conn = _connector(memory_store, load_async=True)
    req = _plain()
    assert conn.scheduler.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
    blocks = list(range(3, 3 + 3 * CHUNK // BS))
    conn.scheduler.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: [blocks]), 3 * CHUNK
    )
    memory_store.remove([KEYS[1]])  # evicted between the lookup and the load
    conn.worker.start_load_kv(conn.scheduler.build_connector_meta(_empty_output()))
    assert _finished(conn) == {"r"}
    assert conn.worker.get_block_ids_with_load_errors() == set(blocks[CHUNK // BS :])
    assert torch.equal(_scattered(conn, RequestLoad("r", blocks, []), 0), _chunk(0))
