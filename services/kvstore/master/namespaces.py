"""The master's namespace table: whose KV each object is (docs/kvstore.md, "Namespaces").

A chunk's key is an opaque chain hash, so a put says whose KV it carries: the model
fingerprint (its digest and labels) and the chain root its keys start from (the digest, or
the digest of a cache salt or an adapter over it). The table interns them: one
:class:`Fingerprint` per digest, one :class:`Namespace` per root pointing at it, and each
object holds a reference to its namespace (None = unknown: restored from a node's re-report,
or written by a client that did not say). So 10^5 objects share a handful of records, and
the read path's only namespace work is a set lookup, done only while a quarantine or a drop
hides something (:attr:`NamespaceTable.hidden`).

It also keeps the quarantines (by digest, also of fingerprints with no object: the router
may quarantine what it saw served before the store held any of it) and when each
fingerprint was last used (a put or a hit), which makes a fingerprint *idle* after
``idle_s``: eviction takes idle fingerprints' objects first (:mod:`.eviction`).

Plain and single-threaded; what changed since the last :meth:`take_changes` is what the
journal writes (:class:`~.persistence.NamespaceChanges`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve import errors
from pdserve.services.kvstore.master.persistence import (
    NamespaceChanges,
    StoredNamespace,
    StoredQuarantine,
)
from pdserve.validation import TENANT_NAME

_HEX64 = re.compile(r"[0-9a-f]{64}")
#: Most labels a namespace may carry, and the longest label name or value (characters).
MAX_LABELS = 32
MAX_LABEL_CHARS = 256
#: Most namespaces one put may name.
MAX_PUT_NAMESPACES = 64
#: Longest quarantine reason (characters).
MAX_REASON = 1024
#: Most dropped keys remembered against a node's re-report (``held``; about 150 bytes each).
MAX_TOMBSTONES = 100_000


def hex_problem(what: str, value: str) -> str:
    """Why ``value`` is not a digest or chain root (64 lowercase hex characters), or ""."""
    if _HEX64.fullmatch(value) is None:
        return f"{what} must be 64 lowercase hex characters, got {value[:80]!r}"
    return ""


def tenant_problem(what: str, tenant: str) -> str:
    """Why ``tenant`` is not a tenant name ("" = no tenant is one), or ""."""
    if tenant and TENANT_NAME.fullmatch(tenant) is None:
        return (
            f"{what} {tenant[:80]!r} must be 1-64 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return ""


#: What a put names for each namespace: (root, fingerprint digest, labels[, tenant]).
Spec = tuple[str, str, Mapping[str, str]] | tuple[str, str, Mapping[str, str], str]


def check_hex(what: str, value: str) -> str:
    """``value``, or InvalidArgument when :func:`hex_problem` finds one."""
    problem = hex_problem(what, value)
    if problem:
        raise errors.InvalidArgument(problem)
    return value


@dataclass(frozen=True, slots=True)
class Quarantine:
    """Why a fingerprint is quarantined, who said so and since when (unix ms)."""

    reason: str
    by: str
    since_ms: int


@dataclass(eq=False, slots=True)
class Fingerprint:
    """One model fingerprint: its labels (as its last put named them) and its use."""

    digest: str
    labels: dict[str, str]
    #: Monotonic time of its last put or hit (its creation or the master's start at first).
    last_used: float
    quarantine: Quarantine | None = None
    roots: list[Namespace] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class Namespace:
    """One chain root of a fingerprint; objects point at it (identity hashed)."""

    root: str
    fp: Fingerprint
    #: The tenant whose requests write under it ("" = none; its first put naming one sets it).
    tenant: str = ""


#: The namespace of objects dropped while a reader held them: hidden at once, freed when the
#: lease ends (:mod:`.invalidation`). No fingerprint has its root.
DROPPED = Namespace("", Fingerprint("", {}, 0.0))


class NamespaceTable:
    """Fingerprints, their roots, quarantines and use (see the module docstring)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._roots: dict[str, Namespace] = {}
        self._fps: dict[str, Fingerprint] = {}
        #: Namespaces whose objects readers must not see (a quarantined fingerprint's roots,
        #: :data:`DROPPED` while objects wait for their lease to end). The object table reads
        #: this very set; empty on the fast path.
        self.hidden: set[Namespace] = set()
        #: Keys dropped lately (the last :data:`MAX_TOMBSTONES`): a node that re-reports one
        #: as ``held`` on a mount does not bring it back; a new put of the key forgets it.
        self.tombstones: OrderedDict[str, None] = OrderedDict()
        self._changes = NamespaceChanges()

    def __len__(self) -> int:
        return len(self._fps)

    # ------------------------------------------------------------------ interning

    def get(self, root: str) -> Namespace | None:
        """The namespace of chain root ``root`` (None = unknown)."""
        return self._roots.get(root)

    def fingerprint(self, digest: str) -> Fingerprint | None:
        return self._fps.get(digest)

    def fingerprints(self) -> list[Fingerprint]:
        return [self._fps[d] for d in sorted(self._fps)]

    def intern_all(self, specs: Sequence[Spec], now: float) -> list[Namespace]:
        """The namespaces a put names, each ``(root, fingerprint digest, labels[, tenant])``,
        interned (new ones journaled); InvalidArgument for a malformed one, a root that another
        fingerprint already owns, or one another tenant writes under."""
        if len(specs) > MAX_PUT_NAMESPACES:
            raise errors.InvalidArgument(
                f"the put names {len(specs)} namespaces; at most {MAX_PUT_NAMESPACES}"
            )
        out = []
        for i, (root, digest, labels, *tenant) in enumerate(specs):
            ns = self._intern(root, digest, labels, now, i)
            self._tag(ns, tenant[0] if tenant else "", i)
            out.append(ns)
        return out

    def _tag(self, ns: Namespace, tenant: str, i: int) -> None:
        """Records ``tenant`` as ``ns``'s ("" changes nothing); another tenant's is refused."""
        if not tenant or tenant == ns.tenant:
            return
        problem = tenant_problem(f"namespaces[{i}].tenant", tenant)
        if problem:
            raise errors.InvalidArgument(problem)
        if ns.tenant:
            raise errors.InvalidArgument(
                f"namespaces[{i}]: root {ns.root[:16]}... belongs to tenant {ns.tenant!r}, "
                f"not {tenant!r}"
            )
        ns.tenant = tenant
        self._changed(ns)

    def _intern(
        self, root: str, digest: str, labels: Mapping[str, str], now: float, i: int
    ) -> Namespace:
        ns = self._roots.get(root)
        if ns is not None and ns.fp.digest == digest:
            if labels and labels != ns.fp.labels:
                self._check_labels(labels, i)
                ns.fp.labels = dict(labels)
                self._changed(ns)
            return ns
        check_hex(f"namespaces[{i}].root", root)
        check_hex(f"namespaces[{i}].fingerprint", digest)
        if ns is not None:
            raise errors.InvalidArgument(
                f"namespaces[{i}]: root {root[:16]}... belongs to fingerprint "
                f"{ns.fp.digest[:16]}..., not {digest[:16]}..."
            )
        self._check_labels(labels, i)
        return self._add(root, digest, dict(labels), now)

    @staticmethod
    def _check_labels(labels: Mapping[str, str], i: int) -> None:
        if len(labels) > MAX_LABELS:
            raise errors.InvalidArgument(
                f"namespaces[{i}] has {len(labels)} labels; at most {MAX_LABELS}"
            )
        for k, v in labels.items():
            if len(k) > MAX_LABEL_CHARS or len(v) > MAX_LABEL_CHARS:
                raise errors.InvalidArgument(
                    f"namespaces[{i}] label {k[:40]!r} is longer than {MAX_LABEL_CHARS} characters"
                )

    def _add(self, root: str, digest: str, labels: dict[str, str], now: float) -> Namespace:
        fp = self._fps.get(digest)
        if fp is None:
            fp = self._fps[digest] = Fingerprint(digest, labels, now)
        elif labels:
            fp.labels = labels
        ns = self._roots[root] = Namespace(root, fp)
        fp.roots.append(ns)
        if fp.quarantine is not None:
            self.hidden.add(ns)
        self._changed(ns)
        return ns

    def _changed(self, ns: Namespace) -> None:
        self._changes.namespaces[ns.root] = StoredNamespace(
            ns.root, ns.fp.digest, ns.fp.labels, ns.tenant
        )
        self._changes.dropped.discard(ns.root)

    # ------------------------------------------------------------------ use and idleness

    @staticmethod
    def used(ns: Namespace | None, now: float) -> None:
        """A put or a hit of ``ns``'s objects (None = unknown: nothing to record)."""
        if ns is not None:
            ns.fp.last_used = now

    def idle(self, now: float) -> set[Namespace]:
        """The namespaces of fingerprints with no put and no hit for ``idle_s``."""
        cutoff = now - self.idle_s
        return {ns for fp in self._fps.values() if fp.last_used <= cutoff for ns in fp.roots}

    # ------------------------------------------------------------------ quarantine

    def set_quarantine(self, digest: str, q: Quarantine | None, now: float) -> Fingerprint:
        """Quarantines ``digest`` (``q``) or clears it (None); returns its fingerprint (made
        for a quarantine of a digest with no object yet)."""
        fp = self._fps.get(digest)
        if fp is None:
            fp = self._fps[digest] = Fingerprint(digest, {}, now)
        fp.quarantine = q
        for ns in fp.roots:
            if q is None:
                self.hidden.discard(ns)
            else:
                self.hidden.add(ns)
        self._changes.quarantines[digest] = (
            None if q is None else StoredQuarantine(digest, q.reason, q.by, q.since_ms)
        )
        if q is None and not fp.roots:
            del self._fps[digest]
        return fp

    def quarantined(self) -> list[Fingerprint]:
        return [fp for fp in self.fingerprints() if fp.quarantine is not None]

    # ------------------------------------------------------------------ drops

    def matching(self, digests: Iterable[str], roots: Iterable[str]) -> set[Namespace]:
        """The namespaces of fingerprints ``digests`` (every root) and of ``roots``."""
        out = {ns for d in digests if (fp := self._fps.get(d)) for ns in fp.roots}
        return out | {ns for r in roots if (ns := self._roots.get(r)) is not None}

    def bury(self, key: str) -> None:
        """Remembers the dropped ``key`` (see :attr:`tombstones`)."""
        self.tombstones[key] = None
        self.tombstones.move_to_end(key)
        if len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)

    def forget(self, namespaces: Iterable[Namespace]) -> None:
        """Forgets dropped namespaces (a later put interns them again); a fingerprint left
        with no root goes too, unless it is quarantined."""
        for ns in namespaces:
            if self._roots.get(ns.root) is not ns:
                continue
            del self._roots[ns.root]
            ns.fp.roots.remove(ns)
            self.hidden.discard(ns)
            self._changes.namespaces.pop(ns.root, None)
            self._changes.dropped.add(ns.root)
            if not ns.fp.roots and ns.fp.quarantine is None:
                self._fps.pop(ns.fp.digest, None)

    # ------------------------------------------------------------------ persistence

    def restore(
        self,
        namespaces: Iterable[StoredNamespace],
        quarantines: Iterable[StoredQuarantine],
        now: float,
    ) -> None:
        """Loads what the journal kept (at start; nothing is journaled again)."""
        for row in namespaces:
            if row.root not in self._roots:
                self._add(row.root, row.fingerprint, dict(row.labels), now).tenant = row.tenant
        for q in quarantines:
            self.set_quarantine(q.fingerprint, Quarantine(q.reason, q.by, q.since_ms), now)
        self._changes = NamespaceChanges()

    def take_changes(self) -> NamespaceChanges:
        """What changed since the last call (for the journal's flush)."""
        out, self._changes = self._changes, NamespaceChanges()
        return out
