"""The router's view of the workers: who is there (static lists or meta discovery), their live
load (meta heartbeats plus the router's own in-flight counts), channels, a circuit breaker
that takes a repeatedly failing worker out of rotation until a health probe says it is back,
and the refusal of workers whose registered KV fingerprint is not the cluster's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter, Gauge

from pdserve import grpcutil
from pdserve.enums import ROLE
from pdserve.services.meta.access import one_worker
from pdserve.telemetry import REGISTRY, init_labels
from pdserve.v1 import common_pb2, engine_pb2_grpc, meta_pb2

log = logging.getLogger(__name__)

#: The worker roles, spelled as the Role enum's table spells them (the keys of
#: ``WorkerPool.workers``).
PREFILL = ROLE.names[common_pb2.ROLE_PREFILL]
DECODE = ROLE.names[common_pb2.ROLE_DECODE]

BREAKER_TRIPS = Counter(
    "pdserve_router_breaker_trips", "Workers taken out of rotation", ["role"], registry=REGISTRY
)
WORKERS = Gauge(
    "pdserve_router_workers", "Workers in rotation", ["role", "model"], registry=REGISTRY
)
WORKER_LOAD = Gauge(
    "pdserve_router_worker_load",
    "Requests queued or running on each worker as the router places by them: the fresher of "
    "the worker's last report through meta and the router's own requests on it",
    ["role", "worker"],
    registry=REGISTRY,
)
REFUSED = Counter(
    "pdserve_router_refused_workers",
    "Workers refused (kept out of placement) because their registered KV fingerprint differs "
    "from the cluster's, counted once per worker and reason",
    ["role"],
    registry=REGISTRY,
)
init_labels(BREAKER_TRIPS, (PREFILL, DECODE))
init_labels(REFUSED, (PREFILL, DECODE))


@dataclass
class Worker:
    """One prefill or decode worker as the router sees it."""

    id: str
    address: str
    role: str
    max_running: int = 0
    #: Last load reported to meta (may lag by a heartbeat).
    queue_length: int = 0
    running: int = 0
    kv_usage: float = 0.0
    #: What the worker registered about itself (``services/worker.py``,
    #: ``registration_labels``: engine, KV fingerprint and its fields, limits).
    labels: dict[str, str] = field(default_factory=dict)
    #: The identity that registered it in meta (``worker:decode-0``; "" without TLS): with TLS
    #: the router talks to it only if its server presents that identity's certificate.
    owner: str = ""
    #: Why the worker gets no work ("" = it may): its KV fingerprint is not the cluster's.
    refused: str = ""
    #: The router's own requests on this worker now, and their uncached prefill tokens.
    inflight: int = 0
    inflight_tokens: int = 0
    #: Circuit breaker: consecutive failures; broken while ``open_until`` > 0.
    failures: int = 0
    open_until: float = 0.0
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)

    @property
    def load(self) -> int:
        """Requests queued or running: the fresher of meta's report and our own count."""
        return max(self.running + self.queue_length, self.inflight)

    @property
    def broken(self) -> bool:
        return self.open_until > 0

    @property
    def http(self) -> bool:
        """A stock ``vllm serve`` at an ``http://`` URL (services/router/http_worker_client.py),
        not a pdserve worker's gRPC address."""
        return self.address.startswith(("http://", "https://"))

    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            role, _, name = self.owner.partition(":")
            expect = name if role == "worker" else ""
            self._channel = grpcutil.channel(self.address, server_name=expect)
        return self._channel

    def prefill_stub(self) -> engine_pb2_grpc.PrefillServiceStub:
        return engine_pb2_grpc.PrefillServiceStub(self.channel())

    def decode_stub(self) -> engine_pb2_grpc.DecodeServiceStub:
        return engine_pb2_grpc.DecodeServiceStub(self.channel())

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class WorkerPool:
    """Workers by role. Plain state plus two optional background loops (meta watch, probes)."""

    def __init__(
        self, *, model: str = "", breaker_failures: int = 3, breaker_cooldown_s: float = 5.0
    ) -> None:
        self.model = model
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self.workers: dict[str, dict[str, Worker]] = {PREFILL: {}, DECODE: {}}
        #: Given every worker's labels, why each must get no work ("" = it may):
        #: ``FingerprintSource.refusals``, set by the router; checked on every meta update.
        self.refusals: Callable[[Sequence[Mapping[str, str]]], list[str]] | None = None
        #: Called after every change of membership, capacity or health (the router's admission
        #: control: its in-flight limit may follow the workers' capacity).
        self.on_change: Callable[[], None] | None = None

    # --- membership -------------------------------------------------------------------------

    def add_static(self, role: str, addresses: list[str]) -> None:
        for addr in addresses:
            w = self.workers[role][f"{role}@{addr}"] = Worker(f"{role}@{addr}", addr, role)
            _watch(w)
        self._changed()

    def apply(self, event_type: int, inst: meta_pb2.Instance) -> None:
        """Applies one meta InstanceEvent (JOINED / UPDATED / LEFT)."""
        self._apply(event_type, inst)
        self._check_refusals()

    def _apply(self, event_type: int, inst: meta_pb2.Instance) -> None:
        role = ROLE.names.get(inst.role)
        if role not in self.workers or (self.model and inst.model and inst.model != self.model):
            return
        table = self.workers[role]
        if event_type == meta_pb2.INSTANCE_EVENT_LEFT:
            gone = table.pop(inst.instance_id, None)
            if gone is not None:
                _unwatch(gone)
                asyncio.get_event_loop().create_task(gone.close())
        else:
            w = table.get(inst.instance_id)
            if w is None or (w.address, w.owner) != (inst.address, inst.owner):
                if w is not None:
                    asyncio.get_event_loop().create_task(w.close())
                w = Worker(inst.instance_id, inst.address, role, owner=inst.owner)
                table[inst.instance_id] = w
                _watch(w)
            w.max_running = inst.max_running
            w.labels = dict(inst.labels)
            w.queue_length = inst.load.queue_length
            w.running = inst.load.running_requests
            w.kv_usage = inst.load.kv_usage

    def candidates(self, role: str, exclude: set[str] | None = None) -> list[Worker]:
        """Workers of ``role`` in rotation (breaker closed, not refused), minus ``exclude``,
        one per worker identity: placement spreads by identity, not by instance. Of several
        instances whose owner names one worker (``worker:decode-0``, which meta lets hold one
        by default: services/meta/caps.py) only the one with the lowest id (``decode-0`` before
        ``decode-0-b``) is a candidate, and none once one of them is in ``exclude``, so a
        certificate that registered a second instance gets no second share of the requests
        (issue 56). Not the least loaded: each instance counts only its own load, so the
        identity would still take two shares. Workers without an owner (no TLS, static) and
        those of a pool's shared certificate (``worker:decode``) count one each."""
        table, exclude = self.workers[role], exclude or set()
        tried = {table[i].owner for i in exclude if i in table}
        found: list[Worker] = []
        slot: dict[str, int] = {}  # owner naming one worker -> its place in ``found``
        for w in table.values():
            if w.broken or w.refused or w.id in exclude:
                continue
            if not one_worker(w.owner):
                found.append(w)
            elif w.owner in tried:
                continue
            elif w.owner not in slot:
                slot[w.owner] = len(found)
                found.append(w)
            elif w.id < found[slot[w.owner]].id:
                found[slot[w.owner]] = w
        return found

    def count(self, role: str) -> int:
        return len(self.workers[role])

    def registered_labels(self) -> list[dict[str, str]]:
        """The labels of every worker that registered some (meta workers, refused included)."""
        return [w.labels for table in self.workers.values() for w in table.values() if w.labels]

    def label_values(self, name: str) -> set[str]:
        """The values workers of any role that are not refused registered for label ``name``
        (empty when none)."""
        return {
            w.labels[name]
            for table in self.workers.values()
            for w in table.values()
            if name in w.labels and not w.refused
        }

    def refused(self) -> list[Worker]:
        return [w for table in self.workers.values() for w in table.values() if w.refused]

    def _check_refusals(self) -> None:
        """Marks the workers to refuse; logs and counts each (worker, reason) once."""
        if self.refusals is not None:
            workers = [w for table in self.workers.values() for w in table.values()]
            for w, reason in zip(workers, self.refusals([w.labels for w in workers]), strict=True):
                if reason and reason != w.refused:
                    REFUSED.labels(w.role).inc()
                    log.warning(
                        "worker %s (%s) refused: %s; it gets no work", w.id, w.address, reason
                    )
                elif w.refused and not reason:
                    log.info("worker %s (%s) accepted: its KV fingerprint matches", w.id, w.address)
                w.refused = reason
        self._changed()

    # --- circuit breaker --------------------------------------------------------------------

    def record_success(self, w: Worker) -> None:
        w.failures = 0

    def record_failure(self, w: Worker) -> None:
        w.failures += 1
        if w.failures >= self.breaker_failures and not w.broken:
            w.open_until = time.monotonic() + self.breaker_cooldown_s
            BREAKER_TRIPS.labels(w.role).inc()
            log.warning(
                "worker %s (%s) out of rotation after %d failures", w.id, w.address, w.failures
            )
            self._changed()

    async def probe_once(self) -> None:
        """Health-checks broken workers whose cooldown passed; SERVING puts them back."""
        now = time.monotonic()
        for table in self.workers.values():
            for w in list(table.values()):
                if w.broken and w.open_until <= now:
                    if await _healthy(w):
                        w.failures = 0
                        w.open_until = 0.0
                        log.info("worker %s (%s) back in rotation", w.id, w.address)
                    else:
                        w.open_until = time.monotonic() + self.breaker_cooldown_s
        self._changed()

    async def probe_loop(self, stop: asyncio.Event, period_s: float = 0.5) -> None:
        while not stop.is_set():
            await self.probe_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)

    # --- discovery --------------------------------------------------------------------------

    def sync(self, instances: list[meta_pb2.Instance]) -> None:
        """Makes membership and load match meta's current instances (joins, updates, leaves).
        Static workers (ids ``role@address``) are left alone."""
        present = set()
        for inst in instances:
            if ROLE.names.get(inst.role) in self.workers:
                self._apply(meta_pb2.INSTANCE_EVENT_UPDATED, inst)
                present.add(inst.instance_id)
        for role, table in self.workers.items():
            for wid in list(table):
                if wid not in present and not wid.startswith(f"{role}@"):
                    self._apply(
                        meta_pb2.INSTANCE_EVENT_LEFT,
                        meta_pb2.Instance(instance_id=wid, role=ROLE.values[role]),
                    )
        self._check_refusals()

    async def watch_meta(
        self, meta_address: str, stop: asyncio.Event, period_s: float = 0.2
    ) -> None:
        """Keeps the pool in step with pdserve.discovery's watch-updated cache of meta: on
        every change (joins, leaves, load updates), and every ``period_s`` at the latest."""
        from pdserve.discovery import Discovery

        disc = Discovery(meta_address, model=self.model)
        await disc.start()
        try:
            while not stop.is_set():
                self.sync(disc.instances())
                await disc.next_change(period_s)
        finally:
            await disc.close()

    async def close(self) -> None:
        for table in self.workers.values():
            for w in table.values():
                await w.close()

    def decode_capacity(self) -> int:
        """Requests the decode workers in rotation (one per identity: :meth:`candidates`) can
        run at once: their ``max_num_seqs`` summed (0 when none reported it, as static workers
        do not)."""
        return sum(w.max_running for w in self.candidates(DECODE))

    def _changed(self) -> None:
        """Membership, capacity or health changed: the gauges, then ``on_change``."""
        for role, table in self.workers.items():
            WORKERS.labels(role, self.model).set(
                sum(1 for w in table.values() if not w.broken and not w.refused)
            )
        if self.on_change is not None:
            self.on_change()


def _watch(w: Worker) -> None:
    """The worker's load on ``/metrics``, read at each scrape."""
    WORKER_LOAD.labels(w.role, w.id).set_function(lambda: w.load)


def _unwatch(w: Worker) -> None:
    with contextlib.suppress(KeyError):
        WORKER_LOAD.remove(w.role, w.id)


async def _healthy(w: Worker, timeout: float = 1.0) -> bool:
    """gRPC health of a pdserve worker; for an ``http://`` one (stock vLLM), whether its
    ``GET /health`` answers 200."""
    if not w.http:
        return await grpcutil.check_health(w.address, timeout=timeout)
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(f"{w.address}/health") as resp,
        ):
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
