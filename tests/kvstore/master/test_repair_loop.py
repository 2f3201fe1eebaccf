"""The master's re-replication loop asks the target's node to copy (CopyReplica) and moves no
payload itself: no data-plane transport is ever made in the master for it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.services.kvstore.master.repair_loop import RepairLoop
from pdserve.services.kvstore.master.servicer import MasterHandlers
from pdserve.store import grants
from pdserve.store.transports import base, shm, tcp_client
from pdserve.store.transports.tcp import segment_key
from pdserve.v1 import kvstore_pb2 as pb


def _transport_classes() -> list[type]:
    assert tcp_client.TcpTransport and shm  # the transports the master could have used
    out, todo = [], [base.Transport]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


@pytest.fixture
def no_transports(monkeypatch):
    """Any data-plane transport made from here on fails the test."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"the master made a data-plane transport: {type(self).__name__}")

    for cls in _transport_classes():
        monkeypatch.setattr(cls, "__init__", refuse)


class FakeNode:
    """A KVNodeService stub that records the CopyReplica requests it gets."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, pb.CopyReplicaRequest]] = []
        self.fail = fail
        self.address = ""

    async def CopyReplica(self, request, timeout=None):
        self.calls.append((self.address, request))
        if self.fail:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
            )
        return pb.CopyReplicaResponse(size=request.size)


def _lose_a_replica(s, clock, silent: str = "") -> str:
    """Three nodes, an object on two; the node of one copy stops heartbeating. Returns it.
    ``silent``: a node that mounts without its address."""
    for i in (1, 2, 3):
        address = "" if f"n{i}" == silent else f"10.0.0.{i}:7000"
        s.mount(f"s{i}", f"n{i}", 1 << 20, [], address=address)
    (out,) = s.put_start("c", [("a", 1000)], replicas=2)
    # The placement is seeded: the copies land on n1 and n2, so n3 is the repair target.
    assert {r.node_id for r in out.replicas} == {"n1", "n2"}
    assert out.code == pb.KV_OK
    s.put_end("c", ["a"])
    lost = out.replicas[0].node_id
    for _ in range(20):
        clock.advance(0.1)
        for n in ("n1", "n2", "n3"):
            if n != lost:
                s.heartbeat(n, [f"s{n[-1]}"])
        s.tick()
    assert s.under_replicated() == 1
    return lost


def _loop(s, node: FakeNode) -> RepairLoop:
    def stub_for(address: str) -> FakeNode:
        node.address = address
        return node

    return RepairLoop(MasterHandlers(s), 8, stub_for=stub_for)


def test_the_target_node_is_asked_to_copy_and_the_master_moves_no_bytes(
    make_state, clock, no_transports
) -> None:
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    lost = _lose_a_replica(s, clock)
    node = FakeNode()
    loop = _loop(s, node)
    assert asyncio.run(loop.run_once()) == 1
    ((address, req),) = node.calls
    target, source = req.target, req.source
    assert target.node_id not in (lost, source.node_id) and source.node_id != lost
    assert address == f"10.0.0.{target.node_id[-1]}:7000"  # the address it mounted with
    assert req.key == "a" and req.size == source.size == target.size == 1000
    # Each side carries its grant: read on the source, write on the target.
    for rep, op in ((source, grants.OP_READ), (target, grants.OP_WRITE)):
        key = grants.segment_key_for(loop.handlers.data_key, rep.segment_id)
        seg = segment_key(rep.segment_id)
        exp, off, n = rep.token_expires_ms, rep.offset, rep.size
        check = grants.GrantKey(key).check
        assert check(seg, off, n, op, off, n, exp, rep.alloc_id, rep.token, 0) is None
    (g,) = s.get_replicas("r", ["a"])
    assert {r.node_id for r in g.replicas} == {source.node_id, target.node_id}
    assert s.under_replicated() == 0 and s.counters.repairs == 1


def test_a_failed_copy_frees_the_target_and_queues_the_object_again(
    make_state, clock, no_transports
) -> None:
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    _lose_a_replica(s, clock)
    used = s.segments.used()
    node = FakeNode(fail=True)
    assert asyncio.run(_loop(s, node).run_once()) == 0
    assert len(node.calls) == 1
    assert s.segments.used() == used  # the target's range is free again
    assert s.under_replicated() == 1 and s.counters.repairs == 0
    assert s.counters.repair_failures == 1
    assert s.remove(["a"])[0].code == pb.KV_OK  # the repair lease is gone


def test_a_node_that_mounted_without_its_address_is_not_a_repair_target(make_state, clock) -> None:
    """n3, the only node that could take the copy, cannot be asked to make it: no job is
    handed out (nothing allocated, no failure counted, no warning each pass); the object
    waits, queued, for a node that can."""
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    _lose_a_replica(s, clock, silent="n3")
    used = s.segments.used()
    node = FakeNode()
    loop = _loop(s, node)
    for _ in range(3):
        assert asyncio.run(loop.run_once()) == 0
    assert node.calls == [] and s.under_replicated() == 1
    assert s.segments.used() == used and s.counters.repair_failures == 0
    s.mount("s4", "n4", 1 << 20, [], address="10.0.0.4:7000")  # a node that can
    assert asyncio.run(loop.run_once()) == 1
    ((address, _req),) = node.calls
    assert address == "10.0.0.4:7000" and s.under_replicated() == 0
