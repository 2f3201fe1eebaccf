"""Caps on what meta holds: :class:`Limits`, the index of live records they count
(:class:`Index`), and :class:`Room`, which checks that one more registration fits and holds its
place while the backend stores it, so that a burst of registrations cannot pass a cap together.

The per-role bound (``max_instances_per_identity_by_role``; by default one prefill and one
decode instance per worker identity) counts the live instances of one role that one identity
registered, except the one being registered: a restart, or a worker whose lease was lost,
registers its own ``instance_id`` again and replaces it. A record stops counting when it leaves
the index: deregistered, or its lease expired (the backend's LEFT event). Whose instances count
is :func:`pdserve.services.meta.access.bounded`: a worker certificate that names one worker, not
a pool's shared one, and no caller without TLS. The security review that asked for it (issue 56)
saw a decode certificate register a second instance under its own name and take 10 of 20
requests from the router.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pdserve.enums import ROLE
from pdserve.errors import ResourceExhausted
from pdserve.v1 import meta_pb2

#: A ListInstances page ends before its instances pass this many bytes (the message limit is
#: 16 MiB); one record must fit.
PAGE_BYTES = 4 * 1024 * 1024
#: The default per-role bound: one live prefill or decode instance per worker identity.
DEFAULT_ROLE_BOUNDS = {"prefill": 1, "decode": 1}


@dataclass(frozen=True)
class Limits:
    """Caps on what meta holds (MetaConfig carries them; exceeding one is RESOURCE_EXHAUSTED
    naming it)."""

    #: Live instances in all (count).
    max_instances: int = 4096
    #: Live instances one TLS identity registered (count; no cap without TLS).
    max_instances_per_identity: int = 256
    #: Live instances of a role one TLS identity registered, by role name (``prefill``,
    #: ``decode``, ``router``, ``kvstore-master``, ``kvstore-node``); a role not named, or 0,
    #: has no bound of its own (count).
    max_instances_per_identity_by_role: Mapping[str, int] = field(
        default_factory=lambda: dict(DEFAULT_ROLE_BOUNDS)
    )
    #: Labels per instance (count).
    max_labels: int = 64
    #: Bytes of one label key, and of one label value (UTF-8).
    max_label_bytes: int = 256
    #: Bytes of one serialized Instance as registered. With the default page size this keeps
    #: a full page at PAGE_BYTES.
    max_record_bytes: int = 8192

    def validate(self) -> None:
        by_role = self.max_instances_per_identity_by_role
        for name, value in vars(self).items():
            if value is not by_role and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_record_bytes > PAGE_BYTES:
            raise ValueError(f"max_record_bytes must be <= {PAGE_BYTES} (one page)")
        for role, bound in by_role.items():
            if role not in ROLE.choices:
                raise ValueError(
                    f"max_instances_per_identity_by_role: unknown role {role!r}; expected one "
                    f"of {', '.join(ROLE.choices)}"
                )
            if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
                raise ValueError(
                    f"max_instances_per_identity_by_role: {role} must be a count >= 0 "
                    f"(0 = no bound), got {bound!r}"
                )

    def role_bound(self, role: int) -> int:
        """The per-identity bound of instances of ``role`` (0 = none)."""
        return self.max_instances_per_identity_by_role.get(ROLE.names.get(role, ""), 0)


@dataclass
class Entry:
    role: int
    owner: str
    lease_id: str


class Index:
    """This meta's view of the live records: id -> (role, owner, lease), lease -> id, and the
    ids each owner holds."""

    def __init__(self) -> None:
        self.by_id: dict[str, Entry] = {}
        self.by_lease: dict[str, str] = {}
        self.of_owner: dict[str, set[str]] = {}

    def reset(self, instances: list[meta_pb2.Instance]) -> None:
        self.by_id.clear()
        self.by_lease.clear()
        self.of_owner.clear()
        for inst in instances:
            self.put(inst)

    def put(self, inst: meta_pb2.Instance) -> None:
        self._remove(inst.instance_id)
        self.by_id[inst.instance_id] = Entry(inst.role, inst.owner, inst.lease_id)
        self.by_lease[inst.lease_id] = inst.instance_id
        self.of_owner.setdefault(inst.owner, set()).add(inst.instance_id)

    def drop(self, inst: meta_pb2.Instance) -> None:
        """Removes ``inst`` unless a later registration of its id replaced it already."""
        entry = self.by_id.get(inst.instance_id)
        if entry is not None and entry.lease_id == inst.lease_id:
            self._remove(inst.instance_id)

    def held(self, owner: str, role: int, but: str) -> list[str]:
        """The ids of ``owner``'s live instances of ``role`` other than ``but``, sorted."""
        ids = self.of_owner.get(owner, ())
        return sorted(i for i in ids if i != but and self.by_id[i].role == role)

    def _remove(self, instance_id: str) -> None:
        old = self.by_id.pop(instance_id, None)
        if old is None:
            return
        self.by_lease.pop(old.lease_id, None)
        ids = self.of_owner[old.owner]
        ids.discard(instance_id)
        if not ids:
            del self.of_owner[old.owner]


@dataclass
class _Claim:
    """The place a registration holds between its checks and its store."""

    owner: str
    role: int
    adds: bool  # a new instance: counts against max_instances
    adds_owner: bool  # new to its owner: counts against max_instances_per_identity


class Room:
    """Checks registrations against the caps. The registry runs registrations of one
    ``instance_id`` one at a time, so each id holds at most one claim."""

    def __init__(self, index: Index, limits: Limits) -> None:
        self.index, self.limits = index, limits
        self._claims: dict[str, _Claim] = {}

    @contextlib.contextmanager
    def hold(
        self, record: meta_pb2.Instance, current: Entry | None, bounded: bool
    ) -> Iterator[None]:
        """Checks that ``record`` fits (``current``: the live record of its id, if any;
        ``bounded``: whether its owner's instances count against the per-role bound) and
        holds its place meanwhile; RESOURCE_EXHAUSTED naming the cap otherwise."""
        owner, limits = record.owner, self.limits
        adds = current is None
        adds_owner = bool(owner) and (current is None or current.owner != owner)
        claims = self._claims.values()
        if adds and len(self.index.by_id) + sum(c.adds for c in claims) >= limits.max_instances:
            raise ResourceExhausted(
                f"meta holds its max_instances ({limits.max_instances}) live instances; "
                "deregister some or raise max_instances"
            )
        mine = len(self.index.of_owner.get(owner, ()))
        mine += sum(c.adds_owner for c in claims if c.owner == owner)
        if adds_owner and mine >= limits.max_instances_per_identity:
            raise ResourceExhausted(
                f"{owner} holds its max_instances_per_identity "
                f"({limits.max_instances_per_identity}) live instances"
            )
        if bounded:
            self._check_role_bound(record)
        self._claims[record.instance_id] = _Claim(owner, record.role, adds, adds_owner)
        try:
            yield
        finally:
            del self._claims[record.instance_id]

    def _check_role_bound(self, record: meta_pb2.Instance) -> None:
        bound = self.limits.role_bound(record.role)
        if not bound:
            return
        owner, role = record.owner, record.role
        held = self.index.held(owner, role, but=record.instance_id)
        held += sorted(i for i, c in self._claims.items() if (c.owner, c.role) == (owner, role))
        if len(held) >= bound:
            shown = ", ".join(repr(i) for i in held[:3]) + (", ..." if len(held) > 3 else "")
            raise ResourceExhausted(
                f"{owner} already holds {len(held)} live {ROLE.names[role]} instance(s) "
                f"({shown}); max_instances_per_identity_by_role allows {bound} per identity: "
                f"register that instance_id again, or deregister it (or let its lease expire) "
                f"before registering {record.instance_id!r}"
            )
