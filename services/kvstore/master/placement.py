"""Placement strategies: in which segments the replicas of a new object go.

A strategy only orders the candidate segments; the master walks that order, takes at most one
segment per node (replicas on distinct nodes) and allocates in each until it has enough
replicas. Adding a strategy is adding a class here and an entry in :data:`STRATEGIES`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from pdserve.v1 import kvstore_pb2


class Candidate(Protocol):
    """What a strategy may look at: a live segment."""

    segment_id: str
    node_id: str

    @property
    def capacity(self) -> int: ...
    @property
    def free(self) -> int: ...


class PlacementStrategy:
    """Orders live segments for a new object of ``size`` bytes.

    Contract: returns a permutation (or subset) of ``candidates``; must not mutate them; no
    I/O. Segments that cannot fit ``size`` may be left in: the master skips them."""

    name = "base"

    def order(self, candidates: Sequence[Candidate], size: int) -> list[Candidate]:
        raise NotImplementedError


class FreeRatioFirst(PlacementStrategy):
    """Segment with the largest free fraction first: spreads load and keeps watermarks even."""

    name = "free_ratio_first"

    def order(self, candidates: Sequence[Candidate], size: int) -> list[Candidate]:
        return sorted(
            candidates, key=lambda c: c.free / c.capacity if c.capacity else 0.0, reverse=True
        )


class RandomPlacement(PlacementStrategy):
    """Uniformly random order (seedable for tests)."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def order(self, candidates: Sequence[Candidate], size: int) -> list[Candidate]:
        out = list(candidates)
        self._rng.shuffle(out)
        return out


def make_strategies(seed: int | None = None) -> dict[int, PlacementStrategy]:
    """One instance per proto enum value; PLACEMENT_UNSPECIFIED maps to the default."""
    default = FreeRatioFirst()
    return {
        kvstore_pb2.PLACEMENT_UNSPECIFIED: default,
        kvstore_pb2.PLACEMENT_FREE_RATIO_FIRST: default,
        kvstore_pb2.PLACEMENT_RANDOM: RandomPlacement(seed),
    }
