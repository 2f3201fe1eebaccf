"""Placement of a request whose worker prefills it locally (the local plan: colocated
serving, conditional disaggregation, fallback): the worker where its first token is expected
soonest.

    cost(w) = prompt tokens w must compute
            + store_load_weight * tokens w loads from the pooled store
            + prefill tokens already waiting on w
            + stream_tokens * requests streaming on w

Tokens ``w`` holds in its own prefix cache cost nothing (what its KV events say, for a stock
engine that publishes them: :class:`EngineCaches`; else the router's own picks,
:class:`PrefixAffinity`), tokens the
store holds cost a fraction of computing them (a memcpy-speed load instead of a forward pass),
and the waiting term is the router's own not-yet-first-token prompt work on ``w`` (fresh), or
its reported queue times ``request_tokens`` when that is larger (other routers' requests).
Each stream the router has on ``w`` adds ``stream_tokens``: decodes share every engine step.
Compared with round robin over separate engines this sends a request to the worker that
already holds its prefix unless that worker is busier by more than the prefix is worth, and
it never queues behind a long prompt while another core idles.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.services.router.engine_events import EngineCaches
from pdserve.services.router.policies.affinity import PrefixAffinity
from pdserve.services.router.policies.base import PickOrder, RouteContext
from pdserve.services.router.workers import Worker


class ColocatedPlacement:
    def __init__(
        self,
        affinity: PrefixAffinity | None = None,
        *,
        store_load_weight: float = 0.05,
        request_tokens: float = 256.0,
        stream_tokens: float = 8.0,
        engines: EngineCaches | None = None,
    ) -> None:
        self.affinity = affinity or PrefixAffinity()
        self.engines = engines
        self._order = PickOrder()
        self.store_load_weight = store_load_weight
        self.request_tokens = request_tokens
        self.stream_tokens = stream_tokens

    def queued_tokens(self, w: Worker) -> float:
        return max(float(w.inflight_tokens), w.queue_length * self.request_tokens)

    def own_tokens(self, w: Worker, ctx: RouteContext, keys: Sequence[str], chunk: int) -> float:
        """What the request itself costs on ``w``, in prompt tokens computed."""
        held = self.engines.cached_tokens(w, ctx) if self.engines is not None else None
        if held is None:
            held = self.affinity.longest(w.id, keys) * chunk
        local = min(ctx.prompt_tokens - 1, held)
        stored = max(0, ctx.cached_tokens - local)
        computed = ctx.prompt_tokens - max(local, ctx.cached_tokens)
        return computed + self.store_load_weight * stored

    def cost(self, w: Worker, ctx: RouteContext, keys: Sequence[str], chunk: int) -> float:
        return (
            self.own_tokens(w, ctx, keys, chunk)
            + self.queued_tokens(w)
            + self.stream_tokens * w.inflight
        )

    def choose(
        self, workers: Sequence[Worker], ctx: RouteContext, keys: Sequence[str], chunk: int
    ) -> Worker:
        """Contract: ``workers`` is non-empty; returns one of them; mutates nothing. Ties (an
        idle cluster, a prompt no worker holds) go to the worker with fewer requests now, then
        to the one picked longest ago (:meth:`record`): new prefixes spread over the workers
        instead of all starting on the first."""
        return min(
            workers,
            key=lambda w: (
                self.cost(w, ctx, keys, chunk),
                w.load,
                self._order.rank(w.id),
                w.id,
            ),
        )

    def record(self, worker_id: str, keys: Sequence[str]) -> None:
        """``worker_id`` takes the request with chain ``keys`` (the router's picks)."""
        self.affinity.record(worker_id, keys)
        self._order.record(worker_id)
