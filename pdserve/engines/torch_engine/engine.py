"""The reference engine: a Hugging Face transformers causal LM in fp32 on the CPU.

It is small and exact rather than fast: the ground truth of the tests and the engine of
machines without vLLM. It reads and writes the same canonical KV chunks as the vLLM engine.
Its parts, one file each: the model runner (:mod:`.model`), the sampler (:mod:`.sampler`), a
prompt's KV through the store (:mod:`.kv`), and the one thread that runs the model
(:mod:`.scheduler`); nothing runs on the event loop.

A generation with a KV handle first gets its chunks from the store on a KV loader thread, not
on the model's thread: in write mode that includes waiting for chunks a parallel prefill is
still publishing (:mod:`pdserve.engines.chunk_wait`, up to ``chunk_wait_ms`` per chunk), so
the running generations keep decoding meanwhile. Only then is it queued for the model's
thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections.abc import AsyncIterator, Sequence

from pdserve import tracing
from pdserve.engines.base import Engine, EngineLoad, PrefillOutcome, TokenEvent
from pdserve.engines.chunk_io import ChunkIO, ChunkStore
from pdserve.engines.config import EngineConfig
from pdserve.engines.torch_engine.kv import PromptKV
from pdserve.engines.torch_engine.model import TorchModel
from pdserve.engines.torch_engine.sampler import refuse_constrained
from pdserve.engines.torch_engine.scheduler import GenJob, PrefillJob, Scheduler
from pdserve.errors import InvalidArgument, Unavailable
from pdserve.model.fingerprint import model_fingerprint
from pdserve.requests import KVRef, Sampling


class TorchEngine(Engine):
    """See the module docstring. ``store``: a synchronous, thread-safe store
    (:class:`pdserve.engines.chunk_io.ChunkStore`: the store client, or the in-memory backend)
    or None for no store, reached through :class:`ChunkIO` once the model (and so the
    fingerprint) is loaded; ``owns_store``: close it with the engine. ``model``, ``kv`` and
    ``scheduler`` (the parts) exist once started."""

    def __init__(
        self, cfg: EngineConfig, store: ChunkStore | None = None, *, owns_store: bool = False
    ) -> None:
        self.cfg = cfg
        self._store_at_start = store
        self._owns_store = owns_store
        self.model: TorchModel
        self.kv: PromptKV | None = None
        self.scheduler: Scheduler | None = None
        # KV handle loads, write mode's waits included: one thread per running generation
        self._loader = concurrent.futures.ThreadPoolExecutor(
            max(4, cfg.resolved_max_num_seqs()), thread_name_prefix="torch-kv-load"
        )
        self._closed = threading.Event()

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.cfg
        self.model = model = await asyncio.to_thread(TorchModel.load, cfg)
        self.vocab_size = model.vocab_size
        self.max_model_len = model.max_model_len
        self.eos_token_id = model.eos_token_id
        self.served_model_name = cfg.served_name()
        self.fingerprint = model_fingerprint(
            model.path,
            self.served_model_name,
            cfg.resolved_kv_dtype(),
            cfg.chunk_size,
            cfg.resolved_kv_compression(),
        )
        self.kv = PromptKV(cfg, model, self.fingerprint)
        self.kv.attach(self._store_at_start)
        # the capacity load() measures against: max_num_seqs contexts of max_model_len
        self._kv_capacity_bytes = (
            cfg.resolved_max_num_seqs() * self.max_model_len * model.kv_token_bytes
        )
        self.scheduler = Scheduler(cfg, model, self.kv)
        self.scheduler.start()

    async def close(self) -> None:
        self._closed.set()
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
            self.scheduler = None
        if self._owns_store and self.chunks is not None:
            self.chunks.close()
        if self.kv is not None:
            self.kv.chunks = None

    @property
    def chunks(self) -> ChunkIO | None:
        """The store seam (None: no store, or not started)."""
        return self.kv.chunks if self.kv is not None else None

    def attach_store(self, store: ChunkStore | None) -> None:
        """Reads and writes chunks through ``store`` from now on (None: no store), with a
        fresh failure backoff. The engine must be started."""
        assert self.kv is not None, "attach_store needs a started engine"
        self.kv.attach(store)

    # ----------------------------------------------------------------- public API

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special_tokens=add_special_tokens)

    def decode_text(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.model.decode_text(token_ids, skip_special_tokens)

    def load(self) -> EngineLoad:
        s = self.scheduler
        if s is None:
            return EngineLoad(queue_length=0, running_requests=0, kv_usage=0.0)
        return EngineLoad(
            queue_length=s.queue.qsize() + len(s.waiting),
            running_requests=len(s.running) + s.busy_prefill,
            kv_usage=self.kv_bytes() / self._kv_capacity_bytes,
        )

    def kv_bytes(self) -> int:
        """Bytes of KV the engine holds now (:meth:`Scheduler.held_tokens`), at most the
        capacity."""
        held = self.scheduler.held_tokens() if self.scheduler is not None else 0
        return min(self._kv_capacity_bytes, held * self.model.kv_token_bytes)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        *,
        publish_incrementally: bool = False,
        cache_salt: str = "",
        bypass_store: bool = False,
        priority: int = 0,  # arrival order here (Engine.prefill)
    ) -> PrefillOutcome:
        scheduler = self._require_started()
        tokens = list(prompt_token_ids)
        sampling.validate(self.cfg.resolved_max_tokens_limit(self.max_model_len))
        self.check_prompt(tokens, sampling)
        refuse_constrained(sampling)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        scheduler.submit(
            PrefillJob(
                request_id, tokens, sampling, publish_incrementally, fut, cache_salt, bypass_store
            )
        )
        return await asyncio.wrap_future(fut)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        *,
        kv: KVRef | None = None,
        first_token_id: int | None = None,
        chunk_wait_ms: int = 0,
        cache_salt: str = "",
        bypass_store: bool = False,
        priority: int = 0,  # arrival order here (Engine.prefill)
    ) -> AsyncIterator[TokenEvent]:
        """Emits every output token, the prefill's ``first_token_id`` included (first). A
        ``kv`` handle's chunks are got (in write mode: waited for) on a loader thread before
        the generation is queued for the model's thread; ``bypass_store`` drops the handle
        (the prompt is computed here, nothing saved)."""
        self._require_started()
        tokens = list(prompt_token_ids)
        sampling.validate(self.cfg.resolved_max_tokens_limit(self.max_model_len))
        self.check_prompt(tokens, sampling)
        refuse_constrained(sampling)
        if first_token_id is not None and not 0 <= first_token_id < self.vocab_size:
            raise InvalidArgument(
                f"first_token_id {first_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        if bypass_store:
            kv = None
        job = GenJob(
            request_id,
            tokens,
            sampling,
            kv,
            first_token_id,
            chunk_wait_ms,
            lambda item: loop.call_soon_threadsafe(events.put_nowait, item),
            time.monotonic(),
            seed,
            cache_salt,
            bypass_store,
        )
        try:
            if kv is not None:
                await loop.run_in_executor(self._loader, self._fetch_handle, job)
            self._require_started().submit(job)
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish is not None:
                    return
        finally:
            job.cancelled.set()

    def _require_started(self) -> Scheduler:
        if self.scheduler is None:
            raise Unavailable("the engine is not started (or already closed)")
        return self.scheduler

    def _fetch_handle(self, job: GenJob) -> None:
        """Loader thread: gets the handle's chunks into ``job.fetched``, waiting up to
        ``chunk_wait_ms`` for each one still landing (write mode)."""
        kv = self.kv
        assert kv is not None and job.kv is not None
        keys = kv.handle_keys(job.kv, job.tokens, job.cache_salt, job.request_id)
        if keys is None:
            return
        with tracing.continued(job.trace):
            job.fetched = kv.fetch(
                keys,
                job.chunk_wait_ms,
                lambda: job.cancelled.is_set() or self._closed.is_set(),
            )
