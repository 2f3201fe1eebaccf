"""Recovery and persistence of the KV store master's state: the dormant replicas loaded from a
:class:`~pdserve.services.kvstore.persistence.MetadataStore` (or left by a dead node), and the
per-call write-back of committed and removed objects (:meth:`PersistenceMixin.flush`)."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

from pdserve.services.kvstore.master_config import MasterConfig
from pdserve.services.kvstore.master_types import Clock, ObjectState
from pdserve.services.kvstore.persistence import MetadataStore, StoredObject, StoredReplica

log = logging.getLogger(__name__)


class PersistenceMixin:
    """Dormant replicas and the metadata store, for :class:`~.master_state.MasterState`."""

    cfg: MasterConfig
    clock: Clock
    store: MetadataStore | None
    objects: OrderedDict[str, ObjectState]
    pending: dict[str, ObjectState]
    dormant: dict[str, StoredObject]
    _dormant_by_segment: dict[str, set[str]]
    _dormant_deadline: dict[str, float]
    _dirty: dict[str, ObjectState]
    _deleted: set[str]

    def _load(self, store: MetadataStore) -> None:
        wall = self.clock.wall_ms()
        expired = []
        for obj in store.load():
            if obj.ttl_deadline_ms and obj.ttl_deadline_ms <= wall:
                expired.append(obj.key)
                continue
            self._add_dormant(obj)
        store.apply([], expired)
        if self.dormant:
            log.info(
                "loaded %d committed objects from %s; waiting up to %.0fs for %d segments",
                len(self.dormant),
                store.path,
                self.cfg.dormant_grace_s,
                len(self._dormant_by_segment),
            )

    def _add_dormant(self, stored: StoredObject) -> None:
        """Remembers ``stored``'s replicas until their segments remount or their grace ends."""
        old = self.dormant.get(stored.key)
        if old is not None:
            have = {(r.segment_id, r.offset) for r in old.replicas}
            extra = tuple(r for r in stored.replicas if (r.segment_id, r.offset) not in have)
            stored = dataclasses.replace(old, replicas=old.replicas + extra)
        self.dormant[stored.key] = stored
        deadline = self.clock.mono() + self.cfg.dormant_grace_s
        for r in stored.replicas:
            self._dormant_by_segment.setdefault(r.segment_id, set()).add(stored.key)
            self._dormant_deadline.setdefault(r.segment_id, deadline)

    def _forget_dormant(self, segment_id: str) -> list[tuple[StoredObject, StoredReplica]]:
        """Takes the dormant replicas of ``segment_id`` out; returns them with their objects.
        A key left with no dormant replica and no live object loses its persisted row."""
        self._dormant_deadline.pop(segment_id, None)
        out = []
        for key in sorted(self._dormant_by_segment.pop(segment_id, ())):
            stored = self.dormant.get(key)
            if stored is None:
                continue
            rest = tuple(r for r in stored.replicas if r.segment_id != segment_id)
            out.extend((stored, r) for r in stored.replicas if r.segment_id == segment_id)
            if rest:
                self.dormant[key] = dataclasses.replace(stored, replicas=rest)
            else:
                del self.dormant[key]
                if key not in self.objects and key not in self.pending:
                    self._mark_deleted(key)
        return out

    def _mark(self, obj: ObjectState) -> None:
        if self.store is not None:
            self._dirty[obj.key] = obj
            self._deleted.discard(obj.key)

    def _mark_deleted(self, key: str) -> None:
        if self.store is not None:
            self._dirty.pop(key, None)
            self._deleted.add(key)

    def flush(self) -> None:
        """Writes this call's changes in one transaction (called at the end of every mutating
        public method)."""
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
