"""Admission control: a bounded queue in front of a number of in-flight requests, and optional
SLO targets. A request that cannot be served in time is refused at once with
RESOURCE_EXHAUSTED and a reason, instead of waiting forever.

The in-flight limit is ``max_inflight``, or with ``max_inflight`` 0 what the decode workers
can run: the sum of their ``max_num_seqs`` as they register it (``DEFAULT_INFLIGHT`` while none
has). Requests beyond it wait here, out of the workers' sight; a worker's scheduler can only
order (by deadline, by shared prefix, by priority) the requests it has, so the default hands
the workers as many as they can run. Waiting requests are let in by weighted fair queueing
across tenants (their ``share``) and by ``priority`` (lower first), then arrival, within a
tenant (:mod:`~pdserve.services.router.fair_queue`). Before it queues, a request passes its
tenant's rate limits (:mod:`~pdserve.services.router.rate_limit`).

Headroom: a tenant below its fair share of the slots (``limit * share / the shares of the
tenants holding or waiting for slots``) is not kept waiting for another tenant's requests to
end. When every slot is held, its request is admitted at once beyond the limit, up to
``fair_headroom`` extra slots in all (work-conserving: nothing running is preempted; the
flooding tenant gets the slots back as its requests end, since it is past its share and so
waits until in-flight requests are below the limit again). One tenant alone never uses it.
What a tenant uses is the slots it holds now, or with none of its requests waiting and
``USAGE_WINDOW_S`` of history, the lesser of those and what it held on average over the
last seconds (:meth:`Admission.used`: time-weighted, decaying over that window): a tenant
sending a tenth of the capacity at random holds 3 or 4 slots now and then, past a share of 2
of 4 slots, while its average stays near 0.4; counting what it holds kept such a burst
waiting for the flood's requests to end, 0.5-1 s (2026-12-07). A flood has requests waiting,
or no history yet: past its share from its first second. Each admitted request's engine
priority carries its tenant's rank, the whole fair shares of slots it uses
(:func:`~pdserve.services.router.fair_queue.engine_priority`), so the engine prefills a light
tenant's prompt (rank 0) before a flood's beyond its share (rank 1 and up).

Predictions come from what the router observed (EWMAs, so they follow the cluster's speed):
    predicted TTFT = base_ms + ms_per_prefill_token * (own uncached tokens
                     + prefill tokens already queued or running / prefill workers)
The TPOT target refuses new requests while the observed time per output token is above it.
Nothing is refused on a prediction before the first observation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from pdserve.errors import RateLimited, ResourceExhausted
from pdserve.services.router.fair_queue import FairQueue, engine_priority
from pdserve.services.router.rate_limit import RateLimits
from pdserve.telemetry import REGISTRY, init_labels
from pdserve.tenants import Tenants

#: Why admission control refuses a request (the ``reason`` label).
REASONS = ("queue_full", "slo_ttft", "slo_tpot", "rate_limit")
REJECTED = init_labels(
    Counter(
        "pdserve_router_rejected",
        "Requests refused by admission control",
        ["reason"],
        registry=REGISTRY,
    ),
    REASONS,
)
TENANT_QUEUED = Gauge(
    "pdserve_router_tenant_queued",
    "Requests waiting for admission, by tenant",
    ["tenant"],
    registry=REGISTRY,
)
TENANT_ADMITTED = Counter(
    "pdserve_router_tenant_admitted",
    "Requests admitted (given an in-flight slot), by tenant",
    ["tenant"],
    registry=REGISTRY,
)
TENANT_REJECTED = Counter(
    "pdserve_router_tenant_rejected",
    "Requests refused by admission control, by tenant and reason",
    ["tenant", "reason"],
    registry=REGISTRY,
)
TENANT_RATE_LIMITED = Counter(
    "pdserve_router_tenant_rate_limited",
    "Requests refused by a tenant's rate limit, by tenant and limit (requests, tokens)",
    ["tenant", "limit"],
    registry=REGISTRY,
)
QUEUED = Gauge("pdserve_router_queued", "Requests waiting for admission", registry=REGISTRY)
INFLIGHT = Gauge("pdserve_router_inflight", "Requests being orchestrated", registry=REGISTRY)
INFLIGHT_LIMIT = Gauge(
    "pdserve_router_inflight_limit",
    "Requests orchestrated at once before more wait (max_inflight, or the workers' capacity)",
    registry=REGISTRY,
)

#: The in-flight limit under ``max_inflight`` 0 until a decode worker reports its capacity.
DEFAULT_INFLIGHT = 64
#: Seconds over which a tenant's slots held are averaged (:meth:`Admission.used`): long next
#: to a request (a burst barely moves it), short next to a flood (which reaches its share
#: within seconds).
USAGE_WINDOW_S = 10.0


class Ewma:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


@dataclass
class _Use:
    """A tenant's slots over time (:meth:`Admission.used`)."""

    #: Slots held on average (time-weighted, decaying over USAGE_WINDOW_S) as of ``at``.
    average: float = 0.0
    at: float = 0.0
    #: Since when it has held slots with no pause of USAGE_WINDOW_S or more.
    active_since: float = 0.0
    #: When it last held none.
    idle_since: float = -math.inf

    def average_at(self, now: float, held: int) -> float:
        """The average at ``now``, having held ``held`` slots since ``at``."""
        return held + (self.average - held) * math.exp(-max(0.0, now - self.at) / USAGE_WINDOW_S)


class Admission:
    def __init__(
        self,
        max_inflight: int,
        max_queue: int,
        *,
        slo_ttft_ms: float = 0.0,
        slo_tpot_ms: float = 0.0,
        capacity: Callable[[], int] | None = None,
        tenants: Tenants | None = None,
        rates: RateLimits | None = None,
        fair_headroom: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_inflight`` 0: the limit is ``capacity()`` (requests the workers can run at
        once; 0 when unknown), read on every admission and release. ``tenants``: their shares
        and the per-tenant metrics' labels; ``rates``: their rate limits (None: none);
        ``fair_headroom``: slots beyond the limit for tenants below their share (0: none; the
        router's config defaults to 4); ``clock``: seconds, for the tenants' average use."""
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.fair_headroom = fair_headroom
        self.slo_ttft_ms = slo_ttft_ms
        self.slo_tpot_ms = slo_tpot_ms
        self._capacity = capacity
        tenants = tenants or Tenants()
        self._rates = rates
        self._share: Callable[[str], float] = lambda tenant: tenants.limits_of(tenant).share
        #: Requests waiting for a slot: each is woken with its slot taken, and its rank.
        self._slots: FairQueue[asyncio.Future[int]] = FairQueue(self._share)
        #: Slots held, by tenant (tenants holding none absent).
        self._held: dict[str, int] = {}
        self._clock = clock
        #: Per tenant, its slots over time (:meth:`used`).
        self._use: dict[str, _Use] = {}
        for name in tenants.names:  # "" = the anonymous tenant
            init_labels(TENANT_REJECTED, (name,), REASONS[:3])
            init_labels(TENANT_RATE_LIMITED, (name,), ("requests", "tokens"))
            TENANT_QUEUED.labels(name).set(0)
            TENANT_ADMITTED.labels(name)
        INFLIGHT_LIMIT.set(self.limit())
        self.waiting = 0
        self.inflight = 0
        #: Uncached prefill tokens of admitted-or-waiting requests not past their first token.
        self.pending_prefill_tokens = 0
        self.ms_per_token = Ewma()
        self.base_ms = Ewma()
        self.tpot_ms = Ewma()

    # --- observations -----------------------------------------------------------------------

    def observe_prefill(self, computed_tokens: int, worker_ms: float) -> None:
        if computed_tokens > 0 and worker_ms > 0:
            self.ms_per_token.add(worker_ms / computed_tokens)

    def observe_ttft(self, uncached_tokens: int, ttft_ms: float) -> None:
        per_token = self.ms_per_token.value or 0.0
        self.base_ms.add(max(0.0, ttft_ms - per_token * uncached_tokens))

    def observe_tpot(self, tpot_ms: float) -> None:
        self.tpot_ms.add(tpot_ms)

    # --- decisions --------------------------------------------------------------------------

    def limit(self) -> int:
        """Requests orchestrated at once (see the module docstring)."""
        if self.max_inflight > 0:
            return self.max_inflight
        known = self._capacity() if self._capacity is not None else 0
        return known if known > 0 else DEFAULT_INFLIGHT

    def fair_slots(self, tenant: str) -> float:
        """``tenant``'s fair share of the limit: ``limit * share`` over the shares of the
        tenants holding or waiting for slots, ``tenant`` included."""
        active = {*self._held, *self._slots.waiting_tenants(), tenant}
        return self.limit() * self._share(tenant) / sum(self._share(t) for t in active)

    def used(self, tenant: str) -> float:
        """The slots ``tenant`` uses: those it holds; for a tenant with none of its requests
        waiting that has held slots for ``USAGE_WINDOW_S`` without a pause that long, the
        lesser of those and its average over the last seconds (held slots, time-weighted, the
        past decaying by ``e^(-age / USAGE_WINDOW_S)``). A tenant with requests waiting wants
        more than it gets: its average is what the queue let through, not its demand; a
        tenant that has just begun has no average yet (a flood's first second, before any of
        its requests waits, would have taken the headroom)."""
        held = self._held.get(tenant, 0)
        use = self._use.get(tenant)
        now = self._clock()
        if use is None or self._slots.queued(tenant) or now - use.active_since < USAGE_WINDOW_S:
            return held
        return min(held, use.average_at(now, held))

    def _note(self, tenant: str, change: int) -> None:
        """Records that ``tenant``'s slots held change by ``change`` now."""
        held = self._held.get(tenant, 0)
        now = self._clock()
        use = self._use.setdefault(tenant, _Use())
        use.average, use.at = use.average_at(now, held), now
        if held == 0 and change > 0 and now - use.idle_since >= USAGE_WINDOW_S:
            use.active_since = now
        elif held + change == 0:
            use.idle_since = now

    def below_share(self, tenant: str) -> bool:
        """Whether another tenant holds or waits for slots and ``tenant`` uses fewer than its
        fair share (:meth:`used`): headroom is for it."""
        contended = any(t != tenant for t in (*self._held, *self._slots.waiting_tenants()))
        return contended and self.used(tenant) < self.fair_slots(tenant)

    def predicted_ttft_ms(self, uncached_tokens: int, prefill_workers: int) -> float | None:
        if self.ms_per_token.value is None or self.base_ms.value is None:
            return None
        queued = self.pending_prefill_tokens / max(1, prefill_workers)
        return self.base_ms.value + self.ms_per_token.value * (uncached_tokens + queued)

    def check(
        self, uncached_tokens: int, prefill_workers: int, tenant: str = "", prompt_tokens: int = 0
    ) -> None:
        """Raises ResourceExhausted with the reason when ``tenant``'s request should be
        refused: a full queue, an SLO, then the tenant's rate limits (RateLimited; they count
        the request only when it passes)."""
        refusal = self._refusal(uncached_tokens, prefill_workers, tenant)
        if refusal is not None:
            reason, message = refusal
            REJECTED.labels(reason).inc()
            TENANT_REJECTED.labels(tenant, reason).inc()
            raise ResourceExhausted(message)
        if self._rates is None:
            return
        try:
            self._rates.check(tenant, prompt_tokens)
        except RateLimited as exc:
            REJECTED.labels("rate_limit").inc()
            TENANT_RATE_LIMITED.labels(tenant, exc.limit).inc()
            raise

    def _refusal(
        self, uncached_tokens: int, prefill_workers: int, tenant: str
    ) -> tuple[str, str] | None:
        """(reason, message) of the admission refusal that applies now to ``tenant``'s
        request, None for none. ``max_queue`` bounds each tenant's waiting requests: a tenant
        that floods fills its own queue, never another's."""
        queued = self._slots.queued(tenant)
        if self.inflight >= self.limit() and queued >= self.max_queue:
            whose = f" of tenant {tenant!r}" if tenant else ""
            return "queue_full", (
                f"queue full: {queued} requests{whose} waiting (max_queue={self.max_queue})"
            )
        if self.slo_ttft_ms > 0:
            pred = self.predicted_ttft_ms(uncached_tokens, prefill_workers)
            if pred is not None and pred > self.slo_ttft_ms:
                return "slo_ttft", (
                    f"predicted time to first token {pred:.0f} ms exceeds the SLO of "
                    f"{self.slo_ttft_ms:.0f} ms ({self.pending_prefill_tokens} prefill tokens "
                    f"queued)"
                )
        if self.slo_tpot_ms > 0 and self.inflight > 0:
            tpot = self.tpot_ms.value
            if tpot is not None and tpot > self.slo_tpot_ms:
                return "slo_tpot", (
                    f"time per output token is {tpot:.1f} ms, above the SLO of "
                    f"{self.slo_tpot_ms:.1f} ms, with {self.inflight} requests running"
                )
        return None

    @contextlib.asynccontextmanager
    async def admit(
        self,
        uncached_tokens: int,
        prefill_workers: int,
        *,
        tenant: str = "",
        priority: int = 0,
        prompt_tokens: int = 0,
    ) -> AsyncIterator[Ticket]:
        """Checks (:meth:`check`), then waits for an in-flight slot, in ``tenant``'s turn and
        at ``priority`` (lower first) among its own; the ticket's ``first_token()`` marks the
        end of its prefill work for the TTFT prediction."""
        self.check(uncached_tokens, prefill_workers, tenant, prompt_tokens)
        ticket = Ticket(self, uncached_tokens)
        self.pending_prefill_tokens += uncached_tokens
        self.waiting += 1
        QUEUED.set(self.waiting)
        try:
            ticket.engine_priority = engine_priority(priority, await self._slot(tenant, priority))
        except BaseException:
            ticket.first_token()
            raise
        finally:
            self.waiting -= 1
            QUEUED.set(self.waiting)
        try:
            yield ticket
        finally:
            ticket.first_token()
            self._release(tenant)

    async def _slot(self, tenant: str, priority: int) -> int:
        """Takes an in-flight slot, at once if one is free to ``tenant`` (:meth:`_free_now`),
        else in turn; returns the tenant's rank as it took it (:meth:`_take`)."""
        if self._free_now(tenant):
            self._slots.charge(tenant)
            return self._take(tenant)
        granted = asyncio.get_running_loop().create_future()
        self._slots.push(tenant, granted, priority)
        TENANT_QUEUED.labels(tenant).set(self._slots.queued(tenant))
        try:
            return await granted
        except BaseException:
            if granted.done() and not granted.cancelled():  # its slot came with the cancel
                self._release(tenant)
            elif self._slots.remove(granted):
                TENANT_QUEUED.labels(tenant).set(self._slots.queued(tenant))
                self.wake()  # one that queued behind it while a slot was free goes now
            raise

    def _free_now(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` arriving now takes a slot without queueing: one is
        free and nobody waits, or the tenant is below its share with none of its own waiting
        and headroom is left (the module docstring)."""
        limit = self.limit()
        if not self._slots and self.inflight < limit:
            return True
        return (
            self.inflight < limit + self.fair_headroom
            and not self._slots.queued(tenant)
            and self.below_share(tenant)
        )

    def _take(self, tenant: str) -> int:
        """Gives ``tenant`` a slot; returns its rank before it (the engine priority's
        tiebreak): the fair shares of slots it uses, ``used // fair_slots``."""
        rank = int(self.used(tenant) // self.fair_slots(tenant))
        self._note(tenant, +1)
        self._held[tenant] = self._held.get(tenant, 0) + 1
        self.inflight += 1
        INFLIGHT.set(self.inflight)
        TENANT_ADMITTED.labels(tenant).inc()
        return rank

    def _release(self, tenant: str) -> None:
        self._note(tenant, -1)
        held = self._held[tenant] - 1
        if held:
            self._held[tenant] = held
        else:
            del self._held[tenant]
        self.inflight -= 1
        INFLIGHT.set(self.inflight)
        self.wake()

    def wake(self) -> None:
        """Hands free slots to the waiting requests, in the fair queue's order, then the
        headroom to waiting tenants below their share; called on every release and whenever
        the workers' capacity changes."""
        limit = self.limit()
        INFLIGHT_LIMIT.set(limit)
        while self._slots:
            if self.inflight < limit:
                tenant, granted = self._slots.pop()
            elif self.inflight < limit + self.fair_headroom and (
                (light := self._slots.peek_tenant(self.below_share)) is not None
            ):
                tenant, granted = self._slots.pop(light)
            else:
                break
            TENANT_QUEUED.labels(tenant).set(self._slots.queued(tenant))
            if not granted.done():  # a cancelled one is on its way out
                granted.set_result(self._take(tenant))


class Ticket:
    def __init__(self, admission: Admission, tokens: int) -> None:
        self._adm = admission
        self._tokens = tokens
        #: The priority the engine gets (:func:`~pdserve.services.router.fair_queue.
        #: engine_priority`), set when the request is admitted.
        self.engine_priority = 0

    def first_token(self) -> None:
        """Idempotent: this request's prefill tokens are no longer pending."""
        self._adm.pending_prefill_tokens -= self._tokens
        self._tokens = 0
