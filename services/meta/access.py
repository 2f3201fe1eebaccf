"""Who may register, renew and remove what in meta (mutual TLS only; a plaintext meta trusts
every caller, and its records have no owner).

- A record is registered only by the identity role that does the job it announces: prefill
  and decode instances by ``worker``, routers by ``router``, storage nodes by ``node``, the KV
  master by ``master``. A stolen node certificate cannot announce a fake decode worker that
  routers would send prompts to; a node announces only its own node id (its certificate's
  name), as at the KV master.
- A worker's certificate names its pool and itself: ``worker:<pool>`` or
  ``worker:<pool>-<suffix>``, the pool being ``prefill`` or ``decode``. It registers only
  instances of its pool's role (a prefill worker cannot announce itself as a decode worker and
  take user traffic), under its own name or ``<name>-<anything>`` (``worker:decode-0`` is the
  instance ``decode-0``; a pool certificate ``worker:decode``, shared by a Kubernetes
  StatefulSet's pods, registers ``decode-0``, ``decode-1``...). Routers check that the server
  at a worker's address presents the certificate named by the record's owner.
- The registering identity owns the record (``Instance.owner``): while it is live, only that
  identity may heartbeat, deregister or re-register its ``instance_id``, so nobody takes over
  another's instance, not even with the lease id that ListInstances shows. A record without
  an owner (registered before TLS was turned on, kept by etcd) may be taken by anyone.
- One worker identity, bounded instances: meta holds at most
  ``max_instances_per_identity_by_role`` live instances of a role per registering identity
  (default: one prefill or decode instance per worker certificate), so a worker's certificate
  cannot register a second instance under its own name and take a second share of the
  router's requests. :func:`bounded` says whose instances count: a pool's shared certificate
  (``worker:decode``) is every pod of its pool, which meta cannot tell apart, and ``admin``
  is not bounded by role.
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
    if caller.role == "worker":
        _check_worker(caller, instance)
    if current is not None:
        check_owner(caller, current, f"re-register instance {instance.instance_id!r}")


#: The instance role each worker pool (the first part of a worker certificate's name) serves.
WORKER_POOL = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}


def _check_worker(caller: Identity, instance: meta_pb2.Instance) -> None:
    pool = caller.name.split("-", 1)[0]
    if pool not in WORKER_POOL:
        raise PermissionDenied(
            f"{caller} may register no worker: a worker certificate is named after its pool, "
            f"worker:prefill[-<suffix>] or worker:decode[-<suffix>]"
        )
    if instance.role != WORKER_POOL[pool]:
        role = common_pb2.Role.Name(instance.role)
        raise PermissionDenied(f"{caller} may not register a {role}: it is a {pool} worker")
    iid = instance.instance_id
    if iid != caller.name and not iid.startswith(caller.name + "-"):
        raise PermissionDenied(
            f"{caller} may register only {caller.name!r} or {caller.name + '-<suffix>'!r}, "
            f"not {iid!r}"
        )


def one_worker(owner: str) -> bool:
    """Whether ``owner`` (an ``Instance.owner``) names one worker (``worker:decode-0``), not a
    pool's shared certificate (``worker:decode``) and not "" (no TLS): the router counts the
    instances of such an owner as one worker (``WorkerPool.candidates``)."""
    role, _, name = owner.partition(":")
    return role == "worker" and bool(name) and name not in WORKER_POOL


def bounded(caller: Identity | None, role: int) -> bool:
    """Whether ``caller``'s live instances of ``role`` count against the per-identity bound of
    the role (``max_instances_per_identity_by_role``): an identity of the role's registrant
    (``admin`` is not bounded by role; no TLS, no identity, no bound), and for workers only
    one that names one worker (:func:`one_worker`)."""
    if caller is None or caller.role != REGISTRANT.get(role):
        return False
    return caller.role != "worker" or one_worker(str(caller))


def check_owner(caller: Identity | None, owner: str, action: str) -> None:
    """Raises PermissionDenied unless ``caller`` may ``action`` on a record owned by ``owner``."""
    if caller is None or not owner or owner == str(caller) or caller.role == "admin":
        return
    raise PermissionDenied(f"{caller} may not {action}: it belongs to {owner}")
