"""The master's journal: the per-call write-back of committed and removed objects to a
:class:`~.persistence.MetadataStore`, and what a restart loads back from it.

Parts of the state say what changed (:meth:`Journal.mark`, :meth:`Journal.mark_deleted`;
the namespace and pin tables keep their own changes, taken at the flush); the facade writes it once at
the end of every mutating call (:meth:`Journal.flush`, one transaction). Without a store
every call is a no-op. An object dropped while leased (its namespace
:data:`~.namespaces.DROPPED`) is never written again: its row went with the drop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.services.kvstore.master.namespaces import DROPPED, NamespaceTable
from pdserve.services.kvstore.master.persistence import (
    MetadataStore,
    StoredNamespace,
    StoredObject,
    StoredPin,
    StoredQuarantine,
    StoredReplica,
)
from pdserve.services.kvstore.master.types import Clock, ObjectState

if TYPE_CHECKING:
    from pdserve.services.kvstore.master.pins import PinTable


class Journal:
    def __init__(
        self, store: MetadataStore | None, clock: Clock, namespaces: NamespaceTable
    ) -> None:
        self.store = store
        self.clock = clock
        self.namespaces = namespaces
        #: The pin table whose changes each flush writes too (set by the facade).
        self.pins: PinTable | None = None
        self._dirty: dict[str, ObjectState] = {}
        self._deleted: set[str] = set()

    def load(self) -> list[StoredObject]:
        """The persisted objects whose TTL has not ended (the others are deleted now)."""
        if self.store is None:
            return []
        wall = self.clock.wall_ms()
        keep, expired = [], []
        for obj in self.store.load():
            if obj.ttl_deadline_ms and obj.ttl_deadline_ms <= wall:
                expired.append(obj.key)
            else:
                keep.append(obj)
        self.store.apply([], expired)
        return keep

    def load_namespaces(self) -> tuple[list[StoredNamespace], list[StoredQuarantine]]:
        """The persisted namespaces and quarantines."""
        return ([], []) if self.store is None else self.store.load_namespaces()

    def load_pins(self) -> list[StoredPin]:
        """The persisted pins."""
        return [] if self.store is None else self.store.load_pins()

    def mark(self, obj: ObjectState) -> None:
        """``obj`` (committed) changed: its row is written at the next flush."""
        if self.store is not None and obj.ns is not DROPPED:
            self._dirty[obj.key] = obj
            self._deleted.discard(obj.key)

    def mark_deleted(self, key: str) -> None:
        """``key`` is gone: its row is deleted at the next flush."""
        if self.store is not None:
            self._dirty.pop(key, None)
            self._deleted.add(key)

    def unmark(self, key: str) -> None:
        """Leaves ``key``'s row as it is (an object gone dormant keeps its row)."""
        self._dirty.pop(key, None)

    def flush(self) -> None:
        """Writes this call's changes in one transaction."""
        changes = self.namespaces.take_changes()
        if self.pins is not None:
            changes.pins = self.pins.take_changes()
        if self.store is None or (not self._dirty and not self._deleted and not changes):
            return
        mono, wall = self.clock.mono(), self.clock.wall_ms()
        ups = [
            StoredObject(
                o.key,
                o.size,
                o.soft_pin,
                int(wall + (o.ttl_deadline - mono) * 1000) if o.ttl_deadline else 0,
                tuple(StoredReplica(r.segment_id, r.node_id, r.offset) for r in o.replicas),
                o.checksum,
                o.ns.root if o.ns is not None else "",
            )
            for o in self._dirty.values()
        ]
        self.store.apply(ups, self._deleted, changes)
        self._dirty.clear()
        self._deleted.clear()
