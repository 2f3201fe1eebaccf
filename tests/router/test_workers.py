"""Worker pool: meta membership and load, static workers, circuit breaker state."""

from __future__ import annotations

import asyncio

from pdserve.services.router.workers import DECODE, PREFILL, WorkerPool
from pdserve.v1 import common_pb2, meta_pb2


def inst(iid, role, addr, model="tiny", running=0, queue=0, kv=0.0):
    return meta_pb2.Instance(
        instance_id=iid,
        role=role,
        address=addr,
        model=model,
        max_running=8,
        load=common_pb2.Load(running_requests=running, queue_length=queue, kv_usage=kv),
    )


def test_sync_follows_meta_and_keeps_static_workers():
    async def main():
        pool = WorkerPool(model="tiny")
        pool.add_static(DECODE, ["127.0.0.1:1"])
        pool.sync(
            [
                inst("p0", common_pb2.ROLE_PREFILL, "127.0.0.1:2", running=3, queue=1),
                inst("p1", common_pb2.ROLE_PREFILL, "127.0.0.1:3"),
                inst("other", common_pb2.ROLE_PREFILL, "127.0.0.1:4", model="big"),
                inst("m", common_pb2.ROLE_KVSTORE_MASTER, "127.0.0.1:5"),
            ]
        )
        assert sorted(pool.workers[PREFILL]) == ["p0", "p1"]
        assert pool.workers[PREFILL]["p0"].load == 4
        pool.workers[PREFILL]["p1"].inflight = 2  # our own count beats a stale report
        assert pool.workers[PREFILL]["p1"].load == 2
        pool.sync([inst("p1", common_pb2.ROLE_PREFILL, "127.0.0.1:3", kv=0.5)])
        assert list(pool.workers[PREFILL]) == ["p1"]
        assert pool.workers[PREFILL]["p1"].kv_usage == 0.5
        assert list(pool.workers[DECODE]) == ["decode@127.0.0.1:1"]  # static: untouched
        await pool.close()

    asyncio.run(main())


def test_breaker_opens_after_consecutive_failures_and_success_resets():
    pool = WorkerPool(breaker_failures=3, breaker_cooldown_s=60)
    pool.add_static(PREFILL, ["127.0.0.1:1", "127.0.0.1:2"])
    a, b = pool.workers[PREFILL].values()
    pool.record_failure(a)
    pool.record_failure(a)
    pool.record_success(a)  # not consecutive any more
    pool.record_failure(a)
    pool.record_failure(a)
    assert not a.broken
    pool.record_failure(a)
    assert a.broken and pool.candidates(PREFILL) == [b]
    assert pool.candidates(PREFILL, exclude={b.id}) == []


def test_probe_keeps_a_dead_worker_out():
    async def main():
        pool = WorkerPool(breaker_failures=1, breaker_cooldown_s=0.0)
        pool.add_static(PREFILL, ["127.0.0.1:9"])  # nothing listens there
        (w,) = pool.workers[PREFILL].values()
        pool.record_failure(w)
        await pool.probe_once()
        assert w.broken
        await pool.close()

    asyncio.run(main())
