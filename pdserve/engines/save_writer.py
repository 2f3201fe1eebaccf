"""Chunk saves written off the engine step (:class:`SaveWriter`; on with the engine's
``store_save_queue_mib`` > 0, a stock engine's ``save_queue_mib``; by default on a GPU, 256
MiB, and off on a CPU, where the writer would share the engine's one core: a colocated
request's chunks are then in the store by the time it answers).

After a step's forward the connector gathers the KV of the chunks the step completed into
fresh host tensors (the copy is the only part that must happen before vLLM may reuse the
blocks) and hands the store writes to one background thread, so the next forward does not
wait on the store's round trips, its encoding or its copy into the storage node. Writes keep
their order (one thread, first in first out: a chain's parent is put before its children).

The queue is bounded in bytes: a step whose saves would pass the bound waits until the writer
has made room, so a store slower than the engine slows the engine rather than filling memory
(counted in ``pdserve_kv_save_queue_waits_total``). A write that fails is a future miss, as a
failed save always was (:class:`pdserve.engines.chunk_io.ChunkIO` logs and backs off).

Saves that a reader awaits as soon as the request answers (a P/D prefill's chunks and tail:
the decode worker loads them next) are not queued: the connector writes them inside the step,
so the answer still means every chunk is in the store.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from pdserve.engines import metrics

log = logging.getLogger(__name__)


class SaveWriter:
    """One writer thread with a queue of at most ``max_bytes`` pending (a single write
    larger than that is still taken, alone)."""

    def __init__(self, max_bytes: int, name: str = "pdserve-kv-save") -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._name = name
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, Callable[[], object]]] = collections.deque()
        self._pending = 0  # bytes queued or being written
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._pending

    def submit(self, nbytes: int, write: Callable[[], object]) -> None:
        """Queues ``write`` (``nbytes`` of chunks), first waiting while the queue is too full
        to take it; runs it here when the writer is closed."""
        with self._cond:
            if self._closed:
                run_now = True
            else:
                run_now = False
                if self._pending and self._pending + nbytes > self.max_bytes:
                    metrics.KV_SAVE_QUEUE_WAITS.inc()
                    self._cond.wait_for(
                        lambda: not self._pending or self._pending + nbytes <= self.max_bytes
                    )
                self._queue.append((nbytes, write))
                self._pending += nbytes
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        if run_now:
            _run_one(write)

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every queued write is done; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Writes what is queued (up to ``timeout`` seconds) and stops the thread; later
        submits run in the caller. False when writes were still pending at the timeout."""
        done = self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout if done else 0.1)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and empty
                nbytes, write = self._queue.popleft()
            _run_one(write)
            with self._cond:
                self._pending -= nbytes
                self._cond.notify_all()


def _run_one(write: Callable[[], object]) -> None:
    try:
        write()
    except Exception:  # a write's own errors are ChunkIO's to handle; never kill the thread
        log.exception("pdserve KV save failed in the background writer")
