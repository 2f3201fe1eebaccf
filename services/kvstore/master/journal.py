"""The master's journal: the per-call write-back of committed and removed objects to a
:class:`~.persistence.MetadataStore`, and what a restart loads back from it.

Parts of the state say what changed (:meth:`Journal.mark`, :meth:`Journal.mark_deleted`);
the facade writes it once at the end of every mutating call (:meth:`Journal.flush`, one
transaction). Without a store every call is a no-op.
"""

from __future__ import annotations

from pdserve.services.kvstore.master.persistence import MetadataStore, StoredObject, StoredReplica
from pdserve.services.kvstore.master.types import Clock, ObjectState


class Journal:
    def __init__(self, store: MetadataStore | None, clock: Clock) -> None:
        self.store = store
        self.clock = clock
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

    def mark(self, obj: ObjectState) -> None:
        """``obj`` (committed) changed: its row is written at the next flush."""
        if self.store is not None:
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
        if self.store is None or (not self._dirty and not self._deleted):
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
            )
            for o in self._dirty.values()
        ]
        self.store.apply(ups, self._deleted)
        self._dirty.clear()
        self._deleted.clear()
