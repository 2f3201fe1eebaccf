"""Invalidation: what the store holds per model fingerprint, dropping a fingerprint's (or a
chain root's) objects, and quarantines (docs/kvstore.md, "Namespaces").

:class:`Invalidation` combines the parts it is given, as :class:`~.membership.Membership`
does: the object table, the namespace table, the dormant replicas, the journal, and the
facade's ``delete`` (which frees an object's replicas in every tier, journals its removal and
publishes the removed event). It does not flush: the facade does, once per call.

Rules:

* A drop removes every committed object of the matching namespaces from memory and disk
  (one object is one record however many tiers hold it), and the dormant ones (a node
  presumed dead, or not remounted since a master restart): their persisted rows go, so
  neither a node's remount nor a master restart brings them back. The last dropped keys are
  remembered (:attr:`~.namespaces.NamespaceTable.tombstones`, in memory) against a node that
  re-reports one as ``held``.
* An object a reader holds a read lease on is hidden at once (its namespace becomes
  :data:`~.namespaces.DROPPED`: lookups and gets answer not found, its row is deleted) and
  removed when the last lease ends (:meth:`Invalidation.reap`, each housekeeping pass):
  freeing its space under a reader would let a new put overwrite bytes being read.
* A quarantined fingerprint's objects read as not found (lookups, exists, gets) and its puts
  are refused (``KV_QUARANTINED``); they stay stored, so clearing the quarantine serves them
  again (drop them first when they are bad).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve import errors
from pdserve.services.kvstore.master.dormant import DormantReplicas
from pdserve.services.kvstore.master.journal import Journal
from pdserve.services.kvstore.master.namespaces import (
    DROPPED,
    MAX_REASON,
    Fingerprint,
    Namespace,
    NamespaceTable,
    Quarantine,
    check_hex,
)
from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.types import Clock, Counters, ObjectState
from pdserve.v1 import kvstore_pb2 as pb

#: delete(obj, reason): the facade's removal of a committed object.
Delete = Callable[..., None]
#: Most fingerprints plus roots one drop may name.
MAX_DROP_NAMES = 1024


@dataclass
class FingerprintReport:
    """A fingerprint's share of the store (``pb.FingerprintUsage``): objects and bytes per
    root, its labels, its quarantine and how long it has been idle."""

    digest: str
    labels: dict[str, str] = field(default_factory=dict)
    #: root -> [objects, bytes]
    roots: dict[str, list[int]] = field(default_factory=dict)
    quarantine: Quarantine | None = None
    idle_s: float = 0.0

    def add(self, root: str, size: int) -> None:
        n = self.roots.setdefault(root, [0, 0])
        n[0] += 1
        n[1] += size

    @property
    def objects(self) -> int:
        return sum(n[0] for n in self.roots.values())

    @property
    def bytes(self) -> int:
        return sum(n[1] for n in self.roots.values())


@dataclass
class DropReport:
    """What a drop removed (or would): per fingerprint, and how many were leased."""

    fingerprints: list[FingerprintReport]
    deferred: int = 0


class Invalidation:
    def __init__(
        self,
        clock: Clock,
        counters: Counters,
        *,
        objects: ObjectTable,
        namespaces: NamespaceTable,
        dormant: DormantReplicas,
        journal: Journal,
        delete: Delete,
    ) -> None:
        self.clock = clock
        self.counters = counters
        self.objects = objects
        self.namespaces = namespaces
        self.dormant = dormant
        self.journal = journal
        self.delete = delete
        #: Dropped objects still leased by a reader, by key (removed by :meth:`reap`).
        self.doomed: dict[str, ObjectState] = {}

    # ------------------------------------------------------------------ listing

    def usage(self) -> list[FingerprintReport]:
        """Every fingerprint known (also one only a quarantine names), by digest, and the
        objects of no known namespace under digest "" first (when there are any). One pass
        over the objects: an admin call, not a hot path."""
        now = self.clock.mono()
        out: dict[str, FingerprintReport] = {}
        for fp in self.namespaces.fingerprints():
            out[fp.digest] = self._report(fp, now)
        unknown = FingerprintReport("")
        for obj in self.objects.values():
            ns = obj.ns
            if ns is None:
                unknown.add("", obj.size)
            elif ns is not DROPPED:
                out[ns.fp.digest].add(ns.root, obj.size)
        return ([unknown] if unknown.roots else []) + list(out.values())

    @staticmethod
    def _report(fp: Fingerprint, now: float) -> FingerprintReport:
        return FingerprintReport(
            fp.digest,
            dict(fp.labels),
            {ns.root: [0, 0] for ns in fp.roots},
            fp.quarantine,
            max(0.0, now - fp.last_used),
        )

    # ------------------------------------------------------------------ drops

    def drop(self, digests: Sequence[str], roots: Sequence[str], dry_run: bool) -> DropReport:
        """Removes (``dry_run``: counts) the objects of fingerprints ``digests`` (all their
        roots) and of chain ``roots``, live and dormant; see the module docstring."""
        if not digests and not roots:
            raise errors.InvalidArgument("name at least one fingerprint or root to drop")
        if len(digests) + len(roots) > MAX_DROP_NAMES:
            raise errors.InvalidArgument(
                f"{len(digests) + len(roots)} fingerprints and roots; at most {MAX_DROP_NAMES}"
            )
        for i, d in enumerate(digests):
            check_hex(f"fingerprints[{i}]", d)
        for i, r in enumerate(roots):
            check_hex(f"roots[{i}]", r)
        now = self.clock.mono()
        spaces = self.namespaces.matching(digests, roots)
        reports: dict[str, FingerprintReport] = {}
        for ns in spaces:
            if ns.fp.digest not in reports:
                reports[ns.fp.digest] = FingerprintReport(ns.fp.digest, dict(ns.fp.labels))
        victims = [o for o in self.objects.values() if o.ns in spaces]
        by_root = {ns.root: ns for ns in spaces}
        for stored in self.dormant.with_roots(by_root):
            reports[by_root[stored.root].fp.digest].add(stored.root, stored.size)
        report = DropReport(list(reports.values()))
        for obj in victims:
            assert obj.ns is not None
            reports[obj.ns.fp.digest].add(obj.ns.root, obj.size)
            if obj.leased(now):
                report.deferred += 1
        if dry_run:
            return report
        for obj in victims:
            self._drop(obj, now)
        for key in self.dormant.drop_roots(by_root):
            self.namespaces.bury(key)
            if key not in self.objects:
                self.journal.mark_deleted(key)
        self.namespaces.forget(spaces)
        return report

    def _drop(self, obj: ObjectState, now: float) -> None:
        self.counters.dropped_objects += 1
        self.namespaces.bury(obj.key)
        if not obj.leased(now):
            self.delete(obj, pb.KV_EVENT_REASON_REMOVE)
            return
        self.journal.mark_deleted(obj.key)
        obj.ns = DROPPED  # hidden from now on; never journaled again
        self.namespaces.hidden.add(DROPPED)
        self.doomed[obj.key] = obj

    def reap(self, now: float) -> None:
        """Removes the dropped objects whose read leases ended."""
        for key, obj in list(self.doomed.items()):
            if self.objects.get(key) is not obj:  # gone meanwhile (evicted, its node died)
                del self.doomed[key]
            elif not obj.leased(now):
                del self.doomed[key]
                self.delete(obj, pb.KV_EVENT_REASON_REMOVE)
        if not self.doomed:
            self.namespaces.hidden.discard(DROPPED)

    # ------------------------------------------------------------------ quarantine

    def set_quarantine(
        self, digest: str, quarantined: bool, reason: str, by: str
    ) -> tuple[bool, int]:
        """Quarantines ``digest`` (``reason`` required) or clears it; returns whether it was
        quarantined before and how many committed objects it has."""
        check_hex("fingerprint", digest)
        if len(reason) > MAX_REASON:
            raise errors.InvalidArgument(f"reason is longer than {MAX_REASON} characters")
        if quarantined and not reason.strip():
            raise errors.InvalidArgument("a quarantine needs a reason")
        fp = self.namespaces.fingerprint(digest)
        was = fp is not None and fp.quarantine is not None
        q = Quarantine(reason, by, int(self.clock.wall_ms())) if quarantined else None
        if quarantined and was:
            assert fp is not None and fp.quarantine is not None
            q = fp.quarantine  # the first reason stands
        if quarantined or was:
            fp = self.namespaces.set_quarantine(digest, q, self.clock.mono())
        roots: set[Namespace] = set(fp.roots) if fp is not None else set()
        n = sum(1 for o in self.objects.values() if o.ns in roots) if roots else 0
        return was, n
