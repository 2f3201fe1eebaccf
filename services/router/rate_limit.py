"""Per-tenant rate limits: requests per second and prompt tokens per second (``rps=`` and
``tps=`` in the tenants file, :mod:`pdserve.tenants`), each a token bucket.

A bucket fills at its rate up to one second's worth (at least one unit: ``rps=0.5`` lets a
request through every two seconds, none in a burst). A request passes when every bucket of
its tenant holds what it costs, or a whole bucket when it costs more than that (a prompt
longer than ``tps``): it then takes its whole cost, and a bucket may go into debt, which the
tenant's next requests wait out. A request that does not pass takes nothing and is refused
with :class:`~pdserve.errors.RateLimited`, which names the limit and when a retry can pass
(the wait until every bucket will hold enough again): HTTP 429 with ``Retry-After``, gRPC
RESOURCE_EXHAUSTED with the trailing metadata ``retry-after``.

Plain logic with an injectable clock; the admission control
(:mod:`~pdserve.services.router.admission`) checks each request before it queues.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import RateLimited
from pdserve.tenants import Tenants


@dataclass
class TokenBucket:
    """``rate`` units a second, up to ``capacity``; ``level`` as of ``stamp`` (clock seconds)."""

    rate: float
    capacity: float
    level: float
    stamp: float

    @classmethod
    def per_second(cls, rate: float, now: float) -> TokenBucket:
        """A full bucket of ``rate`` a second holding one second's worth (at least 1)."""
        capacity = max(1.0, rate)
        return cls(rate, capacity, capacity, now)

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until the bucket holds ``cost`` (or is full, for a cost above capacity);
        0 when it does now."""
        self._refill(now)
        need = min(cost, self.capacity)
        return max(0.0, (need - self.level) / self.rate)

    def take(self, cost: float, now: float) -> None:
        """Takes ``cost`` (the level may go below 0: a debt)."""
        self._refill(now)
        self.level -= cost

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now


class RateLimits:
    """Each tenant's buckets, made on its first request from ``tenants``' options."""

    def __init__(self, tenants: Tenants, clock: Callable[[], float] = time.monotonic) -> None:
        self._tenants = tenants
        self._clock = clock
        self._buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}

    def check(self, tenant: str, prompt_tokens: int) -> None:
        """Counts one request of ``tenant`` with ``prompt_tokens``; RateLimited (taking
        nothing) when a limit refuses it, its ``limit`` ``requests`` or ``tokens``."""
        now = self._clock()
        requests, tokens = self._of(tenant, now)
        waits = []
        if requests is not None:
            waits.append((requests.wait_s(1, now), "requests", requests.rate, "requests"))
        if tokens is not None:
            waits.append(
                (tokens.wait_s(prompt_tokens, now), "tokens", tokens.rate, "prompt tokens")
            )
        wait, limit, rate, unit = max(waits, default=(0.0, "", 0.0, ""))
        if wait > 0:
            raise RateLimited(
                f"tenant {tenant!r} is over its rate limit of {rate:g} {unit} per second; "
                f"retry in {wait:.2f} s",
                retry_after_s=wait,
                limit=limit,
            )
        if requests is not None:
            requests.take(1, now)
        if tokens is not None:
            tokens.take(prompt_tokens, now)

    def _of(self, tenant: str, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        if tenant not in self._buckets:
            opts = self._tenants.limits_of(tenant)
            self._buckets[tenant] = (
                TokenBucket.per_second(opts.rps, now) if opts.rps else None,
                TokenBucket.per_second(opts.tps, now) if opts.tps else None,
            )
        return self._buckets[tenant]
