"""The store client API on top of a real Mooncake Store cluster (``mooncake_master`` plus
``MooncakeDistributedStore`` clients), so a user who already runs Mooncake keeps it.

Mooncake differs from pdserve's store in ways the API hides or documents:
* ``put`` of an existing key is a silent no-op there; this backend asks ``batch_is_exist``
  first so that ``put`` still answers False for an existing key.
* Storage lives in the segments clients contribute (``global_segment_size``); run
  ``pdserve mooncake storage`` (:mod:`pdserve.commands.mooncake`) to contribute memory from a
  process of its own, the way a pdserve storage node does.
* ``longest_prefix`` is ``batch_is_exist`` plus a count on the client side.
* Mooncake's ``get`` / ``is_exist`` hold read leases the client cannot release, so
  ``remove`` waits (bounded) for them to lapse.

Connection: P2PHANDSHAKE metadata (no metadata server), tcp protocol, 127.0.0.1 by default;
services choose it with ``--store-backend mooncake`` (``pdserve.store.StoreBackendConfig``), and
code opens it with ``pdserve.store.open_store(..., backend="mooncake")``. A local cluster for
tests and benchmarks: :mod:`pdserve.store.mooncake_cluster`.
Mooncake has no per-object TTL: request-scoped tail chunks stay until evicted.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from pdserve import errors
from pdserve.store.api import (
    DEFAULT_OPTIONS,
    StoreBackend,
    StoreOptions,
    byte_view,
    check_keys,
    kv_error,
)
from pdserve.v1 import kvstore_pb2

#: Mooncake error codes this backend names (mooncake-store/include/types.h).
OBJECT_HAS_LEASE = -706
NO_AVAILABLE_HANDLE = -200
#: Mooncake return codes as pdserve's KVErrorCode (the exceptions come from one table,
#: :func:`pdserve.store.api.kv_error`); any other nonzero code is a failure of the cluster.
_KV_CODES = {NO_AVAILABLE_HANDLE: kvstore_pb2.KV_NO_SPACE}


def available() -> bool:
    """Whether the mooncake package (its store binding) is installed."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return True


class MooncakeStoreClient(StoreBackend):
    """:class:`~pdserve.store.api.StoreBackend` over ``MooncakeDistributedStore``.

    ``segment_bytes`` is the memory this client contributes to the pool (0 = none: objects
    land in other clients' segments). Calls are serialized by a lock (the binding's client is
    shared). ``host``, ``metadata_server``, ``protocol``, ``device_name`` and ``buffer_bytes``
    are Mooncake's ``local_hostname``, ``metadata_server``, ``protocol``, ``device_name`` and
    ``local_buffer_size`` (``pdserve.compat``); ``segment_bytes`` its ``global_segment_size``."""

    def __init__(
        self,
        master_address: str,
        *,
        segment_bytes: int = 0,
        buffer_bytes: int = 64 * 1024 * 1024,
        host: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise errors.Unavailable(
                f"the mooncake backend needs mooncake installed: {exc}"
            ) from exc
        self.master_address = master_address
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            host, metadata_server, segment_bytes, buffer_bytes, protocol, device_name,
            master_address,
        )  # fmt: skip
        if rc != 0:
            raise errors.Unavailable(
                f"MooncakeDistributedStore.setup({master_address}, metadata {metadata_server}, "
                f"{protocol}) failed: {rc}"
            )
        self._buf = np.empty(0, dtype=np.uint8)
        self._lock = threading.Lock()

    def _config(self, options: StoreOptions):
        from mooncake.store import ReplicateConfig

        options.validate()
        cfg = ReplicateConfig()
        cfg.replica_num = options.replicas
        return cfg

    def _staging(self, size: int) -> np.ndarray:
        """A registered buffer of at least ``size`` bytes (lock held)."""
        if len(self._buf) < size:
            if len(self._buf):
                self._store.unregister_buffer(self._buf.ctypes.data)
            self._buf = np.empty(max(size, 1 << 20), dtype=np.uint8)
            rc = self._store.register_buffer(self._buf.ctypes.data, len(self._buf))
            if rc != 0:
                raise errors.Unavailable(f"mooncake register_buffer failed: {rc}")
        return self._buf

    def batch_put(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        options: StoreOptions = DEFAULT_OPTIONS,
    ) -> list[bool]:
        keys = check_keys([k for k, _ in items])
        views = [byte_view(d) for _, d in items]
        cfg = self._config(options)
        with self._lock:
            present = self._store.batch_is_exist(keys)
            out = []
            for key, view, there in zip(keys, views, present, strict=True):
                if there == 1:
                    out.append(False)
                    continue
                staging = self._staging(len(view))
                staging[: len(view)] = np.frombuffer(view, dtype=np.uint8)
                rc = self._store.put_from(key, staging.ctypes.data, len(view), cfg)
                if rc != 0:
                    raise kv_error(_KV_CODES.get(rc), f"mooncake put of {key!r}", f"code {rc}")
                out.append(True)
        return out

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = check_keys(keys)
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                size = self._store.get_size(key)
                if size <= 0:
                    out.append(None)
                    continue
                staging = self._staging(size)
                n = self._store.get_into(key, staging.ctypes.data, size)
                out.append(staging[:n].tobytes() if n > 0 else None)
        return out

    def get_into(self, key: str, buf: memoryview) -> int | None:
        key = check_keys([key])[0]
        mv = byte_view(buf, writable=True, allow_empty=True)
        with self._lock:
            size = self._store.get_size(key)
            if size <= 0:
                return None
            if size > len(mv):
                raise errors.InvalidArgument(
                    f"buffer of {len(mv)} bytes is smaller than object {key!r} ({size} bytes)"
                )
            staging = self._staging(size)
            n = self._store.get_into(key, staging.ctypes.data, size)
            if n <= 0:
                return None
            np.frombuffer(mv, dtype=np.uint8, count=n)[:] = staging[:n]
            return n

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        if not keys:
            return []
        with self._lock:
            return [r == 1 for r in self._store.batch_is_exist(keys)]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        n = 0
        for there in self.exists(keys):
            if not there:
                break
            n += 1
        return n

    def remove(self, keys: Sequence[str], lease_wait_s: float = 1.0) -> int:
        """Removes ``keys``. Mooncake's own ``get`` and ``is_exist`` grant read leases that a
        client cannot release early, so a leased key is retried for up to ``lease_wait_s``
        (the master's ``default_kv_lease_ttl`` decides how long that takes)."""
        keys = check_keys(keys)
        removed = 0
        deadline = time.monotonic() + lease_wait_s
        with self._lock:
            for k in keys:
                rc = self._store.remove(k)
                while rc == OBJECT_HAS_LEASE and time.monotonic() < deadline:
                    time.sleep(0.02)
                    rc = self._store.remove(k)
                removed += rc == 0
        return removed

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
