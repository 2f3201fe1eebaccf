"""Place: which worker takes a request's next call. The policies (``policies/``) rank the
candidates; this stage asks the pool for the ones in rotation that were not tried yet and
applies the policy the plan calls for."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.router.policies import (
    ColocatedPlacement,
    DecodeChoice,
    PrefillPolicy,
    RouteContext,
)
from pdserve.services.router.workers import DECODE, PREFILL, Worker, WorkerPool


@dataclass
class Placer:
    pool: WorkerPool
    #: Prefill workers (read and write plans).
    prefill_policy: PrefillPolicy
    #: Decode workers of the read and write plans (the prompt's KV comes from the store).
    decode_choice: DecodeChoice
    #: Decode workers of the local plan (the worker prefills: cache and load aware).
    placement: ColocatedPlacement

    def prefill(self, ctx: RouteContext, tried: set[str]) -> Worker | None:
        """A prefill worker not in ``tried``; None when none is left in rotation."""
        cands = self.pool.candidates(PREFILL, tried)
        return self.prefill_policy.choose(cands, ctx) if cands else None

    def decode(
        self,
        tried: set[str],
        keys: list[str],
        *,
        local: RouteContext | None = None,
        chunk_size: int = 0,
    ) -> Worker | None:
        """A decode worker not in ``tried`` for a request with chain ``keys``: for the local
        plan (``local``: the prompt the worker prefills) the colocated placement, else the
        decode choice. The pick is recorded as holding ``keys`` (placement affinity). None
        when no worker is left in rotation."""
        cands = self.pool.candidates(DECODE, tried)
        if not cands:
            return None
        if local is not None:
            w = self.placement.choose(cands, local, keys, chunk_size)
        else:
            w = self.decode_choice.choose(cands)
        self.placement.record(w.id, keys)
        return w

    def prompt_work(self, w: Worker, ctx: RouteContext, keys: list[str], chunk_size: int) -> int:
        """Prompt tokens ``w`` computes for the request (its own prefix cache and the store
        discounted), counted on ``w`` until its first token: the queued work placement sees."""
        if self.placement.engines is None:
            return ctx.uncached_tokens
        return max(1, int(self.placement.own_tokens(w, ctx, keys, chunk_size)))
