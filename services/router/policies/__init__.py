"""Prefill routing policies (one file each) and the decode choice."""

from __future__ import annotations

from pdserve.services.router.engine_events import EngineCaches
from pdserve.services.router.policies.affinity import PrefixAffinity
from pdserve.services.router.policies.base import PrefillPolicy, RouteContext
from pdserve.services.router.policies.cache_aware import CacheAware
from pdserve.services.router.policies.colocated import ColocatedPlacement
from pdserve.services.router.policies.decode_choice import DecodeChoice
from pdserve.services.router.policies.least_load import LeastLoad
from pdserve.services.router.policies.round_robin import RoundRobin

__all__ = [
    "CacheAware",
    "ColocatedPlacement",
    "DecodeChoice",
    "LeastLoad",
    "PrefillPolicy",
    "PrefixAffinity",
    "RoundRobin",
    "RouteContext",
    "make_policy",
]


def make_policy(name: str, engines: EngineCaches | None = None, **kwargs: float) -> PrefillPolicy:
    """The policy called ``name`` in RouterConfig.policy (``engines``: the stock engines' own
    prefix caches, for cache_aware)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(engines=engines, **kwargs)
    raise ValueError(f"unknown policy {name!r}")
