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


def test_workers_with_another_kv_fingerprint_are_refused_logged_and_counted_once(caplog):
    from pdserve.hashing import ModelFingerprint
    from pdserve.services.router.fingerprint import FingerprintSource
    from pdserve.services.router.workers import REFUSED

    def labels(chunk: int) -> dict[str, str]:
        fp = ModelFingerprint("tiny", "rev", "float32", chunk)
        return {**fp.to_labels(), "max_model_len": str(chunk * 16)}

    def worker(iid: str, chunk: int) -> meta_pb2.Instance:
        i = inst(iid, common_pb2.ROLE_DECODE, f"127.0.0.1:{len(iid)}0")
        i.labels.update(labels(chunk))
        return i

    async def main():
        pool = WorkerPool(model="tiny")
        src = FingerprintSource("tiny", "rev", kv_dtype="auto", chunk_size=0,
                                workers=pool.registered_labels)  # fmt: skip
        pool.refusals = src.refusals
        before = REFUSED.labels(DECODE)._value.get()
        pool.add_static(DECODE, ["127.0.0.1:1"])  # registers no fingerprint: never refused
        for _ in range(3):  # every meta update checks again; logs and counts once
            pool.sync([worker("d0", 32), worker("d1", 32), worker("odd", 64)])
        assert src.current().chunk_size == 32  # the workers' majority
        odd = pool.workers[DECODE]["odd"]
        assert "chunk_size 64 != 32" in odd.refused
        assert sorted(w.id for w in pool.candidates(DECODE)) == ["d0", "d1", "decode@127.0.0.1:1"]
        assert [w.id for w in pool.refused()] == ["odd"]
        assert pool.label_values("max_model_len") == {"512"}  # limits of refused ones ignored
        assert REFUSED.labels(DECODE)._value.get() == before + 1
        assert caplog.text.count("worker odd (127.0.0.1:30) refused") == 1
        pool.sync([worker("d0", 32), worker("d1", 32), worker("odd", 32)])  # reconfigured
        assert not odd.refused and len(pool.candidates(DECODE)) == 4
        await pool.close()

    asyncio.run(main())


def test_decode_capacity_follows_registered_workers_and_reports_changes():
    async def main():
        pool = WorkerPool(model="tiny")
        changes = []
        pool.on_change = lambda: changes.append(pool.decode_capacity())
        pool.add_static(DECODE, ["127.0.0.1:1"])  # static: no capacity reported
        assert pool.decode_capacity() == 0 and changes == [0]
        d0 = inst("d0", common_pb2.ROLE_DECODE, "127.0.0.1:2")
        d1 = inst("d1", common_pb2.ROLE_DECODE, "127.0.0.1:3")
        d1.max_running = 128
        pool.sync([d0, d1, inst("p0", common_pb2.ROLE_PREFILL, "127.0.0.1:4")])
        assert pool.decode_capacity() == 8 + 128  # prefill-only workers run no generation
        pool.apply(meta_pb2.INSTANCE_EVENT_LEFT, d1)
        assert changes[-2:] == [136, 8]
        for _ in range(pool.breaker_failures):  # a broken worker's slots are not counted
            pool.record_failure(pool.workers[DECODE]["d0"])
        assert changes[-1] == 0
        await pool.close()

    asyncio.run(main())


def test_each_workers_load_is_a_gauge_until_it_leaves():
    from pdserve.telemetry import REGISTRY

    def load(wid):
        return REGISTRY.get_sample_value(
            "pdserve_router_worker_load", {"role": PREFILL, "worker": wid}
        )

    async def main():
        pool = WorkerPool(model="tiny")
        pool.sync([inst("gauge-p0", common_pb2.ROLE_PREFILL, "127.0.0.1:2", running=1, queue=2)])
        assert load("gauge-p0") == 3
        pool.workers[PREFILL]["gauge-p0"].inflight = 5  # read at each scrape
        assert load("gauge-p0") == 5
        pool.sync([])
        assert load("gauge-p0") is None
        await pool.close()

    asyncio.run(main())
