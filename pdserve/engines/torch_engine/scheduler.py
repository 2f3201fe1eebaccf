"""The torch engine's scheduler: the one thread that owns the model, and the jobs it runs.

- Jobs arrive on a queue. A prefill job runs to completion as soon as the thread sees it.
- A generation joins the running set (at most ``max_num_seqs``; the rest wait in FIFO order)
  once it is queued (its KV handle's chunks already fetched by the engine's loader thread);
  its prompt KV is then built from them, or computed. The thread advances every running
  generation by one token per round (step-wise interleaving, batch size 1 per forward). This
  is fair continuous scheduling, not batched compute: a long prefill pauses the running
  generations while it runs.
- A cancelled generation (its async iterator closed) is dropped at the next round and its
  KV freed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve import tenants, tracing
from pdserve.engines import metrics
from pdserve.engines.base import PrefillOutcome, TokenEvent, next_text, text_stream
from pdserve.engines.config import EngineConfig
from pdserve.engines.textstream import TextStream
from pdserve.engines.torch_engine.kv import PromptKV
from pdserve.engines.torch_engine.model import TorchModel
from pdserve.engines.torch_engine.sampler import sample_token, token_logprob
from pdserve.errors import Unavailable
from pdserve.requests import KVRef, Sampling

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    request_id: str
    tokens: list[int]
    sampling: Sampling
    publish: bool
    future: concurrent.futures.Future
    cache_salt: str = ""
    #: Neither load from nor save to the store (Engine.prefill).
    bypass_store: bool = False
    #: The request's trace (W3C headers, taken where the job is made): its store spans'.
    trace: dict[str, str] = field(default_factory=tracing.headers)
    #: The request's tenant (taken where the job is made): its saved chunks' KVNamespace.tenant.
    tenant: str = field(default_factory=tenants.current.get)


@dataclass
class GenJob:
    request_id: str
    tokens: list[int]
    sampling: Sampling
    kv: KVRef | None
    first_token: int | None
    chunk_wait_ms: int
    deliver: Callable[[Any], None]
    t0: float
    seed: int
    cache_salt: str = ""
    #: Neither load from nor save to the store (Engine.generate; the engine drops ``kv``).
    bypass_store: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: The handle's chunks (and tail) as the loader thread got them (``PromptKV.fetch``);
    #: None when there is no handle or it does not match the prompt.
    fetched: list[torch.Tensor | None] | None = None
    cache: Any = None
    out_ids: list[int] = field(default_factory=list)
    #: Prompt tokens loaded from the store / computed here, reported with the last token.
    loaded: int = 0
    #: The request's trace (W3C headers, taken where the job is made): its store spans'.
    trace: dict[str, str] = field(default_factory=tracing.headers)
    #: The request's tenant (taken where the job is made): its saved chunks' KVNamespace.tenant.
    tenant: str = field(default_factory=tenants.current.get)
    recomputed: int = 0
    stream: TextStream | None = None
    last_token: int = -1
    done: bool = False


_STOP = object()


class Scheduler:
    """See the module docstring. ``submit`` from any thread; ``start`` and ``stop`` (blocking:
    it fails every job still queued or running with UNAVAILABLE) from the engine."""

    def __init__(self, cfg: EngineConfig, model: TorchModel, kv: PromptKV) -> None:
        self.cfg = cfg
        self.model = model
        self.kv = kv
        self.queue: queue.Queue = queue.Queue()
        self.waiting: collections.deque[GenJob] = collections.deque()
        self.running: list[GenJob] = []
        self.busy_prefill = 0
        #: Prompt tokens of the prefill running now (its KV is held while it runs).
        self.prefill_tokens = 0
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def submit(self, job: PrefillJob | GenJob) -> None:
        self.queue.put(job)

    def held_tokens(self) -> int:
        """Tokens whose KV the thread holds now: every running generation's context (prompt
        and output so far) and the prompt of the prefill in progress. Read from other threads
        while the model's thread changes the running set: a snapshot."""
        tokens = sum(len(j.tokens) + len(j.out_ids) for j in list(self.running))
        return tokens + self.prefill_tokens

    # ----------------------------------------------------------------- the thread

    def _worker(self) -> None:
        torch.set_num_threads(self.cfg.torch_threads)
        with torch.inference_mode():
            while True:
                block = not self.running and not self.waiting
                try:
                    item = self.queue.get(block=block)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    self._shutdown()
                    return
                if isinstance(item, PrefillJob):
                    self._run_prefill(item)
                elif isinstance(item, GenJob):
                    self.waiting.append(item)
                self._admit()
                self._step_all()

    def _shutdown(self) -> None:
        err = Unavailable("the engine is shutting down")
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, PrefillJob):
                item.future.set_exception(err)
            elif isinstance(item, GenJob):
                self.waiting.append(item)
        for job in [*self.running, *self.waiting]:
            job.deliver(err)
        self.running.clear()
        self.waiting.clear()

    # ----------------------------------------------------------------- prefill

    def _run_prefill(self, job: PrefillJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        self.busy_prefill = 1
        self.prefill_tokens = len(job.tokens)
        try:
            with tracing.continued(job.trace):
                job.future.set_result(self._prefill(job))
        except BaseException as exc:
            log.exception("prefill %s failed", job.request_id)
            job.future.set_exception(exc)
        finally:
            self.busy_prefill = 0
            self.prefill_tokens = 0

    def _prefill(self, job: PrefillJob) -> PrefillOutcome:
        tokens = job.tokens
        _cache, logits, cached, computed = self.kv.compute(
            job.request_id,
            tokens,
            job.cache_salt,
            write_tail=True,
            publish=job.publish,
            phase="prefill",
            bypass_store=job.bypass_store,
            tenant=job.tenant,
        )
        seed = job.sampling.seed if job.sampling.seed is not None else random.getrandbits(63)
        first = sample_token(
            logits, job.sampling, seed, 0, prompt=tokens, eos_token_id=self.model.eos_token_id
        )
        lp = None
        if job.sampling.logprobs is not None:
            lp = token_logprob(logits, first, job.sampling.logprobs)
        kv = self.kv.handle(tokens, job.request_id, job.cache_salt)
        return PrefillOutcome(first, kv, cached, computed, first == self.model.eos_token_id, lp)

    # ----------------------------------------------------------------- generations

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.resolved_max_num_seqs():
            job = self.waiting.popleft()
            if job.cancelled.is_set():
                continue
            try:
                with tracing.continued(job.trace):
                    self._start_generation(job)
            except BaseException as exc:
                log.exception("generation %s failed to start", job.request_id)
                job.deliver(exc)
                continue
            if not job.done:
                self.running.append(job)

    def _step_all(self) -> None:
        for job in list(self.running):
            if job.cancelled.is_set() or job.done:
                self.running.remove(job)
                job.cache = None
                continue
            try:
                logits = self.model.forward([job.last_token], job.cache)
                token = sample_token(
                    logits,
                    job.sampling,
                    job.seed,
                    len(job.out_ids),
                    prompt=job.tokens,
                    output=job.out_ids,
                    eos_token_id=self.model.eos_token_id,
                )
                self._emit(job, token, logits)
            except BaseException as exc:
                log.exception("generation %s failed", job.request_id)
                job.deliver(exc)
                job.done = True
            if job.done:
                self.running.remove(job)
                job.cache = None

    def _start_generation(self, job: GenJob) -> None:
        """Builds the prompt KV (from the handle, else by local prefill) and emits the first
        token: the prefill's ``first_token`` when given, else one sampled here."""
        tokens = job.tokens
        n = len(tokens)
        job.stream = text_stream(self.model.decode_text, job.sampling)
        if job.kv is not None:
            job.cache, loaded = self.kv.cache_from_handle(job.kv, tokens, job.fetched)
            job.fetched = None
            if job.first_token is None:
                # write mode: the handle covers a prefix; the last token is computed for logits
                loaded = min(loaded, n - 1)
                job.cache = self.model.truncated(job.cache, loaded)
            logits = self.model.forward(tokens[loaded:], job.cache) if loaded < n else None
            recomputed = n - loaded
            if recomputed:
                metrics.KV_COMPUTED_TOKENS.labels("kv_miss").inc(recomputed)
        else:
            job.cache, logits, loaded, recomputed = self.kv.compute(
                job.request_id,
                tokens,
                job.cache_salt,
                write_tail=False,
                publish=False,
                phase="decode",
                bypass_store=job.bypass_store,
                tenant=job.tenant,
            )
        if job.first_token is not None:
            first = job.first_token
            logits = None  # prefill's token: its logprobs are prefill's
        else:
            assert logits is not None
            first = sample_token(
                logits,
                job.sampling,
                job.seed,
                0,
                prompt=tokens,
                eos_token_id=self.model.eos_token_id,
            )
        job.loaded, job.recomputed = loaded, recomputed
        self._emit(job, first, logits)

    def _emit(self, job: GenJob, token: int, logits: torch.Tensor | None = None) -> None:
        """Delivers one token; the last one carries the prompt counts (TokenEvent's contract).
        ``logits``: those it was sampled from, for its logprobs (None: prefill's token)."""
        assert job.stream is not None
        logprobs = []
        if logits is not None and job.sampling.logprobs is not None:
            logprobs = [token_logprob(logits, token, job.sampling.logprobs)]
        job.out_ids.append(token)
        job.last_token = token
        metrics.GENERATED_TOKENS.inc()
        text, finish = next_text(
            job.stream,
            token,
            len(job.out_ids),
            job.sampling,
            self.model.eos_token_id,
            context_full=len(job.tokens) + len(job.out_ids) >= self.model.max_model_len,
        )
        job.done = finish is not None
        job.deliver(
            TokenEvent(
                token_ids=[token],
                text=text,
                times_ms=[(time.monotonic() - job.t0) * 1000.0],
                finish=finish,
                loaded_tokens=job.loaded if job.done else 0,
                recomputed_tokens=job.recomputed if job.done else 0,
                logprobs=logprobs,
            )
        )
