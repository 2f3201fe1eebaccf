"""Cache-aware routing: the least expected cost, where

    cost(worker) = cache_weight * uncached prompt tokens + load_weight * queued prefill tokens

The cached length comes from the pooled store's longest-prefix answer (shared by every
worker), or from the worker's own prefix cache where that holds more (a stock engine's KV
events: :class:`EngineCaches`), so the uncached term is what this request will cost to
prefill there; the queued term is the prefill work already waiting on the worker: the
router's own in-flight uncached tokens, or the worker's reported queue times
``request_tokens`` when that is larger (other routers).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.services.router.engine_events import EngineCaches
from pdserve.services.router.policies.base import PickOrder, PrefillPolicy, RouteContext
from pdserve.services.router.workers import Worker


class CacheAware(PrefillPolicy):
    name = "cache_aware"

    def __init__(
        self,
        cache_weight: float = 1.0,
        load_weight: float = 1.0,
        request_tokens: float = 256.0,
        engines: EngineCaches | None = None,
    ) -> None:
        self.engines = engines
        self.cache_weight = cache_weight
        self.load_weight = load_weight
        self.request_tokens = request_tokens
        self._order = PickOrder()

    def queued_tokens(self, w: Worker) -> float:
        reported = (w.running + w.queue_length) * self.request_tokens
        return max(float(w.inflight_tokens), reported)

    def uncached_tokens(self, w: Worker, ctx: RouteContext) -> int:
        held = self.engines.cached_tokens(w, ctx) if self.engines is not None else None
        return ctx.prompt_tokens - max(ctx.cached_tokens, min(held or 0, ctx.prompt_tokens - 1))

    def cost(self, w: Worker, ctx: RouteContext) -> float:
        uncached = self.uncached_tokens(w, ctx)
        return self.cache_weight * uncached + self.load_weight * self.queued_tokens(w)

    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        # Ties (e.g. an idle cluster between sequential requests) go to the worker with fewer
        # requests now, then to the one this policy picked longest ago, then by id.
        w = min(workers, key=lambda w: (self.cost(w, ctx), w.load, self._order.rank(w.id), w.id))
        self._order.record(w.id)
        return w
