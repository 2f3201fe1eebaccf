"""Who may register, renew and remove what in meta (mutual TLS only; a plaintext meta trusts
every caller, and its records have no owner).

- A record is registered only by the identity role that does the job it announces: prefill
  and decode instances by ``worker``, routers by ``router``, storage nodes by ``node``, the KV
  master by ``master``. A stolen node certificate cannot announce a fake decode worker that
  routers would send prompts to; a node announces only its own node id (its certificate's
  name), as at the KV master.
- The registering identity owns the record (``Instance.owner``): while it is live, only that
  identity may heartbeat, deregister or re-register its ``instance_id``, so nobody takes over
  another's instance, not even with the lease id that ListInstances shows. A record without
  an owner (registered before TLS was turned on, kept by etcd) may be taken by anyone.
- Listing and watching take any identity of the cluster. ``admin`` may do everything.
"""

from __future__ import annotations

from pdserve.errors import PermissionDenied
from pdserve.identity import Identity, require
from pdserve.v1 import common_pb2, meta_pb2

#: The identity role that may register each instance role.
REGISTRANT = {
    common_pb2.ROLE_PREFILL: "worker",
    common_pb2.ROLE_DECODE: "worker",
    common_pb2.ROLE_ROUTER: "router",
    common_pb2.ROLE_KVSTORE_NODE: "node",
    common_pb2.ROLE_KVSTORE_MASTER: "master",
}


def owner_of(caller: Identity | None) -> str:
    """What ``Instance.owner`` says for records ``caller`` registers ("" without TLS)."""
    return "" if caller is None else str(caller)


def check_register(
    caller: Identity | None, instance: meta_pb2.Instance, current: str | None
) -> None:
    """Raises PermissionDenied unless ``caller`` may register ``instance``; ``current`` is the
    owner of the live record with the same id (None: there is none)."""
    if caller is None:
        return
    role = common_pb2.Role.Name(instance.role)
    require(caller, (REGISTRANT[instance.role],), f"register a {role} instance")
    node = instance.role == common_pb2.ROLE_KVSTORE_NODE and caller.role != "admin"
    if node and instance.instance_id != caller.name:
        # as at the KV master: a node is its certificate's name, so it announces only itself
        raise PermissionDenied(
            f"{caller} may register only the node {caller.name!r}, not {instance.instance_id!r}"
        )
    if current is not None:
        check_owner(caller, current, f"re-register instance {instance.instance_id!r}")


def check_owner(caller: Identity | None, owner: str, action: str) -> None:
    """Raises PermissionDenied unless ``caller`` may ``action`` on a record owned by ``owner``."""
    if caller is None or not owner or owner == str(caller) or caller.role == "admin":
        return
    raise PermissionDenied(f"{caller} may not {action}: it belongs to {owner}")
