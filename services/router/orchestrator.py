"""Orchestrates one request across the workers (plain logic; the servicers call it).

Plans, chosen per request:
- read (default): Prefill on a prefill worker (retried once on another worker), then Decode
  on a decode worker with the returned KV handle; decode pulls the chunks from the store.
- write: Prefill (publishing each chunk as it is computed) and Decode start together. Decode
  gets the keys of the first ``(n - 1) // chunk_size`` full chunks, no first token, and
  ``chunk_wait_ms``: it loads each chunk as soon as it lands, computes the remaining prompt
  tokens itself and samples the first token. Prompts shorter than that run locally.
- local (colocated, conditional disaggregation): Decode without a KV handle; the decode worker
  prefills (reusing cached prefix chunks). Used when the mode is colocated, when no prefill
  worker is in rotation, when the uncached part of the prompt is below
  ``local_prefill_threshold``, and as the fallback when every prefill attempt failed.

Failures: worker errors other than the caller's own (invalid argument, deadline, cancel) count
against the worker's circuit breaker; a decode that fails before its first token is retried
once on another decode worker. Cancelling the consumer of :meth:`generate` (or its deadline)
cancels the worker calls, which frees their slots.
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
from pdserve.engines.base import Sampling
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.services.router.admission import Admission
from pdserve.services.router.fingerprint import FingerprintSource
from pdserve.services.router.policies import (
    ColocatedPlacement,
    DecodeChoice,
    PrefillPolicy,
    RouteContext,
)
from pdserve.services.router.request import GenRequest
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

#: Worker status codes that are the caller's fault or choice: passed through, never retried.
_CALLER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
}

PrefixLookup = Callable[[list[str]], Awaitable[int]]


@dataclass
class StreamChunk:
    """Tokens for the client; ``finish`` is set on the last chunk only."""

    token_ids: list[int]
    text: str
    times_ms: list[float]
    finish: int = common_pb2.FINISH_REASON_UNSPECIFIED
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Trace:
    """What happened to one request (for tests, logs and the overhead figure)."""

    plan: str = ""
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


class Orchestrator:
    def __init__(
        self,
        *,
        model: str,
        fingerprint: ModelFingerprint | FingerprintSource,
        pool: WorkerPool,
        policy: PrefillPolicy,
        admission: Admission,
        prefix_lookup: PrefixLookup | None = None,
        decode_choice: DecodeChoice | None = None,
        placement: ColocatedPlacement | None = None,
        detokenize: Callable[[list[int]], str] = lambda ids: "",
        default_mode: str = "read",
        local_prefill_threshold: int = 0,
        prefill_retries: int = 1,
        chunk_wait_ms: int = 30000,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.model = model
        self.fingerprints = (
            fingerprint
            if isinstance(fingerprint, FingerprintSource)
            else FingerprintSource.fixed(fingerprint)
        )
        self.pool = pool
        self.policy = policy
        self.admission = admission
        self.prefix_lookup = prefix_lookup
        self.decode_choice = decode_choice or DecodeChoice()
        self.placement = placement or ColocatedPlacement()
        self.detokenize = detokenize
        self.default_mode = default_mode
        self.local_prefill_threshold = local_prefill_threshold
        self.prefill_retries = prefill_retries
        self.chunk_wait_ms = chunk_wait_ms
        self.request_timeout_s = request_timeout_s
        #: Recent router overheads (ms), for the benchmark figure.
        self.overheads_ms: deque[float] = deque(maxlen=10000)
        self.traces: deque[Trace] = deque(maxlen=1000)

    @property
    def fp(self) -> ModelFingerprint | None:
        """The KV fingerprint agreed with the workers (None until one has registered)."""
        return self.fingerprints.current()

    async def cached_tokens(self, tokens: list[int]) -> tuple[list[str], int]:
        """Chain keys of the prompt's full chunks and how many prompt tokens the store holds."""
        fp = self.fp
        if fp is None:
            return [], 0
        keys = chunk_keys(fp, tokens)
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
        """Streams the request's tokens. Raises pdserve errors (mapped to status codes)."""
        t0 = time.monotonic()
        deadline = t0 + (timeout_s if timeout_s is not None else self.request_timeout_s)
        tokens = req.prompt_token_ids
        n = len(tokens)
        keys, cached = await self.cached_tokens(tokens)
        uncached = max(1, n - cached)
        mode = req.mode or self.default_mode
        n_prefill = len(self.pool.candidates(PREFILL))
        trace = Trace(cached_tokens=cached)
        plan = "local"
        chunk = self.fp.chunk_size if self.fp is not None else 0
        if mode == "write" and n_prefill and chunk and (n - 1) // chunk > 0:
            plan = "write"
        elif mode in ("read", "write") and n_prefill:
            below = self.local_prefill_threshold and uncached < self.local_prefill_threshold
            plan = "local" if below else "read"
        trace.plan = plan
        outcome = "error"
        async with self.admission.admit(uncached if plan != "local" else 0, n_prefill) as ticket:
            trace.admitted = time.monotonic()
            try:
                if plan == "read":
                    stream = self._read(req, keys, uncached, deadline, t0, trace)
                elif plan == "write":
                    stream = self._write(req, keys, uncached, deadline, t0, trace)
                else:
                    stream = self._local(req, keys, deadline, t0, trace)
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
                        self.admission.observe_ttft(uncached, now_ms)
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
                REQUESTS.labels(plan, outcome).inc()
                if outcome == "ok":
                    E2E.observe(trace.total_ms / 1000.0)
                    _observe_phases(trace, t0)
                    if trace.plan in ("read", "local"):
                        over = trace.total_ms - trace.prefill_worker_ms - trace.decode_worker_ms
                        trace.overhead_ms = over
                        OVERHEAD.observe(over)
                        self.overheads_ms.append(over)
                self.traces.append(trace)
                log.info("request %s %s %s", req.request_id, outcome, json.dumps(asdict(trace)))

    # --- plans ------------------------------------------------------------------------------

    async def _read(
        self,
        req: GenRequest,
        keys: list[str],
        uncached: int,
        deadline: float,
        t0: float,
        trace: Trace,
    ) -> AsyncIterator[StreamChunk]:
        resp = await self._prefill(req, uncached, deadline, trace, publish=False)
        if resp is None:  # every prefill attempt failed: the decode worker prefills itself
            trace.plan = "read->local"
            async for c in self._local(req, keys, deadline, t0, trace):
                yield c
            return
        n = len(req.prompt_token_ids)
        CACHED.labels("store").inc(resp.cached_tokens)  # prefill reports store + its own cache
        CACHED.labels("computed").inc(resp.computed_tokens)
        head = {"prompt_tokens": n, "cached_tokens": resp.cached_tokens}
        first = resp.first_token_id
        s = req.sampling
        if (resp.first_token_is_eos and not s.ignore_eos) or s.max_tokens == 1:
            finish = (
                common_pb2.FINISH_REASON_LENGTH
                if s.max_tokens == 1 and not (resp.first_token_is_eos and not s.ignore_eos)
                else common_pb2.FINISH_REASON_EOS
            )
            text = "" if finish == common_pb2.FINISH_REASON_EOS else self.detokenize([first])
            yield StreamChunk([first], text, [], finish, **head)
            return
        dreq = engine_pb2.DecodeRequest(
            request_id=req.request_id,
            model=self.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_proto(s),
            kv=resp.kv,
            first_token_id=first,
        )
        async for c in self._decode(dreq, deadline, trace, head, keys=keys):
            yield c

    async def _write(
        self,
        req: GenRequest,
        keys: list[str],
        uncached: int,
        deadline: float,
        t0: float,
        trace: Trace,
    ) -> AsyncIterator[StreamChunk]:
        n = len(req.prompt_token_ids)
        cs = self.fp.chunk_size
        k = (n - 1) // cs
        handle = common_pb2.KVHandle(
            chunk_keys=keys[:k],
            num_tokens=k * cs,
            chunk_size=cs,
            fingerprint=self.fp.digest(),
        )
        prefill = asyncio.ensure_future(self._prefill(req, uncached, deadline, trace, publish=True))
        dreq = engine_pb2.DecodeRequest(
            request_id=req.request_id,
            model=self.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_proto(req.sampling),
            kv=handle,
            chunk_wait_ms=self.chunk_wait_ms,
        )
        head = {"prompt_tokens": n, "cached_tokens": trace.cached_tokens}
        decode = self._decode(dreq, deadline, trace, head, keys=keys, abort_on=prefill)
        finished = False
        try:
            async for c in decode:
                yield c
            finished = True
        except _PrefillFailed:
            # No chunks are coming: do not let decode wait for them; it prefills itself.
            trace.plan = "write->local"
            async for c in self._local(req, keys, deadline, t0, trace):
                yield c
            finished = True
        finally:
            if finished:
                # Decode is done; a prefill still running only publishes chunks for reuse.
                prefill.add_done_callback(_retrieve)
            else:
                prefill.cancel()

    async def _local(
        self, req: GenRequest, keys: list[str], deadline: float, t0: float, trace: Trace
    ) -> AsyncIterator[StreamChunk]:
        dreq = engine_pb2.DecodeRequest(
            request_id=req.request_id,
            model=self.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_proto(req.sampling),
        )
        n = len(req.prompt_token_ids)
        head = {"prompt_tokens": n, "cached_tokens": -1}
        ctx = RouteContext(n, min(trace.cached_tokens, n - 1))
        chunk = self.fp.chunk_size if self.fp is not None else 0

        def place(cands: list[Worker]) -> Worker:
            return self.placement.choose(cands, ctx, keys, chunk)

        async for c in self._decode(
            dreq, deadline, trace, head, keys=keys, choose=place, prefill_tokens=ctx.uncached_tokens
        ):
            yield c

    # --- worker calls -----------------------------------------------------------------------

    async def _prefill(
        self, req: GenRequest, uncached: int, deadline: float, trace: Trace, *, publish: bool
    ) -> engine_pb2.PrefillResponse | None:
        """Prefill with retries on other workers; None when every attempt failed."""
        preq = engine_pb2.PrefillRequest(
            request_id=req.request_id,
            model=self.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_proto(req.sampling),
            publish_incrementally=publish,
        )
        ctx = RouteContext(len(req.prompt_token_ids), len(req.prompt_token_ids) - uncached)
        tried: set[str] = set()
        for attempt in range(1 + self.prefill_retries):
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
                resp = await w.prefill_stub().Prefill(preq, timeout=_remaining(deadline))
            except grpc.aio.AioRpcError as exc:
                self._worker_error(w, exc)
                log.warning("prefill on %s failed: %s %s", w.id, exc.code(), exc.details())
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
        dreq: engine_pb2.DecodeRequest,
        deadline: float,
        trace: Trace,
        head: dict[str, int],
        *,
        keys: list[str],
        abort_on: asyncio.Future | None = None,
        choose: Callable[[list[Worker]], Worker] | None = None,
        prefill_tokens: int = 0,
    ) -> AsyncIterator[StreamChunk]:
        """Streams from a decode worker (``choose``, else the decode choice), retrying once on
        another worker before the first token and resuming on another one after it.
        ``prefill_tokens`` is the prompt work the worker does before its first token (the local
        plan), counted on the worker until that token arrives, for placement."""
        tried: set[str] = set()
        last: grpc.aio.AioRpcError | None = None
        prompt = list(dreq.prompt_token_ids)
        emitted: list[int] = []  # tokens already streamed to the client, across attempts
        sent_text = ""  # their text as streamed
        pending_text = ""  # text the failed worker held back, owed to the client
        for attempt in range(2):
            cands = self.pool.candidates(DECODE, tried)
            if not cands:
                if attempt:
                    break
                raise errors.Unavailable("no decode worker is in rotation")
            w = choose(cands) if choose is not None else self.decode_choice.choose(cands)
            tried.add(w.id)
            self.placement.affinity.record(w.id, keys)
            if attempt:
                RETRIES.labels(DECODE).inc()
                trace.retries.append(f"decode:{w.id}")
            trace.decode_worker = w.id
            trace.decode_start = time.monotonic()
            call = w.decode_stub().Decode(dreq, timeout=_remaining(deadline))
            prefill_failed = False

            def on_prefill(fut: asyncio.Future, call=call) -> None:
                nonlocal prefill_failed
                if fut.cancelled() or fut.exception() is not None or fut.result() is None:
                    prefill_failed = True
                    call.cancel()

            if abort_on is not None:
                abort_on.add_done_callback(on_prefill)
            w.inflight += 1
            pending = prefill_tokens
            w.inflight_tokens += pending
            started = False
            # with a KV handle the worker's first message echoes prefill's first token
            echoes = 1 if dreq.HasField("first_token_id") else 0
            local_plan = not dreq.HasField("kv")
            try:
                async for resp in call:
                    if not started:
                        w.inflight_tokens -= pending
                        pending = 0
                    if not echoes and not trace.decode_first:
                        trace.decode_first = time.monotonic()
                    echoes = max(0, echoes - 1)
                    started = True
                    # Decode reports its prompt counts once, on the first message that knows
                    # them (torch: the first; vLLM: the last, from its KV connector).
                    if resp.loaded_tokens or resp.recomputed_tokens or resp.prefix_cached_tokens:
                        trace.decode_loaded = resp.loaded_tokens
                        trace.decode_recomputed = resp.recomputed_tokens
                        trace.decode_prefix_cached = resp.prefix_cached_tokens
                        if local_plan:  # the decode worker did the whole prompt
                            CACHED.labels("store").inc(resp.loaded_tokens)
                            CACHED.labels("prefix_cache").inc(resp.prefix_cached_tokens)
                            CACHED.labels("computed").inc(resp.recomputed_tokens)
                        if head.get("cached_tokens", 0) < 0:
                            head["cached_tokens"] = resp.loaded_tokens + resp.prefix_cached_tokens
                    elif head.get("cached_tokens", 0) < 0:
                        # not known yet: report what the store held at routing time
                        head["cached_tokens"] = trace.cached_tokens
                    if resp.token_times_ms:
                        trace.decode_worker_ms = resp.token_times_ms[-1]
                    text = pending_text + resp.text
                    pending_text = ""
                    emitted.extend(resp.token_ids)
                    sent_text += text
                    chunk = StreamChunk(list(resp.token_ids), text, [], resp.finish_reason)
                    if head:
                        chunk.prompt_tokens = head["prompt_tokens"]
                        chunk.cached_tokens = max(0, head["cached_tokens"])
                        head = {}
                    yield chunk
                self.pool.record_success(w)
                return
            except grpc.aio.AioRpcError as exc:
                if prefill_failed and exc.code() == grpc.StatusCode.CANCELLED:
                    raise _PrefillFailed() from exc
                self._worker_error(w, exc)
                log.warning("decode on %s failed: %s %s", w.id, exc.code(), exc.details())
                last = exc
                if started:
                    resumed = _resume(dreq, prompt, emitted)
                    if resumed is None:
                        raise errors.Unavailable(
                            f"decode worker {w.id} failed mid-stream: {exc.code().name}"
                        ) from exc
                    # Resume on another worker from the tokens already streamed: it prefills
                    # prompt + emitted (reusing stored chunks) and continues; greedy output
                    # is unchanged. Text the dead worker held back (a partial character) is
                    # re-derived from the tokens.
                    dreq = resumed
                    full = self.detokenize(emitted)
                    pending_text = full[len(sent_text) :] if full.startswith(sent_text) else ""
                    trace.retries.append(f"decode-resume:{w.id}")
            finally:
                w.inflight -= 1
                w.inflight_tokens -= pending
                if abort_on is not None:
                    abort_on.remove_done_callback(on_prefill)
                if not call.done():
                    call.cancel()
        why = f"{last.code().name} {last.details()}" if last is not None else "no worker"
        raise errors.Unavailable(f"decode failed on {len(tried)} worker(s): {why}")

    def _worker_error(self, w: Worker, exc: grpc.aio.AioRpcError) -> None:
        """Caller errors pass through; a busy worker (RESOURCE_EXHAUSTED) is tried elsewhere
        without counting against it; anything else counts against the worker's breaker."""
        code = exc.code()
        if code in _CALLER_CODES:
            raise errors.from_status(code, exc.details() or code.name) from exc
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.pool.record_failure(w)


def _resume(
    dreq: engine_pb2.DecodeRequest, prompt: list[int], emitted: list[int]
) -> engine_pb2.DecodeRequest | None:
    """The request that continues a generation after ``emitted`` tokens, or None when it
    cannot be resumed (no explicit max_tokens, or nothing left to generate)."""
    left = dreq.sampling.max_tokens - len(emitted)
    if dreq.sampling.max_tokens == 0 or left <= 0 or not emitted:
        return None
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(dreq.sampling)
    sampling.max_tokens = left
    return engine_pb2.DecodeRequest(
        request_id=dreq.request_id,
        model=dreq.model,
        prompt_token_ids=[*prompt, *emitted],
        sampling=sampling,
    )


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


class _PrefillFailed(Exception):
    """Write mode: the parallel prefill failed everywhere, so no chunk will land."""


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
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
    return p
