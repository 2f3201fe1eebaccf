"""The node's side of re-replication and of moves between its tiers
(``KVNodeService.CopyReplica``): read an object from a replica on another node over the data
plane, or from another of this node's own segments (memory to disk, disk to memory), and
write it into a range of this node's own segment that the master allocated, so no payload
passes through the master. A copy onto a disk segment is on the device before the call
returns (:meth:`~pdserve.store.segment.SegmentMemory.write`).

The request is checked before a byte moves: the target must be in one of this node's
segments and inside it, the sizes must agree, and (with data tokens on) the target's write
grant must verify under the segment's data key, exactly as the tcp server checks a client's
write. The source is read with its read grant like any client read; the node reads straight
into the target range (it is no replica until the master records the copy as done).
"""

from __future__ import annotations

import time

from pdserve import errors
from pdserve.services.kvstore.node.node import KVNode
from pdserve.store import grants
from pdserve.store.transports.base import Transport, TransportError
from pdserve.store.transports.tcp import segment_key
from pdserve.v1 import kvstore_pb2 as pb


def request_problem(node: KVNode, request: pb.CopyReplicaRequest) -> str:
    """Why ``request`` is malformed for this node, or "" when it is fine."""
    size, source, target = request.size, request.source, request.target
    if not request.key:
        return "key is empty"
    if size == 0:
        return "size must be > 0"
    if not request.HasField("source") or not request.HasField("target"):
        return "source and target replicas are both required"
    if source.size != size or target.size != size:
        return f"size {size} differs from the source's {source.size} or the target's {target.size}"
    if target.node_id != node.cfg.node_id:
        return f"target is on node {target.node_id!r}, not this node {node.cfg.node_id!r}"
    if source.node_id == node.cfg.node_id:  # a move between this node's tiers
        src = node.segment(source.segment_id)
        if src is None:
            return f"source segment {source.segment_id!r} is not one of this node's"
        if source.segment_id == target.segment_id:
            return "source and target are the same segment"
        if source.offset + size > src.size:
            return (
                f"source range [{source.offset}, +{size}) is outside segment "
                f"{source.segment_id!r} of {src.size} bytes"
            )
    elif not any(e.transport == pb.TRANSPORT_TCP for e in source.endpoints):
        return "the source replica has no tcp endpoint"
    seg = node.segment(target.segment_id)
    if seg is None:
        return f"target segment {target.segment_id!r} is not one of this node's"
    if target.offset + size > seg.size:
        return (
            f"target range [{target.offset}, +{size}) is outside segment "
            f"{target.segment_id!r} of {seg.size} bytes"
        )
    return ""


def check_target_grant(node: KVNode, target: pb.Replica, now_ms: float) -> None:
    """PERMISSION_DENIED unless the master granted a write of ``target``'s range;
    FAILED_PRECONDITION before the segment's first mount answer (no key yet)."""
    if target.segment_id not in node.data_keys:
        raise errors.FailedPrecondition(
            f"segment {target.segment_id!r} is not mounted yet (no data key)"
        )
    key = node.data_keys[target.segment_id]
    if not key:  # the master runs with data tokens off
        return
    why = grants.GrantKey(key).check(
        segment_key(target.segment_id),
        target.offset,
        target.size,
        grants.OP_WRITE,
        target.offset,
        target.size,
        target.token_expires_ms,
        target.alloc_id,
        target.token,
        now_ms - node.cfg.grant_clock_skew_ms,
    )
    if why is not None:
        raise errors.PermissionDenied(f"target write grant refused: {why}")


def copy_replica(node: KVNode, request: pb.CopyReplicaRequest, tcp: Transport) -> int:
    """Copies ``request.source`` into ``request.target`` (this node's); returns the bytes
    copied. Raises :mod:`pdserve.errors` (a status for the caller). Blocking: call it off
    the event loop."""
    problem = request_problem(node, request)
    if problem:
        raise errors.InvalidArgument(f"CopyReplica of {request.key!r}: {problem}")
    target = request.target
    check_target_grant(node, target, time.time() * 1000.0)
    seg = node.segment(target.segment_id)
    assert seg is not None
    local = node.segment(request.source.segment_id)
    if request.source.node_id == node.cfg.node_id and local is not None:
        src_off, size = request.source.offset, request.size
        if local.on_disk:  # up into memory: read from the file
            with seg.view as whole, whole[target.offset : target.offset + size] as dest:
                local.read_into(src_off, dest)
        else:
            with local.view as mem, mem[src_off : src_off + size] as src:
                seg.write(target.offset, src)  # onto disk: durable when this returns
        node.bytes_moved += size
        return size
    if seg.on_disk:
        raise errors.InvalidArgument(
            f"CopyReplica of {request.key!r}: a disk segment takes copies from this node only"
        )
    with seg.view as whole, whole[target.offset : target.offset + request.size] as dest:
        try:
            tcp.read_into(request.source, dest)
        except TransportError as exc:
            raise errors.Unavailable(
                f"CopyReplica of {request.key!r}: reading the source on node "
                f"{request.source.node_id!r} failed: {exc}"
            ) from exc
    node.bytes_copied += request.size
    return request.size
