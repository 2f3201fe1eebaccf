"""Dormant replicas: committed objects the master remembers without serving them, because
their segment is away (its node was declared dead, or the master restarted and loaded them
from its journal). They come back when the same segment remounts with its bytes kept, and
are dropped with it after ``dormant_grace_s``."""

from __future__ import annotations

import dataclasses
from collections.abc import Container

from pdserve.services.kvstore.master.persistence import StoredObject, StoredReplica


class DormantReplicas:
    """Dormant objects by key and by segment, with each segment's grace deadline."""

    def __init__(self) -> None:
        self._objects: dict[str, StoredObject] = {}
        self._by_segment: dict[str, set[str]] = {}
        # segment id -> monotonic time its dormant replicas (and, if dead, itself) are dropped
        self._deadline: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    @property
    def segments(self) -> int:
        """How many segments have dormant replicas."""
        return len(self._by_segment)

    def add(self, stored: StoredObject, deadline: float) -> None:
        """Remembers ``stored``'s replicas until their segments remount or ``deadline``
        (monotonic seconds; a segment keeps the earliest one it was given)."""
        old = self._objects.get(stored.key)
        if old is not None:
            have = {(r.segment_id, r.offset) for r in old.replicas}
            extra = tuple(r for r in stored.replicas if (r.segment_id, r.offset) not in have)
            stored = dataclasses.replace(old, replicas=old.replicas + extra)
        self._objects[stored.key] = stored
        for r in stored.replicas:
            self._by_segment.setdefault(r.segment_id, set()).add(stored.key)
            self._deadline.setdefault(r.segment_id, deadline)

    def hold_until(self, segment_id: str, deadline: float) -> None:
        """Sets ``segment_id``'s grace deadline unless it has one."""
        self._deadline.setdefault(segment_id, deadline)

    def forget(self, segment_id: str) -> tuple[list[tuple[StoredObject, StoredReplica]], list[str]]:
        """Takes the dormant replicas of ``segment_id`` out; returns them with their objects,
        and the keys left with no dormant replica at all."""
        self._deadline.pop(segment_id, None)
        out, gone = [], []
        for key in sorted(self._by_segment.pop(segment_id, ())):
            stored = self._objects.get(key)
            if stored is None:
                continue
            rest = tuple(r for r in stored.replicas if r.segment_id != segment_id)
            out.extend((stored, r) for r in stored.replicas if r.segment_id == segment_id)
            if rest:
                self._objects[key] = dataclasses.replace(stored, replicas=rest)
            else:
                del self._objects[key]
                gone.append(key)
        return out, gone

    def with_roots(self, roots: Container[str]) -> list[StoredObject]:
        """The dormant objects whose namespace's chain root is in ``roots``."""
        return [o for o in self._objects.values() if o.root and o.root in roots]

    def drop_roots(self, roots: Container[str]) -> list[str]:
        """Forgets the dormant objects under ``roots`` (a drop); returns their keys."""
        gone = self.with_roots(roots)
        for stored in gone:
            del self._objects[stored.key]
            for r in stored.replicas:
                keys = self._by_segment.get(r.segment_id)
                if keys is not None:
                    keys.discard(stored.key)
        return [o.key for o in gone]

    def due(self, now: float) -> list[str]:
        """The segments whose grace ended by ``now``."""
        return [s for s, t in self._deadline.items() if t <= now]
