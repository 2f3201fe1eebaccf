"""The node's side of re-replication (CopyReplica): two in-process nodes with tcp data
servers (threads, no process); the target node reads the source over tcp with its read grant
and writes its own segment after checking the write grant."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from pdserve import errors
from pdserve.identity import Identity
from pdserve.services.kvstore.node import servicer as node_servicer
from pdserve.services.kvstore.node.config import NodeConfig
from pdserve.services.kvstore.node.copy import copy_replica
from pdserve.services.kvstore.node.node import KVNode
from pdserve.store import grants
from pdserve.store.transports.tcp import segment_key
from pdserve.store.transports.tcp_client import TcpTransport
from pdserve.v1 import kvstore_pb2 as pb

SIZE = 40_000


def _node(name: str) -> KVNode:
    cfg = NodeConfig(
        node_id=f"copy-{name}-{uuid.uuid4().hex[:8]}",
        segment_sizes=["1MiB"],
        transports=["tcp"],
        prefault=False,
    )
    cfg.validate()
    node = KVNode(cfg)
    node.start()
    return node


@pytest.fixture
def nodes() -> Iterator[tuple[KVNode, KVNode, bytes, bytes]]:
    """A source and a target node, each with its segment's data key set."""
    made = []
    try:
        src, dst = _node("src"), _node("dst")
        made = [src, dst]
        keys = (grants.new_master_key(), grants.new_master_key())
        for node, key in zip(made, keys, strict=True):
            node.set_data_key(node.segments[0].segment_id, key)
        yield src, dst, *keys
    finally:
        for node in made:
            node.stop()


def _replica(node: KVNode, key: bytes, offset: int, size: int, op: int) -> pb.Replica:
    seg = node.segments[0]
    rep = pb.Replica(
        node_id=node.cfg.node_id,
        segment_id=seg.segment_id,
        offset=offset,
        size=size,
        endpoints=node.segment_proto(seg).endpoints,
        token_expires_ms=int(time.time() * 1000) + 60_000,
        alloc_id=7,
    )
    rep.token = grants.GrantKey(key).mint(
        segment_key(seg.segment_id), offset, size, op, rep.token_expires_ms, rep.alloc_id
    )
    return rep


def _request(nodes, size: int = SIZE, target_offset: int = 4096) -> pb.CopyReplicaRequest:
    src, dst, src_key, dst_key = nodes
    return pb.CopyReplicaRequest(
        key="obj",
        size=size,
        source=_replica(src, src_key, 0, size, grants.OP_READ),
        target=_replica(dst, dst_key, target_offset, size, grants.OP_WRITE),
    )


def test_the_target_node_copies_the_source_bytes_into_its_segment(nodes) -> None:
    src, dst = nodes[0], nodes[1]
    data = os.urandom(SIZE)
    src.segments[0].view[0:SIZE] = data
    tcp = TcpTransport(timeout_s=5.0)
    try:
        assert copy_replica(dst, _request(nodes), tcp) == SIZE
    finally:
        tcp.close()
    assert bytes(dst.segments[0].view[4096 : 4096 + SIZE]) == data
    assert dst.bytes_copied == SIZE


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda r: setattr(r, "key", ""), "key is empty"),
        (lambda r: setattr(r, "size", 0), "size must be > 0"),
        (lambda r: r.ClearField("source"), "both required"),
        (lambda r: setattr(r.target, "size", 5), "differs"),
        (lambda r: setattr(r.target, "node_id", "elsewhere"), "not this node"),
        (lambda r: setattr(r.target, "segment_id", "nope"), "not one of this node's"),
        (lambda r: setattr(r.target, "offset", (1 << 20) - 10), "outside segment"),
        (
            lambda r: setattr(r.source, "node_id", r.target.node_id),
            "source segment .* is not one of this node.s",
        ),
    ],
)
def test_a_malformed_request_is_invalid_argument(nodes, change, why) -> None:
    dst = nodes[1]
    req = _request(nodes)
    change(req)
    with pytest.raises(errors.InvalidArgument, match=why):
        copy_replica(dst, req, TcpTransport())


def test_a_bad_target_grant_is_refused_before_any_read(nodes) -> None:
    _src, dst, src_key, _dst_key = nodes
    req = _request(nodes)
    forged = _replica(dst, src_key, 4096, SIZE, grants.OP_WRITE)  # minted with another key
    req.target.CopyFrom(forged)
    with pytest.raises(errors.PermissionDenied, match="grant"):
        copy_replica(dst, req, TcpTransport())
    read = _replica(dst, nodes[3], 4096, SIZE, grants.OP_READ)  # a read grant is no write grant
    req.target.CopyFrom(read)
    with pytest.raises(errors.PermissionDenied):
        copy_replica(dst, req, TcpTransport())


def test_an_unreadable_source_is_unavailable(nodes) -> None:
    dst = nodes[1]
    req = _request(nodes)
    req.source.token = b"\0" * 16  # the source node refuses the read
    tcp = TcpTransport(timeout_s=5.0)
    try:
        with pytest.raises(errors.Unavailable, match="reading the source"):
            copy_replica(dst, req, tcp)
    finally:
        tcp.close()


class _Context:
    """Enough of a grpc.aio.ServicerContext for the rpc wrapper's abort."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise grpc.aio.AbortError()


@pytest.mark.parametrize(
    ("role", "allowed"), [("master", True), ("admin", True), ("worker", False)]
)
def test_only_the_master_may_ask_for_a_copy(nodes, monkeypatch, role, allowed) -> None:
    src, dst = nodes[0], nodes[1]
    src.segments[0].view[0:SIZE] = b"x" * SIZE
    monkeypatch.setattr(node_servicer, "grpc_caller", lambda _ctx: Identity(role, "someone"))
    tcp = TcpTransport(timeout_s=5.0)
    servicer = node_servicer.NodeServicer(dst, tcp)
    ctx = _Context()

    async def call():
        try:
            return await servicer.CopyReplica(_request(nodes), ctx)
        except grpc.aio.AbortError:
            return None

    try:
        resp = asyncio.run(call())
    finally:
        tcp.close()
    if allowed:
        assert resp.size == SIZE and ctx.status is None
    else:
        assert resp is None and ctx.status is not None
        assert ctx.status[0] == grpc.StatusCode.PERMISSION_DENIED
