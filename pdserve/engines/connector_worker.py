"""The worker half of the pdserve vLLM connector (:mod:`pdserve.engines.vllm_connector`): it
owns the engine's KV cache tensors, reads and verifies chunks from the store and scatters them
into paged blocks before a step's forward (asynchronous loads, write mode's and those of
``load_async``, off the step on waiter threads), gathers completed chunks after the forward
and writes them (with a save queue, those no reader awaits off the step:
:mod:`pdserve.engines.save_writer`). Where K and V lie in a block is
:mod:`pdserve.engines.kv_layout`'s, derived from vLLM at ``register_kv_caches``."""

from __future__ import annotations

import concurrent.futures
import re
import threading
from typing import Any

import torch

from pdserve import hashing, tracing
from pdserve.engines import kv_layout
from pdserve.engines.chunk_io import ChunkIO
from pdserve.engines.connector_data import (
    ChunkLoad,
    ChunkSave,
    PdserveConnectorMetadata,
    RequestLoad,
    log,
    log_store_off,
)
from pdserve.engines.save_writer import SaveWriter
from pdserve.kvformat import DTYPE_NAMES, encoded_size
from pdserve.store.api import ChunkMeta


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    return int(found[-1]) if found else 0


class ConnectorWorker:
    """The worker-side state and calls (see the module docstring); ``rank_fp``: this TP
    rank's fingerprint, under whose keys it keeps its share of each chunk."""

    def __init__(
        self,
        vllm_config: Any,
        fp: hashing.ModelFingerprint,
        rank_fp: hashing.ModelFingerprint,
        block_size: int,
        io: ChunkIO,
        save_queue_mib: int = 0,
    ) -> None:
        self.vllm_config = vllm_config
        self.fp = fp
        self.rank_fp = rank_fp
        self.block_size = block_size
        self.chunk_size = fp.chunk_size
        self.blocks_per_chunk = self.chunk_size // block_size
        self.io = io
        #: why this worker moves no chunk ("" = it does): a KV layout it cannot convert
        self.off_reason = ""
        #: the caches' layout (kv_layout), set in register_kv_caches
        self._layout: kv_layout.BlockLayout | None = None
        self._caches: list[torch.Tensor] = []
        self._failed_blocks: set[int] = set()
        #: write mode's waiter threads: the stop event of each wait in progress, the requests
        #: whose wait ended (for get_finished); ``_lock`` guards these and _failed_blocks
        self._lock = threading.Lock()
        self._waits: dict[str, threading.Event] = {}
        self._landed: set[str] = set()
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        self._arena = bytearray()
        self._arena_tensor = torch.empty(0, dtype=torch.uint8)
        #: writes the saves no reader awaits, off the step (None: all inside it)
        self._writer = SaveWriter(save_queue_mib << 20) if save_queue_mib > 0 else None

    def turn_off(self, reason: str) -> None:
        """Move no chunk from now on (logged once): vLLM recomputes what was planned."""
        if not self.off_reason:
            log_store_off(reason)
        self.off_reason = reason

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        self._caches = [kv_caches[n] for n in names]
        dtype = DTYPE_NAMES.get(self._caches[0].dtype)
        if dtype != self.fp.kv_dtype:
            raise ValueError(
                f"vLLM's KV cache dtype {self._caches[0].dtype} does not match the "
                f"fingerprint's kv_dtype {self.fp.kv_dtype!r}"
            )
        cache = self._caches[0]
        try:
            self._layout = kv_layout.engine_layout(
                self.vllm_config, cache.dtype, int(cache.shape[2]), int(cache.shape[3]) // 2
            )
            self._layout.views(cache)  # checks the cache's shape and strides against it
        except kv_layout.LayoutError as exc:
            self.turn_off(str(exc))

    def start_load_kv(self, meta: PdserveConnectorMetadata) -> None:
        """Before the step's forward: the step's loads (write mode's handed to waiters)."""
        for load in meta.loads:
            if self.off_reason:  # planned by a scheduler that could convert: recompute it
                with self._lock:
                    if load.chunks:
                        self._failed_blocks.update(self._blocks_from(load, 0))
                    if load.asynchronous:
                        self._landed.add(load.req_id)
            elif load.asynchronous:
                self._start_wait(load)
            else:
                self._load_request(load)

    def _start_wait(self, load: RequestLoad) -> None:
        """An asynchronous load (write mode's, or any with ``load_async``): hands ``load`` to a
        waiter thread (see the module docstring)."""
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(
                4, thread_name_prefix="pdserve-kv-wait"
            )
        stop = threading.Event()
        with self._lock:
            self._waits[load.req_id] = stop
        self._waiter.submit(self._await_load, load, stop)

    def _await_load(self, load: RequestLoad, stop: threading.Event) -> None:
        """Waiter thread: scatters each chunk of ``load`` as it lands. The request's blocks
        are its own until it is reported finished, so this writes them while vLLM's forwards
        use others. The chunks are read into fresh buffers, not the forward thread's arena.
        Chunks that did not land (or were corrupt) are reported as failed blocks before the
        request is reported finished, as vLLM requires."""
        keys = [self._rank_key(c.key) for c in load.chunks]
        loaded = 0

        def land(start: int, end: int) -> int:
            nonlocal loaded
            tensors = self.io.get(keys[start:end])
            good = []
            for chunk, kv in zip(load.chunks[start:end], tensors, strict=True):
                if not self._valid(kv, chunk.num_tokens):
                    break
                good.append((chunk, kv))
            self._scatter_all(good, load.block_ids)  # type: ignore[arg-type]
            loaded += len(good)
            return len(good)

        with tracing.continued(load.trace):
            self.io.load_as_landed(keys, load.wait_ms, land, stop.is_set)
        with self._lock:
            if loaded < len(load.chunks) and not stop.is_set():
                self._failed_blocks.update(self._blocks_from(load, loaded))
                log.warning(
                    "pdserve chunk %d of %s %s: recomputing from it",
                    loaded,
                    load.req_id,
                    f"did not land in {load.wait_ms} ms" if load.wait_ms else "missing or corrupt",
                )
            del self._waits[load.req_id]
            self._landed.add(load.req_id)

    def _blocks_from(self, load: RequestLoad, index: int) -> list[int]:
        """The blocks ``load`` fills from its chunk ``index`` on (recomputed on a failure)."""
        bs = self.block_size
        chunk = load.chunks[index]
        first = max(chunk.start, chunk.skip_before) // bs
        last = (load.chunks[-1].stop + bs - 1) // bs
        return load.block_ids[first:last]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The asynchronous loads that ended since the last call; a finished (aborted)
        request's wait is stopped, and reported here once its thread has let go of its
        blocks (vLLM frees them then)."""
        with self._lock:
            for req_id in finished_req_ids:
                stop = self._waits.get(req_id)
                if stop is not None:
                    stop.set()
            landed, self._landed = self._landed, set()
        return None, landed or None

    def _load_request(self, load: RequestLoad) -> None:
        bs = self.block_size
        with tracing.continued(load.trace):
            tensors = self.io.get(
                [self._rank_key(c.key) for c in load.chunks], arena=self._arena_for(load)
            )
        loaded: list[tuple[ChunkLoad, torch.Tensor]] = []
        for i, (chunk, kv) in enumerate(zip(load.chunks, tensors, strict=True)):
            if not self._valid(kv, chunk.num_tokens):
                first = max(chunk.start, chunk.skip_before) // bs
                with self._lock:
                    self._failed_blocks.update(self._blocks_from(load, i))
                log.warning(
                    "pdserve chunk %d of %s missing or corrupt: recomputing from token %d",
                    i,
                    load.req_id,
                    first * bs,
                )
                break
            assert kv is not None
            loaded.append((chunk, kv))
        self._scatter_all(loaded, load.block_ids)

    def _arena_for(self, load: RequestLoad) -> memoryview:
        """The reusable read buffer, grown to hold every chunk of ``load`` (the chunks are
        scattered into the paged cache before the next load reuses it)."""
        cache = self._caches[0]
        layers, heads, dim = len(self._caches), cache.shape[1], self._layout.head_dim
        need = sum(
            encoded_size((layers, 2, heads, c.num_tokens, dim), cache.dtype, self.fp.kv_compression)
            for c in load.chunks
        )
        if len(self._arena) < need:
            self._arena = bytearray(need)
            self._arena_tensor = torch.frombuffer(self._arena, dtype=torch.uint8)
        return memoryview(self._arena)

    def _valid(self, kv: torch.Tensor | None, num_tokens: int) -> bool:
        if kv is None or not self._caches:
            return False
        heads, dim = self._caches[0].shape[1], self._layout.head_dim
        expected = (len(self._caches), 2, heads, num_tokens, dim)
        return tuple(kv.shape) == expected and kv.dtype == self._caches[0].dtype

    def _scatter_all(
        self, loaded: list[tuple[ChunkLoad, torch.Tensor]], block_ids: list[int]
    ) -> None:
        """Writes loaded chunks into their paged blocks. Chunks written whole go in one
        indexed copy per layer and K/V for all of them (per-block copies cost more in call
        overhead than in bytes: 3,840 of them for a 2k-token prompt); the partial blocks at
        the edges (local-cache overlap, the last prompt token) one by one."""
        bs = self.block_size
        whole: dict[tuple[int, ...], list[tuple[ChunkLoad, torch.Tensor]]] = {}
        for chunk, kv in loaded:
            begin, end = max(chunk.start, chunk.skip_before), chunk.stop
            whole_blocks = chunk.num_tokens % bs == 0  # not a request's partial tail
            if whole_blocks and begin == chunk.start and end == chunk.start + chunk.num_tokens:
                whole.setdefault(tuple(kv.shape), []).append((chunk, kv))
            else:
                self._scatter(kv, chunk, block_ids)
        for shape, group in whole.items():
            per = shape[3] // bs  # blocks per chunk (chunk sizes are multiples of bs)
            src = self._stacked([kv for _, kv in group])  # [n, L, 2, H, t, D]
            idx = torch.tensor(
                [[block_ids[c.start // bs + j] for j in range(per)] for c, _ in group],
                device=self._caches[0].device,
            )
            layout = self._layout
            for layer, cache in enumerate(self._caches):
                for part, view in enumerate(layout.views(cache)):
                    # [n, H, t, D] -> [n, per, H, bs, D] in the layout's axes, a view: one
                    # index_put per layer and part
                    blocks = src[:, layer, part].unflatten(2, (per, bs)).transpose(1, 2)
                    view[idx] = layout.factor(blocks, part).to(cache.device)

    def _stacked(self, kvs: list[torch.Tensor]) -> torch.Tensor:
        """``torch.stack(kvs)``, without the copy when the chunks lie evenly spaced in the
        read arena (as the store client reads them): a strided view of it."""
        first = kvs[0]
        base = self._arena_tensor
        esize = first.element_size()
        start = base.data_ptr()
        offsets = [kv.data_ptr() - start for kv in kvs]
        step = offsets[1] - offsets[0] if len(kvs) > 1 else 0
        if (
            len(kvs) > 1
            and step > 0
            and offsets[0] >= 0
            and offsets[0] % esize == 0
            and step % esize == 0
            and offsets[-1] + first.nbytes <= base.numel()
            and len(base) % esize == 0
            and all(kv.is_contiguous() for kv in kvs)
            and all(o == offsets[0] + i * step for i, o in enumerate(offsets))
        ):
            return base.view(first.dtype).as_strided(
                (len(kvs), *first.shape),
                (step // esize, *first.stride()),
                offsets[0] // esize,
            )
        return torch.stack(kvs)

    def _scatter(self, kv: torch.Tensor, chunk: ChunkLoad, block_ids: list[int]) -> None:
        """Writes the positions ``[max(start, skip_before), stop)`` of one chunk, block by
        block. A block written in part is read, patched and written back whole (a layout may
        interleave neighbouring tokens); its other positions are recomputed by vLLM later."""
        bs = self.block_size
        begin, end = max(chunk.start, chunk.skip_before), chunk.stop
        for b in range(begin // bs, (end + bs - 1) // bs):
            lo, hi = max(b * bs, begin), min((b + 1) * bs, end)
            src = kv[:, :, :, lo - chunk.start : hi - chunk.start, :]  # [L, 2, H, t, D]
            for layer, cache in enumerate(self._caches):
                ids = torch.tensor([block_ids[b]], device=cache.device)
                block = self._layout.gather(cache, ids)  # [1, 2, H, bs, D]
                block[0, :, :, lo - b * bs : hi - b * bs] = src[layer]
                self._layout.scatter(cache, ids, block)

    def wait_for_save(self, meta: PdserveConnectorMetadata) -> None:
        """After the step's forward: gathers the step's saves into fresh host tensors and
        writes them: those a reader awaits now, the others on the background writer."""
        if not meta.saves or self.off_reason or not self.io.available():
            return
        # one batched put per TTL (prompt chunks; request tails) and per way of writing: two
        # master round trips per put whatever the chunk count, existing keys skipped by the
        # master, no pre-check
        puts: dict[tuple[int, bool], list[tuple[str, torch.Tensor]]] = {}
        for save, kv in zip(meta.saves, self._gather_all(meta.saves), strict=True):
            now = save.awaited or self._writer is None
            puts.setdefault((save.ttl_ms, now), []).append((self._rank_key(save.key), kv))
        # KV events describe the chain (rank 0's keys: H(parent || tokens)); other ranks' keys
        # are derived, not chained, and carry none
        chain = {
            s.key: ChunkMeta(
                s.parent,
                s.tokens,
                s.num_tokens,
                engine_hashes=s.engine_hashes,
                engine_parent=s.engine_parent,
                engine_block_size=s.engine_block_size,
            )
            for s in meta.saves
            if s.tokens and self.rank_fp.tp_rank == 0
        }
        # the master tags each chunk with its request's chain root (a salt's, an adapter's)
        roots = {self._rank_key(s.key): s.root for s in meta.saves if s.root}
        tenants = {s.root: s.tenant for s in meta.saves if s.root and s.tenant}
        # in the trace of the step's first traced request (a batch serves them all)
        trace = meta.save_traces[0] if meta.save_traces else None

        def put(items: list[tuple[str, torch.Tensor]], ttl_ms: int) -> None:
            with tracing.continued(trace):  # a chunk not saved: a future miss
                self.io.save(items, ttl_ms=ttl_ms, meta=chain, roots=roots, tenants=tenants)

        for (ttl_ms, now), items in puts.items():
            if now:
                put(items, ttl_ms)
            else:
                assert self._writer is not None
                nbytes = sum(kv.numel() * kv.element_size() for _key, kv in items)
                self._writer.submit(nbytes, lambda items=items, ttl_ms=ttl_ms: put(items, ttl_ms))

    def drain_saves(self, timeout: float | None = None) -> bool:
        """Waits until the background writer has written every queued save (True at once
        without one); False when ``timeout`` passed first."""
        return self._writer is None or self._writer.drain(timeout)

    def _gather_all(self, saves: list[ChunkSave]) -> list[torch.Tensor]:
        """Each save's KV ``[layers, 2, kv_heads, tokens, head_dim]``. The full chunks of a
        step are gathered together (:meth:`_gather_blocks`: one indexed copy per layer and K
        or V for all of them; one chunk at a time cost about 1.2 ms each for SmolLM2's 30
        layers, a 512-token prompt's 16 chunks about 20 ms inside the step, together about
        4.5 ms); a partial tail alone."""
        bpc, cs = self.blocks_per_chunk, self.chunk_size
        full = [i for i, s in enumerate(saves) if s.num_tokens == cs and len(s.block_ids) >= bpc]
        out: list[torch.Tensor | None] = [None] * len(saves)
        if full:
            together = self._gather_blocks([saves[i].block_ids[:bpc] for i in full])
            for j, i in enumerate(full):
                out[i] = together[j]
        return [kv if kv is not None else self._gather(s) for kv, s in zip(out, saves, strict=True)]

    def _gather(self, save: ChunkSave) -> torch.Tensor:
        """One save's KV ``[layers, 2, kv_heads, num_tokens, head_dim]``, contiguous."""
        nblocks = (save.num_tokens + self.block_size - 1) // self.block_size
        kv = self._gather_blocks([save.block_ids[:nblocks]])[0]
        return kv[:, :, :, : save.num_tokens].contiguous()

    def _gather_blocks(self, block_lists: list[list[int]]) -> torch.Tensor:
        """The KV of each list of blocks (all of one length ``nb``), in the chunk layout:
        ``[lists, layers, 2, kv_heads, nb * block_size, head_dim]``, one indexed copy per
        layer and K or V for all the lists, each list's slice contiguous."""
        n, nb = len(block_lists), len(block_lists[0])
        layout, first = self._layout, self._caches[0]
        heads, bs, dim = first.shape[1], self.block_size, layout.head_dim
        ids = [b for blocks in block_lists for b in blocks]
        index = torch.tensor(ids, dtype=torch.long, device=first.device)
        # on the host: the store reads and writes host memory
        out = torch.empty((n, len(self._caches), 2, heads, nb * bs, dim), dtype=first.dtype)
        for layer, cache in enumerate(self._caches):
            for half, view in enumerate(layout.views(cache)):
                blocks = view.index_select(0, index)  # [n * nb, H, t_hi, t_lo, d_hi, d_lo]
                dst = out[:, layer, half].view(n, heads, nb, bs, dim).transpose(1, 2)
                layout.factor(dst, half).copy_(blocks.view(n, nb, *blocks.shape[1:]))
        return out

    def _rank_key(self, key: str) -> str:
        """Where this worker's TP rank keeps its share of the chunk rank 0 keeps at ``key``."""
        return hashing.rank_key(key, self.rank_fp)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        with self._lock:
            for stop in self._waits.values():
                stop.set()
        if self._waiter is not None:
            self._waiter.shutdown(wait=True, cancel_futures=True)
        if self._writer is not None and not self._writer.close():
            log.warning("pdserve KV saves still queued at shutdown were dropped (future misses)")
