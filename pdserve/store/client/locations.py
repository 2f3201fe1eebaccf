"""Where objects are, kept by the store client between its lookup and its reads, so a read
of a prompt's chunks goes straight to the nodes with no master round trip of its own.

A connector asks ``longest_prefix`` of every prompt it schedules, then reads the chunks it
found. :meth:`StoreClient.longest_prefix <pdserve.store.client.StoreClient.longest_prefix>`
asks the master for the found keys' replica lists with the answer (``LongestPrefix`` with
``with_replicas``: each with a read lease and read grants, as ``BatchGetReplicaList`` gives
them) and keeps them here; :class:`~.reads.Reads` then takes them from here instead of
asking ``BatchGetReplicaList``, and asks the master only for the keys it does not find.
Mooncake's own client and Redis Cluster clients keep locations the same way.

Why a kept location never hands out wrong bytes:

* An entry is used only while its read lease lasts, and the lease is what keeps its bytes
  where they are: the master refuses to remove a leased object (``BatchRemove`` answers
  ``KV_LEASED``), eviction and TTL expiry skip leased objects, so a location within its lease
  cannot point to space that another object reuses. The lease belongs to this cache
  (:attr:`LocationCache.holder`, one per master per process), not to one read, and is not
  released after a read: it ends on the master by itself. It is released early only when
  the entry goes (the client removes or puts the key, a read of it failed, it passed its
  use, the bound pushed it out, the process's last client closed), and then only once no read uses the entry and no lookup of
  the key is in flight (a lookup
  answered with the holder's lease may be about to keep a new entry that relies on it). A
  lookup's answer is not kept while a release of the key is on its way, nor when one ended
  after the lookup was sent: the master may have granted the lease before the release ended
  it (:meth:`LocationCache.end_lookup`).
* An entry stops being used :func:`margin_s` before its lease ends, the lease counted from
  before the lookup was sent (an upper bound of when the master granted it). The read that
  takes it must *end* within the lease: :class:`~.reads.ReadCheck` discards a read that ends
  later (past its lease the region may hold another object), and the node refuses a range
  whose grant expired on its own clock (the master's clock stamped the grant; the clocks may
  differ). A read started at the end of an entry's life would be late and paid twice. The
  margin, 25 % of the lease or 250 ms, whichever is larger, leaves the read time for its
  bytes (a 256 MiB batch, the bench's largest, at 1 GB/s) and the clocks room to differ.
* A read from a kept location that fails anyway (a transport error, a grant refused as
  expired or forged after a master restart, bytes that fail the checksum or the chunk's
  decode) drops the entry and looks that key up again once through ``BatchGetReplicaList``
  (:class:`~.reads.Reads`); what that second read gets is checked as any read is. Leases do
  not outlive a master restart, but grants do not either (a new master key): the node
  refuses the stale ranges over tcp; over shm and mooncake, whose nodes check no grants,
  the checksum (or the KV chunk's header) catches the rest, as it does for any read.

The cache is bounded (LRU, :data:`CAPACITY` entries) and shared: several clients of the same
master in one process (vLLM's connector opens one on its scheduler side and one on its worker
side, in one process on CPU) use one cache (:func:`shared`), so what the scheduler side looked
up the worker side reads. Thread-safe.

Only ``longest_prefix`` answers are kept. A plain get's lookup is not, and its leases are
released after its read as before: a lease pins its object against eviction, and keeping
every read's lease for seconds would pin everything read lately (measured: 56 MiB read from
a 64 MiB pool and kept leased, the next 24 puts of 1 MiB evicted each other, 4 stayed; with
the leases released the reads' objects made way). A prefix lookup's leases pin the keys it
just found, which it also marked most recently used (eviction takes them last anyway).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.store.client.control import MasterLink
from pdserve.store.client.leases import LeaseReleaser
from pdserve.v1 import kvstore_pb2

#: Entries kept at most (least recently used go first).
CAPACITY = 65536
#: An entry stops being used this fraction of its lease before the lease ends ...
MARGIN_FRACTION = 0.25
#: ... or this long before (seconds), whichever is longer.
MARGIN_MIN_S = 0.25
#: How long the end of a key's lease release is remembered (seconds): longer than any lookup
#: can be in flight (a master call's timeout).
FENCE_S = 120.0


def margin_s(lease_s: float) -> float:
    """How long before its lease ends an entry leased for ``lease_s`` stops being used."""
    return max(lease_s * MARGIN_FRACTION, MARGIN_MIN_S)


@dataclass(slots=True)
class Location:
    """One key's replica list as the master answered it, and its times (monotonic)."""

    result: kvstore_pb2.ReplicaListResult
    #: Reads may start from this entry until then (the lease's end less :func:`margin_s`).
    usable_until: float
    #: The lease's end, counted from before the lookup was sent: a read that ends later is
    #: discarded.
    lease_end: float


class LocationCache:
    """Key -> :class:`Location`, bounded to ``capacity`` entries (LRU). ``holder``: the
    client id the cache's leases are granted to (one per cache: any client that shares the
    cache uses them). ``releaser``: sends the early releases of the holder's leases (None:
    nothing is sent, a release counts as done at once; set it with :meth:`attach`).
    ``clock``: monotonic seconds (tests inject one). Thread-safe."""

    def __init__(
        self,
        capacity: int = CAPACITY,
        holder: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.holder = holder or f"locations-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.clock = clock
        self.releaser: LeaseReleaser | None = None
        self.lock = threading.Lock()
        #: Clients using the cache (:meth:`open`, :meth:`close`).
        self.users = 0
        self._entries: OrderedDict[str, Location] = OrderedDict()
        #: Key -> reads using its entry now (taken, not yet done).
        self._inflight: dict[str, int] = {}
        #: Key -> lookups of it in flight (begun, not yet ended).
        self._looking: dict[str, int] = {}
        #: Keys dropped while in use: their leases go back when the last use ends.
        self._release_after: set[str] = set()
        #: Key -> releases of its lease sent and not yet ended.
        self._releasing: dict[str, int] = {}
        #: Key -> when the last release of its lease ended (monotonic), oldest first.
        self._fence: OrderedDict[str, float] = OrderedDict()

    def attach(self, releaser: LeaseReleaser) -> None:
        """Sends the holder's early releases with ``releaser`` (whose ``on_released`` must
        be :meth:`released`)."""
        self.releaser = releaser

    def open(self) -> None:
        """One more client uses the cache."""
        with self.lock:
            self.users += 1

    def close(self) -> None:
        """One client less; after the last, every entry goes and its lease is released
        (waiting for the releases), so that a process's leases do not outlive its clients
        (another process's removal of those objects would be refused until they end)."""
        with self.lock:
            self.users -= 1
            last = self.users <= 0
        if last:
            self.clear()
            self.flush()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # ------------------------------------------------------------------ lookups

    def begin_lookup(self, keys: Iterable[str]) -> None:
        """A lookup of ``keys`` is about to be sent (end it with :meth:`end_lookup`, also
        when it fails): until then no release of their leases is sent."""
        with self.lock:
            for key in keys:
                self._looking[key] = self._looking.get(key, 0) + 1

    def end_lookup(
        self,
        keys: Iterable[str],
        results: Iterable[kvstore_pb2.ReplicaListResult] = (),
        sent: float = 0.0,
    ) -> int:
        """Ends the lookup of ``keys`` (:meth:`begin_lookup`) and keeps its found ``results``
        (sent at ``sent``, monotonic, taken before the request left); returns how many were
        kept. Not kept: a lease too short to leave any use after :func:`margin_s`, and a key
        whose lease release is on its way or ended after ``sent`` (the master may have
        granted this lease before the release ended it)."""
        kept = 0
        release: list[str] = []
        with self.lock:
            now = self.clock()
            for res in results:
                if res.code != kvstore_pb2.KV_OK or not res.lease_ms:
                    continue
                key = res.key
                if self._releasing.get(key) or self._fence.get(key, -1.0) >= sent:
                    continue
                lease_s = res.lease_ms / 1000
                usable = sent + lease_s - margin_s(lease_s)
                if usable <= now:
                    continue
                self._entries[key] = Location(res, usable, sent + lease_s)
                self._entries.move_to_end(key)
                self._release_after.discard(key)  # a new lease: a deferred release would end it
                kept += 1
            while len(self._entries) > self.capacity:
                release += self._forget(*self._entries.popitem(last=False), now)
            for key in keys:
                n = self._looking.get(key, 0) - 1
                if n > 0:
                    self._looking[key] = n
                else:
                    self._looking.pop(key, None)
                    release += self._unused(key)
        self._send(release)
        return kept

    def put(self, results: Iterable[kvstore_pb2.ReplicaListResult], sent: float) -> int:
        """Keeps the found ``results`` of a lookup sent at ``sent`` (:meth:`end_lookup` of a
        lookup that was not begun)."""
        return self.end_lookup((), results, sent)

    # ------------------------------------------------------------------ reads

    def take(self, keys: Sequence[str]) -> list[Location | None]:
        """Per key, its entry while it may still be used (counted as in use until
        :meth:`done`), else None. Entries past their use are dropped (their leases
        released)."""
        out: list[Location | None] = []
        release: list[str] = []
        with self.lock:
            now = self.clock()
            for key in keys:
                loc = self._entries.get(key)
                if loc is not None and now >= loc.usable_until:
                    release += self._forget(key, self._entries.pop(key), now)
                    loc = None
                if loc is not None:
                    self._entries.move_to_end(key)
                    self._inflight[key] = self._inflight.get(key, 0) + 1
                out.append(loc)
        self._send(release)
        return out

    def done(self, keys: Iterable[str]) -> None:
        """Ends the use of the entries :meth:`take` gave for ``keys`` (one key per entry
        taken); a lease dropped meanwhile goes back once no one uses it."""
        release: list[str] = []
        with self.lock:
            for key in keys:
                n = self._inflight.get(key, 0) - 1
                if n > 0:
                    self._inflight[key] = n
                    continue
                self._inflight.pop(key, None)
                release += self._unused(key)
        self._send(release)

    # ------------------------------------------------------------------ drops and releases

    def drop(self, keys: Iterable[str]) -> None:
        """Forgets ``keys`` (removed, put, or a read from their location failed) and sends
        the release of their leases, or defers it while a read uses an entry or a lookup of
        the key is in flight."""
        release: list[str] = []
        with self.lock:
            now = self.clock()
            for key in keys:
                loc = self._entries.pop(key, None)
                if loc is not None:
                    release += self._forget(key, loc, now)
        self._send(release)

    def clear(self) -> None:
        """Forgets every entry (:meth:`drop` of each)."""
        with self.lock:
            keys = list(self._entries)
        self.drop(keys)

    def flush(self) -> None:
        """Returns once the releases sent so far ended (a removal that follows is not
        refused for the holder's leases, unless a read or lookup still uses them)."""
        if self.releaser is not None:
            self.releaser.flush()

    def released(self, keys: list[str]) -> None:
        """The releaser's report: the release of ``keys``' leases ended (answered or not)."""
        with self.lock:
            now = self.clock()
            for key in keys:
                n = self._releasing.get(key, 0) - 1
                if n > 0:
                    self._releasing[key] = n
                else:
                    self._releasing.pop(key, None)
                self._fence[key] = now
                self._fence.move_to_end(key)
            fence = self._fence
            while fence and (
                len(fence) > self.capacity or next(iter(fence.values())) < now - FENCE_S
            ):
                fence.popitem(last=False)

    def _forget(self, key: str, loc: Location, now: float) -> list[str]:
        """The entry ``loc`` of ``key`` is out (dropped, past its use, or the least recently
        used beyond the bound): its lease, while it lasts, goes back once no one uses it
        (:meth:`_unused`). Call with the lock held."""
        if loc.lease_end <= now:
            return []
        self._release_after.add(key)
        return self._unused(key)

    def _unused(self, key: str) -> list[str]:
        """``[key]`` when its deferred release may go now (no read, no lookup uses it),
        counted as on its way; else ``[]``. Call with the lock held."""
        if key not in self._release_after or self._inflight.get(key) or self._looking.get(key):
            return []
        self._release_after.discard(key)
        self._releasing[key] = self._releasing.get(key, 0) + 1
        return [key]

    def _send(self, keys: list[str]) -> None:
        """Sends the release of ``keys``' leases (without a releaser: done at once)."""
        if not keys:
            return
        if self.releaser is None:
            self.released(keys)
        else:
            self.releaser.release(keys)


_shared: dict[tuple[int, str], LocationCache] = {}
_shared_lock = threading.Lock()


def shared(master_address: str, timeout_s: float = 5.0, control: str = "auto") -> LocationCache:
    """This process's cache for ``master_address``: every client of that master in the
    process uses the same one. Its releases go over a master link of its own (``timeout_s``,
    ``control`` as :class:`MasterLink`'s, from the first client), which outlives any one
    client. A forked child gets a new one (its parent's leases are its parent's to release)."""
    key = (os.getpid(), master_address)
    with _shared_lock:
        cache = _shared.get(key)
        if cache is None:
            cache = _shared[key] = LocationCache()
            link = MasterLink(master_address, timeout_s, control)
            cache.attach(LeaseReleaser(link.call, cache.holder, timeout_s, cache.released))
        return cache
