"""A prompt's KV through the store, for the torch engine: build it (load the longest cached
chunk prefix, compute the rest, save the new chunks and the tail), check a KV handle against
the prompt, fetch its chunks (waiting for those still landing, write mode) and build the cache
from them. Every store failure degrades to computing those positions, counted in
:mod:`pdserve.engines.metrics`.

The cache of positions ``[i * chunk_size, (i + 1) * chunk_size)`` is stored under the i-th
chain key (:func:`pdserve.hashing.chunk_keys`, salted with the request's cache salt; the
engine keeps no prefix cache of its own, so the store is its only reuse) as a canonical
``[layers, 2, kv_heads, tokens, head_dim]`` tensor, in the ``kv_compression`` encoding (read
back in ``kv_dtype``); the partial tail under a request-scoped key with a TTL. The store is
reached through :class:`pdserve.engines.chunk_io.ChunkIO`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdserve import hashing
from pdserve.engines import metrics
from pdserve.engines.chunk_io import ChunkIO, ChunkStore
from pdserve.engines.config import EngineConfig
from pdserve.engines.torch_engine.model import TorchModel
from pdserve.requests import KVRef
from pdserve.store.api import ChunkMeta

log = logging.getLogger(__name__)


class PromptKV:
    """Prompt KV of one model and fingerprint. ``chunks``: the store seam (None: no store,
    always compute), replaced by :meth:`attach`."""

    def __init__(
        self, cfg: EngineConfig, model: TorchModel, fingerprint: hashing.ModelFingerprint
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.fingerprint = fingerprint
        self.digest = fingerprint.digest()
        self.chunks: ChunkIO | None = None

    def attach(self, store: ChunkStore | None) -> None:
        """Reads and writes chunks through ``store`` from now on (None: no store), with a
        fresh failure backoff (:class:`pdserve.engines.chunk_io.ChunkIO`)."""
        self.chunks = (
            None
            if store is None
            else ChunkIO(store, self.fingerprint, replicas=self.cfg.store_replicas)
        )

    def handle(self, tokens: Sequence[int], request_id: str, cache_salt: str) -> KVRef:
        """The KV handle of a prefill of ``tokens``: every full chunk and the tail."""
        return KVRef(
            chunk_keys=tuple(hashing.chunk_keys(self.fingerprint, tokens, cache_salt)),
            tail_key=hashing.tail_key(self.fingerprint, tokens, request_id, cache_salt),
            num_tokens=len(tokens),
            chunk_size=self.cfg.chunk_size,
            fingerprint=self.digest,
        )

    # ----------------------------------------------------------------- a prompt's KV

    def compute(
        self,
        request_id: str,
        tokens: list[int],
        cache_salt: str,
        *,
        write_tail: bool,
        publish: bool,
        phase: str,
        bypass_store: bool = False,
        tenant: str = "",
    ) -> tuple[Any, torch.Tensor, int, int]:
        """Builds the prompt's KV: loads the longest cached chunk prefix of ``cache_salt``'s
        chain, computes the rest and writes new full chunks (and the tail when
        ``write_tail``; chunk by chunk as each exists when ``publish``: write mode). Returns
        the cache, the last position's logits, and the loaded and computed token counts.
        ``bypass_store``: no load and no write (everything computed; Engine.prefill).
        ``tenant``: the tenant the written chunks are tagged with ("" = none)."""
        cs = self.cfg.chunk_size
        n = len(tokens)
        keys = hashing.chunk_keys(self.fingerprint, tokens, cache_salt)
        root = hashing.chain_root(self.fingerprint, cache_salt).hex()  # the master's namespace
        space = (root, tenant)
        # chunks saved: every full one, none when bypassing the store
        saved = 0 if bypass_store else len(keys)
        chunks = [] if bypass_store else self._load_prefix(keys)
        loaded = min(len(chunks) * cs, n - 1)  # the last token is always computed (logits)
        cache = self.model.cache_from_chunks(chunks, loaded)
        if loaded:
            metrics.KV_LOADED_TOKENS.labels(phase).inc(loaded)
        done_chunks = len(chunks)
        if publish:
            pos = loaded
            logits = None
            while pos < n:
                end = min(n, (pos // cs + 1) * cs)
                logits = self.model.forward(tokens[pos:end], cache)
                if end % cs == 0 and done_chunks < end // cs <= saved:
                    self._save_chunks(cache, keys, done_chunks, end // cs, tokens, *space)
                    done_chunks = end // cs
                pos = end
            assert logits is not None
        else:
            logits = self.model.forward(tokens[loaded:], cache)
            self._save_chunks(cache, keys, done_chunks, saved, tokens, *space)
        if write_tail and n % cs and not bypass_store:
            tail = hashing.tail_key(self.fingerprint, tokens, request_id, cache_salt)
            self._save_tail(cache, tail, n, *space)
        reason = "uncached" if phase == "prefill" else "local"
        metrics.KV_COMPUTED_TOKENS.labels(reason).inc(n - loaded)
        return cache, logits, loaded, n - loaded

    # ----------------------------------------------------------------- a KV handle

    def handle_keys(
        self, kv: KVRef, tokens: Sequence[int], cache_salt: str, request_id: str
    ) -> list[str] | None:
        """The store keys of the KV handle ``kv``, chunks then tail; None when the handle
        does not belong to this prompt, model and cache salt (it is then ignored rather than
        trusted). The handle covers the whole prompt (read mode: full chunks plus the tail)
        or a chunk-aligned prefix of it (write mode, no tail)."""
        cs = self.cfg.chunk_size
        n = len(tokens)
        expected = hashing.chunk_keys(self.fingerprint, tokens, cache_salt)
        k = len(kv.chunk_keys)
        covered = n if kv.tail_key else k * cs
        if (
            kv.fingerprint != self.digest
            or kv.chunk_size != cs
            or list(kv.chunk_keys) != expected[:k]
            or kv.num_tokens != covered
            or covered > n
            or (kv.tail_key and (k != n // cs or n % cs == 0))
        ):
            log.warning(
                "request %s: KV handle does not match prompt/model; recomputing", request_id
            )
            metrics.KV_CHUNK_MISSES.labels("handle").inc()
            return None
        return list(kv.chunk_keys) + ([kv.tail_key] if kv.tail_key else [])

    def fetch(
        self, keys: list[str], wait_ms: int, cancelled: Callable[[], bool]
    ) -> list[torch.Tensor | None]:
        """Gets the keys' chunks in order, ending after the first miss (a None: missing,
        corrupt, or not landed within ``wait_ms``: in write mode a key not stored yet is
        waited for, it may still be landing). Runs on a loader thread, never the model's."""
        out: list[torch.Tensor | None] = []
        chunks = self.chunks
        if not keys or chunks is None or not chunks.available():
            return out

        def load(start: int, end: int) -> int:
            for t in chunks.get(keys[start:end]):
                out.append(t)
                if t is None:
                    return len(out) - 1 - start
            return len(out) - start

        done = chunks.load_as_landed(keys, wait_ms, load, cancelled)
        if done == len(out) < len(keys):  # the next key did not land in time
            out.append(None)
        return out

    def cache_from_handle(
        self, kv: KVRef, tokens: Sequence[int], fetched: list[torch.Tensor | None] | None
    ) -> tuple[Any, int]:
        """Builds the cache from the chunks :meth:`fetch` got for ``kv`` (None: the handle
        did not match); returns it and how many leading prompt tokens it holds (the rest must
        be computed)."""
        if fetched is None:
            return self.model.new_cache(), 0
        cs = self.cfg.chunk_size
        n = len(tokens)
        k = len(kv.chunk_keys)
        covered = n if kv.tail_key else k * cs
        chunks: list[torch.Tensor] = []
        for i, t in enumerate(fetched):
            want = cs if i < k else n % cs
            if not self.model.valid_chunk(t, want):
                metrics.KV_CHUNK_MISSES.labels("chunk" if i < k else "tail").inc()
                break
            chunks.append(t)  # type: ignore[arg-type]
        loaded = min(covered, len(chunks) * cs)
        if loaded:
            metrics.KV_LOADED_TOKENS.labels("decode").inc(loaded)
        return self.model.cache_from_chunks(chunks, loaded), loaded

    # ----------------------------------------------------------------- store access

    def _load_prefix(self, keys: list[str]) -> list[torch.Tensor]:
        """The longest run of leading chunks that exist and verify."""
        if self.chunks is None:
            return []
        out: list[torch.Tensor] = []
        for t in self.chunks.load_prefix(keys):
            if not self.model.valid_chunk(t, self.cfg.chunk_size):
                metrics.KV_CHUNK_MISSES.labels("chunk").inc()
                break
            out.append(t)
        return out

    def _save_chunks(
        self,
        cache: Any,
        keys: list[str],
        first: int,
        end: int,
        tokens: Sequence[int] = (),
        root: str = "",
        tenant: str = "",
    ) -> None:
        """Writes chunks ``first..end-1`` (one batched put; the store skips those it holds),
        with each one's parent key and token ids (for the master's KV events) when
        ``tokens`` (the prompt) is given, tagged with chain ``root`` (hex; "" = the
        fingerprint's digest) and ``tenant`` ("" = none)."""
        if first >= end or self.chunks is None or not self.chunks.available():
            return
        cs = self.cfg.chunk_size
        meta = {
            keys[i]: ChunkMeta(keys[i - 1] if i else "", tokens[i * cs : (i + 1) * cs], cs)
            for i in range(first, end)
            if tokens
        }
        self.chunks.save(
            [
                (keys[i], self.model.chunk_of(cache, i * cs, (i + 1) * cs))
                for i in range(first, end)
            ],
            meta=meta,
            roots=dict.fromkeys(keys[first:end], root) if root else None,
            tenants={root: tenant} if root and tenant else None,
        )

    def _save_tail(self, cache: Any, key: str, n: int, root: str = "", tenant: str = "") -> None:
        if self.chunks is None or not self.chunks.available():
            return
        start = n - n % self.cfg.chunk_size
        chunk = self.model.chunk_of(cache, start, n)
        roots = {key: root} if root else None
        tenants = {root: tenant} if root and tenant else None
        self.chunks.save([(key, chunk)], ttl_ms=self.cfg.tail_ttl_ms, roots=roots, tenants=tenants)
