"""Who may call what on the KV master (mutual TLS only; a plaintext master trusts everyone).

- Node calls (mount, unmount, heartbeat) take the ``node`` role, and a node acts only on its
  own node id, which is its certificate's name: it cannot remount another node's segment
  with its own endpoints, nor declare another node's segments with a forged heartbeat.
  Segment ids are bound to their node (``<node id>-seg<i>`` / ``-disk<i>``,
  :func:`pdserve.store.segment.belongs_to`), so a segment of a node presumed dead stays that
  node's (its objects, and the data key the id derives) until the node itself, or an admin,
  remounts or releases it; a shared-memory endpoint must name the segment's own file
  (:func:`~pdserve.store.segment.shm_name`), not another node's.
- Client calls take ``worker`` or ``router``. A client's ``client_id`` is scoped by its
  identity (``<name>/<client_id>``), so a put is committed or revoked, and a lease released,
  only by the identity that started it, whatever ``client_id`` another one sends. Removal
  takes the identity that wrote the object.
- Reads of public state (exists, longest prefix, stats, the wire's address, events) take any
  identity of the cluster. A longest prefix that also asks for the replicas
  (``with_replicas``) grants read leases and data-plane grants as ``BatchGetReplicaList``
  does, so it is a client call like it. ``admin`` may do everything.
- Namespaces: listing and dropping a model's chunks take ``admin``. A quarantine may be set
  by the ``router`` (its production check finds a fingerprint whose stored KV diverges) and
  cleared only by ``admin`` (an operator decides the chunks are good again).
- Tenants' pins (pin, unpin, list) take the ``router`` (it authenticates the tenant by its
  API key and names it) or ``admin``.
"""

from __future__ import annotations

from typing import Any

from pdserve.errors import PermissionDenied
from pdserve.identity import Identity, require
from pdserve.services.kvstore.master.state import MasterState
from pdserve.store.segment import belongs_to, shm_name
from pdserve.v1 import kvstore_pb2 as pb

NODE_CALLS = frozenset({"MountSegment", "UnmountSegment", "Heartbeat"})
CLIENT_CALLS = frozenset(
    {
        "BatchPutStart",
        "BatchPutEnd",
        "BatchPutRevoke",
        "BatchGetReplicaList",
        "BatchReleaseLease",
        "BatchRemove",
    }
)
CLIENT_ROLES = ("worker", "router")
ADMIN_CALLS = frozenset({"ListNamespaces", "DropNamespaces"})
PIN_CALLS = frozenset({"PinKeys", "UnpinKeys", "ListPins"})


def owner_prefix(caller: Identity) -> str:
    """What the ``client_id`` of everything ``caller`` starts begins with."""
    return f"{caller.name}/"


def authorize(state: MasterState, method: str, request: Any, caller: Identity | None) -> None:
    """Raises PermissionDenied unless ``caller`` may make this call; scopes a client call's
    ``client_id`` to the caller's identity (in place)."""
    if caller is None:
        return
    if method in NODE_CALLS:
        require(caller, ("node",), f"call {method}")
        if caller.role == "admin":
            return
        if method == "MountSegment":
            node_id = request.segment.node_id
        elif method == "Heartbeat":
            node_id = request.node_id
        else:
            seg = state.segments.get(request.segment_id)
            node_id = seg.node_id if seg is not None else caller.name
        if node_id != caller.name:
            raise PermissionDenied(
                f"{caller} may act only on node {caller.name!r}, not {node_id!r}"
            )
        if method == "MountSegment":
            _check_own_segment(caller, request.segment)
        elif method == "UnmountSegment":
            _check_own_segment(caller, pb.Segment(segment_id=request.segment_id))
    elif method in ADMIN_CALLS:
        require(caller, ("admin",), f"call {method}")
    elif method in PIN_CALLS:
        require(caller, ("router",), f"call {method}")
    elif method == "SetQuarantine":
        if request.quarantined:
            require(caller, ("router",), "quarantine a fingerprint")
        else:
            require(caller, ("admin",), "clear a quarantine")
    elif method in CLIENT_CALLS or (method == "LongestPrefix" and request.with_replicas):
        require(caller, CLIENT_ROLES, f"call {method}")
        request.client_id = owner_prefix(caller) + request.client_id


def _check_own_segment(caller: Identity, segment: pb.Segment) -> None:
    """A node names only its own segments, and serves their shared memory from their files."""
    if not belongs_to(segment.segment_id, caller.name):
        raise PermissionDenied(
            f"{caller} may act only on its own segments ({caller.name}-seg<i>, "
            f"{caller.name}-disk<i>), not {segment.segment_id!r}"
        )
    for ep in segment.endpoints:
        if ep.transport == pb.TRANSPORT_SHM and ep.shm_name != shm_name(segment.segment_id):
            raise PermissionDenied(
                f"{caller}: segment {segment.segment_id!r} must be served from its own "
                f"shared-memory file {shm_name(segment.segment_id)!r}, not {ep.shm_name!r}"
            )
