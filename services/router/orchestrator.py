"""Orchestrates one request across the workers (plain logic; the servicers call it): it keeps
the plans and the retries, and calls a stage for each step. Parse (``frontend.py``,
``request.py``: a validated :class:`GenRequest`), plan (``plan.py``), place (``place.py``: which
worker), build the worker request (``worker_requests.py``), execute one call on one worker
(``execute.py``), stream the client's chunks across attempts (``stream.py``); ``trace.py``
records what happened, ``running.py`` finds a request to abort.

Plans (:class:`Plan`, chosen per request by :func:`choose_plan`):
- read (default): Prefill on a prefill worker (retried once on another worker), then Decode
  on a decode worker with the returned KV handle; decode pulls the chunks from the store.
- write: Prefill (publishing each chunk as it is computed) and Decode start together. Decode
  gets the keys of the first ``(n - 1) // chunk_size`` full chunks, no first token, and
  ``chunk_wait_ms``: it loads each chunk as soon as it lands, computes the remaining prompt
  tokens itself and samples the first token. Prompts shorter than that run locally. A decode
  worker that cannot take such a handle answers UNIMPLEMENTED (one predating write mode said
  INVALID_ARGUMENT): before its first token either one turns the request into the read plan
  with the prefill already running (``write->read``), never into the caller's error; a request
  that is itself invalid then fails in that prefill, with the caller's status.
- local (colocated, conditional disaggregation): Decode without a KV handle; the decode worker
  prefills (reusing cached prefix chunks). Used when the mode is colocated, when no prefill
  worker is in rotation, when the uncached part of the prompt is below
  ``local_prefill_threshold``, and as the fallback when every prefill attempt failed.

Failures: worker errors other than the caller's own (invalid argument, deadline, cancel) count
against the worker's circuit breaker; a decode that fails before its first token is retried
once on another decode worker, one that fails after it is resumed on another one
(``stream.DecodeSession``). Cancelling the consumer of :meth:`Orchestrator.generate` (or its
deadline) cancels the worker calls, which frees their slots. Workers are called only through
a :class:`WorkerClient`, so tests drive all of this in-process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import asdict, dataclass, replace

import grpc

from pdserve import errors
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.requests_codec import logprobs_from_proto
from pdserve.services.router import worker_requests as build
from pdserve.services.router.admission import Admission
from pdserve.services.router.execute import (
    DecodeAttempt,
    PrefillFailed,
    WriteRefused,
    count_failure,
    prefill_once,
)
from pdserve.services.router.fingerprint import FingerprintSource
from pdserve.services.router.kv_check import KVCheck
from pdserve.services.router.place import Placer
from pdserve.services.router.plan import Plan, choose_plan
from pdserve.services.router.policies import (
    ColocatedPlacement,
    DecodeChoice,
    PrefillPolicy,
    RouteContext,
)
from pdserve.services.router.request import GenRequest
from pdserve.services.router.running import Running
from pdserve.services.router.stream import DecodeSession, StreamChunk
from pdserve.services.router.trace import CACHED, RETRIES, TTFT, Trace, end_span, record_outcome
from pdserve.services.router.trace import traced as trace_span
from pdserve.services.router.worker_client import WorkerCallError, WorkerClient
from pdserve.services.router.workers import DECODE, PREFILL, WorkerPool
from pdserve.tenants import Tenants
from pdserve.v1 import engine_pb2

log = logging.getLogger(__name__)

PrefixLookup = Callable[[list[str]], Awaitable[int]]


@dataclass(frozen=True)
class OrchestratorConfig:
    """The router settings the orchestrator acts on (built from RouterConfig)."""

    #: Served model name, sent with every worker request.
    model: str
    #: Mode of requests that leave it unset: read, write or colocated.
    default_mode: str = "read"
    #: Uncached prompt tokens below which the decode worker prefills (0 = never).
    local_prefill_threshold: int = 0
    #: Retries of a failed prefill on another prefill worker.
    prefill_retries: int = 1
    #: Write plan: how long decode waits for each chunk (ms).
    chunk_wait_ms: int = 30000
    #: Deadline of a request that has none of its own (s).
    request_timeout_s: float = 600.0


@dataclass
class _Job:
    """One admitted request as the plans see it."""

    req: GenRequest
    #: Chain keys of the prompt's full chunks, salted with the request's cache salt: lookups,
    #: handles and placement affinity see only the tenant's own entries.
    keys: list[str]
    #: Prompt tokens the store does not hold (at least 1).
    uncached: int
    #: ``time.monotonic()`` by which the request must end.
    deadline: float
    trace: Trace


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        *,
        client: WorkerClient,
        fingerprints: FingerprintSource,
        pool: WorkerPool,
        policy: PrefillPolicy,
        admission: Admission,
        prefix_lookup: PrefixLookup | None = None,
        decode_choice: DecodeChoice | None = None,
        placement: ColocatedPlacement | None = None,
        detokenize: Callable[[list[int]], str] = lambda ids: "",
        tenants: Tenants | None = None,
        kv_check: KVCheck | None = None,
    ) -> None:
        self.config = config
        #: API keys by tenant and each tenant's requests in flight (:mod:`pdserve.tenants`).
        self.tenants = tenants or Tenants()
        self.client = client
        self.fingerprints = fingerprints
        self.pool = pool
        self.admission = admission
        self.prefix_lookup = prefix_lookup
        self.place = Placer(
            pool, policy, decode_choice or DecodeChoice(), placement or ColocatedPlacement()
        )
        self.detokenize = detokenize
        #: Recent router overheads (ms), for the benchmark figure.
        self.overheads_ms: deque[float] = deque(maxlen=10000)
        self.running = Running()
        self.traces: deque[Trace] = deque(maxlen=1000)
        #: Samples requests served from the store for a cold recompute (``kv_check.py``).
        self.kv_check = kv_check

    @property
    def fp(self) -> ModelFingerprint | None:
        """The KV fingerprint agreed with the workers (None until one has registered)."""
        return self.fingerprints.current()

    async def cached_tokens(self, tokens: list[int], cache_salt: str = "") -> tuple[list[str], int]:
        """Chain keys of the prompt's full chunks in ``cache_salt``'s chain and how many prompt
        tokens the store holds under them (so only the tenant's own entries count)."""
        fp = self.fp
        if fp is None:
            return [], 0
        keys = chunk_keys(fp, tokens, cache_salt)
        if not keys or self.prefix_lookup is None:
            return keys, 0
        try:
            found = await self.prefix_lookup(keys)
        except Exception as exc:  # the store is an optimisation: never fail a request on it
            log.warning("longest-prefix lookup failed: %s", exc)
            found = 0
        if self.kv_check is not None:  # none while its fingerprint is quarantined
            found = self.kv_check.store_hits(fp.digest().hex(), found)
        return keys, min(found, len(keys)) * fp.chunk_size

    def generate(
        self, req: GenRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[StreamChunk]:
        """Streams the request's tokens. Raises pdserve errors (mapped to status codes).

        :meth:`abort` (RouterService.Abort) ends it early: the worker calls are cancelled and
        the stream ends with a FINISH_REASON_CANCELLED chunk."""
        traced = trace_span(
            req.request_id, len(req.prompt_token_ids), self._generate(req, timeout_s=timeout_s)
        )
        inner = self._counted(req, traced)
        key = Tenants.abort_key(req.tenant, req.abort_id or req.request_id)
        return self.running.track(key, req.request_id, inner)

    async def _counted(
        self, req: GenRequest, inner: AsyncIterator[StreamChunk]
    ) -> AsyncIterator[StreamChunk]:
        """``inner``, counted among its tenant's requests in flight (RESOURCE_EXHAUSTED past
        the tenant's cap, before any work)."""
        self.tenants.enter(req.tenant)
        try:
            async for chunk in inner:
                yield chunk
        finally:
            self.tenants.leave(req.tenant)
            await inner.aclose()

    def abort(self, request_id: str, tenant: str = "") -> bool:
        """Aborts ``tenant``'s running request(s) with this id; False when none runs (another
        tenant's requests are not seen)."""
        return self.running.abort(Tenants.abort_key(tenant, request_id))

    async def _generate(
        self, req: GenRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[StreamChunk]:
        t0 = time.monotonic()
        deadline = t0 + (timeout_s if timeout_s is not None else self.config.request_timeout_s)
        n = len(req.prompt_token_ids)
        fp = self.fp
        fp_hex = fp.digest().hex() if fp is not None else ""
        if self.kv_check is not None:
            req = self.kv_check.route(req, fp_hex)  # a quarantined fingerprint's salt
        keys, cached = await self.cached_tokens(req.prompt_token_ids, req.cache_salt)
        n_prefill = len(self.pool.candidates(PREFILL))
        mode = req.mode or self.config.default_mode
        if req.sampling.constrained:
            # guided decoding keeps a grammar state per generation: one engine must run it all
            mode = "colocated"
        plan = choose_plan(
            mode=mode,
            prompt_tokens=n,
            cached_tokens=cached,
            chunk_size=fp.chunk_size if fp is not None else 0,
            prefill_workers=n_prefill,
            local_threshold=self.config.local_prefill_threshold,
        )
        trace = Trace(plan, tenant=req.tenant, received=t0, cached_tokens=cached)
        job = _Job(req, keys, max(1, n - cached), deadline, trace)
        outcome = "error"
        admit_tokens = job.uncached if plan != Plan.LOCAL else 0
        admit = self.admission.admit(
            admit_tokens, n_prefill, tenant=req.tenant, priority=req.priority, prompt_tokens=n
        )
        async with admit as ticket:
            trace.admitted = time.monotonic()
            # the workers get the caller's priority with the tenant's fairness rank
            job.req = replace(req, priority=ticket.engine_priority)
            try:
                if plan == Plan.READ:
                    stream = self._read(job)
                elif plan == Plan.WRITE:
                    stream = self._write(job)
                else:
                    stream = self._local(job)
                first = True
                last_t = 0.0
                async for chunk in stream:
                    now_ms = (time.monotonic() - t0) * 1000.0
                    chunk.times_ms = [now_ms] * len(chunk.token_ids)
                    if first and chunk.token_ids:
                        first = False
                        trace.first_token = time.monotonic()
                        ticket.first_token()
                        TTFT.observe(now_ms / 1000.0)
                        self.admission.observe_ttft(job.uncached, now_ms)
                    elif chunk.token_ids and last_t:
                        self.admission.observe_tpot((now_ms - last_t) / len(chunk.token_ids))
                    if chunk.token_ids:
                        last_t = now_ms
                    yield chunk
                outcome = "ok"
                if self.kv_check is not None:
                    self.kv_check.offer(req, trace, fp_hex)
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            finally:
                trace.total_ms = (time.monotonic() - t0) * 1000.0
                overhead = record_outcome(trace, plan, outcome, t0)
                end_span(trace, outcome, t0)
                if overhead is not None:
                    self.overheads_ms.append(overhead)
                self.traces.append(trace)
                log.info("request %s %s %s", req.request_id, outcome, json.dumps(asdict(trace)))

    # --- plans ------------------------------------------------------------------------------

    async def _read(self, job: _Job) -> AsyncIterator[StreamChunk]:
        resp = await self._prefill(job, publish=False)
        async for c in self._decode_prefilled(job, resp, Plan.READ_THEN_LOCAL):
            yield c

    async def _decode_prefilled(
        self, job: _Job, resp: engine_pb2.PrefillResponse | None, local_plan: Plan
    ) -> AsyncIterator[StreamChunk]:
        """Decode with the KV handle and first token of prefill's answer ``resp``; None (every
        prefill attempt failed): the decode worker prefills itself, as ``local_plan``."""
        if resp is None:
            job.trace.plan = local_plan
            async for c in self._local(job):
                yield c
            return
        CACHED.labels("store").inc(resp.cached_tokens)  # prefill reports store + its own cache
        job.trace.prefill_cached = resp.cached_tokens
        CACHED.labels("computed").inc(resp.computed_tokens)
        first = resp.first_token_id
        # Whether the first token already ends the generation (EOS, a stop string, max_tokens
        # 1) is the engine's decision (engines.base.next_text): the decode worker streams it
        # as its first message, with the finish when it is the last, before touching the KV.
        first_lp = None
        if resp.HasField("first_token_logprobs"):
            first_lp = next(iter(logprobs_from_proto(resp.first_token_logprobs)), None)
        request = build.decode_request(job.req, self.config.model, kv=resp.kv, first_token_id=first)
        session = DecodeSession(
            request, job.trace, cached_tokens=resp.cached_tokens, first_logprob=first_lp
        )
        async for c in self._decode(session, job):
            yield c

    async def _write(self, job: _Job) -> AsyncIterator[StreamChunk]:
        fp = self.fp
        assert fp is not None, "the write plan needs the chunk size"
        handle = build.write_handle(job.keys, len(job.req.prompt_token_ids), fp)
        prefill = asyncio.ensure_future(self._prefill(job, publish=True))
        request = build.decode_request(
            job.req, self.config.model, kv=handle, chunk_wait_ms=self.config.chunk_wait_ms
        )
        session = DecodeSession(
            request, job.trace, cached_tokens=job.trace.cached_tokens, prefill=prefill
        )
        finished = False
        try:
            async for c in self._decode(session, job):
                yield c
            finished = True
        except PrefillFailed:
            # No chunks are coming: do not let decode wait for them; it prefills itself.
            job.trace.plan = Plan.WRITE_THEN_LOCAL
            async for c in self._local(job):
                yield c
            finished = True
        except WriteRefused as refused:
            # The worker cannot wait for chunks: decode with prefill's answer (read plan).
            log.warning(
                "decode worker %s refused the write-mode handle (%s %s); reading instead",
                refused.worker,
                refused.code.name,
                refused.details,
            )
            job.trace.plan = Plan.WRITE_THEN_READ
            resp = await prefill  # an invalid request fails here, with the caller's status
            async for c in self._decode_prefilled(job, resp, Plan.WRITE_THEN_LOCAL):
                yield c
            finished = True
        finally:
            if finished:
                # Decode is done; a prefill still running only publishes chunks for reuse.
                prefill.add_done_callback(_retrieve)
            else:
                prefill.cancel()

    async def _local(self, job: _Job) -> AsyncIterator[StreamChunk]:
        n = len(job.req.prompt_token_ids)
        ctx = RouteContext(
            n,
            min(job.trace.cached_tokens, n - 1),
            job.req.prompt_token_ids,
            job.req.cache_salt,
        )
        session = DecodeSession(
            build.decode_request(job.req, self.config.model), job.trace, cached_tokens=None
        )
        async for c in self._decode(session, job, local=ctx):
            yield c

    # --- retries ----------------------------------------------------------------------------

    async def _prefill(self, job: _Job, *, publish: bool) -> engine_pb2.PrefillResponse | None:
        """Prefill with retries on other workers; None when every attempt failed."""
        req, trace, uncached = job.req, job.trace, job.uncached
        preq = build.prefill_request(req, self.config.model, publish=publish)
        n = len(req.prompt_token_ids)
        ctx = RouteContext(n, n - uncached, req.prompt_token_ids, req.cache_salt)
        tried: set[str] = set()
        for attempt in range(1 + self.config.prefill_retries):
            w = self.place.prefill(ctx, tried)
            if w is None:
                break
            tried.add(w.id)
            if attempt:
                RETRIES.labels(PREFILL).inc()
                trace.retries.append(f"prefill:{w.id}")
            try:
                resp = await prefill_once(
                    self.client, w, preq, uncached=uncached, trace=trace, deadline=job.deadline
                )
            except WorkerCallError as exc:
                count_failure(self.pool, w, exc)
                log.warning("prefill on %s failed: %s %s", w.id, exc.code, exc.details)
                continue
            self.pool.record_success(w)
            trace.prefill_worker_ms = resp.worker_ms
            self.admission.observe_prefill(resp.computed_tokens, resp.worker_ms)
            return resp
        return None

    async def _decode(
        self, session: DecodeSession, job: _Job, *, local: RouteContext | None = None
    ) -> AsyncIterator[StreamChunk]:
        """Streams ``session`` from a decode worker (``local``: the local plan's prompt, which
        the worker prefills), retrying once on another worker before the first token and
        resuming on another one after it. A worker that could not be reached at all
        (UNAVAILABLE before it answered: dead, not yet out of rotation) does not use up that
        try; every worker is tried at most once."""
        trace = session.trace
        fp = self.fp
        chunk_size = fp.chunk_size if fp is not None else 0
        tried: set[str] = set()
        last: WorkerCallError | None = None
        tries = 2
        while tries > 0:
            w = self.place.decode(tried, job.keys, local=local, chunk_size=chunk_size)
            if w is None:
                if tried:
                    break
                raise errors.Unavailable("no decode worker is in rotation")
            retry = bool(tried)
            tried.add(w.id)
            if retry:
                RETRIES.labels(DECODE).inc()
                trace.retries.append(f"decode:{w.id}")
            attempt = DecodeAttempt(
                self.client,
                w,
                session,
                deadline=job.deadline,
                prefill_tokens=(
                    self.place.prompt_work(w, local, job.keys, chunk_size)
                    if local is not None
                    else 0
                ),
            )
            try:
                async with aclosing(attempt.stream()) as chunks:
                    async for c in chunks:
                        yield c
                self.pool.record_success(w)
                return
            except WorkerCallError as exc:
                count_failure(self.pool, w, exc)
                log.warning("decode on %s failed: %s %s", w.id, exc.code, exc.details)
                last = exc
                if attempt.started or exc.code != grpc.StatusCode.UNAVAILABLE:
                    tries -= 1
                if attempt.started:
                    if not session.resume(self.detokenize):
                        raise errors.Unavailable(
                            f"decode worker {w.id} failed mid-stream: {exc.code.name}"
                        ) from exc
                    trace.retries.append(f"decode-resume:{w.id}")
        why = f"{last.code.name} {last.details}" if last is not None else "no worker"
        raise errors.Unavailable(f"decode failed on {len(tried)} worker(s): {why}")


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("write-mode prefill failed after decode finished: %s", fut.exception())
