"""Orchestrates one request across the workers (plain logic; the servicers call it).

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
(:class:`DecodeSession`). Cancelling the consumer of :meth:`Orchestrator.generate` (or its
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
from dataclasses import asdict, dataclass, field

import grpc
from prometheus_client import Counter, Histogram

from pdserve import errors
from pdserve.engines.base import Sampling, TokenLogprob
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.logprobs import from_proto as logprobs_from_proto
from pdserve.services.router.admission import Admission
from pdserve.services.router.fingerprint import FingerprintSource
from pdserve.services.router.plan import Plan, choose_plan
from pdserve.services.router.policies import (
    ColocatedPlacement,
    DecodeChoice,
    PrefillPolicy,
    RouteContext,
)
from pdserve.services.router.request import GenRequest
from pdserve.services.router.worker_client import DecodeCall, WorkerCallError, WorkerClient
from pdserve.services.router.workers import DECODE, PREFILL, Worker, WorkerPool
from pdserve.telemetry import REGISTRY
from pdserve.v1 import common_pb2, engine_pb2

log = logging.getLogger(__name__)

_MS_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 25, 50, 100, 250, 500, 1000, 2500, 5000)
_S_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REQUESTS = Counter(
    "pdserve_router_requests",
    "Requests by plan and outcome",
    ["plan", "outcome"],
    registry=REGISTRY,
)
RETRIES = Counter(
    "pdserve_router_retries",
    "Worker calls retried on another worker",
    ["role"],
    registry=REGISTRY,
)
TTFT = Histogram(
    "pdserve_router_ttft_seconds", "Time to first token", buckets=_S_BUCKETS, registry=REGISTRY
)
E2E = Histogram(
    "pdserve_router_e2e_seconds", "Request latency", buckets=_S_BUCKETS, registry=REGISTRY
)
OVERHEAD = Histogram(
    "pdserve_router_overhead_ms",
    "Router time per request excluding worker time (read and local plans)",
    buckets=_MS_BUCKETS,
    registry=REGISTRY,
)
CACHED = Counter(
    "pdserve_router_prompt_tokens", "Prompt tokens by source", ["source"], registry=REGISTRY
)
PHASE = Histogram(
    "pdserve_router_phase_seconds",
    "Time per request phase as the router sees it: queue (waiting for admission), prefill "
    "(admitted to first token: the prefill call, or the worker's local prefill with its store "
    "load), kv_transfer (disaggregated plans: prefill answer to the decode worker's first new "
    "token, i.e. its KV load plus one step), decode (first token to the last)",
    ["phase"],
    buckets=_S_BUCKETS,
    registry=REGISTRY,
)

#: Write plan: what a decode worker that cannot take a write-mode handle answers (before its
#: first token); the request falls back to the read plan.
_WRITE_REFUSALS = {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT}

#: Worker status codes that are the caller's fault or choice: passed through, never retried.
_CALLER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
}

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
class StreamChunk:
    """Tokens for the client; ``finish`` is set on the last chunk only."""

    token_ids: list[int]
    text: str
    times_ms: list[float]
    finish: int = common_pb2.FINISH_REASON_UNSPECIFIED
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: One per token of ``token_ids`` when the request asked logprobs, else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Trace:
    """What happened to one request (for tests, logs and the overhead figure)."""

    plan: Plan
    admitted: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    cached_tokens: int = 0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    decode_start: float = 0.0
    #: When the decode worker streamed its first token of its own (after any KV load).
    decode_first: float = 0.0
    first_token: float = 0.0
    prefill_worker_ms: float = 0.0
    decode_worker_ms: float = 0.0
    #: Prompt tokens the decode worker loaded from the store / computed itself / found in its
    #: own prefix cache.
    decode_loaded: int = 0
    decode_recomputed: int = 0
    decode_prefix_cached: int = 0
    total_ms: float = 0.0
    overhead_ms: float = -1.0
    retries: list[str] = field(default_factory=list)


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


class DecodeSession:
    """One generation streamed from decode workers, across attempts (a retry before the first
    token, a resume after it): the request of the next attempt, what the client has got, and
    the prompt counts it gets once, with the first chunk."""

    def __init__(
        self,
        request: engine_pb2.DecodeRequest,
        trace: Trace,
        *,
        cached_tokens: int | None,
        prefill: asyncio.Future | None = None,
        first_logprob: TokenLogprob | None = None,
    ) -> None:
        self.request = request
        #: Prefill's first token's logprobs: the worker echoes that token without them.
        self.first_logprob = first_logprob
        self.trace = trace
        self._first_request = request
        #: Prompt tokens the client is told were cached: fixed by the plan, or None when the
        #: decode worker prefills (local plan) and its own counts tell.
        self.cached_tokens = cached_tokens
        self.reported = False
        #: Tokens streamed to the client across attempts, their text as streamed, and text a
        #: failed worker held back (a partial character), owed to the client.
        self.emitted: list[int] = []
        self.sent_text = ""
        self.pending_text = ""
        #: Messages of this attempt still to come that echo prefill's first token.
        self.echoes = 1 if request.HasField("first_token_id") else 0
        #: Write plan: the parallel prefill. Failing before decode's first token means no
        #: chunk will land: the watched call is cancelled and ``prefill_failed`` set.
        self.prefill = prefill
        self.prefill_failed = False
        self._watched: DecodeCall | None = None

    @property
    def local(self) -> bool:
        """The attempt's worker prefills the whole prompt itself (no KV handle)."""
        return not self.request.HasField("kv")

    def watch(self, call: DecodeCall) -> None:
        """Cancels ``call`` when the prefill fails, until :meth:`unwatch`."""
        if self.prefill is not None:
            self._watched = call
            self.prefill.add_done_callback(self._on_prefill)

    def unwatch(self) -> None:
        if self.prefill is not None and self._watched is not None:
            self._watched = None
            self.prefill.remove_done_callback(self._on_prefill)

    def _on_prefill(self, fut: asyncio.Future) -> None:
        if self._watched is None:
            return
        if fut.cancelled() or fut.exception() is not None or fut.result() is None:
            self.prefill_failed = True
            self._watched.cancel()

    def on_response(self, resp: engine_pb2.DecodeResponse) -> StreamChunk:
        """The client's chunk for one decode message; records the worker's counts."""
        trace = self.trace
        if not self.echoes and not trace.decode_first:
            trace.decode_first = time.monotonic()
        logprobs = logprobs_from_proto(resp.logprobs) if resp.HasField("logprobs") else []
        if self.echoes and resp.token_ids and self.first_logprob is not None:
            logprobs.insert(0, self.first_logprob)
        self.echoes = max(0, self.echoes - 1)
        # Decode reports its prompt counts on its last message only (DecodeResponse), so the
        # client's first chunk gets them only when it is also the last.
        counted = resp.loaded_tokens or resp.recomputed_tokens or resp.prefix_cached_tokens
        if counted:
            trace.decode_loaded = resp.loaded_tokens
            trace.decode_recomputed = resp.recomputed_tokens
            trace.decode_prefix_cached = resp.prefix_cached_tokens
            if self.local:
                CACHED.labels("store").inc(resp.loaded_tokens)
                CACHED.labels("prefix_cache").inc(resp.prefix_cached_tokens)
                CACHED.labels("computed").inc(resp.recomputed_tokens)
        if resp.token_times_ms:
            trace.decode_worker_ms = resp.token_times_ms[-1]
        text = self.pending_text + resp.text
        self.pending_text = ""
        self.emitted.extend(resp.token_ids)
        self.sent_text += text
        chunk = StreamChunk(list(resp.token_ids), text, [], resp.finish_reason, logprobs=logprobs)
        if not self.reported:
            self.reported = True
            chunk.prompt_tokens = len(self._first_request.prompt_token_ids)
            if self.cached_tokens is not None:
                chunk.cached_tokens = self.cached_tokens
            elif counted:
                chunk.cached_tokens = resp.loaded_tokens + resp.prefix_cached_tokens
            else:  # not known yet: what the store held at routing time
                chunk.cached_tokens = trace.cached_tokens
        return chunk

    def resume(self, detokenize: Callable[[list[int]], str]) -> bool:
        """Makes the next attempt continue after the tokens already streamed: the worker
        prefills prompt + emitted (reusing stored chunks) and generates the tokens left, so
        greedy output is unchanged; text the failed worker held back is re-derived from the
        tokens. False when it cannot be resumed (no max_tokens, or nothing left)."""
        first = self._first_request
        left = first.sampling.max_tokens - len(self.emitted)
        if first.sampling.max_tokens == 0 or left <= 0 or not self.emitted:
            return False
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(first.sampling)
        sampling.max_tokens = left
        self.request = engine_pb2.DecodeRequest(
            request_id=first.request_id,
            model=first.model,
            prompt_token_ids=[*first.prompt_token_ids, *self.emitted],
            sampling=sampling,
            cache_salt=first.cache_salt,
        )
        self.echoes = 0
        full = detokenize(self.emitted)
        self.pending_text = full[len(self.sent_text) :] if full.startswith(self.sent_text) else ""
        return True


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
    ) -> None:
        self.config = config
        self.client = client
        self.fingerprints = fingerprints
        self.pool = pool
        self.policy = policy
        self.admission = admission
        self.prefix_lookup = prefix_lookup
        self.decode_choice = decode_choice or DecodeChoice()
        self.placement = placement or ColocatedPlacement()
        self.detokenize = detokenize
        #: Recent router overheads (ms), for the benchmark figure.
        self.overheads_ms: deque[float] = deque(maxlen=10000)
        #: Running requests by abort id (GenRequest.abort_id, else request_id).
        self.running: dict[str, list[_AbortHandle]] = {}
        self.traces: deque[Trace] = deque(maxlen=1000)

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
        return keys, min(found, len(keys)) * fp.chunk_size

    async def generate(
        self, req: GenRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[StreamChunk]:
        """Streams the request's tokens. Raises pdserve errors (mapped to status codes).

        :meth:`abort` (RouterService.Abort) ends it early: the worker calls are cancelled and
        the stream ends with a FINISH_REASON_CANCELLED chunk."""
        handle = _AbortHandle(asyncio.current_task())
        key = req.abort_id or req.request_id
        self.running.setdefault(key, []).append(handle)
        inner = self._generate(req, timeout_s=timeout_s)
        try:
            while not handle.requested:
                handle.task = asyncio.current_task()  # n > 1: the HTTP API's pump tasks
                handle.waiting = True
                try:
                    chunk = await anext(inner)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    # Abort cancels this task only while it waits here: take that cancel back
                    if handle.requested and handle.task is not None and not handle.task.uncancel():
                        break
                    raise
                finally:
                    handle.waiting = False
                yield chunk
            await inner.aclose()
            log.info("request %s aborted", req.request_id)
            yield StreamChunk([], "", [], common_pb2.FINISH_REASON_CANCELLED)
        finally:
            entries = self.running.get(key, [])
            if handle in entries:
                entries.remove(handle)
            if not entries:
                self.running.pop(key, None)
            await inner.aclose()

    def abort(self, request_id: str) -> bool:
        """Aborts the running request(s) with this id; False when none runs."""
        handles = self.running.get(request_id)
        if not handles:
            return False
        for h in list(handles):
            h.requested = True
            if h.waiting and h.task is not None:
                h.task.cancel()
        return True

    async def _generate(
        self, req: GenRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[StreamChunk]:
        t0 = time.monotonic()
        deadline = t0 + (timeout_s if timeout_s is not None else self.config.request_timeout_s)
        n = len(req.prompt_token_ids)
        keys, cached = await self.cached_tokens(req.prompt_token_ids, req.cache_salt)
        n_prefill = len(self.pool.candidates(PREFILL))
        fp = self.fp
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
        job = _Job(req, keys, max(1, n - cached), deadline, Trace(plan, cached_tokens=cached))
        trace = job.trace
        outcome = "error"
        admit_tokens = job.uncached if plan != Plan.LOCAL else 0
        async with self.admission.admit(admit_tokens, n_prefill) as ticket:
            trace.admitted = time.monotonic()
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
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            finally:
                trace.total_ms = (time.monotonic() - t0) * 1000.0
                REQUESTS.labels(plan.value, outcome).inc()
                if outcome == "ok":
                    E2E.observe(trace.total_ms / 1000.0)
                    _observe_phases(trace, t0)
                    if trace.plan in (Plan.READ, Plan.LOCAL):
                        over = trace.total_ms - trace.prefill_worker_ms - trace.decode_worker_ms
                        trace.overhead_ms = over
                        OVERHEAD.observe(over)
                        self.overheads_ms.append(over)
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
        CACHED.labels("computed").inc(resp.computed_tokens)
        first = resp.first_token_id
        # Whether the first token already ends the generation (EOS, a stop string, max_tokens
        # 1) is the engine's decision (engines.base.next_text): the decode worker streams it
        # as its first message, with the finish when it is the last, before touching the KV.
        first_lp = None
        if resp.HasField("first_token_logprobs"):
            first_lp = next(iter(logprobs_from_proto(resp.first_token_logprobs)), None)
        session = DecodeSession(
            self._decode_request(job.req, kv=resp.kv, first_token_id=first),
            job.trace,
            cached_tokens=resp.cached_tokens,
            first_logprob=first_lp,
        )
        async for c in self._decode(session, job, self.decode_choice.choose):
            yield c

    async def _write(self, job: _Job) -> AsyncIterator[StreamChunk]:
        fp = self.fp
        assert fp is not None, "the write plan needs the chunk size"
        cs = fp.chunk_size
        k = (len(job.req.prompt_token_ids) - 1) // cs
        handle = common_pb2.KVHandle(
            chunk_keys=job.keys[:k], num_tokens=k * cs, chunk_size=cs, fingerprint=fp.digest()
        )
        prefill = asyncio.ensure_future(self._prefill(job, publish=True))
        session = DecodeSession(
            self._decode_request(job.req, kv=handle, chunk_wait_ms=self.config.chunk_wait_ms),
            job.trace,
            cached_tokens=job.trace.cached_tokens,
            prefill=prefill,
        )
        finished = False
        try:
            async for c in self._decode(session, job, self.decode_choice.choose):
                yield c
            finished = True
        except _PrefillFailed:
            # No chunks are coming: do not let decode wait for them; it prefills itself.
            job.trace.plan = Plan.WRITE_THEN_LOCAL
            async for c in self._local(job):
                yield c
            finished = True
        except _WriteRefused as refused:
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
        ctx = RouteContext(n, min(job.trace.cached_tokens, n - 1))
        fp = self.fp
        chunk = fp.chunk_size if fp is not None else 0
        session = DecodeSession(self._decode_request(job.req), job.trace, cached_tokens=None)
        async for c in self._decode(
            session,
            job,
            lambda cands: self.placement.choose(cands, ctx, job.keys, chunk),
            prefill_tokens=ctx.uncached_tokens,
        ):
            yield c

    def _decode_request(self, req: GenRequest, **fields) -> engine_pb2.DecodeRequest:
        return engine_pb2.DecodeRequest(
            request_id=req.request_id,
            model=self.config.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_proto(req.sampling),
            cache_salt=req.cache_salt,
            **fields,
        )

    # --- worker calls -----------------------------------------------------------------------

    async def _prefill(self, job: _Job, *, publish: bool) -> engine_pb2.PrefillResponse | None:
        """Prefill with retries on other workers; None when every attempt failed."""
        req, trace, uncached = job.req, job.trace, job.uncached
        preq = engine_pb2.PrefillRequest(
            request_id=req.request_id,
            model=self.config.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_proto(req.sampling),
            publish_incrementally=publish,
            cache_salt=req.cache_salt,
        )
        ctx = RouteContext(len(req.prompt_token_ids), len(req.prompt_token_ids) - uncached)
        tried: set[str] = set()
        for attempt in range(1 + self.config.prefill_retries):
            cands = self.pool.candidates(PREFILL, tried)
            if not cands:
                break
            w = self.policy.choose(cands, ctx)
            tried.add(w.id)
            if attempt:
                RETRIES.labels(PREFILL).inc()
                trace.retries.append(f"prefill:{w.id}")
            w.inflight += 1
            w.inflight_tokens += uncached
            trace.prefill_worker = w.id
            trace.prefill_start = time.monotonic()
            try:
                resp = await self.client.prefill(w, preq, _remaining(job.deadline))
            except WorkerCallError as exc:
                self._worker_error(w, exc)
                log.warning("prefill on %s failed: %s %s", w.id, exc.code, exc.details)
                continue
            finally:
                w.inflight -= 1
                w.inflight_tokens -= uncached
                trace.prefill_end = time.monotonic()
            self.pool.record_success(w)
            trace.prefill_worker_ms = resp.worker_ms
            self.admission.observe_prefill(resp.computed_tokens, resp.worker_ms)
            return resp
        return None

    async def _decode(
        self,
        session: DecodeSession,
        job: _Job,
        choose: Callable[[list[Worker]], Worker],
        *,
        prefill_tokens: int = 0,
    ) -> AsyncIterator[StreamChunk]:
        """Streams ``session`` from a decode worker that ``choose`` picks, retrying once on
        another worker before the first token and resuming on another one after it. A worker
        that could not be reached at all (UNAVAILABLE before it answered: dead, not yet out of
        rotation) does not use up that try; every worker is tried at most once.
        ``prefill_tokens`` is the prompt work the worker does before its first token (the local
        plan), counted on the worker until that token arrives, for placement."""
        trace = session.trace
        tried: set[str] = set()
        last: WorkerCallError | None = None
        tries = 2
        while tries > 0:
            cands = self.pool.candidates(DECODE, tried)
            if not cands:
                if tried:
                    break
                raise errors.Unavailable("no decode worker is in rotation")
            w = choose(cands)
            retry = bool(tried)
            tried.add(w.id)
            self.placement.affinity.record(w.id, job.keys)
            if retry:
                RETRIES.labels(DECODE).inc()
                trace.retries.append(f"decode:{w.id}")
            trace.decode_worker = w.id
            trace.decode_start = time.monotonic()
            call = self.client.decode(w, session.request, _remaining(job.deadline))
            session.watch(call)
            w.inflight += 1
            pending = prefill_tokens
            w.inflight_tokens += pending
            started = False
            try:
                async for resp in call:
                    if not started:  # the prompt is done: chunks and placement no longer matter
                        started = True
                        session.unwatch()
                        w.inflight_tokens -= pending
                        pending = 0
                    yield session.on_response(resp)
                self.pool.record_success(w)
                return
            except WorkerCallError as exc:
                if session.prefill_failed and exc.code == grpc.StatusCode.CANCELLED:
                    raise _PrefillFailed() from exc
                if session.prefill is not None and not started and exc.code in _WRITE_REFUSALS:
                    raise _WriteRefused(w.id, exc.code, exc.details) from exc
                self._worker_error(w, exc)
                log.warning("decode on %s failed: %s %s", w.id, exc.code, exc.details)
                last = exc
                if started or exc.code != grpc.StatusCode.UNAVAILABLE:
                    tries -= 1
                if started:
                    if not session.resume(self.detokenize):
                        raise errors.Unavailable(
                            f"decode worker {w.id} failed mid-stream: {exc.code.name}"
                        ) from exc
                    trace.retries.append(f"decode-resume:{w.id}")
            finally:
                w.inflight -= 1
                w.inflight_tokens -= pending
                session.unwatch()
                call.cancel()
        why = f"{last.code.name} {last.details}" if last is not None else "no worker"
        raise errors.Unavailable(f"decode failed on {len(tried)} worker(s): {why}")

    def _worker_error(self, w: Worker, exc: WorkerCallError) -> None:
        """Caller errors pass through; a busy worker (RESOURCE_EXHAUSTED) is tried elsewhere
        without counting against it; anything else counts against the worker's breaker."""
        if exc.code in _CALLER_CODES:
            raise errors.from_status(exc.code, exc.details or exc.code.name) from exc
        if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.pool.record_failure(w)


def _observe_phases(trace: Trace, t0: float) -> None:
    """Feeds PHASE from a finished request's timestamps (see its help for the phases)."""
    if not trace.first_token:
        return
    PHASE.labels("queue").observe(max(0.0, trace.admitted - t0))
    PHASE.labels("prefill").observe(max(0.0, trace.first_token - trace.admitted))
    if trace.prefill_end and trace.decode_first > trace.prefill_end:
        PHASE.labels("kv_transfer").observe(trace.decode_first - trace.prefill_end)
    PHASE.labels("decode").observe(max(0.0, t0 + trace.total_ms / 1000.0 - trace.first_token))


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("write-mode prefill failed after decode finished: %s", fut.exception())


@dataclass(eq=False)
class _AbortHandle:
    """A running generation as :meth:`Orchestrator.abort` sees it: the task consuming it,
    whether that task waits for its next chunk now, and whether an abort was asked."""

    task: asyncio.Task | None
    waiting: bool = False
    requested: bool = False


class _PrefillFailed(Exception):
    """Write mode: the parallel prefill failed everywhere, so no chunk will land."""


class _WriteRefused(Exception):
    """Write mode: the decode worker cannot take a write-mode handle (``_WRITE_REFUSALS``)."""

    def __init__(self, worker: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{worker}: {code.name} {details}")
        self.worker = worker
        self.code = code
        self.details = details


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise errors.DeadlineExceeded("request deadline passed")
    return left


def sampling_proto(s: Sampling) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.presence_penalty:
        p.presence_penalty = s.presence_penalty
    if s.frequency_penalty:
        p.frequency_penalty = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        p.repetition_penalty = s.repetition_penalty
    for token, bias in s.logit_bias:
        p.logit_bias[token] = bias
    p.stop_token_ids.extend(s.stop_token_ids)
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    p.json_object = s.json_object
    p.json_schema = s.json_schema
    return p
