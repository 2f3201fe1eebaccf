"""Decode worker choice: the lowest load relative to capacity, then the most free KV."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.services.router.workers import Worker


class DecodeChoice:
    """score = load / max_running (load alone when capacity is unknown) + kv_weight * kv_usage.

    A worker whose KV is full (kv_usage >= 1) is only chosen when every worker is full.
    """

    def __init__(self, kv_weight: float = 1.0) -> None:
        self.kv_weight = kv_weight

    def score(self, w: Worker) -> float:
        load = w.load / w.max_running if w.max_running else float(w.load)
        return load + self.kv_weight * w.kv_usage

    def choose(self, workers: Sequence[Worker]) -> Worker:
        return min(workers, key=lambda w: (w.kv_usage >= 1.0, self.score(w), w.id))
