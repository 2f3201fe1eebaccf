"""The store client's read leases: the leases of every get's lookup go back to the master in
batches from a background thread (one ``BatchReleaseLease`` per ~:data:`RELEASE_DELAY_S`), so
a get costs at most one master round trip on its own path; a lost release only means the
lease runs out on its own. Objects that failed verification on every replica are removed
after the releases. (The leases of locations kept from ``longest_prefix`` are the location
cache's, released by a releaser of its own only when an entry is dropped: :mod:`.locations`.)"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve import errors
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)

#: How long lease releases wait to be sent together (seconds).
RELEASE_DELAY_S = 0.01


class LeaseReleaser:
    """Queued lease releases and removals, sent by a thread started at the first release.
    ``call(method, request)`` reaches the master; ``on_released(keys)``, when given, is told
    of each batch of releases once its call ended (answered or failed). Thread-safe."""

    def __init__(
        self,
        call: Callable[[str, Any], Any],
        client_id: str,
        timeout_s: float,
        on_released: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.call = call
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.on_released = on_released
        self.cv = threading.Condition()
        self.flush_lock = threading.Lock()
        #: Keys whose read leases are still to be released.
        self.pending_release: list[str] = []
        #: Keys to remove once released (no replica holds what was written).
        self.pending_remove: set[str] = set()
        self.thread: threading.Thread | None = None
        self.closing = False

    def release(self, keys: list[str]) -> None:
        """Queues the read leases of ``keys`` for release."""
        if not keys:
            return
        with self.cv:
            self.pending_release.extend(keys)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._loop, name="store-lease-release", daemon=True
                )
                self.thread.start()
            self.cv.notify()

    def discard(self, key: str) -> None:
        """Queues the removal of an object none of whose replicas holds what was written
        (torn, overwritten): readers would miss on it until it is evicted, and its writers
        would skip it as already stored. Sent after the lease releases."""
        with self.cv:
            self.pending_remove.add(key)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.pending_release and not self.closing:
                    self.cv.wait()
                if self.closing and not self.pending_release:
                    return
            time.sleep(RELEASE_DELAY_S)  # let more releases coalesce
            self.flush()

    def flush(self) -> None:
        """Sends the queued releases now; returns once no release is in flight."""
        with self.flush_lock:
            with self.cv:
                keys, self.pending_release = self.pending_release, []
                bad, self.pending_remove = self.pending_remove, set()
            if not keys:
                return
            try:
                self.call(
                    "BatchReleaseLease",
                    kvstore_pb2.BatchKeysRequest(client_id=self.client_id, keys=keys),
                )
                if bad:
                    resp = self.call("BatchRemove", kvstore_pb2.BatchKeysRequest(keys=sorted(bad)))
                    gone = sum(r.code == kvstore_pb2.KV_OK for r in resp.results)
                    log.warning(
                        "removed %d of %d objects that failed verification on every replica, "
                        "so their next writer stores them again",
                        gone,
                        len(bad),
                    )
            except errors.PdserveError as exc:
                log.debug("lease release of %d key(s) failed: %s", len(keys), exc)
            finally:
                if self.on_released is not None:
                    self.on_released(keys)

    def close(self) -> None:
        """Sends what is queued and stops the thread."""
        with self.cv:
            self.closing = True
            self.cv.notify()
        self.flush()
        if self.thread is not None:
            self.thread.join(timeout=self.timeout_s)
