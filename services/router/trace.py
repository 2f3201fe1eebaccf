"""What happened to one request (:class:`Trace`) and the router's request metrics fed from it:
outcomes by plan, retries, time to first token, latency, the router's own overhead, prompt
tokens by source and the time of each phase."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Histogram

from pdserve import tracing
from pdserve.services.router.plan import Plan
from pdserve.services.router.workers import DECODE, PREFILL
from pdserve.telemetry import REGISTRY, init_labels

T = TypeVar("T")

_MS_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 25, 50, 100, 250, 500, 1000, 2500, 5000)
_S_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REQUESTS = Counter(
    "pdserve_router_requests",
    "Requests by plan and outcome",
    ["plan", "outcome"],
    registry=REGISTRY,
)
RETRIES = init_labels(
    Counter(
        "pdserve_router_retries",
        "Worker calls retried on another worker",
        ["role"],
        registry=REGISTRY,
    ),
    (PREFILL, DECODE),
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


@dataclass
class Trace:
    """What happened to one request (for tests, logs and the overhead figure)."""

    plan: Plan
    #: The tenant whose key sent it ("" = the anonymous tenant).
    tenant: str = ""
    #: When the router took the request (``time.monotonic()``, as every timestamp here).
    received: float = 0.0
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
    #: Prompt tokens the prefill worker did not compute (the store's, its own prefix cache's).
    prefill_cached: int = 0
    #: Prompt tokens the decode worker loaded from the store / computed itself / found in its
    #: own prefix cache.
    decode_loaded: int = 0
    decode_recomputed: int = 0
    decode_prefix_cached: int = 0
    total_ms: float = 0.0
    overhead_ms: float = -1.0
    retries: list[str] = field(default_factory=list)


def observe_phases(trace: Trace, t0: float) -> None:
    """Feeds PHASE from a finished request's timestamps (see its help for the phases)."""
    if not trace.first_token:
        return
    PHASE.labels("queue").observe(max(0.0, trace.admitted - t0))
    PHASE.labels("prefill").observe(max(0.0, trace.first_token - trace.admitted))
    if trace.prefill_end and trace.decode_first > trace.prefill_end:
        PHASE.labels("kv_transfer").observe(trace.decode_first - trace.prefill_end)
    PHASE.labels("decode").observe(max(0.0, t0 + trace.total_ms / 1000.0 - trace.first_token))


def record_outcome(trace: Trace, plan: Plan, outcome: str, t0: float) -> float | None:
    """Feeds the request metrics from a request that started at ``t0`` with ``plan`` (its
    label, whatever fallback ``trace.plan`` shows) and ended with ``outcome`` (``ok``,
    ``error`` or ``cancelled``); sets ``trace.overhead_ms`` when it ended well on the read or
    the local plan (the router's time: the total less the times the workers reported), and
    returns it (None when not set)."""
    REQUESTS.labels(plan.value, outcome).inc()
    if outcome != "ok":
        return None
    E2E.observe(trace.total_ms / 1000.0)
    observe_phases(trace, t0)
    if trace.plan in (Plan.READ, Plan.LOCAL):
        trace.overhead_ms = trace.total_ms - trace.prefill_worker_ms - trace.decode_worker_ms
        OVERHEAD.observe(trace.overhead_ms)
        return trace.overhead_ms
    return None


def traced(request_id: str, prompt_tokens: int, inner: AsyncIterator[T]) -> AsyncIterator[T]:
    """``inner`` (a request's chunks) inside its span ``pdserve.request``, the current span
    while it runs, so that the workers' and the store's spans join it (:mod:`pdserve.tracing`;
    the caller's trace when it sent one); ``inner`` as it is while tracing is off. Its
    attributes and phases are set as it ends (:func:`end_span`)."""
    if not tracing.enabled():
        return inner
    return _traced(request_id, prompt_tokens, inner)


async def _traced(request_id: str, prompt_tokens: int, inner: AsyncIterator[Any]) -> Any:
    attrs = {"pdserve.request_id": request_id, "pdserve.prompt_tokens": prompt_tokens}
    with tracing.span("pdserve.request", attrs, kind=SpanKind.SERVER):
        async with contextlib.aclosing(inner) as items:  # type: ignore[type-var]
            async for item in items:
                yield item


def end_span(trace: Trace, outcome: str, t0: float) -> None:
    """Sets the request span's attributes from ``trace`` and records its phases as child
    spans (the intervals of PHASE, :func:`observe_phases`; nothing while tracing is off)."""
    if not tracing.enabled():
        return
    tracing.annotate(
        {
            "pdserve.plan": trace.plan.value,
            "pdserve.outcome": outcome,
            "pdserve.cached_tokens": trace.cached_tokens,
            "pdserve.prefill_worker": trace.prefill_worker,
            "pdserve.decode_worker": trace.decode_worker,
            "pdserve.decode_loaded_tokens": trace.decode_loaded,
            "pdserve.retries": len(trace.retries),
        }
    )
    end = t0 + trace.total_ms / 1000.0
    tracing.record("pdserve.phase.queue", t0, trace.admitted or end)
    if not trace.first_token:
        return
    tracing.record("pdserve.phase.prefill", trace.admitted, trace.first_token)
    if trace.prefill_end and trace.decode_first > trace.prefill_end:
        tracing.record("pdserve.phase.kv_transfer", trace.prefill_end, trace.decode_first)
    tracing.record("pdserve.phase.decode", trace.first_token, end)
