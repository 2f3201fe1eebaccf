"""The one seam between an engine and the KV store.

Both engines (the torch engine in its own process, the vLLM KV connector inside vLLM's
processes) reach the store only through :class:`ChunkIO`, so they share one failure policy:

- Every store error (unreachable master, timeout, no space) is a miss, never the request's
  failure: a lookup answers 0, a read None for each chunk, a save nothing. The engine then
  computes what it could not load.
- After an error that says the store is unreachable or slow (UNAVAILABLE, DEADLINE_EXCEEDED,
  a timeout, a socket error) the store is skipped for ``backoff_s``, doubling on each further
  one up to ``max_backoff_s`` and reset by a success: a store that is down costs one timeout,
  not one per request. Other errors (no space, a refused put, too few nodes alive to place a
  put: the master answered) are counted and logged only. (A put refused for want of nodes
  while a new master waited for the nodes to remount, a fraction of a second after a
  failover, used to skip the store, loads too, for 2 s more: measured with `pdserve bench
  chaos --kvstore-masters 2`.)
- Saves are one batched put (two master round trips whatever the chunk count); the master
  skips keys it already holds, so nothing asks ``exists`` first.
- Each operation is counted and timed (:mod:`pdserve.engines.metrics`).

The store is anything with the :class:`ChunkStore` methods: the store client
(:class:`pdserve.store.client.StoreClient`), the in-process
:class:`pdserve.store.memory.MemoryBackend` (tests run the production codec through it), or
any :class:`pdserve.store.api.StoreBackend`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from pdserve import errors, hashing, tracing
from pdserve.engines import metrics
from pdserve.engines.chunk_wait import load_as_landed
from pdserve.kvformat import encoded_size
from pdserve.store.api import ChunkMeta, ChunkNamespace, NotEnoughNodes, StoreOptions

log = logging.getLogger(__name__)

#: First and longest pause of the store after it was unreachable (seconds).
BACKOFF_S = 2.0
MAX_BACKOFF_S = 30.0
#: Errors that mean the store is unreachable or too slow (the others do not pause it).
_DOWN = (errors.Unavailable, errors.DeadlineExceeded, TimeoutError, OSError)


class ChunkStore(Protocol):
    """What an engine needs of a store (:class:`pdserve.store.api.StoreBackend` has it)."""

    def longest_prefix(self, keys: Sequence[str]) -> int: ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def batch_get_chunks(
        self, keys: Sequence[str], fingerprint: bytes, *, arena: memoryview | None = None
    ) -> list[torch.Tensor | None]: ...

    def batch_put_chunks(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        fingerprint: bytes,
        options: StoreOptions = ...,
        *,
        encoding: str = "none",
        meta: Mapping[str, ChunkMeta] | None = None,
        namespace: ChunkNamespace | None = None,
    ) -> list[bool]: ...

    def close(self) -> None: ...


class ChunkIO:
    """Lookups, reads, write-mode waits and saves of one fingerprint's chunks (see the module
    docstring). Thread-safe when the store is. ``replicas``: copies of each saved chunk."""

    def __init__(
        self,
        store: ChunkStore,
        fingerprint: hashing.ModelFingerprint,
        *,
        replicas: int = 1,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.digest = fingerprint.digest()
        #: The labels of the fingerprint whose chain the saves belong to, sent with every save
        #: (the master's namespaces): rank 0's, on every tensor-parallel rank. A rank's keys
        #: derive from rank 0's (:func:`pdserve.hashing.rank_key`), and the master keeps one
        #: fingerprint per chain root: a rank tagging its own refused every TP save.
        self.labels = replace(fingerprint, tp_rank=0).to_labels()
        self.replicas = replicas
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._next_backoff = backoff_s

    # ------------------------------------------------------------------ failure policy

    def available(self) -> bool:
        """False while the store is skipped after an error."""
        return self._clock() >= self._down_until

    def _failed(self, op: str, exc: BaseException) -> None:
        metrics.KV_STORE_ERRORS.labels(op).inc()
        if not isinstance(exc, _DOWN) or isinstance(exc, NotEnoughNodes):
            log.warning("KV store %s failed (%s: %s)", op, type(exc).__name__, exc)
            return
        with self._lock:
            wait = self._next_backoff
            self._down_until = self._clock() + wait
            self._next_backoff = min(wait * 2, self.max_backoff_s)
        log.warning(
            "KV store %s failed (%s: %s); computing instead, store skipped for %.1f s",
            op,
            type(exc).__name__,
            exc,
            wait,
        )

    def _ok(self) -> None:
        if self._next_backoff != self.backoff_s:
            with self._lock:
                self._next_backoff = self.backoff_s

    # ------------------------------------------------------------------ operations

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the store holds (0 on an error or while skipped)."""
        if not keys or not self.available():
            return 0
        start = time.perf_counter()
        try:
            n = self.store.longest_prefix(keys)
        except Exception as exc:
            self._failed("lookup", exc)
            return 0
        metrics.KV_STORE_SECONDS.labels("lookup").observe(time.perf_counter() - start)
        self._ok()
        return n

    def has(self, key: str) -> bool:
        """Whether the store holds ``key`` (False on an error or while skipped)."""
        return self.lookup([key]) == 1

    def get(
        self, keys: Sequence[str], *, arena: memoryview | None = None
    ) -> list[torch.Tensor | None]:
        """The verified chunks of ``keys``, None for each that is missing or corrupt (all
        None on an error or while skipped). ``arena``: as the store client's
        ``batch_get_chunks`` (chunks read into it, views valid until it is reused)."""
        if not keys:
            return []
        if not self.available():
            return [None] * len(keys)
        with tracing.span("pdserve.kv.load", root=False) as span:
            start = time.perf_counter()
            try:
                if arena is None:
                    got = self.store.batch_get_chunks(keys, self.digest)
                else:
                    got = self.store.batch_get_chunks(keys, self.digest, arena=arena)
            except Exception as exc:
                self._failed("load", exc)
                return [None] * len(keys)
            metrics.KV_STORE_SECONDS.labels("load").observe(time.perf_counter() - start)
            self._ok()
            if span.is_recording():
                span.set_attributes(self._moved(len(keys), [t for t in got if t is not None]))
            return got

    def load_prefix(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """The chunks of the longest run of leading ``keys`` that are stored and verify."""
        n = self.lookup(keys)
        out: list[torch.Tensor] = []
        for kv in self.get(keys[:n]) if n else []:
            if kv is None:
                metrics.KV_CHUNK_MISSES.labels("chunk").inc()
                break
            out.append(kv)
        return out

    def load_as_landed(
        self,
        keys: Sequence[str],
        wait_ms: int,
        load: Callable[[int, int], int],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> int:
        """Write mode (:func:`pdserve.engines.chunk_wait.load_as_landed`): ``load(start, end)``
        for each run of ``keys`` as it lands; how many leading keys were loaded. ``load``
        reads with :meth:`get`. A store error ends the wait (counted, backoff)."""
        if not keys or not self.available():
            return 0
        try:
            return load_as_landed(self.store, keys, wait_ms, load, cancelled)
        except Exception as exc:
            self._failed("lookup", exc)
            return 0

    def save(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        ttl_ms: int = 0,
        meta: Mapping[str, ChunkMeta] | None = None,
        roots: Mapping[str, str] | None = None,
        tenants: Mapping[str, str] | None = None,
    ) -> int:
        """Stores the chunks (one batched put; keys the store holds are skipped by it) in the
        fingerprint's chunk encoding; how many were written now. Nothing on an error or while
        skipped: a chunk not saved is a future miss. ``meta``: per key, the chunk's parent key
        and token ids, which the master publishes with its KV events; ``roots``: per key, the
        chain root (hex) of its request's chain (a key not there: the fingerprint's digest),
        with which the master tags it, together with the fingerprint's labels (stores that
        cannot carry either drop it); ``tenants``: chain root -> the tenant writing under it."""
        if not items or not self.available():
            return 0
        kind = "tail" if ttl_ms else "chunk"
        start = time.perf_counter()
        namespace = ChunkNamespace(
            self.labels[hashing.DIGEST_LABEL], self.labels, roots or {}, tenants or {}
        )
        extra: dict[str, object] = {"namespace": namespace}
        if meta:
            extra["meta"] = meta
        try:
            with tracing.span("pdserve.kv.save", {"pdserve.kv.kind": kind}, root=False) as span:
                written = self.store.batch_put_chunks(
                    items,
                    self.digest,
                    StoreOptions(replicas=self.replicas, ttl_ms=ttl_ms),
                    encoding=self.fingerprint.kv_compression,
                    **extra,
                )
                if span.is_recording():
                    done = [kv for (_k, kv), ok in zip(items, written, strict=True) if ok]
                    span.set_attributes(self._moved(len(items), done))
        except Exception as exc:
            self._failed("save", exc)
            return 0
        metrics.KV_STORE_SECONDS.labels("save").observe(time.perf_counter() - start)
        self._ok()
        n = sum(written)
        metrics.KV_CHUNKS_WRITTEN.labels(kind).inc(n)
        if len(items) - n:
            metrics.KV_CHUNKS_SKIPPED.inc(len(items) - n)
        return n

    def _moved(self, asked: int, chunks: Sequence[torch.Tensor]) -> dict[str, int]:
        """A load or save span's attributes: chunks asked for, chunks moved and their bytes
        in the store (encoded chunks, headers included)."""
        encoding = self.fingerprint.kv_compression
        size = sum(encoded_size(tuple(kv.shape), kv.dtype, encoding) for kv in chunks)
        return {
            "pdserve.kv.chunks": asked,
            "pdserve.kv.moved": len(chunks),
            "pdserve.kv.bytes": size,
        }

    def drop(self, digests: Sequence[str]) -> bool:
        """Removes every chunk of the fingerprints ``digests`` (hex) from the store, all their
        chain roots, memory and disk (``DropNamespaces``: the connector's reset). False, with
        the reason logged, when the store cannot (a backend without namespaces) or this
        process's identity may not (the master takes admin), or on any store error."""
        drop = getattr(self.store, "drop_namespaces", None)
        if drop is None:
            log.warning(
                "KV store reset: the %s backend keeps no namespaces; its chunks stay",
                type(self.store).__name__,
            )
            return False
        try:
            resp = drop(list(digests))
        except errors.PermissionDenied as exc:
            log.warning(
                "KV store reset: this engine's identity may not drop chunks (the master "
                "takes an admin identity; run `pdserve kvstore drop` instead): %s",
                exc,
            )
            return False
        except Exception as exc:
            log.warning("KV store reset failed (%s: %s); its chunks stay", type(exc).__name__, exc)
            return False
        n = sum(f.objects for f in resp.dropped)
        log.info("KV store reset: dropped %d chunks of fingerprint(s) %s", n, list(digests))
        return True

    def close(self) -> None:
        self.store.close()
