"""An in-process store backend: the store client API (:class:`StoreBackend`) over a dict.

For engines and tools that run without a cluster (unit tests drive the engines' production
chunk codec through it) and as the reference semantics of the API: idempotent puts (an
existing key is kept, the put answers False), reads that miss rather than raise, TTLs that
expire objects. Thread-safe. Bytes are copied in and out, as a remote store would."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from pdserve.store.api import DEFAULT_OPTIONS, StoreBackend, StoreOptions, byte_view, check_keys


class MemoryBackend(StoreBackend):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: key -> bytes; ``_expiry``: key -> monotonic deadline of objects put with a TTL
        self.objects: dict[str, bytes] = {}
        self._expiry: dict[str, float] = {}

    def _live(self, key: str) -> bytes | None:
        """The key's bytes unless absent or expired (then dropped). Holds ``_lock``."""
        deadline = self._expiry.get(key)
        if deadline is not None and time.monotonic() >= deadline:
            self.objects.pop(key, None)
            self._expiry.pop(key, None)
        return self.objects.get(key)

    def batch_put(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        options: StoreOptions = DEFAULT_OPTIONS,
    ) -> list[bool]:
        options.validate()
        keys = check_keys([k for k, _ in items])
        views = [byte_view(d) for _, d in items]
        out = []
        with self._lock:
            for key, view in zip(keys, views, strict=True):
                if self._live(key) is not None:
                    out.append(False)
                    continue
                self.objects[key] = bytes(view)
                if options.ttl_ms:
                    self._expiry[key] = time.monotonic() + options.ttl_ms / 1000.0
                out.append(True)
        return out

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = check_keys(keys)
        with self._lock:
            return [self._live(k) for k in keys]

    def get_into(self, key: str, buf: memoryview) -> int | None:
        data = self.get(key)
        if data is None or len(data) > len(buf):
            return None
        buf[: len(data)] = data
        return len(data)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        with self._lock:
            return [self._live(k) is not None for k in keys]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        keys = check_keys(keys)
        with self._lock:
            n = 0
            while n < len(keys) and self._live(keys[n]) is not None:
                n += 1
            return n

    def remove(self, keys: Sequence[str]) -> int:
        keys = check_keys(keys)
        with self._lock:
            removed = 0
            for k in keys:
                if self._live(k) is not None:
                    del self.objects[k]
                    self._expiry.pop(k, None)
                    removed += 1
            return removed

    def close(self) -> None:
        pass
