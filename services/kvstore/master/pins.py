"""Tenants' pins: named sets of chunk keys (a system prompt's chunks) that eviction never
takes (docs/architecture.md, "Tenant shares and pins").

A tenant pins a prefix under a name (the router computes the keys of the prompt under the
tenant's chain root, ``POST /v1/pdserve/pins``); a pin of a name the tenant already has
replaces it. The bytes of a tenant's pinned committed objects (each object once, whatever
number of its pins name it) count against its memory share: a pin that would take them past
it is refused with RESOURCE_EXHAUSTED naming the share and the size. Keys not committed yet
are pinned when their put commits (:meth:`PinTable.committed`), unless the share cannot hold
them then: such a key leaves the pin (logged), so pinned bytes never pass the share. A key
whose object is another tenant's is refused (INVALID_ARGUMENT).

Pins are journaled with the objects (:class:`~.persistence.StoredPin`: SQLite's ``pins``
table, the HA etcd prefix's ``pins/``), so a master restart or an HA takeover keeps them.
Plain and single-threaded; what changed since the last :meth:`PinTable.take_changes` is what
the journal writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pdserve import errors
from pdserve.services.kvstore.master.namespaces import tenant_problem
from pdserve.services.kvstore.master.persistence import StoredPin
from pdserve.services.kvstore.master.types import ObjectState, is_block_key

log = logging.getLogger(__name__)

#: Longest pin name (characters) and most pins one tenant may hold.
MAX_NAME_CHARS = 128
MAX_PINS_PER_TENANT = 64


@dataclass
class Pin:
    """One pin: its tenant, name, keys (chain order) and creation time (unix ms)."""

    tenant: str
    name: str
    keys: list[str]
    created_ms: int


@dataclass(frozen=True)
class PinReport:
    """A pin as it stands (``PinInfo``): keys named, committed now, their bytes."""

    tenant: str
    name: str
    keys: int
    present: int
    bytes: int
    created_ms: int


class PinTable:
    """The pins, and which keys they hold, over the committed ``objects``."""

    def __init__(self, objects: Mapping[str, ObjectState], max_keys: int) -> None:
        self.objects = objects
        self.max_keys = max_keys
        self._pins: dict[tuple[str, str], Pin] = {}
        #: key -> the pins naming it (tenant, name).
        self._by_key: dict[str, set[tuple[str, str]]] = {}
        #: (tenant, name) -> its row now (None = gone), since the last take_changes.
        self._changes: dict[tuple[str, str], StoredPin | None] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def holds(self, obj: ObjectState) -> bool:
        """Whether a pin holds ``obj`` (never evicted)."""
        return bool(self._by_key) and obj.key in self._by_key

    def tenants(self) -> set[str]:
        return {t for t, _ in self._pins}

    def pinned_bytes(self, tenant: str, without: str | None = None) -> int:
        """Bytes of ``tenant``'s pinned committed objects, each once (leaving out its pin
        named ``without``)."""
        return self._bytes(self._keys_of(tenant, without))

    def _keys_of(self, tenant: str, without: str | None = None) -> set[str]:
        return {
            k for (t, n), p in self._pins.items() if t == tenant and n != without for k in p.keys
        }

    def _bytes(self, keys: set[str]) -> int:
        objs = self.objects
        return sum(o.size for k in keys if (o := objs.get(k)) is not None)

    def pin(
        self, tenant: str, name: str, keys: Sequence[str], share: int, now_ms: int
    ) -> tuple[PinReport, int]:
        """Pins ``keys`` for ``tenant`` as ``name``; returns the pin and the tenant's pinned
        bytes in all. ``share``: the tenant's memory share (bytes). InvalidArgument for a
        malformed request or another tenant's key, ResourceExhausted past the share."""
        self._check(tenant, name)
        if not keys:
            raise errors.InvalidArgument("keys is empty: name the chunk keys to pin")
        if len(keys) > self.max_keys:
            raise errors.InvalidArgument(f"{len(keys)} keys; at most {self.max_keys} per pin")
        for i, key in enumerate(keys):
            if not is_block_key(key):
                raise errors.InvalidArgument(
                    f"keys[{i}] {key[:80]!r} is not a chunk key (64 lowercase hex characters)"
                )
            obj = self.objects.get(key)
            if obj is not None and obj.tenant != tenant:
                raise errors.InvalidArgument(
                    f"keys[{i}] is a chunk of tenant {obj.tenant!r}, not of {tenant!r}"
                )
        if (tenant, name) not in self._pins and (
            sum(1 for t, _ in self._pins if t == tenant) >= MAX_PINS_PER_TENANT
        ):
            raise errors.ResourceExhausted(
                f"tenant {tenant!r} has {MAX_PINS_PER_TENANT} pins, the most it may hold; "
                "unpin one first"
            )
        total = self._bytes(self._keys_of(tenant, name) | set(keys))
        if total > share:
            raise errors.ResourceExhausted(
                f"tenant {tenant!r} would pin {total} bytes ({self._bytes(set(keys))} of them "
                f"in this pin's {sum(1 for k in keys if k in self.objects)} stored chunks); its "
                f"memory share is {share} bytes (kvstore_master.tenant_shares)"
            )
        self.unpin(tenant, name)
        pin = self._add(Pin(tenant, name, list(dict.fromkeys(keys)), now_ms))
        self._changed(pin)
        return self._report(pin), total

    def _add(self, pin: Pin) -> Pin:
        self._pins[(pin.tenant, pin.name)] = pin
        for k in pin.keys:
            self._by_key.setdefault(k, set()).add((pin.tenant, pin.name))
        return pin

    def _changed(self, pin: Pin) -> None:
        row = StoredPin(pin.tenant, pin.name, tuple(pin.keys), pin.created_ms)
        self._changes[(pin.tenant, pin.name)] = row

    def unpin(self, tenant: str, name: str) -> bool:
        """Removes ``tenant``'s pin ``name``; False when there was none."""
        self._check(tenant, name)
        pin = self._pins.pop((tenant, name), None)
        if pin is None:
            return False
        for k in pin.keys:
            self._release(k, (tenant, name))
        self._changes[(tenant, name)] = None
        return True

    def _release(self, key: str, owner: tuple[str, str]) -> None:
        held = self._by_key.get(key)
        if held is not None:
            held.discard(owner)
            if not held:
                del self._by_key[key]

    def committed(self, obj: ObjectState, share_of: Callable[[str], int]) -> None:
        """``obj`` was just committed: the pins naming its key hold it from now on, unless
        it is another tenant's or its tenant's share (``share_of``: tenant -> memory share,
        bytes) cannot hold it too; then the key leaves those pins (logged)."""
        owners = self._by_key.get(obj.key)
        if not owners:
            return
        t = obj.tenant
        for owner in list(owners):
            tenant, name = owner
            if tenant == t and self.pinned_bytes(tenant) <= share_of(tenant):
                continue
            log.warning(
                "pin %r of tenant %r: chunk %s... left the pin (%s)",
                name,
                tenant,
                obj.key[:16],
                "another tenant's" if tenant != t else "the tenant's memory share is full",
            )
            self._pins[owner].keys.remove(obj.key)
            self._release(obj.key, owner)
            self._changed(self._pins[owner])

    def restore(self, rows: Sequence[StoredPin]) -> None:
        """Loads the journaled pins (at start; nothing is journaled again)."""
        for row in rows:
            self._add(Pin(row.tenant, row.name, list(row.keys), row.created_ms))

    def take_changes(self) -> dict[tuple[str, str], StoredPin | None]:
        """What changed since the last call (for the journal's flush)."""
        out, self._changes = self._changes, {}
        return out

    def report(self, tenant: str | None = None) -> list[PinReport]:
        """The pins (only ``tenant``'s when given), by tenant then name."""
        return [
            self._report(p)
            for (t, _), p in sorted(self._pins.items())
            if tenant is None or t == tenant
        ]

    def _report(self, pin: Pin) -> PinReport:
        present = [k for k in pin.keys if k in self.objects]
        return PinReport(
            pin.tenant,
            pin.name,
            len(pin.keys),
            len(present),
            self._bytes(set(present)),
            pin.created_ms,
        )

    @staticmethod
    def _check(tenant: str, name: str) -> None:
        problem = tenant_problem("tenant", tenant)
        if problem:
            raise errors.InvalidArgument(problem)
        if not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable() or not name.isascii():
            raise errors.InvalidArgument(
                f"pin name {name[:80]!r} must be 1-{MAX_NAME_CHARS} printable ASCII characters"
            )
