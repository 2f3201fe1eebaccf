"""The reference engine: a Hugging Face transformers causal LM in fp32 on the CPU.

It is small and exact rather than fast: the ground truth of the tests and the engine of
machines without vLLM. It reads and writes the same canonical KV chunks as the vLLM engine.

Scheduling (one dedicated worker thread owns the model; nothing runs on the event loop):

- Jobs arrive on a queue. A prefill job runs to completion as soon as the thread sees it.
- A generation with a KV handle first gets its chunks from the store on a KV loader thread
  (``_loader``), not on the model's thread: in write mode that includes waiting for chunks a
  parallel prefill is still publishing (:mod:`pdserve.engines.chunk_wait`, up to
  ``chunk_wait_ms`` per chunk), so the running generations keep decoding meanwhile. Only then
  is it queued for the model's thread.
- A generation joins the running set (at most ``max_num_seqs``; the rest wait in FIFO order)
  after its prompt KV is loaded or computed; the thread then advances every running
  generation by one token per round (step-wise interleaving, batch size 1 per forward). This
  is fair continuous scheduling, not batched compute: a long prefill pauses the running
  generations while it runs.
- A cancelled generation (its async iterator closed) is dropped at the next round and its
  KV freed.

KV chunks: the cache of positions ``[i * chunk_size, (i + 1) * chunk_size)`` is stored under
the i-th chain key (:func:`pdserve.hashing.chunk_keys`, salted with the request's cache salt;
the engine keeps no prefix cache of its own, so the store is its only reuse) as a canonical
``[layers, 2, kv_heads, tokens, head_dim]`` tensor, in the ``kv_compression`` encoding (read
back in ``kv_dtype``); the partial tail under a request-scoped key with a TTL. The store is
reached through :class:`pdserve.engines.chunk_io.ChunkIO`: any store failure (unreachable,
timeout, missing or corrupt chunk) degrades to recomputing those positions, counted in
:mod:`pdserve.engines.metrics`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve import hashing
from pdserve.engines import metrics
from pdserve.engines.base import (
    Engine,
    EngineLoad,
    KVRef,
    PrefillOutcome,
    Sampling,
    TokenEvent,
    TokenLogprob,
    next_text,
)
from pdserve.engines.chunk_io import ChunkIO, ChunkStore
from pdserve.engines.config import EngineConfig
from pdserve.engines.fingerprint import model_fingerprint
from pdserve.engines.textstream import TextStream
from pdserve.errors import InvalidArgument, Unavailable
from pdserve.store.api import ChunkMeta

log = logging.getLogger(__name__)

_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def process_logits(
    logits: torch.Tensor,
    sampling: Sampling,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> torch.Tensor:
    """``logits`` ([vocab]) after ``logit_bias`` and the penalties, in vLLM's order (its
    sampler: logit bias, then the repetition penalty over ``prompt`` and ``output`` tokens,
    then the frequency and presence penalties over the ``output`` tokens). Unchanged (the same
    tensor) when the sampling asks none."""
    if not sampling.penalized:
        return logits
    scores = logits.float().clone()
    vocab = scores.numel()
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], dtype=torch.long)
        scores.index_add_(0, ids, torch.tensor([b for _, b in sampling.logit_bias]))
    if sampling.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([*prompt, *output], dtype=torch.long)] = True
        r = sampling.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
    if (sampling.frequency_penalty or sampling.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].float()
        scores = scores - sampling.frequency_penalty * counts
        scores = scores - sampling.presence_penalty * (counts > 0).float()
    return scores


def sample_token(
    logits: torch.Tensor,
    sampling: Sampling,
    seed: int,
    step: int,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> int:
    """Picks the next token from last-position ``logits`` ([vocab]).

    First :func:`process_logits` (logit bias and penalties, given the ``prompt`` and the
    ``output`` tokens so far); then greedy when temperature is 0; otherwise temperature, top-k
    and top-p filtering, then a draw from a generator seeded by ``(seed, step)``, so a seeded
    request gives the same tokens whether or not its first token was sampled on another worker.
    """
    logits = process_logits(logits, sampling, prompt, output)
    if sampling.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = cum - sorted_probs > sampling.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log probability under the raw model distribution (log_softmax of the
    unprocessed ``logits``, vLLM's default ``logprobs_mode="raw_logprobs"``) and the ``top``
    most likely tokens, most likely first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), best)


def _refuse_constrained(sampling: Sampling) -> None:
    if sampling.constrained:
        field = "json_schema" if sampling.json_schema else "json_object"
        raise InvalidArgument(
            f"response_format ({field}): the torch engine has no guided decoding (structured "
            "outputs); serve with the vllm engine for JSON output",
            param="response_format",
        )


@dataclass
class _PrefillJob:
    request_id: str
    tokens: list[int]
    sampling: Sampling
    publish: bool
    future: concurrent.futures.Future
    cache_salt: str = ""


@dataclass
class _GenJob:
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
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: The handle's chunks (and tail) as the loader thread got them (``TorchEngine._fetch``);
    #: None when there is no handle or it does not match the prompt.
    fetched: list[torch.Tensor | None] | None = None
    cache: Any = None
    out_ids: list[int] = field(default_factory=list)
    #: Prompt tokens loaded from the store / computed here, reported with the last token.
    loaded: int = 0
    recomputed: int = 0
    stream: TextStream | None = None
    last_token: int = -1
    done: bool = False


_STOP = object()


class TorchEngine(Engine):
    """See the module docstring. ``store``: a synchronous, thread-safe store
    (:class:`pdserve.engines.chunk_io.ChunkStore`: the store client, or the in-memory backend)
    or None for no store, reached through :class:`ChunkIO` once the model (and so the
    fingerprint) is loaded; ``owns_store``: close it with the engine."""

    def __init__(
        self, cfg: EngineConfig, store: ChunkStore | None = None, *, owns_store: bool = False
    ) -> None:
        self.cfg = cfg
        self._store_at_start = store
        self.chunks: ChunkIO | None = None
        self._owns_store = owns_store
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._waiting: collections.deque[_GenJob] = collections.deque()
        self._running: list[_GenJob] = []
        self._busy_prefill = 0
        #: Prompt tokens of the prefill running now (its KV is held while it runs).
        self._prefill_tokens = 0
        self._kv_dtype = _KV_DTYPES[cfg.resolved_kv_dtype()]
        # KV handle loads, write mode's waits included: one thread per running generation
        self._loader = concurrent.futures.ThreadPoolExecutor(
            max(4, cfg.resolved_max_num_seqs()), thread_name_prefix="torch-kv-load"
        )
        self._closed = threading.Event()

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self._load_model)
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()

    def _load_model(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pdserve.model.prepare import resolve_model

        torch.set_num_threads(self.cfg.torch_threads)
        path = Path(resolve_model(self.cfg.model))
        self.model_path = path
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        self.model = model.eval()
        conf = model.config
        self.num_layers = conf.num_hidden_layers
        self.num_kv_heads = conf.num_key_value_heads
        self.head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // (
            conf.num_attention_heads
        )
        self.vocab_size = conf.vocab_size
        limit = conf.max_position_embeddings
        self.max_model_len = min(self.cfg.max_model_len or limit, limit)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = conf.eos_token_id[0] if isinstance(conf.eos_token_id, list) else conf.eos_token_id
        self.eos_token_id = int(eos)
        self.served_model_name = self.cfg.served_name()
        self.fingerprint = model_fingerprint(
            path,
            self.served_model_name,
            self.cfg.resolved_kv_dtype(),
            self.cfg.chunk_size,
            self.cfg.resolved_kv_compression(),
        )
        self._fp = self.fingerprint.digest()
        self.attach_store(self._store_at_start)
        # KV bytes per token as the model's DynamicCache holds it (float32 K and V per layer),
        # and the capacity load() measures against: max_num_seqs contexts of max_model_len
        self._kv_token_bytes = 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
        self._kv_capacity_bytes = (
            self.cfg.resolved_max_num_seqs() * self.max_model_len * self._kv_token_bytes
        )
        log.info(
            "torch engine: model %s from %s, %d layers, %d kv heads, head_dim %d, max_model_len %d",
            self.served_model_name,
            path,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.max_model_len,
        )

    async def close(self) -> None:
        self._closed.set()
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._queue.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._owns_store and self.chunks is not None:
            self.chunks.close()
        self.chunks = None

    # ----------------------------------------------------------------- public API

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def load(self) -> EngineLoad:
        return EngineLoad(
            queue_length=self._queue.qsize() + len(self._waiting),
            running_requests=len(self._running) + self._busy_prefill,
            kv_usage=self.kv_bytes() / self._kv_capacity_bytes if self._thread else 0.0,
        )

    def kv_bytes(self) -> int:
        """Bytes of KV the engine holds now: every running generation's context (prompt and
        output so far) and the prompt of the prefill in progress, at most the capacity. Read
        from the event loop while the model's thread changes the running set: a snapshot."""
        tokens = sum(len(j.tokens) + len(j.out_ids) for j in list(self._running))
        return min(self._kv_capacity_bytes, (tokens + self._prefill_tokens) * self._kv_token_bytes)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        *,
        publish_incrementally: bool = False,
        cache_salt: str = "",
    ) -> PrefillOutcome:
        self._require_started()
        tokens = list(prompt_token_ids)
        sampling.validate(self.cfg.resolved_max_tokens_limit(self.max_model_len))
        self.check_prompt(tokens, sampling)
        _refuse_constrained(sampling)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(
            _PrefillJob(request_id, tokens, sampling, publish_incrementally, fut, cache_salt)
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
    ) -> AsyncIterator[TokenEvent]:
        """Emits every output token, the prefill's ``first_token_id`` included (first). A
        ``kv`` handle's chunks are got (in write mode: waited for) on a loader thread before
        the generation is queued for the model's thread."""
        self._require_started()
        tokens = list(prompt_token_ids)
        sampling.validate(self.cfg.resolved_max_tokens_limit(self.max_model_len))
        self.check_prompt(tokens, sampling)
        _refuse_constrained(sampling)
        if first_token_id is not None and not 0 <= first_token_id < self.vocab_size:
            raise InvalidArgument(
                f"first_token_id {first_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        job = _GenJob(
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
        )
        try:
            if kv is not None:
                await loop.run_in_executor(self._loader, self._fetch_handle, job)
                self._require_started()
            self._queue.put(job)
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish is not None:
                    return
        finally:
            job.cancelled.set()

    def _require_started(self) -> None:
        if self._thread is None:
            raise Unavailable("the engine is not started (or already closed)")

    # ----------------------------------------------------------------- worker thread

    def _worker(self) -> None:
        torch.set_num_threads(self.cfg.torch_threads)
        with torch.inference_mode():
            while True:
                block = not self._running and not self._waiting
                try:
                    item = self._queue.get(block=block)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    self._shutdown()
                    return
                if isinstance(item, _PrefillJob):
                    self._run_prefill(item)
                elif isinstance(item, _GenJob):
                    self._waiting.append(item)
                self._admit()
                self._step_all()

    def _shutdown(self) -> None:
        err = Unavailable("the engine is shutting down")
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _PrefillJob):
                item.future.set_exception(err)
            elif isinstance(item, _GenJob):
                self._waiting.append(item)
        for job in [*self._running, *self._waiting]:
            job.deliver(err)
        self._running.clear()
        self._waiting.clear()

    def _run_prefill(self, job: _PrefillJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        self._busy_prefill = 1
        self._prefill_tokens = len(job.tokens)
        try:
            job.future.set_result(self._prefill(job))
        except BaseException as exc:
            log.exception("prefill %s failed", job.request_id)
            job.future.set_exception(exc)
        finally:
            self._busy_prefill = 0
            self._prefill_tokens = 0

    def _prefill(self, job: _PrefillJob) -> PrefillOutcome:
        tokens = job.tokens
        _cache, logits, cached, computed = self._compute_prompt(
            job.request_id,
            tokens,
            job.cache_salt,
            write_tail=True,
            publish=job.publish,
            phase="prefill",
        )
        seed = job.sampling.seed if job.sampling.seed is not None else random.getrandbits(63)
        first = sample_token(logits, job.sampling, seed, 0, prompt=tokens)
        lp = None
        if job.sampling.logprobs is not None:
            lp = token_logprob(logits, first, job.sampling.logprobs)
        kv = KVRef(
            chunk_keys=tuple(hashing.chunk_keys(self.fingerprint, tokens, job.cache_salt)),
            tail_key=hashing.tail_key(self.fingerprint, tokens, job.request_id, job.cache_salt),
            num_tokens=len(tokens),
            chunk_size=self.cfg.chunk_size,
            fingerprint=self._fp,
        )
        return PrefillOutcome(first, kv, cached, computed, first == self.eos_token_id, lp)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.cfg.resolved_max_num_seqs():
            job = self._waiting.popleft()
            if job.cancelled.is_set():
                continue
            try:
                self._start_generation(job)
            except BaseException as exc:
                log.exception("generation %s failed to start", job.request_id)
                job.deliver(exc)
                continue
            if not job.done:
                self._running.append(job)

    def _step_all(self) -> None:
        for job in list(self._running):
            if job.cancelled.is_set() or job.done:
                self._running.remove(job)
                job.cache = None
                continue
            try:
                logits = self._forward([job.last_token], job.cache)
                token = sample_token(
                    logits,
                    job.sampling,
                    job.seed,
                    len(job.out_ids),
                    prompt=job.tokens,
                    output=job.out_ids,
                )
                self._emit(job, token, logits)
            except BaseException as exc:
                log.exception("generation %s failed", job.request_id)
                job.deliver(exc)
                job.done = True
            if job.done:
                self._running.remove(job)
                job.cache = None

    def _start_generation(self, job: _GenJob) -> None:
        """Builds the prompt KV (from the handle, else by local prefill) and emits the first
        token: the prefill's ``first_token`` when given, else one sampled here."""
        tokens = job.tokens
        n = len(tokens)
        job.stream = TextStream(self.decode_text, job.sampling.stop)
        if job.kv is not None:
            job.cache, loaded = self._cache_from_handle(job)
            if job.first_token is None:
                # write mode: the handle covers a prefix; the last token is computed for logits
                loaded = min(loaded, n - 1)
                job.cache = self._truncated(job.cache, loaded)
            logits = self._forward(tokens[loaded:], job.cache) if loaded < n else None
            recomputed = n - loaded
            if recomputed:
                metrics.KV_COMPUTED_TOKENS.labels("kv_miss").inc(recomputed)
        else:
            job.cache, logits, loaded, recomputed = self._compute_prompt(
                job.request_id,
                tokens,
                job.cache_salt,
                write_tail=False,
                publish=False,
                phase="decode",
            )
        if job.first_token is not None:
            first = job.first_token
            logits = None  # prefill's token: its logprobs are prefill's
        else:
            assert logits is not None
            first = sample_token(logits, job.sampling, job.seed, 0, prompt=tokens)
        job.loaded, job.recomputed = loaded, recomputed
        self._emit(job, first, logits)

    def _emit(self, job: _GenJob, token: int, logits: torch.Tensor | None = None) -> None:
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
            self.eos_token_id,
            context_full=len(job.tokens) + len(job.out_ids) >= self.max_model_len,
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

    # ----------------------------------------------------------------- model and KV

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        """Runs ``ids`` after what ``cache`` holds; returns the last position's logits."""
        out = self.model(
            input_ids=torch.tensor([list(ids)], dtype=torch.long),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    def _chunk_of(self, cache: Any, start: int, end: int) -> torch.Tensor:
        """Canonical ``[layers, 2, kv_heads, end - start, head_dim]`` KV of positions
        ``[start, end)``."""
        kv = torch.stack(
            [
                torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
                for layer in cache.layers
            ]
        )
        return kv.to(self._kv_dtype).contiguous()

    def _cache_from_chunks(self, chunks: Sequence[torch.Tensor], num_tokens: int) -> Any:
        cache = self._new_cache()
        if not chunks or num_tokens == 0:
            return cache
        kv = torch.cat(list(chunks), dim=3)[:, :, :, :num_tokens].to(torch.float32)
        for i in range(self.num_layers):
            cache.update(kv[i, 0].unsqueeze(0).clone(), kv[i, 1].unsqueeze(0).clone(), i)
        return cache

    def _valid_chunk(self, kv: torch.Tensor | None, tokens: int) -> bool:
        return (
            kv is not None
            and kv.dtype == self._kv_dtype
            and tuple(kv.shape) == (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)
        )

    def _compute_prompt(
        self,
        request_id: str,
        tokens: list[int],
        cache_salt: str,
        *,
        write_tail: bool,
        publish: bool,
        phase: str,
    ) -> tuple[Any, torch.Tensor, int, int]:
        """Builds the prompt's KV: loads the longest cached chunk prefix of ``cache_salt``'s
        chain, computes the rest and writes new full chunks (and the tail when
        ``write_tail``). Returns the cache, the last position's logits, and the loaded and
        computed token counts."""
        cs = self.cfg.chunk_size
        n = len(tokens)
        keys = hashing.chunk_keys(self.fingerprint, tokens, cache_salt)
        chunks = self._load_prefix(keys)
        loaded = min(len(chunks) * cs, n - 1)  # the last token is always computed (logits)
        cache = self._cache_from_chunks(chunks, loaded)
        if loaded:
            metrics.KV_LOADED_TOKENS.labels(phase).inc(loaded)
        done_chunks = len(chunks)
        if publish:
            # write mode: compute chunk by chunk and publish each one as soon as it exists
            pos = loaded
            logits = None
            while pos < n:
                end = min(n, (pos // cs + 1) * cs)
                logits = self._forward(tokens[pos:end], cache)
                if end % cs == 0 and end // cs > done_chunks:
                    self._save_chunks(cache, keys, done_chunks, end // cs, tokens)
                    done_chunks = end // cs
                pos = end
            assert logits is not None
        else:
            logits = self._forward(tokens[loaded:], cache)
            self._save_chunks(cache, keys, done_chunks, len(keys), tokens)
        if write_tail and n % cs:
            tail = hashing.tail_key(self.fingerprint, tokens, request_id, cache_salt)
            self._save_tail(cache, tail, n)
        reason = "uncached" if phase == "prefill" else "local"
        metrics.KV_COMPUTED_TOKENS.labels(reason).inc(n - loaded)
        return cache, logits, loaded, n - loaded

    def _handle_keys(self, job: _GenJob) -> list[str] | None:
        """The store keys of ``job``'s KV handle, chunks then tail; None when the handle does
        not belong to this prompt, model and cache salt (it is then ignored rather than
        trusted). The handle covers the whole prompt (read mode: full chunks plus the tail) or
        a chunk-aligned prefix of it (write mode, no tail)."""
        kv, tokens = job.kv, job.tokens
        assert kv is not None
        cs = self.cfg.chunk_size
        n = len(tokens)
        expected = hashing.chunk_keys(self.fingerprint, tokens, job.cache_salt)
        k = len(kv.chunk_keys)
        covered = n if kv.tail_key else k * cs
        if (
            kv.fingerprint != self._fp
            or kv.chunk_size != cs
            or list(kv.chunk_keys) != expected[:k]
            or kv.num_tokens != covered
            or covered > n
            or (kv.tail_key and (k != n // cs or n % cs == 0))
        ):
            log.warning(
                "request %s: KV handle does not match prompt/model; recomputing", job.request_id
            )
            metrics.KV_CHUNK_MISSES.labels("handle").inc()
            return None
        return list(kv.chunk_keys) + ([kv.tail_key] if kv.tail_key else [])

    def _fetch_handle(self, job: _GenJob) -> None:
        """Loader thread: gets the handle's chunks into ``job.fetched``, waiting up to
        ``chunk_wait_ms`` for each one still landing (write mode)."""
        keys = self._handle_keys(job)
        if keys is None:
            return
        job.fetched = self._fetch(
            keys,
            job.chunk_wait_ms,
            lambda: job.cancelled.is_set() or self._closed.is_set(),
        )

    def _cache_from_handle(self, job: _GenJob) -> tuple[Any, int]:
        """Builds the cache from the chunks the loader thread got; returns it and how many
        leading prompt tokens it holds (the rest must be computed)."""
        kv, tokens = job.kv, job.tokens
        assert kv is not None
        if job.fetched is None:
            return self._new_cache(), 0
        cs = self.cfg.chunk_size
        n = len(tokens)
        k = len(kv.chunk_keys)
        covered = n if kv.tail_key else k * cs
        chunks: list[torch.Tensor] = []
        for i, t in enumerate(job.fetched):
            want = cs if i < k else n % cs
            if not self._valid_chunk(t, want):
                metrics.KV_CHUNK_MISSES.labels("chunk" if i < k else "tail").inc()
                break
            chunks.append(t)  # type: ignore[arg-type]
        job.fetched = None
        loaded = min(covered, len(chunks) * cs)
        if loaded:
            metrics.KV_LOADED_TOKENS.labels("decode").inc(loaded)
        return self._cache_from_chunks(chunks, loaded), loaded

    def _truncated(self, cache: Any, num_tokens: int) -> Any:
        """A cache holding only the first ``num_tokens`` positions of ``cache``."""
        if cache.get_seq_length() <= num_tokens:
            return cache
        out = self._new_cache()
        for i, layer in enumerate(cache.layers):
            out.update(
                layer.keys[:, :, :num_tokens].clone(), layer.values[:, :, :num_tokens].clone(), i
            )
        return out

    # ----------------------------------------------------------------- store access

    def attach_store(self, store: ChunkStore | None) -> None:
        """Reads and writes chunks through ``store`` from now on (None: no store), with a
        fresh failure backoff (:class:`pdserve.engines.chunk_io.ChunkIO`)."""
        self.chunks = (
            None
            if store is None
            else ChunkIO(store, self.fingerprint, replicas=self.cfg.store_replicas)
        )

    def _load_prefix(self, keys: list[str]) -> list[torch.Tensor]:
        """The longest run of leading chunks that exist and verify."""
        if self.chunks is None:
            return []
        out: list[torch.Tensor] = []
        for t in self.chunks.load_prefix(keys):
            if not self._valid_chunk(t, self.cfg.chunk_size):
                metrics.KV_CHUNK_MISSES.labels("chunk").inc()
                break
            out.append(t)
        return out

    def _fetch(
        self, keys: list[str], wait_ms: int, cancelled: Callable[[], bool]
    ) -> list[torch.Tensor | None]:
        """Gets the keys' chunks in order, ending after the first miss (a None: missing,
        corrupt, or not landed within ``wait_ms``: in write mode a key not stored yet is
        waited for, it may still be landing). Runs on a loader thread."""
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

    def _save_chunks(
        self, cache: Any, keys: list[str], first: int, end: int, tokens: Sequence[int] = ()
    ) -> None:
        """Writes chunks ``first..end-1`` (one batched put; the store skips those it holds),
        with each one's parent key and token ids (for the master's KV events) when
        ``tokens`` (the prompt) is given."""
        if first >= end or self.chunks is None or not self.chunks.available():
            return
        cs = self.cfg.chunk_size
        meta = {
            keys[i]: ChunkMeta(keys[i - 1] if i else "", tokens[i * cs : (i + 1) * cs], cs)
            for i in range(first, end)
            if tokens
        }
        self.chunks.save(
            [(keys[i], self._chunk_of(cache, i * cs, (i + 1) * cs)) for i in range(first, end)],
            meta=meta,
        )

    def _save_tail(self, cache: Any, key: str, n: int) -> None:
        if self.chunks is None or not self.chunks.available():
            return
        start = n - n % self.cfg.chunk_size
        self.chunks.save([(key, self._chunk_of(cache, start, n))], ttl_ms=self.cfg.tail_ttl_ms)
