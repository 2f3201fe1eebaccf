"""Chunk saves off the engine step (pdserve/engines/save_writer.py): written in order, the
queue bounded in bytes (a step waits for room), errors kept to the write, a close that writes
what is queued; and the connector worker's use of it: saves no reader awaits return before
they are written, with the bytes of the step even after vLLM reuses the blocks, while a P/D
prefill's awaited saves are written inside the step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.engines import metrics
from pdserve.engines.save_writer import SaveWriter


def _waits() -> float:
    return sum(c.value for c in metrics.KV_SAVE_QUEUE_WAITS.metric.collect()[0].samples)


def test_writes_run_in_order_off_the_caller_and_drain():
    done: list[int] = []
    writer = SaveWriter(1 << 20)
    for i in range(50):
        writer.submit(10, lambda i=i: done.append(i))
    assert writer.drain(30)
    assert done == list(range(50)) and writer.pending_bytes == 0
    assert writer.close()


def test_a_full_queue_makes_the_step_wait_until_the_writer_makes_room():
    writer = SaveWriter(100)
    release, first_started = threading.Event(), threading.Event()

    def slow() -> None:
        first_started.set()
        release.wait(30)

    writer.submit(60, slow)
    assert first_started.wait(30)
    waits = _waits()
    second = threading.Thread(target=writer.submit, args=(60, lambda: None))
    second.start()
    deadline = time.monotonic() + 30
    while _waits() == waits and time.monotonic() < deadline:  # until it waits for room
        time.sleep(0.01)
    assert _waits() == waits + 1 and second.is_alive()
    assert writer.pending_bytes == 60  # the second write is not queued yet
    release.set()
    second.join(30)
    assert not second.is_alive()
    assert writer.drain(30)
    # one write larger than the whole bound is still taken, alone
    writer.submit(500, lambda: None)
    assert writer.drain(30)


def test_a_failing_write_does_not_stop_the_writer_and_close_writes_what_is_queued():
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("store down")

    writer = SaveWriter(1 << 20)
    writer.submit(1, boom)
    writer.submit(1, lambda: done.append("after"))
    assert writer.close(30)
    assert done == ["after"]
    writer.submit(1, lambda: done.append("inline"))  # closed: runs in the caller
    assert done == ["after", "inline"]
    with pytest.raises(ValueError, match="positive"):
        SaveWriter(0)


def test_the_worker_returns_before_a_background_save_is_written_with_the_steps_bytes():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from pdserve.engines import kv_layout
    from pdserve.engines.connector_data import ChunkSave, PdserveConnectorMetadata
    from pdserve.engines.connector_worker import ConnectorWorker
    from pdserve.hashing import ModelFingerprint

    layout = kv_layout.content_layout(4, 8)
    bs, chunk = layout.block_size, 2 * layout.block_size
    fp = ModelFingerprint("m", kv_dtype="bfloat16", chunk_size=chunk)
    release, calls = threading.Event(), []

    class IO:
        def available(self) -> bool:
            return True

        def save(self, items, *, ttl_ms=0, meta=None, roots=None, tenants=None):
            released = release.wait(30)  # the store is slow
            calls.append((released, [(k, kv.clone()) for k, kv in items]))
            return len(items)

    worker = ConnectorWorker(None, fp, fp, bs, IO(), save_queue_mib=256)
    worker._layout = layout
    torch.manual_seed(0)
    worker._caches = [
        torch.randn(8, 2, bs, 2 * layout.head_dim).to(torch.bfloat16) for _ in range(3)
    ]
    save = ChunkSave("k0", 0, chunk, [5, 2])
    want = worker._gather(save)
    worker.wait_for_save(PdserveConnectorMetadata(saves=[save]))
    assert calls == []  # returned while the store still writes it
    for cache in worker._caches:  # vLLM reuses the blocks for the next step
        cache.zero_()
    release.set()
    assert worker.drain_saves(30)
    [(released, items)] = calls
    assert released and [k for k, _ in items] == [worker._rank_key("k0")]
    assert torch.equal(items[0][1], want)  # the step's bytes, not the reused blocks'

    # a P/D prefill's chunk (awaited: decode loads it next) is written inside the step
    calls.clear()
    awaited = ChunkSave("k1", 0, chunk, [1, 3], awaited=True)
    worker.wait_for_save(PdserveConnectorMetadata(saves=[awaited]))
    assert [k for k, _ in calls[0][1]] == [worker._rank_key("k1")]
    worker.shutdown()


@pytest.mark.parametrize(
    ("tail", "answers_first", "awaited"),
    [("tail-x", False, True), ("", True, True), ("", False, False)],
)
def test_the_scheduler_marks_the_saves_a_reader_loads_next(tail, answers_first, awaited):
    """A P/D prefill's chunks (it has a tail key: decode loads them next) and those of a
    request that answers with its first token are written in the step; a colocated
    request's go to the writer."""
    from pdserve.engines.connector_data import ConnectorSettings, PdserveConnectorMetadata
    from pdserve.engines.connector_scheduler import ConnectorScheduler, _SaveTracker
    from pdserve.hashing import ModelFingerprint, chunk_keys

    cs, bs = 8, 4
    fp = ModelFingerprint("awaited", chunk_size=cs)
    prompt = list(range(10, 10 + 2 * cs + 3))
    sched = ConnectorScheduler(ConnectorSettings("", fp, tail_ttl_ms=5000), bs, io=None)
    tracker = _SaveTracker(chunk_keys(fp, prompt), len(prompt), prompt, tail, list(range(6)))
    tracker.answers_first = answers_first
    sched._trackers = {"r": tracker}
    meta = PdserveConnectorMetadata()
    sched._advance("r", len(prompt), meta)
    assert len(meta.saves) == 2 + bool(tail)
    assert {s.awaited for s in meta.saves} == {awaited}
