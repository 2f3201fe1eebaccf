"""The router spreads by worker identity, not by instance (issue 56): a decode certificate that
registered a second instance under its own name took 10 of 20 requests from the router, beside
one honest decode worker. ``WorkerPool.candidates`` offers one instance per identity that
names one worker, so the two identities split the requests evenly."""

from __future__ import annotations

import asyncio
from collections import Counter

from pdserve.services.router.policies.decode_choice import DecodeChoice
from pdserve.services.router.workers import DECODE, WorkerPool
from pdserve.v1 import common_pb2, meta_pb2


def inst(iid: str, owner: str, running: int = 0) -> meta_pb2.Instance:
    return meta_pb2.Instance(
        instance_id=iid,
        role=common_pb2.ROLE_DECODE,
        address=f"127.0.0.1:{9000 + len(iid)}",
        model="tiny",
        max_running=8,
        owner=owner,
        load=common_pb2.Load(running_requests=running),
    )


def pool_of(*instances: meta_pb2.Instance) -> WorkerPool:
    pool = WorkerPool(model="tiny")
    pool.sync(list(instances))
    return pool


def test_two_instances_of_one_identity_get_one_share() -> None:
    async def main() -> None:
        pool = pool_of(
            inst("decode-0", "worker:decode-0"),
            inst("decode-0-b", "worker:decode-0"),  # the second instance of one certificate
            inst("decode-1", "worker:decode-1"),
        )
        choice, placed = DecodeChoice(), Counter()
        for _ in range(20):  # requests that stay running: each adds to its worker's load
            w = choice.choose(pool.candidates(DECODE))
            w.inflight += 1
            placed[w.owner] += 1
        assert placed == {"worker:decode-0": 10, "worker:decode-1": 10}
        await pool.close()

    asyncio.run(main())


def test_the_lowest_id_of_an_identity_is_its_candidate() -> None:
    """The lowest id, not the least loaded instance: each instance counts only its own load,
    so the identity's least loaded one would win placement again and again (14 of the 20
    requests of the test above, measured)."""

    async def main() -> None:
        pool = pool_of(
            inst("decode-0", "worker:decode-0", running=3),
            inst("decode-0-b", "worker:decode-0", running=1),
            inst("decode-1", "worker:decode-1", running=5),
        )
        assert [w.id for w in pool.candidates(DECODE)] == ["decode-0", "decode-1"]
        # a broken instance is out before the choice: its sibling stands for the identity
        pool.workers[DECODE]["decode-0"].open_until = 1.0
        assert [w.id for w in pool.candidates(DECODE)] == ["decode-0-b", "decode-1"]
        # an identity one of whose instances was tried is tried
        pool.workers[DECODE]["decode-0"].open_until = 0.0
        assert [w.id for w in pool.candidates(DECODE, {"decode-0-b"})] == ["decode-1"]
        assert pool.decode_capacity() == 16  # two identities of 8
        await pool.close()

    asyncio.run(main())


def test_pool_certificates_and_plaintext_instances_count_one_each() -> None:
    """A pool's shared certificate (worker:decode) is every pod of a Kubernetes StatefulSet,
    and without TLS there is no owner: each instance is a worker of its own."""

    async def main() -> None:
        pool = pool_of(
            inst("decode-a", "worker:decode"),
            inst("decode-b", "worker:decode"),
            inst("decode-p", ""),
            inst("decode-q", ""),
        )
        pool.add_static(DECODE, ["127.0.0.1:1"])
        assert len(pool.candidates(DECODE)) == 5
        assert [w.id for w in pool.candidates(DECODE, {"decode-a", "decode-p"})] == [
            "decode-b",
            "decode-q",
            "decode@127.0.0.1:1",
        ]
        await pool.close()

    asyncio.run(main())
